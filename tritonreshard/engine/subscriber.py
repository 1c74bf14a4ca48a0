"""The inference side of a refit group: destination buffers, and pulls into them.

Who calls what (an inference rank; :class:`tritonreshard.RefitInference` builds both)::

    bufs = ServingBuffers(rank, layouts, ...)      # once: the buffer sets and what they serve
    sub = Subscriber(group, route, bufs, sources)   # each epoch, with the rank's route
    sub.pull()                          # wait for the next version, copy, install
    sub.start_pull(); ...; sub.swap()   # shadow / spare mode: copy in a background thread meanwhile

The buffer sets (as many as the :class:`~tritonreshard.engine.modes.BufferMode` says: one in place
or in spare mode, two in shadow mode) and the serving version outlive epochs; a
:class:`Subscriber` belongs to one epoch. A rank keeps serving the last complete version while its
trainers restart, and then pulls from the new ones through a new subscriber over the same buffers.

Where the bytes come from is the route's reads over :class:`~tritonreshard.engine.sources.Sources`
(arenas and relay buffers on this host, mapped once): one descriptor table per buffer set, built
once, run every pull.

Each pull is measured (:class:`PullStats`): time waiting for the sources, the copy itself (device
sync included), the total up to the ack, and the extra memory it allocated (``staging_bytes``:
the peak allocator delta on CUDA; on CPU the bytes of every new tensor created by the pull thread,
counted by a thread-local ``TorchDispatchMode``).
"""
from __future__ import annotations

import math
import mmap
import os
import threading
import time
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..errors import RefitError
from ..kernels import CopyBackend, DescriptorTable, QuantizeTable
from ..planning import BufferRef, Route
from ..transport import pack_offsets
from .group import Group, check_timeout
from .modes import BufferMode
from .sources import Sources

__all__ = ["PullStats", "ServingBuffers", "Subscriber"]


@dataclass(frozen=True)
class PullStats:
    """One successful pull, measured. Milliseconds; ``staging_bytes`` as measured (see module doc)."""

    version: int
    wait_ms: float       # waiting for every source to publish the version
    copy_ms: float       # sources' prepare + descriptor-table copy + device sync
    total_ms: float      # from the start of the pull to the ack
    staging_bytes: int
    sink_ms: float = 0.0  # in a layer sink's open / close (the engine's own work, not in copy_ms)
    copy_cpu_ms: float = 0.0  # copy_ms's CPU time on this thread: its own cost, where generation shares the core

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


class ServingBuffers:
    """An inference rank's destination buffers and what they serve; they outlive group epochs.

    Args:
        rank: this rank. layouts: ``{name: Layout}`` of the destinations this rank holds.
        order: the names in the group's buffer order (same-geometry shards back to back).
        tensors: optional ``{name: tensor}`` to write (the engine's parameters): the serving set in
            in-place mode, the first of the two sets in shadow mode. device: of the buffers.
        mode: a :class:`~tritonreshard.engine.modes.BufferMode`: ``Shadow()`` (two sets: pull into the
            spare, then swap), ``InPlace()`` or ``Spare()`` (one set, pulled into in the background too).
        fills: the plan's zero fills of this rank (padding no copy writes): zeroed once here.
        layers: optional :class:`~tritonreshard.engine.modes.LayerSink`: its destinations get no
            buffer (each pull streams them into the sink's tensors, fills included).
    """

    def __init__(self, rank: int, layouts: dict, order, *, tensors=None, device, mode: BufferMode, fills=(),
                 layers=None):
        self.rank, self.mode, self.device, self.layouts, self.layers = rank, mode, device, dict(layouts), layers
        tensors = tensors or {}
        self.streamed = _streamed(layers, set(order), tensors)
        self.names = list(order)   # every destination of this rank, in the group's buffer order
        self.order = [n for n in order if n not in self.streamed]   # those in the buffer sets
        self.version = 0           # version being served
        self.consistent = True     # a mode that tears (in place, spare): False while a copy may be partial
        self.pulls, self.last_pull = 0, None   # pulls installed; the last one's PullStats
        self.staging_bytes = 0     # the largest staging_bytes measured over this rank's pulls
        # One flat allocation per buffer set, in the group's order (as in the trainers' arenas):
        # copies of equal shards then differ by a constant address step.
        self.sets: list[dict[str, torch.Tensor]] = []
        for i in range(mode.sets):
            own = [n for n in self.order if not (i == 0 and n in tensors)]
            sizes = [self.layouts[n].local_numel(rank) * self.layouts[n].itemsize for n in own]
            offsets, total = pack_offsets(sizes)
            flat = _zeroed(total, device)
            bufs = {n: tensors[n] for n in self.order if i == 0 and n in tensors}
            for n, off, size in zip(own, offsets, sizes, strict=True):
                lay = self.layouts[n]
                bufs[n] = flat[off:off + size].view(lay.dtype).view(lay.local_shape(rank))
            self.sets.append({n: bufs[n] for n in self.order})
        self.fills = tuple(fills)
        for bufs in self.sets:  # padding: no op ever writes it, so once is enough (streamed: each pull)
            for f in self.fills:
                if f.name not in self.streamed:
                    bufs[f.name][f.dst_slices].zero_()
        self.serving = 0

    @property
    def tensors(self) -> dict[str, torch.Tensor]:
        """The serving weights (in shadow mode a new dict after each swap: re-read it)."""
        return dict(self.sets[self.serving])

    @property
    def spare(self) -> int:
        """The set a pull writes: the other one in shadow mode, the one set in place or in spare mode."""
        return self.mode.spare(self.serving)

    def install(self, slot: int, version: int, stats: PullStats) -> None:
        """A pull into ``slot`` completed: serve it."""
        self.serving, self.version, self.consistent = slot, version, True
        self.last_pull = stats
        self.staging_bytes = max(self.staging_bytes, stats.staging_bytes)
        self.pulls += 1

    def release(self) -> None:
        self.sets = []


def _streamed(layers, order: set, tensors) -> dict[str, int]:
    """``{name: group}`` of a layer sink's destinations (empty without one); a ``ValueError``
    naming every name the sink streams that this rank does not hold, holds twice, or is given
    as a tensor too."""
    if layers is None:
        return {}
    out: dict[str, int] = {}
    problems = []
    for g, names in enumerate(layers.groups):
        for n in names:
            if n in out:
                problems.append(f"{n!r} is in groups {out[n]} and {g}")
            elif n not in order:
                problems.append(f"{n!r} (group {g}) is not a destination of this rank")
            elif n in tensors:
                problems.append(f"{n!r} (group {g}) is given as tensors= too")
            out[n] = g
    if problems:
        raise ValueError("PullOptions(layers=): " + "; ".join(problems))
    return out


def _streamed_bytes(group_ops, layouts: dict, quant: dict, rank: int) -> int:
    """Bytes the streamed groups write per pull, as their tables' ``bytes_written`` would count
    them (the tables are built at pull time): each plain op's elements, each block-FP8 weight's
    fp8 bytes and fp32 scales."""
    ops = [op for g in group_ops for op in g]
    plain = sum(math.prod(s.stop - s.start for s in op.dst_slices) * layouts[op.name].itemsize
                for op in ops if op.name not in quant)
    fp8 = {op.name for op in ops if op.name in quant}
    return plain + sum(layouts[n].local_numel(rank) + layouts[quant[n].scale].local_numel(rank) * 4 for n in fp8)


def _zeroed(nbytes: int, device) -> torch.Tensor:
    """``nbytes`` zero bytes on ``device``. On CPU a private anonymous mapping, which the kernel
    zeroes a page at a time when it is first written: ``torch.zeros`` writes, so faults in, every
    page inside the join (~0.6 s of CPU for the 1.7 GB set of a TP-2 Qwen3-1.7B rank,
    bench/join_cost.py), where the first pull faults them in anyway. The memoryview keeps the
    mapping alive as long as any view of it (see ``ShmArena``)."""
    if torch.device(device).type != "cpu" or nbytes == 0:
        return torch.zeros(nbytes, dtype=torch.uint8, device=device)
    mm = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(memoryview(mm), dtype=torch.uint8, count=nbytes)


def _label(b: BufferRef):
    """How a buffer is named in messages: its owner for a source arena, ``relay <rank>`` else."""
    return b.owner if b.kind == "arena" else f"relay {b.owner}"


class Subscriber:
    """The inference side of one rank for one epoch.

    Args:
        group: the epoch's group. route: this rank's route. buffers: the rank's
            :class:`ServingBuffers`. sources: the epoch's :class:`~tritonreshard.engine.sources.Sources`
            (mapped; the subscriber closes them). backend: the
            :class:`~tritonreshard.kernels.CopyBackend` that runs its tables (resolved for its device).
    """

    def __init__(self, group: Group, route: Route, buffers: ServingBuffers, sources: Sources, *,
                 backend: CopyBackend, quant=None):
        self.group, self.route, self.buffers, self.sources = group, route, buffers, sources
        self.rank, self.backend, self.device = group.rank, backend, buffers.device
        if set(route.fills) != set(buffers.fills):  # the same layouts and parts join every epoch
            raise RefitError(f"rank {self.rank}: epoch {group.epoch}'s plan zero-fills {len(route.fills)} "
                             f"region(s) of this rank's buffers, the buffers were set up with "
                             f"{len(buffers.fills)}: a rank keeps its destination layouts and parts")
        for b, c in sources.remote.items():
            group.liveness.beat_into(c)
            group.liveness.watch(b.owner, c)
        # What every pull reads and checks, derived once: the sources' control blocks by label, the
        # ones another process owns (they can die or abort), and their owners.
        self._controls = {_label(b): c for b, c in sources.controls.items()}
        self._remote = list(sources.remote.values())
        self._owners = sorted({b.owner for b in sources.remote})
        self._thread = None
        self._target = None
        self._result = None
        self._cancel = threading.Event()
        #: An elastic group's reader: the first version its sources admitted it to read (:meth:`join`).
        self.first_version = 0
        self._joined = False
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        pos = {n: i for i, n in enumerate(buffers.names)}
        # Table order: by buffer, then where the source view lies in it, then the destination.
        reads = sorted(route.reads, key=lambda r: (*r.order_key, pos[r.op.name],
                                                   tuple(s.start for s in r.op.dst_slices)))
        views = {}

        def src_view(read):
            key = read.order_key
            if key not in views:
                views[key] = sources.view(read)
            return views[key]

        by_op = {r.op: r for r in reads}
        quant = quant or {}
        self._quant, self._src = quant, lambda op: src_view(by_op[op])
        streamed = buffers.streamed
        held = [r for r in reads if r.op.name not in streamed]
        # Block-FP8 weights (quant) go to a quantize table: each block read whole, quantized in registers.
        self._tables = [self.backend.prepare(DescriptorTable.build([r.op for r in held if r.op.name not in quant],
                                                                   src=self._src, dst=lambda op, b=bufs: b[op.name]))
                        for bufs in buffers.sets]
        qops = [r.op for r in held if r.op.name in quant]
        self._qtables = [QuantizeTable.build(qops, quant, src=self._src, dst=lambda op, b=bufs: b[op.name],
                                             scale=lambda r, n, b=bufs: b[n])
                         if qops else None for bufs in buffers.sets]
        # A layer sink's groups: their ops, in table order, and their fills; their tables are built
        # at each pull, over the tensors the sink hands over then.
        groups = len(buffers.layers.groups) if buffers.layers is not None else 0
        self._group_ops: list[list] = [[] for _ in range(groups)]
        self._group_fills: list[list] = [[] for _ in range(groups)]
        for r in reads:  # one pass each: a model has thousands of layers and many more ops
            if r.op.name in streamed:
                self._group_ops[streamed[r.op.name]].append(r.op)
        for f in route.fills:
            if f.name in streamed:
                self._group_fills[streamed[f.name]].append(f)
        self._streamed_bytes = _streamed_bytes(self._group_ops, buffers.layouts, quant, self.rank)

    # ------------------------------------------------------------------ joining (elastic groups)
    def join(self, timeout: float) -> int:
        """An elastic group's reader: ask every source to admit this rank (its join word), wait for
        the admissions, and return the first version it reads: the newest any source admitted it
        at. A source that admitted it at an older version gets an ack of the one before, so that
        source's fence does not wait for a version this rank never reads."""
        remote, rank = self._remote, self.rank
        for c in remote:
            c.request_join(rank, os.getpid())
        self._joined = True

        def doorbell():
            for c in remote:
                if c.admitted_version(rank) == 0:
                    return c.doorbell()
            return None

        self.group.wait(lambda: all(c.admitted_version(rank) > 0 for c in remote),
                        f"sources {self._owners} to admit rank {rank}", timeout, peers=self._owners,
                        controls=remote, doorbell=doorbell,
                        status=lambda: f"admitted at: {[c.admitted_version(rank) for c in remote]}")
        first = max((c.admitted_version(rank) for c in remote), default=1)
        for c in remote:
            if c.admitted_version(rank) < first:
                c.ack(rank, first - 1)
        self.first_version = first
        return first

    def _leave(self) -> None:
        if self._joined:
            self._joined = False
            for c in self._remote:
                c.leave(self.rank)

    # ------------------------------------------------------------------ pulling
    def available_version(self) -> int:
        """The newest version every source of this rank has published."""
        versions = [c.published_version for c in self._controls.values()]
        return min(versions) if versions else 0

    def _pull_into(self, slot: int, version: int, timeout: float, cancel=None, ready=None,
                   newest: bool = False) -> PullStats:
        """Copy ``version`` into buffer set ``slot``. ``newest``: a pull of "the newest" (no version
        asked for) takes the sources' common version when they are all past ``version`` by the time
        it may read: the first version of an epoch whose trainers went on from where they were (a
        new epoch after a partition: their first version may be past the one after this rank's)."""
        t0 = time.perf_counter()
        sources, group, controls, owners = self.sources, self.group, self._controls, self._owners
        table, qtable = self._tables[slot], self._qtables[slot]

        def published():
            return {s: c.published_version for s, c in controls.items()}

        def doorbell():  # sleep on the first source that is behind
            for c in controls.values():
                if c.published_version < version:
                    return c.doorbell()
            return None

        group.wait(lambda: all(c.published_version >= version for c in controls.values()),
                   f"sources {list(controls)} to publish version {version}", timeout,
                   peers=owners, controls=self._remote, doorbell=doorbell,
                   status=lambda: f"published: {published()}", cancel=cancel)
        common = set(published().values())
        if newest and len(common) == 1 and min(common) > version:
            version = min(common)
        ahead = {s: v for s, v in published().items() if v != version}
        if ahead:
            raise RefitError(f"rank {self.rank}: sources moved past version {version} before it was read "
                             f"({ahead}); a trainer published without fence()")
        t1, c1 = time.perf_counter(), time.thread_time()
        if self.buffers.mode.tears:  # from here on a failure leaves the serving tensors torn
            self.buffers.consistent = False
        with _StagingMeter(self.device) as meter:
            sources.prepare(version)
            if self._stream is not None:
                if ready is not None:  # the caller's stream finished with this buffer set
                    self._stream.wait_event(ready)
                with torch.cuda.stream(self._stream):
                    self.backend.run(table)
                    if qtable is not None:
                        self.backend.run(qtable)
                self._stream.synchronize()  # the ack follows the copy stream's completion
            else:
                self.backend.run(table)
                if qtable is not None:
                    self.backend.run(qtable)
        sink_s, sink_cpu_s, streamed_staging = self._stream_groups()
        t2, c2 = time.perf_counter(), time.thread_time()
        # The copy is only valid if no source changed or died while it ran (a dead trainer's
        # memory stays mapped, but the version it was publishing can no longer be vouched for).
        group.raise_if_dead(owners, f"during the pull of version {version}")
        moved = {s: v for s, v in published().items() if v != version}
        if moved:
            raise RefitError(f"rank {self.rank}: sources published {moved} during the pull of version "
                             f"{version}; the copy may be torn")
        for c in controls.values():
            c.ack(self.rank, version)
        t3 = time.perf_counter()
        return PullStats(version, (t1 - t0) * 1e3, (t2 - t1 - sink_s) * 1e3, (t3 - t0) * 1e3,
                         max(meter.nbytes, streamed_staging), sink_s * 1e3, (c2 - c1 - sink_cpu_s) * 1e3)

    def _stream_groups(self) -> tuple[float, float, int]:
        """A layer sink's groups, one after the other: its tensors, written, given back. Returns the
        wall and CPU seconds spent in the sink (its own work) and the most staging one group's copy
        allocated (the sink's calls run outside the meter: what they allocate is the engine's)."""
        sink, in_sink, in_sink_cpu, staging = self.buffers.layers, 0.0, 0.0, 0
        for g, (ops, fills) in enumerate(zip(self._group_ops, self._group_fills, strict=True)):
            t0, c0 = time.perf_counter(), time.thread_time()
            dst = sink.open(g)
            in_sink, in_sink_cpu = in_sink + time.perf_counter() - t0, in_sink_cpu + time.thread_time() - c0
            staging = max(staging, self._write_group(ops, fills, dst))
            del dst  # given back: a sink may reuse the memory of tensors nobody holds (vLLM's on CPU)
            t0, c0 = time.perf_counter(), time.thread_time()
            sink.close(g)
            in_sink, in_sink_cpu = in_sink + time.perf_counter() - t0, in_sink_cpu + time.thread_time() - c0
        return in_sink, in_sink_cpu, staging

    def _write_group(self, ops, fills, dst: dict) -> int:
        """One group's ops and fills into the sink's tensors ``dst``, the copy waited for (on the caller's
        stream, where they were made); returns the staging allocated. Its tables end with the call."""
        # Built outside the meter: every view a table takes would pass through it.
        plain, qops = [op for op in ops if op.name not in self._quant], [op for op in ops if op.name in self._quant]
        tables = [self.backend.prepare(DescriptorTable.build(plain, src=self._src, dst=lambda op: dst[op.name]))] + (
            [QuantizeTable.build(qops, self._quant, src=self._src, dst=lambda op: dst[op.name],
                                 scale=lambda r, n: dst[n])] if qops else [])
        with _StagingMeter(self.device) as meter:
            for table in tables:
                self.backend.run(table)
            for f in fills:
                dst[f.name][f.dst_slices].zero_()
            if self.device.type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()
        return meter.nbytes

    def next_version(self, version=None) -> int:
        if version is not None:
            if isinstance(version, bool) or not isinstance(version, int):
                raise ValueError(f"version must be an int (or None: the newest), got version={version!r}")
            if version <= self.buffers.version:
                raise ValueError(f"version={version} must be newer than the serving version {self.buffers.version}")
            if version < self.first_version:
                raise ValueError(f"version={version} is older than version {self.first_version}, the first this "
                                 f"rank was admitted to read")
            return version
        return max(self.available_version(), self.buffers.version + 1, self.first_version)

    def pull(self, version: int | None = None, timeout: float | None = None) -> int:
        """Wait for and install the next version (default: the newest available, at least one newer
        than the serving one). Returns the version now served. A failure fails this pull only:
        shadow mode keeps serving the previous version; in-place and spare mode set
        ``consistent = False`` if the copy had started."""
        timeout = check_timeout("pull", timeout, self.group.timeout)
        if self._thread is not None:  # a background pull is in flight: this pull is that one
            return self.swap(timeout=None)
        target = self.next_version(version)
        # The caller waits anyway, so the copy runs on this thread (no thread start or join on
        # the refit's critical path); shadow mode still writes the spare set and then swaps.
        slot = self.buffers.spare
        stats = self._pull_into(slot, target, timeout, ready=self._ready_event(), newest=version is None)
        self.buffers.install(slot, stats.version, stats)
        return stats.version

    def _ready_event(self):
        if self._stream is None:
            return None
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        return ev

    def start_pull(self, version: int | None = None, timeout: float | None = None) -> int:
        """Shadow or spare mode: pull ``version`` (default: the next) into the spare buffer set in a
        background thread (on its own CUDA stream), while generation goes on with the serving
        weights (spare mode: with the caller's own; its one set is not read until ``swap``).
        Returns the version. Work queued on the caller's current stream before this call (e.g.
        generation, or a copy out of the set, still reading it) is finished before the copy writes it."""
        if not self.buffers.mode.background:
            raise ValueError(f"start_pull needs a mode with background pulls, trs.Shadow() or trs.Spare() (this "
                             f"endpoint has mode='{self.buffers.mode}'); in-place pulls are synchronous: use pull()")
        if self._thread is not None:
            return self._target
        timeout = check_timeout("start_pull", timeout, self.group.timeout)
        target = self.next_version(version)
        spare, ready, cancel = self.buffers.spare, self._ready_event(), threading.Event()
        self._target, self._result, self._cancel = target, None, cancel

        def run():
            try:
                if self.device.type == "cuda":
                    torch.cuda.set_device(self.device)  # launches and syncs go to our device
                self._result = (spare, target, self._pull_into(spare, target, timeout, cancel=cancel, ready=ready),
                                None)
            except BaseException as exc:  # handed to swap(), which re-raises it in the caller
                self._result = (spare, target, None, exc)

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
        return self._result[3]

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
        slot, target, stats, exc = self._result
        if exc is not None:
            raise exc
        self.buffers.install(slot, target, stats)
        return target

    # ------------------------------------------------------------------ stats and lifetime
    @property
    def bytes_per_refit(self) -> int:
        if not self._tables:
            return 0
        q = self._qtables[0]
        return self._tables[0].bytes_written + (q.bytes_written if q is not None else 0) + self._streamed_bytes

    @property
    def num_descriptors(self) -> int:
        return len(self._tables[0]) if self._tables else 0

    @property
    def num_copies(self) -> int:
        """Work items per pull: kernel launches (triton backend) or coalesced ``copy_`` calls (torch)."""
        return self.backend.work_items(self._tables[0]) if self._tables else 0

    def abort(self) -> None:
        """Tell every source's control block that this rank gave up on the epoch (an elastic
        group's reader leaves instead: the group goes on without it)."""
        if self._joined:
            return  # close() leaves once the pull in flight stopped reading
        if self.sources is not None:
            for c in self.sources.remote.values():
                c.abort(self.rank)

    def close(self) -> None:
        """Abandon any pull in flight and unmap the sources (the buffers stay). Idempotent."""
        if self._thread is not None:
            self._cancel.set()
            self._thread.join(60.0)
            self._thread = None
        self._leave()  # after the last copy: the sources stop fencing this rank
        self._tables = []
        self._qtables = []
        if self.sources is not None:
            self.sources.close()
            self.sources = None
