"""The tree is the import tree, and imports only point down.

* every module lives where its name says: ``tritonreshard.X`` in ``tritonreshard/X``, except the
  Triton kernels, which the design card puts at the top level: ``tritonreshard.kernels`` is
  ``kernels/`` (pyproject's ``package-dir``; ``pip install -e .`` maps it, like a src layout);
  pyproject's package list is the tree's;
* layers, bottom up: errors, layout, planning, recipes, kernels, execute, transport, engine, the
  serving seam, then the vLLM backend and the apps on top; a module imports only its own layer or those below;
* a private module (``_name``) is imported only inside its own package, and a private name only
  inside its own module;
* no import circles: no module reaches itself through the imports of others (lazy imports included);
* the library never imports its applications (nor matplotlib, which only the apps' pictures need);
* every module of ``tritonreshard/`` is at most 600 lines and every function in it (methods and nested
  functions too) at most 80, from its ``def`` to its last line; the Triton kernels (``kernels/``) are
  exempt.
"""
import ast
import subprocess
import sys
from itertools import pairwise
from pathlib import Path

import tritonreshard

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "tritonreshard"
#: Packages whose folder is not where their name says (pyproject's ``package-dir``).
MAPPED = {"tritonreshard.kernels": ROOT / "kernels"}
LAYERS = ["errors", "layout", "planning", "recipes", "kernels", "execute", "transport", "engine", "serving",
          "vllm", "frameworks", "apps"]

PROBE = r"""
import importlib, json, pathlib, sys
import tritonreshard
import tritonreshard.kernels
root = pathlib.Path(tritonreshard.__file__).parent
kernels = pathlib.Path(tritonreshard.kernels.__file__).parent
names = []
for base, path in sorted([(root, p) for p in root.rglob("*.py")] + [(kernels, p) for p in kernels.rglob("*.py")]):
    head = ("tritonreshard",) if base == root else ("tritonreshard", "kernels")
    parts = head + path.relative_to(base).with_suffix("").parts
    parts = parts[:-1] if parts[-1] == "__init__" else parts
    name = ".".join(parts)
    if name.startswith(("tritonreshard.apps", "tritonreshard.vllm._")):  # apps; vLLM's workers only
        continue
    importlib.import_module(name)
    names.append(name)
loaded = sorted(m for m in sys.modules if m == "tritonreshard.apps" or m.startswith("tritonreshard.apps.")
                or m.split(".")[0] == "matplotlib")
files = {n: sys.modules[n].__file__ for n in names}
print(json.dumps({"imported": names, "loaded": loaded, "files": files, "root": tritonreshard.__file__}))
"""

def _where(name: str) -> Path:
    """The folder or file stem of module ``name`` in the checkout (``MAPPED`` packages included)."""
    for pkg, folder in MAPPED.items():
        if name == pkg or name.startswith(pkg + "."):
            return folder.joinpath(*name[len(pkg):].split(".")[1:])
    return ROOT.joinpath(*name.split("."))


def _modules():
    trees = [(PKG, ("tritonreshard",))] + [(folder, tuple(pkg.split("."))) for pkg, folder in MAPPED.items()]
    for base, head in trees:
        for path in sorted(base.rglob("*.py")):
            parts = list(head + path.relative_to(base).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            yield ".".join(parts), path


def _imports(name: str, path: Path):
    """Absolute names of the tritonreshard modules (or names) ``path`` imports."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if mod.split(".")[0] != "tritonreshard":
                continue
            for alias in node.names:
                yield f"{mod}.{alias.name}", node.lineno
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "tritonreshard":
                    yield alias.name, node.lineno


def _layer(name: str) -> int | None:
    parts = name.split(".")
    if len(parts) < 2:
        return None  # the package itself (its __init__ is the public face, above every layer)
    head = parts[1]
    return LAYERS.index(head) if head in LAYERS else None


def test_library_never_imports_the_apps_and_modules_live_where_they_import_from():
    import json
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    # The walk really covered the library's layers (else the checks below could not fail).
    for mod in ("tritonreshard.planning.reshard", "tritonreshard.layout", "tritonreshard.execute",
                "tritonreshard.kernels.gather", "tritonreshard.engine.endpoint", "tritonreshard.transport.wait"):
        assert mod in res["imported"], res["imported"]
    assert res["loaded"] == [], f"library modules pulled in application modules: {res['loaded']}"
    # A checkout imports from its own root, and each module is the file its name says.
    assert Path(res["root"]).resolve() == PKG / "__init__.py"
    for name, file in res["files"].items():
        want = _where(name)
        assert Path(file).resolve() in (want.with_suffix(".py"), want / "__init__.py"), (name, file)


def test_no_import_points_upward_and_private_modules_stay_in_their_package():
    problems = []
    for name, path in _modules():
        own = _layer(name)
        for target, line in _imports(name, path):
            where = f"{path.relative_to(ROOT)}:{line} imports {target}"
            layer = _layer(target)
            if own is not None and layer is not None and layer > own:
                problems.append(f"{where}: upward ({LAYERS[own]} -> {LAYERS[layer]})")
            parts = target.split(".")
            for i, p in enumerate(parts[:-1]):  # a private module on the way: only from inside its package
                if p.startswith("_") and not name.startswith(".".join(parts[:i])):
                    problems.append(f"{where}: private module {'.'.join(parts[:i + 1])} from outside its package")
            if parts[-1].startswith("_") and not parts[-1].startswith("__") and \
                    ".".join(parts[:-1]) != name and (_where(".".join(parts[:-1])) / "__init__.py").exists() is False:
                problems.append(f"{where}: a private name of another module (make it public, or keep it there)")
    assert not problems, "\n".join(problems)


def _import_graph() -> dict[str, dict[str, str]]:
    """``{module: {module it imports: "path:line" of an import of it}}`` over the checkout.

    ``from pkg import name`` imports the submodule ``pkg.name`` where there is one, else ``pkg`` itself
    (its ``__init__``: a re-export is an import of the package). The packages above a module, whose
    ``__init__`` Python runs first, are not edges: every module would otherwise close a circle with
    its own package."""
    modules = dict(_modules())
    graph: dict[str, dict[str, str]] = {name: {} for name in modules}
    for name, path in modules.items():
        for target, line in _imports(name, path):
            if target not in modules:
                target = target.rpartition(".")[0]
            if target in modules and target != name:
                graph[name].setdefault(target, f"{path.relative_to(ROOT)}:{line}")
    return graph


def _circles(graph: dict[str, dict[str, str]]) -> list[list[str]]:
    """One shortest circle (``[a, b, ..., a]``) through each group of modules that reach each other
    (Tarjan's strongly connected components, then a breadth-first walk inside each)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = [stack.pop()]
            while group[-1] != v:
                group.append(stack.pop())
            if len(group) > 1:
                groups.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    circles = []
    for group in groups:
        start, members, prev = group[0], set(group), {}
        queue = [start]
        for v in queue:
            for w in sorted(graph[v]):
                if w in members and w not in prev:
                    prev[w] = v
                    queue.append(w)
        path = [start]
        while len(path) == 1 or path[-1] != start:
            path.append(prev[path[-1]])
        circles.append(path[::-1])
    return circles


def test_no_import_circles():
    """No module reaches itself through the imports of others: the layers say which way imports
    point between packages, this says it inside them too (``apps/bench``'s command line once
    imported its delta runner, which imported a parser back from the command line). Imports inside
    functions count as well: a lazy import is for a heavy or optional dependency, and does not make
    a circle go away (it only moves it from import time to the first call); a helper both sides need
    goes down to a module both import."""
    graph = _import_graph()
    # The graph really holds the library's imports (else the check could not fail).
    assert "tritonreshard.apps.bench.config" in graph["tritonreshard.apps.bench.cli"]
    assert "tritonreshard.planning" in graph["tritonreshard.apps.bench.deltas"]  # a package's re-export
    problems = [" -> ".join(c) + "\n    " + "; ".join(f"{graph[a][b]} imports {b}" for a, b in pairwise(c))
                for c in _circles(graph)]
    assert not problems, "import circles:\n" + "\n".join(problems)


def test_pyproject_lists_every_package_of_the_tree():
    """setuptools is given an explicit package list (``find`` cannot map ``kernels/``): a package
    added to the tree and not to the list would be missing from a wheel."""
    import tomllib
    conf = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    tree = {name for name, path in _modules() if path.name == "__init__.py"}
    assert set(conf["packages"]) == tree
    assert {k: ROOT / v for k, v in conf["package-dir"].items()} == MAPPED


def test_apps_live_in_the_package():
    import tritonreshard.apps as apps
    import tritonreshard.apps.cli as cli
    assert Path(apps.__file__).resolve().parent == PKG / "apps"
    assert Path(cli.__file__).resolve() == PKG / "apps" / "cli.py"
    assert tritonreshard.__file__  # the package imported at all (from the checkout or an install)


def test_imports_are_at_the_top_or_say_why_they_are_lazy():
    """An import inside a function is deliberate (a CUDA-only or optional dependency, a heavy one
    only some users need): a comment says why, on the function's first import or the line before
    it (one reason covers the function's lazy imports)."""
    silent = []
    for _, path in _modules():
        lines = path.read_text().splitlines()
        for fn in ast.walk(ast.parse("\n".join(lines))):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            imports = sorted(n.lineno for n in ast.walk(fn) if isinstance(n, (ast.Import, ast.ImportFrom)))
            if imports and not ("#" in lines[imports[0] - 1] or lines[imports[0] - 2].strip().startswith("#")):
                silent.append(f"{path.relative_to(ROOT)}:{imports[0]}: {lines[imports[0] - 1].strip()}")
    assert not silent, "lazy imports without a reason:\n" + "\n".join(sorted(set(silent)))


MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 80


def test_modules_and_functions_stay_small():
    """Every module of the package (kernels/ excluded) at most MAX_MODULE_LINES lines, every function
    (methods, nested functions) at most MAX_FUNCTION_LINES, ``def`` to last line: each one over is
    named with its count."""
    over = []
    for path in sorted(PKG.rglob("*.py")):
        if "kernels" in path.relative_to(ROOT).parts:
            continue
        text = path.read_text()
        where = path.relative_to(ROOT)
        lines = len(text.splitlines())
        if lines > MAX_MODULE_LINES:
            over.append(f"{where}: {lines} lines (module, at most {MAX_MODULE_LINES})")
        for fn in ast.walk(ast.parse(text)):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = fn.end_lineno - fn.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    over.append(f"{where}:{fn.lineno}: {fn.name} is {n} lines (function, at most {MAX_FUNCTION_LINES})")
    assert not over, "too long:\n" + "\n".join(over)
