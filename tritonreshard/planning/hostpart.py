"""One host's part of the host plan from the group's layouts (:func:`plan_host_part`): what a rank on
several hosts plans. The same part as ``plan_hosts(plan, hosts, host=)`` of the merged per-rank
plans of the host's destination ranks, without making a plan: the ops into the host are planned once
per geometry (a model's layers repeat a few: :func:`.reshard.rows_into`), each need's union and
fan-out once per geometry, and a rank's ops are made only when asked for."""
from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from collections import defaultdict
from collections.abc import Mapping
from functools import cached_property
from typing import NamedTuple

from . import replicas
from ._gc import gc_paused
from .boxes import RECV_ALIGN, Box, box_of, cut_global, intersect_boxes, union_boxes
from .checks import check_inputs, refuse_transposed, used_sources
from .crossings import (
    Crossing,
    assign_receivers,
    check_hosts,
    choose_senders,
    lay_out_buffers,
    name_key,
    new_crossing,
    sender_name,
)
from .hostplan import CrossTransfer, FanoutOp, HostPlan, Traffic, new_fanout, tally_transfers
from .hosts import plan_hosts
from .ops import Plan, TransferOp, merge_plans, new_op
from .quant import QuantizedPlan, plan_quantized, quantized_inputs
from .reshard import Job, OpRow, rows_into, source_itemsize

__all__ = ["host_part", "plan_host_part"]


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
    rel = tuple(slice(a - b0, b - b0) for (a, b), (b0, _) in zip(cut, base, strict=True))
    dst = tuple(slice(ds.start + a - sa, ds.start + b - sa)
                for (a, b), (sa, _), ds in zip(cut, sb, row.dst_slices, strict=True))
    g = tuple(cut_global(gi, a - sa, b - sa) for (a, b), (sa, _), gi in zip(cut, sb, row.global_index, strict=True))
    return rel, dst, g, tuple([d.start for d in dst])


class _Need(NamedTuple):
    """What a host needs of one source geometry from one replica set: the union of its ranks' source
    boxes (:func:`.boxes.union_boxes`), and each reading rank's pieces of it. Shared by every source
    tensor of the geometry (layers)."""

    boxes: tuple[Box, ...]
    readers: tuple[frozenset, ...]          # per union box: the destination ranks that read it
    by_dst: dict                            # dst_rank -> [_Reader, ...]
    rows: dict                              # dst_rank -> [(job, OpRow), ...] (for cut boxes)
    reads: tuple[tuple[int, int], ...]      # per union box: (elements read from it, fan-out ops)


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
        cands = (range(len(boxes)) if starts is None
                 else range(bisect_right(stops, sb[0][0]), bisect_left(starts, sb[0][1])))
        for u in cands:
            cut = intersect_boxes(sb, boxes[u])
            if cut is not None:
                readers[u].add(row.dst_rank)
                by_dst[row.dst_rank].append(_Reader(j, u, *_reads(row, sb, cut, boxes[u])))
    reads = [[0, 0] for _ in boxes]
    for rds in by_dst.values():
        for rd in rds:
            reads[rd.box][0] += _numel(rd.rel)
            reads[rd.box][1] += 1
    return _Need(boxes, tuple(frozenset(r) for r in readers), dict(by_dst), dict(by_rows),
                 tuple((n, c) for n, c in reads))


def _numel(slices: tuple[slice, ...]) -> int:
    return math.prod(s.stop - s.start for s in slices)


class _Source(NamedTuple):
    """One source tensor read into the host: its jobs (``Job``), its needs per replica set (in
    sorted order) and, per need, its transfers aligned with the union boxes (None where the senders
    or receivers cut a box: the fan-out then intersects the transfers)."""

    name: str | tuple[str, ...]   # a name, or aliases' names (read as one source)
    jobs: tuple[Job, ...]
    needs: dict                 # group -> _Need
    transfers: dict             # group -> list[CrossTransfer] (all of this need's)
    aligned: dict               # group -> tuple[CrossTransfer, ...] | None (one per union box)


class _HostPart(HostPlan):
    """A host's part made by :func:`plan_host_part`: transfers and buffers made up front, ops made
    per rank when asked (``local_ops_for_dst``, ``fanout_for_dst``), all of them only for
    ``local_ops`` / ``fanout``. ``plan`` (the merged per-rank plans of the host's destination ranks)
    is made only when asked for, too. Equal, query by query, to ``plan_hosts(..., host=)``."""

    def __init__(self, make_plan, src_layouts, dst_layouts, hosts, host: str, transfers, buffer_bytes, sources,
                 jobs, local_jobs, dst_ranks, shift: int = 0):
        self._make_plan = make_plan
        self._src_layouts = src_layouts
        self._dst_layouts = dst_layouts
        self._jobs = jobs                # every Job into the host
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
        self._readers: dict[int, tuple] = {}

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
                alias = job.alias
                for row in by_dst.get(rank, ()):
                    keyed.append(((job.name, tuple([s.start for s in row.dst_slices]), row.src_rank),
                                  new_op(job.name, row.src_rank, rank, row.src_slices, row.dst_slices,
                                         row.global_index, job.src_name if alias is None else alias[row.src_rank])))
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
                for group, need in src.needs.items():
                    aligned = src.aligned[group]
                    if aligned is not None:
                        for rd in need.by_dst.get(rank, ()):
                            t = aligned[rd.box]
                            name = src.jobs[rd.job].name
                            keyed.append(((name, rd.starts, t.index + shift),
                                          new_fanout(t.index + shift, new_op(name, t.receiver, rank, rd.rel,
                                                                             rd.dst_slices, rd.global_index, t.name))))
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
                                                                                 g, t.name))))
            keyed.sort(key=_first)
            got = self._fan_cache[rank] = tuple(f for _, f in keyed)
        return got

    @gc_paused
    def buffer_readers(self, receiver: int) -> tuple[int, ...]:
        got = self._readers.get(receiver)
        if got is None:
            out: set[int] = set()
            for src in self._sources:
                for group, need in src.needs.items():
                    aligned = src.aligned[group]
                    if aligned is not None:
                        for t, rs in zip(aligned, need.readers, strict=True):
                            if t.receiver == receiver:
                                out.update(rs)
                        continue
                    for t in src.transfers[group]:
                        if t.receiver != receiver:
                            continue
                        tb = box_of(t.box)
                        for d, rows in need.rows.items():
                            if any(intersect_boxes(box_of(row.src_slices), tb) is not None for _, row in rows):
                                out.add(d)
            got = self._readers[receiver] = tuple(sorted(out))
        return got

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

    @gc_paused
    def traffic(self) -> Traffic:
        """As :meth:`HostPlan.traffic`, summed per geometry (no op is made)."""
        ow, iw, oa, ia, pc = (defaultdict(int) for _ in range(5))
        s_isz = {n: lay.itemsize for n, lay in self._src_layouts.items()}
        s_isz.update((src.name, source_itemsize(self._src_layouts, src.name)) for src in self._sources)
        s_isz.update((job.src_name, source_itemsize(self._src_layouts, job.src_name)) for job, _ in self._local_jobs)
        d_isz = {n: lay.itemsize for n, lay in self._dst_layouts.items()}
        # What each destination rank writes (every row into it), per geometry times its tensors.
        times: dict[tuple[int, int], int] = defaultdict(int)
        rows_of: dict[int, tuple] = {}
        for job in self._jobs:
            times[(job.key, d_isz[job.name])] += 1
            rows_of[job.key] = job.rows
        writes: dict[int, dict[int, int]] = {}
        for (key, isz), count in times.items():
            per = writes.get(key)
            if per is None:
                per = writes[key] = defaultdict(int)
                for row in rows_of[key]:
                    per[row.dst_rank] += _numel(row.dst_slices)
            for d, n in per.items():
                iw[d] += n * isz * count
        for job, by_dst in self._local_jobs:
            isz = s_isz[job.src_name]
            for d, rows in by_dst.items():
                pc[d] += len(rows)
                for row in rows:
                    ow[row.src_rank] += _numel(row.src_slices) * isz
                    pc[row.src_rank] += 1
        aligned_needs: dict[int, int] = defaultdict(int)
        needs_by_id: dict[int, _Need] = {}
        for src in self._sources:
            isz = s_isz[src.name]
            for group, need in src.needs.items():
                aligned = src.aligned[group]
                if aligned is not None:
                    for t, (n, count) in zip(aligned, need.reads, strict=True):
                        ow[t.receiver] += n * isz
                        pc[t.receiver] += count
                    aligned_needs[id(need)] += 1
                    needs_by_id[id(need)] = need
                    continue
                for d, rows in need.rows.items():
                    for _, row in rows:
                        sb = box_of(row.src_slices)
                        for t in src.transfers[group]:
                            cut = intersect_boxes(sb, box_of(t.box))
                            if cut is not None:
                                ow[t.receiver] += math.prod(b - a for a, b in cut) * isz
                                pc[t.receiver] += 1
                                pc[d] += 1
        for i, count in aligned_needs.items():   # fan-out ops each rank runs, per geometry
            for d, rds in needs_by_id[i].by_dst.items():
                pc[d] += len(rds) * count
        ingress: dict[str, int] = defaultdict(int)
        return tally_transfers(self.transfers, ow, iw, oa, ia, pc, ingress)

    def joined(self, transfers, buffer_bytes, shift: int) -> HostPlan:
        part = _HostPart(self._make_plan, self._src_layouts, self._dst_layouts, self._hosts, self._host, transfers,
                         buffer_bytes, self._sources, self._jobs, self._local_jobs, self._dst_ranks,
                         self._shift + shift)
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
        padded = sorted(n for n in quant if any(sn is None for sn, _, _, _ in resolved.get(n, ())))
        if padded:
            raise ValueError(f"plan_quantized: {padded} have zero padding (fills); quantized weights must be "
                             f"built from sources only")
    used = used_sources(planned, resolved)
    ranks = {r for n in used for r in src_layouts[n].ranks} | {r for lay in planned.values() for r in lay.ranks}
    host_of = check_hosts(ranks, hosts, host, align, first_index, "plan_host_part")
    if host is None:
        raise ValueError("plan_host_part: host must name one host of hosts")
    return host_part(src_layouts, dst_layouts, parts, quant, planned, resolved, hosts, host_of, host,
                     src_offsets, align, first_index)


def host_part(src_layouts, dst_layouts, parts, quant, planned, resolved, hosts, host_of, host, src_offsets,
              align, first_index) -> HostPlan:
    """:func:`plan_host_part` once its inputs are checked: ``planned`` / ``resolved`` are the planner's
    destination layouts and parts (:func:`.quant.quantized_inputs`, :func:`.checks.check_inputs`),
    ``host_of`` the checked host map. (:func:`~.traffic.refit_traffic` checks once for every host.)
    Refuses transposed parts (``Part(src_dims=...)``): host parts cut and relay source boxes in
    the source's order of dims, and their ops carry no permutation."""
    refuse_transposed("plan_host_part", parts, "a plan across hosts cannot carry (host parts, relays and "
                      "deltas cut source boxes in the source's order of dims; plan such a model on one host)")
    mine = sorted({r for lay in planned.values() for r in lay.ranks if host_of[r] == host})

    def make_plan() -> Plan:
        if not mine:
            return Plan(src_layouts, dst_layouts, ())
        merged = merge_plans([plan_quantized(src_layouts, dst_layouts, parts, quant, rank=d) for d in mine])
        return QuantizedPlan(merged, dst_layouts, quant) if quant else merged

    jobs = rows_into(src_layouts, planned, resolved, frozenset(mine))
    crossing = {s for s, h in host_of.items() if h != host}
    split = _split_by_geometry(jobs, crossing)
    if split is None:
        return plan_hosts(make_plan(), hosts, src_offsets=src_offsets, align=align, host=host,
                          first_index=first_index)
    local_jobs, by_source = split
    sources, crossings, receivers = _needs(by_source, crossing, host)
    knobs = replicas.KNOBS

    # (sender, name) -> the shard's offset in the sender's arena; None: every offset 0
    arena_pos = None if src_offsets is None else (lambda sender, name: src_offsets.get((sender, name), 0))

    src_lay = src_layouts
    boxes = choose_senders(crossings, src_lay, knobs)
    boxes = assign_receivers(boxes, receivers, src_lay, arena_pos, knobs)
    geometry = {src.name: src.jobs[0].source for src in sources}
    shapes: dict[tuple, tuple] = {}

    def shape_of(name, sender: int) -> tuple:   # per (source geometry, rank): layers share it
        key = (geometry[name], sender)
        got = shapes.get(key)
        if got is None:
            got = shapes[key] = tuple(src_lay[sender_name(name, sender, src_lay)].local_shape(sender))
        return got

    transfers, buffers, order = lay_out_buffers(boxes, host_of, src_lay, arena_pos, align, first_index, shape_of)
    _attach_transfers(sources, order, transfers)
    return _HostPart(make_plan, src_layouts, dst_layouts, host_of, host, tuple(transfers), buffers, sources,
                     jobs, local_jobs, mine)


def _split_by_geometry(jobs, crossing: set[int]):
    """Per geometry, the rows within the host (``crossing``: the source ranks on other hosts).
    Returns ``(local_jobs, by_source)``: ``[(job, {dst rank: [row, ...]})]`` of the jobs with rows
    within the host, and ``{source name: [job, ...]}``; or None when a cross-host row has a replica
    on the host (re-sourced there, in plan order over all ops: plan_hosts does it)."""
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
                    return None
            by_dst = local_of[job.key] = dict(by_dst)
        if by_dst:
            local_jobs.append((job, by_dst))
        by_source[job.src_name].append(job)
    return local_jobs, by_source


def _needs(by_source, crossing: set[int], host: str) -> tuple[list[_Source], list[Crossing], set[int]]:
    """Per source tensor: its needs (a union per replica set), shared by the sources of one
    geometry. Returns the sources that need anything from other hosts, the crossings of their
    needs' boxes (sender chosen later unless the replica set is one rank), and the receiving ranks."""

    def cross(row: OpRow) -> bool:
        return row.src_rank in crossing

    need_of: dict[tuple, dict] = {}
    sources: list[_Source] = []
    crossings: list[Crossing] = []
    receivers: set[int] = set()
    for name in sorted(by_source, key=name_key):
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
            crossings += [new_crossing((host, name, group, box, sender, -1)) for box in need.boxes]
    return sources, crossings, receivers


def _attach_transfers(sources: list[_Source], order, transfers) -> None:
    """Each source's transfers per replica set (``order``: the crossing each transfer came from),
    and ``aligned``: those in the order of the need's boxes, or None where a box was cut."""
    by_need: dict[tuple[str, tuple], list[CrossTransfer]] = defaultdict(list)
    for c, t in zip(order, transfers, strict=True):
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
