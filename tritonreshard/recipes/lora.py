"""PEFT LoRA adapters (trainers' A/B factors) -> vLLM's per-TP-rank LoRA slot buffers.

Pure Python planning (no peft, transformers or vLLM import): :func:`lora_to_vllm` lays out the
adapter tensors the trainers hold (PEFT's saved names, ``get_peft_model_state_dict``; replicated or
FSDP ``Shard(0)`` rows) and the LoRA buffers each vLLM TP rank holds for the adapter's slot, and
names the scaling vLLM folds into ``lora_B``. Facts follow vLLM 0.32's ``vllm/lora`` (unchanged in
0.33 for these layers; see docs/lora.md), with ``fully_sharded_loras=False`` (vLLM's default):

* Each LoRA-wrapped linear holds ``lora_a_stacked[i]`` ``[max_loras, 1, max_lora_rank, in_local]``
  and ``lora_b_stacked[i]`` ``[max_loras, 1, out_local, max_lora_rank]`` per slice ``i``; an adapter
  in slot ``s`` occupies ``lora_a_stacked[i][s, 0]`` (rows ``[0, r)``, the rest zero) and
  ``lora_b_stacked[i][s, 0]`` (columns ``[0, r)``, the rest zero). Those slot views are this
  recipe's destinations, named ``{vLLM module}.lora_a_stacked.{i}`` / ``.lora_b_stacked.{i}``.
* Column-parallel (``qkv_proj``, ``gate_up_proj``): ``lora_A`` whole on every rank, ``lora_B`` split on
  its output rows, per slice: ``qkv_proj`` has slices q, k, v (``MergedQKVParallelLinearWithLoRA``;
  KV heads replicated over ``tp // num_kv_heads`` ranks when tp exceeds them, as the base layer),
  ``gate_up_proj`` slices gate, up (``MergedColumnParallelLinearWithLoRA``).
* Row-parallel (``o_proj``, ``down_proj``): ``lora_A`` split on its input columns, ``lora_B`` whole.
* Scaling: vLLM multiplies ``lora_B`` (already cast to its LoRA dtype) in place by
  ``lora_alpha / r`` (``/ sqrt(r)`` with rsLoRA; per module with ``rank_pattern`` /
  ``alpha_pattern``) when it registers the adapter (``LoRALayerWeights.optimize``), and its kernels
  then run with scale 1. The slot holds ``(B.to(dtype) * scaling)``; the plan moves ``B`` as is and
  :attr:`LoraSpec.scaling` says which factor to apply, once, in ``dtype`` after the copy.
"""
from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ..layout import Layout, Part, Replicate, Shard
from ..planning import Plan, plan_reshard
from .builder import check_divisible, check_tp, positive_int, raise_problems, rank_list, tp_layout

__all__ = ["LoraSpec", "lora_to_vllm", "LORA_MODEL_TYPES", "LORA_MODULES", "PEFT_PREFIX"]

#: Model types whose adapters this recipe lays out (dense attention + MLP; vLLM's Llama / Qwen2 /
#: Qwen3 LoRA wrappers).
LORA_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")

#: HF module kind -> (vLLM module it lives in, slice index there, kind of parallel layer).
LORA_MODULES: dict[str, tuple[str, int, str]] = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0, "qkv"),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1, "qkv"),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2, "qkv"),
    "self_attn.o_proj": ("self_attn.o_proj", 0, "row"),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0, "column"),
    "mlp.up_proj": ("mlp.gate_up_proj", 1, "column"),
    "mlp.down_proj": ("mlp.down_proj", 0, "row"),
}

#: What PEFT puts before the model's own module names in a saved adapter.
PEFT_PREFIX = "base_model.model."

# Modules PEFT can target that this recipe does not lay out (vLLM 0.32 wraps both, with LoRA buffers of
# other shapes: VocabParallelEmbeddingWithLoRA, LogitsProcessorWithLoRA).
_NOT_LAID_OUT = ("model.embed_tokens", "lm_head")
# vLLM's packed modules (its LoRA deployment filter accepts the packed or the packed-into names).
_PACKED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


@dataclass(frozen=True)
class LoraSpec:
    """A LoRA adapter's refit into vLLM's LoRA slots.

    ``src``: ``{PEFT saved name: Layout}`` over the trainer ranks (``base_model.model.{module}.lora_A.weight``
    ``[r, in]`` and ``.lora_B.weight`` ``[out, r]``, ``Replicate`` or ``Shard(0)``, ``src_dtype``).
    ``dst``: ``{"{vLLM module}.lora_{a,b}_stacked.{i}": Layout}`` over the inference ranks, the slot views
    (``lora_a``: ``[max_lora_rank, in]``, ``lora_b``: ``[out, max_lora_rank]`` globally;
    ``layout.local_shape(r)`` is exactly ``lora_x_stacked[i][slot, 0].shape`` on TP rank r).
    ``parts``: ``{dst: [Part, ...]}`` (rank padding rows / columns are zero fills).
    ``scaling``: ``{lora_b dst name: factor}``, what vLLM folds into that ``lora_B`` (in ``dst``'s dtype,
    after the cast); ``1.0`` where it folds nothing. ``ranks``: ``{HF module: r}`` of the adapter.
    """

    model_type: str
    tp: int
    max_lora_rank: int
    src: dict[str, Layout] = field(repr=False)
    dst: dict[str, Layout] = field(repr=False)
    parts: dict[str, tuple[Part, ...]] = field(repr=False)
    scaling: dict[str, float] = field(repr=False)
    ranks: dict[str, int] = field(repr=False)

    def plan(self, rank: int | None = None) -> Plan:
        """The whole plan, or with ``rank`` that rank's part of it (``plan_reshard(..., rank=)``)."""
        return plan_reshard(self.src, self.dst, self.parts, rank=rank)


def _field(cfg: Any, name: str, default=None):
    return cfg.get(name, default) if isinstance(cfg, Mapping) else getattr(cfg, name, default)


def _pattern(pattern: Mapping | None, name: str):
    """PEFT's (and vLLM's ``PEFTHelper``) rule: a key matches when it is a suffix of ``name`` at a
    ``.`` boundary; the first match wins."""
    for key, value in (pattern or {}).items():
        if re.match(rf"(.*\.)?({key})$", name):
            return value
    return None


def _targets(target, name: str) -> bool:
    """PEFT's ``check_target_module_exists`` for one module name: a ``str`` is a full-match regex,
    a collection matches a name equal to an entry or ending in ``.{entry}``."""
    if isinstance(target, str):
        return re.fullmatch(target, name) is not None
    return name in target or any(name.endswith(f".{t}") for t in target)


def _layer_index(name: str) -> int:
    return int(name.split(".")[2])  # model.layers.{i}.…


def _check_adapter(lora_config: Any, modules: list[str], others: list[str], max_lora_rank: int,
                   served: Any, problems: list[str]) -> dict[str, tuple[int, float]]:
    """``{HF module: (r, scaling)}`` of the modules the adapter targets; a problem for each thing
    vLLM (or this recipe) does not serve."""
    r, alpha, target = (_field(lora_config, k) for k in ("r", "lora_alpha", "target_modules"))
    if not positive_int(r):
        problems.append(f"lora_config.r={r!r} must be a positive int")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        problems.append(f"lora_config.lora_alpha={alpha!r} must be a number")
    if target == "all-linear":  # PEFT: every linear but the output layer
        target = sorted({m.split(".", 3)[3] for m in modules})
    if not target or not isinstance(target, (str, list, tuple, set, frozenset)):
        problems.append(f"lora_config.target_modules={target!r} must be module names or a regex")
        return {}
    for flag, why in (("use_dora", "DoRA"), ("lora_bias", "LoRA bias")):
        if _field(lora_config, flag, False):
            problems.append(f"lora_config.{flag}=True: vLLM does not serve {why}")
    if _field(lora_config, "bias", "none") != "none":
        problems.append(f"lora_config.bias={_field(lora_config, 'bias')!r}: vLLM serves only bias='none'")
    for name in ("modules_to_save", "target_parameters", "layers_pattern", "exclude_modules"):
        if _field(lora_config, name):
            problems.append(f"lora_config.{name}={_field(lora_config, name)!r} is not laid out by this recipe")
    only = _field(lora_config, "layers_to_transform")
    only = None if only is None else {only} if isinstance(only, int) else set(only)

    chosen = [m for m in modules if _targets(target, m) and (only is None or _layer_index(m) in only)]
    unserved = [m for m in others if _targets(target, m)]
    if unserved:
        problems.append(f"target modules {unserved} are not laid out by lora_to_vllm (it lays out "
                        f"{sorted({m.split('.', 3)[3] for m in modules})})")
    if not isinstance(target, str):
        missing = sorted(t for t in target if not any(_targets((t,), m) for m in modules + others))
        if missing:
            problems.append(f"target modules {missing} name no module of the model")
    if not chosen and not unserved:
        problems.append(f"lora_config.target_modules={target!r} matches no module vLLM serves")
    if served is not None:
        allowed = set(served)
        out = sorted({m.rsplit(".", 1)[-1] for m in chosen if not (
            m.rsplit(".", 1)[-1] in allowed or m in allowed
            or any(m.rsplit(".", 1)[-1] in kids and parent in allowed for parent, kids in _PACKED.items()))})
        if out:
            problems.append(f"target modules {out} are not served by the engine (its LoRA target_modules="
                            f"{sorted(allowed)})")
    if not positive_int(r) or isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        return {}
    rsl = bool(_field(lora_config, "use_rslora", False))
    out: dict[str, tuple[int, float]] = {}
    too_big: dict[int, list[str]] = {}
    for m in chosen:
        rank = _pattern(_field(lora_config, "rank_pattern"), m) or r
        a = _pattern(_field(lora_config, "alpha_pattern"), m)
        a = alpha if a is None else a
        if not positive_int(rank):
            problems.append(f"rank_pattern gives {m} rank {rank!r}, not a positive int")
            continue
        if positive_int(max_lora_rank) and rank > max_lora_rank:
            too_big.setdefault(rank, []).append(m)
        out[m] = (rank, a / math.sqrt(rank) if rsl else a / rank)
    for rank, names in sorted(too_big.items()):
        problems.append(f"adapter rank {rank} ({len(names)} modules, e.g. {names[0]}) exceeds the engine's "
                        f"max_lora_rank={max_lora_rank}")
    return out


def lora_to_vllm(lora_config: Any, config: Any, tp: int, trainer_ranks, inference_ranks, *, max_lora_rank: int = 16,
                 dtype: torch.dtype = torch.bfloat16, src_dtype: torch.dtype = torch.float32, fsdp: bool = False,
                 served_modules=None) -> LoraSpec:
    """The layouts and parts that refit a PEFT LoRA adapter into vLLM's LoRA slots.

    Args:
        lora_config: a ``peft.LoraConfig`` (or its ``adapter_config.json`` as a dict): ``r``,
            ``lora_alpha``, ``target_modules`` (names, a regex, or ``"all-linear"``), ``use_rslora``,
            ``rank_pattern``, ``alpha_pattern``, ``layers_to_transform``.
        config: the base model's ``transformers`` config (:data:`LORA_MODEL_TYPES`).
        tp: vLLM's tensor-parallel size. ``trainer_ranks`` / ``inference_ranks``: as in
            :func:`~tritonreshard.recipes.hf_to_vllm` (``k * tp`` inference ranks: ``k`` replicas).
        max_lora_rank: the engine's ``max_lora_rank`` (vLLM's default 16): the slots' rank width.
        dtype: the engine's LoRA dtype (``lora_dtype``, by default the model's dtype).
        src_dtype: the trainers' adapter dtype. ``fsdp``: the trainers hold ``Shard(0)`` rows of each
            adapter tensor (FSDP); otherwise each holds the whole adapter (``Replicate``).
        served_modules: the engine's LoRA ``target_modules`` deployment filter (``None``: every
            module vLLM wraps), as vLLM matches it (a module's name, or its packed parent / child).

    Raises one ``ValueError`` naming every problem before anything moves: an unknown model type, bad
    ranks or ``tp``, sizes vLLM cannot split over ``tp``, an adapter rank above ``max_lora_rank``,
    target modules the engine does not serve, adapter features vLLM does not serve (DoRA, bias,
    ``modules_to_save``).
    """
    problems: list[str] = []
    model_type = getattr(config, "model_type", None)
    if model_type not in LORA_MODEL_TYPES:
        problems.append(f"config.model_type={model_type!r} has no LoRA recipe; known: {list(LORA_MODEL_TYPES)}")
    tp = check_tp(tp, problems)
    src_ranks = rank_list(trainer_ranks, "trainer_ranks", problems)
    dst_ranks = rank_list(inference_ranks, "inference_ranks", problems)
    if tp and dst_ranks and len(dst_ranks) % tp:
        problems.append(f"inference_ranks has {len(dst_ranks)} ranks, not a multiple of tp={tp}")
    if not positive_int(max_lora_rank):
        problems.append(f"max_lora_rank={max_lora_rank!r} must be a positive int")
    if served_modules is not None and (isinstance(served_modules, str) or not all(
            isinstance(m, str) for m in served_modules)):
        problems.append(f"served_modules={served_modules!r} must be a list of module names or None")
        served_modules = None
    L = getattr(config, "num_hidden_layers", 0)
    modules = [f"model.layers.{i}.{kind}" for i in range(L) for kind in LORA_MODULES]
    others = list(_NOT_LAID_OUT)
    chosen = _check_adapter(lora_config, modules, others, max_lora_rank, served_modules, problems)
    dims = _Dims.of(config)
    if tp:
        _check_split(dims, tp, problems)
    raise_problems(f"lora_to_vllm: {model_type}, tp={tp}, max_lora_rank={max_lora_rank}", problems)

    slots = _SlotLayouts(dims, tp, max_lora_rank, src_ranks, dst_ranks, dtype, src_dtype,
                         Shard(0) if fsdp else Replicate())
    for m, (r, scale) in chosen.items():
        slots.module(m, r, scale)
    return LoraSpec(model_type, tp, max_lora_rank, slots.src, slots.dst, slots.parts, slots.scaling,
                    {m: r for m, (r, _) in chosen.items()})


@dataclass(frozen=True)
class _Dims:
    """The base model's sizes an adapter's factors take theirs from."""

    H: int
    nq: int
    nkv: int
    hd: int
    inter: int

    @classmethod
    def of(cls, config: Any) -> _Dims:
        H, nq = config.hidden_size, config.num_attention_heads
        return cls(H, nq, getattr(config, "num_key_value_heads", None) or nq,
                   getattr(config, "head_dim", None) or H // nq, config.intermediate_size)


def _check_split(dims: _Dims, tp: int, problems: list[str]) -> None:
    """vLLM's split of the heads, KV heads (replicated when tp exceeds them) and MLP over ``tp``."""
    check_divisible(problems, "num_attention_heads", dims.nq, tp)
    if tp >= dims.nkv and tp % dims.nkv:
        problems.append(f"tp={tp} >= num_key_value_heads={dims.nkv} but is not a multiple of it")
    if tp < dims.nkv:
        check_divisible(problems, "num_key_value_heads", dims.nkv, tp)
    check_divisible(problems, "intermediate_size", dims.inter, tp)


class _SlotLayouts:
    """An adapter's layouts, parts and scalings as they are collected, one targeted module at a
    time: its A/B factors on the trainers (``src_placement``), its slot views on vLLM's ranks."""

    def __init__(self, dims: _Dims, tp: int, max_lora_rank: int, src_ranks, dst_ranks, dtype: torch.dtype,
                 src_dtype: torch.dtype, src_placement):
        self.dims, self.tp, self.R = dims, tp, max_lora_rank
        self.src_ranks, self.dst_ranks, self.dtype, self.src_dtype = src_ranks, dst_ranks, dtype, src_dtype
        self.src_placement = src_placement
        self.src: dict[str, Layout] = {}
        self.dst: dict[str, Layout] = {}
        self.parts: dict[str, tuple[Part, ...]] = {}
        self.scaling: dict[str, float] = {}

    def module(self, m: str, r: int, scale: float) -> None:
        """HF module ``m`` (``model.layers.{i}.{kind}``) with adapter rank ``r``: its ``lora_A`` into
        slice ``i``'s ``lora_a_stacked`` rows ``[0, r)``, its ``lora_B`` into ``lora_b_stacked``
        columns ``[0, r)``, the rest of the slot zero-filled."""
        H, nkv, hd, inter = self.dims.H, self.dims.nkv, self.dims.hd, self.dims.inter
        tp, R, Q = self.tp, self.R, self.dims.nq * hd
        pre, kind = m.rsplit(".", 2)[0], m.split(".", 3)[3]
        vmod, i, par = LORA_MODULES[kind]
        a_name, b_name = f"{PEFT_PREFIX}{m}.lora_A.weight", f"{PEFT_PREFIX}{m}.lora_B.weight"
        a_dst, b_dst = f"{pre}.{vmod}.lora_a_stacked.{i}", f"{pre}.{vmod}.lora_b_stacked.{i}"
        out_size = {"q_proj": Q, "k_proj": nkv * hd, "v_proj": nkv * hd, "o_proj": H, "gate_proj": inter,
                    "up_proj": inter, "down_proj": H}[kind.rsplit(".", 1)[-1]]
        in_size = {"o_proj": Q, "down_proj": inter}.get(kind.rsplit(".", 1)[-1], H)
        self.src[a_name] = Layout((r, in_size), self.src_ranks, [self.src_placement], self.src_dtype)
        self.src[b_name] = Layout((out_size, r), self.src_ranks, [self.src_placement], self.src_dtype)
        pad_rows = [Part(None, [(r, R), None])] if r < R else []
        pad_cols = [Part(None, [None, (r, R)])] if r < R else []
        a_place = Shard(1) if par == "row" else Replicate()
        self.dst[a_dst] = tp_layout((R, in_size), self.dst_ranks, tp, a_place, self.dtype)
        self.parts[a_dst] = (Part(a_name, [(0, r), None]), *pad_rows)
        if par == "row":
            self.dst[b_dst] = tp_layout((out_size, R), self.dst_ranks, tp, Replicate(), self.dtype)
            plist = [Part(b_name, [None, (0, r)])]
        elif kind.endswith(("k_proj", "v_proj")) and tp > nkv:
            # one KV head per rank, rank j's from head j // replicas (as the base qkv_proj)
            rep = tp // nkv
            self.dst[b_dst] = tp_layout((tp * hd, R), self.dst_ranks, tp, Shard(0), self.dtype)
            plist = [Part(b_name, [(j * hd, (j + 1) * hd), (0, r)], ((j // rep) * hd, 0)) for j in range(tp)]
        else:
            self.dst[b_dst] = tp_layout((out_size, R), self.dst_ranks, tp, Shard(0), self.dtype)
            plist = [Part(b_name, [None, (0, r)])]
        self.parts[b_dst] = (*plist, *pad_cols)
        self.scaling[b_dst] = float(scale)
