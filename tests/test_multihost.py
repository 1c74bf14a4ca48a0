"""Cross-host refits over torch.distributed point-to-point, on hosts of the host harness
(tritonreshard.apps.hosts: a network, /dev/shm and hostname each, linked through a switch).

Every rank runs in its own process on its host. Senders send their host plan's
messages straight from an arena-like flat buffer (provenance data: every element's value encodes
its global index and the version); receivers receive into their receive buffers, which come back
to the test; the test then runs the local and fan-out ops on those bytes and compares every
destination element bit for bit. Faults: a SIGKILLed sender or receiver on the other host makes
its peers raise PeerDiedError naming it, within the hard timeout. Two runs stay on this machine over
loopback, each saying why: NCCL between two GPUs, and the engine with hosts by label.
"""
import datetime
import gc
import math
import os
import signal
import socket
import time

import pytest
import torch
import torch.distributed as dist
from _faults import our_fds, our_maps
from _mp import free_port, run_ranks

import tritonreshard as trs
from tritonreshard import Layout, Replicate, Shard
from tritonreshard.planning import plan_hosts, plan_messages
from tritonreshard.transport import pack_offsets
from tritonreshard.transport._dist import CrossHostCopy, DistLink, LinkError


def _value(version: int, global_index: torch.Tensor, dtype) -> torch.Tensor:
    # Exact in float32 (< 2**24) and bfloat16-safe only for small tensors: the tests below use
    # float32 for provenance checks.
    return (global_index + version * 100_000).to(dtype)


def _arena_layout(plan, rank):
    """Deterministic arena packing of a source rank's shards (every rank computes the same)."""
    names = [n for n in plan.names if rank in plan.src_layouts[n].ranks]
    sizes = [plan.src_layouts[n].local_numel(rank) * plan.src_layouts[n].itemsize for n in names]
    offsets, total = pack_offsets(sizes)
    return dict(zip(names, offsets, strict=True)), total


def _setup(rank, world, addr, port, src, dst, hosts, device="cpu"):
    plan = trs.plan_reshard(src, dst)
    src_offsets = {}
    for r in plan.src_ranks:
        offs, _ = _arena_layout(plan, r)
        src_offsets.update({(r, n): o for n, o in offs.items()})
    hp = plan_hosts(plan, hosts, src_offsets=src_offsets)
    msgs = plan_messages(hp, src_offsets)
    store = dist.TCPStore(addr, port, world, rank == 0, timeout=datetime.timedelta(seconds=30))
    if device == "cuda":
        device = f"cuda:{rank}"
        torch.cuda.set_device(device)
    link = DistLink(store, rank=rank, world_size=world, timeout=20.0, prefix="test-dist/", device=device)
    arena = shard = None
    if rank in plan.src_ranks:
        offs, total = _arena_layout(plan, rank)
        arena = torch.zeros(total, dtype=torch.uint8, device=device)
        shard = {n: arena[o:o + plan.src_layouts[n].local_numel(rank) * plan.src_layouts[n].itemsize]
                 .view(plan.src_layouts[n].dtype).view(plan.src_layouts[n].local_shape(rank))
                 for n, o in offs.items()}
    recv = torch.full((hp.buffer_bytes.get(rank, 0),), 0xA5, dtype=torch.uint8, device=device)
    copy = CrossHostCopy(link, msgs, hp.transfers, arena=arena, shard=shard,
                         recv_buffer=recv if rank in hp.buffer_bytes else None)
    return plan, hp, store, link, shard, recv, copy


def _fill(plan, shard, rank, version):
    for n, t in shard.items():
        lay = plan.src_layouts[n]
        g = torch.arange(lay.numel, dtype=torch.int64).reshape(lay.shape)
        t.copy_(_value(version, lay.shard(g, rank), t.dtype).to(t.device))


def _rank_refits(rank, world, addr, port, src, dst, hosts, versions, device="cpu"):
    """One rank: ``versions`` refits over the wire. Returns the receive buffer after each."""
    plan, hp, store, link, shard, recv, copy = _setup(rank, world, addr, port, src, dst, hosts, device)
    got = []
    for v in range(1, versions + 1):
        if shard:
            _fill(plan, shard, rank, v)
        pending_recv = copy.start_recvs()
        pending_send = copy.start_sends(v)
        if pending_send is not None:
            pending_send.wait()
        if pending_recv is not None:
            pending_recv.wait()
            copy.check_headers(v)
        got.append(recv.cpu().numpy().tobytes())  # plain bytes: tensors would travel as fds of a dead process
    stats = (copy.bytes_sent_per_refit, copy.bytes_received_per_refit, copy.num_messages,
             copy.send_staging_bytes)
    store.set(f"done/{rank}", "1")
    if rank == 0:  # the store's host outlives everyone's use of it
        store.wait([f"done/{r}" for r in range(world)], datetime.timedelta(seconds=30))
    link.close()
    return got, stats


def _check_outputs(plan, hp, buffers, version):
    """Local + fan-out ops on the received bytes; every destination element bit for bit."""
    src = {}
    for n, lay in plan.src_layouts.items():
        g = torch.arange(lay.numel, dtype=torch.int64).reshape(lay.shape)
        for r in lay.ranks:
            src.setdefault(r, {})[n] = _value(version, lay.shard(g, r), lay.dtype)
    for n, lay in plan.dst_layouts.items():
        g = torch.arange(lay.numel, dtype=torch.int64).reshape(lay.shape)
        for r in lay.ranks:
            out = torch.full(lay.local_shape(r), float("nan"), dtype=lay.dtype)
            for op in hp.local_ops_for_dst(r):
                if op.name == n:
                    out[op.dst_slices] = src[op.src_rank][n][op.src_slices].to(lay.dtype)
            for f in hp.fanout_for_dst(r):
                if f.op.name == n:
                    t = hp.transfers[f.transfer]
                    box = buffers[t.receiver][t.offset:t.offset + t.nbytes].view(t.dtype).view(t.shape)
                    out[f.op.dst_slices] = box[f.op.src_slices].to(lay.dtype)
            want = _value(version, lay.shard(g, r), plan.src_layouts[n].dtype).to(lay.dtype)
            assert torch.equal(out.view(-1).view(torch.uint8), want.view(-1).view(torch.uint8)), \
                f"{n} on rank {r}, version {version}"


def _run(src, dst, spec, harness, versions=2, device="cpu"):
    """Rank ``r`` on the host ``spec`` names it in (``{name: ranks}``): the i-th name is the harness's
    host ``i``; ``harness=None``: every rank on this machine, over loopback (the hosts only in the plan)."""
    hosts = _hosts(spec, harness)
    world = len(hosts)
    if harness is None:
        res = run_ranks(_rank_refits, world, args=(world, "127.0.0.1", free_port(), src, dst, hosts, versions, device),
                        timeout=120)
    else:
        placement = [harness.names.index(hosts[r]) for r in range(world)]
        res = harness.run_ranks(_rank_refits, placement, args=(world, harness.address(placement[0]), free_port(), src,
                                                               dst, hosts, versions, device), timeout=120)
    plan = trs.plan_reshard(src, dst)
    hp = plan_hosts(plan, hosts, src_offsets={
        (r, n): o for r in plan.src_ranks for n, o in _arena_layout(plan, r)[0].items()})
    for v in range(1, versions + 1):
        _check_outputs(plan, hp, {r: torch.frombuffer(bytearray(res[r][0][v - 1]), dtype=torch.uint8)
                                  for r in res if res[r][0][v - 1]}, v)
    stats = {r: res[r][1] for r in res}
    # What crossed, counted by both ends, is the host plan's cross-host bytes.
    assert sum(s[0] for s in stats.values()) == sum(s[1] for s in stats.values()) == hp.cross_host_bytes
    return hp, stats


def _hosts(spec, harness=None):
    """``{rank: host}`` from ``{name: ranks}``; on ``harness``, its i-th host's hostname for the i-th name."""
    names = {h: (harness.names[i] if harness is not None else h) for i, h in enumerate(spec)}
    return {r: names[h] for h, ranks in spec.items() for r in ranks}


def test_seed_example_across_two_hosts_over_gloo(two_hosts):
    src = {"w": Layout((8, 8), 2, [Shard(0)])}
    dst = {"w": Layout((8, 8), [2, 3, 4, 5], [Shard(1)])}
    hp, stats = _run(src, dst, {"a": [0, 1], "b": [2, 3, 4, 5]}, two_hosts)
    assert hp.cross_host_bytes == 256
    # Each trainer sends its whole shard once: one header + one message.
    assert stats[0][2] == stats[1][2] == 1 and stats[0][3] == 0


@pytest.mark.cuda
def test_nccl_between_two_gpus_on_two_simulated_hosts():
    # Over loopback, the hosts only in the plan (the transport reads no host identity): it needs two
    # GPUs, which a GPU machine has, where the host harness (root, namespaces) may not be made.
    if torch.cuda.device_count() < 2:
        pytest.skip("NCCL needs one GPU per rank: 2 GPUs")
    src = {"w": Layout((64, 96), 1, [Replicate()], torch.bfloat16), "c": Layout((40, 24), 1, [Replicate()])}
    dst = {"w": Layout((64, 96), [1], [Replicate()], torch.bfloat16), "c": Layout((40, 24), [1], [Shard(1)])}
    hp, stats = _run(src, dst, {"a": [0], "b": [1]}, None, versions=3, device="cuda")
    assert hp.cross_host_bytes == 64 * 96 * 2 + 40 * 24 * 4


def test_columns_to_replicas_four_ranks_on_one_host_each_byte_once(two_hosts):
    src, dst = {}, {}
    for i in range(6):
        shape = (48, 64 + 16 * i)
        src[f"t{i}"] = Layout(shape, 2, [Shard(1)])
        dst[f"t{i}"] = Layout(shape, [2, 3, 4, 5], [Replicate()])
    hp, stats = _run(src, dst, {"a": [0, 1], "b": [2, 3, 4, 5]}, two_hosts, versions=3)
    model = sum(lay.numel * 4 for lay in dst.values())
    assert hp.cross_host_bytes == model and hp.p2p_cross_host_bytes == 4 * model
    assert all(stats[r][1] > 0 for r in (2, 3, 4, 5))  # every inference rank receives a share


def test_overlapping_meshes_and_packed_boxes_three_hosts(three_hosts):
    src = {"w": Layout((12, 10), [0, 1, 2, 3], [Shard(0)]),
           "b": Layout((30,), [0, 1, 2, 3], [Shard(0)], torch.bfloat16)}
    dst = {"w": Layout((12, 10), [2, 3, 4, 5], [Shard(1)]),
           "b": Layout((30,), [2, 3, 4, 5], [Replicate()], torch.float32)}
    hp, stats = _run(src, dst, {"a": [0, 1], "b": [2, 3], "c": [4, 5]}, three_hosts)
    assert any(not t.contiguous for t in hp.transfers)  # column halves of row shards: packed
    assert sum(s[3] for s in stats.values()) == hp.send_staging_bytes > 0


# ---------------------------------------------------------------- faults
def _rank_fault(rank, world, addr, port, src, dst, hosts, victim, when):
    plan, hp, store, link, shard, recv, copy = _setup(rank, world, addr, port, src, dst, hosts)
    # Everyone connected (first refit completes) before the fault.
    for v in (1, 2):
        if rank == victim and v == 2 and when == "before-send":
            os.kill(os.getpid(), signal.SIGKILL)
        if shard:
            _fill(plan, shard, rank, v)
        pr, ps = copy.start_recvs(), copy.start_sends(v)
        try:
            if ps is not None:
                ps.wait(timeout=30)
            if pr is not None:
                pr.wait(timeout=30)
                copy.check_headers(v)
        except trs.PeerDiedError as exc:
            t0 = time.monotonic()
            with pytest.raises(LinkError, match="broken"):
                copy.start_recvs() if pr is not None else copy.start_sends(v + 1)
            return ("died", exc.rank, str(exc), v, time.monotonic() - t0)
    return ("ok",)


@pytest.mark.parametrize("victim", [0, 3], ids=["sender", "receiver"])
def test_killed_rank_on_the_other_host_is_a_named_peer_died_error(victim, two_hosts):
    src = {"w": Layout((64, 64), 2, [Shard(0)])}
    dst = {"w": Layout((64, 64), [2, 3], [Replicate()])}
    hosts = _hosts({"a": [0, 1], "b": [2, 3]}, two_hosts)
    world = 4
    res = two_hosts.run_ranks(_rank_fault, [0, 0, 1, 1], args=(world, two_hosts.address(0), free_port(), src, dst,
                                                               hosts, victim, "before-send"),
                              timeout=90, victims=[victim], allow_errors=True)
    hp = plan_hosts(trs.plan_reshard(src, dst), hosts)
    # The victim's peers over the wire are exactly the ones that must see it die.
    peers = {t.receiver for t in hp.sends_of(victim)} | {t.src_rank for t in hp.recvs_of(victim)}
    assert peers
    for r in peers:
        status, value = res[r]
        assert status == "ok" and value[0] == "died", (r, res[r])
        _, who, msg, v, _ = value
        # PeerDiedError, not TimeoutError: the closed connection was noticed, not the 20 s timeout.
        assert who == victim and f"rank {victim}" in msg and v == 2, msg


# ================================================================ the engine across hosts
def _global(name_id, layout, version):
    n = math.prod(layout.shape)
    return (torch.arange(n, dtype=torch.float64) + 1000 * version + 100000 * name_id).reshape(layout.shape)


def _engine_worker(rank, world, port, sc):
    if "store" in sc:  # on the host harness: the host is the machine's own (its hostname)
        assert socket.gethostname() == sc["hosts"][rank], (socket.gethostname(), sc["hosts"][rank])
        if sc.get("plant_host"):  # a wrong host map: one identity for every machine
            os.environ["TRITONRESHARD_HOST"] = sc["plant_host"]
    else:
        os.environ["TRITONRESHARD_HOST"] = sc["hosts"][rank]
    torch.set_num_threads(1)
    src, dst = sc["src"], sc["dst"]
    ids = {n: i for i, n in enumerate(sorted(dst))}
    trainer, infer = rank in sc["trainers"], rank in sc["inference"]
    kw = dict(meeting=trs.Meeting(rank=rank, world_size=world, store=f"{sc.get('store', '127.0.0.1')}:{port}"),
              timeouts=trs.Timeouts(wait=60, peer=sc.get("peer_timeout", 10)))
    if trainer:
        kw.update(source=trs.SourceData({n: lay.shard(_global(ids[n], lay, 1).to(lay.dtype), rank)
                                         for n, lay in src.items() if rank in lay.ranks}, src))
    if infer:
        kw.update(destination=trs.DestinationData(dst), pull=trs.PullOptions(mode=sc.get("mode", "shadow")))
    report = {"died": None, "cross": [], "pid": os.getpid()}
    with trs.RefitEndpoint(**kw) as ep:
        try:
            for v in range(1, sc.get("versions", 3) + 1):
                if trainer:
                    ep.fence()
                    if v > 1:
                        for n, t in ep.source_tensors.items():
                            t.copy_(src[n].shard(_global(ids[n], src[n], v).to(src[n].dtype), rank))
                    if sc.get("kill") == (rank, v):
                        time.sleep(sc.get("kill_delay", 0))
                        os.kill(os.getpid(), signal.SIGKILL)
                    assert ep.publish() == v
                    time.sleep(sc.get("pace", 0))
                if infer:
                    assert ep.pull() == v
                    for n, t in ep.tensors.items():
                        want = dst[n].shard(_global(ids[n], src[n], v).to(src[n].dtype), rank).to(dst[n].dtype)
                        assert torch.equal(t.view(-1).view(torch.uint8), want.view(-1).view(torch.uint8)), \
                            f"rank {rank} {n} v{v}"
                    report["cross"].append(ep.stats.cross_host_bytes)
                    if sc.get("mark"):  # tells the test (outside the hosts) what this rank serves
                        open(os.path.join(sc["mark"], f"{rank}.{v}"), "w").close()
            if trainer:
                ep.fence()
        except trs.PeerDiedError as exc:
            report["died"] = (exc.rank, str(exc))
            report["died_at"] = time.time()
            if infer:  # the serving weights stay the last complete version
                report["version"] = ep.version
                for n, t in ep.tensors.items():
                    want = dst[n].shard(_global(ids[n], src[n], ep.version).to(src[n].dtype), rank).to(dst[n].dtype)
                    assert torch.equal(t, want)
        report["staging"] = ep.stats.staging_bytes
        report["handles"] = ep.stats.handles_opened
        hp = ep.host_plan   # this rank's view: its host's part and its own sends
        # What its set-up fetched of the other hosts' transfers: the ones it sends, nothing more.
        report["fetched"], report["sends"] = ep.stats.setup_transfers, len(ep.route.sends)
        report["receives"] = len(ep.route.receives)
        report["known"] = len(hp.transfers) if hp is not None else 0
        # Ranks on another host never map this rank's memory: every arena it opened is on its host.
        report["sources"] = hp.local_sources_of(rank) if hp is not None and infer else ()
    del ep, hp
    t = None  # the loops' last arena view: a view keeps its mapping alive
    gc.collect()
    # Closed, even after a peer died: no receive buffer, arena or control block of ours stays open.
    report["leftover"] = our_fds() + our_maps()
    report["end"] = time.time()
    return report


def _engine(sc, world, **kw):
    return run_ranks(_engine_worker, world, args=(world, free_port(), sc), timeout=180, **kw)


def _on_hosts(hosts, sc, placement, **kw):
    """The engine scenario ``sc`` with rank ``r`` on host ``placement[r]`` of the host harness (its
    own network, /dev/shm and hostname: the host map is the machines' own, nothing simulated), the
    store on rank 0's host. ``sc["hosts"]`` is set to the hostnames, for the plan the test checks."""
    sc.update(hosts={r: hosts.names[h] for r, h in enumerate(placement)}, store=hosts.address(placement[0]))
    return hosts.run_ranks(_engine_worker, placement, args=(len(placement), free_port(), sc), timeout=180, **kw)


def test_engine_seed_example_across_two_hosts():
    # Hosts by label ($TRITONRESHARD_HOST per rank, over loopback), not on the harness: the host
    # identity of `tritonreshard bench --net labels` and of a rehearsal on one machine (docs/hosts.md),
    # which needs no root; the engine tests below run on the harness.
    sc = dict(src={"w": Layout((8, 8), 2, [Shard(0)])}, dst={"w": Layout((8, 8), [2, 3, 4, 5], [Shard(1)])},
              trainers=[0, 1], inference=[2, 3, 4, 5], hosts=_hosts({"a": [0, 1], "b": [2, 3, 4, 5]}))
    res = _engine(sc, 6)
    hp = plan_hosts(trs.plan_reshard(sc["src"], sc["dst"]), sc["hosts"])
    for v in range(3):  # the engine's own accounting: what the receivers got, every refit
        assert sum(res[r]["cross"][v] for r in (2, 3, 4, 5)) == hp.cross_host_bytes == 256
    # Receive buffers are the staging, counted where they live.
    assert {r: res[r]["staging"] for r in (2, 3, 4, 5)} == {r: hp.buffer_bytes.get(r, 0) for r in (2, 3, 4, 5)}
    assert all(res[r]["sources"] == () for r in (2, 3, 4, 5))  # nothing read from host a's memory
    assert all(res[r]["leftover"] == [] for r in res), {r: res[r]["leftover"] for r in res}
    _fetched_only_own_transfers(res, hp)


def _fetched_only_own_transfers(res, hp):
    """Each rank's set-up fetched exactly the transfers it sends (its host's receives it planned
    itself), so all ranks together fetched each transfer once: never every host's transfers each."""
    fetched_sends = {r: (res[r]["fetched"], res[r]["sends"]) for r in res}
    assert all(res[r]["fetched"] == res[r]["sends"] for r in res), fetched_sends
    assert sum(res[r]["fetched"] for r in res) == sum(res[r]["receives"] for r in res) > 0
    for r in res:  # and it knows its host's transfers and its own sends, not the others'
        into_host = sum(res[x]["receives"] for x in res if hp.host_of(x) == hp.host_of(r))
        assert res[r]["known"] == into_host + res[r]["sends"], (r, res[r])


def test_engine_columns_to_replicas_four_inference_ranks_on_one_host(two_hosts):
    src, dst = {}, {}
    for i in range(4):
        shape = (32, 48 + 16 * i)
        src[f"t{i}"] = Layout(shape, 2, [Shard(1)], torch.float32)
        dst[f"t{i}"] = Layout(shape, [2, 3, 4, 5], [Replicate()], torch.bfloat16)
    sc = dict(src=src, dst=dst, trainers=[0, 1], inference=[2, 3, 4, 5], mode="inplace")
    res = _on_hosts(two_hosts, sc, [0, 0, 1, 1, 1, 1])
    model = sum(lay.numel * 4 for lay in src.values())
    for v in range(3):
        assert sum(res[r]["cross"][v] for r in (2, 3, 4, 5)) == model  # each byte once, not 4 times
    assert all(res[r]["cross"][0] > 0 for r in (2, 3, 4, 5))


def test_engine_overlapping_meshes_across_hosts(two_hosts):
    src = {"w": Layout((12, 10), [0, 1, 2, 3], [Shard(0)]), "b": Layout((30,), [0, 1, 2, 3], [Shard(0)])}
    dst = {"w": Layout((12, 10), [2, 3, 4, 5], [Shard(1)]), "b": Layout((30,), [2, 3, 4, 5], [Replicate()])}
    sc = dict(src=src, dst=dst, trainers=[0, 1, 2, 3], inference=[2, 3, 4, 5])
    res = _on_hosts(two_hosts, sc, [0, 0, 0, 1, 1, 1])
    hp = plan_hosts(trs.plan_reshard(src, dst), sc["hosts"])
    for v in range(3):
        assert sum(res[r]["cross"][v] for r in (2, 3, 4, 5)) == hp.cross_host_bytes > 0
    assert 3 in res[4]["sources"]  # rank 4 reads colocated rank 3's arena on its own host
    _fetched_only_own_transfers(res, hp)


@pytest.mark.parametrize("kill_delay", [0, 4.5])
def test_engine_killed_trainer_on_the_other_host_is_a_named_peer_died_error(kill_delay, two_hosts):
    """Rank 1 dies before publishing version 3; rank 0 publishes it, fences and closes. Relay 2
    (rank 0's receiver) then waits for its host's readers, which wait for relay 3 (rank 1's). The
    error names rank 1 even when rank 0 closed more than ``peer_timeout`` before rank 1 died
    (``kill_delay``): a peer that finished and closed is not a death of the waits that do not need it."""
    sc = dict(src={"w": Layout((64, 64), 2, [Shard(0)])}, dst={"w": Layout((64, 64), [2, 3], [Replicate()])},
              trainers=[0, 1], inference=[2, 3], kill=(1, 3), kill_delay=kill_delay, peer_timeout=3)
    res = _on_hosts(two_hosts, sc, [0, 0, 1, 1], victims=[1])
    for r in (2, 3):
        who, msg = res[r]["died"]
        assert who == 1 and "rank 1" in msg, msg
        assert res[r]["version"] == 2  # still serving the last complete version
    assert all(res[r]["leftover"] == [] for r in res), {r: res[r]["leftover"] for r in res}


# ================================================================ isolation: hosts that are really apart
def test_a_host_map_that_puts_two_machines_on_one_host_is_refused_naming_both(two_hosts):
    """Every rank says it is on host "rack-1" ($TRITONRESHARD_HOST), but ranks 0-1 are on host0 and
    2-3 on host1, each with its own /dev/shm: a rank of one would try to map the other's arena. The
    group refuses it at hello, before a byte moves, on every rank, naming both machines."""
    sc = dict(src={"w": Layout((16, 16), 2, [Shard(0)])}, dst={"w": Layout((16, 16), [2, 3], [Shard(1)])},
              trainers=[0, 1], inference=[2, 3], plant_host="rack-1")
    res = _on_hosts(two_hosts, sc, [0, 0, 1, 1], allow_errors=True)
    for r in range(4):
        status, (kind, msg, *_) = res[r]
        assert status == "error" and kind == "ValueError", (r, res[r])
        assert "host 'rack-1' is claimed by ranks that share no memory" in msg, msg
        assert "rank(s) [0, 1] on machine 'host0'" in msg and "rank(s) [2, 3] on machine 'host1'" in msg, msg
    assert two_hosts.shm_files(0) == two_hosts.shm_files(1) == []


def _arena_across(rank, addr, port):
    """Rank 0 (host0) makes a named arena and posts its handle; rank 1 (host1) tries to map it."""
    import pickle

    from tritonreshard.transport import create_arena, open_arena
    store = dist.TCPStore(addr, port, 2, rank == 0, timeout=datetime.timedelta(seconds=30))
    out = {"shm": sorted(os.listdir("/dev/shm"))}
    if rank == 0:
        arena = create_arena(4096)
        store.set("handle", pickle.dumps(arena.export()))
        out["shm"] = sorted(os.listdir("/dev/shm"))
        store.wait(["tried"])
        arena.close()
        return out
    try:
        open_arena(pickle.loads(store.get("handle")))
        out["error"] = None
    except ConnectionError as exc:
        out["error"] = str(exc)
    store.set("tried", "1")
    return out


def test_another_hosts_arena_is_not_in_this_hosts_shared_memory_and_mapping_it_names_the_host(two_hosts):
    res = two_hosts.run_ranks(_arena_across, [0, 1], args=(two_hosts.address(0), free_port()), timeout=60)
    made = [f for f in res[0]["shm"] if f.startswith("trs-")]
    assert len(made) == 1 and res[1]["shm"] == []  # host0's /dev/shm holds it, host1's does not
    assert "belongs to a process on host 'host0', and this process is on host 'host1'" in res[1]["error"]
    assert two_hosts.shm_files(0) == two_hosts.shm_files(1) == []  # closed: unlinked


def test_a_lost_trainer_host_is_named_by_heartbeats_not_pids_and_inference_keeps_serving(fresh_hosts, tmp_path):
    """Every process of the trainers' host is SIGKILLed at once (a node lost) after the inference
    host served version 2. Each host has its own pid namespace, so the two hosts' ranks have the
    same pids: a pid means nothing across hosts. Liveness across hosts is the peers' connections
    (closed by the kernel when the processes die) and their heartbeat counters in the group's store
    (here on the inference host): the inference ranks get a PeerDiedError naming a trainer rank,
    and still serve their last complete version, bit for bit (checked by the ranks)."""
    hosts = fresh_hosts(2, pid_namespace=True)
    # Versions enough for 100 s of publishing (pace 0.05 s): host0 is lost after version 2, however
    # long this process waits for a CPU before it looks (with 200, a stall of 10 s would let the
    # trainers finish first, and no host would be lost).
    versions = 2000
    sc = dict(src={"w": Layout((64, 64), [2, 3], [Shard(0)])}, dst={"w": Layout((64, 64), [0, 1], [Replicate()])},
              trainers=[2, 3], inference=[0, 1], versions=versions, pace=0.05, peer_timeout=3, mark=str(tmp_path))

    def lose_host0(h, stop):
        deadline = time.monotonic() + 120
        while not all((tmp_path / f"{r}.2").exists() for r in (0, 1)):
            assert time.monotonic() < deadline, "the inference ranks never served version 2"
            time.sleep(0.05)
        lost = time.time()
        h.kill(0)
        return lost

    res = _on_hosts(hosts, sc, [1, 1, 0, 0], victims=[2, 3], during=lose_host0)
    for r in (0, 1):
        who, msg = res[r]["died"]
        assert who in (2, 3) and f"rank {who}" in msg, msg
        assert 2 <= res[r]["version"] < versions
        # Noticed and closed, not waited out: the wait timeout is 60 s, and the store's host (rank 0)
        # no longer waits at close for the lost ranks it never exchanged bytes with.
        assert res[r]["end"] - res["during"] < 60, (r, res[r]["died_at"] - res["during"], res[r]["end"] - res["during"])
        assert res[r]["leftover"] == []
    assert res[0]["pid"] != res[1]["pid"]              # one host's ranks: one pid namespace
    assert hosts.shm_files(1) == []


# ================================================================ bench --hosts
def test_bench_hosts_placement_and_bad_values():
    from tritonreshard.apps.bench import BenchConfig
    cfg = BenchConfig(layout="cols-replicas", trainers=2, inference=5, hosts=3)
    assert [cfg.host_of(r) for r in range(7)] == ["host0", "host0", "host1", "host1", "host1", "host2", "host2"]
    assert BenchConfig(hosts=1).host_of(0) is None
    assert any("--hosts=0" in p for p in BenchConfig(hosts=0).problems())
    assert any("colocated" in p for p in BenchConfig(layout="colocated", hosts=2).problems())
    assert any("--inference=1" in p for p in BenchConfig(inference=1, hosts=3).problems())


def test_bench_two_hosts_columns_to_replicas_crosses_the_model_once():
    from tritonreshard.apps.bench import BenchConfig, BenchSession
    cfg = BenchConfig(size=1 << 20, layout="cols-replicas", trainers=2, inference=4, hosts=2, timeout=120)
    with BenchSession(cfg) as s:
        r = s.refits("tritonreshard", 2, verify=True)
        assert r["verified"]
        model = s.model_bytes
        assert s.cross_host_bytes() == model           # the engine's own accounting
        base = s.baseline_cross_host_bytes()
        assert base["p2p"] == 4 * model and base["gather_broadcast"] == 4 * model
        assert s.refits("p2p", 1, verify=True)["verified"]
