"""Llama-family layouts: Hugging Face trainer shards -> vLLM tensor-parallel load-format parameters.

Pure Python (no vLLM import): the trainer side and the vLLM workers derive the same layouts from
the same Hugging Face config, so nothing but a few ints crosses the control plane.

Interim: these are written by hand for dense Llama/Mistral-shaped models until the recipes of the
real-model-layouts issue (``trs.recipes.hf_to_vllm``) land. The planner of today needs one name and
one global shape on both sides, so a destination here is keyed by the *Hugging Face* name and a
:class:`Bind` says where its rows go inside the vLLM parameter:

* ``q_proj``/``k_proj``/``v_proj`` -> rows of ``qkv_proj`` (``[q heads of rank r | k | v]``), KV
  heads replicated over ``tp // num_kv_heads`` ranks when tp exceeds them;
* ``gate_proj``/``up_proj`` -> rows of ``gate_up_proj`` (``[gate chunk r | up chunk r]``);
* ``o_proj``/``down_proj`` split on dim 1; norms replicated;
* ``embed_tokens``/``lm_head``: vLLM pads the vocab to a multiple of 64 and splits rows. When that
  split coincides with an even row split the destination is ``Shard(0)``; otherwise (vocab 1000 on
  TP=2: vLLM's rank 0 holds rows 0..511) each rank pulls the whole vocab matrix and keeps its rows
  (the one full tensor here; the recipes' padded dims remove it).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..layout import Layout, Replicate, Shard

__all__ = ["Bind", "VLLMLayouts", "llama_layouts"]

_VOCAB_PAD = 64  # vLLM's DEFAULT_VOCAB_PADDING_SIZE


@dataclass(frozen=True)
class Bind:
    """Where destination tensor ``name`` (this rank's pulled buffer) goes: rows ``src_rows`` of the
    buffer are copied into rows ``dst_rows`` of vLLM's load-format parameter ``param``; rows of
    ``param`` in ``zero_rows`` (vocab padding) are zero-filled."""

    name: str
    param: str
    src_rows: tuple[int, int]
    dst_rows: tuple[int, int]
    zero_rows: tuple[int, int] | None = None


@dataclass(frozen=True)
class VLLMLayouts:
    """``src``: ``{HF name: Layout}`` (FSDP rows over the trainer ranks); ``dst``: ``{HF name:
    Layout}`` over the inference ranks, as vLLM's TP ranks hold the data; ``binds(tp_rank)``: where
    each destination buffer goes inside the vLLM parameters of that TP rank; ``param_shapes``:
    ``{vLLM parameter: load-format shape on one TP rank}``."""

    src: dict
    dst: dict
    tp: int
    inference_ranks: tuple[int, ...]
    _binds: tuple[tuple[Bind, ...], ...]
    param_shapes: dict

    def binds(self, tp_rank: int) -> tuple[Bind, ...]:
        return self._binds[tp_rank]


def _get(config, key):
    return config.get(key) if isinstance(config, dict) else getattr(config, key, None)


def llama_layouts(config, *, tp: int, trainer_ranks, inference_ranks, src_dtype=torch.float32,
                  dst_dtype=torch.float32) -> VLLMLayouts:
    """Layouts for a dense Llama-shaped ``config`` (a ``transformers`` config or a dict with its
    fields) trained on ``trainer_ranks`` (FSDP ``Shard(0)``) and served by vLLM with tensor
    parallelism ``tp`` on ``inference_ranks`` (index = vLLM TP rank).

    Raises ``ValueError`` listing every problem (unknown architecture, tp not dividing the heads,
    rank lists of the wrong length or overlapping, tied embeddings)."""
    problems = []
    arch = (_get(config, "architectures") or ["LlamaForCausalLM"])[0]
    if arch not in ("LlamaForCausalLM", "MistralForCausalLM"):
        problems.append(f"config architectures={arch!r}: only LlamaForCausalLM / MistralForCausalLM "
                        f"layouts are written (until trs.recipes.hf_to_vllm lands)")
    hidden, heads = _get(config, "hidden_size"), _get(config, "num_attention_heads")
    kv = _get(config, "num_key_value_heads") or heads
    head_dim = _get(config, "head_dim") or (hidden // heads if hidden and heads else None)
    inter, vocab, layers = (_get(config, "intermediate_size"), _get(config, "vocab_size"),
                            _get(config, "num_hidden_layers"))
    if _get(config, "tie_word_embeddings"):
        problems.append("config tie_word_embeddings=True is not supported yet (vLLM exposes only "
                        "model.embed_tokens.weight then)")
    if _get(config, "attention_bias") or _get(config, "mlp_bias"):
        problems.append("config attention_bias/mlp_bias=True is not supported yet")
    trainer_ranks, inference_ranks = tuple(trainer_ranks), tuple(inference_ranks)
    if not isinstance(tp, int) or tp < 1:
        problems.append(f"tp must be a positive int, got tp={tp!r}")
    elif len(inference_ranks) != tp:
        problems.append(f"inference_ranks={list(inference_ranks)} must name one rank per TP rank (tp={tp})")
    if not trainer_ranks:
        problems.append("trainer_ranks must not be empty")
    if set(trainer_ranks) & set(inference_ranks):
        problems.append(f"trainer_ranks={list(trainer_ranks)} and inference_ranks={list(inference_ranks)} "
                        f"overlap")
    if isinstance(tp, int) and tp >= 1 and heads and kv and inter:
        if heads % tp:
            problems.append(f"tp={tp} must divide num_attention_heads={heads}")
        if (kv % tp) if tp <= kv else (tp % kv):
            problems.append(f"tp={tp} and num_key_value_heads={kv}: one must divide the other")
        if inter % tp:
            problems.append(f"tp={tp} must divide intermediate_size={inter}")
    if problems:
        raise ValueError("llama_layouts: " + "; ".join(problems))

    fsdp = lambda shape: Layout(shape, list(trainer_ranks), [Shard(0)], dtype=src_dtype)  # noqa: E731
    inf = list(inference_ranks)
    rows = lambda shape: Layout(shape, inf, [Shard(0)], dtype=dst_dtype)  # noqa: E731
    cols = lambda shape: Layout(shape, inf, [Shard(1)], dtype=dst_dtype)  # noqa: E731
    repl = lambda shape: Layout(shape, inf, [Replicate()], dtype=dst_dtype)  # noqa: E731
    if tp <= kv:
        kv_dst = rows
        kv_per = kv // tp
    else:  # each KV head replicated over tp // kv consecutive ranks: mesh (kv heads, replicas)
        mesh = [inf[i * (tp // kv):(i + 1) * (tp // kv)] for i in range(kv)]
        kv_dst = lambda shape: Layout(shape, mesh, [Shard(0), Replicate()], dtype=dst_dtype)  # noqa: E731
        kv_per = 1
    q_per, i_per = heads // tp * head_dim, inter // tp
    qkv_rows = q_per + 2 * kv_per * head_dim

    src, dst = {}, {}
    binds: list[list[Bind]] = [[] for _ in range(tp)]
    shapes = {}

    def add(name, shape, dst_layout, param, row0, param_rows):
        src[name], dst[name] = fsdp(shape), dst_layout(shape)
        shapes[param] = (param_rows,) + dst[name].local_shape(inf[0])[1:]
        n = dst[name].local_shape(inf[0])[0]
        for r in range(tp):
            binds[r].append(Bind(name, param, (0, n), (row0, row0 + n)))

    for i in range(layers):
        p = f"model.layers.{i}."
        qkv = p + "self_attn.qkv_proj.weight"
        add(p + "self_attn.q_proj.weight", (heads * head_dim, hidden), rows, qkv, 0, qkv_rows)
        add(p + "self_attn.k_proj.weight", (kv * head_dim, hidden), kv_dst, qkv, q_per, qkv_rows)
        add(p + "self_attn.v_proj.weight", (kv * head_dim, hidden), kv_dst, qkv, q_per + kv_per * head_dim,
            qkv_rows)
        add(p + "self_attn.o_proj.weight", (hidden, heads * head_dim), cols, p + "self_attn.o_proj.weight",
            0, hidden)
        gu = p + "mlp.gate_up_proj.weight"
        add(p + "mlp.gate_proj.weight", (inter, hidden), rows, gu, 0, 2 * i_per)
        add(p + "mlp.up_proj.weight", (inter, hidden), rows, gu, i_per, 2 * i_per)
        add(p + "mlp.down_proj.weight", (hidden, inter), cols, p + "mlp.down_proj.weight", 0, hidden)
        for norm in ("input_layernorm.weight", "post_attention_layernorm.weight"):
            add(p + norm, (hidden,), repl, p + norm, 0, hidden)
    add("model.norm.weight", (hidden,), repl, "model.norm.weight", 0, hidden)

    # Vocab-parallel tensors: vLLM pads the vocab to a multiple of 64, then splits rows evenly.
    per = -(-((vocab + _VOCAB_PAD - 1) // _VOCAB_PAD * _VOCAB_PAD) // tp)
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        src[name] = fsdp((vocab, hidden))
        shapes[name] = (per, hidden)
        if per * tp == vocab:  # padding-free and even: an ordinary row split
            dst[name] = rows((vocab, hidden))
            for r in range(tp):
                binds[r].append(Bind(name, name, (0, per), (0, per)))
            continue
        dst[name] = repl((vocab, hidden))
        for r in range(tp):
            lo, hi = min(r * per, vocab), min((r + 1) * per, vocab)
            binds[r].append(Bind(name, name, (lo, hi), (0, hi - lo), (hi - lo, per) if hi - lo < per else None))
    return VLLMLayouts(src, dst, tp, tuple(inference_ranks), tuple(tuple(b) for b in binds), shapes)
