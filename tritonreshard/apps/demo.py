"""``tritonreshard demo``: an asynchronous RL loop whose policy refits through tritonreshard.

Processes (spawned by the shared driver, :mod:`.driver`, one per rank; global ranks ``0..T-1``
train, ``T..T+I-1`` serve; each role has its own torch.distributed group)::

    trainers (FSDP rows, Shard(0))                 inference (tensor parallel, TP = I)
    ------------------------------                 -------------------------------------------
    all-gather rows -> forward/backward            generate rollouts on the serving weights,
    on trajectories from the queue                 every token: column-parallel gate_up,
    all-reduce grads, keep own rows                row-parallel down + all-reduce, vocab-
    tr.fence()    (readers acked newest)           parallel lm_head + all-gather
    optimizer.step() on tr.tensors (the arena)     at each rollout boundary (all TP ranks agree
    probe logits + weight digest of v -> store     through one MIN all-reduce): start_pull() the
    checkpoint of v (every trainer rank)           newest version in the background, keep
    tr.publish()  -> version v                     generating, swap() when every TP rank is done
            <---- trajectories (policy version, prompts, actions, rewards) via the TCPStore

The trainers' row shards *are* the arena tensors (``tr.tensors``): the optimizer updates them in
place and ``publish()`` only bumps a version, so no copy happens per step on the trainer side.
Trajectories carry the version that generated them; a trainer at version ``v`` drops any older than
``v - max_staleness``.

Verification (exact by construction): after every refit, the inference ranks all-gather their TP
shards into full weights (pure copies, so bit-identical to the global tensors) and the first
inference rank runs :func:`tritonreshard.apps._policy.probe`, a dense CPU float32 single-threaded forward
on fixed probe inputs. The trainers all-gather their row shards of the same version and run the
very same function, publishing a SHA-1 of the weight bytes and the probe logits' bytes. The
inference side compares both bit for bit: equal digests mean every element of every parameter
arrived in the right place with the right bits, and equal logits show the served model computes
the trainer's function. The tensor-parallel forward itself sums partial products in a different
order, so its difference to the dense logits is reported (``tp_max_abs_diff``), not asserted.

Numbers (a summary line, then with ``--json`` a JSON object as the last line, both on stdout):
``refit_ms_p50`` is the median time of a pull, start to ack (``last_pull.total_ms`` of the slowest
TP rank); ``max_inference_stall_ms`` the longest time generation paused for a refit (shadow: the
``swap()``; in-place: the whole ``pull()``); the verification gather and probe are instrumentation
and not counted. ``bytes_per_refit`` sums the bytes every inference rank writes per refit;
``staleness_max`` is the largest ``v - version`` of a trajectory the trainers used;
``staging_bytes`` the extra memory the pulls allocated, as the engine measured it (the most one
pull took, summed over the TP ranks); ``inference_pids`` the inference processes' ids.

Faults (``--fault``, see its help): a rank's failure makes the driver set an ``abort`` key that
ranks waiting on the store poll; ranks blocked in a collective get gloo's "connection closed" at
once; the engine raises PeerDiedError in fences and pulls. The inference group decides at each
rollout boundary through its MIN all-reduce whether every TP rank's pull succeeded and nothing
aborted: if not, every TP rank discards its pull, the group verifies what it serves (digest against
the trainers' digest of that version) and records it, then exits. Survivors get ``--peer-timeout``
+ 10 s to exit on their own before the driver terminates them. Each failed rank is reported in one
line (``TRITONRESHARD_DEBUG=1`` prints the ranks' tracebacks too).

Restarts (``--restart``): when only trainers failed, the driver stops what is left of the trainer
group and starts new trainer processes in the refit group's next epoch; they load the newest
checkpoint every trainer rank wrote (each rank checkpoints a version before publishing it, so the
checkpoint is never older than what the inference group holds) and publish from the next version
on. The inference processes drop the broken pull together, keep generating on their last complete
version, and ``rejoin()`` the new epoch once its trainers are up; refits go on, verified as before.
``recoveries`` counts the restarts, ``recovery_ms`` is the time from the failure to the first
refit of the new epoch.

Entry points (wired by ``apps/cli.py``): :func:`add_arguments` and :func:`run`.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import pickle
import shutil
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass

from .driver import Driver, RankFailed, poll_until, wait_key

__all__ = ["add_arguments", "run"]

SUMMARY_KEYS = ("steps", "refits", "verified", "reward_first", "reward_last", "refit_ms_p50",
                "max_inference_stall_ms", "bytes_per_refit", "staleness_max", "staging_bytes",
                "recoveries", "recovery_ms", "inference_pids")
MAX_RESTARTS = 3  # --restart: trainer-group restarts per run before a failure ends it
# Added to the summary of a failed run (after SUMMARY_KEYS, which then describe what got done).
FAILURE_KEYS = ("error", "inference_version", "inference_consistent", "detect_ms", "fault", "pids")
FAULTS = ("kill-trainer", "kill-inference", "crash-trainer")


@dataclass(frozen=True)
class _RunConfig:
    steps: int
    trainers: int
    inference: int
    mode: str
    backend: str
    device: str
    dist_backend: str
    max_staleness: int
    prompts: int
    group: int
    lr: float
    seed: int
    timeout: float
    peer_timeout: float = 10.0
    fault: tuple[str, int] | None = None  # (kind, K) from --fault
    restart: bool = False                 # --restart: a failed trainer group restarts from its checkpoint
    checkpoint_dir: str = ""              # where trainers checkpoint every version they publish

    @property
    def world_size(self) -> int:
        return self.trainers + self.inference

    @property
    def trainer_ranks(self) -> tuple[int, ...]:
        return tuple(range(self.trainers))

    @property
    def inference_ranks(self) -> tuple[int, ...]:
        return tuple(range(self.trainers, self.world_size))


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Adds the demo's options to ``parser`` (used by ``tritonreshard demo``)."""
    parser.add_argument("--steps", type=int, default=60,
                        help="trainer steps = published versions after the first (default 60)")
    parser.add_argument("--trainers", type=int, default=2, help="trainer processes, FSDP row shards (default 2)")
    parser.add_argument("--inference", type=int, default=4, help="inference processes, one TP group (default 4)")
    parser.add_argument("--mode", choices=("shadow", "inplace"), default="shadow",
                        help="shadow: pull in the background and swap at a boundary (default); "
                             "inplace: pause generation and pull into the serving weights")
    parser.add_argument("--backend", choices=("torch", "triton"), default="torch",
                        help="copy backend of the pull (triton on CPU runs the slow interpreter)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="device of weights and compute")
    parser.add_argument("--max-staleness", type=int, default=2,
                        help="drop trajectories generated more than this many versions ago (default 2)")
    parser.add_argument("--prompts", type=int, default=32, help="prompts per rollout batch (default 32)")
    parser.add_argument("--group", type=int, default=8, help="samples per prompt, GRPO group (default 8)")
    parser.add_argument("--lr", type=float, default=1e-2, help="Adam learning rate (default 1e-2)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=300.0,
                        help="hard limit in seconds for the whole run; also bounds every wait (default 300)")
    parser.add_argument("--peer-timeout", type=float, default=10.0,
                        help="seconds without a heartbeat after which the refit engine declares a peer "
                             "dead (its peer_timeout; a local process that is gone is noticed at once); "
                             "after a failure the other ranks get this long (+10 s) to notice and exit "
                             "before the driver terminates them (default 10)")
    parser.add_argument("--fault", metavar="KIND:K", default=None,
                        help="inject a fault, to see how failures are handled. kill-trainer:K: trainer "
                             "rank 0 SIGKILLs itself right after publishing version K (2 <= K <= steps+1), "
                             "while the inference ranks pull it; they reject K and keep serving K-1 "
                             "(checked against the trainers' digest of K-1). kill-inference:K: the first "
                             "inference rank (TP rank 0, global rank --trainers) SIGKILLs itself when it "
                             "would pull version K; the trainers' fence() raises PeerDiedError naming it "
                             "and the refit fails (the dead reader is reported, never dropped silently). "
                             "crash-trainer:K: the last trainer rank raises an exception at step K. Every "
                             "fault makes the demo exit 1 naming the failed rank; --json adds \"error\", "
                             "\"inference_version\", \"inference_consistent\" and \"detect_ms\" (slowest "
                             "survivor's time to notice a kill)")
    parser.add_argument("--restart", action="store_true",
                        help="when trainers fail, restart the trainer group from its last checkpoint (the "
                             "trainers checkpoint every version before publishing it) while the inference "
                             "processes keep serving their last complete version and join the new group's "
                             "refits without being restarted; the summary counts \"recoveries\" and "
                             "\"recovery_ms\" (failure to the first refit of the new group). Shadow mode only")
    parser.add_argument("--png", metavar="FILE", help="save reward and refit time per step to FILE")
    parser.add_argument("--json", action="store_true", help="print a JSON summary as the last stdout line")
    return parser


# ============================================================================================
# Driver
# ============================================================================================
def _validate(args) -> list[str]:
    problems = []
    if args.steps < 1:
        problems.append(f"--steps={args.steps} must be >= 1")
    if args.trainers < 1 or args.inference < 1:
        problems.append(f"--trainers={args.trainers} and --inference={args.inference} must be >= 1")
    if args.max_staleness < 0:
        problems.append(f"--max-staleness={args.max_staleness} must be >= 0")
    if args.group < 2:
        problems.append(f"--group={args.group} must be >= 2 (advantages are relative to the group)")
    if args.prompts < 1 or args.prompts % max(args.trainers, 1):
        problems.append(f"--prompts={args.prompts} must be a positive multiple of --trainers={args.trainers}")
    from ._policy import PolicyConfig
    cfg = PolicyConfig()
    if args.inference >= 1 and (cfg.hidden % args.inference or cfg.vocab % args.inference):
        problems.append(f"--inference={args.inference} must divide hidden={cfg.hidden} and vocab={cfg.vocab}")
    if args.peer_timeout <= 0:
        problems.append(f"--peer-timeout={args.peer_timeout} must be > 0")
    if args.fault is not None:
        try:
            _parse_fault(args.fault, args.steps)
        except ValueError as e:
            problems.append(str(e))
    if args.restart and args.mode != "shadow":
        problems.append(f"--restart needs --mode=shadow (got --mode={args.mode}): an in-place pull that a "
                        f"failure broke leaves torn weights, nothing to keep serving")
    if args.restart and args.fault is not None and args.fault.startswith("kill-trainer:") \
            and args.fault.partition(":")[2] == str(args.steps + 1):
        problems.append(f"--restart with --fault={args.fault}: the kill lands after the last version, "
                        f"so a restarted trainer group has no step left; use K <= --steps={args.steps}")
    if args.png:
        from .viz import check_figure_path
        try:
            check_figure_path(args.png, "--png")
        except ValueError as e:
            problems.append(str(e))
    if args.device == "cuda":
        import torch
        if not torch.cuda.is_available():
            problems.append("--device=cuda but torch.cuda.is_available() is False")
    return problems


def _parse_fault(spec: str, steps: int) -> tuple[str, int]:
    kind, _, k = spec.partition(":")
    if kind not in FAULTS or not k.lstrip("-").isdigit():
        raise ValueError(f"--fault={spec!r} must be KIND:K with KIND one of {', '.join(FAULTS)} and K an int")
    k = int(k)
    lo, hi = (1, steps) if kind == "crash-trainer" else (2, steps + 1)
    if not lo <= k <= hi:
        what = "step" if kind == "crash-trainer" else "version (1 is the initial weights)"
        raise ValueError(f"--fault={spec!r}: K is a {what} and must be in [{lo}, {hi}] with --steps={steps}")
    return kind, k


def run(args: argparse.Namespace) -> int:
    """Runs the demo; returns the process exit code (0 = ran, refit and verified every version)."""
    problems = _validate(args)
    if problems:
        print("tritonreshard demo: invalid arguments:\n  - " + "\n  - ".join(problems), file=sys.stderr)
        return 2

    import torch
    from tqdm import tqdm

    world = args.trainers + args.inference
    if args.device == "cuda" and torch.cuda.device_count() >= world:
        dist_backend = "cpu:gloo,cuda:nccl"
    else:
        dist_backend = "gloo"  # CUDA tensors are staged through the CPU for the collectives
    ckpt_dir = tempfile.mkdtemp(prefix="trs-demo-ckpt-")  # trainer checkpoints (--restart resumes from them)
    rc = _RunConfig(steps=args.steps, trainers=args.trainers, inference=args.inference, mode=args.mode,
                    backend=args.backend, device=args.device, dist_backend=dist_backend,
                    max_staleness=args.max_staleness, prompts=args.prompts, group=args.group,
                    lr=args.lr, seed=args.seed, timeout=args.timeout, peer_timeout=args.peer_timeout,
                    fault=_parse_fault(args.fault, args.steps) if args.fault else None,
                    restart=args.restart, checkpoint_dir=ckpt_dir)
    print(f"tritonreshard demo: starting {world} processes ({args.trainers} trainers, {args.inference} "
          f"inference); each imports torch and joins the refit group before step 1, which takes a while "
          f"on a busy machine", file=sys.stderr, flush=True)
    drv = Driver("demo", world, _worker, (rc,), timeout=args.timeout, prefix="demo", role=lambda r: _role(rc, r))
    dstore = drv.pstore
    t0 = time.perf_counter()
    bar = tqdm(total=args.steps, desc="refit demo", unit="step", file=sys.stderr, dynamic_ncols=True)
    seen = {"steps": 0, "phase": None}

    def progress():
        phase = _phase(dstore, world)
        if phase is not None and phase != seen["phase"]:
            seen["phase"] = phase
            bar.set_postfix_str(phase)
        done = int(dstore.add("steps_done", 0))
        while seen["steps"] < done and dstore.check([f"step/{seen['steps'] + 1}"]):
            seen["steps"] += 1
            m = json.loads(dstore.get(f"step/{seen['steps']}"))
            post = {"reward": f"{m['reward']:.3f}", "version": m["version"]}
            refits = int(dstore.add("refits_done", 0))
            if refits:
                post["refit_ms"] = f"{json.loads(dstore.get(f'refit/{refits}'))['pull_ms']:.1f}"
            bar.set_postfix(post)
            bar.update(1)

    failure = None            # RankFailed / TimeoutError that ended the run
    recoveries = []           # one dict per trainer-group restart
    terminated: list[int] = []
    still_running: list[int] = []
    grace = rc.peer_timeout + 10.0  # how long survivors get to notice a failure and exit
    deadline = time.monotonic() + args.timeout
    leaked: list[str] = []
    try:
        drv.start()
        while True:
            try:
                drv.wait(lambda: not drv.alive(), "the demo's ranks to finish", tick=progress,
                         timeout=max(0.0, deadline - time.monotonic()))
                break
            except RankFailed as exc:
                if _can_restart(rc, exc.errors, recoveries):
                    recoveries.append(_restart_trainers(drv, rc, exc.errors, bar))
                    continue
                failure = exc
            except TimeoutError as exc:
                failure, still_running = exc, drv.alive()
            break
        if isinstance(failure, RankFailed):
            # Ranks waiting on the store (trajectories, the end of the run) stop at once; ranks in
            # the engine or a collective notice the failure themselves.
            drv.abort(f"rank {failure.errors[0].rank} ({_role(rc, failure.errors[0].rank)}) failed")
            try:
                drv.wait(lambda: not drv.alive(), "the other ranks to notice the failure and exit",
                         timeout=grace, watch=[])
            except TimeoutError:
                terminated = drv.stop()
    finally:
        bar.close()
        leaked = drv.close()
        shutil.rmtree(ckpt_dir, ignore_errors=True)

    pids = drv.pids()
    if failure is not None:
        if isinstance(failure, RankFailed):
            errors = drv.failures()
            lines = [drv.describe(e) for e in errors]
            if terminated:
                lines.append(f"rank(s) {terminated} still running {grace:g} s after the first failure were "
                             f"terminated")
        else:
            lines = [f"{failure}; ranks still running then: {still_running}"]
        print("tritonreshard demo failed: " + "\n  ".join(lines), file=sys.stderr)
        if leaked:
            print(f"tritonreshard demo: /dev/shm entries appeared during the run: {leaked}", file=sys.stderr)
        summary = _summarize_failure(dstore, rc, "; ".join(lines), pids, terminated, recoveries)
        inf = (f"inference serves version {summary['inference_version']} (consistent: "
               f"{summary['inference_consistent']})")
        det = "" if summary["detect_ms"] is None else f"; survivors noticed within {summary['detect_ms']:.0f} ms"
        print(f"tritonreshard demo: {inf}{det}")
        if args.json:
            print(json.dumps(summary))
        return 1

    summary, steps, refits = _summarize(dstore, rc, pids, recoveries)
    wall = time.perf_counter() - t0
    restarts = (f"; {summary['recoveries']} trainer restart(s), {summary['recovery_ms']:.0f} ms from the "
                f"failure to the first refit of the new trainers, inference processes never restarted "
                f"(pids {summary['inference_pids']})") if recoveries else ""
    print(f"tritonreshard demo: {summary['steps']} steps, {summary['refits']} refits "
          f"({args.mode}, {args.backend} backend, {args.trainers} trainers -> {args.inference} TP ranks) in "
          f"{wall:.1f} s; reward {summary['reward_first']:.3f} -> {summary['reward_last']:.3f}; refit p50 "
          f"{summary['refit_ms_p50']:.2f} ms, longest stall {summary['max_inference_stall_ms']:.2f} ms, "
          f"{summary['bytes_per_refit']} B per refit, staging {summary['staging_bytes']} B (measured); "
          f"verified={summary['verified']}; max |TP - dense| "
          f"{max((r['tp_max_abs_diff'] for r in refits), default=0.0):.2e}{restarts}")
    if leaked:  # the engine names no segment (see Driver.close), so one here is a leak
        print(f"tritonreshard demo: /dev/shm entries appeared during the run: {leaked}", file=sys.stderr)
    if args.png:
        _plot(args.png, steps, refits, args)
        print(f"tritonreshard demo: wrote {os.path.abspath(args.png)}")
    if args.json:
        print(json.dumps(summary))
    return 0 if summary["verified"] and not leaked else 1


def _phase(dstore, world: int) -> str | None:
    """What the demo is doing before its first step (for the progress bar), None after."""
    if dstore.check(["step/1"]):
        return None
    up = int(dstore.add("ranks_up", 0))
    if up < world:
        return f"starting processes: {up}/{world} up"
    if not dstore.check(["pulled/1"]):
        return "forming the refit group; the inference ranks pull version 1"
    return "generating the first rollouts; trainer step 1"


def _role(rc: _RunConfig, rank: int) -> str:
    if rank < rc.trainers:
        return f"trainer {rank}"
    return f"inference, TP rank {rank - rc.trainers}"


def _can_restart(rc: _RunConfig, errors, recoveries) -> bool:
    """--restart: only trainers failed (the inference group serves on), and restarts remain."""
    return (rc.restart and len(recoveries) < MAX_RESTARTS
            and all(e.rank in rc.trainer_ranks for e in errors))


def _restart_trainers(drv, rc: _RunConfig, errors, bar) -> dict:
    """The trainer group failed: stop what is left of it, then start new trainer processes in the next
    group epoch; they resume from their last complete checkpoint, and the inference processes (still
    serving their last complete version) join that epoch."""
    failed_at = min(e.time for e in errors)
    bar.write(f"tritonreshard demo: {'; '.join(drv.describe(e) for e in errors)}; restarting the trainer "
              f"group from its last checkpoint (the inference processes keep serving)", file=sys.stderr)
    # The other trainers' state is in their checkpoints: a short grace to exit on their own (most
    # notice at once: a collective with the dead rank fails), then SIGTERM.
    try:
        drv.wait(lambda: not any(r in drv.alive() for r in rc.trainer_ranks), "the old trainers to exit",
                 timeout=1.0, watch=[])
    except TimeoutError:
        drv.stop(rc.trainer_ranks, grace=5.0)
    epoch = int(drv.pstore.add("trainer_epoch", 1))  # the ranks of that epoch read it when they start
    drv.start(rc.trainer_ranks)
    return {"failed_at": failed_at, "epoch": epoch, "errors": [drv.describe(e) for e in errors]}


def _summarize(dstore, rc: _RunConfig, pids, recoveries):
    steps = [json.loads(dstore.get(f"step/{s}")) for s in range(1, rc.steps + 1)]
    inf = json.loads(dstore.get("inference_summary"))
    refits = [json.loads(dstore.get(f"refit/{i}")) for i in range(1, inf["refits"] + 1)]
    k = max(1, min(5, len(steps) // 4))
    pull_ms = [r["pull_ms"] for r in refits]
    # The inference processes at the end are the ones the driver spawned at the start: each rank
    # reported its pid when it started and again when it finished.
    inference_pids = [pids[r] for r in rc.inference_ranks]
    same = all(json.loads(dstore.get(f"pid/{r}")) == {"start": pids[r], "end": pids[r]} for r in rc.inference_ranks)
    recovery_ms = None
    if recoveries:
        first_new = [r["time"] for r in refits if r["epoch"] == recoveries[0]["epoch"]]
        recovery_ms = 1e3 * (min(first_new) - recoveries[0]["failed_at"]) if first_new else None
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
        "inference_pids": inference_pids,
    }
    assert tuple(summary) == SUMMARY_KEYS
    return summary, steps, refits


def _summarize_failure(dstore, rc: _RunConfig, error: str, pids, terminated, recoveries) -> dict:
    """The summary of a failed run: SUMMARY_KEYS over what got done, then FAILURE_KEYS.

    ``inference_version`` / ``inference_consistent`` are what the inference group holds at the end:
    when it noticed the failure together it verified its serving weights (gather + digest against
    the trainers' digest of that version) and recorded them; otherwise the version is the one every
    surviving inference rank reported (None if they differ) and consistency is unknown (None).
    ``detect_ms``: for a --fault kill, the slowest surviving rank's time from the kill to noticing
    it (its first error); None if a survivor never noticed (the driver had to terminate it)."""
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
        "inference_pids": [pids[r] for r in rc.inference_ranks],
    }
    if final is not None:
        version, consistent = final["version"], final["consistent"]
    else:
        states = [get(f"inference_state/{r}") for r in rc.inference_ranks]
        versions = {s["version"] for s in states if s is not None}
        version, consistent = (versions.pop() if len(versions) == 1 else None), None
    kill = get("fault/kill")
    detect_ms = None
    if kill is not None and not terminated:
        noticed = [get(f"error/{r}") for r in range(rc.world_size) if r != kill["rank"]]
        if all(n is not None for n in noticed):
            detect_ms = 1e3 * max(n["time"] - kill["time"] for n in noticed)
    summary.update({
        "error": error, "inference_version": version, "inference_consistent": consistent,
        "detect_ms": detect_ms, "fault": f"{rc.fault[0]}:{rc.fault[1]}" if rc.fault else None,
        "pids": [pids[r] for r in sorted(pids)]})
    assert tuple(summary) == SUMMARY_KEYS + FAILURE_KEYS
    return summary


def _plot(path: str, steps, refits, args) -> None:
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
    ax1.plot(rx, [r["pull_ms"] for r in refits], marker=".", label="pull (background in shadow mode)")
    ax1.plot(rx, [r["stall_ms"] for r in refits], marker=".", label="generation stall")
    ax1.set_xlabel("trainer step")
    ax1.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax1.set_ylabel("refit time per step (ms)")
    ax1.grid(alpha=0.3)
    ax1.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ============================================================================================
# Workers
# ============================================================================================
def _worker(rank: int, store, dstore, rc: _RunConfig) -> None:
    """Every spawned rank (run by the shared driver, which records a failure under ``error/<rank>``).

    Each role has its own default process group (trainers: ``pg-trainers-e<epoch>``, inference:
    ``pg-inference``), never one spanning both: restarted trainers form a new group of their own,
    while the inference processes' tensor-parallel group lives on."""
    import torch
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=rc.timeout)
    if rc.device == "cuda":
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    trainer = rank < rc.trainers
    epoch = int(dstore.add("trainer_epoch", 0)) if trainer else 0
    pg_name = f"pg-trainers-e{epoch}" if trainer else "pg-inference"
    group_rank = rank if trainer else rank - rc.trainers
    dist.init_process_group(rc.dist_backend, store=dist.PrefixStore(pg_name, store), rank=group_rank,
                            world_size=rc.trainers if trainer else rc.inference, timeout=timeout)
    dstore.add("ranks_up", 1)
    try:
        if trainer:
            _trainer_main(rank, rc, store, dstore, epoch, device)
        else:
            _inference_main(rank, rc, store, dstore, device)
    finally:
        dist.destroy_process_group()


def _fault_at(rc: _RunConfig, kind: str, k: int) -> bool:
    return rc.fault is not None and rc.fault == (kind, k)


def _kill_self(dstore, rank: int, rc: _RunConfig) -> None:
    """--fault kill-*: record when and who, then SIGKILL this process (no cleanup runs)."""
    dstore.set("fault/kill", json.dumps({"rank": rank, "pid": os.getpid(), "time": time.time(),
                                         "fault": f"{rc.fault[0]}:{rc.fault[1]}"}))
    os.kill(os.getpid(), signal.SIGKILL)


def _check_readers(tr) -> None:
    """Raises PeerDiedError if a rank of the refit group died (the engine's liveness call: no wait)."""
    from tritonreshard import PeerDiedError
    dead = tr.dead_peers()
    if dead:
        # The group's own reasons name each rank with its pid, as the engine's waits do.
        reasons = [tr.group.dead_reason(r) or f"rank {r} died" for r in dead]
        raise PeerDiedError(dead[0], "; ".join(reasons))


def _refit_store(store):
    """What the refit endpoints get as ``store``: the demo's own TCPStore (the driver hosts it),
    under a prefix; every epoch of the refit group keeps its keys apart inside it."""
    import torch.distributed as dist
    return dist.PrefixStore("refit", store)


# --- trainer checkpoints: one file per (version, rank); a version is complete when every rank's is there
def _ckpt_path(rc: _RunConfig, version: int, rank: int) -> str:
    return os.path.join(rc.checkpoint_dir, f"v{version:06d}-r{rank}.pt")


def _save_checkpoint(rc: _RunConfig, rank: int, version: int, state: dict) -> None:
    import torch
    path = _ckpt_path(rc, version, rank)
    torch.save(state, path + ".tmp")
    os.replace(path + ".tmp", path)  # atomic: a rank killed mid-write leaves no torn checkpoint
    old = _ckpt_path(rc, version - 2, rank)  # keep two: the newest may be incomplete on other ranks
    if os.path.exists(old):
        os.unlink(old)


def _last_checkpoint(rc: _RunConfig) -> int | None:
    """The newest version every trainer rank checkpointed, or None."""
    versions = None
    for r in rc.trainer_ranks:
        mine = {int(n[1:7]) for n in os.listdir(rc.checkpoint_dir) if n.endswith(f"-r{r}.pt")}
        versions = mine if versions is None else versions & mine
    return max(versions) if versions else None


def _trainer_main(rank, rc: _RunConfig, store, dstore, epoch: int, device) -> None:
    import torch
    from tritonreshard import RefitTrainer

    from . import _policy as P

    cfg = P.PolicyConfig()
    comm = P.Comm(device, "nccl" if "nccl" in rc.dist_backend else "gloo")
    tgroup = None  # this role's default process group: the trainers of this epoch
    src_layouts = P.trainer_layouts(cfg, rc.trainer_ranks)
    resume = _last_checkpoint(rc) if epoch > 0 else None
    if epoch > 0 and resume is None:
        raise RuntimeError(f"trainer epoch {epoch}: no complete checkpoint in {rc.checkpoint_dir} to restart from")
    if resume is None:
        full0 = P.init_params(cfg, rc.seed)
        local = {n: lay.shard(full0[n], rank).to(device) for n, lay in src_layouts.items()}
        ckpt = None
    else:
        ckpt = torch.load(_ckpt_path(rc, resume, rank), weights_only=False)
        local = {n: t.to(device) for n, t in ckpt["params"].items()}
    if rank == 0:
        dstore.set(f"trainers_up/{epoch}", "1")  # the inference group joins this epoch now

    # A restarted group resumes the version numbering: its first publish() is resume + 1.
    tr = RefitTrainer(local, src_layouts, rank=rank, world_size=rc.world_size, store=_refit_store(store),
                      timeout=rc.timeout, peer_timeout=rc.peer_timeout, epoch=epoch,
                      start_version=resume or 0)
    try:
        # Train on the arena tensors themselves: Parameter(t) shares t's storage, and Adam updates
        # in place, so every optimizer step writes straight into the published buffers.
        params = {n: torch.nn.Parameter(tr.tensors[n]) for n in src_layouts}
        for n, p in params.items():
            assert p.data_ptr() == tr.tensors[n].data_ptr()
        opt = torch.optim.Adam(params.values(), lr=rc.lr)
        tpos = rank  # this trainer's slice of every batch: prompts [tpos*n, (tpos+1)*n)
        per = rc.prompts // rc.trainers * rc.group
        if ckpt is None:
            version = tr.publish()
            full = P.gather_full(src_layouts, tr.tensors, rank, tgroup, comm)
            if rank == 0:
                _publish_probe(dstore, cfg, version, full)
            first_step, queue, dropped, published = 1, 0, 0, True
        else:
            # The inference group serves resume or resume - 1 and pulls resume + 1 next (the probe
            # of resume is in the store already: it was written before resume was published).
            opt.load_state_dict(ckpt["optimizer"])
            version, queue, dropped = resume, ckpt["queue"], ckpt["dropped"]
            full = P.gather_full(src_layouts, tr.tensors, rank, tgroup, comm)
            first_step, published = resume, False
        for step in range(first_step, rc.steps + 1):
            if rank == rc.trainers - 1 and _fault_at(rc, "crash-trainer", step) and epoch == 0:
                raise RuntimeError(f"injected failure (--fault crash-trainer:{step})")
            t_step = time.perf_counter()
            # Both trainers read the same queue in the same order and apply the same rule, so they
            # always pick the same batch without talking to each other.
            while True:
                key = f"traj/{queue}"
                wait_key(dstore, key, rc.timeout, check=lambda: _check_readers(tr))
                batch = pickle.loads(dstore.get(key))
                queue += 1
                staleness = version - batch["version"]
                if staleness <= rc.max_staleness:
                    break
                dropped += 1
            prompts = torch.from_numpy(batch["prompts"]).long()[tpos * per:(tpos + 1) * per].to(device)
            actions = torch.from_numpy(batch["actions"]).long()[tpos * per:(tpos + 1) * per].to(device)
            rewards = torch.from_numpy(batch["rewards"])
            adv = P.group_advantages(rewards, rc.group)[tpos * per:(tpos + 1) * per].to(device)

            # Forward/backward on the all-gathered weights (overlaps the inference pulls of `version`).
            leaves = {n: t.to(device).requires_grad_() for n, t in full.items()}
            loss = P.policy_loss(leaves, prompts, actions, adv, denom=rewards.numel())
            loss.backward()
            # Reduce-scatter, spelled out (gloo has none): one all-reduce over the flat gradient,
            # then each rank keeps its own rows.
            flat = torch.cat([leaves[n].grad.reshape(-1) for n in src_layouts])
            flat = comm.all_reduce(flat, tgroup)
            off = 0
            for n, lay in src_layouts.items():
                g = flat[off:off + lay.numel].view(lay.shape)
                off += lay.numel
                params[n].grad = lay.shard(g, rank).to(device)

            if published:
                tr.fence()  # every inference rank finished reading `version`: now it may change
            opt.step()
            nxt = version + 1
            # Before publishing nxt: its probe (so whoever installs nxt can verify it, even if this
            # rank dies right after publishing) and every rank's checkpoint of it (so a restarted
            # group resumes at or after anything the inference group can hold).
            full = P.gather_full(src_layouts, tr.tensors, rank, tgroup, comm)
            _save_checkpoint(rc, rank, nxt, {
                "params": {n: t.detach().cpu().clone() for n, t in tr.tensors.items()},
                "optimizer": opt.state_dict(), "queue": queue, "dropped": dropped})
            if rank == 0:
                _publish_probe(dstore, cfg, nxt, full)
                dstore.set(f"step/{step}", json.dumps({
                    "step": step, "version": nxt, "reward": float(rewards.mean()), "epoch": epoch,
                    "batch_version": batch["version"], "staleness": staleness, "dropped": dropped,
                    "loss": loss.item(), "step_ms": 1e3 * (time.perf_counter() - t_step)}))
                if step == rc.steps:
                    dstore.set("final_version", str(nxt))
                dstore.add("steps_done", 1)
            version = tr.publish()
            published = True
            assert version == nxt, (version, nxt)
            if rank == 0 and epoch == 0 and _fault_at(rc, "kill-trainer", version):
                # Land the kill while the inference group pulls `version` (it has swapped in
                # version - 1 by then), so it serves exactly version - 1 afterwards.
                wait_key(dstore, f"pull_started/{version}", rc.timeout)
                _kill_self(dstore, rank, rc)
        tr.fence()  # the last version is read by everyone before the arena goes away
        dstore.add("trainers_done", 1)
        # Keep the arena alive until every inference rank has closed its endpoint.
        wait_key(dstore, "inference_closed", rc.timeout)
    finally:
        tr.close()


def _publish_probe(dstore, cfg, version: int, full) -> None:
    from . import _policy as P
    logits = P.probe(cfg, full)
    dstore.set(f"probe/{version}", pickle.dumps({
        "weights_sha1": P.weights_digest(full), "logits": logits.numpy().tobytes()}))


def _inference_main(rank, rc: _RunConfig, store, dstore, device) -> None:
    import torch
    from tritonreshard import RefitInference, plan_reshard

    from . import _policy as P

    cfg = P.PolicyConfig()
    comm = P.Comm(device, "nccl" if "nccl" in rc.dist_backend else "gloo")
    igroup = None  # this role's default process group: the TP group
    tp_rank = rank - rc.trainers
    leader = tp_rank == 0
    dst_layouts = P.inference_layouts(cfg, rc.inference_ranks)
    src_layouts = P.trainer_layouts(cfg, rc.trainer_ranks)
    plan_bytes = plan_reshard(src_layouts, dst_layouts).stats.total_bytes
    pid = os.getpid()

    inf = RefitInference(dst_layouts, rank=rank, world_size=rc.world_size, store=_refit_store(store),
                         mode=rc.mode, device=device, backend=rc.backend, timeout=rc.timeout,
                         peer_timeout=rc.peer_timeout)
    try:
        inf.pull()  # waits (up to the timeout) for version 1, the trainers' initial weights
        assert inf.version == 1, inf.version
        if leader:
            dstore.set("pulled/1", "1")
        pending = {}  # version -> (weights sha1, probe logits) awaiting the trainer's probe
        verified = []
        bad = []
        _verify_local(rank, cfg, inf, dst_layouts, igroup, comm, leader, pending)

        gen = torch.Generator().manual_seed(rc.seed * 1000 + 17)
        sample_gen = torch.Generator().manual_seed(rc.seed * 1000 + 23)
        n_rows = rc.prompts * rc.group
        batch_id = 0
        refits = 0
        pulling = None          # version being pulled into the shadow (all TP ranks agree)
        orphaned = False        # --restart: the trainers' epoch ended; wait for the next one
        final_version = None
        max_stall = 0.0
        while True:
            # ---- generation boundary: one MIN all-reduce makes every TP rank take the same decision
            if final_version is None and dstore.check(["final_version"]):
                final_version = int(dstore.get("final_version"))
            done = pulling is not None and inf.pull_done()
            failed = done and inf.pull_error() is not None
            aborted = dstore.check(["abort"])  # the driver saw a rank fail and is stopping the demo
            # The trainers' epoch the driver started last, if its rank 0 is up to meet us.
            epoch = int(dstore.add("trainer_epoch", 0))
            epoch = epoch if dstore.check([f"trainers_up/{epoch}"]) else inf.epoch
            latest = inf.version if orphaned else inf.available_version()
            state = torch.tensor([latest, int(done), int(final_version is not None and
                                  inf.version == final_version and pulling is None), int(not failed),
                                  int(not aborted), epoch], dtype=torch.int64)
            latest, all_done, all_finished, all_ok, go_on, epoch = comm.all_reduce_min(state, igroup).tolist()
            if not go_on or (not all_ok and not rc.restart):
                # Some TP rank's pull failed, or another rank of the demo did: every TP rank drops
                # its pull (even a successful one), so the group keeps serving one complete version.
                noticed = time.time()
                cause = _drop_pull(inf, rc, pulling)
                if cause is None:
                    cause = (f"another TP rank's pull of version {pulling} failed" if not all_ok else
                             f"the demo is stopping ({dstore.get('abort').decode()})" if aborted else
                             "another TP rank saw the demo stop")
                _fail_group(rank, inf, dstore, igroup, comm, leader, dst_layouts, refits, plan_bytes,
                            f"refit of version {pulling} failed" if pulling is not None else "refit stopped",
                            cause, noticed)
            if not all_ok or epoch > inf.epoch:
                # --restart: the trainers failed (a pull says so, or the driver already started new
                # ones). Drop the pull together, keep serving, and join the new epoch once its
                # trainers are up; this process and its weights live on.
                if pulling is not None:
                    _drop_pull(inf, rc, pulling)
                    pulling = None
                orphaned = True
                if epoch > inf.epoch:
                    inf.rejoin(epoch=epoch)
                    orphaned = False
                    latest = inf.available_version()
                else:
                    latest = inf.version
            if all_finished:
                break
            stall = None
            if orphaned:
                pass  # nothing to pull until the new trainers are up
            elif rc.mode == "shadow":
                if pulling is not None and all_done:
                    t = time.perf_counter()
                    serving = inf.swap()
                    stall = time.perf_counter() - t
                    installed_at = time.time()
                    if serving != pulling:
                        raise RuntimeError(f"rank {rank}: swapped in version {serving}, expected {pulling}")
                    pulling = None
                if pulling is None and latest > inf.version:
                    if leader and _fault_at(rc, "kill-inference", inf.version + 1):
                        _kill_self(dstore, rank, rc)
                    started = inf.start_pull()
                    if started != inf.version + 1:
                        # The fence keeps the trainers at most one version ahead of the slowest
                        # pull, so every TP rank starts on the same version.
                        raise RuntimeError(f"rank {rank}: start_pull() returned {started}, expected "
                                           f"{inf.version + 1}")
                    pulling = started
                    if leader:
                        dstore.set(f"pull_started/{started}", "1")
            elif latest > inf.version:
                if leader and _fault_at(rc, "kill-inference", inf.version + 1):
                    _kill_self(dstore, rank, rc)
                if leader:
                    dstore.set(f"pull_started/{inf.version + 1}", "1")
                t = time.perf_counter()
                cause = None
                try:
                    inf.pull()
                except Exception as e:  # noqa: BLE001 -- torn: inf.consistent is False now; decided together below
                    cause = e
                stall = time.perf_counter() - t
                installed_at = time.time()
                ok = comm.all_reduce_min(torch.tensor([int(cause is None)], dtype=torch.int64), igroup)
                if not int(ok):
                    _fail_group(rank, inf, dstore, igroup, comm, leader, dst_layouts, refits, plan_bytes,
                                f"in-place refit of version {latest} failed",
                                cause or "another TP rank's pull failed", time.time())
            if stall is not None:
                refits += 1
                # The slowest TP rank decides both the refit time and the stall.
                pull_s, stall_t = comm.all_reduce_max(
                    torch.tensor([inf.last_pull.total_ms / 1e3, stall], dtype=torch.float64), igroup).tolist()
                tp_diff = _verify_local(rank, cfg, inf, dst_layouts, igroup, comm, leader, pending)
                if leader:
                    max_stall = max(max_stall, stall_t)
                    dstore.set(f"refit/{refits}", json.dumps({
                        "version": inf.version, "pull_ms": 1e3 * pull_s, "stall_ms": 1e3 * stall_t,
                        "tp_max_abs_diff": tp_diff, "epoch": inf.epoch, "time": installed_at}))
                    dstore.add("refits_done", 1)
            if leader:
                _check_pending(dstore, pending, verified, bad, block=False)

            # ---- one rollout batch on the serving weights (re-read: swap() replaces the dict)
            w = inf.tensors
            version = inf.version
            prompts = torch.randint(0, cfg.vocab, (rc.prompts, cfg.length), generator=gen)
            prompts = prompts.repeat_interleave(rc.group, 0).to(device)
            actions = torch.empty_like(prompts)
            prev = torch.full((n_rows,), cfg.bos, dtype=torch.int64, device=device)
            with torch.no_grad():
                for t in range(cfg.length):
                    pos = torch.full((n_rows,), t, dtype=torch.int64, device=device)
                    logits = P.tp_forward(w, prompts[:, t], prev, pos, igroup, comm)
                    # Sample on one rank and broadcast: TP ranks must continue the same sequences.
                    a = torch.multinomial(torch.softmax(logits.float().cpu(), -1), 1, generator=sample_gen).squeeze(1)
                    a = comm.broadcast(a.to(device), 0, igroup)  # TP rank 0 of the inference group
                    actions[:, t] = a
                    prev = a
            if leader:
                r = P.reward(cfg, prompts, actions)
                dstore.set(f"traj/{batch_id}", pickle.dumps({
                    "version": version, "prompts": prompts.cpu().to(torch.int8).numpy(),
                    "actions": actions.cpu().to(torch.int8).numpy(), "rewards": r.cpu().numpy()}))
            batch_id += 1

        if leader:
            _check_pending(dstore, pending, verified, bad, block=True, timeout=rc.timeout)
            if bad:
                print(f"rank {rank}: probe mismatch for versions {bad}", file=sys.stderr)
        ours = torch.tensor([int(inf.bytes_per_refit), int(inf.staging_bytes)], dtype=torch.int64)
        total, staging = comm.all_reduce(ours, igroup).tolist()
        if leader:
            dstore.set("inference_summary", json.dumps({
                "refits": refits, "verified": not bad and len(verified) == refits + 1,
                "verified_versions": len(verified), "bad_versions": bad, "max_stall_ms": 1e3 * max_stall,
                "bytes_per_refit": int(total) or plan_bytes, "plan_bytes": plan_bytes,
                "staging_bytes": int(staging), "final_version": inf.version, "batches": batch_id}))
        dstore.set(f"pid/{rank}", json.dumps({"start": pid, "end": os.getpid()}))
    finally:
        dstore.set(f"inference_state/{rank}", json.dumps({"version": inf.version, "consistent": inf.consistent}))
        inf.close()
        if dstore.add("inference_closed_count", 1) == len(rc.inference_ranks):
            dstore.set("inference_closed", "1")


def _drop_pull(inf, rc: _RunConfig, pulling):
    """Every TP rank, after the group decided to drop its pull: wait for it to end (its own waits are
    bounded), discard it; returns its error (None if it had succeeded or none was running)."""
    if pulling is None:
        return None
    poll_until(inf.pull_done, timeout=2 * rc.timeout, what=f"the pull of version {pulling} to end")
    cause = inf.pull_error()
    inf.discard()
    return cause


class InferenceGroupStopped(RuntimeError):
    """The inference group stopped refitting together; ``noticed_at``: when it noticed (wall time)."""

    def __init__(self, message: str, noticed_at: float):
        super().__init__(message)
        self.noticed_at = noticed_at


def _fail_group(rank, inf, dstore, igroup, comm, leader, dst_layouts, refits, plan_bytes, what, cause,
                noticed) -> None:
    """Every TP rank, together, after the group decided to stop: check what the group serves (all
    ranks on one version, none torn, and the gathered weights' digest equal to the digest the
    trainers published for that version), record it as ``inference_final``, then raise."""
    import torch

    from . import _policy as P

    vmin, neg_vmax, cons = comm.all_reduce_min(
        torch.tensor([inf.version, -inf.version, int(inf.consistent)], dtype=torch.int64), igroup).tolist()
    ours = torch.tensor([int(inf.bytes_per_refit), int(inf.staging_bytes)], dtype=torch.int64)
    total, staging = comm.all_reduce(ours, igroup).tolist()
    full = P.gather_full(dst_layouts, inf.tensors, rank, igroup, comm)
    same = vmin == -neg_vmax
    if leader:
        sha = P.weights_digest(full)
        key = f"probe/{vmin}"  # the trainers published it before they published vmin
        ref = pickle.loads(dstore.get(key))["weights_sha1"] if dstore.check([key]) else None
        dstore.set("inference_final", json.dumps({
            "version": vmin if same else None,
            "consistent": None if ref is None else bool(cons and same and sha == ref),
            "weights_sha1": sha, "expected_sha1": ref, "refits": refits,
            "bytes_per_refit": int(total) or plan_bytes, "staging_bytes": int(staging)}))
    cause = cause if isinstance(cause, str) else (str(cause).splitlines()[0] if str(cause) else type(cause).__name__)
    raise InferenceGroupStopped(f"{what}: {cause}; the inference group serves version "
                                f"{vmin if same else (vmin, -neg_vmax)}", noticed)


def _verify_local(rank, cfg, inf, dst_layouts, igroup, comm, leader, pending):
    """All TP ranks: gather the serving shards into full weights and run the probes; the leader
    records (weights digest, dense probe logits) for comparison with the trainer's. Returns the max
    abs difference between the TP forward and the dense forward on the probe inputs."""
    import torch
    from . import _policy as P

    full = P.gather_full(dst_layouts, inf.tensors, rank, igroup, comm)
    prompts, prev = P.probe_inputs(cfg)
    pos = torch.arange(cfg.length).repeat(prompts.shape[0])
    dev = next(iter(inf.tensors.values())).device
    with torch.no_grad():
        tp = P.tp_forward(inf.tensors, prompts.reshape(-1).to(dev), prev.reshape(-1).to(dev),
                          pos.to(dev), igroup, comm).cpu()
    if not leader:
        return 0.0
    dense = P.probe(cfg, full)
    pending[inf.version] = (P.weights_digest(full), dense)
    return float((tp.view_as(dense) - dense).abs().max())


def _check_pending(dstore, pending, verified, bad, block: bool, timeout: float = 0.0) -> None:
    import numpy as np
    for v in sorted(pending):
        key = f"probe/{v}"
        if not block and not dstore.check([key]):
            continue
        if block:
            dstore.wait([key], datetime.timedelta(seconds=timeout))
        ref = pickle.loads(dstore.get(key))
        sha, logits = pending.pop(v)
        ours = logits.numpy().tobytes()
        if ref["weights_sha1"] == sha and ref["logits"] == ours:
            verified.append(v)
        else:
            diff = np.abs(np.frombuffer(ref["logits"], dtype=np.float32) - logits.numpy().reshape(-1)).max()
            bad.append({"version": v, "weights_match": ref["weights_sha1"] == sha, "max_abs_diff": float(diff)})


def _main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tritonreshard.apps.demo", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(_main())
