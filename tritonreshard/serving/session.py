"""One refit of a serving engine, the same for every engine: :func:`refit`.

Check the request, agree over the TP group, obtain the version (:mod:`~.pull`), agree again, and
only when every TP rank holds the same version does any rank apply it. An engine brings two
functions of its own:

* ``agree(version, error) -> outcomes``: every TP rank's ``(rank, version, error text)``
  (:func:`outcome` makes one), gathered over the engine's TP group, in TP rank order;
* ``apply(tensors) -> dict``: copy the pulled buffers (``{dst name: this rank's shard}``) into the
  engine's parameters; returns its timing split (at least ``copy_ms`` and ``post_ms``);

and ``fail(outcomes, cause)``, which raises the agreed failure (or, for an engine whose RPC cannot
take an exception on every rank, raises on one and returns on the others). A failed pull on any
rank fails every rank, naming the failed rank(s), before anything is applied: the engine keeps
serving the previous version, except after a direct pull (:class:`~.pull.DirectPull`), which
writes the engine's parameters itself: ``writing()`` is called before it may, and the engine's
weights are part old, part new until a refit succeeds.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from .. import RefitInference
from .pull import BackgroundPull, DirectPull, InlinePull

__all__ = ["refit", "outcome", "failure_text", "any_failed"]


def outcome(rank: int, version: int | None, error: BaseException | None) -> tuple:
    """One TP rank's part of an agreement: ``(rank, version, "Type: message" or None)`` (plain
    data: it crosses the TP group's object gather)."""
    return rank, version, None if error is None else f"{type(error).__name__}: {error}"


def any_failed(outcomes: Sequence[tuple], *, same_version: bool = False) -> bool:
    """Whether any rank failed (and, with ``same_version``, whether the ranks hold different versions)."""
    return any(e is not None for _, _, e in outcomes) or (same_version and len({v for _, v, _ in outcomes}) > 1)


def failure_text(outcomes: Sequence[tuple]) -> str:
    """Why an agreement failed, the same on every rank: every failed rank's reason (once when they
    all failed alike), or the different versions the ranks hold."""
    failed = [(r, e) for r, _, e in outcomes if e is not None]
    versions = {v for _, v, e in outcomes if e is None}
    texts = {e for _, e in failed}
    return (f"every rank: {failed[0][1]}" if len(failed) > 1 and len(texts) == 1 else
            "; ".join(f"rank {r}: {e}" for r, e in failed) or f"TP ranks pulled different versions {versions}")


def _check_request(requested, timeout: float, installed: int) -> None:
    if requested is not None and (isinstance(requested, bool) or not isinstance(requested, int)):
        raise ValueError(f"update_info version must be an int (or None: the newest pulled), got {requested!r}")
    if not timeout >= 0:
        raise ValueError(f"update_info timeout must be a number of seconds >= 0, got {timeout!r}")
    if requested is not None and requested <= installed:
        raise ValueError(f"update_info version={requested}: version {installed} is installed "
                         f"already; only a newer one can be installed")


def refit(sub: RefitInference, pull: BackgroundPull | InlinePull | DirectPull, *, requested: int | None, timeout,
          installed: int, agree: Callable, apply: Callable, fail: Callable,
          writing: Callable[[], None] = lambda: None) -> dict | None:
    """Install a version on this TP rank, all TP ranks or none (every rank calls it together).

    ``requested``: the version to install (None: the newest any TP rank pulled or is pulling, else
    the next one to be published); ``timeout``: seconds to wait for it; ``installed``: the version
    of this group the engine serves (0: none yet). Returns the stats of the refit (``version``,
    ``prefetched``, the time split in ms, the pull's and the transfer's figures: ``bytes``,
    ``pull_copy_ms``, ``pull_gb_s``, ...), or None when it
    failed and ``fail`` returned instead of raising. Holds the pull's session for the whole call.
    ``writing``: called before a pull that writes what the engine serves (``pull.WRITES_SERVED``)."""
    with pull.session():
        t0 = time.perf_counter()
        # Broad on purpose, both times: whatever failed here, every TP rank must reach the
        # agreements below (or the others would wait in them for the engine's collective timeout);
        # the error is re-raised there, naming every rank's reason.
        error, holds = None, 0
        try:
            timeout = float(timeout)
            _check_request(requested, timeout, installed)
            holds = pull.holds(sub)
        except Exception as exc:  # noqa: BLE001
            error = exc
        t1 = time.perf_counter()
        outcomes = agree(holds, error)
        t2 = time.perf_counter()
        if any_failed(outcomes):
            fail(outcomes, error)
            return None
        # The version: the one asked for; else the newest any TP rank pulled or is pulling (the
        # others wait for theirs, or pull it now); else the next one to be published.
        target = requested if requested is not None else max(max(v for _, v, _ in outcomes), installed + 1)
        # Prefetched: this rank had pulled the version, complete, before the refit asked (the
        # trainers' fence returned then); else the refit waited for a pull still copying, or pulled it now.
        prefetched = pull.pulled(sub, target)
        try:
            if pull.WRITES_SERVED:  # from here on the engine's weights may be part old, part new
                writing()
            pull.obtain(sub, target, timeout)
        except Exception as exc:  # noqa: BLE001
            error = exc
        t3 = time.perf_counter()
        outcomes = agree(sub.version if error is None else None, error)
        t4 = time.perf_counter()
        if any_failed(outcomes, same_version=True):
            fail(outcomes, error)
            return None
        split = apply(sub.tensors)
        # The background pull may write the set once this returns (the lock is released), and its
        # copy waits only for work queued on its own thread's stream: on CUDA the apply's reads of
        # the set, queued on this thread's stream, must have run first.
        if sub.device.type == "cuda":
            torch.cuda.current_stream(sub.device).synchronize()
        return _stats(sub, target, prefetched, split, (t0, t1, t2, t3, t4))


def _stats(sub: RefitInference, target: int, prefetched: bool, split: dict, times) -> dict:
    t0, t1, t2, t3, t4 = times
    pull, st = sub.last_pull, sub.stats   # st: of the version served (target), not a newer one received
    return {"version": target, "prefetched": prefetched,
            # the refit's own time: waiting for (or doing) the pull, the two agreements, and the
            # apply (copy into the engine's tensors, its post-processing)
            "wait_ms": ((t1 - t0) + (t3 - t2)) * 1e3, "agree_ms": ((t2 - t1) + (t4 - t3)) * 1e3,
            "apply_ms": (time.perf_counter() - t4) * 1e3, **split,
            "total_ms": (time.perf_counter() - t0) * 1e3,
            # the pull of this version (in the background when prefetched)
            "pull_wait_ms": pull.wait_ms, "pull_copy_ms": pull.copy_ms, "pull_total_ms": pull.total_ms,
            # inside the pull, the engine's own work on the layers it streamed (its layer sink)
            "pull_sink_ms": pull.sink_ms,
            "staging_bytes": pull.staging_bytes, "bytes": st.bytes_per_refit,
            # the pull's copy rate: its bytes over its copy time (bytes / ms / 1e6 = GB/s)
            "pull_gb_s": st.bytes_per_refit / (pull.copy_ms * 1e6) if pull.copy_ms > 0 else 0.0,
            # the same over its CPU time on the pulling thread: the copy's own cost where a
            # background pull shares the cores with generation
            "pull_copy_cpu_ms": pull.copy_cpu_ms,
            "pull_cpu_gb_s": st.bytes_per_refit / (pull.copy_cpu_ms * 1e6) if pull.copy_cpu_ms > 0 else 0.0,
            # what crossed into this rank from other hosts for this version (0 on one host)
            "cross_host_bytes": st.cross_host_bytes, "cross_host_delta_bytes": st.cross_host_delta_bytes,
            "cross_host_dense_bytes": st.cross_host_dense_bytes, "cross_host_changed": st.cross_host_changed}
