"""Block-FP8 quantization in the refit's own pass: bf16 (or fp32 / fp16) source slices -> e4m3 blocks
plus their fp32 scales, with no staged copy of the weights.

The formula is DeepGEMM's ``per_block_cast_to_fp8`` (what vLLM and SGLang ship), over each zero-padded
``bn x bk`` block of a partition of the weight:

* ``amax = max(max|x|, 1e-4)`` (fp32);
* ``s = amax / 448`` (IEEE division), or with UE8M0 ``s = 2**ceil(log2(amax / 448))`` computed on the
  bits (exponent + 1 when the mantissa is non-zero), stored as fp32;
* ``q = e4m3(x * (1 / s))``: round to nearest even, saturating at +-448.

``scale_rule="nemo_rl"`` is NeMo-RL's / verl's code (``nemo_rl/models/generation/fp8.py``): ``inv = 448 /
amax`` computed as torch computes a float divided by a tensor (``amax.reciprocal() * 448``, two
roundings), ``1.0`` for a zero block, no floor; ``q = e4m3(x * inv)``, ``s = 1 / inv``. It differs
from DeepGEMM's ``s`` in about half the blocks.

Three implementations, bit-identical (tests compare them with each other and with vLLM's own
``per_block_cast_to_fp8``):

* :func:`per_block_cast_to_fp8`: the reference on a whole tensor (torch ops);
* the torch backend of :class:`QuantizeTable` (torch ops, about 1 MiB of block rows of one destination
  at a time in an fp32 scratch buffer: no copy of the weight is kept);
* :func:`quantize_blocks_kernel`: one Triton program per destination block, reading the block whole
  from whatever source slices hold it (table-driven, like the gather kernels) and writing the e4m3
  block and its scale; the block lives in registers only. On CUDA fp32 -> e4m3 is the hardware
  conversion (``cvt.rn.satfinite.e4m3x2.f32`` on sm_90); in Triton's interpreter it is the integer
  round-to-nearest-even converter (:func:`e4m3_from_f32` in torch, ``_e4m3_bits`` in Triton), because
  the interpreter's own fp8 cast is wrong (Triton 3.9, measured: 2.1% of normally distributed values,
  a quarter of ties and subnormals; NaN from 464 up). The scale uses ``tl.math.div_rn``: Triton's ``/`` on
  fp32 compiles to an approximate division.

NaN or inf in a block: the scale is NaN or inf as in the reference; not a supported input.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import numpy as np
import torch
import triton.language as tl

from tritonreshard.planning import CASTABLE_DTYPES, FP8_DTYPE, BlockQuant

from ._jit import interpreted, jit
from .backends import copy_backend

# The descriptor flag bit and the 128-bit vector width mean the same in both kernels' tables: one home.
from .gather import ALIGN_BYTES as _ALIGN
from .gather import FLAG_ALIGNED

__all__ = ["E4M3_MAX", "AMAX_FLOOR", "QUANT_VARIANTS", "QuantizeLaunch", "QuantizeTable", "ceil_to_ue8m0",
           "e4m3_from_f32", "per_block_cast_to_fp8", "quantize_blocks_kernel", "quantize_launch_configs"]

E4M3_MAX = 448.0
AMAX_FLOOR = 1e-4
#: Source dtypes the quantizer reads (its launches are keyed by them).
QUANT_VARIANTS = tuple(CASTABLE_DTYPES)
BFIELDS = 8  # blocks table: dst_addr, ds_row, n_rows, n_cols, scale_addr, piece0, npieces, flags
PFIELDS = 8  # pieces table: src_addr, r0, r1, c0, c1, ss_row, ss_col (always 1), flags
_NUM_WARPS = 16  # the 128x128 tile at 16 warps: 89 registers (bf16), 121 (fp32), no spills (8 warps spill)
_SRC_T = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
_RULE = {"deepgemm": 0, "nemo_rl": 1}
# The torch backend quantizes this many bytes of fp32 scratch per step (as many block rows as fit,
# at least one), in one scratch and one work buffer for the whole table: 2 MiB in all, which stays in
# a core's L2 from step to step. Measured on a busy 2-core machine at 256 MiB: a scratch per weight
# (144 MiB touched per refit) made every op there 3-4x slower and the quantize 2.5-5x slower; 1 MiB
# steps are within 10% of the fastest single-threaded and take half the ops of one block row a step.
_TORCH_CHUNK_BYTES = 1 << 20


# ---------------------------------------------------------------------------------------------------
# torch numerics


def e4m3_from_f32(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> float8_e4m3fn bits (uint8 tensor of ``x``'s shape), integer round-to-nearest-even on
    the fp32 bits, saturating: finite values and infinities beyond 448 give +-448 (as
    ``cvt.rn.satfinite``), NaN gives 0x7F | sign. Equal to ``x.to(torch.float8_e4m3fn)`` wherever
    torch's cast is finite (torch gives NaN from 480 up)."""
    u = x.contiguous().view(torch.int32)
    sign = (u >> 24) & 0x80
    a = u & 0x7FFFFFFF
    # normal e4m3 (|x| >= 2**-6): rebias 127 -> 7 and round 23 -> 3 mantissa bits, ties to even;
    # a carry out of the mantissa bumps the exponent, as it should
    normal = (a - (120 << 23) + 0x7FFFF + ((a >> 20) & 1)) >> 20
    # subnormal e4m3: |x| / 2**-9 = m24 >> (141 - e), ties to even (shift capped at 31: rounds to 0)
    e = a >> 23
    m = (a & 0x7FFFFF) | torch.where(e != 0, 0x800000, 0)
    s = torch.clamp(141 - torch.clamp(e, min=1), 21, 31)
    q = m >> s
    rem = m & ((1 << s) - 1)
    half = 1 << (s - 1)
    sub = q + ((rem > half) | ((rem == half) & ((q & 1) == 1))).to(torch.int32)
    mag = torch.where(a > 0x7F800000, 0x7F,
                      torch.where(a >= 0x43E00000, 0x7E,  # >= 448: saturate (480 is NaN in e4m3fn)
                                  torch.where(a >= 0x3C800000, normal, sub)))
    return (sign | mag).to(torch.uint8)


def ceil_to_ue8m0(s: torch.Tensor) -> torch.Tensor:
    """The power of two at or above each positive normal fp32 ``s``, on the bits: the exponent, plus
    one when the mantissa is non-zero (DeepGEMM's ``ceil_to_ue8m0``, exactly; its
    ``2**ceil(log2(s))`` form rounds ``log2`` first and returns the power below for mantissas within a
    few ulps of zero)."""
    u = s.contiguous().view(torch.int32)
    e = ((u >> 23) & 0xFF) + ((u & 0x7FFFFF) != 0).to(torch.int32)
    return (e << 23).view(torch.float32)


def _scales(amax: torch.Tensor, ue8m0: bool, scale_rule: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(s, inv) from fp32 block maxima: ``w ~= q * s``, ``q = e4m3(x * inv)``."""
    if scale_rule == "nemo_rl":
        # NeMo-RL's code as written: ``448 / amax`` on a tensor is torch's reciprocal-then-multiply
        # (two roundings), a zero or infinite block gets 1.0, no floor
        inv = torch.where((amax == 0) | (amax == torch.inf), 1.0, amax.reciprocal() * E4M3_MAX)
        return inv.reciprocal(), inv
    s = amax.clamp(min=AMAX_FLOOR) / E4M3_MAX
    if ue8m0:
        s = ceil_to_ue8m0(s)
    return s, 1.0 / s


def _to_e4m3(y: torch.Tensor) -> torch.Tensor:
    # torch's cast is round-to-nearest-even; the clamp makes it saturate like cvt.rn.satfinite
    return y.clamp(-E4M3_MAX, E4M3_MAX).to(FP8_DTYPE)


def per_block_cast_to_fp8(x: torch.Tensor, block=(128, 128), ue8m0: bool = False,
                          scale_rule: str = "deepgemm") -> tuple[torch.Tensor, torch.Tensor]:
    """The reference: quantize a whole ``[..., N, K]`` tensor (any float dtype) in ``block`` blocks
    of its last two dims, zero-padded. Returns ``(q, s)``: ``q`` float8_e4m3fn ``[..., N, K]``, ``s``
    float32 ``[..., ceil(N/bn), ceil(K/bk)]``."""
    bn, bk = block
    *lead, n, k = x.shape
    nb, kb = -(-n // bn), -(-k // bk)
    xp = torch.zeros((*lead, nb * bn, kb * bk), dtype=torch.float32, device=x.device)
    xp[..., :n, :k] = x
    v = xp.view(*lead, nb, bn, kb, bk)
    amax = v.abs().amax(dim=(-3, -1), keepdim=True)
    s, inv = _scales(amax, ue8m0, scale_rule)
    q = _to_e4m3(v * inv).view(*lead, nb * bn, kb * bk)[..., :n, :k].contiguous()
    return q, s.reshape(*lead, nb, kb)


# ---------------------------------------------------------------------------------------------------
# Triton


@jit
def _e4m3_bits(u):
    """fp32 bits (int32) -> e4m3fn bits (int32 in 0..255): :func:`e4m3_from_f32` in Triton."""
    sign = (u >> 24) & 0x80
    a = u & 0x7FFFFFFF
    normal = (a - (120 << 23) + 0x7FFFF + ((a >> 20) & 1)) >> 20
    e = a >> 23
    m = (a & 0x7FFFFF) | tl.where(e != 0, 0x800000, 0)
    s = tl.minimum(tl.maximum(141 - tl.maximum(e, 1), 21), 31)
    q = m >> s
    rem = m & ((1 << s) - 1)
    half = 1 << (s - 1)
    sub = q + ((rem > half) | ((rem == half) & ((q & 1) == 1))).to(tl.int32)
    mag = tl.where(a > 0x7F800000, 0x7F, tl.where(a >= 0x43E00000, 0x7E, tl.where(a >= 0x3C800000, normal, sub)))
    return sign | mag


@jit(do_not_specialize=["num_blocks"])
def quantize_blocks_kernel(
    blocks_ptr,  # int64 [num_blocks, BFIELDS]: one destination block each
    pieces_ptr,  # int64 [num_pieces, PFIELDS]: the source boxes of each block, consecutive per block
    num_blocks,
    SRC_T: tl.constexpr,  # tl.float32 / tl.bfloat16 / tl.float16
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    VEC: tl.constexpr,  # source elements per 128-bit vector
    UE8M0: tl.constexpr,
    RULE: tl.constexpr,  # 0 deepgemm, 1 nemo_rl
    HW_CVT: tl.constexpr,  # compiled: the hardware's fp32 -> e4m3 (RNE, saturating); interpreted: integer RNE
    BFIELDS: tl.constexpr,
    PFIELDS: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    d = blocks_ptr + b * BFIELDS
    dst_addr = tl.load(d + 0)
    ds_row = tl.load(d + 1)
    n_rows = tl.load(d + 2).to(tl.int32)
    n_cols = tl.load(d + 3).to(tl.int32)
    scale_addr = tl.load(d + 4)
    piece0 = tl.load(d + 5)
    npieces = tl.load(d + 6)
    bflags = tl.load(d + 7).to(tl.int32)
    rows = tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_K)
    # The block, zero-padded like the reference, held in the source dtype (exact; half the registers
    # of fp32 for 16-bit sources); each source box overwrites its own rectangle (a select, not an add:
    # -0.0 must stay -0.0). Columns are contiguous in every box (the builder checked): one pointer
    # per row, and the compiler addresses a row's elements by immediate offsets.
    x = tl.full([BLOCK_N, BLOCK_K], 0.0, SRC_T)
    for p in range(piece0, piece0 + npieces):
        e = pieces_ptr + p * PFIELDS
        src_addr = tl.load(e + 0)
        r0 = tl.load(e + 1).to(tl.int32)
        r1 = tl.load(e + 2).to(tl.int32)
        c0 = tl.load(e + 3).to(tl.int32)
        c1 = tl.load(e + 4).to(tl.int32)
        ss_row = tl.load(e + 5)
        pflags = tl.load(e + 7).to(tl.int32)
        row_in = (rows >= r0) & (rows < r1)
        rr = tl.where(row_in, rows - r0, 0).to(tl.int64)
        # element (row, c0) of the box is src_addr; the pointer of column 0 is c0 elements before
        row_ptr = src_addr.to(tl.pointer_type(SRC_T)) + rr * ss_row - c0
        if (pflags & 1) != 0:
            # c0 == 0, 16-byte aligned rows, c1 a whole number of vectors: 128-bit loads
            m = row_in[:, None] & (cols < (c1 // VEC) * VEC)[None, :]
            v = tl.load(tl.multiple_of(row_ptr, 16)[:, None] + cols[None, :], mask=m, other=0.0)
        else:
            m = row_in[:, None] & ((cols >= c0) & (cols < c1))[None, :]
            v = tl.load(row_ptr[:, None] + cols[None, :], mask=m, other=0.0)
        x = tl.where(m, v, x)
    x = x.to(tl.float32)
    # tl.max is a @jit helper the interpreted twin cannot call; tl.reduce with tl.max's own combine
    # function is the same reduction compiled, and the interpreter's numpy fast path interpreted
    amax = tl.reduce(tl.reduce(tl.abs(x), 1, tl.standard._elementwise_max), 0, tl.standard._elementwise_max)
    if RULE == 0:
        s = tl.math.div_rn(tl.maximum(amax, 1e-4), 448.0)
        if UE8M0:
            sb = s.to(tl.int32, bitcast=True)
            sb = (((sb >> 23) & 0xFF) + ((sb & 0x7FFFFF) != 0).to(tl.int32)) << 23
            s = sb.to(tl.float32, bitcast=True)
        inv = tl.math.div_rn(1.0, s)
    else:
        special = (amax == 0.0) | (amax == float("inf"))  # NeMo-RL gives these blocks 1.0
        inv = tl.where(special, 1.0, tl.math.div_rn(1.0, tl.where(special, 1.0, amax)) * 448.0)
        s = tl.math.div_rn(1.0, inv)
    y = x * inv
    if HW_CVT:
        q = y.to(tl.float8e4nv).to(tl.int8, bitcast=True)
    else:
        q = _e4m3_bits(y.to(tl.int32, bitcast=True)).to(tl.int8)
    out = dst_addr.to(tl.pointer_type(tl.int8))
    rows64 = rows.to(tl.int64)
    if (bflags & 1) != 0:
        # 16-byte aligned rows, n_cols a multiple of 16: 128-bit stores
        out_rows = tl.multiple_of(out + rows64 * ds_row, 16)
        sm = (rows < n_rows)[:, None] & (cols < (n_cols // 16) * 16)[None, :]
        tl.store(out_rows[:, None] + cols[None, :], q, mask=sm)
    else:
        sm = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
        tl.store(out + (rows64 * ds_row)[:, None] + cols.to(tl.int64)[None, :], q, mask=sm)
    tl.store(scale_addr.to(tl.pointer_type(tl.float32)), s)


# ---------------------------------------------------------------------------------------------------
# host side


def quantize_launch_configs() -> tuple:
    """Every ``(src_dtype, block, ue8m0, scale_rule)`` configuration a recipe can launch (block
    128x128): what the compile gate compiles."""
    return tuple((dt, (128, 128), ue, rule) for dt in QUANT_VARIANTS
                 for ue, rule in ((False, "deepgemm"), (True, "deepgemm"), (False, "nemo_rl")))


class QuantizeLaunch:
    """One kernel launch: every destination block of one (source dtype, block, mode) group.
    :meth:`call` is what a compiled launch passes (also the compile gate's input); :meth:`launch`
    runs it, compiled on CUDA, interpreted (integer e4m3 conversion) on CPU."""

    def __init__(self, key, blocks: torch.Tensor, pieces: torch.Tensor):
        self.key = key
        self.blocks, self.pieces = blocks, pieces
        self.num_blocks = blocks.shape[0]

    def call(self):
        """``(kernel, grid, args, kwargs)`` of the compiled launch."""
        src_dtype, (bn, bk), ue8m0, rule = self.key
        kw = dict(SRC_T=_SRC_T[src_dtype], BLOCK_N=bn, BLOCK_K=bk, VEC=_ALIGN // src_dtype.itemsize,
                  UE8M0=ue8m0, RULE=_RULE[rule], HW_CVT=True, BFIELDS=BFIELDS, PFIELDS=PFIELDS,
                  num_warps=_NUM_WARPS)
        return quantize_blocks_kernel, (self.num_blocks,), (self.blocks, self.pieces, self.num_blocks), kw

    def launch(self) -> None:
        if self.num_blocks == 0:
            return
        kernel, grid, args, kw = self.call()
        if self.blocks.device.type == "cpu":
            interpreted(kernel)[grid](*args, **dict(kw, HW_CVT=False))
        else:
            with torch.cuda.device(self.blocks.device):
                kernel[grid](*args, **kw)


def _aligned(addr: int, *strides_bytes: int) -> bool:
    return addr % _ALIGN == 0 and all(s % _ALIGN == 0 for s in strides_bytes)


class _Job:
    """One destination weight on one rank: its fp8 tensor, scale tensor and source pieces."""

    def __init__(self, name: str, rank: int, q: BlockQuant, weight: torch.Tensor, scale: torch.Tensor):
        self.name, self.rank, self.q = name, rank, q
        self.weight, self.scale = weight, scale
        self.pieces: list[tuple[tuple[slice, ...], torch.Tensor]] = []  # (dst slices, source view)


class QuantizeTable:
    """The quantizing counterpart of :class:`~tritonreshard.kernels.DescriptorTable`: built once from a
    rank's ops into block-quantized weights, run every refit.

    ``run("triton")`` is one :func:`quantize_blocks_kernel` launch per (source dtype, block, mode)
    group, one program per destination block; ``run("torch")`` quantizes about 1 MiB of block rows at a
    time with torch ops in one fp32 scratch and one work buffer shared by every weight of the table
    (its only allocations besides torch's temporaries: no copy of the weights). Both write every destination element and
    every scale.
    """

    def __init__(self, jobs: list[_Job], device: torch.device):
        self.jobs = jobs
        self.device = device
        self.bytes_read = sum(sv.numel() * sv.element_size() for j in jobs for _, sv in j.pieces)
        self.bytes_written = sum(j.weight.numel() + j.scale.numel() * 4 for j in jobs)
        self._launches: list[QuantizeLaunch] | None = None
        self._chunks: list | None = None

    @classmethod
    def build(cls, ops: Iterable, quant: Mapping[str, BlockQuant], src: Callable[[object], torch.Tensor],
              dst: Callable[[object], torch.Tensor], scale: Callable[[int, str], torch.Tensor]) -> QuantizeTable:
        """``ops``: TransferOps into the weights named in ``quant`` (others are refused). ``src(op)``:
        the source rank's full local shard; ``dst(op)``: the destination rank's fp8 weight;
        ``scale(rank, name)``: that rank's fp32 scale tensor ``name``. Raises one ``ValueError``
        listing every problem: shapes, dtypes, devices, a weight whose rows are not contiguous, a
        destination element no op writes (each block must be read whole)."""
        problems: list[str] = []
        jobs: dict[tuple[int, str], _Job] = {}
        device = None
        for i, op in enumerate(ops):
            where = f"op {i} ({op.name!r} r{op.src_rank}->r{op.dst_rank})"
            q = quant.get(op.name)
            if q is None:
                problems.append(f"{where}: {op.name!r} is not a quantized weight")
                continue
            s_full, w = src(op).detach(), dst(op).detach()
            key = (op.dst_rank, op.name)
            if key not in jobs:
                sc = scale(op.dst_rank, q.scale).detach()
                jobs[key] = _Job(op.name, op.dst_rank, q, w, sc)
                if w.dtype != FP8_DTYPE:
                    problems.append(f"{where}: destination is {w.dtype}, not {FP8_DTYPE}")
                if w.dim() < 2 or w.stride(-1) != 1:
                    problems.append(f"{where}: destination {tuple(w.shape)} stride {w.stride()} needs >= 2 dims "
                                    f"and contiguous rows")
                elif sum(q.rows) != w.shape[-2]:
                    problems.append(f"{where}: rows {q.rows} do not add up to the weight's {w.shape[-2]}")
                elif tuple(sc.shape) != q.scale_shape(tuple(w.shape)) or sc.dtype != torch.float32:
                    problems.append(f"{where}: scale {q.scale!r} is {tuple(sc.shape)} {sc.dtype}, the block "
                                    f"grid is {q.scale_shape(tuple(w.shape))} torch.float32")
                if device is None:
                    device = w.device
                if w.device != device or sc.device != device:
                    problems.append(f"{where}: destination on {w.device}, scale on {sc.device}, others on {device}")
            if s_full.dtype not in QUANT_VARIANTS:
                problems.append(f"{where}: source dtype {s_full.dtype} is not one of {QUANT_VARIANTS}")
            if s_full.device.type != w.device.type:
                problems.append(f"{where}: source on {s_full.device}, destination on {w.device}")
            sv = s_full[tuple(op.src_slices)]
            if getattr(op, "src_dims", None) is not None:   # plan_quantized refuses these; never copy one wrong
                problems.append(f"{where}: a transposed op (src_dims={op.src_dims}); quantized weights are read "
                                f"untransposed")
                continue
            if tuple(sv.shape) != tuple(op.shape):
                problems.append(f"{where}: source slice {tuple(sv.shape)}, op says {tuple(op.shape)}")
                continue
            if sv.shape[-1] > 1 and sv.stride(-1) != 1:
                # the kernel reads a box's rows as contiguous runs (one pointer a row: no spills)
                problems.append(f"{where}: source columns have stride {sv.stride(-1)}; quantized sources "
                                f"need contiguous rows (stride 1)")
            jobs[key].pieces.append((tuple(op.dst_slices), sv))
        for j in jobs.values():
            cover = sum(sv.numel() for _, sv in j.pieces)
            if cover != j.weight.numel():
                problems.append(f"{j.name!r} on rank {j.rank}: ops write {cover} of its {j.weight.numel()} "
                                f"elements; a block is quantized only when read whole")
        if problems:
            raise ValueError("cannot build quantize table:\n  " + "\n  ".join(problems))
        return cls(list(jobs.values()), device if device is not None else torch.device("cpu"))

    # ------------------------------------------------------------------ Triton
    def _build_launches(self) -> list[QuantizeLaunch]:
        groups: dict = {}
        for j in self.jobs:
            q = j.q
            bn, bk = q.block
            w = j.weight
            *lead, n, k = w.shape
            sdt = j.pieces[0][1].dtype
            key = (sdt, q.block, q.ue8m0, q.scale_rule)
            blocks, pieces = groups.setdefault(key, ([], []))
            ds_row = w.stride(-2)
            sc = j.scale
            for li in np.ndindex(*lead):
                w_off = sum(i * st for i, st in zip(li, w.stride()[:-2], strict=True))
                s_off = sum(i * st for i, st in zip(li, sc.stride()[:-2], strict=True))
                mine = [(ds, sv[tuple(i - d.start for i, d in zip(li, ds[:-2], strict=True))] if lead else sv)
                        for ds, sv in j.pieces if all(d.start <= i < d.stop for i, d in zip(li, ds[:-2], strict=True))]
                for si, (a, z) in enumerate(q.row_blocks()):
                    for ci, c in enumerate(range(0, k, bk)):
                        cz = min(c + bk, k)
                        p0 = len(pieces)
                        for ds, sv in mine:
                            ra, rz = max(a, ds[-2].start), min(z, ds[-2].stop)
                            ca, cb = max(c, ds[-1].start), min(cz, ds[-1].stop)
                            if ra >= rz or ca >= cb:
                                continue
                            isz = sv.element_size()
                            addr = (sv.data_ptr() + ((ra - ds[-2].start) * sv.stride(-2)
                                                     + (ca - ds[-1].start) * sv.stride(-1)) * isz)
                            r0, r1, c0, c1 = ra - a, rz - a, ca - c, cb - c
                            ok = (c0 == 0 and sv.stride(-1) == 1 and c1 % (_ALIGN // isz) == 0
                                  and _aligned(addr, sv.stride(-2) * isz if r1 - r0 > 1 else 0))
                            pieces.append((addr, r0, r1, c0, c1, sv.stride(-2), sv.stride(-1),
                                           FLAG_ALIGNED if ok else 0))
                        daddr = w.data_ptr() + w_off + a * ds_row + c
                        saddr = sc.data_ptr() + (s_off + si * sc.stride(-2) + ci * sc.stride(-1)) * 4
                        bok = _aligned(daddr, ds_row if z - a > 1 else 0) and (cz - c) % 16 == 0
                        blocks.append((daddr, ds_row, z - a, cz - c, saddr, p0, len(pieces) - p0,
                                       FLAG_ALIGNED if bok else 0))
        out = []
        for key, (blocks, pieces) in groups.items():
            bt = torch.tensor(blocks, dtype=torch.int64).reshape(-1, BFIELDS).to(self.device)
            pt = torch.tensor(pieces, dtype=torch.int64).reshape(-1, PFIELDS).to(self.device)
            out.append(QuantizeLaunch(key, bt, pt))
        return out

    @property
    def launches(self) -> list[QuantizeLaunch]:
        if self._launches is None:
            self._launches = self._build_launches()
        return self._launches

    # ------------------------------------------------------------------ torch
    def _build_chunks(self) -> list:
        """Per chunk of up to ``_TORCH_CHUNK_BYTES // (bn * kp * 4)`` consecutive block rows of one
        weight matrix: ``(job, scratch view [m, bn, kb, bk], work view (same), zero-fill views,
        [(scratch rows, source rows)], [(weight rows, work rows)], scale rows)``. Block row ``i`` of a
        chunk sits at scratch rows ``[i*bn, i*bn + rows)``; full block rows that follow each other in
        the weight are one run, copied in and out by one op per source piece."""
        sizes = []
        for j in self.jobs:
            bn, bk = j.q.block
            kp = -(-j.weight.shape[-1] // bk) * bk
            per = max(1, min(len(j.q.row_blocks()), _TORCH_CHUNK_BYTES // (bn * kp * 4)))
            sizes.append((per * bn, kp))
        numel = max((r * kp for r, kp in sizes), default=0)
        # one scratch and one work buffer for the whole table, reused by every chunk: no copy of the
        # weights, and the same 2 MiB stay in cache from chunk to chunk
        scratch_all = torch.empty(numel, dtype=torch.float32, device=self.device)
        work_all = torch.empty(numel, dtype=torch.float32, device=self.device)
        out = []
        for j, (rows, kp) in zip(self.jobs, sizes, strict=True):
            bn, bk = j.q.block
            *lead, n, k = j.weight.shape
            kb = kp // bk
            per = rows // bn
            scratch = scratch_all[:rows * kp].view(rows, kp)
            work = work_all[:rows * kp].view(rows, kp)
            rb = j.q.row_blocks()
            for li in np.ndindex(*lead):
                mine = [(ds, sv[tuple(i - d.start for i, d in zip(li, ds[:-2], strict=True))] if lead else sv)
                        for ds, sv in j.pieces if all(d.start <= i < d.stop for i, d in zip(li, ds[:-2], strict=True))]
                weight, scale = j.weight[li], j.scale[li]
                for c in range(0, len(rb), per):
                    blocks = rb[c:c + per]
                    m = len(blocks)
                    # the reference's zero padding: the columns past k (the buffer is shared with other
                    # weights) and the rows past a short block row's end
                    zeros = [scratch[:m * bn, k:]] if k < kp else []
                    runs: list[list[int]] = []  # [weight row a, weight row z, scratch row]
                    for i, (a, z) in enumerate(blocks):
                        if z - a < bn:
                            zeros.append(scratch[i * bn + z - a:(i + 1) * bn])
                        if runs and runs[-1][1] == a and runs[-1][2] + runs[-1][1] - runs[-1][0] == i * bn:
                            runs[-1][1] = z
                        else:
                            runs.append([a, z, i * bn])
                    copies, writes = [], []
                    for a, z, r in runs:
                        for ds, sv in mine:
                            ra, rz = max(a, ds[-2].start), min(z, ds[-2].stop)
                            if ra < rz:
                                copies.append((scratch[r + ra - a:r + rz - a, ds[-1].start:ds[-1].stop],
                                               sv[ra - ds[-2].start:rz - ds[-2].start]))
                        writes.append((weight[a:z], work[r:r + z - a, :k]))
                    out.append((j, scratch[:m * bn].view(m, bn, kb, bk), work[:m * bn].view(m, bn, kb, bk), zeros,
                                copies, writes, scale[c:c + m]))
        return out

    def copy(self) -> None:
        """Quantize every block with torch ops (about 1 MiB of block rows at a time, see the class docstring)."""
        if self._chunks is None:
            self._chunks = self._build_chunks()
        for j, v, w, zeros, copies, writes, scale in self._chunks:
            for z in zeros:
                z.zero_()
            for d, src in copies:
                d.copy_(src)
            torch.abs(v, out=w)
            s, inv = _scales(w.amax(dim=(1, 3)), j.q.ue8m0, j.q.scale_rule)
            torch.mul(v, inv[:, None, :, None], out=w)
            # the clamp makes torch's round-to-nearest-even cast saturate (cvt.rn.satfinite)
            w.clamp_(-E4M3_MAX, E4M3_MAX)
            for d, src in writes:
                d.copy_(src)
            scale.copy_(s)

    def run(self, backend="triton") -> None:
        """Quantize every block with ``backend`` (a :class:`~tritonreshard.kernels.CopyBackend` or its
        name): ``"triton"``: :meth:`launch`; ``"torch"``: :meth:`copy`; ``"auto"``: by the table's device."""
        copy_backend(backend).run(self)

    def launch(self) -> None:
        """Quantize every block with the kernel (compiled on CUDA, interpreted on CPU)."""
        for lc in self.launches:
            lc.launch()

    def __len__(self) -> int:
        return len(self.jobs)

    @property
    def num_blocks(self) -> int:
        return sum(lc.num_blocks for lc in self.launches)

    def __repr__(self) -> str:
        return f"<QuantizeTable {len(self.jobs)} weights, {self.bytes_read} B read, {self.bytes_written} B written>"
