"""Inference survives a trainer restart: the SAME inference processes keep serving the last complete
version while every trainer is SIGKILLed, then rejoin the restarted trainers' next epoch on the same
store and pull the following versions bit for bit.

The driver (this test) hosts the store, so it outlives the trainers; every rank connects as a client
(``host_store=False``). New trainer processes start at ``epoch=1`` from a "checkpoint" of version 3.
"""
import gc
import os
import signal
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _faults import our_fds, our_maps
from _mp import collect_ok, reap, start_rank

import tritonreshard as trs
from tritonreshard import Layout, Shard

pytestmark = pytest.mark.timeout(300)

TRAINERS, INFERENCE = (0, 1), (2, 3)
WORLD = 4
SRC = {"w": Layout((9, 6), TRAINERS, [Shard(0)]),
       "b": Layout((7,), TRAINERS, [Shard(0)], dtype=torch.bfloat16)}
DST = {"w": Layout((9, 6), INFERENCE, [Shard(1)]),
       "b": Layout((7,), INFERENCE, [Shard(0)], dtype=torch.bfloat16)}
LAST_OF_EPOCH0, LAST = 3, 6


def full(name, v):
    """Provenance-encoded global tensor of ``name`` at version ``v``."""
    lay = SRC[name]
    n = 1
    for s in lay.shape:
        n *= s
    return (torch.arange(n, dtype=torch.float64) + 1000 * v + 100000 * (name == "b")).reshape(lay.shape).to(lay.dtype)


def _trainer(rank, port, epoch, start_version, last):
    torch.set_num_threads(1)
    shards = {n: lay.shard(full(n, start_version), rank) for n, lay in SRC.items()}  # the checkpoint
    meeting = trs.Meeting(rank=rank, world_size=WORLD, store=f"127.0.0.1:{port}", host_store=False, epoch=epoch)
    with trs.RefitTrainer(shards, SRC, meeting, start_version=start_version, timeouts=trs.Timeouts(wait=120)) as tr:
        for v in range(start_version + 1, last + 1):
            tr.fence()
            for n, t in tr.source_tensors.items():
                t.copy_(SRC[n].shard(full(n, v), rank))
            assert tr.publish() == v
        tr.fence()
        tr.store.set(f"trained/{rank}", b"1")
        if epoch == 0:
            time.sleep(600)  # the driver SIGKILLs this process now
    return {"epoch": epoch}


def _check(ep, rank, v):
    for n, t in ep.tensors.items():
        want = DST[n].shard(full(n, v), rank)
        assert torch.equal(t.view(torch.uint8), want.contiguous().view(torch.uint8)), (rank, n, v)


def _inference(rank, port):
    torch.set_num_threads(1)
    pid = os.getpid()
    ep = trs.RefitInference(DST, trs.Meeting(rank=rank, world_size=WORLD, store=f"127.0.0.1:{port}", host_store=False),
                            timeouts=trs.Timeouts(wait=120))
    for v in range(1, LAST_OF_EPOCH0 + 1):
        assert ep.pull() == v
        _check(ep, rank, v)
    # The next pull is in flight (waiting for version 4) when every trainer is SIGKILLed.
    assert ep.start_pull() == LAST_OF_EPOCH0 + 1
    while not ep.pull_done():
        _check(ep, rank, LAST_OF_EPOCH0)  # "generation" goes on with the serving weights
        time.sleep(0.01)
    error = ep.pull_error()
    error_text, error_rank = f"{type(error).__name__}: {error}", getattr(error, "rank", None)
    del error  # its traceback holds the failed pull's frames (and their views of the dead arenas)
    with pytest.raises(trs.PeerDiedError):
        ep.swap()
    assert ep.version == LAST_OF_EPOCH0 and not ep.alive()
    _check(ep, rank, LAST_OF_EPOCH0)  # still serving the last complete version, exactly
    assert ep.rejoin() == 1
    assert ep.alive() and ep.epoch == 1
    pulled = []
    for v in range(LAST_OF_EPOCH0 + 1, LAST + 1):
        pulled.append(ep.pull())
        _check(ep, rank, v)
    stats, staging = ep.last_pull, ep.stats.staging_bytes
    ep.close()
    del ep
    gc.collect()
    return {"our_fds": our_fds(), "our_maps": our_maps(), "pid_start": pid, "pid_end": os.getpid(), "error": error_text,
            "error_rank": error_rank, "pulled": pulled, "copy_ms": stats.copy_ms,
            "staging": staging}


def test_inference_survives_a_trainer_restart():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    trs.secret_for_children()
    ctx = mp.get_context("spawn")
    results = ctx.Queue()

    def start(fn, rank, *args):
        return start_rank(ctx, fn, rank, (store.port, *args), results)

    procs = {r: start(_inference, r) for r in INFERENCE}
    old = {r: start(_trainer, r, 0, 0, LAST_OF_EPOCH0) for r in TRAINERS}
    new = {}
    try:
        e0 = dist.PrefixStore("trs/default/e0/", store)
        e0.wait([f"trained/{r}" for r in TRAINERS], timedelta(seconds=200))
        for p in old.values():
            os.kill(p.pid, signal.SIGKILL)
        for p in old.values():
            p.join(30)
            assert p.exitcode == -signal.SIGKILL
        new = {r: start(_trainer, r, 1, LAST_OF_EPOCH0, LAST) for r in TRAINERS}
        out = collect_ok(results, range(WORLD), 240)
    finally:
        reap([*procs.values(), *old.values(), *new.values()])
    for r in INFERENCE:
        rep = out[r]
        assert rep["pid_start"] == rep["pid_end"] == procs[r].pid, rep  # the same processes throughout
        assert rep["error"].startswith("PeerDiedError") and rep["error_rank"] in TRAINERS, rep
        assert rep["pulled"] == [4, 5, 6], rep
        assert rep["staging"] == 0, rep
        assert rep["our_fds"] == [] and rep["our_maps"] == [], rep  # both epochs' mappings released
    assert all(out[r]["epoch"] == 1 for r in TRAINERS)
