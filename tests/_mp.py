"""Multi-process test harness: spawn ranks with a hard timeout, collect what each rank reports.

A hang fails fast (every process is killed at the deadline) and a rank's exception fails the test
with that rank's traceback.
"""
from __future__ import annotations

import queue
import signal
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


def start_rank(ctx, fn, rank: int, args, results):
    """Start one rank now: a daemon process of ``ctx`` running ``fn(rank, *args)``, whose result (or
    exception) goes to ``results`` as ``run_ranks`` collects them. For tests that start, kill and
    restart ranks themselves."""
    p = ctx.Process(target=_entry, args=(fn, rank, tuple(args), results), daemon=True)
    p.start()
    return p


def collect_ok(results, ranks, timeout: float) -> dict:
    """``{rank: value}`` of the ranks started with :func:`start_rank`, read from ``results`` until
    every one of ``ranks`` reported; a rank that raised fails with its traceback, and ranks still
    silent after ``timeout`` seconds fail with a TimeoutError naming them."""
    out = {}
    deadline = time.monotonic() + timeout
    while not set(ranks) <= set(out):
        try:
            rank, status, value = results.get(timeout=max(0.1, deadline - time.monotonic()))
        except queue.Empty:
            raise TimeoutError(f"ranks {sorted(set(ranks) - set(out))} did not finish") from None
        assert status == "ok", f"rank {rank} raised {value[0]}: {value[1]}\n{value[2]}"
        out[rank] = value
    return out


def run_ranks(fn, nprocs: int, args=(), timeout: float = 120.0, allow_errors: bool = False,
              victims=()) -> dict:
    """Run ``fn(rank, *args)`` in ``nprocs`` spawned processes; return {rank: value}.

    With ``allow_errors`` a rank's exception is returned as ``("error", (type, message, tb))``
    instead of failing the call. Ranks in ``victims`` must die of SIGKILL (fault-injection tests):
    they report nothing, their exit code is checked, and only the survivors are returned.
    """
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
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"ranks {sorted(survivors - set(out))} did not finish within "
                                   f"{timeout:g} s")
            try:
                rank, status, value = results.get(timeout=min(remaining, 0.5))
            except queue.Empty:
                gone = [r for r in sorted(survivors - set(out)) if not procs[r].is_alive()]
                if gone:
                    time.sleep(0.5)  # its report may still be in the pipe
                    while not results.empty():
                        rank, status, value = results.get()
                        out[rank] = (status, value)
                    gone = [r for r in gone if r not in out]
                    if gone:
                        raise RuntimeError(f"ranks {gone} died without a report, exit codes "
                                           f"{[procs[r].exitcode for r in gone]}")
                continue
            out[rank] = (status, value)
        for r in victims:
            procs[r].join(max(1.0, deadline - time.monotonic()))
            assert procs[r].exitcode == -signal.SIGKILL, f"rank {r} exit code {procs[r].exitcode}, expected SIGKILL"
    finally:
        for p in procs:
            p.join(timeout=max(0.1, min(10.0, deadline - time.monotonic())))
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
        results.close()
    out = {r: v for r, v in out.items() if r in survivors}
    if not allow_errors:
        errors = {r: v for r, (s, v) in out.items() if s == "error"}
        if errors:
            r, (name, msg, tb) = sorted(errors.items())[0]
            raise AssertionError(f"rank {r} raised {name}: {msg}\n{tb}")
        return {r: v for r, (s, v) in out.items()}
    return out
