"""Block-quantized destinations: which destination tensors are written as FP8 blocks plus scales.

Pure Python. A :class:`BlockQuant` says how one destination weight is quantized: its block grid (per
logical partition of the quantized rows, ``block`` = ``(128, 128)``), where its scales go and which
scale rule applies. :func:`plan_quantized` plans the weights' ops exactly as :func:`plan_reshard`
plans a copy (the ops only say where each destination element's bf16 value comes from) and returns a
:class:`QuantizedPlan`: the same ops, with the quantization next to them. The scales have no ops: the
kernel that quantizes a block writes its scale in the same pass (``tritonreshard.kernels.quantize``).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from ..layout import Layout
from .checks import transposed
from .dtypes import CASTABLE_DTYPES
from .reshard import Plan, plan_reshard

__all__ = ["BlockQuant", "QuantizedPlan", "SCALE_RULES", "FP8_DTYPE", "plan_quantized", "quantized_inputs"]

#: ``"deepgemm"``: ``s = amax / 448``, ``q = x * (1 / s)`` (DeepGEMM's ``per_block_cast_to_fp8``, what
#: vLLM and SGLang ship); ``"nemo_rl"``: ``q = x * (448 / amax)``, ``s = 1 / (448 / amax)`` (NeMo-RL, verl;
#: exact semantics in ``tritonreshard.kernels.quantize``).
SCALE_RULES = ("deepgemm", "nemo_rl")
FP8_DTYPE = torch.float8_e4m3fn


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class BlockQuant:
    """How one destination weight is block-quantized.

    The weight's local shard is ``[*lead, N_loc, K_loc]`` (``lead``: e.g. the experts of a MoE
    weight). ``rows``: the sizes of its logical partitions along ``N_loc`` (q, k, v; gate, up), the
    same on every rank; each has its own grid of ``block = (bn, bk)`` blocks starting at its first
    row, the last block of a partition (and of ``K_loc``) possibly short. ``scale``: the name of the
    fp32 scale tensor, local shape :meth:`scale_shape` (``[*lead, sum ceil(rows_i / bn),
    ceil(K_loc / bk)]``), the dequantization multiplier (``w ~= q * s``). ``ue8m0``: scales rounded up
    to a power of two (DeepGEMM's UE8M0), still stored as fp32. ``scale_rule``: one of
    :data:`SCALE_RULES`.
    """

    scale: str
    rows: tuple[int, ...]
    block: tuple[int, int] = (128, 128)
    ue8m0: bool = False
    scale_rule: str = "deepgemm"

    def __post_init__(self):
        object.__setattr__(self, "rows", tuple(self.rows))
        object.__setattr__(self, "block", tuple(self.block))

    def problems(self) -> list[str]:
        out = []
        if len(self.block) != 2 or not all(isinstance(b, int) and b > 0 for b in self.block):
            out.append(f"block={self.block!r} must be two positive ints")
        if not self.rows or not all(isinstance(r, int) and r > 0 for r in self.rows):
            out.append(f"rows={self.rows!r} must be positive ints")
        if self.scale_rule not in SCALE_RULES:
            out.append(f"scale_rule={self.scale_rule!r} must be one of {SCALE_RULES}")
        if self.ue8m0 and self.scale_rule != "deepgemm":
            out.append(f"ue8m0=True is DeepGEMM's rule; it does not combine with scale_rule={self.scale_rule!r}")
        return out

    def row_blocks(self) -> tuple[tuple[int, int], ...]:
        """``(start, stop)`` of every block row in local rows, partition by partition, in scale-row order."""
        out, base = [], 0
        for n in self.rows:
            out += [(base + i, base + min(i + self.block[0], n)) for i in range(0, n, self.block[0])]
            base += n
        return tuple(out)

    def scale_shape(self, weight_shape) -> tuple[int, ...]:
        """The local scale shape of a weight of local shape ``weight_shape``."""
        *lead, _, k = weight_shape
        return (*lead, sum(_cdiv(n, self.block[0]) for n in self.rows), _cdiv(k, self.block[1]))


class QuantizedPlan(Plan):
    """A :class:`Plan` whose destinations include block-quantized weights: ``quant`` maps each such
    weight's name to its :class:`BlockQuant`. Its ops fill the weights' blocks (the executor reads
    each block whole and quantizes it); the scale tensors are in ``dst_layouts`` but no op writes
    them."""

    def __init__(self, plan: Plan, dst_layouts: Mapping[str, Layout], quant: Mapping[str, BlockQuant]):
        super().__init__(plan.src_layouts, dst_layouts, plan.ops, plan.fills, plan.parts, rank=plan.rank)
        self._quant = dict(quant)

    @property
    def quant(self) -> dict[str, BlockQuant]:
        return dict(self._quant)

    @property
    def scale_names(self) -> tuple[str, ...]:
        return tuple(sorted(q.scale for q in self._quant.values()))

    def summary(self) -> str:
        return super().summary() + f", {len(self._quant)} quantized to FP8 blocks"


def plan_quantized(src_layouts: Mapping[str, Layout], dst_layouts: Mapping[str, Layout], parts=None,
                   quant: Mapping[str, BlockQuant] | None = None, *, rank: int | None = None) -> Plan:
    """:func:`plan_reshard` with block-quantized destinations.

    ``quant``: ``{weight name: BlockQuant}``; each weight is a ``float8_e4m3fn`` destination built
    from float sources (float32 / bfloat16 / float16), its scale a float32 destination of the
    :meth:`BlockQuant.scale_shape` on every rank. Without ``quant`` this is ``plan_reshard``.
    ``rank``: that rank's part of the plan only, as in ``plan_reshard(..., rank=)``.

    Raises one ``ValueError`` naming every problem (and ``plan_reshard``'s own) before anything moves.
    """
    if not quant:
        return plan_reshard(src_layouts, dst_layouts, parts, rank=rank)
    planned = quantized_inputs(src_layouts, dst_layouts, parts, quant)
    plan = plan_reshard(src_layouts, planned, parts, rank=rank)
    padded = sorted({f.name for f in plan.fills if f.name in quant})
    if padded:
        raise ValueError(f"plan_quantized: {padded} have zero padding (fills); quantized weights must be "
                         f"built from sources only")
    return QuantizedPlan(plan, dst_layouts, quant)


def quantized_inputs(src_layouts: Mapping[str, Layout], dst_layouts: Mapping[str, Layout], parts,
                     quant: Mapping[str, BlockQuant]) -> dict[str, Layout]:
    """``quant`` checked against the layouts (one ``ValueError`` naming every problem), and the
    destination layouts the planner plans: each quantized weight as a float32 copy of its geometry
    (ops carry no dtype: they say where each value comes from), the scales left out (the quantizer
    writes them, no op does)."""
    problems: list[str] = []
    if not isinstance(quant, Mapping):
        raise ValueError(f"quant must be a mapping name -> BlockQuant, got {type(quant).__name__}")
    scales = {}
    for name, q in sorted(quant.items()):
        where = f"quant[{name!r}]"
        if not isinstance(q, BlockQuant):
            problems.append(f"{where} is a {type(q).__name__}, not a BlockQuant")
            continue
        problems += [f"{where}: {p}" for p in q.problems()]
        w, s = dst_layouts.get(name), dst_layouts.get(q.scale)
        if w is None:
            problems.append(f"{where}: no destination layout {name!r}")
        if s is None:
            problems.append(f"{where}: no destination layout for its scale {q.scale!r}")
        if q.scale in quant or q.scale in scales:
            problems.append(f"{where}: scale {q.scale!r} is also a weight or another weight's scale")
        scales[q.scale] = name
        if w is None or s is None or q.problems():
            continue
        if w.dtype != FP8_DTYPE:
            problems.append(f"dst_layouts[{name!r}].dtype={w.dtype}, a block-quantized weight is {FP8_DTYPE}")
        if s.dtype != torch.float32:
            problems.append(f"dst_layouts[{q.scale!r}].dtype={s.dtype}, scales are torch.float32")
        if len(w.shape) < 2:
            problems.append(f"dst_layouts[{name!r}] has shape {tuple(w.shape)}: block quantization needs >= 2 dims")
            continue
        if tuple(s.ranks) != tuple(w.ranks):
            problems.append(f"dst_layouts[{q.scale!r}] is on ranks {list(s.ranks)}, its weight on {list(w.ranks)}")
            continue
        for r in w.ranks:
            ws = tuple(w.local_shape(r))
            if sum(q.rows) != ws[-2]:
                problems.append(f"{where}: rows {q.rows} sum to {sum(q.rows)}, rank {r}'s {name!r} has "
                                f"{ws[-2]} rows {ws}")
                break
            if tuple(s.local_shape(r)) != q.scale_shape(ws):
                problems.append(f"dst_layouts[{q.scale!r}] on rank {r} is {tuple(s.local_shape(r))}, the block "
                                f"grid of {name!r} {ws} is {q.scale_shape(ws)}")
                break
        for p in (parts or {}).get(name, ()):
            for sname in getattr(p, "sources", ()):
                sl = src_layouts.get(sname)
                if sl is not None and sl.dtype not in CASTABLE_DTYPES:
                    problems.append(f"{where}: source {sname!r} is {sl.dtype}; quantized from {CASTABLE_DTYPES}")
        if name not in (parts or {}) and name in src_layouts and src_layouts[name].dtype not in CASTABLE_DTYPES:
            problems.append(f"{where}: source {name!r} is {src_layouts[name].dtype}; quantized from {CASTABLE_DTYPES}")
    flipped = [n for n in transposed(parts) if n in quant]
    if flipped:   # the quantizer reads whole 128x128 blocks in the source's order of dims
        problems.append(f"{flipped} are built from transposed parts (Part(src_dims=...)), which block "
                        f"quantization does not read; quantize them untransposed or leave them unquantized")
    if problems:
        raise ValueError("plan_quantized: " + "; ".join(problems))
    return {n: (Layout(lay.shape, lay.mesh, lay.placements, torch.float32) if n in quant else lay)
            for n, lay in dst_layouts.items() if n not in scales}

