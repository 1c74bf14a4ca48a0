"""Provenance data: every element's bf16 bits are a hash of (tensor name, global index) XOR a key of
the version, with the top exponent bit clear (finite values). Every refit changes every weight, so a
rank checks its destination shards bit for bit with no reference copy: a stale, misplaced or
unwritten element differs.

The bits of version ``v`` are ``hash ^ key16(v)``. A trainer fills its shards once
(:func:`fill_bits`, version 0) and moves them from version ``v - 1`` to ``v`` in place by XOR with
``key16(v - 1) ^ key16(v)``; an inference rank recomputes the hash when it checks
(:func:`check_bits`). Both work in row chunks of at most :data:`CHUNK` elements, so the int64
arithmetic of the hash needs a few MiB whatever the tensor's size (hashing a whole 32 MiB tensor at
once took ~700 MiB of temporaries), and nobody keeps a copy of the expected bits.
"""
from __future__ import annotations

import math
import zlib

import torch

from tritonreshard.layout import Layout

__all__ = ["fill_bits", "check_bits", "key16", "CHUNK", "HASH_BYTES_PER_ELEMENT"]

_MASK = 0xBFFF  # clear the top exponent bit: every value is finite (|x| < 2), no NaN payloads
CHUNK = 1 << 18  # elements hashed at once (rows of a shard, at least one row)
#: Temporaries per element hashed at once: the int64 global index and one int64 scratch, plus the
#: per-dimension coordinates (what :mod:`.memory` charges for a chunk).
HASH_BYTES_PER_ELEMENT = 24


def _version_key(v: int) -> int:
    assert 0 <= v < 1 << 15, "too many refits for the version key"
    return (v & 0x3FFF) | ((v >> 14) << 15)


def key16(v: int) -> int:
    """The version key as an int16 value (XORed into every element's bits)."""
    k = _version_key(v)
    return k - (1 << 16) if k >= 1 << 15 else k


def _row_chunks(shape) -> list[slice]:
    """Row ranges of a local shard of ``shape`` holding at most CHUNK elements (one row at least)."""
    if not shape:
        return [slice(None)]
    per_row = max(1, math.prod(shape[1:]))
    step = max(1, CHUNK // per_row)
    return [slice(r, min(r + step, shape[0])) for r in range(0, shape[0], step)] or [slice(0, 0)]


def _hash_rows(layout: Layout, rank: int, name: str, rows: slice, device) -> torch.Tensor:
    """int16 version-0 bits of rows ``rows`` of ``rank``'s local shard: a hash of (name, global index)."""
    idx = _global_index(layout, rank, device, rows)
    seed = zlib.crc32(name.encode()) & 0xFFFFFF
    # In place: the index tensor is the hash's only full-size temporary besides one shift.
    h = idx.mul_(0x9E3779B1).add_(seed * 0x85EBCA6B).bitwise_and_(0xFFFFFFFF)
    h.bitwise_xor_(h >> 15)
    h.mul_(0x2C1B3C6D).bitwise_and_(0xFFFFFFFF)
    h.bitwise_xor_(h >> 12)
    h.bitwise_right_shift_(8).bitwise_and_(_MASK)
    return h.sub_(torch.where(h >= 1 << 15, 1 << 16, 0)).to(torch.int16)


def fill_bits(out: torch.Tensor, layout: Layout, rank: int, name: str) -> None:
    """Writes version 0 into ``out``, ``rank``'s local shard of ``layout`` (any 16-bit dtype)."""
    bits = out.view(torch.int16)
    for rows in _row_chunks(tuple(out.shape)):
        bits[rows] = _hash_rows(layout, rank, name, rows, out.device)


def check_bits(tensors: list[torch.Tensor], keys: list[int], layout: Layout, rank: int, name: str) -> list[bool]:
    """Whether each ``tensors[i]`` (``rank``'s local shard of ``layout``) holds ``hash ^ keys[i]``
    bit for bit; one hash pass serves every tensor."""
    ok = [True] * len(tensors)
    for rows in _row_chunks(tuple(layout.local_shape(rank))):
        expect = _hash_rows(layout, rank, name, rows, tensors[0].device if tensors else "cpu")
        for i, (t, k) in enumerate(zip(tensors, keys, strict=True)):
            if ok[i]:
                ok[i] = torch.equal(t.view(torch.int16)[rows], torch.bitwise_xor(expect, k))
    return ok


def _global_index(layout: Layout, rank: int, device, rows: slice = slice(None)) -> torch.Tensor:
    """int64 global flat index of every element of rows ``rows`` of ``rank``'s local shard."""
    shape = list(layout.local_shape(rank))
    idx = torch.zeros((), dtype=torch.int64, device=device)
    stride = 1
    for d in reversed(range(len(layout.shape))):
        segs = layout.segments(rank)[d]
        coord = torch.cat([torch.arange(s, e, dtype=torch.int64, device=device) for s, e, _ in segs]) \
            if segs else torch.zeros(0, dtype=torch.int64, device=device)
        if d == 0:
            coord = coord[rows]
            shape[0] = coord.numel()
        view = [1] * len(shape)
        view[d] = -1
        idx = idx + (coord * stride).view(view)
        stride *= layout.shape[d]
    return idx.expand(shape).contiguous() if shape else idx.clone()
