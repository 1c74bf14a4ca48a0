"""Gather-kernel bandwidth vs. torch's device-to-device copy, one JSON line per measurement.

Seed pattern at scale: a square global matrix, row-sharded over 2 source ranks, gathered into 4
column-shard destination ranks (one descriptor table, one launch per dtype pair), bf16 -> bf16 and
fp32 -> bf16. Bandwidth = (bytes read + bytes written) / time, next to torch's contiguous copy of the
same bytes measured in the same run (goal: ratio >= 0.85).

    python bench/gpu_kernels.py                       # CUDA, 1 GiB bf16 destination
    python bench/gpu_kernels.py --device cpu --size 2MiB   # smoke test (interpreter + torch backend)
"""
import argparse
import json
import math
import statistics
import sys
import time

import torch

import tritonreshard as trs
from tritonreshard import kernels  # noqa: F401  (interpreter setup before any triton import)
from tritonreshard._descriptors import DescriptorTable

GOAL = 0.85


def parse_size(s: str) -> int:
    units = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "kb": 10**3, "mb": 10**6, "gb": 10**9, "b": 1}
    low = s.strip().lower()
    for u, m in units.items():
        if low.endswith(u):
            return int(float(low[: -len(u)]) * m)
    return int(low)


def timer(device: torch.device, fn, warmup: int, iters: int) -> float:
    """Median seconds of ``fn()``: CUDA events on GPU, perf_counter on CPU."""
    for _ in range(warmup):
        fn()
    times = []
    if device.type == "cuda":
        torch.cuda.synchronize()
        for _ in range(iters):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
    else:
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def seed_table(n: int, src_dtype, dst_dtype, device):
    src_l = {"w": trs.Layout((n, n), 2, [trs.Shard(0)], src_dtype)}
    dst_l = {"w": trs.Layout((n, n), [2, 3, 4, 5], [trs.Shard(1)], dst_dtype)}
    plan = trs.plan_reshard(src_l, dst_l)
    src = {r: {"w": torch.randn(src_l["w"].local_shape(r), device=device).to(src_dtype)} for r in (0, 1)}
    out = {r: {"w": torch.empty(dst_l["w"].local_shape(r), device=device, dtype=dst_dtype)} for r in (2, 3, 4, 5)}
    table = DescriptorTable.build(plan.ops, src=lambda op: src[op.src_rank][op.name],
                                  dst=lambda op: out[op.dst_rank][op.name])
    return plan, src, out, table


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--size", default="1GiB", help="bytes of the bf16 destination (default 1GiB)")
    ap.add_argument("--warmup", type=int, default=None)
    ap.add_argument("--iters", type=int, default=None)
    ap.add_argument("--check", action="store_true", help=f"exit 3 if a ratio is below {GOAL}")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_kernels.py: --device cuda but torch.cuda.is_available() is False", file=sys.stderr)
        return 1
    on_gpu = device.type == "cuda"
    warmup = args.warmup if args.warmup is not None else (5 if on_gpu else 1)
    iters = args.iters if args.iters is not None else (30 if on_gpu else 3)
    n = int(math.isqrt(parse_size(args.size) // 2))
    n -= n % 8  # 2 row shards, 4 column shards, rows 16-byte aligned
    backends = ["triton"] if on_gpu else ["triton", "torch"]
    worst = math.inf
    for src_dtype in (torch.bfloat16, torch.float32):
        plan, src, out, table = seed_table(n, src_dtype, torch.bfloat16, device)
        moved = table.bytes_read + table.bytes_written
        a = torch.empty(moved // 2, dtype=torch.uint8, device=device)
        b = torch.empty_like(a)
        t_copy = timer(device, lambda: b.copy_(a), warmup, iters)
        copy_gbps = moved / t_copy / 1e9
        del a, b
        for backend in backends:
            t = timer(device, lambda: table.run(backend), warmup, iters)
            gbps = moved / t / 1e9
            ratio = gbps / copy_gbps
            if backend == "triton" and on_gpu:
                worst = min(worst, ratio)
            # correctness of what was timed
            g = torch.cat([src[0]["w"], src[1]["w"]]).to(torch.bfloat16)
            ok = all(torch.equal(out[r]["w"], g[:, (r - 2) * (n // 4):(r - 1) * (n // 4)]) for r in (2, 3, 4, 5))
            print(json.dumps({
                "name": f"seed_gather_{str(src_dtype).removeprefix('torch.')}_to_bfloat16",
                "backend": backend, "device": str(device), "shape": [n, n], "ops": len(plan.ops),
                "launches": table.num_launches, "bytes_moved": moved, "median_ms": round(t * 1e3, 4),
                "gbps": round(gbps, 2), "copy_gbps": round(copy_gbps, 2), "ratio_to_copy": round(ratio, 3),
                "goal": GOAL, "correct": ok,
            }), flush=True)
            if not ok:
                print("gpu_kernels.py: WRONG RESULT", file=sys.stderr)
                return 2
    if args.check and worst < GOAL:
        print(f"gpu_kernels.py: kernel bandwidth ratio {worst:.3f} below goal {GOAL}", file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
