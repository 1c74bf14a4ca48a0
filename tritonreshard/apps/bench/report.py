"""The bench's report: :func:`measure` runs every method on a session and returns the JSON object
``tritonreshard bench --json`` prints; :func:`table` is the text version of it."""
from __future__ import annotations

import os
import platform
import statistics

import torch

from tritonreshard.planning import fmt_bytes

from .config import CODECS, METHODS, WORKER_METHODS
from .session import BenchSession

__all__ = ["measure", "table"]


def _result(seconds: list[float], nbytes: int) -> dict:
    s = statistics.median(seconds)
    return {"seconds": s, "gbps": nbytes / s / 1e9, "seconds_min": min(seconds), "seconds_all": seconds}


def measure(session: BenchSession, methods, repeats: int, warmup: int) -> dict:
    """Runs every method on ``session``; returns the JSON object ``tritonreshard bench --json`` prints."""
    cfg, nbytes = session.cfg, session.dst_bytes
    workers = [m for m in methods if m in WORKER_METHODS]
    for m in workers:
        if warmup:
            session.refits(m, warmup)
    # Rounds interleave the methods (memcpy included), so load from anything else on the machine
    # hits every method alike instead of skewing the ratios.
    secs = {m: [] for m in methods}
    pulls, coords = [], []
    for _ in range(repeats):
        if "memcpy" in methods:
            secs["memcpy"] += session.memcpy(1, warmup=0 if secs["memcpy"] else max(1, warmup))
        for m in workers:
            r = session.refits(m, 1)
            secs[m] += r["seconds"]
            if m == "tritonreshard":
                pulls += r["pull_seconds_max"]
                coords += r["coordination_seconds"]
    results = {m: _result(secs[m], nbytes) for m in methods}
    if workers:
        for m, ok in session.verify_all(workers).items():
            results[m]["verified"] = ok
    if "memcpy" in results:
        results["memcpy"]["threads"] = torch.get_num_threads() if cfg.device == "cpu" else None
        if cfg.device == "cpu":
            one = _result(session.memcpy(max(3, repeats // 2), 1, threads=1), nbytes)
            results["memcpy"]["gbps_1thread"] = one["gbps"]
    if pulls:
        results["tritonreshard"]["pull_seconds_max"] = statistics.median(pulls)
        # Per refit: refit time minus the slowest rank's copy; the median and the spread.
        results["tritonreshard"]["coordination_ms"] = 1e3 * statistics.median(coords)
        results["tritonreshard"]["coordination_ms_all"] = [1e3 * c for c in coords]
    if "tritonreshard" in results:
        results["tritonreshard"]["staging_bytes"] = session.staging_bytes()
        results["tritonreshard"]["cross_host_bytes"] = session.cross_host_bytes()
        results["tritonreshard"]["trainer_egress_bytes"] = session.trainer_egress_bytes()
    for m, b in session.baseline_cross_host_bytes().items():
        if m in results:
            results[m]["cross_host_bytes"] = b
    out = {"bytes": nbytes, "results": results}
    ours = results.get("tritonreshard")
    if ours:
        ours["descriptors"] = session.descriptors
        if "memcpy" in results:
            ours["ratio_to_memcpy"] = ours["gbps"] / results["memcpy"]["gbps"]
            # What the refit costs beyond copying its bytes at memcpy speed, per tensor.
            extra = ours["seconds"] - nbytes / (results["memcpy"]["gbps"] * 1e9)
            ours["overhead_per_tensor_us"] = extra / len(session.model) * 1e6
        for b in ("p2p", "gather_broadcast"):
            if b in results:
                ours[f"speedup_vs_{b}"] = results[b]["seconds"] / ours["seconds"]
    if "memcpy" in results:
        for r in results.values():
            r.setdefault("ratio_to_memcpy", r["gbps"] / results["memcpy"]["gbps"])
    transport = session.rank_info[0]["transport"]
    out.update({
        "layout": cfg.layout, "trainers": cfg.num_trainers, "inference": cfg.inference, "device": cfg.device,
        "mode": cfg.mode, "backend": session.rank_info[-1]["backend"], "baseline_transport": transport,
        "model_bytes": session.model_bytes, "tensors": len(session.model), "plan_ops": session.plan_ops,
        "repeats": repeats, "warmup": warmup, "processes": cfg.world_size, "hosts": cfg.hosts, "net": cfg.net,
        "replicas": cfg.replicas, "codec": cfg.delta,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__,
                    "python": platform.python_version(),
                    "gpu": torch.cuda.get_device_name(0) if cfg.device == "cuda" else None},
    })
    return out


def _codec(out: dict) -> str:
    """The run's codec as the table names it: ``codec off (trs.Dense())``."""
    return f"codec {out['codec']} ({CODECS[out['codec']]})"


def table(out: dict) -> str:
    """The table ``tritonreshard bench`` prints, from :func:`measure`'s result."""
    res = out["results"]
    lines = [f"tritonreshard bench: {out['layout']}, {out['trainers']} trainer(s) -> {out['inference']} inference "
             f"rank(s), {out['device']}, {out['backend']} backend, {out['mode']} mode, {_codec(out)}; "
             f"{fmt_bytes(out['model_bytes'])} bf16 model in {out['tensors']} tensors, "
             f"{fmt_bytes(out['bytes'])} written per refit; median of {out['repeats']} "
             f"(after {out['warmup']} warm-up)"]
    ours = res.get("tritonreshard")
    rows = [("method", "median ms", "GB/s", "x memcpy", "tritonreshard speed-up", "verified")]
    for m in METHODS:
        if m not in res:
            continue
        r = res[m]
        ratio = f"{r['ratio_to_memcpy']:.2f}" if "ratio_to_memcpy" in r else "-"
        speed = f"{r['seconds'] / ours['seconds']:.1f}x" if ours and m != "tritonreshard" else "-"
        ver = {True: "yes", False: "NO"}.get(r.get("verified"), "-")
        rows.append((m, f"{r['seconds'] * 1e3:.2f}", f"{r['gbps']:.2f}", ratio, speed, ver))
    w = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        lines.append("  " + "  ".join(c.ljust(w[0]) if i == 0 else c.rjust(w[i]) for i, c in enumerate(row)))
    if ours:
        coord = f"coordination {ours['coordination_ms']:.3f} ms per refit (beyond the slowest copy), " \
            if "coordination_ms" in ours else ""
        lines.append(f"tritonreshard: {coord}staging bytes {ours['staging_bytes']} (measured), "
                     f"{ours['descriptors']} descriptors "
                     f"over the inference ranks" + (f", overhead beyond memcpy {ours['overhead_per_tensor_us']:.1f} "
                                                    f"us per tensor" if "overhead_per_tensor_us" in ours else ""))
    if ours and "trainer_egress_bytes" in ours:
        k = out.get("replicas", 1)
        lines.append(f"trainers' egress per refit: {fmt_bytes(ours['trainer_egress_bytes'])} for {k} inference "
                     f"replica(s), {fmt_bytes(ours['trainer_egress_bytes'] / k)} per replica "
                     f"(model {fmt_bytes(out['model_bytes'])})")
    if out.get("hosts", 1) > 1:
        cross = ", ".join(f"{m} {fmt_bytes(res[m]['cross_host_bytes'])}" for m in METHODS
                          if "cross_host_bytes" in res.get(m, {}))
        how = "hosts of the harness (network namespaces)" if out.get("net") == "namespaces" else "simulated hosts"
        lines.append(f"{out['hosts']} {how} (trainers on host0): bytes across hosts per refit: "
                     f"{cross} (model {fmt_bytes(out['model_bytes'])})")
    lines.append(f"baselines over {out['baseline_transport']}; {out['processes']} processes on "
                 f"{out['machine']['cpus']} CPUs")
    return "\n".join(lines)
