"""tritonreshard: zero-copy, parallel weight refit from training ranks to inference ranks.

Three layers: pure-Python planning (:mod:`~tritonreshard.layout`, :mod:`~tritonreshard.plan`),
Triton kernels (:mod:`tritonreshard.kernels`), and transport / endpoints (:mod:`~tritonreshard.refit`
composing a group, a :mod:`~tritonreshard.publisher` and a :mod:`~tritonreshard.subscriber`).
"""
from .layout import Layout, Replicate, Shard
from .plan import Plan, PlanStats, TransferOp, plan_reshard
from .execute import execute_local
from ._rendezvous import secret_for_children
from .refit import (PeerDiedError, PullStats, RefitEndpoint, RefitError, RefitInference,
                    RefitTrainer)

__all__ = [
    "Layout", "Shard", "Replicate", "Plan", "PlanStats", "TransferOp", "plan_reshard", "execute_local",
    "RefitEndpoint", "RefitTrainer", "RefitInference", "RefitError", "PeerDiedError", "PullStats",
    "secret_for_children",
]
__version__ = "0.1.0"
