"""verl's actor side, the export: each actor rank's own shards from ``engine.get_per_tensor_param_shard()``
as a refit source (:func:`export_source`), with no full tensor built. FSDP2 shards (DTensor
placements over the trainer ranks) become :class:`~tritonreshard.Layout` s, bound to the arena where
the engine's parameters can be the arena itself; Megatron engines map onto the Megatron recipe.
The backend that publishes it is :mod:`.actor`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ... import Layout, Replicate
from ...engine.fsdp import FSDP2Source
from ...recipes import Megatron, megatron_tensors, megatron_to_vllm

__all__ = ["ShardSource", "export_source", "SRC_DTYPE"]

#: What both of verl's exports cast floating shards to.
SRC_DTYPE = torch.bfloat16


@dataclass(frozen=True)
class ShardSource:
    """One actor rank's export as a refit source: ``layouts`` ``{name: Layout}`` over the trainer
    ranks, ``tensors`` ``{name: local shard}`` (views of what the export yielded, shaped
    ``layouts[name].local_shape(rank)``), ``exported`` ``{name in the export: name here}``, and how
    the shards can be the arena itself: ``fsdp2`` (a ``tritonreshard.engine.fsdp.FSDP2Source`` of
    the engine's module) or ``megatron`` (the ``trs.recipes.Megatron`` to ``megatron_bind`` with),
    both None when every sync must copy."""

    layouts: dict
    tensors: dict
    exported: dict
    fsdp2: Any = None
    megatron: Any = None


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
                            inference_ranks=[max(trainer_ranks) + 1], src_dtype=SRC_DTYPE)
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
    """The engine's FSDP2 module as a source whose shards become the arena, when the export is
    exactly its parameters' local shards (same names, storage, dtype and layout; verl's export
    casts fp32 parameters to fresh bf16 tensors, which can't be)."""
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


def export_source(engine, *, trainer_ranks, rank: int, megatron: dict | None = None) -> ShardSource:
    """One pass of ``engine.get_per_tensor_param_shard()`` as this rank's refit source.

    DTensor engines (FSDP2, veomni, torchtitan): each ``ShardSpec``'s ``(full_shape, mesh,
    placements)`` is the layout (``mesh=None``: every trainer rank holds it whole). Megatron
    (``engine.engine_config.strategy == "megatron"``): the layouts of ``trs.recipes.megatron_to_vllm``
    for ``megatron`` (its settings). ``rank``: this rank's refit rank, one of ``trainer_ranks``.

    Zero-copy where the shards can be the arena: an FSDP2 engine whose export is its parameters'
    own local shards (bf16 parameters, no offload), or a Megatron one whose bf16 parameters each own
    their storage (no distributed optimizer's buffer, no offload). Raises one ``ValueError`` naming
    every parameter that can't be served (explicit placements, strided shards, a dtype that is not
    bf16, a shard whose size is not its layout's), before anything joins. The first pass holds the
    whole local export at once (fp32 parameters: one bf16 copy of this rank's shards, once)."""
    trainer_ranks = [int(r) for r in trainer_ranks]
    gen, _ = engine.get_per_tensor_param_shard()
    records = list(gen)
    problems: list[str] = []
    mega = getattr(getattr(engine, "engine_config", None), "strategy", None) == "megatron"
    meg = _megatron_setting(engine, megatron, problems) if mega else None
    if mega and meg is not None:
        layouts, flat, exported, bindable = _megatron_layouts(engine, meg, trainer_ranks, rank, records, problems)
    else:
        layouts, flat, exported, bindable = {}, {}, {}, False
        for name, local, spec in ([] if mega else records):
            lay = _dtensor_layout(name, local, spec, trainer_ranks, problems)
            if lay is not None:
                layouts[name], flat[name], exported[name] = lay, local, name
    tensors = {}
    for name, local in flat.items():
        lay = layouts[name]
        if local.dtype != SRC_DTYPE:
            problems.append(f"{name!r}: the export yielded {local.dtype}; verl's exports give {SRC_DTYPE}")
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
    return ShardSource(layouts, tensors, exported, fsdp2=fsdp2, megatron=meg if bindable else None)


# ------------------------------------------------------------------------------------ backend
