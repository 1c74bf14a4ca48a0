"""vLLM's apply step: the pulled buffers into vLLM's parameters, :func:`apply`.

Called by the refit session (:func:`tritonreshard.serving.refit`) on every TP rank once every TP
rank holds the same version, with the :class:`~._model.ModelMatch` of the model check:

* layers whose live parameters are not their load format (vLLM's CPU backend repacks linear
  weights into oneDNN handles, leaving ``weight`` of shape [0]; quantized layers; MLA attention)
  go through vLLM's layerwise reload: the load-format parameters are materialized, filled from the
  pulled buffers, and vLLM's own ``process_weights_after_loading`` runs and copies into the kernel
  tensors;
* when no layer needs that (unquantized on CUDA), every parameter is written in place by one
  multi-tensor copy (``torch._foreach_copy_``): the addresses CUDA graphs captured stay valid;
* a layer whose parameters the direct pull wrote itself (``init_info(prefetch=False)``,
  :meth:`~._model.ModelMatch.direct`) is in ``bufs`` with none of them: nothing is copied, and in
  the layerwise reload it gets its own tensors back as they are;
* with the direct pull, the layers vLLM post-processes are not in ``bufs`` either: the pull
  streamed them through :class:`ReloadSink` (vLLM's layerwise reload a layer at a time: each
  materialized, written by the pull, post-processed, dropped), and the apply only ends the reload.

Imported inside vLLM's workers only.
"""
from __future__ import annotations

import itertools
import time

import torch
from vllm.model_executor.layers.attention import is_deferred_attention_layer
from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod
from vllm.model_executor.model_loader.reload import layerwise as _layerwise
from vllm.model_executor.model_loader.reload.meta import SKIP_MODULES, SKIP_TENSORS, materialize_layer
from vllm.model_executor.model_loader.reload.utils import get_layer_tensors

from ..engine.heap import ReusedPages, release_freed_heap
from ._model import ModelMatch
from ._versions import finish_reload, start_reload

__all__ = ["ReloadSink", "apply"]


class ReloadSink:
    """vLLM's layerwise reload as the direct pull's layer sink (a ``trs.LayerSink``): the layers
    vLLM post-processes, each taken whole when the pull reaches it, so the load-format memory alive
    at once is one layer's (vLLM's own reload materializes them so too), never a buffer set.

    ``groups``: the buffer names of each unit, in module-name order; a unit is a post-processed
    layer, with the layers tied to it (an LM head tied to the embeddings shares the embeddings'
    tensor). ``skip``: buffer names written some other way (the direct ones).
    :meth:`begin` starts vLLM's reload (every layer's load-format tensors on meta, its kernel
    tensors kept); ``open(g)`` materializes the unit's layers and hands over their load-format
    parameters; ``close(g)`` runs vLLM's post-processing (its copy into the kernel tensors, whose
    addresses CUDA graphs captured, included); :meth:`end` puts every
    other layer's own tensors back and ends the reload, after a whole pull or a failed one."""

    def __init__(self, model: torch.nn.Module, model_config, match: ModelMatch, skip, device):
        self.model, self.model_config, self.device = model, model_config, device
        self._units = _units(match, set(skip))
        self.groups = [[name for _, _, name, tied in unit if not tied] for _, unit in self._units]
        self.active, self.experts = False, 0
        # On CPU each unit's load-format tensors are carved from the pages the last unit's were:
        # fresh pages for every layer halved the pull's copy speed (vLLM's own materialization
        # allocates each layer anew). CUDA's caching allocator reuses its blocks already.
        self._pages = ReusedPages() if torch.device(device).type == "cpu" else None

    @property
    def mappings(self) -> int:
        """CPU mappings the units were carved from since the join: one per pull where each unit
        wrote the pages of the one before (0 on CUDA: vLLM materializes them)."""
        return 0 if self._pages is None else self._pages.mappings

    def begin(self) -> None:
        if not self.active:
            start_reload(self.model)
            self.active, self.experts = True, 0

    @torch.no_grad()
    def open(self, group: int) -> dict[str, torch.Tensor]:
        modules, unit = self._units[group]
        tying = {id(mod) for mod, _, _, tied in unit if tied}
        owners, others = [m for m in modules if id(m) not in tying], [m for m in modules if id(m) in tying]
        materialize = self._materializer(owners + others, {(id(m), p) for m, p, _, tied in unit if tied},
                                         {(id(m), p) for m, p, _, tied in unit if not tied})
        # The owners first; a tied parameter then *is* its owner's, as at vLLM's first load (an LM
        # head tied to the embeddings holds no tensor of its own), before its layer materializes
        # what else it has.
        for mod in owners:
            materialize(mod)
        for mod, pname, name, tied in unit:
            if tied:  # its owner is materialized (a layer holding the other's tensor is not an owner)
                setattr(mod, pname, next(getattr(m, p) for m, p, n, t in unit if n == name and not t))
        for mod in others:  # (a MoE layer tied to its router's bias)
            materialize(mod)
        return {name: getattr(mod, pname).data for mod, pname, name, tied in unit if not tied}

    def _materializer(self, modules: list, tied: set, written: set):
        """``materialize(module)``: its load-format tensors, on meta since the reload began. On CUDA
        vLLM's own; on CPU views of one block of :class:`~tritonreshard.engine.heap.ReusedPages`
        for the whole unit (``tied``: ``(id(module), name)`` set to their owner's, not
        materialized). A tensor the pull does not write (``written``: what it does) is zeroed, as
        vLLM 0.34 zeroes every one it materializes: the pages hold the last unit's bytes."""
        if self._pages is None:
            return lambda mod: materialize_layer(mod, _layerwise.get_layerwise_info(mod))
        metas = [(mod, name, t) for mod in modules if mod.__class__.__name__ not in SKIP_MODULES
                 for name, t in get_layer_tensors(mod).items()
                 if name not in SKIP_TENSORS and t.is_meta and (id(mod), name) not in tied]
        spans = [_PAGE * -(-_storage_bytes(t) // _PAGE) for _, _, t in metas]
        block, at = self._pages.take(sum(spans)), {}
        for (mod, name, t), start in zip(metas, itertools.accumulate([0, *spans[:-1]]), strict=True):
            view = block[start:start + _storage_bytes(t)].view(t.dtype).as_strided(t.size(), t.stride())
            view.__class__, view.__dict__ = t.__class__, t.__dict__.copy()  # as vLLM's materialize does
            if (id(mod), name) not in written:
                view.zero_()
            at.setdefault(id(mod), []).append((name, view))

        def materialize(mod):
            for name, view in at.get(id(mod), ()):
                setattr(mod, name, view)
        return materialize

    @torch.no_grad()
    def close(self, group: int) -> None:
        for mod in self._units[group][0]:
            self.experts += _process(mod, _layerwise.get_layerwise_info(mod))

    def end(self) -> None:
        """Every layer not post-processed in this reload gets its own tensors back (those the
        pull never reached, after a failure: vLLM's weights then hold part of a version), and
        vLLM's reload ends; the pages the units were carved from are given back."""
        if self.active:
            self.active = False
            if self._pages is not None:
                self._pages.release()
            _restore_untouched(self.model, done=set())
            finish_reload(self.model, self.model_config, self.device)
            if torch.device(self.device).type == "cpu":
                # The dropped load-format layers (below glibc's mmap threshold once a larger one was
                # freed) would stay resident: 0.4x a Qwen3-1.7B worker's weights did without this.
                release_freed_heap()


#: Each carved tensor starts on a page of its own (any alignment a kernel may assume).
_PAGE = 4096


def _storage_bytes(t: torch.Tensor) -> int:
    """Bytes a tensor of ``t``'s size and stride spans from its first element."""
    if t.numel() == 0:
        return 0
    return (1 + sum((n - 1) * st for n, st in zip(t.size(), t.stride(), strict=True))) * t.element_size()


def _units(match: ModelMatch, skip: set) -> list[tuple[list, list]]:
    """The post-processed layers whose buffers are not in ``skip``, grouped with the layers tied
    to them: ``[(modules in name order, [(module, parameter name, buffer name, tied), ...])]``."""
    owners: dict[str, str] = {}   # buffer name -> the module name that owns it (not tied)
    for mname, (_, params) in match.layers.items():
        for _, name, tied in params:
            if not tied:
                owners[name] = mname
    unit_of: dict[str, str] = {}
    for mname in sorted(match.layers):
        _, params = match.layers[mname]
        if all(name in skip for _, name, _ in params):
            continue
        # a layer with a tied parameter joins the unit of that parameter's owner
        root = next((owners[name] for _, name, tied in params if tied), mname)
        unit_of[mname] = unit_of.get(root, root)
    units: dict[str, list[str]] = {}
    for mname in sorted(unit_of):
        units.setdefault(unit_of[mname], []).append(mname)
    return [([match.layers[m][0] for m in names],
             [(match.layers[m][0], pname, name, tied) for m in names for pname, name, tied in match.layers[m][1]])
            for _, names in sorted(units.items())]


@torch.no_grad()
def apply(model: torch.nn.Module, model_config, match: ModelMatch, bufs: dict[str, torch.Tensor],
          device: torch.device, sink: ReloadSink | None = None) -> dict:
    """Copy the pulled buffers (``{vLLM name: this rank's load-format shard}``, padding rows
    already zero; without the names a direct pull wrote in place or streamed through ``sink``)
    into vLLM's parameters. Returns the split: ``copy_ms`` (into vLLM's tensors)
    and ``post_ms`` (vLLM's post-processing and the layerwise reload around it), ``layerwise``,
    ``experts_processed``."""
    if sink is not None and sink.active:  # the pull streamed the post-processed layers: end the reload
        t0 = time.perf_counter()
        experts = sink.experts
        sink.end()
        return {"copy_ms": 0.0, "post_ms": (time.perf_counter() - t0) * 1e3, "layerwise": True,
                "experts_processed": experts}
    if match.layerwise:
        return _layerwise_apply(model, model_config, match, bufs, device)
    # Plain layers: one multi-tensor copy in place, so every parameter keeps its address (CUDA
    # graphs captured on them stay valid); a tied parameter is the tensor written here already.
    t0 = time.perf_counter()
    dst, src = _plain_copy(match, bufs)
    torch._foreach_copy_(dst, src)
    if device.type == "cuda":  # the copy is done (and timed) before update_weights returns
        torch.cuda.current_stream(device).synchronize()
    return {"copy_ms": (time.perf_counter() - t0) * 1e3, "post_ms": 0.0, "layerwise": False,
            "experts_processed": 0}


def _layerwise_apply(model: torch.nn.Module, model_config, match: ModelMatch, bufs: dict, device) -> dict:
    t0 = time.perf_counter()
    start_reload(model)
    copy_s, experts, bound = 0.0, 0, set()
    for mname in sorted(match.layers):
        mod, params = match.layers[mname]
        if not any(name in bufs for _, name, _ in params):  # the direct pull wrote its own tensors
            continue
        bound.add(id(mod))
        info = _layerwise.get_layerwise_info(mod)
        materialize_layer(mod, info)
        # Copy, never alias the pull's buffer set: some post-processing keeps views of the
        # load-format weight (zentorch), and a later pull into an aliased buffer would then
        # change the served weights unprocessed.
        tc = time.perf_counter()
        for pname, name, _ in params:
            getattr(mod, pname).data.copy_(bufs[name])
        copy_s += time.perf_counter() - tc
        # vLLM's own post-load processing; for a plain layer it only copies into the kernel tensors.
        experts += _process(mod, info)
    _restore_untouched(model, done=bound)
    finish_reload(model, model_config, device)
    if torch.device(device).type == "cpu":  # the dropped load-format layers: see ReloadSink.end
        release_freed_heap()
    return {"copy_ms": copy_s * 1e3, "post_ms": (time.perf_counter() - t0 - copy_s) * 1e3,
            "layerwise": True, "experts_processed": experts}


def _restore_untouched(model: torch.nn.Module, done: set) -> None:
    """Layers nothing of ours landed in during this reload (rotary caches, those the direct pull
    wrote, those a failed pull never reached): put vLLM's own tensors back as finalize would,
    minus its "failed to load weights" warning on every refit. ``done``: ids of the layers the
    reload processed."""
    for mod in model.modules():
        info = _layerwise.get_layerwise_info(mod)
        if (id(mod) not in done and info.can_load() and info.load_numel == 0
                and info.kernel_tensors is not None and not is_deferred_attention_layer(mod)):
            _layerwise._place_kernel_tensors(mod, info)
            info.reset()


def _plain_copy(match: ModelMatch, bufs: dict[str, torch.Tensor]) -> tuple[list, list]:
    """``(vLLM's tensors, the pulled buffers)`` of the in-place apply, in one order."""
    pairs = [(getattr(mod, pname).data, bufs[name]) for mod, params in match.layers.values()
             for pname, name, tied in params if not tied and name in bufs]
    return [d for d, _ in pairs], [s for _, s in pairs]


def _process(mod: torch.nn.Module, info) -> bool:
    """vLLM's post-load processing of one refitted layer, exactly once, then its kernel tensors
    refreshed in place (their storage is what vLLM serves from).

    Unquantized MoE experts need one step more than vLLM's layerwise reload runs: on a weight
    update (``moe_kernel`` already built) vLLM 0.32's ``UnquantizedFusedMoEMethod._setup_kernel``
    skips ``moe_kernel.fused_experts.process_weights_after_loading``, which on CPU pads each
    rank's intermediate size to a multiple of 32 and prepacks ``w13_weight`` / ``w2_weight``
    (``cpu_prepack_moe_weight``). Without it the load-format tensors land in the prepacked
    storage (or fail to fit it when padded) and greedy output diverges. Elsewhere that step is
    vLLM's no-op, so running it is the same as vLLM's first load. Returns whether ``mod`` was
    such an experts layer."""
    qm = getattr(mod, "quant_method", None)
    if not (isinstance(qm, UnquantizedFusedMoEMethod) and qm.moe_kernel is not None):
        _layerwise._layerwise_process(mod, info)
        return False
    qm.process_weights_after_loading(mod)  # padding and kernel format (apply materialized and filled the layer)
    qm.moe_kernel.fused_experts.process_weights_after_loading(mod)  # the step vLLM skips on an update
    _layerwise._copy_and_restore_kernel_tensors(mod, info)
    info.reset()
    return True
