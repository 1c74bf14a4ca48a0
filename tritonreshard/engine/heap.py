"""CPU memory a refit takes and gives back: the C heap's free pages handed back to the system
(:func:`release_freed_heap`), and one layer's pages used again by the next (:class:`ReusedPages`).

Tensors below glibc's mmap threshold (which rises to 32 MiB once a larger block was freed: most of a
model's shards and layers) live on the heap, and freed ones stay resident until trimmed. Many such
tensors are freed at once: a trainer's arena adopting the caller's shards as it fills, a vLLM
worker dropping each layer's load-format tensors after its layerwise reload, a set-up step whose
cost is measured.
"""
from __future__ import annotations

import ctypes
import functools
import mmap
import sys

import torch

__all__ = ["ReusedPages", "release_freed_heap"]


@functools.cache
def _malloc_trim():
    """The C library's ``malloc_trim``, looked up once (None: not glibc, or no C library to open)."""
    try:
        return getattr(ctypes.CDLL(None), "malloc_trim", None)
    except OSError:
        return None


def release_freed_heap() -> None:
    """glibc's ``malloc_trim(0)``; nothing where the C library has none. Called while an arena
    fills (every 16 MiB adopted) and after every layerwise reload: the lookup is done once."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


class ReusedPages:
    """CPU memory for one layer at a time, whose pages the next layer writes again: a pull that
    streams layers into fresh allocations touches every page for the first time, and on this
    machine a copy into fresh 4 KiB pages ran at 3.1 GB/s, into the same pages again at 7.2 GB/s
    (the kernel maps and zeroes each new page on the copy's first write).

    :meth:`take` returns ``nbytes`` as a ``uint8`` tensor over one anonymous mapping (transparent
    huge pages asked for: fresh ones then cost a fault per 2 MiB), the same mapping as the last
    call's when it is large enough and nothing holds a tensor over it any more. Whether anything
    does is exact: each tensor storage over the mapping holds a reference to it, so a layer whose
    tensors outlive its turn (kept by whoever took them) keeps its mapping, and the next layer gets
    a new one. :meth:`release` drops the mapping (it is unmapped once no tensor holds it):
    nothing is held between pulls. ``mappings``: how many were made (1 when every layer reused
    the first)."""

    def __init__(self):
        self._mm: mmap.mmap | None = None
        self.mappings = 0

    def take(self, nbytes: int) -> torch.Tensor:
        if nbytes == 0:  # (a layer whose tensors are all empty: torch.frombuffer refuses a count of 0)
            return torch.empty(0, dtype=torch.uint8)
        # References while nothing holds a tensor over it: this attribute and getrefcount's argument.
        if self._mm is None or len(self._mm) < nbytes or sys.getrefcount(self._mm) > 2:
            self._mm = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            if hasattr(mmap, "MADV_HUGEPAGE"):  # Linux; a no-op where the kernel's THP is "never"
                self._mm.madvise(mmap.MADV_HUGEPAGE)
            self.mappings += 1
        return torch.frombuffer(self._mm, dtype=torch.uint8, count=nbytes)

    def release(self) -> None:
        self._mm = None
