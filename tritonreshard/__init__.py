"""tritonreshard: zero-copy, parallel weight refit from training ranks to inference ranks.

Layers, bottom up, each importing only those below it: :mod:`~tritonreshard.errors`,
:mod:`~tritonreshard.layout`, :mod:`~tritonreshard.planning` (plans; pure Python),
:mod:`~tritonreshard.recipes` (HF -> vLLM layouts), :mod:`~tritonreshard.kernels` (Triton kernels
and their descriptor tables), :mod:`~tritonreshard.execute` (all ranks in one process),
:mod:`~tritonreshard.transport` (arenas, control blocks, the one wait, point-to-point links) and
:mod:`~tritonreshard.engine` (groups, routes, publishers, subscribers, endpoints). On top:
:mod:`tritonreshard.vllm` (the vLLM backend) and :mod:`tritonreshard.apps` (CLI, demo, bench), which
the library never imports.
"""
from .errors import PeerDiedError, RefitError
from .layout import Layout, Part, Replicate, Shard
from .planning import FillOp, Plan, PlanStats, TransferOp, plan_reshard
from .execute import execute_local
from . import recipes
from .engine import (PullStats, RefitEndpoint, RefitInference, RefitStats, RefitTrainer,
                     secret_for_children)

__all__ = [
    "Layout", "Shard", "Replicate", "Part", "Plan", "FillOp", "PlanStats", "TransferOp", "plan_reshard",
    "execute_local", "recipes",
    "RefitEndpoint", "RefitTrainer", "RefitInference", "RefitError", "PeerDiedError", "PullStats", "RefitStats",
    "secret_for_children",
]
__version__ = "0.1.0"
