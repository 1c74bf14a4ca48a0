"""Host-aware planning: which bytes cross between hosts, who receives them, and the fan-out after.

Pure Python and deterministic, like :mod:`tritonreshard.planning` (no device, no Triton): every rank
derives the same :class:`HostPlan` from the same :class:`~tritonreshard.planning.Plan` and rank -> host
map.

A plain plan reads every slice straight from the source rank that holds it. That is right inside one
host (shared memory / CUDA IPC), but across hosts a byte that several ranks of one host need would
cross the network once per rank (the NCCL M2N pattern). :func:`plan_hosts` rewrites the plan so that
each byte needed on a host crosses into it exactly once:

* **local ops**: ops whose source and destination share a host stay as they are. A cross-host op
  whose source data also lives on the destination's host (a replica of the source shard there) is
  re-sourced to that replica: it becomes a local op and nothing crosses.
* **transfers** (:class:`CrossTransfer`): for each destination host, the union of the source boxes
  its ranks still need from other hosts, per tensor and per set of source replicas, cut into
  disjoint boxes of the source's local shard (a whole shard needed on the host is one box, sent
  straight from the source's memory as one message). Each box has exactly one sender (a source
  replica) and one receiver on the destination host (each receiver takes one run of the host's
  boxes in the senders' arena order, so neighbours travel as one message), both balanced by bytes
  with the reshard planner's own core, :mod:`.replicas`.
* **receive buffers**: each receiver holds its boxes back to back (``align``-byte aligned, source
  dtype). They are the only staging of the cross-host path; :attr:`HostPlan.buffer_bytes` counts
  them per rank.
* **fan-out ops** (:class:`FanoutOp`): every destination rank on the host reads its part of each box
  from the receiver's buffer, through the same shared-memory / IPC path and descriptor tables as a
  local op (casting there if the destination dtype differs).

Everything within one host is unchanged: only ranks on the same host ever share memory, and only
transfers cross between hosts.

Who calls what: every rank of a refit group calls ``plan_hosts(plan, hosts)`` after the group agreed
on the plan and the hosts; a source rank then sends ``sends_of(rank)``, a receiver receives
``recvs_of(rank)`` into its buffer (``buffer_bytes[rank]`` bytes) and exports it to
``buffer_readers(rank)``, and a destination rank runs ``local_ops_for_dst(rank)`` from the source
arenas and ``fanout_for_dst(rank)`` from the receivers' buffers.

On several hosts a rank makes only its host's part, from the layouts:
:func:`~.hostpart.plan_host_part` (the same part as ``plan_hosts(..., host=)``, without a plan).
Steps 3 to 5 (senders, receivers, buffers) live in :mod:`.crossings`, shared by both.
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping

from . import replicas
from ._gc import gc_paused
from .boxes import RECV_ALIGN, box_of, cut_global, intersect_boxes, union_boxes
from .checks import refuse_transposed
from .crossings import Crossing, assign_receivers, check_hosts, choose_senders, lay_out_buffers, name_key, sender_name
from .hostplan import CrossTransfer, FanoutOp, HostPlan, host_order
from .ops import Plan, TransferOp

# HostPlan and its parts live in .hostplan; this module plans them (they stay importable from here).
__all__ = ["CrossTransfer", "FanoutOp", "HostPlan", "host_order", "hosts_from_map", "plan_hosts"]


@gc_paused
def plan_hosts(plan: Plan, hosts: Mapping[int, str], *,
               src_offsets: Mapping[tuple[int, str], int] | None = None,
               align: int = RECV_ALIGN, host: str | None = None, first_index: int = 0) -> HostPlan:
    """Split ``plan`` by host so that each byte needed on a host crosses into it once.

    Args:
        plan: the group's plan (``plan_reshard``); with ``host``, any plan holding at least every op
            of the group's plan whose destination is on ``host`` (e.g. :func:`~.reshard.merge_plans`
            of the per-rank plans of that host's destination ranks): other ops are ignored.
        hosts: rank -> host identity for every rank of the plan (ranks with the same identity share
            memory; different identities never do).
        src_offsets: optional ``(source rank, name) -> byte offset`` of each shard in its arena. A
            receiver's boxes from one sender are then laid out in arena order, so boxes back to back
            in the arena are back to back in the buffer and can travel as one message.
        align: alignment of each box in a receive buffer, in bytes.
        host: None for every host; else only destination host ``host``'s part: its local ops, the
            transfers into it (their receivers, buffers, senders) and its fan-out.
        first_index: the index of the part's first transfer (with ``host``: the number of transfers
            into the hosts before it in :func:`host_order`).

    Returns a :class:`HostPlan`. Deterministic: every rank derives the same one. Raises
    ``ValueError`` listing every problem with ``hosts`` (missing ranks, bad names).

    Every step works on one destination host at a time, from the ops into that host alone, so the
    whole host plan is its hosts' parts, in :func:`host_order`, transfers numbered on: a host's
    part is exactly the slice of the whole that concerns the host, made without the other hosts'
    ops (per-rank planning across hosts). Per destination host: re-source cross-host ops to replicas
    on the host (:func:`_resource_locally`); union what the host still needs into disjoint boxes
    (:func:`_union_needs`); choose each box's sender (:func:`_choose_senders`); cut the host's
    boxes into one run per receiver (:func:`_assign_receivers`); lay out the receive buffers
    (:func:`_lay_out_buffers`); derive the fan-out ops (:func:`_fan_out`). Both balancing steps use
    :mod:`.replicas` and its :data:`~.replicas.KNOBS`, like the reshard planner.
    """
    if not isinstance(plan, Plan):
        raise TypeError(f"plan must be a trs.Plan, got {type(plan).__name__}")
    host_of = check_hosts(set(plan.src_ranks) | set(plan.dst_ranks), hosts, host, align, first_index, "plan_hosts")
    if len(set(host_of.values())) > 1:   # one host: every op stays as planned, permutation and all
        refuse_transposed("plan_hosts", plan.parts, "a plan across hosts cannot carry (crossings, relays and "
                          "deltas cut source boxes in the source's order of dims; plan such a model on one host)")
    knobs = replicas.KNOBS
    src_lay = plan.src_layouts

    # (sender, name) -> the shard's offset in the sender's arena; None: every offset 0
    arena_pos = None if src_offsets is None else (lambda sender, name: src_offsets.get((sender, name), 0))

    source_of = _sources(plan)
    replica_sets = _replica_sets(plan, source_of)
    into: dict[str, list[tuple[TransferOp, object]]] = defaultdict(list)   # destination host -> its ops
    for op in plan.ops:                                                   # (and sources), in plan order
        into[host_of[op.dst_rank]].append((op, source_of(op)))
    local: list[TransferOp] = []
    transfers: list[CrossTransfer] = []
    fanout: list[FanoutOp] = []
    buffer_bytes: dict[int, int] = {}
    for h in host_order(host_of) if host is None else (host,):
        h_local, needs = _resource_locally(into.get(h, []), src_lay, host_of, replica_sets)
        boxes = choose_senders(_union_needs(needs), src_lay, knobs)
        receivers = {op.dst_rank for ops in needs.values() for op in ops}
        boxes = assign_receivers(boxes, receivers, src_lay, arena_pos, knobs)
        h_transfers, h_buffers, order = lay_out_buffers(boxes, host_of, src_lay, arena_pos, align,
                                                         first_index + len(transfers))
        fanout += _fan_out(needs, h_transfers, order)
        local += h_local
        transfers += h_transfers
        buffer_bytes.update(h_buffers)
    local.sort(key=lambda op: (op.name, op.dst_rank, tuple([s.start for s in op.dst_slices]), op.src_rank))
    fanout.sort(key=lambda f: (f.op.name, f.op.dst_rank, tuple([s.start for s in f.op.dst_slices]), f.transfer))
    return HostPlan(plan, host_of, tuple(local), tuple(transfers), tuple(fanout), buffer_bytes)



def hosts_from_map(host_map: Mapping[str, Iterable[int]], ranks: Iterable[int]) -> dict[int, str]:
    """``{rank: host}`` for exactly the group's ``ranks`` (what :func:`plan_hosts` takes), from a host
    map ``{host name: the ranks on it}``, the way a person writes where ranks run.

    Raises one ``ValueError`` naming every problem at once, before anything is set up: a host with
    no rank, a host on no rank of the group (all its ranks outside ``ranks``), a host listing ranks
    outside the group, a rank on two or more hosts (naming every one), ranks of the group on no
    host, host names that are not non-empty strings, ranks that are not ints >= 0 (bools neither).
    Ranks print as runs (``0-3,8``), the CLI's ``--hosts`` syntax. A host may list a rank twice.

    Example::

        >>> hosts_from_map({"node0": range(0, 2), "node1": [2, 3]}, range(4))
        {0: 'node0', 1: 'node0', 2: 'node1', 3: 'node1'}
        >>> hosts_from_map({"node0": [0, 1], "node1": [1, 9], "node2": []}, range(4))
        Traceback (most recent call last):
        ValueError: host map: 4 problem(s):
          - host 'node1' lists rank(s) 9, not in the group (ranks 0-3)
          - host 'node2' has no rank
          - rank(s) 1 on 2 hosts: 'node0', 'node1' (a rank is on one host)
          - rank(s) 2-3 of the group on no host
    """
    if not isinstance(host_map, Mapping):
        raise TypeError(f"host_map must be a mapping host name -> ranks, got {type(host_map).__name__}")
    problems: list[str] = []
    split = _split_ranks(ranks)
    if split is None:
        problems.append(f"ranks must be an iterable of ints >= 0, got {ranks!r}")
    elif split[1]:
        problems.append(f"ranks lists {', '.join(map(repr, split[1]))}: not ranks (ints >= 0)")
    group = set(split[0]) if split else set()
    on: dict[int, list] = defaultdict(list)   # rank -> the hosts listing it, in the map's order
    for name, value in host_map.items():
        if not isinstance(name, str) or not name.strip():
            problems.append(f"host name {name!r} is not a non-empty string")
        split = _split_ranks(value)
        if split is None:
            problems.append(f"host {name!r}: its ranks must be an iterable of ints >= 0, got {value!r}")
            continue
        good, bad = split
        outside = set(good) - group
        if bad:
            problems.append(f"host {name!r} lists {', '.join(map(repr, bad))}: not ranks (ints >= 0)")
        if not good and not bad:
            problems.append(f"host {name!r} has no rank")
        elif good and outside == set(good):
            problems.append(f"host {name!r} is on no rank of the group: its rank(s) {_runs(outside)} are not "
                            f"among ranks {_runs(group) or '(none)'}")
        elif outside:
            problems.append(f"host {name!r} lists rank(s) {_runs(outside)}, not in the group "
                            f"(ranks {_runs(group) or '(none)'})")
        for r in dict.fromkeys(good):   # a rank listed twice by one host is on one host
            on[r].append(name)
    shared: dict[tuple, list[int]] = defaultdict(list)   # the hosts of a rank on several -> those ranks
    for r in sorted(on):
        if len(on[r]) > 1:
            shared[tuple(on[r])].append(r)
    problems += [f"rank(s) {_runs(rs)} on {len(hs)} hosts: {', '.join(map(repr, hs))} (a rank is on one host)"
                 for hs, rs in shared.items()]
    if group - on.keys():
        problems.append(f"rank(s) {_runs(group - on.keys())} of the group on no host")
    if problems:
        raise ValueError(f"host map: {len(problems)} problem(s):\n  - " + "\n  - ".join(problems))
    return {r: on[r][0] for r in sorted(group)}


def _split_ranks(value) -> tuple[list[int], list] | None:
    """``(ranks, not ranks)`` of an iterable of ranks; None if ``value`` is none (a str is none
    either: "0-3" would read as its characters)."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        return None
    items = list(value)
    ok = [isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in items]
    return [r for r, y in zip(items, ok, strict=True) if y], [r for r, y in zip(items, ok, strict=True) if not y]


def _runs(ranks) -> str:
    """Ranks as sorted runs, ``{0, 1, 2, 3, 8}`` -> ``0-3,8``: a few words for a whole host."""
    out: list[str] = []
    last: int | None = None
    for r in sorted(ranks):
        if last is not None and r == last + 1:
            out[-1] = f"{out[-1].split('-')[0]}-{r}"
        else:
            out.append(str(r))
        last = r
    return ",".join(out)


# (destination host, source, replica set) -> the host's ops reading it; a source is a name or a
# tuple of aliases' names (:func:`_sources`).
_Needs = dict[tuple[str, object, tuple[int, ...]], list[TransferOp]]


def _sources(plan: Plan):
    """``source_of(op)``: the source an op's part reads, its ``src_name`` or, for a part naming
    aliases (copies of one tensor), the tuple of their names: any alias's replica may serve it.
    (:func:`.checks.check_inputs` made sure a destination reads each name under one source.)"""
    keys = {(name, n): p.src for name, ps in plan.parts.items() for p in ps if len(p.sources) > 1
            for n in p.sources}
    if not keys:
        return _src_name
    return lambda op: keys.get((op.name, op.src_name), op.src_name)


def _src_name(op: TransferOp) -> str:
    return op.src_name


def _replica_sets(plan: Plan, source_of) -> dict[tuple[object, int], tuple[int, ...]]:
    """(source, rank) -> the replica set of that rank's shard (:func:`.replicas.group_replicas`),
    for every source an op reads (``parts=`` may read other names than the destinations'). The
    replica sets of aliases span them: a rank holds a region of whichever alias lists it first."""
    out: dict[tuple[object, int], tuple[int, ...]] = {}
    lays = plan.src_layouts
    for src in sorted({source_of(op) for op in plan.ops}, key=name_key):
        segs: dict[int, tuple] = {}
        for name in name_key(src):
            lay = lays[name]
            for r in lay.ranks:
                segs.setdefault(r, lay.segments(r))
        for group in replicas.group_replicas(segs).values():
            out.update(((src, r), group) for r in group)
    return out


def _resource_locally(ops: list[tuple[TransferOp, object]], src_lay, host_of: Mapping[int, str],
                      replica_sets: Mapping[tuple[object, int], tuple[int, ...]]) -> tuple[list[TransferOp], _Needs]:
    """Step 1, for the ``ops`` into one host (in plan order): the ops that stay within the host,
    and what the host needs from others. (A rank's reads served are counted only for readers on
    its own host, so each host's choices depend on its own ops alone.)

    An op whose source and destination share a host stays as it is. A cross-host op whose source
    shard has a replica on the destination's host is re-sourced to the replica there that serves
    the fewest bytes so far (the reshard planner chose replicas blind to hosts): nothing crosses.
    The other cross-host ops are grouped by (destination host, source, replica set). An op reading
    one of several aliases may be re-sourced to any alias's replica (it then reads that alias)."""
    local = [op for op, _ in ops if host_of[op.src_rank] == host_of[op.dst_rank]]
    reads = replicas.Loads()   # source bytes each rank serves to ranks of its own host
    for op in local:
        reads.add(op.src_rank, op.numel * src_lay[op.src_name].itemsize)
    needs: _Needs = defaultdict(list)
    for op, src in ops:
        if host_of[op.src_rank] == host_of[op.dst_rank]:
            continue
        group = replica_sets[(src, op.src_rank)]
        here = [r for r in group if host_of[r] == host_of[op.dst_rank]]
        if here:
            r = reads.least(here)
            local.append(TransferOp(op.name, r, op.dst_rank, op.src_slices, op.dst_slices, op.global_index,
                                    sender_name(src, r, src_lay)))
            reads.add(r, op.numel * src_lay[op.src_name].itemsize)
        else:
            needs[(host_of[op.dst_rank], src, group)].append(op)
    return local, needs


def _union_needs(needs: _Needs) -> list[Crossing]:
    """Step 2: per (host, source name, replica set), the union of the source boxes the host's ranks
    need, as disjoint boxes merged as far as possible (:func:`.boxes.union_boxes`): a whole shard needed on a
    host is one box, so it can be sent straight from the sender's memory as one message."""
    return [Crossing(h, name, group, box)
            for (h, name, group), ops in sorted(needs.items(), key=lambda kv: (kv[0][0], name_key(kv[0][1]), kv[0][2]))
            for box in union_boxes([box_of(op.src_slices) for op in ops])]


def _fan_out(needs: _Needs, transfers: list[CrossTransfer], order: list[Crossing]) -> list[FanoutOp]:
    """Step 6: each cross-host op of the plan becomes reads of the parts of its source box from the
    transfers that hold them, each from the transfer's receive buffer (same host), with source
    slices relative to the transfer's box. ``order``: each transfer's crossing (its need). A read
    names the tensor its transfer carries (for aliases, the sender's alias)."""
    by_need: dict[tuple[str, object, tuple[int, ...]], list[CrossTransfer]] = defaultdict(list)
    for c, t in zip(order, transfers, strict=True):
        by_need[(c.host, c.name, c.group)].append(t)
    fanout: list[FanoutOp] = []
    for key, ops in needs.items():
        for op in ops:
            src_box = box_of(op.src_slices)
            for t in by_need[key]:
                cut = intersect_boxes(src_box, box_of(t.box))
                if cut is None:
                    continue
                rel = tuple(slice(a - tb.start, b - tb.start) for (a, b), tb in zip(cut, t.box, strict=True))
                dst = tuple(slice(ds.start + a - sa, ds.start + b - sa)
                            for (a, b), (sa, _), ds in zip(cut, src_box, op.dst_slices, strict=True))
                g = tuple(cut_global(gi, a - sa, b - sa)
                          for (a, b), (sa, _), gi in zip(cut, src_box, op.global_index, strict=True))
                fanout.append(FanoutOp(t.index, TransferOp(op.name, t.receiver, op.dst_rank, rel, dst, g,
                                                           t.name)))
    return fanout
