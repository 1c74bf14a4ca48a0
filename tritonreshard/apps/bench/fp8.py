"""``tritonreshard bench --quantize fp8-block``: the fused FP8 refit against the bf16 refit and against
"bf16 refit, then quantize with torch" (what RL stacks do today), on the same bytes in one run.

What moves: a Llama-shaped bf16 model of about ``--size`` bytes built by the real recipe
(``trs.recipes.hf_to_vllm``: hidden 1024, 8 heads of 128, 4 KV heads, intermediate 3072, vocab 8192,
as many layers as fit; under 64 MiB hidden 512), from ``--trainers`` FSDP ranks (default 3) to ``--inference`` TP ranks
(default 4), all in this process (:func:`tritonreshard.execute_local`: the copy and quantize work of
every rank, without the engine's processes around it). Methods, each timed as the median of
``--repeats`` runs after ``--warmup``, the methods' rounds interleaved (round i of each before round
i+1 of any; one progress line per round and method on stderr):

* ``bf16``: the plain refit (bf16 -> bf16, vLLM's unquantized layout);
* ``fp8_fused``: the refit into vLLM's block-FP8 layout, each 128x128 block quantized as it is read;
* ``bf16_then_quantize``: the bf16 refit, then every linear's local shard quantized with torch ops
  (DeepGEMM's ``per_block_cast_to_fp8`` per logical partition) into the FP8 layout.

``GB/s`` is the bf16 bytes the refit reads from the trainers (the same for all three) over the time.
``verified``: the fused result equals the refit-then-quantize result bit for bit (weights and scales).
Backend: ``--backend`` (default: triton on CUDA, torch on CPU; the Triton interpreter is a debugger).
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time

import torch

from ... import execute_local, recipes
from ...kernels import DescriptorTable, QuantizeTable, copy_backend, per_block_cast_to_fp8
from .config import parse_size

__all__ = ["fp8_config", "run_fp8"]

_LAYER = dict(hidden_size=1024, num_attention_heads=8, num_key_value_heads=4, head_dim=128, intermediate_size=3072,
              vocab_size=8192)
_SMALL = dict(hidden_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=128, intermediate_size=1024,
              vocab_size=1024)  # under 64 MiB (tests): about 6 MiB a layer


def fp8_config(size: int):
    """A transformers ``LlamaConfig`` of about ``size`` bytes of bf16 (at least one layer)."""
    import transformers  # lazy: heavy, and only this bench mode needs it

    shape = _LAYER if size >= 64 << 20 else _SMALL
    h, i, v = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"]
    qkv = (shape["num_attention_heads"] + 2 * shape["num_key_value_heads"]) * shape["head_dim"]
    per_layer = 2 * (qkv * h + h * h + 3 * h * i + 2 * h)
    layers = max(1, round((size - 2 * (2 * v * h + h)) / per_layer))
    return transformers.LlamaConfig(**shape, num_hidden_layers=layers, tie_word_embeddings=False)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_rounds(fns: dict, repeats: int, warmup: int, device, progress=None) -> dict:
    """The timed rounds' seconds of each method in ``fns`` (a list per method), its rounds
    interleaved: round ``i`` of every method before round ``i + 1`` of any, so a change of machine
    load during the run falls on every method alike (run one after another, a busy spell could make
    either look several times slower). The order within a round rotates, so no method always follows
    the same one. ``progress(line)``: one line per method and round."""
    names = list(fns)
    times = {n: [] for n in names}
    total = warmup + repeats
    for i in range(total):
        for n in names[i % len(names):] + names[:i % len(names)]:
            _sync(device)
            t0 = time.perf_counter()
            fns[n]()
            _sync(device)
            dt = time.perf_counter() - t0
            if i >= warmup:
                times[n].append(dt)
            if progress is not None:
                what = f"warmup {i + 1}/{warmup}" if i < warmup else f"round {i - warmup + 1}/{repeats}"
                progress(f"{what} {n}: {dt * 1e3:.1f} ms")
    return times


def run_fp8(size: int, trainers: int = 3, inference: int = 4, device: str = "cpu", backend: str | None = None,
            repeats: int = 5, warmup: int = 1, quantization: str = "fp8-block", progress=None) -> dict:
    """Measure the three methods; returns the figures (see the module doc). ``progress``: called with
    one line of text per step (building, then each method's round), e.g. a printer to stderr."""
    say = progress or (lambda line: None)
    dev = torch.device(device)
    backend = copy_backend(backend or "auto").for_device(dev)  # "auto": by the device, once
    config = fp8_config(size)
    say(f"building a {config.num_hidden_layers}-layer Llama of about {size / 2**20:.0f} MiB and its plans")
    kw = dict(tp=inference, trainer_ranks=list(range(trainers)),
              inference_ranks=list(range(trainers, trainers + inference)), dtype=torch.bfloat16,
              src_dtype=torch.bfloat16)
    plain = recipes.hf_to_vllm(config, **kw)
    fp8 = recipes.hf_to_vllm(config, **kw, quantization=quantization)
    p_plain, p_fp8 = plain.plan(), fp8.plan()
    g = torch.Generator().manual_seed(0)
    src = {}
    for name, lay in sorted(plain.src.items()):
        full = (torch.randn(lay.shape, generator=g) * 0.02).to(torch.bfloat16)
        for r in lay.ranks:
            src.setdefault(r, {})[name] = lay.shard(full, r).contiguous().to(dev)

    def alloc(plan):
        return {r: {n: torch.zeros(lay.local_shape(r), dtype=lay.dtype, device=dev)
                    for n, lay in plan.dst_layouts.items() if r in lay.ranks} for r in plan.dst_ranks}

    out_bf16, out_fused, out_after = alloc(p_plain), alloc(p_fp8), alloc(p_fp8)
    for r, tensors in out_after.items():  # the stacks' flow: unquantized tensors are the bf16 refit's
        tensors.update({n: t for n, t in out_bf16[r].items() if n not in fp8.quant})

    # Tables built once and run every refit, as the engine's inference ranks do (execute_local
    # would also re-validate every tensor on each call); fills (vocab padding) are zero already.
    say("validating the inputs (one fused refit) and building the tables")
    execute_local(p_fp8, src, out=out_fused, backend=backend)  # validates the inputs once
    get_src = lambda op: src[op.src_rank][op.src_name]  # noqa: E731
    t_bf16 = DescriptorTable.build(p_plain.ops, src=get_src, dst=lambda op: out_bf16[op.dst_rank][op.name])
    fused_dst = lambda op: out_fused[op.dst_rank][op.name]  # noqa: E731
    t_rest = DescriptorTable.build([op for op in p_fp8.ops if op.name not in fp8.quant], src=get_src, dst=fused_dst)
    t_q = QuantizeTable.build([op for op in p_fp8.ops if op.name in fp8.quant], fp8.quant, src=get_src,
                              dst=fused_dst, scale=lambda r, n: out_fused[r][n])

    def bf16():
        backend.run(t_bf16)

    def fused():
        backend.run(t_rest)
        backend.run(t_q)

    def then_quantize():
        bf16()
        for r, tensors in out_bf16.items():
            for name, q in fp8.quant.items():
                w, row = tensors[name], 0
                qo, so = out_after[r][name], out_after[r][q.scale]
                srow = 0
                for n in q.rows:  # each logical partition on its own block grid
                    qq, ss = per_block_cast_to_fp8(w[..., row:row + n, :], q.block, q.ue8m0, q.scale_rule)
                    qo[..., row:row + n, :] = qq
                    so[..., srow:srow + ss.shape[-2], :] = ss
                    row, srow = row + n, srow + ss.shape[-2]

    read = sum(op.numel for op in p_plain.ops) * 2
    rounds = _time_rounds({"bf16": bf16, "fp8_fused": fused, "bf16_then_quantize": then_quantize}, repeats,
                          warmup, dev, progress)
    secs = {m: statistics.median(t) for m, t in rounds.items()}
    verified = all(torch.equal(out_fused[r][n].view(torch.uint8) if t.dtype == torch.float8_e4m3fn else out_fused[r][n],
                               t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t)
                   for r, ts in out_after.items() for n, t in ts.items())
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"quantize": quantization, "backend": backend.name, "device": str(dev), "layers": config.num_hidden_layers,
            "torch_threads": torch.get_num_threads(), "cores": cores,
            "load_avg": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
            "bf16_bytes_read": read, "trainers": trainers, "inference": inference, "repeats": repeats,
            "results": {m: {"seconds": s, "GBps_bf16_read": read / s / 1e9, "spread": max(rounds[m]) / min(rounds[m])}
                        for m, s in secs.items()},
            "fused_vs_bf16": secs["bf16"] / secs["fp8_fused"],
            "fused_vs_then_quantize": secs["bf16_then_quantize"] / secs["fp8_fused"], "verified": verified}


def table(out: dict) -> str:
    lines = [f"FP8 refit ({out['quantize']}, {out['backend']} on {out['device']}): {out['layers']} layers, "
             f"{out['bf16_bytes_read'] / 2**20:.0f} MiB of bf16 read, {out['trainers']} trainers -> "
             f"{out['inference']} TP ranks, median of {out['repeats']}"]
    spread = max(r["spread"] for r in out["results"].values())
    if spread > 1.5:
        # on CPU each torch op is a parallel region that waits for all its threads: on an oversubscribed
        # machine those waits, not the arithmetic, set the times, and they vary several-fold
        load = f"load {out['load_avg']:.1f}" if out.get("load_avg") is not None else "load unknown"
        lines.append(f"  rounds varied up to {spread:.1f}x ({load} on {out['cores']} cores, torch threads "
                     f"{out['torch_threads']}): a busy machine; compare medians of more --repeats"
                     + ("; OMP_NUM_THREADS=1 steadies CPU figures" if out["device"] == "cpu" else ""))
    for m, r in out["results"].items():
        lines.append(f"  {m:20s} {r['seconds'] * 1e3:9.1f} ms  {r['GBps_bf16_read']:7.2f} GB/s")
    lines.append(f"  fused / bf16 refit time: {1 / out['fused_vs_bf16']:.2f}x; refit+quantize / fused: "
                 f"{out['fused_vs_then_quantize']:.2f}x; verified: {out['verified']}")
    return "\n".join(lines)


def run_cli(args) -> int:
    if args.device == "cuda" and not torch.cuda.is_available():
        print("tritonreshard bench: --device=cuda but torch.cuda.is_available() is False", file=sys.stderr)
        return 2
    out = run_fp8(parse_size(args.size), trainers=args.trainers or 3, inference=args.inference,
                  device=args.device, backend=args.backend, repeats=args.repeats, warmup=args.warmup,
                  quantization=args.quantize, progress=lambda line: print(f"bench --quantize: {line}",
                                                                          file=sys.stderr, flush=True))
    print(table(out))
    if args.json:
        print(json.dumps(out))
    return 0 if out["verified"] else 1
