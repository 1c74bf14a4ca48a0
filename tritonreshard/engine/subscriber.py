"""Subscriber: the inference side of a refit group (buffer sets, pull / start_pull / swap, copy thread).

Who calls what (an inference rank; :class:`tritonreshard.RefitInference` builds one)::

    sub.pull()                          # wait for the next version, copy, install
    sub.start_pull(); ...; sub.swap()   # shadow mode: copy in a background thread meanwhile

The buffer sets (one in in-place mode, two in shadow mode) belong to the subscriber for its whole
life; the sources (where the bytes come from) belong to one group epoch. ``attach`` / ``detach``
switch epochs without touching the buffers, so a rank keeps serving the last complete version while
its trainers restart, and then pulls from the new ones.

Where the source bytes come from is one seam, :class:`LocalSources`: the source ranks' arenas on
this host, mapped once. A cross-host receiver provides the same three things (``controls``,
``tensor``, ``prepare``) for sources on other hosts.

Each pull is measured (:class:`PullStats`): time waiting for the sources, the copy itself (device
sync included), the total up to the ack, and the extra memory it allocated (``staging_bytes``:
the peak allocator delta on CUDA; on CPU the bytes of every new tensor created by the pull thread,
counted by a thread-local ``TorchDispatchMode``).
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..errors import RefitError
from ..kernels import DescriptorTable
from .group import Group, check_timeout
from ..planning import Plan
from ..transport import open_arena, open_control_block, pack_offsets

__all__ = ["Subscriber", "LocalSources", "PullStats"]


@dataclass(frozen=True)
class PullStats:
    """One successful pull, measured. Milliseconds; ``staging_bytes`` as measured (see module doc)."""

    version: int
    wait_ms: float       # waiting for every source to publish the version
    copy_ms: float       # sources' prepare + descriptor-table copy + device sync
    total_ms: float      # from the start of the pull to the ack
    staging_bytes: int

    @property
    def coordination_ms(self) -> float:
        """This rank's time in the pull outside the wait and the copy (checks, acks, hand-offs)."""
        return self.total_ms - self.wait_ms - self.copy_ms


class _CountAllocations(TorchDispatchMode):
    """Counts bytes of tensors created with fresh storage by ops dispatched on *this thread*
    (dispatch modes are thread-local). In-place ops (``copy_``: the whole copy path) and views
    allocate nothing and are passed through at once (a few microseconds each)."""

    def __init__(self):
        super().__init__()
        self.nbytes = 0

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # By default torch wraps ``__torch_dispatch__`` in ``torch._disable_dynamo``, which imports
        # torch._dynamo on the first pull. That import, done while a process group exists, keeps
        # the group's gloo threads alive past ``destroy_process_group``: they then release tensors
        # during interpreter shutdown and abort the process ("terminate called without an active
        # exception"). This mode only runs in pulls, never under torch.compile: no wrapper needed.
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.is_view or func._schema.is_mutable:
            return out
        ins = {t.untyped_storage().data_ptr() for t in _tensors((args, kwargs))}
        for t in _tensors(out):
            st = t.untyped_storage()
            if st.data_ptr() not in ins:
                self.nbytes += st.nbytes()
        return out


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            yield from _tensors(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from _tensors(o)


class _StagingMeter:
    """Extra memory allocated inside the ``with`` block: peak CUDA allocator delta on ``device``
    (process-wide: concurrent allocations of other threads count too), else tensor bytes created by
    this thread."""

    def __init__(self, device: torch.device):
        self.device, self.nbytes = device, 0

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
        self._count = _CountAllocations().__enter__()
        return self

    def __exit__(self, *exc):
        self._count.__exit__(*exc)
        self.nbytes = self._count.nbytes
        if self.device.type == "cuda":
            self.nbytes = max(self.nbytes, torch.cuda.max_memory_allocated(self.device) - self._base)
        return False


class LocalSources:
    """Where a subscriber's source bytes come from: the source ranks' arenas on this host.

    Args:
        group: the epoch's group; exports: ``{rank: Exports}`` from ``group.exchange``;
        ranks: the source ranks this subscriber reads; local: the colocated publisher, or None.
        device: the device that reads the memory.
    """

    def __init__(self, group: Group, exports: dict, ranks, *, local=None, device=None):
        self.group, self.exports = group, exports
        self.local = local
        self._arenas: dict[int, object] = {}
        self.controls: dict[int, object] = {}
        try:
            for s in ranks:
                if local is not None and s == group.rank:
                    self.controls[s] = local.control
                    continue
                e = exports[s]
                self._arenas[s] = open_arena(e.arena, secret=group.secret, device=device, timeout=group.timeout)
                self.controls[s] = open_control_block(e.control, secret=group.secret, timeout=group.timeout)
        except BaseException:
            self.close()
            raise

    @property
    def remote(self) -> dict:
        """Control blocks of the sources in other processes (the ones that can die)."""
        return {s: c for s, c in self.controls.items() if s != self.group.rank}

    @property
    def handles_opened(self) -> int:
        return len(self._arenas)

    def tensor(self, rank: int, name: str, layout) -> torch.Tensor:
        """Source ``rank``'s whole local shard of source tensor ``name`` (an op's ``src_name``; a
        view into its arena, no copy)."""
        if self.local is not None and rank == self.group.rank:
            return self.local.tensors[name]
        return self._arenas[rank].tensor(self.exports[rank].offsets[name], layout.local_shape(rank), layout.dtype)

    def ops(self, plan, rank: int) -> tuple:
        """The ops ``rank`` runs from these sources."""
        return plan.ops_for_dst(rank)

    def order_key(self, op) -> tuple:
        """Table order: by source, then where the shard lives in the source's memory."""
        return (op.src_rank, self.exports[op.src_rank].offsets[op.src_name])

    def view(self, op, plan) -> torch.Tensor:
        """The whole source tensor ``op`` indexes with its ``src_slices``."""
        return self.tensor(op.src_rank, op.src_name, plan.src_layouts[op.src_name])

    def prepare(self, version: int) -> None:
        """Before the copy of ``version``: make the bytes of ``tensor()`` current. Local arenas are
        read in place, so nothing to do; a cross-host receiver receives here."""

    def close(self) -> None:
        for c in [c for s, c in self.controls.items() if s != self.group.rank]:
            c.close()
        self.controls.clear()
        for a in self._arenas.values():
            a.close()
        self._arenas.clear()


class Subscriber:
    """Inference side of one rank: owns the buffer sets; reads from one group epoch at a time.

    Args:
        rank: this rank; layouts: ``{name: Layout}`` of the names this rank holds (non-empty).
        tensors: optional ``{name: tensor}`` to write (first buffer set), validated by the endpoint.
        device: device of the buffers; mode: ``"shadow"`` or ``"inplace"``; backend: ``"triton"`` or
            ``"torch"``.
        sources: factory with :class:`LocalSources`' signature (the seam for other byte sources).
        fills: this rank's zero fills (``plan.fills_for_dst(rank)``: padding no op writes, e.g.
            vocab rows past the real vocab). Zeroed once in every buffer set here, at allocation
            (a given ``tensors`` set included), never per pull.
    """

    def __init__(self, rank: int, layouts: dict, *, tensors=None, device: torch.device, mode: str,
                 backend: str, src_order=None, sources=LocalSources, fills=()):
        self.rank, self.mode, self.backend, self.device = rank, mode, backend, device
        self.layouts = dict(layouts)
        self._sources_factory = sources
        self.version = 0           # version being served
        self.consistent = True     # in-place mode: False after a torn pull
        self.pulls = 0
        self.last_pull: PullStats | None = None
        self.staging_bytes = 0     # the largest staging_bytes measured over this rank's pulls
        self.group: Group | None = None
        self.sources: LocalSources | None = None
        self._tables: list[DescriptorTable] = []
        self._thread = None
        self._target = None
        self._result = None
        self._cancel = threading.Event()
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        tensors = tensors or {}
        # One flat allocation per buffer set, same-geometry shards back to back (as in the
        # trainers' arenas): copies of equal shards then differ by a constant address step.
        src_order = src_order or {}
        geo = {n: (lay.local_shape(rank), str(lay.dtype), src_order.get(n, ""), n) for n, lay in self.layouts.items()}
        self._order = sorted(self.layouts, key=geo.__getitem__)
        self._buffers: list[dict[str, torch.Tensor]] = []
        for i in range(2 if mode == "shadow" else 1):
            own = [n for n in self._order if not (i == 0 and n in tensors)]
            sizes = [self.layouts[n].local_numel(rank) * self.layouts[n].itemsize for n in own]
            offsets, total = pack_offsets(sizes)
            flat = torch.zeros(total, dtype=torch.uint8, device=device)
            bufs = {n: tensors[n] for n in self._order if i == 0 and n in tensors}
            for n, off, size in zip(own, offsets, sizes):
                lay = self.layouts[n]
                bufs[n] = flat[off:off + size].view(lay.dtype).view(lay.local_shape(rank))
            self._buffers.append({n: bufs[n] for n in self._order})
        self.fills = tuple(fills)
        for bufs in self._buffers:  # padding: no op ever writes it, so once is enough
            for f in self.fills:
                bufs[f.name][f.dst_slices].zero_()
        self._serving = 0

    # ------------------------------------------------------------------ epochs
    def attach(self, group: Group, plan: Plan, exports: dict, *, local=None, sources=None) -> None:
        """Read from ``group``'s sources: map their arenas, build one descriptor table per buffer
        set. The buffers (and the serving version) are kept. ``sources``: a factory for this epoch
        instead of the subscriber's (e.g. the cross-host one)."""
        fills = plan.fills_for_dst(self.rank)
        if set(fills) != set(self.fills):  # the same layouts and parts join every epoch
            raise RefitError(f"rank {self.rank}: epoch {group.epoch}'s plan zero-fills {len(fills)} "
                             f"region(s) of this rank's buffers, the buffers were set up with "
                             f"{len(self.fills)}: a subscriber keeps its destination layouts and parts")
        self.detach()
        self.group = group
        self.sources = (sources or self._sources_factory)(group, exports, plan.sources_of(self.rank),
                                                          local=local, device=self.device)
        for s, c in self.sources.remote.items():
            group.beat_into(c)
            group.watch(s, c)
        pos = {n: i for i, n in enumerate(self._order)}
        # Sources are keyed by the source tensor's name (op.src_name), destination buffers by the
        # destination's (op.name): they differ for parts= plans (q/k/v -> qkv_proj, ...).
        src = self.sources
        ops = sorted(src.ops(plan, self.rank), key=lambda op: (
            *src.order_key(op), pos[op.name], tuple(s.start for s in op.dst_slices)))
        full = {}

        def src_view(op):
            key = src.order_key(op)
            if key not in full:
                full[key] = src.view(op, plan)
            return full[key]

        self._tables = [DescriptorTable.build(ops, src=src_view, dst=lambda op, b=bufs: b[op.name])
                        for bufs in self._buffers]

    def detach(self) -> None:
        """Stop reading from the current epoch's sources (after a discard of any pull in flight)."""
        if self._thread is not None:
            self.discard()
        self._tables = []
        if self.sources is not None:
            self.sources.close()
            self.sources = None
        self.group = None

    # ------------------------------------------------------------------ pulling
    @property
    def tensors(self) -> dict[str, torch.Tensor]:
        """The serving weights (in shadow mode a new dict after each ``swap``: re-read it)."""
        return dict(self._buffers[self._serving])

    def available_version(self) -> int:
        """The newest version every source of this rank has published."""
        versions = [c.published_version for c in self._attached("available_version").controls.values()]
        return min(versions) if versions else 0

    def _attached(self, what):
        if self.sources is None:
            raise RefitError(f"{what}: rank {self.rank} reads from no group epoch now (its last epoch "
                             f"ended; call rejoin())")
        return self.sources

    def _pull_into(self, slot: int, version: int, timeout: float, cancel=None, ready=None) -> None:
        t0 = time.perf_counter()
        sources, group = self._attached("pull"), self.group
        controls, remote = sources.controls, sources.remote
        table = self._tables[slot]

        def published():
            return {s: c.published_version for s, c in controls.items()}

        def doorbell():  # sleep on the first source that is behind
            for c in controls.values():
                if c.published_version < version:
                    return c.doorbell()
            return None

        group.wait(lambda: all(c.published_version >= version for c in controls.values()),
                   f"sources {list(controls)} to publish version {version}", timeout,
                   peers=list(remote), controls=list(remote.values()), doorbell=doorbell,
                   status=lambda: f"published: {published()}", cancel=cancel)
        ahead = {s: v for s, v in published().items() if v != version}
        if ahead:
            raise RefitError(f"rank {self.rank}: sources moved past version {version} before it was read "
                             f"({ahead}); a trainer published without fence()")
        t1 = time.perf_counter()
        if self.mode == "inplace":  # from here on a failure leaves the serving tensors torn
            self.consistent = False
        with _StagingMeter(self.device) as meter:
            sources.prepare(version)
            if self._stream is not None:
                if ready is not None:  # the caller's stream finished with this buffer set
                    self._stream.wait_event(ready)
                with torch.cuda.stream(self._stream):
                    table.run(self.backend)
                self._stream.synchronize()  # the ack follows the copy stream's completion
            else:
                table.run(self.backend)
        t2 = time.perf_counter()
        # The copy is only valid if no source changed or died while it ran (a dead trainer's
        # memory stays mapped, but the version it was publishing can no longer be vouched for).
        group.raise_if_dead(remote, f"during the pull of version {version}")
        moved = {s: v for s, v in published().items() if v != version}
        if moved:
            raise RefitError(f"rank {self.rank}: sources published {moved} during the pull of version "
                             f"{version}; the copy may be torn")
        for c in controls.values():
            c.ack(self.rank, version)
        t3 = time.perf_counter()
        self.last_pull = PullStats(version, (t1 - t0) * 1e3, (t2 - t1) * 1e3, (t3 - t0) * 1e3, meter.nbytes)
        self.staging_bytes = max(self.staging_bytes, meter.nbytes)
        self.pulls += 1

    def next_version(self, version=None) -> int:
        if version is not None:
            if isinstance(version, bool) or not isinstance(version, int):
                raise ValueError(f"version must be an int (or None: the newest), got version={version!r}")
            if version <= self.version:
                raise ValueError(f"version={version} must be newer than the serving version {self.version}")
            return version
        return max(self.available_version(), self.version + 1)

    def pull(self, version: int | None = None, timeout: float | None = None) -> int:
        """Wait for and install the next version (default: the newest available, at least one newer
        than the serving one). Returns the version now served. A failure fails this pull only:
        shadow mode keeps serving the previous version; in-place mode sets ``consistent = False``
        if the copy had started."""
        timeout = check_timeout("pull", timeout, self._attached("pull").group.timeout)
        if self._thread is not None:  # a background pull is in flight: this pull is that one
            return self.swap(timeout=None)
        target = self.next_version(version)
        # The caller waits anyway, so the copy runs on this thread (no thread start or join on
        # the refit's critical path); shadow mode still writes the spare set and then swaps.
        slot = 1 - self._serving if self.mode == "shadow" else 0
        self._pull_into(slot, target, timeout, ready=self._ready_event())
        if self.mode == "shadow":
            self._serving = slot
        self.consistent = True
        self.version = target
        return target

    def _ready_event(self):
        if self._stream is None:
            return None
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        return ev

    def start_pull(self, version: int | None = None, timeout: float | None = None) -> int:
        """Shadow mode: pull ``version`` (default: the next) into the spare buffer set in a
        background thread (on its own CUDA stream), while generation goes on with the serving
        weights. Returns the version. Work queued on the caller's current stream before this call
        (e.g. generation still reading the spare set) is finished before the copy writes it."""
        if self.mode != "shadow":
            raise ValueError(f"start_pull needs mode='shadow' (this endpoint has mode={self.mode!r}); "
                             f"in-place pulls are synchronous: use pull()")
        if self._thread is not None:
            return self._target
        timeout = check_timeout("start_pull", timeout, self._attached("start_pull").group.timeout)
        target = self.next_version(version)
        spare, ready, cancel = 1 - self._serving, self._ready_event(), threading.Event()
        self._target, self._result, self._cancel = target, None, cancel

        def run():
            try:
                if self.device.type == "cuda":
                    torch.cuda.set_device(self.device)  # launches and syncs go to our device
                self._pull_into(spare, target, timeout, cancel=cancel, ready=ready)
                self._result = (target, None)
            except BaseException as exc:  # handed to swap(), which re-raises it in the caller
                self._result = (target, exc)

        self._thread = threading.Thread(target=run, name=f"trs-pull-{self.rank}", daemon=True)
        self._thread.start()
        return target

    def pull_done(self) -> bool:
        """Shadow mode: True when the background pull finished (successfully or not)."""
        return self._thread is not None and not self._thread.is_alive()

    @property
    def pulling(self) -> bool:
        return self._thread is not None

    def pull_error(self) -> BaseException | None:
        """Once ``pull_done()``: the background pull's error, or None if it succeeded."""
        if not self.pull_done():
            raise ValueError("pull_error: no finished pull (call start_pull and wait for pull_done)")
        return self._result[1]

    def discard(self, timeout: float = 60.0) -> None:
        """Shadow mode: abandon the pull in flight (a wait stops within ~50 ms; a copy finishes
        first) or drop a finished one without installing it. Fails that pull only."""
        if self._thread is None:
            return
        self._cancel.set()
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"rank {self.rank}: discard timed out waiting for the pull of version "
                               f"{self._target}")
        self._thread = None
        self._result = None

    def swap(self, timeout: float | None = None) -> int:
        """Shadow mode: wait for the background pull (``timeout``: default, until it ends: its own
        waits are bounded) and install it with one reference assignment. Re-raises the pull's error,
        leaving the serving weights untouched."""
        if self._thread is None:
            raise ValueError("swap: no pull in flight (call start_pull first)")
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"rank {self.rank}: swap timed out after {timeout:g} s waiting for the pull "
                               f"of version {self._target} (it goes on; swap again or discard)")
        self._thread = None
        target, exc = self._result
        if exc is not None:
            raise exc
        self._serving = 1 - self._serving
        self.version = target
        return target

    # ------------------------------------------------------------------ stats and lifetime
    @property
    def bytes_per_refit(self) -> int:
        return self._tables[0].bytes_written if self._tables else 0

    @property
    def num_descriptors(self) -> int:
        return len(self._tables[0]) if self._tables else 0

    @property
    def num_copies(self) -> int:
        if not self._tables:
            return 0
        t = self._tables[0]
        return t.num_launches if self.backend == "triton" else t.num_torch_copies

    @property
    def handles_opened(self) -> int:
        return self.sources.handles_opened if self.sources is not None else 0

    def abort(self) -> None:
        """Tell every source's control block that this rank gave up on the epoch."""
        if self.sources is not None:
            for c in self.sources.remote.values():
                c.abort(self.rank)

    def close(self) -> None:
        if self._thread is not None:
            self._cancel.set()
            self._thread.join(60.0)
            self._thread = None
        self._tables = []
        if self.sources is not None:
            self.sources.close()
            self.sources = None
        self._buffers = []
