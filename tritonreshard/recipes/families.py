"""Mixtral, Phi-3, GLM-4.5 MoE and Gemma 3 (transformers 5) parameters -> vLLM tensor-parallel parameters.

Pure Python planning (no transformers or vLLM import), reached through
:func:`~tritonreshard.recipes.hf_to_vllm` (``config.model_type`` in :data:`FAMILY_MODEL_TYPES`). Facts
follow vLLM 0.32's ``models/{mixtral,phi3,glm4_moe,gemma3}.py`` loaders, per TP rank r (each checked
element by element against those loaders by ``tests/test_families.py``):

* attention: ``qkv_proj`` ``[q heads of r | k | v]`` as in Llama (KV heads replicated when
  ``tp > num_key_value_heads``, :func:`qkv`), ``o_proj`` split on dim 1;
* Phi-3's checkpoint is already fused, and fused differently: its ``qkv_proj`` is ``[q | k | v]``
  whole and its ``gate_up_proj`` ``[gate | up]`` whole, while vLLM's rank r holds
  ``[q chunk r | k chunk r | v chunk r]`` and ``[gate chunk r | up chunk r]``. The same name and
  global shape on both sides hide that: each rank's rows come from three (two) separate row ranges
  of the one source;
* Mixtral: transformers 5 names the MoE block ``mlp``, vLLM ``block_sparse_moe``
  (``mlp.gate.weight`` -> ``block_sparse_moe.gate.weight``, ``mlp.experts.gate_up_proj`` ->
  ``block_sparse_moe.experts.routed_experts.w13_weight``); experts split by TP on their
  intermediate dim, or whole under expert parallelism (placed like ``determine_expert_map``);
* GLM-4.5 MoE (``glm4_moe``): layers ``< first_k_dense_replace`` dense, the others routed experts plus
  ``shared_experts``; the router ``mlp.gate.weight`` and ``mlp.gate.e_score_correction_bias`` are
  float32 in vLLM whatever the model's dtype (its ``GateLinear(params_dtype=torch.float32)``); the
  bias is a float32 buffer in transformers (whole on every FSDP trainer: ``Replicate``);
  ``attention_bias`` biases ``qkv_proj`` only, ``use_qk_norm`` adds ``q_norm`` / ``k_norm``;
* Gemma 3 (text, ``gemma3_text``): ``q_norm`` / ``k_norm`` and four norms per layer, copied as stored
  (vLLM's ``GemmaRMSNorm`` adds the 1 at run time, as transformers does); ``attention_bias``
  biases ``qkv_proj`` and ``o_proj``; tied embeddings expose only ``embed_tokens``.
"""
from __future__ import annotations

from typing import Any

import torch

from ..layout import Part, Replicate, Shard
from .builder import RecipeBuilder, check_attention, check_moe, check_vocab, raise_problems, shared_experts

__all__ = ["FAMILY_MODEL_TYPES", "build_family", "qkv"]

#: ``config.model_type`` values this module lays out.
FAMILY_MODEL_TYPES = ("mixtral", "phi3", "glm4_moe", "gemma3_text")


def qkv(b: RecipeBuilder, dst: str, tail: tuple, Q: int, nkv: int, hd: int, q: tuple[str, int],
        k: tuple[str, int], v: tuple[str, int]) -> None:
    """vLLM's ``qkv_proj`` ``dst`` (weight: ``tail=(H,)``, bias: ``tail=()``) from the query, key and
    value rows ``q``, ``k``, ``v``: each ``(source name, its first row there)``, so one fused
    source (Phi-3) or three (Llama's q/k/v_proj) alike. ``Q``: the query rows (heads * hd). When
    ``tp > nkv`` the destination's K and V blocks count one head per rank, rank r's from KV head
    ``r // (tp // nkv)``."""
    tp = b.tp
    rest, zeros = [None] * len(tail), (0,) * len(tail)
    plist = [Part(q[0], [(0, Q), *rest], (q[1], *zeros))]
    if tp <= nkv:
        kv = nkv * hd
        plist += [Part(k[0], [(Q, Q + kv), *rest], (k[1], *zeros)),
                  Part(v[0], [(Q + kv, Q + 2 * kv), *rest], (v[1], *zeros))]
    else:
        kv, rep = tp * hd, tp // nkv
        for base, (name, start) in ((Q, k), (Q + kv, v)):
            plist += [Part(name, [(base + j * hd, base + (j + 1) * hd), *rest], (start + (j // rep) * hd, *zeros))
                      for j in range(tp)]
    b.target(dst, (Q + 2 * kv, *tail), Shard(0, (Q, kv, kv)), plist)


def _sizes(config: Any) -> dict[str, Any]:
    nq = config.num_attention_heads
    return dict(H=config.hidden_size, nq=nq, nkv=getattr(config, "num_key_value_heads", None) or nq,
                hd=getattr(config, "head_dim", None) or config.hidden_size // nq, V=config.vocab_size,
                L=config.num_hidden_layers, inter=getattr(config, "intermediate_size", 0) or 0,
                tied=bool(getattr(config, "tie_word_embeddings", False)))


def _moe(config: Any) -> tuple[set[int], int, int, int]:
    """(MoE layers, routed experts, their intermediate size, shared experts) as vLLM reads them."""
    if config.model_type == "mixtral":
        return set(range(config.num_hidden_layers)), config.num_local_experts, config.intermediate_size, 0
    if config.model_type == "glm4_moe" and getattr(config, "n_routed_experts", None):
        first = getattr(config, "first_k_dense_replace", 0) or 0
        return (set(range(first, config.num_hidden_layers)), config.n_routed_experts, config.moe_intermediate_size,
                getattr(config, "n_shared_experts", 0) or 0)
    return set(), 0, 0, 0


def _check(config: Any, tp: int, s: dict, moe: set[int], E: int, moe_i: int, n_shared: int,
           expert_parallel: bool, quantization: str | None) -> None:
    problems: list[str] = []
    if quantization is not None:
        problems.append(f"quantization={quantization!r} is not laid out for {config.model_type} yet")
    check_attention(problems, tp, s["nq"], s["nkv"])
    check_vocab(s["V"], tp, problems)
    check_moe(problems, tp, config.model_type, layers=s["L"], moe_layers=moe, intermediate_size=s["inter"],
              experts=(f"the {E} experts", E), expert_size=("the experts' intermediate size", moe_i),
              expert_parallel=expert_parallel, shared=shared_experts(moe_i, n_shared))
    raise_problems(f"hf_to_vllm: {config.model_type} (hidden_size={s['H']}, heads={s['nq']}, "
                   f"kv_heads={s['nkv']}, head_dim={s['hd']}), tp={tp}", problems)


def build_family(config: Any, b: RecipeBuilder, *, expert_parallel: bool, quantization: str | None) -> None:
    """Lay out one Mixtral, Phi-3, GLM-4.5 MoE or Gemma 3 model on ``b`` (a registry builder, see
    :data:`~tritonreshard.recipes.RECIPES`). Raises ``ValueError`` naming every size vLLM cannot
    split over ``b.tp`` and any ``quantization`` (not laid out for these families yet)."""
    s, mt = _sizes(config), config.model_type
    moe, E, moe_i, n_shared = _moe(config)
    _check(config, b.tp, s, moe, E, moe_i, n_shared, expert_parallel, quantization)
    H, inter = s["H"], s["inter"]
    b.source("model.embed_tokens.weight", (s["V"], H))
    b.vocab("model.embed_tokens.weight", "model.embed_tokens.weight", s["V"], H)
    for i in range(s["L"]):
        pre = f"model.layers.{i}"
        _attention(b, config, f"{pre}.self_attn", s)
        if i in moe:
            _moe_block(b, config, pre, E, moe_i, n_shared, H, expert_parallel)
        elif mt == "phi3":  # fused [gate | up] whole in the checkpoint
            name = f"{pre}.mlp.gate_up_proj.weight"
            b.source(name, (2 * inter, H))
            b.target(name, (2 * inter, H), Shard(0, (inter, inter)), [Part(name, [None, None])])
            b.same(f"{pre}.mlp.down_proj.weight", (H, inter), Shard(1))
        else:
            b.gate_up(f"{pre}.mlp", "weight", (H,), inter)
            b.same(f"{pre}.mlp.down_proj.weight", (H, inter), Shard(1))
        norms = ("input_layernorm", "post_attention_layernorm")
        if mt == "gemma3_text":
            norms += ("pre_feedforward_layernorm", "post_feedforward_layernorm")
        for norm in norms:
            b.same(f"{pre}.{norm}.weight", (H,), Replicate())
    b.same("model.norm.weight", (H,), Replicate())
    if not s["tied"]:
        b.source("lm_head.weight", (s["V"], H))
        b.vocab("lm_head.weight", "lm_head.weight", s["V"], H)


def _attention(b: RecipeBuilder, config: Any, att: str, s: dict) -> None:
    """One layer's ``self_attn``: qkv_proj (fused source for Phi-3), its bias, o_proj, the q/k norms."""
    mt, H, nq, nkv, hd = config.model_type, s["H"], s["nq"], s["nkv"], s["hd"]
    Q, kv = nq * hd, nkv * hd
    bias = bool(getattr(config, "attention_bias", False)) and mt in ("glm4_moe", "gemma3_text")
    if mt == "phi3":
        name = f"{att}.qkv_proj.weight"
        b.source(name, (Q + 2 * kv, H))
        qkv(b, name, (H,), Q, nkv, hd, (name, 0), (name, Q), (name, Q + kv))
    else:
        for suffix, tail in (("weight", (H,)),) + ((("bias", ()),) if bias else ()):
            q, k, v = (f"{att}.{x}_proj.{suffix}" for x in "qkv")
            b.source(q, (Q, *tail))
            b.source(k, (kv, *tail))
            b.source(v, (kv, *tail))
            qkv(b, f"{att}.qkv_proj.{suffix}", tail, Q, nkv, hd, (q, 0), (k, 0), (v, 0))
    b.same(f"{att}.o_proj.weight", (H, Q), Shard(1))
    if bias and mt == "gemma3_text":
        b.same(f"{att}.o_proj.bias", (H,), Replicate())
    if mt == "gemma3_text" or (mt == "glm4_moe" and getattr(config, "use_qk_norm", False)):
        b.same(f"{att}.q_norm.weight", (hd,), Replicate())
        b.same(f"{att}.k_norm.weight", (hd,), Replicate())


def _moe_block(b: RecipeBuilder, config: Any, pre: str, E: int, moe_i: int, n_shared: int, H: int,
               expert_parallel: bool) -> None:
    """One MoE layer's router, shared experts (GLM) and routed experts."""
    if config.model_type == "mixtral":
        b.source(f"{pre}.mlp.gate.weight", (E, H))
        b.target(f"{pre}.block_sparse_moe.gate.weight", (E, H), Replicate(),
                 [Part(f"{pre}.mlp.gate.weight", [None, None])])
        b.experts(f"{pre}.mlp", E, moe_i, H, expert_parallel, dst=f"{pre}.block_sparse_moe")
        return
    gate = f"{pre}.mlp.gate.weight"  # GLM: vLLM's router is float32 whatever the model's dtype
    b.source(gate, (E, H))
    b.target(gate, (E, H), Replicate(), dtype=torch.float32)
    bias = f"{pre}.mlp.gate.e_score_correction_bias"  # a float32 buffer in transformers: whole on every trainer
    b.source(bias, (E,), Replicate(), torch.float32)
    b.target(bias, (E,), Replicate(), dtype=torch.float32)
    if n_shared:
        b.gate_up(f"{pre}.mlp.shared_experts", "weight", (H,), moe_i * n_shared)
        b.same(f"{pre}.mlp.shared_experts.down_proj.weight", (H, moe_i * n_shared), Shard(1))
    b.experts(f"{pre}.mlp", E, moe_i, H, expert_parallel)
