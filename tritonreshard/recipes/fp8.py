"""vLLM 0.32's block-FP8 serving layout as a recipe destination (``quantization="fp8-block"``).

Pure Python. :func:`quantize_destinations` turns a recipe's vLLM destination layouts (bf16 linears)
into the layout ``Fp8LinearMethod`` / ``Fp8MoEMethod`` create with ``weight_block_size=[128, 128]``
(checked against vLLM 0.32's ``quantization/fp8.py`` ``create_weights``,
``utils/fp8_utils.py`` ``create_fp8_scale_parameter`` / ``validate_fp8_block_shape(_moe)`` and the
``BlockQuantScaleParameter`` branches of ``layers/linear.py``'s loaders):

==========================================  ===================  ===========================================
tensor                                      dtype                local shape
==========================================  ===================  ===========================================
``<linear>.weight``                         float8_e4m3fn        ``[N_loc, K_loc]``
``<linear>.weight_scale_inv``               float32              ``[ceil(N_loc/128), ceil(K_loc/128)]``
``...w13_weight``                           float8_e4m3fn        ``[E_loc, 2*I_loc, H]``
``...w13_weight_scale_inv``                 float32              ``[E_loc, 2*ceil(I_loc/128), ceil(H/128)]``
``...w2_weight``                            float8_e4m3fn        ``[E_loc, H, I_loc]``
``...w2_weight_scale_inv``                  float32              ``[E_loc, ceil(H/128), ceil(I_loc/128)]``
embeddings, lm_head, norms, router, biases  the recipe's dtype    unchanged
==========================================  ===================  ===========================================

Linears are ``qkv_proj``, ``o_proj``, ``gate_up_proj``, ``down_proj``. A merged linear's logical
partitions (q, k, v; gate, up) each have their own block grid, as vLLM's loader places the scales of
separately quantized checkpoint tensors (``shard_offset // block_n``). ``s`` is the dequantization
multiplier (``w ~= q * s``); the formula is in :mod:`tritonreshard.kernels.quantize`.
"""
from __future__ import annotations

import torch

from ..layout import Layout, Shard
from ..planning import FP8_DTYPE, SCALE_RULES, BlockQuant

__all__ = ["QUANTIZATIONS", "BLOCK", "SCALE_SUFFIX", "check_quantization", "quantize_destinations"]

#: ``quantization=`` values: block FP8 with fp32 scales, and with power-of-two (UE8M0) scales.
QUANTIZATIONS = ("fp8-block", "fp8-block-ue8m0")
BLOCK = (128, 128)  # vLLM's weight_block_size for DeepSeek-style block FP8
SCALE_SUFFIX = "_scale_inv"  # "x.weight" -> "x.weight_scale_inv", "w13_weight" -> "w13_weight_scale_inv"

# name suffix -> kind: column / row parallel linears (vLLM's LinearBase) and the fused MoE weights
_KINDS = {"qkv_proj.weight": "column", "gate_up_proj.weight": "column", "o_proj.weight": "row",
          "down_proj.weight": "row", "w13_weight": "w13", "w2_weight": "w2"}


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def check_quantization(quantization, scale_rule) -> list[str]:
    """Problems with the recipe's ``quantization=`` / ``scale_rule=`` arguments."""
    out = []
    if quantization is not None and quantization not in QUANTIZATIONS:
        out.append(f"quantization={quantization!r} must be None or one of {QUANTIZATIONS}")
    if scale_rule not in SCALE_RULES:
        out.append(f"scale_rule={scale_rule!r} must be one of {SCALE_RULES}")
    elif quantization == "fp8-block-ue8m0" and scale_rule != "deepgemm":
        out.append(f"quantization='fp8-block-ue8m0' rounds DeepGEMM's scale (scale_rule='deepgemm'), "
                   f"not scale_rule={scale_rule!r}")
    return out


def _kind(name: str) -> str | None:
    for suffix, kind in _KINDS.items():
        if name.endswith("." + suffix) or name == suffix:
            return kind
    return None


def _split(lay: Layout, dim: int) -> tuple[int, tuple[int, ...] | None]:
    """(ways dim is split over the mesh, its blocks or None)."""
    ways, blocks = 1, None
    for size, p in zip(lay.mesh_shape, lay.placements, strict=True):
        if isinstance(p, Shard) and p.dim % len(lay.shape) == dim:
            ways *= size
            blocks = p.blocks if p.blocks is not None else blocks
    return ways, blocks


def _vllm_refusal(kind: str, lay: Layout, tp: int) -> tuple[tuple[int, ...], str | None]:
    """(the local logical partitions of the quantized rows, vLLM's refusal or None), mirroring
    ``validate_fp8_block_shape`` (linears) and ``validate_fp8_block_shape_moe`` (experts) exactly."""
    bn, bk = BLOCK
    nd = len(lay.shape)
    n, k = lay.shape[-2], lay.shape[-1]
    n_ways, n_blocks = _split(lay, nd - 2)
    k_ways, _ = _split(lay, nd - 1)
    if kind in ("w13", "w2"):
        inter = n // 2 if kind == "w13" else k
        i_loc = inter // (n_ways if kind == "w13" else k_ways)
        rows = (i_loc, i_loc) if kind == "w13" else (n,)
        if i_loc % bn:
            return rows, (f"the output_size of gate's and up's weight = {i_loc} is not divisible by weight "
                          f"quantization block_n = {bn}")
        if tp > 1 and i_loc % bk:
            return rows, (f"the input_size of down's weight = {i_loc} is not divisible by weight "
                          f"quantization block_k = {bk}")
        return rows, None
    parts = n_blocks if n_blocks is not None else (n,)
    rows = tuple(p // n_ways for p in parts)
    k_loc = k // k_ways
    if tp > 1 and k // k_loc == tp and k_loc % bk:
        return rows, f"weight input_size_per_partition = {k_loc} is not divisible by weight quantization block_k = {bk}"
    is_tp_split = tp > 1 and n // sum(rows) == tp
    if is_tp_split or len(rows) > 1:
        check = rows if is_tp_split else rows[:-1]  # merged, not split: the last may be ragged
        for r in check:
            if r % bn:
                return rows, (f"weight output_partition_size = {r} is not divisible by weight quantization "
                              f"block_n = {bn}")
    return rows, None


def _scale_layout(lay: Layout) -> Layout:
    """The scale's global layout: every block of the weight's split dims becomes its block count, so
    each rank's local scale is the grid of its local weight."""
    bn, bk = BLOCK
    nd = len(lay.shape)
    shape = list(lay.shape)
    shape[-2], shape[-1] = _cdiv(shape[-2], bn), _cdiv(shape[-1], bk)
    placements = []
    for p in lay.placements:
        if isinstance(p, Shard) and p.dim % nd >= nd - 2:
            b = bn if p.dim % nd == nd - 2 else bk
            if p.blocks is not None:
                placements.append(Shard(p.dim, tuple(_cdiv(x, b) for x in p.blocks)))
                shape[p.dim % nd] = sum(_cdiv(x, b) for x in p.blocks)
                continue
        placements.append(p)
    return Layout(tuple(shape), lay.mesh, placements, torch.float32)


def quantize_destinations(dst: dict[str, Layout], tp: int, quantization: str, scale_rule: str = "deepgemm",
                          where: str = "") -> dict[str, BlockQuant]:
    """Rewrite ``dst`` (a recipe's vLLM layouts, in place) to vLLM's block-FP8 layout: each quantized
    weight becomes ``float8_e4m3fn`` and gains its ``<name>_scale_inv`` float32 layout. Returns
    ``{weight name: BlockQuant}`` (``plan_quantized``'s ``quant=``).

    Raises one ``ValueError`` naming every tensor vLLM's ``validate_fp8_block_shape(_moe)`` would
    refuse (a TP-split out- or in-size not a multiple of 128), with vLLM's reason.
    """
    problems = check_quantization(quantization, scale_rule)
    if problems:
        raise ValueError(f"{where}: " + "; ".join(problems))
    quant: dict[str, BlockQuant] = {}
    refused = []
    for name in sorted(dst):
        kind = _kind(name)
        if kind is None:
            continue
        lay = dst[name]
        rows, why = _vllm_refusal(kind, lay, tp)
        if why is not None:
            refused.append(f"{name} {tuple(lay.shape)} at tp={tp}: {why}")
            continue
        quant[name] = BlockQuant(name + SCALE_SUFFIX, rows, BLOCK, quantization == "fp8-block-ue8m0", scale_rule)
    if refused:
        raise ValueError(f"{where}: {quantization} refused (vLLM's validate_fp8_block_shape would): "
                         + "; ".join(refused))
    for name, q in quant.items():
        lay = dst[name]
        dst[q.scale] = _scale_layout(lay)
        dst[name] = Layout(lay.shape, lay.mesh, lay.placements, FP8_DTYPE)
    return quant
