"""The one torch quirk the package disarms, in one place (``import tritonreshard`` and the engine)."""
from __future__ import annotations

__all__ = ["disarm_process_group_pin"]


def disarm_process_group_pin() -> None:
    """Import ``torch.distributed.nn`` now if no process group exists yet.

    Its functions take ``group.WORLD`` as a default argument, evaluated when the module is first
    imported. Imported after ``init_process_group`` (torch.optim's first step and torch._dynamo
    import it), they keep the job's process group, and its gloo threads, alive past
    ``destroy_process_group``; those threads then release tensors during interpreter shutdown and
    abort the process ("terminate called without an active exception"). Imported before, the
    defaults are None. Not imported when a group already exists: that would pin it.
    """
    # Lazy: the package itself loads torch only once a name is used (the CLI answers without it).
    import torch.distributed as dist
    if dist.is_available() and not dist.is_initialized():
        import torch.distributed.nn  # noqa: F401
