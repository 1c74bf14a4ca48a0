"""Helpers for fault-injection tests: dying on purpose and resource snapshots.

Groups in which some ranks SIGKILL themselves run through ``_mp.run_ranks(..., victims=[...])``.
"""
from __future__ import annotations

import os
import signal
import time


def die():
    """SIGKILL this process (no cleanup of any kind runs)."""
    os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)


def fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


def our_fds() -> list[str]:
    """Descriptors of this process that point at our shared memory (memfds or /dev/shm names)."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if "trs-" in target:
            out.append(target)
    return out


def our_maps() -> list[str]:
    """Mappings of this process of our shared memory (``/dev/shm/trs-*`` or ``memfd:trs-*``)."""
    with open("/proc/self/maps") as f:
        return [line.strip() for line in f if "trs-" in line]


def shm_entries() -> set[str]:
    return {e for e in os.listdir("/dev/shm") if e.startswith("trs-")}


def wait_no_new_shm(before: set[str], timeout: float = 10.0) -> set[str]:
    """New ``/dev/shm/trs-*`` entries that stay. Other test sessions may share this machine and
    create short-lived entries of their own, so only entries that outlive ``timeout`` count."""
    deadline = time.monotonic() + timeout
    while True:
        new = shm_entries() - before
        if not new or time.monotonic() > deadline:
            return new
        time.sleep(0.2)


def rss_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError("no VmRSS in /proc/self/status")


def fd_targets() -> set:
    """(fd, target) pairs of this process's open file descriptors."""
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            out.add((fd, os.readlink(f"/proc/self/fd/{fd}")))
        except OSError:
            pass
    return out
