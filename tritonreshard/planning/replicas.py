"""Replica grouping and load balancing, written once for both planners, with one set of knobs.

Pure Python and deterministic (ties break on rank, then on each piece's ``key``), so every rank
derives the same choices.

* :func:`group_replicas`: source ranks holding identical regions of a tensor are replicas; any of
  them can serve a read of those regions.
* :func:`share`: which replica(s) serve one piece, from the piece alone (its size and a ``turn``
  the caller derives from the piece's place in the plan). The reshard planner spreads a
  destination's reads over source replicas with it, so that any rank derives any piece's choice
  without planning the other pieces (per-rank planning).
* :func:`spread`: which replica serves each piece, balancing the pieces against each other. The
  host planner spreads a host's cross-host boxes over the sender replicas off that host. Biggest pieces first, each to
  its least-loaded replica, water-filled over several replicas only where one would carry clearly more than its share.
* :func:`cut_runs`: how an ordered list of boxes is cut into one consecutive run per receiver of
  about equal bytes (the host planner's receivers), so neighbours stay together.

Both balancers cut a piece only along its outermost dim of extent > 1 (:func:`split_axis`), in
whole units of that dim, so a part of a contiguous box is contiguous. Both planners read
:data:`KNOBS` each time they are called and pass it down (the reshard planner also keys its cache
on it), so replacing ``KNOBS`` changes both planners at once.
"""
from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = ["KNOBS", "Knobs", "Loads", "Piece", "cut_runs", "group_replicas", "rotation", "share", "split_axis",
           "spread"]


@dataclass(frozen=True)
class Knobs:
    """How readily the planners cut a piece to balance load. One instance (:data:`KNOBS`) serves the
    reshard planner and the host planner alike.

    ``min_split_bytes``: a piece is cut only into parts of about this many bytes or more. A cut
    costs one more part: a descriptor region for a copy, a message for a cross-host box. 4 KiB is
    one tile of the gather kernels (``kernels.ROWS_TILE_BYTES``): a smaller part costs a tile's
    fixed work while carrying less, so it removes less imbalance than it costs. Cuts stay bounded
    whatever the value: :func:`share` cuts a piece into at most ``replicas`` parts (it cannot see the
    other pieces, so a piece of at least two parts' bytes is always cut), :func:`spread` and
    :func:`cut_runs` cut only where balance demands it (a piece that would push its replica past the
    slack, or a box at the end of a receiver's run): at most ``receivers - 1`` extra messages per host.

    ``slack``: (:func:`share`) a piece is cut into as few parts as keep each part within ``slack``
    times its replica's fair share of the piece. (:func:`spread`, :func:`cut_runs`) a whole piece
    is kept whole while its bin (a replica's reads or sends, a receiver's
    run) stays within this factor of its fair share. 1.05 accepts a slowest link 5% busier than
    perfect to save a cut, and leaves room inside the 10-25% balance the tests demand for the
    rounding of cuts to whole units.
    """

    min_split_bytes: int = 4096
    slack: float = 1.05

    def __post_init__(self):
        if not isinstance(self.min_split_bytes, int) or self.min_split_bytes < 1:
            raise ValueError(f"Knobs: min_split_bytes must be a positive int, got {self.min_split_bytes!r}")
        if not self.slack >= 1.0:
            raise ValueError(f"Knobs: slack must be >= 1.0, got {self.slack!r}")


#: The knobs both planners use.
KNOBS = Knobs()


def group_replicas(segments: Mapping[int, tuple]) -> dict[tuple, tuple[int, ...]]:
    """Replica sets of one tensor: ``segments`` maps each source rank to its regions (per dim, its
    ``(global_start, global_stop, local_offset)`` segments, as :meth:`Layout.segments` gives);
    ranks with identical regions hold identical local shards. Returns regions -> ranks, in the
    mapping's order. Empty shards hold nothing to read and join no set."""
    groups: dict[tuple, list[int]] = {}
    for rank, segs in segments.items():
        if all(segs):
            groups.setdefault(segs, []).append(rank)
    return {segs: tuple(ranks) for segs, ranks in groups.items()}


def split_axis(extents: Sequence[int]) -> int | None:
    """The dim a box is cut along: its outermost dim of extent > 1 (None: one element). A contiguous
    box cut there stays contiguous, in every part."""
    return next((d for d, n in enumerate(extents) if n > 1), None)


def rotation(n: int, k: int) -> int:
    """The sum of ``n``'s base-``k`` digits: a turn for :func:`share` from a position ``n``. Numbers
    that differ in one base-``k`` digit get different turns mod ``k``, so positions that step by a
    power of ``k`` (the same TP rank in consecutive replicas, ``tp`` apart) still rotate, and any
    ``k**m`` consecutive positions take every turn mod ``k`` equally often."""
    if k < 2:
        return 0
    total = 0
    while n:
        n, digit = divmod(n, k)
        total += digit
    return total


def share(replicas: Sequence[int], nbytes: int, extent: int, turn: int,
          knobs: Knobs | None = None) -> tuple[tuple[int, int], ...]:
    """Which of ``replicas`` serve a piece of ``nbytes`` bytes cuttable into ``extent`` equal units,
    decided from the piece alone.

    The piece is cut into ``n`` near-equal consecutive parts, the fewest that keep each part within
    ``knobs.slack`` times the fair share ``nbytes / len(replicas)`` (``ceil(k / slack)``), but no
    more than ``extent`` parts nor parts under ``knobs.min_split_bytes`` (a small piece stays
    whole). Part ``i`` goes to ``replicas[(turn + i) % k]``: consecutive turns rotate over the
    replicas, so pieces the caller numbers consecutively (a destination rank's pieces, the
    destination ranks of a tensor, the tensors) land on different replicas.

    Returns ``((replica, units), ...)``, units summing to ``extent``.

    The balance this buys, with no information about other pieces: a piece of ``n >= 2`` parts
    loads each replica with at most one unit over its share; whole pieces rotate, so ``m`` pieces of
    one size numbered by consecutive turns land at most ``ceil(m / k)`` on any replica.
    """
    knobs = KNOBS if knobs is None else knobs
    k = len(replicas)
    n = max(1, min(k, extent, nbytes // knobs.min_split_bytes, math.ceil(k / knobs.slack)))
    base, extra = divmod(extent, n)
    return tuple((replicas[(turn + i) % k], base + (i < extra)) for i in range(n))


class Loads:
    """Bytes each rank carries so far (reads served, bytes sent): what the balancers read and add to.
    A planner keeps one per resource it balances."""

    def __init__(self):
        self._bytes: dict[int, int] = defaultdict(int)

    def __getitem__(self, rank: int) -> int:
        return self._bytes.get(rank, 0)

    def add(self, rank: int, nbytes: int) -> None:
        self._bytes[rank] += nbytes

    def least(self, ranks: Sequence[int]) -> int:
        """The least-loaded of ``ranks`` (the lowest rank on a tie)."""
        return min(ranks, key=lambda r: (self[r], r))

    def as_dict(self) -> dict[int, int]:
        return {r: b for r, b in sorted(self._bytes.items())}


@dataclass(frozen=True)
class Piece:
    """Something one of ``replicas`` must serve: ``nbytes`` bytes that can be cut into ``extent``
    equal units (along :func:`split_axis`; 1: only whole). ``key`` (a tuple, comparable with the
    other pieces' keys) orders pieces of equal size; input order breaks the remaining ties."""

    replicas: tuple[int, ...]
    nbytes: int
    extent: int = 1
    key: tuple = ()


def spread(pieces: Sequence[Piece], loads: Loads, knobs: Knobs | None = None) -> list[tuple[tuple[int, int], ...]]:
    """Choose the replica(s) serving each piece, balancing ``loads`` (which it updates).

    Pieces with a single replica are counted first (they leave no choice), then the others go
    biggest first (LPT). A piece goes whole to its least-loaded replica while that keeps the
    replica within ``knobs.slack`` times its replica set's projected fair load (the set's current
    load plus every piece of the set not yet placed, over the set's size). Otherwise it is
    water-filled over the least-loaded replicas (at most ``nbytes // min_split_bytes`` of them, and
    never into parts of fewer than one unit) so that their loads come out level.

    Returns, per piece in input order, ``((replica, units), ...)``: the piece's units in order, cut
    into consecutive parts, each served by its replica; units sum to ``piece.extent``.

    The balance this buys: with one replica set of k replicas and no earlier load, no replica ends
    above ``slack * total / k + excess``, where ``excess`` is the largest of: one unit of a piece
    that can be cut k ways (``extent >= k`` and ``nbytes >= k * min_split_bytes``), and the whole
    size of any other piece (one that may have to go whole, or to fewer replicas).
    """
    knobs = KNOBS if knobs is None else knobs
    out: list[tuple[tuple[int, int], ...]] = [()] * len(pieces)
    remaining: dict[tuple[int, ...], int] = defaultdict(int)
    for i, p in enumerate(pieces):
        if len(p.replicas) == 1:   # no choice: counted before any choice is made
            out[i] = ((p.replicas[0], p.extent),)
            loads.add(p.replicas[0], p.nbytes)
        else:
            remaining[p.replicas] += p.nbytes
    for i in sorted(range(len(pieces)), key=lambda i: (-pieces[i].nbytes, pieces[i].key)):
        p = pieces[i]
        if len(p.replicas) == 1:
            continue
        target = (sum(loads[c] for c in p.replicas) + remaining[p.replicas]) / len(p.replicas)
        remaining[p.replicas] -= p.nbytes
        order = sorted(p.replicas, key=lambda c: (loads[c], c))
        if (loads[order[0]] + p.nbytes <= target * knobs.slack or p.extent <= 1
                or p.nbytes < 2 * knobs.min_split_bytes):
            out[i] = ((order[0], p.extent),)
            loads.add(order[0], p.nbytes)
            continue
        chosen = order[:min(len(order), p.nbytes // knobs.min_split_bytes, p.extent)]
        units = _water_fill([loads[c] for c in chosen], p.nbytes, p.extent)
        unit_bytes = p.nbytes // p.extent
        out[i] = tuple((c, u) for c, u in zip(chosen, units, strict=True) if u)
        for c, u in out[i]:
            loads.add(c, u * unit_bytes)
    return out


def _water_fill(loads: list[int], nbytes: int, extent: int) -> list[int]:
    """Units of ``extent`` per bin so that bins of ``loads`` plus their part end up level: the water
    level L with sum(max(0, L - load)) == nbytes, rounded to whole units by largest remainder."""
    ordered = sorted(loads)
    level = 0.0
    for k in range(len(ordered), 0, -1):
        level = (sum(ordered[:k]) + nbytes) / k
        if level >= ordered[k - 1]:
            break
    want = [max(0.0, level - b) / nbytes * extent for b in loads]
    units = [int(w) for w in want]
    for j in sorted(range(len(want)), key=lambda j: (units[j] - want[j], j))[:extent - sum(units)]:
        units[j] += 1
    return units


def cut_runs(items: Sequence[tuple[int, int]], n_runs: int,
             knobs: Knobs | None = None) -> list[tuple[int, int, int, int]]:
    """Cut an ordered list of items into ``n_runs`` consecutive runs of about equal bytes.

    ``items``: per item ``(nbytes, extent)``, cuttable into ``extent`` equal units. Items keep their
    order, so neighbours (boxes back to back in a sender's arena) stay in one run and travel as one
    message. A run takes whole items while it stays within ``knobs.slack`` of its share of the bytes
    not yet in a closed run; the item at its end is cut in whole units where both sides get at least
    ``min_split_bytes``, else it goes whole to this run if most of it fits (or the run is empty),
    else it starts the next run. The last run takes the rest.

    Returns ``(item, unit_start, unit_stop, run)`` parts, in order, covering every unit of every
    item once.
    """
    knobs = KNOBS if knobs is None else knobs
    if n_runs < 1:
        raise ValueError(f"cut_runs: n_runs must be >= 1, got {n_runs}")
    out: list[tuple[int, int, int, int]] = []
    left = sum(n for n, _ in items)      # bytes not in a closed run
    run, filled, share = 0, 0, left / n_runs
    for i, (nbytes, extent) in enumerate(items):
        unit, u0 = nbytes / extent, 0
        while u0 < extent:
            size, room = (extent - u0) * unit, share - filled
            last = run == n_runs - 1
            if last or size <= room * knobs.slack:
                take = extent - u0
            else:
                fit = int(room / unit)
                if (0 < fit < extent - u0 and room >= knobs.min_split_bytes
                        and size - room >= knobs.min_split_bytes):
                    take = fit
                elif filled == 0 or room >= size / 2:   # an empty run, or most of it fits: take it
                    take = extent - u0
                else:                                    # most of it does not: the next run starts
                    left -= filled
                    run, filled = run + 1, 0
                    share = left / (n_runs - run)
                    continue
            out.append((i, u0, u0 + take, run))
            u0 += take
            filled += take * unit
            if not last and filled >= share * (1 - 1e-9):
                left -= filled
                run, filled = run + 1, 0
                share = left / (n_runs - run)
    return out
