"""``delta="auto"`` weighs the link against detection (issue 41, item 3): per transfer, whole where
finding what changed would cost more than sending every byte, the delta where it costs less.

The decision is the sender's :class:`~tritonreshard.transport.LinkModel`'s, from measured speeds;
here the speeds are given (starting figures) and the clock is injected, so nothing depends on how
fast this machine is: no test reads a wall clock. The wire test runs a real gloo pair on two hosts of
the host harness (tritonreshard.apps.hosts: a network, /dev/shm and hostname each) with a frozen
model (its clock stands still, so what it measures is never counted) and checks what crossed.
"""
import datetime
import json

import pytest
import torch
import torch.distributed as dist
from _mp import free_port

import tritonreshard as trs
from tritonreshard import Layout, Replicate
from tritonreshard.engine.crosshost import LINK_GBPS_ENV, simulated_link_gbps
from tritonreshard.planning import plan_hosts, plan_messages
from tritonreshard.transport import CrossHostCopy, DistLink, LinkModel
from tritonreshard.transport import delta as dc

pytestmark = pytest.mark.timeout(120)

MiB = 1 << 20
N = 64 * MiB                     # a transfer's bytes: over min_bytes, so the speeds decide
FAST = dict(link_bps=5e9, detect_bps=0.3e9)      # loopback on a CPU: the link outruns detection
SLOW = dict(link_bps=0.125e9, detect_bps=0.3e9)  # 1 Gbit/s: detection (3.3 s/GB) beats sending


# ---------------------------------------------------------------- the rule
def test_fast_link_whole_slow_link_delta():
    fast, slow = LinkModel(**FAST), LinkModel(**SLOW, fraction=0.03)
    assert not fast.prefers_delta(N) and slow.prefers_delta(N)
    assert not trs.Delta().sends_delta(0, fast, N) and not trs.Delta().wants_delta(fast, N)
    assert trs.Delta().sends_delta(0, slow, N) and trs.Delta().wants_delta(slow, N)
    # The delta's own bytes count: detect * (1 - f) against the link.
    edge = LinkModel(link_bps=0.2e9, detect_bps=0.3e9, fraction=0.3)     # 0.21 > 0.2: delta
    worse = LinkModel(link_bps=0.2e9, detect_bps=0.3e9, fraction=0.4)    # 0.18 < 0.2: whole
    assert edge.prefers_delta(N) and not worse.prefers_delta(N)
    assert not trs.Dense().sends_delta(0, slow, N) and not trs.Dense().wants_delta(slow, N)


def test_force_always_sends_deltas_and_encodes_sparse():
    fast = LinkModel(**FAST)
    always = trs.Delta(force=True)
    assert always.sends_delta(0, fast, N) and always.wants_delta(fast, N)
    new = torch.arange(4096, dtype=torch.int16).view(torch.uint8)
    assert always.encode(new, torch.zeros_like(new), 2).kind != dc.DENSE   # every word changed: still sparse
    assert trs.Delta().encode(new, torch.zeros_like(new), 2).kind == dc.DENSE


def test_the_anchor_still_decides():
    slow = LinkModel(**SLOW)
    for codec in (trs.Delta(anchor=3), trs.Delta(anchor=3, force=True)):
        assert codec.sends_delta(1, slow, N) and not codec.sends_delta(2, slow, N)
        assert codec.wants_delta(slow, N)    # an anchor is due, but the sender keeps its base
    assert not trs.Delta(anchor=1).sends_delta(0, slow, N)
    assert trs.Delta(anchor=3).sends_delta(1) and not trs.Delta(anchor=3).sends_delta(2)   # no model: bytes decide


def test_small_transfers_are_not_weighed():
    fast = LinkModel(**FAST)
    assert fast.prefers_delta(MiB - 1) and not fast.prefers_delta(MiB)
    assert LinkModel(**FAST, min_bytes=0).prefers_delta(0) is False


# ---------------------------------------------------------------- what it measures, in order
def test_measurements_in_the_order_refits_give_them():
    m = LinkModel(window=4, reprobe=5)   # the times are given: its clock is never read
    assert not m.prefers_delta(N) and m.link_bps is None          # nothing known: whole, to measure the link
    m.whole_sent(N, 10.0)                                          # the first send: the connection, not counted
    assert m.link_bps is None and not m.prefers_delta(N)
    m.whole_sent(N, N / 5e9)                                       # 5 GB/s
    assert m.link_bps == pytest.approx(5e9) and m.detect_bps is None
    assert m.prefers_delta(N)                                      # detection unknown: a delta, to measure it
    m.delta_encoded(N, N / 0.2e9, N // 40)                         # the first encode: cold, its time not counted
    assert m.detect_bps is None and m.fraction == pytest.approx(0.025, abs=1e-3) and m.prefers_delta(N)
    m.delta_encoded(N, N / 0.3e9, N // 40)
    assert m.detect_bps == pytest.approx(0.3e9) and m.fraction == pytest.approx(0.025, abs=1e-3)
    assert not m.prefers_delta(N)                                  # 0.29 GB/s < 5 GB/s: whole from now on
    for _ in range(4):
        m.whole_sent(N, N / 5e9)
        assert not m.prefers_delta(N)
    m.whole_sent(N, N / 5e9)                                       # reprobe=5 wholes in a row: measure again
    assert m.prefers_delta(N)
    m.delta_encoded(N, N / 0.3e9, N // 40)
    assert not m.prefers_delta(N)
    # The link slows down (medians of the last 4): the delta wins once most recent sends say so.
    for _ in range(2):
        m.whole_sent(N, N / 0.1e9)
    assert not m.prefers_delta(N)
    m.whole_sent(N, N / 0.1e9)
    assert m.link_bps == pytest.approx(0.1e9) and m.prefers_delta(N)
    assert "LinkModel(link 0.1 GB/s, detection 0.3 GB/s" in repr(m)


def test_the_first_encode_is_not_counted_as_detection():
    """A sender's first delta encode faults in the encoder's working memory (later ones reuse it):
    counted, that cold time made detection look 1.4x slower than it is, and across a link about as
    fast as detection ``auto`` kept sending whole where the delta paid. Its fraction is exact and
    counts; a starting detection figure (nothing to measure first) counts the first encode too."""
    link = 0.19e9                                   # a 3 Gbit/s link shared by two senders
    m = LinkModel(link_bps=link)
    assert m.prefers_delta(N)                       # detection unknown: a delta, to measure it
    m.delta_encoded(N, N / 0.19e9, N // 25)         # cold: as slow as the link
    assert m.detect_bps is None and m.fraction == pytest.approx(0.04) and m.prefers_delta(N)
    m.delta_encoded(N, N / 0.3e9, N // 25)          # warm: 0.3 GB/s * (1 - 0.04) > 0.19: the delta pays
    assert m.detect_bps == pytest.approx(0.3e9) and m.prefers_delta(N)
    counted = LinkModel(link_bps=link, detect_bps=0.3e9)
    counted.delta_encoded(N, N / 0.1e9, N // 25)
    assert counted.detect_bps == pytest.approx(0.1e9) and not counted.prefers_delta(N)
    small = LinkModel(link_bps=link)                # under min_bytes: neither counted nor warming up
    small.delta_encoded(100, 1.0, 1)
    small.delta_encoded(N, N / 0.3e9, N // 25)
    assert small.detect_bps is None


def test_the_receivers_apply_counts_in_detection():
    """A delta also costs its apply (the receiver writes it into its buffer before its readers
    pull; the sender does the same to its snapshot and times it). With encodes near a 10 Gbit/s
    link's speed, leaving the apply out chose deltas that lost (measured: 107 ms against 67 ms
    whole); counted, the same figures send whole. An apply of another size or without a counted
    encode changes nothing."""
    link = 1.0e9                                    # a 10 Gbit/s link, as refits measure it
    m = LinkModel(link_bps=link, detect_bps=1.2e9)
    m.delta_encoded(N, N / 1.2e9, N // 25)          # encode alone: 1.2 * 0.96 > 1.0, the delta
    assert m.prefers_delta(N)
    m.delta_applied(N, N / 4e9)                     # plus the apply: 1 / (1/1.2 + 1/4) = 0.92 GB/s
    assert m.detect_bps == pytest.approx(1 / (1 / 1.2e9 + 1 / 4e9)) and not m.prefers_delta(N)
    m.delta_applied(N, N / 4e9)                     # applied once only
    assert m.detect_bps == pytest.approx(1 / (1 / 1.2e9 + 1 / 4e9))
    other = LinkModel(link_bps=link, detect_bps=1.2e9)
    other.delta_encoded(N, N / 1.2e9, N // 25)
    other.delta_applied(N // 2, 1.0)                # not the encode's size: ignored
    assert other.detect_bps == pytest.approx(1.2e9)
    cold = LinkModel(link_bps=link)
    cold.delta_encoded(N, 1.0, N // 25)             # the first encode is not counted, nor its apply
    cold.delta_applied(N, 1.0)
    assert cold.detect_bps is None


def test_sizes_under_min_bytes_and_zero_times_are_not_counted():
    m = LinkModel(**FAST)
    m.whole_sent(MiB - 1, 1.0)
    m.whole_sent(N, 0.0)
    m.delta_encoded(100, 1.0, 1)
    assert m.link_bps == 5e9 and m.detect_bps == 0.3e9


def test_bad_link_model_names_every_problem():
    with pytest.raises(ValueError, match=r"LinkModel: link_bps must be None or bytes/s > 0, got link_bps=0; "
                                         r"detect_bps must be None or bytes/s > 0, got detect_bps='x'; "
                                         r"fraction must be in \[0, 1\].*got fraction=2; "
                                         r"window must be an int >= 1, got window=0; min_bytes must be an int >= 0, "
                                         r"got min_bytes=-1; reprobe must be an int >= 1, got reprobe=True; "
                                         r"clock must be a callable"):
        LinkModel(link_bps=0, detect_bps="x", fraction=2, window=0, min_bytes=-1, reprobe=True, clock=3)


def test_simulated_link_rate_hook(monkeypatch):
    monkeypatch.delenv(LINK_GBPS_ENV, raising=False)
    assert simulated_link_gbps() is None
    for text, want in (("2.5", 2.5), ("inf", None), ("", None)):
        monkeypatch.setenv(LINK_GBPS_ENV, text)
        assert simulated_link_gbps() == want
    for text in ("0", "-1", "fast", "nan"):
        monkeypatch.setenv(LINK_GBPS_ENV, text)
        with pytest.raises(ValueError, match=rf"\$TRITONRESHARD_SIMULATED_LINK_GBPS must be gigabits/s > 0.*{text!r}"):
            simulated_link_gbps()
    with pytest.raises(ValueError, match=r"simulated_gbps must be None or gigabits/s > 0, got simulated_gbps=0"):
        DistLink(None, rank=0, world_size=1, simulated_gbps=0)


# ---------------------------------------------------------------- on the wire
def _wire(rank, addr, port, figures, force, versions):
    rows, cols = 256, 2048           # 1 MiB of bf16: as large as min_bytes, so the figures decide
    src = {"w": Layout((rows, cols), [0], [Replicate()], torch.bfloat16)}
    dst = {"w": Layout((rows, cols), [1], [Replicate()], torch.bfloat16)}
    plan = trs.plan_reshard(src, dst)
    hp = plan_hosts(plan, {0: "host0", 1: "host1"}, src_offsets={(0, "w"): 0})
    store = dist.TCPStore(addr, port, 2, rank == 0, timeout=datetime.timedelta(seconds=30))
    link = DistLink(store, rank=rank, world_size=2, timeout=20.0, prefix="delta-auto/")
    arena = torch.zeros(rows * cols * 2, dtype=torch.uint8)
    recv = torch.full((hp.buffer_bytes.get(1, 0),), 0xA5, dtype=torch.uint8)
    model = LinkModel(**figures, fraction=0.01, clock=lambda: 0.0)   # frozen: measures nothing
    copy = CrossHostCopy(link, plan_messages(hp, {(0, "w"): 0}), hp.transfers,
                         arena=arena if rank == 0 else None, shard={"w": arena.view(torch.bfloat16).view(rows, cols)},
                         recv_buffer=recv if rank == 1 else None, codec=trs.Delta(anchor=64, force=force),
                         link_model=model)
    seen = []
    first = (torch.randn(rows, cols, generator=torch.Generator().manual_seed(7)) * 0.02).to(torch.bfloat16)
    for v in range(1, versions + 1):
        w = first.clone()
        w.view(-1)[:1000 * v] = v      # version v changes 1000 elements of version v - 1
        if rank == 0:
            arena.view(torch.bfloat16).copy_(w.view(-1))
            d = copy.prepare_sends(v, {1: v - 1})    # the receiver holds the last version whole
            store.set(f"d/{v}", json.dumps(d[1]))
            copy.start_sends(v).wait()
            copy.commit_sends()
            seen.append((d[1]["base"], copy.snapshot_bytes))
        else:
            d = json.loads(store.get(f"d/{v}"))
            copy.start_recvs({0: d}).wait()
            copy.check_headers(v)
            copy.apply()
            assert torch.equal(recv[:arena.numel()], w.view(-1).view(torch.uint8)), v
            seen.append((copy.last_received["delta_bytes"], copy.last_received["dense_bytes"]))
    store.set(f"done/{rank}", "1")
    if rank == 0:
        store.wait(["done/1"], datetime.timedelta(seconds=30))
    link.close()
    return seen


@pytest.mark.parametrize("figures,force,deltas", [(FAST, False, False), (SLOW, False, True), (FAST, True, True)],
                         ids=["fast-link-whole", "slow-link-delta", "fast-link-always"])
def test_auto_on_the_wire(figures, force, deltas, two_hosts):
    versions, whole = 4, 256 * 2048 * 2
    res = two_hosts.run_ranks(_wire, [0, 1], args=(two_hosts.address(0), free_port(), figures, force, versions),
                              timeout=90)
    sender, receiver = res[0], res[1]
    assert sender[0][0] == 0 and receiver[0] == (0, whole)      # the first transfer: whole (no base)
    for v in range(1, versions):
        if deltas:   # against the version before, a few % of the bytes
            assert sender[v][0] == v and receiver[v][1] == 0 and 0 < receiver[v][0] < 0.1 * whole, (v, res)
        else:        # whole, and the sender keeps no snapshot it would not use
            assert sender[v] == (0, 0) and receiver[v] == (0, whole), (v, res)
    assert all(s[1] == (whole if deltas else 0) for s in sender)
