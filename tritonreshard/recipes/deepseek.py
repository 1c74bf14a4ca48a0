"""DeepSeek-V2 / V3 (transformers 5) training parameters -> vLLM tensor-parallel parameters.

Pure Python planning (no transformers or vLLM import), reached through
:func:`~tritonreshard.recipes.hf_to_vllm` (``config.model_type`` ``"deepseek_v2"`` or ``"deepseek_v3"``). Facts follow
vLLM 0.32's ``models/deepseek_v2.py`` with MLA attention (vLLM's default for these models), per TP rank r, in load
format:

* ``self_attn.fused_qkv_a_proj.weight`` ``[q_lora_rank + kv_lora_rank + qk_rope_head_dim, H]``
  (when ``q_lora_rank`` is set): ``cat(q_a_proj, kv_a_proj_with_mqa)``, replicated;
  without q-lora ``kv_a_proj_with_mqa.weight`` is replicated and ``q_proj.weight`` takes
  ``q_b_proj``'s place;
* ``q_b_proj.weight`` / ``q_proj.weight`` ``[heads * (qk_nope + qk_rope), .]`` and ``kv_b_proj.weight``
  ``[heads * (qk_nope + v_head_dim), kv_lora_rank]``: row chunk r (whole heads);
  ``o_proj.weight`` ``[H, heads * v_head_dim]``: column chunk r;
* ``q_a_layernorm`` / ``kv_a_layernorm``: replicated. vLLM's CPU backend also derives ``W_UK_T`` /
  ``W_UV`` from ``kv_b_proj`` when it post-processes the attention layer; those are not parameters
  (the refit engine has vLLM redo that post-processing);
* dense layers (``i < first_k_dense_replace``, or ``i % moe_layer_freq != 0``): ``mlp.gate_up_proj`` /
  ``mlp.down_proj`` as in Llama;
* MoE layers: router ``mlp.gate.weight`` replicated; ``mlp.gate.e_score_correction_bias``
  (``topk_method == "noaux_tc"``, DeepSeek-V3) replicated and always float32 on both sides: in
  transformers it is a buffer (FSDP leaves buffers whole on every trainer, so the source is
  ``Replicate``), and training changes it; ``mlp.shared_experts.gate_up_proj`` / ``down_proj`` as
  the dense MLP with ``moe_intermediate_size * n_shared_experts``; routed experts
  ``mlp.experts.routed_experts.w13_weight`` / ``w2_weight`` exactly as Qwen3-MoE (split by TP, or
  whole experts placed like vLLM's ``determine_expert_map`` under expert parallelism);
* ``embed_tokens`` / ``lm_head``: vocab padded to 64 and split by rows.
"""
from __future__ import annotations

from typing import Any

import torch

from ..layout import Part, Replicate, Shard
from .builder import RecipeBuilder, RecipeSpec, check_divisible, check_moe, check_vocab, raise_problems, shared_experts

__all__ = ["build_deepseek", "deepseek_to_vllm", "DEEPSEEK_MODEL_TYPES"]

#: ``config.model_type`` values this module lays out (DeepseekV2ForCausalLM / DeepseekV3ForCausalLM).
DEEPSEEK_MODEL_TYPES = ("deepseek_v2", "deepseek_v3")


def _moe_layers(config: Any) -> set[int]:
    """vLLM's DeepseekV2DecoderLayer rule for which layers hold routed experts."""
    E = getattr(config, "n_routed_experts", None)
    first = getattr(config, "first_k_dense_replace", 0) or 0
    freq = getattr(config, "moe_layer_freq", None) or 1
    if not E:
        return set()
    return {i for i in range(config.num_hidden_layers) if i >= first and i % freq == 0}


def build_deepseek(config: Any, b: RecipeBuilder, *, expert_parallel: bool, quantization: str | None) -> None:
    """Lay out one DeepSeek-V2/V3 model on ``b`` (a registry builder, see
    :data:`~tritonreshard.recipes.RECIPES`). Raises ``ValueError`` naming every size vLLM cannot
    split over ``b.tp``, and any ``quantization`` (MLA's block-FP8 layout is not laid out yet)."""
    model_type, tp = config.model_type, b.tp
    H, nq, L = config.hidden_size, config.num_attention_heads, config.num_hidden_layers
    V = config.vocab_size
    q_lora = getattr(config, "q_lora_rank", None)
    kv_lora = getattr(config, "kv_lora_rank", 0) or 0
    nope = getattr(config, "qk_nope_head_dim", 0) or 0
    rope = getattr(config, "qk_rope_head_dim", 0) or 0
    vhd = getattr(config, "v_head_dim", 0) or 0
    inter = config.intermediate_size
    moe_layers = _moe_layers(config)
    E = getattr(config, "n_routed_experts", None) or 0
    moe_i = getattr(config, "moe_intermediate_size", 0) or 0
    n_shared = getattr(config, "n_shared_experts", None) or 0
    bias = getattr(config, "topk_method", None) == "noaux_tc"
    tied = bool(getattr(config, "tie_word_embeddings", False))

    problems: list[str] = []
    if quantization is not None:
        # vLLM quantizes MLA's own projections (fused_qkv_a_proj, q_b_proj, kv_b_proj) too; their
        # block grids are not laid out here yet, and a partial FP8 layout would not load.
        problems.append(f"quantization={quantization!r} is not laid out for {model_type} (MLA) yet")
    if not (kv_lora and rope and nope):
        problems.append(f"kv_lora_rank={kv_lora}, qk_nope_head_dim={nope}, qk_rope_head_dim={rope}: only MLA "
                        f"attention (all three set) has a recipe")
    check_divisible(problems, "num_attention_heads", nq, tp)
    check_vocab(V, tp, problems)
    check_moe(problems, tp, model_type, layers=L, moe_layers=moe_layers, intermediate_size=inter,
              experts=(f"n_routed_experts={E}", E), expert_size=("moe_intermediate_size", moe_i),
              expert_parallel=expert_parallel, shared=shared_experts(moe_i, n_shared), lacking="MoE layers")
    raise_problems(f"hf_to_vllm: {model_type} (hidden_size={H}, heads={nq}, kv_lora_rank={kv_lora}), tp={tp}",
                   problems)

    b.source("model.embed_tokens.weight", (V, H))
    b.vocab("model.embed_tokens.weight", "model.embed_tokens.weight", V, H)
    for i in range(L):
        pre = f"model.layers.{i}"
        _mla(b, f"{pre}.self_attn", H, nq, q_lora, kv_lora, nope, rope, vhd)
        if i in moe_layers:
            b.same(f"{pre}.mlp.gate.weight", (E, H), Replicate())
            if bias:  # a float32 buffer in transformers: whole on every trainer
                name = f"{pre}.mlp.gate.e_score_correction_bias"
                b.source(name, (E,), Replicate(), torch.float32)
                b.target(name, (E,), Replicate(), dtype=torch.float32)
            if n_shared:
                _mlp(b, f"{pre}.mlp.shared_experts", H, moe_i * n_shared)
            b.experts(f"{pre}.mlp", E, moe_i, H, expert_parallel)
        else:
            _mlp(b, f"{pre}.mlp", H, inter)
        b.same(f"{pre}.input_layernorm.weight", (H,), Replicate())
        b.same(f"{pre}.post_attention_layernorm.weight", (H,), Replicate())
    b.same("model.norm.weight", (H,), Replicate())
    if not tied:
        b.source("lm_head.weight", (V, H))
    b.vocab("model.embed_tokens.weight" if tied else "lm_head.weight", "lm_head.weight", V, H)  # vLLM never ties it


def _mla(b: RecipeBuilder, att: str, H: int, nq: int, q_lora: int | None, kv_lora: int, nope: int, rope: int,
         vhd: int) -> None:
    """One layer's MLA attention (``att``: ``model.layers.{i}.self_attn``): with q-lora (V3) q_a and
    kv_a fused into ``fused_qkv_a_proj``, without it (V2) ``q_proj`` and ``kv_a_proj_with_mqa`` as they are."""
    qk = nope + rope
    kv_a = f"{att}.kv_a_proj_with_mqa.weight"
    b.source(kv_a, (kv_lora + rope, H))
    if q_lora:
        q_a = f"{att}.q_a_proj.weight"
        b.source(q_a, (q_lora, H))
        b.target(f"{att}.fused_qkv_a_proj.weight", (q_lora + kv_lora + rope, H), Replicate(),
                 [Part(q_a, [(0, q_lora), None]), Part(kv_a, [(q_lora, q_lora + kv_lora + rope), None])])
        b.same(f"{att}.q_a_layernorm.weight", (q_lora,), Replicate())
        b.same(f"{att}.q_b_proj.weight", (nq * qk, q_lora), Shard(0))
    else:
        b.target(kv_a, (kv_lora + rope, H), Replicate())
        b.same(f"{att}.q_proj.weight", (nq * qk, H), Shard(0))
    b.same(f"{att}.kv_a_layernorm.weight", (kv_lora,), Replicate())
    b.same(f"{att}.kv_b_proj.weight", (nq * (nope + vhd), kv_lora), Shard(0))
    b.same(f"{att}.o_proj.weight", (H, nq * vhd), Shard(1))


def _mlp(b: RecipeBuilder, pre: str, H: int, size: int) -> None:
    """A dense MLP (or the shared experts) of intermediate ``size``: gate_up_proj and down_proj."""
    b.gate_up(pre, "weight", (H,), size)
    b.same(f"{pre}.down_proj.weight", (H, size), Shard(1))


def deepseek_to_vllm(config: Any, tp: int, src_ranks: tuple[int, ...], dst_ranks: tuple[int, ...],
                     dtype: torch.dtype, src_dtype: torch.dtype, expert_parallel: bool) -> RecipeSpec:
    """The recipe of one DeepSeek-V2/V3 model, unquantized: what ``hf_to_vllm`` returns for it once
    ``tp`` and the ranks are checked (``src_ranks``: trainer ranks, FSDP rows; ``dst_ranks``: TP ranks
    in order, ``k * tp`` for ``k`` replicas). Raises ``ValueError`` as :func:`build_deepseek`."""
    b = RecipeBuilder(src_ranks, dst_ranks, tp, dtype, src_dtype)
    build_deepseek(config, b, expert_parallel=expert_parallel, quantization=None)
    return b.spec(config.model_type, expert_parallel)
