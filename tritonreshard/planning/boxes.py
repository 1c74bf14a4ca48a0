"""Boxes of a local shard (``((start, stop), ...)`` per dim) and the arithmetic both planners do on
them: union, intersection, cuts along the split axis, global intervals, contiguity; and the one
alignment every byte layout shares (:data:`RECV_ALIGN`)."""
from __future__ import annotations

import math
from itertools import pairwise

from . import replicas

__all__ = ["Box", "RECV_ALIGN", "box_extent", "box_is_contiguous", "box_nbytes", "box_of", "box_part",
           "cut_global", "intersect_boxes", "slices_of", "union_boxes"]

#: Every tensor in an arena and every box in a receive buffer starts on this boundary, in bytes
#: (128-bit vector loads, GPU coalescing; a multiple of every dtype's size). The one home of the
#: value: the transports' ``ALIGN`` is this constant (planning is the lower layer). Boxes back to back
#: in a source arena stay back to back in a receive buffer and travel as one message.
RECV_ALIGN = 256

Box = tuple[tuple[int, int], ...]   # per dim [start, stop) in a source rank's local shard


def slices_of(box: Box) -> tuple[slice, ...]:
    return tuple(slice(a, b) for a, b in box)


def box_of(slices: tuple[slice, ...]) -> Box:
    return tuple((s.start, s.stop) for s in slices)


def box_is_contiguous(box: Box, shape: tuple[int, ...]) -> bool:
    """True when ``box`` is one contiguous range of a row-major tensor of ``shape``: every dim before
    the first one of extent != 1 has extent 1, and every dim after it is whole."""
    for d, (a, b) in enumerate(box):
        if b - a != 1:
            return all(box[j] == (0, shape[j]) for j in range(d + 1, len(box)))
    return True


def union_boxes(boxes: list[Box]) -> list[Box]:
    """Disjoint boxes covering the union of ``boxes``, merged along every dim where the pieces on
    both sides of a cut are equal (a set of boxes tiling a whole shard comes back as one box)."""
    if not boxes:
        return []
    if not boxes[0]:
        return [()]
    cuts = sorted({b[0][0] for b in boxes} | {b[0][1] for b in boxes})
    out: list[Box] = []
    run: tuple[int, int, tuple[Box, ...]] | None = None
    for a, b in pairwise(cuts):
        inside = [bx[1:] for bx in boxes if bx[0][0] <= a and b <= bx[0][1]]
        sub = tuple(union_boxes(inside)) if inside else None
        if run is not None and sub == run[2]:
            run = (run[0], b, sub)
            continue
        if run is not None and run[2] is not None:
            out.extend(((run[0], run[1]),) + s for s in run[2])
        run = (a, b, sub)
    if run is not None and run[2] is not None:
        out.extend(((run[0], run[1]),) + s for s in run[2])
    return out


def intersect_boxes(a: Box, b: Box) -> Box | None:
    out = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b, strict=True))
    return out if all(lo < hi for lo, hi in out) else None


def box_nbytes(lay, box: Box) -> int:
    return math.prod(b - a for a, b in box) * lay.itemsize


def box_extent(box: Box) -> int:
    """Units ``box`` can be cut into: its extent along :func:`~.replicas.split_axis` (1: one element)."""
    axis = replicas.split_axis([b - a for a, b in box])
    return 1 if axis is None else box[axis][1] - box[axis][0]


def box_part(box: Box, u0: int, u1: int) -> Box:
    """Units ``[u0, u1)`` of ``box`` along :func:`~.replicas.split_axis` (contiguous if ``box`` is)."""
    if (u0, u1) == (0, box_extent(box)):
        return box
    axis = replicas.split_axis([b - a for a, b in box])
    a = box[axis][0]
    return box[:axis] + ((a + u0, a + u1),) + box[axis + 1:]


def cut_global(intervals: tuple[tuple[int, int], ...], start: int, stop: int) -> tuple[tuple[int, int], ...]:
    """The global intervals covering positions [start, stop) of the concatenation of ``intervals``."""
    out, pos = [], 0
    for a, b in intervals:
        n = b - a
        lo, hi = max(start, pos), min(stop, pos + n)
        if lo < hi:
            out.append((a + lo - pos, a + hi - pos))
        pos += n
    return tuple(out)
