"""Recipes traced from a loader: integer-coded tensors in, the boxes they landed in out.

Pure Python planning (no transformers or vLLM import): the engine side
(:func:`tritonreshard.vllm.trace_recipe`) feeds :func:`encode`'d full tensors through each TP
rank's own loader (vLLM's ``load_weights``) into parameters poisoned with :data:`POISON`, and hands
what each rank holds to :func:`spec_from_trace`, which compresses it into the planner's form (a
:class:`~tritonreshard.recipes.RecipeSpec`: layouts and :class:`~tritonreshard.Part` boxes).

**Codes** (float64, every one exact): element ``i`` (row-major) of source number ``s`` is
``s * 2**33 + 2 * i + 1``: odd, positive, below ``2**53``. A loader that only copies (narrow, cat,
index, ``copy_``) leaves codes; one that combines or transforms values (a sum, a scale, a cast to a
narrower dtype, a sign flip) leaves a value that is no code (even, fractional, negative, out of
range) and is refused by name. ``0.0`` is a zero fill (vLLM's vocab padding); :data:`POISON`
(``-1.0``) an element no source reached.

The vLLM side (:mod:`tritonreshard.vllm.trace`) also runs a recipe's own plan over the same codes
(``realize``: what the refit writes on a rank) and compares recipes by that effect
(``recipe_differences``); the engine's verification (``verify=``) compares it with vLLM's loader.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import lru_cache
from itertools import permutations

import torch

from ..layout import Layout, Part, Replicate, Shard
from .builder import RecipeSpec, raise_problems, rank_list, tp_layout

__all__ = ["encode", "decode", "POISON", "FILL", "UNTOUCHED", "NOT_A_COPY", "spec_from_trace", "checkpoint_views",
           "part_sources"]

_SHIFT = 1 << 33
#: What a traced parameter holds before its loader runs (no code is negative).
POISON = -1.0
#: The id :func:`decode` gives a zero-filled element.
FILL = -1
#: The id :func:`decode` gives an element no source reached.
UNTOUCHED = -2
#: The id :func:`decode` gives a value that is no code.
NOT_A_COPY = -3


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
@lru_cache(maxsize=256)
def _slice_base(shape: tuple[int, ...], dim: int) -> torch.Tensor:
    """Flat indices of ``src.select(dim, 0)`` of a source of ``shape``, flattened."""
    n = 1
    for s in shape:
        n *= s
    return torch.arange(n).reshape(shape).movedim(dim, 0)[0].reshape(-1)


def _row_keys(ids: torch.Tensor, flat: torch.Tensor, dim: int, shapes: Sequence[tuple]) -> list | None:
    """Each slice ``k`` along ``dim`` as ``(source id, source index of slice k - k)`` (``(FILL, 0)``
    for zeros), when it is exactly a whole slice of one source along the same dim; else None."""
    n = ids.shape[dim]
    i2, f2 = ids.movedim(dim, 0).reshape(n, -1), flat.movedim(dim, 0).reshape(n, -1)
    first = i2[:, 0]
    if not bool((i2 == first[:, None]).all()):
        return None
    keys: list = [None] * n
    for s in first.unique().tolist():
        rows = (first == s).nonzero().flatten()
        if s == FILL:
            for k in rows.tolist():
                keys[k] = (FILL, 0)
            continue
        if s < 0:
            return None
        shape = shapes[s]
        rest = tuple(x for j, x in enumerate(ids.shape) if j != dim)
        if len(shape) != ids.dim() or tuple(x for j, x in enumerate(shape) if j != dim) != rest:
            return None
        stride = 1
        for x in shape[dim + 1:]:
            stride *= x
        c = f2[rows, 0] // stride
        if not bool((f2[rows] == c[:, None] * stride + _slice_base(tuple(shape), dim)[None, :]).all()):
            return None
        for k, ck in zip(rows.tolist(), c.tolist()):
            keys[k] = (s, ck - k)
    return keys


def _runs(keys: list) -> list[tuple[int, int, tuple]]:
    """Maximal ``[start, stop)`` runs of equal keys: ``(start, stop, key)``."""
    out: list = []
    for k, key in enumerate(keys):
        if out and out[-1][2] == key:
            out[-1] = (out[-1][0], k + 1, key)
        else:
            out.append((k, k + 1, key))
    return out


def _parts(name: str, ids, flat, shapes, names: Sequence[str], dims: Sequence[int]) -> list[Part] | None:
    """The global tensor (decoded) as boxes of whole source slices along the first of ``dims`` that
    works: one :class:`Part` per run (zeros: ``Part(None, ...)``); None when no dim does."""
    for dim in dims:
        keys = _row_keys(ids, flat, dim, shapes)
        if keys is None:
            continue
        parts = []
        for start, stop, (s, off) in _runs(keys):
            box = [None] * ids.dim()
            if (start, stop) != (0, ids.shape[dim]):
                box[dim] = (start, stop)
            at = [0] * ids.dim()
            at[dim] = start + off
            parts.append(Part(None if s == FILL else names[s], box, tuple(at) if any(at) else None))
        return parts
    return None


def _candidates(local_keys: list, sizes: list[int], d: int) -> list:
    """Placements to try for a destination split on dim ``d``: blocks where every rank's runs of
    sources agree in number (a trailing zero fill belongs to the run before it), then plain
    ``Shard(d)``, then vLLM's balanced split."""
    out = []
    if all(k is not None for k in local_keys):
        runs = []
        for keys in local_keys:
            r = _runs(keys)
            if len(r) > 1 and r[-1][2][0] == FILL:
                r = r[:-2] + [(r[-2][0], r[-1][1], r[-2][2])]
            runs.append([b - a for a, b, _ in r])
        if len({len(r) for r in runs}) == 1 and len(runs[0]) > 1:
            out.append(Shard(d, tuple(sum(r[j] for r in runs) for j in range(len(runs[0])))))
    return out + [Shard(d), Shard(d, balanced=True)]


def _assemble(layout: Layout, local_ids: list, local_flat: list) -> tuple | None:
    """The global (ids, flat) of a destination from every rank's local, placed by ``layout``
    (ranks ``0 .. tp-1``); None when a rank's local shape differs or an element stays unplaced."""
    ids = torch.full(layout.shape, UNTOUCHED, dtype=torch.int64)
    flat = torch.zeros(layout.shape, dtype=torch.int64)
    for r, (li, lf) in enumerate(zip(local_ids, local_flat)):
        if tuple(layout.local_shape(r)) != tuple(li.shape):
            return None
        segs = layout.segments(r)
        boxes = [[]]
        for dim_segs in segs:
            boxes = [b + [s] for b in boxes for s in dim_segs]
        for box in boxes:
            g = tuple(slice(a, b) for a, b, _ in box)
            loc = tuple(slice(o, o + b - a) for a, b, o in box)
            ids[g], flat[g] = li[loc], lf[loc]
    return None if bool((ids == UNTOUCHED).any()) else (ids, flat)


def _infer(name: str, local_ids: list, local_flat: list, shapes, names) -> tuple | None:
    """``(placement, global shape, parts)`` of one destination from its TP ranks' decoded locals."""
    tp, ndim = len(local_ids), local_ids[0].dim()
    if all(torch.equal(local_ids[0], i) and torch.equal(local_flat[0], f) for i, f in zip(local_ids, local_flat)):
        parts = _parts(name, local_ids[0], local_flat[0], shapes, names, range(ndim))
        return None if parts is None else (Replicate(), tuple(local_ids[0].shape), parts)
    differ = [d for d in range(ndim) if len({i.shape[d] for i in local_ids}) > 1]
    for d in differ + [d for d in range(ndim) if d not in differ]:
        local_keys = [_row_keys(i, f, d, shapes) for i, f in zip(local_ids, local_flat)]
        sizes = [i.shape[d] for i in local_ids]
        for placement in _candidates(local_keys, sizes, d):
            shape = list(local_ids[0].shape)
            shape[d] = sum(sizes)
            layout = Layout(tuple(shape), list(range(tp)), [placement], torch.float64)
            got = _assemble(layout, local_ids, local_flat)
            if got is None:
                continue
            parts = _parts(name, *got, shapes, names, [d] + [x for x in range(ndim) if x != d])
            if parts is not None:
                return placement, tuple(shape), parts
    return None


def _transposed(local_ids: list, local_flat: list, shapes, names) -> tuple | None:
    """``(placement, global shape, parts)`` of a destination whose ranks each hold a box split of
    sources put in another order of dims (the loader transposed: a rank holds ``box.permute(order)``),
    in the destination's own dims, each part with ``src_dims=order``; None when no other order of
    dims fits either."""
    ndim = local_ids[0].dim()
    for perm in permutations(range(ndim)):
        if perm == tuple(range(ndim)):
            continue
        got = _infer("", [i.permute(perm) for i in local_ids], [f.permute(perm) for f in local_flat], shapes, names)
        if got is None:
            continue
        # Found in the source's order of dims (dim j of the permuted view is destination dim
        # perm[j]); destination dim k is dim order[k] of that view, so it runs along source dim order[k].
        order = tuple(sorted(range(ndim), key=perm.__getitem__))
        placement, shape, plist = got
        if isinstance(placement, Shard):
            placement = Shard(perm[placement.dim], placement.blocks, placement.balanced)
        parts = [Part(p.src, [p.dst[j] for j in order], p.src_start, None if p.src is None else order)
                 for p in plist]
        return placement, tuple(shape[j] for j in order), parts
    return None


def _problems(traced: Sequence[Mapping[str, torch.Tensor]], numels, names) -> tuple[list, list]:
    """Decode every rank's tensors; the problems (names differ across ranks, elements no source
    reached, values that are no copy) and ``[{name: (ids, flat)}]`` per rank."""
    problems, decoded = [], []
    if len({frozenset(t) for t in traced}) > 1:
        problems.append(f"the TP ranks hold different parameters: {[sorted(t) for t in traced]}")
    bad, untouched = {}, {}
    for r, tensors in enumerate(traced):
        decoded.append({})
        for n, t in tensors.items():
            ids, flat = decode(t, numels)
            decoded[r][n] = (ids, flat)
            if bool((ids == NOT_A_COPY).any()):
                bad.setdefault(n, r)
            elif bool((ids == UNTOUCHED).any()):
                untouched.setdefault(n, r)
    for n, r in bad.items():
        ids, _ = decoded[r][n]
        near = {names[s] for s in decoded[r][n][0].unique().tolist() if s >= 0}
        problems.append(f"{n}: its loader is not a copy on TP rank {r} (values that are no source element, "
                        f"e.g. combined or scaled; its copied elements come from {sorted(near)}); "
                        f"{int((ids == NOT_A_COPY).sum())} such elements")
    if untouched:
        problems.append(f"vLLM parameters no source reached (in part or whole): {sorted(untouched)}")
    used = {s for per in decoded for ids, _ in per.values() for s in ids.unique().tolist() if s >= 0}
    unused = [n for i, n in enumerate(names) if i not in used]
    if unused:
        problems.append(f"sources vLLM's loader left out (their names do not match its parameters): {unused}")
    return problems, decoded


def spec_from_trace(model_type: str, sources: Mapping[str, Layout], traced: Sequence[Mapping[str, torch.Tensor]],
                    *, tp: int, inference_ranks, dtypes: Mapping[str, torch.dtype],
                    expert_parallel: bool = False) -> RecipeSpec:
    """The recipe of a trace: ``sources`` (``{name: Layout}``: the trainers' layouts; source number
    ``i`` is the ``i``-th, as :func:`encode`'d), ``traced[t]`` what TP rank ``t`` holds (``{vLLM
    parameter: float64 tensor}``) after its loader read the codes, ``dtypes`` the parameters'
    dtypes. A loader that transposes gives parts with ``src_dims`` (:class:`~tritonreshard.Part`).
    Raises one ``ValueError`` naming every problem (a loader that is not a copy, parameters no
    source reached, sources left out, a destination no box form fits in any order of dims)."""
    where = f"trace of {model_type!r}, tp={tp}"
    problems: list[str] = []
    dst_ranks = rank_list(inference_ranks, "inference_ranks", problems)
    if len(traced) != tp:
        problems.append(f"{len(traced)} traced ranks for tp={tp}")
    raise_problems(where, problems)
    names = list(sources)
    shapes = [tuple(lay.shape) for lay in sources.values()]
    numels = [lay.numel for lay in sources.values()]
    problems, decoded = _problems(traced, numels, names)
    raise_problems(where, problems)
    dst, parts = {}, {}
    for n in traced[0]:
        local_ids, local_flat = [d[n][0] for d in decoded], [d[n][1] for d in decoded]
        # A box split as the loader holds it, else one of the source put in another order of dims
        # (vLLM's gpt-oss experts: box.permute(0, 2, 1)).
        got = _infer(n, local_ids, local_flat, shapes, names) or _transposed(local_ids, local_flat, shapes, names)
        if got is None:
            problems.append(f"{n}: no split of one dim into source boxes reproduces every rank")
            continue
        placement, shape, plist = got
        dst[n] = tp_layout(shape, dst_ranks, tp, placement, dtypes[n])
        identity = len(plist) == 1 and plist[0].src == n and sources[n].shape == shape and \
            all(x is None for x in plist[0].dst) and plist[0].src_start is None and plist[0].src_dims is None
        if not identity:
            parts[n] = tuple(plist)
    raise_problems(where, problems)
    return RecipeSpec(model_type, tp, expert_parallel, dict(sources), dst, parts)
