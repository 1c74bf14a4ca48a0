"""Which dtypes a plan may connect: the one table the planner validates against and the kernels
convert by (``tritonreshard.kernels.supported_conversion`` reads it; planning never imports kernels).
"""
from __future__ import annotations

import torch

__all__ = ["CASTABLE_DTYPES", "castable"]

#: Dtypes the kernels convert between in the same pass (round-to-nearest-even, like ``.to()``).
#: Any dtype may be copied to itself.
CASTABLE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def castable(src_dtype: torch.dtype, dst_dtype: torch.dtype) -> bool:
    """True if a plan may fill a ``dst_dtype`` destination from a ``src_dtype`` source: the same dtype
    (a bit copy), or a cast between two of :data:`CASTABLE_DTYPES`."""
    return src_dtype == dst_dtype or (src_dtype in CASTABLE_DTYPES and dst_dtype in CASTABLE_DTYPES)
