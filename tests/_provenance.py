"""Provenance values that every dtype on the way holds exactly.

A test that fills element ``i`` with ``i + 1000 * version`` checks nothing once a cast rounds: in
float16 every value past 65504 is ``inf``, and in bfloat16 (8 significant bits) integers past 256
are rounded to multiples of 2, 4, ... 1024, so neighbours compare equal. Here each (element, version,
tag) gets a distinct integer code, and the code becomes a float that every dtype given holds
exactly:

* codes below ``2**p`` (``p`` = the narrowest dtype's significant bits: 8 for bfloat16, 11 for
  float16, 24 for float32) are the integers themselves, readable in a failure message;
* larger codes continue in blocks of ``2**(p-1)``: block ``k`` (from 1) holds
  ``(2**(p-1) + r) * 2**k`` (a ``p``-bit mantissa ``r``, one exponent per block), so the blocks'
  ranges ``[2**(p-1+k), 2**(p+k))`` never overlap and every value is exact.

The version sits in the low bits of the code (``code = (i * versions + version) * tags + tag``), so
even the first elements of two versions differ. :func:`assert_exact` (a round trip through each
dtype) checks the result, so a new dtype or a larger tensor cannot silently lose exactness.
"""
from __future__ import annotations

import math

import torch

__all__ = ["significant_bits", "exact_values", "assert_exact", "provenance"]


def significant_bits(dtype: torch.dtype) -> int:
    """Bits of mantissa, the implicit one included (bfloat16 8, float16 11, float32 24)."""
    if dtype.is_floating_point:
        return 1 - int(math.log2(torch.finfo(dtype).eps))
    info = torch.iinfo(dtype)
    return info.bits - (1 if info.min < 0 else 0)


def exact_values(codes: torch.Tensor, dtypes) -> torch.Tensor:
    """Distinct non-negative int64 ``codes`` -> distinct float64 values exact in each of ``dtypes``."""
    p = min(significant_bits(d) for d in dtypes)
    half = 1 << (p - 1)
    codes = codes.to(torch.int64)
    above = (codes - 2 * half).clamp(min=0)
    block = 1 + above // half
    spread = (half + above % half).double() * torch.pow(2.0, block.double())
    values = torch.where(codes < 2 * half, codes.double(), spread)
    for d in dtypes:
        assert_exact(values, d)
    return values


def assert_exact(values: torch.Tensor, dtype: torch.dtype) -> None:
    """``values`` (float64) survive a round trip through ``dtype`` unchanged and are pairwise distinct."""
    back = values.to(dtype).double()
    bad = (back != values).nonzero()
    assert bad.numel() == 0, (f"provenance not exact in {dtype}: element {bad[0].tolist()} is "
                              f"{values[tuple(bad[0])].item()!r}, becomes {back[tuple(bad[0])].item()!r}")
    assert values.unique().numel() == values.numel(), "provenance values repeat: elements cannot be told apart"


def provenance(shape, version: int, tag: int = 0, *, dtypes=(torch.float32,), versions: int = 8,
               tags: int = 4) -> torch.Tensor:
    """A float64 tensor of ``shape`` whose element ``i`` encodes (``i``, ``version``, ``tag``): distinct
    over all three (for ``version < versions`` and ``tag < tags``) and exact in every one of ``dtypes``
    (give the source's and the destination's dtype when a refit casts)."""
    assert 0 <= version < versions and 0 <= tag < tags, (version, versions, tag, tags)
    n = math.prod(shape)
    codes = (torch.arange(n, dtype=torch.int64) * versions + version) * tags + tag
    return exact_values(codes, dtypes).reshape(shape)
