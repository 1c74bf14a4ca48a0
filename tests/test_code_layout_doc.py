"""docs/code-layout.md stays true: every file its "Adding ..." sections name exists, and every
module of the library has a row in its table (a new module without one fails here)."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = (ROOT / "docs" / "code-layout.md").read_text()
SECTIONS = ("## Adding a model family", "## Adding a serving engine", "## Adding an RL framework")


def _section(title: str) -> str:
    start = DOC.index(title)
    end = DOC.find("\n## ", start + len(title))
    return DOC[start:end if end >= 0 else len(DOC)]


def test_each_adding_section_names_only_files_that_exist():
    for title in SECTIONS:
        named = re.findall(r"`([\w./-]+\.(?:py|md|toml))`", _section(title))
        assert len(named) >= 4, (title, named)   # a section that names no file says nothing
        missing = [f for f in named if not (ROOT / f).is_file()]
        assert not missing, f"{title}: {missing} do not exist"


def test_every_library_module_has_a_row():
    table = DOC[:DOC.index("## Adding a model family")]
    said = set(re.findall(r"`([\w./-]+\.py)`", table))
    for path in sorted((ROOT / "tritonreshard").rglob("*.py")) + sorted((ROOT / "kernels").glob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if path.name == "__init__.py" and rel != "tritonreshard/vllm/__init__.py" or "/apps/" in rel:
            continue   # packages are rows by their modules; the apps are one row
        short = rel.removeprefix("tritonreshard/")
        tail = "/".join(short.split("/")[-2:])
        assert {rel, short, tail, path.name} & said, f"{rel} has no row in docs/code-layout.md"


def test_the_vllm_refit_examples_parts_have_rows():
    """examples/vllm_refit.py is split by job into modules beside it: each has a row, and every
    example file a row names exists."""
    table = DOC[:DOC.index("## Adding a model family")]
    said = set(re.findall(r"`(examples/[\w./-]+\.py)`", table))
    parts = {p.relative_to(ROOT).as_posix() for p in (ROOT / "examples").glob("vllm_refit*.py")}
    assert "examples/vllm_refit.py" in parts and len(parts) > 1, parts
    assert parts <= said, f"no row in docs/code-layout.md: {sorted(parts - said)}"
    assert all((ROOT / f).is_file() for f in said), sorted(f for f in said if not (ROOT / f).is_file())
