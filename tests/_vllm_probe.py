"""Run under a Python that has vLLM (CPU build): build a model at TP=world over gloo, load the HF
weights in ``MODEL_DIR/full.pt`` with vLLM's own ``load_weights``, save each rank's
``named_parameters()`` to ``OUT.<tp_rank>.pt``.

Usage: python _vllm_probe.py MODEL_DIR WORLD PORT OUT [ep]   (used by tests/test_recipes.py)
"""
import os
import sys

import torch


def _rank(rank, world, model_dir, port, out, ep):
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    # A different identifier per rank keeps vLLM off its CPU shared-memory communicator (plain
    # torch.distributed instead), so nothing is left in /dev/shm.
    os.environ["VLLM_DIST_IDENT"] = f"trs-probe-{port}-{rank}"
    from vllm.config import ModelConfig, ParallelConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.model_executor.models.registry import ModelRegistry

    mc = ModelConfig(model=model_dir, tokenizer=model_dir, skip_tokenizer_init=True, dtype="float32",
                     enforce_eager=True)
    vc = VllmConfig(model_config=mc, parallel_config=ParallelConfig(tensor_parallel_size=world,
                                                                    enable_expert_parallel=ep))
    with set_current_vllm_config(vc):
        init_distributed_environment(world_size=world, rank=rank, local_rank=rank,
                                     distributed_init_method=f"tcp://127.0.0.1:{port}", backend="gloo")
        initialize_model_parallel(world)
        cls, _ = ModelRegistry.resolve_model_cls([mc.hf_config.architectures[0]], mc)
        model = cls(vllm_config=vc, prefix="")
        model.load_weights(torch.load(os.path.join(model_dir, "full.pt")).items())
    torch.save({n: p.detach().clone() for n, p in model.named_parameters()}, f"{out}.{rank}.pt")


if __name__ == "__main__":
    import torch.multiprocessing as mp

    model_dir, world, port, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    ep = sys.argv[5:] == ["ep"]
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_rank, args=(r, world, model_dir, port, out, ep)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(240)
    for p in procs:
        if p.is_alive():
            p.kill()
    sys.exit(max(abs(p.exitcode or 0) for p in procs) if all(p.exitcode is not None for p in procs) else 124)
