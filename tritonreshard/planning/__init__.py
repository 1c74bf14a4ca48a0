"""Planning: pure Python and deterministic (no device, no Triton), validated before any data moves.

Modules, bottom up (each imports only those above it in this list):

* :mod:`.text`: how sizes, slices and tables print, for every printer;
* :mod:`.dtypes`: which dtypes a plan may connect (copy or cast), for the planner and the kernels;
* :mod:`.checks`: ``plan_reshard``'s inputs checked before anything is planned, every problem at once;
* :mod:`.replicas`: replica grouping and load balancing, with the one set of knobs both planners use;
* :mod:`.reshard`: ``plan_reshard(src_layouts, dst_layouts, parts=)`` -> :class:`Plan`, a tuple of
  :class:`TransferOp` (one box from one source rank to one destination rank) and :class:`FillOp`
  (zero padding);
* :mod:`.quant`: block-quantized (FP8) destinations: :class:`BlockQuant`, :func:`plan_quantized`;
* :mod:`.hosts`: the same plan split by host (:func:`plan_hosts`): each byte a host needs crosses into
  it once, then fans out locally; :func:`refit_traffic`, a model of each rank's bytes per link at a
  scale where the whole plan is too big to make;
* :mod:`.rank`: one rank's whole plan (:func:`plan_rank` -> :class:`RankPlan`, then its :class:`Route`).
"""
from .dtypes import CASTABLE_DTYPES, castable
from .hosts import (CrossTransfer, FanoutOp, HostPlan, Message, box_is_contiguous, host_order, join_host_parts,
                    plan_hosts,
                    plan_messages, RECV_ALIGN, Traffic, refit_traffic)
from .reshard import FillOp, Plan, PlanStats, TransferOp, merge_plans, plan_reshard, source_pieces
from .quant import FP8_DTYPE, SCALE_RULES, BlockQuant, QuantizedPlan, plan_quantized
from .text import fmt_bytes, fmt_global, fmt_slices
from .rank import BufferRef, HostTransfers, RankPlan, Read, Route, host_outbox, plan_rank, tensor_order  # noqa: E402 (last: it imports the names above)

__all__ = ["BlockQuant", "CASTABLE_DTYPES", "CrossTransfer", "FP8_DTYPE", "FanoutOp", "FillOp", "HostPlan",
           "Message", "Plan", "PlanStats", "QuantizedPlan", "RECV_ALIGN", "SCALE_RULES", "Traffic", "TransferOp",
           "box_is_contiguous", "castable", "fmt_bytes", "fmt_global", "fmt_slices", "host_order", "join_host_parts", "merge_plans",
           "plan_hosts", "plan_messages",
           "plan_quantized", "plan_reshard", "refit_traffic", "source_pieces",
           "BufferRef", "HostTransfers", "RankPlan", "Read", "Route", "host_outbox", "plan_rank", "tensor_order"]
