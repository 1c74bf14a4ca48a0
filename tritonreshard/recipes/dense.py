"""Llama, Mistral, Qwen2, Qwen3 and Qwen3-MoE (transformers 5) parameters -> vLLM tensor-parallel parameters.

Pure Python planning (no transformers or vLLM import), reached through
:func:`~tritonreshard.recipes.hf_to_vllm` (``config.model_type`` in :data:`FAMILIES`). Facts follow
vLLM 0.32's ``models/{llama,qwen2,qwen3,qwen3_moe}.py`` loaders, per TP rank r:

* ``qkv_proj`` (``QKVParallelLinear``): rank r holds ``[q heads of r | k | v]``; when tp >= the KV-head
  count the KV heads are replicated, ``replicas = tp // num_kv_heads`` and rank r holds KV head
  ``r // replicas``. Here the destination's global index then counts one KV head per rank (``tp``
  heads per K/V block), and every replica's box maps to the same source rows.
* ``gate_up_proj``: ``[gate chunk r | up chunk r]`` (:meth:`RecipeBuilder.gate_up`).
* ``o_proj``, ``down_proj`` (``RowParallelLinear``): split on dim 1; their biases are replicated.
* ``embed_tokens``, ``lm_head``: padded vocab split by rows (:meth:`RecipeBuilder.vocab`). Tied
  embeddings expose only ``model.embed_tokens.weight``.
* MoE layers (Qwen3-MoE): routed experts as :meth:`RecipeBuilder.experts` lays them out (vLLM 0.32's
  Qwen3-MoE refuses ``tp > num_experts``, with or without EP); the router ``mlp.gate.weight`` is
  replicated.

A family is one row of :data:`FAMILIES`; a new architecture is a few lines there.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..layout import Part, Replicate, Shard
from .builder import RecipeBuilder, check_attention, check_moe, check_vocab, raise_problems

__all__ = ["Family", "FAMILIES", "moe_layers", "build_dense"]


@dataclass(frozen=True)
class Family:
    """What differs between architecture families. Each flag is a bool, or the name of a config
    attribute that holds it (``"attention_bias"``)."""

    qkv_bias: bool | str = False
    o_bias: bool | str = False
    mlp_bias: bool | str = False
    qk_norm: bool = False
    moe: bool = False


#: ``config.model_type`` -> family. Checked against vLLM 0.32's models/{llama,qwen2,qwen3,qwen3_moe}.py.
FAMILIES: dict[str, Family] = {
    "llama": Family(qkv_bias="attention_bias", o_bias="attention_bias", mlp_bias="mlp_bias"),
    "mistral": Family(),
    "qwen2": Family(qkv_bias=True),
    "qwen3": Family(qkv_bias="attention_bias", qk_norm=True),             # vLLM's o_proj has no bias
    "qwen3_moe": Family(qkv_bias="attention_bias", qk_norm=True, moe=True),
}


def _flag(value: bool | str, config: Any) -> bool:
    return bool(getattr(config, value, False)) if isinstance(value, str) else value


def moe_layers(config: Any) -> set[int]:
    """The layers that hold routed experts (vLLM's and transformers' Qwen3-MoE rule: not in
    ``mlp_only_layers``, and ``(i + 1) % decoder_sparse_step == 0``); empty for a dense family."""
    if not FAMILIES[config.model_type].moe or not getattr(config, "num_experts", 0):
        return set()
    only = set(getattr(config, "mlp_only_layers", None) or ())
    step = getattr(config, "decoder_sparse_step", 1) or 1
    return {i for i in range(config.num_hidden_layers) if i not in only and (i + 1) % step == 0}


def build_dense(config: Any, b: RecipeBuilder, *, expert_parallel: bool, quantization: str | None) -> None:
    """Lay out one model of a :data:`FAMILIES` family on ``b`` (a registry builder, see
    :data:`~tritonreshard.recipes.RECIPES`; ``quantization`` is applied by the caller afterwards).
    Raises ``ValueError`` naming every size vLLM cannot split over ``b.tp`` (heads, KV heads,
    intermediate sizes, padded vocab, experts)."""
    fam = FAMILIES[config.model_type]
    tp = b.tp
    H = config.hidden_size
    nq = config.num_attention_heads
    nkv = getattr(config, "num_key_value_heads", None) or nq
    hd = getattr(config, "head_dim", None) or H // nq
    inter = getattr(config, "intermediate_size", 0)
    V = config.vocab_size
    L = config.num_hidden_layers
    tied = bool(getattr(config, "tie_word_embeddings", False))
    moe = moe_layers(config)
    E = getattr(config, "num_experts", 0)
    moe_i = getattr(config, "moe_intermediate_size", 0)

    problems: list[str] = []
    check_attention(problems, tp, nq, nkv)
    check_vocab(V, tp, problems)
    # vLLM's Qwen3MoeSparseMoeBlock refuses tp > num_experts, with or without EP; a MoE family's
    # config may also have no expert layer at all, which expert_parallel then leaves alone.
    check_moe(problems, tp, config.model_type, layers=L, moe_layers=moe, intermediate_size=inter,
              experts=(f"num_experts={E}", E), expert_size=("moe_intermediate_size", moe_i),
              expert_parallel=expert_parallel, vllm_refuses_tp_over_experts=True,
              lacking=None if fam.moe else "experts")
    raise_problems(f"hf_to_vllm: {config.model_type} (hidden_size={H}, heads={nq}, kv_heads={nkv}, "
                   f"head_dim={hd}), tp={tp}", problems)

    b.source("model.embed_tokens.weight", (V, H))
    b.vocab("model.embed_tokens.weight", "model.embed_tokens.weight", V, H)
    for i in range(L):
        pre = f"model.layers.{i}"
        _attention(b, config, fam, f"{pre}.self_attn", H, nq, nkv, hd)
        if i in moe:
            b.same(f"{pre}.mlp.gate.weight", (E, H), Replicate())
            b.experts(f"{pre}.mlp", E, moe_i, H, expert_parallel)
        else:
            b.gate_up(f"{pre}.mlp", "weight", (H,), inter)
            b.same(f"{pre}.mlp.down_proj.weight", (H, inter), Shard(1))
            if _flag(fam.mlp_bias, config):
                b.gate_up(f"{pre}.mlp", "bias", (), inter)
                b.same(f"{pre}.mlp.down_proj.bias", (H,), Replicate())
        b.same(f"{pre}.input_layernorm.weight", (H,), Replicate())
        b.same(f"{pre}.post_attention_layernorm.weight", (H,), Replicate())
    b.same("model.norm.weight", (H,), Replicate())
    if not tied:
        b.source("lm_head.weight", (V, H))
        b.vocab("lm_head.weight", "lm_head.weight", V, H)


def _attention(b: RecipeBuilder, config: Any, fam: Family, att: str, H: int, nq: int, nkv: int, hd: int) -> None:
    """One layer's attention (``att``: ``model.layers.{i}.self_attn``): qkv_proj (and its bias),
    o_proj (and its bias), the q/k norms, as ``fam`` has them."""
    _qkv(b, att, "weight", (H,), nq * hd, nkv, hd)
    if _flag(fam.qkv_bias, config):
        _qkv(b, att, "bias", (), nq * hd, nkv, hd)
    b.same(f"{att}.o_proj.weight", (H, nq * hd), Shard(1))
    if _flag(fam.o_bias, config):
        b.same(f"{att}.o_proj.bias", (H,), Replicate())
    if fam.qk_norm:
        b.same(f"{att}.q_norm.weight", (hd,), Replicate())
        b.same(f"{att}.k_norm.weight", (hd,), Replicate())


def _qkv(b: RecipeBuilder, pre: str, suffix: str, tail: tuple, Q: int, nkv: int, hd: int) -> None:
    """q/k/v -> qkv_proj (weight: tail=(H,), bias: tail=()); ``Q``: the query rows (heads * hd)."""
    tp = b.tp
    q, k, v = (f"{pre}.{x}_proj.{suffix}" for x in "qkv")
    b.source(q, (Q, *tail))
    b.source(k, (nkv * hd, *tail))
    b.source(v, (nkv * hd, *tail))
    rest = [None] * len(tail)
    if tp <= nkv:
        kv = nkv * hd
        plist = [Part(q, [(0, Q), *rest]), Part(k, [(Q, Q + kv), *rest]), Part(v, [(Q + kv, Q + 2 * kv), *rest])]
    else:  # one KV head per rank: rank r's box comes from head r // replicas
        kv, rep = tp * hd, tp // nkv
        plist = [Part(q, [(0, Q), *rest])]
        for base, name in ((Q, k), (Q + kv, v)):
            plist += [Part(name, [(base + j * hd, base + (j + 1) * hd), *rest],
                           ((j // rep) * hd, *([0] * len(tail)))) for j in range(tp)]
    b.target(f"{pre}.qkv_proj.{suffix}", (Q + 2 * kv, *tail), Shard(0, (Q, kv, kv)), plist)
