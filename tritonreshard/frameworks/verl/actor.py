"""verl's actor side: the ``"tritonreshard"`` checkpoint-engine backend, from the engine's own shards.

verl 0.9.1 (``verl/checkpoint_engine/base.py``) picks a weight-sync backend from its
``CheckpointEngineRegistry`` by ``rollout.checkpoint_engine.backend``; :class:`TritonreshardCheckpointEngine`
is registered there as ``"tritonreshard"``. Every other backend gets the gathered full tensors of
``engine.get_per_tensor_param()``; this one takes the training engine itself and publishes each
actor rank's *local* shards from ``engine.get_per_tensor_param_shard()`` (``(name, local flat
shard, ShardSpec(full_shape, mesh, placements))``), so no full tensor is ever built. The vLLM workers
read their TP shards straight out of the actors' shared arenas.

**What crosses verl's three set-up calls** (``CheckpointEngineManager.build_process_group``, before
every sync, with the replicas the manager holds then; the rollout side,
``tritonreshard.frameworks.verl.rollout``, reads the same):

* ``prepare()`` returns a plain dict. Actor ranks (built by verl with ``is_master=`` given):
  ``{"side": "actor", "rank": <torch rank>, "store": "host:port" on the master (actor rank 0,
  which hosts the refit group's TCPStore), else None, "megatron": engine_kwargs' settings or
  None, "elastic": engine_kwargs' elastic, "src_dtype": the training engine's parameter dtype}``
  (``"float32"``, ``"bfloat16"`` or ``"float16"``: :func:`~.export.source_dtype`; the engine is
  the one the wrap of ``execute_checkpoint_engine`` hands the backend, see below). Rollout
  workers (built with no ``is_master``): ``{"side": "rollout"}``; the rollout side may add keys.
* ``build_topology(n_actor, n_rollout, metadata)`` returns ``({"topology": [dict] * n_actor},
  {"topology": [dict] * n_rollout})``, one :class:`Topology` dict per worker: ``rank`` (its rank in
  the refit group: actor ``i`` is ``i``), ``store``, ``trainer_ranks`` (``0 .. n_actor - 1``),
  ``group`` (:data:`GROUP`), ``src_dtype`` (the actors' parameter dtype, the same on every actor:
  the actors send their own dtype and each vLLM worker's copy casts once, to the dtype it serves),
  ``megatron`` (``engine_kwargs``' Megatron settings as a dict, or None) and ``elastic``. How the
  rollout workers are numbered depends on it:

  - **elastic** (``engine_kwargs`` ``elastic=True``, the default): the actors meet alone
    (``trs.Elastic()``) and every vLLM worker joins the running group at its replica's first sync,
    as rank ``n_actor + replica * tp + tp_rank`` (its replica index from ``VERL_REPLICA_RANK``, see
    the rollout side). The rollout workers' topology names no ranks (``rank`` None,
    ``inference_ranks`` empty): a replica's ranks follow from its index, not from where it sits in
    the manager's list, which ``add_replicas`` / ``remove_replicas`` change. A replica verl adds
    joins at the next sync and installs that sync's version; one that verl removes, or whose
    processes die, is dropped by the actors' next ``fence`` (named in a warning, counted in the
    sync's metrics) and the others go on. One host only (the readers map the actors' arenas).
  - **fixed** (``elastic=False``): every rollout worker meets with the actors once, rollout worker
    ``j`` as rank ``n_actor + j`` (``inference_ranks``: ``n_actor .. n_actor + n_rollout - 1``, in
    verl's order: replica after replica, so ``inference_ranks[i]`` is TP rank ``i % tp`` of replica
    ``i // tp``). Several hosts work; a replica added or removed is refused, and a dead one fails
    the actors' next sync.
* ``init_process_group(topology=dict)`` keeps it as ``self.topology`` (a :class:`Topology`) and
  ``self.init_info`` (:meth:`Topology.init_info`: the group's fields of ``tritonreshard.vllm.init_info``
  for the rollout side's vLLM workers). Nothing joins there: the group meets inside the first sync
  (the actors' ``send_weights`` beside the rollout's ``receive_weights``) and lives until the process
  ends. verl calls the three before every sync; once the group formed, an actor refuses a topology
  that changed (any change of an elastic actor's: its rank, the actors' number, the store, the
  Megatron settings, the mode; of a fixed one's, the rollout workers too) with one ``ValueError``
  naming each field, old and new.

``send_weights(engine, global_steps)``: at the first sync, each rank's export becomes source
:class:`~tritonreshard.Layout` s and the rank joins as a :class:`~tritonreshard.RefitTrainer`; every
sync then waits for the readers of the last version (``fence``: in an elastic group the readers
admitted now, never one that left or died), writes the export into the arena and publishes version
``global_steps + 1`` (verl's first sync is step 0, or the step it resumed at; the rollout side
installs the same version), refusing a step that does not follow the last one before anything
moves. Its metrics add ``tritonreshard/readers`` (rollout ranks reading this actor when it
published) and ``tritonreshard/dropped`` (dropped since the last sync). Shards that can be the
arena itself are bound to it at the first sync, and later syncs copy nothing
(:func:`export_source`). The store listens beyond loopback across hosts: set
``TRITONRESHARD_GROUP_SECRET`` (64 hex digits) in every worker's environment.

verl hands the engine only to its ``delta_sharded`` backend (``workers/engine_workers.py:759``), so
:func:`wrap_update_weights` wraps ``ActorRolloutRefWorker.update_weights`` for this backend alone;
upstream, ``or getattr(self.checkpoint_engine, "consumes_engine", False)`` on that line makes the
wrap unnecessary, and the wrap then installs nothing. verl's ``prepare`` gets no engine at all:
:func:`wrap_execute_checkpoint_engine` wraps ``ActorRolloutRefWorker.execute_checkpoint_engine``
(how verl calls every set-up method) to hand it to this backend first, so that ``prepare`` can
announce the parameters' dtype before the first sync.
"""
from __future__ import annotations

import atexit
import dataclasses
import functools
import inspect
import logging
import socket
import time
from dataclasses import asdict, dataclass

import torch
import verl
from verl.checkpoint_engine.base import CheckpointEngine, CheckpointEngineRegistry
from verl.workers import engine_workers

from ... import Elastic, Meeting, RefitTrainer, Timeouts
from ...recipes import Megatron, megatron_bind
from ...serving import SRC_DTYPES, src_dtype_name

# The rollout side's module imports neither vLLM nor verl's rollout at its top (its worker extension
# is built on first use): one rule for the version of a step, written there.
from .export import ShardSource, export_shards, export_source, source_dtype
from .rollout import receive_weights, version_for

__all__ = ["TritonreshardCheckpointEngine", "VerlRefitConfig", "Topology", "ShardSource", "export_source",
           "source_dtype", "settings_problems", "wrap_update_weights", "wrap_execute_checkpoint_engine", "install",
           "BACKEND", "GROUP", "KNOWN_VERL", "KNOWN_SIGNATURE", "KNOWN_EXECUTE_SIGNATURE"]

#: The backend's name in verl's registry (``rollout.checkpoint_engine.backend``).
BACKEND = "tritonreshard"
#: The refit group's name in its store.
GROUP = "verl"
#: The verl release and ``update_weights`` signature the wrap was written against.
KNOWN_VERL = "0.9.1"
KNOWN_SIGNATURE = "(self, global_steps: int = None, mode: str = 'auto')"
#: ``ActorRolloutRefWorker.execute_checkpoint_engine``'s, for :func:`wrap_execute_checkpoint_engine`.
KNOWN_EXECUTE_SIGNATURE = "(self, method: str, *args, **kwargs)"
_MARK = "__tritonreshard_wrapped__"

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class VerlRefitConfig:
    """``rollout.checkpoint_engine.engine_kwargs.tritonreshard`` (verl passes the same to the actor
    and the rollout side). ``store_host`` / ``store_port``: where actor rank 0 hosts the group's
    store (None: this node's address as Ray reports it, 127.0.0.1 outside Ray; 0: a free port).
    ``timeout`` / ``peer_timeout``: seconds, as :class:`~tritonreshard.Timeouts`' ``wait`` / ``peer``.
    ``megatron``: for a Megatron actor, its settings as ``trs.recipes.Megatron`` fields (``tp``,
    ``pp``, ``ep``, ``etp``, ``vocab_divisible_by``, ``vpp``): the vLLM workers need them before the
    first sync to build the Megatron recipe, and the actor checks them against its engine.
    ``elastic``: the rollout replicas join and leave a running group (verl's ``add_replicas`` /
    ``remove_replicas``; actors and rollout on one host); False: a fixed group of the first sync's
    workers, which may span hosts (see the module docstring)."""

    store_host: str | None = None
    store_port: int = 0
    timeout: float = 300.0
    peer_timeout: float = 30.0
    megatron: dict | None = None
    elastic: bool = True

    @classmethod
    def from_kwargs(cls, **kwargs) -> VerlRefitConfig:
        """One ``ValueError`` naming every unknown key and bad value."""
        known = {f for f in cls.__dataclass_fields__}
        problems = [f"unknown key {k!r} (known: {sorted(known)})" for k in kwargs if k not in known]
        args = {k: v for k, v in kwargs.items() if k in known}
        port = args.get("store_port", 0)
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port < 65536:
            problems.append(f"store_port={port!r} must be an int in 0..65535")
        for key in ("timeout", "peer_timeout"):
            value = args.get(key, 1.0)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                problems.append(f"{key}={value!r} must be > 0 seconds")
        if not isinstance(args.get("elastic", True), bool):
            problems.append(f"elastic={args['elastic']!r} must be True or False")
        meg = args.get("megatron")
        if meg is not None:
            try:  # narrow: Megatron's own checks, gathered with the others
                Megatron(**dict(meg))
            except (TypeError, ValueError) as exc:
                problems.append(f"megatron={meg!r}: {exc}")
            args["megatron"] = dict(meg)
        if problems:
            raise ValueError("tritonreshard verl backend engine_kwargs: " + "; ".join(problems))
        return cls(**args)


@dataclass(frozen=True)
class Topology:
    """One worker's place in the refit group (see the module docstring): what ``build_topology``
    hands each worker's ``init_process_group``, as a dict (:meth:`as_dict`) through Ray.
    ``rank``: None for a rollout worker of an elastic group (its rank follows from its replica);
    ``inference_ranks``: every rollout worker's rank in a fixed group, empty in an elastic one."""

    rank: int | None
    store: str
    trainer_ranks: tuple[int, ...]
    inference_ranks: tuple[int, ...]
    group: str = GROUP
    src_dtype: str = "bfloat16"
    megatron: dict | None = None
    elastic: bool = True

    def __post_init__(self):
        object.__setattr__(self, "trainer_ranks", tuple(self.trainer_ranks))
        object.__setattr__(self, "inference_ranks", tuple(self.inference_ranks))

    def as_dict(self) -> dict:
        return asdict(self)

    def init_info(self) -> dict:
        """The group's fields of ``tritonreshard.vllm.init_info`` (plain JSON types) that a vLLM
        worker joins with; the rollout side adds its replica (and, elastic, its own ranks)."""
        info = {"store": self.store, "trainer_ranks": list(self.trainer_ranks), "group": self.group,
                "src_dtype": self.src_dtype}
        if self.elastic:
            info["elastic"] = True
        else:
            info["inference_ranks"] = list(self.inference_ranks)
        if self.megatron is not None:
            info["megatron"] = dict(self.megatron)
        return info

    @property
    def world_size(self) -> int:
        """The group's size at the meeting: the actors alone in an elastic group."""
        return len(self.trainer_ranks) + len(self.inference_ranks)


def _node_address() -> str:
    """This node's address as Ray reports it (what verl's own backends bind to), else loopback."""
    import ray  # verl's workers run under Ray; outside it (tests) the store stays on loopback

    return ray.util.get_node_ip_address().strip("[]") if ray.is_initialized() else "127.0.0.1"


def _free_port(host: str) -> int:
    # The kernel's pick for port 0: another process may take it before actor rank 0's TCPStore
    # binds it at the first sync (set engine_kwargs store_port to pin one).
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@CheckpointEngineRegistry.register(BACKEND)
class TritonreshardCheckpointEngine(CheckpointEngine):
    """verl's ``"tritonreshard"`` checkpoint engine (``rollout.checkpoint_engine.backend=tritonreshard``,
    ``custom_backend_module=tritonreshard.frameworks.verl``). verl builds one in every actor rank
    (``is_master=`` given: rank 0 is the master) and one per rollout worker (no ``is_master``); the
    keywords past ``bucket_size`` are ``engine_kwargs.tritonreshard`` (:class:`VerlRefitConfig`).
    ``bucket_size`` is unused: nothing is bucketed, each vLLM rank copies its shards straight out
    of the actors' arenas.

    ``consumes_engine``: this backend's ``send_weights`` takes the training engine, not tensors (the
    attribute verl would read upstream, making the wrap of ``update_weights`` unnecessary).
    ``dropped``: on an actor of an elastic group, ``(rank, why)`` of every rollout rank the group
    dropped (its replica left or died), in order. ``actor_engine``: on an actor, the training
    engine, handed over by the wrap of ``execute_checkpoint_engine`` before verl's set-up calls.
    """

    consumes_engine = True

    def __init__(self, bucket_size: int = 0, is_master: bool | None = None, **engine_kwargs):
        self.config = VerlRefitConfig.from_kwargs(**engine_kwargs)
        self.side = "rollout" if is_master is None else "actor"
        self.is_master = bool(is_master)
        self.topology: Topology | None = None
        self.init_info: dict | None = None  # the topology's init_info() fields, for the rollout side
        self.trainer: RefitTrainer | None = None
        self.source: ShardSource | None = None
        self.stats: dict = {}
        self.dropped: list[tuple[int, str]] = []
        self.actor_engine = None
        self._store: str | None = None

    # -- set-up: every sync ----------------------------------------------------------------
    def prepare(self) -> dict:
        """This worker's metadata for :meth:`build_topology` (see the module docstring)."""
        if self.side == "rollout":
            return {"side": "rollout"}
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        if self.is_master and self._store is None:
            host = self.config.store_host or _node_address()
            port = self.config.store_port or _free_port(host)
            self._store = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        # None without the engine: build_topology names the missing wrap.
        dtype = None if self.actor_engine is None else src_dtype_name(source_dtype(self.actor_engine))
        return {"side": "actor", "rank": rank, "store": self._store if self.is_master else None,
                "megatron": self.config.megatron, "elastic": self.config.elastic, "src_dtype": dtype}

    @classmethod
    def build_topology(cls, actor_wg_world_size: int, rollout_world_size: int, metadata: list[dict]):
        """Every actor rank a trainer; every rollout worker an inference rank, numbered by its
        replica (elastic) or by its place (fixed): see the module docstring. ``metadata``: the
        actors' ``prepare()`` then the rollout workers', as verl gathers them."""
        n, m = int(actor_wg_world_size), int(rollout_world_size)
        problems = []
        if len(metadata) != n + m:
            problems.append(f"{len(metadata)} metadata for {n} actor and {m} rollout workers")
        sides = [getattr(x, "get", lambda k: None)("side") for x in metadata]
        if sides[:n] != ["actor"] * n or sides[n:] != ["rollout"] * m:
            problems.append(f"metadata sides {sides}: expected {n} actor then {m} rollout")
        ranks = [x.get("rank") for x in metadata[:n]] if not problems else []
        if ranks and ranks != list(range(n)):
            problems.append(f"the actors report torch ranks {ranks}, not 0..{n - 1} in worker order")
        store = metadata[0].get("store") if not problems else None
        if not problems and not store:
            problems.append("actor rank 0 (verl's is_master) reported no store address")
        modes = [x.get("elastic") for x in metadata[:n]] if not problems else [True]
        if any(not isinstance(e, bool) for e in modes) or len(set(modes)) != 1:
            problems.append(f"the actors report elastic={modes}: one bool, the same on every actor (engine_kwargs)")
        dtypes = [x.get("src_dtype") for x in metadata[:n]] if not problems else ["bfloat16"]
        if None in dtypes:
            problems.append(f"actor rank(s) {[r for r, d in enumerate(dtypes) if d is None]} reported no src_dtype: "
                            f"verl ran prepare() without handing the backend its training engine (the wrap of "
                            f"ActorRolloutRefWorker.execute_checkpoint_engine is not active: import "
                            f"tritonreshard.frameworks.verl in every actor worker, "
                            f"rollout.checkpoint_engine.custom_backend_module)")
        elif len(set(dtypes)) != 1 or dtypes[0] not in SRC_DTYPES:
            problems.append(f"the actors report src_dtype={dtypes}: one of {list(SRC_DTYPES)}, the same on every actor "
                            f"(their parameters' dtype)")
        if problems:
            raise ValueError("tritonreshard verl backend build_topology: " + "; ".join(problems))
        meg, elastic, trainers = metadata[0].get("megatron"), modes[0], tuple(range(n))
        actors = [Topology(r, store, trainers, () if elastic else tuple(range(n, n + m)), src_dtype=dtypes[0],
                           megatron=meg, elastic=elastic) for r in range(n)]
        # Elastic: a rollout worker's rank is its replica's (the rollout side derives it), not its
        # place in the manager's list, which add_replicas / remove_replicas change.
        rollout = [dataclasses.replace(actors[0], rank=None if elastic else n + j) for j in range(m)]
        return {"topology": [t.as_dict() for t in actors]}, {"topology": [t.as_dict() for t in rollout]}

    def init_process_group(self, topology: dict):
        """Keep this worker's :class:`Topology`. An actor whose group formed must see the same one:
        in an elastic group the actors' topology names no rollout worker, so replicas verl adds or
        removes change nothing here, and any change is one the group cannot follow (the actors
        keep their ranks and arena for the job's life); a fixed group refuses replica changes too.
        One ``ValueError`` names every changed field, old and new; nothing is kept."""
        topo = Topology(**topology)
        if self.trainer is not None and topo != self.topology:
            raise ValueError(self._changed(topo))
        self.topology = topo
        self.init_info = topo.init_info()

    def _changed(self, topo: Topology) -> str:
        old = self.topology
        fields = [f.name for f in dataclasses.fields(Topology) if getattr(old, f.name) != getattr(topo, f.name)]
        diff = "; ".join(f"{name}: {getattr(old, name)!r} -> {getattr(topo, name)!r}" for name in fields)
        if fields == ["inference_ranks"]:  # only the rollout workers changed: a fixed group's replicas
            hint = ("verl added or removed rollout replicas, and this refit group is fixed (engine_kwargs "
                    "elastic=False): its readers are the rollout workers it met; elastic=True (the default, one "
                    "host) lets replicas join and leave, or restart the job")
        else:
            hint = ("the actors keep their refit ranks, store and arena for the job's life: a change of the actor "
                    "world size, the Megatron settings, the parameters' dtype, the group or elastic needs a restart "
                    "of the job")
        return (f"tritonreshard verl backend (refit rank {old.rank}): the topology changed after the refit group "
                f"formed ({diff}); {hint}; nothing was changed")

    def finalize(self):
        """Nothing per sync: the group and the arena live across syncs (verl calls this after each);
        :meth:`close` ends them (at exit)."""

    def close(self) -> None:
        trainer, self.trainer = self.trainer, None
        if trainer is not None:
            atexit.unregister(self.close)
            trainer.close()

    # -- each sync -------------------------------------------------------------------------
    async def send_weights(self, weights, global_steps: int | None = None) -> dict:
        """Publish this actor rank's shards as the next version (see the module docstring).
        ``weights``: the training engine (anything with ``get_per_tensor_param_shard``); gathered
        tensors are refused before one is read. Returns metrics: the version, ``global_steps``,
        bytes this rank copied and seconds spent."""
        if self.side != "actor" or self.topology is None:
            raise RuntimeError(f"tritonreshard verl backend: send_weights on a {self.side} worker with topology "
                               f"{self.topology} (verl calls prepare / build_topology / init_process_group first)")
        if not hasattr(weights, "get_per_tensor_param_shard"):
            raise ValueError(f"tritonreshard verl backend: send_weights got {type(weights).__name__}, not the training "
                             f"engine: verl handed it gathered tensors, so the wrap of ActorRolloutRefWorker."
                             f"update_weights is not active (import tritonreshard.frameworks.verl in every actor "
                             f"worker: rollout.checkpoint_engine.custom_backend_module); nothing was read")
        want = version_for(global_steps)
        if self.trainer is not None and want is not None and want != self.trainer.published + 1:
            raise ValueError(f"tritonreshard verl backend (refit rank {self.topology.rank}): the sync of global_steps="
                             f"{global_steps} is version {want}, but this rank's last version is "
                             f"{self.trainer.published}: one version per sync, step s is version s + 1 (as the rollout "
                             f"side reads them); nothing was sent")
        start = time.perf_counter()
        copied = self._join(weights, 0 if want is None else want - 1) if self.trainer is None else self._write(weights)
        readers = len(self.trainer.readers)  # before publishing: a reader may take the version and leave at once
        version = self.trainer.publish()
        dropped = self._newly_dropped(version)
        self.stats = {"tritonreshard/version": version, "tritonreshard/copied_bytes": copied,
                      "tritonreshard/send_s": time.perf_counter() - start, "tritonreshard/readers": readers,
                      "tritonreshard/dropped": len(dropped)}
        if global_steps is not None:  # verl's trackers log numbers; a sync without steps has none
            self.stats["tritonreshard/global_steps"] = global_steps
        return dict(self.stats)

    def _newly_dropped(self, version: int) -> list[tuple[int, str]]:
        """The rollout ranks the group dropped since the last sync (an elastic group drops a reader
        whose replica left or died, and goes on): kept in ``dropped`` and named in a warning."""
        new = self.trainer.dropped[len(self.dropped):]  # the trainer's list only grows, in order
        self.dropped.extend(new)
        if new:
            logger.warning("tritonreshard verl backend (refit rank %s): dropped rollout rank(s) %s from the refit "
                           "group before version %s (%s); the other replicas keep refitting", self.topology.rank,
                           [r for r, _ in new], version, "; ".join(why for _, why in new))
        return new

    def _join(self, engine, start_version: int) -> int:
        """First sync: the export's layouts, then join the group as a trainer whose next version is
        ``start_version + 1`` (elastic: the actors meet alone, the rollout workers join them).
        Returns bytes copied into the arena (the whole local export, once)."""
        topo = self.topology
        src = export_source(engine, trainer_ranks=topo.trainer_ranks, rank=topo.rank, megatron=self.config.megatron,
                            src_dtype=SRC_DTYPES[topo.src_dtype])
        meeting = Meeting(rank=topo.rank, world_size=topo.world_size, store=topo.store, group=topo.group)
        timeouts = Timeouts(wait=self.config.timeout, peer=self.config.peer_timeout)
        tensors = src.fsdp2 if src.fsdp2 is not None else src.tensors
        self.trainer = RefitTrainer(tensors, src.layouts, meeting, timeouts=timeouts, start_version=start_version,
                                    membership=Elastic() if topo.elastic else None)
        atexit.register(self.close)
        if src.megatron is not None:  # the parameters train the arena from now on
            megatron_bind(engine.module, self.trainer.source_tensors, megatron=src.megatron,
                          rank=topo.trainer_ranks.index(topo.rank))
        self.source = src
        return sum(t.numel() * t.element_size() for t in src.tensors.values())

    def _write(self, engine) -> int:
        """Later syncs: once the readers finished the last version, each exported shard into its
        arena slot (:func:`~.export.export_shards`: the module's own shards where the first sync
        read them there), skipped where it already is that slot. A shard that no longer fits its
        slot aborts the group (its arena is part-written: no reader may take it for a version)."""
        self.trainer.fence()
        arena, exported, copied = self.trainer.source_tensors, self.source.exported, 0
        seen = set()
        for name, local in export_shards(engine, self.source):
            mine = exported.get(name)
            if mine is None and local is not None and local.numel() == 0:
                continue  # another pipeline stage's placeholder, as at the first sync
            slot = arena.get(mine)
            # A floating buffer of the module's own was cast at the first sync too: copy_ casts it.
            cast = local is not None and name in self.source.own and local.is_floating_point()
            if slot is None or local is None or local.numel() != slot.numel() or (local.dtype != slot.dtype
                                                                                   and not cast):
                self._abort(f"{name!r} is not in the first sync's export or changed shape or dtype "
                            f"({None if local is None else (tuple(local.shape), local.dtype)})")
            seen.add(mine)
            if local.data_ptr() != slot.data_ptr():
                slot.copy_(local.view(slot.shape) if local.is_contiguous() else local.reshape(slot.shape))
                copied += local.numel() * local.element_size()
        if seen != set(arena):
            self._abort(f"the export no longer yields {sorted(set(arena) - seen)[:8]}")
        return copied

    def _abort(self, why: str):
        """Abort the group (peers stop waiting at once) and raise ``ValueError`` with ``why``."""
        trainer, self.trainer = self.trainer, None
        if trainer is not None:
            atexit.unregister(self.close)
            trainer.close(abort=True)
        raise ValueError(f"tritonreshard verl backend (refit rank {self.topology.rank}): {why}; the refit group "
                         f"was aborted, nothing of this sync is served")

    def receive_weights(self, global_steps: int | None = None):
        """The rollout side: :func:`tritonreshard.frameworks.verl.rollout.receive_weights`."""

        return receive_weights(self, global_steps)


# ------------------------------------------------------------------------ the update_weights wrap
def settings_problems(config, mode: str) -> list[str]:
    """What in an actor worker's config (``actor_rollout_ref``) keeps this backend from running,
    for ``update_weights(mode=mode)``: a trainer mode that forces ``naive``, a hybrid engine, a
    rollout that is not vLLM."""
    problems = []
    backend = config.rollout.checkpoint_engine.backend
    effective = backend if mode == "auto" else mode
    if effective != backend:
        why = (" (trainer.v1.trainer_mode 'sync' and 'colocate_async' force checkpoint_engine.backend='naive'; "
               "use trainer.v1.trainer_mode=separate_async or the fully-async trainer)" if effective == "naive" else "")
        problems.append(f"verl called update_weights(mode={mode!r}) with checkpoint_engine.backend={backend!r}{why}")
    if bool(config.get("hybrid_engine", True)):
        problems.append("actor_rollout_ref.hybrid_engine=True: set it to False (the rollout replicas are separate "
                        "vLLM engines; hybrid replicas sync through verl's own 'naive' path)")
    name = config.rollout.get("name", None)
    if name != "vllm":
        problems.append(f"actor_rollout_ref.rollout.name={name!r}: this backend refits vLLM only")
    return problems


def _honours_consumes_engine(fn) -> bool:
    """verl already hands the engine to backends that ask (the upstream one-line fix)."""
    try:  # narrow: a function without readable source (built in C, a REPL) has not got the fix
        return "consumes_engine" in inspect.getsource(fn)
    except (OSError, TypeError):
        return False


def _signature(fn) -> str:
    """``fn``'s parameters as written, annotations by name whether evaluated or strings (a module
    with ``from __future__ import annotations`` holds them as strings)."""
    parts = []
    for p in inspect.signature(fn).parameters.values():
        text = {p.VAR_POSITIONAL: "*", p.VAR_KEYWORD: "**"}.get(p.kind, "") + p.name
        if p.annotation is not inspect.Parameter.empty:
            text += f": {p.annotation if isinstance(p.annotation, str) else p.annotation.__name__}"
        if p.default is not inspect.Parameter.empty:
            text += f" = {p.default!r}"
        parts.append(text)
    return f"({', '.join(parts)})"


def wrap_update_weights(worker_cls, verl_version: str) -> bool:
    """Make ``worker_cls.update_weights`` (verl's ``ActorRolloutRefWorker``) hand the training engine
    to a :class:`TritonreshardCheckpointEngine`; every other backend runs verl's method unchanged.
    Returns False (nothing installed) when verl already honours ``consumes_engine`` or the wrap is
    in place. Raises one ``ValueError`` naming verl's version and the method's signature when they
    are not the ones the wrap knows (:data:`KNOWN_VERL`, :data:`KNOWN_SIGNATURE`)."""
    original = worker_cls.update_weights
    if getattr(original, _MARK, False) or _honours_consumes_engine(original):
        return False
    signature = _signature(original)
    if verl_version != KNOWN_VERL or signature != KNOWN_SIGNATURE or not inspect.iscoroutinefunction(original):
        raise ValueError(f"tritonreshard verl backend: verl {verl_version} with {worker_cls.__name__}.update_weights"
                         f"{signature} (async: {inspect.iscoroutinefunction(original)}); the wrap knows verl "
                         f"{KNOWN_VERL} with update_weights{KNOWN_SIGNATURE} (async). A verl that passes the engine "
                         f"to backends with consumes_engine=True needs no wrap; otherwise pin verl=={KNOWN_VERL}")

    @functools.wraps(original)  # keeps verl's register() attributes: the worker group dispatches on them
    async def update_weights(self, global_steps: int = None, mode: str = "auto"):
        backend = getattr(self, "checkpoint_engine", None)
        if not isinstance(backend, TritonreshardCheckpointEngine):
            return await original(self, global_steps=global_steps, mode=mode)
        problems = settings_problems(self.config, mode)
        if problems:
            raise ValueError("tritonreshard verl backend: " + "; ".join(problems) + " (nothing was sent)")
        return await backend.send_weights(self.actor.engine, global_steps=global_steps) or {}

    setattr(update_weights, _MARK, True)
    worker_cls.update_weights = update_weights
    return True


def wrap_execute_checkpoint_engine(worker_cls) -> bool:
    """Make ``worker_cls.execute_checkpoint_engine`` (verl's ``ActorRolloutRefWorker``: how verl's
    manager calls ``prepare``, ``init_process_group`` and ``finalize`` on each actor) hand the
    training engine to a :class:`TritonreshardCheckpointEngine` (its ``actor_engine``) before the
    call, so that ``prepare`` announces the parameters' dtype; other backends are called unchanged.
    Returns False when the wrap is in place already. Raises one ``ValueError`` naming the method's
    signature when it is not :data:`KNOWN_EXECUTE_SIGNATURE` (or the method is async)."""
    original = worker_cls.execute_checkpoint_engine
    if getattr(original, _MARK, False):
        return False
    signature = _signature(original)
    if signature != KNOWN_EXECUTE_SIGNATURE or inspect.iscoroutinefunction(original):
        raise ValueError(f"tritonreshard verl backend: {worker_cls.__name__}.execute_checkpoint_engine{signature} "
                         f"(async: {inspect.iscoroutinefunction(original)}); the wrap knows "
                         f"execute_checkpoint_engine{KNOWN_EXECUTE_SIGNATURE} (not async): pin verl=={KNOWN_VERL}")

    @functools.wraps(original)  # keeps verl's register() attributes, as for update_weights
    def execute_checkpoint_engine(self, method: str, *args, **kwargs):
        backend = getattr(self, "checkpoint_engine", None)
        if isinstance(backend, TritonreshardCheckpointEngine):  # prepare() reads the parameters' dtype off it
            backend.actor_engine = self.actor.engine
        return original(self, method, *args, **kwargs)

    setattr(execute_checkpoint_engine, _MARK, True)
    worker_cls.execute_checkpoint_engine = execute_checkpoint_engine
    return True


def install() -> bool:
    """Wrap verl's ``ActorRolloutRefWorker.update_weights`` (see :func:`wrap_update_weights`) and
    ``execute_checkpoint_engine`` (:func:`wrap_execute_checkpoint_engine`). True when either was
    installed now."""
    worker_cls = engine_workers.ActorRolloutRefWorker
    wrapped = wrap_update_weights(worker_cls, verl.__version__)
    return wrap_execute_checkpoint_engine(worker_cls) or wrapped
