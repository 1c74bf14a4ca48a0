"""Batched strided gather with dtype conversion: one launch copies any number of regions.

Descriptor table format (int64 tensor ``[num_regions, NFIELDS]`` on the kernel's device), one row per
rectangular region of at most ``MAX_DIMS`` = 4 dims (dims contiguous in both source and destination
are collapsed by the table builder, so 4 is plenty; more are split into several regions):

====  ===========  ============================================================================
col   name         meaning
====  ===========  ============================================================================
0     src_addr     byte address of the region's first source element (``tensor.data_ptr()``)
1     dst_addr     byte address of the region's first destination element
2-5   n0..n3       region shape, outermost first, padded with leading 1s; n3 is the inner dim
6-9   ss0..ss3     source strides in *elements*
10-13 ds0..ds3     destination strides in *elements*
14    tile0        index of the region's first tile (exclusive prefix sum of tile counts)
15    log_w        log2 of the lanes a tile spends on one row (``LOG_BLOCK``: one row per tile)
16    col_tiles    tiles along the inner dim (``ceil(n3 / 2**log_w)``)
17    flags        bit 0: "aligned": inner strides are 1 and the row starts are 16-byte aligned,
                   so full tiles may take the unmasked, vectorised path
====  ===========  ============================================================================

Addresses are raw integers, so regions of one launch may live in different tensors, arenas, or memory
mapped from other processes (shared memory, CUDA IPC); only the dtype pair is fixed per launch.

Tiling (why): the copy is bandwidth bound, so each program moves one tile of ``BLOCK`` elements
(8 KiB on the wider side) laid along the innermost dim, which the builder makes the destination's
contiguous dim: wide, contiguous, coalesced loads and stores, and with 16-byte alignment the compiler
emits 128-bit vector accesses. Rows narrower than ``BLOCK`` share a tile (``2**log_w`` lanes per row) so
column shards of small matrices do not waste lanes. A tile table (``int32`` region index per tile) maps
a program to its region in O(1). Sizes and counts are data in the table or runtime arguments marked
``do_not_specialize``, so new shapes never trigger a recompile; only the dtype pair does.

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
import torch
import triton
import triton.language as tl

MAX_DIMS = 4
FIELD_NAMES = (
    "src_addr", "dst_addr",
    "n0", "n1", "n2", "n3",
    "ss0", "ss1", "ss2", "ss3",
    "ds0", "ds1", "ds2", "ds3",
    "tile0", "log_w", "col_tiles", "flags",
)
NFIELDS = len(FIELD_NAMES)
FLAG_ALIGNED = 1
ALIGN_BYTES = 16

# dtype "kinds" the conversion code understands; RAW means "copy the bits"
_RAW, _F32, _BF16, _F16 = 0, 1, 2, 3
_KIND = {torch.float32: _F32, torch.bfloat16: _BF16, torch.float16: _F16}
_BITS_T = {1: tl.int8, 2: tl.int16, 4: tl.int32, 8: tl.int64}


def supported_conversion(src_dtype: torch.dtype, dst_dtype: torch.dtype) -> bool:
    """True if the kernel can copy ``src_dtype`` -> ``dst_dtype`` (same dtype of width 1/2/4/8 bytes,
    or any pair among float32, bfloat16, float16)."""
    if src_dtype == dst_dtype:
        return src_dtype.itemsize in _BITS_T
    return src_dtype in _KIND and dst_dtype in _KIND


def group_key(src_dtype: torch.dtype, dst_dtype: torch.dtype):
    """Launch-group key: regions with equal keys share one launch. Same-dtype copies are grouped by
    width only (an int32 copy and a float32 copy are the same bit copy)."""
    if src_dtype == dst_dtype:
        return ("copy", src_dtype.itemsize)
    return ("cast", src_dtype, dst_dtype)


def block_for(key) -> int:
    """Tile size in elements: 8 KiB on the wider side (enough bytes in flight per program to saturate
    HBM with 4 warps of 128-bit accesses), at least 1024 lanes so each tile row is 16-byte aligned."""
    if key[0] == "copy":
        width = key[1]
    else:
        width = max(key[1].itemsize, key[2].itemsize)
    return max(1024, min(4096, 8192 // width))


def tile_geometry(inner: int, rows: int, block: int) -> tuple[int, int, int]:
    """``(log_w, col_tiles, num_tiles)`` of a region with ``rows`` rows of ``inner`` elements."""
    log_block = block.bit_length() - 1
    if inner <= 0 or rows <= 0:
        return log_block, 0, 0
    log_w = min(log_block, max(0, (inner - 1).bit_length()))  # lanes per row: next pow2 >= inner
    w = 1 << log_w
    col_tiles = -(-inner // w)
    rows_per_tile = block >> log_w
    return log_w, col_tiles, col_tiles * -(-rows // rows_per_tile)


# ---------------------------------------------------------------------------------------------------
# bit-exact conversions (integer arithmetic only; fp32 bits are carried in int32)


@triton.jit
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


@triton.jit
def _f32_bits_to_bf16_bits(u):
    a = u & 0x7FFFFFFF
    lsb = (u >> 16) & 1
    # add 0x7FFF + lsb and truncate: round to nearest, ties to even; carries into the exponent give
    # the next binade or inf, as they should. Done on the magnitude so the sign never overflows.
    mag = (a + 0x7FFF + lsb) >> 16
    sign = (u >> 16) & 0x8000
    r = tl.where(a > 0x7F800000, 0x7FC0, sign | mag)
    return r.to(tl.int16)


@triton.jit
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


@triton.jit
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
# the kernel


@triton.jit(do_not_specialize=["num_tiles"])
def gather_kernel(
    desc_ptr,  # int64 [num_regions, NFIELDS]
    tile_region_ptr,  # int32 [num_tiles]: region of each tile
    num_tiles,
    SRC_T: tl.constexpr,  # integer type of the source's bit width
    DST_T: tl.constexpr,
    SRC_KIND: tl.constexpr,  # 0 raw bits, 1 fp32, 2 bf16, 3 fp16
    DST_KIND: tl.constexpr,
    SRC_BYTES: tl.constexpr,
    DST_BYTES: tl.constexpr,
    NFIELDS: tl.constexpr,
    BLOCK: tl.constexpr,
    LOG_BLOCK: tl.constexpr,
):
    tile = tl.program_id(0).to(tl.int64)
    region = tl.load(tile_region_ptr + tile).to(tl.int64)
    d = desc_ptr + region * NFIELDS
    src_addr = tl.load(d + 0)
    dst_addr = tl.load(d + 1)
    n0 = tl.load(d + 2)
    n1 = tl.load(d + 3)
    n2 = tl.load(d + 4)
    n3 = tl.load(d + 5)
    ss0 = tl.load(d + 6)
    ss1 = tl.load(d + 7)
    ss2 = tl.load(d + 8)
    ss3 = tl.load(d + 9)
    ds0 = tl.load(d + 10)
    ds1 = tl.load(d + 11)
    ds2 = tl.load(d + 12)
    ds3 = tl.load(d + 13)
    tile0 = tl.load(d + 14)
    log_w = tl.load(d + 15)
    col_tiles = tl.load(d + 16)
    flags = tl.load(d + 17)
    # a program past num_tiles (over-sized grid) sees an empty inner dim and touches nothing
    n3 = tl.where(tile < num_tiles, n3, 0)

    local = tile - tile0
    row_tile = local // col_tiles
    col_tile = local - row_tile * col_tiles
    lane = tl.arange(0, BLOCK).to(tl.int64)
    src_base = src_addr.to(tl.pointer_type(SRC_T))
    dst_base = dst_addr.to(tl.pointer_type(DST_T))

    if log_w == LOG_BLOCK:
        # One row per tile (the common case: rows of >= BLOCK/2 elements). Decode the row index once
        # per program with scalar divisions instead of per element.
        col0 = col_tile * BLOCK
        i2 = row_tile % n2
        r = row_tile // n2
        i1 = r % n1
        i0 = r // n1
        src_row = i0 * ss0 + i1 * ss1 + i2 * ss2
        dst_row = i0 * ds0 + i1 * ds1 + i2 * ds2
        if ((flags & 1) != 0) & (col0 + BLOCK <= n3):
            # Full tile, unit inner strides, 16-byte aligned row starts (checked by the builder):
            # unmasked contiguous access, so the compiler can use 128-bit loads and stores.
            src_row_addr = tl.multiple_of(src_addr + (src_row + col0) * SRC_BYTES, 16)
            dst_row_addr = tl.multiple_of(dst_addr + (dst_row + col0) * DST_BYTES, 16)
            x = tl.load(src_row_addr.to(tl.pointer_type(SRC_T)) + lane)
            tl.store(dst_row_addr.to(tl.pointer_type(DST_T)) + lane, _convert_bits(x, SRC_KIND, DST_KIND))
        else:
            col = col0 + lane
            mask = col < n3
            x = tl.load(src_base + (src_row + col * ss3), mask=mask)
            tl.store(dst_base + (dst_row + col * ds3), _convert_bits(x, SRC_KIND, DST_KIND), mask=mask)
    else:
        # Narrow rows: 2**log_w lanes per row, BLOCK >> log_w rows per tile.
        rows_per_tile = BLOCK >> log_w
        row = row_tile * rows_per_tile + (lane >> log_w)
        col = col_tile * (1 << log_w) + (lane & ((1 << log_w) - 1))
        mask = (row < n0 * n1 * n2) & (col < n3)
        i2 = row % n2
        r = row // n2
        i1 = r % n1
        i0 = r // n1
        src_off = i0 * ss0 + i1 * ss1 + i2 * ss2 + col * ss3
        dst_off = i0 * ds0 + i1 * ds1 + i2 * ds2 + col * ds3
        x = tl.load(src_base + src_off, mask=mask)
        tl.store(dst_base + dst_off, _convert_bits(x, SRC_KIND, DST_KIND), mask=mask)


def launch_gather(desc: torch.Tensor, tile_region: torch.Tensor, key, num_warps: int = 4) -> None:
    """Launch :func:`gather_kernel` once over every tile of a descriptor table.

    ``desc``: int64 ``[R, NFIELDS]``, ``tile_region``: int32 ``[T]`` on the device whose memory the
    addresses point to (CPU tensors run in the interpreter). ``key`` is :func:`group_key` of the
    regions' (src dtype, dst dtype). All regions must have been tiled with ``block_for(key)``.
    Called by ``DescriptorTable.run``; the checks here are cheap and run every launch.
    """
    if desc.dtype != torch.int64 or desc.dim() != 2 or desc.shape[1] != NFIELDS:
        raise ValueError(f"desc must be int64 [R, {NFIELDS}], got {desc.dtype} {tuple(desc.shape)}")
    if tile_region.dtype != torch.int32 or tile_region.dim() != 1:
        raise ValueError(f"tile_region must be int32 [T], got {tile_region.dtype} {tuple(tile_region.shape)}")
    if desc.device != tile_region.device:
        raise ValueError(f"desc is on {desc.device} but tile_region on {tile_region.device}")
    num_tiles = tile_region.numel()
    if num_tiles == 0:
        return
    if key[0] == "copy":
        src_bytes = dst_bytes = key[1]
        src_kind = dst_kind = _RAW
    else:
        src_bytes, dst_bytes = key[1].itemsize, key[2].itemsize
        src_kind, dst_kind = _KIND[key[1]], _KIND[key[2]]
    block = block_for(key)
    gather_kernel[(num_tiles,)](
        desc, tile_region, num_tiles,
        SRC_T=_BITS_T[src_bytes], DST_T=_BITS_T[dst_bytes],
        SRC_KIND=src_kind, DST_KIND=dst_kind,
        SRC_BYTES=src_bytes, DST_BYTES=dst_bytes,
        NFIELDS=NFIELDS, BLOCK=block, LOG_BLOCK=block.bit_length() - 1,
        num_warps=num_warps,
    )
