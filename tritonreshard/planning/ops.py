"""What a plan is made of: :class:`TransferOp` (one box from one source rank to one destination
rank), :class:`FillOp` (zero padding), :class:`Plan` (the ops with the layouts they came from, its
byte accounting :class:`PlanStats` and its text) and :func:`merge_plans` (the union of per-rank
plans). No planning happens here: :mod:`.reshard` makes plans."""
from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from itertools import chain

from ..layout import Layout, Part
from ._gc import gc_paused
from .text import fmt_bytes, fmt_global, fmt_slices, render_table

__all__ = ["FillOp", "Plan", "PlanStats", "TransferOp", "merge_plans", "new_op"]


class _DstBox:
    """``shape`` / ``numel`` of an op's destination box (``dst_slices``), shared by both op kinds."""

    __slots__ = ()

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(s.stop - s.start for s in self.dst_slices)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True, eq=True, slots=True)
class TransferOp(_DstBox):
    """Copy ``src_rank``'s local ``src_name[src_slices]`` into ``dst_rank``'s local ``name[dst_slices]``.

    Slices are unit-step, one per tensor dim, of equal extent. ``global_index`` gives, per dim, the
    intervals of the *source's* global index the op covers (several when a packed-block op spans
    block boundaries). ``src_name`` is the source tensor's name; it equals ``name`` unless the plan
    was given ``parts=`` (q/k/v -> qkv and the like). Consumers look sources up by ``src_name``.

    ``src_dims``: None, or the permutation of a transposed part (``Part(src_dims=...)``): the op
    copies ``src_name[src_slices].permute(src_dims)`` (``src_slices`` and ``global_index`` are in the
    source's order of dims, ``dst_slices`` in the destination's; the element count is the same).
    """

    name: str
    src_rank: int
    dst_rank: int
    src_slices: tuple[slice, ...]
    dst_slices: tuple[slice, ...]
    global_index: tuple[tuple[tuple[int, int], ...], ...]
    src_name: str | None = None
    src_dims: tuple[int, ...] | None = None

    def __post_init__(self):
        if self.src_name is None:
            object.__setattr__(self, "src_name", self.name)

    def __hash__(self) -> int:  # slices are unhashable before Python 3.12
        return hash((self.name, self.src_name, self.src_rank, self.dst_rank,
                     tuple((s.start, s.stop) for s in self.src_slices),
                     tuple((s.start, s.stop) for s in self.dst_slices), self.src_dims))

    @property
    def is_local(self) -> bool:
        """True when the destination rank reads its own source shard (colocated meshes)."""
        return self.src_rank == self.dst_rank

    def __str__(self) -> str:
        frm = "" if self.src_name == self.name else f" from {self.src_name}"
        return (f"{self.name}: {self.src_rank}->{self.dst_rank}{frm} global{fmt_global(self.global_index)} "
                f"src{fmt_slices(self.src_slices)}{_permute(self)} -> dst{fmt_slices(self.dst_slices)} "
                f"({'x'.join(map(str, self.shape))})")


def _permute(op: TransferOp) -> str:
    """``.permute(...)`` of a transposed op, "" otherwise (what its source slices are read through)."""
    return "" if op.src_dims is None else f".permute({', '.join(map(str, op.src_dims))})"


@dataclass(frozen=True, eq=True, slots=True)
class FillOp(_DstBox):
    """Zero ``dst_rank``'s local ``name[dst_slices]`` (padding, e.g. vocab rows past the real vocab).

    ``global_index``: per dim, the destination's global intervals the fill covers. No op writes these
    elements, so a refit engine may zero them once when it allocates the destination.
    """

    name: str
    dst_rank: int
    dst_slices: tuple[slice, ...]
    global_index: tuple[tuple[tuple[int, int], ...], ...]

    def __hash__(self) -> int:
        return hash((self.name, self.dst_rank, tuple((s.start, s.stop) for s in self.dst_slices)))

    def __str__(self) -> str:
        return (f"{self.name}: zeros->{self.dst_rank} global{fmt_global(self.global_index)} "
                f"dst{fmt_slices(self.dst_slices)} ({'x'.join(map(str, self.shape))})")


@dataclass(frozen=True)
class PlanStats:
    """Byte accounting of a plan. Destination bytes use the destination dtype, source bytes the
    source dtype (they differ when the plan casts)."""

    num_ops: int
    total_bytes: int
    local_bytes: int
    remote_bytes: int
    pair_bytes: Mapping[tuple[int, int], int]   # (src_rank, dst_rank) -> destination bytes
    send_bytes: Mapping[int, int]               # src_rank -> source bytes it serves
    recv_bytes: Mapping[int, int]               # dst_rank -> destination bytes it writes
    fill_bytes: int = 0                          # destination bytes zero-filled (padding), not moved


class Plan:
    """An immutable reshard plan: ``ops`` (copies), ``fills`` (zero padding) plus the layouts and
    parts it was derived from.

    ``str(plan)`` is a readable table (ops, the byte matrix between ranks, per-rank totals).

    ``rank``: None for the whole plan; else this is rank ``rank``'s plan (``plan_reshard(...,
    rank=)``): its ``ops`` are exactly the whole plan's ops whose source or destination is ``rank``
    (in the same order), its ``fills`` those of ``rank``'s destinations, and ``stats`` count only them.
    """

    def __init__(self, src_layouts: Mapping[str, Layout], dst_layouts: Mapping[str, Layout],
                 ops: tuple[TransferOp, ...], fills: tuple[FillOp, ...] = (),
                 parts: Mapping[str, tuple[Part, ...]] | None = None, rank: int | None = None):
        self.rank = rank
        self._src = dict(src_layouts)
        self._dst = dict(dst_layouts)
        self._ops = ops
        self._fills = fills
        self._parts = dict(parts or {})

    @property
    def ops(self) -> tuple[TransferOp, ...]:
        return self._ops

    @property
    def fills(self) -> tuple[FillOp, ...]:
        """Regions of destination shards that no op writes and that must hold zeros (padding)."""
        return self._fills

    @property
    def parts(self) -> Mapping[str, tuple[Part, ...]]:
        """For each destination built from ``parts=``: its parts, boxes resolved to ints."""
        return dict(self._parts)

    @property
    def quant(self) -> dict:
        """Block-quantized destinations ``{name: BlockQuant}``: none here (a
        :class:`~tritonreshard.planning.QuantizedPlan` has some)."""
        return {}

    def fills_for_dst(self, rank: int) -> tuple[FillOp, ...]:
        """The zero fills of ``rank``'s destination shards."""
        return tuple(f for f in self._fills if f.dst_rank == rank)

    @property
    def src_layouts(self) -> Mapping[str, Layout]:
        return dict(self._src)

    @property
    def dst_layouts(self) -> Mapping[str, Layout]:
        return dict(self._dst)

    @property
    def names(self) -> tuple[str, ...]:
        """Names the plan moves (the destination names), in plan order."""
        return tuple(sorted(self._dst))

    @cached_property
    def src_ranks(self) -> tuple[int, ...]:
        return tuple(sorted({r for lay in self._src.values() for r in lay.ranks}))

    @cached_property
    def dst_ranks(self) -> tuple[int, ...]:
        return tuple(sorted({r for lay in self._dst.values() for r in lay.ranks}))

    @cached_property
    def _by_dst(self) -> dict[int, tuple[TransferOp, ...]]:
        groups: dict[int, list[TransferOp]] = defaultdict(list)
        for op in self._ops:
            groups[op.dst_rank].append(op)
        return {r: tuple(v) for r, v in groups.items()}

    @cached_property
    def _by_src(self) -> dict[int, tuple[TransferOp, ...]]:
        groups: dict[int, list[TransferOp]] = defaultdict(list)
        for op in self._ops:
            groups[op.src_rank].append(op)
        return {r: tuple(v) for r, v in groups.items()}

    def ops_for_dst(self, rank: int) -> tuple[TransferOp, ...]:
        """The ops that write ``rank``'s destination shards (what an inference rank executes)."""
        return self._by_dst.get(rank, ())

    def ops_for_src(self, rank: int) -> tuple[TransferOp, ...]:
        """The ops that read ``rank``'s source shards (who a trainer must wait for at its fence)."""
        return self._by_src.get(rank, ())

    def readers_of(self, src_rank: int) -> tuple[int, ...]:
        """Destination ranks that read ``src_rank``'s shards."""
        return tuple(sorted({op.dst_rank for op in self.ops_for_src(src_rank)}))

    def sources_of(self, dst_rank: int) -> tuple[int, ...]:
        """Source ranks that ``dst_rank`` reads from."""
        return tuple(sorted({op.src_rank for op in self.ops_for_dst(dst_rank)}))

    def __len__(self) -> int:
        return len(self._ops)

    def __iter__(self):
        return iter(self._ops)

    @cached_property
    def stats(self) -> PlanStats:
        pair: dict[tuple[int, int], int] = defaultdict(int)
        send: dict[int, int] = defaultdict(int)
        recv: dict[int, int] = defaultdict(int)
        local = 0
        isz = {}
        for op in self._ops:
            key = (op.src_name, op.name)
            if key not in isz:
                isz[key] = (self._src[op.src_name].itemsize, self._dst[op.name].itemsize)
            s_sz, d_sz = isz[key]
            b = op.numel * d_sz
            pair[(op.src_rank, op.dst_rank)] += b
            send[op.src_rank] += op.numel * s_sz
            recv[op.dst_rank] += b
            if op.is_local:
                local += b
        total = sum(recv.values())
        fill = sum(f.numel * self._dst[f.name].itemsize for f in self._fills)
        return PlanStats(len(self._ops), total, local, total - local, dict(pair), dict(send), dict(recv), fill)

    def summary(self) -> str:
        st = self.stats
        extra = ""
        if self._parts:
            extra += f", {len(self._parts)} built from parts"
        if self._fills:
            extra += f", {len(self._fills)} zero fills ({fmt_bytes(st.fill_bytes)})"
        whose = "" if self.rank is None else f" (rank {self.rank}'s part)"
        return (f"Plan{whose}: {len(self.names)} tensor(s), {st.num_ops} ops, {fmt_bytes(st.total_bytes)} to "
                f"{len(self.dst_ranks)} destination rank(s) from {len(self.src_ranks)} source rank(s) "
                f"({fmt_bytes(st.local_bytes)} local, {fmt_bytes(st.remote_bytes)} remote{extra})")

    def table(self, max_ops: int | None = 64) -> str:
        """The plan as text. ``max_ops`` caps the op rows (``None``: all)."""
        st = self.stats
        lines = [self.summary()]
        renamed = any(op.src_name != op.name for op in self._ops)
        # With parts, "global" is the source's index, so the source's name goes with it.
        headers = ("tensor", "src->dst", "source[global]" if renamed else "global", "src local", "dst local",
                   "shape", "bytes")

        def op_row(op: TransferOp) -> tuple[str, ...]:
            g = fmt_global(op.global_index)
            return (op.name, f"{op.src_rank}->{op.dst_rank}", op.src_name + g if renamed else g,
                    fmt_slices(op.src_slices) + _permute(op), fmt_slices(op.dst_slices),
                    "x".join(map(str, op.shape)) or "scalar", fmt_bytes(op.numel * self._dst[op.name].itemsize))

        def fill_row(f: FillOp) -> tuple[str, ...]:
            return (f.name, f"zeros->{f.dst_rank}", fmt_global(f.global_index), "-", fmt_slices(f.dst_slices),
                    "x".join(map(str, f.shape)), fmt_bytes(f.numel * self._dst[f.name].itemsize))

        rows = chain(map(op_row, self._ops), map(fill_row, self._fills))
        lines += render_table(headers, rows, max_rows=max_ops,
                              sections=(("ops", len(self._ops)), ("zero fills", len(self._fills))))
        if self._parts:
            lines.append("parts (destination box <- source):")
            for name in sorted(self._parts)[:16 if max_ops is not None else None]:
                lines.append(f"  {name}: " + "; ".join(map(str, self._parts[name])))
            if max_ops is not None and len(self._parts) > 16:
                lines.append(f"  ... {len(self._parts) - 16} more")
        srcs, dsts = self.src_ranks, self.dst_ranks
        if len(srcs) <= 16 and len(dsts) <= 16:
            lines.append("bytes (rows: source rank, columns: destination rank)")
            lines += render_table(["src\\dst"] + [str(d) for d in dsts],
                                  [[str(s)] + [fmt_bytes(st.pair_bytes[(s, d)]) if (s, d) in st.pair_bytes
                                               else "." for d in dsts] for s in srcs], right=True)
        lines.append("send: " + ", ".join(f"{r}: {fmt_bytes(b)}" for r, b in sorted(st.send_bytes.items())))
        lines.append("recv: " + ", ".join(f"{r}: {fmt_bytes(b)}" for r, b in sorted(st.recv_bytes.items())))
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()

    def __repr__(self) -> str:
        return f"<{self.summary()}>"


_obj_new = object.__new__
# The slots' own setters: an op is 96 bytes with slots (336 with a __dict__), and setting slots
# through their descriptors is the cheapest way to make a frozen dataclass (a big plan makes
# millions of ops).
_set_op = tuple(TransferOp.__dict__[f].__set__ for f in ("name", "src_rank", "dst_rank", "src_slices",
                                                         "dst_slices", "global_index", "src_name", "src_dims"))


def new_op(name, src_rank, dst_rank, src_slices, dst_slices, global_index, src_name, src_dims=None,
           _new=_obj_new, _cls=TransferOp, _s=_set_op) -> TransferOp:
    """``TransferOp(...)`` without the frozen dataclass's per-field ``object.__setattr__`` (a third
    of a big plan's time); the values are the planner's own, already checked."""
    op = _new(_cls)
    _s[0](op, name)
    _s[1](op, src_rank)
    _s[2](op, dst_rank)
    _s[3](op, src_slices)
    _s[4](op, dst_slices)
    _s[5](op, global_index)
    _s[6](op, src_name)
    _s[7](op, src_dims)
    return op


@gc_paused
def merge_plans(plans: Sequence[Plan]) -> Plan:
    """The union of per-rank plans of one group (``plan_reshard(..., rank=r)`` for several r) as
    one :class:`Plan`: every op and fill of any of them once, in the whole plan's order (by name,
    then destination rank, destination start, source rank). Its ops are then exactly the whole
    plan's ops whose source or destination is one of the ranks, without making the whole plan
    (the host planner's input for one host: :func:`~.hosts.plan_hosts` with ``host=``).
    ``rank`` of the result is None; its layouts and parts are the first plan's."""
    if not plans:
        raise ValueError("merge_plans: no plans to merge")
    ops: dict[tuple, TransferOp] = {}
    fills: dict[tuple, FillOp] = {}
    for p in plans:
        for op in p.ops:
            ops.setdefault((op.name, op.dst_rank, tuple([s.start for s in op.dst_slices]), op.src_rank), op)
        for f in p.fills:
            fills.setdefault((f.name, f.dst_rank, tuple([s.start for s in f.dst_slices])), f)
    first = plans[0]
    return Plan(first.src_layouts, first.dst_layouts, tuple(ops[k] for k in sorted(ops)),
                tuple(fills[k] for k in sorted(fills)), first.parts)
