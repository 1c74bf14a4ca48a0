"""GPU figures: the gather kernels and the cross-process refit against torch's device-to-device copy.

Bandwidth = (bytes read + bytes written) / time, next to torch's contiguous ``copy_`` of the same
bytes measured in the same run (``copy_gbps``; on an H200 about 4.3 TB/s). Targets (measured here,
never asserted in a test): kernels >= 0.90 of D2D on wide rows, >= 0.75 on narrow rows; the
cross-process pull >= 0.85.

Parts (``--part``):

* ``kernels`` (:func:`kernel_figures`): one descriptor table per case, >= ``--size`` bytes read:
  ``wide_rows`` (bf16 [n, n], 2 row shards -> 4 column shards: ~n/4-element rows, the "rows"
  kernel), ``narrow_rows`` (bf16 [R, 256] column shards of 64 elements: the "tiles" kernel) and
  ``cast_bf16_to_fp32`` (the wide-rows case, bf16 -> fp32). Every result is checked bit for bit.
* ``refit`` (:func:`refit_figures`): the engine across processes on one GPU: 2 trainer processes
  publish >= ``--refit-size`` bytes, 2 inference processes pull them (shadow mode) with the
  compiled kernels; the slowest pull per refit against one D2D copy of the same bytes. This part
  uses the engine's public API only (``RefitTrainer`` / ``RefitInference``) and is the one function
  to adapt when that API changes.

* ``delta`` (:func:`delta_figures`): the delta codec's change detection on a bf16 message of
  ``--size`` bytes at 0%, 2.5% and 30% changed words: ``encode`` with the Triton compare-and-compact
  (``kernels.delta``) against torch's ops (``backend="torch"``), as milliseconds per GB of message
  (both read the message and its snapshot), and whether the two payloads are identical. On CPU only
  torch is timed (the interpreter is no speed measure).

Each part merges its figures into ``--json`` as soon as it has them (a later failure cannot lose
them) and prints them. ``--device cpu --size 256KiB --refit-size 4MiB`` is a smoke test (kernels in the
interpreter, the refit with torch-copy pulls over shared memory).
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import os
import statistics
import sys
import time
import traceback

import torch

TARGETS = {"wide_rows": 0.90, "narrow_rows": 0.75, "cast_bf16_to_fp32": 0.75, "refit": 0.85}


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
        torch.cuda.synchronize(device)
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


def d2d_seconds(nbytes: int, device, warmup: int, iters: int) -> float:
    """torch's contiguous copy of ``nbytes`` (read ``nbytes``, write ``nbytes``)."""
    a = torch.empty(nbytes, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    t = timer(device, functools.partial(b.copy_, a), warmup, iters)
    del a, b
    return t


def merge_json(path: str | None, part: str, value) -> None:
    if not path:
        return
    data = {}
    if os.path.exists(path):
        with open(path) as f:
            data = json.load(f)
    data[part] = value
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=2)
    os.replace(tmp, path)


# ----------------------------------------------------------------------------------- kernel figures


def _case(name: str, shape, src_l, dst_l, device):
    from tritonreshard.kernels import DescriptorTable

    import tritonreshard as trs

    plan = trs.plan_reshard({"w": src_l}, {"w": dst_l})
    torch.manual_seed(0)
    # random finite values, made on the device (1 GiB of CPU randn would cost seconds); the copy is
    # checked exactly against torch's own slicing and cast of the same global tensor
    glob = torch.randn(shape, dtype=torch.float32, device=device).to(src_l.dtype)
    src = {r: {"w": src_l.shard(glob, r).contiguous()} for r in src_l.ranks}
    out = {r: {"w": torch.full(dst_l.local_shape(r), float("nan"), dtype=dst_l.dtype, device=device)}
           for r in dst_l.ranks}
    table = DescriptorTable.build(plan.ops, src=lambda op: src[op.src_rank][op.name],
                                  dst=lambda op: out[op.dst_rank][op.name])

    def bits(t):
        return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])

    def check() -> bool:
        ref = glob.to(dst_l.dtype)
        return all(torch.equal(bits(out[r]["w"]), bits(dst_l.shard(ref, r).contiguous())) for r in dst_l.ranks)

    return plan, table, check


def kernel_figures(size: int, device: torch.device, warmup: int, iters: int) -> list[dict]:
    """Kernel GB/s vs torch D2D for wide rows, narrow rows and a bf16 -> fp32 cast (>= ``size``
    bytes read per run)."""
    import tritonreshard as trs

    bf16, f32 = torch.bfloat16, torch.float32
    n = math.isqrt(size // 2) + 64
    n -= n % 64  # 4 column shards of whole 16-byte vectors
    rows = -(-size // (256 * 2))
    rows += -rows % 2
    cases = [
        ("wide_rows", (n, n), trs.Layout((n, n), 2, [trs.Shard(0)], bf16),
         trs.Layout((n, n), [2, 3, 4, 5], [trs.Shard(1)], bf16)),
        ("narrow_rows", (rows, 256), trs.Layout((rows, 256), 2, [trs.Shard(0)], bf16),
         trs.Layout((rows, 256), [2, 3, 4, 5], [trs.Shard(1)], bf16)),
        ("cast_bf16_to_fp32", (n, n), trs.Layout((n, n), 2, [trs.Shard(0)], bf16),
         trs.Layout((n, n), [2, 3, 4, 5], [trs.Shard(1)], f32)),
    ]
    results = []
    for name, shape, src_l, dst_l in cases:
        plan, table, check = _case(name, shape, src_l, dst_l, device)
        moved = table.bytes_read + table.bytes_written
        t_copy = d2d_seconds(moved // 2, device, warmup, iters)
        t = timer(device, functools.partial(table.run, "triton"), warmup, iters)
        variants = sorted({lc.variant for g in table._groups for lc in g.launches})
        res = {
            "name": name, "device": str(device), "shape": list(shape), "ops": len(plan.ops),
            "launches": table.num_launches, "kernels": variants, "bytes_read": table.bytes_read,
            "bytes_written": table.bytes_written, "median_ms": round(t * 1e3, 4),
            "gbps": round(moved / t / 1e9, 1), "d2d_gbps": round(moved / t_copy / 1e9, 1),
            "ratio_to_d2d": round(t_copy / t, 3), "target": TARGETS[name], "correct": check(),
        }
        print(json.dumps(res), flush=True)
        results.append(res)
        del plan, table, check
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return results


# ------------------------------------------------------------------------------------ delta figures


def delta_figures(size: int, device: torch.device, warmup: int, iters: int) -> list[dict]:
    """``encode`` of a bf16 message of ``size`` bytes against its snapshot, Triton vs torch: ms and
    ms per GB of message, at 0, 2.5 and 30% of words changed (one-ulp changes) and with every word
    random; and ``decode`` (the receiver applying it to its base: torch on the device)."""
    from tritonreshard.transport import delta as dc

    n = size // 2
    g = torch.Generator(device="cpu").manual_seed(11)
    old = (torch.randn(n, generator=g) * 0.02).to(torch.bfloat16).to(device)
    results = []
    for frac in (0.0, 0.025, 0.3, 1.0):
        new = old.clone()
        w = new.view(torch.int16)
        if frac == 1.0:   # every word random: no sparse encoding pays
            new.copy_(torch.randint(0, 256, (2 * n,), dtype=torch.uint8, generator=g).to(device).view(new.dtype))
        else:
            pick = (torch.rand(n, generator=g) < frac).to(device)
            w[pick] ^= 1
        ob, nb = old.view(torch.uint8), new.view(torch.uint8)
        ref = dc.encode(nb, ob, 2, backend="torch")
        res = {"name": f"delta_bf16_{frac:g}", "device": str(device), "bytes": 2 * n, "changed": ref.changed,
               "kind": dc.KINDS[ref.kind], "nbytes": ref.nbytes}
        backends = ("torch", "triton") if device.type == "cuda" else ("torch",)
        for b in backends:
            t = timer(device, functools.partial(dc.encode, nb, ob, 2, backend=b), warmup, iters)
            res[f"{b}_ms"] = round(t * 1e3, 3)
            res[f"{b}_ms_per_gb"] = round(t * 1e3 / (2 * n / 1e9), 3)
        if ref.payload is not None:
            base = ob.clone()   # applied again and again: the work per call is the same
            t = timer(device, functools.partial(dc.decode, ref.kind, ref.payload, base, 2, ref.entries), warmup, iters)
            res["decode_ms"] = round(t * 1e3, 3)
            res["decode_ms_per_gb"] = round(t * 1e3 / (2 * n / 1e9), 3)
            del base
        if "triton" in backends:
            got = dc.encode(nb, ob, 2, backend="triton")
            res["speedup"] = round(res["torch_ms"] / res["triton_ms"], 2)
            res["correct"] = (got.kind == ref.kind and got.nbytes == ref.nbytes and got.entries == ref.entries
                              and (ref.payload is None or torch.equal(got.payload, ref.payload)))
        else:
            res["correct"] = True
        print(json.dumps(res), flush=True)
        results.append(res)
        del new, ref
    return results


# ------------------------------------------------------------------------------------ refit figures


_TRAINERS, _INFERENCE = (0, 1), (2, 3)


def _refit_layouts(total: int):
    """16 bf16 matrices of ``total`` bytes together: trainers FSDP rows (Shard(0) over 2),
    inference tensor parallel columns (Shard(1) over 2)."""
    import tritonreshard as trs

    cols = 16384
    rows = max(64, -(-total // (16 * cols * 2)))
    rows += -rows % 64
    src = {f"w{i:02d}": trs.Layout((rows, cols), list(_TRAINERS), [trs.Shard(0)], torch.bfloat16) for i in range(16)}
    dst = {k: trs.Layout(v.shape, list(_INFERENCE), [trs.Shard(1)], torch.bfloat16) for k, v in src.items()}
    return src, dst


def _pattern(layout, rank: int, version: int, device) -> torch.Tensor:
    """Provenance of a shard: ((global row * 131 + global col) % 200 + version), exact in bf16."""
    full_rows, full_cols = layout.shape
    g_rows = torch.arange(full_rows, device=device, dtype=torch.int64)[:, None]
    g_cols = torch.arange(full_cols, device=device, dtype=torch.int64)[None, :]
    glob = ((g_rows * 131 + g_cols) % 200 + version).to(torch.bfloat16)
    shard = layout.shard(glob, rank).clone()
    del glob
    return shard


def _refit_member(rank: int, port: int, total: int, repeats: int, device: str, queue) -> None:
    try:
        import tritonreshard as trs

        dev = torch.device(device)
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        else:
            torch.set_num_threads(1)
        src_l, dst_l = _refit_layouts(total)
        meeting = trs.Meeting(rank=rank, world_size=len(_TRAINERS) + len(_INFERENCE), store=f"127.0.0.1:{port}")
        kw = dict(meeting=meeting, timeouts=trs.Timeouts(wait=300))
        if rank in _TRAINERS:
            tensors = {k: _pattern(lay, rank, 0, dev) for k, lay in src_l.items()}
            with trs.RefitTrainer(tensors, src_l, **kw) as ep:
                for _version in range(1, repeats + 1):
                    for k in src_l:
                        ep.source_tensors[k].add_(1)  # version v: pattern + v
                    ep.publish()
                    ep.fence()
            queue.put((rank, "ok", None))
        else:
            pulls = []
            with trs.RefitInference(dst_l, pull=trs.PullOptions(device=dev), **kw) as ep:
                for v in range(1, repeats + 1):
                    ep.pull(version=v)
                    pulls.append(ep.last_pull.copy_ms / 1e3)
                ok = all(torch.equal(ep.tensors[k], _pattern(lay, rank, repeats, dev)) for k, lay in dst_l.items())
            queue.put((rank, "ok", {"pull_seconds": pulls, "correct": ok}))
    except BaseException:  # reported to the parent, which prints it next to the figures
        queue.put((rank, "error", traceback.format_exc()))


def refit_figures(total: int, repeats: int, deadline_s: float, device: str = "cuda:0") -> dict:
    """Cross-process refit of ``total`` bytes on one GPU (2 trainers -> 2 inference processes) vs a
    D2D copy of the same bytes; the slowest pull of each refit, median over refits.

    The one place that uses the engine's public API; adapt it here if that API changes."""
    import torch.multiprocessing as mp

    from tritonreshard.apps.kit import free_port, reap

    port = free_port()
    src_l, _ = _refit_layouts(total)
    nbytes = sum(math.prod(lay.shape) * 2 for lay in src_l.values())
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    ranks = [*_TRAINERS, *_INFERENCE]
    procs = [ctx.Process(target=_refit_member, args=(r, port, total, repeats, device, queue)) for r in ranks]
    for p in procs:
        p.start()
    got, end = {}, time.monotonic() + deadline_s
    try:
        while len(got) < len(ranks) and time.monotonic() < end:
            try:
                rank, status, value = queue.get(timeout=1.0)
            except Exception:  # queue.Empty: keep waiting until the deadline or a death
                if any(p.exitcode not in (None, 0) for p in procs):
                    break
                continue
            got[rank] = (status, value)
    finally:
        reap(procs, timeout=5 if len(got) == len(ranks) else 0.1)
    errors = {r: v for r, (s, v) in got.items() if s != "ok"}
    missing = [r for r in ranks if r not in got]
    res = {"device": device, "bytes": nbytes, "tensors": len(src_l), "trainers": len(_TRAINERS),
           "inference": len(_INFERENCE), "repeats": repeats}
    if errors or missing:
        res["error"] = {"ranks_failed": errors, "ranks_missing": missing,
                        "exitcodes": {r: p.exitcode for r, p in zip(ranks, procs, strict=True)}}
        return res
    per_refit = [max(got[r][1]["pull_seconds"][i] for r in _INFERENCE) for i in range(repeats)]
    timed = per_refit[1:] if repeats > 1 else per_refit  # the first pull compiles the kernels
    slowest = statistics.median(timed)
    moved = 2 * nbytes  # every byte read from a trainer arena and written once
    t_copy = d2d_seconds(nbytes, torch.device(device), 3, 10)
    res.update({
        "slowest_pull_s": round(slowest, 5), "slowest_pull_each_s": [round(x, 5) for x in per_refit],
        "gbps": round(moved / slowest / 1e9, 1), "d2d_gbps": round(moved / t_copy / 1e9, 1),
        "ratio_to_d2d": round(t_copy / slowest, 3), "target": TARGETS["refit"],
        "correct": all(got[r][1]["correct"] for r in _INFERENCE),
    })
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--part", choices=("kernels", "delta", "refit", "all"), default="all")
    ap.add_argument("--size", default="1GiB", help="bytes read per kernel case (default 1GiB)")
    ap.add_argument("--refit-size", default="8GiB", help="bytes refit across processes (default 8GiB)")
    ap.add_argument("--repeats", type=int, default=6, help="refits timed (the first one is not counted)")
    ap.add_argument("--deadline", type=float, default=240.0, help="seconds for the refit part")
    ap.add_argument("--warmup", type=int, default=None)
    ap.add_argument("--iters", type=int, default=None)
    ap.add_argument("--json", default=None, help="merge the figures into this JSON file")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_kernels.py: --device cuda but torch.cuda.is_available() is False", file=sys.stderr)
        return 1
    on_gpu = device.type == "cuda"
    warmup = args.warmup if args.warmup is not None else (3 if on_gpu else 1)
    iters = args.iters if args.iters is not None else (20 if on_gpu else 2)
    status = 0
    if args.part in ("kernels", "all"):
        figs = kernel_figures(parse_size(args.size), device, warmup, iters)
        merge_json(args.json, "kernels", figs)
        status |= 0 if all(f["correct"] for f in figs) else 2
    if args.part in ("delta", "all"):
        figs = delta_figures(parse_size(args.size), device, warmup, iters)
        merge_json(args.json, "delta", figs)
        status |= 0 if all(f["correct"] for f in figs) else 8
    if args.part in ("refit", "all"):
        dev = f"cuda:{device.index or 0}" if on_gpu else "cpu"  # cpu: a smoke test of this part
        fig = refit_figures(parse_size(args.refit_size), args.repeats, args.deadline, dev)
        print(json.dumps(fig), flush=True)
        merge_json(args.json, "refit", fig)
        status |= 0 if fig.get("correct") else 4
    return status


if __name__ == "__main__":
    sys.exit(main())
