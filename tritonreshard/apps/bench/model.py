"""The bench's synthetic model: a Llama-shaped bf16 state dict of ``--size`` bytes (:func:`build_model`)
and its source and destination layouts for each ``--layout`` (:func:`layouts`). Pure Python: every
process derives the same from the config."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from tritonreshard.layout import Layout, Replicate, Shard

from .config import BenchConfig

__all__ = ["TensorSpec", "build_model", "layouts"]


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    kind: str   # qkv, o, gate_up, down, norm, embed


def _layer_numel(h: int, i: int) -> int:
    return 3 * h * h + h * h + 2 * i * h + i * h + 2 * h


def _ffn(h: int, align: int) -> int:
    return max(align, -(-(8 * h // 3) // align) * align)


def build_model(cfg: BenchConfig) -> list[TensorSpec]:
    """A Llama-shaped model of ``cfg.size`` bytes of bf16 (within one embedding row), with
    ``cfg.tensors`` tensors when given (many small layers; extra 1-D tensors make the count exact)."""
    elems = cfg.size // 2
    if cfg.tensors is None:
        layers = max(1, round((elems / 196608) ** (1 / 3)))  # Llama proportions: hidden ~ 128 x layers
        align = 64 if elems >= 1 << 22 else 8
        extra = 0
    else:
        layers = max(1, (cfg.tensors - 3) // 6)
        extra = cfg.tensors - 3 - 6 * layers
        align = 8
    budget = 0.94 * elems / layers  # ~6% for embedding and lm_head, as in Llama-2-7B
    h = max(align, int(math.sqrt(budget / 12)) // align * align)
    while h > align and _layer_numel(h, _ffn(h, align)) > budget:
        h -= align
    while _layer_numel(h + align, _ffn(h + align, align)) <= budget:
        h += align
    i = _ffn(h, align)
    out = []
    for layer in range(layers):
        p = f"layers.{layer}."
        out += [TensorSpec(p + "attn.qkv.weight", (3 * h, h), "qkv"),
                TensorSpec(p + "attn.o.weight", (h, h), "o"),
                TensorSpec(p + "mlp.gate_up.weight", (2 * i, h), "gate_up"),
                TensorSpec(p + "mlp.down.weight", (h, i), "down"),
                TensorSpec(p + "input_norm.weight", (h,), "norm"),
                TensorSpec(p + "post_norm.weight", (h,), "norm")]
    out += [TensorSpec(f"extra.{k}.bias", (h,), "norm") for k in range(extra)]
    out.append(TensorSpec("norm.weight", (h,), "norm"))
    rest = max(2 * h, elems - sum(math.prod(t.shape) for t in out))
    vocab = max(1, rest // (2 * h))
    out.append(TensorSpec("embed.weight", (vocab + (rest - 2 * vocab * h) // h, h), "embed"))
    out.append(TensorSpec("lm_head.weight", (vocab, h), "embed"))
    return out


def _tp_placement(t: TensorSpec):
    h = t.shape[-1] if t.kind != "down" else t.shape[0]
    if t.kind == "qkv":
        return Shard(0, blocks=(h, h, h))
    if t.kind == "gate_up":
        return Shard(0, blocks=(t.shape[0] // 2, t.shape[0] // 2))
    if t.kind in ("o", "down"):
        return Shard(1)
    if t.kind == "embed":
        return Shard(0)
    return Replicate()


def _megatron_placement(t: TensorSpec):
    """Megatron-Core's TP placement: qkv rows split contiguously (whole query groups; the per-group
    interleave is not modelled: the synthetic qkv has no heads), fc1 [gate_r; up_r], proj/fc2 on dim
    1, vocab rows, norms replicated."""
    if t.kind == "qkv":
        return Shard(0)
    return _tp_placement(t)


def _megatron_stage(t: TensorSpec, layers: int, tr: list[int]) -> list[int]:
    """The TP ranks of the pipeline stage holding ``t`` (Megatron TP 2, PP = trainers / 2, rank =
    tp_rank + 2 * pp_rank): layers in contiguous blocks per stage, the embedding on the first, the
    final norm and lm_head on the last."""
    pp = len(tr) // 2
    if t.name.startswith("layers."):
        stage = int(t.name.split(".")[1]) * pp // layers
    else:
        stage = 0 if t.name == "embed.weight" else pp - 1
    return tr[2 * stage:2 * stage + 2]


def layouts(cfg: BenchConfig, model: list[TensorSpec]) -> tuple[dict[str, Layout], dict[str, Layout]]:
    """(src_layouts, dst_layouts) of the configured layout."""
    bf16 = torch.bfloat16
    tr, inf = list(cfg.trainer_ranks), list(cfg.inference_ranks)
    src, dst = {}, {}
    tp = len(inf) // cfg.replicas

    def tp_layout(t: TensorSpec) -> Layout:
        """TP over the inference ranks; with replicas, a (replicas, tp) mesh replicated over dim 0."""
        if cfg.replicas == 1:
            return Layout(t.shape, inf, [_tp_placement(t)], bf16)
        mesh = [inf[i:i + tp] for i in range(0, len(inf), tp)]
        return Layout(t.shape, mesh, [Replicate(), _tp_placement(t)], bf16)

    layers = sum(t.name.startswith("layers.") and t.kind == "qkv" for t in model)
    for t in model:
        if cfg.layout in ("fsdp-tp", "colocated"):
            src[t.name] = Layout(t.shape, tr, [Shard(0)], bf16)
            dst[t.name] = tp_layout(t)
        elif cfg.layout == "cols-replicas":
            src[t.name] = Layout(t.shape, tr, [Shard(len(t.shape) - 1)], bf16)
            dst[t.name] = Layout(t.shape, inf, [Replicate()], bf16)
        elif cfg.layout == "replicated-sources":
            half = len(tr) // 2
            src[t.name] = Layout(t.shape, [tr[:half], tr[half:]], [Replicate(), Shard(0)], bf16)
            dst[t.name] = tp_layout(t)
        elif cfg.layout == "megatron-tp-pp":
            src[t.name] = Layout(t.shape, _megatron_stage(t, layers, tr), [_megatron_placement(t)], bf16)
            dst[t.name] = tp_layout(t)
        else:
            raise ValueError(f"unknown layout {cfg.layout!r}")
    return src, dst
