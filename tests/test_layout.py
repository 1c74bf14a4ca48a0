"""Layouts: chunk semantics, blocks, N-D meshes, validation errors, DTensor interop."""
import os

import pytest
import torch

import tritonreshard as trs
from tritonreshard import Layout, Replicate, Shard
from tritonreshard.apps.kit import free_port, run_ranks


def test_chunk_semantics_match_torch_chunk_with_short_and_empty_tail():
    lay = Layout((10,), 4, [Shard(0)])          # chunk = 3: 3, 3, 3, 1
    assert [lay.local_shape(r) for r in range(4)] == [(3,), (3,), (3,), (1,)]
    lay = Layout((5,), 4, [Shard(0)])           # chunk = 2: 2, 2, 1, 0
    assert [lay.local_shape(r) for r in range(4)] == [(2,), (2,), (1,), (0,)]
    x = torch.arange(5)
    for r, piece in enumerate(torch.chunk(x, 4)):
        assert torch.equal(lay.shard(x, r), piece)
    assert lay.shard(x, 3).shape == (0,)


def test_two_mesh_dims_on_one_tensor_dim_split_outermost_first():
    lay = Layout((8, 2), [[0, 1], [2, 3]], [Shard(0), Shard(0)])
    x = torch.arange(16).reshape(8, 2)
    # Mesh dim 0 takes halves, mesh dim 1 splits each half again.
    assert torch.equal(lay.shard(x, 0), x[0:2])
    assert torch.equal(lay.shard(x, 1), x[2:4])
    assert torch.equal(lay.shard(x, 2), x[4:6])
    assert torch.equal(lay.shard(x, 3), x[6:8])


def test_blocks_split_independently_and_concatenate():
    lay = Layout((12, 3), [5, 6], [Shard(0, blocks=(4, 8))])
    x = torch.arange(36).reshape(12, 3)
    assert torch.equal(lay.shard(x, 5), torch.cat([x[0:2], x[4:8]]))
    assert torch.equal(lay.shard(x, 6), torch.cat([x[2:4], x[8:12]]))
    assert lay.local_shape(6) == (6, 3)


def test_balanced_split_matches_numpy_array_split_and_vllm_expert_placement():
    """``Shard(d, balanced=True)``: the first n % k pieces are one longer (numpy.array_split, vLLM's
    "linear" expert placement), where torch.chunk would leave a short or empty tail."""
    for n, k in [(6, 4), (5, 4), (3, 4), (8, 4), (7, 3), (0, 2), (1, 1)]:
        lay = Layout((n, 3), list(range(10, 10 + k)), [Shard(0, balanced=True)])
        x = torch.arange(n * 3).reshape(n, 3)
        pieces = torch.tensor_split(x, k)  # numpy.array_split semantics
        for i, piece in enumerate(pieces):
            assert lay.local_shape(10 + i) == tuple(piece.shape), (n, k, i)
            assert torch.equal(lay.shard(x, 10 + i), piece), (n, k, i)
    # 6 experts over 4 ranks: 2, 2, 1, 1 (torch.chunk: 2, 2, 2, 0)
    assert [Layout((6,), 4, [Shard(0, balanced=True)]).local_shape(r)[0] for r in range(4)] == [2, 2, 1, 1]
    assert [Layout((6,), 4, [Shard(0)]).local_shape(r)[0] for r in range(4)] == [2, 2, 2, 0]
    # blocks: each block balanced on its own; two mesh dims: the outer piece is split again
    lay = Layout((7,), [5, 6], [Shard(0, blocks=(3, 4), balanced=True)])
    assert lay.segments(5) == (((0, 2, 0), (3, 5, 2)),) and lay.segments(6) == (((2, 3, 0), (5, 7, 1)),)
    lay = Layout((7,), [[0, 1], [2, 3]], [Shard(0, balanced=True), Shard(0, balanced=True)])
    assert [lay.segments(r)[0] for r in range(4)] == [((0, 2, 0),), ((2, 4, 0),), ((4, 6, 0),), ((6, 7, 0),)]
    assert str(Shard(0, balanced=True)) == "S(0,bal)" and str(Shard(1, (2, 2), True)) == "S(1,[2,2],bal)"
    assert Shard(0, balanced=True) != Shard(0) and Layout((6,), 4, [Shard(-1, balanced=True)]).placements[0].balanced
    with pytest.raises(ValueError) as e:
        Layout((6,), [[0, 1], [2, 3]], [Shard(0, balanced=True), Shard(0)])
    assert "shard dim 0 both balanced and not" in str(e.value)
    with pytest.raises(ValueError, match="balanced must be a bool"):
        Layout((6,), 2, [Shard(0, balanced=1)])


def test_balanced_split_plans_and_executes_exactly():
    """A balanced destination is planned and copied like any other: every element once, bit for bit."""
    x = torch.arange(6 * 5, dtype=torch.float32).reshape(6, 5)
    src = {"w": Layout((6, 5), [0, 1], [Shard(0)])}
    dst = {"w": Layout((6, 5), [2, 3, 4, 5], [Shard(0, balanced=True)])}
    plan = trs.plan_reshard(src, dst)
    assert sum(op.numel for op in plan.ops) == 30
    out = {r: {"w": torch.full(dst["w"].local_shape(r), float("nan"))} for r in (2, 3, 4, 5)}
    got = trs.execute_local(plan, {r: {"w": src["w"].shard(x, r)} for r in (0, 1)}, out=out, backend="torch")
    for r, piece in zip((2, 3, 4, 5), torch.tensor_split(x, 4), strict=True):
        assert torch.equal(got[r]["w"], piece)


def test_mesh_forms_ranks_str_and_hash():
    a = Layout((4, 4), [[3, 2], [1, 0]], [Replicate(), Shard(1)], torch.bfloat16)
    assert a.ranks == (3, 2, 1, 0) and a.mesh_shape == (2, 2)
    assert str(a) == "[R,S(1)]@((3,2),(1,0))"
    assert str(Layout((8, 8), 2, [Shard(0)])) == "[S(0)]@(0,1)"
    b = Layout((4, 4), torch.tensor([[3, 2], [1, 0]]), (Replicate(), Shard(1)), torch.bfloat16)
    assert a == b and hash(a) == hash(b)
    assert Layout((4,), [7], [Shard(0)]) != Layout((4,), [7], [Shard(0)], torch.float16)
    assert Layout((4, 4), 2, [Shard(-1)]).placements == (Shard(1),)
    with pytest.raises(AttributeError):
        a.shape = (1,)
    assert repr(a).startswith("Layout(shape=(4, 4), mesh=((3, 2), (1, 0))")


@pytest.mark.parametrize("kwargs, message", [
    (dict(shape=(4,), mesh=[0, 0, 1], placements=[Shard(0)]), "duplicate ranks [0]"),
    (dict(shape=(4,), mesh=[[0, 1], [2, 3]], placements=[Shard(0)]), "placements has 1 entries but mesh has 2 dims"),
    (dict(shape=(4, 4), mesh=2, placements=[Shard(2)]), "shard dim 2 is out of range"),
    (dict(shape=(6,), mesh=2, placements=[Shard(0, blocks=(2, 3))]), "blocks sum to 5 but shape[0]=6"),
    (dict(shape=(6,), mesh=2, placements=["S(0)"]), "is not a supported placement"),
    (dict(shape=(6,), mesh=[[0, 1], [2]], placements=[Shard(0), Shard(0)]), "ragged"),
    (dict(shape=(6,), mesh=0, placements=[Shard(0)]), "at least one rank"),
    (dict(shape=(-1,), mesh=2, placements=[Shard(0)]), "negative size"),
    (dict(shape=(6,), mesh=[[0, 1], [2, 3]], placements=[Shard(0, blocks=(3, 3)), Shard(0)]), "conflicting blocks"),
    # past int64 a plan's sizes wrap (the CLI once planned "2980232238769.5 GiB" for this shape)
    (dict(shape=(99999999999999999999, 8), mesh=2, placements=[Shard(0)]),
     "shape=(99999999999999999999, 8): shape[0]=99999999999999999999 is past int64"),
    (dict(shape=(10 ** 10, 10 ** 10), mesh=2, placements=[Shard(0)]),
     "shape=(10000000000, 10000000000) of torch.float32 is 400000000000000000000 bytes"),
    (dict(shape=(1 << 31, 1 << 31), mesh=2, placements=[Shard(0)], dtype=torch.bfloat16), "more than int64"),
    (dict(shape=(0, 1 << 63), mesh=2, placements=[Shard(0)]), "shape[1]=9223372036854775808 is past int64"),
])
def test_invalid_layouts_raise_value_error(kwargs, message):
    with pytest.raises(ValueError, match="invalid Layout") as info:
        Layout(**kwargs)
    assert message in str(info.value)


def test_all_layout_problems_reported_at_once():
    with pytest.raises(ValueError) as info:
        Layout((4,), [1, 1], [Shard(3), Replicate()])
    text = str(info.value)
    assert "duplicate ranks" in text and "shard dim 3" in text and "placements has 2 entries" in text


def test_local_shape_of_foreign_rank_is_a_clear_error():
    with pytest.raises(ValueError, match="rank=7 is not in this layout's mesh"):
        Layout((4,), 2, [Shard(0)]).local_shape(7)


def test_plan_validation_lists_every_problem():
    src = {"a": Layout((4, 4), 2, [Shard(0)]), "b": Layout((4, 4), 2, [Shard(0)]),
           "c": Layout((4,), 2, [Shard(0)], torch.float32)}
    dst = {"a": Layout((4, 5), 2, [Shard(0)]), "missing": Layout((4,), 2, [Shard(0)]),
           "c": Layout((4,), 2, [Shard(0)], torch.int8), "b": Layout((4, 4), [3], [Replicate()])}
    with pytest.raises(ValueError) as info:
        trs.plan_reshard(src, dst)
    text = str(info.value)
    assert "3 problem(s)" in text
    assert "dst_layouts['missing'] has no source" in text
    assert "dst_layouts['a'].shape=(4, 5) != src_layouts['a'].shape=(4, 4)" in text
    assert "dst_layouts['c'].dtype=torch.int8" in text and "src_layouts['c'].dtype=torch.float32" in text


def test_plan_rejects_non_layouts():
    with pytest.raises(TypeError, match="src_layouts"):
        trs.plan_reshard({"a": "S(0)"}, {"a": Layout((4,), 2, [Shard(0)])})


def test_torch_placements_are_accepted():
    from torch.distributed.tensor import Replicate as TRep
    from torch.distributed.tensor import Shard as TShard
    lay = Layout((4, 6), [[0, 1], [2, 3]], [TShard(1), TRep()])
    assert lay.placements == (Shard(1), Replicate())


def _dtensor_worker(rank, world, port, cases):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        for shape, mesh_shape, placements in cases:
            mesh = init_device_mesh("cpu", mesh_shape)
            full = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape)
            dt = distribute_tensor(full, mesh, placements)
            lay = Layout.from_dtensor(dt)
            assert lay.shape == tuple(shape) and lay.ranks == tuple(range(world))
            mine = lay.shard(full, rank)
            assert torch.equal(mine, dt.to_local()), (shape, mesh_shape, placements, mine, dt.to_local())
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_dtensor_interop_matches_to_local():
    from torch.distributed.tensor import Replicate as TRep
    from torch.distributed.tensor import Shard as TShard
    port = free_port()
    cases = [((7, 5), (4,), [TShard(0)]),
             ((3, 10), (4,), [TShard(1)]),
             ((9, 4), (2, 2), [TShard(0), TShard(0)]),
             ((5, 6), (2, 2), [TRep(), TShard(1)]),
             ((6, 7), (2, 2), [TShard(1), TShard(0)])]
    run_ranks(_dtensor_worker, 4, args=(4, port, cases), timeout=100)


def test_largest_int64_byte_size_is_accepted():
    assert Layout(((1 << 62) - 1, 2), 2, [Shard(0)], torch.int8).numel == (1 << 63) - 2
