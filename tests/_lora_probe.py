"""Run under a Python that has vLLM (CPU build): start one LLM engine with ``enable_lora=True`` at
TP=``tp`` on ``MODEL_DIR``, load each adapter directory with vLLM's own loader (``add_lora`` of a
``LoRARequest``), and save what every TP rank's LoRA layers then hold.

Usage: python _lora_probe.py CASE.json   (used by tests/test_lora.py)

``CASE.json``: ``{"model_dir", "tp", "max_lora_rank", "max_loras", "adapters": [[name, id, dir], ...],
"out"}``. Writes ``OUT`` (``torch.save``): ``{"dist_idents": the engine's TP shared-memory names (removed
at exit), "ranks": [one dict per TP rank]}``, each rank's dict
``{"index_to_id": [...], "{module}.lora_{a,b}_stacked.{i}": whole buffer [max_loras, 1, ., .]}`` (the
embedding and LM head hold one buffer each, ``{module}.lora_{a,b}_stacked``),
plus ``"lora_config"``: the engine's ``max_lora_rank``, ``max_loras``, ``lora_dtype``.
"""
import json
import os
import sys

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # the read-out below is a pickled callable
os.environ.setdefault("VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS", "30")

import torch  # noqa: E402


def read_slots(worker):
    """Every LoRA layer's buffers on this worker, and which adapter id sits in which slot."""
    manager = worker.model_runner.lora_manager._adapter_manager  # vLLM 0.32 / 0.33: LoRAModelManager
    out = {"index_to_id": list(manager.lora_index_to_id),
           "lora_config": {"max_lora_rank": manager.lora_config.max_lora_rank,
                           "max_loras": manager.lora_config.max_loras,
                           "lora_dtype": str(manager.lora_config.lora_dtype)}}
    for name, module in manager.modules.items():
        for what in ("lora_a_stacked", "lora_b_stacked"):
            held = getattr(module, what)
            if isinstance(held, torch.Tensor):  # embed_tokens / lm_head: one buffer, no slices
                out[f"{name}.{what}"] = held.detach().clone()
            else:
                for i, t in enumerate(held):
                    out[f"{name}.{what}.{i}"] = t.detach().clone()
    return out


def dist_ident(worker):
    """The name vLLM's CPU workers give their shared-memory TP communicator (``VLLM_DIST_IDENT``)."""
    return os.environ.get("VLLM_DIST_IDENT")


def main(case):
    from vllm import LLM
    from vllm.lora.request import LoRARequest

    tp = case["tp"]
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(i % (os.cpu_count() or 1)) for i in range(tp)))
    llm = LLM(case["model_dir"], tensor_parallel_size=tp, dtype="float32", enforce_eager=True,
              skip_tokenizer_init=True, max_model_len=64, max_num_seqs=2, enable_lora=True,
              max_lora_rank=case["max_lora_rank"], max_loras=case["max_loras"], seed=0)
    idents = sorted(set(llm.collective_rpc(dist_ident)) - {None})
    try:
        for name, lora_id, path in case["adapters"]:
            assert llm.llm_engine.add_lora(LoRARequest(name, lora_id, path)), name
        slots = llm.collective_rpc(read_slots)
    finally:
        # Now, with time to exit cleanly; then remove exactly this engine's TP shared-memory segments,
        # which workers killed after the grace leave behind.
        llm.llm_engine.engine_core.shutdown(timeout=30)
        for f in sorted(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else []:
            if any(f.startswith(f"{i}-") for i in idents):
                os.unlink(os.path.join("/dev/shm", f))
    torch.save({"ranks": slots, "dist_idents": idents}, case["out"])
    print("probe done", flush=True)


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        main(json.load(f))
