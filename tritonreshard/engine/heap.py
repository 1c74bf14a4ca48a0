"""The C heap's free pages, handed back to the system: :func:`release_freed_heap`.

Tensors below glibc's mmap threshold (which rises to 32 MiB once a larger block was freed: most of a
model's shards and layers) live on the heap, and freed ones stay resident until trimmed. Many such
tensors are freed at once: a trainer's arena adopting the caller's shards as it fills, a vLLM
worker dropping each layer's load-format tensors after its layerwise reload, a set-up step whose
cost is measured.
"""
from __future__ import annotations

import ctypes
import functools

__all__ = ["release_freed_heap"]


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
