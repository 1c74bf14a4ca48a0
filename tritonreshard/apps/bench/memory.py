"""The bench's peak memory, estimated before any process starts (:func:`estimate`), and the
refusal when it does not fit (:func:`refusal`).

The estimate adds up what each rank allocates, from the same layouts and plan the ranks derive:

* every process: :data:`PROCESS_BYTES` (Python, torch, gloo, the store client: measured, see
  below), the driver :data:`DRIVER_BYTES`; the plan (:data:`PLAN_OP_BYTES` per op, every rank) and
  an inference rank's descriptors and views (:data:`DST_OP_BYTES` per op it receives);
* a trainer: its arena (its local shards, shared memory the inference ranks map) and, during
  set-up only, the version-0 bits the endpoint copies into it (as much again);
* an inference rank: the engine's buffer sets (two in shadow mode, one in place);
* ``p2p``: a destination set of its own on each inference rank, and a staging buffer for every
  op whose slice is not contiguous (sent from a packed copy, received into a temporary);
* ``gather_broadcast``: a destination set of its own, the largest tensor whole on every rank of
  a gather or broadcast, the gather's receive slots on its root, a padding buffer;
* ``--hosts`` > 1: a relay's receive buffer on each inference host (at most the model), and the
  senders' packing of boxes that are not contiguous (at most their arena);
* ``--codec`` auto or always with ``--hosts`` > 1 (:data:`DELTA_WORK`): a trainer's snapshot of
  what it sends (at most its arena) and the encoder's temporaries, a receiving rank's decoder's,
  each :data:`DELTA_WORK` times the largest message (at most a trainer's arena: a whole arena needed
  on a host is one message);
* the driver: ``memcpy``'s two buffers of at most ``MEMCPY_CHUNK`` bytes.

Shared memory is counted once (at its owner), as the kernel does. The per-process figures were
measured as the sum over a run's processes of their peak PSS (``/proc/<pid>/smaps_rollup``)
minus the buffers above, on CPU (torch 2.13, Python 3.11); on CUDA the buffers live in GPU memory
and the check counts only the processes.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from tritonreshard.engine.modes import buffer_mode
from tritonreshard.planning import plan_reshard

from ..driver import fmt_gib, memory_shortage
from .baselines import bcast_set, gather_set
from .config import BenchConfig
from .model import build_model, layouts
from .provenance import CHUNK, HASH_BYTES_PER_ELEMENT
from .session import MEMCPY_CHUNK

__all__ = ["MemoryEstimate", "estimate", "refusal", "PROCESS_BYTES", "DRIVER_BYTES", "PLAN_OP_BYTES", "DST_OP_BYTES",
           "DELTA_WORK"]

#: One spawned rank beyond its buffers (measured: see the module docstring).
PROCESS_BYTES = 192 << 20
#: The driver process beyond memcpy's buffers (measured likewise).
DRIVER_BYTES = 320 << 20
#: Every rank holds the whole plan (Python objects, per op), and an inference rank its copies'
#: descriptors and views (per op it receives): measured with 10000 tensors (86658 ops).
PLAN_OP_BYTES = 1 << 10
DST_OP_BYTES = 8 << 10
#: The delta codec's temporaries per byte of a message, when every element changed (as the
#: provenance bits do every refit): int64 positions and int32 differences per 2-byte word and their
#: intermediates. Measured as the peak RSS growth of one ``encode`` (16.7x, ``force_sparse`` or not)
#: and one ``decode`` (17.1x) of a 32 MiB message on CPU (torch 2.13).
DELTA_WORK = 18


@dataclass
class MemoryEstimate:
    """``ranks``: per rank, ``{what: bytes}``; ``driver``: likewise; ``total``: their sum."""

    ranks: dict[int, dict[str, int]] = field(default_factory=dict)
    driver: dict[str, int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(sum(r.values()) for r in self.ranks.values()) + sum(self.driver.values())

    def summary(self, cfg: BenchConfig) -> str:
        """One clause per kind of process: ``4 inference ranks x 5.2 GiB (...)``."""
        parts = []
        for name, ranks in (("trainer", [r for r in cfg.trainer_ranks if r not in cfg.inference_ranks]),
                            ("inference rank", [r for r in cfg.inference_ranks if r not in cfg.trainer_ranks]),
                            ("trainer + inference rank", [r for r in cfg.inference_ranks if r in cfg.trainer_ranks])):
            if not ranks:
                continue
            biggest = max(ranks, key=lambda r: sum(self.ranks[r].values()))
            items = sorted(self.ranks[biggest].items(), key=lambda kv: -kv[1])
            what = ", ".join(f"{k} {fmt_gib(v)}" for k, v in items if v >= 1 << 20)
            parts.append(f"{len(ranks)} {name}{'s' if len(ranks) > 1 else ''} x up to "
                         f"{fmt_gib(sum(self.ranks[biggest].values()))} ({what})")
        parts.append(f"the driver {fmt_gib(sum(self.driver.values()))}")
        return "; ".join(parts)


def _contiguous(shape, slices) -> bool:
    """Whether ``t[slices]`` of a contiguous ``t`` of ``shape`` is contiguous (torch's rule:
    dimensions of size 1 do not count)."""
    expected = 1
    for d in reversed(range(len(shape))):
        size = slices[d].stop - slices[d].start
        if size != 1 and expected != math.prod(shape[d + 1:]):
            return False
        expected *= size
    return True


def estimate(cfg: BenchConfig) -> MemoryEstimate:
    """The peak memory of a bench session of ``cfg`` (all of ``cfg.methods``), per rank and driver."""
    model = build_model(cfg)
    src, dst = layouts(cfg, model)
    methods = cfg.worker_methods
    on_gpu = cfg.device == "cuda"  # the buffers are in GPU memory: only the processes count
    plan = plan_reshard(src, dst)
    est = MemoryEstimate()
    received = {}
    for op in plan.ops:
        received[op.dst_rank] = received.get(op.dst_rank, 0) + 1
    for r in range(cfg.world_size):
        est.ranks[r] = {"process": PROCESS_BYTES, "plan": len(plan.ops) * PLAN_OP_BYTES}
        if received.get(r):
            est.ranks[r]["descriptors"] = received[r] * DST_OP_BYTES
    if not on_gpu:
        for r in cfg.trainer_ranks:
            # (megatron-tp-pp: a trainer holds only its pipeline stage's tensors)
            shards = sum(src[t.name].local_numel(r) * 2 for t in model if r in src[t.name].ranks)
            est.ranks[r]["arena"] = shards
            est.ranks[r]["version-0 bits at set-up"] = shards
        for r in cfg.inference_ranks:
            shards = sum(dst[t.name].local_numel(r) * 2 for t in model)
            est.ranks[r]["engine buffer sets"] = shards * buffer_mode(cfg.mode).sets
            baselines = [m for m in ("p2p", "gather_broadcast") if m in methods]
            if baselines:
                est.ranks[r]["baseline destination sets"] = shards * len(baselines)
            est.ranks[r]["verification"] = CHUNK * HASH_BYTES_PER_ELEMENT
        if "p2p" in methods:
            for op in plan.ops:
                if op.numel == 0 or op.src_rank == op.dst_rank:
                    continue
                nbytes = op.numel * 2
                if not _contiguous(src[op.src_name].local_shape(op.src_rank), op.src_slices):
                    _add(est.ranks[op.src_rank], "p2p send staging", nbytes)
                if not _contiguous(dst[op.name].local_shape(op.dst_rank), op.dst_slices):
                    _add(est.ranks[op.dst_rank], "p2p receive staging", nbytes)
        if "gather_broadcast" in methods:
            biggest = max(math.prod(t.shape) for t in model) * 2
            gsets = [gather_set(src[t.name]) for t in model]
            bsets = [bcast_set(src[t.name], dst[t.name]) for t in model]
            max_local = max(src[t.name].local_numel(q) for t, g in zip(model, gsets, strict=True) for q in g) * 2
            most = max(len(g) for g in gsets)
            for r in range(cfg.world_size):
                if any(r in g or r in b for g, b in zip(gsets, bsets, strict=True)):
                    _add(est.ranks[r], "gather_broadcast buffers", biggest)
                if any(r == g[0] for g in gsets):
                    _add(est.ranks[r], "gather_broadcast buffers", most * max_local)
                _add(est.ranks[r], "gather_broadcast buffers", max_local)
        if cfg.hosts > 1:
            # Each byte crosses into a host once, into a relay's receive buffer there (at most the
            # model, or what that host's ranks hold); senders may pack boxes that are not contiguous.
            model_bytes = sum(math.prod(t.shape) * 2 for t in model)
            by_host = {}
            for r in cfg.inference_ranks:
                by_host.setdefault(cfg.host_of(r), []).append(r)
            for ranks in by_host.values():
                held = sum(dst[t.name].local_numel(r) * 2 for t in model for r in ranks)
                _add(est.ranks[ranks[0]], "cross-host receive buffer", min(model_bytes, held))
            for r in cfg.trainer_ranks:
                _add(est.ranks[r], "cross-host send staging", est.ranks[r]["arena"])
            if cfg.delta != "off":
                # A snapshot of what each trainer sends, and the codec's temporaries for the largest
                # message: at most an arena, sent whole to a host that needs it (one message).
                largest = max(est.ranks[r]["arena"] for r in cfg.trainer_ranks)
                for r in cfg.trainer_ranks:
                    _add(est.ranks[r], "delta snapshot", est.ranks[r]["arena"])
                    _add(est.ranks[r], "delta encoding", DELTA_WORK * est.ranks[r]["arena"])
                for ranks in by_host.values():
                    held = sum(dst[t.name].local_numel(r) * 2 for t in model for r in ranks)
                    _add(est.ranks[ranks[0]], "delta decoding", DELTA_WORK * min(largest, held))
    est.driver["process"] = DRIVER_BYTES
    if "memcpy" in cfg.methods and not on_gpu:
        nbytes = sum(lay.local_numel(r) * lay.itemsize for lay in dst.values() for r in lay.ranks)
        est.driver["memcpy buffers"] = 2 * min(nbytes, MEMCPY_CHUNK)
    return est


def _add(d: dict, key: str, n: int) -> None:
    d[key] = d.get(key, 0) + n


def _sizes_below(size: int):
    """Round sizes below ``size``, largest first: 1.5 x 2^k and 2^k MiB (768MiB, 512MiB, 384MiB...)."""
    mib = 1 << 20
    out = sorted({m * mib for k in range(0, 20) for m in (1 << k, 3 << k >> 1) if mib <= m * mib < size},
                 reverse=True)
    return out


def fmt_size(n: int) -> str:
    """``--size`` as a user would type it: 768MiB, 1GiB (bytes when neither is whole)."""
    if n % (1 << 30) == 0:
        return f"{n >> 30}GiB"
    return f"{n >> 20}MiB" if n % (1 << 20) == 0 else str(n)


def refusal(cfg: BenchConfig, available: tuple[int, str] | None = None) -> str | None:
    """None when ``cfg``'s estimated peak fits in the memory available now; else the message that
    refuses to start: the estimate and its parts, what is available, and a ``--size`` that fits."""
    need = estimate(cfg)
    short = memory_shortage(need.total, available=available)
    if short is None:
        return None
    fits = next((s for s in _sizes_below(cfg.size)
                 if memory_shortage(estimate(replace(cfg, size=s)).total, available=available) is None), None)
    tries = [f"--size {fmt_size(fits)} ({fmt_gib(estimate(replace(cfg, size=fits)).total)})"] if fits else []
    lighter = tuple(m for m in cfg.methods if m in ("memcpy", "tritonreshard"))
    if lighter and lighter != cfg.methods:
        light = estimate(replace(cfg, methods=lighter)).total
        if memory_shortage(light, available=available) is None:
            tries.append(f"--methods {','.join(lighter)} ({fmt_gib(light)})")
    hint = f"Try {' or '.join(tries)}." if tries else "No --size fits: use fewer --inference or --trainers ranks."
    return (f"--layout {cfg.layout} --size {fmt_size(cfg.size)} needs about {fmt_gib(need.total)} at its peak, and "
            f"{short}. {hint} The estimate, {cfg.world_size} processes and methods {','.join(cfg.methods)}: "
            f"{need.summary(cfg)}.")
