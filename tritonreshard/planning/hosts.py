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

On several hosts a rank makes only its host's part: :func:`plan_host_part`, from the layouts, is
the same part as ``plan_hosts(plan, hosts, host=)`` of the merged per-rank plans of the host's
destination ranks, without making a plan: each geometry is planned once (a model's layers repeat a
few), and a rank's ops are made only when asked for.
"""
from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from collections import defaultdict
from collections.abc import Mapping
from functools import cached_property, lru_cache, partial
from typing import NamedTuple

from . import replicas
from .boxes import (RECV_ALIGN, Box, box_extent, box_is_contiguous, box_nbytes, box_of, box_part, cut_global,
                    intersect_boxes, slices_of, union_boxes)
from .checks import check_inputs
from .hostplan import CrossTransfer, FanoutOp, HostPlan, host_order, new_fanout, new_transfer
from .ops import Plan, TransferOp, merge_plans, new_op
from .quant import QuantizedPlan, plan_quantized, quantized_inputs
from .reshard import Job, OpRow, rows_into
from ._gc import gc_paused

__all__ = ["CrossTransfer", "FanoutOp", "HostPlan", "host_order", "plan_host_part", "plan_hosts"]


def _check_hosts(ranks, hosts, host: str | None, align, first_index, who: str) -> dict[int, str]:
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
    host_of = _check_hosts(set(plan.src_ranks) | set(plan.dst_ranks), hosts, host, align, first_index, "plan_hosts")
    knobs = replicas.KNOBS
    src_lay = plan.src_layouts

    def arena_pos(sender: int, name: str) -> int:
        return src_offsets.get((sender, name), 0) if src_offsets is not None else 0

    replica_sets = _replica_sets(plan)
    into: dict[str, list[TransferOp]] = defaultdict(list)   # destination host -> its ops, in plan order
    for op in plan.ops:
        into[host_of[op.dst_rank]].append(op)
    local: list[TransferOp] = []
    transfers: list[CrossTransfer] = []
    fanout: list[FanoutOp] = []
    buffer_bytes: dict[int, int] = {}
    for h in host_order(host_of) if host is None else (host,):
        h_local, needs = _resource_locally(into.get(h, []), src_lay, host_of, replica_sets)
        boxes = _choose_senders(_union_needs(needs), src_lay, knobs)
        receivers = {op.dst_rank for ops in needs.values() for op in ops}
        boxes = _assign_receivers(boxes, receivers, src_lay, arena_pos, knobs)
        h_transfers, h_buffers, _ = _lay_out_buffers(boxes, host_of, src_lay, arena_pos, align,
                                                     first_index + len(transfers))
        fanout += _fan_out(needs, h_transfers, replica_sets)
        local += h_local
        transfers += h_transfers
        buffer_bytes.update(h_buffers)
    local.sort(key=lambda op: (op.name, op.dst_rank, tuple([s.start for s in op.dst_slices]), op.src_rank))
    fanout.sort(key=lambda f: (f.op.name, f.op.dst_rank, tuple([s.start for s in f.op.dst_slices]), f.transfer))
    return HostPlan(plan, host_of, tuple(local), tuple(transfers), tuple(fanout), buffer_bytes)



_Needs = dict[tuple[str, str, tuple[int, ...]], list[TransferOp]]


class _Crossing(NamedTuple):
    """A box of a source's local shard on its way into ``host``; ``sender`` and ``receiver`` are
    filled in by the steps that choose them (-1 until then)."""

    host: str
    name: str
    group: tuple[int, ...]   # the source replicas holding the box
    box: Box
    sender: int = -1
    receiver: int = -1


#: ``_new_crossing((host, name, group, box, sender, receiver))``: a :class:`_Crossing` without the
#: NamedTuple's Python-level ``__new__`` (a host part makes tens of thousands).
_new_crossing = partial(tuple.__new__, _Crossing)


def _replica_sets(plan: Plan) -> dict[tuple[str, int], tuple[int, ...]]:
    """(source name, rank) -> the replica set of that rank's shard (:func:`.replicas.group_replicas`),
    for every source tensor an op reads (``parts=`` may read other names than the destinations')."""
    out: dict[tuple[str, int], tuple[int, ...]] = {}
    for name in sorted({op.src_name for op in plan.ops}):
        lay = plan.src_layouts[name]
        for group in replicas.group_replicas({r: lay.segments(r) for r in lay.ranks}).values():
            out.update(((name, r), group) for r in group)
    return out


def _resource_locally(ops: list[TransferOp], src_lay, host_of: Mapping[int, str],
                      replica_sets: Mapping[tuple[str, int], tuple[int, ...]]) -> tuple[list[TransferOp], _Needs]:
    """Step 1, for the ``ops`` into one host (in plan order): the ops that stay within the host,
    and what the host needs from others. (A rank's reads served are counted only for readers on
    its own host, so each host's choices depend on its own ops alone.)

    An op whose source and destination share a host stays as it is. A cross-host op whose source
    shard has a replica on the destination's host is re-sourced to the replica there that serves
    the fewest bytes so far (the reshard planner chose replicas blind to hosts): nothing crosses.
    The other cross-host ops are grouped by (destination host, source name, replica set)."""
    local = [op for op in ops if host_of[op.src_rank] == host_of[op.dst_rank]]
    reads = replicas.Loads()   # source bytes each rank serves to ranks of its own host
    for op in local:
        reads.add(op.src_rank, op.numel * src_lay[op.src_name].itemsize)
    needs: _Needs = defaultdict(list)
    for op in (op for op in ops if host_of[op.src_rank] != host_of[op.dst_rank]):
        group = replica_sets[(op.src_name, op.src_rank)]
        here = [r for r in group if host_of[r] == host_of[op.dst_rank]]
        if here:
            r = reads.least(here)
            local.append(TransferOp(op.name, r, op.dst_rank, op.src_slices, op.dst_slices, op.global_index,
                                    op.src_name))
            reads.add(r, op.numel * src_lay[op.src_name].itemsize)
        else:
            needs[(host_of[op.dst_rank], op.src_name, group)].append(op)
    return local, needs


def _union_needs(needs: _Needs) -> list[_Crossing]:
    """Step 2: per (host, source name, replica set), the union of the source boxes the host's ranks
    need, as disjoint boxes merged as far as possible (:func:`.boxes.union_boxes`): a whole shard needed on a
    host is one box, so it can be sent straight from the sender's memory as one message."""
    return [_Crossing(h, name, group, box) for (h, name, group), ops in sorted(needs.items())
            for box in union_boxes([box_of(op.src_slices) for op in ops])]


def _choose_senders(crossings: list[_Crossing], src_lay, knobs: replicas.Knobs) -> list[_Crossing]:
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


def _assign_receivers(crossings: list[_Crossing], receivers: set[int], src_lay, arena_pos,
                      knobs: replicas.Knobs) -> list[_Crossing]:
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
        out.append(_new_crossing((h, name, group, box, sender, recvs[run])))
    return out


@lru_cache(maxsize=1 << 16)
def _size(box: Box, itemsize: int) -> tuple[int, int]:
    """``(bytes, extent)`` of a box (layers repeat boxes)."""
    return math.prod(b - a for a, b in box) * itemsize, box_extent(box)


@lru_cache(maxsize=1 << 16)
def _contiguous(box: Box, shape: tuple[int, ...]) -> bool:
    return box_is_contiguous(box, shape)


def _lay_out_buffers(crossings: list[_Crossing], host_of: Mapping[int, str], src_lay, arena_pos,
                     align: int, first: int = 0, shape_of=None) -> tuple[list[CrossTransfer], dict[int, int], list[_Crossing]]:
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


def _fan_out(needs: _Needs, transfers: list[CrossTransfer],
             replica_sets: Mapping[tuple[str, int], tuple[int, ...]]) -> list[FanoutOp]:
    """Step 6: each cross-host op of the plan becomes reads of the parts of its source box from the
    transfers that hold them, each from the transfer's receive buffer (same host), with source
    slices relative to the transfer's box."""
    by_need: dict[tuple[str, str, tuple[int, ...]], list[CrossTransfer]] = defaultdict(list)
    for t in transfers:
        by_need[(t.dst_host, t.name, replica_sets[(t.name, t.src_rank)])].append(t)
    fanout: list[FanoutOp] = []
    for key, ops in needs.items():
        for op in ops:
            src_box = box_of(op.src_slices)
            for t in by_need[key]:
                cut = intersect_boxes(src_box, box_of(t.box))
                if cut is None:
                    continue
                rel = tuple(slice(a - tb.start, b - tb.start) for (a, b), tb in zip(cut, t.box))
                dst = tuple(slice(ds.start + a - sa, ds.start + b - sa)
                            for (a, b), (sa, _), ds in zip(cut, src_box, op.dst_slices))
                g = tuple(cut_global(gi, a - sa, b - sa) for (a, b), (sa, _), gi in zip(cut, src_box, op.global_index))
                fanout.append(FanoutOp(t.index, TransferOp(op.name, t.receiver, op.dst_rank, rel, dst, g,
                                                           op.src_name)))
    return fanout


# ------------------------------------------------------------------ one host's part, from the layouts
class _Reader(NamedTuple):
    """A piece of a cross-host row's read from one union box of its need: ``box`` (index into the
    need's union), source slices relative to it, destination slices, global index, and the
    destination starts (the fan-out's sort key)."""

    job: int                       # position of the row's job among its source's jobs
    box: int
    rel: tuple[slice, ...]
    dst_slices: tuple[slice, ...]
    global_index: tuple
    starts: tuple[int, ...]


def _reads(row: OpRow, sb: Box, cut: Box, base: Box) -> tuple:
    """(rel, dst, global, starts) of the part ``cut`` of ``row`` (source box ``sb``), relative to ``base``."""
    rel = tuple(slice(a - b0, b - b0) for (a, b), (b0, _) in zip(cut, base))
    dst = tuple(slice(ds.start + a - sa, ds.start + b - sa) for (a, b), (sa, _), ds in zip(cut, sb, row.dst_slices))
    g = tuple(cut_global(gi, a - sa, b - sa) for (a, b), (sa, _), gi in zip(cut, sb, row.global_index))
    return rel, dst, g, tuple([d.start for d in dst])


class _Need(NamedTuple):
    """What a host needs of one source geometry from one replica set: the union of its ranks' source
    boxes (:func:`.boxes.union_boxes`), and each reading rank's pieces of it. Shared by every source
    tensor of the geometry (layers)."""

    boxes: tuple[Box, ...]
    readers: tuple[frozenset, ...]          # per union box: the destination ranks that read it
    by_dst: dict                            # dst_rank -> [_Reader, ...]
    rows: dict                              # dst_rank -> [(job, OpRow), ...] (for cut boxes)


def _need(jobs_rows: tuple[tuple[OpRow, ...], ...], group: tuple[int, ...], cross) -> _Need:
    rows = [(j, row) for j, rs in enumerate(jobs_rows) for row in rs if row.group == group and cross(row)]
    boxes = tuple(union_boxes([box_of(row.src_slices) for _, row in rows]))
    starts = [b[0][0] for b in boxes] if boxes and boxes[0] else None
    stops = [b[0][1] for b in boxes] if starts is not None else None
    readers: list[set] = [set() for _ in boxes]
    by_dst: dict[int, list[_Reader]] = defaultdict(list)
    by_rows: dict[int, list] = defaultdict(list)
    for j, row in rows:
        sb = box_of(row.src_slices)
        by_rows[row.dst_rank].append((j, row))
        # The union boxes are in order along dim 0 (starts and stops both ascending).
        cands = range(len(boxes)) if starts is None else range(bisect_right(stops, sb[0][0]), bisect_left(starts, sb[0][1]))
        for u in cands:
            cut = intersect_boxes(sb, boxes[u])
            if cut is not None:
                readers[u].add(row.dst_rank)
                by_dst[row.dst_rank].append(_Reader(j, u, *_reads(row, sb, cut, boxes[u])))
    return _Need(boxes, tuple(frozenset(r) for r in readers), dict(by_dst), dict(by_rows))


class _Source(NamedTuple):
    """One source tensor read into the host: its jobs (``Job``), its needs per replica set (in
    sorted order) and, per need, its transfers aligned with the union boxes (None where the senders
    or receivers cut a box: the fan-out then intersects the transfers)."""

    name: str
    jobs: tuple[Job, ...]
    needs: dict                 # group -> _Need
    transfers: dict             # group -> list[CrossTransfer] (all of this need's)
    aligned: dict               # group -> tuple[CrossTransfer, ...] | None (one per union box)


class _HostPart(HostPlan):
    """A host's part made by :func:`plan_host_part`: transfers and buffers made up front, ops made
    per rank when asked (``local_ops_for_dst``, ``fanout_for_dst``), all of them only for
    ``local_ops`` / ``fanout``. ``plan`` (the merged per-rank plans of the host's destination ranks)
    is made only when asked for, too. Equal, query by query, to ``plan_hosts(..., host=)``."""

    def __init__(self, make_plan, src_layouts, hosts, host: str, transfers, buffer_bytes, sources, local_jobs,
                 dst_ranks, shift: int = 0):
        self._make_plan = make_plan
        self._src_layouts = src_layouts
        self._hosts = dict(hosts)
        self._host = host
        self.transfers = transfers
        self._buffer_bytes = dict(buffer_bytes)
        self._sources = sources          # [_Source, ...]
        self._local_jobs = local_jobs    # [(Job, {dst_rank: [OpRow, ...]}), ...]: rows within the host
        self._dst_ranks = dst_ranks
        self._shift = shift
        self._local_cache: dict[int, tuple] = {}
        self._fan_cache: dict[int, tuple] = {}

    @cached_property
    def plan(self) -> Plan:
        return self._make_plan()

    @property
    def src_layouts(self):
        return dict(self._src_layouts)

    @cached_property
    @gc_paused
    def local_ops(self) -> tuple[TransferOp, ...]:
        ops = [op for r in self._dst_ranks for op in self.local_ops_for_dst(r)]
        ops.sort(key=lambda op: (op.name, op.dst_rank, tuple([s.start for s in op.dst_slices]), op.src_rank))
        return tuple(ops)

    @cached_property
    @gc_paused
    def fanout(self) -> tuple[FanoutOp, ...]:
        fan = [f for r in self._dst_ranks for f in self.fanout_for_dst(r)]
        fan.sort(key=lambda f: (f.op.name, f.op.dst_rank, tuple([s.start for s in f.op.dst_slices]), f.transfer))
        return tuple(fan)

    @gc_paused
    def local_ops_for_dst(self, rank: int) -> tuple[TransferOp, ...]:
        got = self._local_cache.get(rank)
        if got is None:
            keyed = []
            for job, by_dst in self._local_jobs:
                for row in by_dst.get(rank, ()):
                    keyed.append(((job.name, tuple([s.start for s in row.dst_slices]), row.src_rank),
                                  new_op(job.name, row.src_rank, rank, row.src_slices, row.dst_slices,
                                         row.global_index, job.src_name)))
            keyed.sort(key=_first)
            got = self._local_cache[rank] = tuple(op for _, op in keyed)
        return got

    @gc_paused
    def fanout_for_dst(self, rank: int) -> tuple[FanoutOp, ...]:
        got = self._fan_cache.get(rank)
        if got is None:
            keyed = []
            shift = self._shift
            for src in self._sources:
                sname = src.name
                for group, need in src.needs.items():
                    aligned = src.aligned[group]
                    if aligned is not None:
                        for rd in need.by_dst.get(rank, ()):
                            t = aligned[rd.box]
                            name = src.jobs[rd.job].name
                            keyed.append(((name, rd.starts, t.index + shift),
                                          new_fanout(t.index + shift, new_op(name, t.receiver, rank, rd.rel,
                                                                             rd.dst_slices, rd.global_index, sname))))
                        continue
                    for j, row in need.rows.get(rank, ()):   # a cut box: intersect the transfers
                        sb = box_of(row.src_slices)
                        name = src.jobs[j].name
                        for t in src.transfers[group]:
                            tb = box_of(t.box)
                            cut = intersect_boxes(sb, tb)
                            if cut is not None:
                                rel, dst, g, starts = _reads(row, sb, cut, tb)
                                keyed.append(((name, starts, t.index + shift),
                                              new_fanout(t.index + shift, new_op(name, t.receiver, rank, rel, dst,
                                                                                 g, sname))))
            keyed.sort(key=_first)
            got = self._fan_cache[rank] = tuple(f for _, f in keyed)
        return got

    @cached_property
    @gc_paused
    def _readers(self) -> dict[int, tuple[int, ...]]:
        out: dict[int, set[int]] = defaultdict(set)
        for src in self._sources:
            for group, need in src.needs.items():
                aligned = src.aligned[group]
                if aligned is not None:
                    for t, rs in zip(aligned, need.readers):
                        out[t.receiver].update(rs)
                    continue
                for t in src.transfers[group]:
                    tb = box_of(t.box)
                    for d, rows in need.rows.items():
                        if any(intersect_boxes(box_of(row.src_slices), tb) is not None for _, row in rows):
                            out[t.receiver].add(d)
        return {r: tuple(sorted(v)) for r, v in out.items()}

    def buffer_readers(self, receiver: int) -> tuple[int, ...]:
        return self._readers.get(receiver, ())

    @cached_property
    @gc_paused
    def _local_readers(self) -> dict[int, tuple[int, ...]]:
        out: dict[int, set[int]] = defaultdict(set)
        for _, by_dst in self._local_jobs:
            for d, rows in by_dst.items():
                out_d = {row.src_rank for row in rows}
                for s in out_d:
                    out[s].add(d)
        return {r: tuple(sorted(v)) for r, v in out.items()}

    def local_readers_of(self, src_rank: int) -> tuple[int, ...]:
        return self._local_readers.get(src_rank, ())

    def joined(self, transfers, buffer_bytes, shift: int) -> HostPlan:
        part = _HostPart(self._make_plan, self._src_layouts, self._hosts, self._host, transfers, buffer_bytes,
                         self._sources, self._local_jobs, self._dst_ranks, self._shift + shift)
        if "plan" in self.__dict__:
            part.plan = self.plan
        return part


def _first(item):
    return item[0]


@gc_paused
def plan_host_part(src_layouts, dst_layouts, parts=None, quant=None, hosts: Mapping[int, str] | None = None,
                   host: str | None = None, *, src_offsets: Mapping[tuple[int, str], int] | None = None,
                   align: int = RECV_ALIGN, first_index: int = 0) -> HostPlan:
    """Destination host ``host``'s part of the group's host plan, from the group's layouts.

    The same part as ``plan_hosts(merge_plans([plan_quantized(src_layouts, dst_layouts, parts, quant,
    rank=d) for d in the host's destination ranks]), hosts, host=host, src_offsets=, align=,
    first_index=)`` (its transfers, buffers and every query), without making a plan: the ops into
    the host are planned once per geometry (:func:`.reshard.rows_into`), each need's union and
    fan-out once per geometry, and a rank's ops are made only when asked for. A host without
    destination ranks gets an empty part. ``plan`` of the result (the merged plans) is made only if
    read. Raises what ``plan_quantized`` and ``plan_hosts`` raise.

    A host whose ops would be re-sourced to a replica on the host (replicated sources with a
    replica there) is planned through ``plan_hosts`` (the choice depends on every op before it).
    """
    planned = quantized_inputs(src_layouts, dst_layouts, parts, quant) if quant else dst_layouts
    resolved = check_inputs(src_layouts, planned, parts)
    if quant:
        padded = sorted(n for n in quant if any(sn is None for sn, _, _ in resolved.get(n, ())))
        if padded:
            raise ValueError(f"plan_quantized: {padded} have zero padding (fills); quantized weights must be "
                             f"built from sources only")
    used = {n for n in planned if n not in resolved} | {p[0] for rs in resolved.values() for p in rs
                                                       if p[0] is not None}
    ranks = {r for n in used for r in src_layouts[n].ranks} | {r for lay in planned.values() for r in lay.ranks}
    host_of = _check_hosts(ranks, hosts, host, align, first_index, "plan_host_part")
    if host is None:
        raise ValueError("plan_host_part: host must name one host of hosts")
    mine = sorted({r for lay in planned.values() for r in lay.ranks if host_of[r] == host})

    def make_plan() -> Plan:
        if not mine:
            return Plan(src_layouts, dst_layouts, ())
        merged = merge_plans([plan_quantized(src_layouts, dst_layouts, parts, quant, rank=d) for d in mine])
        return QuantizedPlan(merged, dst_layouts, quant) if quant else merged

    jobs = rows_into(src_layouts, planned, resolved, frozenset(mine))
    crossing = {s for s, h in host_of.items() if h != host}

    def cross(row: OpRow) -> bool:
        return row.src_rank in crossing

    # Per geometry: the rows within the host, and whether a cross-host row has a replica on the host.
    local_of: dict[tuple, dict] = {}
    local_jobs, by_source = [], defaultdict(list)
    for job in jobs:
        by_dst = local_of.get(job.key)
        if by_dst is None:
            by_dst = defaultdict(list)
            for row in job.rows:
                if row.src_rank not in crossing:
                    by_dst[row.dst_rank].append(row)
                elif len(row.group) > 1 and any(r not in crossing for r in row.group):
                    by_dst = None   # re-sourced on the host, in plan order over all ops: plan_hosts does it
                    break
            if by_dst is None:
                return plan_hosts(make_plan(), hosts, src_offsets=src_offsets, align=align, host=host,
                                  first_index=first_index)
            by_dst = local_of[job.key] = dict(by_dst)
        if by_dst:
            local_jobs.append((job, by_dst))
        by_source[job.src_name].append(job)
    # Per source tensor: its needs (a union per replica set), shared by the sources of one geometry.
    need_of: dict[tuple, dict] = {}
    sources: list[_Source] = []
    crossings: list[_Crossing] = []
    receivers: set[int] = set()
    for name in sorted(by_source):
        src_jobs = tuple(by_source[name])
        key = tuple(j.key for j in src_jobs)
        needs = need_of.get(key)
        if needs is None:
            groups = sorted({row.group for j in src_jobs for row in j.rows if row.src_rank in crossing})
            jobs_rows = tuple(j.rows for j in src_jobs)
            needs = need_of[key] = {g: _need(jobs_rows, g, cross) for g in groups}
        if not needs:
            continue
        sources.append(_Source(name, src_jobs, needs, {}, {}))
        for group, need in needs.items():
            receivers.update(need.by_dst)
            sender = group[0] if len(group) == 1 else -1
            crossings += [_new_crossing((host, name, group, box, sender, -1)) for box in need.boxes]
    knobs = replicas.KNOBS

    def arena_pos(sender: int, name: str) -> int:
        return src_offsets.get((sender, name), 0) if src_offsets is not None else 0

    src_lay = src_layouts
    boxes = _choose_senders(crossings, src_lay, knobs)
    boxes = _assign_receivers(boxes, receivers, src_lay, arena_pos, knobs)
    geometry = {src.name: src.jobs[0].source for src in sources}
    shapes: dict[tuple, tuple] = {}

    def shape_of(name: str, sender: int) -> tuple:   # per (source geometry, rank): layers share it
        key = (geometry[name], sender)
        got = shapes.get(key)
        if got is None:
            got = shapes[key] = tuple(src_lay[name].local_shape(sender))
        return got

    transfers, buffers, order = _lay_out_buffers(boxes, host_of, src_lay, arena_pos, align, first_index, shape_of)
    by_need: dict[tuple[str, tuple], list[CrossTransfer]] = defaultdict(list)
    for c, t in zip(order, transfers):
        by_need[(c.name, c.group)].append(t)
    for src in sources:
        for group, need in src.needs.items():
            got = src.transfers[group] = by_need[(src.name, group)]
            # Steps 3 and 4 only cut boxes: as many transfers as union boxes means none was cut.
            if len(got) != len(need.boxes):
                src.aligned[group] = None
            elif len(got) == 1:
                src.aligned[group] = got
            else:
                at = {box_of(t.box): t for t in got}
                src.aligned[group] = tuple(at[b] for b in need.boxes)
    return _HostPart(make_plan, src_layouts, host_of, host, tuple(transfers), buffers, sources, local_jobs, mine)
