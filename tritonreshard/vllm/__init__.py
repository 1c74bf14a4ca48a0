"""tritonreshard as a vLLM weight-transfer backend (``weight_transfer_config={"backend": "tritonreshard"}``).

Inference side: :mod:`tritonreshard.vllm._worker` (imported by vLLM's workers only, through the
``vllm.general_plugins`` entry point :func:`register`), split by job: ``_agree`` (the TP group's
agreement), ``_model`` (the model check), ``_apply`` (the apply step); the rest is the serving seam
(:mod:`tritonreshard.serving`: the init info, the trainer side, the per-rank layout, the pull
modes, the refit session), which vLLM shares with any other engine. Trainer side: :class:`Trainer`,
used in each trainer process; the RL script drives vLLM's four phases::

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
membership=trs.Elastic())`` in every trainer process (the trainers meet alone and keep running; their
``inference_ranks`` are not needed), and ``init_info(..., elastic=True, replica=i,
inference_ranks=<this engine's own TP ranks>)`` for engine ``i``, passed to its
``init_weight_transfer_engine`` whenever it starts: it joins the running group and serves the newest
version from then on. Its ``shutdown_weight_transfer_engine`` (or its process's death) takes it out of
the group; the trainers' ``fence()`` stops waiting for it, and the other engines go on. See
docs/elastic.md.

Importing this package does not import vLLM.
"""
from __future__ import annotations

import inspect

from ..serving import SRC_DTYPES, ServingInit
from ._recipes import GROUP
from .trainer import Trainer

__all__ = ["Trainer", "WorkerExtension", "init_info", "register", "BACKEND", "WORKER_EXTENSION", "SRC_DTYPES"]

BACKEND = "tritonreshard"
WORKER_EXTENSION = f"{__name__}.WorkerExtension"  # for LLM(worker_extension_cls=...)

# SRC_DTYPES (re-exported): the trainers' dtypes by the name that crosses the wire in init_info,
# the one table of tritonreshard.serving.schema.

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


def init_info(**fields) -> dict:
    """The plain dict to pass to ``init_weight_transfer_engine``: a
    :class:`~tritonreshard.serving.ServingInit` of these keywords (its fields, defaults and checks:
    one ``ValueError`` naming every problem), as :meth:`~tritonreshard.serving.ServingInit.to_dict`.
    ``store``: ``"host:port"`` of the
    refit group's TCPStore (trainer rank 0 hosts it); ``inference_ranks``: the global ranks of every
    replica's TP ranks in the refit group, replica after replica (``inference_ranks[i]`` is TP rank
    ``i % tp`` of replica ``i // tp``); ``replica``: which replica this engine is (its workers join as
    ``inference_ranks[replica * tp + tp rank]``); ``src_dtype``: the trainers' parameter dtype. Each
    worker derives its layouts from the served model's config with ``trs.recipes.hf_to_vllm``, or with
    ``trs.recipes.megatron_to_vllm`` when ``megatron`` (a ``trs.recipes.Megatron``: the trainers are
    Megatron-Core ranks, ``trainer_ranks`` in Megatron rank order) is given; it crosses as a dict.
    ``prefetch``: each worker pulls every published version in the background into its spare
    buffer set, so ``update_weights`` only applies it (False: the pull runs inside
    ``update_weights``, and the trainers' ``fence()`` waits for it; see docs/vllm.md). ``direct``
    (with ``prefetch=False``): the pull writes the parameters vLLM serves in load format (all of them
    for an unquantized model on CUDA; the norms on vLLM's CPU backend) directly, with no buffer, and
    the rest into one buffer set; a pull that fails part-way then leaves vLLM's weights torn (marked
    incomplete on vLLM 0.34) until an ``update_weights`` succeeds (False: one buffer set for every
    parameter, and vLLM keeps serving the previous version on a failure).
    ``delta``, ``delta_anchor``: the cross-host deltas, the same as the trainers' (``Trainer(codec=)``;
    see :class:`~tritonreshard.RefitEndpoint`).

    ``elastic``: join an elastic group (the trainers are ``Trainer(..., membership=trs.Elastic())``; see
    docs/elastic.md) while it runs: ``inference_ranks`` are then this engine's own TP ranks (TP rank
    ``t`` joins as ``inference_ranks[t]``; ranks no other engine or trainer uses, below
    ``trs.engine.elastic.MAX_RANKS``), and ``replica`` its index among the engines (any int >= 0
    that no engine in the group holds). ``shutdown_weight_transfer_engine`` leaves the group."""
    return ServingInit(**{"group": GROUP, **fields}).to_dict()


# The keywords are ServingInit's (keyword-only here), so help() and editors show its fields and defaults.
init_info.__signature__ = inspect.Signature(
    [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in inspect.signature(ServingInit).parameters.values()],
    return_annotation=dict)
