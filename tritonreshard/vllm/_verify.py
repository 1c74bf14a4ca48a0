"""Fail-closed: a recipe checked against vLLM's own ``load_weights``, once per engine: :func:`verify_model`.

vLLM's loader runs on meta tensors (:func:`trace_load`: the trainers' parameters by name and shape,
into meta scratch copies of its parameters; nothing allocated, nothing read, the served tensors
never written: a dispatch guard refuses it), every copy recorded as a box with its source map
(:class:`~tritonreshard.recipes.metatrace.LoadTracer`), and those boxes must equal, element for
element, the boxes the recipe's own plan writes on the rank
(:func:`~tritonreshard.recipes.boxes.recipe_pieces`, :func:`~tritonreshard.recipes.boxes.first_difference`).
Every parameter of every layer, at the model's real sizes, in seconds and megabytes whatever the
model's size: the cost is the number of boxes. A recipe that puts names and shapes right but
elements wrong (a swapped qkv split, a transposed shard, experts out of order: vllm#51520) is
refused before the rank joins the refit group, naming the first parameter that differs, where,
and the recipe; one the boxes cannot follow is refused with the reason (docs/vllm.md says what the
method can and cannot miss).

Also :func:`scratch_load`: vLLM's load of real tensors into float64 scratch copies (what vLLM
itself holds; tests compare refits with it). Imported inside vLLM processes only.
"""
from __future__ import annotations

import contextlib
from types import MethodType

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from vllm.model_executor.model_loader.reload import layerwise as _layerwise
from vllm.model_executor.model_loader.reload.sanitize import layer_ref_sentinel

from ..recipes.boxes import first_difference, recipe_pieces, where
from ..recipes.metatrace import LoadTracer
from ..recipes.trace import POISON, checkpoint_views, layer_of
from ._cost import Cost

__all__ = ["scratch_load", "trace_load", "verify_model"]



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


def _scratch(mod: torch.nn.Module, pname: str, live: torch.Tensor, meta: bool = False) -> torch.Tensor:
    """A copy of parameter ``pname`` in its load format (vLLM's restore metadata where vLLM
    post-processed it, else the live parameter's shape), its class and attributes (weight loaders
    bound to ``mod``): float64 on the CPU, every element :data:`POISON`, or (``meta``) on the meta
    device in the parameter's dtype, no element allocated."""
    restore = _layerwise.get_layerwise_info(mod).restore_metadata[0].get(pname)
    like = live if restore is None else restore
    t = torch.empty(tuple(like.shape), dtype=like.dtype, device="meta") if meta else \
        torch.full(tuple(like.shape), POISON, dtype=torch.float64)
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


@contextlib.contextmanager
def _scratch_params(model: torch.nn.Module, names, meta: bool):
    """The parameters ``names`` of ``model`` (and every alias of them) swapped for scratch copies
    (:func:`_scratch`) while the block runs: yields ``({name: scratch}, data pointers of every
    served tensor)``. The model's parameters are put back whatever happens."""
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
            scratch[key] = _scratch(mod, pname, live, meta)
        swapped.append((mod, pname, live))
        mod._parameters[pname] = scratch[key]
    ptrs = {t.untyped_storage().data_ptr() for t in list(model.parameters()) + list(model.buffers())
            if not t.is_meta and t.numel()} - {t.untyped_storage().data_ptr() for t in scratch.values() if not meta}
    try:
        yield scratch, ptrs
    finally:
        for mod, pname, live in swapped:
            mod._parameters[pname] = live


@torch.no_grad()
def scratch_load(model: torch.nn.Module, feed, names) -> dict[str, torch.Tensor]:
    """vLLM's own ``model.load_weights(feed)`` into float64 scratch copies of the parameters
    ``names``, never into the model's tensors: ``{name: float64 tensor}``, poisoned where the
    loader wrote nothing (what vLLM makes of real tensors: tests compare refits with it)."""
    with _scratch_params(model, names, meta=False) as (scratch, ptrs), _NoLiveWrites(ptrs):
        model.load_weights(feed)
    return {n: t.data for n, t in scratch.items()}


@torch.no_grad()
def trace_load(model: torch.nn.Module, sources: dict[str, torch.Tensor], names, model_type: str | None = None) -> dict:
    """vLLM's own ``model.load_weights`` of the meta tensors ``sources`` (``{HF name: meta
    tensor}``, source id = its place in the dict; fed as the checkpoint names them,
    :func:`~tritonreshard.recipes.trace.checkpoint_views`) into meta scratch copies of the
    parameters ``names``: ``{name: Written}`` (:class:`~tritonreshard.recipes.boxes.Written`: the
    boxes each holds, or why that is undecided). No element is allocated or read; a write into a
    served tensor raises."""
    feed = [pair for n, t in sources.items() for pair in checkpoint_views(n, t, model_type)]
    with _scratch_params(model, names, meta=True) as (scratch, ptrs):
        tracer = LoadTracer(dict(enumerate(sources.values())), scratch, ptrs)
        with tracer:
            model.load_weights(iter(feed))
    return tracer.written


def verify_model(model: torch.nn.Module, spec, *, rank: int, tp_rank: int, recipe: str | None = None) -> dict:
    """Check ``spec`` on global rank ``rank`` (TP rank ``tp_rank``) against vLLM's own
    ``load_weights``, every parameter of every layer: the loader runs on meta tensors
    (:func:`trace_load`) and the boxes it writes must equal, element for element, the boxes the
    recipe's own plan writes on this rank (:func:`~tritonreshard.recipes.boxes.recipe_pieces`).
    Quantized destinations (no copy) are left out. Raises ``ValueError`` naming the first
    parameter that differs, where, what each side puts there, and the recipe (``recipe``: how to
    name it); a parameter the trace cannot decide is refused the same way, with the reason.
    Returns the measured cost: ``{verify_ms, verify_cpu_ms, verify_peak_bytes, verify_held_bytes,
    verify_params, verify_elements, verify_layers, verify_pieces}`` (docs/vllm.md)."""
    recipe = recipe or f"trs.recipes.hf_to_vllm({spec.model_type!r})"
    names = [n for n in spec.dst if n not in (spec.quant or {})]
    srcs = list(spec.src)
    shapes = [tuple(lay.shape) for lay in spec.src.values()]
    with Cost() as cost:
        sources = {n: torch.empty(lay.shape, dtype=lay.dtype, device="meta") for n, lay in spec.src.items()}
        traced = trace_load(model, sources, names, spec.model_type)
        want = recipe_pieces(spec, rank, names)
        elements, pieces = 0, 0
        for name in names:
            written = traced[name]
            if written.undecided:
                raise ValueError(f"tritonreshard (TP rank {tp_rank}): verify failed, nothing was loaded: {name}: "
                                 f"what vLLM's own load_weights does to it cannot be checked as boxes "
                                 f"({written.undecided}), so the recipe {recipe} is refused, not trusted")
            local = tuple(spec.dst[name].local_shape(rank))
            if written.shape != local:
                raise ValueError(f"tritonreshard (TP rank {tp_rank}): verify failed, nothing was loaded: {name}: "
                                 f"vLLM's load format is {written.shape}, the recipe {recipe}'s {local}")
            got = written.pieces()
            pieces += len(got)
            diff = first_difference(got, want[name])
            if diff is not None:
                x, count, g, w = diff
                raise ValueError(f"tritonreshard (TP rank {tp_rank}): verify failed, nothing was loaded: the recipe "
                                 f"{recipe} differs from vLLM's own load_weights of the same tensors: {name} at "
                                 f"{list(x)} ({count} of {_numel(written.shape)} elements differ): vLLM's own "
                                 f"load_weights puts {where(g, x, srcs, shapes)} there, the recipe "
                                 f"{where(w, x, srcs, shapes)}")
            elements += _numel(written.shape)
        del sources, traced, want
    layers = sorted({layer for layer in map(layer_of, names) if layer is not None})
    return {**cost.stats("verify"), "verify_params": len(names), "verify_elements": elements,
            "verify_layers": layers, "verify_pieces": pieces}


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
