"""Faults injected on purpose (``--fault KIND:K``) and the trainers' checkpoints, what a trainer
group restarted by ``--restart`` resumes from.

Checkpoints: one file per (version, trainer rank) in ``RunConfig.checkpoint_dir``; a version is
complete when every trainer rank's file is there. Every trainer rank writes its checkpoint of a
version before publishing it, so the newest complete one is never older than what the inference
group can hold.
"""
from __future__ import annotations

import json
import os
import signal
import time

import torch

from .config import RunConfig

__all__ = ["FAULTS", "parse_fault", "fault_at", "kill_self", "save_checkpoint", "load_checkpoint",
           "last_checkpoint"]

FAULTS = ("kill-trainer", "kill-inference", "crash-trainer")


def parse_fault(spec: str, steps: int) -> tuple[str, int]:
    """``--fault`` -> (kind, K); ValueError naming the flag when K is out of range for ``steps``."""
    kind, _, k = spec.partition(":")
    if kind not in FAULTS or not k.lstrip("-").isdigit():
        raise ValueError(f"--fault={spec!r} must be KIND:K with KIND one of {', '.join(FAULTS)} and K an int")
    k = int(k)
    lo, hi = (1, steps) if kind == "crash-trainer" else (2, steps + 1)
    if not lo <= k <= hi:
        what = "step" if kind == "crash-trainer" else "version (1 is the initial weights)"
        raise ValueError(f"--fault={spec!r}: K is a {what} and must be in [{lo}, {hi}] with --steps={steps}")
    return kind, k


def fault_at(rc: RunConfig, kind: str, k: int) -> bool:
    return rc.fault is not None and rc.fault == (kind, k)


def kill_self(dstore, rank: int, rc: RunConfig) -> None:
    """--fault kill-*: record when and who, then SIGKILL this process (no cleanup runs)."""
    dstore.set("fault/kill", json.dumps({"rank": rank, "pid": os.getpid(), "time": time.time(),
                                         "fault": f"{rc.fault[0]}:{rc.fault[1]}"}))
    os.kill(os.getpid(), signal.SIGKILL)


def _path(rc: RunConfig, version: int, rank: int) -> str:
    return os.path.join(rc.checkpoint_dir, f"v{version:06d}-r{rank}.pt")


def save_checkpoint(rc: RunConfig, rank: int, version: int, state: dict) -> None:
    path = _path(rc, version, rank)
    torch.save(state, path + ".tmp")
    os.replace(path + ".tmp", path)  # atomic: a rank killed mid-write leaves no torn checkpoint
    old = _path(rc, version - 2, rank)  # keep two: the newest may be incomplete on other ranks
    if os.path.exists(old):
        os.unlink(old)


def load_checkpoint(rc: RunConfig, version: int, rank: int) -> dict:
    return torch.load(_path(rc, version, rank), weights_only=False)


def last_checkpoint(rc: RunConfig) -> int | None:
    """The newest version every trainer rank checkpointed, or None."""
    versions = None
    for r in rc.trainer_ranks:
        mine = {int(n[1:7]) for n in os.listdir(rc.checkpoint_dir) if n.endswith(f"-r{r}.pt")}
        versions = mine if versions is None else versions & mine
    return max(versions) if versions else None
