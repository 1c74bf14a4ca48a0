"""What ``plan_reshard`` accepts, checked before anything is planned: layouts, parts (in bounds,
tiling each destination exactly) and dtype pairs (:mod:`.dtypes`). Every problem is collected and
reported at once, naming the tensor, the part and both values."""
from __future__ import annotations

import math
from collections.abc import Mapping
from functools import lru_cache

import torch

from ..layout import Layout, Part
from . import dtypes
from .text import fmt_box

__all__ = ["Resolved", "check_inputs"]

#: A resolved part: (source name or None for zeros, destination box, source start).
Resolved = tuple[str | None, tuple[tuple[int, int], ...], tuple[int, ...]]


@lru_cache(maxsize=4096)
def _tiling_gaps(shape: tuple[int, ...], boxes: tuple[tuple[tuple[int, int], ...], ...]) -> tuple:
    """Overlaps ``("overlap", i, j, box)`` and holes ``("hole", count, box)`` of ``boxes`` (already
    in bounds) against ``shape``. Cached on geometry: a model's layers repeat a few tilings."""
    out = []
    for i in range(len(boxes)):
        for j in range(i):
            inter = tuple((max(a0, b0), min(a1, b1)) for (a0, a1), (b0, b1) in zip(boxes[i], boxes[j]))
            if all(a < b for a, b in inter):
                out.append(("overlap", j, i, inter))
    if math.prod(shape) == 0:
        return tuple(out)
    # Holes: compress coordinates to the boxes' edges, count coverage per cell.
    edges = [sorted({0, n, *(x for box in boxes for x in box[d])}) for d, n in enumerate(shape)]
    grid = torch.zeros([len(e) - 1 for e in edges], dtype=torch.int32)
    for box in boxes:
        if all(a < b for a, b in box):
            grid[tuple(slice(e.index(a), e.index(b)) for e, (a, b) in zip(edges, box))] += 1
    holes = (grid == 0).nonzero().tolist()
    for cell in holes[:4]:
        out.append(("hole", len(holes), tuple((edges[d][c], edges[d][c + 1]) for d, c in enumerate(cell))))
    return tuple(out)


def _resolve_parts(name: str, d: Layout, parts, src: Mapping[str, Layout], problems: list[str]) -> tuple[Resolved, ...]:
    """Checks one destination's parts against the layouts; appends every problem found."""
    where = f"parts[{name!r}]"
    if isinstance(parts, Part) or isinstance(parts, (str, bytes)) or not isinstance(parts, (list, tuple)):
        problems.append(f"{where} must be a list of trs.Part, got {type(parts).__name__}")
        return ()
    resolved, labels, n_before = [], [], len(problems)
    for i, p in enumerate(parts):
        w = f"{where}[{i}]"
        if not isinstance(p, Part):
            problems.append(f"{w} is a {type(p).__name__}, not a trs.Part")
            continue
        if len(p.dst) != d.ndim:
            problems.append(f"{w}={p}: dst box has {len(p.dst)} dims but dst_layouts[{name!r}].shape={d.shape}")
            continue
        box = tuple((0, n) if iv is None else iv for iv, n in zip(p.dst, d.shape))
        bad = [f"dim {k}: {a}:{b}" for k, ((a, b), n) in enumerate(zip(box, d.shape)) if not 0 <= a <= b <= n]
        if bad:
            problems.append(f"{w}={p}: dst box {fmt_box(box)} is outside dst_layouts[{name!r}].shape="
                            f"{d.shape} ({'; '.join(bad)})")
            continue
        start = p.src_start if p.src_start is not None else (0,) * d.ndim
        if p.src is not None:
            s = src.get(p.src)
            if s is None:
                problems.append(f"{w}={p}: src_layouts has no {p.src!r}")
                continue
            if s.ndim != d.ndim or len(start) != d.ndim:
                problems.append(f"{w}={p}: src_layouts[{p.src!r}].shape={s.shape} and src_start={start} "
                                f"must have the destination's {d.ndim} dims")
                continue
            stop = tuple(a + (hi - lo) for a, (lo, hi) in zip(start, box))
            if any(a < 0 or b > n for a, b, n in zip(start, stop, s.shape)):
                problems.append(f"{w}={p}: source box {fmt_box(tuple(zip(start, stop)))} is outside "
                                f"src_layouts[{p.src!r}].shape={s.shape}")
                continue
            if not dtypes.castable(s.dtype, d.dtype):
                problems.append(f"{w}: dst_layouts[{name!r}].dtype={d.dtype} cannot be produced from "
                                f"src_layouts[{p.src!r}].dtype={s.dtype}")
                continue
        resolved.append((p.src, box, start))
        labels.append(f"[{i}] {p}")
    if len(problems) == n_before:
        gaps = _tiling_gaps(d.shape, tuple(b for _, b, _ in resolved))
        for kind, *rest in gaps:
            if kind == "overlap":
                i, j, box = rest
                problems.append(f"dst_layouts[{name!r}]: parts {labels[i]} and {labels[j]} overlap on "
                                f"{fmt_box(box)}")
            else:
                count, box = rest
                problems.append(f"dst_layouts[{name!r}]: no part covers {fmt_box(box)} (a hole; mark "
                                f"padding with trs.Part(None, ...))")
        holes = [g for g in gaps if g[0] == "hole"]
        if holes and holes[0][1] > len(holes):
            problems.append(f"dst_layouts[{name!r}]: ... and {holes[0][1] - len(holes)} more uncovered region(s)")
    return tuple(resolved)


def check_inputs(src: Mapping[str, Layout], dst: Mapping[str, Layout], parts) -> dict[str, tuple[Resolved, ...]]:
    """Checks ``plan_reshard``'s arguments and resolves each destination's parts (boxes to ints,
    default source starts). Raises ``TypeError`` for values that are not mappings of Layouts /
    Parts, and one ``ValueError`` listing every other problem found."""
    for param, mapping in (("src_layouts", src), ("dst_layouts", dst)):
        if not isinstance(mapping, Mapping):
            raise TypeError(f"{param} must be a mapping of name -> Layout, got {type(mapping).__name__}")
        bad = [f"{param}[{k!r}] is {type(v).__name__}" for k, v in mapping.items()
               if not isinstance(k, str) or not isinstance(v, Layout)]
        if bad:
            raise TypeError(f"{param} must map str names to trs.Layout: " + "; ".join(bad))
    if parts is None:
        parts = {}
    if not isinstance(parts, Mapping):
        raise TypeError(f"parts must be a mapping of destination name -> [trs.Part, ...], got {type(parts).__name__}")
    problems = []
    for name in parts:
        if name not in dst:
            problems.append(f"parts[{name!r}] names no destination: dst_layouts has no {name!r}")
    resolved = {}
    for name, d in dst.items():
        if name in parts:
            resolved[name] = _resolve_parts(name, d, parts[name], src, problems)
            continue
        s = src.get(name)
        if s is None:
            problems.append(f"dst_layouts[{name!r}] has no source: src_layouts has no {name!r} "
                            f"(and parts has no entry for it)")
            continue
        if s.shape != d.shape:
            problems.append(f"dst_layouts[{name!r}].shape={d.shape} != src_layouts[{name!r}].shape={s.shape}")
        if not dtypes.castable(s.dtype, d.dtype):
            problems.append(f"dst_layouts[{name!r}].dtype={d.dtype} cannot be produced from "
                            f"src_layouts[{name!r}].dtype={s.dtype}: casts are supported among "
                            f"{', '.join(map(str, dtypes.CASTABLE_DTYPES))}; other dtypes copy only to themselves")
    if problems:
        raise ValueError(f"plan_reshard: {len(problems)} problem(s):\n  - " + "\n  - ".join(problems))
    return resolved
