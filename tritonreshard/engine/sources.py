"""Where the bytes of a rank's reads come from: buffers on its host, mapped once per epoch.

A rank's :class:`~tritonreshard.planning.Route` says which buffer each read comes from (a source
arena or a relay's receive buffer, :class:`~tritonreshard.planning.BufferRef`); here those buffers
are one protocol, :class:`CopySource` (read in place), and :class:`Sources` holds the ones a
subscriber reads in one epoch. :class:`Exported` is what a rank hands the group for a buffer it owns.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

import torch

from ..planning import BufferRef, CrossTransfer, HostTransfers, Read, Route
from ..transport import ArenaHandle, ControlBlock, open_arena, open_control_block
from .group import Group
from .rendezvous import register_plain

__all__ = ["CopySource", "Exported", "MappedBuffer", "OwnBuffer", "Sources"]


@dataclass(frozen=True)
class Exported:
    """A buffer a rank hands the group at set-up: its arena and control block handles, and for a
    source arena the byte offset of each shard (``{source name: offset}``)."""

    buffer: BufferRef
    arena: ArenaHandle
    control: ArenaHandle
    offsets: dict = field(default_factory=dict)


register_plain(BufferRef, Exported, CrossTransfer, HostTransfers)  # they travel through the store at set-up


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
