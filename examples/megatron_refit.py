"""Refit a running vLLM engine straight from Megatron-Core TP x PP trainer ranks.

Four trainer processes form a Megatron-Core world over gloo (TP 2 x PP 2 by default) and build real
``GPTModel`` chunks (local layer spec, CPU) of a tiny Llama (hidden 128, 4 heads, 2 KV heads, 4
layers, vocab 1000: Megatron pads it to 1024 rows at TP 2, vLLM to 1024 with zero rows). Their
weights start as the Hugging Face checkpoint vLLM loads, converted to Megatron's layout (qkv
interleaved per query group, fc1 = [gate; up], the dummy vocab rows random junk).

Each trainer hands ``trs.recipes.megatron_tensors(model, ...)`` to ``tritonreshard.vllm.Trainer``
with ``megatron=``; vLLM's workers get the same ``Megatron`` through ``init_info(megatron=...)``
and pull their TP shards of vLLM's parameters directly from the Megatron ranks' shards (no gather,
no HF conversion, no ``load_weights``). ``megatron_bind`` re-points the Megatron parameters at the
trainer's arena; each step the trainers perturb those parameters in place (an evolution-strategies
style update); after every refit, vLLM's greedy generation (float32,
eager) must equal transformers' on the same weights (converted back from Megatron's shards by this
script, independently of the recipe), token for token.

``--model tiny-qwen3-moe --megatron-ep 2`` does the same for Megatron-Core MoE ranks: a tiny
Qwen3-MoE (q/k norms, 8 experts of intermediate 48, top 2; layer 1 a dense MLP, the others sparse)
whose experts live on Megatron's expert grid (EP 2, expert TP 1), into vLLM's fused ``w13`` / ``w2``
experts split by vLLM's TP.

Run: ``python examples/megatron_refit.py --refits 2 --json`` (vLLM TP 2; a few minutes on 2 cores).
The last stdout line (``--json``) is one JSON object with ``refits``, ``tokens_compared``,
``mismatches``, ``greedy`` and ``refit_ms``.
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import shutil
import signal
import sys
import tempfile
import time
import zlib

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS", "30")

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from vllm_refit import compare, dist_ident, remove_vllm_shm, worker_stats  # noqa: E402

from tritonreshard.apps.kit import TINY, expect, free_port, random_prompts, reap, tiny_config, tiny_model  # noqa: E402

SEED = 0
SIGMA = 0.02
CONFIG = dict(TINY, num_hidden_layers=4)  # the tiny Llama of the other examples, 4 layers (2 pipeline stages)


MODELS = {  # name: (transformers config class, fields)
    "tiny-llama": ("LlamaConfig", CONFIG),
    "tiny-qwen3-moe": ("Qwen3MoeConfig", dict(CONFIG, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48,
                                              decoder_sparse_step=1, mlp_only_layers=[1], norm_topk_prob=True)),
}


def model_config(name: str = "tiny-llama"):
    cls, fields = MODELS[name]
    return tiny_config(cls, fields)


def _moe_layer(cfg, i: int) -> bool:
    return cfg.model_type == "qwen3_moe" and i not in cfg.mlp_only_layers


# --------------------------------------------------------------- HF <-> Megatron (full tensors)
def hf_to_megatron(cfg, hf: dict, vocab_rows: int) -> dict:
    """Full Megatron tensors (global names) from full HF tensors; dummy vocab rows are random."""
    nq, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    g = torch.Generator().manual_seed(SEED + 7)
    junk = torch.randn(vocab_rows - cfg.vocab_size, cfg.hidden_size, generator=g)
    out = {"embedding.word_embeddings.weight": torch.cat([hf["model.embed_tokens.weight"], junk]),
           "output_layer.weight": torch.cat([hf["lm_head.weight"], junk]),
           "decoder.final_layernorm.weight": hf["model.norm.weight"]}
    for i in range(cfg.num_hidden_layers):
        p, m = f"model.layers.{i}", f"decoder.layers.{i}"
        q = hf[f"{p}.self_attn.q_proj.weight"].reshape(nkv, nq // nkv, hd, -1)
        k = hf[f"{p}.self_attn.k_proj.weight"].reshape(nkv, 1, hd, -1)
        v = hf[f"{p}.self_attn.v_proj.weight"].reshape(nkv, 1, hd, -1)
        out[f"{m}.self_attention.linear_qkv.weight"] = torch.cat([q, k, v], 1).reshape(-1, cfg.hidden_size)
        out[f"{m}.self_attention.linear_qkv.layer_norm_weight"] = hf[f"{p}.input_layernorm.weight"]
        out[f"{m}.self_attention.linear_proj.weight"] = hf[f"{p}.self_attn.o_proj.weight"]
        if cfg.model_type == "qwen3_moe":
            out[f"{m}.self_attention.q_layernorm.weight"] = hf[f"{p}.self_attn.q_norm.weight"]
            out[f"{m}.self_attention.k_layernorm.weight"] = hf[f"{p}.self_attn.k_norm.weight"]
        if _moe_layer(cfg, i):  # transformers 5 fuses the experts: gate_up_proj [E, 2I, H] = [gate; up] each
            out[f"{m}.pre_mlp_layernorm.weight"] = hf[f"{p}.post_attention_layernorm.weight"]
            out[f"{m}.mlp.router.weight"] = hf[f"{p}.mlp.gate.weight"]
            for e in range(cfg.num_experts):
                expert = f"{m}.mlp.experts.local_experts.{e}"
                out[f"{expert}.linear_fc1.weight"] = hf[f"{p}.mlp.experts.gate_up_proj"][e:e + 1]
                out[f"{expert}.linear_fc2.weight"] = hf[f"{p}.mlp.experts.down_proj"][e:e + 1]
            continue
        out[f"{m}.mlp.linear_fc1.weight"] = torch.cat([hf[f"{p}.mlp.gate_proj.weight"], hf[f"{p}.mlp.up_proj.weight"]])
        out[f"{m}.mlp.linear_fc1.layer_norm_weight"] = hf[f"{p}.post_attention_layernorm.weight"]
        out[f"{m}.mlp.linear_fc2.weight"] = hf[f"{p}.mlp.down_proj.weight"]
    return out


def megatron_to_hf(cfg, meg: dict) -> dict:
    """Full HF tensors from full Megatron tensors (the inverse of :func:`hf_to_megatron`)."""
    nq, nkv, hd, V = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.vocab_size
    out = {"model.embed_tokens.weight": meg["embedding.word_embeddings.weight"][:V],
           "lm_head.weight": meg["output_layer.weight"][:V], "model.norm.weight": meg["decoder.final_layernorm.weight"]}
    for i in range(cfg.num_hidden_layers):
        p, m = f"model.layers.{i}", f"decoder.layers.{i}"
        qkv = meg[f"{m}.self_attention.linear_qkv.weight"].reshape(nkv, nq // nkv + 2, hd, -1)
        out[f"{p}.self_attn.q_proj.weight"] = qkv[:, :-2].reshape(nq * hd, -1)
        out[f"{p}.self_attn.k_proj.weight"] = qkv[:, -2].reshape(nkv * hd, -1)
        out[f"{p}.self_attn.v_proj.weight"] = qkv[:, -1].reshape(nkv * hd, -1)
        out[f"{p}.input_layernorm.weight"] = meg[f"{m}.self_attention.linear_qkv.layer_norm_weight"]
        out[f"{p}.self_attn.o_proj.weight"] = meg[f"{m}.self_attention.linear_proj.weight"]
        if cfg.model_type == "qwen3_moe":
            out[f"{p}.self_attn.q_norm.weight"] = meg[f"{m}.self_attention.q_layernorm.weight"]
            out[f"{p}.self_attn.k_norm.weight"] = meg[f"{m}.self_attention.k_layernorm.weight"]
        if _moe_layer(cfg, i):
            experts = f"{m}.mlp.experts.local_experts"
            out[f"{p}.post_attention_layernorm.weight"] = meg[f"{m}.pre_mlp_layernorm.weight"]
            out[f"{p}.mlp.gate.weight"] = meg[f"{m}.mlp.router.weight"]
            out[f"{p}.mlp.experts.gate_up_proj"] = torch.cat([meg[f"{experts}.{e}.linear_fc1.weight"]
                                                              for e in range(cfg.num_experts)])
            out[f"{p}.mlp.experts.down_proj"] = torch.cat([meg[f"{experts}.{e}.linear_fc2.weight"]
                                                           for e in range(cfg.num_experts)])
            continue
        gate, up = meg[f"{m}.mlp.linear_fc1.weight"].chunk(2)
        out[f"{p}.mlp.gate_proj.weight"], out[f"{p}.mlp.up_proj.weight"] = gate, up
        out[f"{p}.post_attention_layernorm.weight"] = meg[f"{m}.mlp.linear_fc1.layer_norm_weight"]
        out[f"{p}.mlp.down_proj.weight"] = meg[f"{m}.mlp.linear_fc2.weight"]
    return out


def unshard(layouts: dict, shards: dict) -> dict:
    """Full tensors from every rank's local shards ``{rank: {name: tensor}}``, placed by their layouts.
    Every copy of a replicated region must be equal (the refit may read any of them): a copy that
    differs from one placed before is an error here, not a silent choice."""
    full = {}
    for name, lay in layouts.items():
        t = torch.full(lay.shape, float("nan"), dtype=lay.dtype)
        for r in lay.ranks:
            if name not in shards.get(r, {}):
                continue
            local = shards[r][name]
            for box in itertools.product(*lay.segments(r)):  # a segment per block and dim (fc1: gate, up)
                dst, src = t, local
                for d, (s, e, at) in enumerate(box):
                    dst, src = dst.narrow(d, s, e - s), src.narrow(d, at, e - s)
                if not torch.isnan(dst).all() and not torch.equal(dst, src):
                    raise ValueError(f"{name}: rank {r}'s copy differs from another replica's")
                dst.copy_(src)
        full[name] = t
    return full


# ---------------------------------------------------------------------------------------- trainers
def trainer(rank, world, model_name, meg_fields, train_path, tp, store, gloo, commands, results) -> None:
    """One Megatron-Core rank: builds its GPTModel chunk, loads its shards, publishes through vLLM's backend."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    torch.set_num_threads(1)
    import warnings

    warnings.filterwarnings("ignore")
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig
    from safetensors.torch import load_file

    import tritonreshard as trs
    import tritonreshard.vllm as trs_vllm

    cfg, meg = model_config(model_name), trs.recipes.Megatron(**meg_fields)
    moe = cfg.model_type == "qwen3_moe"
    dist.init_process_group("gloo", init_method=f"tcp://{gloo}", rank=rank, world_size=world)
    ps.initialize_model_parallel(meg.tp, meg.pp, expert_model_parallel_size=meg.ep,
                                 expert_tensor_parallel_size=meg.etp)
    tc = TransformerConfig(num_layers=cfg.num_hidden_layers, hidden_size=cfg.hidden_size,
                           num_attention_heads=cfg.num_attention_heads, num_query_groups=cfg.num_key_value_heads,
                           kv_channels=cfg.head_dim, ffn_hidden_size=cfg.intermediate_size, gated_linear_unit=True,
                           activation_func=torch.nn.functional.silu, normalization="RMSNorm", add_bias_linear=False,
                           use_cpu_initialization=True, qk_layernorm=moe,
                           tensor_model_parallel_size=meg.tp, pipeline_model_parallel_size=meg.pp,
                           pipeline_dtype=torch.float32, expert_model_parallel_size=meg.ep,
                           expert_tensor_parallel_size=meg.etp,
                           **(dict(num_moe_experts=cfg.num_experts, moe_ffn_hidden_size=cfg.moe_intermediate_size,
                                   moe_router_topk=cfg.num_experts_per_tok, moe_token_dispatcher_type="allgather",
                                   moe_grouped_gemm=False) if moe else {}))
    if moe:  # dense and MoE layers mixed: Megatron's per-layer pattern
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

        tc.moe_layer_freq = [int(_moe_layer(cfg, i)) for i in range(cfg.num_hidden_layers)]
        layer_spec = get_gpt_decoder_block_spec(tc, use_transformer_engine=False, normalization="RMSNorm")
    else:
        layer_spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    model = GPTModel(tc, layer_spec,
                     vocab_size=trs.recipes.megatron_vocab_size(cfg.vocab_size, meg), max_sequence_length=256,
                     pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage(),
                     share_embeddings_and_output_weights=False, position_embedding_type="rope")
    inference = list(range(world, world + tp))
    shards = trs.recipes.megatron_tensors(model, megatron=meg, rank=rank)  # views of the parameters
    spec = trs.recipes.megatron_to_vllm(cfg, megatron=meg, tp=tp, trainer_ranks=world, inference_ranks=inference,
                                        dtype=torch.float32, src_dtype=torch.float32)
    full = hf_to_megatron(cfg, load_file(train_path), spec.src["embedding.word_embeddings.weight"].shape[0])
    for name, t in shards.items():  # the checkpoint, in Megatron's layout, into this rank's parameters
        t.copy_(spec.src[name].shard(full[name], rank))
    with trs_vllm.Trainer(cfg, shards, rank=rank, tp=tp, trainer_ranks=list(range(world)),
                          inference_ranks=inference, store=store, group="megatron", megatron=meg,
                          timeouts=trs.Timeouts(wait=300.0)) as tr:
        # Megatron's parameters now live in the trainer's shared arena: training updates what
        # vLLM pulls, with no copy per step.
        trs.recipes.megatron_bind(model, tr.source_tensors, megatron=meg, rank=rank)
        results.put(("ready", rank, None))
        while True:
            cmd, step = commands.get()
            if cmd == "stop":
                break
            tr.fence()  # every reader acked the last version: the parameters may change
            params = trs.recipes.megatron_tensors(model, megatron=meg, rank=rank)
            for name in sorted(params):  # the "optimizer step", on Megatron's own parameters
                lay = spec.src[name]
                # One global update per tensor, of which each rank adds its shard: every copy of a
                # replicated tensor (TP-replicated norms, DP replicas) stays equal, as Megatron's
                # all-reduced gradients keep them, so any copy may serve a read.
                g = torch.Generator().manual_seed(zlib.crc32(f"{SEED}/{step}/{name}".encode()))
                params[name].add_(lay.shard(torch.randn(tuple(lay.shape), generator=g) * SIGMA, rank))
            v = tr.publish()
            results.put(("published", rank, (v, {n: t.clone() for n, t in tr.tensors.items()})))
    dist.destroy_process_group()


# ---------------------------------------------------------------------------------------- driver
def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tp", type=int, default=2, help="vLLM tensor parallelism (default 2)")
    ap.add_argument("--megatron-tp", type=int, default=2, help="Megatron tensor parallelism (default 2)")
    ap.add_argument("--megatron-pp", type=int, default=2, help="Megatron pipeline stages (default 2)")
    ap.add_argument("--megatron-ep", type=int, default=1, help="Megatron expert parallelism (MoE; default 1)")
    ap.add_argument("--megatron-etp", type=int, default=None,
                    help="Megatron expert tensor parallelism (default: Megatron's, the TP size)")
    ap.add_argument("--model", choices=sorted(MODELS), default="tiny-llama",
                    help="tiny-llama (default) or tiny-qwen3-moe (Megatron-Core MoE ranks)")
    ap.add_argument("--refits", type=int, default=2, help="refits to run and check (default 2)")
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--json", action="store_true", help="print a JSON summary as the last stdout line")
    args = ap.parse_args(argv)
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(i % (os.cpu_count() or 1))
                                                                for i in range(args.tp)))
    from safetensors.torch import save_file

    import tritonreshard as trs
    import tritonreshard.vllm as trs_vllm

    cfg = model_config(args.model)
    meg = trs.recipes.Megatron(tp=args.megatron_tp, pp=args.megatron_pp, ep=args.megatron_ep, etp=args.megatron_etp)
    world = meg.tp * meg.pp
    model_dir = tempfile.mkdtemp(prefix="trs-megatron-")
    hf = tiny_model(cfg, seed=SEED, path=model_dir)
    train_path = model_dir.rstrip("/") + "-train.safetensors"
    save_file({n: p.detach().contiguous() for n, p in hf.named_parameters()}, train_path)
    prompts = random_prompts(cfg.vocab_size, range(12, 12 + args.prompts), seed=SEED + 1)
    summary = {"model": args.model, "megatron": {"tp": meg.tp, "pp": meg.pp, "ep": meg.ep, "etp": meg.etp},
               "tp": args.tp, "refits": 0, "prompts": len(prompts),
               "tokens_compared": 0, "mismatches": 0, "refit_ms": [], "worker": [], "greedy": []}
    spec = trs.recipes.megatron_to_vllm(cfg, megatron=meg, tp=args.tp, trainer_ranks=world,
                                        inference_ranks=list(range(world, world + args.tp)),
                                        dtype=torch.float32, src_dtype=torch.float32)

    trs.secret_for_children()
    ctx = mp.get_context("spawn")
    store, gloo = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    results, commands = ctx.Queue(), {r: ctx.Queue() for r in range(world)}
    procs = {r: ctx.Process(target=trainer, args=(r, world, args.model, dataclasses.asdict(meg), train_path, args.tp,
                                                  store, gloo, commands[r], results), daemon=True)
             for r in range(world)}
    for p in procs.values():
        p.start()

    from vllm import LLM

    llm = LLM(model_dir, tensor_parallel_size=args.tp, dtype="float32", enforce_eager=True, skip_tokenizer_init=True,
              max_model_len=128, max_num_seqs=max(4, len(prompts)), seed=SEED,
              weight_transfer_config={"backend": trs_vllm.BACKEND}, worker_extension_cls=trs_vllm.WORKER_EXTENSION)
    idents = sorted(set(llm.collective_rpc(dist_ident)) - {None})
    try:
        info = trs_vllm.init_info(store=store, trainer_ranks=list(range(world)),
                                  inference_ranks=list(range(world, world + args.tp)), group="megatron",
                                  timeout=300.0, megatron=meg)
        llm.collective_rpc("init_weight_transfer_engine", kwargs={"init_info": info})
        for _ in range(world):
            expect(results, "ready", procs, who="trainer rank(s)")
        print(f"refit group formed: {args.model}, Megatron TP {meg.tp} x PP {meg.pp} x EP {meg.ep} ({world} ranks), "
              f"vLLM TP {args.tp}", flush=True)
        compare(llm, hf, prompts, args.max_tokens, "version 0 (checkpoint)", summary)
        for k in range(1, args.refits + 1):
            for r in range(world):
                commands[r].put(("step", k))
            shards = {}
            for _ in range(world):
                _, r, (v, sh) = expect(results, "published", procs, who="trainer rank(s)")
                shards[r] = sh
            t0 = time.perf_counter()
            llm.collective_rpc("start_weight_update")
            llm.collective_rpc("update_weights", kwargs={"update_info": {"version": k}})
            llm.collective_rpc("finish_weight_update")
            summary["refit_ms"].append(round((time.perf_counter() - t0) * 1e3, 2))
            llm.reset_prefix_cache()
            stats = llm.collective_rpc(worker_stats)
            summary["worker"].append(stats[0])
            summary["worker_bytes"] = [w["bytes"] for w in stats]  # what each TP rank pulls per refit
            summary["refits"] += 1
            weights = megatron_to_hf(cfg, unshard(spec.src, shards))
            hf.load_state_dict(weights, strict=True)  # transformers' reference: the trainers' weights
            compare(llm, hf, prompts, args.max_tokens, f"refit {k}, version {k}", summary)
    finally:
        for r, p in procs.items():
            if p.is_alive():
                commands[r].put(("stop", None))
        reap(procs, timeout=30)
        llm.collective_rpc("shutdown_weight_transfer_engine")
        llm.llm_engine.engine_core.shutdown(timeout=30)
        summary["vllm_shm_removed"] = remove_vllm_shm(idents) if os.path.isdir("/dev/shm") else []
        shutil.rmtree(model_dir)
        os.unlink(train_path)
    summary["ok"] = summary["mismatches"] == 0 and summary["refits"] == args.refits
    if args.json:
        print(json.dumps(summary), flush=True)
    return summary


if __name__ == "__main__":
    sys.exit(0 if main()["ok"] else 1)
