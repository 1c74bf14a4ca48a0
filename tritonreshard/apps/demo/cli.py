"""The demo's command line: its options (:func:`add_arguments`), their checks, and :func:`run`, what
``tritonreshard demo`` and ``python -m tritonreshard.apps.demo`` call: check, configure, drive the
ranks (:mod:`.driver`), report (:mod:`.report`)."""
from __future__ import annotations

import argparse
import shutil
import sys
import tempfile

from .config import RunConfig

__all__ = ["add_arguments", "validate", "run", "peak_memory", "memory_refusal"]


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
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the policy's initial weights, the prompts and the sampling (default 0)")
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
                             "while the inference ranks pull it; they serve K if every TP rank's pull of K "
                             "completed before the kill, else discard it and serve K-1 (checked against the "
                             "trainers' digest of the version served; \"inference_why\" says which). "
                             "kill-inference:K: the first "
                             "inference rank (TP rank 0, global rank --trainers) SIGKILLs itself when it "
                             "would pull version K; the trainers' fence() raises PeerDiedError naming it "
                             "and the refit fails (the dead reader is reported, never dropped silently). "
                             "crash-trainer:K: the last trainer rank raises an exception at step K. Without "
                             "--restart every fault makes the demo exit 1 naming the failed rank; --json adds "
                             "\"error\", \"inference_version\", \"inference_consistent\" and \"detect_ms\" "
                             "(slowest survivor's time to notice a kill). With --restart a trainer fault "
                             "(kill-trainer, crash-trainer) restarts the trainer group once and the run goes on: "
                             "it exits 0 if every version the inference ranks installed verified (1 if not), "
                             "and --json reports the normal summary with \"recoveries\": 1; kill-inference "
                             "still exits 1")
    parser.add_argument("--restart", action="store_true",
                        help="when trainers fail, restart the trainer group from its last checkpoint (the "
                             "trainers checkpoint every version before publishing it) while the inference "
                             "processes keep serving their last complete version and join the new group's "
                             "refits without being restarted; the summary counts \"recoveries\" and "
                             "\"recovery_ms\" (failure to the first refit of the new group). Shadow mode only")
    parser.add_argument("--png", metavar="FILE", help="save reward and refit time per step to FILE")
    parser.add_argument("--json", action="store_true", help="print a JSON summary as the last stdout line")
    return parser


def validate(args: argparse.Namespace) -> list[str]:
    """Every problem with the arguments, one line each (all reported at once, before any process starts)."""
    # Lazy: these load torch, which `tritonreshard demo --help` and `tritonreshard plan` never need.
    import torch

    from ..viz import check_figure_path
    from .faults import parse_fault
    from .policy import PolicyConfig

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
    cfg = PolicyConfig()
    if args.inference >= 1 and (cfg.hidden % args.inference or cfg.vocab % args.inference):
        problems.append(f"--inference={args.inference} must divide hidden={cfg.hidden} and vocab={cfg.vocab}")
    if args.peer_timeout <= 0:
        problems.append(f"--peer-timeout={args.peer_timeout} must be > 0")
    if args.fault is not None:
        try:
            parse_fault(args.fault, args.steps)
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
        try:
            check_figure_path(args.png, "--png")
        except ValueError as e:
            problems.append(str(e))
    if args.device == "cuda" and not torch.cuda.is_available():
        problems.append("--device=cuda but torch.cuda.is_available() is False")
    return problems


#: Peak PSS of one process, measured (sum over a run's processes of their peak
#: ``/proc/<pid>/smaps_rollup`` PSS, CPU, torch 2.13: 1.5 GiB for 2 trainers + 4 inference ranks +
#: the driver) and rounded up: the policy is tiny, so the processes themselves are the cost.
TRAINER_BYTES, INFERENCE_BYTES, DRIVER_BYTES = 300 << 20, 224 << 20, 320 << 20


def peak_memory(trainers: int, inference: int) -> int:
    """The demo's estimated peak memory (bytes) with ``trainers`` and ``inference`` processes."""
    return trainers * TRAINER_BYTES + inference * INFERENCE_BYTES + DRIVER_BYTES


def memory_refusal(args: argparse.Namespace, available=None) -> str | None:
    """None when the demo's processes fit in the memory available now, else the refusal."""
    from ..driver import fmt_gib, memory_shortage  # lazy: the process driver loads torch
    need = peak_memory(args.trainers, args.inference)
    short = memory_shortage(need, available=available)
    if short is None:
        return None
    least = peak_memory(1, 1)
    return (f"{args.trainers + args.inference} processes ({args.trainers} trainers x {fmt_gib(TRAINER_BYTES)}, "
            f"{args.inference} inference x {fmt_gib(INFERENCE_BYTES)}, the driver {fmt_gib(DRIVER_BYTES)}) need "
            f"about {fmt_gib(need)} at their peak, and {short}. The fewest, --trainers 1 --inference 1, need "
            f"about {fmt_gib(least)}.")


def run(args: argparse.Namespace) -> int:
    """Runs the demo; returns the process exit code (0 = ran, refit and verified every version)."""
    # Lazy: the run's modules load torch; parsing the command line (and --help) must not wait for it.
    import torch

    from .driver import drive
    from .faults import parse_fault
    from .report import report

    problems = validate(args)
    if problems:
        print("tritonreshard demo: invalid arguments:\n  - " + "\n  - ".join(problems), file=sys.stderr)
        return 2
    short = memory_refusal(args)  # before any process starts (a rank killed for memory says only SIGKILL)
    if short:
        print(f"tritonreshard demo: not enough memory: {short}", file=sys.stderr)
        return 2

    world = args.trainers + args.inference
    if args.device == "cuda" and torch.cuda.device_count() >= world:
        dist_backend = "cpu:gloo,cuda:nccl"
    else:
        dist_backend = "gloo"  # CUDA tensors are staged through the CPU for the collectives
    ckpt_dir = tempfile.mkdtemp(prefix="trs-demo-ckpt-")  # trainer checkpoints (--restart resumes from them)
    try:
        rc = RunConfig(steps=args.steps, trainers=args.trainers, inference=args.inference, mode=args.mode,
                       backend=args.backend, device=args.device, dist_backend=dist_backend,
                       max_staleness=args.max_staleness, prompts=args.prompts, group=args.group,
                       lr=args.lr, seed=args.seed, timeout=args.timeout, peer_timeout=args.peer_timeout,
                       fault=parse_fault(args.fault, args.steps) if args.fault else None,
                       restart=args.restart, checkpoint_dir=ckpt_dir)
        print(f"tritonreshard demo: starting {world} processes ({args.trainers} trainers, {args.inference} "
              f"inference); each imports torch and joins the refit group before step 1, which takes a while "
              f"on a busy machine", file=sys.stderr, flush=True)
        outcome = drive(rc)
    finally:
        shutil.rmtree(ckpt_dir, ignore_errors=True)
    return report(outcome, rc, args)
