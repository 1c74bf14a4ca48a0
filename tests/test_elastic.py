"""Elastic groups: inference replicas join a running group, leave it and die, and nobody stops.

Two FSDP trainers (ranks 0, 1) and replica 0 (TP=2, ranks 2, 3) refit in lockstep (the trainers
fence on every admitted reader); replica 0 pulls every version, checked bit for bit. Mid-run:

* replica 1 (ranks 4, 5) joins; before that, rank 4 is refused twice with one ValueError each
  (a dtype that differs from the group's replicas; replica index 0, already in use) while the group
  goes on; it serves versions from the one it was admitted at, then closes (leaves);
* replica 2 (ranks 6, 7) joins, pulls a version and is SIGKILLed: the trainers drop both ranks
  (seen through their pidfds, well within ``peer_timeout``) and their fences stop waiting for them.

The trainers keep their processes, arenas and version counter throughout. Then they exit, new
trainers meet in epoch 1 from the last version, and replica 0 (the same processes, serving its last
version meanwhile) ``rejoin()`` s them through the same join and pulls the next versions. Every
process ends with nothing of ours mapped or open, and nothing in /dev/shm.
"""
import gc
import os
import queue
import signal
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _faults import die, our_fds, our_maps
from _mp import reap, start_rank
from _provenance import provenance

import tritonreshard as trs
from tritonreshard import Layout, Replicate, Shard

pytestmark = pytest.mark.timeout(300)  # spawning 10 processes on a loaded 2-core machine

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


def _trainer(rank, port, epoch=0, start=0):
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
    shards = {n: lay.shard(full(n, start), rank) for n, lay in SRC.items()}  # epoch 1: the last version's checkpoint
    with trs.RefitTrainer(shards, SRC,
                          meeting=trs.Meeting(rank=rank, world_size=len(TRAINERS), store=store, epoch=epoch),
                          timeouts=trs.Timeouts(wait=90, peer=PEER_TIMEOUT), membership=trs.Elastic(),
                          start_version=start) as tr:
        arena = {n: t.data_ptr() for n, t in tr.tensors.items()}
        _key(store, "go/train") if epoch == 0 else [_key(store, f"rejoined/{r}") for r in REPLICAS[0]]
        end, v, gone = (None, 0, {}) if epoch == 0 else (start + 3, start, {})
        while True:
            tr.fence()
            if end is None and store.check(["end"]):
                end = int(store.get("end"))
            if end is not None and v >= end:
                break
            v += 1
            for n, t in tr.tensors.items():
                t.copy_(SRC[n].shard(full(n, v), rank))
            assert tr.publish() == v
            if rank == 0:
                store.set("published", str(v))
            for r, why in tr.dropped:
                gone.setdefault(r, (time.monotonic(), why))
            if rank == 0 and end is None and store.check(["stop"]):
                # Rank 1 is at most one version ahead, and reads "end" before it publishes again.
                end = v + 2
                store.set("end", str(end))
        same_arena = arena == {n: t.data_ptr() for n, t in tr.tensors.items()}
        report = {"published": tr.published, "readers": tr.readers, "gone": gone, "same_arena": same_arena,
                  "epoch": tr.epoch, "pid": os.getpid()}
        # Replica 0 stays until the readers are counted: a reader that acked the last version and
        # closed at once would otherwise be counted as left, not as a reader (a race, not a drop).
        store.set(f"counted/{epoch}/{rank}", "1")
        return report


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
    with trs.RefitInference(dst(0), meeting=trs.Meeting(rank=rank, store=store), timeouts=trs.Timeouts(wait=90),
                            membership=trs.Elastic(replica=0)) as inf:
        store.set(f"joined/{rank}", "1")
        if rank == REPLICAS[0][0]:
            store.wait([f"joined/{r}" for r in REPLICAS[0]], timedelta(seconds=60))
            store.set("go/train", "1")
        first = inf.join_stats.first_version

        def stop(v):
            time.sleep(0.005)  # generation between refits
            return store.check(["end"]) and v >= int(store.get("end"))
        pulled = _pull_until(inf, rank, 0, stop)
        end = inf.version
        with pytest.raises(trs.PeerDiedError):  # the trainers exit; new ones meet in epoch 1
            inf.pull()
        _check(inf, rank, 0, end)  # still serving the last version, exactly
        assert inf.rejoin() == 1 and inf.epoch == 1
        store.set(f"rejoined/{rank}", "1")
        rejoined = inf.join_stats
        after = _pull_until(inf, rank, 0, lambda v: v >= end + 3)
        store.wait([f"counted/1/{r}" for r in TRAINERS], timedelta(seconds=60))
    del inf
    gc.collect()  # the PeerDiedError's traceback held the failed pull's frames (views of epoch 0's arenas)
    return {"first": first, "pulled": pulled, "after": after, "rejoined": rejoined, "fds": our_fds(),
            "maps": our_maps()}


def _replica1(rank, port):
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
    _key(store, "go/r1")
    refused = []
    if rank == REPLICAS[1][0]:  # bad input first: refused, and the group goes on
        wrong_shape = {**dst(1), "w": Layout((12, 9), REPLICAS[1], [Shard(1)])}
        for kw in (dict(layouts=dst(1, torch.bfloat16), replica=1), dict(layouts=dst(1), replica=0),
                   dict(layouts=wrong_shape, replica=1)):
            with pytest.raises(ValueError) as err:
                trs.RefitInference(kw["layouts"], meeting=trs.Meeting(rank=rank, store=store),
                                   timeouts=trs.Timeouts(wait=30), membership=trs.Elastic(replica=kw["replica"]))
            refused.append(str(err.value))
    t0 = time.monotonic()
    before = int(store.get("published"))
    inf = trs.RefitInference(dst(1), meeting=trs.Meeting(rank=rank, store=store), timeouts=trs.Timeouts(wait=90),
                             membership=trs.Elastic(replica=1))
    t_joined = time.monotonic()
    first = inf.join_stats.first_version
    pulled = [inf.pull()]
    _check(inf, rank, 1, inf.version)
    t_first = time.monotonic()
    pulled += _pull_until(inf, rank, 1, lambda v: v >= first + 3)
    stats = inf.join_stats
    inf.close()
    del inf
    gc.collect()
    store.set(f"r1/left/{rank}", "1")
    return {"refused": refused, "before": before, "first": first, "pulled": pulled, "fds": our_fds(),
            "maps": our_maps(), "joined_s": t_joined - t0, "first_s": t_first - t0, "stats": stats}


def _replica2(rank, port):
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
    _key(store, "go/r2")
    inf = trs.RefitInference(dst(2), meeting=trs.Meeting(rank=rank, store=store), timeouts=trs.Timeouts(wait=90),
                             membership=trs.Elastic(replica=2))
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
    procs = {r: start_rank(ctx, fn, r, (store.port,), results) for r, fn in ROLES.items()}
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
        store.set("stop", "1")
        deadline = time.monotonic() + 120

        def collect(ranks):
            while not ranks <= set(out):
                try:
                    rank, status, value = results.get(timeout=max(0.1, deadline - time.monotonic()))
                except queue.Empty:
                    raise TimeoutError(f"ranks {sorted(ranks - set(out))} did not finish") from None
                assert status == "ok", f"rank {rank} raised {value[0]}: {value[1]}\n{value[2]}"
                out[f"t1/{rank}" if rank in TRAINERS and value["epoch"] == 1 else rank] = value
        collect(set(TRAINERS) | set(REPLICAS[1]))
        for r in TRAINERS:  # the next epoch's trainers, from the last version
            procs[f"t1/{r}"] = start_rank(ctx, _trainer, r, (store.port, 1, out[r]["published"]), results)
        collect({*REPLICAS[0], *(f"t1/{r}" for r in TRAINERS)})
    finally:
        reap(procs)
    end = int(store.get("end"))
    for r in TRAINERS:  # same processes, arenas and counter; nobody left but replica 0
        t = out[r]
        assert t["published"] == end and t["same_arena"] and t["epoch"] == 0, t
        assert sorted(t["readers"]) == list(REPLICAS[0]), t
        assert {q: "left" if why.endswith(" left") else " died" in why for q, (_, why) in t["gone"].items()} == {
            4: "left", 5: "left", 6: True, 7: True}, t  # died, or died (zombie) until its parent reaps it
        for q in REPLICAS[2]:  # seen through the pidfd, long before peer_timeout
            assert t["gone"][q][0] - float(store.get(f"r2/dying/{q}")) < PEER_TIMEOUT, t["gone"]
    for r in REPLICAS[0]:  # every version, in order, exact (checked in the rank)
        rep = out[r]
        assert rep["pulled"] == list(range(rep["first"], end + 1)) and rep["first"] == 1, rep["pulled"][:5]
        assert rep["after"] == [end + 1, end + 2, end + 3] and rep["rejoined"].first_version == end + 1, rep
        assert rep["fds"] == [] and rep["maps"] == [], rep
    for r in TRAINERS:
        t = out[f"t1/{r}"]
        assert t["published"] == end + 3 and t["epoch"] == 1 and sorted(t["readers"]) == list(REPLICAS[0]), t
    for r in REPLICAS[1]:
        rep = out[r]
        assert rep["first"] >= rep["before"] and rep["pulled"] == list(range(rep["first"], rep["first"] + 4)), rep
        assert rep["fds"] == [] and rep["maps"] == [], rep
        print(f"rank {r}: joined in {rep['joined_s'] * 1e3:.0f} ms, first refit {rep['first_s'] * 1e3:.0f} ms "
              f"after its constructor started ({rep['stats']})")
    dtype_err, in_use_err, shape_err = out[REPLICAS[1][0]]["refused"]
    assert "'w'" in shape_err and "(12, 9)" in shape_err and "(12, 8)" in shape_err, shape_err  # the planner's word
    assert "dst_layouts['w']" in dtype_err and "torch.bfloat16" in dtype_err and "torch.float32" in dtype_err, dtype_err
    assert "1 problem(s)" in dtype_err, dtype_err  # 'w' only: 'b' is the same
    assert "replica 0 (its rank #0) is already in use by rank 2 of replica 0" in in_use_err, in_use_err
    assert {f for f in os.listdir("/dev/shm") if f.startswith("trs-")} <= shm_before


@pytest.mark.parametrize("quantization", [None, "fp8-block"])
def test_a_joiners_route_is_its_reads_without_a_host_plan(quantization):
    """RankPlan.local_route (what a joiner runs) reads exactly what route() over a host plan reads,
    for a MoE model's recipe (fused QKV and gate/up, padded vocab, experts), plain and block-FP8."""
    transformers = pytest.importorskip("transformers")
    from tritonreshard.planning import plan_rank, source_order
    from tritonreshard.transport import pack_offsets
    config = transformers.Qwen3MoeConfig(vocab_size=100, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=128, num_experts=4,
                                         num_experts_per_tok=2, moe_intermediate_size=512, mlp_only_layers=[1])
    trainers, replica = [0, 1, 2], [7, 8]
    spec = trs.recipes.hf_to_vllm(config, tp=2, trainer_ranks=trainers, inference_ranks=replica, dtype=torch.bfloat16,
                                  src_dtype=torch.bfloat16, quantization=quantization)
    offsets = {}
    for r in trainers:  # as the trainers' arenas lay their shards out
        order = source_order(spec.src, r)
        offs, _ = pack_offsets([spec.src[n].local_numel(r) * spec.src[n].itemsize for n in order])
        offsets.update({(r, n): o for n, o in zip(order, offs, strict=True)})
    hosts = {r: "h" for r in trainers + replica}
    for rank in replica:
        rp = plan_rank(spec.src, spec.dst, hosts, rank, parts=spec.parts, quant=spec.quant or None)
        local, full_route = rp.local_route(offsets), rp.route(offsets, rp.host_part(offsets))
        assert local.reads and set(local.reads) == set(full_route.reads) and len(local.reads) == len(full_route.reads)
        assert local.fills == full_route.fills and local.buffers == full_route.buffers


def test_control_block_join_and_admission_words():
    """The words an elastic trainer and its readers share: a join word the reader writes, an
    admission word the owner writes with the reader's ack restarted, drops that never clear another
    process's join."""
    from tritonreshard.transport import create_control_block
    with create_control_block(4, 4, secret=b"s" * 32, joins=True) as cb, \
            create_control_block(2, 2, secret=b"s" * 32) as plain:
        assert cb.has_joins and not plain.has_joins and cb.join_requests().tolist() == [0, 0, 0, 0]
        cb.request_join(2, 1234)
        cb.heartbeat(2)
        cb.ack(2, 9)  # the slot's last occupant acked version 9
        assert cb.join_requests().tolist() == [0, 0, 1234, 0] and cb.admitted_version(2) == 0
        cb.admit(2, 5)
        assert (cb.admitted_version(2), cb.acked_version(2), cb.last_heartbeat_ns(2)) == (5, 4, 0)
        cb.drop(2, pid=999)  # another pid: the admission goes, the join word is not ours to clear
        assert cb.admitted_version(2) == 0 and cb.join_requests()[2] == 1234
        cb.admit(2, 6)
        cb.drop(2, pid=1234)
        assert cb.admitted_version(2) == 0 and cb.join_requests()[2] == 0
        cb.request_join(3, 77)
        cb.leave(3)
        assert cb.join_requests().tolist() == [0, 0, 0, 0]
        with pytest.raises(ValueError, match="no join words"):
            plain.request_join(0, 1)
        with pytest.raises(ValueError, match="reader must be in"):
            cb.request_join(4, 1)


def _across_hosts(rank, addr, port):
    """Trainers 0-1 on host0 (rank 0 hosts the store), rank 2 on host1 trying to join as replica 0."""
    torch.set_num_threads(1)
    wait = timedelta(seconds=60)
    store = (dist.TCPStore(addr, port, is_master=True, wait_for_workers=False, timeout=wait) if rank == 0
             else dist.TCPStore(addr, port, is_master=False, timeout=wait))
    if rank == 2:
        store.wait(["published"], wait)
        with pytest.raises(ValueError) as err:
            trs.RefitInference(dst(0), meeting=trs.Meeting(rank=rank, store=store), timeouts=trs.Timeouts(wait=30),
                               membership=trs.Elastic(replica=0))
        store.set("refused", "1")
        store.wait(["done/0", "done/1"], wait)
        return {"error": str(err.value), "shm": os.listdir("/dev/shm"), "fds": our_fds(), "maps": our_maps()}
    shards = {n: lay.shard(full(n, 0), rank) for n, lay in SRC.items()}
    with trs.RefitTrainer(shards, SRC, meeting=trs.Meeting(rank=rank, world_size=len(TRAINERS), store=store),
                          timeouts=trs.Timeouts(wait=60), membership=trs.Elastic()) as tr:
        v = 0
        while v < 2 or not store.check(["refused"]):   # the group goes on while the joiner is refused
            tr.fence()
            v += 1
            for n, t in tr.tensors.items():
                t.copy_(SRC[n].shard(full(n, v), rank))
            tr.publish()
            if rank == 0 and v == 2:
                store.set("published", str(v))
            time.sleep(0.01)
        tr.fence()
        readers = tr.readers
    store.set(f"done/{rank}", "1")
    if rank == 0:
        store.wait(["done/1"], wait)
    return {"published": v, "readers": readers}


def test_a_joiner_on_another_host_is_refused_naming_both_hosts(two_hosts):
    """An elastic group runs on one host (its readers map the trainers' arenas in place): a replica
    rank on a host that is really apart is refused before any byte moves, naming its host and the
    trainers', while the trainers go on publishing (docs/elastic.md, Limits)."""
    from _mp import free_port

    out = two_hosts.run_ranks(_across_hosts, [0, 0, 1], args=(two_hosts.address(0), free_port()), timeout=180)
    err = out[2]["error"]
    assert "an elastic group runs on one host: this rank is on 'host1', trainers on ['host0']" in err, err
    assert out[2]["shm"] == [] and out[2]["fds"] == [] and out[2]["maps"] == [], out[2]
    for r in TRAINERS:
        assert out[r]["published"] >= 2 and not out[r]["readers"], out[r]   # nobody joined
