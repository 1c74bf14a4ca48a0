"""Background or inline pull: how a serving rank gets a published version, chosen once.

:func:`pull_mode` picks :class:`BackgroundPull` (``ServingInit.prefetch=True``),
:class:`InlinePull` or :class:`DirectPull` (``prefetch=False``, with ``direct`` and an engine that
names parameters in load format) when an engine sets up; all have one interface, and only need the
rank's :class:`~tritonreshard.RefitInference`. Engine-agnostic: the engine's refit
(:func:`~.session.refit`) calls them; only the direct pull writes the engine's own parameters.

* ``MODE``, ``BUFFER_SETS``, ``BACKGROUND``, ``WRITES_SERVED``: the endpoint's buffer mode
  (``trs.Spare()`` or ``trs.InPlace()``: one buffer set either way), how many buffer sets it holds,
  whether a thread pulls in the background, whether the pull writes what the engine serves;
* ``start(sub)`` / ``stop()``: bind to the joined endpoint (the background thread starts) / end;
* ``session()``: a context held for a whole refit: the background thread neither swaps a finished
  pull in nor starts one while it is held, so the set being applied is never pulled into;
* ``holds(sub)``: the newest version this rank holds or is pulling (raising a background failure
  not yet reported); ``pulled(sub, target)``: whether ``target`` was pulled, complete, before the
  refit waits for anything (the stats' ``prefetched``);
* ``obtain(sub, target, timeout)``: make the endpoint's buffer set hold ``target``, complete.

**Background pull.** A thread (``trs-prefetch-<rank>``) watches the trainers' version words; as
soon as every trainer this rank reads from published a version newer than the one it holds, it
pulls it into the rank's one buffer set (on CUDA on its own stream) and acks it, while the engine
keeps generating from its own parameters. The trainers' ``fence()`` therefore returns without any
engine call. A prefetched version is not installed: the engine's parameters change only in its
refit, which copies the set into them. The trainers cannot publish over a version a rank is still
pulling (``fence()`` waits for its ack); once it acked, a newer version replaces the prefetched one
that was never installed (the arenas hold only the newest version anyway).

One set is enough (``trs.Spare()``, 1.0x the rank's weights beside the engine's own), because
nothing serves from it: it is read only by the refit's apply, under :meth:`~BackgroundPull.session`,
and the watcher starts a pull only while holding that same lock. A refit that arrives while a pull
is in flight waits for it (its copy, at most: it started only once the version was published) and
installs what the set holds when it ends, the newest version; a refit asking for an older version
the set no longer holds fails, naming the one to install. A pull that fails part-way tears the set
(``consistent`` False), never the engine's weights: the next refit reports the failure, the engine
keeps serving, and the version after the torn set's is pulled again, inline, by the refit after
that (the thread retries only once a newer version is published).

**Inline pull.** The pull runs inside the refit (and the trainers' ``fence()`` waits for it); one
buffer set is enough: the engine's own parameters are what is served, and they are written only
after every TP rank pulled the whole version.

**Direct pull.** The inline pull, with the engine's parameters that are in load format as the
destination of the pull itself (the endpoint's ``tensors=``; ``trs.InPlace()`` writes them): no
buffer and no second copy for them, one buffer set for the rest (parameters the engine
post-processes). The memory is the price of the guarantee above: a pull that fails part-way
(or fails on another TP rank after this one pulled) leaves the engine's weights part old, part new.
The refit then fails on every rank saying so, the engine hears it before the pull starts
(:meth:`~.seam.ServingEngine.writing_served`: an engine that can refuse to serve marks its weights) and the next refit
pulls the newest version whole.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from .. import RefitError, RefitInference
from ..engine import InPlace, Spare

__all__ = ["BackgroundPull", "DirectPull", "InlinePull", "pull_mode"]


def _obtain_now(sub: RefitInference, target: int, timeout: float) -> None:
    """Pull ``target`` into ``sub``'s buffers unless it holds it already, complete (both modes'
    last step; no pull is in flight)."""
    if not sub.consistent and sub.version >= target:  # the set held it until a newer pull tore it
        raise ValueError(f"update_info version={target}: a pull of a version after {sub.version} failed "
                         f"part-way on this rank and tore its buffer set; a trainer's arena holds only its "
                         f"newest version: install {sub.version + 1} or newer (or pass no version)")
    if sub.version > target:
        raise ValueError(f"update_info version={target}: this rank already pulled version {sub.version}, "
                         f"published after it; a trainer's arena holds only its newest version: install "
                         f"{sub.version} (or pass no version)")
    if sub.version < target:
        try:
            sub.pull(target, timeout)
        except TimeoutError as exc:
            newest = sub.available_version()
            if newest < target:
                raise RefitError(f"update_info version={target} was never published: the newest version "
                                 f"the trainers published is {newest} (waited {timeout:g} s)") from exc
            raise


class InlinePull:
    """Pull inside the refit (``prefetch=False``): one buffer set, nothing in the background."""

    MODE, BACKGROUND, WRITES_SERVED = InPlace(), False, False
    BUFFER_SETS = MODE.sets

    def __init__(self, *, rank: int, logger: logging.Logger | None = None, served: Callable[[], int] = lambda: 0):
        self.rank = rank
        self._lock = threading.Lock()  # one refit at a time, as in the background mode

    def start(self, sub: RefitInference) -> None:
        pass

    def stop(self) -> None:
        pass

    def session(self):
        return self._lock

    def holds(self, sub: RefitInference) -> int:
        return sub.version

    def pulled(self, sub: RefitInference, target: int) -> bool:
        return sub.version == target and sub.consistent

    def obtain(self, sub: RefitInference, target: int, timeout: float) -> None:
        _obtain_now(sub, target, timeout)


class DirectPull(InlinePull):
    """Pull inside the refit straight into the engine's load-format parameters (``prefetch=False``,
    ``direct=True``): one buffer set for the rest only; a failed pull tears what is served (see the
    module docstring)."""

    WRITES_SERVED = True


class BackgroundPull:
    """Pull every published version in the background (``prefetch=True``; see the module docstring)
    into the rank's one buffer set (``trs.Spare()``).

    ``logger``: where a background failure is logged (an engine passes its own: one under the
    engine's logging tree reaches its handler); ``served``: the version the engine serves, for that line."""

    MODE, BACKGROUND, WRITES_SERVED = Spare(), True, False
    BUFFER_SETS = MODE.sets
    # How often the watcher looks at the trainers' version words (a read of shared memory): a
    # published version starts pulling within this much, at a negligible CPU cost.
    POLL_S = 0.005

    def __init__(self, *, rank: int, logger: logging.Logger | None = None, served: Callable[[], int] = lambda: 0):
        self.rank, self._log, self._served = rank, logger or logging.getLogger(__name__), served
        # The lock is held by the watcher while it swaps a finished pull in or starts one, and by
        # the refit for the whole call, so the one set is never pulled into while it is applied.
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._watcher: threading.Thread | None = None
        self._inflight: int | None = None     # the version the background pull is pulling
        self._error: tuple[int, BaseException] | None = None  # (version, error), until reported
        self._failed = 0                      # the last version a background pull failed on

    def start(self, sub: RefitInference) -> None:
        self._stop.clear()
        self._watcher = threading.Thread(target=self._watch, args=(sub,), daemon=True,
                                         name=f"trs-prefetch-{self.rank}")
        self._watcher.start()

    def stop(self) -> None:
        self._stop.set()
        if self._watcher is not None:
            self._watcher.join(60.0)
            self._watcher = None

    def session(self):
        return self._lock

    def _watch(self, sub: RefitInference) -> None:
        """The watcher thread: mark each finished background pull as the version the endpoint's set
        holds (not into the engine: that is the refit's job), and start the next one as soon as a
        newer version is published."""
        while not self._stop.wait(self.POLL_S):
            with self._lock:
                if self._stop.is_set():  # stopped while waiting for the lock (shut down, re-initialized)
                    return
                # Broad on purpose: the thread must not die silently; whatever failed is reported
                # by the next refit (with the engine's weights untouched) and retried only for a
                # newer version.
                try:
                    self._watch_step(sub)
                except Exception as exc:  # noqa: BLE001
                    self._background_failed(self._inflight, exc)

    def _watch_step(self, sub: RefitInference) -> None:
        if sub.pulling:
            if not sub.pull_done():
                return
            target, self._inflight = self._inflight, None
            try:
                sub.swap(timeout=0)  # the endpoint's set only: the engine's parameters stay as they are
            except Exception as exc:  # noqa: BLE001  (a failed pull: reported, see _watch)
                self._background_failed(target, exc)
            return
        newest = sub.available_version()
        if newest > max(sub.version, self._failed):
            self._inflight = sub.start_pull(newest)

    def _background_failed(self, version, exc: BaseException) -> None:
        self._inflight = None
        self._failed = max(self._failed, version or 0)
        self._error = (version, exc)
        self._log.warning("tritonreshard (rank %s): background pull of version %s failed: %s: %s (reported at the "
                          "next update_weights; the engine keeps serving version %s)", self.rank, version,
                          type(exc).__name__, exc, self._served())

    def holds(self, sub: RefitInference) -> int:
        if self._error is not None:
            (failed, exc), self._error = self._error, None
            raise RefitError(f"the background pull of version {failed} failed: {type(exc).__name__}: {exc}") from exc
        if not sub.pulling and not sub.consistent:
            # A torn set holds nothing; the oldest version it can be pulled to is the next one
            # (the trainers could publish no later one: the torn pull was never acked).
            return sub.version + 1
        return max(sub.version, self._inflight or 0)

    def pulled(self, sub: RefitInference, target: int) -> bool:
        """Whether ``target`` is in the set, complete, before the refit waits for anything: a
        finished pull the watcher has not marked yet (it polls every ``POLL_S``, and a refit holding
        the lock keeps it waiting) counts; one still copying does not."""
        if sub.pulling:
            return self._inflight == target and sub.pull_done() and sub.pull_error() is None
        return sub.version == target and sub.consistent

    def obtain(self, sub: RefitInference, target: int, timeout: float) -> None:
        """A pull in flight is waited for whatever ``target`` is (it writes the one set the apply
        reads); then a prefetched version is there already, an older one is refused (the set
        holds a newer one), a newer one is pulled now."""
        if sub.pulling:
            inflight, self._inflight = self._inflight, None
            try:
                sub.swap(timeout)
            except TimeoutError:
                self._inflight = inflight  # it goes on; the watcher swaps it in later
                raise
            except Exception as exc:
                self._failed = max(self._failed, inflight or 0)
                raise RefitError(f"the background pull of version {inflight} failed: {type(exc).__name__}: "
                                 f"{exc}") from exc
        _obtain_now(sub, target, timeout)


def pull_mode(prefetch: bool, *, direct: bool = False, rank: int, logger: logging.Logger | None = None,
              served: Callable[[], int] = lambda: 0) -> BackgroundPull | InlinePull | DirectPull:
    """The pull of a serving rank, chosen once (the one ``prefetch`` test of the serving side);
    ``direct``: the inline pull writes the engine's load-format parameters (ignored with ``prefetch``)."""
    kind = BackgroundPull if prefetch else DirectPull if direct else InlinePull
    return kind(rank=rank, logger=logger, served=served)

