"""Planning at frontier scale: how long one rank takes to plan its part of a refit, and its peak memory.

A benchmark script, not a test (``python bench/plan_scale.py``): each measurement runs in a fresh
process, so every cache is cold, and prints one row. The model is a config's sizes (default: the
published Qwen3-235B-A22B, ``bench/configs/qwen3-235b-a22b.json``), FSDP trainers (``Shard(0)``,
bf16 here) -> ``replicas`` x TP inference ranks (bf16), through ``hf_to_vllm``.

Per row:

Times are the process's CPU seconds (``time.process_time``): this machine's 2 cores are shared, and
wall time under load measures the neighbours more than the planner.

* ``recipe s``: building the layouts (``hf_to_vllm``), every rank does it once;
* ``plan s``: ``spec.plan(rank=r)`` (``--what dst|src``: the first inference rank, the first trainer; with
  ``--hosts-of``: its host's part, ``plan_host_part``, and its queries of it),
  or the whole plan (``--what whole``: what every rank computed before per-rank planning);
* ``ops``: the plan's ops (on several hosts: the ops the rank runs); ``RSS MB``: the process's peak resident set
  (``ru_maxrss``) after planning, torch and the library imported included, and ``+MB`` the growth over the peak before
  the recipe was built.

``--all`` runs the figures reported in the README (one subprocess each).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

HERE = Path(__file__).resolve().parent
DEFAULT_CONFIG = HERE / "configs" / "qwen3-235b-a22b.json"


def measure(config: Path, trainers: int, tp: int, replicas: int, what: str, hosts_of: int = 0,
            merged: bool = False) -> dict:
    """One measurement in this process (call it in a fresh one: caches must be cold).

    ``hosts_of``: 0 for one host; else ranks ``[k * hosts_of, (k + 1) * hosts_of)`` share host k,
    and the rank plans as the engine's set-up does: ``plan_rank`` (its own ops), then its host's part
    of the host plan from the layouts (``RankPlan.host_part``, through ``plan_host_part``; every
    rank of a host makes the same part, relay or not), then asks it for its own ops, sends, receives
    and readers (``ops``: the ops it runs). ``merged``: the part the way before ``plan_host_part``,
    from the merged per-rank plans of the host's destination ranks (``plan_hosts(..., host=)``).
    With ``--what whole``: the whole plan and the whole host plan, what every rank made before."""
    import torch

    import tritonreshard as trs

    cfg = SimpleNamespace(**json.loads(config.read_text()))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.process_time()
    # Trainers are ranks 0..trainers-1, the inference ranks follow (disjoint meshes).
    spec = trs.recipes.hf_to_vllm(cfg, tp=tp, trainer_ranks=list(range(trainers)),
                                  inference_ranks=list(range(trainers, trainers + replicas * tp)),
                                  dtype=torch.bfloat16, src_dtype=torch.bfloat16)
    t1 = time.process_time()
    # "dst": the first inference rank (on several hosts, a relay of its host); "dst71": the last rank of
    # the first inference host of 8 (plain destination there); "src": the first trainer
    rank = {"dst": trainers, "dst71": trainers + 7, "src": 0, "whole": None}[what]
    t2 = time.process_time()
    extra = {}
    if hosts_of:
        ranks = range(trainers + replicas * tp)
        host = {r: f"host{r // hosts_of}" for r in ranks}
        if rank is None:
            plan = spec.plan()
            hp = trs.planning.plan_hosts(plan, host)
            n_ops = len(plan.ops)
        elif merged:   # the rank's plan merged with its host's destination ranks' plans, then its host's part
            mine = [d for d in range(trainers, trainers + replicas * tp) if host[d] == host[rank]]
            plan = trs.planning.merge_plans([spec.plan(rank=d) for d in sorted({rank, *mine})])
            hp = trs.planning.plan_hosts(plan, host, host=host[rank])
        else:          # what the engine's set-up plans (engine.epoch): the rank plan, then its host's part
            rp = trs.planning.plan_rank(spec.src, spec.dst, host, rank, parts=spec.parts, quant=spec.quant)
            hp = rp.host_part(None)
        if rank is not None:
            mine_ops = hp.local_ops_for_dst(rank) + hp.fanout_for_dst(rank)
            hp.sends_of(rank), hp.buffer_readers(rank), hp.local_readers_of(rank)
            n_ops = len(mine_ops)
        extra = {"hosts": len(set(host.values())), "transfers": len(hp.transfers),
                 "receives": len(hp.recvs_of(rank)) if rank is not None else 0}
    else:
        plan = spec.plan() if rank is None else spec.plan(rank=rank)   # plan(): also the code before rank=
        n_ops = len(plan.ops)
    t3 = time.process_time()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"model": cfg.model_type, "trainers": trainers, "tp": tp, "replicas": replicas, "what": what,
            "rank": rank, "recipe_s": round(t1 - t0, 3), "plan_s": round(t3 - t2, 3), "ops": n_ops,
            "rss_mb": round(peak / 1024), "rss_growth_mb": round((peak - before) / 1024), "hosts_of": hosts_of,
            **extra}


def run_fresh(config: Path, trainers: int, tp: int, replicas: int, what: str, hosts_of: int = 0,
              merged: bool = False) -> dict:
    """:func:`measure` in a new interpreter (cold caches, its own peak RSS)."""
    cmd = [sys.executable, __file__, "--config", str(config), "--trainers", str(trainers), "--tp", str(tp),
           "--replicas", str(replicas), "--what", what, "--hosts-of", str(hosts_of), "--json"]
    cmd += ["--merged"] if merged else []
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=os.environ.copy())
    return json.loads(out.stdout.strip().splitlines()[-1])


def _row(m: dict) -> str:
    who = {"dst": f"inference rank {m['rank']}", "dst71": f"inference rank {m['rank']}",
           "src": f"trainer rank {m['rank']}", "whole": "whole plan"}[m["what"]]
    where = ""
    if m.get("hosts_of"):
        into = "in all" if m["rank"] is None else "into its host"
        where = (f" on {m['hosts']} hosts of {m['hosts_of']}: "
                 f"{m['transfers']:,} transfer(s) {into}, {m['receives']:,} received by it")
    return (f"{m['model']:<10} FSDP-{m['trainers']:<3} -> {m['replicas']:>2} x TP-{m['tp']:<2} {who:<20} "
            f"recipe {m['recipe_s']:6.3f} s  plan {m['plan_s']:6.3f} s CPU  {m['ops']:>9,} ops  "
            f"peak RSS {m['rss_mb']:>5} MB (+{m['rss_growth_mb']} MB){where}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", type=Path, default=DEFAULT_CONFIG)
    ap.add_argument("--trainers", type=int, default=64)
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--replicas", type=int, default=8)
    ap.add_argument("--what", choices=["dst", "dst71", "src", "whole"], default="dst")
    ap.add_argument("--hosts-of", type=int, default=0,
                    help="ranks per host (0: one host); the rank also makes its host's part of the host plan")
    ap.add_argument("--merged", action="store_true",
                    help="with --hosts-of: the host part from the merged per-rank plans "
                         "(the way before plan_host_part)")
    ap.add_argument("--json", action="store_true", help="measure here and print one JSON line")
    ap.add_argument("--all", action="store_true", help="the README's figures, each in a fresh process")
    ap.add_argument("--repeat", type=int, default=3,
                    help="fresh processes per row; the fastest is shown (the machine is shared)")
    args = ap.parse_args(argv)
    if args.json:
        print(json.dumps(measure(args.config, args.trainers, args.tp, args.replicas, args.what, args.hosts_of,
                                 args.merged)))
        return
    runs = ([(64, 8, 8, "dst", 0), (64, 8, 8, "src", 0), (64, 8, 16, "dst", 0), (64, 8, 16, "src", 0),
             (64, 8, 1, "whole", 0), (8, 8, 1, "whole", 0),
             # 8 trainer hosts -> 8 inference hosts of 8: rank 64 receives (a relay), rank 71 only reads
             (64, 8, 8, "dst", 8), (64, 8, 8, "dst71", 8), (64, 8, 8, "src", 8)] if args.all
            else [(args.trainers, args.tp, args.replicas, args.what, args.hosts_of)])
    print(f"Planning cost on this machine (cold caches: a fresh process per run, fastest of {args.repeat}):")
    for trainers, tp, replicas, what, hosts_of in runs:
        best = min((run_fresh(args.config, trainers, tp, replicas, what, hosts_of, args.merged)
                    for _ in range(args.repeat)),
                   key=lambda m: m["plan_s"])
        print(_row(best), flush=True)


if __name__ == "__main__":
    main()
