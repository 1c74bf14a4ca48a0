"""tritonreshard: zero-copy, parallel weight refit from training ranks to inference ranks.

Three layers: pure-Python planning (:mod:`~tritonreshard.layout`, :mod:`~tritonreshard.plan`,
:mod:`~tritonreshard.recipes`), Triton kernels (:mod:`tritonreshard.kernels`), and transport /
endpoints (:mod:`~tritonreshard.refit` composing a group, a :mod:`~tritonreshard.publisher` and a
:mod:`~tritonreshard.subscriber`).
"""
from .layout import Layout, Part, Replicate, Shard
from .plan import FillOp, Plan, PlanStats, TransferOp, plan_reshard
from .execute import execute_local
from . import recipes
from ._rendezvous import secret_for_children
from .refit import (PeerDiedError, PullStats, RefitEndpoint, RefitError, RefitInference,
                    RefitTrainer)

__all__ = [
    "Layout", "Shard", "Replicate", "Part", "Plan", "FillOp", "PlanStats", "TransferOp", "plan_reshard",
    "execute_local", "recipes",
    "RefitEndpoint", "RefitTrainer", "RefitInference", "RefitError", "PeerDiedError", "PullStats",
    "secret_for_children",
]
__version__ = "0.1.0"
