"""examples/debug_8x8.ipynb runs top to bottom in a Jupyter kernel and shows what it promises.

The notebook is its own single source (no paired script): this test executes it with nbclient, which
fails on the first cell that raises, and the notebook's cells assert their own claims (bit-exact
copies, untouched poison, the offsets its prose reads off the descriptor table).
"""
import os
from pathlib import Path

import nbclient  # these and ipykernel (the kernel) come with pip install -e '.[test]'
import nbformat

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "examples" / "debug_8x8.ipynb"


def test_debug_8x8_notebook_is_stored_clean():
    """No outputs or execution counts in the repository: diffs show the source only, and what a
    reader sees is what their own run produced."""
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            assert not cell.outputs and cell.execution_count is None, f"cell {i} has stored outputs"


def test_debug_8x8_notebook_runs(tmp_path):
    nb = nbformat.read(NOTEBOOK, as_version=4)
    # The kernel imports this checkout (not an installed copy) and starts in a scratch folder.
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    client = nbclient.NotebookClient(nb, timeout=120, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute(env=env)  # raises CellExecutionError, with the cell and its traceback, on any error

    text, images = [], 0
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            assert out.output_type != "error", out
            if out.output_type == "stream":
                text.append(out.text)
            elif out.output_type in ("display_data", "execute_result"):
                images += "image/png" in out.data
                text.append(out.data.get("text/plain", ""))
    text = "".join(text)
    assert images == 1, "the plan picture is not shown inline"
    for part in ["Plan: 1 tensor(s), 8 ops, 128 B to 4 destination rank(s)", "w       1->3      [4:8, 2:4]",
                 "DescriptorTable: 2 entries, 2 regions", "1 launch(es) on cpu",
                 "[1] 'w' r1[0:4, 2:4] -> r3[4:8, 0:2] shape (4, 2) float32->bfloat16",
                 "src +8B strides (0, 0, 8, 1) | dst +16B strides (0, 0, 2, 1)",
                 "entry 1: 8 elements written bit for bit, 8 untouched",
                 "inference rank 5 (local shape (8, 2))", "r1:62", "provenance OK"]:
        assert part in text, part
