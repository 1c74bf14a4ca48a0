"""The boxes that cross into one host, steps 3 to 5 of the host planner (:mod:`.hosts`), shared by
:func:`~.hosts.plan_hosts` and :func:`~.hostpart.plan_host_part`: each box's sender
(:func:`choose_senders`), its receiver (:func:`assign_receivers`) and its place in the receiver's
buffer (:func:`lay_out_buffers`); and the checks of the host map both entry points run
(:func:`check_hosts`).

A crossing's ``name`` is its source as the planner reads it: a tensor's name, or a tuple of
aliases' names (copies of one tensor, :class:`~tritonreshard.layout.Part`) whose replica set spans
them. The transfer names the alias its sender holds (:func:`sender_name`)."""
from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping
from functools import lru_cache, partial
from operator import itemgetter
from typing import NamedTuple

from . import replicas
from .boxes import Box, box_extent, box_is_contiguous, box_nbytes, box_part, slices_of
from .hostplan import CrossTransfer, new_transfer

__all__ = ["Crossing", "assign_receivers", "check_hosts", "choose_senders", "lay_out_buffers", "name_key",
           "new_crossing", "sender_name"]


def name_key(name: str | tuple[str, ...]) -> tuple[str, ...]:
    """A source (a name or aliases' names) as a sort key: names and aliases compare."""
    return (name,) if isinstance(name, str) else name


def sender_name(name: str | tuple[str, ...], sender: int, src_lay) -> str:
    """The tensor ``sender`` reads for source ``name``: the name, or the first alias it holds."""
    if isinstance(name, str):
        return name
    return next(n for n in name if sender in src_lay[n].ranks)


def _layout(src_lay, name: str | tuple[str, ...]):
    """The layout of a source (aliases share shape and dtype: the first's)."""
    return src_lay[name if isinstance(name, str) else name[0]]


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
    name: str | tuple[str, ...]   # the source: a name, or aliases' names (read as one source)
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
    pieces = [replicas.Piece(c.group, box_nbytes(_layout(src_lay, c.name), c.box), box_extent(c.box),
                             (c.host, name_key(c.name), c.group, c.box)) for c in crossings]
    out = []
    for c, shares in zip(crossings, replicas.spread(pieces, replicas.Loads(), knobs), strict=True):
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
    aliased = any(type(c.name) is not str for c in crossings)
    if arena_pos is None and not aliased:   # every arena offset 0: (sender, name, box), compared in C
        seq = sorted(crossings, key=_by_sender)
    elif arena_pos is None:
        seq = sorted(crossings, key=lambda c: (c.sender, name_key(c.name), c.box))
    else:
        seq = sorted(crossings, key=lambda c: (c.sender, arena_pos(c.sender, sender_name(c.name, c.sender, src_lay)),
                                               name_key(c.name), c.box))
    isz = {name: _layout(src_lay, name).itemsize for name in {c.name for c in seq}}
    sizes = [_size(c.box, isz[c.name]) for c in seq]
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


_by_sender = itemgetter(4, 1, 3)          # Crossing: (sender, name, box)
_by_receiver = itemgetter(5, 4, 1, 3)     # Crossing: (receiver, sender, name, box)


@lru_cache(maxsize=1 << 16)
def _facts(box: Box, shape: tuple[int, ...], itemsize: int) -> tuple[tuple[slice, ...], int, bool]:
    """``(slices, bytes, contiguous)`` of a box of a shard of ``shape`` (layers repeat them)."""
    return slices_of(box), math.prod(b - a for a, b in box) * itemsize, box_is_contiguous(box, shape)


def lay_out_buffers(crossings: list[Crossing], host_of: Mapping[int, str], src_lay, arena_pos,
                    align: int, first: int = 0,
                    shape_of=None) -> tuple[list[CrossTransfer], dict[int, int], list[Crossing]]:
    """Step 5: each receiver's buffer holds its boxes back to back, ``align``-byte aligned, grouped by
    sender in the sender's arena order (so arena neighbours are buffer neighbours: one message).
    Returns the transfers, numbered in buffer order from ``first``, each receiver's buffer size, and
    the crossings in transfer order. ``arena_pos(sender, name)``: the shard's offset in the sender's
    arena (None: all 0). ``shape_of(name, sender)``: the sender's local shape of the source
    (default: the layout's)."""
    transfers: list[CrossTransfer] = []
    buffer_bytes: dict[int, int] = defaultdict(int)
    shapes: dict[tuple[str, int], tuple] = {}
    aliased = any(type(c.name) is not str for c in crossings)
    if arena_pos is None and not aliased:
        order = sorted(crossings, key=_by_receiver)
    elif arena_pos is None:
        order = sorted(crossings, key=lambda c: (c.receiver, c.sender, name_key(c.name), c.box))
    else:
        order = sorted(crossings, key=lambda c: (c.receiver, c.sender,
                                                 arena_pos(c.sender, sender_name(c.name, c.sender, src_lay)),
                                                 name_key(c.name), c.box))
    facts = {name: (_layout(src_lay, name).itemsize, _layout(src_lay, name).dtype) for name in {c.name for c in order}}
    for h, name, _, box, sender, receiver in order:
        itemsize, dtype = facts[name]
        read = name if type(name) is str else sender_name(name, sender, src_lay)
        shape = shapes.get((read, sender))
        if shape is None:
            shape = shapes[(read, sender)] = (tuple(src_lay[read].local_shape(sender)) if shape_of is None
                                              else shape_of(name, sender))
        slices, size, contiguous = _facts(box, shape, itemsize)
        pos = -(-buffer_bytes[receiver] // align) * align
        transfers.append(new_transfer(first + len(transfers), read, sender, receiver, host_of[sender], h,
                                      slices, dtype, pos, size, contiguous))
        buffer_bytes[receiver] = pos + size
    return transfers, {r: -(-b // align) * align for r, b in buffer_bytes.items()}, order
