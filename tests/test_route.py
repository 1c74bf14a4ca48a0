"""Routes: one code path for one host and many.

A rank's route comes from its rank plan (``trs.planning.plan_rank``: the group's layouts and host
map), the arenas' offsets and, across hosts, what the other hosts' parts have it send. On one host it has no
transfers and reads exactly the plan's ops for the rank; across hosts its reads come from source
arenas and relay buffers on its own host, and together the ranks' routes still write every
destination element exactly once. Cross-host readiness travels as store signals that wake a
doorbell (no polling).
"""
import datetime
import threading
import time

import pytest
import torch
import torch.distributed as dist
from _mp import free_port

import tritonreshard as trs
from tritonreshard import Layout, Replicate, Shard
from tritonreshard.engine.crosshost import Signals
from tritonreshard.planning import BufferRef, host_outbox, plan_hosts, plan_messages, plan_rank
from tritonreshard.transport import pack_offsets
from tritonreshard.transport.wait import wait_until


def _offsets(plan):
    """Each source rank's shards packed in name order (what an arena's offsets look like)."""
    out = {}
    for r in plan.src_ranks:
        names = [n for n in plan.names if r in plan.src_layouts[n].ranks]
        offs, _ = pack_offsets([plan.src_layouts[n].local_numel(r) * plan.src_layouts[n].itemsize for n in names])
        out.update({(r, n): o for n, o in zip(names, offs, strict=True)})
    return out


def routes_of(src, dst, hosts, offsets, parts=None):
    """Every rank's route as the set-up script derives them: each rank plans its own part, each host
    posts its part's transfers, and each rank takes only the summaries and its own sends."""
    rps = {r: plan_rank(src, dst, hosts, r, parts=parts) for r in sorted(hosts)}
    parts = {r: rp.host_part(offsets) for r, rp in rps.items()}
    boxes = {}
    for r, rp in rps.items():
        boxes.setdefault(rp.host, host_outbox(parts[r], rp.host))
    out = {}
    for r, rp in rps.items():
        others = {h: b[0] for h, b in boxes.items() if h != rp.host}
        sends = {h: b[1][r] for h, b in boxes.items() if h != rp.host and r in b[1]}
        out[r] = rp.route(offsets, parts[r], others, sends)
    return out


def reference_route(plan, hosts, rank, offsets) -> dict:
    """What one rank's route was before rank plans: the whole plan's host plan, read for ``rank``
    (reads from arenas, then from relay buffers; its fences, sends, receives and messages)."""
    hp = plan_hosts(plan, hosts, src_offsets=offsets)
    src = plan.src_layouts
    reads = [(op, BufferRef("arena", op.src_rank), offsets[(op.src_rank, op.src_name)],
              src[op.src_name].local_shape(op.src_rank), src[op.src_name].dtype) for op in hp.local_ops_for_dst(rank)]
    for f in hp.fanout_for_dst(rank):
        t = hp.transfer(f.transfer)
        reads.append((f.op, BufferRef("relay", t.receiver), t.offset, t.shape, t.dtype))
    return dict(spans_hosts=bool(hp.transfers), reads=reads, fills=plan.fills_for_dst(rank),
                fenced=hp.local_readers_of(rank), sends=hp.sends_of(rank), receives=hp.recvs_of(rank),
                buffer_bytes=hp.buffer_bytes.get(rank, 0), buffer_readers=hp.buffer_readers(rank),
                messages=tuple(m for m in plan_messages(hp, offsets) if rank in (m.sender, m.receiver)))


def assert_route_is(route, ref: dict) -> None:
    got = dict(spans_hosts=route.spans_hosts,
               reads=[(x.op, x.buffer, x.offset, x.shape, x.dtype) for x in route.reads],
               **{k: getattr(route, k) for k in ref if k not in ("spans_hosts", "reads")})
    for k in ref:
        assert got[k] == ref[k], (route.rank, k)


def _covered(plan, routes):
    """``{(dst rank, name): int tensor}`` counting how often each destination element is written."""
    count = {(r, n): torch.zeros(lay.local_shape(r), dtype=torch.int32)
             for n, lay in plan.dst_layouts.items() for r in lay.ranks}
    for route in routes.values():
        for read in route.reads:
            count[(route.rank, read.op.name)][read.op.dst_slices] += 1
    return count


def test_one_host_is_a_route_without_transfers():
    src = {"w": Layout((8, 8), 2, [Shard(0)]), "b": Layout((5,), [0, 1], [Replicate()])}
    dst = {"w": Layout((8, 8), [2, 3, 4, 5], [Shard(1)]), "b": Layout((5,), [2, 3, 4, 5], [Replicate()])}
    plan = trs.plan_reshard(src, dst)
    hosts = {r: "a" for r in range(6)}
    routes = routes_of(src, dst, hosts, _offsets(plan))
    for r, route in routes.items():
        assert not route.spans_hosts and not route.sends and not route.receives and route.buffer_bytes == 0
        assert sorted(map(str, (x.op for x in route.reads))) == sorted(map(str, plan.ops_for_dst(r)))
        assert all(x.buffer == BufferRef("arena", x.op.src_rank) for x in route.reads)
        assert route.fenced == plan.readers_of(r)
    assert all(bool((c == 1).all()) for c in _covered(plan, routes).values())
    text = str(routes[2])
    assert text.startswith(f"rank 2@a: {len(plan.ops_for_dst(2))} read(s) from arena of rank 0, arena of rank 1"), text


def test_two_hosts_read_each_byte_once_and_only_from_their_own_host():
    src = {"w": Layout((8, 8), 2, [Shard(0)])}
    dst = {"w": Layout((8, 8), [2, 3, 4, 5], [Shard(1)])}
    plan = trs.plan_reshard(src, dst)
    hosts = {0: "a", 1: "a", 2: "b", 3: "b", 4: "b", 5: "b"}
    routes = routes_of(src, dst, hosts, _offsets(plan))
    assert all(route.spans_hosts for route in routes.values())
    for route in routes.values():
        for read in route.reads:  # ranks never map memory of another host
            assert hosts[read.buffer.owner] == route.host
    assert all(bool((c == 1).all()) for c in _covered(plan, routes).values())
    # What crosses, crosses once, and each sender's sends are some receiver's receives.
    sent = sorted(t.index for r in routes.values() for t in r.sends)
    received = sorted(t.index for r in routes.values() for t in r.receives)
    assert sent == received == list(range(len(trs.planning.plan_hosts(plan, hosts).transfers)))
    assert sum(t.nbytes for r in routes.values() for t in r.receives) == 8 * 8 * 4
    for route in routes.values():
        for t in route.receives:
            assert route.rank in routes[t.src_rank].receivers and t.src_rank in route.senders
        assert route.fenced == ()  # trainers' readers are all on the other host: their relays stand in
        if route.buffer_bytes:
            assert "relays" in str(route)


# A trainer replica on each host (re-sourced locally), shards crossing to several receivers, packed
# column boxes and a colocated rank: every case the host planner splits.
_SRC = {"w": Layout((12, 10), [0, 1, 2, 3], [Shard(0)]), "b": Layout((30,), [0, 1], [Shard(0)], torch.bfloat16),
        "r": Layout((8, 6), [0, 3], [Replicate()])}
_DST = {"w": Layout((12, 10), [3, 4, 5, 6], [Shard(1)]), "b": Layout((30,), [3, 4, 5, 6], [Replicate()]),
        "r": Layout((8, 6), [3, 4, 5, 6], [Shard(0)], torch.bfloat16)}


@pytest.mark.parametrize("hosts", [{r: "a" for r in range(7)},
                                   {0: "a", 1: "a", 2: "a", 3: "b", 4: "b", 5: "c", 6: "c"},
                                   {0: "a", 1: "b", 2: "c", 3: "a", 4: "b", 5: "c", 6: "a"},
                                   {0: "x", 1: "y", 2: "x", 3: "y", 4: "x", 5: "y", 6: "z"}],
                         ids=["one-host", "trainers-apart", "spread", "mixed"])
def test_a_rank_plan_routes_as_the_whole_plan_did(hosts):
    """``plan_rank`` plans a rank's part only (its ops and, across hosts, its host's destination
    ranks'), yet each rank's route is the one the whole plan's host plan gives it: its reads, fills,
    fences, sends, receives, buffer and messages."""
    plan = trs.plan_reshard(_SRC, _DST)
    offsets = _offsets(plan)
    routes = routes_of(_SRC, _DST, hosts, offsets)
    several = len(set(hosts.values())) > 1
    for r, route in routes.items():
        rp = plan_rank(_SRC, _DST, hosts, r)
        assert rp.several_hosts == several and rp.host == hosts[r]
        # Never an op between two ranks off its host: it planned its host, not the group.
        assert all(hosts[r] in (hosts[op.src_rank], hosts[op.dst_rank]) for op in rp.plan.ops)
        assert_route_is(route, reference_route(plan, hosts, r, offsets))
        # It knows its host's transfers and its own sends, nothing else.
        assert {t.index for t in route.transfers.values()} == (
            {t.index for t in plan_hosts(plan, hosts).transfers if t.dst_host == hosts[r] or t.src_rank == r})
    assert all(bool((c == 1).all()) for c in _covered(plan, routes).values())
    assert any(route.sends for route in routes.values()) == several


def test_a_rank_plans_its_buffer_order_and_fills():
    plan = trs.plan_reshard(_SRC, _DST)
    rp = plan_rank(_SRC, _DST, {r: "a" for r in range(7)}, 3)
    assert rp.src_order == tuple(trs.planning.tensor_order(plan, ["w", "r"]))
    assert rp.dst_order == tuple(trs.planning.tensor_order(plan, ["b", "r", "w"]))
    assert set(rp.dst_layouts) == {"w", "b", "r"} and rp.fills == plan.fills_for_dst(3)
    assert rp.plan.rank == 3 and rp.plan.ops == tuple(op for op in plan.ops if 3 in (op.src_rank, op.dst_rank))


def test_signals_wake_a_doorbell_and_close_ends_the_popping_thread():
    store = dist.TCPStore("127.0.0.1", free_port(), 1, True, datetime.timedelta(seconds=30))
    a, b = Signals(store, 0, send_timeout=10), Signals(store, 1, send_timeout=10)
    try:
        assert not b.has("ready", [0], 1)
        seen = []

        def send_later():
            time.sleep(0.2)
            seen.append(time.monotonic())
            a.send(1, "ready", 1, "v7")

        threading.Thread(target=send_later).start()
        t0 = time.monotonic()
        # Sleeps on the doorbell: woken by the signal, not by a poll period or a timeout.
        assert wait_until(lambda: b.has("ready", [0], 1), b.bell.doorbell, time.monotonic() + 10)
        woke = time.monotonic()
        # Bounds far from the failure (the 10 s deadline), so that a loaded machine's scheduling passes.
        assert woke - t0 >= 0.15 and woke - seen[0] < 3.0
        assert b.get("ready", 0, 1) == "v7" and not b.has("ready", [0], 2)
    finally:
        a.close()
        b.close()
    assert not a._thread.is_alive() and not b._thread.is_alive()


@pytest.mark.timeout(60)
def test_a_signal_never_queues_behind_another_call_on_the_groups_connection():
    """A store call in flight on the group's connection (a liveness look over a cut link, a wait for
    a key) holds that connection until the store's timeout; a signal sent meanwhile goes at once, on
    a connection of its own (a relay's "ready" once waited behind such a call for 60 s, and the
    close that joined the relay with it). A close told the store does not answer sends no stop."""
    port = free_port()
    master = dist.TCPStore("127.0.0.1", port, 1, True, datetime.timedelta(seconds=30), wait_for_workers=False)
    shared = dist.TCPStore("127.0.0.1", port, 1, False, datetime.timedelta(seconds=20))
    stuck = threading.Thread(target=shared.get, args=("never-set",), daemon=True)
    stuck.start()
    time.sleep(0.3)                      # the get holds the shared connection, waiting for its key
    sig = Signals(shared, 0, send_timeout=5)
    try:
        t0 = time.monotonic()
        sig.send(0, "ready", 1, "v1")
        assert time.monotonic() - t0 < 5.0   # queued behind the stuck get, it would take its 20 s
        assert wait_until(lambda: sig.has("ready", [0], 1), sig.bell.doorbell, time.monotonic() + 10)
        assert sig.get("ready", 0, 1) == "v1" and stuck.is_alive()
    finally:
        t0 = time.monotonic()
        sig.close(store_answers=False)
        assert time.monotonic() - t0 < 5.0   # a stop sent on the stuck connection would wait out its 20 s
    master.set("never-set", "1")         # the stuck call ends
    stuck.join(10)
    sig = Signals(shared, 1, send_timeout=5)
    sig.close()                          # a store that answers: the popping thread is stopped
    assert not sig._thread.is_alive()
