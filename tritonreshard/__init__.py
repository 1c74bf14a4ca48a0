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
import importlib
import sys

from . import _compat

__all__ = [
    "Layout", "Shard", "Replicate", "Part", "Plan", "FillOp", "PlanStats", "TransferOp", "plan_reshard",
    "execute_local", "recipes",
    "RefitEndpoint", "RefitTrainer", "RefitInference", "RefitError", "PeerDiedError", "PullStats", "RefitStats",
    "secret_for_children", "Meeting", "SourceData", "DestinationData", "Timeouts", "PullOptions", "Fixed", "Elastic",
    "Dense", "Delta", "BufferMode", "Shadow", "InPlace", "Spare", "LayerSink", "CopyBackend", "AutoBackend",
    "TritonBackend", "TorchBackend",
]
__version__ = "0.1.0"

#: Where each public name lives. They load on first use (PEP 562), not with the package: the
#: ``tritonreshard`` command imports ``tritonreshard.apps.cli``, and ``tritonreshard --help`` or a
#: mistyped flag must answer before torch and Triton (seconds on a busy machine) are loaded.
_EXPORTS = {
    "PeerDiedError": "errors", "RefitError": "errors",
    "Layout": "layout", "Part": "layout", "Replicate": "layout", "Shard": "layout",
    "FillOp": "planning", "Plan": "planning", "PlanStats": "planning", "TransferOp": "planning",
    "plan_reshard": "planning",
    "execute_local": "execute",
    "PullStats": "engine", "RefitEndpoint": "engine", "RefitInference": "engine", "RefitStats": "engine",
    "RefitTrainer": "engine", "secret_for_children": "engine",
    "Meeting": "engine", "SourceData": "engine", "DestinationData": "engine",
    "Timeouts": "engine", "PullOptions": "engine", "Fixed": "engine", "Elastic": "engine",
    "Dense": "transport", "Delta": "transport",
    "BufferMode": "engine", "Shadow": "engine", "InPlace": "engine", "Spare": "engine", "LayerSink": "engine",
    "CopyBackend": "engine", "AutoBackend": "engine", "TritonBackend": "engine", "TorchBackend": "engine",
}
#: The layers, reachable as attributes too (``trs.planning.fmt_bytes``) once anything asks.
_SUBMODULES = {"errors", "layout", "planning", "recipes", "kernels", "execute", "transport", "engine"}


if "torch" in sys.modules:
    # The script imported torch before us (so it may call init_process_group next): disarm torch's
    # process-group trap now, as an eagerly loaded package did. Without torch loaded (the command
    # line), nothing here loads it; the engine disarms it when it is first imported.
    _compat.disarm_process_group_pin()


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    elif name in _SUBMODULES:
        value = importlib.import_module(f".{name}", __name__)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__) | _SUBMODULES)
