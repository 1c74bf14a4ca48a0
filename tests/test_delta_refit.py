"""Cross-host delta refits: only the elements that changed cross hosts, exactly, with no torn version.

Trainers run on host0, inference ranks on host1 of the host harness (tritonreshard.apps.hosts: a
network, /dev/shm and hostname each; the store on rank 0's host, or, for the restart, on an
inference rank's, which outlives the trainers), as in test_multihost. The weights are bf16 with
std 0.02 and every version is an Adam-sized step (1e-6 per element, the sign random), as in RL
fine-tuning: about 2% of the bf16 elements change per version. A float32 tensor cycles through
bit patterns that value comparisons get wrong (NaN payloads, -0.0, subnormals). Every check
compares bits.
"""
import datetime
import gc
import json
import os
import signal
import time

import pytest
import torch
import torch.distributed as dist
from _faults import our_fds, our_maps
from _mp import free_port

import tritonreshard as trs
from tritonreshard import Layout, Replicate, Shard
from tritonreshard.planning import plan_hosts, plan_messages
from tritonreshard.transport import CrossHostCopy, DistLink, codec_for

pytestmark = pytest.mark.timeout(300)

TRAINERS, INFERENCE, WORLD = (0, 1), (2, 3), 4
PLACEMENT = [0, 0, 1, 1]   # rank -> harness host: trainers on host0, inference ranks on host1
SRC = {"w": Layout((64, 96), TRAINERS, [Shard(0)], torch.bfloat16),
       "v": Layout((40, 32), TRAINERS, [Shard(0)], torch.bfloat16),
       "odd": Layout((6, 4), TRAINERS, [Shard(0)], torch.float32)}
DST = {"w": Layout((64, 96), INFERENCE, [Replicate()], torch.bfloat16),
       "v": Layout((40, 32), INFERENCE, [Shard(1)], torch.bfloat16),
       "odd": Layout((6, 4), INFERENCE, [Replicate()], torch.float32)}
MODEL = sum(lay.numel * lay.itemsize for lay in SRC.values())   # each byte crosses once (into host1)
_ODD = [0x00000000, 0x80000000, 0x7FC00001, 0x7FC00002, 0x00000001, 0x00000002, 0xFFC00003, 0x3F800000]


def full(name: str, v: int) -> torch.Tensor:
    """The global tensor ``name`` at version ``v``: bf16 weights after ``v - 1`` Adam-sized steps
    (replayed, so every process derives the same bits), or a float32 tensor of special bit patterns."""
    lay = SRC[name]
    if name == "odd":
        i = torch.arange(lay.numel, dtype=torch.int64)
        words = torch.tensor(_ODD, dtype=torch.int64)[(i + (i % 3 == 0) * v) % len(_ODD)]
        return words.to(torch.int32).view(torch.float32).reshape(lay.shape)
    g = torch.Generator().manual_seed({"w": 1, "v": 2}[name])
    w = (torch.randn(lay.shape, generator=g) * 0.02).to(torch.bfloat16)
    for step in range(2, v + 1):
        g = torch.Generator().manual_seed(1000 * step + len(name))
        w = (w.float() - 1e-6 * torch.sign(torch.randn(lay.shape, generator=g))).to(torch.bfloat16)
    return w


def _bits(t):
    return t.contiguous().view(-1).view(torch.uint8)


def _check(ep, rank, v):
    for n, t in ep.tensors.items():
        want = DST[n].shard(full(n, v), rank)
        assert torch.equal(_bits(t), _bits(want)), (rank, n, v)


# ---------------------------------------------------------------- the engine, Adam-sized steps
def _worker(rank, addr, port, versions, anchor):
    torch.set_num_threads(1)
    kw = dict(meeting=trs.Meeting(rank=rank, world_size=WORLD, store=f"{addr}:{port}"),
              timeouts=trs.Timeouts(wait=60), codec=trs.Delta(anchor=anchor))
    out = []
    if rank in TRAINERS:
        with trs.RefitTrainer({n: lay.shard(full(n, 1), rank) for n, lay in SRC.items()}, SRC, **kw) as tr:
            for v in range(1, versions + 1):
                tr.fence()
                for n, t in tr.tensors.items():
                    t.copy_(SRC[n].shard(full(n, v), rank))
                tr.publish()
            tr.fence()
            out.append(tr.stats.staging_bytes)
        return out
    with trs.RefitInference(DST, **kw) as ep:
        for v in range(1, versions + 1):
            assert ep.pull() == v
            _check(ep, rank, v)
            s = ep.stats
            out.append((s.cross_host_bytes, s.cross_host_delta_bytes, s.cross_host_dense_bytes, s.cross_host_changed))
    return out


def test_adam_sized_bf16_steps_cross_as_exact_deltas(two_hosts):
    versions, anchor = 5, 4
    res = two_hosts.run_ranks(_worker, PLACEMENT, args=(two_hosts.address(0), free_port(), versions, anchor),
                              timeout=240)
    for v in range(versions):
        got = [res[r][v] for r in INFERENCE]
        crossed = sum(g[0] for g in got)
        assert crossed == sum(g[1] + g[2] for g in got)
        if v in (0, anchor):   # the first version, and the anchor after anchor - 1 deltas: whole
            assert crossed == MODEL and all(g[1] == 0 and g[3] is None for g in got), (v, got)
        else:                  # about 2% changed: at most 10% of the dense bytes cross
            assert all(g[2] == 0 and 0.005 < g[3] < 0.2 for g in got), (v, got)
            assert 0 < crossed <= 0.10 * MODEL, (v, crossed, MODEL)
    # The snapshot of what each trainer sent: one copy of its cross-host bytes (plus no packing here).
    assert sum(res[r][0] for r in TRAINERS) == MODEL


# ---------------------------------------------------------------- the wire: base versions decide
def _wire(rank, addr, port, steps, anchor):
    src = {"w": Layout((16, 64), [0], [Replicate()], torch.bfloat16)}
    dst = {"w": Layout((16, 64), [1], [Replicate()], torch.bfloat16)}
    plan = trs.plan_reshard(src, dst)
    hp = plan_hosts(plan, {0: "host0", 1: "host1"}, src_offsets={(0, "w"): 0})
    store = dist.TCPStore(addr, port, 2, rank == 0, timeout=datetime.timedelta(seconds=30))
    link = DistLink(store, rank=rank, world_size=2, timeout=20.0, prefix="delta-wire/")
    arena = torch.zeros(16 * 64 * 2, dtype=torch.uint8)
    recv = torch.full((hp.buffer_bytes.get(1, 0),), 0xA5, dtype=torch.uint8)
    copy = CrossHostCopy(link, plan_messages(hp, {(0, "w"): 0}), hp.transfers,
                         arena=arena if rank == 0 else None, shard={"w": arena.view(torch.bfloat16).view(16, 64)},
                         recv_buffer=recv if rank == 1 else None, codec=trs.Delta(anchor=anchor))
    seen = []
    first = (torch.randn(16, 64, generator=torch.Generator().manual_seed(7)) * 0.02).to(torch.bfloat16)
    for v, base in steps:
        w = first.clone()
        w.view(-1)[:3 * v] = v              # version v changes 3 elements of version v - 1
        if rank == 0:
            arena.view(torch.bfloat16).copy_(w.view(-1))
            d = copy.prepare_sends(v, {1: base})
            store.set(f"d/{v}", json.dumps(d[1]))
            copy.start_sends(v).wait()
            copy.commit_sends()
            seen.append(d[1]["base"])
        else:
            d = json.loads(store.get(f"d/{v}"))
            copy.start_recvs({0: d}).wait()
            copy.check_headers(v)
            copy.apply()
            assert torch.equal(recv[:arena.numel()], _bits(w)), v   # the buffer is version v, bit for bit
            seen.append((d["base"], copy.last_received["delta_bytes"], copy.last_received["dense_bytes"]))
    store.set(f"done/{rank}", "1")
    if rank == 0:
        store.wait(["done/1"], datetime.timedelta(seconds=30))
    link.close()
    return seen


def test_the_receivers_base_decides_whole_or_delta(two_hosts):
    """(version, the base the receiver announces): a delta only against the version last sent; a
    receiver with no base (a failed refit), a stale base (skipped versions) or an anchor due gets it whole."""
    steps = [(1, 0), (2, 1), (3, 0), (4, 2), (5, 4), (6, 5), (7, 6), (8, 7)]
    res = two_hosts.run_ranks(_wire, [0, 1], args=(two_hosts.address(0), free_port(), steps, 3), timeout=120)
    assert res[0] == [0, 1, 0, 0, 4, 5, 0, 7]   # 7: anchor 3 after two deltas (5, 6) -> whole
    dense = 16 * 64 * 2
    for (v, _), base, (rbase, delta, whole) in zip(steps, res[0], res[1], strict=True):
        assert rbase == base and (whole, delta > 0) == ((dense, False) if base == 0 else (0, True)), (v, res[1])
        if base:
            assert delta < 0.1 * dense


# ---------------------------------------------------------------- bad input
def test_bad_delta_and_ranks_that_disagree(two_hosts):
    with pytest.raises(ValueError, match=r"delta must be one of \['auto', 'off', 'always'\], got delta='sparse'"):
        trs.RefitInference(DST, meeting=trs.Meeting(rank=2, world_size=WORLD, store="127.0.0.1:9"),
                           codec=codec_for("sparse"))
    with pytest.raises(ValueError, match="anchor must be an int >= 1"):
        trs.RefitTrainer({}, SRC, meeting=trs.Meeting(rank=0, world_size=WORLD, store="127.0.0.1:9"),
                         codec=trs.Delta(anchor=0))
    res = two_hosts.run_ranks(_disagree, PLACEMENT, args=(two_hosts.address(0), free_port()), timeout=120,
                              allow_errors=True)
    msgs = {r: res[r][1] for r in res}
    assert all(res[r][0] == "error" and msgs[r][0] == "ValueError" for r in res), msgs
    assert len({msgs[r][1] for r in res}) == 1                # the same one error on every rank
    assert ("rank(s) [3] joined with codec ['Dense()'] but rank 0 has Delta(anchor=64, force=False)"
            in msgs[0][1]), msgs[0][1]


def _disagree(rank, addr, port):
    kw = dict(meeting=trs.Meeting(rank=rank, world_size=WORLD, store=f"{addr}:{port}"),
              timeouts=trs.Timeouts(wait=60))
    if rank in TRAINERS:
        trs.RefitTrainer({n: lay.shard(full(n, 1), rank) for n, lay in SRC.items()}, SRC, **kw)
    else:
        trs.RefitInference(DST, codec=codec_for("off" if rank == 3 else "auto"), **kw)


# ---------------------------------------------------------------- a sender killed mid-delta
KILLED_AT, LAST = 3, 4
STORE_RANK = 2   # the store lives with an inference rank (host1): it outlives the trainers it sees die


def _meeting(rank, addr, port, epoch=None):
    return trs.Meeting(rank=rank, world_size=WORLD, store=f"{addr}:{port}", host_store=rank == STORE_RANK,
                       epoch=epoch)


def _epoch0(rank, addr, port, marks):
    """Epoch 0 of the restart test: the trainers (host0) and the inference ranks (host1)."""
    return _trainer(rank, addr, port, 0, 0) if rank in TRAINERS else _inference(rank, addr, port, marks)


def _trainer(rank, addr, port, epoch, start):
    torch.set_num_threads(1)
    if epoch == 0 and rank == 1:
        post = DistLink.post

        def dying_post(self, sends, recvs, tag=0):
            """Version 3's deltas: the headers go, then this process dies before its payloads."""
            if sends and int(sends[0][1][0]) == KILLED_AT:
                headers = [(p, t) for p, t in sends if t.dtype == torch.int64]
                assert len(headers) < len(sends)      # payloads were due: a delta, cut short
                post(self, headers, [], tag).wait(timeout=10)
                os.kill(os.getpid(), signal.SIGKILL)
            return post(self, sends, recvs, tag)
        DistLink.post = dying_post
    shards = {n: lay.shard(full(n, start), rank) for n, lay in SRC.items()}
    meeting = _meeting(rank, addr, port, epoch)
    with trs.RefitTrainer(shards, SRC, meeting, start_version=start, timeouts=trs.Timeouts(wait=120)) as tr:
        last = KILLED_AT if epoch == 0 else LAST
        for v in range(start + 1, last + 1):
            tr.fence()
            for n, t in tr.tensors.items():
                t.copy_(SRC[n].shard(full(n, v), rank))
            tr.publish()
        try:
            tr.fence()
        except trs.PeerDiedError:   # rank 0 of epoch 0: its peer died
            pass
        if epoch == 0:   # ended as a job's driver would end it, once the inference ranks served
            tr.store.wait([f"served/{r}" for r in INFERENCE], datetime.timedelta(seconds=200))
            os.kill(os.getpid(), signal.SIGKILL)
    return epoch


def _inference(rank, addr, port, marks):
    torch.set_num_threads(1)
    ep = trs.RefitInference(DST, _meeting(rank, addr, port), timeouts=trs.Timeouts(wait=120, peer=5))
    for v in range(1, KILLED_AT):
        assert ep.pull() == v
        _check(ep, rank, v)
    with pytest.raises(trs.PeerDiedError) as e:
        ep.pull()
    who = e.value.rank
    del e   # its traceback holds the failed pull's frames (and their views of the dead epoch's buffers)
    assert ep.version == KILLED_AT - 1
    _check(ep, rank, KILLED_AT - 1)      # still serving the last complete version, exactly
    ep.store.set(f"served/{rank}", b"1")
    open(os.path.join(marks, f"served.{rank}"), "w").close()   # for the test, outside the hosts
    assert ep.rejoin() == 1
    stats = []
    for v in range(KILLED_AT, LAST + 1):
        assert ep.pull() == v
        _check(ep, rank, v)
        s = ep.stats
        stats.append((s.cross_host_delta_bytes, s.cross_host_dense_bytes))
    ep.close()
    del ep
    gc.collect()
    return {"who": who, "stats": stats, "leftover": our_fds() + our_maps()}


def test_sender_killed_mid_delta_serves_no_torn_version_and_the_next_transfer_is_whole(two_hosts, tmp_path):
    """Trainer rank 1 (host0) dies between version 3's delta headers and payloads; once the inference
    ranks (host1) served version 2 on, both trainers are gone and restart on host0 as epoch 1 from the
    checkpoint of version 2 (the one being served): version 3 again, then 4. The inference ranks
    rejoin without restarting."""
    addr, port = two_hosts.address(1), free_port()   # the store: on STORE_RANK's host

    def restart(hosts, stop):
        deadline = time.monotonic() + 200
        while not all((tmp_path / f"served.{r}").exists() for r in INFERENCE):
            assert time.monotonic() < deadline and not stop.is_set(), "the inference ranks never served version 2"
            time.sleep(0.05)
        return hosts.run_ranks(_trainer, [0, 0], args=(addr, port, 1, KILLED_AT - 1), timeout=200)

    out = two_hosts.run_ranks(_epoch0, PLACEMENT, args=(addr, port, str(tmp_path)), timeout=280,
                              victims=TRAINERS, during=restart)
    assert out["during"] == {0: 1, 1: 1}   # the restarted trainers ended epoch 1
    for r in INFERENCE:
        assert out[r]["who"] == 1, out[r]
        (d3, w3), (d4, w4) = out[r]["stats"]
        assert d3 == 0 and w3 > 0          # the first transfer of the new epoch: whole
        assert d4 > 0 and w4 == 0          # then deltas again
        assert out[r]["leftover"] == [], out[r]["leftover"]
    assert sum(out[r]["stats"][0][1] for r in INFERENCE) == MODEL
    assert two_hosts.shm_files(0) == two_hosts.shm_files(1) == []
