"""What a host plan is made of (:func:`.hosts.plan_hosts` makes them): :class:`CrossTransfer` (one box
crossing into a host), :class:`FanoutOp` (a read from a receive buffer), :class:`HostPlan` (a plan
split by host: its queries per rank and its text) and :func:`host_order`."""
from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import NamedTuple

import torch

from .boxes import box_of
from .ops import Plan, TransferOp
from .text import fmt_bytes, fmt_ranks, fmt_slices, render_table

__all__ = ["CrossTransfer", "FanoutOp", "HostPlan", "Traffic", "host_order", "new_fanout", "new_transfer"]


@dataclass(frozen=True, slots=True)
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


@dataclass(frozen=True, slots=True)
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


@dataclass(frozen=True)
class Traffic:
    """Bytes each rank moves in one refit, by direction and by link kind, as a host plan moves them
    (:meth:`HostPlan.traffic`, :func:`~.traffic.refit_traffic`). ``{rank: bytes}`` each: ``out_within`` / ``in_within``
    over the host's own links (reads of source arenas and relay buffers on the host), ``out_across`` / ``in_across``
    between hosts (each byte a host needs once). ``pieces``: ``{rank: pieces it reads or serves}`` (the
    plan's ops, before replicas cut some into parts). ``host_ingress``: ``{host: bytes}``."""

    out_within: Mapping[int, int]
    in_within: Mapping[int, int]
    out_across: Mapping[int, int]
    in_across: Mapping[int, int]
    pieces: Mapping[int, int]
    host_ingress: Mapping[str, int]


class _TransferIndex(NamedTuple):
    sends: dict[int, tuple[CrossTransfer, ...]]    # src_rank -> its transfers
    recvs: dict[int, tuple[CrossTransfer, ...]]    # receiver -> its transfers


class _OpIndex(NamedTuple):
    local: dict[int, tuple[TransferOp, ...]]       # dst_rank -> its local ops
    fanout: dict[int, tuple[FanoutOp, ...]]        # dst_rank -> its fan-out ops
    readers: dict[int, tuple[int, ...]]            # receiver -> the ranks reading its buffer


class HostPlan:
    """A :class:`~tritonreshard.planning.Plan` split by host: local ops, cross-host transfers, receive
    buffers and fan-out ops (see the module docstring). ``str(host_plan)`` is a readable table."""

    def __init__(self, plan: Plan, hosts: Mapping[int, str], local_ops: tuple[TransferOp, ...],
                 transfers: tuple[CrossTransfer, ...], fanout: tuple[FanoutOp, ...],
                 buffer_bytes: Mapping[int, int]):
        self.plan = plan
        self._hosts = dict(hosts)
        self._local_ops = local_ops
        self.transfers = transfers
        self._fanout = fanout
        self._buffer_bytes = dict(buffer_bytes)

    @property
    def local_ops(self) -> tuple[TransferOp, ...]:
        """Ops within a host (unchanged or re-sourced to a replica there), in plan order."""
        return self._local_ops

    @property
    def fanout(self) -> tuple[FanoutOp, ...]:
        """Reads from receive buffers, in plan order."""
        return self._fanout

    @property
    def src_layouts(self) -> Mapping[str, object]:
        """The source layouts the transfers' boxes index (the plan's)."""
        return self.plan.src_layouts

    def traffic(self) -> Traffic:
        """The bytes this host plan moves per rank: ``in_within``: what a destination rank writes
        (destination dtype); ``out_within``: what a rank serves on its host (source bytes read from
        its arena by local ops, from its receive buffer by fan-out ops); ``out_across`` /
        ``in_across``: the transfers it sends / receives; ``pieces``: the ops it runs or serves and
        the transfers it sends; ``host_ingress``: bytes into each host that receives any."""
        ow, iw, oa, ia, pc = (defaultdict(int) for _ in range(5))
        ingress: dict[str, int] = defaultdict(int)
        src, dst = self.src_layouts, self.plan.dst_layouts
        for op, server in [(op, op.src_rank) for op in self.local_ops] + [(f.op, f.op.src_rank) for f in self.fanout]:
            n = op.numel
            iw[op.dst_rank] += n * dst[op.name].itemsize
            ow[server] += n * src[op.src_name].itemsize
            pc[op.dst_rank] += 1
            pc[server] += 1
        return tally_transfers(self.transfers, ow, iw, oa, ia, pc, ingress)

    def joined(self, transfers: tuple[CrossTransfer, ...], buffer_bytes: Mapping[int, int], shift: int) -> HostPlan:
        """This host plan with the group's ``transfers`` and receive buffers instead of its own, its
        fan-out's transfer numbers moved on by ``shift`` (:func:`~.wire.join_host_parts`)."""
        fanout = tuple(FanoutOp(f.transfer + shift, f.op) for f in self.fanout)
        return HostPlan(self.plan, self._hosts, self.local_ops, transfers, fanout, buffer_bytes)

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
    def _transfer_index(self) -> _TransferIndex:
        sends, recvs = defaultdict(list), defaultdict(list)
        for t in self.transfers:
            sends[t.src_rank].append(t)
            recvs[t.receiver].append(t)
        return _TransferIndex({k: tuple(v) for k, v in sends.items()}, {k: tuple(v) for k, v in recvs.items()})

    @cached_property
    def _op_index(self) -> _OpIndex:
        local, fan = defaultdict(list), defaultdict(list)
        readers: dict[int, set[int]] = defaultdict(set)
        for op in self.local_ops:
            local[op.dst_rank].append(op)
        for f in self.fanout:
            fan[f.op.dst_rank].append(f)
            readers[f.op.src_rank].add(f.op.dst_rank)
        return _OpIndex({k: tuple(v) for k, v in local.items()}, {k: tuple(v) for k, v in fan.items()},
                        {k: tuple(sorted(v)) for k, v in readers.items()})

    def sends_of(self, rank: int) -> tuple[CrossTransfer, ...]:
        """Transfers ``rank`` sends (a source rank), in receive-buffer order per receiver."""
        return self._transfer_index.sends.get(rank, ())

    def recvs_of(self, rank: int) -> tuple[CrossTransfer, ...]:
        """Transfers ``rank`` receives into its buffer, in buffer order."""
        return self._transfer_index.recvs.get(rank, ())

    def local_ops_for_dst(self, rank: int) -> tuple[TransferOp, ...]:
        """Ops ``rank`` runs from a source arena on its own host (unchanged or re-sourced)."""
        return self._op_index.local.get(rank, ())

    def fanout_for_dst(self, rank: int) -> tuple[FanoutOp, ...]:
        """Ops ``rank`` runs from receivers' buffers on its own host."""
        return self._op_index.fanout.get(rank, ())

    def buffer_readers(self, receiver: int) -> tuple[int, ...]:
        """Destination ranks that read ``receiver``'s buffer (the receiver itself included if it
        reads its own)."""
        return self._op_index.readers.get(receiver, ())

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


def host_order(hosts: Mapping[int, str]) -> tuple[str, ...]:
    """The distinct hosts of ``{rank: host}`` in order of their lowest rank: the order of the host
    plan's parts (each host's transfers are numbered after those of the hosts before it)."""
    seen: dict[str, None] = {}
    for r in sorted(hosts):
        seen.setdefault(hosts[r], None)
    return tuple(seen)


_obj_new = object.__new__
_CT_FIELDS = ("index", "name", "src_rank", "receiver", "src_host", "dst_host", "box", "dtype", "offset", "nbytes",
              "contiguous")
_set_ct = tuple(CrossTransfer.__dict__[f].__set__ for f in _CT_FIELDS)
_set_fan = (FanoutOp.__dict__["transfer"].__set__, FanoutOp.__dict__["op"].__set__)


def new_transfer(*values) -> CrossTransfer:
    """``CrossTransfer(...)`` (positional, in field order) without the frozen dataclass's per-field
    ``object.__setattr__`` (the host planner's values, already checked; a host part makes tens of
    thousands)."""
    t = _obj_new(CrossTransfer)
    for s, v in zip(_set_ct, values, strict=True):
        s(t, v)
    return t


def tally_transfers(transfers, ow, iw, oa, ia, pc, ingress) -> Traffic:
    """:class:`Traffic` from the counts within hosts (``ow``, ``iw``, op counts ``pc``) and
    ``transfers``, which add each sender's and receiver's bytes across hosts and each host's
    ingress (both host planners' ``traffic()``)."""
    for t in transfers:
        oa[t.src_rank] += t.nbytes
        ia[t.receiver] += t.nbytes
        pc[t.src_rank] += 1
        ingress[t.dst_host] += t.nbytes
    return Traffic(*(dict(sorted(x.items())) for x in (ow, iw, oa, ia, pc)), dict(sorted(ingress.items())))


def renumbered(transfers, by: int) -> list[CrossTransfer]:
    """``transfers`` with their indices moved on by ``by`` (made like :func:`new_transfer`: joining
    a host's part into the group's numbering renumbers tens of thousands)."""
    return [new_transfer(t.index + by, t.name, t.src_rank, t.receiver, t.src_host, t.dst_host, t.box, t.dtype,
                         t.offset, t.nbytes, t.contiguous) for t in transfers]


def new_fanout(transfer: int, op: TransferOp, _new=_obj_new, _cls=FanoutOp, _s=_set_fan) -> FanoutOp:
    """``FanoutOp(transfer, op)``, made like :func:`new_transfer`."""
    f = _new(_cls)
    _s[0](f, transfer)
    _s[1](f, op)
    return f
