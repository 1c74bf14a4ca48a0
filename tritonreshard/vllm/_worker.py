"""Inference side: the ``"tritonreshard"`` weight-transfer engine, one instance per vLLM worker.

Imported only inside vLLM (the ``vllm.general_plugins`` entry point registers it lazily). Each
worker (TP rank ``t``) joins the refit group as global rank ``inference_ranks[t]`` and pulls exactly
its own TP shards of vLLM's parameters (names, layouts and parts from ``trs.recipes.hf_to_vllm`` for
the served model's config; vocab padding rows are zero-filled by the engine, never pulled) out of
the trainers' shared arenas into its own buffer sets (shadow mode: vLLM's parameters are untouched
while the copy runs).

**Background pull** (``init_info`` ``prefetch=True``, the default). A thread of the worker
(``trs-prefetch-<rank>``) watches the trainers' version words; as soon as every trainer this rank
reads from published a version newer than the one it holds, it pulls it into the spare buffer set
(on CUDA on its own stream) and acks it, while vLLM keeps generating. The trainers' ``fence()``
therefore returns without any vLLM call. A prefetched version is not installed: vLLM's parameters
change only in ``update_weights``. The trainers cannot publish over a version a worker is still
pulling (``fence()`` waits for its ack); once it acked, a newer version replaces the prefetched one
that was never installed (the arenas hold only the newest version anyway). A background pull that
failed is reported by the next ``update_weights``; the thread retries only once a newer version is
published.

**update_weights** waits for a pull still running (or pulls the version itself when it was not
prefetched), the TP group agrees, and only when every TP rank holds the same version does any rank
apply it:

* layers whose live parameters are not their load format (vLLM's CPU backend repacks linear
  weights into oneDNN handles, leaving ``weight`` of shape [0]; quantized layers) go through vLLM's
  layerwise reload: the load-format parameters are materialized, filled from the pulled buffers,
  and vLLM's own ``process_weights_after_loading`` runs and copies into the kernel tensors;
* when no layer needs that (unquantized on CUDA), every parameter is written in place by one
  multi-tensor copy (``torch._foreach_copy_``): the addresses CUDA graphs captured stay valid.

A failed pull on any rank raises on every rank, naming the failed rank(s), before anything is
applied: the engine keeps serving the previous version.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size, get_tp_group
from vllm.logger import init_logger
from vllm.distributed.weight_transfer.base import (WeightTransferEngine, WeightTransferInitInfo,
                                                   WeightTransferUpdateInfo)
from vllm.model_executor.layers.attention import MLAAttention, is_deferred_attention_layer
from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod
from vllm.model_executor.layers.linear import UnquantizedLinearMethod
from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod
from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload
from vllm.model_executor.model_loader.reload import layerwise as _layerwise
from vllm.model_executor.model_loader.reload.meta import materialize_layer
from vllm.platforms import current_platform

from .. import RefitError, RefitInference, recipes
from ..engine.elastic import epoch_key
from ..engine.rendezvous import connect_store
from . import SRC_DTYPES

__all__ = ["TritonreshardInitInfo", "TritonreshardUpdateInfo", "TritonreshardWeightTransferEngine"]

# Under vLLM's logger, so these lines go through its handler and level (VLLM_LOGGING_LEVEL) in
# every worker; a logger outside "vllm" has no handler there, and INFO lines would be lost.
logger = init_logger(f"vllm.{__name__}")

@dataclass
class TritonreshardInitInfo(WeightTransferInitInfo):
    """``init_weight_transfer_engine`` payload (a plain dict on the wire; see
    :func:`tritonreshard.vllm.init_info`)."""

    store: str
    trainer_ranks: list[int]
    inference_ranks: list[int]
    src_dtype: str = "float32"
    group: str = "vllm"
    timeout: float = 60.0
    peer_timeout: float = 10.0
    replica: int = 0   # which replica (engine) these workers are: inference_ranks[replica * tp + tp rank]
    megatron: dict | None = None  # trs.recipes.Megatron's fields: the trainers are Megatron-Core ranks
    prefetch: bool = True  # pull each published version in the background (see the module docstring)
    delta: str = "auto"           # cross-host deltas, as the trainers' (tritonreshard.vllm.Trainer(delta=))
    delta_anchor: int = 64
    elastic: bool = False  # join an elastic group: inference_ranks are this engine's own TP ranks


@dataclass
class TritonreshardUpdateInfo(WeightTransferUpdateInfo):
    """``update_weights`` payload: the version to install (None: the newest one every TP rank
    pulled, or the next one to be published when none is newer than the installed one) and how long
    to wait for it (None: the init timeout)."""

    version: int | None = None
    timeout: float | None = None
    extra: dict = field(default_factory=dict)


def _served_quantization(vllm_config) -> str | None:
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


class TritonreshardWeightTransferEngine(WeightTransferEngine[TritonreshardInitInfo, TritonreshardUpdateInfo]):
    """vLLM ``WeightTransferEngine`` pulling TP shards through tritonreshard (registered as
    ``"tritonreshard"``). Which process calls what: vLLM calls every method in every worker, driven
    by the four phases (``init_weight_transfer_engine``, ``start_weight_update``,
    ``update_weights``, ``finish_weight_update``) of the engine's ``collective_rpc``.

    ``worker``: the vLLM worker that owns this engine, handed over by
    :class:`tritonreshard.vllm.WorkerExtension` when the worker stores its engine (see there why
    an engine needs it); :meth:`init_transfer_engine` refuses to start without it."""

    init_info_cls = TritonreshardInitInfo
    update_info_cls = TritonreshardUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device, model):
        super().__init__(config, vllm_config, device, model)
        self._sub: RefitInference | None = None
        self._session = False
        self.applied_version = 0
        self.stats: dict = {}
        self.worker = None
        # The background pull: the watcher thread and what it shares with update_weights. The lock
        # is held by the watcher while it swaps a finished pull in or starts one, and by
        # update_weights for the whole call, so a set being applied is never pulled into.
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._watcher: threading.Thread | None = None
        self._inflight: int | None = None     # the version the background pull is pulling
        self._bg_error: tuple[int, BaseException] | None = None  # (version, error), until reported
        self._failed = 0                      # the last version a background pull failed on
        self._group_version = 0               # the version of this group installed (0: none yet)

    def bind_worker(self, worker) -> None:
        """Called once per engine by :class:`~tritonreshard.vllm.WorkerExtension`, in the worker's
        ``load_model`` right after vLLM's factory created this engine."""
        self.worker = worker

    def _agree(self, version, error) -> list:
        """Every TP rank's ``(rank, version, error text)``: all ranks decide together."""
        outcomes = [None] * get_tensor_model_parallel_world_size()
        dist.all_gather_object(outcomes, (getattr(self, "rank", get_tensor_model_parallel_rank()), version,
                                          None if error is None else f"{type(error).__name__}: {error}"),
                               group=get_tp_group().cpu_group)
        return outcomes

    def _fail(self, outcomes, cause, what: str = "refit") -> None:
        """Raise the TP group's agreed failure so that vLLM stays usable.

        vLLM 0.32's multiproc executor reads the workers' replies in rank order and raises at the
        first failure, leaving later ranks' replies queued: every later ``collective_rpc`` would then
        read a stale reply. So only the last TP rank raises (with every rank's reason); the others
        close their weight-update session as vLLM does after an exception, and return.
        """
        failed = [(r, e) for r, _, e in outcomes if e is not None]
        versions = {v for _, v, e in outcomes if e is None}
        texts = {e for _, e in failed}
        why = (f"every rank: {failed[0][1]}" if len(failed) > 1 and len(texts) == 1 else
               "; ".join(f"rank {r}: {e}" for r, e in failed) or f"TP ranks pulled different versions {versions}")
        err = RefitError(f"tritonreshard {what} failed ({why}); nothing was applied, vLLM keeps serving "
                         f"version {self.applied_version}")
        if get_tensor_model_parallel_rank() < get_tensor_model_parallel_world_size() - 1:
            logger.warning("%s", err)
            if what == "refit":
                # What vLLM's worker does when update_weights raises (its except clause; 0.32 has no
                # public call for it). Not the worker's finish_weight_update: that also drops LoRA
                # adapters, which the last rank (where vLLM's own except clause runs) would keep.
                if self.worker is not None:  # (none: init_weight_transfer_engine refuses to start)
                    self.worker._weight_update_active = False
                self.reset_weight_update_target()
                self._session = False
            return
        raise err from cause

    # ------------------------------------------------------------------ phase 1
    def init_transfer_engine(self, init_info: TritonreshardInitInfo) -> None:
        if self._sub is not None:  # the same on every rank: no agreement needed
            raise RuntimeError(f"tritonreshard (rank {self.rank}): init_weight_transfer_engine was already called "
                               f"(call shutdown_weight_transfer_engine first)")
        error = None
        try:  # broad on purpose: every TP rank must reach the agreement (see receive_weights)
            self._init(init_info)
        except Exception as exc:  # noqa: BLE001
            error = exc
        outcomes = self._agree(0, error)
        if any(e is not None for _, _, e in outcomes):
            if self._sub is not None:
                self._sub.close(abort=True)
                self._sub = None
            self._fail(outcomes, error, what="init_weight_transfer_engine")
            return
        # A new group numbers its versions from 1 again; vLLM keeps serving what it serves.
        self._inflight, self._bg_error, self._failed, self._group_version = None, None, 0, 0
        if init_info.prefetch:
            self._stop.clear()
            self._watcher = threading.Thread(target=self._watch, args=(self._sub,), daemon=True,
                                             name=f"trs-prefetch-{self.rank}")
            self._watcher.start()

    def _init(self, init_info: TritonreshardInitInfo) -> None:
        pc = self.parallel_config
        problems = []
        if pc.pipeline_parallel_size != 1 or pc.data_parallel_size != 1:
            problems.append(f"pipeline_parallel_size={pc.pipeline_parallel_size} and data_parallel_size="
                            f"{pc.data_parallel_size}: only tensor parallelism is supported")
        if pc.enable_expert_parallel and (pc.enable_eplb or pc.expert_placement_strategy != "linear"):
            problems.append(f"enable_expert_parallel with enable_eplb={pc.enable_eplb}, expert_placement_strategy="
                            f"{pc.expert_placement_strategy!r}: only vLLM's default linear placement (no redundant "
                            f"experts) is laid out")
        if not isinstance(init_info.elastic, bool):
            problems.append(f"init_info elastic={init_info.elastic!r} must be true or false")
        if not isinstance(init_info.prefetch, bool):
            problems.append(f"init_info prefetch={init_info.prefetch!r} must be true or false")
        if init_info.src_dtype not in SRC_DTYPES:
            problems.append(f"init_info src_dtype={init_info.src_dtype!r} must be one of {list(SRC_DTYPES)}")
        if self.worker is None:
            problems.append("the vLLM worker has no tritonreshard WorkerExtension: pass worker_extension_cls="
                            "tritonreshard.vllm.WORKER_EXTENSION to LLM(...) (--worker-extension-cls "
                            "tritonreshard.vllm.WorkerExtension to vllm serve); a failed refit needs it to end "
                            "every TP rank's weight-update session")
        if problems:
            raise ValueError("tritonreshard init_weight_transfer_engine: " + "; ".join(problems))
        self.tp_rank, tp = get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
        common = dict(tp=tp, trainer_ranks=init_info.trainer_ranks, inference_ranks=init_info.inference_ranks,
                      dtype=self.model_config.dtype, src_dtype=SRC_DTYPES[init_info.src_dtype],
                      quantization=_served_quantization(self.vllm_config),
                      expert_parallel=bool(pc.enable_expert_parallel))
        if init_info.megatron is not None:  # the same parts as the Megatron trainers' recipe
            self.spec = recipes.megatron_to_vllm(self.model_config.hf_config,
                                                 megatron=recipes.Megatron(**init_info.megatron), **common)
        else:
            self.spec = recipes.hf_to_vllm(self.model_config.hf_config, **common)
        if init_info.elastic:  # this engine's own ranks: the group's other engines are not known here
            if len(init_info.inference_ranks) != tp:
                raise ValueError(f"tritonreshard init_weight_transfer_engine: elastic init_info's inference_ranks "
                                 f"are this engine's own TP ranks, {tp} of them, got {init_info.inference_ranks}")
            self.rank = init_info.inference_ranks[self.tp_rank]
        else:
            replicas = len(init_info.inference_ranks) // tp   # the recipe checked k * tp ranks
            if not 0 <= init_info.replica < replicas:
                raise ValueError(f"tritonreshard init_weight_transfer_engine: init_info replica={init_info.replica} "
                                 f"but inference_ranks holds {replicas} replica(s) of TP-{tp}")
            self.rank = init_info.inference_ranks[init_info.replica * tp + self.tp_rank]
        self.replica = init_info.replica
        self._check_model()
        self._timeout = float(init_info.timeout)
        if init_info.elastic or self.rank != 0:  # (rank 0 of a plain group hosts the store: nothing to ask yet)
            self._check_elastic(connect_store(init_info.store, world_size=1, is_master=False,
                                              timeout=init_info.timeout), init_info)
        # Two buffer sets for the background pull (one is pulled into while the other holds the
        # newest complete version); without it one set is enough: vLLM's own parameters are what is
        # served, and they are written only after every TP rank pulled the whole version.
        common = dict(rank=self.rank, store=init_info.store, mode="shadow" if init_info.prefetch else "inplace",
                      device=self.device, timeout=init_info.timeout, peer_timeout=init_info.peer_timeout,
                      group=init_info.group, delta=init_info.delta, delta_anchor=init_info.delta_anchor)
        t0 = time.perf_counter()
        if init_info.elastic:  # joins the running group: meet, check, plan, map, admit (JoinStats)
            self._sub = RefitInference.from_recipe(self.spec, elastic=True, replica=init_info.replica, **common)
        else:
            self._sub = RefitInference.from_recipe(
                self.spec, world_size=len(init_info.trainer_ranks) + len(init_info.inference_ranks), **common)
        # How long joining the group took (an elastic join: join_stats says step by step).
        self.join_ms, self.join_stats = (time.perf_counter() - t0) * 1e3, self._sub.join_stats
        # What the refit costs in memory on this rank, beyond vLLM's own weights (docs/vllm.md).
        self.buffer_sets = 2 if init_info.prefetch else 1
        self.buffer_bytes = sum(lay.local_numel(self.rank) * lay.itemsize for lay in self.spec.dst.values())
        logger.info("tritonreshard (rank %s): joined %srefit group %r in %.1f ms; background pull %s; %d buffer "
                    "set(s) of %.1f MB", self.rank, "elastic " if init_info.elastic else "", init_info.group,
                    self.join_ms, "on" if init_info.prefetch else "off", self.buffer_sets, self.buffer_bytes / 1e6)

    @staticmethod
    def _check_elastic(store, init_info: TritonreshardInitInfo) -> None:
        """Both sides elastic or neither: an elastic group's trainers post their epoch under
        :func:`~tritonreshard.engine.elastic.epoch_key` once they met. A plain engine that finds it
        would wait in a meeting the trainers never join; an elastic engine that does not find it
        within the timeout says whom it waited for. (A plain engine that starts before elastic
        trainers met cannot see them yet: it times out in the meeting.)"""
        key = epoch_key(init_info.group)
        if not init_info.elastic and store.check([key]):
            raise ValueError(f"tritonreshard init_weight_transfer_engine: the trainers of group {init_info.group!r} "
                             f"are elastic (tritonreshard.vllm.Trainer(elastic=True)) but init_info has elastic=False: "
                             f"pass init_info(elastic=True, replica=<this engine's index>, inference_ranks=<its "
                             f"own TP ranks>)")
        if init_info.elastic:
            deadline = time.monotonic() + float(init_info.timeout)
            while not store.check([key]):
                if time.monotonic() >= deadline:
                    raise ValueError(f"tritonreshard init_weight_transfer_engine: init_info has elastic=True but no "
                                     f"elastic trainers of group {init_info.group!r} met at {init_info.store} within "
                                     f"{init_info.timeout:g} s: are the trainers tritonreshard.vllm.Trainer("
                                     f"elastic=True)? (plain trainers wait for every engine in their meeting)")
                time.sleep(0.05)

    def _check_model(self) -> None:
        """Every recipe destination is a vLLM parameter with the load-format shape the recipe gives
        this TP rank, and every vLLM parameter is filled by one (tied weights count once), checked
        before anything moves."""
        restore = {}
        for mname, mod in self.model.named_modules():
            meta_params, _ = _layerwise.get_layerwise_info(mod).restore_metadata
            for pname, meta in meta_params.items():
                restore[f"{mname}.{pname}" if mname else pname] = meta
        self._restore_shapes = {n: tuple(m.shape) for n, m in restore.items()}
        # vLLM's reload keeps ``bias`` live (never on meta, so not in the restore metadata): its
        # live shape is its load format.
        live = {n: tuple(p.shape) for n, p in self.model.named_parameters(remove_duplicate=False)}
        problems = []
        for name, layout in self.spec.dst.items():
            have, want = self._restore_shapes.get(name, live.get(name)), tuple(layout.local_shape(self.rank))
            if have is None:
                problems.append(f"vLLM model has no parameter {name!r}")
            elif have != want:
                problems.append(f"vLLM parameter {name!r} has load-format shape {have}, the recipe gives {want}")
        # named_parameters() lists a tied parameter once (lm_head.weight is embed_tokens.weight).
        # Parameters vLLM's post-processing derives (MLA's W_UK_T / W_UV from kv_b_proj) have no
        # weight_loader: nothing loads them, the attention layer's post-processing refreshes them.
        unfilled = sorted(n for n, p in self.model.named_parameters() if n not in self.spec.dst
                          and (n in self._restore_shapes or hasattr(p, "weight_loader")))
        if unfilled:
            problems.append(f"vLLM parameters the recipe does not fill: {unfilled}")
        if problems:
            raise ValueError(f"tritonreshard (TP rank {self.tp_rank}): the model does not match "
                             f"trs.recipes.hf_to_vllm({self.spec.model_type!r}): " + "; ".join(problems))
        # Tied parameters (lm_head.weight is embed_tokens.weight): the aliasing layer gets the same
        # buffer, so that vLLM's post-processing of that layer runs too (on CPU the LM head keeps its
        # own oneDNN handle of the tied weight, which would otherwise serve the old embeddings).
        # A module reachable under two names (the MoE router is also ``experts.gate``) is one layer.
        modules = dict(self.model.named_modules(remove_duplicate=False))
        everything = dict(self.model.named_parameters(remove_duplicate=False))
        owner = {id(everything[n]): n for n in self.spec.dst if n in everything}
        tied = {n: owner[id(p)] for n, p in everything.items() if n not in self.spec.dst and id(p) in owner
                and modules[n.rsplit(".", 1)[0]] is not modules[owner[id(p)].rsplit(".", 1)[0]]}
        # Which layers vLLM post-processes after loading (their live tensors are not the load format).
        self._layers: dict[str, tuple[torch.nn.Module, list[tuple[str, str, bool]]]] = {}
        for name, buf in [(n, n) for n in self.spec.dst] + sorted(tied.items()):
            mname, pname = name.rsplit(".", 1)
            self._layers.setdefault(mname, (modules[mname], []))[1].append((pname, buf, name in tied))
        self._processed = {m for m, (mod, _) in self._layers.items() if self._needs_processing(m, mod)}
        # MLA attention derives W_UK_T / W_UV from kv_b_proj in its own post-processing, which only
        # the layerwise path runs (vLLM's deferred attention step in finalize): on CUDA too.
        self._mla = any(isinstance(m, MLAAttention) for m in self.model.modules())

    def _needs_processing(self, mname: str, mod: torch.nn.Module) -> bool:
        qm = getattr(mod, "quant_method", None)
        if qm is None:
            return False
        if not isinstance(qm, (UnquantizedLinearMethod, UnquantizedEmbeddingMethod)) or current_platform.is_cpu():
            # quantized, or the CPU backend's repack into oneDNN / sgl handles; MoE experts too: their
            # kernel format may shuffle in place, keeping the load-format shape
            return True
        return any(tuple(p.shape) != self._restore_shapes[f"{mname}.{n}"] for n, p in
                   mod.named_parameters(recurse=False) if f"{mname}.{n}" in self._restore_shapes)

    # ------------------------------------------------------------------ the background pull
    # How often the watcher looks at the trainers' version words (a read of shared memory): a
    # published version starts pulling within this much, at a negligible CPU cost.
    POLL_S = 0.005

    def _watch(self, sub: RefitInference) -> None:
        """The watcher thread: swap each finished background pull into the engine's buffer sets
        (not into vLLM: that is update_weights' job), and start the next one as soon as a newer
        version is published."""
        while not self._stop.wait(self.POLL_S):
            with self._lock:
                if self._sub is not sub:  # shut down, or re-initialized: a new watcher runs
                    return
                # Broad on purpose: the thread must not die silently; whatever failed is reported
                # by the next update_weights (with vLLM's weights untouched) and retried only for
                # a newer version.
                try:
                    self._watch_step(sub)
                except Exception as exc:  # noqa: BLE001
                    self._background_failed(self._inflight, exc)

    def _watch_step(self, sub: RefitInference) -> None:
        if sub.pulling:
            if not sub.pull_done():
                return
            target, self._inflight = self._inflight, None
            try:
                sub.swap(timeout=0)  # the engine's sets only: vLLM's parameters stay as they are
            except Exception as exc:  # noqa: BLE001  (a failed pull: reported, see _watch)
                self._background_failed(target, exc)
            return
        newest = sub.available_version()
        if newest > max(sub.version, self._failed):
            self._inflight = sub.start_pull(newest)

    def _background_failed(self, version, exc: BaseException) -> None:
        self._inflight = None
        self._failed = max(self._failed, version or 0)
        self._bg_error = (version, exc)
        logger.warning("tritonreshard (rank %s): background pull of version %s failed: %s: %s (reported at the "
                       "next update_weights; vLLM keeps serving version %s)", self.rank, version,
                       type(exc).__name__, exc, self.applied_version)

    def _stop_watcher(self) -> None:
        self._stop.set()
        if self._watcher is not None:
            self._watcher.join(60.0)
            self._watcher = None

    # ------------------------------------------------------------------ phases 2-4
    def start_weight_update(self) -> None:
        # Before init_weight_transfer_engine too: raising here would raise on every TP rank, and
        # vLLM 0.32's executor would then leave the later ranks' replies queued (see _fail); the
        # update_weights that follows fails on every rank together instead, naming the cause.
        self._session = True

    def receive_weights(self, update_info: TritonreshardUpdateInfo) -> None:
        if not self._session:
            raise RuntimeError(f"tritonreshard (rank {self.rank}): update_weights outside start/finish_weight_update")
        if self._sub is None:  # every rank fails together, as a failed refit does
            error = RuntimeError("update_weights before init_weight_transfer_engine: call "
                                 "init_weight_transfer_engine first")
            self._fail(self._agree(0, error), error)
            return
        with self._lock:  # the watcher neither swaps nor starts a pull until this call is done
            self._receive(update_info)

    def _receive(self, update_info: TritonreshardUpdateInfo) -> None:
        t0 = time.perf_counter()
        sub, requested = self._sub, update_info.version
        # Broad on purpose, both times: whatever failed here, every TP rank must reach the
        # agreements below (or the others would wait in them for vLLM's collective timeout); the
        # error is re-raised there, naming every rank's reason.
        error, holds = None, 0
        try:
            timeout = float(self._timeout if update_info.timeout is None else update_info.timeout)
            self._check_request(requested, timeout)
            if self._bg_error is not None:
                (failed, exc), self._bg_error = self._bg_error, None
                raise RefitError(f"the background pull of version {failed} failed: {type(exc).__name__}: {exc}") \
                    from exc
            holds = max(sub.version, self._inflight or 0)
        except Exception as exc:  # noqa: BLE001
            error = exc
        t1 = time.perf_counter()
        outcomes = self._agree(holds, error)
        t2 = time.perf_counter()
        if any(e is not None for _, _, e in outcomes):
            self._fail(outcomes, error)
            return
        # The version: the one asked for; else the newest any TP rank pulled or is pulling (the
        # others wait for theirs, or pull it now); else the next one to be published.
        target = requested if requested is not None else max(max(v for _, v, _ in outcomes), self._group_version + 1)
        prefetched = sub.version == target
        try:
            self._obtain(sub, target, timeout)
        except Exception as exc:  # noqa: BLE001
            error = exc
        t3 = time.perf_counter()
        outcomes = self._agree(sub.version if error is None else None, error)
        t4 = time.perf_counter()
        if any(e is not None for _, _, e in outcomes) or len({v for _, v, _ in outcomes}) > 1:
            self._fail(outcomes, error)
            return
        split = self._apply(sub.tensors)
        self.applied_version = self._group_version = target
        pull, st = sub.last_pull, sub.stats   # st: of the version served (target), not a newer one received
        self.stats = {"version": target, "prefetched": prefetched,
                      # update_weights' own time: waiting for (or doing) the pull, the two
                      # agreements, and the apply (copy into vLLM's tensors, vLLM's post-processing)
                      "wait_ms": ((t1 - t0) + (t3 - t2)) * 1e3, "agree_ms": ((t2 - t1) + (t4 - t3)) * 1e3,
                      "apply_ms": (time.perf_counter() - t4) * 1e3, **split,
                      "total_ms": (time.perf_counter() - t0) * 1e3,
                      # the pull of this version (in the background when prefetched)
                      "pull_wait_ms": pull.wait_ms, "pull_copy_ms": pull.copy_ms, "pull_total_ms": pull.total_ms,
                      "staging_bytes": pull.staging_bytes, "bytes": st.bytes_per_refit,
                      # what crossed into this rank from other hosts for this version (0 on one host)
                      "cross_host_bytes": st.cross_host_bytes, "cross_host_delta_bytes": st.cross_host_delta_bytes,
                      "cross_host_dense_bytes": st.cross_host_dense_bytes, "cross_host_changed": st.cross_host_changed}
        logger.info("tritonreshard (rank %s): installed version %s (%s) in %.1f ms: wait %.1f, agree %.1f, copy %.1f, "
                    "post-processing %.1f ms", self.rank, target, "prefetched" if prefetched else "pulled now",
                    self.stats["total_ms"], self.stats["wait_ms"], self.stats["agree_ms"], split["copy_ms"],
                    split["post_ms"])

    def _check_request(self, requested, timeout: float) -> None:
        if requested is not None and (isinstance(requested, bool) or not isinstance(requested, int)):
            raise ValueError(f"update_info version must be an int (or None: the newest pulled), got {requested!r}")
        if not timeout >= 0:
            raise ValueError(f"update_info timeout must be a number of seconds >= 0, got {timeout!r}")
        if requested is not None and requested <= self._group_version:
            raise ValueError(f"update_info version={requested}: version {self._group_version} is installed "
                             f"already; only a newer one can be installed")

    def _obtain(self, sub: RefitInference, target: int, timeout: float) -> None:
        """Make ``target`` the engine's serving buffer set (never vLLM's tensors): a prefetched
        version is there already; a pull in flight is waited for; otherwise pull it now."""
        if sub.version < target and sub.pulling:
            inflight, self._inflight = self._inflight, None
            try:
                sub.swap(timeout)
            except TimeoutError:
                self._inflight = inflight  # it goes on; the watcher swaps it in later
                raise
            except Exception as exc:
                self._failed = max(self._failed, inflight or 0)
                raise RefitError(f"the background pull of version {inflight} failed: {type(exc).__name__}: "
                                 f"{exc}") from exc
        if sub.version > target:
            raise ValueError(f"update_info version={target}: this rank already pulled version {sub.version}, "
                             f"published after it; a trainer's arena holds only its newest version: install "
                             f"{sub.version} (or pass no version)")
        if sub.version < target:
            try:
                sub.pull(target, timeout)
            except TimeoutError as exc:
                newest = sub.available_version()
                if newest < target:
                    raise RefitError(f"update_info version={target} was never published: the newest version "
                                     f"the trainers published is {newest} (waited {timeout:g} s)") from exc
                raise

    @torch.no_grad()
    def _apply(self, bufs: dict[str, torch.Tensor]) -> dict:
        """Copy the pulled buffers (``{vLLM name: this rank's load-format shard}``, padding rows
        already zero) into vLLM's parameters. Returns the split: ``copy_ms`` (into vLLM's tensors)
        and ``post_ms`` (vLLM's post-processing and the layerwise reload around it)."""
        if self._processed or self._mla:
            t0 = time.perf_counter()
            initialize_layerwise_reload(self.model)
            copy_s, experts = 0.0, 0
            for mname in sorted(self._layers):
                mod, params = self._layers[mname]
                info = _layerwise.get_layerwise_info(mod)
                materialize_layer(mod, info)
                # Copy, never alias the shadow buffers: some post-processing keeps views of the
                # load-format weight (zentorch), and a later pull into an aliased buffer would then
                # change the served weights unprocessed.
                tc = time.perf_counter()
                for pname, name, _ in params:
                    getattr(mod, pname).data.copy_(bufs[name])
                copy_s += time.perf_counter() - tc
                # vLLM's own post-load processing; for a plain layer it only copies into the kernel tensors.
                experts += self._process(mod, info)
            # Layers nothing of ours lands in (rotary caches): put vLLM's own tensors back as
            # finalize would, minus its "failed to load weights" warning on every refit.
            bound = {id(mod) for mod, _ in self._layers.values()}
            for mod in self.model.modules():
                info = _layerwise.get_layerwise_info(mod)
                if (id(mod) not in bound and info.can_load() and info.load_numel == 0
                        and info.kernel_tensors is not None and not is_deferred_attention_layer(mod)):
                    _layerwise._place_kernel_tensors(mod, info)
                    info.reset()
            finalize_layerwise_reload(self.model, self.model_config)
            return {"copy_ms": copy_s * 1e3, "post_ms": (time.perf_counter() - t0 - copy_s) * 1e3,
                    "layerwise": True, "experts_processed": experts}
        # Plain layers: one multi-tensor copy in place, so every parameter keeps its address (CUDA
        # graphs captured on them stay valid); a tied parameter is the tensor written here already.
        t0 = time.perf_counter()
        dst, src = self._plain_copy(bufs)
        torch._foreach_copy_(dst, src)
        if self.device.type == "cuda":  # the copy is done (and timed) before update_weights returns
            torch.cuda.current_stream(self.device).synchronize()
        return {"copy_ms": (time.perf_counter() - t0) * 1e3, "post_ms": 0.0, "layerwise": False,
                "experts_processed": 0}

    def _plain_copy(self, bufs: dict[str, torch.Tensor]) -> tuple[list, list]:
        """``(vLLM's tensors, the pulled buffers)`` of the in-place apply, in one order."""
        pairs = [(getattr(mod, pname).data, bufs[name]) for mod, params in self._layers.values()
                 for pname, name, tied in params if not tied]
        return [d for d, _ in pairs], [s for _, s in pairs]

    @staticmethod
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
        qm.process_weights_after_loading(mod)  # padding and kernel format (_apply materialized and filled the layer)
        qm.moe_kernel.fused_experts.process_weights_after_loading(mod)  # the step vLLM skips on an update
        _layerwise._copy_and_restore_kernel_tensors(mod, info)
        info.reset()
        return True

    def finish_weight_update(self) -> None:
        self._session = False

    def shutdown(self) -> None:
        self._stop_watcher()
        if self._sub is not None:
            self._sub.close()
            self._sub = None
