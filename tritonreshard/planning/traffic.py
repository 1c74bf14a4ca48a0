"""A refit's bytes per rank and per link kind (:func:`refit_traffic`), for the CLI's model of a refit
at a scale where the whole plan is too big to make."""
from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass

from .boxes import union_boxes
from .reshard import source_pieces
from ._gc import gc_paused

__all__ = ["Traffic", "refit_traffic"]


@dataclass(frozen=True)
class Traffic:
    """Bytes each rank moves in one refit, by direction and by link kind, as :func:`refit_traffic`
    models them. ``{rank: bytes}`` each: ``out_within`` / ``in_within`` over the host's own links
    (reads of source arenas and relay buffers on the host), ``out_across`` / ``in_across`` between
    hosts (each byte a host needs once). ``pieces``: ``{rank: pieces it reads or serves}`` (the
    plan's ops, before replicas cut some into parts). ``host_ingress``: ``{host: bytes}``."""

    out_within: Mapping[int, int]
    in_within: Mapping[int, int]
    out_across: Mapping[int, int]
    in_across: Mapping[int, int]
    pieces: Mapping[int, int]
    host_ingress: Mapping[str, int]


@gc_paused
def refit_traffic(src_layouts, dst_layouts, parts=None, hosts: Mapping[int, str] | None = None) -> Traffic:
    """A model of one refit's traffic per rank, from :func:`.reshard.source_pieces` (no ops made, so
    it runs at frontier scale). ``hosts``: ``{rank: host}`` (default: one host).

    As the engine moves bytes: a piece whose source has a replica on the destination's host is read
    there (split evenly over those replicas); every other piece's source box crosses into the
    destination's host once (the union of the boxes the host's ranks need, per source tensor and
    replica set), sent evenly by the replica set, received evenly by the host's ranks that read
    across hosts (the relays), then fanned out: each reader reads its piece from a relay buffer on
    its host. A model, not the plan: the host planner's exact cuts differ by its balance slack."""
    ranks = {r for lay in (*src_layouts.values(), *dst_layouts.values()) for r in lay.ranks}
    host_of = {r: "host" for r in ranks} if hosts is None else dict(hosts)
    missing = sorted(ranks - set(host_of))
    if missing:
        raise ValueError(f"refit_traffic: hosts has no entry for rank(s) {missing}")
    ow, iw, oa, ia, n_pieces = (defaultdict(int) for _ in range(5))
    ingress: dict[str, int] = defaultdict(int)
    relayed: dict[str, set[int]] = defaultdict(set)      # host -> its ranks that read across hosts
    fanout: dict[str, int] = defaultdict(int)             # host -> bytes read from its relay buffers
    for cls, (count, rows) in enumerate(source_pieces(src_layouts, dst_layouts, parts)):
        crossing: dict[tuple, list] = defaultdict(list)
        for group, dst_rank, src_box, numel, s_isz, d_isz in rows:
            h = host_of[dst_rank]
            n_pieces[dst_rank] += count
            iw[dst_rank] += count * numel * d_isz
            here = [r for r in group if host_of[r] == h]
            if here:
                for r in here:
                    ow[r] += count * numel * s_isz // len(here)
                    n_pieces[r] += count if r != dst_rank else 0
                continue
            crossing[(h, group, s_isz)].append(src_box)
            relayed[h].add(dst_rank)
            fanout[h] += count * numel * d_isz
        for (h, group, s_isz), boxes in crossing.items():
            nbytes = count * s_isz * sum(math.prod(b - a for a, b in box) for box in union_boxes(boxes))
            ingress[h] += nbytes
            for r in group:
                oa[r] += nbytes // len(group)
                n_pieces[r] += count * len(boxes) // len(group)
    for h, readers in relayed.items():
        for r in readers:
            ia[r] += ingress[h] // len(readers)
            ow[r] += fanout[h] // len(readers)
    return Traffic(*(dict(sorted(d.items())) for d in (ow, iw, oa, ia, n_pieces)), dict(sorted(ingress.items())))
