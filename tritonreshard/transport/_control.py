"""Control block: a few int64 slots in host shared memory for versions, acks, heartbeats, abort,
and a doorbell word that every state change rings (see ``tritonreshard.transport.wait``).

One writer per slot: the owner (a trainer rank) writes ``published_version`` and the state word;
reader ``i`` writes ``acked_version[i]``; rank ``r`` writes ``heartbeat[r]``. Everyone may read
everything, and anyone may set the state word to ABORT (the last abort reason wins).

A block made with ``joins=True`` (an elastic group's trainer, see
:mod:`tritonreshard.engine.elastic`) also has, per reader, a **join word** (the reader writes its pid
to ask in, 0 when it leaves) and an **admission word** (the owner writes the first version the
reader may read, 0 when it is not, or no longer, admitted). The owner writes the reader's ack word
once, at admission (version - 1), before the admission word; from then on only the reader does.

Memory-ordering assumption: slots are 8-byte aligned (each on its own 64-byte line, so pollers
don't false-share) and read/written as single int64 loads/stores through a numpy view, which are
single-copy atomic on x86-64 and arm64 (no torn values). Writers write the data first and the
version counter last; readers read the counter first, then the data. x86-64 (TSO) keeps that
order for CPU data. For device data the writer must finish the copy (stream synchronize / event)
before ``publish``, which orders it. On arm64 with CPU-resident data the store order is not
architecturally guaranteed by plain stores; publish() adds a lock release/acquire pair, which
CPython implements with a pthread mutex (a release+acquire barrier), to order them in practice.
"""
from __future__ import annotations

import threading
import time

import torch

from . import wait as _wait
from ._base import ArenaHandle
from ._shm import ShmArena

__all__ = ["ControlBlock", "create_control_block", "open_control_block",
           "STATE_OK", "STATE_CLOSED", "STATE_ABORT"]

MAGIC = 0x7472735F63746C31  # "trs_ctl1"
LINE = 8  # int64 slots per 64-byte line
_MAGIC, _NREADERS, _NRANKS, _STATE, _PUBLISHED, _PUBLISHED_NS, _ABORT_RANK, _DOORBELL = range(8)
_JOINS = 8  # 1: the block has join and admission words (elastic groups)
_HEADER_LINES = 9
STATE_OK, STATE_CLOSED, STATE_ABORT = 0, 1, 2
_fence_lock = threading.Lock()


def _fence():
    _fence_lock.acquire()
    _fence_lock.release()
    _fence_lock.acquire()
    _fence_lock.release()


class ControlBlock:
    """Slots for one publisher, ``n_readers`` readers and ``n_ranks`` heartbeating ranks."""

    def __init__(self, arena: ShmArena):
        self._arena = arena
        t = arena.tensor(0, arena.nbytes // 8, torch.int64)
        self._slots = t.numpy()  # shares memory with the arena; int64, 8-byte aligned
        self._bell_addr = self._slots.ctypes.data + _DOORBELL * LINE * 8
        if arena.is_owner:
            return
        if int(self._slots[_MAGIC * LINE]) != MAGIC:
            raise ValueError(f"open_control_block: {arena.handle!r} is not a control block")

    # --- layout -------------------------------------------------------------------------------
    @property
    def n_readers(self) -> int:
        return int(self._slots[_NREADERS * LINE])

    @property
    def n_ranks(self) -> int:
        return int(self._slots[_NRANKS * LINE])

    def _ack_slot(self, reader: int) -> int:
        if not 0 <= reader < self.n_readers:
            raise ValueError(f"reader must be in [0, {self.n_readers}), got reader={reader}")
        return (_HEADER_LINES + reader) * LINE

    def _hb_slot(self, rank: int) -> int:
        if not 0 <= rank < self.n_ranks:
            raise ValueError(f"rank must be in [0, {self.n_ranks}), got rank={rank}")
        return (_HEADER_LINES + self.n_readers + rank) * LINE

    @property
    def has_joins(self) -> bool:
        """The block has join and admission words (``create_control_block(..., joins=True)``)."""
        return int(self._slots[_JOINS * LINE]) == 1

    def _join_slot(self, reader: int, admission: bool = False) -> int:
        if not self.has_joins:
            raise ValueError("this control block has no join words (create_control_block(joins=False))")
        self._ack_slot(reader)  # the same range check
        return (_HEADER_LINES + self.n_readers + self.n_ranks + admission * self.n_readers + reader) * LINE

    # --- versions -----------------------------------------------------------------------------
    @property
    def published_version(self) -> int:
        return int(self._slots[_PUBLISHED * LINE])

    def publish(self, version: int) -> None:
        """Publisher: call after the data of ``version`` is completely written (and synced)."""
        _fence()
        self._slots[_PUBLISHED_NS * LINE] = time.monotonic_ns()
        self._slots[_PUBLISHED * LINE] = version
        self.ring()

    @property
    def published_ns(self) -> int:
        """``time.monotonic_ns()`` when the last version was published (CLOCK_MONOTONIC: comparable
        across the processes of a host)."""
        return int(self._slots[_PUBLISHED_NS * LINE])

    def acked_version(self, reader: int) -> int:
        return int(self._slots[self._ack_slot(reader)])

    def ack(self, reader: int, version: int) -> None:
        """Reader ``reader``: it finished reading ``version`` (the publisher may overwrite)."""
        _fence()
        self._slots[self._ack_slot(reader)] = version
        self.ring()

    def acked_versions(self) -> list[int]:
        return [self.acked_version(i) for i in range(self.n_readers)]

    # --- joining (blocks made with joins=True) ---------------------------------------------------
    def request_join(self, reader: int, pid: int) -> None:
        """Reader ``reader`` (process ``pid``): ask the owner to admit it."""
        self._slots[self._join_slot(reader)] = pid
        self.ring()

    def leave(self, reader: int) -> None:
        """Reader ``reader``: it reads no more (the owner drops it at once)."""
        self._slots[self._join_slot(reader)] = 0
        self.ring()

    def join_requests(self):
        """Owner: every reader's join word (an int64 numpy array: a pid, or 0), read at once."""
        base = self._join_slot(0)
        return self._slots[base:base + self.n_readers * LINE:LINE].copy()

    def admitted_version(self, reader: int) -> int:
        """The first version the owner admitted ``reader`` to read (0: not admitted)."""
        return int(self._slots[self._join_slot(reader, admission=True)])

    def admit(self, reader: int, version: int) -> None:
        """Owner: ``reader`` may read from ``version`` on (> 0); its ack word restarts at version - 1
        (a reused reader slot must not carry its last occupant's acks)."""
        self._slots[self._ack_slot(reader)] = version - 1
        if reader < self.n_ranks:  # a heartbeat of the slot's last occupant must not age the new one
            self._slots[self._hb_slot(reader)] = 0
        _fence()
        self._slots[self._join_slot(reader, admission=True)] = version
        self.ring()

    def drop(self, reader: int, pid: int | None = None) -> None:
        """Owner: ``reader`` is no longer admitted (it left or died). ``pid``: a dead reader's, whose
        join word is cleared unless another process already wrote its own."""
        self._slots[self._join_slot(reader, admission=True)] = 0
        if pid is not None and int(self._slots[self._join_slot(reader)]) == pid:
            self._slots[self._join_slot(reader)] = 0
        self.ring()

    # --- liveness -----------------------------------------------------------------------------
    def heartbeat(self, rank: int) -> None:
        """Store ``time.monotonic_ns()`` (CLOCK_MONOTONIC: comparable across processes of a host)."""
        self._slots[self._hb_slot(rank)] = time.monotonic_ns()

    def last_heartbeat_ns(self, rank: int) -> int:
        return int(self._slots[self._hb_slot(rank)])

    @property
    def state(self) -> int:
        return int(self._slots[_STATE * LINE])

    def abort(self, rank: int = -1) -> None:
        """Any process: mark the group aborted (waiters raise ``RuntimeError``)."""
        self._slots[_ABORT_RANK * LINE] = rank
        self._slots[_STATE * LINE] = STATE_ABORT
        self.ring()

    @property
    def abort_rank(self) -> int | None:
        """The rank named by the abort word (None unless aborted)."""
        return int(self._slots[_ABORT_RANK * LINE]) if self.state == STATE_ABORT else None

    def abort_reason(self) -> str | None:
        if self.state == STATE_ABORT:
            return f"rank {int(self._slots[_ABORT_RANK * LINE])} set the abort word"
        return None

    # --- waiting ------------------------------------------------------------------------------
    def ring(self) -> None:
        """Wake everyone sleeping on this block's doorbell (after a state change they wait for)."""
        _wait.ring(self._slots, _DOORBELL * LINE, self._bell_addr)

    def doorbell(self) -> tuple[int, int]:
        """``(address, value)`` of the doorbell word, for ``_wait.futex_wait``."""
        return self._bell_addr, int(self._slots[_DOORBELL * LINE]) & 0xFFFFFFFF


    # --- lifetime -----------------------------------------------------------------------------
    def export(self) -> ArenaHandle:
        return self._arena.export()

    def unlink(self) -> None:
        self._arena.unlink()

    @property
    def handle(self) -> ArenaHandle:
        return self._arena.handle

    def close(self) -> None:
        self._slots = None
        self._arena.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def __repr__(self):
        if self._slots is None:
            return f"ControlBlock(closed, {self._arena.handle!r})"
        return (f"ControlBlock(published={self.published_version}, acked={self.acked_versions()}, "
                f"state={self.state})")


def create_control_block(n_readers: int, n_ranks: int, *, secret=None,
                         expected_peers: int | None = None, joins: bool = False) -> ControlBlock:
    """Owner (the publishing rank): a fresh block, all versions 0 (= nothing published yet).
    ``joins``: with a join and an admission word per reader (elastic groups)."""
    problems = [f"{n}={v} must be >= 0" for n, v in (("n_readers", n_readers), ("n_ranks", n_ranks)) if v < 0]
    if problems:
        raise ValueError("create_control_block: " + "; ".join(problems))
    nbytes = (_HEADER_LINES + n_readers + n_ranks + (2 * n_readers if joins else 0)) * LINE * 8
    arena = ShmArena.create(nbytes, secret=secret, expected_peers=expected_peers)
    cb = ControlBlock(arena)
    cb._slots[:] = 0
    cb._slots[_NREADERS * LINE] = n_readers
    cb._slots[_NRANKS * LINE] = n_ranks
    cb._slots[_JOINS * LINE] = int(joins)
    cb._slots[_MAGIC * LINE] = MAGIC
    return cb


def open_control_block(handle: ArenaHandle, *, secret=None, timeout: float = 10.0) -> ControlBlock:
    """Any other process: map the owner's control block."""
    arena = ShmArena.open(handle, secret=secret, timeout=timeout)
    try:
        return ControlBlock(arena)
    except BaseException:
        arena.close()
        raise
