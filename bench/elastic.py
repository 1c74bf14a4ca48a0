"""Elastic groups, measured: a replica's join, a trainer restart, and what a join recomputes at scale.

A benchmark script, not a test (``python bench/elastic.py``). Every rank is a fresh ``python``
process started by this driver (``subprocess``, as a launcher would), which hosts the store, so
the figures include what a new process costs. Times are wall clock on this machine, from
``time.monotonic()`` (CLOCK_MONOTONIC: one clock for every process of the host).

``--live`` (default): two FSDP trainers and replica 0 (TP=2) refit in lockstep (replica 0 pulls a
version every 10 ms, "generating" in between), on ``--mib`` MiB of fp32 weights.

* **join**: replica 1 (TP=2) is launched mid-run; per rank: *start* (launch -> its first line of
  Python), *import* (``import torch, tritonreshard``), *init* (the constructor before the join:
  arguments, store connection), then the join's steps (:class:`~tritonreshard.engine.elastic.JoinStats`:
  *meet*, *check*, *plan*, *map*, *admit*) and *first refit* (its first pull, checked);
* **restart**: both trainers are SIGKILLed; *detect* (kill -> replica 0's pull raised
  PeerDiedError), *start* and *import* of the new trainers (launched right after the kill, as a
  launcher that waits on its children would), *meet* (the trainers' constructor), replica 0's
  *rejoin* steps, and *first refit* (kill -> replica 0 serves the first version of the new trainers).

``--imports``: ``python -c pass``, ``import torch`` and ``import torch, tritonreshard`` with the
engine (the package imports it on first use of ``trs.RefitInference``) alone, each the median of 5
fresh processes.

``--scale``: what one join recomputes at Qwen3-235B (``bench/configs/qwen3-235b-a22b.json``):
FSDP-64 trainers -> 8 x TP-8 replicas (bf16), a ninth replica joins. The planner alone, CPU seconds
in this process: the joiner's layouts (``hf_to_vllm`` for its 8 ranks), the posted group it reads
(its size in the store, encode and decode), ``plan_rank`` for its first rank, its host plan and
route; the trainers recompute nothing (an admission is a scan of their join words).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
T_MAIN = time.monotonic()  # this process's first line of Python (before its heavy imports)

TRAINERS, REPLICA0, REPLICA1 = (0, 1), (2, 3), (4, 5)


def _layouts(mib: int):
    import torch

    from tritonreshard import Layout, Replicate, Shard
    rows = max(2, mib * 2**20 // (4 * 1024))
    src = {"w": Layout((rows, 1024), TRAINERS, [Shard(0)]), "b": Layout((1024,), TRAINERS, [Shard(0)])}

    def dst(ranks):
        return {"w": Layout((rows, 1024), ranks, [Shard(1)]), "b": Layout((1024,), ranks, [Replicate()])}
    return src, dst, torch


def _full(src, name, v, torch):
    lay = src[name]
    n = 1
    for s in lay.shape:
        n *= s
    return ((torch.arange(n, dtype=torch.float32) % 4096) + 4096 * (v % 1000)).reshape(lay.shape)


def _store(port):
    from datetime import timedelta

    import torch.distributed as dist
    return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=120))


def _post(store, key, obj):
    store.set(key, json.dumps(obj))


def _get(store, key):
    from datetime import timedelta
    store.wait([key], timedelta(seconds=120))
    return json.loads(store.get(key))


def _import():
    """``import torch, tritonreshard`` and the engine (the package loads it on first use)."""
    import torch

    import tritonreshard as trs
    trs.RefitTrainer, trs.RefitInference  # noqa: B018 (the lazy package imports the engine here)
    return torch, trs


def role_trainer(rank, port, mib, epoch, start_version):
    torch, trs = _import()
    t_imported = time.monotonic()
    src, _, _ = _layouts(mib)
    store = _store(port)
    shards = {n: lay.shard(_full(src, n, start_version, torch), rank) for n, lay in src.items()}
    t_ctor = time.monotonic()
    with trs.RefitTrainer(shards, src, trs.Meeting(rank=rank, world_size=len(TRAINERS), store=store, epoch=epoch),
                          timeouts=trs.Timeouts(wait=120), membership=trs.Elastic(), start_version=start_version) as tr:
        t_met = time.monotonic()
        _post(store, f"t/{epoch}/{rank}", {"main": T_MAIN, "imported": t_imported, "ctor": t_ctor, "met": t_met})
        while not store.check([f"stop/{epoch}"]):
            tr.fence()
            v = tr.published + 1
            for n, t in tr.tensors.items():
                t.copy_(src[n].shard(_full(src, n, v, torch), rank))
            tr.publish()
            if rank == 0:
                store.set("published", str(v))
        tr.fence(timeout=5)


def role_replica(rank, port, mib, replica, ranks):
    torch, trs = _import()
    t_imported = time.monotonic()
    src, dst, _ = _layouts(mib)
    layouts = dst(ranks)
    store = _store(port)

    def check(inf):
        for n, t in inf.tensors.items():
            if not torch.equal(t, layouts[n].shard(_full(src, n, inf.version, torch), rank)):
                raise AssertionError(f"rank {rank}: {n} of version {inf.version} differs")

    t_ctor = time.monotonic()
    inf = trs.RefitInference(layouts, trs.Meeting(rank=rank, store=store), timeouts=trs.Timeouts(wait=120),
                             membership=trs.Elastic(replica=replica))
    t_joined = time.monotonic()
    inf.pull()
    t_first = time.monotonic()
    check(inf)
    s = inf.join_stats
    _post(store, f"r/{replica}/{rank}/join", {"main": T_MAIN, "imported": t_imported, "ctor": t_ctor,
                                              "joined": t_joined,
                                              "first": t_first, "stats": [s.meet_ms, s.check_ms, s.plan_ms, s.map_ms,
                                                                          s.admit_ms]})
    while not store.check(["end"]):
        time.sleep(0.01)  # generation
        try:
            inf.pull()
        except trs.PeerDiedError:
            t_detect = time.monotonic()
            inf.rejoin()
            t_rejoined = time.monotonic()
            v = inf.pull()
            t_first = time.monotonic()
            check(inf)
            s = inf.join_stats
            _post(store, f"r/{replica}/{rank}/restart", {"detect": t_detect, "rejoined": t_rejoined,
                                                         "first": t_first, "version": v,
                                                         "stats": [s.meet_ms, s.check_ms, s.plan_ms, s.map_ms,
                                                                   s.admit_ms]})
            continue
        check(inf)
    inf.close()


def _spawn(*args):
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    return subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--role", *map(str, args)], env=env)


def live(mib: int) -> None:
    from datetime import timedelta

    import torch.distributed as dist

    import tritonreshard as trs
    trs.secret_for_children()
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    port = store.port
    procs = []
    try:
        procs += [_spawn("trainer", r, port, mib, 0, 0) for r in TRAINERS]
        procs += [_spawn("replica", r, port, mib, 0, ",".join(map(str, REPLICA0))) for r in REPLICA0]
        store.wait(["published"], timedelta(seconds=120))
        time.sleep(1.0)  # steady state: every process started, replica 0 refitting
        t_launch = time.monotonic()
        procs += [_spawn("replica", r, port, mib, 1, ",".join(map(str, REPLICA1))) for r in REPLICA1]
        joins = {r: _get(store, f"r/1/{r}/join") for r in REPLICA1}
        print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
        print(f"join of replica 1 (TP=2, {mib} MiB of fp32 weights, 2 trainers, replica 0 refitting every 10 ms), ms:")
        print(f"{'rank':>4} {'start':>6} {'import':>6} {'init':>6} {'meet':>6} {'check':>6} {'plan':>6} {'map':>6} "
              f"{'admit':>6} {'1st refit':>9} | {'joined':>6} {'ctor->joined':>12} {'ctor->1st refit':>15}")
        for r, j in joins.items():
            steps = j["stats"]
            init = (j["joined"] - j["ctor"]) * 1e3 - sum(steps)
            print(f"{r:>4} {(j['main'] - t_launch) * 1e3:6.0f} {(j['imported'] - j['main']) * 1e3:6.0f} {init:6.1f} "
                  + " ".join(f"{x:6.1f}" for x in steps)
                  + f" {(j['first'] - j['joined']) * 1e3:9.1f} | {(j['joined'] - t_launch) * 1e3:6.0f} "
                  f"{(j['joined'] - j['ctor']) * 1e3:12.1f} {(j['first'] - j['ctor']) * 1e3:15.1f}")
        time.sleep(1.0)
        # Trainer restart: SIGKILL both, launch the new ones at once (epoch 1, from the last version).
        old = procs[:2]
        t_kill = time.monotonic()
        for p in old:
            os.kill(p.pid, signal.SIGKILL)
        for p in old:
            p.wait()
        last = int(store.get("published"))
        t_launch2 = time.monotonic()
        procs += [_spawn("trainer", r, port, mib, 1, last) for r in TRAINERS]
        ts = {r: _get(store, f"t/1/{r}") for r in TRAINERS}
        rs = {r: _get(store, f"r/0/{r}/restart") for r in REPLICA0}
        print(f"\ntrainer restart (both SIGKILLed at version {last}; new processes launched "
              f"{(t_launch2 - t_kill) * 1e3:.0f} ms after the kill), ms from the kill:")
        for r, t in ts.items():
            print(f"  trainer {r}: start {(t['main'] - t_launch2) * 1e3:.0f}, "
                  f"import {(t['imported'] - t['main']) * 1e3:.0f}, "
                  f"until its constructor {(t['ctor'] - t['imported']) * 1e3:.0f}, meet (constructor) "
                  f"{(t['met'] - t['ctor']) * 1e3:.0f}; met at {(t['met'] - t_kill) * 1e3:.0f}")
        for r, x in rs.items():
            meet, check, plan, mapped, admit = x["stats"]
            print(f"  replica 0 rank {r}: detect {(x['detect'] - t_kill) * 1e3:.0f}, rejoined at "
                  f"{(x['rejoined'] - t_kill) * 1e3:.0f} (its join: meet {meet:.1f}, check {check:.1f}, "
                  f"plan {plan:.1f}, map {mapped:.1f}, admit {admit:.1f}), first refit (version {x['version']}) at "
                  f"{(x['first'] - t_kill) * 1e3:.0f}")
    finally:
        store.set("end", "1")
        store.set("stop/0", "1")
        store.set("stop/1", "1")
        for p in procs:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def imports() -> None:
    def median(code):
        times = []
        for _ in range(5):
            t0 = time.monotonic()
            subprocess.run([sys.executable, "-c", code], check=True,
                           env=dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"))
            times.append(time.monotonic() - t0)
        return statistics.median(times) * 1e3
    for code in ("pass", "import torch", "import torch, tritonreshard; tritonreshard.RefitInference"):
        print(f"python -c {code!r:36}: {median(code):6.0f} ms (median of 5 fresh processes)")


def scale(config: Path) -> None:
    import resource
    from types import SimpleNamespace

    import torch
    import torch.distributed as dist

    import tritonreshard as trs
    from tritonreshard.engine import rendezvous as rdv
    from tritonreshard.engine.elastic import ElasticGroup
    from tritonreshard.engine.members import Member
    from tritonreshard.engine.sources import Exported
    from tritonreshard.planning import BufferRef, plan_rank, source_order
    from tritonreshard.transport import ArenaHandle, pack_offsets

    cfg = SimpleNamespace(**json.loads(config.read_text()))
    trainers, tp, before = 64, 8, 8
    clock = time.process_time
    t0 = clock()
    joiner = list(range(trainers + before * tp, trainers + (before + 1) * tp))
    spec = trs.recipes.hf_to_vllm(cfg, tp=tp, trainer_ranks=list(range(trainers)), inference_ranks=joiner,
                                  dtype=torch.bfloat16, src_dtype=torch.bfloat16)
    t1 = clock()
    # What the trainers made at their meeting (every trainer once, not on a join): arena offsets.
    exported = []
    for r in range(trainers):
        order = source_order(spec.src, r)
        offs, total = pack_offsets([spec.src[n].local_numel(r) * spec.src[n].itemsize for n in order])
        handle = ArenaHandle("shm-fd", "0" * 32, total, total, "cpu", 1000 + r, "h")
        exported.append(Exported(BufferRef("arena", r), handle, handle, dict(zip(order, offs, strict=True))))
    members = tuple(Member(r, 1000 + r, "h", "cpu") for r in range(trainers))
    group = ElasticGroup(0, dict(spec.src), members, tuple(exported))
    store = dist.HashStore()
    t2 = clock()
    rdv.publish(store, "elastic/group", group)
    t3 = clock()
    nbytes = len(store.get("elastic/group"))
    t4 = clock()
    got = rdv.fetch(store, "elastic/group", timeout=10)
    t5 = clock()
    hosts = {r: "h" for r in [*range(trainers), *joiner]}
    rp = plan_rank(got.src_layouts, spec.dst, hosts, joiner[0], parts=spec.parts, quant=spec.quant or None)
    t6 = clock()
    offsets = {(e.buffer.owner, n): o for e in got.exported for n, o in e.offsets.items()}
    route = rp.local_route(offsets)
    t7 = clock()
    full_route = rp.route(offsets, rp.host_part(offsets))
    t8 = clock()
    assert set(full_route.reads) == set(route.reads)
    print(f"Qwen3-235B-A22B, FSDP-64 -> 8 x TP-8, a ninth replica (ranks {joiner[0]}-{joiner[-1]}) joins; "
          f"CPU s of this process ({len(spec.src)} trainer tensors, {len(spec.dst)} vLLM tensors):")
    print(f"  joiner: its layouts (hf_to_vllm, 8 ranks)   {t1 - t0:7.2f} s")
    print(f"  trainers (at their meeting, not per join): posting the group {t3 - t2:.2f} s "
          f"({nbytes / 2**20:.1f} MiB in the store)")
    print(f"  joiner: reading the posted group (decode)     {t5 - t4:7.2f} s")
    print(f"  joiner: plan_rank for rank {joiner[0]}                 {t6 - t5:7.2f} s ({len(rp.plan.ops)} ops)")
    print(f"  joiner: its route (RankPlan.local_route)       {t7 - t6:7.2f} s ({len(route.reads)} reads from "
          f"{len(route.buffers)} arenas; through a host plan, the same reads: {t8 - t7:.2f} s)")
    print(f"  joiner total {t7 - t4 + t1 - t0:.2f} s; "
          f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MB")
    print("  trainers: nothing planned or mapped; each admits the joiner's ranks it serves (a scan of its join words)")
    print("  other replicas: nothing")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--live", action="store_true")
    ap.add_argument("--imports", action="store_true")
    ap.add_argument("--scale", action="store_true")
    ap.add_argument("--mib", type=int, default=16)
    ap.add_argument("--config", type=Path, default=HERE / "configs" / "qwen3-235b-a22b.json")
    ap.add_argument("--role", nargs="+", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.role:
        kind, rank, port, mib, a, b = args.role
        if kind == "trainer":
            role_trainer(int(rank), int(port), int(mib), int(a), int(b))
        else:
            role_replica(int(rank), int(port), int(mib), int(a), tuple(int(x) for x in b.split(",")))
        return
    if args.imports:
        imports()
    if args.scale:
        scale(args.config)
    if args.live or not (args.imports or args.scale):
        live(args.mib)


if __name__ == "__main__":
    main()
