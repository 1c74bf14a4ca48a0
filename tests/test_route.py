"""Routes: one code path for one host and many.

A rank's route comes from the plan, the host map and the arenas' offsets. On one host it has no
transfers and reads exactly the plan's ops for the rank; across hosts its reads come from source
arenas and relay buffers on its own host, and together the ranks' routes still write every
destination element exactly once. Cross-host readiness travels as store signals that wake a
doorbell (no polling).
"""
import datetime
import threading
import time

import torch
import torch.distributed as dist

import tritonreshard as trs
from tritonreshard import Layout, Replicate, Shard
from tritonreshard.engine.relay import Signals
from tritonreshard.engine.route import BufferRef, build_route
from tritonreshard.transport import pack_offsets
from tritonreshard.transport.wait import wait_until

from _mp import free_port


def _offsets(plan):
    """Each source rank's shards packed in name order (what an arena's offsets look like)."""
    out = {}
    for r in plan.src_ranks:
        names = [n for n in plan.names if r in plan.src_layouts[n].ranks]
        offs, _ = pack_offsets([plan.src_layouts[n].local_numel(r) * plan.src_layouts[n].itemsize for n in names])
        out.update({(r, n): o for n, o in zip(names, offs)})
    return out


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
    routes = {r: build_route(plan, hosts, r, _offsets(plan)) for r in range(6)}
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
    routes = {r: build_route(plan, hosts, r, _offsets(plan)) for r in range(6)}
    assert all(route.spans_hosts for route in routes.values())
    for route in routes.values():
        for read in route.reads:  # ranks never map memory of another host
            assert hosts[read.buffer.owner] == route.host
    assert all(bool((c == 1).all()) for c in _covered(plan, routes).values())
    # What crosses, crosses once, and each sender's sends are some receiver's receives.
    sent = sorted(t.index for r in routes.values() for t in r.sends)
    received = sorted(t.index for r in routes.values() for t in r.receives)
    assert sent == received == list(range(len(routes[0].transfers)))
    assert sum(t.nbytes for r in routes.values() for t in r.receives) == 8 * 8 * 4
    for route in routes.values():
        for t in route.receives:
            assert route.rank in routes[t.src_rank].receivers and t.src_rank in route.senders
        assert route.fenced == ()  # trainers' readers are all on the other host: their relays stand in
        if route.buffer_bytes:
            assert "relays" in str(route)


def test_signals_wake_a_doorbell_and_close_ends_the_popping_thread():
    store = dist.TCPStore("127.0.0.1", free_port(), 1, True, datetime.timedelta(seconds=30))
    a, b = Signals(store, 0), Signals(store, 1)
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
        assert woke - t0 >= 0.15 and woke - seen[0] < 0.5
        assert b.get("ready", 0, 1) == "v7" and not b.has("ready", [0], 2)
    finally:
        a.close()
        b.close()
    assert not a._thread.is_alive() and not b._thread.is_alive()
