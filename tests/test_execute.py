"""execute_local: whole plans in one process, checked by provenance (sources hold an arange of the
global tensor, so every destination element is known exactly), both backends, poisoned outputs."""
import pytest
import torch
from test_kernels import assert_same_bits, bits, poison

import tritonreshard as trs
from tritonreshard import execute as _execute
from tritonreshard.execute import execute_local

FLOATS = (torch.float32, torch.bfloat16, torch.float16)
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
BACKENDS = ("triton", "torch")


def global_tensor(shape, dtype):
    n = 1
    for s in shape:
        n *= s
    g = torch.arange(n, dtype=torch.float64).reshape(shape)
    if dtype.is_floating_point:
        return (g / 7.0).to(dtype)  # non-representable values: the cast has to round
    return g.to(dtype)


def run_case(src_layouts, dst_layouts, device, backend, transpose_src=False, specials=False):
    plan = trs.plan_reshard(src_layouts, dst_layouts)
    globals_ = {}
    for name, lay in src_layouts.items():
        g = global_tensor(lay.shape, lay.dtype)
        if specials and lay.dtype.is_floating_point:
            flat = g.view(-1)
            vals = torch.tensor([float("inf"), -float("inf"), float("nan"), 1e-40, 65520.0, -0.0,
                                 1.00390625, 70000.0])
            flat[: min(len(vals), flat.numel())] = vals[: flat.numel()].to(lay.dtype)
        globals_[name] = g
    src_shards = {}
    for name, lay in src_layouts.items():
        for r in lay.ranks:
            t = lay.shard(globals_[name], r).to(device)
            if transpose_src and t.dim() >= 2:  # same values, column-major strides
                t = t.transpose(0, 1).contiguous().transpose(0, 1)
            src_shards.setdefault(r, {})[name] = t
    out = {r: {n: poison(torch.empty(lay.local_shape(r), dtype=lay.dtype, device=device))
               for n, lay in dst_layouts.items() if r in lay.ranks}
           for r in {r for lay in dst_layouts.values() for r in lay.ranks}}
    res = execute_local(plan, src_shards, out=out, backend=backend)
    for name, lay in dst_layouts.items():
        ref_global = globals_[name].to(lay.dtype)
        for r in lay.ranks:
            assert res[r][name] is out[r][name]
            assert_same_bits(res[r][name].cpu(), lay.shard(ref_global, r))
    return plan, res


SEED_SRC = {"w": trs.Layout((8, 8), 2, [trs.Shard(0)])}
SEED_DST = {"w": trs.Layout((8, 8), [2, 3, 4, 5], [trs.Shard(1)])}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("src_dtype,dst_dtype", [(s, d) for s in FLOATS for d in FLOATS],
                         ids=lambda d: str(d).removeprefix("torch."))
def test_seed_all_dtype_pairs(src_dtype, dst_dtype, backend, device):
    src = {"w": SEED_SRC["w"].with_dtype(src_dtype)}
    dst = {"w": SEED_DST["w"].with_dtype(dst_dtype)}
    run_case(src, dst, device, backend, specials=True)


CASES = {
    "1d-uneven": ({"v": trs.Layout((13,), 3, [trs.Shard(0)])}, {"v": trs.Layout((13,), 2, [trs.Shard(0)])}),
    "empty-shards": ({"v": trs.Layout((3,), 2, [trs.Shard(0)])}, {"v": trs.Layout((3,), [2, 3, 4, 5], [trs.Shard(0)])}),
    "3d": ({"x": trs.Layout((4, 5, 6), 2, [trs.Shard(2)])}, {"x": trs.Layout((4, 5, 6), 3, [trs.Shard(1)])}),
    "4d": ({"x": trs.Layout((2, 3, 4, 5), 2, [trs.Shard(0)], torch.bfloat16)},
           {"x": trs.Layout((2, 3, 4, 5), [5, 6], [trs.Shard(3)], torch.float32)}),
    "packed-qkv": ({"qkv": trs.Layout((12, 4), 2, [trs.Shard(0, blocks=(4, 4, 4))])},
                   {"qkv": trs.Layout((12, 4), [2, 3, 4], [trs.Shard(0, blocks=(4, 4, 4))], torch.bfloat16)}),
    "replicate-to-shard": ({"b": trs.Layout((10, 3), 2, [trs.Replicate()])},
                           {"b": trs.Layout((10, 3), [2, 3, 4], [trs.Shard(0)], torch.float16)}),
    "2d-mesh": ({"w": trs.Layout((6, 8), [[0, 1], [2, 3]], [trs.Shard(0), trs.Shard(1)])},
                {"w": trs.Layout((6, 8), [4, 5, 6], [trs.Shard(1)], torch.bfloat16)}),
    "int-and-bool": ({"i": trs.Layout((9, 4), 2, [trs.Shard(0)], torch.int64),
                      "m": trs.Layout((9, 4), 2, [trs.Shard(1)], torch.bool)},
                     {"i": trs.Layout((9, 4), [2, 3], [trs.Shard(1)], torch.int64),
                      "m": trs.Layout((9, 4), [2, 3], [trs.Shard(0)], torch.bool)}),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("transpose_src", [False, True], ids=["contig", "colmajor"])
@pytest.mark.parametrize("case", list(CASES), ids=str)
def test_layouts(case, transpose_src, backend, device):
    src, dst = CASES[case]
    run_case(src, dst, device, backend, transpose_src=transpose_src)


def test_backends_agree_bit_for_bit():
    src = {"w": SEED_SRC["w"].with_dtype(torch.float32)}
    dst = {"w": SEED_DST["w"].with_dtype(torch.float16)}
    _, a = run_case(src, dst, "cpu", "triton", specials=True)
    _, b = run_case(src, dst, "cpu", "torch", specials=True)
    for r in a:
        assert torch.equal(bits(a[r]["w"]), bits(b[r]["w"]))


def test_allocates_outputs_and_auto_backend():
    plan = trs.plan_reshard(SEED_SRC, {"w": SEED_DST["w"].with_dtype(torch.bfloat16)})
    g = global_tensor((8, 8), torch.float32)
    res = execute_local(plan, {r: {"w": SEED_SRC["w"].shard(g, r)} for r in (0, 1)})
    assert sorted(res) == [2, 3, 4, 5]
    for r in res:
        assert res[r]["w"].dtype == torch.bfloat16 and res[r]["w"].shape == (8, 2)
        assert torch.equal(res[r]["w"], SEED_DST["w"].shard(g, r).to(torch.bfloat16))


def test_table_cache_reused_with_same_out():
    plan = trs.plan_reshard(SEED_SRC, SEED_DST)
    g = global_tensor((8, 8), torch.float32)
    src = {r: {"w": SEED_SRC["w"].shard(g, r)} for r in (0, 1)}
    out = {r: {"w": torch.empty(8, 2)} for r in (2, 3, 4, 5)}
    _execute._table_cache.clear()
    execute_local(plan, src, out=out, backend="torch")
    (table,) = _execute._table_cache.values()
    src[0]["w"].add_(1000)  # a new "version" of the weights, same buffers
    execute_local(plan, src, out=out, backend="torch")
    assert list(_execute._table_cache.values()) == [table]
    assert out[2]["w"][0, 0] == 1000
    assert table.num_launches == 1 and len(table) == len(plan.ops)


def test_validation_reports_every_problem_before_moving_data():
    plan = trs.plan_reshard(SEED_SRC, SEED_DST)
    out = {r: {"w": torch.full((8, 2), 7.0)} for r in (2, 3, 4)}
    out[2]["w"] = torch.full((8, 2), 7.0, dtype=torch.float16)
    with pytest.raises(ValueError) as exc:
        execute_local(plan, {0: {"w": torch.zeros(3, 8)}}, out=out, backend="nope")
    msg = str(exc.value)
    for part in ["backend must be 'auto', 'torch' or 'triton'", "src_shards is missing rank(s) [1]",
                 "src_shards[0]['w'] has shape (3, 8), layout says (4, 8)",
                 "out is missing rank(s) [5]", "out[2]['w'] has dtype torch.float16, layout says torch.float32"]:
        assert part in msg
    assert (out[3]["w"] == 7).all()
    with pytest.raises(ValueError, match=r"src_shards\[1\]\['w'\] is missing"):
        execute_local(plan, {0: {"w": torch.zeros(4, 8)}, 1: {}})
