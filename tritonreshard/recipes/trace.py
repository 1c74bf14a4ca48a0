"""Recipes traced from a loader: the boxes each TP rank's loader wrote in, a recipe out.

Pure Python planning (no transformers or vLLM import): the engine side
(:func:`tritonreshard.vllm.trace_recipe`) runs each TP rank's own loader (vLLM's ``load_weights``)
on meta tensors under :class:`~tritonreshard.recipes.metatrace.LoadTracer`, and hands what each
rank's parameters were written with (:class:`~tritonreshard.recipes.boxes.Written`: pieces, boxes
with a source map) to :func:`spec_from_trace`, which compresses them into the planner's form (a
:class:`~tritonreshard.recipes.RecipeSpec`: layouts and :class:`~tritonreshard.Part` boxes) and
checks the result against them. :func:`layer_groups` lets a trace of one layer of each structure
stand for all of them (``verify=`` checks every layer at full size).

**Codes** (float64, every one exact), for the tests and tools that load real tensors
(:func:`tritonreshard.vllm.trace.vllm_load`): element ``i`` (row-major) of source number ``s`` is
``s * 2**33 + 2 * i + 1``: odd, positive, below ``2**53``, so every element says which source
element it is; :func:`decode` reads them back. ``0.0`` is a zero fill; :data:`POISON` (``-1.0``)
an element no source reached.
"""
from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import pairwise, product

import torch

from ..layout import Layout, Part, Replicate, Shard
from .boxes import (
    FILL,
    NOT_A_COPY,
    UNTOUCHED,
    Piece,
    Written,
    any_overlap,
    contiguous_strides,
    first_difference,
    merge_pieces,
    recipe_pieces,
    shifted,
)
from .builder import RecipeSpec, raise_problems, rank_list, tp_layout

__all__ = ["encode", "decode", "POISON", "FILL", "UNTOUCHED", "NOT_A_COPY", "spec_from_trace", "checkpoint_views",
           "part_sources", "layer_of", "layer_groups", "LayerGroups"]

_SHIFT = 1 << 33
#: What a traced parameter holds before its loader runs (no code is negative).
POISON = -1.0
# decode's ids for a zero, an element no source reached and a value that is no code are the boxes'
# (FILL, UNTOUCHED, NOT_A_COPY: one meaning in both).


def encode(index: int, shape: Sequence[int]) -> torch.Tensor:
    """Source number ``index``'s codes: float64 of ``shape``, element ``i`` is ``index * 2**33 + 2 i + 1``."""
    n = 1
    for s in shape:
        n *= int(s)
    return (torch.arange(n, dtype=torch.float64) * 2 + (index * _SHIFT + 1)).reshape(tuple(shape))


def decode(t: torch.Tensor, numels: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(source ids, flat indices)`` (int64, ``t``'s shape) of a traced tensor; ``numels[s]``:
    source ``s``'s element count. Ids: :data:`FILL` for zeros, :data:`UNTOUCHED` for
    :data:`POISON`, :data:`NOT_A_COPY` for a value that is no element of any source."""
    t = t.to(torch.float64)
    whole = t == torch.round(t)
    ti = torch.where(whole & (t > 0) & (t < 2.0 ** 53), t, torch.zeros_like(t)).to(torch.int64)
    ids, flat = ti // _SHIFT, (ti % _SHIFT) // 2
    limit = torch.tensor(list(numels) + [0], dtype=torch.int64)
    good = (ti % 2 == 1) & (ids < len(numels)) & (flat < limit[ids.clamp(max=len(numels))])
    ids = torch.where(good, ids, torch.full_like(ids, NOT_A_COPY))
    ids = torch.where(t == 0, torch.full_like(ids, FILL), ids)
    ids = torch.where(t == POISON, torch.full_like(ids, UNTOUCHED), ids)
    return ids, torch.where(good, flat, torch.zeros_like(flat))


# How a model type's checkpoint names its routed experts where transformers 5 renamed them in
# memory: (the MoE block's checkpoint name for the in-memory ``mlp``, (gate, up, down) names per
# expert). Any other type: the in-memory names, ``gate_proj`` / ``up_proj`` / ``down_proj``.
# (Checked against what ``save_pretrained`` writes, tests/test_trace.py.)
_CHECKPOINT_MOE = {"mixtral": ("block_sparse_moe", ("w1", "w3", "w2"))}
# Model types whose checkpoints hold the fused experts as transformers holds them in memory (fed as
# they are): gpt-oss's ``gate_up_proj`` is ``[E, H, 2I]`` (gate and up interleaved), ``down_proj``
# ``[E, I, H]``, neither the ``[E, 2I, H]`` / ``[E, H, I]`` split below assumes (what
# ``save_pretrained`` writes, tests/test_gpt_oss.py).
_CHECKPOINT_FUSED = {"gpt_oss"}


def checkpoint_views(name: str, tensor: torch.Tensor, model_type: str | None = None):
    """``(checkpoint name, view)`` pairs of one trainer tensor as vLLM's loaders read them: fused
    routed experts (transformers 5's ``experts.gate_up_proj`` ``[E, 2I, H]``, gate first, and
    ``experts.down_proj`` ``[E, H, I]``) one expert at a time as checkpoints store them
    (``experts.{e}.gate_proj.weight``, ...; Mixtral's ``block_sparse_moe.experts.{e}.w1.weight``,
    ``w3``, ``w2``, and its router ``block_sparse_moe.gate.weight``, by ``model_type``); anything
    else as it is (gpt-oss's fused experts too: its checkpoints keep them fused). Views: codes pass
    unchanged."""
    if model_type in _CHECKPOINT_FUSED:
        yield name, tensor
        return
    block, (gate, up, down) = _CHECKPOINT_MOE.get(model_type, ("mlp", ("gate_proj", "up_proj", "down_proj")))
    if block != "mlp" and (".mlp.gate." in name or ".mlp.experts." in name):
        name = name.replace(".mlp.", f".{block}.", 1)
    if name.endswith(".experts.gate_up_proj") and tensor.dim() == 3:
        pre, i = name[:-len("gate_up_proj")], tensor.shape[1] // 2
        for e in range(tensor.shape[0]):
            yield f"{pre}{e}.{gate}.weight", tensor[e, :i]
            yield f"{pre}{e}.{up}.weight", tensor[e, i:]
    elif name.endswith(".experts.down_proj") and tensor.dim() == 3:
        pre = name[:-len("down_proj")]
        for e in range(tensor.shape[0]):
            yield f"{pre}{e}.{down}.weight", tensor[e]
    else:
        yield name, tensor


def part_sources(spec, names) -> list[str]:
    """The source names the destinations ``names`` of ``spec`` read, in first-use order."""
    out: dict[str, None] = {}
    for name in names:
        for part in spec.parts.get(name) or (Part(name, [None] * spec.dst[name].ndim),):
            src = part.src if isinstance(part.src, tuple) else (part.src,)
            out.update((s, None) for s in src if s is not None)
    return list(out)


# ------------------------------------------------------------------------------------- the trace
def _to_part(p: Piece, dshape: Sequence[int], names: Sequence[str], shapes: Sequence[tuple]) -> Part | None:
    """A global piece as a :class:`Part` of the destination of shape ``dshape``: the source box it
    reads, in the source's order of dims (``src_dims`` where the loader transposed); None when the
    piece is no box of its source (a reshape, a stride)."""
    box = [None if (a, b) == (0, n) else (a, b) for (a, b), n in zip(p.box, dshape, strict=True)]
    if p.src == FILL:
        return Part(None, box)
    shape = shapes[p.src]
    if len(shape) != len(dshape):
        return None
    cst = contiguous_strides(shape)
    dims: list = [None] * len(shape)
    for k, ((a, b), c) in enumerate(zip(p.box, p.coef, strict=True)):
        if b - a > 1:
            j = next((j for j in range(len(shape)) if cst[j] == c and shape[j] > 1 and j not in dims), None)
            if j is None:
                return None
            dims[k] = j
    free = iter(j for j in range(len(shape)) if j not in dims)
    dims = [next(free) if j is None else j for j in dims]
    start = [(p.base // cst[j]) % shape[j] for j in range(len(shape))]
    if sum(a * c for a, c in zip(start, cst, strict=True)) != p.base or any(
            start[dims[k]] + b - a > shape[dims[k]] for k, (a, b) in enumerate(p.box)):
        return None
    return Part(names[p.src], box, tuple(start) if any(start) else None,
                None if dims == list(range(len(shape))) else tuple(dims))


def _runs(pieces: Sequence[Piece], d: int, n: int) -> list[int] | None:
    """The lengths along dim ``d`` (local size ``n``) of a rank's runs of one source: where every
    piece spans whole intervals of ``d`` that tile it; a trailing zero fill belongs to the run
    before it. None where the pieces do not cut ``d`` into intervals."""
    spans: dict[tuple, set] = {}
    for p in pieces:
        spans.setdefault(p.box[d], set()).add(p.src)
    order = sorted(spans)
    if not order or order[0][0] != 0 or order[-1][1] != n or any(x[1] != y[0] for x, y in pairwise(order)):
        return None
    runs: list = []
    for span in order:
        key = frozenset(spans[span])
        if runs and (runs[-1][0] == key or (key == {FILL} and span == order[-1])):
            runs[-1][1] += span[1] - span[0]
        else:
            runs.append([key, span[1] - span[0]])
    return [length for _, length in runs]


def _candidates(local: list, shapes_local: list, d: int) -> list:
    """Placements to try for a destination split on dim ``d``: blocks where every rank's runs of
    sources agree in number, then plain ``Shard(d)``, then vLLM's balanced split."""
    runs = [_runs(p, d, s[d]) for p, s in zip(local, shapes_local, strict=True)]
    out = []
    if all(r is not None for r in runs) and len({len(r) for r in runs}) == 1 and len(runs[0]) > 1:
        out.append(Shard(d, tuple(sum(r[j] for r in runs) for j in range(len(runs[0])))))
    return out + [Shard(d), Shard(d, balanced=True)]


def _globalize(layout: Layout, local: list) -> list[Piece] | None:
    """Every rank's pieces in the destination's global coordinates (placed by ``layout``, ranks
    ``0 .. tp-1``); None when they do not tile the global shape exactly once."""
    out = []
    for r, pieces in enumerate(local):
        segs = layout.segments(r)
        for p in pieces:
            for combo in product(*segs):
                box = tuple((off, off + b - a) for a, b, off in combo)
                q = p.clip(box)
                if q is not None:
                    out.append(shifted(q, [a - off for a, _, off in combo]))
    total = 1
    for n in layout.shape:
        total *= n
    if sum(p.numel for p in out) != total or any_overlap(out):
        return None
    return out


def _infer(local: list, shapes_local: list, dshape_names, shapes) -> tuple | None:
    """``(placement, global shape, parts)`` of one destination from its TP ranks' pieces."""
    names = dshape_names
    tp, ndim = len(local), len(shapes_local[0])
    if len(set(shapes_local)) == 1 and all(sorted(merge_pieces(p), key=_order)
                                           == sorted(merge_pieces(local[0]), key=_order) for p in local):
        parts = [_to_part(p, shapes_local[0], names, shapes) for p in sorted(merge_pieces(local[0]), key=_order)]
        return None if None in parts else (Replicate(), shapes_local[0], parts)
    # Every placement that fits, the one with the fewest parts kept (a row split of a column-split
    # tensor fits too, as one part per rank): as few as there are sources is the least there can be.
    best, least = None, len({p.src for per in local for p in per})
    differ = [d for d in range(ndim) if len({s[d] for s in shapes_local}) > 1]
    for d in differ + [d for d in range(ndim) if d not in differ]:
        shape = list(shapes_local[0])
        shape[d] = sum(s[d] for s in shapes_local)
        for placement in _candidates(local, shapes_local, d):
            layout = Layout(tuple(shape), list(range(tp)), [placement], torch.float64)
            if any(tuple(layout.local_shape(r)) != tuple(s) for r, s in enumerate(shapes_local)):
                continue
            pieces = _globalize(layout, local)
            if pieces is None:
                continue
            parts = [_to_part(p, shape, names, shapes) for p in sorted(merge_pieces(pieces), key=_order)]
            if None not in parts and (best is None or len(parts) < len(best[2])):
                best = placement, tuple(shape), parts
                if len(parts) <= least:
                    return best
    return best


def _order(p: Piece):
    return (p.box, p.src, p.base, p.coef)


def _problems(traced: Sequence[Mapping[str, Written]], names: Sequence[str]) -> tuple[list, list]:
    """Each rank's pieces (``[{name: [Piece]}]``) and the problems: names that differ across ranks,
    loaders the boxes cannot express, values that are no copy, elements no source reached, sources
    no parameter reads."""
    problems, pieces = [], []
    if len({frozenset(t) for t in traced}) > 1:
        problems.append(f"the TP ranks hold different parameters: {[sorted(t) for t in traced]}")
    undecided, bad, untouched, used = {}, {}, {}, set()
    for r, per in enumerate(traced):
        pieces.append({})
        for n, written in per.items():
            if written.undecided:
                undecided.setdefault(n, (r, written.undecided))
                continue
            got = written.pieces()
            pieces[r][n] = got
            used.update(p.src for p in got if p.src >= 0)
            if any(p.src == NOT_A_COPY for p in got):
                bad.setdefault(n, (r, sorted({names[p.src] for p in got if p.src >= 0})))
            elif sum(p.numel for p in got) != math.prod(written.shape):
                untouched.setdefault(n, r)
    for n, (r, why) in undecided.items():
        problems.append(f"{n}: what its loader does on TP rank {r} is no box copy the trace can follow ({why})")
    for n, (r, near) in bad.items():
        problems.append(f"{n}: its loader is not a copy on TP rank {r} (values that are no source element, "
                        f"e.g. combined or scaled; its copied elements come from {near})")
    if untouched:
        problems.append(f"vLLM parameters no source reached (in part or whole): {sorted(untouched)}")
    unused = [n for i, n in enumerate(names) if i not in used]
    if unused and not undecided:
        problems.append(f"sources vLLM's loader left out (their names do not match its parameters): {unused}")
    return problems, pieces


def spec_from_trace(model_type: str, sources: Mapping[str, Layout], traced: Sequence[Mapping[str, Written]],
                    *, tp: int, inference_ranks, dtypes: Mapping[str, torch.dtype],
                    expert_parallel: bool = False) -> RecipeSpec:
    """The recipe of a trace: ``sources`` (``{name: Layout}``: the trainers' layouts; source number
    ``i`` is the ``i``-th), ``traced[t]`` what TP rank ``t``'s loader wrote (``{vLLM parameter:
    Written}``, :class:`~tritonreshard.recipes.metatrace.LoadTracer`), ``dtypes`` the parameters'
    dtypes. A loader that transposes gives parts with ``src_dims`` (:class:`~tritonreshard.Part`).
    The recipe is checked against the trace before it is returned: every rank's plan writes exactly
    the pieces the loader wrote. Raises one ``ValueError`` naming every problem (a loader that is
    not a copy or that the boxes cannot follow, parameters no source reached, sources left out, a
    destination no placement of boxes fits)."""
    where_ = f"trace of {model_type!r}, tp={tp}"
    problems: list[str] = []
    dst_ranks = rank_list(inference_ranks, "inference_ranks", problems)
    if len(traced) != tp:
        problems.append(f"{len(traced)} traced ranks for tp={tp}")
    raise_problems(where_, problems)
    names = list(sources)
    shapes = [tuple(lay.shape) for lay in sources.values()]
    problems, pieces = _problems(traced, names)
    raise_problems(where_, problems)
    dst, parts = {}, {}
    for n in traced[0]:
        got = _infer([per[n] for per in pieces], [traced[t][n].shape for t in range(tp)], names, shapes)
        if got is None:
            problems.append(f"{n}: no split of one dim into source boxes reproduces every rank")
            continue
        placement, shape, plist = got
        dst[n] = tp_layout(shape, dst_ranks, tp, placement, dtypes[n])
        identity = len(plist) == 1 and plist[0].src == n and sources[n].shape == shape and \
            all(x is None for x in plist[0].dst) and plist[0].src_start is None and plist[0].src_dims is None
        if not identity:
            parts[n] = tuple(plist)
    raise_problems(where_, problems)
    spec = RecipeSpec(model_type, tp, expert_parallel, dict(sources), dst, parts)
    for t in range(tp):  # the recipe, as the refit plans it, against what the loader wrote
        want = recipe_pieces(spec, dst_ranks[t], order=names)
        problems += [f"{n}: the traced recipe writes other elements than the loader on TP rank {t} (at "
                     f"{list(diff[0])})" for n in dst if (diff := first_difference(pieces[t][n], want[n])) is not None]
    raise_problems(where_, problems)
    return spec


# ------------------------------------------------------------------------ one layer of each kind
_LAYER = re.compile(r"\.layers\.(\d+)\.")


def layer_of(name: str) -> int | None:
    """The decoder layer a parameter name is in (``...layers.{i}....``), or None."""
    m = _LAYER.search(name)
    return None if m is None else int(m.group(1))


def _renamed(name, a: int, b: int):
    """``name`` (a str, a tuple of aliases, or None) with layer ``a`` made layer ``b``."""
    if name is None or a == b:
        return name
    if isinstance(name, tuple):
        return tuple(_renamed(n, a, b) for n in name)
    return name.replace(f".layers.{a}.", f".layers.{b}.", 1)


@dataclass(frozen=True)
class LayerGroups:
    """The decoder layers grouped by structure: ``of[i]`` is the first layer whose vLLM parameters
    and HF sources have the same names (the layer index aside), shapes and dtypes as layer ``i``'s.
    A trace of those first layers (``traced``) is extended by name to the others (:meth:`extend`);
    ``verify=`` then checks every layer against the engine's loader at full size."""

    of: Mapping[int, int]

    @property
    def traced(self) -> set[int]:
        return set(self.of.values())

    def extend(self, spec: RecipeSpec, sources: Mapping[str, Layout], order: Sequence[str]) -> RecipeSpec:
        """``spec`` (the traced layers and everything outside the layers) extended to every
        parameter of ``order`` (vLLM's names, in its order) over all the ``sources``: each
        layer's destinations and parts are its structure's first layer's, renamed. One
        ``ValueError`` names a parameter or source the extension leaves without its counterpart."""
        dst, parts, problems = {}, {}, []
        for n in order:
            layer = layer_of(n)
            rep = layer if layer is None else self.of[layer]
            first = n if layer is None else _renamed(n, layer, rep)
            if first not in spec.dst:
                problems.append(f"{n}: its structure's first layer has no {first}")
                continue
            dst[n] = spec.dst[first]
            if first in spec.parts:
                parts[n] = tuple(Part(_renamed(p.src, rep, layer), p.dst, p.src_start, p.src_dims)
                                 for p in spec.parts[first])
        read = {s for n in dst
                for s in ((n,) if n not in parts else
                          [x for p in parts[n] for x in (p.src if isinstance(p.src, tuple) else (p.src,))])}
        problems += [f"{s}: read by the extended recipe, but no such source"
                     for s in sorted(read - set(sources) - {None})]
        unread = [s for s in sources if s not in read]
        if unread:
            problems.append(f"sources the extended recipe reads nowhere: {unread[:20]}")
        raise_problems(f"trace of {spec.model_type!r}, extended from layers {sorted(self.traced)}", problems)
        return RecipeSpec(spec.model_type, spec.tp, spec.expert_parallel, dict(sources), dst, parts)


def layer_groups(params: Mapping[str, Sequence[int]], sources: Mapping[str, Layout]) -> LayerGroups:
    """Group the decoder layers of a model whose vLLM parameters have the shapes ``params`` and
    whose HF sources are ``sources`` by structure (names less the index, shapes, source dtypes)."""
    sig: dict[int, list] = {}
    for n, shape in params.items():
        if (layer := layer_of(n)) is not None:
            sig.setdefault(layer, []).append(("dst", _renamed(n, layer, -1), tuple(shape)))
    for n, lay in sources.items():
        if (layer := layer_of(n)) is not None:
            sig.setdefault(layer, []).append(("src", _renamed(n, layer, -1), tuple(lay.shape), str(lay.dtype)))
    first: dict[tuple, int] = {}
    of = {}
    for layer in sorted(sig):
        key = tuple(sorted(sig[layer]))
        of[layer] = first.setdefault(key, layer)
    return LayerGroups(of)
