"""README.md's and docs/*.md's code runs as written, or says that it is a fragment and where the real
thing runs; their links lead somewhere; the README's two commands are the ones CI runs.

Every ```python block, in README.md and in every docs/*.md page, is one of:

* **a fragment**: its first line is ``# fragment: <what it needs>; see <path>`` (a user's model,
  several processes, vLLM, a GPU). It must still compile, and ``<path>`` (the example or test that
  runs it, relative to the repository root) must exist;
* **runnable**: it runs in a fresh interpreter (offline, under a timeout), in file order. A block
  that does not begin with an import continues the runnable block before it in the same file, as a
  reader would run them one after the other (the API tour, then "Executing a plan in one process").

So a block that breaks, or a block that is neither runnable nor marked, fails here. Each file is a
test parameter and each block is placed at its own line number, so a failure names the file and a
traceback names the line (``docs/fp8.md:12``).

A ``$ tritonreshard plan --shape ...`` block (the README's picture of the 8x8 example), wherever it
lives, is checked against what the command prints.
"""
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
TEXT = {p.relative_to(ROOT).as_posix(): p.read_text() for p in FILES}  # {"README.md": ..., "docs/fp8.md": ...}
README = TEXT["README.md"]

_PYTHON_BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
_ANY_BLOCK = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)
_FRAGMENT = re.compile(r"# fragment: (?P<needs>[^;\n]+); see (?P<path>\S+)\n")
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
_TIMEOUT_S = 300  # one session; importing transformers alone takes seconds on a loaded 2-core box


def _line_of(text: str, at: int) -> int:
    return text.count("\n", 0, at) + 1


def _blocks(name: str) -> list[tuple[int, str]]:
    """[(first code line in the file, code)] of every ```python block of one file, in order."""
    text = TEXT[name]
    return [(_line_of(text, m.start(1)), m.group(1)) for m in _PYTHON_BLOCK.finditer(text)]


def _is_fragment(code: str) -> bool:
    return code.startswith("# fragment")


def _sessions(name: str) -> list[list[tuple[int, str]]]:
    """One file's runnable blocks grouped into the programs a reader runs: a new one at each block
    that begins (after comments) with an import, later blocks appended to it."""
    sessions: list[list[tuple[int, str]]] = []
    for line, code in _blocks(name):
        if _is_fragment(code):
            continue
        first = next((s for s in code.splitlines() if s.strip() and not s.lstrip().startswith("#")), "")
        if not sessions or first.startswith(("import ", "from ")):
            sessions.append([])
        sessions[-1].append((line, code))
    return sessions


def _at_lines(blocks: list[tuple[int, str]]) -> str:
    """The blocks as one program, each at its line in the file (blank lines between)."""
    program = ""
    for line, code in blocks:
        program += "\n" * (line - 1 - program.count("\n")) + code
    return program


FRAGMENTS = [(name, line, code) for name in TEXT for line, code in _blocks(name) if _is_fragment(code)]
SESSIONS = [(name, blocks) for name in TEXT for blocks in _sessions(name)]
PLAN_BLOCKS = [(name, _line_of(text, m.start(1)), m.group(1)) for name, text in TEXT.items()
               for m in _ANY_BLOCK.finditer(text) if m.group(1).startswith("$ tritonreshard plan --shape ")]


@pytest.mark.parametrize("name", list(TEXT))
def test_every_python_block_is_seen(name):
    blocks = _blocks(name)
    assert len(blocks) == TEXT[name].count("```python"), f"{name}: a ```python fence this test does not parse"
    fragments = [b for b in blocks if _is_fragment(b[1])]
    assert len(fragments) + sum(map(len, _sessions(name))) == len(blocks)


def test_the_docs_have_runnable_blocks():
    assert _sessions("README.md"), "README.md: the API tour runs"
    assert len(SESSIONS) >= 4  # the API tour, HF -> vLLM, Megatron -> vLLM, FP8
    assert PLAN_BLOCKS and PLAN_BLOCKS[0][0] == "README.md", "the README's picture of the 8x8 example"


@pytest.mark.parametrize("name, line, code", FRAGMENTS, ids=[f"{n}:{line}" for n, line, _ in FRAGMENTS])
def test_fragment_compiles_and_points_at_what_runs_it(name, line, code):
    m = _FRAGMENT.match(code)
    assert m, (f"{name}:{line}: a fragment's first line is "
               f"'# fragment: <what it needs>; see <example or test that runs it>'")
    assert (ROOT / m["path"]).is_file(), f"{name}:{line}: {m['path']} does not exist"
    compile(_at_lines([(line, code)]), name, "exec")


@pytest.mark.parametrize("name, blocks", SESSIONS,
                         ids=[f"{n}:" + "+".join(str(line) for line, _ in b) for n, b in SESSIONS])
def test_runnable_blocks_run(name, blocks, tmp_path):
    script = tmp_path / name  # tracebacks then read ".../docs/fp8.md", line <the file's own line>
    script.parent.mkdir(parents=True, exist_ok=True)
    script.write_text(_at_lines(blocks))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")  # a block that downloads fails at once
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=_TIMEOUT_S)
    assert proc.returncode == 0, f"{name}:{blocks[0][0]}\n" + proc.stderr[-4000:]
    if "for op in plan.ops_for_dst(3):" in script.read_text():  # the API tour: what its comments say it prints
        assert "Plan: 1 tensor(s), 8 ops" in proc.stdout, proc.stdout
        assert "w: 0->3 global[0:4, 2:4] src[0:4, 2:4] -> dst[0:4, 0:2] (4x2)" in proc.stdout, proc.stdout


@pytest.mark.parametrize("name, line, shown", PLAN_BLOCKS, ids=[f"{n}:{line}" for n, line, _ in PLAN_BLOCKS])
def test_plan_output_shown_is_what_the_command_prints(name, line, shown, capsys):
    from tritonreshard.apps.cli import main

    command, *lines = shown.splitlines()
    argv = shlex.split(command[len("$ "):])
    assert argv[0] == "tritonreshard"
    assert main(argv[1:]) == 0, f"{name}:{line}: {command}"
    out = capsys.readouterr().out.splitlines()
    shown_lines = [s for s in lines if s != "  ..."]
    at = [out.index(s) if s in out else -1 for s in shown_lines]
    missing = "\n".join(s for s, i in zip(shown_lines, at, strict=True) if i < 0)
    assert -1 not in at and at == sorted(at), f"{name}:{line}: not printed (or not in this order):\n{missing or at}"


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(text: str) -> set[str]:
    prose = _ANY_BLOCK.sub("", text)  # a "# comment" in a code block is not a heading
    return {_slug(m.group(1)) for m in re.finditer(r"^#{1,6} (.+)$", prose, re.M)}


LINKS = [(name, _line_of(text, m.start()), m.group(1)) for name, text in TEXT.items()
         for m in _LINK.finditer(_ANY_BLOCK.sub(lambda b: "\n" * b.group(0).count("\n"), text))
         if not re.match(r"[a-z]+:", m.group(1))]  # not http:, https:, mailto:


@pytest.mark.parametrize("name, line, target", LINKS, ids=[f"{n}:{line}" for n, line, _ in LINKS])
def test_links_lead_to_files_and_headings_that_exist(name, line, target):
    path, _, anchor = target.partition("#")
    dest = (ROOT / name).parent / path if path else ROOT / name
    shown = dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest
    assert dest.exists(), f"{name}:{line}: {target}: {shown} does not exist"
    if anchor and dest.suffix == ".md":
        assert anchor in _anchors(dest.read_text()), f"{name}:{line}: {target}: no heading with that anchor"


def test_every_docs_page_is_linked_from_the_readme():
    linked = {(ROOT / target.partition("#")[0]).resolve() for n, _, target in LINKS if n == "README.md"}
    unlinked = [p.relative_to(ROOT).as_posix() for p in FILES[1:] if p.resolve() not in linked]
    assert not unlinked, f"README.md links to no {unlinked}"


def test_the_two_commands_are_what_ci_runs():
    """The README's second command is `bash .ci/run`; .ci/run installs the torch the first command
    pins, runs the test command the README names, and the README quotes its time."""
    section = README.split("\n## The two commands\n", 1)[1].split("\n## ", 1)[0]
    demo, tests = re.findall(r"^```bash\n(.*?)^```", section, re.S | re.M)
    assert re.fullmatch(r"pip install torch==\S+ && pip install -e \. && tritonreshard demo .*\n", demo), demo
    assert tests == "bash .ci/run\n"
    ci = (ROOT / ".ci" / "run").read_text()
    torch_pin = re.search(r"torch==\S+", demo).group(0)
    assert f"pip install --quiet {torch_pin}" in ci, f".ci/run does not install {torch_pin}"
    assert "python3 -m venv --clear" in ci, ".ci/run does not build a fresh venv"
    ran = re.search(r"runs `python (-m pytest[^`]*)` in", section).group(1)
    assert re.search(rf'^"\$py" {re.escape(ran)} ', ci, re.M), f".ci/run does not run `python {ran}` in its venv"
    minutes = re.search(r"\d+ to \d+ minutes", section).group(0)
    assert f"{minutes} on 2 cores" in ci, f".ci/run's phase line does not say {minutes!r} as the README does"
