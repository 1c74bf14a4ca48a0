"""Hugging Face (transformers 5) training parameters under FSDP -> vLLM tensor-parallel parameters.

Pure Python planning (no transformers or vLLM import): :func:`hf_to_vllm` checks the arguments every
recipe shares, picks the architecture's builder from :data:`RECIPES` by ``config.model_type``, lets
it lay out the source layouts (FSDP rows of the HF parameters over the trainer ranks), the
destination layouts (vLLM's ``named_parameters()`` on each TP rank) and the
:class:`~tritonreshard.Part` mapping between them on a :class:`~tritonreshard.recipes.RecipeBuilder`,
then quantizes the destinations if asked (:mod:`~tritonreshard.recipes.fp8`).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .builder import RecipeBuilder, RecipeSpec, check_tp, raise_problems, rank_list
from .deepseek import DEEPSEEK_MODEL_TYPES, build_deepseek
from .dense import FAMILIES, build_dense
from .families import FAMILY_MODEL_TYPES, build_family
from .fp8 import check_quantization, quantize_destinations
from .gpt_oss import GPT_OSS_MODEL_TYPES, build_gpt_oss
from .hybrid import HYBRID_MODEL_TYPES, build_hybrid

__all__ = ["hf_to_vllm", "RECIPES", "Builder"]

#: A registry builder: ``build(config, b, *, expert_parallel, quantization)`` lays out ``config``'s
#: parameters on the :class:`RecipeBuilder` ``b`` (its ranks, ``tp`` and dtypes already checked), or
#: raises one ``ValueError`` naming every size (or ``quantization``) it cannot lay out.
Builder = Callable[..., None]

#: ``config.model_type`` -> its builder. A new family of the dense kind is a row of
#: :data:`~tritonreshard.recipes.dense.FAMILIES`; a new kind of architecture, a builder here.
RECIPES: dict[str, Builder] = {**{t: build_dense for t in FAMILIES},
                               **{t: build_deepseek for t in DEEPSEEK_MODEL_TYPES},
                               **{t: build_family for t in FAMILY_MODEL_TYPES},
                               **{t: build_hybrid for t in HYBRID_MODEL_TYPES},
                               **{t: build_gpt_oss for t in GPT_OSS_MODEL_TYPES}}


def _unknown_model_type(model_type) -> str:
    return (f"config.model_type={model_type!r} has no recipe; known: {sorted(RECIPES)} (another model type vLLM "
            f"serves: trace its recipe from vLLM's loader, tritonreshard.vllm.trace.trace_recipe, and pass "
            f"init_info(trace=True) to the engine)")


def hf_to_vllm(config: Any, tp: int, trainer_ranks, inference_ranks, dtype: torch.dtype = torch.bfloat16,
               src_dtype: torch.dtype = torch.float32, expert_parallel: bool = False,
               quantization: str | None = None, scale_rule: str = "deepgemm") -> RecipeSpec:
    """The layouts and parts that refit an HF model trained under FSDP into vLLM's TP ranks.

    Args:
        config: a ``transformers`` config of a :data:`RECIPES` model type (``LlamaConfig``,
            ``MistralConfig``, ``Qwen2Config``, ``Qwen3Config``, ``Qwen3MoeConfig``,
            ``DeepseekV2Config``, ``DeepseekV3Config``, ``MixtralConfig``, ``Phi3Config``,
            ``Glm4MoeConfig``, ``Gemma3TextConfig``, ``Qwen3NextConfig``, ``GptOssConfig``) or any object with the
            same fields.
        tp: vLLM's tensor-parallel size; ``len(inference_ranks)`` must be a multiple of it.
        trainer_ranks: global ranks of the trainers (FSDP rows, ``Shard(0)``), or their count.
        inference_ranks: global ranks of ``k * tp`` inference ranks (or their count): ``k`` replicas
            of TP-``tp`` (vLLM data parallel), in order. ``inference_ranks[i]`` is TP rank ``i % tp``
            of replica ``i // tp`` and holds exactly what a single TP group's rank ``i % tp`` holds:
            the destinations are laid out on a ``(k, tp)`` mesh, ``Replicate`` over the replicas.
        dtype: vLLM's parameter dtype. ``src_dtype``: the trainer's parameter dtype.
        expert_parallel: MoE experts split over the ranks (vLLM's ``enable_expert_parallel``).
        quantization: ``None``, ``"fp8-block"`` or ``"fp8-block-ue8m0"``: the linears and experts in
            vLLM's block-FP8 layout, quantized in the refit's pass (:mod:`tritonreshard.recipes.fp8`).
        scale_rule: ``"deepgemm"`` (``s = amax / 448``) or ``"nemo_rl"`` (``s = 1 / (448 / amax)``).

    Raises ``ValueError`` naming every problem at once: unknown ``model_type``, bad ranks or ``tp``;
    then (the builder's) sizes vLLM cannot split over ``tp`` (heads, KV heads, intermediate size,
    padded vocab, experts); then tensors vLLM's block-FP8 layout refuses.
    """
    problems: list[str] = []
    model_type = getattr(config, "model_type", None)
    build = RECIPES.get(model_type)
    if build is None:
        problems.append(_unknown_model_type(model_type))
    tp = check_tp(tp, problems)
    src_ranks = rank_list(trainer_ranks, "trainer_ranks", problems)
    dst_ranks = rank_list(inference_ranks, "inference_ranks", problems)
    if tp and dst_ranks and len(dst_ranks) % tp:
        problems.append(f"inference_ranks has {len(dst_ranks)} ranks, not a multiple of tp={tp} "
                        f"(k replicas of TP-{tp} take k * {tp} ranks)")
    problems += check_quantization(quantization, scale_rule)
    raise_problems("hf_to_vllm", problems)

    b = RecipeBuilder(src_ranks, dst_ranks, tp, dtype, src_dtype)
    build(config, b, expert_parallel=expert_parallel, quantization=quantization)
    quant = quantize_destinations(b.dst, tp, quantization, scale_rule, f"hf_to_vllm: {model_type}, tp={tp}") \
        if quantization else {}
    return b.spec(model_type, expert_parallel, quant)
