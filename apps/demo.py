"""``tritonreshard demo``: an asynchronous RL loop whose policy refits through tritonreshard.

Processes (spawned, one per rank; global ranks ``0..T-1`` train, ``T..T+I-1`` serve)::

    trainers (FSDP rows, Shard(0))                 inference (tensor parallel, TP = I)
    ------------------------------                 -------------------------------------------
    all-gather rows -> forward/backward            generate rollouts on the serving weights,
    on trajectories from the queue                 every token: column-parallel gate_up,
    all-reduce grads, keep own rows                row-parallel down + all-reduce, vocab-
    tr.fence()    (readers acked newest)           parallel lm_head + all-gather
    optimizer.step() on tr.tensors (the arena)     at each rollout boundary (all TP ranks agree
    tr.publish()  -> version v                     through one MIN all-reduce): start_pull() the
    probe logits + weight digest of v -> store     newest version in the background, keep
                                                   generating, swap() when every TP rank is done
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

Numbers (``--json`` prints them as the last stdout line): ``refit_ms_p50`` is the median copy time
of a pull (``last_pull_seconds`` of the slowest TP rank); ``max_inference_stall_ms`` the longest
time generation paused for a refit (shadow: the ``swap()``; in-place: the whole ``pull()``); the
verification gather and probe are instrumentation and not counted. ``bytes_per_refit`` sums the
bytes every inference rank writes per refit; ``staleness_max`` is the largest ``v - version`` of a
trajectory the trainers used.

Faults (``--fault``, see its help): a rank's failure makes the driver set an ``abort`` key that
ranks waiting on the store poll; ranks blocked in a collective get gloo's "connection closed" at
once; the engine raises PeerDiedError in fences and pulls. The inference group decides at each
rollout boundary through its MIN all-reduce whether every TP rank's pull succeeded and nothing
aborted: if not, every TP rank discards its pull, the group verifies what it serves (digest against
the trainers' digest of that version) and records it, then exits. Survivors get ``--peer-timeout``
+ 10 s to exit on their own before the driver terminates them.

Entry points (wired by ``apps/cli.py``): :func:`add_arguments` and :func:`run`.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import pickle
import signal
import statistics
import sys
import time
import traceback
from dataclasses import dataclass

__all__ = ["add_arguments", "run"]

SUMMARY_KEYS = ("steps", "refits", "verified", "reward_first", "reward_last", "refit_ms_p50",
                "max_inference_stall_ms", "bytes_per_refit", "staleness_max")
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
    port: int
    peer_timeout: float = 10.0
    fault: tuple[str, int] | None = None  # (kind, K) from --fault

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
    import torch.distributed as dist
    import torch.multiprocessing as mp
    from tqdm import tqdm

    shm_before = _shm_entries()
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=args.timeout))
    dstore = dist.PrefixStore("demo", store)
    world = args.trainers + args.inference
    if args.device == "cuda" and torch.cuda.device_count() >= world:
        dist_backend = "cpu:gloo,cuda:nccl"
    else:
        dist_backend = "gloo"  # CUDA tensors are staged through the CPU for the collectives
    rc = _RunConfig(steps=args.steps, trainers=args.trainers, inference=args.inference, mode=args.mode,
                    backend=args.backend, device=args.device, dist_backend=dist_backend,
                    max_staleness=args.max_staleness, prompts=args.prompts, group=args.group,
                    lr=args.lr, seed=args.seed, timeout=args.timeout, port=store.port,
                    peer_timeout=args.peer_timeout,
                    fault=_parse_fault(args.fault, args.steps) if args.fault else None)

    from tritonreshard._rendezvous import secret_for_children

    secret_for_children()  # children inherit it; it never crosses the store
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_worker, args=(rank, rc), name=f"trs-demo-rank{rank}") for rank in range(world)]
    t0 = time.perf_counter()
    for p in procs:
        p.start()

    failure = None
    seen_steps = 0
    exited_at: dict[int, float] = {}  # rank -> wall time the driver saw it exit
    first_failure = None              # wall time the driver saw the first rank fail
    grace = rc.peer_timeout + 10.0    # how long survivors get to notice a failure and exit
    terminated: list[int] = []
    bar = tqdm(total=args.steps, desc="refit demo", unit="step", file=sys.stderr, dynamic_ncols=True)
    try:
        while True:
            codes = [p.exitcode for p in procs]  # exitcode reaps: a killed rank stops being a zombie
            now = time.time()
            for r, c in enumerate(codes):
                if c is not None and r not in exited_at:
                    exited_at[r] = now
            bad = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
            if bad and first_failure is None:
                first_failure = now
                # Ranks waiting on the store (trajectories, the end of the run) stop at once.
                dstore.set("abort", _describe_failure(dstore, rc, bad, exited_at))
            if all(c is not None for c in codes):
                break
            if first_failure is not None and now - first_failure > grace:
                terminated = [r for r, c in enumerate(codes) if c is None]
                break
            if time.perf_counter() - t0 > args.timeout:
                alive = [r for r, c in enumerate(codes) if c is None]
                failure = f"timed out after {args.timeout:.0f} s; ranks still running: {alive}"
                break
            done = dstore.add("steps_done", 0)
            while seen_steps < done:
                seen_steps += 1
                m = json.loads(dstore.get(f"step/{seen_steps}"))
                post = {"reward": f"{m['reward']:.3f}", "version": m["version"]}
                refits = dstore.add("refits_done", 0)
                if refits:
                    r = json.loads(dstore.get(f"refit/{refits}"))
                    post["refit_ms"] = f"{r['pull_ms']:.1f}"
                bar.set_postfix(post)
                bar.update(1)
            time.sleep(0.02)
    finally:
        bar.close()
        if failure is not None or first_failure is not None:
            _stop(procs)
        for p in procs:
            p.join(timeout=10)
        _stop(procs)

    leaked = sorted(_shm_entries() - shm_before)
    if first_failure is not None and failure is None:
        bad = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode != 0 and r not in terminated]
        failure = _describe_failure(dstore, rc, bad, exited_at)
        if terminated:
            failure += (f"; rank(s) {terminated} still running {grace:g} s after the first failure "
                        f"were terminated")
    if failure is not None:
        print(f"tritonreshard demo failed: {failure}", file=sys.stderr)
        # Ranks killed while blocked in a collective never ran their close(); their segments are
        # ours to remove (all children are dead by now).
        removed = _remove_segments(leaked)
        if removed:
            print(f"tritonreshard demo: removed {len(removed)} shared-memory segments of killed ranks",
                  file=sys.stderr)
        if args.json:
            summary = _summarize_failure(dstore, rc, failure, procs, terminated)
            inf = (f"inference serves version {summary['inference_version']} (consistent: "
                   f"{summary['inference_consistent']})")
            det = "" if summary["detect_ms"] is None else f"; survivors noticed within {summary['detect_ms']:.0f} ms"
            print(f"tritonreshard demo: {inf}{det}", file=sys.stderr)
            print(json.dumps(summary))
        return 1

    summary, steps, refits = _summarize(dstore, rc)
    wall = time.perf_counter() - t0
    print(f"tritonreshard demo: {summary['steps']} steps, {summary['refits']} refits "
          f"({args.mode}, {args.backend} backend, {args.trainers} trainers -> {args.inference} TP ranks) in "
          f"{wall:.1f} s; reward {summary['reward_first']:.3f} -> {summary['reward_last']:.3f}; refit p50 "
          f"{summary['refit_ms_p50']:.2f} ms, longest stall {summary['max_inference_stall_ms']:.2f} ms, "
          f"{summary['bytes_per_refit']} B per refit; verified={summary['verified']}; "
          f"max |TP - dense| {max((r['tp_max_abs_diff'] for r in refits), default=0.0):.2e}",
          file=sys.stderr)
    if leaked:  # every rank closed its endpoint, so a segment left here is a bug
        print(f"tritonreshard demo: /dev/shm entries left behind: {leaked}", file=sys.stderr)
    if args.png:
        _plot(args.png, steps, refits, args)
    if args.json:
        print(json.dumps(summary))
    del store
    return 0 if summary["verified"] and not leaked else 1


def _shm_entries() -> set[str]:
    """The engine's named segments in /dev/shm (``trs-*``; its fd-passed segments have no name).
    Other entries belong to other programs (e.g. ``sem.mp-*`` of a concurrent multiprocessing run)."""
    try:
        return {n for n in os.listdir("/dev/shm") if n.startswith("trs-")}
    except FileNotFoundError:
        return set()


def _remove_segments(names) -> list[str]:
    removed = []
    for name in names:
        if name.startswith("trs-"):
            try:
                os.unlink(os.path.join("/dev/shm", name))
                removed.append(name)
            except FileNotFoundError:
                pass
    return removed


def _role(rc: _RunConfig, rank: int) -> str:
    if rank < rc.trainers:
        return f"trainer {rank}"
    return f"inference, TP rank {rank - rc.trainers}"


def _describe_failure(dstore, rc: _RunConfig, bad, exited_at=None) -> str:
    """One line per failed rank, the earliest first (later ones are usually its echoes: a peer's
    PeerDiedError or a collective's connection reset). A rank killed by a signal wrote no error;
    it is dated by the fault record (a --fault kill) or when the driver saw it exit."""
    kill = json.loads(dstore.get("fault/kill")) if dstore.check(["fault/kill"]) else None
    failed = []
    for rank, code in bad:
        key = f"error/{rank}"
        when, detail = (exited_at or {}).get(rank, float("inf")), ""
        if dstore.check([key]):
            err = json.loads(dstore.get(key))
            when, detail = err["time"], err["traceback"].strip().splitlines()[-1]
        elif code is not None and code < 0:
            detail = f"killed by {signal.Signals(-code).name}"
            if kill is not None and kill["rank"] == rank:
                when, detail = kill["time"], detail + f" (--fault {kill['fault']})"
        failed.append((when, rank, code, detail))
    return "; ".join(f"rank {rank} ({_role(rc, rank)}) exited with code {code}" + (f": {detail}" if detail else "")
                     for _, rank, code, detail in sorted(failed))


def _stop(procs) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()  # SIGTERM -> SystemExit in the worker, so endpoints close and unlink
    deadline = time.monotonic() + 5
    for p in procs:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(timeout=5)


def _summarize(dstore, rc: _RunConfig):
    steps = [json.loads(dstore.get(f"step/{s}")) for s in range(1, rc.steps + 1)]
    inf = json.loads(dstore.get("inference_summary"))
    refits = [json.loads(dstore.get(f"refit/{i}")) for i in range(1, inf["refits"] + 1)]
    k = max(1, min(5, len(steps) // 4))
    pull_ms = [r["pull_ms"] for r in refits]
    summary = {
        "steps": len(steps),
        "refits": inf["refits"],
        "verified": bool(inf["verified"] and inf["verified_versions"] == rc.steps + 1),
        "reward_first": float(statistics.fmean(s["reward"] for s in steps[:k])),
        "reward_last": float(statistics.fmean(s["reward"] for s in steps[-k:])),
        "refit_ms_p50": float(statistics.median(pull_ms)) if pull_ms else 0.0,
        "max_inference_stall_ms": float(max((r["stall_ms"] for r in refits), default=0.0)),
        "bytes_per_refit": int(inf["bytes_per_refit"]),
        "staleness_max": int(max(s["staleness"] for s in steps)),
    }
    assert tuple(summary) == SUMMARY_KEYS
    return summary, steps, refits


def _summarize_failure(dstore, rc: _RunConfig, error: str, procs, terminated) -> dict:
    """The summary of a failed run: SUMMARY_KEYS over what got done, then FAILURE_KEYS.

    ``inference_version`` / ``inference_consistent`` are what the inference group holds at the end:
    when it noticed the failure together it verified its serving weights (gather + digest against
    the trainers' digest of that version) and recorded them; otherwise the version is the one every
    surviving inference rank reported (None if they differ) and consistency is unknown (None).
    ``detect_ms``: for a --fault kill, the slowest surviving rank's time from the kill to noticing
    it (its first error); None if a survivor never noticed (the driver had to terminate it)."""
    get = lambda k: json.loads(dstore.get(k)) if dstore.check([k]) else None  # noqa: E731
    steps = [get(f"step/{s}") for s in range(1, int(dstore.add("steps_done", 0)) + 1)]
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
        "pids": [p.pid for p in procs]})
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
def _worker(rank: int, rc: _RunConfig) -> None:
    """Entry point of every spawned rank."""
    import torch
    import torch.distributed as dist

    def _sigterm(signum, frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, _sigterm)
    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=rc.timeout)
    store = dist.TCPStore("127.0.0.1", rc.port, is_master=False, timeout=timeout)
    dstore = dist.PrefixStore("demo", store)
    try:
        if rc.device == "cuda":
            device = torch.device("cuda", rank % torch.cuda.device_count())
            torch.cuda.set_device(device)
        else:
            device = torch.device("cpu")
        dist.init_process_group(rc.dist_backend, store=dist.PrefixStore("pg", store), rank=rank,
                                world_size=rc.world_size, timeout=timeout)
        # Every rank creates both subgroups, in the same order (new_group is collective).
        tgroup = dist.new_group(list(rc.trainer_ranks))
        igroup = dist.new_group(list(rc.inference_ranks))
        if rank < rc.trainers:
            _trainer_main(rank, rc, store, dstore, tgroup, device)
        else:
            _inference_main(rank, rc, store, dstore, igroup, device)
        dist.barrier()
        dist.destroy_process_group()
    except BaseException as e:
        if not (isinstance(e, SystemExit) and e.code in (0, None)):
            # "time": when this rank noticed the failure (the inference group notices together,
            # then verifies and records what it serves before it raises).
            noticed = getattr(e, "noticed_at", None) or time.time()
            dstore.set(f"error/{rank}", json.dumps({"time": noticed, "exit_time": time.time(),
                                                    "traceback": traceback.format_exc()}))
        raise


def _fault_at(rc: _RunConfig, kind: str, k: int) -> bool:
    return rc.fault is not None and rc.fault == (kind, k)


def _kill_self(dstore, rank: int, rc: _RunConfig) -> None:
    """--fault kill-*: record when and who, then SIGKILL this process (no cleanup runs)."""
    dstore.set("fault/kill", json.dumps({"rank": rank, "pid": os.getpid(), "time": time.time(),
                                         "fault": f"{rc.fault[0]}:{rc.fault[1]}"}))
    os.kill(os.getpid(), signal.SIGKILL)


def _wait_key(dstore, key: str, timeout: float, check=None) -> None:
    """Wait for ``key`` in the store, but stop at once when the driver set ``abort`` (another rank
    failed) and call ``check()`` (e.g. a liveness probe of the refit peers) while waiting."""
    deadline = time.monotonic() + timeout
    while not dstore.check([key]):
        if dstore.check(["abort"]):
            raise RuntimeError(f"stopped waiting for {key!r}: {dstore.get('abort').decode()}")
        if check is not None:
            check()
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:g} s waiting for {key!r}")
        time.sleep(0.02)


def _readers_alive(tr) -> None:
    """Raises PeerDiedError if a reader of ``tr``'s arena died: ``fence`` with no time to wait checks
    the readers' liveness once; readers merely behind are fine here (the real fence comes later)."""
    try:
        tr.fence(timeout=0.0)
    except TimeoutError:
        pass


def _refit_store(rc: _RunConfig, store):
    """What the refit endpoints get as ``store``: the demo's own TCPStore, under a prefix."""
    import torch.distributed as dist
    return dist.PrefixStore("refit", store)


def _trainer_main(rank, rc: _RunConfig, store, dstore, tgroup, device) -> None:
    import torch
    from . import _policy as P
    from tritonreshard.refit import RefitTrainer

    cfg = P.PolicyConfig()
    comm = P.Comm(device, "nccl" if "nccl" in rc.dist_backend else "gloo")
    src_layouts = P.trainer_layouts(cfg, rc.trainer_ranks)
    full0 = P.init_params(cfg, rc.seed)
    local = {n: lay.shard(full0[n], rank).to(device) for n, lay in src_layouts.items()}

    tr = RefitTrainer(local, src_layouts, rank=rank, world_size=rc.world_size,
                      store=_refit_store(rc, store), timeout=rc.timeout, peer_timeout=rc.peer_timeout)
    try:
        # Train on the arena tensors themselves: Parameter(t) shares t's storage, and Adam updates
        # in place, so every optimizer step writes straight into the published buffers.
        params = {n: torch.nn.Parameter(tr.tensors[n]) for n in src_layouts}
        for n, p in params.items():
            assert p.data_ptr() == tr.tensors[n].data_ptr()
        opt = torch.optim.Adam(params.values(), lr=rc.lr)
        version = tr.publish()
        full = P.gather_full(src_layouts, tr.tensors, rank, tgroup, comm)
        if rank == 0:
            _publish_probe(dstore, cfg, version, full)

        tpos = rank  # this trainer's slice of every batch: prompts [tpos*n, (tpos+1)*n)
        per = rc.prompts // rc.trainers * rc.group
        queue = 0
        dropped = 0
        for step in range(1, rc.steps + 1):
            if rank == rc.trainers - 1 and _fault_at(rc, "crash-trainer", step):
                raise RuntimeError(f"injected failure (--fault crash-trainer:{step})")
            t_step = time.perf_counter()
            # Both trainers read the same queue in the same order and apply the same rule, so they
            # always pick the same batch without talking to each other.
            while True:
                key = f"traj/{queue}"
                _wait_key(dstore, key, rc.timeout, check=lambda: _readers_alive(tr))
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

            tr.fence()  # every inference rank finished reading `version`: now it may change
            opt.step()
            version = tr.publish()
            if rank == 0 and _fault_at(rc, "kill-trainer", version):
                _kill_self(dstore, rank, rc)  # the inference ranks are about to pull `version`
            full = P.gather_full(src_layouts, tr.tensors, rank, tgroup, comm)
            if rank == 0:
                _publish_probe(dstore, cfg, version, full)
                dstore.set(f"step/{step}", json.dumps({
                    "step": step, "version": version, "reward": float(rewards.mean()),
                    "batch_version": batch["version"], "staleness": staleness, "dropped": dropped,
                    "loss": loss.item(), "step_ms": 1e3 * (time.perf_counter() - t_step)}))
                if step == rc.steps:
                    dstore.set("final_version", str(version))
                dstore.add("steps_done", 1)
        tr.fence()  # the last version is read by everyone before the arena goes away
        dstore.add("trainers_done", 1)
        # Keep the arena alive until every inference rank has closed its endpoint.
        _wait_key(dstore, "inference_closed", rc.timeout)
    finally:
        tr.close()


def _publish_probe(dstore, cfg, version: int, full) -> None:
    from . import _policy as P
    logits = P.probe(cfg, full)
    dstore.set(f"probe/{version}", pickle.dumps({
        "weights_sha1": P.weights_digest(full), "logits": logits.numpy().tobytes()}))


def _inference_main(rank, rc: _RunConfig, store, dstore, igroup, device) -> None:
    import torch
    from . import _policy as P
    from tritonreshard.plan import plan_reshard
    from tritonreshard.refit import RefitInference

    cfg = P.PolicyConfig()
    comm = P.Comm(device, "nccl" if "nccl" in rc.dist_backend else "gloo")
    tp_rank = rank - rc.trainers
    leader = tp_rank == 0
    dst_layouts = P.inference_layouts(cfg, rc.inference_ranks)
    src_layouts = P.trainer_layouts(cfg, rc.trainer_ranks)
    plan_bytes = plan_reshard(src_layouts, dst_layouts).stats.total_bytes

    inf = RefitInference(dst_layouts, rank=rank, world_size=rc.world_size,
                         store=_refit_store(rc, store), mode=rc.mode, device=device,
                         backend=rc.backend, timeout=rc.timeout, peer_timeout=rc.peer_timeout)
    try:
        inf.pull()  # waits (up to the timeout) for version 1, the trainers' initial weights
        assert inf.version == 1, inf.version
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
        final_version = None
        max_stall = 0.0
        while True:
            # ---- generation boundary: one MIN all-reduce makes every TP rank take the same decision
            if final_version is None and dstore.check(["final_version"]):
                final_version = int(dstore.get("final_version"))
            done = pulling is not None and inf.pull_done()
            failed = done and inf.pull_error() is not None
            aborted = dstore.check(["abort"])  # the driver saw a rank fail
            state = torch.tensor([inf.available_version(), int(done), int(final_version is not None and
                                  inf.version == final_version and pulling is None), int(not failed),
                                  int(not aborted)], dtype=torch.int64)
            latest, all_done, all_finished, all_ok, go_on = comm.all_reduce_min(state, igroup).tolist()
            if not (all_ok and go_on):
                # Some TP rank's pull failed, or another rank of the demo did: every TP rank drops
                # its pull (even a successful one), so the group keeps serving one complete version.
                noticed = time.time()
                cause = None
                if pulling is not None:
                    deadline = time.monotonic() + 2 * rc.timeout  # the pull's own waits are bounded
                    while not inf.pull_done() and time.monotonic() < deadline:
                        time.sleep(0.005)
                    cause = inf.pull_error() if inf.pull_done() else None
                    inf.discard()
                if cause is None:
                    cause = (f"another TP rank's pull of version {pulling} failed" if not all_ok else
                             f"the demo is stopping: {dstore.get('abort').decode()}" if aborted else
                             "another TP rank saw the demo stop")
                _fail_group(rank, inf, dstore, igroup, comm, leader, dst_layouts, refits, plan_bytes,
                            f"refit of version {pulling} failed" if pulling is not None else "refit stopped",
                            cause, noticed)
            if all_finished:
                break
            stall = None
            if rc.mode == "shadow":
                if pulling is not None and all_done:
                    t = time.perf_counter()
                    serving = inf.swap()
                    stall = time.perf_counter() - t
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
            elif latest > inf.version:
                if leader and _fault_at(rc, "kill-inference", inf.version + 1):
                    _kill_self(dstore, rank, rc)
                t = time.perf_counter()
                cause = None
                try:
                    inf.pull()
                except Exception as e:  # torn: inf.consistent is False now
                    cause = e
                stall = time.perf_counter() - t
                ok = comm.all_reduce_min(torch.tensor([int(cause is None)], dtype=torch.int64), igroup)
                if not int(ok):
                    _fail_group(rank, inf, dstore, igroup, comm, leader, dst_layouts, refits, plan_bytes,
                                f"in-place refit of version {latest} failed",
                                cause or "another TP rank's pull failed", time.time())
            if stall is not None:
                refits += 1
                # The slowest TP rank decides both the refit time and the stall.
                pull_s, stall_t = comm.all_reduce_max(
                    torch.tensor([inf.last_pull_seconds, stall], dtype=torch.float64), igroup).tolist()
                tp_diff = _verify_local(rank, cfg, inf, dst_layouts, igroup, comm, leader, pending)
                if leader:
                    max_stall = max(max_stall, stall_t)
                    dstore.set(f"refit/{refits}", json.dumps({
                        "version": inf.version, "pull_ms": 1e3 * pull_s, "stall_ms": 1e3 * stall_t,
                        "tp_max_abs_diff": tp_diff}))
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
                    a = comm.broadcast(a.to(device), rc.inference_ranks[0], igroup)
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
        bytes_per_refit = getattr(inf, "bytes_per_refit", None)
        ours = torch.tensor([int(bytes_per_refit) if bytes_per_refit is not None else -1], dtype=torch.int64)
        total = comm.all_reduce(ours, igroup)
        if leader:
            dstore.set("inference_summary", json.dumps({
                "refits": refits, "verified": not bad and len(verified) == refits + 1,
                "verified_versions": len(verified), "bad_versions": bad, "max_stall_ms": 1e3 * max_stall,
                "bytes_per_refit": int(total) if int(ours) >= 0 else plan_bytes, "plan_bytes": plan_bytes,
                "batches": batch_id}))
    finally:
        dstore.set(f"inference_state/{rank}", json.dumps({"version": inf.version, "consistent": inf.consistent}))
        inf.close()
        if dstore.add("inference_closed_count", 1) == len(rc.inference_ranks):
            dstore.set("inference_closed", "1")


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
    ours = torch.tensor([int(inf.bytes_per_refit)], dtype=torch.int64)
    total = int(comm.all_reduce(ours, igroup))
    full = P.gather_full(dst_layouts, inf.tensors, rank, igroup, comm)
    same = vmin == -neg_vmax
    if leader:
        sha = P.weights_digest(full)
        key = f"probe/{vmin}"  # the trainers published it before they published vmin + 1
        ref = pickle.loads(dstore.get(key))["weights_sha1"] if dstore.check([key]) else None
        dstore.set("inference_final", json.dumps({
            "version": vmin if same else None,
            "consistent": None if ref is None else bool(cons and same and sha == ref),
            "weights_sha1": sha, "expected_sha1": ref, "refits": refits,
            "bytes_per_refit": total or plan_bytes}))
    raise InferenceGroupStopped(f"rank {rank}: {what}: {cause}; the inference group serves version "
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
