"""The gather kernel and descriptor tables, driven by hand-made transfer ops (no planner).

CPU runs use Triton's interpreter (small tensors on purpose); ``@pytest.mark.cuda`` runs the same
cases compiled. Outputs are poisoned before each run and compared as bit patterns.
"""
import os
import subprocess
import sys
import textwrap
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from tritonreshard.kernels import DescriptorTable

from tritonreshard import kernels

FLOATS = (torch.float32, torch.bfloat16, torch.float16)
PAIRS = [(s, d) for s in FLOATS for d in FLOATS]
BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


@dataclass(frozen=True)
class Op:
    """The fields of ``TransferOp`` the descriptor layer reads."""

    name: str
    src_rank: int
    dst_rank: int
    src_slices: tuple
    dst_slices: tuple

    @property
    def shape(self):
        return tuple(s.stop - s.start for s in self.src_slices)


def full_op(t: torch.Tensor, name="t", src_rank=0, dst_rank=1) -> Op:
    sl = tuple(slice(0, n) for n in t.shape)
    return Op(name, src_rank, dst_rank, sl, sl)


def bits(t: torch.Tensor) -> torch.Tensor:
    if t.dtype == torch.bool:
        return t.view(torch.int8)
    if t.dtype.is_complex:
        return torch.view_as_real(t).view(BITS[t.element_size() // 2])
    return t.view(BITS[t.element_size()])


def poison(t: torch.Tensor) -> torch.Tensor:
    """Fill with NaN (floats) or random bits, so unwritten elements can't pass."""
    if t.dtype.is_floating_point:
        t.fill_(float("nan"))
    else:
        b = bits(t)
        b.copy_(torch.randint(-100, 100, b.shape, dtype=b.dtype))
    return t


def assert_same_bits(out: torch.Tensor, ref: torch.Tensor):
    """Bit-exact except NaN payloads (torch's own NaN bits depend on device and vector path): where
    ``ref`` is NaN, ``out`` must be NaN."""
    assert out.dtype == ref.dtype and out.shape == ref.shape
    if out.dtype.is_floating_point:
        nan = ref.isnan()
        assert torch.equal(out.isnan(), nan), "NaN positions differ"
        assert torch.equal(bits(out)[~nan], bits(ref)[~nan])
    else:
        assert torch.equal(bits(out), bits(ref))


def copy_one(src_full, dst_full, op, backend, device="cpu"):
    table = DescriptorTable.build([op], src=lambda o: src_full, dst=lambda o: dst_full)
    table.run(backend)
    return table


# -------------------------------------------------------------------------------------- conversions


def nan_policy(src_bits: np.ndarray, src: torch.dtype, dst: torch.dtype) -> np.ndarray:
    """The kernel's documented NaN bits (see kernels/gather.py) for NaN inputs given as raw bits."""
    b = src_bits.astype(np.int64) & (0xFFFFFFFF if src == torch.float32 else 0xFFFF)
    if src == dst:  # a same-dtype copy moves bits
        return b
    if src == torch.float32:
        f32 = b
    elif src == torch.bfloat16:
        f32 = b << 16
    else:
        f32 = ((b & 0x8000) << 16) | 0x7FC00000 | ((b & 0x3FF) << 13)
    if dst == torch.float32:
        return f32
    if dst == torch.bfloat16:
        return np.full_like(f32, 0x7FC0)
    return ((f32 >> 16) & 0x8000) | 0x7E00 | ((f32 & 0x7FFFFF) >> 13)


def special_f32() -> torch.Tensor:
    """fp32 bit patterns on every boundary the conversions care about, plus random bits."""
    v = []
    for base in range(0x33000000, 0x38900000, 0x00080000):  # fp16 subnormal range and its edges
        v += [base, base + 0x1000, base + 0xFFF, base + 0x1001, base + 0x3000, base + 0x2FFF]
    v += [0x477FE000, 0x477FEFFF, 0x477FF000, 0x477FF001, 0x47800000, 0x7F7FFFFF,  # fp16 overflow
          0x7F800000, 0x7F800001, 0x7FC00000, 0x7FFFFFFF, 0x7FA00000, 0x7F802000,  # inf, NaNs
          0x3F808000, 0x3F818000, 0x3F808001, 0x3F80FFFF, 0x3F7F8000, 0x7F7F8000,  # bf16 ties
          0x3F801000, 0x3F803000, 0x3F801001,  # fp16 ties
          0, 1, 0x007FFFFF, 0x00800000, 0x33000000, 0x33000001, 0x32FFFFFF, 0x387FE000, 0x387FF000]
    v = v + [x | 0x80000000 for x in v]
    rnd = torch.randint(-2**31, 2**31, (4000,), dtype=torch.int64, generator=torch.Generator().manual_seed(1))
    return torch.cat([torch.tensor(v, dtype=torch.int64), rnd]).to(torch.int32).view(torch.float32)


def all_16bit(dtype) -> torch.Tensor:
    return torch.arange(-2**15, 2**15, dtype=torch.int32).to(torch.int16).view(dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("src_dtype,dst_dtype", PAIRS, ids=lambda d: str(d).removeprefix("torch."))
def test_conversion_bit_exact(src_dtype, dst_dtype, device):
    """Every fp16 / bf16 bit pattern and the fp32 boundary cases: bits equal torch's ``.to()`` (NaN:
    NaN, with the kernel's documented payload); the torch backend agrees too."""
    src = (special_f32() if src_dtype == torch.float32 else all_16bit(src_dtype)).to(device)
    ref = src.to(dst_dtype)
    for backend in ("triton", "torch"):
        out = poison(torch.empty(src.shape, dtype=dst_dtype, device=device))
        copy_one(src, out, full_op(src), backend)
        assert_same_bits(out, ref)
        if backend == "triton":
            nan = src.isnan().cpu()
            want = nan_policy(bits(src).cpu().numpy()[nan.numpy()], src_dtype, dst_dtype)
            got = bits(out).cpu().numpy()[nan.numpy()].astype(np.int64) & (
                0xFFFFFFFF if dst_dtype == torch.float32 else 0xFFFF)
            np.testing.assert_array_equal(got, want)


def test_fp32_to_bf16_nan_is_c10_canonical():
    src = torch.tensor([0x7FC00000, 0xFFC00000, 0x7F800001, 0xFFFFFFFF], dtype=torch.int64)
    src = src.to(torch.int32).view(torch.float32)
    out = torch.empty(4, dtype=torch.bfloat16)
    copy_one(src, out, full_op(src), "triton")
    assert (bits(out) == 0x7FC0).all()


# -------------------------------------------------------------------------------- same-dtype copies


def random_tensor(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_complex:
        return torch.randn(*shape, dtype=dtype, generator=g)
    if dtype.is_floating_point and dtype.itemsize >= 2:
        return torch.randn(*shape, generator=g).to(dtype)
    b = torch.randint(-2**62, 2**62, shape, generator=g, dtype=torch.int64).to(BITS[dtype.itemsize])
    return b.view(dtype)


SAME = [torch.int8, torch.bool, torch.int64, torch.float64, torch.float8_e4m3fn, torch.float8_e5m2,
        torch.int32, torch.uint8, torch.int16, torch.complex64, torch.complex128, *FLOATS]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", SAME, ids=lambda d: str(d).removeprefix("torch."))
def test_same_dtype_raw_copy(dtype, device):
    src_full = random_tensor((6, 37), dtype).to(device)
    op = Op("t", 0, 1, (slice(1, 5), slice(3, 33)), (slice(0, 4), slice(2, 32)))
    ref = src_full[1:5, 3:33]
    for backend in ("triton", "torch"):
        dst_full = poison(torch.empty((5, 40), dtype=dtype, device=device))
        before = bits(dst_full).clone()
        copy_one(src_full, dst_full, op, backend)
        assert torch.equal(bits(dst_full[0:4, 2:32]), bits(ref))
        untouched = torch.ones(5, 40, dtype=torch.bool)
        untouched[0:4, 2:32] = False
        assert torch.equal(bits(dst_full)[untouched.to(device)], before[untouched.to(device)])


def test_nan_payload_kept_by_same_dtype_copy():
    src = torch.tensor([0x7FA00001, 0xFF800001], dtype=torch.int64).to(torch.int32).view(torch.float32)
    out = torch.zeros(2)
    copy_one(src, out, full_op(src), "triton")
    assert torch.equal(bits(out), bits(src))


# ------------------------------------------------------------------------------ shapes and strides


def strided_cases():
    g = torch.Generator().manual_seed(3)
    base = torch.randn(9, 10, 11, generator=g)
    yield "1d", torch.randn(50, generator=g), (slice(5, 45),)
    yield "2d-narrow-cols", torch.randn(33, 9, generator=g), (slice(0, 33), slice(2, 5))
    yield "2d-transposed", torch.randn(12, 30, generator=g).t(), (slice(3, 27), slice(1, 11))
    yield "3d-sliced", base[::2], (slice(0, 5), slice(1, 9), slice(0, 11))
    yield "3d-permuted", base.permute(2, 0, 1), (slice(1, 10), slice(0, 9), slice(2, 8))
    yield "4d", torch.randn(3, 4, 5, 6, generator=g), (slice(1, 3), slice(0, 4), slice(1, 5), slice(0, 6))
    yield "5d-split", torch.randn(2, 3, 2, 3, 4, generator=g).transpose(1, 3), (slice(0, 2),) * 5
    yield "expanded", torch.randn(1, 7, generator=g).expand(5, 7), (slice(0, 5), slice(0, 7))
    yield "empty", torch.randn(4, 6, generator=g), (slice(2, 2), slice(0, 6))
    yield "wide-rows", torch.randn(3, 5000, generator=g), (slice(0, 3), slice(3, 4999))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", list(strided_cases()), ids=lambda c: c[0])
@pytest.mark.parametrize("dst_dtype", [torch.float32, torch.bfloat16], ids=["copy", "cast"])
def test_strided_regions(case, dst_dtype, device):
    _, src_full, src_sl = case
    src_full = src_full.to(device)
    shape = tuple(s.stop - s.start for s in src_sl)
    # destination: a transposed, offset view of a bigger buffer, so dst strides are awkward too
    big = torch.empty(tuple(n + 2 for n in reversed(shape)), dtype=dst_dtype, device=device)
    dst_full = big.permute(*reversed(range(len(shape))))
    dst_sl = tuple(slice(1, 1 + n) for n in shape)
    op = Op("t", 0, 1, src_sl, dst_sl)
    ref = src_full[src_sl].to(dst_dtype)
    for backend in ("triton", "torch"):
        poison(big)
        table = copy_one(src_full, dst_full, op, backend)
        assert_same_bits(dst_full[dst_sl], ref)
        assert table.num_launches == (0 if ref.numel() == 0 else 1)
        assert table.bytes_written == ref.numel() * dst_dtype.itemsize


def test_collapse_contiguous_dims():
    src = torch.randn(4, 6, 8)
    out = torch.empty(4, 6, 8, dtype=torch.bfloat16)
    table = DescriptorTable.build([full_op(src)], src=lambda o: src, dst=lambda o: out)
    (region,) = table.entries[0].regions
    assert region.shape == (1, 1, 1, 192) and region.src_strides[3] == region.dst_strides[3] == 1


# ------------------------------------------------------------------------- one launch, many buffers


@pytest.mark.parametrize("device", DEVICES)
def test_one_launch_per_dtype_pair_across_buffers(device):
    """Many tensors, several source buffers and ranks: launches = distinct (src, dst) dtype groups;
    same-width copies of different dtypes share one launch."""
    g = torch.Generator().manual_seed(5)
    srcs = {r: {n: torch.randn(8, 16, generator=g).to(device) for n in ("a", "b", "c")} for r in (0, 1)}
    srcs[0]["i"] = torch.arange(64, dtype=torch.int32, device=device).reshape(8, 8)
    dst_dtype = {"a": torch.bfloat16, "b": torch.bfloat16, "c": torch.float32, "i": torch.int32}
    outs = {n: poison(torch.empty(16, 16, dtype=dst_dtype[n], device=device)) for n in ("a", "b", "c")}
    outs["i"] = poison(torch.empty(8, 8, dtype=torch.int32, device=device))
    ops = [Op(n, r, 9, (slice(0, 8), slice(0, 16)), (slice(8 * r, 8 * r + 8), slice(0, 16)))
           for n in ("a", "b", "c") for r in (0, 1)]
    ops.append(Op("i", 0, 9, (slice(0, 8), slice(0, 8)), (slice(0, 8), slice(0, 8))))
    table = DescriptorTable.build(ops, src=lambda o: srcs[o.src_rank][o.name], dst=lambda o: outs[o.name])
    assert len(table) == 7
    assert table.num_launches == 2  # f32->bf16 (a, b), 4-byte copies (c, i)
    table.run("triton")
    for n in ("a", "b", "c"):
        ref = torch.cat([srcs[0][n], srcs[1][n]]).to(dst_dtype[n])
        assert_same_bits(outs[n], ref)
    assert torch.equal(outs["i"], srcs[0]["i"])
    text = str(table)
    assert "2 launch(es)" in text and "'a' r1[0:8, 0:16] -> r9[8:16, 0:16]" in text


def test_step_through_one_entry():
    src = torch.arange(32.0).reshape(4, 8)
    out = torch.full((4, 8), float("nan"))
    ops = [Op("w", 0, 1, (slice(0, 4), slice(4 * k, 4 * k + 4)), (slice(0, 4), slice(4 * k, 4 * k + 4)))
           for k in (0, 1)]
    table = DescriptorTable.build(ops, src=lambda o: src, dst=lambda o: out)
    table.subset([1]).run("triton")
    e = table.entries[1]
    assert torch.equal(e.dst_view, e.src_view) and out[:, :4].isnan().all()


def test_build_rejects_bad_input():
    src, out = torch.zeros(4, 4), torch.zeros(4, 4, dtype=torch.int32)
    with pytest.raises(NotImplementedError, match="float32 -> torch.int32"):
        DescriptorTable.build([full_op(src)], src=lambda o: src, dst=lambda o: out)
    bad = Op("t", 0, 1, (slice(0, 4), slice(0, 4)), (slice(0, 2), slice(0, 4)))
    with pytest.raises(ValueError, match=r"src slice has shape \(4, 4\), dst slice \(2, 4\)"):
        DescriptorTable.build([bad], src=lambda o: src, dst=lambda o: src)
    with pytest.raises(ValueError, match="backend"):
        DescriptorTable.build([full_op(src)], src=lambda o: src, dst=lambda o: src).run("cuda")


# ------------------------------------------------------------------------------- kernel variants


def _variants(table):
    return sorted((lc.variant, lc.num_tiles) for g in table._groups for lc in g.launches)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("src_dtype,dst_dtype", [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16),
                                                 (torch.bfloat16, torch.float32), (torch.int8, torch.int8)],
                         ids=["copy16", "f32-bf16", "bf16-f32", "copy8"])
def test_wide_rows_tails_and_narrow_regions_in_one_table(src_dtype, dst_dtype, device):
    """Aligned wide rows take the 128-bit "rows" kernel (whole 4 KiB tiles); the rest of each row
    (whole vectors: the aligned "tiles" path; an odd tail) and the narrow unaligned region take
    "tiles": two launches, every element exact, nothing outside the slices written."""
    vec = 16 // min(src_dtype.itemsize, dst_dtype.itemsize)
    cols = 4096 // max(src_dtype.itemsize, dst_dtype.itemsize) * 2 + 3 * vec + 3  # 2 full tiles, a partial one, a tail
    pad16 = lambda n: -(-n // 16) * 16  # noqa: E731  (16 elements: 16-byte aligned row strides)
    src_full = random_tensor((3, pad16(cols + 9)), src_dtype, seed=7).to(device)
    dst_full = poison(torch.empty((4, pad16(cols + 8)), dtype=dst_dtype, device=device))
    before = bits(dst_full).clone()
    ops = [
        Op("w", 0, 1, (slice(0, 3), slice(0, cols)), (slice(0, 3), slice(0, cols))),  # aligned wide rows (+ tails)
        Op("n", 0, 1, (slice(0, 3), slice(1, 9)), (slice(1, 4), slice(cols, cols + 8))),  # narrow, unaligned
    ]
    table = DescriptorTable.build(ops, src=lambda o: src_full, dst=lambda o: dst_full)
    variants = _variants(table)
    assert [v for v, _ in variants] == ["rows", "tiles"] and table.num_launches == 2
    assert variants[0][1] == 3 * 2  # 3 rows x 2 whole 4 KiB tiles; the rest of each row: "tiles"
    (tiles,) = [lc for g in table._groups for lc in g.launches if lc.variant == "tiles"]
    flags = tiles.table[:, kernels.FIELD_NAMES.index("flags")].tolist()
    assert flags == [kernels.FLAG_ALIGNED, 0, 0]  # rest of the rows: whole vectors, odd tail; narrow op
    table.run("triton")
    assert_same_bits(dst_full[0:3, 0:cols], src_full[0:3, 0:cols].to(dst_dtype))
    assert_same_bits(dst_full[1:4, cols:cols + 8], src_full[0:3, 1:9].to(dst_dtype))
    written = torch.zeros(dst_full.shape, dtype=torch.bool)
    written[0:3, 0:cols] = True
    written[1:4, cols:cols + 8] = True
    written = written.to(device)
    assert torch.equal(bits(dst_full)[~written], before[~written])


def test_long_unaligned_run_is_reflowed_into_full_rows():
    """A contiguous run that starts off a 16-byte boundary cannot take "rows"; the builder re-flows
    it into COLS-wide rows so every lane of a "tiles" tile is used (few tiles), and stays exact."""
    src = random_tensor((1000,), torch.float32, seed=9)
    out = poison(torch.empty(1000, dtype=torch.bfloat16))
    op = Op("t", 0, 1, (slice(1, 998),), (slice(3, 1000),))
    table = DescriptorTable.build([op], src=lambda o: src, dst=lambda o: out)
    (launch,) = table._groups[0].launches
    assert launch.variant == "tiles" and launch.num_regions == 2  # 15 rows of 64 + a 37-element tail
    assert launch.num_tiles == 2
    table.run("triton")
    assert_same_bits(out[3:], src[1:998].to(torch.bfloat16))
    assert out[:3].isnan().all()


def test_plan_launches_rejects_unknown_device():
    with pytest.raises(ValueError, match="device must be cpu or cuda, got device='meta'"):
        kernels.plan_launches(("copy", 4), [], "meta")


def test_import_neither_initialises_cuda_nor_switches_triton_to_the_interpreter(tmp_path):
    """``import tritonreshard`` must not touch CUDA (a fork after import must stay possible) and must
    leave ``triton.jit`` compiling for every other library: checked in a fresh interpreter whose CUDA
    entry points raise if called."""
    script = tmp_path / "probe.py"
    script.write_text(textwrap.dedent('''
        import os, torch
        def boom(*a, **k):
            raise AssertionError("CUDA was touched at import")
        for name in ("is_available", "device_count", "init", "_lazy_init", "current_device"):
            setattr(torch.cuda, name, boom)
        torch._C._cuda_getDeviceCount = boom
        import tritonreshard, tritonreshard.kernels, tritonreshard.kernels.descriptors, tritonreshard.execute
        import triton, triton.language as tl
        from triton.runtime.jit import JITFunction
        assert "TRITON_INTERPRET" not in os.environ, os.environ["TRITON_INTERPRET"]
        @triton.jit
        def other_library_kernel(x_ptr):
            tl.store(x_ptr, 1)
        assert type(other_library_kernel) is JITFunction, type(other_library_kernel)
        assert type(tritonreshard.kernels.copy_rows_kernel) is JITFunction
        print("ok")
    '''))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr


def test_interpreter_env_does_not_change_which_kernels_run(tmp_path):
    """With ``TRITON_INTERPRET=1`` set by the user, our kernels are still the compiled JIT functions
    (what a CUDA launch and the compile gate use); CPU tensors still run exactly."""
    script = tmp_path / "probe.py"
    script.write_text(textwrap.dedent('''
        import torch
        from triton.runtime.jit import JITFunction
        from tritonreshard import kernels
        from tritonreshard.kernels import DescriptorTable
        assert type(kernels.copy_tiles_kernel) is JITFunction
        src = torch.arange(40, dtype=torch.float32).reshape(4, 10)
        out = torch.full((4, 10), float("nan"), dtype=torch.bfloat16)
        class Op:
            name, src_rank, dst_rank, shape = "t", 0, 1, (4, 10)
            src_slices = dst_slices = (slice(0, 4), slice(0, 10))
        DescriptorTable.build([Op()], src=lambda o: src, dst=lambda o: out).run("triton")
        assert torch.equal(out, src.to(torch.bfloat16))
        print("ok")
    '''))
    env = dict(os.environ, TRITON_INTERPRET="1")
    res = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr
