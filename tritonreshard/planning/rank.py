"""A rank's whole plan for one group epoch, as pure functions of the group's inputs.

Every rank of a refit group calls, in this order (the engine's set-up script,
:mod:`tritonreshard.engine.epoch`, feeds the data the steps need):

1. :func:`plan_rank` ``(src_layouts, dst_layouts, hosts, rank, parts=, quant=)`` -> :class:`RankPlan`:
   its own ops (``plan_quantized(..., rank=)``), the buffer order of its shards, its zero fills,
   and whether the group spans hosts (decided here, once).
2. ``rank_plan.host_part(src_offsets)``, once the arenas' byte offsets are known (they come with the
   exported arenas): its host's part of the host plan, straight from the layouts on several hosts
   (:func:`~tritonreshard.planning.plan_host_part`: the host's destination ranks' ops planned once
   per geometry, never another host's), the whole of it on one host. :func:`host_outbox` says what a host's part tells
   the other hosts: a :class:`HostTransfers` summary, and per sending rank the transfers it sends.
3. ``rank_plan.route(src_offsets, part, summaries, sends)`` -> :class:`Route`: what the rank reads,
   sends, receives, relays and fences. ``summaries``: every other host's :class:`HostTransfers`
   (numbering, who takes part); ``sends``: the transfers other hosts' parts have this rank send.
   A rank never learns another host's transfers that neither it sends nor its host receives.

One host is a route with no transfers: the same three steps, one code path.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property

import torch

from .checks import refuse_transposed
from .hostpart import plan_host_part
from .hostplan import CrossTransfer, HostPlan, host_order, renumbered
from .hosts import plan_hosts
from .ops import FillOp, Plan, TransferOp
from .quant import plan_quantized
from .wire import Message, plan_messages

__all__ = ["BufferRef", "HostTransfers", "RankPlan", "Read", "Route", "host_outbox", "plan_rank", "source_order",
           "tensor_order"]


@dataclass(frozen=True, order=True)
class BufferRef:
    """One buffer copies read from, exported by its owner to the ranks of its host: a source rank's
    ``"arena"`` (its local shards) or a receiving rank's ``"relay"`` buffer (boxes that crossed
    into the host)."""

    kind: str
    owner: int

    def __str__(self) -> str:
        return f"{self.kind} of rank {self.owner}"


@dataclass(frozen=True)
class Read:
    """One copy of a destination rank. ``op`` is the planned op (its ``dst_slices`` index this rank's
    destination shard ``op.name``); its ``src_slices`` index the source view: a tensor of ``shape``
    and ``dtype`` at byte ``offset`` of ``buffer``."""

    op: TransferOp
    buffer: BufferRef
    offset: int
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def order_key(self) -> tuple:
        """Table order: arenas before relay buffers, then by owner and where the view lies."""
        return (self.buffer.kind != "arena", self.buffer.owner, self.offset)


@dataclass(frozen=True)
class HostTransfers:
    """What a destination host's part of the host plan tells the other hosts: how many transfers
    go into it (the group numbers transfers host after host, :func:`~tritonreshard.planning.host_order`),
    and which ranks send and receive them."""

    host: str
    count: int
    senders: tuple[int, ...]
    receivers: tuple[int, ...]


@dataclass(frozen=True)
class Route:
    """What rank ``rank`` does in one epoch.

    * **reads**: every copy it runs, each from a :class:`BufferRef` on its host (a source arena, or
      a relay buffer holding boxes that crossed into the host once);
    * **fills**: zero padding of its destination buffers (written once at set-up);
    * **fenced**: the ranks on its host that read its arena (readers on other hosts are stood for by
      the sends to their relays);
    * **sends** / **receives**: boxes of its arena it sends to other hosts, boxes it receives into its
      receive buffer (``buffer_bytes``), read by ``buffer_readers``;
    * **messages**: the point-to-point messages it sends or receives;
    * **cross_host_ranks**: every rank of the group that sends or receives (the store's host
      outlives their use of the store).

    ``spans_hosts``: the group's plan reads across hosts (every rank then joins the point-to-point
    group, even one without transfers). ``host_plan``: this rank's view of the host plan (its
    host's local ops, fan-out and receives, and the transfers it sends)."""

    rank: int
    host: str
    spans_hosts: bool
    reads: tuple[Read, ...]
    fills: tuple[FillOp, ...]
    fenced: tuple[int, ...]
    sends: tuple[CrossTransfer, ...]
    receives: tuple[CrossTransfer, ...]
    buffer_bytes: int
    buffer_readers: tuple[int, ...]
    messages: tuple[Message, ...] = field(repr=False)
    cross_host_ranks: tuple[int, ...] = field(repr=False, default=())
    host_plan: HostPlan = field(repr=False, compare=False, default=None)

    @cached_property
    def buffers(self) -> tuple[BufferRef, ...]:
        """The buffers this rank's reads come from, in table order."""
        return tuple(sorted({r.buffer for r in self.reads}, key=lambda b: (b.kind != "arena", b.owner)))

    @cached_property
    def receivers(self) -> tuple[int, ...]:
        """Ranks on other hosts this rank sends to."""
        return tuple(sorted({t.receiver for t in self.sends}))

    @cached_property
    def senders(self) -> tuple[int, ...]:
        """Ranks on other hosts this rank receives from."""
        return tuple(sorted({t.src_rank for t in self.receives}))

    @property
    def transfers(self) -> dict[int, CrossTransfer]:
        """``{index: transfer}`` of the transfers this rank knows (its host's and its sends)."""
        return {t.index: t for t in self.host_plan.transfers} if self.host_plan is not None else {}

    def __str__(self) -> str:
        parts = [f"rank {self.rank}@{self.host}: {len(self.reads)} read(s) from "
                 f"{', '.join(map(str, self.buffers)) or 'nothing'}"]
        if self.fenced:
            parts.append(f"fences readers {list(self.fenced)}")
        if self.sends:
            parts.append(f"sends {len(self.sends)} box(es) to {list(self.receivers)}")
        if self.receives:
            parts.append(f"relays {len(self.receives)} box(es) from {list(self.senders)} "
                         f"({self.buffer_bytes} B) to {list(self.buffer_readers)}")
        return "; ".join(parts)


def tensor_order(plan: Plan, names) -> list[str]:
    """``names`` in the group's one buffer order: by geometry (local shapes, dtypes, both sides'
    layouts), then name. Trainers' arenas and inference ranks' buffers both use it, so shards of
    the same geometry sit back to back on both sides."""
    src, dst = plan.src_layouts, plan.dst_layouts  # once: each is a copy (per name, sorting was quadratic)

    def key(n):
        lay = src.get(n) or dst.get(n)
        other = dst.get(n) if n in src else src.get(n)
        return (lay.shape, str(lay.dtype), lay.ranks, tuple(map(str, lay.placements)),
                (other.shape, other.ranks, tuple(map(str, other.placements))) if other is not None else (), n)
    return sorted(names, key=key)


def source_order(src_layouts: Mapping, rank: int) -> list[str]:
    """The names of ``rank``'s source shards in buffer order when the destinations are not known
    when the arena is made (an elastic group's trainers meet before any replica joins): by geometry
    (shape, dtype, layout), then name, as :func:`tensor_order` without the other side."""
    def key(n):
        lay = src_layouts[n]
        return (lay.shape, str(lay.dtype), lay.ranks, tuple(map(str, lay.placements)), n)
    return sorted((n for n, lay in src_layouts.items() if rank in lay.ranks), key=key)


def host_outbox(part: HostPlan, host: str) -> tuple[HostTransfers, dict[int, tuple[CrossTransfer, ...]]]:
    """What ``host``'s ``part`` (``RankPlan.host_part``) tells the other hosts: its summary, and
    ``{sending rank: the transfers into host it sends}`` (numbered within the part, from 0)."""
    senders = sorted({t.src_rank for t in part.transfers})
    summary = HostTransfers(host, len(part.transfers), tuple(senders),
                            tuple(sorted({t.receiver for t in part.transfers})))
    return summary, {s: part.sends_of(s) for s in senders}


@dataclass(frozen=True)
class RankPlan:
    """Rank ``rank``'s plan for one epoch (see the module docstring).

    ``plan``: its own ops (``plan_reshard(..., rank=)``: what it reads and serves); ``inputs``: the
    group's planning inputs ``(src_layouts, dst_layouts, parts, quant)``, from which a rank on
    several hosts plans its host's part. ``src_order`` / ``dst_order``: the
    names of its source / destination shards in the group's buffer order. ``fills``: the zero fills
    of its destination shards. ``several_hosts``: the ranks are on more than one host."""

    rank: int
    host: str
    hosts: Mapping[int, str] = field(repr=False)
    several_hosts: bool
    plan: Plan = field(repr=False)
    src_order: tuple[str, ...]
    dst_order: tuple[str, ...]
    fills: tuple[FillOp, ...] = field(repr=False)
    inputs: tuple = field(repr=False, compare=False, default=())

    @cached_property
    def host_names(self) -> tuple[str, ...]:
        """The hosts of the plan's ranks in the order the group numbers their transfers
        (:func:`~tritonreshard.planning.host_order`)."""
        ranks = set(self.plan.src_ranks) | set(self.plan.dst_ranks)
        return host_order({r: h for r, h in self.hosts.items() if r in ranks})

    @property
    def dst_layouts(self) -> dict:
        """``{name: Layout}`` of the destinations this rank holds."""
        dst = self.plan.dst_layouts  # a copy: taken once, not per name
        return {n: dst[n] for n in self.dst_order}

    def host_part(self, src_offsets: Mapping[tuple[int, str], int]) -> HostPlan:
        """This rank's host's part of the host plan (on one host: all of it), given the byte
        offset of every source shard in its arena (``{(source rank, name): offset}``). Every rank of
        a host derives the same part."""
        if not self.several_hosts:
            return plan_hosts(self.plan, self.hosts, src_offsets=src_offsets)
        src_layouts, dst_layouts, parts, quant = self.inputs
        return plan_host_part(src_layouts, dst_layouts, parts, quant, self.hosts, self.host, src_offsets=src_offsets)

    def local_route(self, src_offsets: Mapping[tuple[int, str], int]) -> Route:
        """A destination rank's :class:`Route` on one host when nobody reads from it: its reads
        straight from its own ops, without a host plan (an elastic group's joiner, which fences
        nobody and sends nothing: at Qwen3-235B scale the host plan of its 58k ops took 1.1 s).
        Its reads are the ones :meth:`route` gives (the same set; a subscriber orders them)."""
        assert not self.several_hosts, "local_route: the group is on one host"
        src, views, buffers, shapes = self.plan.src_layouts, {}, {}, {}
        reads = []
        for op in self.plan.ops:
            if op.dst_rank != self.rank:
                continue
            key = (op.src_rank, op.src_name)
            view = views.get(key)
            if view is None:  # one source shard serves many ops (its layers' slices, its experts)
                lay = src[op.src_name]
                geometry = (lay.shape, lay.placements, lay.mesh, op.src_rank)  # layers repeat a few geometries
                shape = shapes.get(geometry)
                if shape is None:
                    shape = shapes[geometry] = lay.local_shape(op.src_rank)
                view = views[key] = (src_offsets[key], shape, lay.dtype)
                buffers.setdefault(op.src_rank, BufferRef("arena", op.src_rank))
            reads.append(Read(op, buffers[op.src_rank], *view))
        reads = tuple(reads)
        return Route(rank=self.rank, host=self.host, spans_hosts=False, reads=reads, fills=self.fills, fenced=(),
                     sends=(), receives=(), buffer_bytes=0, buffer_readers=(), messages=())

    def route(self, src_offsets: Mapping[tuple[int, str], int], part: HostPlan,
              summaries: Mapping[str, HostTransfers] = None,
              sends: Mapping[str, Sequence[CrossTransfer]] = None) -> Route:
        """The rank's :class:`Route` from its host's ``part`` (:meth:`host_part`), the other hosts'
        ``summaries`` (``{host: HostTransfers}``) and ``sends`` (``{host: transfers into that host
        this rank sends}``, numbered within that host's part). On one host both are empty."""
        summaries = dict(summaries or {})
        summaries[self.host] = host_outbox(part, self.host)[0]
        sends = dict(sends or {})
        base, n = {}, 0
        missing = sorted(set(self.host_names) - set(summaries))
        assert not missing, f"rank {self.rank}: no transfer summary from host(s) {missing}"
        for h in self.host_names:   # the group's numbering: host after host
            base[h] = n
            n += summaries[h].count
        own = base.get(self.host, 0)
        mine = renumbered(part.transfers, own)
        for h, ts in sends.items():
            assert all(t.src_rank == self.rank and t.dst_host == h for t in ts), (self.rank, h)
            mine += renumbered(ts, base[h])
        mine.sort(key=lambda t: t.index)
        hp = part.joined(tuple(mine), part.buffer_bytes, own)   # ops stay lazy: only this rank's are made
        return _route(self, hp, src_offsets, n,
                      sorted({r for s in summaries.values() for r in (*s.senders, *s.receivers)}))


def _route(rp: RankPlan, hp: HostPlan, src_offsets, total: int, users) -> Route:
    rank, src = rp.rank, rp.plan.src_layouts
    reads = [Read(op, BufferRef("arena", op.src_rank), src_offsets[(op.src_rank, op.src_name)],
                  src[op.src_name].local_shape(op.src_rank), src[op.src_name].dtype)
             for op in hp.local_ops_for_dst(rank)]
    for f in hp.fanout_for_dst(rank):
        t = hp.transfer(f.transfer)
        reads.append(Read(f.op, BufferRef("relay", t.receiver), t.offset, t.shape, t.dtype))
    messages = plan_messages(hp, src_offsets, rank=rank) if hp.transfers else ()
    return Route(rank=rank, host=rp.host, spans_hosts=total > 0, reads=tuple(reads), fills=rp.fills,
                 fenced=hp.local_readers_of(rank), sends=hp.sends_of(rank), receives=hp.recvs_of(rank),
                 buffer_bytes=hp.buffer_bytes.get(rank, 0), buffer_readers=hp.buffer_readers(rank),
                 messages=messages, cross_host_ranks=tuple(users), host_plan=hp)


def plan_rank(src_layouts, dst_layouts, hosts: Mapping[int, str], rank: int, *, parts=None,
              quant=None) -> RankPlan:
    """Rank ``rank``'s :class:`RankPlan` from the group's inputs (as agreed by every rank: the
    trainers' ``src_layouts``, the inference ranks' ``dst_layouts``, ``parts`` and ``quant``, as
    :func:`~tritonreshard.planning.plan_quantized` takes them) and ``hosts`` (``{rank: host
    identity}`` of every rank of the group). Pure and deterministic: no callbacks, no exchange.

    On several hosts the rank's host part (:meth:`RankPlan.host_part`) is planned from the same
    inputs, for its host's destination ranks only. Raises ``ValueError`` / ``NotImplementedError``
    as the planner does, before anything moves."""
    several = len(set(hosts.values())) > 1
    if several:   # said at planning time, before any rank maps a buffer
        refuse_transposed(f"plan_rank(rank={rank})", parts, "a plan across hosts cannot carry (crossings, relays and "
                          "deltas cut source boxes in the source's order of dims; plan such a model on one host)")
    own = plan_quantized(src_layouts, dst_layouts, parts or None, quant or None, rank=rank)
    src_here = [n for n, lay in own.src_layouts.items() if rank in lay.ranks]
    dst_here = [n for n, lay in own.dst_layouts.items() if rank in lay.ranks]
    return RankPlan(rank=rank, host=hosts[rank], hosts=dict(hosts), several_hosts=several, plan=own,
                    src_order=tuple(tensor_order(own, src_here)), dst_order=tuple(tensor_order(own, dst_here)),
                    fills=own.fills_for_dst(rank), inputs=(src_layouts, dst_layouts, parts or None, quant or None))
