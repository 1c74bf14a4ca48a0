"""The ``tritonreshard`` command: ``plan`` (print / draw a plan), ``demo`` (the RL refit loop) and
``bench`` (refit throughput against baselines)."""
from __future__ import annotations

import argparse
import math
import os
import re
import sys
import time

import torch

from tritonreshard.layout import MAX_RANKS, Layout, Replicate, Shard
from tritonreshard.planning import plan_reshard

from . import bench, demo
from .viz import check_figure_path, draw_plan

__all__ = ["main", "parse_layout_spec"]

DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16,
          "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
          "int8": torch.int8, "int32": torch.int32, "int64": torch.int64, "uint8": torch.uint8,
          "fp8": torch.float8_e4m3fn, "float64": torch.float64}

SPEC_HELP = """\
Layout specs: MESH[@FIRST]:PLACEMENTS
  MESH        N (a 1-D mesh of N ranks) or AxB[xC] (an N-D mesh, row-major)
  @FIRST      first global rank of the mesh (default: 0 for --src; for --dst the rank after the
              last source rank, i.e. disjoint meshes, or 0 with --colocated)
  PLACEMENTS  one per mesh dim, comma-separated: S(d) shards tensor dim d, S(d,[b0,b1,...]) shards
              packed blocks independently (sizes sum to shape[d]), R replicates.
Examples:
  tritonreshard plan --shape 8x8 --src "2:S(0)" --dst "4:S(1)"             # the seed example
  tritonreshard plan --shape 8x8 --src "4:S(1)" --dst "4:R"                # columns -> replicas
  tritonreshard plan --shape 12x8 --src "2x2:R,S(0)" --dst "3:S(0,[4,4,4])" --png plan.png
"""

_PLACEMENT = re.compile(r"\s*(?:(S|Shard)\(\s*(-?\d+)\s*(?:,\s*\[([\d,\s]*)\])?\s*\)|(R|Replicate)(?:\(\))?)\s*(?:,|$)")


def _parse_dims(text: str, what: str) -> tuple[int, ...]:
    parts = text.lower().split("x")
    if not all(p.strip().isdigit() for p in parts):
        raise ValueError(f"{what}={text!r} must look like 8x8 (non-negative ints joined by 'x')")
    return tuple(int(p) for p in parts)


def parse_layout_spec(spec: str, shape, dtype, first_default: int = 0, what: str = "--src") -> Layout:
    """Parses ``MESH[@FIRST]:PLACEMENTS`` (see ``tritonreshard plan --help``) into a Layout."""
    mesh_part, sep, place_part = spec.partition(":")
    if not sep:
        raise ValueError(f"{what}={spec!r} must be MESH[@FIRST]:PLACEMENTS, e.g. '2:S(0)'")
    mesh_txt, _, first_txt = mesh_part.partition("@")
    mesh_shape = _parse_dims(mesh_txt, f"{what} mesh")
    if first_txt.strip() and not re.fullmatch(r"\s*-?\d+\s*", first_txt):
        raise ValueError(f"{what}={spec!r}: @FIRST={first_txt!r} must be a rank number, e.g. '4@2:S(0)'")
    first = int(first_txt) if first_txt.strip() else first_default
    placements, pos = [], 0
    while pos < len(place_part):
        m = _PLACEMENT.match(place_part, pos)
        if not m or m.end() == pos:
            raise ValueError(f"{what}={spec!r}: cannot parse placements at {place_part[pos:]!r}; "
                             f"use S(d), S(d,[b0,b1]) or R")
        if m.group(4):
            placements.append(Replicate())
        else:
            blocks = tuple(int(b) for b in m.group(3).split(",") if b.strip()) if m.group(3) is not None else None
            placements.append(Shard(int(m.group(2)), blocks))
        pos = m.end()
    n = math.prod(mesh_shape)
    if n > MAX_RANKS:
        raise ValueError(f"{what}={spec!r}: mesh of {n} ranks; at most {MAX_RANKS} are supported")
    ranks = torch.arange(first, first + n).reshape(mesh_shape).tolist() if n else []
    return Layout(shape, ranks, placements, dtype)


def _cmd_plan(args) -> int:
    shape = _parse_dims(args.shape, "--shape")
    src_dtype = DTYPES[args.src_dtype or args.dtype]
    dst_dtype = DTYPES[args.dst_dtype or args.dtype]
    src = parse_layout_spec(args.src, shape, src_dtype, 0, "--src")
    dst = parse_layout_spec(args.dst, shape, dst_dtype, 0 if args.colocated else max(src.ranks) + 1, "--dst")
    if args.png:  # a bad path fails now, in one line, not after the work
        check_figure_path(args.png, "--png")
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
                       formatter_class=argparse.RawDescriptionHelpFormatter, epilog=SPEC_HELP)
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
