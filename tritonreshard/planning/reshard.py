"""The reshard planner: which slice goes from which source rank to which destination rank.

Pure Python and deterministic: every rank derives the same :class:`Plan` from the same layouts, with
no coordinator. A plan is a tuple of small immutable :class:`TransferOp`s; executing all of them
writes every element of every destination rank's local shard exactly once, straight from a source
rank's local shard (nothing gathered, nothing staged).

Cost grows with tensors x overlapping (src, dst) rank pairs, never with elements: per tensor dim a
rank holds a few segments (one per block), and intersections are computed on segments.

Per-rank plans (``plan_reshard(..., rank=r)``): exactly the whole plan's ops with source or
destination ``r``, computed from ``r``'s own pieces only (what it reads as a destination, what its
replica set serves as a source), so the cost grows with ``r``'s work, not the world. This works
because a piece's replica choice (:func:`.replicas.share`) depends only on the piece's place in the
plan, never on the other pieces. Overlap pieces are cached per (source geometry, destination
geometry, rank): a model's layers repeat a few geometries.

A destination may be built from other sources than its namesake (``parts=``): each
:class:`~tritonreshard.layout.Part` maps a box of the destination's global index to a box of a source
tensor, or marks it as padding. The planner clips the destination ranks' segments to the box and
shifts them into the source's coordinates, then intersects as usual; padding becomes
:class:`FillOp`s (zeros). The parts must tile the destination exactly.

A part may name several *aliases*, source tensors holding the same data (Megatron's tied embedding
on its first and last stages): the planner reads them as one source whose geometry
(:class:`_Aliases`) is their ranks together, so a replica set spans the aliases and the usual
spreading serves the part from all of them. Each op reads the alias its source rank holds.

A part may be transposed (``Part(src_dims=...)``): destination dim k is intersected with source dim
``src_dims[k]``, pieces stay in the destination's order of dims, and each op carries the
permutation with its ``src_slices`` / ``global_index`` in the source's order (``src[src_slices]
.permute(src_dims)`` is the op's box). Bytes are counted as for any op (same element count).
"""
from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from itertools import chain, product
from operator import itemgetter
from typing import NamedTuple

from ..layout import Layout, Part, Segment, segments_by_mesh_index
from . import replicas
from ._gc import gc_paused
from .boxes import cut_global
from .checks import check_inputs, used_sources
from .ops import FillOp, Plan, PlanStats, TransferOp, merge_plans, new_op

# Plan, its ops and merge_plans live in .ops; this module makes plans (they stay importable from here).
__all__ = ["TransferOp", "FillOp", "Plan", "PlanStats", "merge_plans", "plan_reshard", "source_pieces"]



# One dim of an intersection: (src_local_start, dst_local_start, length, global intervals).
_DimPiece = tuple[int, int, int, tuple[tuple[int, int], ...]]


def _intersect_dim(src: tuple[Segment, ...], dst: tuple[Segment, ...]) -> list[_DimPiece]:
    """Overlap of two segment lists along one dim, coalesced where both sides stay contiguous."""
    out: list[_DimPiece] = []
    i = j = 0
    while i < len(src) and j < len(dst):
        s0, s1, sl = src[i]
        d0, d1, dl = dst[j]
        lo, hi = max(s0, d0), min(s1, d1)
        if lo < hi:
            if out and out[-1][0] + out[-1][2] == sl + lo - s0 and out[-1][1] + out[-1][2] == dl + lo - d0:
                # Contiguous on both local sides (e.g. matching packed blocks): one longer piece.
                ps, pd, pn, pg = out[-1]
                g = pg[:-1] + ((pg[-1][0], hi),) if pg[-1][1] == lo else pg + ((lo, hi),)
                out[-1] = (ps, pd, pn + hi - lo, g)
            else:
                out.append((sl + lo - s0, dl + lo - d0, hi - lo, ((lo, hi),)))
        if s1 <= d1:
            i += 1
        else:
            j += 1
    return out


def _op_fields(dims: tuple[_DimPiece, ...], order: tuple[int, ...] | None = None) -> tuple:
    """(src_slices, dst_slices, global_index) of a piece. ``dims`` run in the destination's order;
    ``order``: a transposed part's ``src_dims`` (destination dim k runs along source dim
    ``order[k]``), the source's slices and global intervals then put in the source's order."""
    src = tuple(slice(s, s + n) for s, _, n, _ in dims)
    glob = tuple(g for _, _, _, g in dims)
    if order is not None:
        at = {j: k for k, j in enumerate(order)}   # source dim -> the destination dim along it
        src, glob = tuple(src[at[j]] for j in range(len(src))), tuple(glob[at[j]] for j in range(len(glob)))
    return src, tuple(slice(d, d + n) for _, d, n, _ in dims), glob


def _make_op(name: str, src: int, dst: int, dims: tuple[_DimPiece, ...], src_name: str,
             order: tuple[int, ...] | None = None) -> TransferOp:
    return TransferOp(name, src, dst, *_op_fields(dims, order), src_name, order)


def _split(dims: tuple[_DimPiece, ...], units: list[int]) -> list[tuple[_DimPiece, ...]]:
    """Split a piece along :func:`~.replicas.split_axis` into consecutive parts of ``units``."""
    axis = replicas.split_axis([p[2] for p in dims])
    s, d, n, g = dims[axis]
    parts, pos = [], 0
    for u in units:
        if u:
            cut = (s + pos, d + pos, u, cut_global(g, pos, pos + u))
            parts.append(dims[:axis] + (cut,) + dims[axis + 1:])
        pos += u
    assert pos == n
    return parts



@gc_paused
def plan_reshard(src_layouts: Mapping[str, Layout], dst_layouts: Mapping[str, Layout],
                 parts: Mapping[str, list[Part]] | None = None, *, rank: int | None = None) -> Plan:
    """Plan moving every tensor of ``dst_layouts`` from the source layouts.

    Args:
        src_layouts: name -> Layout on the source (trainer) ranks. Names no destination needs are
            ignored.
        dst_layouts: name -> Layout on the destination (inference) ranks. A destination without an
            entry in ``parts`` comes from the source of the same name and global shape. The dtype may
            differ among float32 / bfloat16 / float16 (cast in the copy).
        parts: optional ``{dst_name: [trs.Part, ...]}``: boxes of the destination's global index
            and the source tensor (of any name) or zero padding each comes from. The parts must tile
            the destination exactly. This builds fused tensors (q/k/v -> qkv, gate/up -> gate_up),
            replicated pieces (one source box feeding several boxes) and padded dims. A part may
            name aliases, ``Part((a, b), ...)``: copies of one tensor (equal shape and dtype, split
            alike) whose ranks all serve the box as replicas; each op reads its rank's copy. A part
            with ``src_dims`` reads its box transposed (ops carry ``src_dims``).
        rank: None (default) for the whole plan; a rank for that rank's plan only: the ops it
            executes as a destination (its reads) and serves as a source (what it must fence), and
            its destinations' fills, exactly as the whole plan has them. Its cost grows with that
            rank's own work (the pieces it reads or serves), not with the number of ranks.

    Returns a :class:`Plan` whose ops and fills write each element of each destination rank's local
    shard exactly once. Meshes may be disjoint or overlap: a destination rank that holds the data as
    a source copies locally. Reads from replicated sources are spread over the replicas
    (:func:`.replicas.share`: each piece's choice follows from its own place in the plan, so a
    rank's plan needs no other rank's pieces). Deterministic and cached: the same inputs give the
    same plan on every rank.

    Raises ``ValueError`` listing every problem (missing source, shape mismatch, unsupported dtype
    pair, a part out of bounds, a hole or an overlap in a destination, aliases that are not copies
    of one tensor, naming the tensor and the range) before anything moves; ``TypeError`` for values
    that are not Layouts / Parts.
    """
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or rank < 0):
        raise ValueError(f"plan_reshard: rank={rank!r} must be None (the whole plan) or a rank >= 0")
    resolved = check_inputs(src_layouts, dst_layouts, parts)
    needed = tuple(sorted((n, src_layouts[n]) for n in used_sources(dst_layouts, resolved)))
    return _plan_cached(needed, tuple(sorted(dst_layouts.items())), tuple(sorted(resolved.items())),
                        replicas.KNOBS, rank)


def _geometry(layout: Layout) -> tuple:
    """What the overlap pieces depend on: shape, mesh and placements (not the dtype)."""
    return (layout.shape, layout.mesh_shape, layout.ranks, layout.placements)


@dataclass(frozen=True)
class _Aliases:
    """The geometry of a part's aliases read as one source (:class:`~tritonreshard.layout.Part`):
    one :func:`_geometry` per alias, in the part's order. Its ranks are all the aliases' ranks (a
    rank listed twice reads the first alias listing it); :func:`.checks.check_inputs` made sure
    they split alike, so ranks of several aliases holding one region form one replica set."""

    geometries: tuple


def source_geometry(src_layouts: Mapping[str, Layout], src) -> tuple | _Aliases:
    """The geometry of a resolved part's source: a name's layout's, or its aliases' together."""
    if isinstance(src, str):
        return _geometry(src_layouts[src])
    return _Aliases(tuple(_geometry(src_layouts[n]) for n in src))


def source_itemsize(src_layouts: Mapping[str, Layout], src) -> int:
    """The element size of a resolved part's source (aliases share their dtype)."""
    return src_layouts[src if isinstance(src, str) else src[0]].itemsize


@lru_cache(maxsize=1024)
def _segments_of(geometry) -> dict:
    if isinstance(geometry, _Aliases):
        merged: dict = {}
        for g in geometry.geometries:
            for r, segs in _segments_of(g).items():
                merged.setdefault(r, segs)
        return merged
    shape, mesh_shape, ranks, placements = geometry
    return dict(zip(ranks, segments_by_mesh_index(shape, mesh_shape, placements), strict=True))


@lru_cache(maxsize=1024)
def alias_of(src: tuple[str, ...], geometry: _Aliases) -> dict[int, str]:
    """``{rank: the alias it reads}`` for aliases ``src`` of ``geometry`` (the first listing it)."""
    out: dict[int, str] = {}
    for name, g in zip(src, geometry.geometries, strict=True):
        for r in g[2]:
            out.setdefault(r, name)
    return out


@lru_cache(maxsize=1024)
def _positions(ranks: tuple[int, ...]) -> dict[int, int]:
    return {r: i for i, r in enumerate(ranks)}


@lru_cache(maxsize=1024)
def _source_groups(s_geo: tuple) -> tuple[tuple, dict[int, int]]:
    """The source's replica sets ``((regions, ranks), ...)`` and ``{rank: index of its set}``."""
    items = tuple(replicas.group_replicas(_segments_of(s_geo)).items())
    return items, {r: i for i, (_, group) in enumerate(items) for r in group}


def _clip(segs: tuple[Segment, ...], lo: int, hi: int, delta: int) -> tuple[Segment, ...]:
    """The parts of a rank's segments inside global [lo, hi), shifted by ``delta`` (into the source's
    coordinates); local offsets stay those of the destination."""
    out = []
    for g0, g1, loc in segs:
        a, b = max(g0, lo), min(g1, hi)
        if a < b:
            out.append((a + delta, b + delta, loc + a - g0))
    return tuple(out)


def _dst_segments(d_geo: tuple, box: tuple | None, src_start: tuple | None, order: tuple | None,
                  dst_rank: int) -> tuple:
    """``dst_rank``'s segments, clipped to the destination ``box`` and shifted to the source box
    (destination dim k to source dim ``order[k]`` of a transposed part; the segments stay in the
    destination's order of dims)."""
    segs = _segments_of(d_geo)[dst_rank]
    if box is None:
        return segs
    starts = src_start if order is None else tuple(src_start[j] for j in order)
    return tuple(_clip(s, lo, hi, st - lo) for s, (lo, hi), st in zip(segs, box, starts, strict=True))


class _Template(NamedTuple):
    """A piece's op fields when its source is fixed (one replica, or the destination holds the data
    itself), and its sort key: made once per geometry (layers repeat them)."""

    src_rank: int
    src_slices: tuple[slice, ...]
    dst_slices: tuple[slice, ...]
    global_index: tuple
    sort_key: tuple   # (dst_rank, dst starts, src_rank): the plan's order within a tensor


class _Row(NamedTuple):
    """One piece of a (source layout, destination layout) pair, independent of the tensor's name and
    dtype (a model's layers repeat a geometry). Made once per geometry and cached, so a NamedTuple's
    construction cost is paid per geometry, not per op; the hot loops unpack it like a tuple."""

    dst_rank: int
    group_index: int             # which replica set of the source
    group: tuple[int, ...]       # the replica set
    ordinal: int                 # the piece's place among the set's pieces for this dst_rank
    dims: tuple                  # per dim (src_local_start, dst_local_start, length, global intervals)
    numel: int
    template: _Template | None   # None: :func:`.replicas.share` picks the replicas
    order: tuple | None = None   # a transposed part's src_dims (``dims`` run in the destination's order)


class OpRow(NamedTuple):
    """One op of the plan without its tensor's names (:func:`rows_into`): shared by every tensor of
    the same geometry. ``group``: the replica set holding the source box (``src_rank`` is one)."""

    src_rank: int
    dst_rank: int
    src_slices: tuple[slice, ...]
    dst_slices: tuple[slice, ...]
    global_index: tuple
    group: tuple[int, ...]


class Job(NamedTuple):
    """The ops of one (destination tensor, source tensor) pair into some destination ranks
    (:func:`rows_into`). Jobs of the same geometry have the same ``key`` and share one ``rows``;
    ``source`` numbers the source's geometry (equal for sources of one geometry). ``src_name``: the
    source's name, or its aliases' names (a tuple); then ``alias`` maps each source rank to the
    alias it reads (:func:`alias_of`), else it is None."""

    name: str
    src_name: str | tuple[str, ...]
    key: int
    source: int
    rows: tuple[OpRow, ...]
    alias: Mapping[int, str] | None = None


def _rows(dst_rank: int, d_segs: tuple, g_idx: int, s_segs: tuple, group: tuple[int, ...],
          order: tuple | None = None) -> list[_Row]:
    # A transposed part pairs destination dim k with source dim order[k].
    per_dim = [_intersect_dim(s_segs[k if order is None else order[k]], d) for k, d in enumerate(d_segs)]
    if not all(per_dim):
        return []
    rows = []
    for ordinal, dims in enumerate(product(*per_dim)):
        template = None
        if len(group) == 1 or dst_rank in group:
            src_rank = dst_rank if dst_rank in group else group[0]
            fields = _op_fields(dims, order)
            # The op's fields and its sort key, made once per geometry (layers repeat them).
            template = _Template(src_rank, *fields, (dst_rank, tuple(d.start for d in fields[1]), src_rank))
        rows.append(_Row(dst_rank, g_idx, group, ordinal, dims, math.prod(p[2] for p in dims), template, order))
    return rows


@lru_cache(maxsize=1 << 14)
def _dst_rows(s_geo: tuple, d_geo: tuple, box: tuple | None, src_start: tuple | None, order: tuple | None,
              dst_rank: int) -> tuple:
    """The pieces ``dst_rank`` reads, from every replica set of the source (``order``: a
    transposed part's ``src_dims``, else None)."""
    d_segs = _dst_segments(d_geo, box, src_start, order, dst_rank)
    if not all(d_segs):
        return ()
    groups, _ = _source_groups(s_geo)
    return tuple(row for g_idx, (s_segs, group) in enumerate(groups)
                 for row in _rows(dst_rank, d_segs, g_idx, s_segs, group, order))


@lru_cache(maxsize=1 << 14)
def _src_rows(s_geo: tuple, d_geo: tuple, box: tuple | None, src_start: tuple | None, order: tuple | None,
              src_rank: int) -> tuple:
    """The pieces every destination rank reads from ``src_rank``'s replica set (the rank may serve
    only some of them: :func:`_emit` decides)."""
    groups, of_rank = _source_groups(s_geo)
    g_idx = of_rank.get(src_rank)
    if g_idx is None:   # an empty shard: nothing to read
        return ()
    s_segs, group = groups[g_idx]
    out = []
    for dst_rank in d_geo[2]:
        d_segs = _dst_segments(d_geo, box, src_start, order, dst_rank)
        if all(d_segs):
            out += _rows(dst_rank, d_segs, g_idx, s_segs, group, order)
    return tuple(out)


def _emit(row: _Row, name: str, src_name: str, alias: Mapping[int, str] | None, turn: int, s_isz: int,
          knobs: replicas.Knobs) -> list[TransferOp]:
    """The op(s) of one piece whose replicas :func:`.replicas.share` picks. ``turn`` rotates which
    replica of a set serves it; it is derived from the piece's place in the plan (tensor, part,
    destination rank, replica set, ordinal), never from other pieces' choices, so any rank derives
    the choice for any piece on its own. ``alias``: for aliased sources, the alias each rank reads."""
    return [_make_op(name, src_rank, row.dst_rank, part, src_name if alias is None else alias[src_rank], row.order)
            for src_rank, part in _shares(row, turn, s_isz, knobs)]


def _shares(row: _Row, turn: int, s_isz: int, knobs: replicas.Knobs) -> list[tuple[int, tuple]]:
    """``(src_rank, dims)`` of each part of a piece whose replicas :func:`.replicas.share` picks."""
    axis = replicas.split_axis([p[2] for p in row.dims])
    shares = replicas.share(row.group, row.numel * s_isz, 1 if axis is None else row.dims[axis][2], turn, knobs)
    if len(shares) == 1:
        return [(shares[0][0], row.dims)]
    parts = _split(row.dims, [u for _, u in shares])
    return [(src_rank, part) for (src_rank, _), part in zip(shares, parts, strict=True)]


def rows_into(src_layouts: Mapping[str, Layout], dst_layouts: Mapping[str, Layout], resolved: Mapping,
              dst_ranks) -> list[Job]:
    """The whole plan's ops into ``dst_ranks``, as jobs (:class:`Job`: one per destination tensor and
    source it reads, in plan order), without making an op: jobs of the same geometry share one
    tuple of rows. The same ops, with the same replica choices, as :func:`plan_reshard` (``resolved``:
    :func:`.checks.check_inputs`' parts). A job whose pieces :func:`.replicas.share` spreads over
    replicas has rows of its own (its turn depends on the tensor's place in the plan)."""
    knobs = replicas.KNOBS
    # (geometry of the pair) -> (key, source, rows), or None where replicas are chosen per job. One
    # lookup per job: the geometry tuples are big, and hashing them is most of a job's cost.
    classes: dict[tuple, tuple | None] = {}
    sources: dict[tuple, int] = {}
    jobs: list[Job] = []
    next_key = 0
    for t_idx, (name, d_lay) in enumerate(sorted(dst_layouts.items())):
        mine = tuple(d for d in d_lay.ranks if d in dst_ranks)
        if not mine:
            continue
        parts = resolved.get(name)
        if parts is None:
            parts = ((name, None, None, None),)
        d_geo, n_dst, pos = _geometry(d_lay), len(d_lay.ranks), _positions(d_lay.ranks)
        for j_idx, (src_name, box, start, order) in enumerate(parts):
            if src_name is None:
                continue
            s_geo, s_isz = source_geometry(src_layouts, src_name), source_itemsize(src_layouts, src_name)
            alias = None if isinstance(src_name, str) else alias_of(src_name, s_geo)
            geo = (s_geo, s_isz, d_geo, box, start, order, mine)
            seen = classes.get(geo, False)
            if seen:
                jobs.append(Job(name, src_name, *seen, alias))
                continue
            out, fixed = [], True
            base = (t_idx + j_idx) * n_dst
            for d in mine:
                for row in _dst_rows(s_geo, d_geo, box, start, order, d):
                    t = row.template
                    if t is not None:
                        out.append(OpRow(t.src_rank, d, t.src_slices, t.dst_slices, t.global_index, row.group))
                        continue
                    fixed = False
                    turn = replicas.rotation(base + pos[d], len(row.group)) + row.group_index + row.ordinal
                    for src_rank, dims in _shares(row, turn, s_isz, knobs):
                        out.append(OpRow(src_rank, d, *_op_fields(dims, order), row.group))
            got = (next_key, sources.setdefault(s_geo, len(sources)), tuple(out))
            next_key += 1
            if seen is False:
                # Where replicas are chosen, the choice depends on the tensor's place in the plan:
                # each such job has rows of its own.
                classes[geo] = got if fixed else None
            jobs.append(Job(name, src_name, *got, alias))
    return jobs


@lru_cache(maxsize=1024)
def _fill_pieces(d_geo: tuple, box: tuple) -> tuple:
    """``(dst_rank, dst_slices, global_index)`` of the destination box on every destination rank."""
    rows = []
    for dst_rank, dsegs in _segments_of(d_geo).items():
        per_dim = [_clip(segs, lo, hi, 0) for segs, (lo, hi) in zip(dsegs, box, strict=True)]
        for dims in product(*per_dim):
            rows.append((dst_rank, tuple(slice(loc, loc + b - a) for a, b, loc in dims),
                         tuple(((a, b),) for a, b, _ in dims)))
    return tuple(rows)


_first = itemgetter(0)


@lru_cache(maxsize=128)
def _plan_cached(src_items: tuple[tuple[str, Layout], ...], dst_items: tuple[tuple[str, Layout], ...],
                 parts_items: tuple = (), knobs: replicas.Knobs = replicas.KNOBS, rank: int | None = None) -> Plan:
    src, dst, parts = dict(src_items), dict(dst_items), dict(parts_items)
    ops: list[TransferOp] = []
    fills: list[FillOp] = []

    for t_idx, (name, d_lay) in enumerate(dst_items):
        # Names come in order (dst_items is sorted): sort each name's ops on their own, by
        # (dst_rank, dst start, src_rank), with keys made once per op (a big plan's hot loop).
        block: list[tuple[tuple, TransferOp]] = []
        d_geo = _geometry(d_lay)
        n_dst = len(d_lay.ranks)
        pos = _positions(d_lay.ranks)
        jobs = parts.get(name)
        if jobs is None:
            jobs = ((name, None, None, None),)
        for j_idx, (src_name, box, start, order) in enumerate(jobs):
            if src_name is None:
                for dst_rank, ds, g in _fill_pieces(d_geo, box):
                    if rank is None or dst_rank == rank:
                        fills.append(FillOp(name, dst_rank, ds, g))
                continue
            s_geo, s_isz = source_geometry(src, src_name), source_itemsize(src, src_name)
            alias = None if isinstance(src_name, str) else alias_of(src_name, s_geo)
            base = (t_idx + j_idx) * n_dst
            if rank is None:
                rows = chain.from_iterable(_dst_rows(s_geo, d_geo, box, start, order, d) for d in d_lay.ranks)
            else:
                rows = chain(_dst_rows(s_geo, d_geo, box, start, order, rank) if rank in pos else (),
                             # the rank as a source: pieces for other destination ranks only (its
                             # own reads are above)
                             (row for row in _src_rows(s_geo, d_geo, box, start, order, rank) if row[0] != rank))
            for row in rows:
                template = row[6]
                if template is not None:   # the source is fixed: the hot path of a big plan
                    if rank is None or template[0] == rank or row[0] == rank:
                        block.append((template[4], new_op(name, template[0], row[0], template[1], template[2],
                                                           template[3], src_name if alias is None else
                                                           alias[template[0]], order)))
                    continue
                turn = replicas.rotation(base + pos[row[0]], len(row[2])) + row[1] + row[3]
                for op in _emit(row, name, src_name, alias, turn, s_isz, knobs):
                    if rank is None or op.dst_rank == rank or op.src_rank == rank:
                        block.append(((op.dst_rank, tuple([s.start for s in op.dst_slices]), op.src_rank), op))
        block.sort(key=_first)
        ops += [op for _, op in block]

    fills.sort(key=lambda f: (f.name, f.dst_rank, tuple(s.start for s in f.dst_slices)))
    resolved_parts = {name: tuple(Part(sn, box, st if sn is not None else None, od) for sn, box, st, od in rs)
                      for name, rs in parts.items()}
    return Plan(src, dst, tuple(ops), tuple(fills), resolved_parts, rank=rank)



def source_pieces(src_layouts: Mapping[str, Layout], dst_layouts: Mapping[str, Layout],
                  parts: Mapping[str, list[Part]] | None = None) -> list[tuple[int, tuple]]:
    """The whole plan's pieces without making its ops: byte and op accounting at a scale where the
    whole plan would not fit (millions of ops).

    Returns ``[(count, pieces), ...]``: ``count`` source tensors are read exactly alike (same
    layout and dtype, read by destinations of the same layouts, dtypes and parts: a model's layers),
    each through ``pieces``, rows of ``(replicas, dst_rank, src_box, numel, src_itemsize,
    dst_itemsize)``. ``replicas`` are the source ranks that may serve the piece (one when the plan
    has no choice; :func:`plan_reshard` then spreads it over them, in parts); ``src_box`` is the
    piece's box in the source rank's local shard (``((start, stop), ...)`` per dim). Checked like
    :func:`plan_reshard` (one ``ValueError`` listing every problem)."""
    resolved = check_inputs(src_layouts, dst_layouts, parts)
    readers: dict[str | tuple[str, ...], list[tuple]] = defaultdict(list)
    for name, d_lay in sorted(dst_layouts.items()):
        for src_name, box, start, order in resolved.get(name, ((name, None, None, None),)):
            if src_name is not None:
                readers[src_name].append((_geometry(d_lay), d_lay.itemsize, box, start, order))
    classes: dict[tuple, int] = defaultdict(int)
    for src_name, jobs in readers.items():
        geo = source_geometry(src_layouts, src_name)
        classes[(geo, source_itemsize(src_layouts, src_name), tuple(jobs))] += 1
    out = []
    for (s_geo, s_isz, jobs), count in classes.items():
        rows = []
        for d_geo, d_isz, box, start, order in jobs:
            for dst_rank in d_geo[2]:
                for _, _, group, _, dims, numel, template, _ in _dst_rows(s_geo, d_geo, box, start, order, dst_rank):
                    src_box = tuple((s.start, s.stop) for s in _op_fields(dims, order)[0])
                    rows.append(((template[0],) if template is not None else group, dst_rank, src_box, numel,
                                 s_isz, d_isz))
        out.append((count, tuple(rows)))
    return out
