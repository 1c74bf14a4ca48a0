"""Triton kernels of tritonreshard (imported as ``tritonreshard.kernels``).

One kernel, :func:`gather_kernel`, copies a batch of rectangular regions described by a descriptor
table (raw addresses, shapes, strides) and converts dtypes on the way; :func:`launch_gather` is its
thin host wrapper. Tables are built by :mod:`tritonreshard._descriptors`.

Interpreter setup: Triton picks "interpreter or compiler" when a kernel is *decorated*, from the
``TRITON_INTERPRET`` environment variable. On a machine without CUDA this package sets
``TRITON_INTERPRET=1`` (``os.environ.setdefault``, so an explicit ``TRITON_INTERPRET=0`` wins) before it
imports Triton, so the same kernels run on CPU tensors in the interpreter: exact, slow, meant for
tests and debugging. Import this package before anything else decorates Triton kernels if you rely on
that; with CUDA available nothing is changed and kernels compile.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from .gather import (  # noqa: E402  (the environment must be set before triton is imported)
    ALIGN_BYTES,
    FLAG_ALIGNED,
    FIELD_NAMES,
    NFIELDS,
    MAX_DIMS,
    block_for,
    gather_kernel,
    group_key,
    launch_gather,
    supported_conversion,
    tile_geometry,
)

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
"""True when kernels run in Triton's interpreter (CPU tensors) rather than compiled."""

__all__ = [
    "ALIGN_BYTES",
    "FLAG_ALIGNED",
    "FIELD_NAMES",
    "INTERPRET",
    "MAX_DIMS",
    "NFIELDS",
    "block_for",
    "gather_kernel",
    "group_key",
    "launch_gather",
    "supported_conversion",
    "tile_geometry",
]
