"""RL-sized updates for ``tritonreshard bench --update-lr``: what a cross-host delta refit carries.

Version ``v`` of a weight is ``bf16(w0 + lr * v * s)``: ``w0`` an fp32 master weight with std 0.02
and ``s`` a fixed sign per element (Adam's update has a magnitude of about the learning rate, and
its sign holds over steps), rounded to the bf16 copy that is refitted, as a mixed-precision trainer
does. Per version a weight's bf16 bits change when its master weight crosses a rounding boundary:
about ``lr / ulp(w)`` of the weights, 2-3% at lr 1e-6. ``w0`` and ``s`` derive from each element's
global index (a hash, then Box-Muller), so a trainer fills its shard and an inference rank checks
its own without any global tensor.

``lr="random"``: a full random change, for contrast: version ``v`` is fresh weights drawn the same
way from (index, ``v``), unrelated to version ``v - 1`` (every element's bits change, by any amount).
"""
from __future__ import annotations

import math
import zlib

import torch

from tritonreshard.layout import Layout

__all__ = ["AdamShard", "expected_shard"]

_MUL = 6364136223846793005   # Knuth's LCG multiplier (< 2**63: an int64; products wrap)
_M24 = (1 << 24) - 1


def _unit(h: torch.Tensor) -> torch.Tensor:
    """A uniform float64 in (0, 1) from 24 bits of ``h``."""
    return (((h >> 20) & _M24).to(torch.float64) + 0.5) / (1 << 24)


def _master(layout: Layout, rank: int, name: str, draw: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(w0, s)`` of ``rank``'s local shard: fp32 master weights (std 0.02) and signs (+-1);
    ``draw``: another, independent draw (the ``"random"`` updates)."""
    idx = layout.shard(torch.arange(layout.numel, dtype=torch.int64).reshape(layout.shape), rank).contiguous()
    h = idx * _MUL + zlib.crc32(f"{name}#{draw}".encode() if draw else name.encode())
    h = h ^ (h >> 29)
    h = h * _MUL
    u1, u2 = _unit(h), _unit(h * _MUL + 1)
    w0 = (0.02 * torch.sqrt(-2.0 * torch.log(u1)) * torch.cos(2 * math.pi * u2)).to(torch.float32)
    s = torch.where((h >> 7) & 1 == 1, 1.0, -1.0).to(torch.float32)
    return w0, s


def expected_shard(layout: Layout, rank: int, name: str, lr: float | str, version: int) -> torch.Tensor:
    """``rank``'s local shard of version ``version`` (bf16), as the trainers publish it."""
    if lr == "random":
        return _master(layout, rank, name, draw=version)[0].to(torch.bfloat16)
    w0, s = _master(layout, rank, name)
    return (w0 + (lr * version) * s).to(torch.bfloat16)


class AdamShard:
    """A trainer's shard of one weight: :meth:`write` puts version ``v`` into its arena tensor."""

    def __init__(self, layout: Layout, rank: int, name: str, lr: float | str, device):
        self.w0, self.s = (t.to(device) for t in _master(layout, rank, name))
        self.lr, self.layout, self.rank, self.name = lr, layout, rank, name

    def write(self, out: torch.Tensor, version: int) -> None:
        if self.lr == "random":
            out.copy_(expected_shard(self.layout, self.rank, self.name, "random", version).view(out.shape))
            return
        out.copy_((self.w0 + (self.lr * version) * self.s).view(out.shape))
