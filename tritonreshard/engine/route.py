"""A rank's route: what it reads, sends, receives, fences and exports in one group epoch.

Every rank derives its :class:`Route` from the group's plan, the host map and the source arenas'
offsets (:func:`build_route`), through the host planner (:func:`~tritonreshard.planning.plan_hosts`):
a group on one host is a route with no transfers, so there is one code path for one host and many.

* **reads**: every copy this rank runs, each from one :class:`BufferRef` on its host: a source
  rank's arena (the op as planned, or re-sourced to a replica on this host), or a relay's receive
  buffer (the fan-out of a box that crossed into this host once);
* **fills**: zero padding of this rank's destination buffers (written once at set-up);
* **fenced**: the ranks on this host that read this rank's arena (its ``fence`` waits for their acks;
  readers on other hosts are stood for by the sends to their relays);
* **sends** / **receives**: boxes of this rank's arena it sends to other hosts, and boxes it receives
  into its receive buffer (``buffer_bytes``), read by ``buffer_readers``.

Where the bytes of a read come from is one protocol, :class:`CopySource` (an arena or a relay buffer
on this host, read in place); :class:`Sources` holds the ones a subscriber reads in one epoch.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Protocol

import torch

from ..planning import (CrossTransfer, FillOp, HostPlan, Message, TransferOp, join_host_parts, plan_hosts,
                        plan_messages)
from ..transport import ArenaHandle, ControlBlock, open_arena, open_control_block
from .group import Group
from .rendezvous import register_plain

__all__ = ["BufferRef", "CopySource", "Exported", "OwnBuffer", "Read", "Route", "Sources", "build_route"]


@dataclass(frozen=True, order=True)
class BufferRef:
    """One buffer copies read from, exported by its owner to the ranks of its host: a source rank's
    ``"arena"`` (its local shards) or a receiving rank's ``"relay"`` buffer (boxes that crossed
    into the host)."""

    kind: str
    owner: int

    def __str__(self) -> str:
        return f"{self.kind} of rank {self.owner}"


@dataclass(frozen=True)
class Read:
    """One copy of a destination rank. ``op`` is the planned op (its ``dst_slices`` index this rank's
    destination shard ``op.name``); its ``src_slices`` index the source view: a tensor of ``shape``
    and ``dtype`` at byte ``offset`` of ``buffer``."""

    op: TransferOp
    buffer: BufferRef
    offset: int
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def order_key(self) -> tuple:
        """Table order: arenas before relay buffers, then by owner and where the view lies."""
        return (self.buffer.kind != "arena", self.buffer.owner, self.offset)


@dataclass(frozen=True)
class Exported:
    """A buffer a rank hands the group at set-up: its arena and control block handles, and for a
    source arena the byte offset of each shard (``{source name: offset}``)."""

    buffer: BufferRef
    arena: ArenaHandle
    control: ArenaHandle
    offsets: dict = field(default_factory=dict)


register_plain(BufferRef, Exported, CrossTransfer)  # they travel through the store in the set-up exchanges


@dataclass(frozen=True)
class Route:
    """What rank ``rank`` does in one epoch (see the module docstring). ``spans_hosts``: the group's
    plan reads across hosts (every rank then joins the point-to-point group, even one without
    transfers). ``host_plan``: the plan split by host, for tables and figures."""

    rank: int
    host: str
    spans_hosts: bool
    reads: tuple[Read, ...]
    fills: tuple[FillOp, ...]
    fenced: tuple[int, ...]
    sends: tuple[CrossTransfer, ...]
    receives: tuple[CrossTransfer, ...]
    buffer_bytes: int
    buffer_readers: tuple[int, ...]
    messages: tuple[Message, ...] = field(repr=False)
    host_plan: HostPlan = field(repr=False, compare=False)

    @cached_property
    def buffers(self) -> tuple[BufferRef, ...]:
        """The buffers this rank's reads come from, in table order."""
        return tuple(sorted({r.buffer for r in self.reads}, key=lambda b: (b.kind != "arena", b.owner)))

    @cached_property
    def receivers(self) -> tuple[int, ...]:
        """Ranks on other hosts this rank sends to."""
        return tuple(sorted({t.receiver for t in self.sends}))

    @cached_property
    def senders(self) -> tuple[int, ...]:
        """Ranks on other hosts this rank receives from."""
        return tuple(sorted({t.src_rank for t in self.receives}))

    @property
    def transfers(self) -> tuple[CrossTransfer, ...]:
        """Every transfer of the group (indexed by ``CrossTransfer.index``)."""
        return self.host_plan.transfers

    def __str__(self) -> str:
        parts = [f"rank {self.rank}@{self.host}: {len(self.reads)} read(s) from "
                 f"{', '.join(map(str, self.buffers)) or 'nothing'}"]
        if self.fenced:
            parts.append(f"fences readers {list(self.fenced)}")
        if self.sends:
            parts.append(f"sends {len(self.sends)} box(es) to {list(self.receivers)}")
        if self.receives:
            parts.append(f"relays {len(self.receives)} box(es) from {list(self.senders)} "
                         f"({self.buffer_bytes} B) to {list(self.buffer_readers)}")
        return "; ".join(parts)


def build_route(plan, hosts: Mapping[int, str], rank: int, src_offsets: Mapping[tuple[int, str], int], *,
                exchange: Callable[[object], Mapping[int, object]] | None = None) -> Route:
    """Rank ``rank``'s route from the group's ``plan``, ``hosts`` (``{rank: host identity}``) and
    ``src_offsets`` (``{(source rank, source name): byte offset in its arena}``). Deterministic:
    every rank derives the routes of all ranks alike.

    ``exchange``: None when ``plan`` holds every op this rank's host plan depends on (one host, or
    the whole plan). Else (a group on several hosts where each rank planned only its host,
    :func:`~tritonreshard.engine.group.validate_members`) a collective ``{rank: obj}`` gather
    (``Group.exchange``) that every rank calls once: each host's lowest rank makes the host's part
    (``plan_hosts(..., host=)``) and hands in its transfers, so that a sender learns what it sends
    from the hosts that receive it, without planning their ops."""
    if exchange is None:
        hp = plan_hosts(plan, hosts, src_offsets=src_offsets)
    else:
        h = hosts[rank]
        part = plan_hosts(plan, hosts, host=h, src_offsets=src_offsets)
        leader = min(r for r, x in hosts.items() if x == h) == rank
        got = exchange((h, part.transfers) if leader else None)
        hp = join_host_parts(part, h, dict(v for v in got.values() if v is not None))
    src = plan.src_layouts
    reads = [Read(op, BufferRef("arena", op.src_rank), src_offsets[(op.src_rank, op.src_name)],
                  src[op.src_name].local_shape(op.src_rank), src[op.src_name].dtype)
             for op in hp.local_ops_for_dst(rank)]
    for f in hp.fanout_for_dst(rank):
        t = hp.transfer(f.transfer)
        reads.append(Read(f.op, BufferRef("relay", t.receiver), t.offset, t.shape, t.dtype))
    return Route(rank=rank, host=hosts[rank], spans_hosts=bool(hp.transfers),
                 reads=tuple(reads), fills=plan.fills_for_dst(rank), fenced=hp.local_readers_of(rank),
                 sends=hp.sends_of(rank), receives=hp.recvs_of(rank),
                 buffer_bytes=hp.buffer_bytes.get(rank, 0), buffer_readers=hp.buffer_readers(rank),
                 messages=plan_messages(hp, src_offsets) if hp.transfers else (), host_plan=hp)


class CopySource(Protocol):
    """Where the bytes of a copy come from: one buffer on this host, read in place.

    Members:
        buffer: which buffer (a source arena or a relay buffer).
        control: its owner's control block: the published version a pull waits for, the ack word
            this rank writes after its copy, the abort word, and the doorbell every change rings.
        tensor(offset, shape, dtype): a view of the buffer at byte ``offset`` (no copy).
        close(): release this rank's mapping (a no-op for a buffer this rank owns).
    """

    buffer: BufferRef
    control: ControlBlock

    def tensor(self, offset: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor: ...

    def close(self) -> None: ...


class MappedBuffer:
    """A :class:`CopySource` of another process on this host: its arena and control block mapped."""

    def __init__(self, exported: Exported, *, secret, device, timeout: float):
        self.buffer = exported.buffer
        self._arena = open_arena(exported.arena, secret=secret, device=device, timeout=timeout)
        try:
            self.control = open_control_block(exported.control, secret=secret, timeout=timeout)
        except BaseException:
            self._arena.close()
            raise

    def tensor(self, offset, shape, dtype):
        return self._arena.tensor(offset, shape, dtype)

    def close(self) -> None:
        self.control.close()
        self._arena.close()


class OwnBuffer:
    """A :class:`CopySource` this process owns (a colocated rank's own arena or relay buffer):
    read in place; its owner releases it."""

    def __init__(self, buffer: BufferRef, arena, control: ControlBlock):
        self.buffer, self._arena, self.control = buffer, arena, control

    def tensor(self, offset, shape, dtype):
        return self._arena.tensor(offset, shape, dtype)

    def close(self) -> None:
        pass


class Sources:
    """The :class:`CopySource` s one subscriber reads in one epoch, opened once.

    Args:
        group: the epoch's group. route: this rank's route. exported: ``{BufferRef: Exported}`` of
        the group. own: ``{BufferRef: CopySource}`` of the buffers this process owns. device: the
        device that reads the memory.

    The seam for where bytes come from: a subclass may override :meth:`view` and :meth:`prepare`
    (tests hold a copy mid-way, or stage on purpose to show the meter counts it), and is passed to
    the endpoint as ``sources=``.
    """

    def __init__(self, group: Group, route: Route, exported: Mapping[BufferRef, Exported], *,
                 own: Mapping[BufferRef, CopySource], device):
        self.group = group
        self.buffers: dict[BufferRef, CopySource] = {}
        try:
            for b in route.buffers:
                self.buffers[b] = own[b] if b in own else MappedBuffer(
                    exported[b], secret=group.secret, device=device, timeout=group.timeout)
        except BaseException:
            self.close()
            raise

    @property
    def controls(self) -> dict[BufferRef, ControlBlock]:
        return {b: s.control for b, s in self.buffers.items()}

    @property
    def remote(self) -> dict[BufferRef, ControlBlock]:
        """Control blocks of the buffers other processes own (the ones whose owner can die)."""
        return {b: s.control for b, s in self.buffers.items() if isinstance(s, MappedBuffer)}

    @property
    def handles_opened(self) -> int:
        return sum(isinstance(s, MappedBuffer) for s in self.buffers.values())

    def view(self, read: Read) -> torch.Tensor:
        """The source tensor ``read.op.src_slices`` index (a view into its buffer, no copy)."""
        return self.buffers[read.buffer].tensor(read.offset, read.shape, read.dtype)

    def prepare(self, version: int) -> None:
        """Before the copy of ``version``: make the bytes of ``view()`` current. Buffers on this host
        are read in place and were published before the pull saw the version: nothing to do."""

    def close(self) -> None:
        for s in self.buffers.values():
            s.close()
        self.buffers = {}
