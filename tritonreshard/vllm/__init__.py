"""tritonreshard as a vLLM weight-transfer backend (``weight_transfer_config={"backend": "tritonreshard"}``).

Inference side: :mod:`tritonreshard.vllm._worker` (imported by vLLM's workers only, through the
``vllm.general_plugins`` entry point :func:`register`). Trainer side: :class:`Trainer`, used in each
trainer process; the RL script drives vLLM's four phases::

    # every trainer process (FSDP rank r of the trainers; its row shards of the HF parameters)
    tr = tritonreshard.vllm.Trainer(hf_config, shards, rank=r, tp=2, trainer_ranks=[0, 1],
                                    inference_ranks=[2, 3], store="127.0.0.1:29600")
    tr.fence(); optimizer.step(); tr.publish()          # each step

    # the script that owns the vLLM engine
    llm = LLM(model, weight_transfer_config={"backend": tritonreshard.vllm.BACKEND},
              worker_extension_cls=tritonreshard.vllm.WORKER_EXTENSION)
    llm.collective_rpc("init_weight_transfer_engine", kwargs={"init_info": tritonreshard.vllm.init_info(
        store="127.0.0.1:29600", trainer_ranks=[0, 1], inference_ranks=[2, 3])})   # once
    llm.collective_rpc("start_weight_update")                                   # each refit
    llm.collective_rpc("update_weights", kwargs={"update_info": {"version": v}})
    llm.collective_rpc("finish_weight_update")
    llm.reset_prefix_cache()                       # cached KV was computed with the old weights

Several engines (vLLM replicas, data parallel) join one refit group: pass ``k * tp`` inference
ranks (``inference_ranks[i]`` is TP rank ``i % tp`` of replica ``i // tp``) to every trainer and to
every engine's ``init_info``, and ``replica=i`` to engine ``i``'s. Each engine pulls and applies a
version on its own schedule (its own ``start_weight_update`` / ``update_weights`` /
``finish_weight_update``), so a slow replica holds back no other replica, only the trainers: a
trainer's ``fence()`` returns once every rank that reads its arena, in every replica, has read the
version it published (acked its copy), and only then may the trainer overwrite its arena. A replica
that skips a version reads the next one; one that is still reading version v when the trainers
want to publish v + 1 makes them wait at ``fence()``.

**Elastic** (engines that come and go: autoscaling, a crashed replica): ``Trainer(...,
elastic=True)`` in every trainer process (the trainers meet alone and keep running; their
``inference_ranks`` are not needed), and ``init_info(..., elastic=True, replica=i,
inference_ranks=<this engine's own TP ranks>)`` for engine ``i``, passed to its
``init_weight_transfer_engine`` whenever it starts: it joins the running group and serves the newest
version from then on. Its ``shutdown_weight_transfer_engine`` (or its process's death) takes it out of
the group; the trainers' ``fence()`` stops waiting for it, and the other engines go on. See
docs/elastic.md.

Importing this package does not import vLLM.
"""
from __future__ import annotations

import dataclasses
from types import MappingProxyType

import torch

from .. import Layout, RefitTrainer, recipes
from ..engine.elastic import MAX_RANKS
from ..transport import delta_problems

__all__ = ["Trainer", "WorkerExtension", "init_info", "register", "BACKEND", "WORKER_EXTENSION", "SRC_DTYPES"]

BACKEND = "tritonreshard"
WORKER_EXTENSION = f"{__name__}.WorkerExtension"  # for LLM(worker_extension_cls=...)

# The trainers' parameter dtypes the backend accepts, by the name that crosses the wire in
# init_info (a plain dict: vLLM's RPC carries names, not torch dtypes). The one table: init_info,
# Trainer and the workers all read it.
SRC_DTYPES = MappingProxyType({"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16})

_registered = False


def register() -> None:
    """``vllm.general_plugins`` entry point: register the engine with vLLM's factory (lazily: the
    worker module is imported only when a worker creates the engine). Runs in every vLLM process."""
    global _registered
    if _registered:  # a script may also call it itself: vLLM's factory refuses a second registration
        return
    # Lazy: importing this package must not import vLLM (trainers have none).
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    WeightTransferEngineFactory.register_engine(BACKEND, "tritonreshard.vllm._worker",
                                                "TritonreshardWeightTransferEngine")
    _registered = True


class WorkerExtension:
    """vLLM worker extension that hands each worker to its ``"tritonreshard"`` engine; pass
    ``worker_extension_cls=WORKER_EXTENSION`` to ``LLM`` (or ``--worker-extension-cls`` to
    ``vllm serve``) next to the weight-transfer backend. A script with its own extension class
    subclasses this one.

    Why the engine needs its worker: a failed refit must end vLLM's weight-update session on every
    TP rank, but vLLM 0.32's multiprocess executor stops reading replies at the first failed rank
    (the later ranks' replies would answer the next ``collective_rpc``), so only the last TP rank
    may raise, and the others must close their worker's session themselves. vLLM 0.32 gives an
    engine only ``(config, vllm_config, device, model)`` and nothing that reaches the worker;
    ``worker_extension_cls`` is vLLM's way to add attributes to the worker class. The attribute
    added here is the one the worker already assigns its engine to in ``load_model``
    (``weight_transfer_engine``), so the two meet exactly where vLLM creates the engine.
    """

    @property
    def weight_transfer_engine(self):
        return self.__dict__.get("weight_transfer_engine")

    @weight_transfer_engine.setter
    def weight_transfer_engine(self, engine) -> None:
        self.__dict__["weight_transfer_engine"] = engine
        if engine is not None:
            from ._worker import TritonreshardWeightTransferEngine  # vLLM is loaded once an engine exists

            if isinstance(engine, TritonreshardWeightTransferEngine):
                engine.bind_worker(self)


def init_info(*, store: str, trainer_ranks, inference_ranks, src_dtype: str = "float32", group: str = "vllm",
              timeout: float = 60.0, peer_timeout: float = 10.0, replica: int = 0, megatron=None,
              prefetch: bool = True, delta: str = "auto", delta_anchor: int = 64, elastic: bool = False) -> dict:
    """The plain dict to pass to ``init_weight_transfer_engine``. ``store``: ``"host:port"`` of the
    refit group's TCPStore (trainer rank 0 hosts it); ``inference_ranks``: the global ranks of every
    replica's TP ranks in the refit group, replica after replica (``inference_ranks[i]`` is TP rank
    ``i % tp`` of replica ``i // tp``); ``replica``: which replica this engine is (its workers join as
    ``inference_ranks[replica * tp + tp rank]``); ``src_dtype``: the trainers' parameter dtype. Each
    worker derives its layouts from the served model's config with ``trs.recipes.hf_to_vllm``, or with
    ``trs.recipes.megatron_to_vllm`` when ``megatron`` (a ``trs.recipes.Megatron``: the trainers are
    Megatron-Core ranks, ``trainer_ranks`` in Megatron rank order) is given; it crosses as a dict.
    ``prefetch``: each worker pulls every published version in the background into its spare
    buffer set, so ``update_weights`` only applies it (False: the pull runs inside
    ``update_weights``, and the trainers' ``fence()`` waits for it; see docs/vllm.md).
    ``delta``, ``delta_anchor``: the cross-host deltas, the same as the trainers' (``Trainer(delta=)``;
    see :class:`~tritonreshard.RefitEndpoint`).

    ``elastic``: join an elastic group (the trainers are ``Trainer(..., elastic=True)``; see
    docs/elastic.md) while it runs: ``inference_ranks`` are then this engine's own TP ranks (TP rank
    ``t`` joins as ``inference_ranks[t]``; ranks no other engine or trainer uses, below
    ``trs.engine.elastic.MAX_RANKS``), and ``replica`` its index among the engines (any int >= 0
    that no engine in the group holds). ``shutdown_weight_transfer_engine`` leaves the group."""
    problems = list(delta_problems(delta, delta_anchor))
    if not isinstance(elastic, bool):
        problems.append(f"elastic must be True or False, got elastic={elastic!r}")
    if megatron is not None and not isinstance(megatron, recipes.Megatron):
        problems.append(f"megatron must be a trs.recipes.Megatron or None, got megatron={megatron!r}")
    trainer_ranks, inference_ranks = [int(r) for r in trainer_ranks], [int(r) for r in inference_ranks]
    if elastic is True:  # any index: the engines in the group are not known here
        if isinstance(replica, bool) or not isinstance(replica, int) or replica < 0:
            problems.append(f"replica={replica!r} must be an int >= 0 (this engine's index among the elastic "
                            f"group's engines)")
        big = [r for r in inference_ranks + trainer_ranks if not 0 <= r < MAX_RANKS]
        if big:
            problems.append(f"ranks {big} are outside an elastic group's [0, {MAX_RANKS})")
    elif isinstance(replica, bool) or not isinstance(replica, int) or not 0 <= replica < max(1, len(inference_ranks)):
        problems.append(f"replica={replica!r} must be an int in [0, number of replicas)")
    if set(trainer_ranks) & set(inference_ranks):
        problems.append(f"trainer_ranks={trainer_ranks} and inference_ranks={inference_ranks} overlap")
    if not isinstance(store, str) or ":" not in store:
        problems.append(f"store must be 'host:port', got store={store!r}")
    if src_dtype not in SRC_DTYPES:
        problems.append(f"src_dtype must be one of {list(SRC_DTYPES)}, got src_dtype={src_dtype!r}")
    if not isinstance(prefetch, bool):
        problems.append(f"prefetch must be True or False, got prefetch={prefetch!r}")
    if problems:
        raise ValueError("init_info: " + "; ".join(problems))
    return {"store": store, "trainer_ranks": trainer_ranks, "inference_ranks": inference_ranks,
            "src_dtype": src_dtype, "group": group,
            "timeout": float(timeout), "peer_timeout": float(peer_timeout), "replica": replica,
            "megatron": None if megatron is None else dataclasses.asdict(megatron), "prefetch": prefetch,
            "delta": delta, "delta_anchor": delta_anchor, "elastic": elastic}


class Trainer(RefitTrainer):
    """Trainer side of a vLLM refit group: a :class:`~tritonreshard.RefitTrainer` whose source
    layouts are ``trs.recipes.hf_to_vllm(config, tp=tp, ...).src`` (the vLLM workers build the
    destination side of the same recipe from the served model's config).

    ``config``: the model's ``transformers`` config (any ``model_type`` the recipes know: llama,
    mistral, qwen2, qwen3, qwen3_moe, deepseek_v2, deepseek_v3). ``shards``: this rank's FSDP row shards ``{HF parameter name:
    tensor of spec.src[name].local_shape(rank)}`` (``Shard(0)`` over ``trainer_ranks``), copied once
    into the shared arena; train on ``tensors`` afterwards (or pass an ``nn.Module`` whose parameters
    are those shards: they are re-pointed at the arena). Call ``fence()`` before changing the
    weights and ``publish()`` after; the vLLM workers pull from the arena. ``rank`` is this
    process's rank in the refit group (one of ``trainer_ranks``). ``src_dtype``: a name of
    :data:`SRC_DTYPES` or its torch dtype (default: the shards' dtype). ``spec`` is the recipe;
    the attribute ``src_dtype`` the name to pass to :func:`init_info`.

    ``megatron``: a ``trs.recipes.Megatron`` when the trainers are Megatron-Core ranks; ``shards`` are
    then ``trs.recipes.megatron_tensors(model_chunks, megatron=megatron, rank=r)`` and the spec is
    ``trs.recipes.megatron_to_vllm`` (pass the same ``megatron`` to :func:`init_info`).

    ``elastic``: the trainers of an elastic group (docs/elastic.md): they meet alone
    (``trainer_ranks`` must be ``0 .. n-1``, ``inference_ranks`` may be None) and engines join and
    leave while they run (``init_info(elastic=True, replica=i)``); ``fence()`` waits for the engines
    admitted now, never for one that left or died. ``tp`` only shapes the recipe's unused
    destination side here: the source layouts are the same for every ``tp``.
    """

    def __init__(self, config, shards, *, rank: int, tp: int, trainer_ranks, inference_ranks=None, store,
                 src_dtype=None, group: str = "vllm", megatron=None, elastic: bool = False, **kwargs):
        dtype = SRC_DTYPES.get(src_dtype, src_dtype) or next(iter(
            shards.values() if isinstance(shards, dict) else (p for _, p in shards.named_parameters()))).dtype
        names = {d: n for n, d in SRC_DTYPES.items()}
        problems = []
        if dtype not in names:
            problems.append(f"the shards' dtype must be one of {list(SRC_DTYPES)}, got {dtype}")
        trainer_ranks = [int(r) for r in trainer_ranks]
        if not isinstance(elastic, bool):
            problems.append(f"elastic must be True or False, got elastic={elastic!r}")
        elif elastic:
            if trainer_ranks != list(range(len(trainer_ranks))):
                problems.append(f"an elastic group's trainers are its world: trainer_ranks must be "
                                f"{list(range(len(trainer_ranks)))}, got {trainer_ranks}")
            # The recipe's destination side is not used (each engine builds its own); any ranks do.
            inference_ranks = list(range(len(trainer_ranks), len(trainer_ranks) + tp)) \
                if inference_ranks is None else inference_ranks
        elif inference_ranks is None:
            problems.append("inference_ranks is needed (every engine's TP ranks), unless elastic=True")
            inference_ranks = []
        if set(trainer_ranks) & set(inference_ranks):
            problems.append(f"trainer_ranks={list(trainer_ranks)} and inference_ranks={list(inference_ranks)} overlap")
        if problems:
            raise ValueError("Trainer: " + "; ".join(problems))
        # Only the source side matters here; the destination dtype is vLLM's, chosen by the workers.
        if megatron is not None:
            self.spec = recipes.megatron_to_vllm(config, megatron=megatron, tp=tp, trainer_ranks=trainer_ranks,
                                                 inference_ranks=inference_ranks, src_dtype=dtype)
        else:
            self.spec = recipes.hf_to_vllm(config, tp=tp, trainer_ranks=trainer_ranks,
                                           inference_ranks=inference_ranks, src_dtype=dtype)
        self.src_dtype = names[dtype]  # what init_info(src_dtype=...) needs on the vLLM side
        self.source = None
        world = len(trainer_ranks) if elastic else len(trainer_ranks) + len(inference_ranks)
        super().__init__(shards, self.spec.src, rank=rank, world_size=world, store=store, group=group,
                         elastic=elastic, **kwargs)

    @classmethod
    def from_weight_source(cls, source, *, rank: int, trainer_ranks, inference_ranks, store, group: str = "vllm",
                           **kwargs) -> "Trainer":
        """A trainer fed by vLLM's own trainer-side description (vLLM >= 0.33's
        ``vllm.distributed.weight_transfer.base.WeightSource``), with no recipe of its own.

        ``source.metadata`` declares every HF parameter (name, dtype, full shape, ``owners``,
        ``mesh_shape``, ``placements``: each becomes a layout by :meth:`trs.Layout.from_param_meta
        <tritonreshard.Layout.from_param_meta>` over ``trainer_ranks``), and ``source.iter_local()``
        yields this rank's pieces, exactly ``source.owned_names(t)`` in metadata order, where ``t``
        is this rank's index in ``trainer_ranks`` (vLLM's trainer rank). The vLLM workers build the
        destination side from the served model's config as usual; their recipe reads the HF names,
        whatever the trainers' layouts. All parameters must share one dtype of :data:`SRC_DTYPES`
        (the ``src_dtype`` of :func:`init_info`).

        ``publish()`` waits for ``fence()`` and takes a fresh ``iter_local()`` pass into the arena
        before publishing: the framework keeps training its own tensors. Duck-typed: vLLM is not
        imported. Bad input: one ``ValueError`` naming every problem, before joining the group.
        """
        trainer_ranks, inference_ranks = [int(r) for r in trainer_ranks], [int(r) for r in inference_ranks]
        problems = []
        missing = [a for a in ("metadata", "owned_names", "iter_local") if not hasattr(source, a)]
        if missing:
            raise ValueError(f"Trainer.from_weight_source: source {type(source).__name__} has no {missing} "
                             f"(a vLLM >= 0.33 WeightSource has them)")
        if getattr(source, "implements_iter_local", lambda: True)() is False:
            problems.append(f"source {type(source).__name__} does not implement iter_local (each owner's pieces)")
        if rank not in trainer_ranks:
            problems.append(f"rank={rank} is not one of trainer_ranks={trainer_ranks}")
        if set(trainer_ranks) & set(inference_ranks):
            problems.append(f"trainer_ranks={trainer_ranks} and inference_ranks={inference_ranks} overlap")
        layouts = {}
        for meta in source.metadata:
            try:
                layouts[meta.name] = Layout.from_param_meta(meta, trainer_ranks)
            except ValueError as exc:
                problems.append(str(exc))
        dtypes = {lay.dtype for lay in layouts.values()}
        names = {d: n for n, d in SRC_DTYPES.items()}
        if not source.metadata:
            problems.append("source.metadata declares no parameter")
        elif len(dtypes) > 1 or not dtypes <= set(names):
            problems.append(f"the parameters' dtypes {sorted(map(str, dtypes))} must be one of {list(SRC_DTYPES)}, "
                            f"all the same (init_info's src_dtype)")
        if problems:
            raise ValueError("Trainer.from_weight_source: " + "; ".join(problems))
        self = cls.__new__(cls)
        self.spec, self.source = None, source
        self._trainer_index, self._source_rank = trainer_ranks.index(rank), rank
        self._layouts = layouts
        self.src_dtype = names[dtypes.pop()]
        RefitTrainer.__init__(self, self._pass(), layouts, rank=rank,
                              world_size=len(trainer_ranks) + len(inference_ranks), store=store, group=group, **kwargs)
        return self

    def _pass(self) -> dict:
        """One ``iter_local()`` pass of the source, checked against ``owned_names`` and the layouts."""
        want = list(self.source.owned_names(self._trainer_index))
        got = dict(self.source.iter_local())
        problems = []
        if list(got) != want:
            problems.append(f"iter_local yielded {list(got)}, owned_names({self._trainer_index}) is {want}")
        for name, t in got.items():
            lay = self._layouts.get(name)
            rank = self._source_rank
            if lay is not None and rank in lay.ranks and (tuple(t.shape), t.dtype) != (lay.local_shape(rank), lay.dtype):
                problems.append(f"{name}: iter_local yielded {t.dtype} of shape {tuple(t.shape)}, its ParamMeta "
                                f"places {lay.dtype} of {lay.local_shape(rank)} on trainer rank {self._trainer_index}")
        if problems:
            raise ValueError(f"Trainer.from_weight_source (rank {self._source_rank}): " + "; ".join(problems))
        return got

    def publish(self) -> int:
        """Publish the arena as the next version; a trainer made by :meth:`from_weight_source`
        first waits for its readers (``fence()``) and copies a fresh ``iter_local()`` pass in."""
        if self.source is not None:
            self.fence()
            arena = self.tensors
            for name, t in self._pass().items():
                arena[name].copy_(t)
        return super().publish()
