"""README.md's code runs as written, or says that it is a fragment and where the real thing runs.

Every ```python block is one of:

* **a fragment**: its first line is ``# fragment: <what it needs>; see <path>`` (a user's model,
  several processes, vLLM, a GPU). It must still compile, and ``<path>`` (the example or test that
  runs it) must exist;
* **runnable**: it runs in a fresh interpreter (offline, under a timeout), in README order. A block
  that does not begin with an import continues the runnable block before it, as a reader would run
  them one after the other (the API tour, then "Executing a plan in one process").

So a block that breaks, or a block that is neither runnable nor marked, fails here. Each block is
placed at its own line number, so a traceback names the README line that failed.

The unlabeled block at the top (``$ tritonreshard plan ...``) is checked against the command's output.
"""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
TEXT = README.read_text()

_PYTHON_BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
_FRAGMENT = re.compile(r"# fragment: (?P<needs>[^;\n]+); see (?P<path>\S+)\n")
_TIMEOUT_S = 300  # one session; importing transformers alone takes seconds on a loaded 2-core box


def _blocks() -> list[tuple[int, str]]:
    """[(first code line in README.md, code)] of every ```python block, in order."""
    return [(TEXT.count("\n", 0, m.start(1)) + 1, m.group(1)) for m in _PYTHON_BLOCK.finditer(TEXT)]


def _is_fragment(code: str) -> bool:
    return code.startswith("# fragment")


def _sessions() -> list[list[tuple[int, str]]]:
    """Runnable blocks grouped into the programs a reader runs: a new one at each block that begins
    (after comments) with an import, later blocks appended to it."""
    sessions: list[list[tuple[int, str]]] = []
    for line, code in _blocks():
        if _is_fragment(code):
            continue
        first = next((s for s in code.splitlines() if s.strip() and not s.lstrip().startswith("#")), "")
        if not sessions or first.startswith(("import ", "from ")):
            sessions.append([])
        sessions[-1].append((line, code))
    return sessions


def _at_lines(blocks: list[tuple[int, str]]) -> str:
    """The blocks as one program, each at its README line (blank lines between)."""
    program = ""
    for line, code in blocks:
        program += "\n" * (line - 1 - program.count("\n")) + code
    return program


def test_every_python_block_is_seen():
    blocks = _blocks()
    assert len(blocks) == TEXT.count("```python") and len(blocks) >= 7
    fragments = [b for b in blocks if _is_fragment(b[1])]
    assert len(fragments) + sum(map(len, _sessions())) == len(blocks)
    assert len(_sessions()) >= 2  # the API tour (+ one process) and the HF -> vLLM recipe


@pytest.mark.parametrize("line, code", [b for b in _blocks() if _is_fragment(b[1])],
                         ids=lambda v: f"README.md:{v}" if isinstance(v, int) else "")
def test_fragment_compiles_and_points_at_what_runs_it(line, code):
    m = _FRAGMENT.match(code)
    assert m, (f"README.md:{line - 1}: a fragment's first line is "
               f"'# fragment: <what it needs>; see <example or test that runs it>'")
    assert (ROOT / m["path"]).is_file(), f"README.md:{line}: {m['path']} does not exist"
    compile(_at_lines([(line, code)]), str(README), "exec")


@pytest.mark.parametrize("blocks", _sessions(), ids=lambda s: "README.md:" + "+".join(str(line) for line, _ in s))
def test_runnable_blocks_run(blocks, tmp_path):
    script = tmp_path / "README.md"  # tracebacks then read "README.md", line <the README's own line>
    script.write_text(_at_lines(blocks))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")  # a block that downloads fails at once
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-4000:]
    if "for op in plan.ops_for_dst(3):" in script.read_text():  # the API tour: what its comments say it prints
        assert "Plan: 1 tensor(s), 8 ops" in proc.stdout, proc.stdout
        assert "w: 0->3 global[0:4, 2:4] src[0:4, 2:4] -> dst[0:4, 0:2] (4x2)" in proc.stdout, proc.stdout


def test_plan_output_at_the_top_is_what_the_command_prints(capsys):
    from tritonreshard.apps.cli import main

    shown = TEXT.split("```\n", 2)[1]
    command, *lines = shown.splitlines()
    assert command == '$ tritonreshard plan --shape 8x8 --src "2:S(0)" --dst "4:S(1)"'
    assert main(["plan", "--shape", "8x8", "--src", "2:S(0)", "--dst", "4:S(1)"]) == 0
    out = capsys.readouterr().out.splitlines()
    shown_lines = [s for s in lines if s != "  ..."]
    at = [out.index(s) if s in out else -1 for s in shown_lines]
    assert -1 not in at and at == sorted(at), "\n".join(s for s, i in zip(shown_lines, at) if i < 0) or at
