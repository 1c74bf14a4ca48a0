"""The boxes that cross into one host, steps 3 to 5 of the host planner (:mod:`.hosts`), shared by
:func:`~.hosts.plan_hosts` and :func:`~.hostpart.plan_host_part`: each box's sender
(:func:`choose_senders`), its receiver (:func:`assign_receivers`) and its place in the receiver's
buffer (:func:`lay_out_buffers`); and the checks of the host map both entry points run
(:func:`check_hosts`)."""
from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping
from functools import lru_cache, partial
from typing import NamedTuple

from . import replicas
from .boxes import Box, box_extent, box_is_contiguous, box_nbytes, box_part, slices_of
from .hostplan import CrossTransfer, new_transfer

__all__ = ["Crossing", "assign_receivers", "check_hosts", "choose_senders", "lay_out_buffers", "new_crossing"]


def check_hosts(ranks, hosts, host: str | None, align, first_index, who: str) -> dict[int, str]:
    """``{rank: host}`` for the plan's ``ranks``; one ``ValueError`` naming every problem with
    ``hosts`` and the part's arguments."""
    if not isinstance(hosts, Mapping):
        raise TypeError(f"hosts must be a mapping rank -> host name, got {type(hosts).__name__}")
    problems = []
    ranks = sorted(ranks)
    missing = [r for r in ranks if r not in hosts]
    if missing:
        problems.append(f"hosts has no entry for plan rank(s) {missing} (hosts has ranks {sorted(hosts)})")
    bad = [f"hosts[{r!r}]={h!r}" for r, h in hosts.items() if not isinstance(h, str) or not h]
    if bad:
        problems.append("host names must be non-empty strings: " + ", ".join(bad))
    if problems:
        raise ValueError(f"{who}: {len(problems)} problem(s):\n  - " + "\n  - ".join(problems))
    problems = []
    if not isinstance(align, int) or align < 1:
        problems.append(f"align must be a positive int, got align={align!r}")
    if host is not None and host not in set(hosts.values()):
        problems.append(f"host={host!r} is no host of hosts (hosts: {sorted(set(hosts.values()))})")
    if isinstance(first_index, bool) or not isinstance(first_index, int) or first_index < 0:
        problems.append(f"first_index must be an int >= 0, got first_index={first_index!r}")
    if problems:
        raise ValueError(f"{who}: {len(problems)} problem(s):\n  - " + "\n  - ".join(problems))
    return {r: hosts[r] for r in ranks}


class Crossing(NamedTuple):
    """A box of a source's local shard on its way into ``host``; ``sender`` and ``receiver`` are
    filled in by the steps that choose them (-1 until then)."""

    host: str
    name: str
    group: tuple[int, ...]   # the source replicas holding the box
    box: Box
    sender: int = -1
    receiver: int = -1


#: ``new_crossing((host, name, group, box, sender, receiver))``: a :class:`Crossing` without the
#: NamedTuple's Python-level ``__new__`` (a host part makes tens of thousands).
new_crossing = partial(tuple.__new__, Crossing)


def choose_senders(crossings: list[Crossing], src_lay, knobs: replicas.Knobs) -> list[Crossing]:
    """Step 3: each box's sender, one of the box's replica set (all off the destination host),
    balanced by bytes sent into the host with :func:`.replicas.spread` (each host on its own, so
    that a host's part needs no other host's ops). A big box whose replicas
    would otherwise send unevenly is cut along its outermost dim between several of them; every
    resulting box has exactly one sender."""
    if all(len(c.group) == 1 for c in crossings):   # no choice (sources not replicated): boxes stay whole
        return [c if c.sender == c.group[0] else c._replace(sender=c.group[0]) for c in crossings]
    pieces = [replicas.Piece(c.group, box_nbytes(src_lay[c.name], c.box), box_extent(c.box),
                             (c.host, c.name, c.group, c.box)) for c in crossings]
    out = []
    for c, shares in zip(crossings, replicas.spread(pieces, replicas.Loads(), knobs)):
        u0 = 0
        for sender, units in shares:
            out.append(c._replace(box=box_part(c.box, u0, u0 + units), sender=sender))
            u0 += units
    return out


def assign_receivers(crossings: list[Crossing], receivers: set[int], src_lay, arena_pos,
                      knobs: replicas.Knobs) -> list[Crossing]:
    """Step 4: each box's receiver, one of the destination host's ranks that need data from other
    hosts. The host's boxes in (sender, arena) order are cut into one consecutive run per receiver
    of about equal bytes (:func:`.replicas.cut_runs`), a box at a run's end cut along its outermost
    dim: boxes back to back in a sender's arena stay together and travel as few messages.
    ``crossings``: one host's; ``receivers``: its ranks that read from other hosts."""
    if not crossings:
        return []
    seq = sorted(crossings, key=lambda c: (c.sender, arena_pos(c.sender, c.name), c.name, c.box))
    sizes = [_size(c.box, src_lay[c.name].itemsize) for c in seq]
    recvs = sorted(receivers)
    out = []
    for i, u0, u1, run in replicas.cut_runs(sizes, len(recvs), knobs):
        h, name, group, box, sender, _ = seq[i]
        if (u0, u1) != (0, sizes[i][1]):
            box = box_part(box, u0, u1)
        out.append(new_crossing((h, name, group, box, sender, recvs[run])))
    return out


@lru_cache(maxsize=1 << 16)
def _size(box: Box, itemsize: int) -> tuple[int, int]:
    """``(bytes, extent)`` of a box (layers repeat boxes)."""
    return math.prod(b - a for a, b in box) * itemsize, box_extent(box)


@lru_cache(maxsize=1 << 16)
def _contiguous(box: Box, shape: tuple[int, ...]) -> bool:
    return box_is_contiguous(box, shape)


def lay_out_buffers(crossings: list[Crossing], host_of: Mapping[int, str], src_lay, arena_pos,
                     align: int, first: int = 0, shape_of=None) -> tuple[list[CrossTransfer], dict[int, int], list[Crossing]]:
    """Step 5: each receiver's buffer holds its boxes back to back, ``align``-byte aligned, grouped by
    sender in the sender's arena order (so arena neighbours are buffer neighbours: one message).
    Returns the transfers, numbered in buffer order from ``first``, each receiver's buffer size, and
    the crossings in transfer order. ``shape_of(name, sender)``: the sender's local shape of the
    source (default: the layout's)."""
    transfers: list[CrossTransfer] = []
    buffer_bytes: dict[int, int] = defaultdict(int)
    shapes: dict[tuple[str, int], tuple] = {}
    order = sorted(crossings, key=lambda c: (c.receiver, c.sender, arena_pos(c.sender, c.name), c.name, c.box))
    for c in order:
        lay = src_lay[c.name]
        shape = shapes.get((c.name, c.sender))
        if shape is None:
            shape = shapes[(c.name, c.sender)] = (tuple(lay.local_shape(c.sender)) if shape_of is None
                                                  else shape_of(c.name, c.sender))
        pos = -(-buffer_bytes[c.receiver] // align) * align
        size = _size(c.box, lay.itemsize)[0]
        transfers.append(new_transfer(first + len(transfers), c.name, c.sender, c.receiver, host_of[c.sender], c.host,
                                      _slices(c.box), lay.dtype, pos, size, _contiguous(c.box, shape)))
        buffer_bytes[c.receiver] = pos + size
    return transfers, {r: -(-b // align) * align for r, b in buffer_bytes.items()}, order


@lru_cache(maxsize=1 << 16)
def _slices(box: Box) -> tuple[slice, ...]:
    return slices_of(box)
