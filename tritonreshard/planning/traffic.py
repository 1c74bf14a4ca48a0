"""A refit's bytes per rank and per link kind (:func:`refit_traffic`), for the CLI's model of a refit
at a scale where the whole plan is too big to make: summed over the hosts' parts of the host plan,
so the figures are the plan's, not a second model of it."""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from dataclasses import fields

from ._gc import gc_paused
from .boxes import RECV_ALIGN
from .checks import check_inputs, used_sources
from .crossings import check_hosts
from .hostpart import host_part
from .hostplan import Traffic, host_order
from .quant import quantized_inputs

__all__ = ["Traffic", "refit_traffic"]


@gc_paused
def refit_traffic(src_layouts, dst_layouts, parts=None, hosts: Mapping[int, str] | None = None, *,
                  quant=None) -> Traffic:
    """One refit's traffic per rank: the sum of every destination host's part of the host plan
    (:func:`~.hostpart.plan_host_part`, no op made, so it runs at frontier scale), as
    :meth:`~.hostplan.HostPlan.traffic` counts it. ``hosts``: ``{rank: host}`` (default: one host);
    ``quant``: block-quantized destinations, as :func:`~.quant.plan_quantized` takes them.

    Per rank: ``in_within`` the bytes it writes; ``out_within`` the source bytes it serves on its
    host (its arena to local readers, its receive buffer to fan-out readers); ``out_across`` /
    ``in_across`` the bytes it sends / receives between hosts (each byte a host needs crosses
    into it once); ``pieces`` the ops it runs or serves plus the boxes it sends. ``host_ingress``:
    ``{host: bytes}`` for every host that receives any."""
    planned = quantized_inputs(src_layouts, dst_layouts, parts, quant) if quant else dst_layouts
    resolved = check_inputs(src_layouts, planned, parts)
    used = used_sources(planned, resolved)
    ranks = {r for n in used for r in src_layouts[n].ranks} | {r for lay in planned.values() for r in lay.ranks}
    if hosts is None:
        hosts = {r: "host" for r in ranks}
    missing = sorted(ranks - set(hosts)) if isinstance(hosts, Mapping) else []
    if missing:
        raise ValueError(f"refit_traffic: hosts has no entry for rank(s) {missing}")
    host_of = check_hosts(ranks, hosts, None, RECV_ALIGN, 0, "refit_traffic")
    dst_ranks = {r for lay in planned.values() for r in lay.ranks}
    sums = [defaultdict(int) for _ in range(6)]
    for h in host_order(host_of):
        if not any(host_of[d] == h for d in dst_ranks):
            continue
        part = host_part(src_layouts, dst_layouts, parts, quant, planned, resolved, hosts, host_of, h, None,
                         RECV_ALIGN, 0)
        got_all = part.traffic()
        for acc, got in zip(sums, (getattr(got_all, f.name) for f in fields(Traffic)), strict=True):
            for k, v in got.items():
                acc[k] += v
    return Traffic(*(dict(sorted(x.items())) for x in sums))
