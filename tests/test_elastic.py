"""Elastic groups: inference replicas join a running group, leave it and die, and nobody stops.

Two FSDP trainers (ranks 0, 1) and replica 0 (TP=2, ranks 2, 3) refit in lockstep (the trainers
fence on every admitted reader); replica 0 pulls every version, checked bit for bit. Mid-run:

* replica 1 (ranks 4, 5) joins; before that, rank 4 is refused twice with one ValueError each
  (a dtype that differs from the group's replicas; replica index 0, already in use) while the group
  goes on; it serves versions from the one it was admitted at, then closes (leaves);
* replica 2 (ranks 6, 7) joins, pulls a version and is SIGKILLed: the trainers drop both ranks
  (seen through their pidfds, well within ``peer_timeout``) and their fences stop waiting for them.

The trainers keep their processes, arenas and version counter throughout; every process ends with
nothing of ours mapped or open, and nothing in /dev/shm.
"""
import os
import queue
import signal
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import tritonreshard as trs
from tritonreshard import Layout, Replicate, Shard

from _faults import die, our_fds, our_maps
from _mp import _entry
from _provenance import provenance

pytestmark = pytest.mark.timeout(120)

TRAINERS = (0, 1)
REPLICAS = {0: (2, 3), 1: (4, 5), 2: (6, 7)}
SRC = {"w": Layout((12, 8), TRAINERS, [Shard(0)]), "b": Layout((10,), TRAINERS, [Shard(0)])}
VERSIONS = 1 << 14
PEER_TIMEOUT = 30.0


def dst(replica, dtype=torch.float32):
    """Replica ``replica``'s layouts: TP=2, ``w`` split by columns, ``b`` replicated."""
    ranks = REPLICAS[replica]
    return {"w": Layout((12, 8), ranks, [Shard(1)], dtype=dtype), "b": Layout((10,), ranks, [Replicate()])}


def full(name, v):
    return provenance(SRC[name].shape, v, tag=int(name == "b"), versions=VERSIONS, tags=2).float()


def _key(store, key, timeout=90.0):
    store.wait([key], timedelta(seconds=timeout))
    return store.get(key).decode()


def _trainer(rank, port):
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
    shards = {n: lay.shard(full(n, 0), rank) for n, lay in SRC.items()}
    with trs.RefitTrainer(shards, SRC, rank=rank, world_size=len(TRAINERS), store=store, elastic=True,
                          peer_timeout=PEER_TIMEOUT, timeout=90) as tr:
        arena = {n: t.data_ptr() for n, t in tr.tensors.items()}
        _key(store, "go/train")
        end, v, gone = None, 0, {}
        while end is None or v < end:
            tr.fence()
            v += 1
            for n, t in tr.tensors.items():
                t.copy_(SRC[n].shard(full(n, v), rank))
            assert tr.publish() == v
            if rank == 0:
                store.set("published", str(v))
            for r, why in tr.dropped:
                gone.setdefault(r, (time.monotonic(), why))
            if end is None and store.check(["end"]):
                end = int(store.get("end"))
        tr.fence()
        same_arena = arena == {n: t.data_ptr() for n, t in tr.tensors.items()}
        return {"published": tr.published, "readers": tr.readers, "gone": gone, "same_arena": same_arena,
                "epoch": tr.epoch, "pid": os.getpid()}


def _check(inf, rank, replica, v):
    for n, t in inf.tensors.items():
        want = dst(replica)[n].shard(full(n, v), rank)
        assert torch.equal(t, want), (rank, n, v)


def _pull_until(inf, rank, replica, stop):
    """Pull version after version (each one checked) until ``stop(version)``; the versions pulled."""
    pulled = []
    while not stop(inf.version):
        pulled.append(inf.pull())
        _check(inf, rank, replica, inf.version)
    return pulled


def _replica0(rank, port):
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
    with trs.RefitInference(dst(0), rank=rank, store=store, elastic=True, replica=0, timeout=90) as inf:
        store.set(f"joined/{rank}", "1")
        if rank == REPLICAS[0][0]:
            store.wait([f"joined/{r}" for r in REPLICAS[0]], timedelta(seconds=60))
            store.set("go/train", "1")
        first = inf.join_stats.first_version

        def stop(v):
            time.sleep(0.005)  # generation between refits
            return store.check(["end"]) and v >= int(store.get("end"))
        pulled = _pull_until(inf, rank, 0, stop)
    return {"first": first, "pulled": pulled, "fds": our_fds(), "maps": our_maps()}


def _replica1(rank, port):
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
    _key(store, "go/r1")
    refused = []
    if rank == REPLICAS[1][0]:  # bad input first: refused, and the group goes on
        for kw in (dict(layouts=dst(1, torch.bfloat16), replica=1), dict(layouts=dst(1), replica=0)):
            with pytest.raises(ValueError) as err:
                trs.RefitInference(kw["layouts"], rank=rank, store=store, elastic=True, replica=kw["replica"],
                                   timeout=30)
            refused.append(str(err.value))
    t0 = time.monotonic()
    before = int(store.get("published"))
    inf = trs.RefitInference(dst(1), rank=rank, store=store, elastic=True, replica=1, timeout=90)
    t_joined = time.monotonic()
    first = inf.join_stats.first_version
    pulled = [inf.pull()]
    _check(inf, rank, 1, inf.version)
    t_first = time.monotonic()
    pulled += _pull_until(inf, rank, 1, lambda v: v >= first + 3)
    stats = inf.join_stats
    inf.close()
    store.set(f"r1/left/{rank}", "1")
    return {"refused": refused, "before": before, "first": first, "pulled": pulled, "fds": our_fds(),
            "maps": our_maps(), "joined_s": t_joined - t0, "first_s": t_first - t0, "stats": stats}


def _replica2(rank, port):
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
    _key(store, "go/r2")
    inf = trs.RefitInference(dst(2), rank=rank, store=store, elastic=True, replica=2, timeout=90)
    inf.pull()
    _check(inf, rank, 2, inf.version)
    store.set(f"r2/dying/{rank}", repr(time.monotonic()))
    die()


ROLES = {**{r: _trainer for r in TRAINERS}, **{r: _replica0 for r in REPLICAS[0]},
         **{r: _replica1 for r in REPLICAS[1]}, **{r: _replica2 for r in REPLICAS[2]}}


def test_replicas_join_leave_and_die_while_the_group_goes_on():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    trs.secret_for_children()
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    shm_before = {f for f in os.listdir("/dev/shm") if f.startswith("trs-")}
    procs = {r: ctx.Process(target=_entry, args=(fn, r, (store.port,), results), daemon=True)
             for r, fn in ROLES.items()}
    for p in procs.values():
        p.start()
    out = {}
    try:
        wait = timedelta(seconds=90)
        store.wait(["published"], wait)
        while int(store.get("published")) < 3:
            time.sleep(0.01)
        store.set("go/r1", "1")
        store.wait([f"r1/left/{r}" for r in REPLICAS[1]], wait)
        store.set("go/r2", "1")
        for r in REPLICAS[2]:
            procs[r].join(60)
            assert procs[r].exitcode == -signal.SIGKILL, procs[r].exitcode
        store.set("end", str(int(store.get("published")) + 3))
        deadline = time.monotonic() + 60
        survivors = set(ROLES) - set(REPLICAS[2])
        while set(out) < survivors:
            try:
                rank, status, value = results.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(f"ranks {sorted(survivors - set(out))} did not finish") from None
            assert status == "ok", f"rank {rank} raised {value[0]}: {value[1]}\n{value[2]}"
            out[rank] = value
    finally:
        for p in procs.values():
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join(5)
    end = int(store.get("end"))
    for r in TRAINERS:  # same processes, arenas and counter; nobody left but replica 0
        t = out[r]
        assert t["published"] == end and t["same_arena"] and t["epoch"] == 0, t
        assert sorted(t["readers"]) == list(REPLICAS[0]), t
        assert {q: why.split()[-1] for q, (_, why) in t["gone"].items()} == {4: "left", 5: "left", 6: "died", 7: "died"}, t
        for q in REPLICAS[2]:  # seen through the pidfd, long before peer_timeout
            assert t["gone"][q][0] - float(store.get(f"r2/dying/{q}")) < PEER_TIMEOUT, t["gone"]
    for r in REPLICAS[0]:  # every version, in order, exact (checked in the rank)
        rep = out[r]
        assert rep["pulled"] == list(range(rep["first"], end + 1)) and rep["first"] == 1, rep["pulled"][:5]
        assert rep["fds"] == [] and rep["maps"] == [], rep
    for r in REPLICAS[1]:
        rep = out[r]
        assert rep["first"] >= rep["before"] and rep["pulled"] == list(range(rep["first"], rep["first"] + 4)), rep
        assert rep["fds"] == [] and rep["maps"] == [], rep
        print(f"rank {r}: joined in {rep['joined_s'] * 1e3:.0f} ms, first refit {rep['first_s'] * 1e3:.0f} ms "
              f"after its constructor started ({rep['stats']})")
    dtype_err, in_use_err = out[REPLICAS[1][0]]["refused"]
    assert "dst_layouts['w']" in dtype_err and "torch.bfloat16" in dtype_err and "torch.float32" in dtype_err, dtype_err
    assert "1 problem(s)" in dtype_err, dtype_err  # 'w' only: 'b' is the same
    assert "replica 0 (its rank #0) is already in use by rank 2 of replica 0" in in_use_err, in_use_err
    assert {f for f in os.listdir("/dev/shm") if f.startswith("trs-")} <= shm_before
