"""Qwen3-Next and Qwen3.5 (transformers 5) parameters -> vLLM tensor-parallel parameters: the hybrid of
gated DeltaNet linear attention and gated full attention.

Pure Python planning (no transformers or vLLM import), reached through
:func:`~tritonreshard.recipes.hf_to_vllm` (``config.model_type`` ``"qwen3_next"``, ``"qwen3_5_text"``,
``"qwen3_5_moe_text"``). Facts follow vLLM 0.32's ``models/qwen3_next.py``, ``models/qwen3_5.py`` and
``layers/mamba/gdn/qwen_gdn_linear_attn.py``, per TP rank r (checked element by element against
vLLM's loader by ``tests/test_families.py``). With ``nk`` / ``nv`` the linear key / value heads,
``kd = nk * linear_key_head_dim``, ``vd = nv * linear_value_head_dim``:

* ``linear_attn.in_proj_qkvz.weight`` ``[2 kd + 2 vd, H]``: stored interleaved by key-head group
  (each group's q, k, v, z rows together), which vLLM keeps as ONE output block, so rank r holds
  plain row chunk r (whole groups; ``nk % tp == 0``). The same name and shape as a four-block
  ``[q | k | v | z]`` layout (Qwen3.5's) hide a different split;
* ``linear_attn.in_proj_ba.weight`` ``[2 nv, H]``: interleaved likewise, plain row chunk r;
* Qwen3.5 keeps them apart, ``in_proj_qkv`` ``[q kd | k kd | v vd]``, ``in_proj_z`` ``[vd]``,
  ``in_proj_b`` / ``in_proj_a`` ``[nv]`` each, and vLLM fuses them into the same two parameters as
  FOUR and TWO blocks: rank r's ``in_proj_qkvz`` is ``[q r | k r | v r | z r]``, its ``in_proj_ba``
  ``[b r | a r]``. Same names and shapes as Qwen3-Next's, another split;
* ``linear_attn.conv1d.weight`` ``[2 kd + vd, 1, kernel]``: three blocks ``[q kd | k kd | v vd]``,
  each split on its own (vLLM's ``mamba_v2_sharded_weight_loader``);
* ``linear_attn.A_log`` / ``dt_bias`` ``[nv]``: split (``A_log`` float32 in vLLM whatever the model's
  dtype); ``linear_attn.norm.weight`` replicated; ``out_proj`` split on dim 1;
* full-attention layers: ``q_proj`` carries the output gate (``2 * heads * head_dim`` rows, each head's
  query then gate), and vLLM's ``qkv_proj`` counts ``2 * heads`` heads, so rank r's query block is
  whole heads with their gates: the Llama rule with twice the query rows;
* MoE layers (Qwen3-Next: ``(i + 1) % decoder_sparse_step == 0``, not in ``mlp_only_layers``;
  Qwen3.5-MoE: every layer; Qwen3.5: none): router and
  ``shared_expert_gate`` replicated, ``shared_expert`` as a dense MLP, routed experts as
  :meth:`~tritonreshard.recipes.RecipeBuilder.experts` (vLLM refuses ``tp > num_experts``).
"""
from __future__ import annotations

from typing import Any

import torch

from ..layout import Part, Replicate, Shard
from .builder import RecipeBuilder, check_attention, check_divisible, check_moe, check_vocab, raise_problems
from .families import qkv

__all__ = ["HYBRID_MODEL_TYPES", "build_hybrid"]

#: ``config.model_type`` values this module lays out (Qwen3NextForCausalLM, Qwen3_5ForCausalLM,
#: Qwen3_5MoeForCausalLM).
HYBRID_MODEL_TYPES = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")
# Qwen3.5's linear attention: separate q/k/v, z, b and a projections (fused by vLLM in blocks).
_SPLIT_PROJECTIONS = ("qwen3_5_text", "qwen3_5_moe_text")


def _moe_layers(config: Any) -> set[int]:
    """vLLM's rule for which layers hold routed experts: Qwen3_5DecoderLayer's by model type (all
    for Qwen3.5-MoE, none for Qwen3.5), Qwen3NextDecoderLayer's by sparse step otherwise."""
    if config.model_type == "qwen3_5_moe_text":
        return set(range(config.num_hidden_layers))
    if config.model_type == "qwen3_5_text" or not getattr(config, "num_experts", 0):
        return set()
    only = set(getattr(config, "mlp_only_layers", None) or ())
    step = getattr(config, "decoder_sparse_step", 1) or 1
    return {i for i in range(config.num_hidden_layers) if i not in only and (i + 1) % step == 0}


def _check(config: Any, tp: int, moe: set[int], expert_parallel: bool, quantization: str | None) -> None:
    problems: list[str] = []
    if quantization is not None:
        problems.append(f"quantization={quantization!r} is not laid out for {config.model_type} yet")
    nq = config.num_attention_heads
    check_attention(problems, tp, nq, getattr(config, "num_key_value_heads", None) or nq)
    check_divisible(problems, "linear_num_key_heads", config.linear_num_key_heads, tp)
    check_divisible(problems, "linear_num_value_heads", config.linear_num_value_heads, tp)
    check_vocab(config.vocab_size, tp, problems)
    E = getattr(config, "num_experts", 0) or 0
    # vLLM's Qwen3NextSparseMoeBlock refuses tp > num_experts, with or without EP; a shared expert
    # that tp does not divide vLLM replicates, a layout not laid out here.
    shared = getattr(config, "shared_expert_intermediate_size", 0) or 0
    check_moe(problems, tp, config.model_type, layers=config.num_hidden_layers, moe_layers=moe,
              intermediate_size=getattr(config, "intermediate_size", 0), experts=(f"num_experts={E}", E),
              expert_size=("moe_intermediate_size", getattr(config, "moe_intermediate_size", 0)),
              expert_parallel=expert_parallel, vllm_refuses_tp_over_experts=True,
              shared=(f"shared_expert_intermediate_size={shared}", shared))
    raise_problems(f"hf_to_vllm: {config.model_type} (hidden_size={config.hidden_size}, heads={nq}, linear heads "
                   f"k={config.linear_num_key_heads} v={config.linear_num_value_heads}), tp={tp}", problems)


def build_hybrid(config: Any, b: RecipeBuilder, *, expert_parallel: bool, quantization: str | None) -> None:
    """Lay out one Qwen3-Next or Qwen3.5 model on ``b`` (a registry builder, see
    :data:`~tritonreshard.recipes.RECIPES`). Raises ``ValueError`` naming every size vLLM cannot
    split over ``b.tp`` and any ``quantization`` (not laid out for it yet)."""
    moe = _moe_layers(config)
    _check(config, b.tp, moe, expert_parallel, quantization)
    H, V = config.hidden_size, config.vocab_size
    b.source("model.embed_tokens.weight", (V, H))
    b.vocab("model.embed_tokens.weight", "model.embed_tokens.weight", V, H)
    for i, kind in enumerate(config.layer_types[:config.num_hidden_layers]):
        pre = f"model.layers.{i}"
        if kind == "linear_attention":
            _linear_attention(b, config, f"{pre}.linear_attn")
        else:
            _gated_attention(b, config, f"{pre}.self_attn")
        if i in moe:
            E, moe_i, shared = config.num_experts, config.moe_intermediate_size, config.shared_expert_intermediate_size
            b.same(f"{pre}.mlp.gate.weight", (E, H), Replicate())
            if shared:
                b.same(f"{pre}.mlp.shared_expert_gate.weight", (1, H), Replicate())
                b.gate_up(f"{pre}.mlp.shared_expert", "weight", (H,), shared)
                b.same(f"{pre}.mlp.shared_expert.down_proj.weight", (H, shared), Shard(1))
            b.experts(f"{pre}.mlp", E, moe_i, H, expert_parallel)
        else:
            b.gate_up(f"{pre}.mlp", "weight", (H,), config.intermediate_size)
            b.same(f"{pre}.mlp.down_proj.weight", (H, config.intermediate_size), Shard(1))
        b.same(f"{pre}.input_layernorm.weight", (H,), Replicate())
        b.same(f"{pre}.post_attention_layernorm.weight", (H,), Replicate())
    b.same("model.norm.weight", (H,), Replicate())
    if not getattr(config, "tie_word_embeddings", False):
        b.source("lm_head.weight", (V, H))
        b.vocab("lm_head.weight", "lm_head.weight", V, H)


def _linear_attention(b: RecipeBuilder, config: Any, pre: str) -> None:
    """One gated-DeltaNet layer (``pre``: ``model.layers.{i}.linear_attn``)."""
    H, nv = config.hidden_size, config.linear_num_value_heads
    kd = config.linear_num_key_heads * config.linear_key_head_dim
    vd = nv * config.linear_value_head_dim
    if config.model_type in _SPLIT_PROJECTIONS:
        qkv_, z, b_, a = (f"{pre}.in_proj_{x}.weight" for x in ("qkv", "z", "b", "a"))
        b.source(qkv_, (2 * kd + vd, H))
        b.source(z, (vd, H))
        b.target(f"{pre}.in_proj_qkvz.weight", (2 * kd + 2 * vd, H), Shard(0, (kd, kd, vd, vd)),
                 [Part(qkv_, [(0, 2 * kd + vd), None]), Part(z, [(2 * kd + vd, 2 * kd + 2 * vd), None])])
        b.source(b_, (nv, H))
        b.source(a, (nv, H))
        b.target(f"{pre}.in_proj_ba.weight", (2 * nv, H), Shard(0, (nv, nv)),
                 [Part(b_, [(0, nv), None]), Part(a, [(nv, 2 * nv), None])])
    else:
        b.same(f"{pre}.in_proj_qkvz.weight", (2 * kd + 2 * vd, H), Shard(0))  # one block: whole key-head groups
        b.same(f"{pre}.in_proj_ba.weight", (2 * nv, H), Shard(0))
    b.source(f"{pre}.conv1d.weight", (2 * kd + vd, 1, config.linear_conv_kernel_dim))
    b.target(f"{pre}.conv1d.weight", (2 * kd + vd, 1, config.linear_conv_kernel_dim), Shard(0, (kd, kd, vd)))
    b.same(f"{pre}.dt_bias", (nv,), Shard(0))
    b.source(f"{pre}.A_log", (nv,))
    b.target(f"{pre}.A_log", (nv,), Shard(0), dtype=torch.float32)  # float32 in vLLM whatever the model's dtype
    b.same(f"{pre}.norm.weight", (config.linear_value_head_dim,), Replicate())
    b.same(f"{pre}.out_proj.weight", (H, vd), Shard(1))


def _gated_attention(b: RecipeBuilder, config: Any, att: str) -> None:
    """One gated full-attention layer: ``q_proj`` holds each head's query and gate rows."""
    H, nq = config.hidden_size, config.num_attention_heads
    nkv = getattr(config, "num_key_value_heads", None) or nq
    hd = getattr(config, "head_dim", None) or H // nq
    Q, kv = 2 * nq * hd, nkv * hd
    q, k, v = (f"{att}.{x}_proj.weight" for x in "qkv")
    b.source(q, (Q, H))
    b.source(k, (kv, H))
    b.source(v, (kv, H))
    qkv(b, f"{att}.qkv_proj.weight", (H,), Q, nkv, hd, (q, 0), (k, 0), (v, 0))
    b.same(f"{att}.o_proj.weight", (H, nq * hd), Shard(1))
    b.same(f"{att}.q_norm.weight", (hd,), Replicate())
    b.same(f"{att}.k_norm.weight", (hd,), Replicate())
