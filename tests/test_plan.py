"""Planner properties: exactly-once coverage with the right data, minimality, determinism, balance."""
import math
import time
from itertools import pairwise

import pytest
import torch
from _aliases import alias_copy
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tritonreshard as trs
from tritonreshard import Layout, Replicate, Shard

SIZES = [0, 1, 2, 3, 5, 7, 8, 13]


def apply_plan(plan, global_tensors):
    """Runs ``plan`` op by op on provenance data; returns {dst_rank: {name: (out, count)}}."""
    src_shards = {}
    for name, lay in plan.src_layouts.items():
        for r in lay.ranks:
            src_shards.setdefault(r, {})[name] = lay.shard(global_tensors[name], r)
    result = {}
    for name, lay in plan.dst_layouts.items():
        for r in lay.ranks:
            shape = lay.local_shape(r)
            result.setdefault(r, {})[name] = (torch.full(shape, -1, dtype=torch.int64),
                                              torch.zeros(shape, dtype=torch.int64))
    for op in plan.ops:
        out, count = result[op.dst_rank][op.name]
        src = src_shards[op.src_rank][op.name]
        assert src[op.src_slices].shape == out[op.dst_slices].shape, op
        out[op.dst_slices] = src[op.src_slices]
        count[op.dst_slices] += 1
    return result


def check_exactly_once(src_layouts, dst_layouts):
    plan = trs.plan_reshard(src_layouts, dst_layouts)
    globals_ = {n: torch.arange(math.prod(lay.shape), dtype=torch.int64).reshape(lay.shape)
                for n, lay in dst_layouts.items()}
    result = apply_plan(plan, globals_)
    for name, lay in dst_layouts.items():
        for r in lay.ranks:
            out, count = result[r][name]
            assert torch.all(count == 1), f"{name} on rank {r}: coverage {count.tolist()}"
            assert torch.equal(out, lay.shard(globals_[name], r)), f"{name} on rank {r}"
    # Minimal: the ops move exactly the destination elements, nothing more.
    assert sum(op.numel for op in plan.ops) == sum(
        lay.local_numel(r) for lay in dst_layouts.values() for r in lay.ranks)
    for op in plan.ops:
        assert all(s.step is None for s in op.src_slices + op.dst_slices)
        assert op.numel > 0
    return plan


@st.composite
def layouts(draw, shape=None, rank_pool=range(12)):
    if shape is None:
        ndim = draw(st.integers(1, 4))
        shape = tuple(draw(st.sampled_from(SIZES)) for _ in range(ndim))
    mesh_ndim = draw(st.integers(1, 3))
    mesh_shape = [draw(st.integers(1, 3)) for _ in range(mesh_ndim)]
    n = math.prod(mesh_shape)
    # Ranks come from a small pool so that source and destination meshes often overlap.
    pool = list(rank_pool) + list(range(100, 100 + max(0, n - len(rank_pool))))
    ranks = draw(st.permutations(pool))[:n]
    mesh = torch.tensor(ranks).reshape(mesh_shape).tolist()
    blocks = {}
    for d, size in enumerate(shape):
        if draw(st.booleans()):
            cuts = sorted(draw(st.lists(st.integers(0, size), min_size=1, max_size=2)))
            edges = [0, *cuts, size]
            blocks[d] = tuple(b - a for a, b in pairwise(edges))
    # Per tensor dim: torch.chunk splits, or numpy.array_split ones (balanced: vLLM's expert
    # placement); every mesh dim sharding one tensor dim splits it the same way.
    balanced = {d: draw(st.booleans()) for d in range(len(shape))}
    placements = []
    for _ in range(mesh_ndim):
        if draw(st.booleans()):
            placements.append(Replicate())
        else:
            d = draw(st.integers(0, len(shape) - 1))
            placements.append(Shard(d, blocks.get(d), balanced=balanced[d]))
    return Layout(shape, mesh, placements)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_exactly_once_random_layouts(data):
    src = data.draw(layouts())
    dst = data.draw(layouts(shape=src.shape))
    check_exactly_once({"t": src}, {"t": dst})


@settings(max_examples=50, deadline=None)
@given(data=st.data())
def test_exactly_once_several_tensors_and_colocated_meshes(data):
    srcs, dsts = {}, {}
    for i in range(data.draw(st.integers(1, 3))):
        srcs[f"t{i}"] = data.draw(layouts(rank_pool=range(4)))
        dsts[f"t{i}"] = data.draw(layouts(shape=srcs[f"t{i}"].shape, rank_pool=range(4)))
    srcs["unused"] = Layout((3,), 2, [Shard(0)])  # names no destination needs are fine
    plan = check_exactly_once(srcs, dsts)
    assert "unused" not in {op.name for op in plan.ops}


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), min_split=st.integers(1, 64), slack=st.sampled_from([1.0, 1.05, 1.5]))
def test_exactly_once_when_the_knobs_cut_small_pieces(data, min_split, slack):
    """The layouts above are too small for the default knobs to ever cut a replicated read: with
    tiny knobs the water-filling runs on every example, and coverage must stay exactly once."""
    from tritonreshard.planning import replicas

    src = data.draw(layouts())
    dst = data.draw(layouts(shape=src.shape))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(replicas, "KNOBS", replicas.Knobs(min_split_bytes=min_split, slack=slack))
        check_exactly_once({"t": src}, {"t": dst})


def test_seed_rows_to_columns_op_by_op():
    plan = trs.plan_reshard({"w": Layout((8, 8), 2, [Shard(0)])},
                            {"w": Layout((8, 8), [2, 3, 4, 5], [Shard(1)])})
    assert len(plan.ops) == 8
    got = {(op.src_rank, op.dst_rank): (op.src_slices, op.dst_slices) for op in plan.ops}
    for j, dst in enumerate([2, 3, 4, 5]):
        for src in (0, 1):
            assert got[(src, dst)] == ((slice(0, 4), slice(2 * j, 2 * j + 2)),
                                       (slice(4 * src, 4 * src + 4), slice(0, 2)))
    assert plan.stats.pair_bytes == {(s, d): 32 for s in (0, 1) for d in (2, 3, 4, 5)}
    assert plan.stats.local_bytes == 0 and plan.stats.total_bytes == 256
    check_exactly_once(plan.src_layouts, plan.dst_layouts)


def test_seed_columns_to_replicas_op_by_op():
    plan = trs.plan_reshard({"w": Layout((8, 8), 4, [Shard(1)])},
                            {"w": Layout((8, 8), [4, 5, 6, 7], [Replicate()])})
    assert len(plan.ops) == 16
    for op in plan.ops:
        assert op.src_slices == (slice(0, 8), slice(0, 2))
        assert op.dst_slices == (slice(0, 8), slice(2 * op.src_rank, 2 * op.src_rank + 2))
    assert {(op.src_rank, op.dst_rank) for op in plan.ops} == {(s, d) for s in range(4) for d in range(4, 8)}


def test_one_coalesced_op_per_overlapping_pair_without_blocks_or_replication():
    src = Layout((10, 9, 4), [[0, 1, 2], [3, 4, 5]], [Shard(0), Shard(1)])
    dst = Layout((10, 9, 4), [6, 7, 8, 9], [Shard(1)])
    plan = check_exactly_once({"x": src}, {"x": dst})
    pairs = [(op.src_rank, op.dst_rank) for op in plan.ops]
    assert len(pairs) == len(set(pairs))


def test_colocated_destination_copies_locally():
    src = Layout((8, 6), [[0, 1], [2, 3]], [Replicate(), Shard(0)])   # DP x FSDP
    dst = Layout((8, 6), [0, 1, 2, 3], [Replicate()])
    plan = check_exactly_once({"w": src}, {"w": dst})
    for op in plan.ops:
        if op.dst_rank in (0, 2):      # holds rows 0:4 itself
            assert op.is_local or op.global_index[0][0][0] >= 4
    assert plan.stats.local_bytes == sum(op.numel * 4 for op in plan.ops if op.is_local) > 0


@pytest.mark.parametrize("dst_mesh", [[8], [8, 9], [8, 9, 10, 11]])
def test_replicated_sources_spread_reads(dst_mesh):
    # DP=2 x FSDP=4 sources, every replica holds a quarter of the rows twice.
    src = Layout((256, 96), [[0, 1, 2, 3], [4, 5, 6, 7]], [Replicate(), Shard(0)])
    dst = Layout((256, 96), dst_mesh, [Shard(1)])
    plan = check_exactly_once({"w": src}, {"w": dst})
    send = plan.stats.send_bytes
    fair = plan.stats.total_bytes / 8
    assert set(send) == set(range(8)), send
    assert max(send.values()) <= 1.25 * fair, (send, fair)


def test_replicated_everywhere_balances_many_tensors():
    src = {f"n{i}": Layout((1024,), 8, [Replicate()]) for i in range(16)}
    dst = {f"n{i}": Layout((1024,), [8, 9, 10, 11], [Replicate()]) for i in range(16)}
    plan = check_exactly_once(src, dst)
    fair = plan.stats.total_bytes / 8
    assert max(plan.stats.send_bytes.values()) <= 1.25 * fair
    # Whole tensors were assigned: no needless splitting of small pieces.
    assert len(plan.ops) == 16 * 4


def test_packed_blocks_go_to_the_right_rank():
    h = 6
    src = Layout((2 * h, 4), 2, [Shard(0)])
    dst = Layout((2 * h, 4), [2, 3, 4], [Shard(0, blocks=(h, h))])
    check_exactly_once({"gate_up": src}, {"gate_up": dst})
    # Rank 3 holds gate rows 2:4 and up rows 8:10.
    assert dst.segments(3)[0] == ((2, 4, 0), (8, 10, 2))
    assert dst.local_shape(3) == (4, 4)


def test_matching_blocks_coalesce_into_one_op():
    lay = Layout((12, 4), 2, [Shard(0, blocks=(4, 4, 4))])
    plan = trs.plan_reshard({"qkv": lay}, {"qkv": Layout((12, 4), [2, 3], [Shard(0, blocks=(4, 4, 4))])})
    assert len(plan.ops) == 2
    assert plan.ops[0].global_index[0] == ((0, 2), (4, 6), (8, 10))


def test_deterministic_and_cached():
    def build():
        return ({"b": Layout((5, 7), 3, [Shard(1)]), "a": Layout((9,), [[0, 1], [2, 3]], [Replicate(), Shard(0)])},
                {"a": Layout((9,), [4, 5], [Shard(0)]), "b": Layout((5, 7), 2, [Replicate()])})
    s1, d1 = build()
    s2, d2 = build()
    d2 = dict(reversed(list(d2.items())))  # insertion order must not matter
    p1, p2 = trs.plan_reshard(s1, d1), trs.plan_reshard(s2, d2)
    assert p1 is p2
    assert p1.ops == p2.ops


def test_scalar_and_empty_tensors():
    check_exactly_once({"s": Layout((), 2, [Replicate()])}, {"s": Layout((), [3, 4], [Replicate()])})
    plan = check_exactly_once({"e": Layout((0, 5), 2, [Shard(0)])}, {"e": Layout((0, 5), [2, 3], [Shard(1)])})
    assert plan.ops == ()


def test_plan_prints_a_table():
    plan = trs.plan_reshard({"w": Layout((8, 8), 2, [Shard(0)])},
                            {"w": Layout((8, 8), [2, 3, 4, 5], [Shard(1)])})
    text = str(plan)
    assert "8 ops" in text and "0->2" in text and "src\\dst" in text
    assert "send: 0: 128 B, 1: 128 B" in text


def llama_layouts(layers=32, hidden=4096, inter=11008, vocab=32000, n_src=8, n_dst=8, dtype=torch.bfloat16):
    src, dst = {}, {}
    fsdp = list(range(n_src))
    tp = list(range(n_src, n_src + n_dst))

    def add(name, shape, dst_placement):
        src[name] = Layout(shape, fsdp, [Shard(0)], dtype)
        dst[name] = Layout(shape, tp, [dst_placement], dtype)

    add("embed", (vocab, hidden), Shard(0))
    for i in range(layers):
        p = f"layers.{i}."
        add(p + "qkv", (3 * hidden, hidden), Shard(0, blocks=(hidden,) * 3))
        add(p + "o", (hidden, hidden), Shard(1))
        add(p + "gate_up", (2 * inter, hidden), Shard(0, blocks=(inter, inter)))
        add(p + "down", (hidden, inter), Shard(1))
        add(p + "input_norm", (hidden,), Replicate())
        add(p + "post_norm", (hidden,), Replicate())
    add("norm", (hidden,), Replicate())
    add("lm_head", (vocab, hidden), Shard(0))
    return src, dst


def test_llama_7b_fsdp8_to_tp8_plans_fast_and_exactly_once():
    src, dst = llama_layouts()
    assert len(dst) == 195
    trs.planning.reshard._plan_cached.cache_clear()
    t0 = time.perf_counter()
    plan = trs.plan_reshard(src, dst)
    elapsed = time.perf_counter() - t0
    print(f"7B FSDP-8 -> TP-8: {len(plan.ops)} ops, planned in {elapsed * 1e3:.1f} ms")
    assert plan.stats.total_bytes == sum(lay.local_numel(r) * 2 for lay in dst.values() for r in lay.ranks)
    # Coverage is checked op-geometrically here (the tensors are too big for provenance data).
    for name, lay in dst.items():
        for r in lay.ranks:
            assert sum(op.numel for op in plan.ops_for_dst(r) if op.name == name) == lay.local_numel(r)


# -- parts: several sources into one destination, replicated boxes, zero padding --------------------

def _expected_from_parts(dst_lay, parts, globals_):
    """The destination's global tensor assembled from the parts (padding = 0), on provenance data."""
    full = torch.zeros(dst_lay.shape, dtype=torch.int64)
    for p in parts:
        bounds = [iv or (0, n) for iv, n in zip(p.dst, dst_lay.shape, strict=True)]
        box = tuple(slice(a, b) if iv is not None else slice(None)
                    for iv, (a, b) in zip(p.dst, bounds, strict=True))
        if p.src is None:
            continue
        start = p.src_start or (0,) * dst_lay.ndim
        ext = [full[box].shape[d] for d in range(dst_lay.ndim)]
        full[box] = globals_[p.sources[0]][tuple(slice(s, s + n) for s, n in zip(start, ext, strict=True))]
    return full


def check_parts_exactly_once(src_layouts, dst_layouts, parts):
    plan = trs.plan_reshard(src_layouts, dst_layouts, parts)
    offset, globals_ = 1, {}
    for n, lay in src_layouts.items():  # distinct, non-zero values in every source
        globals_[n] = torch.arange(offset, offset + math.prod(lay.shape), dtype=torch.int64).reshape(lay.shape)
        offset += math.prod(lay.shape)
    for p in (p for ps in parts.values() for p in ps):   # aliases are copies of one tensor
        for n in p.sources[1:]:
            globals_[n] = globals_[p.sources[0]]
    src_shards = {}
    for name, lay in plan.src_layouts.items():
        for r in lay.ranks:
            src_shards.setdefault(r, {})[name] = lay.shard(globals_[name], r)
    for name, lay in dst_layouts.items():
        want = _expected_from_parts(lay, parts[name], globals_) if name in parts else globals_[name]
        for r in lay.ranks:
            out = torch.full(lay.local_shape(r), -1, dtype=torch.int64)
            count = torch.zeros(lay.local_shape(r), dtype=torch.int64)
            for op in plan.ops_for_dst(r):
                if op.name == name:
                    out[op.dst_slices] = src_shards[op.src_rank][op.src_name][op.src_slices]
                    count[op.dst_slices] += 1
            for f in plan.fills_for_dst(r):
                if f.name == name:
                    out[f.dst_slices] = 0
                    count[f.dst_slices] += 1
            assert torch.all(count == 1), f"{name} on rank {r}: coverage {count.tolist()}"
            assert torch.equal(out, lay.shard(want, r)), f"{name} on rank {r}"
    return plan


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_exactly_once_random_parts(data):
    """A destination cut along one dim into boxes, each from a random source (of any layout, at a
    random offset inside a bigger source), some boxes padding, some sources feeding several boxes."""
    dst = data.draw(layouts())
    if dst.ndim == 0:
        return
    dim = data.draw(st.integers(0, dst.ndim - 1))
    cuts = sorted(data.draw(st.lists(st.integers(0, dst.shape[dim]), max_size=3)))
    edges = [0, *cuts, dst.shape[dim]]
    srcs, parts, read_as = {}, [], {}
    for i, (a, b) in enumerate(pairwise(edges)):
        if a == b and data.draw(st.booleans()):
            continue  # empty boxes may be listed or left out
        box = [None] * dst.ndim
        box[dim] = (a, b)
        kind = data.draw(st.sampled_from(["src", "src", "pad", "reuse"]))
        if kind == "pad":
            parts.append(trs.Part(None, box))
            continue
        if kind == "reuse" and srcs:
            name = data.draw(st.sampled_from(sorted(srcs)))
            extent = list(dst.shape)
            extent[dim] = b - a
            fits = all(e <= n for e, n in zip(extent, srcs[name].shape, strict=True))
            if fits:
                start = [0] * dst.ndim
                start[dim] = data.draw(st.integers(0, srcs[name].shape[dim] - (b - a)))
                parts.append(trs.Part(read_as[name], box, start))   # a name is read as its part's aliases
                continue
        extra = data.draw(st.integers(0, 3))
        shape = list(dst.shape)
        shape[dim] = b - a + extra
        name = f"s{i}"
        srcs[name] = data.draw(layouts(shape=tuple(shape)))
        start = [0] * dst.ndim
        start[dim] = data.draw(st.integers(0, extra))
        names = data.draw(alias_names(srcs, name))   # sometimes copies of it on other ranks too
        parts.append(trs.Part(names, box, start))
        for n in parts[-1].sources:
            read_as[n] = parts[-1].src
    plan = check_parts_exactly_once(srcs, {"t": dst}, {"t": parts})
    assert sum(op.numel for op in plan.ops) + sum(f.numel for f in plan.fills) == sum(
        dst.local_numel(r) for r in dst.ranks)


# -- aliases: a part read from any of several copies of one tensor (Megatron's tied embedding) ------


@st.composite
def alias_names(draw, srcs: dict, name: str, always: bool = False):
    """``name`` alone, or (a third of the time, or always) ``name`` and 1-2 copies of it, added to
    ``srcs``, in any order."""
    if not always and draw(st.integers(0, 2)):
        return name
    fresh = iter(r for r in range(12, 100) if r not in srcs[name].ranks and r not in
                 {r for lay in srcs.values() for r in lay.ranks})
    names = [name]
    for k in range(draw(st.integers(1, 2))):
        names.append(f"{name}'{k}")
        srcs[names[-1]] = alias_copy(draw, srcs[name], fresh)
    return tuple(draw(st.permutations(names)))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), min_split=st.sampled_from([1, 8, 4096]))
def test_exactly_once_from_aliases(data, min_split):
    """A destination read whole from a tensor and its copies on other ranks: exactly once, the right
    data, each op reading the copy its source rank holds (small knobs cut pieces over the copies)."""
    from tritonreshard.planning import replicas

    dst = data.draw(layouts())
    srcs = {"s": data.draw(layouts(shape=dst.shape))}
    names = data.draw(alias_names(srcs, "s", always=True))
    parts = {"t": [trs.Part(names, [None] * dst.ndim)]}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(replicas, "KNOBS", replicas.Knobs(min_split_bytes=min_split))
        plan = check_parts_exactly_once(srcs, {"t": dst}, parts)
    for op in plan.ops:
        assert op.src_rank in srcs[op.src_name].ranks, op
        # a rank holding two copies reads the first listed
        assert op.src_name == next(n for n in trs.Part(names, [None]).sources if op.src_rank in srcs[n].ranks)


def test_aliases_spread_reads_over_every_copy():
    """Two copies on two ranks each (Megatron's first and last stage): every destination piece is cut
    between them, so each copy serves half the bytes, each op naming the copy it reads."""
    src = {"emb": Layout((64, 32), [0, 1], [Shard(0)]), "out": Layout((64, 32), [2, 3], [Shard(0)])}
    dst = {"e": Layout((64, 32), [4, 5], [Shard(1)])}
    plan = check_parts_exactly_once(src, dst, {"e": [trs.Part(("emb", "out"), [None, None])]})
    assert {(op.src_name, op.src_rank) for op in plan.ops} == {("emb", 0), ("emb", 1), ("out", 2), ("out", 3)}
    assert plan.stats.send_bytes == {r: 64 * 32 * 4 // 4 for r in range(4)}
    assert "<- emb or out" in str(plan) and " out[" in str(plan)   # the parts, and each op's copy
    # A destination rank holding a copy reads it locally; the plain name reads that copy only.
    dst = {"e": Layout((64, 32), [2, 5], [Shard(0)])}
    plan = check_parts_exactly_once(src, dst, {"e": [trs.Part(("emb", "out"), [None, None])]})
    assert {(op.src_name, op.src_rank) for op in plan.ops_for_dst(2)} == {("out", 2)}
    assert {op.src_name for op in trs.plan_reshard(src, dst, {"e": [trs.Part("emb", [None, None])]}).ops} == {"emb"}


def test_mismatched_aliases_are_refused_with_every_other_problem():
    src = {"a": Layout((8, 4), [0, 1], [Shard(0)]), "b": Layout((8, 4), [2, 3], [Shard(0)]),
           "short": Layout((6, 4), [2, 3], [Shard(0)]), "half": Layout((8, 4), [2, 3], [Shard(0)], torch.bfloat16),
           "cols": Layout((8, 4), [2, 3], [Shard(1)]), "swap": Layout((8, 4), [1, 0], [Shard(0)]),
           "rep": Layout((8, 4), [[2, 3], [4, 5]], [Replicate(), Shard(0)])}
    dst = {n: Layout((8, 4), [6], [Replicate()]) for n in ("x", "y", "z", "w", "v", "u", "ok")}
    parts = {"x": [trs.Part(("a", "short"), [None, None])], "y": [trs.Part(("a", "half"), [None, None])],
             "z": [trs.Part(("a", "cols"), [None, None])], "w": [trs.Part(("a", "swap"), [None, None])],
             "v": [trs.Part(("a", "nope", "a"), [None, None])],
             "u": [trs.Part(("a", "b"), [(0, 4), None]), trs.Part("a", [(4, 8), None], (4, 0))],
             "ok": [trs.Part(("a", "b", "rep"), [None, None])]}
    with pytest.raises(ValueError) as e:
        trs.plan_reshard(src, dst, parts)
    msg = str(e.value)
    assert "8 problem(s)" in msg, msg
    assert ("parts['x'][0]=[:, :] <- a or short: aliases must be copies of one tensor, but src_layouts['a'] is "
            "(8, 4) torch.float32 and src_layouts['short'] is (6, 4) torch.float32") in msg
    assert "src_layouts['half'] is (8, 4) torch.bfloat16" in msg
    assert ("aliases must be split alike (the same regions, on any ranks), but src_layouts['a']=[S(0)]@(0,1) "
            "and src_layouts['cols']=[S(1)]@(2,3) split (8, 4) differently") in msg
    assert "rank(s) [0, 1] hold different regions of src_layouts['a']=[S(0)]@(0,1) and src_layouts['swap']" in msg
    assert "src_layouts has no 'nope'" in msg and "aliases ['a'] are listed more than once" in msg
    assert "parts['u'] reads 'a' as a or b and as a: a destination reads each source under one list" in msg
    trs.plan_reshard(src, {"ok": dst["ok"]}, {"ok": parts["ok"]})   # more replicas of each region: fine
    assert trs.Part(["a"], [None]) == trs.Part("a", [None]) and trs.Part(["a", "b"], [None]).src == ("a", "b")
    with pytest.raises(TypeError, match="tuple of names of aliases"):
        trs.Part(("a", 3), [None])
    with pytest.raises(TypeError, match="tuple of names of aliases"):
        trs.Part((), [None])


def test_qkv_with_replicated_kv_and_padding_op_by_op():
    # q: 4 rows over 4 ranks; k/v: 2 heads of 1 row, each on 2 ranks (rank r holds head r // 2)
    src = {n: Layout((s, 3), [0, 1], [Shard(0)]) for n, s in (("q", 4), ("k", 2), ("v", 2))}
    dst = {"qkv": Layout((12, 3), [4, 5, 6, 7], [Shard(0, (4, 4, 4))])}
    parts = [trs.Part("q", [(0, 4), None])]
    parts += [trs.Part("k", [(4 + j, 5 + j), None], (j // 2, 0)) for j in range(4)]
    parts += [trs.Part("v", [(8 + j, 9 + j), None], (j // 2, 0)) for j in range(4)]
    plan = check_parts_exactly_once(src, dst, {"qkv": parts})
    ops6 = [(op.src_name, op.src_rank, op.global_index[0], op.dst_slices[0]) for op in plan.ops_for_dst(6)]
    assert ops6 == [("q", 1, ((2, 3),), slice(0, 1)), ("k", 1, ((1, 2),), slice(1, 2)),
                    ("v", 1, ((1, 2),), slice(2, 3))]
    assert "from k" in str(plan.ops_for_dst(6)[1])
    emb = {"e": Layout((10, 2), [4, 5, 6, 7], [Shard(0)])}
    plan = check_parts_exactly_once({"e": Layout((7, 2), [0, 1], [Shard(0)])}, emb,
                                    {"e": [trs.Part("e", [(0, 7), None]), trs.Part(None, [(7, 10), None])]})
    # rows chunk as 3,3,3,1: padding rows 7:10 are rank 6's local rows 1:3 and rank 7's row 0
    assert [(f.dst_rank, f.dst_slices) for f in plan.fills] == [(6, (slice(1, 3), slice(0, 2))),
                                                                (7, (slice(0, 1), slice(0, 2)))]
    assert plan.stats.fill_bytes == 3 * 2 * 4
    assert "zeros->6" in plan.table() and "1 built from parts" in plan.summary()


def test_parts_holes_overlaps_and_bad_boxes_are_all_reported():
    src = {"a": Layout((4, 3), 2, [Shard(0)]), "b": Layout((4, 3), 2, [Shard(0)]),
           "i": Layout((4, 3), 2, [Shard(0)], torch.int32)}
    dst = {"x": Layout((10, 3), [2, 3], [Shard(0)]), "y": Layout((4, 3), [2, 3], [Shard(1)])}
    parts = {
        "x": [trs.Part("a", [(0, 4), None]), trs.Part("b", [(3, 7), None]), trs.Part(None, [(8, 9), None])],
        "y": [trs.Part("a", [(0, 4), (0, 2)]), trs.Part("zzz", [(0, 4), (2, 3)]),
              trs.Part("b", [(0, 5), (0, 1)]), trs.Part("i", [None, None], (1, 0))],
        "nope": [],
    }
    with pytest.raises(ValueError) as e:
        trs.plan_reshard(src, dst, parts)
    msg = str(e.value)
    assert "7 problem(s)" in msg, msg
    assert "parts['nope'] names no destination" in msg
    assert ("dst_layouts['x']: parts [0] [0:4, :] <- a and [1] [3:7, :] <- b overlap on [3:4, 0:3]") in msg
    assert "dst_layouts['x']: no part covers [7:8, 0:3] (a hole" in msg
    assert "dst_layouts['x']: no part covers [9:10, 0:3]" in msg
    assert "src_layouts has no 'zzz'" in msg
    assert "dst box [0:5, 0:1] is outside dst_layouts['y'].shape=(4, 3)" in msg
    assert "source box [1:5, 0:3] is outside src_layouts['i'].shape=(4, 3)" in msg
    with pytest.raises(ValueError, match=r"dst_layouts\['y'\].dtype=torch.float32 cannot be produced from "
                                         r"src_layouts\['i'\].dtype=torch.int32"):
        trs.plan_reshard(src, dst, {"y": [trs.Part("i", [None, None])]})
    with pytest.raises(TypeError, match="must be a source tensor name"):
        trs.Part(3, [(0, 1)])


def test_parts_plans_are_cached_and_hashable():
    src = {"a": Layout((4,), 2, [Shard(0)])}
    dst = {"x": Layout((6,), 3, [Shard(0)])}
    parts = {"x": [trs.Part("a", [(2, 6)]), trs.Part(None, [slice(0, 2)])]}
    assert trs.plan_reshard(src, dst, parts) is trs.plan_reshard(src, dst, parts)
    assert check_parts_exactly_once(src, dst, parts).parts["x"][1] == trs.Part(None, [(0, 2)])


def test_plan_picture_of_a_destination_built_from_parts(tmp_path):
    pytest.importorskip("matplotlib")
    from tritonreshard.apps.viz import draw_plan

    src = {n: Layout((s, 3), [0, 1], [Shard(0)]) for n, s in (("q", 4), ("k", 2), ("v", 2))}
    dst = {"qkv": Layout((12, 3), [4, 5, 6, 7], [Shard(0, (4, 4, 4))]), "k": Layout((2, 3), [4, 5], [Shard(0)])}
    parts = [trs.Part("q", [(0, 4), None])]
    parts += [trs.Part(n, [(o + j, o + 1 + j), None], (j // 2, 0)) for n, o in (("k", 4), ("v", 8)) for j in range(4)]
    plan = trs.plan_reshard(src, dst, {"qkv": parts})
    for name in ("qkv", "k"):
        path = draw_plan(plan, str(tmp_path / f"{name}.png"), name=name)
        with open(path, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_planner_and_kernels_read_one_dtype_table(monkeypatch):
    """plan_reshard's validation and kernels.supported_conversion answer from planning's one table:
    narrowing it narrows both (and the kernels keep their own width rule for bit copies)."""
    from tritonreshard import kernels
    from tritonreshard.planning import dtypes

    f32, bf16, f16 = torch.float32, torch.bfloat16, torch.float16
    src = {"w": Layout((4, 4), 2, [Shard(0)], f32)}
    assert kernels.supported_conversion(f32, f16) and trs.planning.castable(f32, f16)
    trs.plan_reshard(src, {"w": Layout((4, 4), [2, 3], [Shard(1)], f16)})
    assert not kernels.supported_conversion(torch.complex128, torch.complex128)  # 16-byte bit copy
    monkeypatch.setattr(dtypes, "CASTABLE_DTYPES", (f32, bf16))
    assert not kernels.supported_conversion(f32, f16) and kernels.supported_conversion(f32, bf16)
    with pytest.raises(ValueError, match="casts are supported among torch.float32, torch.bfloat16;"):
        trs.plan_reshard(src, {"w": Layout((4, 4), [2, 3], [Shard(0)], f16)})


@pytest.mark.parametrize("shape, dst_mesh, dst_dim", [((16, 16, 4), 8, 1), ((12, 16, 8, 4), 8, 2), ((4, 6, 8), 4, 2)])
def test_plan_picture_of_a_3d_tensor_has_readable_titles_and_labels(shape, dst_mesh, dst_dim, monkeypatch):
    """Tensors of 3+ dims: no two panel titles overlap (the rank panels' titles once ran into each
    other), and ranks whose regions differ only in an undrawn dim share one label, not a pile."""
    matplotlib = pytest.importorskip("matplotlib")
    from tritonreshard.apps import viz

    monkeypatch.setattr(matplotlib, "use", lambda *a, **k: pytest.fail("draw_plan chose a backend"))
    src = {"w": Layout(shape, 2, [Shard(0)])}
    dst = {"w": Layout(shape, list(range(2, 2 + dst_mesh)), [Shard(dst_dim)])}
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    fig = viz._figure(trs.plan_reshard(src, dst), None, None)
    fig.set_dpi(110)  # as draw_plan saves it
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    renderer = canvas.get_renderer()
    titles = [ax.title.get_window_extent(renderer) for ax in fig.axes]
    assert len(titles) == 3 + dst_mesh
    for i, a in enumerate(titles):
        for b in titles[i + 1:]:
            assert not a.overlaps(b), (a, b)
    for ax in fig.axes:
        places = [t.get_position() for t in ax.texts]
        assert len(places) == len(set(places)), [t.get_text() for t in ax.texts]
    assert "not shown" in fig.get_suptitle()


def test_sizes_print_up_to_pib():
    fmt = trs.planning.fmt_bytes
    assert [fmt(n) for n in (0, 1023, 1536, 3 << 20, 5 << 30)] == ["0 B", "1023 B", "1.5 KiB", "3.0 MiB", "5.0 GiB"]
    assert fmt(2 << 40) == "2.0 TiB" and fmt(3 << 50) == "3.0 PiB" and fmt(4096 << 50) == "4096.0 PiB"


def test_planners_pause_the_cyclic_gc_and_restore_it():
    """The planners run with CPython's cyclic collector paused (it dominated planning at frontier
    scale) and leave it as they found it: enabled after a plan, after a refused plan, and still
    disabled for a caller that disabled it."""
    import gc

    from tritonreshard.planning import _gc

    seen = []
    probe = _gc.gc_paused(lambda fail: seen.append(gc.isenabled()) or (fail and 1 / 0))
    assert gc.isenabled()
    probe(False)
    with pytest.raises(ZeroDivisionError):
        probe(True)
    assert seen == [False, False] and gc.isenabled()
    trs.plan_reshard({"w": Layout((4, 4), [0, 1], [Shard(0)])}, {"w": Layout((4, 4), [2], [Replicate()])})
    with pytest.raises(ValueError):
        trs.plan_reshard({"w": Layout((4, 4), [0, 1], [Shard(0)])}, {"w": Layout((5, 4), [2], [Replicate()])})
    assert gc.isenabled()
    gc.disable()
    try:
        probe(False)
        assert not gc.isenabled()
    finally:
        gc.enable()
