"""What ``plan_reshard`` accepts, checked before anything is planned: layouts, parts (in bounds,
tiling each destination exactly) and dtype pairs (:mod:`.dtypes`). Every problem is collected and
reported at once, naming the tensor, the part and both values."""
from __future__ import annotations

import math
from collections.abc import Mapping
from functools import lru_cache

import torch

from ..layout import Layout, Part, segments_by_mesh_index
from . import dtypes
from .text import fmt_box

__all__ = ["Resolved", "check_inputs", "refuse_transposed", "source_names", "transposed", "used_sources"]

#: A resolved part: (source, destination box, source start, source dims). The source is a name, a
#: tuple of aliases' names (copies of one tensor: :class:`~tritonreshard.layout.Part`), or None for
#: zeros; the source dims are None (the identity) or the part's ``src_dims`` (a transpose).
Resolved = tuple[str | tuple[str, ...] | None, tuple[tuple[int, int], ...], tuple[int, ...], tuple[int, ...] | None]


def source_names(src: str | tuple[str, ...] | None) -> tuple[str, ...]:
    """The names a resolved part's source reads: none (zeros), one, or its aliases."""
    return () if src is None else (src,) if isinstance(src, str) else src


def used_sources(dst: Mapping[str, Layout], resolved: Mapping[str, tuple[Resolved, ...]]) -> set[str]:
    """The source names a plan reads: destinations without parts read their namesakes."""
    used = {n for n in dst if n not in resolved}
    used.update(n for rs in resolved.values() for p in rs for n in source_names(p[0]))
    return used


@lru_cache(maxsize=1024)
def _regions(shape, mesh_shape, placements) -> frozenset:
    """The distinct non-empty regions (per dim, segments with local offsets) a geometry's ranks hold."""
    return frozenset(s for s in segments_by_mesh_index(shape, mesh_shape, placements) if all(s))


def _alias_problems(w: str, p: Part, src: Mapping[str, Layout]) -> list[str]:
    """Aliases must be copies of one tensor, split alike: equal shape and dtype, the same regions
    (whichever ranks hold them), and a rank listed by two of them holding the same region of both.
    (A replica set then spans the aliases, with one local offset per region for all its ranks.)"""
    names = p.sources
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        return [f"{w}={p}: aliases {twice} are listed more than once"]
    if not all(n in src for n in names):   # reported with the part's other names
        return []
    out = []
    for i, b in enumerate(names[1:], 1):
        a = names[0]
        la, lb = src[a], src[b]
        if la.shape != lb.shape or la.dtype != lb.dtype:
            out.append(f"{w}={p}: aliases must be copies of one tensor, but src_layouts[{a!r}] is "
                       f"{la.shape} {la.dtype} and src_layouts[{b!r}] is {lb.shape} {lb.dtype}")
            continue
        if _regions(la.shape, la.mesh_shape, la.placements) != _regions(lb.shape, lb.mesh_shape, lb.placements):
            out.append(f"{w}={p}: aliases must be split alike (the same regions, on any ranks), but "
                       f"src_layouts[{a!r}]={la} and src_layouts[{b!r}]={lb} split {la.shape} differently")
            continue
        for c in names[:i]:
            lc = src[c]
            odd = sorted(r for r in set(lc.ranks) & set(lb.ranks) if lc.segments(r) != lb.segments(r))
            if odd:
                out.append(f"{w}={p}: rank(s) {odd} hold different regions of src_layouts[{c!r}]={lc} and "
                           f"src_layouts[{b!r}]={lb}; a rank holding two aliases must hold the same region of both")
    return out


@lru_cache(maxsize=4096)
def _tiling_gaps(shape: tuple[int, ...], boxes: tuple[tuple[tuple[int, int], ...], ...]) -> tuple:
    """Overlaps ``("overlap", i, j, box)`` and holes ``("hole", count, box)`` of ``boxes`` (already
    in bounds) against ``shape``. Cached on geometry: a model's layers repeat a few tilings."""
    out = []
    for i in range(len(boxes)):
        for j in range(i):
            inter = tuple((max(a0, b0), min(a1, b1)) for (a0, a1), (b0, b1) in zip(boxes[i], boxes[j], strict=True))
            if all(a < b for a, b in inter):
                out.append(("overlap", j, i, inter))
    if math.prod(shape) == 0:
        return tuple(out)
    # Holes: compress coordinates to the boxes' edges, count coverage per cell.
    edges = [sorted({0, n, *(x for box in boxes for x in box[d])}) for d, n in enumerate(shape)]
    grid = torch.zeros([len(e) - 1 for e in edges], dtype=torch.int32)
    for box in boxes:
        if all(a < b for a, b in box):
            grid[tuple(slice(e.index(a), e.index(b)) for e, (a, b) in zip(edges, box, strict=True))] += 1
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
        box = tuple((0, n) if iv is None else iv for iv, n in zip(p.dst, d.shape, strict=True))
        bad = [f"dim {k}: {a}:{b}" for k, ((a, b), n) in enumerate(zip(box, d.shape, strict=True))
               if not 0 <= a <= b <= n]
        if bad:
            problems.append(f"{w}={p}: dst box {fmt_box(box)} is outside dst_layouts[{name!r}].shape="
                            f"{d.shape} ({'; '.join(bad)})")
            continue
        start = p.src_start if p.src_start is not None else (0,) * d.ndim
        found = len(problems)
        for sname in p.sources:
            s = src.get(sname)
            if s is None:
                problems.append(f"{w}={p}: src_layouts has no {sname!r}")
                continue
            if s.ndim != d.ndim or len(start) != d.ndim:
                problems.append(f"{w}={p}: src_layouts[{sname!r}].shape={s.shape} and src_start={start} "
                                f"must have the destination's {d.ndim} dims")
                continue
            # The box's extent along each source dim: destination dim k runs along source dim src_dims[k].
            extent = [hi - lo for lo, hi in box]
            if p.src_dims is not None:
                extent = [extent[p.src_dims.index(j)] for j in range(d.ndim)]
            stop = tuple(a + n for a, n in zip(start, extent, strict=True))
            if any(a < 0 or b > n for a, b, n in zip(start, stop, s.shape, strict=True)):
                problems.append(f"{w}={p}: source box {fmt_box(tuple(zip(start, stop, strict=True)))} is outside "
                                f"src_layouts[{sname!r}].shape={s.shape}")
                continue
            if not dtypes.castable(s.dtype, d.dtype):
                problems.append(f"{w}: dst_layouts[{name!r}].dtype={d.dtype} cannot be produced from "
                                f"src_layouts[{sname!r}].dtype={s.dtype}")
        if len(p.sources) > 1:
            problems += _alias_problems(w, p, src)
        if len(problems) > found:
            continue
        resolved.append((p.src, box, start, None if p.src is None else p.src_dims))
        labels.append(f"[{i}] {p}")
    # The host planner tells an op's source by (destination, the name it reads): one source per name.
    read_as: dict[str, object] = {}
    for src_, _, _, _ in resolved:
        for n in source_names(src_):
            if read_as.setdefault(n, src_) not in (src_, None):
                problems.append(f"{where} reads {n!r} as {' or '.join(source_names(read_as[n]))} and as "
                                f"{' or '.join(source_names(src_))}: a destination reads each source under one "
                                f"list of aliases")
                read_as[n] = None   # said once
    if len(problems) == n_before:
        gaps = _tiling_gaps(d.shape, tuple(b for _, b, _, _ in resolved))
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


def transposed(parts) -> list[str]:
    """The destinations of ``parts`` (``{dst name: [Part, ...]}``, or None) with a transposed part
    (``src_dims``), sorted."""
    return sorted(n for n, ps in (parts or {}).items()
                  if isinstance(ps, (list, tuple)) and any(getattr(p, "src_dims", None) is not None for p in ps))


def refuse_transposed(where: str, parts, why: str, names=None) -> None:
    """One ``ValueError`` naming every destination of ``parts`` (of ``names``, when given) built
    from a transposed part: ``why`` says which plan cannot move it (only the single-host copy
    path reads a source box through ``permute``)."""
    bad = [n for n in transposed(parts) if names is None or n in names]
    if bad:
        raise ValueError(f"{where}: {len(bad)} destination(s) are built from transposed parts (Part(src_dims=...)), "
                         f"which {why}: {bad}")


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
