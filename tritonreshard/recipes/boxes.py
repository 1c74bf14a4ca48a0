"""Boxes with an affine source map: what a loader's copies and a recipe's plan both reduce to.

A :class:`Piece` says that every element ``x`` of its ``box`` (a half-open interval per dim of one
destination tensor) holds element ``base + sum((x[k] - box[k][0]) * coef[k])`` (a row-major flat
index) of source number ``src``. A copy through views (narrow, select, transpose, permute, a split
of one dim into two) is one piece; a zero fill is a piece with ``src == FILL``; a value that is no
copy (a sum, a scale) one with ``src == NOT_A_COPY``.

Pure Python (no element data: the cost of a check is the number of pieces, never their size):

* :func:`place` turns a strided view of a contiguous tensor into a box and a split of its dims;
* :func:`copy_pieces` is what one ``dst.copy_(src)`` writes, from the two views' metadata;
* :class:`Written` collects a tensor's pieces in write order (a later write wins);
* :func:`recipe_pieces` is what a recipe's own plan writes on a rank;
* :func:`first_difference` compares two piece sets exactly, element for element, over the common
  refinement of their boxes, and names the first element that differs.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from itertools import product

from ..planning.boxes import Box, intersect_boxes

__all__ = ["Piece", "FILL", "UNTOUCHED", "NOT_A_COPY", "contiguous_strides", "place", "copy_pieces", "Written",
           "recipe_pieces", "first_difference", "merge_pieces", "shifted", "where", "any_overlap"]

#: ``Piece.src`` of a zero fill.
FILL = -1
#: What :func:`where` says of an element no piece covers.
UNTOUCHED = -2
#: ``Piece.src`` of values that are no copy of a source element.
NOT_A_COPY = -3

def contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    out, s = [], 1
    for n in reversed(shape):
        out.append(s)
        s *= n
    return tuple(reversed(out))


@dataclass(frozen=True, slots=True)
class Piece:
    """``box`` of a destination holds source ``src``'s flat elements ``base + sum((x - a) * coef)``.
    ``coef[k]`` is 0 where the box is one element wide, and everywhere for fills."""

    box: Box
    src: int
    base: int = 0
    coef: tuple[int, ...] = ()

    @staticmethod
    def make(box: Box, src: int, base: int = 0, coef: Sequence[int] = ()) -> Piece:
        if src < 0:
            return Piece(tuple(box), src, 0, (0,) * len(box))
        return Piece(tuple(box), src, base, tuple(c if b - a > 1 else 0 for (a, b), c in zip(box, coef, strict=True)))

    @property
    def numel(self) -> int:
        return math.prod(b - a for a, b in self.box)

    def at(self, x: Sequence[int]) -> int:
        """The source flat index at destination coordinates ``x`` (inside the box)."""
        return self.base + sum((xk - a) * c for xk, (a, _), c in zip(x, self.box, self.coef, strict=True))

    def clip(self, box: Box) -> Piece | None:
        """This piece on ``box`` alone (None: they do not meet)."""
        cut = intersect_boxes(self.box, box)
        if cut is None:
            return None
        return Piece.make(cut, self.src, self.at([a for a, _ in cut]), self.coef)


def place(shape: Sequence[int], offset: int, sizes: Sequence[int], strides: Sequence[int]):
    """A strided view (``offset``, ``sizes``, ``strides``, in elements) of a contiguous tensor of
    ``shape`` as a box of it: ``(starts, subs)``, where each of ``subs`` is ``(tensor dim, size, view
    dim, multiplier)``: view dim ``j``'s index is the sum of its subs' indices times their
    multipliers (a view dim that runs over several tensor dims, a flattened view, is split). None
    when the view is no box of the tensor (overlapping, strided by a step, out of bounds)."""
    cst = contiguous_strides(shape)
    by_stride = {cst[k]: k for k in range(len(shape)) if shape[k] > 1}
    work = [(j, n, s, 1) for j, (n, s) in enumerate(zip(sizes, strides, strict=True)) if n > 1]
    subs, used = [], set()
    while work:
        j, n, s, m = work.pop()
        k = by_stride.get(s)
        if k is None or k in used:
            return None
        used.add(k)
        if n <= shape[k]:
            subs.append((k, n, j, m))
            continue
        if n % shape[k]:
            return None
        subs.append((k, shape[k], j, m))
        work.append((j, n // shape[k], s * shape[k], m * shape[k]))
    total = math.prod(shape)
    if not 0 <= offset < max(total, 1):
        return None
    starts = [(offset // cst[k]) % shape[k] if shape[k] else 0 for k in range(len(shape))]
    if any(starts[k] + n > shape[k] for k, n, _, _ in subs):
        return None
    return tuple(starts), subs


def copy_pieces(shape: Sequence[int], dst_view: tuple, src: int, linear, limit: int = 1 << 12) -> list[Piece] | None:
    """What ``dst.copy_(src_view)`` writes into a contiguous destination of ``shape``:
    ``dst_view`` is ``(offset, sizes, strides)``; ``linear`` is ``(base, weights)``: the source
    flat index of view index ``v`` is ``base + sum(v[j] * weights[j])`` (a fill: ``src`` < 0 and
    ``linear`` unused). View dims that run on as one on both sides are one; a view that is no box
    (a step, a dim that both splits and strides) is cut along its outer dims into boxes, at most
    ``limit`` of them; None past that, or when the view leaves the destination."""
    offset, sizes, strides = dst_view
    base, weights = linear if src >= 0 else (0, [0] * len(sizes))
    dims: list[tuple[int, int, int]] = []
    for n, st, w in zip(sizes, strides, weights, strict=True):
        if n == 1:
            continue
        if dims and dims[-1][1] == n * st and dims[-1][2] == n * w:  # the outer dim runs on into this one
            dims[-1] = (dims[-1][0] * n, st, w)
        else:
            dims.append((n, st, w))
    return _cut(tuple(shape), offset, dims, src, base, limit)


def _cut(shape, offset, dims, src, base, limit) -> list[Piece] | None:
    got = place(shape, offset, [n for n, _, _ in dims], [st for _, st, _ in dims])
    if got is not None:
        starts, subs = got
        box = [(a, a + 1) for a in starts]
        coef = [0] * len(shape)
        for k, n, j, m in subs:
            box[k] = (starts[k], starts[k] + n)
            coef[k] = dims[j][2] * m
        return [Piece.make(tuple(box), src, base, coef)]
    if not dims or dims[0][0] > limit:
        return None
    (n, st, w), rest = dims[0], dims[1:]
    out: list[Piece] = []
    for i in range(n):
        sub = _cut(shape, offset + i * st, rest, src, base + i * w, limit // n)
        if sub is None:
            return None
        out += sub
    return out


def _overlaps(a: Box, b: Box) -> bool:
    """``intersect_boxes(a, b) is not None``, without building the intersection (the sweeps' inner loop)."""
    return all(x < d and c < y for (x, y), (c, d) in zip(a, b, strict=True))


def _minus(p: Piece, cut: Box) -> list[Piece]:
    """``p`` less the box ``cut``: up to two pieces a dim, disjoint."""
    out, rest = [], list(p.box)
    for k, ((a, b), (c, d)) in enumerate(zip(p.box, cut, strict=True)):
        c, d = max(a, c), min(b, d)
        for lo, hi in ((a, c), (d, b)):
            if lo < hi:
                out.append(p.clip(tuple(rest[:k]) + ((lo, hi),) + tuple(rest[k + 1:])))
        rest[k] = (c, d)
    return out


class Written:
    """One destination's pieces in the order they were written; :meth:`pieces` resolves overlaps
    (a later write wins) and returns disjoint pieces. ``undecided``: why the writes cannot be
    expressed as pieces (then there are none to compare)."""

    def __init__(self, shape: Sequence[int]):
        self.shape = tuple(shape)
        self.writes: list[Piece] = []
        self.undecided: str | None = None

    def write(self, pieces: list[Piece] | None, why: str = "") -> None:
        if pieces is None:
            self.undecided = self.undecided or why
        else:
            self.writes += pieces

    def pieces(self) -> list[Piece]:
        if not any_overlap(self.writes):
            return list(self.writes)
        out: list[Piece] = []
        for p in self.writes:
            out = [q for old in out for q in ((old,) if not _overlaps(old.box, p.box) else _minus(old, p.box))]
            out.append(p)
        return out


def _sweep(a: Sequence[Piece], b: Sequence[Piece]) -> Iterable[tuple[Piece, Piece]]:
    """Every pair (one of ``a``, one of ``b``) whose boxes meet, by a sweep along dim 0."""
    if not a or not b:
        return
    if not a[0].box:
        yield from ((p, q) for p in a for q in b)
        return
    events = sorted([(p.box[0][0], 0, i) for i, p in enumerate(a)] + [(q.box[0][0], 1, i) for i, q in enumerate(b)])
    active: tuple[dict, dict] = ({}, {})
    lists = (a, b)
    for start, side, i in events:
        piece, other = lists[side][i], active[1 - side]
        for j in [j for j, q in other.items() if q.box[0][1] <= start]:
            del other[j]
        for q in other.values():
            if _overlaps(piece.box, q.box):
                yield (piece, q) if side == 0 else (q, piece)
        active[side][i] = piece


def any_overlap(pieces: Sequence[Piece]) -> bool:
    if len(pieces) < 2 or not pieces[0].box:
        return len(pieces) > 1
    order = sorted(pieces, key=lambda p: p.box[0][0])
    active: list[Piece] = []
    for p in order:
        active = [q for q in active if q.box[0][1] > p.box[0][0]]
        if any(_overlaps(p.box, q.box) for q in active):
            return True
        active.append(p)
    return False


def _first_in(p: Piece, q: Piece) -> tuple[int, ...] | None:
    """The first element (row-major) of ``p``'s box (already the intersection) where ``p`` and
    ``q`` hold different source elements; None if they agree everywhere on it."""
    corner = tuple(a for a, _ in p.box)
    if p.src != q.src or p.at(corner) != q.at(corner):
        return corner
    if p.src < 0:
        return None
    for k in reversed(range(len(corner))):
        a, b = p.box[k]
        if b - a > 1 and p.coef[k] != q.coef[k]:
            return corner[:k] + (a + 1,) + corner[k + 1:]
    return None


def first_difference(got: Sequence[Piece], want: Sequence[Piece]):
    """Compare two sets of disjoint pieces of one tensor element for element: None when equal, else
    ``(index, differing elements, got's piece there or None, want's piece there or None)`` with
    ``index`` the first differing element in row-major order (an element only one side writes
    differs too). Cost: the pairs of pieces that meet, never the elements."""
    first, count, seen = None, 0, 0
    pair = (None, None)
    for p, q in _sweep(got, want):
        cell = p.clip(q.box)
        qc = q.clip(cell.box)
        seen += cell.numel
        x = _first_in(cell, qc)
        if x is None:
            continue
        corner = tuple(a for a, _ in cell.box)
        same_start = cell.src == qc.src and cell.src >= 0 and cell.at(corner) == qc.at(corner)
        count += _unequal(cell, qc) if same_start else cell.numel
        if first is None or x < first:
            first, pair = x, (p, q)
    vol_got, vol_want = sum(p.numel for p in got), sum(q.numel for q in want)
    for side, pieces, vol in ((0, got, vol_got), (1, want, vol_want)):
        if vol != seen:
            count += vol - seen
            x = _first_uncovered(pieces, want if side == 0 else got)
            if x is not None and (first is None or x < first):
                owner = next(p for p in pieces if all(a <= xk < b for xk, (a, b) in zip(x, p.box, strict=True)))
                first, pair = x, ((owner, None) if side == 0 else (None, owner))
    return None if first is None else (first, count, *pair)


def _unequal(p: Piece, q: Piece) -> int:
    """How many elements of the common box ``p.box`` the two maps differ on (they agree at the
    corner): those off the hyperplane where their difference is zero, counted along the dims where
    the coefficients differ (exact when they differ in one dim, the common case; else all)."""
    dims = [k for k, (a, b) in enumerate(p.box) if b - a > 1 and p.coef[k] != q.coef[k]]
    if len(dims) == 1:
        (k,) = dims
        a, b = p.box[k]
        return p.numel // (b - a) * (b - a - 1)
    return p.numel


def _first_uncovered(pieces: Sequence[Piece], others: Sequence[Piece]) -> tuple[int, ...] | None:
    """The first element (row-major) of ``pieces`` that no piece of ``others`` covers."""
    best = None
    for p in pieces:
        rest = [p]
        for q in others:
            rest = [r for old in rest for r in ((old,) if not _overlaps(old.box, q.box) else _minus(old, q.box))]
            if not rest:
                break
        for r in rest:
            x = tuple(a for a, _ in r.box)
            best = x if best is None or x < best else best
    return best


def where(piece: Piece | None, x: Sequence[int], names: Sequence[str], shapes: Sequence[Sequence[int]]) -> str:
    """What ``piece`` puts at ``x``, in words: ``name[i, j]``, "zero", "nothing" or "no copy"."""
    if piece is None:
        return "nothing (no source reached it)"
    if piece.src == FILL:
        return "zero"
    if piece.src < 0:
        return "a value that is no source element"
    flat, coords = piece.at(x), []
    for size in reversed(shapes[piece.src]):
        coords.append(flat % size)
        flat //= size
    return f"{names[piece.src]}[{', '.join(map(str, reversed(coords)))}]"


def recipe_pieces(spec, rank: int, names: Iterable[str] | None = None, *,
                  order: Sequence[str] | None = None) -> dict[str, list[Piece]]:
    """What ``spec``'s own plan (``spec.plan(rank)``, the plan the refit runs) writes on destination
    ``rank``: ``{name: [Piece]}`` for ``names`` (default: every destination that is a copy, not
    quantized), each op's source box in the source's global coordinates (``op.global_index``).
    ``order``: the source names whose places are the ids (default: ``spec.src``'s order)."""
    names = [n for n in (spec.dst if names is None else names) if n not in (spec.quant or {})]
    index = {n: i for i, n in enumerate(spec.src if order is None else order)}
    plan = spec.plan(rank)
    out: dict[str, list[Piece]] = {n: [] for n in names}
    for op in plan.ops:
        if op.dst_rank != rank or op.name not in out:
            continue
        cst = contiguous_strides(spec.src[op.src_name].shape)
        dims = op.src_dims or tuple(range(len(cst)))
        at = {j: k for k, j in enumerate(dims)}  # source dim j runs along destination dim at[j]
        # A packed-block op covers several global intervals of a dim, one after another locally.
        for combo in product(*[_with_offsets(iv) for iv in op.global_index]):
            box = [(s.start, s.stop) for s in op.dst_slices]
            for j, (a, b, local) in enumerate(combo):
                k = at[j]
                start = op.dst_slices[k].start + local
                box[k] = (start, start + b - a)
            base = sum(a * c for (a, _, _), c in zip(combo, cst, strict=True))
            out[op.name].append(Piece.make(tuple(box), index[op.src_name], base,
                                           [cst[dims[k]] for k in range(len(box))]))
    for fill in plan.fills:
        if fill.dst_rank == rank and fill.name in out:
            out[fill.name].append(Piece.make(tuple((s.start, s.stop) for s in fill.dst_slices), FILL))
    return out


def _with_offsets(intervals) -> list[tuple[int, int, int]]:
    """``(start, stop, offset in the op)`` of each of a dim's global intervals."""
    out, local = [], 0
    for a, b in intervals:
        out.append((a, b, local))
        local += b - a
    return out


def merge_pieces(pieces: Iterable[Piece]) -> list[Piece]:
    """Disjoint pieces with fewer, larger boxes: neighbours along a dim whose maps continue into each
    other (same source, same coefficients elsewhere, equal extents in every other dim) become one."""
    out = list(pieces)
    if not out:
        return out
    ndim = len(out[0].box)
    changed = True
    while changed:
        changed = False
        for d in range(ndim):
            def key(p, d=d):
                return (p.src, p.box[:d] + p.box[d + 1:], p.coef[:d] + p.coef[d + 1:], p.box[d][0])
            merged: list[Piece] = []
            for p in sorted(out, key=key):
                if merged and _joins(merged[-1], p, d):
                    q = merged[-1]
                    step = q.coef[d] if q.box[d][1] - q.box[d][0] > 1 else (
                        p.coef[d] if p.box[d][1] - p.box[d][0] > 1 else p.base - q.base)
                    box = q.box[:d] + ((q.box[d][0], p.box[d][1]),) + q.box[d + 1:]
                    merged[-1] = Piece.make(box, q.src, q.base, q.coef[:d] + (step,) + q.coef[d + 1:])
                    changed = True
                else:
                    merged.append(p)
            out = merged
    return out


def _joins(q: Piece, p: Piece, d: int) -> bool:
    if q.src != p.src or q.box[d][1] != p.box[d][0]:
        return False
    if (q.box[:d] + q.box[d + 1:] != p.box[:d] + p.box[d + 1:]
            or q.coef[:d] + q.coef[d + 1:] != p.coef[:d] + p.coef[d + 1:]):
        return False
    if q.src < 0:
        return True
    wq, wp = q.box[d][1] - q.box[d][0], p.box[d][1] - p.box[d][0]
    step = q.coef[d] if wq > 1 else (p.coef[d] if wp > 1 else p.base - q.base)
    if step == 0 or (wq > 1 and wp > 1 and q.coef[d] != p.coef[d]):
        return False
    return p.base == q.base + wq * step and (wp == 1 or p.coef[d] == step)


def shifted(piece: Piece, offsets: Sequence[int]) -> Piece:
    """``piece`` with its box moved by ``offsets`` (local to global coordinates)."""
    return replace(piece, box=tuple((a + o, b + o) for (a, b), o in zip(piece.box, offsets, strict=True)))
