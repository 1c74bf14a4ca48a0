"""verl's actor side, the export: each actor rank's own shards from ``engine.get_per_tensor_param_shard()``
as a refit source (:func:`export_source`), with no full tensor built. FSDP2 shards (DTensor
placements over the trainer ranks) become :class:`~tritonreshard.Layout` s, bound to the arena where
the engine's parameters can be the arena itself; Megatron engines map onto the Megatron recipe.
The backend that publishes it is :mod:`.actor`.

**Dtype.** The source is in the parameters' own dtype (:func:`source_dtype`, which the actors
announce in verl's topology as the init info's ``src_dtype``), and the vLLM workers' copy casts
once, to the dtype vLLM serves, as every other tritonreshard trainer does. verl's exports cast each
floating shard to bf16 (:data:`EXPORT_DTYPE`) on the way out, so for an FSDP2 engine the shards are
read from the module itself under the export's names (:func:`own_shards`); a shard that verl
narrowed and that can't be read there is refused by name, never sent as a bf16 copy of fp32
weights.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from ... import Layout, Replicate
from ...engine.fsdp import FSDP2Source, is_fsdp2
from ...recipes import Megatron, megatron_tensors, megatron_to_vllm
from ...serving import SRC_DTYPES, src_dtype_name

__all__ = ["ShardSource", "export_source", "export_shards", "own_shards", "source_dtype", "EXPORT_DTYPE"]

#: What verl 0.9.1's shard exports cast every floating shard to ("the wire speaks bf16").
EXPORT_DTYPE = torch.bfloat16


@dataclass(frozen=True)
class ShardSource:
    """One actor rank's export as a refit source: ``layouts`` ``{name: Layout}`` over the trainer
    ranks, ``tensors`` ``{name: local shard}`` (views of what the export yielded, shaped
    ``layouts[name].local_shape(rank)``), ``exported`` ``{name in the export: name here}``, and how
    the shards can be the arena itself: ``fsdp2`` (a ``tritonreshard.engine.fsdp.FSDP2Source`` of
    the engine's module) or ``megatron`` (the ``trs.recipes.Megatron`` to ``megatron_bind`` with),
    both None when every sync must copy. ``own``: the export names whose shard is read from the
    module itself (:func:`own_shards`) rather than taken from verl's export."""

    layouts: dict
    tensors: dict
    exported: dict
    fsdp2: Any = None
    megatron: Any = None
    own: frozenset = frozenset()


# -------------------------------------------------------------------------------- the dtype
def _modules(engine) -> list[torch.nn.Module]:
    """The engine's model: one module (FSDP engines) or its chunks (Megatron)."""
    module = getattr(engine, "module", None)
    return [m for m in (module if isinstance(module, (list, tuple)) else [module]) if isinstance(m, torch.nn.Module)]


def source_dtype(engine) -> torch.dtype:
    """The dtype an actor rank sends: its floating parameters' own, one of
    :data:`~tritonreshard.serving.SRC_DTYPES` (vLLM's init info carries one ``src_dtype`` for every
    tensor). One ``ValueError`` names each dtype found, with parameters of it, when there are
    several, or when it is not one of those."""
    by_dtype: dict[torch.dtype, list[str]] = {}
    for module in _modules(engine):
        for name, p in module.named_parameters():
            if p.is_floating_point():
                by_dtype.setdefault(p.dtype, []).append(name)
    if len(by_dtype) == 1 and src_dtype_name(next(iter(by_dtype))) is not None:
        return next(iter(by_dtype))
    if not by_dtype:
        raise ValueError(f"tritonreshard verl backend: the training engine has no floating parameter "
                         f"(engine.module is {type(getattr(engine, 'module', None)).__name__})")
    found = "; ".join(f"{str(d).removeprefix('torch.')}: {names[:3]}" + (f" and {len(names) - 3} more" if
                                                                          len(names) > 3 else "")
                      for d, names in by_dtype.items())
    raise ValueError(f"tritonreshard verl backend: the actor's parameters are {found}; the refit sends one dtype of "
                     f"{list(SRC_DTYPES)} for every parameter (the vLLM workers' init info has one src_dtype)")


def own_shards(engine) -> dict[str, torch.Tensor]:
    """An FSDP2 engine's local shards read from its module, in their own dtype, flat, under the
    names verl's FSDP export gives them (the module's ``state_dict()`` through verl's
    ``convert_weight_keys``, as ``get_per_tensor_param_shard`` names them): what that export casts
    to bf16. Nothing is copied (FSDP2's own local tensors). ``{}`` for an engine that is not FSDP2."""
    module = getattr(engine, "module", None)
    if not is_fsdp2(module):
        return {}
    # Lazy: verl is there whenever an FSDP2 engine of verl's is (export_source also serves stubs).
    from verl.utils.model import convert_weight_keys

    params = convert_weight_keys(module.state_dict(), getattr(module, "_fsdp_wrapped_module", module))
    return {n: (p.to_local() if isinstance(p, DTensor) else p).reshape(-1) for n, p in params.items()}


def _own_or_export(name: str, local: torch.Tensor, own: dict, want: torch.dtype, problems: list[str]):
    """The shard to send for the export's record ``(name, local)``: the module's own tensor when
    it has one of that size (cast to ``want`` if it is a floating buffer of another dtype, as verl's
    export casts it), else verl's. Returns ``(tensor, from the module)``; None with a problem when
    only verl's narrowed copy is there, or a shard of another dtype (an integer buffer)."""
    mine = own.get(name)
    if mine is not None and mine.numel() == local.numel():
        if mine.dtype == want:
            return mine, True
        if mine.is_floating_point():  # a buffer: the parameters set the dtype
            return mine.to(want), True
        local = mine
    if local.dtype == want:
        return local, False
    if local.dtype == EXPORT_DTYPE and want != EXPORT_DTYPE:
        problems.append(f"{name!r}: verl's export cast it to {EXPORT_DTYPE}, and the module has no tensor of that "
                        f"name and size to send in the parameters' {want} (an export that renames or fuses "
                        f"parameters); a bf16 copy of {want} weights is not sent")
    else:
        problems.append(f"{name!r}: the export yielded {local.dtype}; this actor sends {want} (its parameters' dtype)")
    return None, False


# ------------------------------------------------------------------------- export -> layouts
def _spec_problem(name: str, spec) -> str | None:
    """Why a ShardSpec carries no geometry this planner can serve (None when it does)."""
    if getattr(spec, "place", None) is not None:
        return (f"{name!r}: its ShardSpec places the shard explicitly (place={spec.place!r}), which is not a "
                f"DTensor layout")
    if getattr(spec, "to_hf_chunk", None) is not None or getattr(spec, "hf_slots", None) is not None:
        return f"{name!r}: its ShardSpec converts to other HF tensors (to_hf_chunk / hf_slots)"
    if spec.mesh is None and getattr(spec, "gather_group", None) is not None:
        return f"{name!r}: its ShardSpec has a gather_group but no mesh (its geometry is not in the spec)"
    return None


def _dtensor_layout(name: str, local: torch.Tensor, spec, trainer_ranks, problems: list[str]) -> Layout | None:
    """The layout a DTensor engine's ShardSpec describes, its mesh's torch ranks mapped onto
    ``trainer_ranks`` (actor rank ``r`` is refit rank ``trainer_ranks[r]``)."""
    why = _spec_problem(name, spec)
    if why is not None:
        problems.append(why)
        return None
    if spec.mesh is None:  # verl: "the local tensor already is the whole parameter"
        mesh, placements = list(trainer_ranks), [Replicate()]
    else:
        flat = spec.mesh.mesh.reshape(-1).tolist()
        if any(not 0 <= r < len(trainer_ranks) for r in flat):
            problems.append(f"{name!r}: its mesh ranks {flat} are not actor ranks 0..{len(trainer_ranks) - 1}")
            return None
        mesh = torch.tensor([trainer_ranks[r] for r in flat]).reshape(spec.mesh.mesh.shape).tolist()
        placements = list(spec.placements)
    try:  # narrow: the Layout's own checks name unsupported placements (_StridedShard, Partial)
        return Layout(tuple(spec.full_shape), mesh, placements, local.dtype)
    except ValueError as exc:
        problems.append(f"{name!r}: {exc}".replace("\n", " "))
        return None


def _megatron_setting(engine, megatron: dict | None, problems: list[str]) -> Megatron | None:
    """The configured Megatron settings, checked against the engine's own parallel sizes."""
    cfg = engine.engine_config
    have = dict(tp=cfg.tensor_model_parallel_size, pp=cfg.pipeline_model_parallel_size,
                ep=cfg.expert_model_parallel_size, etp=cfg.expert_tensor_parallel_size,
                vpp=cfg.virtual_pipeline_model_parallel_size or 1)
    if megatron is None:
        problems.append(f"a Megatron actor needs engine_kwargs.tritonreshard.megatron (the vLLM workers build "
                        f"the Megatron recipe from it before the first sync), e.g. megatron={have}")
        return None
    meg = Megatron(**megatron)
    mine = dict(tp=meg.tp, pp=meg.pp, ep=meg.ep, etp=meg.expert_tp, vpp=meg.vpp)
    have["etp"] = have["etp"] or have["tp"]  # None is "the tensor-parallel size" on both sides
    bad = [f"{k}={mine[k]} but the engine has {v}" for k, v in have.items() if mine[k] != v]
    if bad:
        problems.append("engine_kwargs.tritonreshard.megatron disagrees with the engine's config: " + ", ".join(bad))
    return meg


def _megatron_layouts(engine, meg: Megatron, trainer_ranks, rank: int, records, problems):
    """Megatron's ShardSpecs carry no geometry (verl's probe owns it), so the layouts are our
    Megatron recipe's. A record's name is its storage's in ``megatron_tensors`` (the local shard
    is a view of the parameter when it is bf16), else its own if the recipe has it."""
    spec = megatron_to_vllm(engine.model_config.hf_config, megatron=meg, tp=1, trainer_ranks=list(trainer_ranks),
                            inference_ranks=[max(trainer_ranks) + 1], src_dtype=EXPORT_DTYPE)
    ours = megatron_tensors(engine.module, megatron=meg, rank=trainer_ranks.index(rank))
    by_storage = {(t.data_ptr(), t.numel()): n for n, t in ours.items()}
    named, shards = {}, {}
    for name, local, sspec in records:
        if local.numel() == 0 and not getattr(sspec, "contributes", True):
            continue  # a parameter of another pipeline stage: verl's lockstep placeholder
        mine = by_storage.get((local.data_ptr(), local.numel())) or (name if name in spec.src else None)
        if mine is None:
            problems.append(f"{name!r} is neither a parameter of this rank's chunks nor a name of the Megatron "
                            f"recipe (Transformer-Engine names, global layer numbers and expert ids)")
            continue
        named[name], shards[mine] = mine, local
    layouts = {n: spec.src[n] for n in shards}
    bindable = set(shards) == set(ours) and all(
        (s.data_ptr(), s.numel()) == (ours[n].data_ptr(), ours[n].numel()) for n, s in shards.items()) and all(
        t.untyped_storage().nbytes() == t.numel() * t.element_size() for t in ours.values())
    return layouts, shards, named, bindable


def _fsdp2_binding(engine, source_tensors: dict, layouts: dict, trainer_ranks) -> FSDP2Source | None:
    """The engine's FSDP2 module as a source whose shards become the arena, when the source is
    exactly its parameters' local shards (same names, storage, dtype and layout: the shards
    :func:`own_shards` read, in any dtype; not with persistent buffers in the export, nor a cast)."""
    module = getattr(engine, "module", None)
    if not isinstance(module, torch.nn.Module) or getattr(engine, "_is_offload_param", False):
        return None
    try:  # narrow: a module that is not wholly fully_shard-managed is simply not bindable
        fs = FSDP2Source(module, rank_map=dict(enumerate(trainer_ranks)))
    except ValueError:
        return None
    same = set(fs) == set(source_tensors) and all(
        fs[n].data_ptr() == t.data_ptr() and fs[n].dtype == t.dtype and fs.layouts[n] == layouts[n]
        for n, t in source_tensors.items())
    return fs if same else None


def export_source(engine, *, trainer_ranks, rank: int, megatron: dict | None = None,
                  src_dtype: torch.dtype | None = None) -> ShardSource:
    """One pass of ``engine.get_per_tensor_param_shard()`` as this rank's refit source.

    DTensor engines (FSDP2, veomni, torchtitan): each ``ShardSpec``'s ``(full_shape, mesh,
    placements)`` is the layout (``mesh=None``: every trainer rank holds it whole). Megatron
    (``engine.engine_config.strategy == "megatron"``): the layouts of ``trs.recipes.megatron_to_vllm``
    for ``megatron`` (its settings). ``rank``: this rank's refit rank, one of ``trainer_ranks``.

    The source's dtype is the parameters' own (:func:`source_dtype`; an engine without a module:
    verl's bf16): FSDP2 shards are read from the module under the export's names (:func:`own_shards`),
    since verl's export casts them to bf16. ``src_dtype``: what this rank announced in verl's
    topology (the vLLM workers build their recipe with it), checked against the parameters.

    Zero-copy where the shards can be the arena: an FSDP2 engine whose export is its parameters'
    own local shards (any dtype, no offload, no persistent buffer), or a Megatron one whose bf16
    parameters each own their storage (no distributed optimizer's buffer, no offload). Raises one
    ``ValueError`` naming every parameter that can't be served (explicit placements, strided
    shards, a shard of another dtype, only verl's bf16 copy of a parameter of another dtype, a
    shard whose size is not its layout's), before anything joins."""
    trainer_ranks = [int(r) for r in trainer_ranks]
    problems: list[str] = []
    have = None
    if _modules(engine):
        try:  # narrow: source_dtype's one ValueError joins the others
            have = source_dtype(engine)
        except ValueError as exc:
            problems.append(str(exc).removeprefix("tritonreshard verl backend: "))
    if src_dtype is not None and have is not None and have != src_dtype:
        problems.append(f"this rank announced src_dtype {src_dtype} in verl's topology (prepare), but its parameters "
                        f"are {have} now")
    want = src_dtype or have or EXPORT_DTYPE
    gen, _ = engine.get_per_tensor_param_shard()
    records = list(gen)
    mega = getattr(getattr(engine, "engine_config", None), "strategy", None) == "megatron"
    meg = _megatron_setting(engine, megatron, problems) if mega else None
    own_names: set[str] = set()
    if mega and want != EXPORT_DTYPE:
        problems.append(f"a Megatron actor's parameters are {want}: verl's Megatron export casts them to "
                        f"{EXPORT_DTYPE} copies that can't be placed on the Megatron recipe; this backend sends "
                        f"Megatron's bf16 parameters (Float16Module, bf16=True)")
    if mega and meg is not None and want == EXPORT_DTYPE:
        layouts, flat, exported, bindable = _megatron_layouts(engine, meg, trainer_ranks, rank, records, problems)
    else:
        layouts, flat, exported, bindable = {}, {}, {}, False
        own = {} if mega else own_shards(engine)
        for name, local, spec in ([] if mega else records):
            local, mine = _own_or_export(name, local, own, want, problems)
            lay = None if local is None else _dtensor_layout(name, local, spec, trainer_ranks, problems)
            if lay is not None:
                layouts[name], flat[name], exported[name] = lay, local, name
                if mine:
                    own_names.add(name)
    tensors = {}
    for name, local in flat.items():
        lay = layouts[name]
        if local.dtype != want:
            problems.append(f"{name!r}: the export yielded {local.dtype}; this actor sends {want}")
        elif local.numel() != lay.local_numel(rank):
            problems.append(f"{name!r}: the local shard has {local.numel()} elements, its layout {lay} places "
                            f"{lay.local_shape(rank)} on refit rank {rank}")
        else:
            tensors[name] = local.view(lay.local_shape(rank)) if local.is_contiguous() else local.reshape(
                lay.local_shape(rank))
    if not records:
        problems.append("get_per_tensor_param_shard() yielded no parameter")
    if problems:
        raise ValueError(f"tritonreshard verl backend (refit rank {rank}): " + "; ".join(problems))
    fsdp2 = None if mega else _fsdp2_binding(engine, tensors, layouts, trainer_ranks)
    # Offloading moves param.data off the arena between syncs: such parameters are copied each sync.
    bindable = bindable and not getattr(engine, "_is_offload_param", False)
    return ShardSource(layouts, tensors, exported, fsdp2=fsdp2, megatron=meg if bindable else None,
                       own=frozenset(own_names))


def export_shards(engine, source: ShardSource):
    """A later sync's ``(export name, shard)`` pairs for ``source`` (an :func:`export_source` of the
    same engine): the module's own shard for each name ``source.own`` has, verl's export for the
    rest. When every name is the module's own, verl's export does not run (it would cast each
    shard to bf16 for nothing)."""
    own = own_shards(engine) if source.own else {}
    if source.own == set(source.exported):
        yield from ((name, own.get(name)) for name in source.exported)
        return
    gen, _ = engine.get_per_tensor_param_shard()
    for name, local, _spec in gen:
        mine = own.get(name) if name in source.own else None
        yield name, (mine if mine is not None and mine.numel() == local.numel() else local)


# ------------------------------------------------------------------------------------ backend
