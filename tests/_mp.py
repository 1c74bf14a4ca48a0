"""Multi-process test harness: spawn ranks with a hard timeout, collect what each rank reports.

A hang fails fast (every process is killed at the deadline) and a rank's exception fails the test
with that rank's traceback.
"""
from __future__ import annotations

import queue
import socket
import time
import traceback

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(fn, rank, args, results):
    try:
        results.put((rank, "ok", fn(rank, *args)))
    except BaseException as exc:  # reported to the parent, which fails the test with it
        results.put((rank, "error", (type(exc).__name__, str(exc), traceback.format_exc())))


def run_ranks(fn, nprocs: int, args=(), timeout: float = 120.0, allow_errors: bool = False) -> dict:
    """Run ``fn(rank, *args)`` in ``nprocs`` spawned processes; return {rank: value}.

    With ``allow_errors`` a rank's exception is returned as ``("error", (type, message, tb))``
    instead of failing the call.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_entry, args=(fn, r, args, results), daemon=True) for r in range(nprocs)]
    for p in procs:
        p.start()
    out: dict = {}
    deadline = time.monotonic() + timeout
    try:
        while len(out) < nprocs:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"ranks {sorted(set(range(nprocs)) - set(out))} did not finish within "
                                   f"{timeout:g} s")
            try:
                rank, status, value = results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if not p.is_alive() and r not in out and p.exitcode]
                if dead:
                    time.sleep(0.5)  # its report may still be in the pipe
                    while not results.empty():
                        rank, status, value = results.get()
                        out[rank] = (status, value)
                    dead = [r for r in dead if r not in out]
                    if dead:
                        raise RuntimeError(f"ranks {dead} died with exit codes "
                                           f"{[procs[r].exitcode for r in dead]}")
                continue
            out[rank] = (status, value)
    finally:
        for p in procs:
            p.join(timeout=max(0.1, min(10.0, deadline - time.monotonic())))
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
        results.close()
    if not allow_errors:
        errors = {r: v for r, (s, v) in out.items() if s == "error"}
        if errors:
            r, (name, msg, tb) = sorted(errors.items())[0]
            raise AssertionError(f"rank {r} raised {name}: {msg}\n{tb}")
        return {r: v for r, (s, v) in out.items()}
    return out
