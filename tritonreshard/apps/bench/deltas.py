"""``tritonreshard bench --hosts N --update-lr LR[,LR...] [--link-gbps G[,G...]] [--net namespaces]``:
what crosses hosts when a refit sends only what changed (cross-host deltas), against every byte, on
the same updates.

For each learning rate (or ``random``: fresh weights every version) and link rate (``--link-gbps``;
default the link as it is) three sessions run side by side on the same versions, their timed refits
in rounds (one of each in turn, so the machine's other load hits them alike), with ``delta="off"`` (every byte),
``"auto"`` (the delta where finding what changed costs less than sending whole: the trainers'
measured link and detection speeds decide) and ``"always"`` (a delta every refit); each refit is an
Adam-sized bf16 update (:mod:`.updates`). Reported per row, as medians over the timed refits (the
first two refits of a session, which cross whole, and the warm-up refits are not timed: in them
``auto`` measures its link, warms its encoder up and measures detection): the fraction of elements
that changed, the cross-host bytes per refit and the refit time of each session, what ``auto``
sent (whole, delta, or mixed: between the two), and the trainers' detection cost in the ``always``
session (comparing with the snapshot of what they last sent and encoding, seconds per GB sent).

The hosts (``--net``): ``labels`` (default) runs every rank on this machine with a
``$TRITONRESHARD_HOST`` each, over loopback, and a slower link is a sleep before each cross-host
send (``$TRITONRESHARD_SIMULATED_LINK_GBPS``); ``namespaces`` runs each host's ranks in a network
namespace of the host harness (:mod:`tritonreshard.apps.hosts`, root only), over real TCP through a
switch, and a slower link is a token bucket on every host's link. There each row also reports, per
host link, the bytes that crossed it per refit: the engine's payload (what the ranks of the host
received, or, for the trainers' host, sent) and the wire (the kernel's counters of the host's
interface during the refit: headers, the store's and gloo's messages included, the idle sessions'
store polls too); ``--png`` draws them.
"""
from __future__ import annotations

import contextlib
import json
import statistics
import sys
from dataclasses import replace

from ...planning import fmt_bytes
from ..driver import sigterm_exits
from ..viz import link_name
from .config import BenchConfig, environment_problems, parse_gbps, parse_size
from .session import BenchSession, link_counters, open_hosts

__all__ = ["parse_rates", "measure_rate", "run_cli", "DELTAS"]

#: The three sessions of a row, in order.
DELTAS = ("off", "auto", "always")


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


def _figures(cfg: BenchConfig, seconds: list[float], each: list, wire: list | None, verified: bool) -> dict:
    """One session's row figures from its timed refits: ``seconds`` and ``each`` (every rank's
    statistics) per refit, ``wire`` (the host harness: what each host's interface carried) per refit."""
    cross = [sum(x["cross_host_bytes"] for x in st) for st in each]
    changed = [statistics.fmean(c) for st in each if (c := [x["changed"] for x in st if x["changed"] is not None])]
    trainers = set(cfg.trainer_ranks)
    per_gb = [max(x["encode_s"] / x["egress_bytes"] * 1e9 for x in st if x["rank"] in trainers and x["egress_bytes"])
              for st in each]
    return {"refit_ms": statistics.median(seconds) * 1e3, "cross_host_bytes": int(statistics.median(cross)),
            "changed": statistics.median(changed) if changed else None,
            "detect_s_per_gb": statistics.median(per_gb),
            "delta_bytes": int(statistics.median(sum(x["delta_bytes"] for x in st) for st in each)),
            "dense_bytes": int(statistics.median(sum(x["dense_bytes"] for x in st) for st in each)),
            "links": _links(cfg, each, wire), "verified": verified}


def _links(cfg: BenchConfig, each, wire) -> dict:
    """Per host, what crossed its link per refit (medians over the timed refits): ``payload``, the
    engine's counters (a host's ranks' ``cross_host_bytes``, what they received; the trainers, all
    on host 0, send what every other host received); and with the host harness ``wire``, the
    kernel's counters of the host's interface (received + sent during the refit)."""
    names = [f"host{i}" for i in range(cfg.hosts)]
    per_refit = []
    for st in each:
        into = dict.fromkeys(names, 0)
        for x in st:
            into[f"host{cfg.host_index(x['rank'])}"] += x["cross_host_bytes"]
        into["host0"] += sum(into[n] for n in names[1:])   # host 0's link carries it all out
        per_refit.append(into)
    out = {n: {"payload": int(statistics.median(p[n] for p in per_refit))} for n in names}
    if wire is not None:
        for n in names:
            out[n]["wire"] = int(statistics.median(w[n] for w in wire))
    return out


def _moved(before: dict, after: dict) -> dict[str, int]:
    """Bytes each host's interface carried between two :func:`.session.link_counters` readings."""
    return {n: (after[n]["rx"] - before[n]["rx"]) + (after[n]["tx"] - before[n]["tx"]) for n in before}


def measure_rate(cfg: BenchConfig, lr: float | str, repeats: int, warmup: int, hosts=None) -> dict:
    """The three sessions (``delta="off"``, ``"auto"``, ``"always"``) at learning rate ``lr`` (or
    ``"random"``), on ``cfg``'s link (``cfg.link_gbps``); ``hosts``: the host harness
    (``cfg.net="namespaces"``, :func:`.session.open_hosts`), whose links the sessions set.

    The sessions run side by side, and their timed refits in rounds (one of each in turn), as
    :func:`.report.measure` interleaves its methods: the load of anything else on the machine then
    hits the three alike (run one after the other, minutes apart on a shared machine, the same whole
    transfer took 95 ms in one session and 119 ms in the next). They hold three sessions' memory at once."""
    base = replace(cfg, update_lr=lr, methods=("tritonreshard",))
    seconds, each = {d: [] for d in DELTAS}, {d: [] for d in DELTAS}
    wire = {d: [] for d in DELTAS} if hosts is not None else None
    with contextlib.ExitStack() as stack:
        sessions = {d: stack.enter_context(BenchSession(replace(base, delta=d), hosts=hosts)) for d in DELTAS}
        for s in sessions.values():
            # Untimed: the first refit (whole: no base; it connects each pair), the second (whole:
            # auto measures its link) and the warm-up (auto warms its encoder up, measures detection).
            s.refits("tritonreshard", 2 + warmup)
        for _ in range(repeats):
            for d, s in sessions.items():
                before = link_counters(hosts) if hosts is not None else None
                r = s.refits("tritonreshard", 1, each_stats=True)
                if hosts is not None:
                    wire[d].append(_moved(before, link_counters(hosts)))
                seconds[d] += r["seconds"]
                each[d] += r["each_stats"]
        verified = {d: s.verify("tritonreshard") for d, s in sessions.items()}
    off, auto, always = (_figures(base, seconds[d], each[d], wire[d] if wire is not None else None, verified[d])
                         for d in DELTAS)
    return {"lr": lr, "link_gbps": cfg.link_gbps, "net": cfg.net, "changed": always["changed"],
            "dense_bytes": off["cross_host_bytes"], "auto_bytes": auto["cross_host_bytes"],
            "delta_bytes": always["cross_host_bytes"],
            "ratio": always["cross_host_bytes"] / off["cross_host_bytes"] if off["cross_host_bytes"] else None,
            # what auto's trainers chose, from the bytes: every byte (whole), no more than a delta every
            # refit (delta: it sends whole only the messages where that is smaller), or between the two
            # (mixed: each trainer weighs its own link, and they differed, or the refits did)
            "auto_picked": "whole" if auto["cross_host_bytes"] >= off["cross_host_bytes"] else
                           "delta" if auto["cross_host_bytes"] <= always["cross_host_bytes"] else "mixed",
            "refit_ms_off": off["refit_ms"], "refit_ms_auto": auto["refit_ms"], "refit_ms_delta": always["refit_ms"],
            "detect_s_per_gb": always["detect_s_per_gb"],
            "links": {d: f["links"] for d, f in zip(DELTAS, (off, auto, always), strict=True)},
            "verified": off["verified"] and auto["verified"] and always["verified"]}


def _fmt(row: dict) -> str:
    changed = "-" if row["changed"] is None else f"{100 * row['changed']:.2f}%"
    auto = (row["auto_picked"] if row["auto_picked"] == "whole"
            else f"{row['auto_picked']} {fmt_bytes(row['auto_bytes'])}")
    return (f"{str(row['lr']):>8}  {link_name(row):>9}  {changed:>8}"
            f"  {fmt_bytes(row['dense_bytes']):>10}  {fmt_bytes(row['delta_bytes']):>10}  {100 * row['ratio']:6.2f}%"
            f"  {auto:>16}  {row['refit_ms_off']:8.1f}  {row['refit_ms_auto']:8.1f}  {row['refit_ms_delta']:9.1f}"
            f"  {row['detect_s_per_gb']:8.2f}  {'yes' if row['verified'] else 'NO'}")


def run_cli(args) -> int:
    """``tritonreshard bench --update-lr``: one row per rate; exit code 0 when every refit verified."""
    net = getattr(args, "net", "labels")
    png = getattr(args, "png", None)
    try:
        rates = parse_rates(args.update_lr)
        links = parse_gbps(getattr(args, "link_gbps", None))
        cfg = BenchConfig(size=parse_size(args.size), layout=args.layout, trainers=args.trainers,
                          inference=args.inference, backend=args.backend or "auto", device=args.device,
                          mode=args.mode, timeout=args.timeout, hosts=args.hosts, methods=("tritonreshard",),
                          net=net)
    except ValueError as exc:
        print(f"tritonreshard bench: {exc}", file=sys.stderr)
        return 2
    problems = [p for lr in rates for g in links for p in replace(cfg, update_lr=lr, link_gbps=g).problems()]
    if cfg.hosts < 2:
        problems.append(f"--update-lr measures what crosses hosts: it needs --hosts >= 2, got {cfg.hosts}")
    if args.repeats < 1 or args.warmup < 0:
        problems.append(f"--repeats={args.repeats} must be >= 1 and --warmup={args.warmup} >= 0")
    problems += environment_problems(cfg, png)
    if problems:
        print("tritonreshard bench: invalid arguments:\n  - " + "\n  - ".join(dict.fromkeys(problems)), file=sys.stderr)
        return 2
    sigterm_exits()  # a SIGTERM from now on unwinds: the sessions stop their ranks, the harness goes
    rows = []
    with (open_hosts(cfg) if net == "namespaces" else contextlib.nullcontext()) as hosts:
        print(f"{'lr':>8}  {'link':>9}  {'changed':>8}  {'whole':>10}  {'delta':>10}  {'ratio':>7}  {'auto sent':>16}  "
              f"{'ms off':>8}  {'ms auto':>8}  {'ms always':>9}  {'s/GB det':>8}  verified", flush=True)
        for lr in rates:
            for g in links:
                rows.append(measure_rate(replace(cfg, link_gbps=g), lr, args.repeats, args.warmup, hosts))
                print(_fmt(rows[-1]), flush=True)
    placement = {f"host{i}": {"trainers": [r for r in cfg.trainer_ranks if cfg.host_index(r) == i],
                              "inference": [r for r in cfg.inference_ranks if cfg.host_index(r) == i]}
                 for i in range(cfg.hosts)}
    out = {"layout": cfg.layout, "size": cfg.size, "hosts": cfg.hosts, "net": net, "placement": placement,
           "rows": rows}
    if png:
        from ..viz import draw_links  # lazy: matplotlib only for a picture
        draw_links(out, png)
        print(f"picture of the hosts, links and bytes: {png}", file=sys.stderr)
    if args.json:
        print(json.dumps(out))
    return 0 if all(r["verified"] for r in rows) else 1

