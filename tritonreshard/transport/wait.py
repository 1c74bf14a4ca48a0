"""The one wait primitive of the refit engine: a short spin, then a futex sleep on a shared word.

Every state change a peer may wait for (a version published, an ack, an abort, a close) is written
into a control block (host shared memory) and then *rings* that block's doorbell: the writer stores
a fresh value into the doorbell word and calls ``FUTEX_WAKE`` on it. A waiter reads the doorbell,
re-checks its condition, and only then sleeps with ``FUTEX_WAIT(doorbell, value_read)``: the kernel
refuses to sleep if the word changed in between, so a ring between the check and the sleep is never
lost. The word is shared between processes (not ``FUTEX_PRIVATE``), which works on a ``MAP_SHARED``
mapping (memfd or /dev/shm).

Two writers may race and store the same doorbell value; the sleep is therefore cut into slices of at
most ``SLICE_S``, which is also how often dead peers are looked for (a dead process rings nothing).
Doorbell values are ``time.monotonic_ns()`` truncated to 32 bits, so two rings essentially never
store the same value.

Waits on something that is not a control block (a cross-host signal that arrived through the store,
a point-to-point transfer that completed) sleep on a :class:`Doorbell`: the same word and the same
wait, in this process's memory, rung by the thread that saw the event.

Wake-up latency (printed by ``tests/test_wait.py``, not asserted): one futex wake plus the
scheduler getting the sleeper onto a CPU; ~150 us p50 across processes on a 2-core machine at load
average 10-20, far less on an idle one. A pull that finds its version already published never
sleeps at all.
"""
from __future__ import annotations

import ctypes
import platform
import time

import numpy as np

__all__ = ["Doorbell", "futex_wait", "futex_wake", "ring", "wait_until", "SLICE_S", "SPIN_S"]

#: Longest single sleep; also the period of liveness checks while waiting.
SLICE_S = 0.05
#: Spin this long (re-checking the condition) before sleeping: hand-offs at copy speed never sleep.
SPIN_S = 50e-6

_SYS_FUTEX = {"x86_64": 202, "aarch64": 98, "arm64": 98}.get(platform.machine())
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1
_libc = ctypes.CDLL(None, use_errno=True)  # CDLL releases the GIL around the call
_syscall = _libc.syscall
_syscall.restype = ctypes.c_long


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def futex_wait(addr: int, expected: int, timeout_s: float) -> None:
    """Sleep while the 32-bit word at ``addr`` equals ``expected`` (at most ``timeout_s``).

    Returns on a wake, a changed word, a timeout or a signal; the caller re-checks its condition.
    Without a futex syscall on this platform it sleeps a short while instead.
    """
    if _SYS_FUTEX is None:  # pragma: no cover - non-Linux fallback: short sleeps
        time.sleep(min(timeout_s, 1e-3))
        return
    ts = _Timespec(int(timeout_s), int((timeout_s % 1.0) * 1e9))
    _syscall(_SYS_FUTEX, ctypes.c_void_p(addr), _FUTEX_WAIT, ctypes.c_uint32(expected & 0xFFFFFFFF),
             ctypes.byref(ts), None, 0)


def futex_wake(addr: int, n: int = 2 ** 31 - 1) -> None:
    """Wake up to ``n`` processes / threads sleeping on the word at ``addr``."""
    if _SYS_FUTEX is None:  # pragma: no cover
        return
    _syscall(_SYS_FUTEX, ctypes.c_void_p(addr), _FUTEX_WAKE, n, None, None, 0)


def ring(words, index: int, addr: int) -> None:
    """Store a fresh value in the doorbell ``words[index]`` (a numpy int64 array; the futex word
    is its low 32 bits, little-endian) and wake its sleepers. Call after writing the state change."""
    words[index] = time.monotonic_ns() & 0xFFFFFFFF
    futex_wake(addr)


class Doorbell:
    """A doorbell word in this process's memory, for events other threads of the process see
    (a store signal, a finished transfer): ``ring()`` after the state change, ``doorbell()`` for
    :func:`wait_until`. Control blocks carry their own word in shared memory."""

    def __init__(self):
        self._words = np.zeros(1, dtype=np.int64)
        self._addr = self._words.ctypes.data

    def ring(self) -> None:
        ring(self._words, 0, self._addr)

    def doorbell(self) -> tuple[int, int]:
        return self._addr, int(self._words[0]) & 0xFFFFFFFF


def wait_until(done, doorbell, deadline: float, check=None, spin_s: float = SPIN_S) -> bool:
    """Wait until ``done()`` is true or ``time.monotonic()`` passes ``deadline``.

    ``doorbell()`` returns ``(addr, value)`` of the word to sleep on (the control block of the peer
    the caller is waiting for; it may change between calls), or None to sleep ``SLICE_S`` blindly.
    ``check()`` runs at least every ``SLICE_S`` while waiting and raises to stop the wait (a dead
    peer, an abort). Returns True when done, False on the deadline.
    """
    if done():
        return True
    spin_end = time.perf_counter() + spin_s
    while time.perf_counter() < spin_end:
        if done():
            return True
    next_check = 0.0
    while True:
        now = time.monotonic()
        if check is not None and now >= next_check:
            check()
            next_check = now + SLICE_S
        bell = doorbell()
        if done():  # read the doorbell first, then the condition: a ring after this is not lost
            return True
        now = time.monotonic()
        if now >= deadline:
            return False
        sleep = min(SLICE_S, deadline - now, max(next_check - now, 1e-4) if check is not None else SLICE_S)
        if bell is None:
            time.sleep(sleep)
        else:
            futex_wait(bell[0], bell[1], sleep)


