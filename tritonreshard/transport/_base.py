"""The transport protocol: an arena (one exported buffer per rank), its handle, views, waiting.

Lifetime rule shared by every transport (CPU shared memory and CUDA):

* ``close()`` is idempotent, never raises because views are still alive, and runs safely from an
  ``except``/``finally`` block. It stops handing the arena out (fd server, name), drops the arena's
  own references, and releases the mapping *as soon as no tensor view refers to it any more*.
  Views created by :meth:`Arena.tensor` keep the mapping alive, so a view that outlives ``close()``
  (for example one held by a traceback) never dangles; the unmap happens when the last view is
  garbage collected. Code that must see the memory gone at a known point drops its views first.
* After ``close()`` the arena hands out no new views (``RuntimeError``).
"""
from __future__ import annotations

import math
import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..planning import RECV_ALIGN

__all__ = [
    "ALIGN",
    "SHM_PREFIX",
    "ArenaHandle",
    "Arena",
    "align_up",
    "pack_offsets",
]

#: Alignment of every tensor inside an arena, in bytes: the planner's :data:`~tritonreshard.planning.RECV_ALIGN`
#: (its one home; planning lays out receive buffers with it, so arena and buffer offsets agree).
ALIGN = RECV_ALIGN

#: Prefix of every name this package creates (/dev/shm entries, memfds, abstract sockets), so a
#: survivor or an operator can recognise them.
SHM_PREFIX = "trs-"

KINDS = ("shm-name", "shm-fd", "cuda-vmm", "cuda-ipc")


def align_up(n: int, align: int = ALIGN) -> int:
    """Smallest multiple of ``align`` that is >= ``n``."""
    if n < 0:
        raise ValueError(f"align_up: n must be >= 0, got n={n}")
    if align <= 0:
        raise ValueError(f"align_up: align must be > 0, got align={align}")
    return (n + align - 1) // align * align


def pack_offsets(nbytes: Sequence[int], align: int = ALIGN) -> tuple[list[int], int]:
    """Lay out buffers of the given sizes back to back, each starting on an ``align`` boundary.

    Returns ``(offsets, total_nbytes)``; ``total_nbytes`` is what to pass to ``create_arena``.
    """
    offsets, pos = [], 0
    bad = [(i, n) for i, n in enumerate(nbytes) if n < 0]
    if bad:
        raise ValueError(f"pack_offsets: negative sizes at (index, nbytes) {bad}")
    for n in nbytes:
        pos = align_up(pos, align)
        offsets.append(pos)
        pos += n
    return offsets, align_up(pos, align)


@dataclass(frozen=True, repr=False)
class ArenaHandle:
    """Small picklable description of an exported arena. Holds no secret.

    ``arena_id`` is an unguessable random token (128 bits): it names the shm segment (``shm-name``)
    or the owner's abstract socket (other kinds). Anyone needs more than this handle to map the
    arena: same uid and mode 0600 for ``shm-name``, the group secret for the fd-passing kinds.
    ``repr`` shows only a prefix of the id so handles can be logged.
    """

    kind: str
    arena_id: str
    nbytes: int
    alloc_nbytes: int
    device: str
    owner_pid: int
    hostname: str

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"ArenaHandle: kind must be one of {KINDS}, got kind={self.kind!r}")

    @property
    def segment_name(self) -> str:
        """Name of the /dev/shm entry (kind ``shm-name``); also used to label memfds."""
        return SHM_PREFIX + self.arena_id

    @property
    def socket_address(self) -> str:
        """Abstract-namespace Unix socket of the owner's fd server (fd-passing kinds)."""
        return "\0" + SHM_PREFIX + "sock-" + self.arena_id

    @property
    def short_id(self) -> str:
        return self.arena_id[:6] + "…"

    def __repr__(self) -> str:
        return (f"ArenaHandle(kind={self.kind!r}, id={self.short_id}, nbytes={self.nbytes}, "
                f"device={self.device!r}, owner_pid={self.owner_pid}, host={self.hostname!r})")

    __str__ = __repr__


def new_handle(kind, arena_id, nbytes, alloc_nbytes, device) -> ArenaHandle:
    return ArenaHandle(kind=kind, arena_id=arena_id, nbytes=int(nbytes),
                       alloc_nbytes=int(alloc_nbytes), device=str(device),
                       owner_pid=os.getpid(), hostname=socket.gethostname())


class Arena:
    """One contiguous exported buffer: the owner's (``is_owner``) or a peer's mapping of it.

    Subclasses set ``_base`` (a 1-D uint8 tensor over the whole arena) and implement ``_close``.
    """

    _base: torch.Tensor | None
    _handle: ArenaHandle
    is_owner: bool

    @property
    def nbytes(self) -> int:
        return self._handle.nbytes

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def handle(self) -> ArenaHandle:
        return self._handle

    @property
    def closed(self) -> bool:
        return self._base is None

    def export(self) -> ArenaHandle:
        """The picklable handle peers pass to ``open_arena`` (owner only)."""
        if not self.is_owner:
            raise RuntimeError(f"export: only the owner exports an arena; {self!r} is a peer mapping")
        return self._handle

    def tensor(self, offset: int, shape: Sequence[int] | int, dtype: torch.dtype) -> torch.Tensor:
        """A view (no copy) of ``prod(shape)`` elements of ``dtype`` starting ``offset`` bytes in.

        ``offset`` must be a multiple of the dtype's size (use :func:`pack_offsets` /
        :data:`ALIGN` for 256-byte alignment). The view keeps the mapping alive (module docstring).
        """
        if self._base is None:
            raise RuntimeError(f"tensor: {self!r} is closed")
        shape = (int(shape),) if isinstance(shape, int) else tuple(int(s) for s in shape)
        itemsize = torch.empty((), dtype=dtype).element_size()
        problems = []
        if offset < 0:
            problems.append(f"offset must be >= 0, got offset={offset}")
        elif offset % itemsize:
            problems.append(f"offset={offset} is not a multiple of the {dtype} size {itemsize}")
        if any(s < 0 for s in shape):
            problems.append(f"shape must be non-negative, got shape={shape}")
        n = math.prod(shape) * itemsize
        if offset >= 0 and offset + n > self.nbytes:
            problems.append(f"offset={offset} + nbytes={n} exceeds the arena nbytes={self.nbytes}")
        if problems:
            raise ValueError("tensor: " + "; ".join(problems))
        return self._base[offset:offset + n].view(dtype).view(shape)

    def unlink(self) -> None:
        """Owner: stop handing the arena out (remove the shm name / stop the fd server).

        Call once every peer acknowledged mapping; existing mappings stay valid. Idempotent.
        """
        if self.is_owner:
            self._unlink()

    def close(self) -> None:
        """Idempotent; see the module docstring for what happens to live views."""
        if self._base is None:
            return
        self._base = None
        self._close()

    def _unlink(self) -> None:  # pragma: no cover - overridden
        pass

    def _close(self) -> None:  # pragma: no cover - overridden
        raise NotImplementedError

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def __del__(self):
        # Best effort for arenas nobody closed; close() itself is the documented path.
        if getattr(self, "_base", None) is not None:
            self.close()

    def __repr__(self) -> str:
        role = "owner" if getattr(self, "is_owner", False) else "peer"
        state = "closed" if getattr(self, "_base", None) is None else "open"
        h = getattr(self, "_handle", None)
        return (f"{type(self).__name__}({role}, {state}, kind={h.kind if h else '?'}, "
                f"id={h.short_id if h else '?'}, nbytes={h.nbytes if h else '?'})")
