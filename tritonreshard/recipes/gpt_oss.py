"""gpt-oss (transformers 5 ``GptOssForCausalLM``) parameters -> vLLM tensor-parallel parameters.

Pure Python planning (no transformers or vLLM import), reached through
:func:`~tritonreshard.recipes.hf_to_vllm` (``config.model_type == "gpt_oss"``). Facts follow vLLM
0.32's ``models/gpt_oss.py`` bf16 loader (``_load_weights_other``), per TP rank r (each checked
element by element against that loader by ``tests/test_gpt_oss.py``):

* attention (``attn``): ``qkv_proj`` weight and bias ``[q heads of r | k | v]`` as in Llama
  (:func:`~.families.qkv`; ``tp`` at most ``num_key_value_heads``, which vLLM never replicates
  here), ``o_proj`` split on dim 1 with its bias whole on every rank, ``sinks`` (one per query
  head) split by heads;
* ``mlp.router`` weight and bias whole on every rank;
* routed experts, fused in the checkpoint as transformers holds them: ``gate_up_proj`` ``[E, H, 2I]``
  (gate and up interleaved, kept interleaved), ``down_proj`` ``[E, I, H]``. vLLM's loader holds
  them transposed: ``w13_weight`` ``[E, 2I, H]`` is ``gate_up_proj[:, :, 2 I r/tp : 2 I (r+1)/tp]
  .permute(0, 2, 1)`` and ``w2_weight`` ``[E, H, I]`` is ``down_proj[:, I r/tp : I (r+1)/tp, :]
  .permute(0, 2, 1)``: one transposed part each (``Part(src_dims=(0, 2, 1))``), which only
  single-host plans move (cross-host and FP8 plans refuse them by name). ``w13_bias`` is
  ``gate_up_proj_bias[:, 2 I r/tp : 2 I (r+1)/tp]``; ``w2_bias`` is ``down_proj_bias`` on rank 0 and
  zeros elsewhere (the loader zeroes it off rank 0): a ``[tp E, H]`` destination split by rows,
  rank 0's rows from the source, the others a zero box. With ``expert_parallel`` each rank holds
  ``E / tp`` whole experts of all four (the loader's ``experts_per_rank = E // ep_size``);
* ``model.embed_tokens`` -> ``model.embedding`` and ``lm_head`` with vLLM's padded vocab; the norms whole.
"""
from __future__ import annotations

from typing import Any

from ..layout import Part, Replicate, Shard
from .builder import RecipeBuilder, check_attention, check_divisible, check_vocab, raise_problems
from .families import qkv

__all__ = ["GPT_OSS_MODEL_TYPES", "build_gpt_oss"]

#: ``config.model_type`` values this module lays out.
GPT_OSS_MODEL_TYPES = ("gpt_oss",)

#: The routed experts' weights as vLLM's loader holds them: ``box.permute(0, 2, 1)``.
_TRANSPOSE = (0, 2, 1)


def _sizes(config: Any) -> dict[str, int]:
    nq = config.num_attention_heads
    return dict(H=config.hidden_size, nq=nq, nkv=getattr(config, "num_key_value_heads", None) or nq,
                hd=getattr(config, "head_dim", None) or config.hidden_size // nq, V=config.vocab_size,
                L=config.num_hidden_layers, E=config.num_local_experts, I=config.intermediate_size)


def _check(config: Any, tp: int, s: dict, expert_parallel: bool, quantization: str | None) -> None:
    """One ``ValueError`` naming every size vLLM's gpt-oss loader cannot split over ``tp``."""
    problems: list[str] = []
    if quantization is not None:  # the experts are transposed parts, which FP8 block plans refuse
        problems.append(f"quantization={quantization!r} is not laid out for gpt_oss (its routed experts are "
                        f"transposed parts, which block quantization does not read)")
    check_attention(problems, tp, s["nq"], s["nkv"], family="gpt-oss")  # GptOssAttention: nkv // tp a rank
    check_vocab(s["V"], tp, problems)
    if expert_parallel:
        # vLLM's loader narrows experts [ep_rank * (E // tp), (ep_rank + 1) * (E // tp)): unless tp
        # divides E it would not load the experts its layer's expert map places on the rank.
        check_divisible(problems, "num_local_experts", s["E"], tp)
    else:
        check_divisible(problems, "intermediate_size", s["I"], tp)
    if getattr(config, "tie_word_embeddings", False):
        problems.append("tie_word_embeddings=True is not laid out for gpt_oss (vLLM's GptOssForCausalLM keeps "
                        "its own lm_head)")
    raise_problems(f"hf_to_vllm: gpt_oss (hidden_size={s['H']}, heads={s['nq']}, kv_heads={s['nkv']}, "
                   f"head_dim={s['hd']}, experts={s['E']}, intermediate_size={s['I']}), tp={tp}", problems)


def build_gpt_oss(config: Any, b: RecipeBuilder, *, expert_parallel: bool, quantization: str | None) -> None:
    """Lay out one gpt-oss model on ``b`` (a registry builder, see
    :data:`~tritonreshard.recipes.RECIPES`). Raises ``ValueError`` naming every size vLLM cannot
    split over ``b.tp`` and any ``quantization`` (not laid out for gpt-oss)."""
    s = _sizes(config)
    _check(config, b.tp, s, expert_parallel, quantization)
    H, V = s["H"], s["V"]
    b.source("model.embed_tokens.weight", (V, H))
    b.vocab("model.embed_tokens.weight", "model.embedding.weight", V, H)
    for i in range(s["L"]):
        pre = f"model.layers.{i}"
        _attention(b, pre, s)
        _experts(b, pre, s, expert_parallel)
        for norm in ("input_layernorm", "post_attention_layernorm"):
            b.same(f"{pre}.{norm}.weight", (H,), Replicate())
    b.same("model.norm.weight", (H,), Replicate())
    b.source("lm_head.weight", (V, H))
    b.vocab("lm_head.weight", "lm_head.weight", V, H)


def _attention(b: RecipeBuilder, pre: str, s: dict) -> None:
    """HF ``self_attn`` -> vLLM ``attn``: qkv_proj and its bias, o_proj and its bias, the sinks."""
    H, nq, nkv, hd = s["H"], s["nq"], s["nkv"], s["hd"]
    Q, kv = nq * hd, nkv * hd
    hf, att = f"{pre}.self_attn", f"{pre}.attn"
    for suffix, tail in (("weight", (H,)), ("bias", ())):
        q, k, v = (f"{hf}.{x}_proj.{suffix}" for x in "qkv")
        b.source(q, (Q, *tail))
        b.source(k, (kv, *tail))
        b.source(v, (kv, *tail))
        qkv(b, f"{att}.qkv_proj.{suffix}", tail, Q, nkv, hd, (q, 0), (k, 0), (v, 0))
    for suffix, shape, placement in (("weight", (H, Q), Shard(1)), ("bias", (H,), Replicate())):
        b.source(f"{hf}.o_proj.{suffix}", shape)
        b.target(f"{att}.o_proj.{suffix}", shape, placement, [Part(f"{hf}.o_proj.{suffix}", [None] * len(shape))])
    b.source(f"{hf}.sinks", (nq,))
    b.target(f"{att}.sinks", (nq,), Shard(0), [Part(f"{hf}.sinks", [None])])


def _experts(b: RecipeBuilder, pre: str, s: dict, expert_parallel: bool) -> None:
    """The router and the routed experts (see the module docstring)."""
    H, E, inter, tp = s["H"], s["E"], s["I"], b.tp
    b.same(f"{pre}.mlp.router.weight", (E, H), Replicate())
    b.same(f"{pre}.mlp.router.bias", (E,), Replicate())
    hf, dst = f"{pre}.mlp.experts", f"{pre}.mlp.experts.routed_experts"
    b.source(f"{hf}.gate_up_proj", (E, H, 2 * inter))
    b.source(f"{hf}.gate_up_proj_bias", (E, 2 * inter))
    b.source(f"{hf}.down_proj", (E, inter, H))
    b.source(f"{hf}.down_proj_bias", (E, H))
    # gate and up stay interleaved: rank r's 2I/tp columns are one contiguous run, plain Shard.
    ep = Shard(0)   # whole experts, E // tp per rank (checked: tp divides E)
    b.target(f"{dst}.w13_weight", (E, 2 * inter, H), ep if expert_parallel else Shard(1),
             [Part(f"{hf}.gate_up_proj", [None] * 3, src_dims=_TRANSPOSE)])
    b.target(f"{dst}.w13_bias", (E, 2 * inter), ep if expert_parallel else Shard(1),
             [Part(f"{hf}.gate_up_proj_bias", [None] * 2)])
    b.target(f"{dst}.w2_weight", (E, H, inter), ep if expert_parallel else Shard(2),
             [Part(f"{hf}.down_proj", [None] * 3, src_dims=_TRANSPOSE)])
    if expert_parallel or tp == 1:
        b.target(f"{dst}.w2_bias", (E, H), ep if expert_parallel else Replicate(),
                 [Part(f"{hf}.down_proj_bias", [None] * 2)])
        return
    # The loader zeroes w2_bias off TP rank 0 (the row-parallel down projection adds it once): rows
    # [0, E) of a [tp E, H] tensor split by rows are rank 0's, the rest a zero box.
    b.target(f"{dst}.w2_bias", (tp * E, H), Shard(0),
             [Part(f"{hf}.down_proj_bias", [(0, E), None]), Part(None, [(E, tp * E), None])])
