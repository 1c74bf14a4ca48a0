"""Helpers for fault-injection tests: ranks that are expected to die, resource snapshots.

``run_ranks_killing`` is ``_mp.run_ranks`` for groups in which some ranks SIGKILL themselves (or are
killed): it collects the survivors' reports and checks that each victim really died of SIGKILL.
"""
from __future__ import annotations

import os
import queue
import signal
import time

import torch.multiprocessing as mp

from _mp import _entry


def run_ranks_killing(fn, nprocs: int, victims, args=(), timeout: float = 120.0) -> dict:
    """Run ``fn(rank, *args)`` in ``nprocs`` spawned processes; ranks in ``victims`` must die of
    SIGKILL, every other rank must return. Returns the survivors' ``{rank: value}``; a survivor's
    exception fails the call with its traceback."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_entry, args=(fn, r, args, results), daemon=True) for r in range(nprocs)]
    for p in procs:
        p.start()
    out: dict = {}
    survivors = set(range(nprocs)) - set(victims)
    deadline = time.monotonic() + timeout
    try:
        while not survivors <= set(out):
            if time.monotonic() > deadline:
                raise TimeoutError(f"ranks {sorted(survivors - set(out))} did not finish within {timeout:g} s")
            try:
                rank, status, value = results.get(timeout=0.5)
            except queue.Empty:
                gone = [r for r in survivors - set(out) if not procs[r].is_alive()]
                if gone and results.empty():
                    time.sleep(0.5)
                    if results.empty():
                        raise RuntimeError(f"ranks {gone} exited without a report "
                                           f"(exit codes {[procs[r].exitcode for r in gone]})")
                continue
            out[rank] = (status, value)
        for r in victims:
            procs[r].join(max(1.0, deadline - time.monotonic()))
            assert procs[r].exitcode == -signal.SIGKILL, f"rank {r} exit code {procs[r].exitcode}, expected SIGKILL"
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(5)
        results.close()
    errors = {r: v for r, (s, v) in out.items() if s == "error"}
    if errors:
        r, (name, msg, tb) = sorted(errors.items())[0]
        raise AssertionError(f"rank {r} raised {name}: {msg}\n{tb}")
    return {r: v for r, (s, v) in out.items() if r in survivors}


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
