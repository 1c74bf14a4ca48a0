"""Hugging Face (transformers 5) training parameters -> vLLM tensor-parallel parameters.

Pure Python planning (no transformers or vLLM import): a recipe reads a ``transformers`` config's
fields and returns the source layouts (FSDP rows of the HF parameters over the trainer ranks), the
destination layouts (vLLM's ``named_parameters()`` on each TP rank) and the :class:`~tritonreshard.Part`
mapping between them. Facts follow vLLM 0.32's loaders:

* ``qkv_proj`` (``QKVParallelLinear``): rank r holds ``[q heads of r | k | v]``; when tp >= the KV-head
  count the KV heads are replicated, ``replicas = tp // num_kv_heads`` and rank r holds KV head
  ``r // replicas``. Here the destination's global index then counts one KV head per rank (``tp``
  heads per K/V block), and every replica's box maps to the same source rows.
* ``gate_up_proj`` (``MergedColumnParallelLinear``): ``[gate chunk r | up chunk r]`` on dim 0.
* ``o_proj``, ``down_proj`` (``RowParallelLinear``): split on dim 1; their biases are replicated.
* ``embed_tokens``, ``lm_head`` (``VocabParallelEmbedding`` / ``ParallelLMHead``): the vocab is padded
  to a multiple of 64 (``pad_vocab_size``) and split by rows; padding rows are zero. Tied embeddings
  expose only ``model.embed_tokens.weight``.
* MoE ``mlp.experts.routed_experts.w13_weight`` ``[E, 2I, H]`` from ``mlp.experts.gate_up_proj`` (gate
  first): ``[gate chunk r | up chunk r]`` on dim 1; ``w2_weight`` ``[E, H, I]`` from
  ``mlp.experts.down_proj``, split on dim 2 (vLLM 0.32's Qwen3-MoE refuses ``tp > num_experts`` even
  so; DeepSeek's does not). With ``expert_parallel=True`` each rank holds whole experts (dim 0),
  placed as vLLM's ``determine_expert_map`` ("linear") does: the first ``E % tp`` ranks hold one
  expert more (``Shard(0, balanced=True)``, not ``torch.chunk``). The router ``mlp.gate.weight`` is
  replicated.

A family is one row of :data:`FAMILIES`; a new architecture is a few lines there.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..layout import Layout, Part, Replicate, Shard
from ..planning import BlockQuant, Plan, plan_quantized
from .fp8 import check_quantization, quantize_destinations

__all__ = ["hf_to_vllm", "RecipeSpec", "RecipeBuilder", "Family", "FAMILIES", "pad_vocab_size", "vllm_layout"]

#: vLLM's ``DEFAULT_VOCAB_PADDING_SIZE``.
VOCAB_PADDING = 64


def pad_vocab_size(vocab_size: int, pad_to: int = VOCAB_PADDING) -> int:
    """The vocab rounded up to a multiple of ``pad_to`` (vLLM's ``pad_vocab_size``)."""
    return -(-vocab_size // pad_to) * pad_to


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


@dataclass(frozen=True)
class RecipeSpec:
    """A refit between HF training parameters and vLLM tensor-parallel parameters.

    ``src``: ``{HF parameter name: Layout}``, global HF shapes, ``Shard(0)`` over the trainer ranks
    (FSDP rows), the trainer dtype. ``dst``: ``{vLLM parameter name: Layout}`` over the inference
    ranks, ``layout.local_shape(r)`` is exactly vLLM's parameter shape on TP rank r. ``parts``: the
    ``{dst name: [Part, ...]}`` mapping. ``plan()``: the validated, cached Plan.
    """

    model_type: str
    tp: int
    expert_parallel: bool
    src: dict[str, Layout] = field(repr=False)
    dst: dict[str, Layout] = field(repr=False)
    parts: dict[str, tuple[Part, ...]] = field(repr=False)
    #: ``{weight name: BlockQuant}`` of FP8-block destinations (``quantization=``); empty otherwise.
    quant: dict[str, BlockQuant] = field(default_factory=dict, repr=False)

    def plan(self, rank: int | None = None) -> Plan:
        """The whole plan, or with ``rank`` that rank's part of it (``plan_reshard(..., rank=)``)."""
        return plan_quantized(self.src, self.dst, self.parts, self.quant or None, rank=rank)


def vllm_layout(shape, dst_ranks: Sequence[int], tp: int, placement, dtype: torch.dtype) -> Layout:
    """A vLLM parameter's layout over ``k * tp`` inference ranks (``k = len(dst_ranks) // tp``
    replicas of TP-``tp``, in order): ``placement`` over each replica's TP ranks; with several
    replicas a ``(k, tp)`` mesh, ``Replicate`` over the replicas, so each replica holds a full copy
    of one TP group's shards (one replica keeps the 1-D mesh it always had). Every recipe's
    destination side goes through here."""
    if len(dst_ranks) == tp:
        return Layout(shape, dst_ranks, [placement], dtype)
    mesh = [list(dst_ranks[i:i + tp]) for i in range(0, len(dst_ranks), tp)]
    return Layout(shape, mesh, [Replicate(), placement], dtype)


class RecipeBuilder:
    """One recipe's layouts and parts as they are collected, for the recipes whose sources have
    Hugging Face names (``hf_to_vllm``'s families, :mod:`~tritonreshard.recipes.deepseek`).

    Sources are FSDP rows (``Shard(0)``) of the trainer's tensors over ``src_ranks`` in
    ``src_dtype`` unless told otherwise; destinations are vLLM parameters over ``dst_ranks`` in
    ``dtype``, laid out by :func:`vllm_layout` (``k`` replicas of TP-``tp``)."""

    def __init__(self, src_ranks: Sequence[int], dst_ranks: Sequence[int], tp: int, dtype: torch.dtype,
                 src_dtype: torch.dtype):
        self.src_ranks, self.dst_ranks, self.tp, self.dtype, self.src_dtype = src_ranks, dst_ranks, tp, dtype, src_dtype
        self.src: dict[str, Layout] = {}
        self.dst: dict[str, Layout] = {}
        self.parts: dict[str, tuple[Part, ...]] = {}

    def source(self, name: str, shape, placement=Shard(0), dtype: torch.dtype | None = None) -> None:
        self.src[name] = Layout(shape, self.src_ranks, [placement], dtype or self.src_dtype)

    def target(self, name: str, shape, placement, plist=None, dtype: torch.dtype | None = None) -> None:
        """vLLM parameter ``name`` of global ``shape``, split by ``placement`` over each replica's TP
        ranks; ``plist``: its parts (None: the source of the same name and shape)."""
        self.dst[name] = vllm_layout(shape, self.dst_ranks, self.tp, placement, dtype or self.dtype)
        if plist is not None:
            self.parts[name] = tuple(plist)

    def same(self, name: str, shape, placement) -> None:
        """A parameter both sides name alike: FSDP rows in, ``placement`` out."""
        self.source(name, shape)
        self.target(name, shape, placement)

    def vocab(self, src_name: str, dst_name: str, vocab_size: int, hidden: int) -> None:
        """``embed_tokens`` / ``lm_head``: rows ``[0, vocab_size)`` from ``src_name``, vLLM's padding
        rows (to a multiple of 64) zero-filled, split by rows."""
        padded = pad_vocab_size(vocab_size)
        self.target(dst_name, (padded, hidden), Shard(0), [Part(src_name, [(0, vocab_size), None])]
                    + ([Part(None, [(vocab_size, padded), None])] if padded > vocab_size else []))

    def gate_up(self, pre: str, suffix: str, tail: tuple, size: int) -> None:
        """``gate_proj`` / ``up_proj`` -> ``gate_up_proj`` (``MergedColumnParallelLinear``: rank r holds
        ``[gate chunk r | up chunk r]``); ``tail``: ``(H,)`` for the weight, ``()`` for the bias."""
        g, u = f"{pre}.gate_proj.{suffix}", f"{pre}.up_proj.{suffix}"
        self.source(g, (size, *tail))
        self.source(u, (size, *tail))
        rest = [None] * len(tail)
        self.target(f"{pre}.gate_up_proj.{suffix}", (2 * size, *tail), Shard(0, (size, size)),
                    [Part(g, [(0, size), *rest]), Part(u, [(size, 2 * size), *rest])])

    def experts(self, pre: str, n_experts: int, inter: int, hidden: int, expert_parallel: bool) -> None:
        """Routed experts ``{pre}.experts.gate_up_proj`` ``[E, 2I, H]`` (gate first) and ``down_proj``
        ``[E, H, I]`` -> vLLM's ``routed_experts.w13_weight`` / ``w2_weight``: split by TP (w13
        ``[gate chunk r | up chunk r]`` on dim 1, w2 on dim 2), or with ``expert_parallel`` whole
        experts per rank, placed like vLLM's ``determine_expert_map`` (``balanced``)."""
        E, I, H = n_experts, inter, hidden
        gu, dn = f"{pre}.experts.gate_up_proj", f"{pre}.experts.down_proj"
        self.source(gu, (E, 2 * I, H))
        self.source(dn, (E, H, I))
        w13 = Shard(0, balanced=True) if expert_parallel else Shard(1, (I, I))
        w2 = Shard(0, balanced=True) if expert_parallel else Shard(2)
        self.target(f"{pre}.experts.routed_experts.w13_weight", (E, 2 * I, H), w13, [Part(gu, [None] * 3)])
        self.target(f"{pre}.experts.routed_experts.w2_weight", (E, H, I), w2, [Part(dn, [None] * 3)])


def _flag(value: bool | str, config: Any) -> bool:
    return bool(getattr(config, value, False)) if isinstance(value, str) else value


def _ranks(value, what: str, problems: list[str]) -> tuple[int, ...]:
    if isinstance(value, int) and not isinstance(value, bool):
        return tuple(range(value))
    if isinstance(value, Sequence) and value and all(isinstance(r, int) and not isinstance(r, bool) for r in value):
        return tuple(value)
    problems.append(f"{what}={value!r} must be a non-empty list of ranks (or a count)")
    return ()


def hf_to_vllm(config: Any, tp: int, trainer_ranks, inference_ranks, dtype: torch.dtype = torch.bfloat16,
               src_dtype: torch.dtype = torch.float32, expert_parallel: bool = False,
               quantization: str | None = None, scale_rule: str = "deepgemm") -> RecipeSpec:
    """The layouts and parts that refit an HF model trained under FSDP into vLLM's TP ranks.

    Args:
        config: a ``transformers`` config (``LlamaConfig``, ``MistralConfig``, ``Qwen2Config``,
            ``Qwen3Config``, ``Qwen3MoeConfig``; ``DeepseekV2Config`` / ``DeepseekV3Config``, laid out by
            :mod:`~tritonreshard.recipes.deepseek`) or any object with the same fields.
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

    Raises ``ValueError`` naming every problem at once: unknown ``model_type``, sizes vLLM cannot
    split over ``tp`` (heads, KV heads, intermediate size, padded vocab, experts).
    """
    # Lazy: deepseek.py builds on this module's RecipeSpec, so it cannot be imported at its top.
    from .deepseek import DEEPSEEK_MODEL_TYPES, deepseek_to_vllm

    problems: list[str] = []
    model_type = getattr(config, "model_type", None)
    fam = FAMILIES.get(model_type)
    if fam is None and model_type not in DEEPSEEK_MODEL_TYPES:
        problems.append(f"config.model_type={model_type!r} has no recipe; known: "
                        f"{sorted([*FAMILIES, *DEEPSEEK_MODEL_TYPES])}")
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        problems.append(f"tp={tp!r} must be a positive int")
        tp = 0
    src_ranks = _ranks(trainer_ranks, "trainer_ranks", problems)
    dst_ranks = _ranks(inference_ranks, "inference_ranks", problems)
    if tp and dst_ranks and len(dst_ranks) % tp:
        problems.append(f"inference_ranks has {len(dst_ranks)} ranks, not a multiple of tp={tp} "
                        f"(k replicas of TP-{tp} take k * {tp} ranks)")
    problems += check_quantization(quantization, scale_rule)
    if fam is None and quantization is not None and model_type in DEEPSEEK_MODEL_TYPES:
        # vLLM quantizes MLA's own projections (fused_qkv_a_proj, q_b_proj, kv_b_proj) too; their
        # block grids are not laid out here yet, and a partial FP8 layout would not load.
        problems.append(f"quantization={quantization!r} is not laid out for {model_type} (MLA) yet")
    if problems:
        raise ValueError("hf_to_vllm: " + "; ".join(problems))
    if fam is None:  # one of DEEPSEEK_MODEL_TYPES
        return deepseek_to_vllm(config, tp, src_ranks, dst_ranks, dtype, src_dtype, expert_parallel)

    H = config.hidden_size
    nq = config.num_attention_heads
    nkv = getattr(config, "num_key_value_heads", None) or nq
    hd = getattr(config, "head_dim", None) or H // nq
    inter = getattr(config, "intermediate_size", 0)
    V = config.vocab_size
    Vp = pad_vocab_size(V)
    L = config.num_hidden_layers
    tied = bool(getattr(config, "tie_word_embeddings", False))
    Q = nq * hd
    where = f"{model_type} (hidden_size={H}, heads={nq}, kv_heads={nkv}, head_dim={hd})"

    if nq % tp:
        problems.append(f"num_attention_heads={nq} is not divisible by tp={tp}")
    if tp >= nkv and tp % nkv:
        problems.append(f"tp={tp} >= num_key_value_heads={nkv} but is not a multiple of it (vLLM replicates "
                        f"each KV head over tp // num_key_value_heads ranks)")
    if tp < nkv and nkv % tp:
        problems.append(f"num_key_value_heads={nkv} is not divisible by tp={tp}")
    if Vp % tp:
        problems.append(f"padded vocab {Vp} (vocab_size={V} rounded up to {VOCAB_PADDING}) is not divisible by tp={tp}")

    moe_layers: set[int] = set()
    if fam.moe:
        E = config.num_experts
        moe_i = config.moe_intermediate_size
        only = set(getattr(config, "mlp_only_layers", None) or ())
        step = getattr(config, "decoder_sparse_step", 1) or 1
        moe_layers = {i for i in range(L) if i not in only and E > 0 and (i + 1) % step == 0}
        if moe_layers:
            if tp > E:  # vLLM's Qwen3MoeSparseMoeBlock refuses it, with or without EP
                problems.append(f"tp={tp} is greater than num_experts={E} (vLLM refuses it too)")
            if not expert_parallel and moe_i % tp:
                problems.append(f"moe_intermediate_size={moe_i} is not divisible by tp={tp}")
    elif expert_parallel:
        problems.append(f"expert_parallel=True but {model_type} has no experts")
    if len(moe_layers) < L and inter % tp:
        problems.append(f"intermediate_size={inter} is not divisible by tp={tp}")
    if problems:
        raise ValueError(f"hf_to_vllm: {where}, tp={tp}: " + "; ".join(problems))

    b = RecipeBuilder(src_ranks, dst_ranks, tp, dtype, src_dtype)
    source, target, same, merged = b.source, b.target, b.same, b.gate_up
    src, dst, parts = b.src, b.dst, b.parts

    def vocab(hf_name, vllm_name):
        b.vocab(hf_name, vllm_name, V, H)

    def qkv(pre, suffix, tail):
        """q/k/v -> qkv_proj (weight: tail=(H,), bias: tail=())."""
        q, k, v = (f"{pre}.{x}_proj.{suffix}" for x in "qkv")
        source(q, (Q, *tail))
        source(k, (nkv * hd, *tail))
        source(v, (nkv * hd, *tail))
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
        target(f"{pre}.qkv_proj.{suffix}", (Q + 2 * kv, *tail), Shard(0, (Q, kv, kv)), plist)

    source("model.embed_tokens.weight", (V, H))
    vocab("model.embed_tokens.weight", "model.embed_tokens.weight")
    for i in range(L):
        pre = f"model.layers.{i}"
        att = f"{pre}.self_attn"
        qkv(att, "weight", (H,))
        if _flag(fam.qkv_bias, config):
            qkv(att, "bias", ())
        same(f"{att}.o_proj.weight", (H, Q), Shard(1))
        if _flag(fam.o_bias, config):
            same(f"{att}.o_proj.bias", (H,), Replicate())
        if fam.qk_norm:
            same(f"{att}.q_norm.weight", (hd,), Replicate())
            same(f"{att}.k_norm.weight", (hd,), Replicate())
        if i in moe_layers:
            E, moe_i = config.num_experts, config.moe_intermediate_size
            same(f"{pre}.mlp.gate.weight", (E, H), Replicate())
            b.experts(f"{pre}.mlp", E, moe_i, H, expert_parallel)
        else:
            merged(f"{pre}.mlp", "weight", (H,), inter)
            same(f"{pre}.mlp.down_proj.weight", (H, inter), Shard(1))
            if _flag(fam.mlp_bias, config):
                merged(f"{pre}.mlp", "bias", (), inter)
                same(f"{pre}.mlp.down_proj.bias", (H,), Replicate())
        same(f"{pre}.input_layernorm.weight", (H,), Replicate())
        same(f"{pre}.post_attention_layernorm.weight", (H,), Replicate())
    same("model.norm.weight", (H,), Replicate())
    if not tied:
        source("lm_head.weight", (V, H))
        vocab("lm_head.weight", "lm_head.weight")
    quant = quantize_destinations(dst, tp, quantization, scale_rule, f"hf_to_vllm: {where}") if quantization else {}
    return RecipeSpec(model_type, tp, expert_parallel, src, dst, parts, quant)
