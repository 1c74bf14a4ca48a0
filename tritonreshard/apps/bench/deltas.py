"""``tritonreshard bench --hosts N --update-lr LR[,LR...] [--link-gbps G[,G...]]``: what crosses hosts
when a refit sends only what changed (cross-host deltas), against every byte, on the same updates.

For each learning rate (or ``random``: fresh weights every version) and simulated link rate
(``--link-gbps``; default loopback as it is) three sessions run the same versions, with
``delta="off"`` (every byte), ``"auto"`` (the delta where finding what changed costs less than
sending whole: the trainers' measured link and detection speeds decide) and ``"always"`` (a delta
every refit); each refit is an Adam-sized bf16 update (:mod:`.updates`). Reported per row, as
medians over the timed refits (the first refit of a session, which crosses whole, and the warm-up
refits, in which ``auto`` measures its link and its detection once, are not timed): the fraction of
elements that changed, the cross-host bytes per refit and the refit time of each session, and the
trainers' detection cost in the ``always`` session (comparing with the snapshot of what they last
sent and encoding, seconds per GB sent).
"""
from __future__ import annotations

import json
import statistics
import sys
from dataclasses import replace

from ...planning import fmt_bytes
from .config import BenchConfig, parse_gbps, parse_size
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
            "dense_bytes": int(statistics.median(sum(x["dense_bytes"] for x in st) for st in each)),
            "verified": bool(r.get("verified"))}


def measure_rate(cfg: BenchConfig, lr: float | str, repeats: int, warmup: int) -> dict:
    """The three sessions (``delta="off"``, ``"auto"``, ``"always"``) at learning rate ``lr`` (or
    ``"random"``), on ``cfg``'s link (``cfg.link_gbps``)."""
    base = replace(cfg, update_lr=lr, methods=("tritonreshard",))
    off, auto, always = (_session_figures(replace(base, delta=d), repeats, warmup) for d in ("off", "auto", "always"))
    return {"lr": lr, "link_gbps": cfg.link_gbps, "changed": always["changed"],
            "dense_bytes": off["cross_host_bytes"], "auto_bytes": auto["cross_host_bytes"],
            "delta_bytes": always["cross_host_bytes"],
            "ratio": always["cross_host_bytes"] / off["cross_host_bytes"] if off["cross_host_bytes"] else None,
            # what auto's trainers chose (each trainer weighs its own link): mixed where they differ
            "auto_picked": "mixed" if auto["delta_bytes"] and auto["dense_bytes"] else
                           "delta" if auto["delta_bytes"] else "whole",
            "refit_ms_off": off["refit_ms"], "refit_ms_auto": auto["refit_ms"], "refit_ms_delta": always["refit_ms"],
            "detect_s_per_gb": always["detect_s_per_gb"],
            "verified": off["verified"] and auto["verified"] and always["verified"]}


def _fmt(row: dict) -> str:
    changed = "-" if row["changed"] is None else f"{100 * row['changed']:.2f}%"
    link = "loopback" if row["link_gbps"] is None else f"{row['link_gbps']:g} Gb/s"
    return (f"{str(row['lr']):>8}  {link:>9}  {changed:>8}  {fmt_bytes(row['dense_bytes']):>10}"
            f"  {fmt_bytes(row['delta_bytes']):>10}  {100 * row['ratio']:6.2f}%  {row['auto_picked']:>5}"
            f"  {row['refit_ms_off']:8.1f}  {row['refit_ms_auto']:8.1f}  {row['refit_ms_delta']:9.1f}"
            f"  {row['detect_s_per_gb']:8.2f}  {'yes' if row['verified'] else 'NO'}")


def run_cli(args) -> int:
    """``tritonreshard bench --update-lr``: one row per rate; exit code 0 when every refit verified."""
    try:
        rates = parse_rates(args.update_lr)
        links = parse_gbps(getattr(args, "link_gbps", None))
        cfg = BenchConfig(size=parse_size(args.size), layout=args.layout, trainers=args.trainers,
                          inference=args.inference, backend=args.backend or "auto", device=args.device,
                          mode=args.mode, timeout=args.timeout, hosts=args.hosts, methods=("tritonreshard",))
    except ValueError as exc:
        print(f"tritonreshard bench: {exc}", file=sys.stderr)
        return 2
    problems = [p for lr in rates for g in links for p in replace(cfg, update_lr=lr, link_gbps=g).problems()]
    if cfg.hosts < 2:
        problems.append(f"--update-lr measures what crosses hosts: it needs --hosts >= 2, got {cfg.hosts}")
    if args.repeats < 1 or args.warmup < 0:
        problems.append(f"--repeats={args.repeats} must be >= 1 and --warmup={args.warmup} >= 0")
    if problems:
        print("tritonreshard bench: invalid arguments:\n  - " + "\n  - ".join(dict.fromkeys(problems)), file=sys.stderr)
        return 2
    rows = []
    print(f"{'lr':>8}  {'link':>9}  {'changed':>8}  {'whole':>10}  {'delta':>10}  {'ratio':>7}  {'auto':>5}  "
          f"{'ms off':>8}  {'ms auto':>8}  {'ms always':>9}  {'s/GB det':>8}  verified")
    for lr in rates:
        for g in links:
            rows.append(measure_rate(replace(cfg, link_gbps=g), lr, args.repeats, args.warmup))
            print(_fmt(rows[-1]), flush=True)
    if args.json:
        print(json.dumps({"layout": cfg.layout, "size": cfg.size, "hosts": cfg.hosts, "rows": rows}))
    return 0 if all(r["verified"] for r in rows) else 1
