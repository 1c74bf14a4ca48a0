"""Batched strided gather with dtype conversion: one launch per (dtype pair, kernel variant) copies
any number of regions of any number of tensors.

Regions come from the table builder (:mod:`tritonreshard.kernels.descriptors`) as 4-D boxes (raw byte
addresses of the first source / destination element, shape outermost first, strides in elements;
the innermost dim is the destination's contiguous one). :func:`plan_launches` turns one dtype group's
regions into at most two launches, one per kernel variant, each with its own table:

* ``"rows"`` (:func:`copy_rows_kernel`): whole ``CHUNK``-element tiles (``ROWS_TILE_BYTES`` = 4 KiB
  on the wider side) of rows whose inner dim is contiguous on both sides and whose starts are
  16-byte aligned. Table: int64 ``[T, 2]``, one entry per tile (``src_addr``, ``dst_addr``). The
  kernel does no index math and has no mask inside a tile: a program reads its ``TILES`` tiles'
  addresses with one vector load per field and moves ``TILES x CHUNK`` elements with 128-bit loads
  and stores. 16 table bytes per 4 KiB tile (< 0.4%). The rest of such a row (shorter than a tile)
  goes to ``"tiles"``, cut where its whole vectors end so that part keeps the 128-bit path there.
* ``"tiles"`` (:func:`copy_tiles_kernel`): everything else (narrow rows, strided or transposed inner
  dims, unaligned starts, tails). Regions are 2-D here (``n_rows x n_cols``; the builder splits
  outer dims and re-flows long contiguous runs into ``COLS``-wide rows). Table: int64
  ``[R, NFIELDS]`` (fields below) plus an int32 tile -> region map. A tile is ``[ROWS, COLS]``
  (4 KiB on the wider side, 2 KiB for 1-byte copies); a program moves ``TILES`` consecutive tiles,
  reading tile k+1's table row while tile k's data moves, so the two dependent table reads are
  waited for once per program, not once per tile. A tile's position is decoded once, in 32 bits
  (the builder keeps rows and columns below ``INDEX_LIMIT``); offsets are per row plus per column,
  so the only per-element work is one add. Regions flagged "aligned" (unit inner strides, 16-byte
  aligned rows, length a whole number of vectors) take a 128-bit path.

====  ===========  ============================================================================
col   name         meaning (``"tiles"`` table)
====  ===========  ============================================================================
0     src_addr     byte address of the region's first source element (``tensor.data_ptr()``)
1     dst_addr     byte address of the region's first destination element
2     n_rows       rows (<= ``INDEX_LIMIT``)
3     n_cols       columns, the destination's contiguous dim (<= ``INDEX_LIMIT``)
4-5   ss_row/col   source strides in elements
6-7   ds_row/col   destination strides in elements
8     tile0        index of the region's first tile (exclusive prefix sum of tile counts)
9     col_tiles    tiles along the columns (``ceil(n_cols / COLS)``)
10    flags        bit 0 ``FLAG_ALIGNED``: the 128-bit path is safe
====  ===========  ============================================================================

Addresses are raw integers, so regions of one launch may live in different tensors, arenas, or memory
mapped from other processes (shared memory, CUDA IPC); only the dtype pair is fixed per launch.
Sizes and counts are table data or runtime arguments marked ``do_not_specialize``, so new shapes
never recompile: the configurations are exactly :func:`launch_configs`, and the compile gate
(``tests/test_compile_gate.py``) compiles every one of them for sm_90 through
:meth:`GatherLaunch.call`, the launch path itself.

Compiled or interpreted: a launch on CUDA tensors runs the compiled kernel; a launch on CPU tensors
runs the same source in Triton's interpreter (:mod:`._jit`), whatever ``TRITON_INTERPRET`` says.

Dtype conversion is done on raw bits with integer arithmetic, so the interpreter (which truncates
fp32->bf16) and compiled code agree bit for bit. Rounding is round-to-nearest-even, infinities and
signed zeros are kept, fp16 overflow gives inf, subnormals are exact. NaN policy (torch itself is not
consistent here: its CPU result depends on vector path and ISA, CUDA gives canonical 0x7FFF):

* to fp32: bf16 NaN bits are kept (``bits << 16``, like torch); fp16 NaN is quieted keeping the payload
  (``sign | 0x7FC00000 | mant << 13``, like x86 F16C / torch's vectorised CPU path).
* to bf16: every NaN becomes ``0x7FC0`` (c10's scalar ``round_to_nearest_even``).
* to fp16: quiet NaN keeping the top payload bits (``sign | 0x7E00 | mant32 >> 13``, like F16C).
* bf16 <-> fp16 go through fp32 (exact first step, one rounding), as torch does.
"""
from __future__ import annotations

import itertools

import numpy as np
import torch
import triton.language as tl

from tritonreshard.planning import CASTABLE_DTYPES, castable

from ._jit import interpreted, jit

FIELD_NAMES = ("src_addr", "dst_addr", "n_rows", "n_cols", "ss_row", "ss_col", "ds_row", "ds_col",
               "tile0", "col_tiles", "flags")
NFIELDS = len(FIELD_NAMES)
FLAG_ALIGNED = 1
ALIGN_BYTES = 16  # one 128-bit vector
MAX_DIMS = 4  # regions the builder hands over are 4-D boxes
VARIANTS = ("rows", "tiles")
INDEX_LIMIT = 2**30  # rows / columns per "tiles" region: 32-bit index math cannot overflow
ROWS_TILE_BYTES = 4096  # "rows": one tile, on the wider side (a multiple of ALIGN_BYTES)
_ROWS_TILES_PER_PROGRAM = 4  # 16 KiB per program: bytes in flight hide the one table read
_TILES_TILE_BYTES = 4096  # "tiles": one [ROWS, COLS] tile, on the wider side (2 KiB for 1-byte copies)
_TILES_COLS = 64  # columns per tile: 64..512 bytes per row segment, whole vectors
_TILES_PER_PROGRAM = 4  # 16 KiB per program; the table reads of the next tile overlap this one's data
_NUM_WARPS = 4

# dtype "kinds" the conversion code understands; RAW means "copy the bits"
_RAW, _F32, _BF16, _F16 = 0, 1, 2, 3
# Which dtypes cast is planning's table (CASTABLE_DTYPES); this is only the conversion code's number
# for each of them. A dtype planning calls castable that the code cannot convert fails here, at import.
_KIND = {dt: {torch.float32: _F32, torch.bfloat16: _BF16, torch.float16: _F16}[dt] for dt in CASTABLE_DTYPES}
_BITS_T = {1: tl.int8, 2: tl.int16, 4: tl.int32, 8: tl.int64}


def supported_conversion(src_dtype: torch.dtype, dst_dtype: torch.dtype) -> bool:
    """True if the kernels can copy ``src_dtype`` -> ``dst_dtype``: what a plan may connect
    (:func:`tritonreshard.planning.castable`: the same dtype, or any pair among
    :data:`~tritonreshard.planning.CASTABLE_DTYPES`), where a bit copy is 1, 2, 4 or 8 bytes wide."""
    return castable(src_dtype, dst_dtype) and (src_dtype != dst_dtype or src_dtype.itemsize in _BITS_T)


def group_key(src_dtype: torch.dtype, dst_dtype: torch.dtype):
    """Launch-group key: regions with equal keys share launches. Same-dtype copies are grouped by
    width only (an int32 copy and a float32 copy are the same bit copy)."""
    if src_dtype == dst_dtype:
        return ("copy", src_dtype.itemsize)
    return ("cast", src_dtype, dst_dtype)


def group_keys() -> tuple:
    """Every key :func:`group_key` can return for a pair :func:`supported_conversion` accepts."""
    copies = [("copy", w) for w in sorted(_BITS_T)]
    casts = [("cast", s, d) for s in _KIND for d in _KIND if s != d]
    return tuple(copies + casts)


def launch_configs() -> tuple:
    """Every ``(variant, key)`` a launch can have: what the compile gate compiles. Constexprs are a
    function of these two (:func:`_constexprs`), everything else is runtime data."""
    return tuple((v, k) for k in group_keys() for v in VARIANTS)


def _widths(key) -> tuple[int, int, int, int]:
    if key[0] == "copy":
        return key[1], key[1], _RAW, _RAW
    return key[1].itemsize, key[2].itemsize, _KIND[key[1]], _KIND[key[2]]


def _vec(key) -> int:
    """Elements per 128-bit vector on the narrower side: a row length that is a multiple of this is
    a whole number of vectors on both sides."""
    sb, db, _, _ = _widths(key)
    return ALIGN_BYTES // min(sb, db)


def _constexprs(variant: str, key) -> dict:
    sb, db, sk, dk = _widths(key)
    wide = max(sb, db)
    common = dict(SRC_T=_BITS_T[sb], DST_T=_BITS_T[db], SRC_KIND=sk, DST_KIND=dk)
    if variant == "rows":
        return dict(common, CHUNK=ROWS_TILE_BYTES // wide, TILES=_ROWS_TILES_PER_PROGRAM)
    # at most 2048 elements a tile (16 a thread): the strided path keeps a 64-bit address per element
    elems = min(_TILES_TILE_BYTES // wide, 2048)
    return dict(common, VEC=_vec(key), ROWS=elems // _TILES_COLS, COLS=_TILES_COLS,
                TILES=_TILES_PER_PROGRAM, NFIELDS=NFIELDS)

# ---------------------------------------------------------------------------------------------------
# bit-exact conversions (integer arithmetic only; fp32 bits are carried in int32)


@jit
def _f16_bits_to_f32_bits(h):
    h = h.to(tl.int32) & 0xFFFF
    sign = (h & 0x8000) << 16
    e = (h >> 10) & 0x1F
    m = h & 0x3FF
    normal = ((e + 112) << 23) | (m << 13)
    infnan = 0x7F800000 | (m << 13) | tl.where(m != 0, 0x400000, 0)
    # fp16 subnormal = m * 2**-24: exact in fp32 (m < 2**10, result is a normal fp32)
    sub = (m.to(tl.float32) * 5.9604644775390625e-08).to(tl.int32, bitcast=True)
    mag = tl.where(e == 0, sub, tl.where(e == 31, infnan, normal))
    return sign | mag


@jit
def _f32_bits_to_bf16_bits(u):
    a = u & 0x7FFFFFFF
    lsb = (u >> 16) & 1
    # add 0x7FFF + lsb and truncate: round to nearest, ties to even; carries into the exponent give
    # the next binade or inf, as they should. Done on the magnitude so the sign never overflows.
    mag = (a + 0x7FFF + lsb) >> 16
    sign = (u >> 16) & 0x8000
    r = tl.where(a > 0x7F800000, 0x7FC0, sign | mag)
    return r.to(tl.int16)


@jit
def _f32_bits_to_f16_bits(u):
    sign = (u >> 16) & 0x8000
    a = u & 0x7FFFFFFF
    # normal fp16 (|x| >= 2**-14): rebias exponent (127 -> 15) and round 23 -> 10 mantissa bits, RNE
    normal = (a - 0x38000000 + 0xFFF + ((a >> 13) & 1)) >> 13
    # subnormal fp16: value / 2**-24 = m24 >> (126 - e), rounded to nearest even
    e = a >> 23
    m = (a & 0x7FFFFF) | tl.where(e != 0, 0x800000, 0)
    s = tl.minimum(tl.maximum(126 - e, 14), 31)  # >= 25 always rounds to 0; 31 keeps shifts defined
    q = m >> s
    rem = m & ((1 << s) - 1)
    half = 1 << (s - 1)
    sub = q + ((rem > half) | ((rem == half) & ((q & 1) == 1))).to(tl.int32)
    nan = 0x7E00 | (a & 0x7FFFFF) >> 13
    # |x| >= 65520 rounds to inf (65504 is the largest fp16; the tie at 65520 goes to even = inf)
    mag = tl.where(a > 0x7F800000, nan,
                   tl.where(a >= 0x477FF000, 0x7C00,
                            tl.where(a >= 0x38800000, normal, sub)))
    return (sign | mag).to(tl.int16)


@jit
def _convert_bits(x, SRC_KIND: tl.constexpr, DST_KIND: tl.constexpr):
    if SRC_KIND == DST_KIND:
        out = x
    else:
        if SRC_KIND == 1:
            u = x
        elif SRC_KIND == 2:
            u = (x.to(tl.int32) & 0xFFFF) << 16
        else:
            u = _f16_bits_to_f32_bits(x)
        if DST_KIND == 1:
            out = u
        elif DST_KIND == 2:
            out = _f32_bits_to_bf16_bits(u)
        else:
            out = _f32_bits_to_f16_bits(u)
    return out


# ---------------------------------------------------------------------------------------------------
# the kernels


@jit(do_not_specialize=["num_tiles"])
def copy_rows_kernel(
    tiles_ptr,  # int64 [num_tiles, 2]: (src_addr, dst_addr) of each CHUNK-element tile
    num_tiles,
    SRC_T: tl.constexpr,  # integer type of the source's bit width
    DST_T: tl.constexpr,
    SRC_KIND: tl.constexpr,  # 0 raw bits, 1 fp32, 2 bf16, 3 fp16
    DST_KIND: tl.constexpr,
    CHUNK: tl.constexpr,  # elements per tile
    TILES: tl.constexpr,  # tiles per program
):
    tile = tl.program_id(0).to(tl.int64) * TILES + tl.arange(0, TILES).to(tl.int64)
    live = tile < num_tiles  # only the last program has tiles past the end
    src_addr = tl.load(tiles_ptr + tile * 2, mask=live, other=0)
    dst_addr = tl.load(tiles_ptr + tile * 2 + 1, mask=live, other=0)
    # Whole tiles of 16-byte aligned starts (the builder's guarantee) + contiguous lanes: 128-bit
    # accesses, and no mask inside a tile (the mask is per tile, constant along the lanes).
    src = tl.multiple_of(src_addr.to(tl.pointer_type(SRC_T)), 16)
    dst = tl.multiple_of(dst_addr.to(tl.pointer_type(DST_T)), 16)
    lane = tl.arange(0, CHUNK)
    x = tl.load(src[:, None] + lane[None, :], mask=live[:, None])
    tl.store(dst[:, None] + lane[None, :], _convert_bits(x, SRC_KIND, DST_KIND), mask=live[:, None])


@jit
def _tile_fields(desc_ptr, region, NFIELDS: tl.constexpr):
    """One "tiles" table row as scalars (sizes and tile bookkeeping in int32: < INDEX_LIMIT)."""
    d = desc_ptr + region.to(tl.int64) * NFIELDS
    return (tl.load(d + 0), tl.load(d + 1), tl.load(d + 2).to(tl.int32), tl.load(d + 3).to(tl.int32),
            tl.load(d + 4), tl.load(d + 5), tl.load(d + 6), tl.load(d + 7),
            tl.load(d + 8).to(tl.int32), tl.load(d + 9).to(tl.int32), tl.load(d + 10).to(tl.int32))


@jit
def _copy_tile(tile, num_tiles, f, SRC_T: tl.constexpr, DST_T: tl.constexpr, SRC_KIND: tl.constexpr,
               DST_KIND: tl.constexpr, VEC: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr):
    src_addr, dst_addr, n_rows, n_cols, ss_row, ss_col, ds_row, ds_col, tile0, col_tiles, flags = f
    local = tile - tile0
    row_tile = local // col_tiles  # once per tile, in 32 bits, not per element
    col_tile = local - row_tile * col_tiles
    rows = row_tile * ROWS + tl.arange(0, ROWS)
    cols = col_tile * COLS + tl.arange(0, COLS)
    row_ok = rows < tl.where(tile < num_tiles, n_rows, 0)  # tiles past the end (last program): none
    rows64 = rows.to(tl.int64)
    src_base = src_addr.to(tl.pointer_type(SRC_T))
    dst_base = dst_addr.to(tl.pointer_type(DST_T))
    if (flags & 1) != 0:
        # Unit inner strides, 16-byte aligned row starts, n_cols a whole number of vectors (checked
        # by the builder): per-row pointers + contiguous columns give 128-bit accesses.
        src_rows = tl.multiple_of(src_base + rows64 * ss_row, 16)
        dst_rows = tl.multiple_of(dst_base + rows64 * ds_row, 16)
        # n_cols is a whole number of vectors; saying so with arithmetic (a hint on a function
        # argument would be lost) lets the mask keep whole vectors together
        mask = row_ok[:, None] & (cols < (n_cols // VEC) * VEC)[None, :]
        x = tl.load(src_rows[:, None] + cols[None, :], mask=mask)
        tl.store(dst_rows[:, None] + cols[None, :], _convert_bits(x, SRC_KIND, DST_KIND), mask=mask)
    else:
        mask = row_ok[:, None] & (cols < n_cols)[None, :]
        cols64 = cols.to(tl.int64)
        src_off = (rows64 * ss_row)[:, None] + (cols64 * ss_col)[None, :]
        dst_off = (rows64 * ds_row)[:, None] + (cols64 * ds_col)[None, :]
        x = tl.load(src_base + src_off, mask=mask)
        tl.store(dst_base + dst_off, _convert_bits(x, SRC_KIND, DST_KIND), mask=mask)


@jit(do_not_specialize=["num_tiles"])
def copy_tiles_kernel(
    desc_ptr,  # int64 [num_regions, NFIELDS]
    tile_region_ptr,  # int32 [num_tiles]: region of each tile
    num_tiles,
    SRC_T: tl.constexpr,
    DST_T: tl.constexpr,
    SRC_KIND: tl.constexpr,
    DST_KIND: tl.constexpr,
    VEC: tl.constexpr,
    ROWS: tl.constexpr,  # rows per tile
    COLS: tl.constexpr,  # columns per tile (a multiple of VEC)
    TILES: tl.constexpr,  # consecutive tiles per program
    NFIELDS: tl.constexpr,
):
    # Table reads are pipelined: while tile k's data moves, tile k+1's table row and tile k+2's
    # region index are already in flight, so only the first tile of a program waits for them.
    # (A run-time loop: one copy of the body keeps the code small and the compile fast.)
    first = tl.program_id(0) * TILES
    region = tl.load(tile_region_ptr + first)  # first < num_tiles: the grid is cdiv(num_tiles, TILES)
    f = _tile_fields(desc_ptr, region, NFIELDS)
    last = num_tiles - 1  # look-ahead past the end re-reads the last entry (always in bounds)
    region = tl.load(tile_region_ptr + tl.minimum(first + 1, last))
    for k in range(TILES):
        tile = first + k
        f_next = _tile_fields(desc_ptr, region, NFIELDS)
        region = tl.load(tile_region_ptr + tl.minimum(tile + 2, last))
        _copy_tile(tile, num_tiles, f, SRC_T, DST_T, SRC_KIND, DST_KIND, VEC, ROWS, COLS)
        f = f_next


# ---------------------------------------------------------------------------------------------------
# host side: regions -> per-variant tables -> launches


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _outer_offsets(shape, strides) -> np.ndarray:
    """Element offsets of every row (all index combinations of the three outer dims), int64."""
    n0, n1, n2 = shape[:3]
    s0, s1, s2 = strides[:3]
    off = (np.arange(n0, dtype=np.int64)[:, None, None] * s0 + np.arange(n1, dtype=np.int64)[None, :, None] * s1
           + np.arange(n2, dtype=np.int64)[None, None, :] * s2)
    return off.reshape(-1)


def _rows_tiles(box, full: int, sb: int, db: int, chunk: int) -> np.ndarray:
    """``"rows"`` table entries of the first ``full`` (a multiple of ``chunk``) elements of every
    row of ``box``."""
    sa, da, shape, ss, ds = box
    so, do = _outer_offsets(shape, ss), _outer_offsets(shape, ds)
    starts = np.arange(0, full, chunk, dtype=np.int64)
    out = np.empty((so.size, starts.size, 2), dtype=np.int64)
    out[..., 0] = sa + (so[:, None] + starts[None, :]) * sb
    out[..., 1] = da + (do[:, None] + starts[None, :]) * db
    return out.reshape(-1, 2)


def _tiles_regions(box, sb: int, db: int, cols: int):
    """2-D ``(addr, addr, n_rows, n_cols, ss_row, ss_col, ds_row, ds_col)`` pieces of ``box`` for the
    ``"tiles"`` variant: one per index of the two outer dims, contiguous single rows re-flowed into
    ``cols``-wide rows (so a long unaligned run still fills every lane), cut below INDEX_LIMIT."""
    sa, da, (n0, n1, n2, n3), ss, ds = box
    for i0, i1 in itertools.product(range(n0), range(n1)):
        a = sa + (i0 * ss[0] + i1 * ss[1]) * sb
        b = da + (i0 * ds[0] + i1 * ds[1]) * db
        pieces = [(a, b, n2, n3, ss[2], ss[3], ds[2], ds[3])]
        if n2 == 1 and ss[3] == 1 and ds[3] == 1 and n3 > cols:
            full = n3 - n3 % cols
            pieces = [(a, b, full // cols, cols, cols, 1, cols, 1)]
            if n3 > full:
                pieces.append((a + full * sb, b + full * db, 1, n3 - full, 0, 1, 0, 1))
        for (a, b, rows, ncols, sr, sc, dr, dc) in pieces:
            for r0 in range(0, rows, INDEX_LIMIT):
                for c0 in range(0, ncols, INDEX_LIMIT):
                    yield (a + (r0 * sr + c0 * sc) * sb, b + (r0 * dr + c0 * dc) * db,
                           min(INDEX_LIMIT, rows - r0), min(INDEX_LIMIT, ncols - c0), sr, sc, dr, dc)


class GatherLaunch:
    """One kernel launch over one table: ``variant`` in ``VARIANTS``, ``key`` a :func:`group_key`.

    Built by :func:`plan_launches`; :meth:`call` is the one place that turns the table into the
    kernel's arguments (used by :meth:`launch` and by the compile gate), :meth:`launch` runs it:
    compiled on CUDA tensors, in Triton's interpreter on CPU tensors.
    """

    def __init__(self, variant: str, key, table: torch.Tensor, tile_region: torch.Tensor | None, num_regions: int):
        self.variant, self.key = variant, key
        self.table, self.tile_region = table, tile_region
        self.num_regions = num_regions
        self.num_tiles = table.shape[0] if variant == "rows" else tile_region.numel()

    @property
    def device(self) -> torch.device:
        return self.table.device

    def call(self):
        """``(kernel, grid, args, kwargs)``: the launch is ``kernel[grid](*args, **kwargs)``."""
        kw = dict(_constexprs(self.variant, self.key), num_warps=_NUM_WARPS)
        if self.variant == "rows":
            return copy_rows_kernel, (_cdiv(self.num_tiles, kw["TILES"]),), (self.table, self.num_tiles), kw
        grid = (_cdiv(self.num_tiles, kw["TILES"]),)
        return copy_tiles_kernel, grid, (self.table, self.tile_region, self.num_tiles), kw

    def launch(self) -> None:
        """Enqueue the copy (CUDA: on the current stream of the table's device; CPU: runs now)."""
        if self.num_tiles == 0:
            return
        kernel, grid, args, kw = self.call()
        if self.device.type == "cpu":
            interpreted(kernel)[grid](*args, **kw)
        else:
            with torch.cuda.device(self.device):
                kernel[grid](*args, **kw)

    def __repr__(self) -> str:
        return f"<GatherLaunch {self.variant} {self.key}: {self.num_regions} regions, {self.num_tiles} tiles>"


def plan_launches(key, boxes, device) -> list[GatherLaunch]:
    """The launches (at most one per variant) that copy ``boxes`` of one dtype group.

    ``boxes``: ``(src_addr, dst_addr, shape, src_strides, dst_strides)`` per region, 4-D shapes
    (outermost first, inner dim last; strides in elements, addresses in bytes). ``device``: where
    the memory is (``cpu`` or ``cuda:N``); the tables are put there. Called once when a descriptor
    table is built; the launches are then reused every refit.
    """
    device = torch.device(device)
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be cpu or cuda, got device={str(device)!r}")
    sb, db, _, _ = _widths(key)
    vec = _vec(key)
    chunk = _constexprs("rows", key)["CHUNK"]
    tc = _constexprs("tiles", key)
    rows_parts, rows_regions, pieces = [], 0, []
    for box in boxes:
        sa, da, shape, ss, ds = box
        if 0 in shape:
            continue
        n3 = shape[3]
        aligned_rows = (ss[3] == 1 and ds[3] == 1 and sa % ALIGN_BYTES == 0 and da % ALIGN_BYTES == 0
                        and all(n == 1 or (s * sb) % ALIGN_BYTES == 0 for n, s in zip(shape[:3], ss[:3], strict=True))
                        and all(n == 1 or (d * db) % ALIGN_BYTES == 0 for n, d in zip(shape[:3], ds[:3], strict=True)))
        if not aligned_rows:
            pieces.extend(_tiles_regions(box, sb, db, tc["COLS"]))
            continue
        # Aligned rows: whole CHUNK tiles to "rows"; the rest of each row to "tiles", cut where
        # the whole vectors end so that the vector part keeps the 128-bit path.
        full, body = n3 - n3 % chunk, n3 - n3 % vec
        if full:
            rows_parts.append(_rows_tiles(box, full, sb, db, chunk))
            rows_regions += 1
        for lo, hi in ((full, body), (max(full, body), n3)):
            if hi > lo:
                pieces.extend(_tiles_regions((sa + lo * sb, da + lo * db, (*shape[:3], hi - lo), ss, ds),
                                             sb, db, tc["COLS"]))

    launches = []
    if rows_parts:
        table = torch.from_numpy(np.concatenate(rows_parts)).to(device)
        launches.append(GatherLaunch("rows", key, table, None, rows_regions))
    if pieces:
        desc, counts, tile0 = [], [], 0
        for (a, b, rows, ncols, sr, sc, dr, dc) in pieces:
            aligned = (sc == 1 and dc == 1 and a % ALIGN_BYTES == 0 and b % ALIGN_BYTES == 0
                       and ncols % vec == 0
                       and (rows == 1 or ((sr * sb) % ALIGN_BYTES == 0 and (dr * db) % ALIGN_BYTES == 0)))
            col_tiles = _cdiv(ncols, tc["COLS"])
            n = col_tiles * _cdiv(rows, tc["ROWS"])
            desc.append((a, b, rows, ncols, sr, sc, dr, dc, tile0, col_tiles, FLAG_ALIGNED if aligned else 0))
            counts.append(n)
            tile0 += n
        if tile0 >= 2**31:
            raise NotImplementedError(f"{tile0} tiles in one launch: the tile index is 32-bit (split the copy)")
        table = torch.tensor(desc, dtype=torch.int64).to(device)
        tile_region = torch.repeat_interleave(torch.arange(len(desc), dtype=torch.int32),
                                              torch.tensor(counts, dtype=torch.int64)).to(device)
        launches.append(GatherLaunch("tiles", key, table, tile_region, len(desc)))
    return launches
