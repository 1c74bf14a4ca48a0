"""``tritonreshard bench --hosts N --update-lr LR[,LR...]``: what crosses hosts when a refit sends only
what changed (cross-host deltas), against every byte, on the same updates.

For each learning rate (or ``random``: fresh weights every version) two sessions run the
same versions, one with ``delta="off"`` and one with ``delta="auto"``; each refit is an Adam-sized
bf16 update (:mod:`.updates`). Reported per rate, as medians over the timed refits (the first
refit of a session, which crosses whole, is a warm-up): the fraction of elements that changed, the
cross-host bytes per refit of both sessions, the refit time of both, and the trainers' detection
cost (comparing with the snapshot of what they last sent and encoding, seconds per GB sent).
"""
from __future__ import annotations

import json
import statistics
import sys
from dataclasses import replace

from ...planning import fmt_bytes
from .config import BenchConfig, parse_size
from .session import BenchSession

__all__ = ["parse_rates", "measure_rate", "run_cli"]


def parse_rates(text: str) -> list[float | str]:
    """``"1e-6,3e-6,random"`` -> ``[1e-6, 3e-6, "random"]`` (``"random"``: fresh weights every version)."""
    out = []
    for part in str(text).split(","):
        part = part.strip()
        if part == "random":
            out.append(part)
            continue
        try:
            out.append(float(part))
        except ValueError:
            raise ValueError(f"--update-lr={text!r}: each value must be a learning rate or 'random', "
                             f"got {part!r}") from None
    return out


def _session_figures(cfg: BenchConfig, repeats: int, warmup: int) -> dict:
    with BenchSession(cfg) as s:
        s.refits("tritonreshard", 1 + warmup)
        r = s.refits("tritonreshard", repeats, verify=True, each_stats=True)
    each = r["each_stats"]
    cross = [sum(x["cross_host_bytes"] for x in st) for st in each]
    changed = [statistics.fmean(c) for st in each if (c := [x["changed"] for x in st if x["changed"] is not None])]
    trainers = set(cfg.trainer_ranks)
    per_gb = [max(x["encode_s"] / x["egress_bytes"] * 1e9 for x in st if x["rank"] in trainers and x["egress_bytes"])
              for st in each]
    return {"refit_ms": statistics.median(r["seconds"]) * 1e3, "cross_host_bytes": int(statistics.median(cross)),
            "changed": statistics.median(changed) if changed else None,
            "detect_s_per_gb": statistics.median(per_gb),
            "delta_bytes": int(statistics.median(sum(x["delta_bytes"] for x in st) for st in each)),
            "verified": bool(r.get("verified"))}


def measure_rate(cfg: BenchConfig, lr: float | str, repeats: int, warmup: int) -> dict:
    """Both sessions (``delta="off"``, ``"auto"``) at learning rate ``lr`` (or ``"random"``)."""
    base = replace(cfg, update_lr=lr, methods=("tritonreshard",))
    off = _session_figures(replace(base, delta="off"), repeats, warmup)
    auto = _session_figures(replace(base, delta="auto"), repeats, warmup)
    return {"lr": lr, "changed": auto["changed"],
            "dense_bytes": off["cross_host_bytes"], "delta_bytes": auto["cross_host_bytes"],
            "ratio": auto["cross_host_bytes"] / off["cross_host_bytes"] if off["cross_host_bytes"] else None,
            "refit_ms_off": off["refit_ms"], "refit_ms_delta": auto["refit_ms"],
            "detect_s_per_gb": auto["detect_s_per_gb"], "verified": off["verified"] and auto["verified"]}


def _fmt(row: dict) -> str:
    changed = "-" if row["changed"] is None else f"{100 * row['changed']:.2f}%"
    return (f"{str(row['lr']):>8}  {changed:>8}  {fmt_bytes(row['dense_bytes']):>10}  {fmt_bytes(row['delta_bytes']):>10}"
            f"  {100 * row['ratio']:6.2f}%  {row['refit_ms_off']:9.1f}  {row['refit_ms_delta']:9.1f}"
            f"  {row['detect_s_per_gb']:8.2f}  {'yes' if row['verified'] else 'NO'}")


def run_cli(args) -> int:
    """``tritonreshard bench --update-lr``: one row per rate; exit code 0 when every refit verified."""
    try:
        rates = parse_rates(args.update_lr)
        cfg = BenchConfig(size=parse_size(args.size), layout=args.layout, trainers=args.trainers,
                          inference=args.inference, backend=args.backend or "auto", device=args.device,
                          mode=args.mode, timeout=args.timeout, hosts=args.hosts, methods=("tritonreshard",))
    except ValueError as exc:
        print(f"tritonreshard bench: {exc}", file=sys.stderr)
        return 2
    problems = [p for lr in rates for p in replace(cfg, update_lr=lr).problems()]
    if cfg.hosts < 2:
        problems.append(f"--update-lr measures what crosses hosts: it needs --hosts >= 2, got {cfg.hosts}")
    if args.repeats < 1 or args.warmup < 0:
        problems.append(f"--repeats={args.repeats} must be >= 1 and --warmup={args.warmup} >= 0")
    if problems:
        print("tritonreshard bench: invalid arguments:\n  - " + "\n  - ".join(dict.fromkeys(problems)), file=sys.stderr)
        return 2
    rows = []
    print(f"{'lr':>8}  {'changed':>8}  {'dense':>10}  {'delta':>10}  {'ratio':>7}  {'ms whole':>9}  "
          f"{'ms delta':>9}  {'s/GB det':>8}  verified")
    for lr in rates:
        rows.append(measure_rate(cfg, lr, args.repeats, args.warmup))
        print(_fmt(rows[-1]), flush=True)
    if args.json:
        print(json.dumps({"layout": cfg.layout, "size": cfg.size, "hosts": cfg.hosts, "rows": rows}))
    return 0 if all(r["verified"] for r in rows) else 1
