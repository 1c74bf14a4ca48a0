"""vLLM's recipes in the serving registry: ``("vllm", "hf")`` and ``("vllm", "megatron")``.

Registered when ``tritonreshard.vllm`` is imported (trainers and vLLM's workers alike; vLLM itself
is not imported), so both sides of a vLLM refit group build their layouts with the same code:

* ``"hf"``: ``trs.recipes.hf_to_vllm``; with the init info's ``trace`` and a model type no
  hand-written recipe covers, the recipe traced from vLLM's own loader
  (:func:`tritonreshard.vllm.trace.trace_recipe`; its cost lands in the ``stats`` dict an engine
  passes);
* ``"megatron"``: ``trs.recipes.megatron_to_vllm`` with the init info's ``megatron``.
"""
from __future__ import annotations

from .. import recipes
from ..serving import register_recipe

__all__ = ["ENGINE", "GROUP"]

#: vLLM's key in the recipe registry, and its refit group's default name (it has always been "vllm").
ENGINE = GROUP = "vllm"


def _common(init, layout) -> dict:
    common = dict(tp=layout.tp, trainer_ranks=list(init.trainer_ranks), inference_ranks=list(init.inference_ranks),
                  src_dtype=init.dtype, expert_parallel=layout.expert_parallel)
    if layout.dtype is not None:  # the trainers' side has no served dtype: the recipes' default shapes the same sources
        common["dtype"] = layout.dtype
    return common


def _hf(init, layout, *, stats: dict | None = None):
    """``hf_to_vllm``, or the trace of vLLM's loader for a type without a recipe when asked."""
    config = layout.config
    if init.trace and getattr(config, "model_type", None) not in recipes.RECIPES:
        if layout.quantization is not None:  # a traced recipe copies; quantizing in the refit needs a hand-written one
            raise ValueError(f"init_info(trace=True) for model_type={config.model_type!r}: the engine serves "
                             f"quantization={layout.quantization!r}, and traced recipes lay out unquantized "
                             f"parameters only")
        from .trace import trace_recipe  # lazy: transformers, needed only without a hand-written recipe

        return trace_recipe(config, **_common(init, layout), stats=stats)
    return recipes.hf_to_vllm(config, quantization=layout.quantization, **_common(init, layout))


def _megatron(init, layout, *, stats: dict | None = None):
    """The same parts as the Megatron trainers' recipe."""
    return recipes.megatron_to_vllm(layout.config, megatron=init.megatron_config, quantization=layout.quantization,
                                    **_common(init, layout))


register_recipe(ENGINE, "hf", _hf)
register_recipe(ENGINE, "megatron", _megatron)
