"""vLLM's model check: the recipe against vLLM's parameters, once per engine: :func:`check_model`.

Every recipe destination is a vLLM parameter with the load-format shape the recipe gives this TP
rank, and every vLLM parameter is filled by one (tied weights count once), checked before anything
moves (fail-closed: one ``ValueError`` naming every parameter that differs). The result,
:class:`ModelMatch`, says where each pulled buffer lands and which layers the apply
(:mod:`._apply`) must post-process. Called by the engine's ``init_weight_transfer_engine``;
imported inside vLLM's workers only.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from vllm.model_executor.layers.attention import MLAAttention
from vllm.model_executor.layers.linear import UnquantizedLinearMethod
from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod
from vllm.model_executor.model_loader.reload import layerwise as _layerwise
from vllm.platforms import current_platform

__all__ = ["ModelMatch", "check_model", "served_quantization"]


def served_quantization(vllm_config) -> str | None:
    """The recipe's ``quantization=`` for the served model: ``"fp8-block"`` for vLLM's block FP8
    (``quant_method="fp8"``, ``weight_block_size=[128, 128]``): the workers pull FP8 weights and fp32
    scales as a checkpoint holds them, and vLLM's ``process_weights_after_loading`` (run by the
    layerwise reload) makes its kernel layouts from them (CUTLASS, DeepGEMM's E8M0 requant) exactly
    as after a checkpoint load. ``None`` for an unquantized model; other quantizations are refused."""
    qc = vllm_config.quant_config
    if qc is None:
        return None
    block = getattr(qc, "weight_block_size", None)
    if qc.get_name() != "fp8" or list(block or ()) != [128, 128]:
        raise ValueError(f"tritonreshard: the served model's quantization {qc.get_name()!r} (weight_block_size="
                         f"{block}) cannot be refitted; supported: none, or fp8 with weight_block_size [128, 128]")
    return "fp8-block"


@dataclass(frozen=True)
class ModelMatch:
    """Where the pulled buffers land in one vLLM model.

    ``layers``: ``{module name: (module, [(parameter name, buffer name, tied), ...])}``, every
    recipe destination and every parameter tied to one (``tied``: it is the same tensor as
    another's, written once). ``processed``: the module names vLLM post-processes after loading
    (their live tensors are not the load format). ``mla``: the model has MLA attention (its
    post-processing derives ``W_UK_T`` / ``W_UV``: the layerwise path on every platform)."""

    layers: dict
    processed: frozenset
    mla: bool

    @property
    def layerwise(self) -> bool:
        """Whether the apply goes through vLLM's layerwise reload (else one in-place copy)."""
        return bool(self.processed) or self.mla

    def direct(self, spec, rank: int) -> dict[str, torch.Tensor]:
        """``{buffer name: vLLM's parameter}`` that a direct pull may write (``init_info(prefetch=
        False)``): every parameter of the layers vLLM serves as loaded, which is all of them for an
        unquantized model on CUDA and the norms on its CPU backend (it repacks linear layers and
        embeddings). A layer counts whole, and only when each of its parameters is contiguous with
        the recipe's shape and dtype for ``rank``, none is tied to another's, and no post-processed
        layer reads one of its buffers (a tied LM head). None with MLA: its attention derives
        tensors from what is loaded."""
        if self.mla:
            return {}
        read_elsewhere = {name for m, (_, params) in self.layers.items() if m in self.processed
                          for _, name, _ in params}
        out: dict[str, torch.Tensor] = {}
        for mname, (mod, params) in self.layers.items():
            if mname in self.processed or any(tied or name in read_elsewhere for _, name, tied in params):
                continue
            mine = {name: getattr(mod, pname).data for pname, name, _ in params}
            if all(t.is_contiguous() and t.dtype == spec.dst[n].dtype
                   and tuple(t.shape) == tuple(spec.dst[n].local_shape(rank)) for n, t in mine.items()):
                out.update(mine)
        return out


def _restore_shapes(model: torch.nn.Module) -> dict[str, tuple]:
    """``{parameter name: load-format shape}`` from vLLM's layerwise restore metadata."""
    restore = {}
    for mname, mod in model.named_modules():
        meta_params, _ = _layerwise.get_layerwise_info(mod).restore_metadata
        for pname, meta in meta_params.items():
            restore[f"{mname}.{pname}" if mname else pname] = meta
    return {n: tuple(m.shape) for n, m in restore.items()}


def _mismatches(model: torch.nn.Module, spec, rank: int, restore: dict) -> list[str]:
    # vLLM's reload keeps ``bias`` live (never on meta, so not in the restore metadata): its
    # live shape is its load format.
    live = {n: tuple(p.shape) for n, p in model.named_parameters(remove_duplicate=False)}
    problems = []
    for name, layout in spec.dst.items():
        have, want = restore.get(name, live.get(name)), tuple(layout.local_shape(rank))
        if have is None:
            problems.append(f"vLLM model has no parameter {name!r}")
        elif have != want:
            problems.append(f"vLLM parameter {name!r} has load-format shape {have}, the recipe gives {want}")
    # named_parameters() lists a tied parameter once (lm_head.weight is embed_tokens.weight).
    # Parameters vLLM's post-processing derives (MLA's W_UK_T / W_UV from kv_b_proj) have no
    # weight_loader: nothing loads them, the attention layer's post-processing refreshes them.
    unfilled = sorted(n for n, p in model.named_parameters() if n not in spec.dst
                      and (n in restore or hasattr(p, "weight_loader")))
    if unfilled:
        problems.append(f"vLLM parameters the recipe does not fill: {unfilled}")
    return problems


def _needs_processing(mname: str, mod: torch.nn.Module, restore: dict) -> bool:
    qm = getattr(mod, "quant_method", None)
    if qm is None:
        return False
    if not isinstance(qm, (UnquantizedLinearMethod, UnquantizedEmbeddingMethod)) or current_platform.is_cpu():
        # quantized, or the CPU backend's repack into oneDNN / sgl handles; MoE experts too: their
        # kernel format may shuffle in place, keeping the load-format shape
        return True
    return any(tuple(p.shape) != restore[f"{mname}.{n}"] for n, p in
               mod.named_parameters(recurse=False) if f"{mname}.{n}" in restore)


def check_model(model: torch.nn.Module, spec, *, rank: int, tp_rank: int) -> ModelMatch:
    """Check ``spec`` (the recipe; ``spec.dst[name].local_shape(rank)``: this rank's load-format
    shard) against vLLM's ``model`` on global rank ``rank`` (TP rank ``tp_rank``, named in the
    error), and say where every buffer lands (:class:`ModelMatch`)."""
    restore = _restore_shapes(model)
    problems = _mismatches(model, spec, rank, restore)
    if problems:
        raise ValueError(f"tritonreshard (TP rank {tp_rank}): the model does not match "
                         f"trs.recipes.hf_to_vllm({spec.model_type!r}): " + "; ".join(problems))
    # Tied parameters (lm_head.weight is embed_tokens.weight): the aliasing layer gets the same
    # buffer, so that vLLM's post-processing of that layer runs too (on CPU the LM head keeps its
    # own oneDNN handle of the tied weight, which would otherwise serve the old embeddings).
    # A module reachable under two names (the MoE router is also ``experts.gate``) is one layer.
    modules = dict(model.named_modules(remove_duplicate=False))
    everything = dict(model.named_parameters(remove_duplicate=False))
    owner = {id(everything[n]): n for n in spec.dst if n in everything}
    tied = {n: owner[id(p)] for n, p in everything.items() if n not in spec.dst and id(p) in owner
            and modules[n.rsplit(".", 1)[0]] is not modules[owner[id(p)].rsplit(".", 1)[0]]}
    # Which layers vLLM post-processes after loading (their live tensors are not the load format).
    layers: dict[str, tuple[torch.nn.Module, list[tuple[str, str, bool]]]] = {}
    for name, buf in [(n, n) for n in spec.dst] + sorted(tied.items()):
        mname, pname = name.rsplit(".", 1)
        layers.setdefault(mname, (modules[mname], []))[1].append((pname, buf, name in tied))
    processed = frozenset(m for m, (mod, _) in layers.items() if _needs_processing(m, mod, restore))
    # MLA attention derives W_UK_T / W_UV from kv_b_proj in its own post-processing, which only
    # the layerwise path runs (vLLM's deferred attention step in finalize): on CUDA too.
    mla = any(isinstance(m, MLAAttention) for m in model.modules())
    return ModelMatch(layers=layers, processed=processed, mla=mla)
