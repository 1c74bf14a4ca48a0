"""Fail-closed: a recipe checked against vLLM's own ``load_weights``, once per engine: :func:`verify_model`.

vLLM's loader and the refit's recipe are fed the same full tensors, integer codes
(:func:`tritonreshard.recipes.trace.encode`: every element says which source element it is), and
every parameter they produce must be equal: vLLM's into scratch copies of its parameters
(:func:`scratch_load`; the served tensors are never written, a dispatch guard refuses it), the
recipe's by its own plan (:func:`~tritonreshard.recipes.trace.realize`). A recipe that puts
names and shapes right but elements wrong (a swapped qkv split, a transposed shard, experts out of
order: vllm#51520) is refused before the rank joins the refit group, naming the first parameter
that differs, where, and the recipe. Checked one unit (a decoder layer, or one top-level
parameter) at a time on the CPU, so the memory is one unit's, never the model's.

Also :func:`scratch_load` for the trace (:mod:`tritonreshard.vllm.trace`). Imported inside vLLM
processes only.
"""
from __future__ import annotations

import math
import re
import time
from types import MethodType

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from vllm.model_executor.model_loader.reload import layerwise as _layerwise
from vllm.model_executor.model_loader.reload.sanitize import layer_ref_sentinel

from ..execute import execute_local
from ..recipes import RecipeSpec
from ..recipes.trace import POISON, checkpoint_views, decode, encode, part_sources

__all__ = ["scratch_load", "verify_model", "verify_units", "realize"]

_LAYER = re.compile(r"\.layers\.(\d+)\.")


class _NoLiveWrites(TorchDispatchMode):
    """Refuses every in-place write into the live model's storages (``ptrs``) while vLLM's loader
    fills the scratch copies: whatever a loader does, the served weights stay as they are."""

    def __init__(self, ptrs: set[int]):
        super().__init__()
        self.ptrs = ptrs

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for i, arg in enumerate(func._schema.arguments):
            if arg.alias_info is not None and arg.alias_info.is_write:
                t = args[i] if i < len(args) else kwargs.get(arg.name)
                if isinstance(t, torch.Tensor) and not t.is_meta and t.untyped_storage().data_ptr() in self.ptrs:
                    raise RuntimeError(f"tritonreshard verify: vLLM's loader wrote into a served tensor ({func})")
        return func(*args, **kwargs)


def _scratch(mod: torch.nn.Module, pname: str, live: torch.Tensor) -> torch.Tensor:
    """A float64 CPU copy of parameter ``pname`` in its load format (vLLM's restore metadata where
    vLLM post-processed it, else the live parameter's shape), its class and attributes (weight
    loaders bound to ``mod``), every element :data:`POISON`."""
    meta = _layerwise.get_layerwise_info(mod).restore_metadata[0].get(pname)
    like = live if meta is None else meta
    t = torch.full(tuple(like.shape), POISON, dtype=torch.float64)
    attrs = dict(like.__dict__)
    # After a layerwise reload (every refit on CPU) the loaders are vLLM's buffering wrappers, which
    # load nothing outside a reload: the loader they wrap is the one to run.
    for key in ("weight_loader", "_weight_loader"):  # (vLLM's BasevLLMParameter keeps it in the latter)
        while getattr(attrs.get(key), "__name__", None) == "online_process_loader":
            attrs[key] = attrs[key].__wrapped__
    for key, value in attrs.items():  # the metadata's loaders are unbound from the layer: bind them again
        if isinstance(value, MethodType) and value.__self__ is layer_ref_sentinel:
            attrs[key] = value.__func__.__get__(mod)
    t.__class__, t.__dict__ = like.__class__, attrs
    return t


@torch.no_grad()
def scratch_load(model: torch.nn.Module, feed, names) -> dict[str, torch.Tensor]:
    """vLLM's own ``model.load_weights(feed)`` into scratch copies of the parameters ``names``
    (and every alias of them), never into the model's tensors: ``{name: float64 tensor}``, poisoned
    where the loader wrote nothing. The model's parameters are put back whatever happens."""
    everything = dict(model.named_parameters(remove_duplicate=False))
    modules = dict(model.named_modules(remove_duplicate=False))
    chosen = {id(everything[n]): n for n in names}
    scratch, swapped = {}, []
    for full, live in everything.items():
        if id(live) not in chosen:
            continue
        mname, pname = full.rsplit(".", 1) if "." in full else ("", full)
        mod = modules[mname]
        key = chosen[id(live)]
        if key not in scratch:
            scratch[key] = _scratch(mod, pname, live)
        swapped.append((mod, pname, live))
        mod._parameters[pname] = scratch[key]
    ptrs = {t.untyped_storage().data_ptr() for t in list(model.parameters()) + list(model.buffers())
            if not t.is_meta and t.numel()} - {t.untyped_storage().data_ptr() for t in scratch.values()}
    try:
        with _NoLiveWrites(ptrs):
            model.load_weights(feed)
    finally:
        for mod, pname, live in swapped:
            mod._parameters[pname] = live
    return {n: t.data for n, t in scratch.items()}


def realize(spec, codes, rank: int | None = None, names=None) -> dict[int, dict[str, torch.Tensor]]:
    """What ``spec``'s own plan writes (``execute_local``, the refit's ops) over the float64
    ``codes`` (``{source name: full tensor}``): ``{destination rank: {name: local tensor}}``, for
    ``rank`` alone when given, for the destinations ``names`` (default: all but the quantized ones:
    quantizing is no copy)."""
    names = [n for n in (spec.dst if names is None else names) if n not in (spec.quant or {})]
    f64 = torch.float64
    srcs = part_sources(spec, names)
    sub = RecipeSpec(spec.model_type, spec.tp, spec.expert_parallel, {n: spec.src[n].with_dtype(f64) for n in srcs},
                     {n: spec.dst[n].with_dtype(f64) for n in names}, {n: spec.parts[n] for n in names if n in spec.parts})
    shards = {r: {n: lay.shard(codes[n], r) for n, lay in sub.src.items() if r in lay.ranks}
              for r in {r for lay in sub.src.values() for r in lay.ranks}}
    every = sorted({r for lay in sub.dst.values() for r in lay.ranks})

    def buf(r, lay):  # execute_local takes every rank's outputs; the rank's plan writes its own only
        return torch.full(lay.local_shape(r), POISON, dtype=f64) if rank in (None, r) else \
            torch.empty(lay.local_shape(r), dtype=f64)

    out = {r: {n: buf(r, lay) for n, lay in sub.dst.items()} for r in every}
    got = execute_local(sub.plan(rank), shards, out=out, backend="torch")
    return got if rank is None else {rank: got[rank]}


def verify_units(spec, sample: bool | str = True) -> list[list[str]]:
    """The destinations to check, one unit (list of names) at a time: every decoder layer
    (``sample="all"``) or a sample (``True``): the first layer of each distinct structure (its
    parameter names and shapes: dense and MoE layers both), the last layer, and every parameter
    outside the layers (embeddings, final norm, LM head), each its own unit. Quantized
    destinations (not copies) are left out."""
    layers: dict[int, list[str]] = {}
    top = []
    for name in spec.dst:
        if name in (spec.quant or {}):
            continue
        m = _LAYER.search(name)
        (layers.setdefault(int(m.group(1)), []) if m else top).append(name)
    if sample == "all":
        keep = sorted(layers)
    else:
        seen, keep = set(), []
        for i in sorted(layers):
            sig = tuple(sorted((_LAYER.sub(".layers.#.", n), spec.dst[n].shape) for n in layers[i]))
            if sig not in seen:
                seen.add(sig)
                keep.append(i)
        if layers and max(layers) not in keep:
            keep.append(max(layers))
    return [layers[i] for i in keep] + [[n] for n in top]


def _where(t_ids, t_flat, index, names, shapes) -> str:
    s, f = int(t_ids[index]), int(t_flat[index])
    if s < 0:
        return {-1: "zero", -2: "nothing (no source reached it)", -3: "a value that is no source element"}[s]
    coords, rem = [], f
    for size in reversed(shapes[s]):
        coords.append(rem % size)
        rem //= size
    return f"{names[s]}[{', '.join(map(str, reversed(coords)))}]"


def _first_difference(name: str, got: torch.Tensor, want: torch.Tensor, names, shapes) -> str | None:
    if tuple(got.shape) != tuple(want.shape):
        return f"{name}: vLLM's load format is {tuple(got.shape)}, the recipe's {tuple(want.shape)}"
    diff = (got != want).nonzero()
    if not len(diff):
        return None
    index = tuple(diff[0].tolist())
    numels = [math.prod(s) for s in shapes]
    gi, gf = decode(got, numels)
    wi, wf = decode(want, numels)
    return (f"{name} at {list(index)} ({len(diff)} of {got.numel()} elements differ): vLLM's own load_weights "
            f"puts {_where(gi, gf, index, names, shapes)} there, the recipe {_where(wi, wf, index, names, shapes)}")


def verify_model(model: torch.nn.Module, spec, *, rank: int, tp_rank: int, sample: bool | str = True,
                 recipe: str | None = None) -> dict:
    """Check ``spec`` on global rank ``rank`` (TP rank ``tp_rank``) against vLLM's ``load_weights``
    of the same full tensors (codes), unit by unit (:func:`verify_units`). Raises ``ValueError``
    naming the first parameter that differs and the recipe (``recipe``: how to name it). Returns
    ``{"verify_ms", "verify_params", "verify_layers", "verify_peak_bytes"}`` (peak: the largest
    unit's codes, every rank's recipe result and this rank's scratch, all float64)."""
    t0 = time.perf_counter()
    names = list(spec.src)
    index = {n: i for i, n in enumerate(names)}
    shapes = [tuple(lay.shape) for lay in spec.src.values()]
    recipe = recipe or f"trs.recipes.hf_to_vllm({spec.model_type!r})"
    checked, peak, layers = 0, 0, []
    for unit in verify_units(spec, sample):
        codes = {n: encode(index[n], spec.src[n].shape) for n in part_sources(spec, unit)}
        want = realize(spec, codes, rank=rank, names=unit)[rank]
        feed = [pair for n, t in codes.items() for pair in checkpoint_views(n, t, spec.model_type)]
        got = scratch_load(model, feed, unit)
        # float64: the codes, every rank's recipe outputs (execute_local's), vLLM's scratch
        peak = max(peak, 8 * (sum(t.numel() for t in codes.values())
                              + sum(spec.dst[n].numel for n in unit) + sum(t.numel() for t in got.values())))
        for name in unit:
            problem = _first_difference(name, got[name], want[name], names, shapes)
            if problem is not None:
                raise ValueError(f"tritonreshard (TP rank {tp_rank}): verify failed, nothing was loaded: the recipe "
                                 f"{recipe} differs from vLLM's own load_weights of the same tensors: {problem}")
        checked += len(unit)
        m = _LAYER.search(unit[0])
        if m:
            layers.append(int(m.group(1)))
    return {"verify_ms": (time.perf_counter() - t0) * 1e3, "verify_params": checked, "verify_layers": layers,
            "verify_peak_bytes": peak}
