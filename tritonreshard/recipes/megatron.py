"""Megatron-Core (0.19) training shards -> vLLM tensor-parallel parameters.

Pure Python planning (no Megatron, transformers or vLLM import). The destination side is exactly
:func:`~tritonreshard.recipes.hf.hf_to_vllm`'s (vLLM's names, layouts and zero padding); every
region that recipe reads from a Hugging Face parameter is read here from the Megatron tensor that
holds it, split where it crosses Megatron tensors. Nothing is gathered: each vLLM rank copies
straight from the Megatron ranks' local shards.

Megatron-Core facts used (checked against megatron-core 0.19.2 on CPU, ``tests/test_megatron.py``):

* ``linear_qkv`` is interleaved per query group ``[q heads of group 0 | k0 | v0][group 1 ...]``
  (its bias too); TP rank r holds the r-th contiguous row slice (whole groups).
* ``linear_fc1`` is ``[gate; up]`` and TP rank r holds ``[gate_r; up_r]``: ``Shard(0, blocks=(I, I))``.
  ``linear_proj`` / ``linear_fc2`` are split on dim 1; norms, q/k layernorms and the router are
  replicated.
* Ranks, order "tp-cp-ep-dp-pp" (cp = 1): dense ``rank = tp_rank + tp * (dp_rank + dp * pp_rank)``;
  experts ``rank = etp_rank + etp * (ep_rank + ep * (edp_rank + edp * pp_rank))`` with
  ``edp = tp * dp / (etp * ep)``; global expert ``e`` lives on ``ep_rank = e // (E / ep)``.
* Stage ``p`` holds layers ``[p * L / pp, (p + 1) * L / pp)`` (with ``vpp`` virtual chunks: chunk
  ``k`` of ``L / (pp * vpp)`` layers on stage ``k % pp``), the first the embedding, the last the
  final norm and ``output_layer``. Tied embeddings: no ``output_layer`` with pp = 1; with pp > 1 the
  last stage's ``output_layer.weight`` is a real copy of the embedding, kept equal by Megatron (the
  first stage's copy initialises it and their gradients are all-reduced), under its own name. The
  recipe names both copies as aliases of one source (``Part((embedding, output_layer), ...)``): the
  planner treats every rank of either copy as a replica, spreads the reads over both stages (and
  their DP replicas), and a host planner reads whichever copy is on the destination's host.
* The vocab is padded to a multiple of ``vocab_divisible_by * tp``; only rows ``[0, V)`` move (the
  dummy rows hold trained junk), vLLM's own padding is zero-filled.

Source names are Megatron's checkpoint names (Transformer-Engine layer spec) with global layer
numbers and global expert ids. An expert's tensors carry a leading dim of 1
(``local_experts.{e}.linear_fc1.weight``: ``[1, 2I, H]``): each is one slab of vLLM's ``[E, ...]``
stacks, and the planner maps boxes of equal rank. :func:`megatron_tensors` gives those as views.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch

from ..layout import Layout, Part, Replicate, Shard
from .builder import RecipeSpec, check_divisible, positive_int, raise_problems, rank_list
from .dense import FAMILIES, moe_layers
from .hf import hf_to_vllm

__all__ = ["Megatron", "megatron_to_vllm", "megatron_tensors", "megatron_bind", "megatron_vocab_size"]


@dataclass(frozen=True)
class Megatron:
    """A Megatron-Core trainer's parallel settings (cp = 1, default rank order "tp-cp-ep-dp-pp").

    ``tp``, ``pp``: tensor and pipeline parallel sizes; ``ep``: expert parallel size; ``etp``: expert
    tensor parallel size (None: ``tp``, as Megatron); ``vocab_divisible_by``: Megatron's
    ``--make-vocab-size-divisible-by`` (the vocab is padded to a multiple of it times ``tp``);
    ``vpp``: virtual pipeline chunks per stage (Megatron's interleaved schedule: the layers split into
    ``pp * vpp`` equal chunks, chunk ``k`` on stage ``k % pp``). The data parallel size is
    ``world / (tp * pp)``, from the trainer ranks the recipe is given.
    """

    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int | None = None
    vocab_divisible_by: int = 128
    vpp: int = 1

    def __post_init__(self):
        bad = [f"{k}={getattr(self, k)!r} must be a positive int"
               for k in ("tp", "pp", "ep", "vocab_divisible_by", "vpp") if not positive_int(getattr(self, k))]
        if self.etp is not None and not positive_int(self.etp):
            bad.append(f"etp={self.etp!r} must be a positive int or None (= tp)")
        if bad:
            raise ValueError("Megatron: " + "; ".join(bad))

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp

    def dense_rank(self, tp_rank: int, dp_rank: int, pp_rank: int, dp: int) -> int:
        """Megatron rank (index into the trainer ranks) of a dense parameter's coordinates."""
        return tp_rank + self.tp * (dp_rank + dp * pp_rank)

    def expert_rank(self, etp_rank: int, ep_rank: int, edp_rank: int, pp_rank: int, dp: int) -> int:
        """Megatron rank of an expert parameter's coordinates (the expert grid)."""
        edp = self.tp * dp // (self.expert_tp * self.ep)
        return etp_rank + self.expert_tp * (ep_rank + self.ep * (edp_rank + edp * pp_rank))


def megatron_vocab_size(vocab_size: int, megatron: Megatron) -> int:
    """Megatron's padded vocab: a multiple of ``vocab_divisible_by * tp`` (Megatron-LM's
    ``_vocab_size_with_padding``), so it changes with tp: 300 -> 384 at tp 1, 512 at tp 2."""
    m = megatron.vocab_divisible_by * megatron.tp
    return -(-vocab_size // m) * m


def megatron_to_vllm(config: Any, *, megatron: Megatron, tp: int, trainer_ranks, inference_ranks,
                     dtype: torch.dtype = torch.bfloat16, src_dtype: torch.dtype = torch.bfloat16,
                     expert_parallel: bool = False, quantization: str | None = None,
                     scale_rule: str = "deepgemm") -> RecipeSpec:
    """The layouts and parts that refit a Megatron-Core model's TP x PP x DP x EP shards into vLLM.

    Args:
        config: the model's ``transformers`` config (llama, mistral, qwen2, qwen3, qwen3_moe).
        megatron: the trainer's :class:`Megatron` settings.
        tp: vLLM's tensor-parallel size.
        trainer_ranks: global ranks of Megatron ranks 0..world-1, in Megatron rank order, or their count.
        inference_ranks: global ranks of ``k * tp`` vLLM ranks (``k`` replicas of TP-``tp``, in
            order, as in ``hf_to_vllm``), or their count.
        dtype: vLLM's parameter dtype; ``src_dtype``: Megatron's parameter dtype.
        expert_parallel: vLLM's ``enable_expert_parallel``.
        quantization, scale_rule: vLLM's block-FP8 destinations, as in ``hf_to_vllm``.

    Returns a :class:`~tritonreshard.recipes.RecipeSpec`: ``src`` ``{Megatron name: Layout}`` over the
    trainer ranks (global shapes, padded vocab, experts ``[1, ...]``), ``dst`` exactly
    ``hf_to_vllm``'s, ``parts`` from Megatron names.

    Raises one ``ValueError`` naming every problem: world not divisible by ``tp * pp``, layers by
    ``pp``, heads or query groups by Megatron's tp, experts by ``ep``, ``etp * ep`` not dividing
    ``tp * dp``, FFN sizes by tp / etp, and whatever ``hf_to_vllm`` refuses.
    """
    if not isinstance(megatron, Megatron):
        raise ValueError(f"megatron_to_vllm: megatron must be a trs.recipes.Megatron, got {megatron!r}")
    problems: list[str] = []
    src_ranks = rank_list(trainer_ranks, "trainer_ranks", problems)
    model_type = getattr(config, "model_type", None)
    if model_type not in FAMILIES:
        problems.append(f"config.model_type={model_type!r} has no recipe; known: {sorted(FAMILIES)}")
    raise_problems("megatron_to_vllm", problems)
    sizes = _Sizes.of(config, megatron, len(src_ranks))
    raise_problems(f"megatron_to_vllm: {model_type} with {megatron} over {sizes.W} trainer ranks",
                   _size_problems(sizes, megatron, model_type))

    hf = hf_to_vllm(config, tp=tp, trainer_ranks=src_ranks, inference_ranks=inference_ranks, dtype=dtype,
                    src_dtype=src_dtype, expert_parallel=expert_parallel, quantization=quantization,
                    scale_rule=scale_rule)
    sources = _MegatronSources(hf.src, megatron, sizes, src_ranks, src_dtype)
    sources.vocab_and_final_norm(bool(getattr(config, "tie_word_embeddings", False)))
    for i in range(sizes.L):
        sources.layer(i)
    missing = sorted(set(hf.src) - set(sources.pieces))
    assert not missing, f"megatron_to_vllm: no Megatron mapping for HF sources {missing}"  # a new family row
    parts = _megatron_parts(hf, sources.pieces)
    return RecipeSpec(hf.model_type, hf.tp, hf.expert_parallel, sources.src, dict(hf.dst), parts, dict(hf.quant))


@dataclass(frozen=True)
class _Sizes:
    """The model's sizes (from its ``transformers`` config) and the trainer's world ``W`` and data
    parallel size ``dp`` (0 when ``W`` is not a multiple of ``tp * pp``), as megatron_to_vllm reads them."""

    W: int
    H: int
    nq: int
    nkv: int
    hd: int
    L: int
    V: int
    inter: int
    moe: set[int]  # moe_layers(config)
    E: int
    moe_i: int
    dp: int

    @classmethod
    def of(cls, config: Any, m: Megatron, W: int) -> _Sizes:
        H, nq = config.hidden_size, config.num_attention_heads
        nkv = getattr(config, "num_key_value_heads", None) or nq
        moe = moe_layers(config)
        return cls(W=W, H=H, nq=nq, nkv=nkv, hd=getattr(config, "head_dim", None) or H // nq,
                   L=config.num_hidden_layers, V=config.vocab_size, inter=getattr(config, "intermediate_size", 0),
                   moe=moe, E=getattr(config, "num_experts", 0) if moe else 0,
                   moe_i=getattr(config, "moe_intermediate_size", 0),
                   dp=W // (m.tp * m.pp) if W % (m.tp * m.pp) == 0 else 0)


def _size_problems(z: _Sizes, m: Megatron, model_type: str) -> list[str]:
    """Every way the model's sizes do not split over Megatron's parallel settings."""
    problems: list[str] = []
    mtp, pp, ep, etp = m.tp, m.pp, m.ep, m.expert_tp
    if not z.dp:
        problems.append(f"world {z.W} (len(trainer_ranks)) is not divisible by tp*pp={mtp}*{pp}")
    if z.L % (pp * m.vpp):
        problems.append(f"num_hidden_layers={z.L} is not divisible by pp={pp}" +
                        (f" * vpp={m.vpp}" if m.vpp > 1 else ""))
    check_divisible(problems, "num_attention_heads", z.nq, mtp, "Megatron tp")
    if z.nkv % mtp:
        problems.append(f"num_key_value_heads={z.nkv} (query groups) is not divisible by Megatron tp={mtp}")
    if z.nq % z.nkv:
        problems.append(f"num_attention_heads={z.nq} is not a multiple of num_key_value_heads={z.nkv}")
    if len(z.moe) < z.L:
        check_divisible(problems, "intermediate_size", z.inter, mtp, "Megatron tp")
    if z.moe:
        check_divisible(problems, "num_experts", z.E, ep, "ep")
        check_divisible(problems, "moe_intermediate_size", z.moe_i, etp, "etp")
    elif ep > 1 or m.etp not in (None, mtp):
        problems.append(f"ep={ep}, etp={m.etp} but {model_type} has no expert layers")
    if z.dp and (mtp * z.dp) % (etp * ep):
        problems.append(f"etp*ep={etp}*{ep} does not divide tp*dp={mtp}*{z.dp} (expert-DP would not be whole)")
    return problems


#: One piece of an HF source held by a Megatron tensor: (HF box start, HF box stop, Megatron name (or
#: aliases: copies), Megatron start).
_Piece = tuple[tuple[int, ...], tuple[int, ...], "str | tuple[str, ...]", tuple[int, ...]]


class _MegatronSources:
    """The Megatron tensors' layouts (``src``) as they are collected, and ``pieces``: ``{HF name:
    [_Piece, ...]}``, where each region of every HF source lives among them."""

    def __init__(self, hf_src: dict[str, Layout], m: Megatron, sizes: _Sizes, src_ranks, src_dtype: torch.dtype):
        self.hf_src, self.m, self.z, self.src_ranks, self.src_dtype = hf_src, m, sizes, src_ranks, src_dtype
        self.src: dict[str, Layout] = {}
        self.pieces: dict[str, list[_Piece]] = {}

    def dense(self, name, shape, placement, stage):
        """A dense Megatron tensor of stage ``stage``: ``placement`` over its TP ranks, replicated over DP."""
        m, dp = self.m, self.z.dp
        mesh = [[self.src_ranks[m.dense_rank(t, d, stage, dp)] for t in range(m.tp)] for d in range(dp)]
        self.src[name] = Layout(shape, mesh, [Replicate(), placement], self.src_dtype)

    def same(self, hf_name, name, stage, placement=Replicate()):
        """A Megatron tensor that is the whole of HF source ``hf_name``."""
        shape = self.hf_src[hf_name].shape
        self.dense(name, shape, placement, stage)
        self.pieces[hf_name] = [((0,) * len(shape), shape, name, (0,) * len(shape))]

    def vocab_and_final_norm(self, tied: bool):
        """Embedding: rows [0, V) of Megatron's padded vocab. Tied, pp = 1: output_layer is the
        embedding's own tensor; tied, pp > 1: the last stage's copy is an alias of the first's."""
        pp, V, H = self.m.pp, self.z.V, self.z.H
        Vm = megatron_vocab_size(V, self.m)
        emb, out = "embedding.word_embeddings.weight", "output_layer.weight"
        self.dense(emb, (Vm, H), Shard(0), 0)
        if not tied or pp > 1:
            self.dense(out, (Vm, H), Shard(0), pp - 1)
        if not tied:
            self.pieces["lm_head.weight"] = [((0, 0), (V, H), out, (0, 0))]
        self.pieces["model.embed_tokens.weight"] = [((0, 0), (V, H), (emb, out) if tied and pp > 1 else emb, (0, 0))]
        self.same("model.norm.weight", "decoder.final_layernorm.weight", pp - 1)

    def layer(self, i: int):
        """Decoder layer ``i`` (global), on the stage its virtual chunk is on."""
        stage = (i // (self.z.L // (self.m.pp * self.m.vpp))) % self.m.pp
        hpre, mpre = f"model.layers.{i}", f"decoder.layers.{i}"
        self.attention(f"{hpre}.self_attn", f"{mpre}.self_attention", stage)
        self.same(f"{hpre}.input_layernorm.weight", f"{mpre}.self_attention.linear_qkv.layer_norm_weight", stage)
        if i in self.z.moe:
            self.same(f"{hpre}.post_attention_layernorm.weight", f"{mpre}.pre_mlp_layernorm.weight", stage)
            self.experts(f"{hpre}.mlp", f"{mpre}.mlp", stage)
        else:
            self.same(f"{hpre}.post_attention_layernorm.weight", f"{mpre}.mlp.linear_fc1.layer_norm_weight", stage)
            self.mlp(f"{hpre}.mlp", f"{mpre}.mlp", stage)

    def attention(self, att, matt, stage):
        """q/k/v from ``linear_qkv``, interleaved per query group; o_proj, the q/k norms."""
        nkv, hd = self.z.nkv, self.z.hd
        qpg = self.z.nq // nkv
        for suffix, tail in (("weight", (self.z.H,)), ("bias", ())):
            if f"{att}.q_proj.{suffix}" not in self.hf_src:
                continue
            qkv = f"{matt}.linear_qkv.{suffix}"
            self.dense(qkv, (nkv * (qpg + 2) * hd, *tail), Shard(0), stage)
            zeros, full = (0,) * len(tail), tuple(tail)
            for x, width, at in (("q", qpg * hd, 0), ("k", hd, qpg * hd), ("v", hd, (qpg + 1) * hd)):
                self.pieces[f"{att}.{x}_proj.{suffix}"] = [
                    ((g * width, *zeros), ((g + 1) * width, *full), qkv, (g * (qpg + 2) * hd + at, *zeros))
                    for g in range(nkv)]
        self.same(f"{att}.o_proj.weight", f"{matt}.linear_proj.weight", stage, Shard(1))
        if f"{att}.o_proj.bias" in self.hf_src:
            self.same(f"{att}.o_proj.bias", f"{matt}.linear_proj.bias", stage)
        if f"{att}.q_norm.weight" in self.hf_src:
            self.same(f"{att}.q_norm.weight", f"{matt}.q_layernorm.weight", stage)
            self.same(f"{att}.k_norm.weight", f"{matt}.k_layernorm.weight", stage)

    def experts(self, mlp, mmlp, stage):
        """The router and each expert's ``[1, ...]`` slab of the HF ``[E, ...]`` stacks, on the expert grid."""
        m, z = self.m, self.z
        H, moe_i, etp = z.H, z.moe_i, m.expert_tp
        edp = m.tp * z.dp // (etp * m.ep)
        self.same(f"{mlp}.gate.weight", f"{mmlp}.router.weight", stage)
        per_ep = z.E // m.ep
        for e in range(z.E):
            ep_rank = e // per_ep
            mesh = [[self.src_ranks[m.expert_rank(t, ep_rank, d, stage, z.dp)] for t in range(etp)]
                    for d in range(edp)]
            fc1, fc2 = (f"{mmlp}.experts.local_experts.{e}.linear_fc{k}.weight" for k in (1, 2))
            self.src[fc1] = Layout((1, 2 * moe_i, H), mesh, [Replicate(), Shard(1, (moe_i, moe_i))], self.src_dtype)
            self.src[fc2] = Layout((1, H, moe_i), mesh, [Replicate(), Shard(2)], self.src_dtype)
            self.pieces.setdefault(f"{mlp}.experts.gate_up_proj", []).append(
                ((e, 0, 0), (e + 1, 2 * moe_i, H), fc1, (0, 0, 0)))
            self.pieces.setdefault(f"{mlp}.experts.down_proj", []).append(
                ((e, 0, 0), (e + 1, H, moe_i), fc2, (0, 0, 0)))

    def mlp(self, mlp, mmlp, stage):
        """A dense MLP: gate/up from ``linear_fc1`` (``[gate; up]``), down from ``linear_fc2``."""
        inter = self.z.inter
        for suffix, tail in (("weight", (self.z.H,)), ("bias", ())):
            if f"{mlp}.gate_proj.{suffix}" not in self.hf_src:
                continue
            fc1 = f"{mmlp}.linear_fc1.{suffix}"
            self.dense(fc1, (2 * inter, *tail), Shard(0, (inter, inter)), stage)
            zeros = (0,) * len(tail)
            self.pieces[f"{mlp}.gate_proj.{suffix}"] = [((0, *zeros), (inter, *tail), fc1, (0, *zeros))]
            self.pieces[f"{mlp}.up_proj.{suffix}"] = [((0, *zeros), (inter, *tail), fc1, (inter, *zeros))]
        self.same(f"{mlp}.down_proj.weight", f"{mmlp}.linear_fc2.weight", stage, Shard(1))
        if f"{mlp}.down_proj.bias" in self.hf_src:
            self.same(f"{mlp}.down_proj.bias", f"{mmlp}.linear_fc2.bias", stage)


def _megatron_parts(hf: RecipeSpec, pieces: dict[str, list[_Piece]]) -> dict[str, tuple[Part, ...]]:
    """``hf``'s parts with each HF source region re-read from the Megatron tensors holding it."""
    parts: dict[str, tuple[Part, ...]] = {}
    scales = {q.scale for q in hf.quant.values()}  # written by the quantizer, read from no source
    for name, lay in hf.dst.items():
        if name in scales:
            continue
        plist = hf.parts.get(name) or (Part(name, [None] * lay.ndim),)
        out: list[Part] = []
        for p in plist:
            out.extend(_split_part(name, p, lay, pieces))
        parts[name] = tuple(out)
    return parts


def _split_part(name: str, p: Part, lay: Layout, pieces: dict[str, list[_Piece]]) -> list[Part]:
    """Part ``p`` of destination ``name`` (an HF source region, or a fill) as the parts that read
    it from Megatron tensors, one per piece it crosses."""
    box = [(0, n) if iv is None else iv for iv, n in zip(p.dst, lay.shape, strict=True)]
    if p.src is None:
        return [Part(None, box)]
    # Megatron's families (dense FAMILIES) have no transposed parts; re-reading one piecewise would
    # need its source box cut along the source's dims, which this does not do.
    assert p.src_dims is None, f"{name}: {p} is transposed; megatron_to_vllm does not re-read transposed parts"
    start = p.src_start or (0,) * lay.ndim
    lo = tuple(start)
    hi = tuple(s + (b - a) for s, (a, b) in zip(start, box, strict=True))
    out: list[Part] = []
    covered = 0
    for plo, phi, mname, morigin in pieces[p.src]:
        ilo = tuple(max(a, b) for a, b in zip(lo, plo, strict=True))
        ihi = tuple(min(a, b) for a, b in zip(hi, phi, strict=True))
        if any(a >= b for a, b in zip(ilo, ihi, strict=True)):
            continue
        covered += _numel(ilo, ihi)
        out.append(Part(mname, [(a + (x - s), a + (y - s)) for (a, _), x, y, s in zip(box, ilo, ihi, lo, strict=True)],
                        tuple(o + (x - q) for o, x, q in zip(morigin, ilo, plo, strict=True))))
    assert covered == _numel(lo, hi), f"{name}: {p} is not covered by Megatron tensors"
    return out


def _numel(lo, hi) -> int:
    n = 1
    for a, b in zip(lo, hi, strict=True):
        n *= max(0, b - a)
    return n


# Megatron-Core local layer spec -> Transformer-Engine spec (checkpoint) names, inside one layer.
_LOCAL_NORMS = {"input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight"}
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")
_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(.*)$")
_GROUPED = re.compile(r"^mlp\.experts\.(weight[12]|linear_fc[12]\.weight\d+)$")


def megatron_tensors(model_chunks, *, megatron: Megatron, rank: int) -> dict[str, torch.Tensor]:
    """A Megatron rank's parameters under :func:`megatron_to_vllm`'s source names, without copying.

    Args:
        model_chunks: this rank's Megatron-Core ``GPTModel`` chunk(s) (one, or the list of its
            virtual pipeline chunks, ``Megatron(vpp=...)``), local or Transformer-Engine layer spec
            (DDP / Float16Module wrappers are unwrapped through ``.module``).
        megatron: the trainer's :class:`Megatron` settings.
        rank: this process's Megatron rank (its index in ``trainer_ranks``).

    Returns ``{name: tensor}``: the parameters' own storage, detached (``param.detach()``: shape =
    the local shard; experts ``param.detach().unsqueeze(0)``, ``[1, 2I/etp, H]`` and
    ``[1, H, I/etp]``); dtype: the parameters'. :func:`megatron_bind` then re-points the parameters
    at a trainer's arena. Layer numbers are global (Megatron's ``layer_number - 1``); expert ids
    are global (the MoE layer's ``local_expert_indices``). Local-spec norms are renamed (``input_layernorm`` ->
    ``self_attention.linear_qkv.layer_norm_weight``; a dense layer's ``pre_mlp_layernorm`` ->
    ``mlp.linear_fc1.layer_norm_weight``). Tied embeddings on a last stage of pp > 1: its
    ``output_layer.weight`` (Megatron's copy of the embedding) keeps its name.

    Raises ``ValueError`` naming every parameter it cannot map (grouped-GEMM experts, unknown
    modules), and ``ValueError`` if ``megatron`` or ``rank`` does not fit the chunks.
    """
    return {n: p.detach().unsqueeze(0) if ".local_experts." in n else p.detach()
            for n, p in _global_params(model_chunks, megatron, rank, "megatron_tensors").items()}


def megatron_bind(model_chunks, tensors, *, megatron: Megatron, rank: int) -> None:
    """Re-point this rank's Megatron parameters at ``tensors`` (``param.data = tensors[name]``), so
    that training updates them in place: hand it a trainer's arena after set-up,
    ``megatron_bind(model, tr.source_tensors, megatron=meg, rank=r)``, and every ``publish()`` then
    serves what the optimizer wrote, with no copy per step. ``tensors``: ``{name: tensor}`` under
    :func:`megatron_tensors`' names and shapes. Not for Megatron's distributed optimizer, whose
    parameters are views of its own gather buffer.

    Raises one ``ValueError`` naming every missing or mismatching tensor, before re-pointing any.
    """
    params = _global_params(model_chunks, megatron, rank, "megatron_bind")
    problems = []
    for name, p in params.items():
        t = tensors.get(name) if hasattr(tensors, "get") else None
        want = (1, *p.shape) if ".local_experts." in name else tuple(p.shape)
        if not isinstance(t, torch.Tensor):
            problems.append(f"tensors has no {name!r}")
        elif tuple(t.shape) != want or t.dtype != p.dtype or not t.is_contiguous():
            problems.append(f"tensors[{name!r}] is {tuple(t.shape)} {t.dtype} (contiguous: {t.is_contiguous()}), "
                            f"the parameter needs {want} {p.dtype} contiguous")
    if problems:
        raise ValueError(f"megatron_bind (rank {rank}): " + "; ".join(problems))
    for name, p in params.items():
        p.data = tensors[name].view(p.shape)


def _global_params(model_chunks, megatron: Megatron, rank: int, what: str) -> dict[str, torch.nn.Parameter]:
    """``{global name: parameter}`` of a rank's chunks (see :func:`megatron_tensors`)."""
    if not isinstance(megatron, Megatron):
        raise ValueError(f"{what}: megatron must be a trs.recipes.Megatron, got {megatron!r}")
    chunks = list(model_chunks) if isinstance(model_chunks, (list, tuple)) else [model_chunks]
    out: dict[str, torch.Tensor] = {}
    problems: list[str] = []
    ep_rank = (rank // megatron.expert_tp) % megatron.ep
    for c, chunk in enumerate(chunks):
        model = chunk
        while not hasattr(model, "decoder") and hasattr(model, "module"):  # DDP / Float16Module wrappers
            model = model.module
        tied = bool(getattr(model, "share_embeddings_and_output_weights", False))
        layers = {}
        for j, layer in enumerate(getattr(getattr(model, "decoder", None), "layers", ()) or ()):
            layers[j] = layer
        for name, p in model.named_parameters():
            where = f"chunk {c}: {name}"
            hit = _LAYER.match(name)
            if hit is None:
                if name == "output_layer.weight" and tied and getattr(model, "pre_process", False):
                    continue  # pp = 1 shares the embedding's tensor (never listed twice anyway)
                if name not in ("embedding.word_embeddings.weight", "output_layer.weight",
                                  "decoder.final_layernorm.weight"):
                    problems.append(f"{where}: no vLLM destination (position embeddings, MTP, ... are not supported)")
                    continue
                _put(out, name, p, where, problems)
                continue
            local, rest = int(hit.group(1)), hit.group(2)
            layer = layers.get(local)
            number = getattr(layer, "layer_number", None)
            if number is None:
                problems.append(f"{where}: layer {local} has no layer_number")
                continue
            mlp = getattr(layer, "mlp", None)
            moe = hasattr(mlp, "router")
            if _GROUPED.match(rest):
                problems.append(f"{where}: grouped-GEMM experts are not supported; build the model with "
                                f"moe_grouped_gemm=False (SequentialMLP: experts.local_experts.{{e}})")
                continue
            ex = _EXPERT.match(rest)
            if ex is not None:
                indices = list(getattr(mlp, "local_expert_indices", ()) or ())
                e = int(ex.group(1))
                if e >= len(indices):
                    problems.append(f"{where}: the MoE layer's local_expert_indices={indices} has no entry {e}")
                    continue
                if indices[0] // len(indices) != ep_rank:
                    problems.append(f"{where}: experts {indices} belong to ep rank {indices[0] // len(indices)}, "
                                    f"but rank {rank} is ep rank {ep_rank} under {megatron}")
                gname = f"decoder.layers.{number - 1}.mlp.experts.local_experts.{indices[e]}.{ex.group(2)}"
                _put(out, gname, p, where, problems)
                continue
            if rest in _LOCAL_NORMS:
                rest = _LOCAL_NORMS[rest]
            elif rest == "pre_mlp_layernorm.weight" and not moe:
                rest = "mlp.linear_fc1.layer_norm_weight"
            _put(out, f"decoder.layers.{number - 1}.{rest}", p, where, problems)
    if problems:
        raise ValueError(f"{what} (rank {rank}): " + "; ".join(problems))
    return out


def _put(out, name, t, where, problems) -> None:
    if name in out:
        problems.append(f"{where}: {name!r} appears twice (overlapping model chunks?)")
    out[name] = t
