"""The demo's report: the summary line, the JSON summary (``--json``, the last stdout line) and the
picture (``--png``), for a run that finished and for one that failed.

The JSON keys are :data:`SUMMARY_KEYS`, then for a failed run :data:`FAILURE_KEYS`; the package
docstring says what each number measures.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from itertools import pairwise

from .config import RunConfig
from .driver import RunOutcome

__all__ = ["report", "SUMMARY_KEYS", "FAILURE_KEYS"]

SUMMARY_KEYS = ("steps", "refits", "verified", "reward_first", "reward_last", "refit_ms_p50",
                "max_inference_stall_ms", "bytes_per_refit", "staleness_max", "staging_bytes",
                "recoveries", "recovery_ms", "recovery_parts_ms", "recovery_launch", "inference_pids")
# Added to the summary of a failed run (after SUMMARY_KEYS, which then describe what got done).
FAILURE_KEYS = ("error", "inference_version", "inference_consistent", "inference_why", "detect_ms", "fault",
                "pids")


def report(out: RunOutcome, rc: RunConfig, args: argparse.Namespace) -> int:
    """Prints what the run did; returns the exit code (0 = ran, refit and verified every version,
    and left nothing in ``/dev/shm``)."""
    if out.failure_lines is not None:
        return _report_failure(out, rc, args)
    summary, steps, refits = _summarize(out.store, rc, out.pids, out.recoveries)
    wall = time.perf_counter() - out.started
    parts = summary["recovery_parts_ms"] or {}
    restarts = (f"; {summary['recoveries']} trainer restart(s), {summary['recovery_ms']:.0f} ms from the "
                f"failure to the first refit of the new trainers "
                f"({', '.join(f'{k} {v:.0f}' for k, v in parts.items())} "
                f"ms; new trainers from {summary['recovery_launch']}), inference processes never restarted "
                f"(pids {summary['inference_pids']})") if out.recoveries else ""
    print(f"tritonreshard demo: {summary['steps']} steps, {summary['refits']} refits "
          f"({args.mode}, {args.backend} backend, {args.trainers} trainers -> {args.inference} TP ranks) in "
          f"{wall:.1f} s; reward {summary['reward_first']:.3f} -> {summary['reward_last']:.3f}; refit p50 "
          f"{summary['refit_ms_p50']:.2f} ms, longest stall {summary['max_inference_stall_ms']:.2f} ms, "
          f"{summary['bytes_per_refit']} B per refit, staging {summary['staging_bytes']} B (measured); "
          f"verified={summary['verified']}; max |TP - dense| "
          f"{max((r['tp_max_abs_diff'] for r in refits), default=0.0):.2e}{restarts}")
    if out.leaked:  # the engine names no segment (see Driver.close), so one here is a leak
        print(f"tritonreshard demo: /dev/shm entries appeared during the run: {out.leaked}", file=sys.stderr)
    if args.png:
        _plot(args.png, steps, refits, args)
        print(f"tritonreshard demo: wrote {os.path.abspath(args.png)}")
    if args.json:
        print(json.dumps(summary))
    return 0 if summary["verified"] and not out.leaked else 1


def _report_failure(out: RunOutcome, rc: RunConfig, args: argparse.Namespace) -> int:
    lines = out.failure_lines
    print("tritonreshard demo failed: " + "\n  ".join(lines), file=sys.stderr)
    if out.leaked:
        print(f"tritonreshard demo: /dev/shm entries appeared during the run: {out.leaked}", file=sys.stderr)
    summary = _summarize_failure(out.store, rc, "; ".join(lines), out.pids, out.recoveries)
    why = f": {summary['inference_why']}" if summary["inference_why"] else ""
    inf = (f"inference serves version {summary['inference_version']} (consistent: "
           f"{summary['inference_consistent']}){why}")
    det = "" if summary["detect_ms"] is None else f"; survivors noticed within {summary['detect_ms']:.0f} ms"
    print(f"tritonreshard demo: {inf}{det}")
    if args.json:
        print(json.dumps(summary))
    return 1


def _summarize(dstore, rc: RunConfig, pids, recoveries):
    steps = [json.loads(dstore.get(f"step/{s}")) for s in range(1, rc.steps + 1)]
    inf = json.loads(dstore.get("inference_summary"))
    refits = [json.loads(dstore.get(f"refit/{i}")) for i in range(1, inf["refits"] + 1)]
    k = max(1, min(5, len(steps) // 4))
    pull_ms = [r["pull_ms"] for r in refits]
    # The inference processes at the end are the ones the driver spawned at the start: each rank
    # reported its pid when it started and again when it finished.
    inference_pids = [pids[r] for r in rc.inference_ranks]
    same = all(json.loads(dstore.get(f"pid/{r}")) == {"start": pids[r], "end": pids[r]} for r in rc.inference_ranks)
    recovery_ms = parts = launch = None
    if recoveries:
        first_new = [r["time"] for r in refits if r["epoch"] == recoveries[0]["epoch"]]
        recovery_ms = 1e3 * (min(first_new) - recoveries[0]["failed_at"]) if first_new else None
        parts = _recovery_parts(dstore, rc, recoveries[0], min(first_new)) if first_new else None
        launch = "+".join(recoveries[0]["launches"])
    # Without a restart every version is refit and verified; a restart can drop the version whose
    # pull the failure broke, so then every version the inference group installed must verify.
    expected = rc.steps + 1 if not recoveries else inf["refits"] + 1
    summary = {
        "steps": len(steps),
        "refits": inf["refits"],
        "verified": bool(inf["verified"] and inf["verified_versions"] == expected and same
                         and inf["final_version"] == rc.steps + 1 and (recovery_ms is not None or not recoveries)),
        "reward_first": float(statistics.fmean(s["reward"] for s in steps[:k])),
        "reward_last": float(statistics.fmean(s["reward"] for s in steps[-k:])),
        "refit_ms_p50": float(statistics.median(pull_ms)) if pull_ms else 0.0,
        "max_inference_stall_ms": float(max((r["stall_ms"] for r in refits), default=0.0)),
        "bytes_per_refit": int(inf["bytes_per_refit"]),
        "staleness_max": int(max(s["staleness"] for s in steps)),
        "staging_bytes": int(inf["staging_bytes"]),
        "recoveries": len(recoveries),
        "recovery_ms": recovery_ms,
        "recovery_parts_ms": parts,
        "recovery_launch": launch,
        "inference_pids": inference_pids,
    }
    assert tuple(summary) == SUMMARY_KEYS
    return summary, steps, refits


def _recovery_parts(dstore, rc: RunConfig, rec: dict, first_refit: float) -> dict[str, float]:
    """The first restart, kill to the first refit of the new trainers, in ms and in order (they add
    up to ``recovery_ms``; one wall clock, ``time.time()``, on one host): ``detect`` (the failure
    until the driver saw it), ``stop`` (the old trainers gone), ``launch`` (until every new trainer
    process runs its rank: a spare's pipe message, or a spawn's interpreter start and imports),
    ``resume`` (checkpoint loaded, process group and refit group met), ``step`` (the first training
    step of the new trainers, to its publish), ``refit`` (the inference group's rejoin, pull and
    swap of that version)."""
    epoch = rec["epoch"]
    entered = max(float(dstore.get(f"entered/{epoch}/{r}")) for r in rc.trainer_ranks)
    resumed = max(float(dstore.get(f"resumed/{epoch}/{r}")) for r in rc.trainer_ranks)
    marks = [rec["failed_at"], rec["detected_at"], rec["stopped_at"], entered, resumed,
             float(dstore.get(f"published/{epoch}")), first_refit]
    names = ("detect", "stop", "launch", "resume", "step", "refit")
    return {n: 1e3 * (b - a) for n, (a, b) in zip(names, pairwise(marks), strict=True)}


def _summarize_failure(dstore, rc: RunConfig, error: str, pids, recoveries) -> dict:
    """The summary of a failed run: SUMMARY_KEYS over what got done, then FAILURE_KEYS.

    ``inference_version`` / ``inference_consistent`` are what the inference group holds at the end:
    when it noticed the failure together it settled its pull in flight (the fault contract of
    docs/guarantees.md), verified its serving weights (gather + digest against the trainers' digest
    of that version) and recorded them with why it serves that version (``inference_why``);
    otherwise the version is the one every
    surviving inference rank reported (None if they differ) and consistency is unknown (None).
    ``detect_ms``: for a --fault kill, the slowest surviving rank's time from the kill to noticing
    it (its first error); None if a survivor never noticed (the driver stopped it first)."""
    get = lambda k: json.loads(dstore.get(k)) if dstore.check([k]) else None  # noqa: E731
    steps = [s for s in (get(f"step/{s}") for s in range(1, int(dstore.add("steps_done", 0)) + 1)) if s]
    refits = [get(f"refit/{i}") for i in range(1, int(dstore.add("refits_done", 0)) + 1)]
    final = get("inference_final")
    k = max(1, min(5, len(steps) // 4))
    mean = lambda xs: float(statistics.fmean(xs)) if xs else None  # noqa: E731
    summary = {
        "steps": len(steps),
        "refits": len(refits),
        "verified": False,
        "reward_first": mean([s["reward"] for s in steps[:k]]),
        "reward_last": mean([s["reward"] for s in steps[-k:]]),
        "refit_ms_p50": float(statistics.median(r["pull_ms"] for r in refits)) if refits else None,
        "max_inference_stall_ms": float(max((r["stall_ms"] for r in refits), default=0.0)),
        "bytes_per_refit": final["bytes_per_refit"] if final else None,
        "staleness_max": int(max((s["staleness"] for s in steps), default=0)),
        "staging_bytes": final["staging_bytes"] if final else None,
        "recoveries": len(recoveries),
        "recovery_ms": None,
        "recovery_parts_ms": None,
        "recovery_launch": None,
        "inference_pids": [pids[r] for r in rc.inference_ranks],
    }
    why = None
    if final is not None:
        version, consistent, why = final["version"], final["consistent"], final["why"]
    else:
        states = [get(f"inference_state/{r}") for r in rc.inference_ranks]
        versions = {s["version"] for s in states if s is not None}
        version, consistent = (versions.pop() if len(versions) == 1 else None), None
    kill = get("fault/kill")
    detect_ms = None
    if kill is not None:
        # When each survivor noticed (its own error), even one the driver had to terminate while it
        # exited (a busy machine can be slow to tear a process down); one stopped before noticing
        # recorded only its stop.
        noticed = [get(f"error/{r}") for r in range(rc.world_size) if r != kill["rank"]]
        if all(n is not None and not n["detail"].startswith("stopped (exit code") for n in noticed):
            detect_ms = 1e3 * max(n["time"] - kill["time"] for n in noticed)
    summary.update({
        "error": error, "inference_version": version, "inference_consistent": consistent, "inference_why": why,
        "detect_ms": detect_ms, "fault": f"{rc.fault[0]}:{rc.fault[1]}" if rc.fault else None,
        "pids": [pids[r] for r in sorted(pids)]})
    assert tuple(summary) == SUMMARY_KEYS + FAILURE_KEYS
    return summary


def _plot(path: str, steps, refits, args) -> None:
    # Lazy: only --png needs matplotlib, and importing it would slow every run that draws nothing.
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, (ax0, ax1) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    xs = [s["step"] for s in steps]
    ax0.plot(xs, [s["reward"] for s in steps], marker=".", label="batch mean")
    ax0.set_ylabel("reward (fraction of tokens correct)")
    ax0.set_ylim(0, 1)
    ax0.grid(alpha=0.3)
    ax0.set_title(f"async RL refit demo: {args.trainers} FSDP trainers -> {args.inference} TP inference ranks "
                  f"({args.mode})", fontsize=10)
    # Refit i installs version i+1, the weights trainer step i produced.
    rx = [r["version"] - 1 for r in refits]
    pulls = [r["pull_ms"] for r in refits]
    stalls = [r["stall_ms"] for r in refits]
    # Log scale: one slow refit (a busy machine, 100+ ms) on a linear axis flattens the usual 1-5 ms
    # pulls and the sub-millisecond stalls into the floor. A zero (nothing measurable) is drawn at
    # the floor of the axis rather than dropped.
    floor = min([v for v in pulls + stalls if v > 0], default=1e-3) / 2
    ax1.plot(rx, [max(v, floor) for v in pulls], marker=".", label="pull (background in shadow mode)")
    ax1.plot(rx, [max(v, floor) for v in stalls], marker=".", label="generation stall")
    ax1.set_yscale("log")
    if pulls:
        med = statistics.median(pulls)
        ax1.axhline(med, color="C0", lw=0.8, ls="--", label=f"median pull {med:.2f} ms")
        top = max(range(len(pulls)), key=pulls.__getitem__)
        ax1.annotate(f"max {pulls[top]:.1f} ms", (rx[top], pulls[top]), textcoords="offset points",
                     xytext=(0, 6), ha="center", fontsize=8, color="C0")
        ax1.set_ylim(top=max(pulls + stalls) * 30)  # room for the annotation and the legend
    ax1.set_xlabel("trainer step")
    ax1.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax1.set_ylabel("refit time per step (ms, log scale)")
    ax1.grid(alpha=0.3)
    ax1.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
