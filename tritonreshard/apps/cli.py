"""The ``tritonreshard`` command: ``plan`` (print / draw a plan), ``demo`` (the RL refit loop) and
``bench`` (refit throughput against baselines)."""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import time
from dataclasses import dataclass
from types import SimpleNamespace

# Only the standard library and the options' own modules load here: `tritonreshard --help` and a
# mistyped flag answer before torch and Triton load (seconds on a busy machine); each command
# imports what it runs when it runs.
from . import bench, demo

__all__ = ["main", "parse_layout_spec"]

#: ``--dtype`` names -> the torch dtype's attribute name (looked up when a command runs).
DTYPES = {"fp32": "float32", "float32": "float32", "bf16": "bfloat16", "bfloat16": "bfloat16",
          "fp16": "float16", "float16": "float16", "int8": "int8", "int32": "int32", "int64": "int64",
          "uint8": "uint8", "fp8": "float8_e4m3fn", "float64": "float64"}


def _torch_dtype(name: str):
    """The torch dtype of a ``--dtype`` name."""
    import torch  # lazy: only a command that runs needs torch (see the imports at the top)
    return getattr(torch, DTYPES[name])


SPEC_HELP = """\
Layout specs: MESH[@FIRST]:PLACEMENTS
  MESH        N (a 1-D mesh of N ranks) or AxB[xC] (an N-D mesh, row-major)
  @FIRST      first global rank of the mesh (default: 0 for --src; for --dst the rank after the
              last source rank, i.e. disjoint meshes, or 0 with --colocated)
  PLACEMENTS  one per mesh dim, comma-separated: S(d) shards tensor dim d, S(d,[b0,b1,...]) shards
              packed blocks independently (sizes sum to shape[d]), R replicates; ",bal" after
              either splits like numpy.array_split (the first n % k shards one larger: vLLM's
              expert placement) instead of torch.chunk, e.g. S(0,bal).
Examples:
  tritonreshard plan --shape 8x8 --src "2:S(0)" --dst "4:S(1)"             # the seed example
  tritonreshard plan --shape 8x8 --src "4:S(1)" --dst "4:R"                # columns -> replicas
  tritonreshard plan --shape 12x8 --src "2x2:R,S(0)" --dst "3:S(0,[4,4,4])" --png plan.png
"""

_PLACEMENT = re.compile(r"\s*(?:(S|Shard)\(\s*(-?\d+)\s*(?:,\s*\[([\d,\s]*)\])?\s*(,\s*bal)?\s*\)"
                        r"|(R|Replicate)(?:\(\))?)"
                        r"\s*(?:,|$)")


def _parse_dims(text: str, what: str) -> tuple[int, ...]:
    parts = text.lower().split("x")
    if not all(p.strip().isdigit() for p in parts):
        raise ValueError(f"{what}={text!r} must look like 8x8 (non-negative ints joined by 'x')")
    return tuple(int(p) for p in parts)


@dataclass(frozen=True)
class _Spec:
    """A parsed ``MESH[@FIRST]:PLACEMENTS``, before any torch: ``placements`` are
    ``("S", dim, blocks, balanced)`` / ``("R",)`` tuples."""
    mesh_shape: tuple[int, ...]
    first: int | None  # None: the flag's default
    placements: tuple[tuple, ...]


def _parse_spec(spec: str, what: str) -> tuple[_Spec | None, list[str]]:
    """The spec's syntax, every problem at once, each naming ``what`` (the flag) and quoting ``spec``."""
    mesh_part, sep, place_part = spec.partition(":")
    if not sep:
        return None, [f"{what}={spec!r} must be MESH[@FIRST]:PLACEMENTS, e.g. '2:S(0)'"]
    problems = []
    mesh_txt, _, first_txt = mesh_part.partition("@")
    try:
        mesh_shape = _parse_dims(mesh_txt, f"{what} mesh")
    except ValueError as exc:
        mesh_shape = None
        problems.append(f"{what}={spec!r}: {exc}")
    first = None
    if first_txt.strip():
        if re.fullmatch(r"\s*-?\d+\s*", first_txt):
            first = int(first_txt)
        else:
            problems.append(f"{what}={spec!r}: @FIRST={first_txt!r} must be a rank number, e.g. '4@2:S(0)'")
    placements, pos = [], 0
    while pos < len(place_part):
        m = _PLACEMENT.match(place_part, pos)
        if not m or m.end() == pos:
            problems.append(f"{what}={spec!r}: cannot parse placements at {place_part[pos:]!r}; "
                            f"use S(d), S(d,[b0,b1]), S(d,bal) or R")
            break
        if m.group(5):
            placements.append(("R",))
        else:
            blocks = tuple(int(b) for b in m.group(3).split(",") if b.strip()) if m.group(3) is not None else None
            placements.append(("S", int(m.group(2)), blocks, m.group(4) is not None))
        pos = m.end()
    if problems:
        return None, problems
    return _Spec(mesh_shape=mesh_shape, first=first, placements=tuple(placements)), []


def _nested_ranks(first: int, mesh_shape: tuple[int, ...]):
    """Ranks ``first, first + 1, ...`` as a row-major nested list of ``mesh_shape``."""
    if len(mesh_shape) == 1:
        return list(range(first, first + mesh_shape[0]))
    step = math.prod(mesh_shape[1:])
    return [_nested_ranks(first + i * step, mesh_shape[1:]) for i in range(mesh_shape[0])]


def _build_layout(parsed: _Spec, spec: str, shape, dtype, first: int, what: str):
    """(Layout | None, problems): the Layout's own checks, each problem named by its flag (``--shape``
    for the shape's, ``what`` for the rest)."""
    # Lazy: the Layout type loads torch; specs that do not parse were reported without it.
    from tritonreshard.layout import MAX_RANKS, Layout, Replicate, Shard

    n = math.prod(parsed.mesh_shape)
    if n > MAX_RANKS:
        return None, [f"{what}={spec!r}: mesh of {n} ranks; at most {MAX_RANKS} are supported"]
    placements = [Replicate() if p[0] == "R" else Shard(p[1], p[2], balanced=p[3]) for p in parsed.placements]
    try:
        return Layout(shape, _nested_ranks(first, parsed.mesh_shape) if n else [], placements, dtype), []
    except ValueError as exc:
        msg = str(exc)
        lines = msg.split("\n  - ")[1:] if msg.startswith("invalid Layout:\n  - ") else [msg]
        return None, [f"--shape: {line}" if line.startswith("shape=") else f"{what}={spec!r}: {line}"
                      for line in lines]


def parse_layout_spec(spec: str, shape, dtype, first_default: int = 0, what: str = "--src"):
    """Parses ``MESH[@FIRST]:PLACEMENTS`` (see ``tritonreshard plan --help``) into a Layout; a
    ValueError lists every problem, each naming ``what``."""
    parsed, problems = _parse_spec(spec, what)
    if parsed is not None:
        first = first_default if parsed.first is None else parsed.first
        layout, problems = _build_layout(parsed, spec, shape, dtype, first, what)
    if problems:
        raise _input_error(problems)
    return layout


def _input_error(problems: list[str]) -> ValueError:
    """One ValueError for every problem: one on its own line, several as a list."""
    unique = list(dict.fromkeys(problems))  # --src and --dst both report a bad --shape
    if len(unique) == 1:
        return ValueError(unique[0])
    return ValueError("invalid arguments:\n  - " + "\n  - ".join(unique))


def _cmd_plan(args) -> int:
    if args.model:
        return _cmd_model_plan(args)
    if args.hosts or args.hosts_of is not None:   # a plan between two layouts has no hosts: say so
        raise ValueError("--hosts and --hosts-of place the ranks of --model's refit on hosts: add --model")
    # Syntax first, with no torch: a mistyped flag is reported at once, every problem together.
    problems = []
    try:
        shape = _parse_dims(args.shape, "--shape")
    except ValueError as exc:
        shape = None
        problems.append(str(exc))
    src_spec, p = _parse_spec(args.src, "--src")
    problems += p
    dst_spec, p = _parse_spec(args.dst, "--dst")
    problems += p
    if problems:
        raise _input_error(problems)
    # Then what only the Layouts can check (torch loads here), both sides before either fails.
    src_dtype = _torch_dtype(args.src_dtype or args.dtype)
    dst_dtype = _torch_dtype(args.dst_dtype or args.dtype)
    src_first = 0 if src_spec.first is None else src_spec.first
    dst_default = 0 if args.colocated else src_first + math.prod(src_spec.mesh_shape)  # after the last source rank
    src, p = _build_layout(src_spec, args.src, shape, src_dtype, src_first, "--src")
    problems += p
    dst, p = _build_layout(dst_spec, args.dst, shape, dst_dtype,
                           dst_default if dst_spec.first is None else dst_spec.first, "--dst")
    problems += p
    from tritonreshard.planning import plan_reshard  # lazy (torch), like the Layouts above

    from .viz import check_figure_path, draw_plan
    if args.png:  # a bad path fails now, with the other problems, not after the work
        try:
            check_figure_path(args.png, "--png")
        except ValueError as exc:
            problems.append(str(exc))
    if problems:
        raise _input_error(problems)
    t0 = time.perf_counter()
    plan = plan_reshard({args.name: src}, {args.name: dst})
    elapsed = time.perf_counter() - t0
    print(f"source      {args.name}: {src}  {src_dtype}")
    print(f"destination {args.name}: {dst}  {dst_dtype}")
    print(plan.table(max_ops=None if args.all_ops else 64))
    if src_dtype != dst_dtype:
        print(f"bytes: the totals, the ops' bytes, the matrix and recv count destination bytes "
              f"({dst_dtype}); send counts source bytes ({src_dtype})")
    print(f"planned in {elapsed * 1e3:.2f} ms")
    if args.png:
        draw_plan(plan, args.png)
        print(f"wrote {os.path.abspath(args.png)}")
    return 0


#: Nominal peak bandwidth per GPU and per direction, in GB/s (1e9 B/s), from the vendors' datasheets:
#: NVLink figures are the datasheets' bidirectional totals halved, IB the port's line rate / 8.
#:  * h100-nvlink, h200-nvlink: NVLink 4, "900 GB/s" (NVIDIA H100 / H200 SXM datasheets);
#:  * h800-nvlink: "400 GB/s" (NVIDIA H800 SXM datasheet);
#:  * gb200-nvlink: NVLink 5, "1.8 TB/s" per GPU (NVIDIA GB200 NVL72 datasheet);
#:  * ib-400g: one NDR 400 Gb/s port per GPU (ConnectX-7; DGX H100's compute fabric);
#:  * ib-800g: one XDR 800 Gb/s port per GPU (ConnectX-8).
#: Peaks, not what a copy reaches: a model's lower bound, never a measurement.
LINKS = {"h100-nvlink": 450.0, "h200-nvlink": 450.0, "h800-nvlink": 200.0, "gb200-nvlink": 900.0,
         "ib-400g": 50.0, "ib-800g": 100.0}

MODEL_HELP = """Model mode (--model): the refit of a Hugging Face config's model, FSDP trainers -> replicas x TP,
modelled per rank without making the whole plan. Trainers are ranks 0..T-1, inference ranks follow;
--hosts-of N puts N consecutive ranks on each host (default: one host); or name each host's ranks,
one --hosts NAME=RANKS per host, RANKS comma-separated ranks and ranges a-b (both ends included):
every rank on exactly one host, every host on a rank (a bad map is refused, every problem named,
before anything is modelled). --link names the link within a host and, after a comma, between
hosts (presets: """ + ", ".join(f"{k} {v:g} GB/s" for k, v in LINKS.items()) + """), or a JSON file
{"within": {"name": ..., "GBps": ...}, "across": {"name": ..., "GBps": ...}}.
  tritonreshard plan --model config.json --trainers 64 --tp 8 --replicas 8 --hosts-of 8 --link h200-nvlink,ib-400g
  tritonreshard plan --model config.json --trainers 4 --tp 2 --replicas 2 --hosts node0=0-3 --hosts node1=4-7
"""


#: The most ranks one ``--hosts`` range may name: more than any group, so a typo (``0-99999999``)
#: is refused at once instead of filling memory.
_MAX_RANGE = 1 << 20


def _parse_host_map(entries: list[str]) -> dict[str, list[int]]:
    """``--hosts NAME=RANKS`` (the flag once per host) -> ``{name: ranks}``, the syntax only; a
    ValueError names every entry that does not parse. RANKS: comma-separated ranks and ranges
    ``a-b`` (both ends included); empty RANKS is a host with no rank, which the map's check names."""
    host_map: dict[str, list[int]] = {}
    problems = []
    for entry in entries:
        name, sep, text = entry.partition("=")
        name = name.strip()
        if not sep or not name:
            problems.append(f"--hosts {entry!r} must be NAME=RANKS, e.g. node0=0-3,8")
            continue
        if name in host_map:
            problems.append(f"--hosts names host {name!r} twice: give each host one --hosts with all its ranks")
            continue
        ranks: list[int] = []
        for item in text.split(",") if text.strip() else []:
            m = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", item)
            a, b = (int(m[1]), int(m[2] or m[1])) if m else (0, -1)
            if not m or b < a or b - a >= _MAX_RANGE:
                problems.append(f"--hosts {entry!r}: {item.strip()!r} is not a rank or a range a-b "
                                f"(a <= b, at most {_MAX_RANGE} ranks)")
                continue
            ranks += range(a, b + 1)
        host_map[name] = ranks
    if problems:
        raise _input_error(problems)
    return host_map


def _links(text: str) -> dict[str, tuple[str, float]]:
    """``--link``: ``{"within": (name, GB/s), "across": (name, GB/s)}``."""
    if text.endswith(".json"):
        with open(text) as f:
            raw = json.load(f)
        out = {}
        for kind in ("within", "across"):
            entry = raw.get(kind, raw.get("within")) if isinstance(raw, dict) else None
            if not isinstance(entry, dict) or not isinstance(entry.get("GBps"), (int, float)) or entry["GBps"] <= 0:
                raise ValueError(f"--link {text}: needs {{\"{kind}\": {{\"name\": ..., \"GBps\": > 0}}}}, "
                                 f"got {entry!r}")
            out[kind] = (str(entry.get("name", kind)), float(entry["GBps"]))
        return out
    names = [n.strip() for n in text.split(",")]
    bad = [n for n in names if n not in LINKS]
    if bad or not 1 <= len(names) <= 2:
        raise ValueError(f"--link={text!r}: one or two of {sorted(LINKS)} (within[,across]) or a .json file")
    within = names[0]
    across = names[-1]
    return {"within": (within, LINKS[within]), "across": (across, LINKS[across])}


def _gpu_sizes(text: str) -> list[float]:
    """``--gpu-gib``: comma-separated positive GiB."""
    try:
        sizes = [float(v) for v in text.split(",")]
    except ValueError:
        sizes = []
    if not sizes or not all(math.isfinite(v) and v > 0 for v in sizes):
        raise argparse.ArgumentTypeError(f"expected positive GiB separated by commas, e.g. 80,141; got {text!r}")
    return sizes


def _cmd_model_plan(args) -> int:
    problems = []
    for flag in ("trainers", "tp", "replicas"):
        v = getattr(args, flag)
        if v is None or v < 1:
            problems.append(f"--{flag} must be a positive int, got {v}")
    if args.hosts_of is not None and args.hosts_of < 1:
        problems.append(f"--hosts-of must be a positive int, got {args.hosts_of}")
    if args.hosts and args.hosts_of is not None:
        problems.append("--hosts and --hosts-of both place ranks on hosts: give one of them")
    if problems:
        raise ValueError("; ".join(problems))
    links = _links(args.link)
    T, n_inf = args.trainers, args.replicas * args.tp
    if args.hosts:   # before the config is read and anything is modelled
        # Lazy: tritonreshard.planning loads torch, which the flags' own checks above do without.
        from tritonreshard.planning import hosts_from_map
        hosts = hosts_from_map(_parse_host_map(args.hosts), range(T + n_inf))
    else:
        hosts = ({r: f"host{r // args.hosts_of}" for r in range(T + n_inf)} if args.hosts_of
                 else {r: "host0" for r in range(T + n_inf)})
    with open(args.model) as f:
        cfg = SimpleNamespace(**json.load(f))
    # Lazy: the recipe and the traffic model load torch, once the arguments are good.
    from tritonreshard.planning import fmt_bytes, refit_traffic
    from tritonreshard.recipes import hf_to_vllm

    dtype = _torch_dtype(args.dst_dtype or "bf16")
    src_dtype = _torch_dtype(args.src_dtype or "bf16")
    trainers, inference = list(range(T)), list(range(T, T + n_inf))
    t0 = time.process_time()
    spec = hf_to_vllm(cfg, tp=args.tp, trainer_ranks=trainers, inference_ranks=inference, dtype=dtype,
                      src_dtype=src_dtype)
    t1 = time.process_time()
    plans = {r: spec.plan(rank=r) for r in (trainers[0], inference[0])}
    t2 = time.process_time()
    traffic = refit_traffic(spec.src, spec.dst, spec.parts, hosts)
    t3 = time.process_time()
    model_bytes = sum(lay.numel * lay.itemsize for lay in spec.src.values())
    n_hosts = len(set(hosts.values()))
    print(f"MODEL, not a measurement: {cfg.model_type} from {args.model} ({fmt_bytes(model_bytes)} in "
          f"{src_dtype}), FSDP-{T} trainers -> {args.replicas} replica(s) x TP-{args.tp} ({dtype}), "
          f"{n_hosts} host(s)"
          f"{f' of {args.hosts_of} ranks' if args.hosts_of else ' from --hosts' if args.hosts else ''}")
    print(f"links (nominal peaks per GPU and direction): within a host {links['within'][0]} "
          f"{links['within'][1]:g} GB/s, across hosts {links['across'][0]} {links['across'][1]:g} GB/s")
    print(f"planning (this machine, CPU s): recipe {t1 - t0:.3f} s; trainer rank {trainers[0]}'s plan and "
          f"inference rank {inference[0]}'s plan {t2 - t1:.3f} s together ({len(plans[trainers[0]].ops):,} and "
          f"{len(plans[inference[0]].ops):,} ops); this traffic model {t3 - t2:.3f} s")
    rows, worst = [], (0.0, "", -1, 0)
    for r in trainers + inference:
        cells = {"out within": traffic.out_within.get(r, 0), "in within": traffic.in_within.get(r, 0),
                 "out across": traffic.out_across.get(r, 0), "in across": traffic.in_across.get(r, 0)}
        for what, b in cells.items():
            name, gbps = links["within" if "within" in what else "across"]
            t = b / (gbps * 1e9)
            if t > worst[0]:
                worst = (t, f"{what} ({name}, {gbps:g} GB/s)", r, b)
        rows.append((r, hosts[r], "trainer" if r < T else f"replica {(r - T) // args.tp} TP {(r - T) % args.tp}",
                     cells, traffic.pieces.get(r, 0)))
    shown = rows if args.all_ops else [row for row in rows if row[0] in (0, T - 1, T, T + args.tp - 1, T + n_inf - 1)]
    w = max(7, *map(len, hosts.values()))   # --hosts names may be longer than "host12"
    print(f"{'rank':>5} {'host':>{w}} {'role':<16} {'out within':>11} {'in within':>11} {'out across':>11} "
          f"{'in across':>11} {'ops':>9}")
    for r, h, role, cells, ops in shown:
        print(f"{r:>5} {h:>{w}} {role:<16} " + " ".join(f"{fmt_bytes(b):>11}" for b in cells.values()) + f" {ops:>9,}")
    if not args.all_ops:
        print(f"  ({len(rows) - len(shown)} more ranks: --all-ops prints every rank)")
    ingress = [b for b in traffic.host_ingress.values() if b]
    if ingress:
        print(f"{len(ingress)} host(s) receive from other hosts: {fmt_bytes(min(ingress))} to "
              f"{fmt_bytes(max(ingress))} "
              f"each ({min(ingress) / model_bytes:.2f}x to {max(ingress) / model_bytes:.2f}x the model)")
    t, what, r, b = worst
    print(f"lower bound of one refit: {t:.3f} s: rank {r}'s {what} carries {fmt_bytes(b)} "
          f"(the busiest link; every other link needs less time, and links are assumed to run at once)")
    _print_refit_memory(spec, inference, args.gpu_gib)
    return 0


def _print_refit_memory(spec, inference: list[int], gpu_gib: list[float]) -> None:
    """The refit's extra memory on the busiest inference GPU, per mode, from the modes' own buffer
    set counts (what an endpoint allocates), and which modes fit each GPU size beside the weights."""
    # Lazy, as the model mode's other imports: the library loads torch, which --help does without.
    from tritonreshard.engine import InPlace, Shadow
    from tritonreshard.planning import fmt_bytes
    from tritonreshard.serving import BackgroundPull, InlinePull

    def shard(name: str, r: int) -> int:
        lay = spec.dst[name]
        return math.prod(lay.local_shape(r)) * lay.itemsize if r in lay.ranks else 0

    weights = max(sum(shard(n, r) for n in spec.dst) for r in inference)
    # The direct pull (prefetch off) writes what vLLM on CUDA serves as loaded in place and streams
    # the layers it post-processes one at a time: block-FP8 weights, MoE experts (their kernel
    # format), every layer with MLA; its extra is the largest such layer (0 when there is none).
    mla = any(n.endswith("kv_b_proj.weight") for n in spec.dst)
    quant = set(spec.quant or ()) | {q.scale for q in (spec.quant or {}).values()}
    layers: dict[str, list[str]] = {}
    for n in spec.dst:
        if mla or n in quant or ".experts." in n:
            layers.setdefault(n.rsplit(".", 1)[0], []).append(n)
    layer = max((sum(shard(n, r) for n in names) for names in layers.values() for r in inference), default=0)
    # The extra sets beside the weights the engine serves: a vLLM worker serves its own parameters,
    # so every buffer set is extra; a RefitInference serves one of its sets.
    modes = [("vLLM, background pull (prefetch on, default)", BackgroundPull.BUFFER_SETS * weights,
              f"{BackgroundPull.BUFFER_SETS}x"),
             ("vLLM, direct pull (prefetch off; CUDA)", layer, f"{layer / weights:.2f}x"),
             ("vLLM, prefetch off, direct=False", InlinePull.BUFFER_SETS * weights, f"{InlinePull.BUFFER_SETS}x"),
             ("RefitInference, Shadow()", (Shadow().sets - 1) * weights, f"{Shadow().sets - 1}x"),
             ("RefitInference, InPlace()", (InPlace().sets - 1) * weights, f"{InPlace().sets - 1}x")]
    print(f"refit memory per inference GPU (the busiest): weights {fmt_bytes(weights)}; beside them:")
    print(f"  {'mode':<48} {'extra':>16} " + " ".join(f"{f'{g:g} GiB GPU':>16}" for g in gpu_gib))
    for name, extra, times in modes:
        cells = []
        for g in gpu_gib:
            left = g * 2**30 - weights - extra
            cells.append(f"{f'{fmt_bytes(left)} left' if left > 0 else 'does not fit':>16}")
        print(f"  {name:<48} {f'{times} = {fmt_bytes(extra)}':>16} " + " ".join(cells))
    print("  (left: for the KV cache, activations and the runtime; a MODEL of the buffer sets, not a measurement;")
    print("   the direct pull's extra is its largest post-processed layer (FP8, MoE experts, MLA), one at a time)")


def plain(doc: str | None) -> str | None:
    """A docstring's first paragraph as help text: reST markup (````x````, ``:func:`x```) removed."""
    if not doc:
        return None
    text = doc.strip().split("\n\n")[0]
    text = re.sub(r":\w+:`~?([^`]+)`", r"\1", text)
    return text.replace("``", "")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tritonreshard", description=plain(__doc__))
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("plan", help="print (and draw) the plan between two layouts",
                       formatter_class=argparse.RawDescriptionHelpFormatter, epilog=SPEC_HELP + "\n" + MODEL_HELP)
    p.add_argument("--shape", default="8x8", help="global tensor shape, e.g. 8x8 (default 8x8)")
    p.add_argument("--src", default="2:S(0)", help="source layout spec (default '2:S(0)')")
    p.add_argument("--dst", default="4:S(1)", help="destination layout spec (default '4:S(1)')")
    p.add_argument("--dtype", default="fp32", choices=sorted(DTYPES), help="dtype of both sides")
    p.add_argument("--src-dtype", choices=sorted(DTYPES), help="source dtype (overrides --dtype)")
    p.add_argument("--dst-dtype", choices=sorted(DTYPES), help="destination dtype (overrides --dtype)")
    p.add_argument("--colocated", action="store_true", help="destination mesh starts at rank 0 too")
    p.add_argument("--name", default="w", help="tensor name shown in the plan")
    p.add_argument("--all-ops", action="store_true", help="print every op (default: first 64)")
    p.add_argument("--png", metavar="FILE", help="draw the plan to FILE")
    p.add_argument("--model", metavar="CONFIG.json", help="model mode: a Hugging Face config.json (see below)")
    p.add_argument("--trainers", type=int, default=8, help="model mode: FSDP trainer ranks (default 8)")
    p.add_argument("--tp", type=int, default=8, help="model mode: vLLM tensor-parallel size (default 8)")
    p.add_argument("--replicas", type=int, default=1, help="model mode: vLLM replicas of TP (default 1)")
    p.add_argument("--hosts-of", type=int, metavar="N", help="model mode: N consecutive ranks per host")
    p.add_argument("--hosts", action="append", metavar="NAME=RANKS",
                   help="model mode: one host and its ranks, e.g. node0=0-3,8; once per host (not with --hosts-of)")
    p.add_argument("--gpu-gib", type=_gpu_sizes, default=[80.0, 141.0], metavar="GIB[,GIB...]",
                   help="model mode: GPU memory sizes to fit the refit's modes into (default 80,141)")
    p.add_argument("--link", default="h200-nvlink,ib-400g",
                   help="model mode: within[,across] link presets or a .json (default h200-nvlink,ib-400g)")
    p.set_defaults(func=_cmd_plan)

    # The demo and the benchmark own their flags and their help text.
    d = sub.add_parser("demo", help="an asynchronous RL loop that refits through tritonreshard",
                       description=plain(demo.__doc__))
    demo.add_arguments(d)
    d.set_defaults(func=demo.run)

    b = sub.add_parser("bench", help="refit throughput against memcpy, p2p and gather+broadcast",
                       description=plain(bench.__doc__))
    bench.add_arguments(b)
    b.set_defaults(func=bench.run)
    return parser


_NEGATIVE_VALUE = re.compile(r"^-[0-9.]")


def _join_negative_values(argv: list[str]) -> list[str]:
    """``--size -5MiB`` -> ``--size=-5MiB``: argparse takes any ``-x`` token that is not a plain
    number for an option and reports "expected one argument"; joined, the option's own check names
    the bad value. (No command takes positional arguments, so such a token is always a value.)"""
    out, i = [], 0
    while i < len(argv):
        tok = argv[i]
        if tok.startswith("--") and "=" not in tok and i + 1 < len(argv) and _NEGATIVE_VALUE.match(argv[i + 1]):
            out.append(f"{tok}={argv[i + 1]}")
            i += 2
            continue
        out.append(tok)
        i += 1
    return out


def main(argv=None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(_join_negative_values(argv))
    try:
        return args.func(args)
    except ValueError as exc:  # bad user input: a clear message, no traceback
        print(f"tritonreshard {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # The reader went away (``tritonreshard plan | head``): stop quietly, like other commands.
        # Point stdout at /dev/null so the interpreter's final flush does not raise again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 128 + 13  # killed by SIGPIPE, as a shell reports it


if __name__ == "__main__":
    sys.exit(main())
