"""Inference side: the ``"tritonreshard"`` weight-transfer engine, one instance per vLLM worker.

Imported only inside vLLM (the ``vllm.general_plugins`` entry point registers it lazily). Each
worker (TP rank ``t``) joins the refit group as global rank ``inference_ranks[t]`` and pulls exactly
its own TP shards of vLLM's parameters (names, layouts and parts from ``trs.recipes.hf_to_vllm`` for
the served model's config, or traced from vLLM's own loader with ``init_info(trace=True)`` for a model
type with no recipe; vocab padding rows are zero-filled by the engine, never pulled) out of
the trainers' shared arenas into its one buffer set (vLLM's parameters are untouched while the copy
runs: ``update_weights`` copies the set into them).

The engine is vLLM's ``WeightTransferEngine`` and the serving seam's
:class:`~tritonreshard.serving.ServingEngine` at once: vLLM's four phases call the seam's join and
refit (the init info, the rank's place, the recipe from the registry (:mod:`._recipes`), fixed or
elastic membership, the background or inline pull, the refit session), and this engine writes
only what is vLLM's own: its rank's layout, vLLM's TP agreement (:mod:`._agree`), the model check
and verification (:mod:`._model`, :mod:`._verify`) and the apply step (:mod:`._apply`).

**Background pull** (``init_info`` ``prefetch=True``, the default). A thread of the worker
(``trs-prefetch-<rank>``) watches the trainers' version words; as soon as every trainer this rank
reads from published a version newer than the one it holds, it pulls it into the worker's one
buffer set (``trs.Spare()``; on CUDA on its own stream) and acks it, while vLLM keeps generating
from its own parameters. The trainers' ``fence()`` therefore returns without any vLLM call. A
prefetched version is not installed: vLLM's parameters change only in ``update_weights``, which
waits for a pull still in flight before it reads the set. A background pull that failed is
reported by the next ``update_weights`` (it tore the set, not vLLM's weights); the thread retries
only once a newer version is published (:class:`tritonreshard.serving.BackgroundPull` has the rest).

**update_weights** waits for a pull still running (or pulls the version itself when it was not
prefetched), the TP group agrees, and only when every TP rank holds the same version does any rank
apply it (:func:`tritonreshard.serving.refit`): through vLLM's layerwise reload where vLLM
post-processes a layer, else by one in-place multi-tensor copy (:mod:`._apply`).

**Background pull off** (``prefetch=False``): the pull runs inside ``update_weights`` and is
direct (``direct=True``, the default): the parameters vLLM serves as loaded
(:meth:`._model.ModelMatch.direct`) are written by the pull itself, and the layers vLLM
post-processes are streamed a layer at a time through its layerwise reload
(:class:`._apply.ReloadSink`): no buffer set.

A failed pull on any rank raises on every rank, naming the failed rank(s), before anything is
applied: the engine keeps serving the previous version (after a direct pull: its weights are marked
incomplete, part old, part new, until an ``update_weights`` succeeds).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
from vllm.distributed.weight_transfer.base import WeightTransferEngine, WeightTransferInitInfo, WeightTransferUpdateInfo
from vllm.logger import init_logger

from ..serving import RankLayout, ServingEngine, ServingInit, ServingRank, UpdateInfo, any_failed
from ._agree import agree, fail
from ._apply import ReloadSink, apply
from ._model import check_model, served_quantization
from ._recipes import ENGINE, GROUP
from ._verify import verify_model
from ._versions import end_session, reload_mode_problem, weights_complete, weights_incomplete

__all__ = ["TritonreshardInitInfo", "TritonreshardUpdateInfo", "TritonreshardWeightTransferEngine"]

# Under vLLM's logger, so these lines go through its handler and level (VLLM_LOGGING_LEVEL) in
# every worker; a logger outside "vllm" has no handler there, and INFO lines would be lost.
logger = init_logger(f"vllm.{__name__}")


class TritonreshardInitInfo(ServingInit, WeightTransferInitInfo):
    """``init_weight_transfer_engine`` payload (a plain dict on the wire; see
    :func:`tritonreshard.vllm.init_info`): a :class:`tritonreshard.serving.ServingInit` (its
    fields, defaults and checks, written there once) that is also vLLM's ``WeightTransferInitInfo``,
    in group ``"vllm"`` unless told otherwise. Not re-decorated: the frozen dataclass's ``__init__``
    builds it by keyword, as vLLM's ``parse_init_info`` does (a dataclass cannot be frozen over
    vLLM's unfrozen base)."""

    GROUP = GROUP


@dataclass
class TritonreshardUpdateInfo(UpdateInfo, WeightTransferUpdateInfo):
    """``update_weights`` payload: the seam's :class:`~tritonreshard.serving.UpdateInfo` (the
    version to install, None: the newest one every TP rank pulled, or the next one to be published
    when none is newer than the installed one; how long to wait for it, None: the init timeout)."""

    extra: dict = field(default_factory=dict)


class TritonreshardWeightTransferEngine(WeightTransferEngine[TritonreshardInitInfo, TritonreshardUpdateInfo],
                                        ServingEngine[TritonreshardInitInfo, TritonreshardUpdateInfo]):
    """vLLM ``WeightTransferEngine`` pulling TP shards through tritonreshard (registered as
    ``"tritonreshard"``), and the serving seam's engine. Which process calls what: vLLM calls every
    method in every worker, driven by the four phases (``init_weight_transfer_engine``,
    ``start_weight_update``, ``update_weights``, ``finish_weight_update``) of the engine's
    ``collective_rpc``.

    ``worker``: the vLLM worker that owns this engine, handed over by
    :class:`tritonreshard.vllm.WorkerExtension` when the worker stores its engine (see there why
    an engine needs it); :meth:`init_transfer_engine` refuses to start without it."""

    init_info_cls = TritonreshardInitInfo
    update_info_cls = TritonreshardUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device, model):
        super().__init__(config, vllm_config, device, model)
        self._session = False
        self.applied_version = 0
        self.stats: dict = {}
        self.verify_stats: dict = {}          # the recipe against vLLM's load_weights, at init (_verify)
        self.trace_stats: dict = {}           # a recipe traced from vLLM's loader (init_info(trace=True))
        self.worker = None
        self._torn = False                    # an apply raised: vLLM's weights may be part old, part new
        self._sink = None                     # the direct pull's layer sink (vLLM's layerwise reload), if any

    def bind_worker(self, worker) -> None:
        """Called once per engine by :class:`~tritonreshard.vllm.WorkerExtension`, in the worker's
        ``load_model`` right after vLLM's factory created this engine."""
        self.worker = worker

    @property
    def spec(self):
        """The recipe of this rank (None before ``init_weight_transfer_engine``)."""
        return None if self.joined is None else self.joined.spec

    # ------------------------------------------------------------------ the seam: vLLM's own parts
    def rank_layout(self, init: ServingInit) -> RankLayout:
        pc = self.parallel_config
        self.tp_rank = get_tensor_model_parallel_rank()
        return RankLayout(engine=ENGINE, tp=get_tensor_model_parallel_world_size(), tp_rank=self.tp_rank,
                          device=self.device, config=self.model_config.hf_config, dtype=self.model_config.dtype,
                          quantization=served_quantization(self.vllm_config),
                          expert_parallel=bool(pc.enable_expert_parallel))

    def check(self, place: ServingRank) -> None:
        """vLLM's model against the recipe, and (fail-closed, before joining) the recipe against
        vLLM's own ``load_weights``; Megatron names are not vLLM's checkpoint names: that recipe is
        checked by its own tests only."""
        self.rank, self.replica = place.rank, place.init.replica
        if self.trace_stats:
            logger.info("tritonreshard (TP rank %s): traced the recipe of %r from vLLM's loader in %.1f ms (%.1f ms "
                        "CPU, peak %s bytes above before, %s held after)", self.tp_rank,
                        self.model_config.hf_config.model_type, self.trace_stats["trace_ms"],
                        self.trace_stats["trace_cpu_ms"], self.trace_stats["trace_peak_bytes"],
                        self.trace_stats["trace_held_bytes"])
        self._match = check_model(self.model, place.spec, rank=place.rank, tp_rank=place.tp_rank)
        self.verify_stats = verify_model(self.model, place.spec, rank=place.rank, tp_rank=place.tp_rank) \
            if place.init.verify and place.init.megatron is None else {"verify_params": 0}
        self.verify_stats["trace_ms"] = self.trace_stats.get("trace_ms")  # None: a hand-written recipe
        logger.info("tritonreshard (rank %s): verify %s", self.rank, self.verify_stats)

    def agree(self, version, error) -> list:
        """Every TP rank's ``(rank, version, error text)``: all ranks decide together."""
        return agree(getattr(self, "rank", None), version, error)

    def fail(self, outcomes, cause) -> None:
        """A refused refit: every rank still serves whole weights (see :meth:`_fail`), unless a
        direct pull wrote them: the layer sink's reload then ends with every layer in place."""
        if self._sink is not None:
            self._sink.end()
        self._untouched()
        self._fail(outcomes, cause, what="refit")

    def direct_tensors(self, place: ServingRank) -> dict:
        """The parameters vLLM serves as loaded (:meth:`._model.ModelMatch.direct`): what a direct
        pull (``init_info(prefetch=False)``) writes with no buffer."""
        return self._match.direct(place.spec, place.rank)

    def layer_sink(self, place: ServingRank, direct: dict) -> ReloadSink | None:
        """The layers vLLM post-processes (all but the norms on its CPU backend; quantized ones,
        MLA), streamed by the direct pull a layer at a time through vLLM's layerwise reload
        (:class:`._apply.ReloadSink`): no buffer set, one layer's load-format tensors at once."""
        self._sink = ReloadSink(self.model, self.model_config, self._match, direct, self.device) \
            if self._match.layerwise else None
        return self._sink

    def writing_served(self) -> None:
        """A direct pull may write vLLM's parameters from here on: torn until the apply returns
        (vLLM 0.34 then reports the weights incomplete, and a failed refit says so); the layer
        sink's reload begins."""
        self._torn = True
        if self.worker is not None:
            weights_incomplete(self.worker)
        if self._sink is not None:
            self._sink.begin()

    def apply(self, bufs) -> dict:
        """vLLM's apply step (:func:`._apply.apply`) with this engine's model and model check."""
        # Torn until the apply returns: if it raises, vLLM 0.34 keeps the weights marked incomplete.
        self._torn = True
        if self.worker is not None:
            weights_incomplete(self.worker)
        split = apply(self.model, self.model_config, self._match, bufs, self.device, sink=self._sink)
        self._torn = False
        return split

    def _fail(self, outcomes, cause, what: str) -> None:
        """Raise the TP group's agreed failure on the last TP rank only (:func:`._agree.fail` says
        why); after a refit, the others end their weight-update session and return."""
        fail(outcomes, cause, what=what, serving=self.applied_version, torn=self._torn,
             quiet=self._end_session if what == "refit" else None)

    def _end_session(self) -> None:
        # What vLLM's worker does when update_weights raises (its except clause; 0.32 has no
        # public call for it). Not the worker's finish_weight_update: that also drops LoRA
        # adapters, which the last rank (where vLLM's own except clause runs) would keep.
        if self.worker is not None:  # (none: init_weight_transfer_engine refuses to start)
            end_session(self.worker, self)
        else:
            self.reset_weight_update_target()
        self._session = False

    def _untouched(self) -> None:
        # vLLM 0.34 counts a started update incomplete until it finishes (is_inference_ready()
        # false); this one wrote nothing, so it clears that, unless an earlier apply tore (_versions).
        if self.worker is not None and not self._torn:
            weights_complete(self.worker)

    # ------------------------------------------------------------------ phase 1
    def parse_update_info(self, update_dict):
        """vLLM's parse; a bad update info is a refit refused before anything was applied."""
        try:
            return super().parse_update_info(update_dict)
        except ValueError:
            self._untouched()
            raise

    def parse_init_info(self, init_dict):
        """The dict as given: vLLM calls this on every TP rank outside any agreement, and a bad
        init info raising here would raise on every rank (see :meth:`_fail`), so it is parsed and
        checked (:class:`TritonreshardInitInfo`) inside :meth:`init_transfer_engine`."""
        return init_dict

    def init_transfer_engine(self, init_info) -> None:
        if self.joined is not None:  # the same on every rank: no agreement needed
            raise RuntimeError(f"tritonreshard (rank {self.rank}): init_weight_transfer_engine was already called "
                               f"(call shutdown_weight_transfer_engine first)")
        error = None
        try:  # broad on purpose: every TP rank must reach the agreement (see receive_weights)
            self._init(TritonreshardInitInfo.from_dict(init_info))
        except Exception as exc:  # noqa: BLE001
            error = exc
        outcomes = self.agree(0, error)
        if any_failed(outcomes):
            self.leave_group(abort=True)
            self._fail(outcomes, error, what="init_weight_transfer_engine")
            return
        # A new group numbers its versions from 1 again; vLLM keeps serving what it serves.
        self.start_pulling()

    def _init(self, init_info: ServingInit) -> None:
        pc = self.parallel_config
        problems = []
        if pc.pipeline_parallel_size != 1 or pc.data_parallel_size != 1:
            problems.append(f"pipeline_parallel_size={pc.pipeline_parallel_size} and data_parallel_size="
                            f"{pc.data_parallel_size}: only tensor parallelism is supported")
        if pc.enable_expert_parallel and (pc.enable_eplb or pc.expert_placement_strategy != "linear"):
            problems.append(f"enable_expert_parallel with enable_eplb={pc.enable_eplb}, expert_placement_strategy="
                            f"{pc.expert_placement_strategy!r}: only vLLM's default linear placement (no redundant "
                            f"experts) is laid out")
        if reload_mode_problem():
            problems.append(reload_mode_problem())
        if self.worker is None:
            problems.append("the vLLM worker has no tritonreshard WorkerExtension: pass worker_extension_cls="
                            "tritonreshard.vllm.WORKER_EXTENSION to LLM(...) (--worker-extension-cls "
                            "tritonreshard.vllm.WorkerExtension to vllm serve); a failed refit needs it to end "
                            "every TP rank's weight-update session")
        if problems:
            raise ValueError("tritonreshard init_weight_transfer_engine: " + "; ".join(problems))
        self.trace_stats = {}
        joined = self.join_group(init_info, logger=logger, served=lambda: self.applied_version,
                                 stats=self.trace_stats)
        # How long joining the group took (join_stats says step by step), and what
        # the refit costs in memory on this rank beyond vLLM's own weights (docs/vllm.md): one
        # buffer set, with the background pull or without: vLLM serves from its own parameters,
        # which update_weights writes from the set, so the set is free to be pulled into between
        # refits (the refit waits for a pull in flight; the watcher starts none during a refit).
        self.join_ms, self.join_stats = joined.join_ms, joined.sub.join_stats
        # A direct pull (prefetch=False) writes the parameters vLLM serves as loaded: the set holds the rest.
        self.buffer_sets, self.buffer_bytes = joined.pull.BUFFER_SETS, joined.set_bytes
        # Its steps (wall/CPU ms each): where a slow join spent its time, waiting (wall far above CPU)
        # or working (planning, allocating, mapping, building the descriptor tables).
        steps = self.join_stats.steps_text() if self.join_stats is not None else ""
        logger.info("tritonreshard (rank %s): joined %srefit group %r in %.1f ms%s; %s pull; %d buffer set(s) of "
                    "%.1f MB%s", self.rank, "elastic " if joined.place.group.elastic else "", init_info.group,
                    self.join_ms, f" (steps, wall/CPU ms: {steps})" if steps else "",
                    "background" if joined.pull.BACKGROUND else "direct" if joined.pull.WRITES_SERVED else "inline",
                    self.buffer_sets, self.buffer_bytes / 1e6, _direct_text(joined))

    # ------------------------------------------------------------------ phases 2-4
    def start_weight_update(self) -> None:
        # Before init_weight_transfer_engine too: raising here would raise on every TP rank, and
        # vLLM 0.32's executor would then leave the later ranks' replies queued (see _fail); the
        # update_weights that follows fails on every rank together instead, naming the cause.
        self._session = True

    def receive_weights(self, update_info: TritonreshardUpdateInfo) -> None:
        if not self._session:
            raise RuntimeError(f"tritonreshard (rank {self.rank}): update_weights outside start/finish_weight_update")
        if self.joined is None:  # every rank fails together, as a failed refit does
            error = RuntimeError("update_weights before init_weight_transfer_engine: call "
                                 "init_weight_transfer_engine first")
            self.fail(self.agree(0, error), error)
            return
        # The seam's refit holds the pull's lock: the watcher neither swaps nor starts a pull until it is done.
        stats = self.refit(update_info)
        if stats is None:  # failed; this rank ended its session (only the last TP rank raises)
            return
        self.applied_version = stats["version"]
        self.stats = {**stats, **self.verify_stats}
        # prefetched: pulled in the background before update_weights asked; pulled now: it waited
        # for a background pull still in flight, or pulled inline. The pull's own figures follow
        # (its copy out of the trainers' arenas, not the copy into vLLM's parameters).
        logger.info("tritonreshard (rank %s): installed version %s (%s) in %.1f ms: wait %.1f, agree %.1f, copy %.1f, "
                    "post-processing %.1f ms; its pull: %.1f MB (%.1f MB straight into vLLM's parameters, %.1f MB "
                    "a layer at a time) in %.1f ms copy, %.2f GB/s (%.2f GB/s of its thread's CPU time), and "
                    "%.1f ms of vLLM's layerwise reload",
                    self.rank, stats["version"], "prefetched" if stats["prefetched"] else "pulled now",
                    stats["total_ms"], stats["wait_ms"], stats["agree_ms"], stats["copy_ms"], stats["post_ms"],
                    stats["bytes"] / 1e6, stats["direct_bytes"] / 1e6, stats["streamed_bytes"] / 1e6,
                    stats["pull_copy_ms"], stats["pull_gb_s"], stats["pull_cpu_gb_s"], stats["pull_sink_ms"])

    def finish_weight_update(self) -> None:
        self._session = False

    def shutdown(self) -> None:
        self.leave_group()


def _direct_text(joined) -> str:
    """What a direct pull writes outside the buffer set, for the join's log line ("" otherwise)."""
    if not joined.pull.WRITES_SERVED:
        return ""
    text = (f"; {len(joined.direct)} of {len(joined.spec.dst)} parameters ({joined.direct_bytes / 1e6:.1f} MB) "
            f"pulled straight into vLLM's")
    if joined.layers is not None:
        text += (f", {len(joined.streamed)} a layer at a time through vLLM's layerwise reload "
                 f"({len(joined.layers.groups)} layers, the largest {joined.layer_bytes / 1e6:.1f} MB)")
    return text
