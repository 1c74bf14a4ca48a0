"""The bench's command line: its options (:func:`add_arguments`) and :func:`run`, what ``tritonreshard
bench`` calls: check, set up a :class:`.session.BenchSession`, :func:`.report.measure`, print."""
from __future__ import annotations

import argparse
import json
import sys

from .config import (
    CODECS,
    DEFAULT_CODEC,
    LAYOUTS,
    METHODS,
    NETS,
    WORKER_METHODS,
    BenchConfig,
    environment_problems,
    parse_gbps,
    parse_size,
)

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Adds the bench options to ``parser`` (used by ``tritonreshard bench``)."""
    parser.add_argument("--size", default="1GiB",
                        help="bytes of the bf16 model (256MiB, 1GiB, a plain int; default 1GiB). On "
                             "--device cuda the model lives in GPU memory: trainer arenas and inference "
                             "shards are on the GPUs (rank %% device count)")
    parser.add_argument("--layout", choices=LAYOUTS, default="fsdp-tp",
                        help="fsdp-tp: FSDP rows -> tensor parallel (default); cols-replicas: column shards "
                             "-> whole tensors on every inference rank; colocated: fsdp-tp with trainers and "
                             "inference on the same processes; replicated-sources: DP x FSDP -> TP; megatron-tp-pp: "
                             "Megatron-Core TP 2 x PP trainers/2 shards -> TP (gather_broadcast is then the "
                             "Megatron-Bridge-style export: gather each tensor on its stage, broadcast)")
    parser.add_argument("--trainers", type=int, default=None,
                        help="trainer processes (default 2 for fsdp-tp, 4 otherwise)")
    parser.add_argument("--inference", type=int, default=4, help="inference processes (default 4)")
    parser.add_argument("--tensors", type=int, default=None,
                        help="number of tensors (many small layers, same total size), e.g. 10000 to "
                             "measure the per-tensor overhead of a refit")
    parser.add_argument("--repeats", type=int, default=10, help="timed refits per method (default 10)")
    parser.add_argument("--warmup", type=int, default=2,
                        help="untimed refits per method first (default 2; with --update-lr these follow the "
                             "two untimed whole refits that start each session)")
    parser.add_argument("--backend", choices=("torch", "triton"), default=None,
                        help="engine copy backend (default: torch on cpu, triton on cuda)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="where the weights live: cpu (default; shared host memory, p2p over gloo) or "
                             "cuda (GPU memory, rank %% device count; p2p over NCCL)")
    parser.add_argument("--mode", choices=("shadow", "inplace"), default="shadow",
                        help="engine mode: pull into a spare buffer set and swap (default), or in place")
    parser.add_argument("--methods", default=",".join(METHODS),
                        help=f"comma-separated subset of {','.join(METHODS)} (default: all)")
    parser.add_argument("--timeout", type=float, default=600.0,
                        help="seconds for set-up and for each command's refits; also bounds every wait")
    parser.add_argument("--replicas", type=int, default=1,
                        help="inference replicas (vLLM data parallel): --inference ranks form this many TP "
                             "groups, in order (fsdp-tp, replicated-sources; default 1)")
    parser.add_argument("--hosts", type=int, default=1,
                        help="N hosts on this machine (see --net): trainers on host 0, inference ranks spread "
                             "over hosts 1..N-1; the JSON adds cross_host_bytes per method (default 1: every "
                             "rank on this host)")
    parser.add_argument("--net", choices=NETS, default="labels",
                        help="how --hosts makes its hosts: labels (default: a TRITONRESHARD_HOST per rank, "
                             "loopback between them, no root needed) or namespaces (the host harness, "
                             "tritonreshard.apps.hosts: a network namespace, /dev/shm and hostname per host, "
                             "real TCP through a switch; needs root)")
    parser.add_argument("--codec", choices=tuple(CODECS), default=None,
                        help=f"how the engine's cross-host messages travel (--hosts >= 2; the library's delta= "
                             f"spelling). Default {DEFAULT_CODEC}: {CODECS['off']}, every byte every refit (the "
                             f"bench's provenance bits change every element every refit, which a delta would "
                             f"compress, so the plain run moves every byte). auto: {CODECS['auto']}, the library's "
                             f"default: a delta where finding what changed costs less than sending whole, as the "
                             f"trainers measure their link and detection. always: {CODECS['always']}, a delta every "
                             f"refit after the first (whole every 64: the anchor), whatever the link. The table "
                             f"and --json ('codec') name it. Not with --update-lr (it runs all three) or --quantize")
    parser.add_argument("--update-lr", default=None, metavar="LR[,LR...]",
                        help="instead: cross-host deltas with --hosts >= 2: every refit an Adam-sized bf16 update "
                             "of this learning rate ('random': every element changes), each rate run with "
                             "delta off, auto and always; prints the changed fraction, cross-host bytes, refit "
                             "time and detection cost (see tritonreshard.apps.bench.deltas)")
    parser.add_argument("--link-gbps", default=None, metavar="GBPS[,GBPS...]",
                        help="a slower link between hosts (--hosts >= 2), gigabits/s: with --net namespaces a "
                             "token bucket (tc tbf) on every host's link, under real TCP; with --net labels "
                             "every cross-host send first sleeps its bytes / this rate "
                             "($TRITONRESHARD_SIMULATED_LINK_GBPS, a test hook of the engine). With --update-lr "
                             "a list, one row per rate and learning rate ('inf': the link as it is); default: "
                             "the link as it is")
    parser.add_argument("--png", default=None, metavar="PATH",
                        help="with --update-lr: draw the hosts, their links with the rates, and the bytes that "
                             "crossed each link per refit (the engine's counters; with --net namespaces also "
                             "the kernel's) to this image file")
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last stdout line")
    parser.add_argument("--quantize", choices=("fp8-block", "fp8-block-ue8m0"), default=None,
                        help="instead: the fused FP8 refit vs the bf16 refit vs bf16 refit + torch quantize, "
                             "in this process (see tritonreshard.apps.bench.fp8)")
    return parser


def _config(args) -> BenchConfig:
    links = parse_gbps(args.link_gbps)
    if len(links) > 1:
        raise ValueError(f"--link-gbps={args.link_gbps!r}: one rate (a list is for --update-lr)")
    return BenchConfig(size=parse_size(args.size), layout=args.layout, trainers=args.trainers,
                       inference=args.inference, tensors=args.tensors, backend=args.backend or "auto",
                       device=args.device, mode=args.mode, timeout=args.timeout, hosts=args.hosts,
                       replicas=args.replicas, link_gbps=links[0], net=args.net,
                       delta=DEFAULT_CODEC if getattr(args, "codec", None) is None else args.codec,
                       methods=tuple(m.strip() for m in args.methods.split(",") if m.strip()))


def run(args: argparse.Namespace) -> int:
    """Runs the bench; returns the exit code (0: measured and every method verified)."""
    codec = getattr(args, "codec", None)
    if codec is not None and (args.update_lr is not None or args.quantize):
        which = ("--update-lr runs every codec (off, auto, always) side by side" if args.update_lr is not None else
                 "--quantize runs in this process: nothing crosses hosts")
        print(f"tritonreshard bench: invalid arguments:\n  - --codec={codec} sets the codec of the plain run, but "
              f"{which}; leave --codec out", file=sys.stderr)
        return 2
    if args.update_lr is not None:
        from .deltas import run_cli as run_deltas_cli  # lazy, as below
        return run_deltas_cli(args)
    if args.quantize:
        # Lazy, like every import below: they load torch (and Triton), which parsing the command
        # line, --help and the argument checks never need.
        from .fp8 import run_cli as run_fp8_cli
        return run_fp8_cli(args)
    try:
        cfg = _config(args)
    except ValueError as exc:
        print(f"tritonreshard bench: {exc}", file=sys.stderr)
        return 2
    methods = list(cfg.methods)
    problems = cfg.problems()
    if args.repeats < 1 or args.warmup < 0:
        problems.append(f"--repeats={args.repeats} must be >= 1 and --warmup={args.warmup} >= 0")
    if args.png:
        problems.append(f"--png={args.png!r} draws the rows of --update-lr; this run has none")
    if cfg.device == "cuda":
        import torch  # lazy (see above): only --device cuda asks torch before the checks are done
        if not torch.cuda.is_available():
            problems.append("--device=cuda but torch.cuda.is_available() is False")
    problems += environment_problems(cfg)
    if problems:
        print("tritonreshard bench: invalid arguments:\n  - " + "\n  - ".join(problems), file=sys.stderr)
        return 2
    from tqdm import tqdm  # lazy (see above): the measuring side, once the arguments are good

    from tritonreshard.planning import fmt_bytes

    from ..driver import RankFailed
    from .memory import refusal
    from .report import measure, table
    from .session import BenchSession

    # Before any process starts: a rank the kernel kills for memory dies minutes in, with a bare SIGKILL.
    short = refusal(cfg)
    if short:
        print(f"tritonreshard bench: not enough memory: {short}", file=sys.stderr)
        return 2

    total = len(methods) * args.repeats + len([m for m in methods if m in WORKER_METHODS]) * args.warmup
    if "memcpy" in methods:
        total += max(1, args.warmup) + (max(3, args.repeats // 2) + 1 if args.device == "cpu" else 0)
    bar = tqdm(total=total, desc=f"bench {cfg.layout} {fmt_bytes(cfg.size)}", unit="refit", file=sys.stderr,
               dynamic_ncols=True)
    leaked: list[str] = []
    try:
        bar.set_postfix_str(f"setting up {cfg.world_size} processes")
        session = BenchSession(cfg, on_progress=bar.update)
        try:
            bar.set_postfix_str("")
            out = measure(session, methods, args.repeats, args.warmup)
        finally:
            leaked = session.close(failed=sys.exc_info()[0] is not None)
    except (RankFailed, TimeoutError) as exc:
        bar.close()
        print(f"tritonreshard bench failed: {exc}", file=sys.stderr)
        return 1
    finally:
        bar.close()
    if leaked:
        print(f"tritonreshard bench: /dev/shm entries appeared during the run: {leaked}", file=sys.stderr)
    out["shm_leaked"] = leaked
    print(table(out))
    if args.json:
        print(json.dumps(out))
    ok = all(r.get("verified", True) for r in out["results"].values()) and not leaked
    return 0 if ok else 1
