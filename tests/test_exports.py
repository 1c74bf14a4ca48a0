"""The public surface is what it says, and the recipes import in one direction.

* every name in every ``__all__`` of the library's packages and public modules resolves, and
  ``from <package> import *`` works (a name listed but never imported breaks both);
* the modules of ``tritonreshard.recipes`` import each other without a cycle, counting the imports
  inside functions too (a lazy import that works around a cycle is still a cycle), and each of them
  imports on its own in a fresh interpreter.
"""
import ast
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "tritonreshard"

PROBE = r"""
import importlib, json, pathlib, sys
import tritonreshard
root = pathlib.Path(tritonreshard.__file__).parent
names = ["tritonreshard.kernels"]
for path in sorted(root.rglob("*.py")):
    parts = ("tritonreshard",) + path.relative_to(root).with_suffix("").parts
    parts = parts[:-1] if parts[-1] == "__init__" else parts
    package = path.name == "__init__.py"
    # packages all; modules of the library only (the apps' may need their optional dependencies)
    if package or not (parts[1] == "apps" or any(p.startswith("_") for p in parts)):
        names.append(".".join(parts))
report = {}
for name in names:
    mod = importlib.import_module(name)
    exported = getattr(mod, "__all__", None)
    if exported is None:
        report[name] = {"package": hasattr(mod, "__path__"), "all": None}
        continue
    ns = {}
    exec(f"from {name} import *", ns)
    report[name] = {"package": hasattr(mod, "__path__"), "all": list(exported),
                    "missing": [n for n in exported if not hasattr(mod, n)],
                    "not_starred": [n for n in exported if n not in ns],
                    "duplicates": sorted({n for n in exported if list(exported).count(n) > 1})}
print(json.dumps(report))
"""


def test_every_name_in_every_all_resolves_and_star_import_works():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    # The walk covered the packages (else nothing below could fail).
    for pkg in ("tritonreshard", "tritonreshard.recipes", "tritonreshard.planning", "tritonreshard.kernels",
                "tritonreshard.engine", "tritonreshard.transport", "tritonreshard.vllm"):
        assert pkg in report, sorted(report)
    assert {"tp_layout", "vllm_layout"} <= set(report["tritonreshard.recipes"]["all"])
    problems = [f"{name}: a package without __all__" for name, r in report.items() if r["package"] and r["all"] is None]
    for name, r in report.items():
        if r["all"] is None:
            continue
        for key in ("missing", "not_starred", "duplicates"):
            if r[key]:
                problems.append(f"{name}.__all__: {key} {r[key]}")
    assert not problems, "\n".join(problems)


def _recipes_modules() -> dict[str, Path]:
    return {("tritonreshard.recipes" if p.name == "__init__.py" else f"tritonreshard.recipes.{p.stem}"): p
            for p in sorted((PKG / "recipes").glob("*.py"))}


def _edges(name: str, path: Path, modules) -> set[str]:
    """The modules of ``modules`` that ``name`` imports, anywhere in the file (functions too)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in modules else mod for a in node.names]
        elif isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            continue
        out |= {t for t in targets if t in modules and t != name}
    return out


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` (``[a, b, ..., a]``), or None."""
    state: dict[str, str] = {}

    def visit(node, stack):
        if state.get(node) == "done":
            return None
        if state.get(node) == "open":
            return stack[stack.index(node):] + [node]
        state[node] = "open"
        for dep in sorted(graph[node]):
            found = visit(dep, stack + [node])
            if found:
                return found
        state[node] = "done"
        return None

    for name in sorted(graph):
        found = visit(name, [])
        if found:
            return found
    return None


def test_recipes_modules_import_without_a_cycle():
    modules = _recipes_modules()
    graph = {name: _edges(name, path, modules) for name, path in modules.items()}
    assert _cycle(graph) is None, "import cycle: " + " -> ".join(_cycle(graph))
    # The check sees what it must: the package imports its modules, and it finds a planted cycle.
    assert "tritonreshard.recipes.hf" in graph["tritonreshard.recipes"], graph
    assert _cycle({**graph, "tritonreshard.recipes.builder": {"tritonreshard.recipes.hf"}})
    # The vLLM side is at the bottom: it imports no other recipe module.
    assert graph["tritonreshard.recipes.builder"] == set()


# One interpreter imports torch (what each recipes module imports first, through the package's
# builder), then forks one child per module: each child imports that module with no module of
# tritonreshard loaded before it, as a fresh interpreter would (``import tritonreshard`` loads no
# torch, so nothing of ours runs before the fork). One torch import instead of one per module, which
# was nearly all of each fresh interpreter's time. Prints one JSON line: {module: None or traceback}.
ALONE = r"""
import json, os, sys, traceback
import torch  # noqa: F401
report = {}
for name in sys.argv[1:]:
    assert not [m for m in sys.modules if m.split(".")[0] == "tritonreshard"], "tritonreshard loaded before the fork"
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        try:
            __import__(name)
            msg = None if name in sys.modules else f"{name} not in sys.modules after its import"
        except BaseException:
            msg = traceback.format_exc()
        os.write(write, json.dumps(msg).encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as f:
        text = f.read()
    _, status = os.waitpid(pid, 0)
    report[name] = json.loads(text) if text else f"the child died: wait status {status}"
print(json.dumps(report))
"""


def test_each_recipes_module_imports_alone_in_a_fresh_interpreter():
    names = list(_recipes_modules())
    out = subprocess.run([sys.executable, "-c", ALONE, *names], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert sorted(report) == sorted(names) and len(names) >= 10, report  # every module, each its own child
    assert {n: e for n, e in report.items() if e is not None} == {}
