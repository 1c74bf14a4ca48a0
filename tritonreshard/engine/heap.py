"""The C heap's free pages, handed back to the system: :func:`release_freed_heap`.

Tensors below glibc's mmap threshold (which rises to 32 MiB once a larger block was freed: most of a
model's shards and layers) live on the heap, and freed ones stay resident until trimmed. Many such
tensors are freed at once: a trainer's arena adopting the caller's shards as it fills, a vLLM
worker dropping each layer's load-format tensors after its layerwise reload, a set-up step whose
cost is measured.
"""
from __future__ import annotations

import ctypes

__all__ = ["release_freed_heap"]


def release_freed_heap() -> None:
    """glibc's ``malloc_trim(0)``; nothing where the C library has none."""
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)
    if trim is not None:
        trim(0)
