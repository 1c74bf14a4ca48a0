"""vLLM's TP agreement: :func:`agree` over vLLM's TP cpu group, and :func:`fail`, raising on one rank.

Called by the engine (:mod:`._worker`) in every phase that can fail on one TP rank: every TP rank
decides together, and a failure is raised so that vLLM's executor stays usable. Imported inside
vLLM's workers only.
"""
from __future__ import annotations

import torch.distributed as dist
from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size, get_tp_group
from vllm.logger import init_logger

from .. import RefitError
from ..serving import failure_text, outcome

__all__ = ["agree", "fail", "raises_here"]

# Under vLLM's logger, so these lines go through its handler and level (VLLM_LOGGING_LEVEL) in
# every worker; a logger outside "vllm" has no handler there, and INFO lines would be lost.
logger = init_logger(f"vllm.{__name__}")


def agree(rank: int | None, version, error) -> list:
    """Every TP rank's ``(rank, version, error text)`` (``rank``: this rank's global rank, or None
    before it has one: its TP rank then), gathered over vLLM's TP cpu group in TP rank order."""
    outcomes = [None] * get_tensor_model_parallel_world_size()
    me = get_tensor_model_parallel_rank() if rank is None else rank
    dist.all_gather_object(outcomes, outcome(me, version, error), group=get_tp_group().cpu_group)
    return outcomes


def raises_here() -> bool:
    """Whether this TP rank is the one that raises an agreed failure: the last (see :func:`fail`)."""
    return get_tensor_model_parallel_rank() == get_tensor_model_parallel_world_size() - 1


def fail(outcomes, cause, *, what: str, serving: int, torn: bool = False, quiet=None) -> None:
    """Raise the TP group's agreed failure so that vLLM stays usable.

    vLLM 0.32's multiproc executor reads the workers' replies in rank order and raises at the
    first failure, leaving later ranks' replies queued: every later ``collective_rpc`` would then
    read a stale reply. So only the last TP rank raises (with every rank's reason); the others
    log it, call ``quiet()`` (the engine closes its weight-update session there, as vLLM does after
    an exception), and return. ``serving``: the version vLLM keeps serving (named in the error);
    ``torn``: a direct pull may have written vLLM's parameters, which then serve no whole version.
    """
    kept = (f"the pull writes vLLM's parameters directly (init_info prefetch=False, direct=True): they may hold "
            f"part of a version after {serving}; do not generate until an update_weights succeeds (vLLM 0.34 "
            f"refuses meanwhile: its weights are marked incomplete; 0.32 and 0.33 cannot refuse)"
            if torn else f"nothing was applied, vLLM keeps serving version {serving}")
    err = RefitError(f"tritonreshard {what} failed ({failure_text(outcomes)}); {kept}")
    if not raises_here():
        logger.warning("%s", err)
        if quiet is not None:
            quiet()
        return
    raise err from cause
