"""One serving TP rank's place and layouts: :func:`recipe_spec`, :func:`serving_rank`, :class:`ServingRank`.

What every engine's worker computes when it sets up, from its :class:`~.schema.ServingInit` and
what only the engine knows (its TP size and rank, the served model's HF config and dtype):

* the recipe (:func:`recipe_spec`): ``trs.recipes.hf_to_vllm``, or ``megatron_to_vllm`` when the
  trainers are Megatron-Core ranks; an engine with its own parameter names passes its own
  ``RecipeSpec``-like object (``src``, ``dst``, ``parts``) instead;
* the global rank it joins as and the group kind (:mod:`~.membership`, chosen once);
* :meth:`ServingRank.join`: the one place the serving side constructs a
  :class:`~tritonreshard.RefitInference`.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from .. import PullOptions, RefitInference, recipes
from ..engine.rendezvous import connect_store
from .membership import ElasticGroup, FixedGroup, membership
from .schema import ServingInit

__all__ = ["ServingRank", "serving_rank", "recipe_spec"]


def recipe_spec(init: ServingInit, config, *, tp: int, dtype, quantization: str | None = None,
                expert_parallel: bool = False, tracer=None):
    """The recipe of an engine serving ``config`` (a ``transformers`` config) with TP ``tp`` in
    ``dtype`` (the served dtype; ``quantization``: the recipe's, e.g. ``"fp8-block"``): the same
    parts as the trainers' recipe, ``megatron_to_vllm`` when ``init.megatron`` is given. With
    ``init.trace`` and a model type no hand-written recipe covers, ``tracer`` (the engine's: called
    as ``tracer(config, tp=, trainer_ranks=, inference_ranks=, dtype=, src_dtype=, expert_parallel=)``,
    vLLM's :func:`tritonreshard.vllm.trace.trace_recipe`) traces one from the engine's own loader."""
    common = dict(tp=tp, trainer_ranks=list(init.trainer_ranks), inference_ranks=list(init.inference_ranks),
                  dtype=dtype, src_dtype=init.dtype, expert_parallel=expert_parallel)
    if init.megatron is not None:  # the same parts as the Megatron trainers' recipe
        return recipes.megatron_to_vllm(config, megatron=init.megatron_config, quantization=quantization, **common)
    if init.trace and getattr(config, "model_type", None) not in recipes.RECIPES:
        problems = []
        if tracer is None:
            problems.append("this engine has no tracer of its loader")
        if quantization is not None:  # a traced recipe copies; quantizing in the refit needs a hand-written one
            problems.append(f"the engine serves quantization={quantization!r}, and traced recipes lay out "
                            f"unquantized parameters only")
        if problems:
            raise ValueError(f"init_info(trace=True) for model_type={config.model_type!r}: " + "; ".join(problems))
        return tracer(config, **common)
    return recipes.hf_to_vllm(config, quantization=quantization, **common)


@dataclass(frozen=True)
class ServingRank:
    """TP rank ``tp_rank`` of a TP-``tp`` engine in a refit group: ``rank`` is its global rank,
    ``spec`` the recipe (``spec.dst[name].local_shape(rank)`` is this rank's shard of ``name``;
    ``spec.parts`` how it is built from the sources; ``spec.quant`` optional),
    ``group`` the group kind (:func:`~.membership.membership`)."""

    init: ServingInit
    spec: object
    tp: int
    tp_rank: int
    rank: int
    group: FixedGroup | ElasticGroup = field(compare=False, repr=False)

    @property
    def buffer_bytes(self) -> int:
        """Bytes of one buffer set on this rank (what a refit costs in memory beyond the engine's
        own weights, per set)."""
        return sum(lay.local_numel(self.rank) * lay.itemsize for lay in self.spec.dst.values())

    def join(self, *, device, mode: str) -> tuple[RefitInference, float]:
        """Check the store (both sides elastic or neither), then join the refit group: the
        inference endpoint of this rank in buffer ``mode`` (``"shadow"``: two sets, for the
        background pull; ``"inplace"``: one), and how long joining took in ms. The one
        construction of a ``RefitInference`` on the serving side; every engine calls it."""
        init = self.init
        if self.group.asks_store(self.rank):
            self.group.check_store(connect_store(init.store, world_size=1, is_master=False, timeout=init.timeout))
        t0 = time.perf_counter()
        # What RefitInference.from_recipe does, for any spec with ``dst`` / ``parts`` (/ ``quant``):
        # a RecipeSpec, LoRA's LoraSpec, an engine's own.
        sub = RefitInference(self.spec.dst, parts=self.spec.parts, quant=getattr(self.spec, "quant", None) or None,
                             rank=self.rank, store=init.store, group=init.group,
                             pull=PullOptions(mode=mode, device=device), **init.configs, **self.group.endpoint_args())
        return sub, (time.perf_counter() - t0) * 1e3


def serving_rank(init: ServingInit, spec, *, tp: int, tp_rank: int) -> ServingRank:
    """Where TP rank ``tp_rank`` of a TP-``tp`` engine joins: ``ValueError`` when ``init`` and
    ``tp`` disagree (a replica the ranks do not hold; an elastic engine's ranks not ``tp``)."""
    group = membership(init)
    return ServingRank(init=init, spec=spec, tp=tp, tp_rank=tp_rank, rank=group.rank(tp, tp_rank), group=group)
