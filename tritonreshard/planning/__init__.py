"""Planning: pure Python and deterministic (no device, no Triton), validated before any data moves.

Modules, bottom up (each imports only those above it in this list):

* :mod:`.text`: how sizes, slices and tables print, for every printer;
* :mod:`.dtypes`: which dtypes a plan may connect (copy or cast), for the planner and the kernels;
* :mod:`.checks`: ``plan_reshard``'s inputs checked before anything is planned, every problem at once;
* :mod:`.replicas`: replica grouping and load balancing, with the one set of knobs both planners use;
* :mod:`.boxes`: box arithmetic (union, intersection, cuts) and :data:`RECV_ALIGN`, the alignment of
  every arena and receive buffer;
* :mod:`.ops`: what a plan is: :class:`TransferOp` (one box from one source rank to one destination
  rank), :class:`FillOp` (zero padding), :class:`Plan` and its text, :func:`merge_plans`;
* :mod:`.reshard`: the planner, ``plan_reshard(src_layouts, dst_layouts, parts=)`` -> :class:`Plan`;
* :mod:`.quant`: block-quantized (FP8) destinations: :class:`BlockQuant`, :func:`plan_quantized`;
* :mod:`.hostplan`: what a host plan is: :class:`HostPlan`, :class:`CrossTransfer`, :class:`FanoutOp`;
* :mod:`.crossings`: the boxes crossing into a host: senders, receivers, receive buffers;
* :mod:`.hosts`: the plan split by host (:func:`plan_hosts`): each byte a host needs crosses into it
  once, then fans out locally; :func:`hosts_from_map` reads a host map ``{host: ranks}``, checked;
* :mod:`.hostpart`: one host's part from the layouts (:func:`plan_host_part`), what a rank on several
  hosts plans, without making a plan;
* :mod:`.wire`: what travels: one rank's view joined from the hosts' parts (:func:`join_host_parts`)
  and the point-to-point messages (:func:`plan_messages`);
* :mod:`.traffic`: :func:`refit_traffic`, each rank's bytes per link kind at a scale where the whole
  plan is too big to make;
* :mod:`.rank`: one rank's whole plan (:func:`plan_rank` -> :class:`RankPlan`, then its :class:`Route`).
"""
from .boxes import RECV_ALIGN, box_is_contiguous, cut_global
from .dtypes import CASTABLE_DTYPES, castable
from .hostpart import plan_host_part
from .hostplan import CrossTransfer, FanoutOp, HostPlan, host_order
from .hosts import hosts_from_map, plan_hosts
from .ops import FillOp, Plan, PlanStats, TransferOp, merge_plans
from .quant import FP8_DTYPE, SCALE_RULES, BlockQuant, QuantizedPlan, plan_quantized
from .rank import BufferRef, HostTransfers, RankPlan, Read, Route, host_outbox, plan_rank, source_order, tensor_order
from .reshard import plan_reshard, source_pieces
from .text import fmt_bytes, fmt_global, fmt_slices
from .traffic import Traffic, refit_traffic
from .wire import Message, join_host_parts, plan_messages

__all__ = ["BlockQuant", "CASTABLE_DTYPES", "CrossTransfer", "FP8_DTYPE", "FanoutOp", "FillOp", "HostPlan",
           "Message", "Plan", "PlanStats", "QuantizedPlan", "RECV_ALIGN", "SCALE_RULES", "Traffic", "TransferOp",
           "box_is_contiguous", "castable", "cut_global", "fmt_bytes", "fmt_global", "fmt_slices", "host_order",
           "hosts_from_map", "join_host_parts", "merge_plans", "plan_host_part", "plan_hosts", "plan_messages",
           "plan_quantized", "plan_reshard", "refit_traffic", "source_pieces",
           "BufferRef", "HostTransfers", "RankPlan", "Read", "Route", "host_outbox", "plan_rank", "source_order",
           "tensor_order"]
