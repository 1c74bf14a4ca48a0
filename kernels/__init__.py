"""Triton kernels of tritonreshard, and the descriptor tables that feed them.

Two kernels copy batches of rectangular regions described by tables (raw addresses, shapes,
strides) and convert dtypes on the way: :func:`copy_rows_kernel` (aligned contiguous rows, 128-bit,
no index math) and :func:`copy_tiles_kernel` (narrow, strided or unaligned regions, 2-D tiles).
:func:`plan_launches` turns one dtype group's regions into their launches; the tables' format and the
design are in :mod:`tritonreshard.kernels.gather`. :mod:`~tritonreshard.kernels.quantize` quantizes to block FP8 in the
same pass (:func:`quantize_blocks_kernel`, one program per destination block, fed by a
:class:`QuantizeTable`). :mod:`~tritonreshard.kernels.delta` compares a message with its snapshot and compacts the
changed words (:func:`delta_count_kernel`, :func:`delta_compact_kernel`: the delta codec's CUDA path).
Tables are built by
:class:`~tritonreshard.kernels.descriptors.DescriptorTable` (once per rank, reused every refit).
Whether a table runs the kernels or torch ops is a :class:`CopyBackend`'s answer
(:mod:`~tritonreshard.kernels.backends`: ``TritonBackend``, ``TorchBackend``, ``AutoBackend``).

Compiled or interpreted is decided per launch from the tables' device: CUDA tensors run the compiled
kernels, CPU tensors run the same source in Triton's interpreter (exact, slow: tests and
debugging). Importing this package sets no environment variable, changes nothing for other
libraries' Triton kernels and does not initialise CUDA.
"""
from .backends import BACKEND_NAMES, AutoBackend, CopyBackend, TorchBackend, TritonBackend, copy_backend
from .delta import (
                    DELTA_BLOCK,
                    DELTA_WORDS,
                    DeltaLaunch,
                    TorchDeltaScan,
                    TritonDeltaScan,
                    delta_compact,
                    delta_compact_kernel,
                    delta_count,
                    delta_count_kernel,
                    delta_launch_configs,
)
from .descriptors import DescriptorTable, Entry, Region
from .gather import (
                    ALIGN_BYTES,
                    FIELD_NAMES,
                    FLAG_ALIGNED,
                    INDEX_LIMIT,
                    MAX_DIMS,
                    NFIELDS,
                    ROWS_TILE_BYTES,
                    VARIANTS,
                    GatherLaunch,
                    copy_rows_kernel,
                    copy_tiles_kernel,
                    group_key,
                    group_keys,
                    launch_configs,
                    plan_launches,
                    supported_conversion,
)
from .quantize import (
                    QuantizeLaunch,
                    QuantizeTable,
                    ceil_to_ue8m0,
                    e4m3_from_f32,
                    per_block_cast_to_fp8,
                    quantize_blocks_kernel,
                    quantize_launch_configs,
)

__all__ = [
    "AutoBackend",
    "BACKEND_NAMES",
    "CopyBackend",
    "TorchBackend",
    "TritonBackend",
    "copy_backend",
    "TorchDeltaScan",
    "TritonDeltaScan",
    "DELTA_BLOCK",
    "DELTA_WORDS",
    "DeltaLaunch",
    "delta_compact",
    "delta_compact_kernel",
    "delta_count",
    "delta_count_kernel",
    "delta_launch_configs",
    "QuantizeLaunch",
    "QuantizeTable",
    "ceil_to_ue8m0",
    "e4m3_from_f32",
    "per_block_cast_to_fp8",
    "quantize_blocks_kernel",
    "quantize_launch_configs",
    "DescriptorTable",
    "Entry",
    "Region",
    "ALIGN_BYTES",
    "FIELD_NAMES",
    "FLAG_ALIGNED",
    "INDEX_LIMIT",
    "MAX_DIMS",
    "NFIELDS",
    "VARIANTS",
    "ROWS_TILE_BYTES",
    "GatherLaunch",
    "copy_rows_kernel",
    "copy_tiles_kernel",
    "group_key",
    "group_keys",
    "launch_configs",
    "plan_launches",
    "supported_conversion",
]
