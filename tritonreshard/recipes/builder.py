"""The vLLM side every recipe shares: :class:`RecipeSpec`, :class:`RecipeBuilder`, :func:`tp_layout`,
and the argument and size checks each recipe runs, written once.

Pure Python planning (no transformers or vLLM import). Facts follow vLLM 0.32:

* ``embed_tokens``, ``lm_head`` (``VocabParallelEmbedding`` / ``ParallelLMHead``): the vocab is padded
  to a multiple of 64 (``pad_vocab_size``) and split by rows; padding rows are zero.
* ``gate_up_proj`` (``MergedColumnParallelLinear``): ``[gate chunk r | up chunk r]`` on dim 0.
* MoE ``mlp.experts.routed_experts.w13_weight`` ``[E, 2I, H]`` from ``mlp.experts.gate_up_proj`` (gate
  first): ``[gate chunk r | up chunk r]`` on dim 1; ``w2_weight`` ``[E, H, I]`` from
  ``mlp.experts.down_proj``, split on dim 2. With ``expert_parallel=True`` each rank holds whole
  experts (dim 0), placed as vLLM's ``determine_expert_map`` ("linear") does: the first ``E % tp``
  ranks hold one expert more (``Shard(0, balanced=True)``, not ``torch.chunk``).
* ``k`` replicas of TP-``tp`` (vLLM data parallel): a ``(k, tp)`` mesh, ``Replicate`` over the replicas.

Checks append a message to a ``problems`` list instead of raising, so that a recipe reports every
problem at once (:func:`raise_problems`).
"""
from __future__ import annotations

import warnings
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

import torch

from ..layout import Layout, Part, Replicate, Shard
from ..planning import BlockQuant, Plan, plan_quantized

__all__ = ["RecipeSpec", "RecipeBuilder", "tp_layout", "vllm_layout", "pad_vocab_size", "VOCAB_PADDING", "positive_int",
           "rank_list", "check_tp", "check_divisible", "check_vocab", "check_attention", "check_moe", "shared_experts",
           "raise_problems"]

#: vLLM's ``DEFAULT_VOCAB_PADDING_SIZE``.
VOCAB_PADDING = 64


def pad_vocab_size(vocab_size: int, pad_to: int = VOCAB_PADDING) -> int:
    """The vocab rounded up to a multiple of ``pad_to`` (vLLM's ``pad_vocab_size``)."""
    return -(-vocab_size // pad_to) * pad_to


# ------------------------------------------------------------------------------------- checks
def positive_int(value) -> bool:
    """``value`` is an int >= 1 (and not a bool)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def rank_list(value, what: str, problems: list[str]) -> tuple[int, ...]:
    """``value`` (a count, or a non-empty sequence of int ranks) as a tuple of ranks; ``()`` and a
    problem naming ``what`` otherwise."""
    if positive_int(value):
        return tuple(range(value))
    if isinstance(value, Sequence) and not isinstance(value, str) and value and all(
            isinstance(r, int) and not isinstance(r, bool) for r in value):
        return tuple(value)
    problems.append(f"{what}={value!r} must be a non-empty list of ranks (or a count)")
    return ()


def check_tp(tp, problems: list[str]) -> int:
    """vLLM's ``tp``, or 0 (and a problem) when it is not a positive int."""
    if positive_int(tp):
        return tp
    problems.append(f"tp={tp!r} must be a positive int")
    return 0


def check_divisible(problems: list[str], what: str, size: int, by: int, by_what: str = "tp") -> None:
    """``{what}={size} is not divisible by {by_what}={by}`` unless it is."""
    if size % by:
        problems.append(f"{what}={size} is not divisible by {by_what}={by}")


def check_attention(problems: list[str], tp: int, nq: int, nkv: int, *, family: str | None = None) -> None:
    """vLLM's ``QKVParallelLinear`` rules: heads split evenly; KV heads split evenly, or (``tp >=
    nkv``) each replicated over ``tp // nkv`` ranks. ``family``: an attention that divides its KV
    heads over ``tp`` and never replicates them (gpt-oss sizes them ``nkv // tp``: past one a rank
    it gets none and vLLM fails to build it), named in the problem."""
    check_divisible(problems, "num_attention_heads", nq, tp)
    if family is not None and tp > nkv:
        problems.append(f"tp={tp} > num_key_value_heads={nkv} (vLLM's {family} attention divides its KV "
                        f"heads over tp, never replicates them)")
    elif tp >= nkv and tp % nkv:
        problems.append(f"tp={tp} >= num_key_value_heads={nkv} but is not a multiple of it (vLLM replicates "
                        f"each KV head over tp // num_key_value_heads ranks)")
    if tp < nkv:
        check_divisible(problems, "num_key_value_heads", nkv, tp)


def check_vocab(vocab_size: int, tp: int, problems: list[str]) -> None:
    """vLLM splits the padded vocab (``pad_vocab_size``) evenly over ``tp``."""
    padded = pad_vocab_size(vocab_size)
    if padded % tp:
        problems.append(f"padded vocab {padded} (vocab_size={vocab_size} rounded up to {VOCAB_PADDING}) "
                        f"is not divisible by tp={tp}")


def check_moe(problems: list[str], tp: int, model_type: str, *, layers: int, moe_layers: Collection[int],
              intermediate_size: int, experts: tuple[str, int], expert_size: tuple[str, int], expert_parallel: bool,
              vllm_refuses_tp_over_experts: bool = False, shared: tuple[str, int] | None = None,
              lacking: str | None = "experts") -> None:
    """vLLM's MLP size rules for a model of ``layers`` layers, of which ``moe_layers`` hold routed
    experts (laid out by :meth:`RecipeBuilder.experts`); each broken rule appends a problem:

    * the dense layers' ``intermediate_size`` splits over ``tp``;
    * no more ranks than experts (``experts``: the phrase that names their count, and the count):
      vLLM's Qwen3-MoE and Qwen3-Next blocks refuse more whatever the parallelism
      (``vllm_refuses_tp_over_experts``); elsewhere only ``expert_parallel`` needs it (a rank would
      hold no expert);
    * split by TP (no ``expert_parallel``), the experts' ``expert_size`` ``(name, size)`` splits over ``tp``;
    * so do the shared experts, ``shared`` ``(the phrase that names their size, the size)``;
    * ``expert_parallel`` without expert layers names what ``model_type`` is ``lacking`` (None: a
      family whose config may have none, and that takes ``expert_parallel`` anyway)."""
    if len(moe_layers) < layers:
        check_divisible(problems, "intermediate_size", intermediate_size, tp)
    if not moe_layers:
        if expert_parallel and lacking is not None:
            problems.append(f"expert_parallel=True but {model_type} has no {lacking}")
        return
    what, count = experts
    if tp > count and vllm_refuses_tp_over_experts:
        problems.append(f"tp={tp} is greater than {what} (vLLM refuses it too)")
    elif tp > count and expert_parallel:
        problems.append(f"expert_parallel: tp={tp} is greater than {what} (a rank would hold no expert)")
    if not expert_parallel:
        check_divisible(problems, *expert_size, tp)
    if shared is not None and shared[1] % tp:
        problems.append(f"{shared[0]} is not divisible by tp={tp}")


def shared_experts(moe_intermediate_size: int, n_shared: int) -> tuple[str, int]:
    """:func:`check_moe`'s ``shared`` where ``n_shared`` experts of ``moe_intermediate_size`` are one
    dense MLP in vLLM (DeepSeek, GLM-4.5: ``mlp.shared_experts``)."""
    size = moe_intermediate_size * n_shared
    return f"shared experts' intermediate size {size} (moe_intermediate_size * n_shared_experts)", size


def raise_problems(where: str, problems: list[str]) -> None:
    """One ``ValueError`` naming every problem (``"{where}: a; b"``), if there is any."""
    if problems:
        raise ValueError(f"{where}: " + "; ".join(problems))


# ------------------------------------------------------------------------------------- the spec
@dataclass(frozen=True)
class RecipeSpec:
    """A refit between training parameters and vLLM tensor-parallel parameters.

    ``src``: ``{source name: Layout}`` over the trainer ranks (for ``hf_to_vllm``: HF names, global
    shapes, ``Shard(0)`` FSDP rows, the trainer dtype). ``dst``: ``{vLLM parameter name: Layout}`` over
    the inference ranks, ``layout.local_shape(r)`` is exactly vLLM's parameter shape on TP rank r.
    ``parts``: the ``{dst name: [Part, ...]}`` mapping. ``plan()``: the validated, cached Plan.
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


def tp_layout(shape, dst_ranks: Sequence[int], tp: int, placement, dtype: torch.dtype) -> Layout:
    """A tensor-parallel serving engine's parameter layout over ``k * tp`` inference ranks
    (``k = len(dst_ranks) // tp`` replicas of TP-``tp``, in order): ``placement`` over each replica's
    TP ranks; with several replicas a ``(k, tp)`` mesh, ``Replicate`` over the replicas, so each
    replica holds a full copy of one TP group's shards (one replica keeps the 1-D mesh it always
    had). Every recipe's destination side goes through here."""
    if len(dst_ranks) == tp:
        return Layout(shape, dst_ranks, [placement], dtype)
    mesh = [list(dst_ranks[i:i + tp]) for i in range(0, len(dst_ranks), tp)]
    return Layout(shape, mesh, [Replicate(), placement], dtype)


def vllm_layout(shape, dst_ranks: Sequence[int], tp: int, placement, dtype: torch.dtype) -> Layout:
    """Deprecated alias of :func:`tp_layout` (the layout is not vLLM's alone), kept for one release."""
    warnings.warn("tritonreshard.recipes.vllm_layout is deprecated; use tritonreshard.recipes.tp_layout",
                  DeprecationWarning, stacklevel=2)
    return tp_layout(shape, dst_ranks, tp, placement, dtype)


class RecipeBuilder:
    """One recipe's layouts and parts as they are collected, for the recipes whose sources have
    Hugging Face names (:data:`~tritonreshard.recipes.RECIPES`).

    Sources are FSDP rows (``Shard(0)``) of the trainer's tensors over ``src_ranks`` in
    ``src_dtype`` unless told otherwise; destinations are vLLM parameters over ``dst_ranks`` in
    ``dtype``, laid out by :func:`tp_layout` (``k`` replicas of TP-``tp``)."""

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
        self.dst[name] = tp_layout(shape, self.dst_ranks, self.tp, placement, dtype or self.dtype)
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

    def experts(self, pre: str, n_experts: int, inter: int, hidden: int, expert_parallel: bool,
                dst: str | None = None) -> None:
        """Routed experts ``{pre}.experts.gate_up_proj`` ``[E, 2I, H]`` (gate first) and ``down_proj``
        ``[E, H, I]`` -> vLLM's ``{dst}.experts.routed_experts.w13_weight`` / ``w2_weight`` (``dst``:
        vLLM's MoE block where its name differs from ``pre``, Mixtral's ``block_sparse_moe``): split
        by TP (w13 ``[gate chunk r | up chunk r]`` on dim 1, w2 on dim 2), or with
        ``expert_parallel`` whole experts per rank, placed like vLLM's ``determine_expert_map``
        (``balanced``)."""
        E, H, dst = n_experts, hidden, pre if dst is None else dst
        gu, dn = f"{pre}.experts.gate_up_proj", f"{pre}.experts.down_proj"
        self.source(gu, (E, 2 * inter, H))
        self.source(dn, (E, H, inter))
        w13 = Shard(0, balanced=True) if expert_parallel else Shard(1, (inter, inter))
        w2 = Shard(0, balanced=True) if expert_parallel else Shard(2)
        self.target(f"{dst}.experts.routed_experts.w13_weight", (E, 2 * inter, H), w13, [Part(gu, [None] * 3)])
        self.target(f"{dst}.experts.routed_experts.w2_weight", (E, H, inter), w2, [Part(dn, [None] * 3)])

    def spec(self, model_type: str, expert_parallel: bool, quant: dict[str, BlockQuant] | None = None) -> RecipeSpec:
        """The collected layouts and parts as a :class:`RecipeSpec`."""
        return RecipeSpec(model_type, self.tp, expert_parallel, self.src, self.dst, self.parts, dict(quant or {}))
