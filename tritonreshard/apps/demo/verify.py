"""Verification of every refit, exact by construction.

The trainers publish, for every version before they publish it, a SHA-1 of the full weights' bytes
and the bytes of the dense probe's logits (:func:`publish_probe`). After each refit the inference
ranks gather their TP shards into full weights (pure copies), and the first one runs the very same
probe on them (:func:`verify_served`); :class:`ProbeChecks` compares both bit for bit once the
trainers' probe of that version is in the store.
"""
from __future__ import annotations

import datetime
import pickle

import numpy as np
import torch

from .policy import PolicyConfig, gather_full, probe, probe_inputs, tp_forward, weights_digest

__all__ = ["publish_probe", "verify_served", "ProbeChecks"]


def publish_probe(dstore, cfg: PolicyConfig, version: int, full: dict[str, torch.Tensor]) -> None:
    """Trainer rank 0, before publishing ``version``: its weights digest and probe logits."""
    logits = probe(cfg, full)
    dstore.set(f"probe/{version}", pickle.dumps({
        "weights_sha1": weights_digest(full), "logits": logits.numpy().tobytes()}))


class ProbeChecks:
    """The first inference rank's record: ``pending`` (version -> (weights sha1, probe logits))
    awaiting the trainers' probe, then ``verified`` versions and ``bad`` ones (with how they differ)."""

    def __init__(self):
        self.pending: dict[int, tuple[str, torch.Tensor]] = {}
        self.verified: list[int] = []
        self.bad: list[dict] = []

    def check(self, dstore, block: bool, timeout: float = 0.0) -> None:
        """Compares every pending version whose probe is in the store (``block``: waits for each)."""
        for v in sorted(self.pending):
            key = f"probe/{v}"
            if not block and not dstore.check([key]):
                continue
            if block:
                dstore.wait([key], datetime.timedelta(seconds=timeout))
            ref = pickle.loads(dstore.get(key))
            sha, logits = self.pending.pop(v)
            ours = logits.numpy().tobytes()
            if ref["weights_sha1"] == sha and ref["logits"] == ours:
                self.verified.append(v)
            else:
                diff = np.abs(np.frombuffer(ref["logits"], dtype=np.float32) - logits.numpy().reshape(-1)).max()
                self.bad.append({"version": v, "weights_match": ref["weights_sha1"] == sha,
                                 "max_abs_diff": float(diff)})


def verify_served(rank: int, cfg: PolicyConfig, inf, dst_layouts, igroup, comm, leader: bool,
                  checks: ProbeChecks) -> float:
    """All TP ranks: gather the serving shards into full weights and run the probes; the leader
    records (weights digest, dense probe logits) in ``checks``. Returns the max abs difference
    between the TP forward and the dense forward on the probe inputs (0.0 on the other ranks)."""
    full = gather_full(dst_layouts, inf.tensors, rank, igroup, comm)
    prompts, prev = probe_inputs(cfg)
    pos = torch.arange(cfg.length).repeat(prompts.shape[0])
    dev = next(iter(inf.tensors.values())).device
    with torch.no_grad():
        tp = tp_forward(inf.tensors, prompts.reshape(-1).to(dev), prev.reshape(-1).to(dev),
                        pos.to(dev), igroup, comm).cpu()
    if not leader:
        return 0.0
    dense = probe(cfg, full)
    checks.pending[inf.version] = (weights_digest(full), dense)
    return float((tp.view_as(dense) - dense).abs().max())
