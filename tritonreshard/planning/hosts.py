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
"""
from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import NamedTuple

import torch

from . import replicas
from .boxes import (RECV_ALIGN, Box, box_extent, box_is_contiguous, box_nbytes, box_of, box_part, cut_global,
                    intersect_boxes, slices_of, union_boxes)
from .ops import Plan, TransferOp
from .text import fmt_bytes, fmt_ranks, fmt_slices, render_table
from ._gc import gc_paused

__all__ = ["CrossTransfer", "FanoutOp", "HostPlan", "host_order", "plan_hosts"]


@dataclass(frozen=True)
class CrossTransfer:
    """One box of a source rank's local shard that crosses from ``src_host`` into ``dst_host``.

    ``src_rank`` sends source tensor ``name``'s local shard ``[box]`` (source dtype ``dtype``,
    ``nbytes`` bytes);
    ``receiver`` (on ``dst_host``) receives it at byte ``offset`` of its receive buffer, laid out as a
    contiguous tensor of ``shape``. ``contiguous``: the box is one range of the sender's shard, so it
    is sent straight from the sender's memory; otherwise the sender packs it first.
    """

    index: int
    name: str
    src_rank: int
    receiver: int
    src_host: str
    dst_host: str
    box: tuple[slice, ...]
    dtype: torch.dtype
    offset: int
    nbytes: int
    contiguous: bool

    def __hash__(self) -> int:  # slices are unhashable before Python 3.12
        return hash((self.index, self.name, self.src_rank, self.receiver, box_of(self.box)))

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(s.stop - s.start for s in self.box)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def __str__(self) -> str:
        return (f"#{self.index} {self.name}: {self.src_rank}@{self.src_host} -> {self.receiver}@{self.dst_host} "
                f"src{fmt_slices(self.box)} ({'x'.join(map(str, self.shape)) or 'scalar'}, "
                f"{fmt_bytes(self.nbytes)}) buf+{self.offset}")


@dataclass(frozen=True)
class FanoutOp:
    """A destination rank's read from a receiver's buffer (same host).

    ``op`` is an ordinary :class:`~tritonreshard.planning.TransferOp` whose ``src_rank`` is the receiver
    and whose ``src_slices`` index the transfer's box as a tensor of ``transfers[transfer].shape``
    (i.e. relative to the box); ``dst_slices`` and ``global_index`` are as in the plan. Descriptor
    tables take it like any op, with the box view as its source tensor.
    """

    transfer: int
    op: TransferOp

    @property
    def receiver(self) -> int:
        return self.op.src_rank

    @property
    def dst_rank(self) -> int:
        return self.op.dst_rank

    def __str__(self) -> str:
        return f"fan-out of #{self.transfer}: {self.op}"


class HostPlan:
    """A :class:`~tritonreshard.planning.Plan` split by host: local ops, cross-host transfers, receive
    buffers and fan-out ops (see the module docstring). ``str(host_plan)`` is a readable table."""

    def __init__(self, plan: Plan, hosts: Mapping[int, str], local_ops: tuple[TransferOp, ...],
                 transfers: tuple[CrossTransfer, ...], fanout: tuple[FanoutOp, ...],
                 buffer_bytes: Mapping[int, int]):
        self.plan = plan
        self._hosts = dict(hosts)
        self.local_ops = local_ops
        self.transfers = transfers
        self.fanout = fanout
        self._buffer_bytes = dict(buffer_bytes)

    # ---------------------------------------------------------------- queries
    @property
    def hosts(self) -> dict[int, str]:
        """rank -> host, for every rank of the plan."""
        return dict(self._hosts)

    def host_of(self, rank: int) -> str:
        return self._hosts[rank]

    @cached_property
    def host_names(self) -> tuple[str, ...]:
        """Distinct hosts, in order of their lowest rank (:func:`host_order`)."""
        return host_order(self._hosts)

    @cached_property
    def _by_index(self) -> dict[int, CrossTransfer]:
        return {t.index: t for t in self.transfers}

    def transfer(self, index: int) -> CrossTransfer:
        """The transfer numbered ``index`` (a host's part numbers its transfers from its
        ``first_index``, so ``transfers[index]`` holds only for the whole plan)."""
        return self._by_index[index]

    @property
    def buffer_bytes(self) -> dict[int, int]:
        """receiver rank -> bytes of its receive buffer (the cross-host path's only staging)."""
        return dict(self._buffer_bytes)

    @property
    def staging_bytes(self) -> int:
        return sum(self._buffer_bytes.values())

    @cached_property
    def cross_host_bytes(self) -> int:
        """Bytes per refit that cross between hosts (source dtype)."""
        return sum(t.nbytes for t in self.transfers)

    @cached_property
    def p2p_cross_host_bytes(self) -> int:
        """What point-to-point transfers of the plain plan would send across hosts (source dtype):
        every destination rank's own slices, a replicated byte once per rank that needs it."""
        src = self.plan.src_layouts
        return sum(op.numel * src[op.src_name].itemsize for op in self.plan.ops
                   if self._hosts[op.src_rank] != self._hosts[op.dst_rank])

    @cached_property
    def host_pair_bytes(self) -> dict[tuple[str, str], int]:
        """(source host, destination host) -> bytes crossing per refit."""
        out: dict[tuple[str, str], int] = defaultdict(int)
        for t in self.transfers:
            out[(t.src_host, t.dst_host)] += t.nbytes
        return dict(out)

    @cached_property
    def send_staging_bytes(self) -> int:
        """Bytes a sender packs because its box is not one contiguous range of its shard."""
        return sum(t.nbytes for t in self.transfers if not t.contiguous)

    @cached_property
    def _index(self):
        sends, recvs, local, fan = (defaultdict(list) for _ in range(4))
        readers: dict[int, set[int]] = defaultdict(set)
        for t in self.transfers:
            sends[t.src_rank].append(t)
            recvs[t.receiver].append(t)
        for op in self.local_ops:
            local[op.dst_rank].append(op)
        for f in self.fanout:
            fan[f.dst_rank].append(f)
            readers[f.receiver].add(f.dst_rank)
        return ({k: tuple(v) for k, v in sends.items()}, {k: tuple(v) for k, v in recvs.items()},
                {k: tuple(v) for k, v in local.items()}, {k: tuple(v) for k, v in fan.items()},
                {k: tuple(sorted(v)) for k, v in readers.items()})

    def sends_of(self, rank: int) -> tuple[CrossTransfer, ...]:
        """Transfers ``rank`` sends (a source rank), in receive-buffer order per receiver."""
        return self._index[0].get(rank, ())

    def recvs_of(self, rank: int) -> tuple[CrossTransfer, ...]:
        """Transfers ``rank`` receives into its buffer, in buffer order."""
        return self._index[1].get(rank, ())

    def local_ops_for_dst(self, rank: int) -> tuple[TransferOp, ...]:
        """Ops ``rank`` runs from a source arena on its own host (unchanged or re-sourced)."""
        return self._index[2].get(rank, ())

    def fanout_for_dst(self, rank: int) -> tuple[FanoutOp, ...]:
        """Ops ``rank`` runs from receivers' buffers on its own host."""
        return self._index[3].get(rank, ())

    def buffer_readers(self, receiver: int) -> tuple[int, ...]:
        """Destination ranks that read ``receiver``'s buffer (the receiver itself included if it
        reads its own)."""
        return self._index[4].get(receiver, ())

    def local_sources_of(self, dst_rank: int) -> tuple[int, ...]:
        """Source ranks whose arenas ``dst_rank`` maps (all on its host)."""
        return tuple(sorted({op.src_rank for op in self.local_ops_for_dst(dst_rank)}))

    def local_readers_of(self, src_rank: int) -> tuple[int, ...]:
        """Destination ranks that read ``src_rank``'s arena directly (all on its host)."""
        return tuple(sorted({op.dst_rank for op in self.local_ops if op.src_rank == src_rank}))

    # ---------------------------------------------------------------- text
    def summary(self) -> str:
        return (f"HostPlan: {len(self.host_names)} host(s), {len(self.transfers)} cross-host transfer(s), "
                f"{fmt_bytes(self.cross_host_bytes)} across hosts (point-to-point of the plain plan: "
                f"{fmt_bytes(self.p2p_cross_host_bytes)}), receive buffers {fmt_bytes(self.staging_bytes)}, "
                f"{len(self.local_ops)} local op(s), {len(self.fanout)} fan-out op(s)")

    def table(self, max_rows: int | None = 64) -> str:
        """The host plan as text: hosts, transfers, host-pair bytes, receive buffers. ``max_rows``
        caps the transfer rows (``None``: all)."""
        lines = [self.summary()]
        by_host: dict[str, list[int]] = defaultdict(list)
        for r in sorted(self._hosts):
            by_host[self._hosts[r]].append(r)
        lines.append("hosts: " + "; ".join(f"{h}: ranks {fmt_ranks(by_host[h])}" for h in self.host_names))
        if self.transfers:
            headers = ("#", "tensor", "src->recv", "hosts", "src local", "shape", "bytes", "buf offset", "send")
            rows = ((str(t.index), t.name, f"{t.src_rank}->{t.receiver}", f"{t.src_host}->{t.dst_host}",
                     fmt_slices(t.box), "x".join(map(str, t.shape)) or "scalar", fmt_bytes(t.nbytes),
                     str(t.offset), "direct" if t.contiguous else "packed") for t in self.transfers)
            lines += render_table(headers, rows, max_rows=max_rows, sections=(("transfers", len(self.transfers)),))
            lines.append("bytes across hosts (rows: source host, columns: destination host)")
            hs = self.host_names
            lines += render_table(["src\\dst"] + list(hs),
                                  [[s] + [fmt_bytes(self.host_pair_bytes[(s, d)]) if (s, d) in self.host_pair_bytes
                                          else "." for d in hs] for s in hs], right=True)
            lines.append("receive buffers: " + ", ".join(
                f"{r}: {fmt_bytes(b)} read by {fmt_ranks(self.buffer_readers(r))}"
                for r, b in sorted(self._buffer_bytes.items())))
        else:
            lines.append("nothing crosses between hosts")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()

    def __repr__(self) -> str:
        return f"<{self.summary()}>"


def _check_hosts(plan: Plan, hosts) -> dict[int, str]:
    if not isinstance(plan, Plan):
        raise TypeError(f"plan must be a trs.Plan, got {type(plan).__name__}")
    if not isinstance(hosts, Mapping):
        raise TypeError(f"hosts must be a mapping rank -> host name, got {type(hosts).__name__}")
    problems = []
    ranks = sorted(set(plan.src_ranks) | set(plan.dst_ranks))
    missing = [r for r in ranks if r not in hosts]
    if missing:
        problems.append(f"hosts has no entry for plan rank(s) {missing} (hosts has ranks {sorted(hosts)})")
    bad = [f"hosts[{r!r}]={h!r}" for r, h in hosts.items() if not isinstance(h, str) or not h]
    if bad:
        problems.append("host names must be non-empty strings: " + ", ".join(bad))
    if problems:
        raise ValueError(f"plan_hosts: {len(problems)} problem(s):\n  - " + "\n  - ".join(problems))
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
    host_of = _check_hosts(plan, hosts)
    problems = []
    if not isinstance(align, int) or align < 1:
        problems.append(f"align must be a positive int, got align={align!r}")
    if host is not None and host not in set(hosts.values()):
        problems.append(f"host={host!r} is no host of hosts (hosts: {sorted(set(hosts.values()))})")
    if isinstance(first_index, bool) or not isinstance(first_index, int) or first_index < 0:
        problems.append(f"first_index must be an int >= 0, got first_index={first_index!r}")
    if problems:
        raise ValueError(f"plan_hosts: {len(problems)} problem(s):\n  - " + "\n  - ".join(problems))
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
        boxes = _assign_receivers(boxes, needs, src_lay, arena_pos, knobs)
        h_transfers, h_buffers = _lay_out_buffers(boxes, host_of, src_lay, arena_pos, align,
                                                  first_index + len(transfers))
        fanout += _fan_out(needs, h_transfers, replica_sets)
        local += h_local
        transfers += h_transfers
        buffer_bytes.update(h_buffers)
    local.sort(key=lambda op: (op.name, op.dst_rank, tuple(s.start for s in op.dst_slices), op.src_rank))
    fanout.sort(key=lambda f: (f.op.name, f.dst_rank, tuple(s.start for s in f.op.dst_slices), f.transfer))
    return HostPlan(plan, host_of, tuple(local), tuple(transfers), tuple(fanout), buffer_bytes)



def host_order(hosts: Mapping[int, str]) -> tuple[str, ...]:
    """The distinct hosts of ``{rank: host}`` in order of their lowest rank: the order of the host
    plan's parts (each host's transfers are numbered after those of the hosts before it)."""
    seen: dict[str, None] = {}
    for r in sorted(hosts):
        seen.setdefault(hosts[r], None)
    return tuple(seen)


# What a host needs from other hosts: (destination host, source name, replica set) -> the plan's ops.
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
    pieces = [replicas.Piece(c.group, box_nbytes(src_lay[c.name], c.box), box_extent(c.box), (c.host, c.name, c.group, c.box))
              for c in crossings]
    out = []
    for c, shares in zip(crossings, replicas.spread(pieces, replicas.Loads(), knobs)):
        u0 = 0
        for sender, units in shares:
            out.append(c._replace(box=box_part(c.box, u0, u0 + units), sender=sender))
            u0 += units
    return out


def _assign_receivers(crossings: list[_Crossing], needs: _Needs, src_lay, arena_pos,
                      knobs: replicas.Knobs) -> list[_Crossing]:
    """Step 4: each box's receiver, one of the destination host's ranks that need data from other
    hosts. The host's boxes in (sender, arena) order are cut into one consecutive run per receiver
    of about equal bytes (:func:`.replicas.cut_runs`), a box at a run's end cut along its outermost
    dim: boxes back to back in a sender's arena stay together and travel as few messages."""
    receivers: dict[str, set[int]] = defaultdict(set)
    for (h, _, _), ops in needs.items():
        receivers[h].update(op.dst_rank for op in ops)
    by_host: dict[str, list[_Crossing]] = defaultdict(list)
    for c in crossings:
        by_host[c.host].append(c)
    out = []
    for h in sorted(by_host):
        seq = sorted(by_host[h], key=lambda c: (c.sender, arena_pos(c.sender, c.name), c.name, c.box))
        sizes = [(box_nbytes(src_lay[c.name], c.box), box_extent(c.box)) for c in seq]
        recvs = sorted(receivers[h])
        for i, u0, u1, run in replicas.cut_runs(sizes, len(recvs), knobs):
            out.append(seq[i]._replace(box=box_part(seq[i].box, u0, u1), receiver=recvs[run]))
    return out


def _lay_out_buffers(crossings: list[_Crossing], host_of: Mapping[int, str], src_lay, arena_pos,
                     align: int, first: int = 0) -> tuple[list[CrossTransfer], dict[int, int]]:
    """Step 5: each receiver's buffer holds its boxes back to back, ``align``-byte aligned, grouped by
    sender in the sender's arena order (so arena neighbours are buffer neighbours: one message).
    Returns the transfers, numbered in buffer order from ``first``, and each receiver's buffer size."""
    transfers: list[CrossTransfer] = []
    buffer_bytes: dict[int, int] = defaultdict(int)
    for c in sorted(crossings, key=lambda c: (c.receiver, c.sender, arena_pos(c.sender, c.name), c.name, c.box)):
        lay = src_lay[c.name]
        pos = -(-buffer_bytes[c.receiver] // align) * align
        size = box_nbytes(lay, c.box)
        transfers.append(CrossTransfer(first + len(transfers), c.name, c.sender, c.receiver, host_of[c.sender], c.host,
                                       slices_of(c.box), lay.dtype, pos, size,
                                       box_is_contiguous(c.box, lay.local_shape(c.sender))))
        buffer_bytes[c.receiver] = pos + size
    return transfers, {r: -(-b // align) * align for r, b in buffer_bytes.items()}


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
