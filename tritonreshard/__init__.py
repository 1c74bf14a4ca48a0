"""tritonreshard: zero-copy, parallel weight refit from training ranks to inference ranks.

Three layers: pure-Python planning (:mod:`~tritonreshard.layout`, :mod:`~tritonreshard.plan`),
Triton kernels (:mod:`tritonreshard.kernels`), and transport / endpoints.
"""
from .layout import Layout, Part, Replicate, Shard
from .plan import FillOp, Plan, PlanStats, TransferOp, plan_reshard
from .execute import execute_local
from . import recipes
from .refit import PeerDiedError, RefitEndpoint, RefitError, RefitInference, RefitTrainer

__all__ = [
    "Layout", "Shard", "Replicate", "Part", "Plan", "FillOp", "PlanStats", "TransferOp", "plan_reshard", "execute_local", "recipes",
    "RefitEndpoint", "RefitTrainer", "RefitInference", "RefitError", "PeerDiedError",
]
__version__ = "0.1.0"
