"""Provenance data: every element's bf16 bits are a hash of (tensor name, global index) XOR a key of
the version, with the top exponent bit clear (finite values). Every refit changes every weight, so a
rank checks its destination shards bit for bit with no reference copy: a stale, misplaced or
unwritten element differs.

A rank computes its shards' version-0 bits once (:func:`hash_bits`, int16 tensors); the bits of
version ``v`` are ``hash_bits ^ key16(v)``.
"""
from __future__ import annotations

import zlib

import torch

from tritonreshard.layout import Layout

__all__ = ["hash_bits", "key16"]

_MASK = 0xBFFF  # clear the top exponent bit: every value is finite (|x| < 2), no NaN payloads


def _version_key(v: int) -> int:
    assert 0 <= v < 1 << 15, "too many refits for the version key"
    return (v & 0x3FFF) | ((v >> 14) << 15)


def _to_int16(bits: torch.Tensor) -> torch.Tensor:
    return torch.where(bits >= 1 << 15, bits - (1 << 16), bits).to(torch.int16)


def key16(v: int) -> int:
    """The version key as an int16 value (XORed into every element's bits)."""
    k = _version_key(v)
    return k - (1 << 16) if k >= 1 << 15 else k


def hash_bits(layout: Layout, rank: int, name: str, device, cache: dict | None = None) -> torch.Tensor:
    """int16 bits of ``rank``'s local shard at version 0: a hash of (name, global index).
    ``cache``: global-index tensors by (layout, rank), shared by tensors of equal layouts."""
    key = (layout, rank)
    idx = cache.get(key) if cache is not None else None
    if idx is None:
        idx = _global_index(layout, rank, device) * 0x9E3779B1
        if cache is not None:
            cache[key] = idx
    seed = zlib.crc32(name.encode()) & 0xFFFFFF
    h = (idx + seed * 0x85EBCA6B) & 0xFFFFFFFF
    h ^= h >> 15
    h = (h * 0x2C1B3C6D) & 0xFFFFFFFF
    h ^= h >> 12
    return _to_int16((h >> 8) & _MASK)


def _global_index(layout: Layout, rank: int, device) -> torch.Tensor:
    """int64 global flat index of every element of ``rank``'s local shard."""
    shape = layout.local_shape(rank)
    idx = torch.zeros((), dtype=torch.int64, device=device)
    stride = 1
    for d in reversed(range(len(layout.shape))):
        segs = layout.segments(rank)[d]
        coord = torch.cat([torch.arange(s, e, dtype=torch.int64, device=device) for s, e, _ in segs]) \
            if segs else torch.zeros(0, dtype=torch.int64, device=device)
        view = [1] * len(shape)
        view[d] = -1
        idx = idx + (coord * stride).view(view)
        stride *= layout.shape[d]
    return idx.expand(shape).contiguous() if shape else idx
