"""The one replica/balance core (tritonreshard.planning.replicas): both planners take its knobs, and
its balancers cover every byte exactly once within the balance they document."""
import contextlib
import dataclasses

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tritonreshard as trs
from tritonreshard import Layout, Replicate, Shard
from tritonreshard.planning import plan_hosts, replicas
from tritonreshard.planning.replicas import Knobs, Loads, Piece, cut_runs, group_replicas, spread


@contextlib.contextmanager
def knobs(**kw):
    """Both planners on other knobs for a while (a context, so that hypothesis tests can use it too:
    a function-scoped monkeypatch would be shared between examples)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(replicas, "KNOBS", Knobs(**kw))
        yield


def test_knobs_are_one_frozen_documented_set():
    assert replicas.KNOBS == Knobs(min_split_bytes=4096, slack=1.05)
    with pytest.raises(dataclasses.FrozenInstanceError):
        replicas.KNOBS.slack = 2.0
    for bad in (dict(min_split_bytes=0), dict(min_split_bytes=1.5), dict(slack=0.9)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            Knobs(**bad)


# DP=2 x FSDP=2 trainers on host a; each 512 KiB row shard has a replica in each DP group.
SRC = {"w": Layout((4096, 64), [[0, 1], [2, 3]], [Replicate(), Shard(0)])}
HOSTS = {0: "a", 1: "a", 2: "a", 3: "a", 4: "b", 5: "b", 6: "b", 7: "b"}


def _reshard_reads():
    """Bytes each trainer serves when one rank on b reads the whole tensor."""
    return trs.plan_reshard(SRC, {"w": Layout((4096, 64), [4], [Replicate()])}).stats.send_bytes


def _host_plan():
    return plan_hosts(trs.plan_reshard(SRC, {"w": Layout((4096, 64), [4, 5, 6, 7], [Replicate()])}), HOSTS)


def test_both_planners_take_their_knobs_from_the_one_place():
    half, quarter = 2048 * 64 * 4, 1024 * 64 * 4
    # Default knobs: the reshard planner reads each shard from both of its replicas; the host plan
    # has all four trainers send a quarter of the tensor, one contiguous box to each receiver.
    assert _reshard_reads() == {0: quarter, 1: quarter, 2: quarter, 3: quarter}
    hp = _host_plan()
    assert sorted((t.src_rank, t.receiver, t.nbytes) for t in hp.transfers) == [
        (0, 4, quarter), (1, 5, quarter), (2, 6, quarter), (3, 7, quarter)]
    # Parts must be at least 1 MiB: nothing is cut. One replica per shard reads / sends it all (the
    # reshard planner rotates the shards over the DP groups), and each 512 KiB box lands whole on
    # one receiver.
    with knobs(min_split_bytes=1 << 20):
        assert _reshard_reads() == {0: half, 3: half}
        hp = _host_plan()
        assert sorted((t.src_rank, t.nbytes) for t in hp.transfers) == [(0, half), (1, half)]
        assert sorted(hp.buffer_bytes.values()) == [half, half]
    # One sender, so only the receiver runs can react: the 1 MiB shard is cut into one run per
    # receiver, unless parts must be 1 MiB.
    plan = trs.plan_reshard({"w": Layout((4096, 64), [0], [Replicate()])},
                            {"w": Layout((4096, 64), [4, 5, 6, 7], [Replicate()])})
    assert plan_hosts(plan, HOSTS).buffer_bytes == {4: quarter, 5: quarter, 6: quarter, 7: quarter}
    with knobs(min_split_bytes=1 << 20):
        assert plan_hosts(plan, HOSTS).buffer_bytes == {4: 4 * quarter}
    # A huge slack: keeping a piece whole on one replica is always good enough, in both planners.
    with knobs(slack=100.0):
        assert _reshard_reads() == {0: half, 3: half}
        assert sorted((t.src_rank, t.nbytes) for t in _host_plan().transfers) == [(0, half), (1, half)]
    # And back: the reshard planner's cache is keyed on the knobs, so nothing stale comes back.
    assert _reshard_reads() == {0: quarter, 1: quarter, 2: quarter, 3: quarter}


def test_group_replicas_by_identical_regions_skipping_empty_shards():
    lay = Layout((3, 4), [[0, 1, 2, 3], [4, 5, 6, 7]], [Replicate(), Shard(0)])   # rank 3 and 7: no rows
    groups = group_replicas({r: lay.segments(r) for r in lay.ranks})
    assert sorted(groups.values()) == [(0, 4), (1, 5), (2, 6)]


def test_spread_counts_pieces_without_a_choice_first():
    # Rank 0 must serve the small piece; the big one, which 0 or 1 could serve, goes to 1 even
    # though it is placed first (biggest first) and 0 is the lower rank.
    out = spread([Piece((0, 1), 4096, 1, ("big",)), Piece((0,), 512, 1, ("small",))], Loads())
    assert out == [((1, 1),), ((0, 1),)]


def test_spread_cuts_only_when_the_slack_is_exceeded_and_never_below_min_split():
    k = Knobs(min_split_bytes=100, slack=1.05)
    loads = Loads()
    assert spread([Piece((0, 1), 1000, 10)], loads, k) == [((0, 5), (1, 5))]
    assert loads.as_dict() == {0: 500, 1: 500}
    # 199 bytes cannot be cut into two parts of 100: whole, whatever the imbalance.
    assert spread([Piece((0, 1), 199, 199)], Loads(), k) == [((0, 199),)]
    # 1200 bytes over 4 replicas with parts of at least 400: 3 parts.
    out = spread([Piece((0, 1, 2, 3), 1200, 12)], Loads(), Knobs(min_split_bytes=400))
    assert [u for _, u in out[0]] == [4, 4, 4]


replica_sets = st.lists(st.integers(0, 5), min_size=1, max_size=4, unique=True).map(lambda r: tuple(sorted(r)))


@st.composite
def pieces(draw, sets=replica_sets):
    extent = draw(st.integers(1, 40))
    unit = draw(st.integers(1, 64))
    return Piece(draw(sets), extent * unit, extent, (draw(st.integers(0, 3)),))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ps=st.lists(pieces(), max_size=30), start=st.dictionaries(st.integers(0, 5), st.integers(0, 2000)),
       min_split=st.integers(1, 300), slack=st.floats(1.0, 1.5))
def test_property_spread_serves_every_unit_once_from_its_own_replicas(ps, start, min_split, slack):
    loads = Loads()
    for r, b in start.items():
        loads.add(r, b)
    out = spread(ps, loads, Knobs(min_split, slack))
    assert len(out) == len(ps)
    served = dict(start)
    for p, shares in zip(ps, out, strict=True):
        assert sum(u for _, u in shares) == p.extent and all(u > 0 for _, u in shares), (p, shares)
        assert len({r for r, _ in shares}) == len(shares) and {r for r, _ in shares} <= set(p.replicas)
        if len(shares) > 1:   # a cut piece is cut into parts of min_split bytes on average at least
            assert p.nbytes >= len(shares) * min_split
        for r, u in shares:
            served[r] = served.get(r, 0) + u * (p.nbytes // p.extent)
    assert loads.as_dict() == dict(sorted(served.items()))
    assert spread(ps, Loads(), Knobs(min_split, slack)) == spread(ps, Loads(), Knobs(min_split, slack))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(k=st.integers(1, 5), data=st.data(), min_split=st.integers(1, 300), slack=st.floats(1.0, 1.5))
def test_property_spread_stays_within_its_documented_slack(k, data, min_split, slack):
    group = tuple(range(k))
    ps = data.draw(st.lists(pieces(st.just(group)), min_size=1, max_size=30))
    loads = Loads()
    spread(ps, loads, Knobs(min_split, slack))
    fair = sum(p.nbytes for p in ps) / k
    excess = max(p.nbytes // p.extent if p.extent >= k and p.nbytes >= k * min_split else p.nbytes for p in ps)
    assert max(loads[r] for r in group) <= slack * fair + excess + 1e-6 * fair, (loads.as_dict(), fair, excess)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(items=st.lists(st.tuples(st.integers(1, 64), st.integers(1, 40)), max_size=30),
       n_runs=st.integers(1, 6), min_split=st.integers(1, 300), slack=st.floats(1.0, 1.5))
def test_property_cut_runs_cover_every_unit_once_in_order(items, n_runs, min_split, slack):
    sizes = [(unit * extent, extent) for unit, extent in items]
    parts = cut_runs(sizes, n_runs, Knobs(min_split, slack))
    # Items in order, each one's units covered once by consecutive parts, runs never going back.
    item, unit_at = 0, 0
    for i, u0, u1, run in parts:
        assert (i, u0) == (item, unit_at) and u1 > u0 and 0 <= run < n_runs, parts
        item, unit_at = (item + 1, 0) if u1 == sizes[i][1] else (item, u1)
    assert item == len(sizes)
    assert [run for *_, run in parts] == sorted(run for *_, run in parts)
    # An item is cut only where both sides get min_split bytes (give or take the unit the cut
    # rounds down to).
    for i, (nbytes, extent) in enumerate(sizes):
        cut = [(u1 - u0) * (nbytes // extent) for j, u0, u1, _ in parts if j == i]
        if len(cut) > 1:
            assert all(b >= min_split - nbytes // extent for b in cut) and cut[-1] >= min_split, cut
