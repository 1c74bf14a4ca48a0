"""Host-aware planning: each byte crosses into a host once, every destination element is written
exactly once with the right bits, and only transfers cross between hosts.

The simulator below executes a HostPlan byte for byte (transfers into receive buffers at their
offsets, then local and fan-out ops) on provenance data: every global element's value is its index.
"""
import math

import pytest
import torch
from _aliases import alias_copy
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tritonreshard as trs
from tritonreshard import Layout, Replicate, Shard
from tritonreshard.planning import RECV_ALIGN, box_is_contiguous, join_host_parts, plan_hosts

SIZES = [0, 1, 2, 3, 5, 7, 8, 13]


def _globals(layouts):
    # The value of each element is its global index (exact in int64; the typed copy may round).
    return {n: torch.arange(math.prod(lay.shape), dtype=torch.int64).reshape(lay.shape)
            for n, lay in layouts.items()}


def simulate(hp, globals_):
    """Runs ``hp`` like the engine would, twice over: the real bytes through receive buffers at their
    offsets (typed), and the global indices through the same ops (exact whatever the dtype).

    Returns (typed outputs, index outputs, write counts, per-host crossed indices), outputs as
    ``{dst_rank: {name: tensor}}``."""
    plan = hp.plan
    src, idx = {}, {}
    for name, lay in plan.src_layouts.items():
        for r in lay.ranks:
            src.setdefault(r, {})[name] = lay.shard(globals_[name].to(lay.dtype), r)
            idx.setdefault(r, {})[name] = lay.shard(globals_[name], r)
    # Receive buffers, poisoned, plus a count of writes per byte (transfers must not overlap).
    bufs = {r: torch.full((n,), 0xA5, dtype=torch.uint8) for r, n in hp.buffer_bytes.items()}
    written = {r: torch.zeros(n, dtype=torch.int64) for r, n in hp.buffer_bytes.items()}
    crossed, idx_boxes = {}, {}
    for t in hp.transfers:
        assert t.src_host == hp.host_of(t.src_rank) != t.dst_host == hp.host_of(t.receiver), t
        assert t.offset % RECV_ALIGN == 0 and t.offset + t.nbytes <= hp.buffer_bytes[t.receiver]
        piece = src[t.src_rank][t.name][t.box]
        assert tuple(piece.shape) == t.shape and t.dtype == piece.dtype
        assert t.nbytes == piece.numel() * piece.element_size() > 0
        lay = plan.src_layouts[t.name]
        assert t.contiguous == box_is_contiguous(tuple((s.start, s.stop) for s in t.box),
                                                 lay.local_shape(t.src_rank))
        bufs[t.receiver][t.offset:t.offset + t.nbytes] = piece.contiguous().view(-1).view(torch.uint8)
        written[t.receiver][t.offset:t.offset + t.nbytes] += 1
        idx_boxes[t.index] = idx[t.src_rank][t.name][t.box]
        crossed.setdefault(t.dst_host, {}).setdefault(t.name, []).extend(idx_boxes[t.index].reshape(-1).tolist())
    for r, w in written.items():
        assert int(w.max()) <= 1, f"receive buffer of rank {r}: transfers overlap"
    out, out_idx, count = {}, {}, {}
    for name, lay in plan.dst_layouts.items():
        for r in lay.ranks:
            shape = lay.local_shape(r)
            out.setdefault(r, {})[name] = torch.full(shape, float("nan"), dtype=lay.dtype)
            out_idx.setdefault(r, {})[name] = torch.full(shape, -1, dtype=torch.int64)
            count.setdefault(r, {})[name] = torch.zeros(shape, dtype=torch.int64)
    for op in hp.local_ops:
        assert hp.host_of(op.src_rank) == hp.host_of(op.dst_rank), op
        out[op.dst_rank][op.name][op.dst_slices] = src[op.src_rank][op.src_name][op.src_slices].to(
            plan.dst_layouts[op.name].dtype)
        out_idx[op.dst_rank][op.name][op.dst_slices] = idx[op.src_rank][op.src_name][op.src_slices]
        count[op.dst_rank][op.name][op.dst_slices] += 1
    for f in hp.fanout:
        t = hp.transfers[f.transfer]
        assert f.receiver == t.receiver and hp.host_of(f.dst_rank) == t.dst_host, f
        assert f.op.src_name == t.name
        view = bufs[t.receiver][t.offset:t.offset + t.nbytes].view(t.dtype).view(t.shape)
        out[f.dst_rank][f.op.name][f.op.dst_slices] = view[f.op.src_slices].to(plan.dst_layouts[f.op.name].dtype)
        out_idx[f.dst_rank][f.op.name][f.op.dst_slices] = idx_boxes[t.index][f.op.src_slices]
        count[f.dst_rank][f.op.name][f.op.dst_slices] += 1
    return out, out_idx, count, crossed


def needed_from_elsewhere(plan, hosts, copies=None):
    """Independent reference: host -> name -> sorted global indices its destination ranks need
    that no source rank on the host holds (``copies``: destination -> the aliases it is read from)."""
    out = {}
    for name, d_lay in plan.dst_layouts.items():
        s_lays = [plan.src_layouts[n] for n in (copies or {}).get(name, [name])]
        g = torch.arange(math.prod(d_lay.shape), dtype=torch.int64).reshape(d_lay.shape)
        for h in sorted(set(hosts.values())):
            need = set()
            for r in d_lay.ranks:
                if hosts[r] == h:
                    need.update(d_lay.shard(g, r).reshape(-1).tolist())
            for s_lay in s_lays:
                for r in s_lay.ranks:
                    if hosts[r] == h:
                        need.difference_update(s_lay.shard(g, r).reshape(-1).tolist())
            if need:
                out.setdefault(h, {})[name] = sorted(need)
    return out


def check(src_layouts, dst_layouts, hosts, parts=None, **kw):
    """``parts``: optional, each destination read whole from aliases (copies of one tensor)."""
    plan = trs.plan_reshard(src_layouts, dst_layouts, parts)
    hp = plan_hosts(plan, hosts, **kw)
    globals_ = _globals(dst_layouts)
    copies = {}   # destination -> the aliases holding its data
    for name, (p,) in (parts or {}).items():
        assert p.dst == (None,) * dst_layouts[name].ndim
        copies[name] = list(p.sources)
        globals_.update((n, globals_[name]) for n in p.sources)
    out, out_idx, count, crossed = simulate(hp, globals_)
    for name, lay in dst_layouts.items():
        typed = globals_[name].to(plan.src_layouts[copies.get(name, [name])[0]].dtype).to(lay.dtype)
        for r in lay.ranks:
            c = count[r][name]
            assert torch.all(c == 1), f"{name} on rank {r}: coverage {c.tolist()}"
            assert torch.equal(out_idx[r][name], lay.shard(globals_[name], r)), f"{name} on rank {r}"
            assert torch.equal(out[r][name].view(-1).view(torch.uint8),
                               lay.shard(typed, r).view(-1).view(torch.uint8)), f"{name} bits on rank {r}"
    # Each byte a host needs from elsewhere crosses into it exactly once (from any copy), and nothing
    # else crosses.
    need = needed_from_elsewhere(plan, hp.hosts, copies)
    of = {n: d for d, ns in copies.items() for n in ns}
    merged = {}
    for h, d in crossed.items():
        for n, v in d.items():
            merged.setdefault(h, {}).setdefault(of.get(n, n), []).extend(v)
    assert {h: {n: sorted(v) for n, v in d.items()} for h, d in merged.items()} == need
    unique = sum(len(v) * plan.src_layouts[copies.get(n, [n])[0]].itemsize for d in need.values() for n, v in d.items())
    assert hp.cross_host_bytes == unique
    assert hp.cross_host_bytes <= hp.p2p_cross_host_bytes
    assert sum(hp.host_pair_bytes.values()) == unique
    # Staging: only the receive buffers, each at most its boxes plus alignment.
    for r, n in hp.buffer_bytes.items():
        boxes = sum(t.nbytes for t in hp.recvs_of(r))
        assert boxes <= n < boxes + RECV_ALIGN * len(hp.recvs_of(r)) + RECV_ALIGN
    # The per-rank views agree with the flat lists.
    ranks = set(hp.hosts)
    assert sum(len(hp.sends_of(r)) for r in ranks) == len(hp.transfers)
    assert sum(len(hp.recvs_of(r)) for r in ranks) == len(hp.transfers)
    assert sum(len(hp.local_ops_for_dst(r)) + len(hp.fanout_for_dst(r)) for r in ranks) == \
        len(hp.local_ops) + len(hp.fanout)
    assert str(hp).startswith("HostPlan: ")
    return hp


def _hosts(spec: dict[str, list[int]]) -> dict[int, str]:
    return {r: h for h, ranks in spec.items() for r in ranks}


def test_seed_example_across_two_hosts():
    src = {"w": Layout((8, 8), 2, [Shard(0)])}
    dst = {"w": Layout((8, 8), [2, 3, 4, 5], [Shard(1)])}
    hp = check(src, dst, _hosts({"a": [0, 1], "b": [2, 3, 4, 5]}))
    # Host b needs all of both trainers' rows: each trainer's shard crosses once, whole, straight
    # from its memory, to one receiver; all four ranks read their columns from the two buffers.
    assert [(t.src_rank, t.receiver, t.box, t.nbytes, t.contiguous) for t in hp.transfers] == [
        (0, 2, (slice(0, 4), slice(0, 8)), 128, True), (1, 3, (slice(0, 4), slice(0, 8)), 128, True)]
    assert hp.cross_host_bytes == 256 == hp.p2p_cross_host_bytes
    assert hp.local_ops == ()
    assert len(hp.fanout) == 8 and hp.buffer_readers(2) == hp.buffer_readers(3) == (2, 3, 4, 5)
    assert hp.send_staging_bytes == 0
    f = next(f for f in hp.fanout_for_dst(4) if f.receiver == 3)
    assert (f.op.src_slices, f.op.dst_slices) == ((slice(0, 4), slice(4, 6)), (slice(4, 8), slice(0, 2)))


def test_seed_example_inference_split_over_two_hosts_packs_columns():
    # Trainers on a, inference ranks 2,3 on b and 4,5 on c: each host needs half the columns of
    # each trainer's rows, which is not one range of the trainer's shard (packed by the sender).
    src = {"w": Layout((8, 8), 2, [Shard(0)])}
    dst = {"w": Layout((8, 8), [2, 3, 4, 5], [Shard(1)])}
    hp = check(src, dst, _hosts({"a": [0, 1], "b": [2, 3], "c": [4, 5]}))
    assert hp.cross_host_bytes == 256
    assert all(not t.contiguous for t in hp.transfers) and hp.send_staging_bytes == 256
    assert {t.dst_host for t in hp.transfers} == {"b", "c"}


def test_columns_to_replicas_four_inference_ranks_on_one_host():
    shape = (1024, 512)
    src = {"w": Layout(shape, 2, [Shard(1)], torch.bfloat16)}
    dst = {"w": Layout(shape, [2, 3, 4, 5], [Replicate()], torch.bfloat16)}
    hp = check(src, dst, _hosts({"a": [0, 1], "b": [2, 3, 4, 5]}))
    model = math.prod(shape) * 2
    # p2p would send every byte to each of the 4 replicas; here each byte crosses once.
    assert hp.p2p_cross_host_bytes == 4 * model and hp.cross_host_bytes == model
    # Receivers spread evenly over the host's four ranks; every rank reads every buffer.
    assert hp.buffer_bytes == {r: model // 4 for r in (2, 3, 4, 5)}
    assert all(hp.buffer_readers(r) == (2, 3, 4, 5) for r in (2, 3, 4, 5))
    assert all(t.contiguous for t in hp.transfers)
    assert {r: sum(t.nbytes for t in hp.sends_of(r)) for r in (0, 1)} == {0: model // 2, 1: model // 2}


def test_columns_to_replicas_many_tensors_balanced_without_splitting():
    src, dst = {}, {}
    for i in range(16):
        shape = (64, 32 + 8 * (i % 4))
        src[f"t{i}"] = Layout(shape, 4, [Shard(1)], torch.bfloat16)
        dst[f"t{i}"] = Layout(shape, [4, 5, 6, 7], [Replicate()], torch.bfloat16)
    hp = check(src, dst, _hosts({"a": [0, 1, 2, 3], "b": [4, 5, 6, 7]}))
    loads = [sum(t.nbytes for t in hp.recvs_of(r)) for r in (4, 5, 6, 7)]
    assert max(loads) <= 1.25 * min(loads), loads
    model = sum(lay.numel * 2 for lay in dst.values())
    assert hp.cross_host_bytes == model and hp.p2p_cross_host_bytes == 4 * model


def test_fsdp_to_tensor_parallel_crosses_the_model_once():
    src, dst = {}, {}
    for i, (shape, place) in enumerate([((96, 64), Shard(0)), ((64, 96), Shard(1)),
                                        ((96,), Replicate()), ((80, 64), Shard(0, blocks=(48, 32)))]):
        src[f"t{i}"] = Layout(shape, 2, [Shard(0)], torch.bfloat16)
        dst[f"t{i}"] = Layout(shape, [2, 3, 4, 5], [place], torch.bfloat16)
    hp = check(src, dst, _hosts({"a": [0, 1], "b": [2, 3, 4, 5]}))
    model = sum(lay.numel * 2 for lay in dst.values())
    assert hp.cross_host_bytes == model
    # Whole trainer shards are needed on b: one direct box per (trainer, tensor).
    assert len(hp.transfers) == 8 and hp.send_staging_bytes == 0


def test_overlapping_meshes_read_locally_and_cross_only_the_rest():
    # Ranks 0..3 train (rows), ranks 2..5 serve (columns); hosts a = {0,1,2}, b = {3,4,5}.
    src = {"w": Layout((12, 10), [0, 1, 2, 3], [Shard(0)])}
    dst = {"w": Layout((12, 10), [2, 3, 4, 5], [Shard(1)])}
    hosts = _hosts({"a": [0, 1, 2], "b": [3, 4, 5]})
    hp = check(src, dst, hosts)
    assert {hp.host_of(op.src_rank) for op in hp.local_ops if op.dst_rank == 2} == {"a"}
    # b holds trainer 3's rows itself and needs trainer 0,1,2's rows (for columns of ranks 3..5).
    assert {t.src_rank for t in hp.transfers if t.dst_host == "b"} == {0, 1, 2}
    assert any(op.src_rank == op.dst_rank == 3 for op in hp.local_ops)


def test_replicated_sources_resourced_to_the_destination_host():
    # DP x FSDP: replica 0 on host a, replica 1 on host b. b's ranks read b's replica: nothing crosses,
    # whatever replica the host-blind planner picked.
    src = {"w": Layout((16, 8), [[0, 1], [2, 3]], [Replicate(), Shard(0)])}
    dst = {"w": Layout((16, 8), [4, 5, 6, 7], [Shard(1)])}
    hp = check(src, dst, _hosts({"a": [0, 1, 4, 5], "b": [2, 3, 6, 7]}))
    assert hp.transfers == () and hp.cross_host_bytes == 0 and hp.buffer_bytes == {}
    assert hp.p2p_cross_host_bytes > 0  # the plain plan did read across hosts
    assert "nothing crosses between hosts" in str(hp)


def test_replicas_off_host_share_the_sending():
    src = {n: Layout((64, 64), [[0, 1], [2, 3]], [Replicate(), Shard(0)]) for n in "abcd"}
    dst = {n: Layout((64, 64), [4, 5], [Replicate()]) for n in "abcd"}
    hp = check(src, dst, _hosts({"a": [0, 1, 2, 3], "b": [4, 5]}))
    assert hp.cross_host_bytes == 4 * 64 * 64 * 4
    # Each shard has two replicas on a; both send half of the boxes.
    assert {r: len(hp.sends_of(r)) for r in range(4)} == {0: 2, 1: 2, 2: 2, 3: 2}


def test_one_host_changes_nothing():
    src = {"w": Layout((8, 8), 2, [Shard(0)])}
    dst = {"w": Layout((8, 8), [2, 3, 4, 5], [Shard(1)])}
    plan = trs.plan_reshard(src, dst)
    hp = plan_hosts(plan, {r: "only" for r in range(6)})
    assert hp.local_ops == plan.ops and hp.transfers == () and hp.fanout == ()


def test_cast_crosses_source_bytes_and_casts_in_the_fanout():
    src = {"w": Layout((6, 10), 2, [Shard(0)], torch.float32)}
    dst = {"w": Layout((6, 10), [2, 3], [Replicate()], torch.bfloat16)}
    hp = check(src, dst, _hosts({"a": [0, 1], "b": [2, 3]}))
    assert hp.cross_host_bytes == 6 * 10 * 4 and all(t.dtype == torch.float32 for t in hp.transfers)


def test_awkward_shapes_scalars_and_empty_shards():
    src = {"s": Layout((), 2, [Replicate()]), "u": Layout((7, 3, 5), 3, [Shard(1)]),
           "e": Layout((2, 9), 4, [Shard(0)])}
    dst = {"s": Layout((), [3, 4], [Replicate()]), "u": Layout((7, 3, 5), [3, 4, 5], [Shard(2)]),
           "e": Layout((2, 9), [3, 4, 5], [Shard(1)])}
    check(src, dst, _hosts({"a": [0, 1, 2], "b": [3, 4], "c": [5]}))


def test_balancing_splits_a_big_box_over_the_receivers():
    shape = (4096, 64)   # one 1 MiB float32 shard per trainer, needed whole by 4 ranks on b
    src = {"w": Layout(shape, 1, [Replicate()])}
    dst = {"w": Layout(shape, [1, 2, 3, 4], [Replicate()])}
    hp = check(src, dst, _hosts({"a": [0], "b": [1, 2, 3, 4]}))
    assert hp.buffer_bytes == {r: 4096 * 64 for r in (1, 2, 3, 4)}
    assert all(t.contiguous for t in hp.transfers)


def test_src_offsets_order_a_receivers_buffer_like_the_arena():
    src = {n: Layout((4, 64), 1, [Replicate()]) for n in "abc"}
    dst = {n: Layout((4, 64), [1], [Replicate()]) for n in "abc"}
    plan = trs.plan_reshard(src, dst)
    hosts = {0: "x", 1: "y"}
    arena = {(0, "c"): 0, (0, "a"): 1024, (0, "b"): 2048}
    hp = plan_hosts(plan, hosts, src_offsets=arena)
    assert [t.name for t in hp.recvs_of(1)] == ["c", "a", "b"]
    assert [t.offset for t in hp.recvs_of(1)] == [0, 1024, 2048]
    assert [t.name for t in plan_hosts(plan, hosts).recvs_of(1)] == ["a", "b", "c"]


def test_bad_hosts_report_every_problem_at_once():
    plan = trs.plan_reshard({"w": Layout((8, 8), 2, [Shard(0)])}, {"w": Layout((8, 8), [2, 3], [Shard(1)])})
    with pytest.raises(ValueError) as e:
        plan_hosts(plan, {0: "a", 1: "", 9: 7})
    msg = str(e.value)
    assert "2 problem(s)" in msg and "[2, 3]" in msg and "hosts[1]=''" in msg and "hosts[9]=7" in msg
    with pytest.raises(TypeError, match="hosts must be a mapping"):
        plan_hosts(plan, ["a", "a", "b", "b"])
    with pytest.raises(ValueError, match="align=0"):
        plan_hosts(plan, {r: "a" for r in range(4)}, align=0)


def test_deterministic():
    src = {"w": Layout((30, 20), [[0, 1], [2, 3]], [Replicate(), Shard(0)])}
    dst = {"w": Layout((30, 20), [4, 5, 6], [Shard(1)])}
    hosts = _hosts({"a": [0, 1], "b": [2, 4], "c": [3, 5, 6]})
    p = trs.plan_reshard(src, dst)
    a, b = plan_hosts(p, hosts), plan_hosts(p, dict(reversed(list(hosts.items()))))
    assert a.transfers == b.transfers and a.fanout == b.fanout and a.local_ops == b.local_ops
    assert str(a) == str(b)


def test_table_names_hosts_transfers_and_buffers():
    src = {"w": Layout((8, 8), 2, [Shard(0)])}
    dst = {"w": Layout((8, 8), [2, 3, 4, 5], [Shard(1)])}
    text = str(plan_hosts(trs.plan_reshard(src, dst), _hosts({"a": [0, 1], "b": [2, 3, 4, 5]})))
    lines = text.splitlines()
    assert lines[0] == ("HostPlan: 2 host(s), 2 cross-host transfer(s), 256 B across hosts (point-to-point "
                        "of the plain plan: 256 B), receive buffers 512 B, 0 local op(s), 8 fan-out op(s)")
    assert lines[1] == "hosts: a: ranks {0,1}; b: ranks {2,3,4,5}"
    assert lines[3].split() == ["0", "w", "0->2", "a->b", "[0:4,", "0:8]", "4x8", "128", "B", "0", "direct"]
    assert "receive buffers: 2: 256 B read by {2,3,4,5}, 3: 256 B read by {2,3,4,5}" in text


# ---------------------------------------------------------------- property test
@st.composite
def layouts(draw, shape=None, rank_pool=range(9)):
    if shape is None:
        ndim = draw(st.integers(0, 3))
        shape = tuple(draw(st.sampled_from(SIZES)) for _ in range(ndim))
    mesh_ndim = draw(st.integers(1, 2))
    mesh_shape = [draw(st.integers(1, 3)) for _ in range(mesh_ndim)]
    n = math.prod(mesh_shape)
    ranks = draw(st.permutations(list(rank_pool)))[:n]
    mesh = torch.tensor(ranks).reshape(mesh_shape).tolist()
    blocks = {}
    for d, size in enumerate(shape):
        if draw(st.booleans()):
            cut = draw(st.integers(0, size))
            blocks[d] = (cut, size - cut)
    placements = []
    for _ in range(mesh_ndim):
        if not shape or draw(st.booleans()):
            placements.append(Replicate())
        else:
            d = draw(st.integers(0, len(shape) - 1))
            placements.append(Shard(d, blocks.get(d)))
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16]))
    return Layout(shape, mesh, placements, dtype)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_property_exactly_once_and_each_byte_crosses_once(data):
    srcs, dsts = {}, {}
    for i in range(data.draw(st.integers(1, 2))):
        srcs[f"t{i}"] = data.draw(layouts())
        dsts[f"t{i}"] = data.draw(layouts(shape=srcs[f"t{i}"].shape))
    ranks = range(9)
    hosts = {r: f"h{data.draw(st.integers(0, 2))}" for r in ranks}
    check(srcs, dsts, hosts)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), min_split=st.integers(1, 64), slack=st.sampled_from([1.0, 1.05, 1.5]))
def test_property_exactly_once_when_the_knobs_cut_small_boxes(data, min_split, slack):
    """With tiny knobs both planners cut pieces on every example (reads over replicas, boxes over
    senders and receivers): still exactly once, each byte crossing once."""
    from tritonreshard.planning import replicas

    srcs, dsts = {}, {}
    for i in range(data.draw(st.integers(1, 2))):
        srcs[f"t{i}"] = data.draw(layouts())
        dsts[f"t{i}"] = data.draw(layouts(shape=srcs[f"t{i}"].shape))
    hosts = {r: f"h{data.draw(st.integers(0, 2))}" for r in range(9)}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(replicas, "KNOBS", replicas.Knobs(min_split_bytes=min_split, slack=slack))
        check(srcs, dsts, hosts)


def test_receiver_runs_keep_arena_neighbours_in_few_messages():
    from tritonreshard.planning import plan_messages
    from tritonreshard.transport import pack_offsets
    src, dst = {}, {}
    for i in range(24):
        shape = (64, 128 * (1 + i % 3))
        src[f"t{i:02d}"] = Layout(shape, 2, [Shard(0)], torch.bfloat16)
        dst[f"t{i:02d}"] = Layout(shape, [2, 3, 4, 5], [Replicate()], torch.bfloat16)
    offsets = {}
    for r in (0, 1):
        names = sorted(src)
        offs, _ = pack_offsets([src[n].local_numel(r) * 2 for n in names])
        offsets.update({(r, n): o for n, o in zip(names, offs, strict=True)})
    hp = check(src, dst, _hosts({"a": [0, 1], "b": [2, 3, 4, 5]}), src_offsets=offsets)
    msgs = plan_messages(hp, offsets)
    for r in (0, 1, 2, 3, 4, 5):   # a rank's own messages are the whole list's that it sends or receives
        assert plan_messages(hp, offsets, rank=r) == tuple(m for m in msgs if r in (m.sender, m.receiver))
    # Each receiver takes one run of the senders' arenas: at most (runs + senders - 1) messages.
    assert len(msgs) <= 4 + 2 - 1, [(m.sender, m.receiver, len(m.transfers)) for m in msgs]
    assert sum(m.nbytes for m in msgs) == hp.cross_host_bytes
    loads = [hp.buffer_bytes[r] for r in (2, 3, 4, 5)]
    assert max(loads) <= 1.1 * min(loads), loads


# ---------------------------------------------------------------- per-host parts (per-rank planning)
def host_parts(srcs, dsts, hosts, src_offsets=None, numbered=True, parts_=None):
    """Each destination host's part of the host plan, made only from the per-rank plans of that
    host's destination ranks (``merge_plans``), numbered on from the parts before it: what the
    ranks of that host compute instead of the whole plan. ``{host: HostPlan}``."""
    from tritonreshard.planning import host_order, merge_plans
    whole = trs.plan_reshard(srcs, dsts, parts_)
    ranks = set(whole.src_ranks) | set(whole.dst_ranks)
    parts, first = {}, 0
    for h in host_order({r: hosts[r] for r in ranks}):
        mine = [d for d in whole.dst_ranks if hosts[d] == h]
        if not mine:
            continue
        sub = merge_plans([trs.plan_reshard(srcs, dsts, parts_, rank=d) for d in mine])
        assert sub.ops == tuple(op for op in whole.ops if op.src_rank in mine or op.dst_rank in mine)
        parts[h] = plan_hosts(sub, hosts, host=h, first_index=first if numbered else 0, src_offsets=src_offsets)
        first += len(parts[h].transfers)
    return parts


def same_part(fast, part):
    """``plan_host_part``'s part equals ``plan_hosts(merged, host=)``'s, field by field and query by
    query (the fast part makes its ops per rank: ask per rank first, then for all)."""
    assert fast.transfers == part.transfers and fast.buffer_bytes == part.buffer_bytes
    for r in sorted(part.hosts):
        assert fast.local_ops_for_dst(r) == part.local_ops_for_dst(r)
        assert fast.fanout_for_dst(r) == part.fanout_for_dst(r)
        assert fast.buffer_readers(r) == part.buffer_readers(r)
        assert fast.local_readers_of(r) == part.local_readers_of(r)
        assert fast.sends_of(r) == part.sends_of(r) and fast.recvs_of(r) == part.recvs_of(r)
    assert fast.local_ops == part.local_ops and fast.fanout == part.fanout
    assert fast.plan.ops == part.plan.ops and fast.cross_host_bytes == part.cross_host_bytes
    assert fast.traffic() == part.traffic()   # summed per geometry == counted op by op


def check_parts(srcs, dsts, hosts, src_offsets=None, parts_=None):
    """Every rank's slice from its host's part (sends: from the parts of the hosts it sends to)
    equals its slice of the whole host plan, field by field, transfer numbers included; and
    ``plan_host_part`` (from the layouts) makes each host's part exactly as ``plan_hosts`` does."""
    from tritonreshard.planning import plan_host_part
    hp = plan_hosts(trs.plan_reshard(srcs, dsts, parts_), hosts, src_offsets=src_offsets)
    parts = host_parts(srcs, dsts, hosts, src_offsets, parts_=parts_)
    first = 0
    for h, part in parts.items():
        same_part(plan_host_part(srcs, dsts, parts_, None, hosts, h, src_offsets=src_offsets, first_index=first),
                  part)
        first += len(part.transfers)
    assert sum((p.transfers for p in parts.values()), ()) == hp.transfers
    for r in hp.hosts:
        part = parts.get(hp.host_of(r))
        if part is None:   # no destination rank on r's host: nothing is read there
            assert not hp.local_ops_for_dst(r) and not hp.fanout_for_dst(r) and not hp.recvs_of(r)
            assert not hp.local_readers_of(r)
        else:
            assert part.local_ops_for_dst(r) == hp.local_ops_for_dst(r)
            assert part.fanout_for_dst(r) == hp.fanout_for_dst(r)
            assert part.recvs_of(r) == hp.recvs_of(r)
            assert part.buffer_bytes.get(r) == hp.buffer_bytes.get(r)
            assert part.buffer_readers(r) == hp.buffer_readers(r)
            assert part.local_readers_of(r) == hp.local_readers_of(r)
            for f in part.fanout_for_dst(r):
                assert part.transfer(f.transfer) == hp.transfers[f.transfer]
        assert sum((p.sends_of(r) for p in parts.values()), ()) == hp.sends_of(r)
    # What the engine does: each host's ranks make its part numbered from 0, the hosts' transfers
    # are exchanged, and every rank joins them with its own part.
    own = host_parts(srcs, dsts, hosts, src_offsets, numbered=False, parts_=parts_)
    shared = {h: p.transfers for h, p in own.items()}
    for r in hp.hosts:
        h = hp.host_of(r)
        if h not in own:
            continue
        view = join_host_parts(own[h], h, shared)
        fast = join_host_parts(plan_host_part(srcs, dsts, parts_, None, hosts, h, src_offsets=src_offsets), h,
                               shared)
        assert fast.transfers == view.transfers and fast.buffer_bytes == view.buffer_bytes
        assert fast.fanout_for_dst(r) == view.fanout_for_dst(r) and fast.buffer_readers(r) == view.buffer_readers(r)
        assert fast.local_ops_for_dst(r) == view.local_ops_for_dst(r)
        assert view.transfers == hp.transfers and view.buffer_bytes == hp.buffer_bytes
        assert view.sends_of(r) == hp.sends_of(r) and view.recvs_of(r) == hp.recvs_of(r)
        assert view.local_ops_for_dst(r) == hp.local_ops_for_dst(r)
        assert view.fanout_for_dst(r) == hp.fanout_for_dst(r)
        assert view.local_readers_of(r) == hp.local_readers_of(r)
        assert view.buffer_readers(r) == hp.buffer_readers(r)
    return hp


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_property_each_hosts_part_is_the_slice_of_the_whole(data):
    srcs, dsts = {}, {}
    for i in range(data.draw(st.integers(1, 3))):
        srcs[f"t{i}"] = data.draw(layouts())
        dsts[f"t{i}"] = data.draw(layouts(shape=srcs[f"t{i}"].shape))
    hosts = {r: f"h{data.draw(st.integers(0, 3))}" for r in range(9)}
    offsets = None
    if data.draw(st.booleans()):   # arenas in reverse name order: receivers' buffers follow them
        offsets = {(r, n): 4096 * (9 - i) for r in range(9) for i, n in enumerate(sorted(srcs))}
    check_parts(srcs, dsts, hosts, offsets)


def test_parts_of_replicated_sources_across_three_hosts():
    # HSDP trainers (two replicas, one per host a/b) feeding TP ranks on hosts c and d: each part
    # picks its own senders, and the union of the parts is the whole plan.
    src = {n: Layout((64, 32), [[0, 1], [2, 3]], [Replicate(), Shard(0)]) for n in "abc"}
    dst = {n: Layout((64, 32), [[4, 5], [6, 7]], [Replicate(), Shard(1)]) for n in "abc"}
    hosts = _hosts({"a": [0, 1], "b": [2, 3], "c": [4, 5], "d": [6, 7]})
    hp = check_parts(src, dst, hosts)
    check(src, dst, hosts)
    assert {t.dst_host for t in hp.transfers} == {"c", "d"} and {t.src_host for t in hp.transfers} == {"a", "b"}


def test_a_part_names_every_bad_argument():
    plan = trs.plan_reshard({"w": Layout((4,), [0, 1], [Shard(0)])}, {"w": Layout((4,), [2], [Replicate()])})
    with pytest.raises(ValueError) as e:
        plan_hosts(plan, {0: "a", 1: "a", 2: "b"}, host="z", first_index=-1, align=0)
    assert "3 problem(s)" in str(e.value) and "'z'" in str(e.value) and "first_index" in str(e.value)


# ------------------------------------------------ aliases: copies of one tensor on other ranks


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), min_split=st.sampled_from([1, 16, 4096]))
def test_property_aliases_cross_once_and_each_hosts_part_is_the_slice_of_the_whole(data, min_split):
    """Destinations read from a tensor and its copies (Megatron's tied embedding): every element
    exactly once, each byte a host needs crosses into it once (none where a copy is on the host),
    and ``plan_host_part`` / per-rank parts equal the whole host plan's slices."""
    from tritonreshard.planning import replicas

    srcs, dsts, parts = {}, {}, {}
    fresh = iter(range(9, 40))
    for i in range(data.draw(st.integers(1, 2))):
        srcs[f"t{i}"] = data.draw(layouts())
        dsts[f"t{i}"] = data.draw(layouts(shape=srcs[f"t{i}"].shape))
        if data.draw(st.integers(0, 3)):
            names = [f"t{i}"] + [f"t{i}'{k}" for k in range(data.draw(st.integers(1, 2)))]
            reps = (1, 2) if len(srcs[f"t{i}"].ranks) <= 4 else (1,)
            for n in names[1:]:
                srcs[n] = alias_copy(data.draw, srcs[f"t{i}"], fresh, reps)
            parts[f"t{i}"] = [trs.Part(tuple(data.draw(st.permutations(names))), [None] * dsts[f"t{i}"].ndim)]
    hosts = {r: f"h{data.draw(st.integers(0, 3))}" for r in range(40)}
    offsets = None
    if data.draw(st.booleans()):   # arenas in reverse name order
        offsets = {(r, n): 4096 * (len(srcs) - i) for r in range(40) for i, n in enumerate(sorted(srcs))}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(replicas, "KNOBS", replicas.Knobs(min_split_bytes=min_split))
        check(srcs, dsts, hosts, parts or None, src_offsets=offsets)
        check_parts(srcs, dsts, hosts, offsets, parts_=parts or None)


def test_aliases_read_the_copy_on_the_destination_host():
    """Megatron's tied embedding: the first stage's copy on host a, the last stage's on host b, a vLLM
    replica on each. Whichever copy the host-blind planner picked, each host reads its own: nothing
    crosses. A host with no copy receives each byte once, sent by both copies' ranks."""
    from tritonreshard.planning import plan_host_part

    src = {"emb": Layout((256, 32), [0, 1], [Shard(0)]), "out": Layout((256, 32), [2, 3], [Shard(0)])}
    dst = {"e": Layout((256, 32), [[4, 5], [6, 7]], [Replicate(), Shard(1)])}
    parts = {"e": [trs.Part(("emb", "out"), [None, None])]}
    plan = trs.plan_reshard(src, dst, parts)
    assert {op.src_name for op in plan.ops_for_dst(6)} == {"emb", "out"}   # host-blind: both copies
    hosts = _hosts({"a": [0, 1, 4, 5], "b": [2, 3, 6, 7]})
    hp = check(src, dst, hosts, parts)
    assert hp.transfers == () and hp.p2p_cross_host_bytes > 0
    assert {(op.dst_rank, op.src_name) for op in hp.local_ops} == {(4, "emb"), (5, "emb"), (6, "out"), (7, "out")}
    check_parts(src, dst, hosts, parts_=parts)
    fast = plan_host_part(src, dst, parts, None, hosts, "b")
    assert fast.local_ops == hp.local_ops_for_dst(6) + hp.local_ops_for_dst(7)
    hosts = _hosts({"a": [0, 1], "b": [2, 3], "c": [4, 5, 6, 7]})
    hp = check(src, dst, hosts, parts)
    assert hp.cross_host_bytes == 256 * 32 * 4
    assert {(t.src_rank, t.name) for t in hp.transfers} == {(0, "emb"), (1, "emb"), (2, "out"), (3, "out")}
    assert {f.op.src_name for f in hp.fanout} == {"emb", "out"}
    check_parts(src, dst, hosts, parts_=parts)
