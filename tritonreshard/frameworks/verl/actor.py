"""verl's actor side: the ``"tritonreshard"`` checkpoint-engine backend, from the engine's own shards.

verl 0.9.1 (``verl/checkpoint_engine/base.py``) picks a weight-sync backend from its
``CheckpointEngineRegistry`` by ``rollout.checkpoint_engine.backend``; :class:`TritonreshardCheckpointEngine`
is registered there as ``"tritonreshard"``. Every other backend gets the gathered full tensors of
``engine.get_per_tensor_param()``; this one takes the training engine itself and publishes each
actor rank's *local* shards from ``engine.get_per_tensor_param_shard()`` (``(name, local flat
shard, ShardSpec(full_shape, mesh, placements))``), so no full tensor is ever built. The vLLM workers
read their TP shards straight out of the actors' shared arenas.

**What crosses verl's three set-up calls** (``CheckpointEngineManager.build_process_group``, before
every sync; the rollout side, ``tritonreshard.frameworks.verl.rollout``, reads the same):

* ``prepare()`` returns a plain dict. Actor ranks (built by verl with ``is_master=`` given):
  ``{"side": "actor", "rank": <torch rank>, "store": "host:port" on the master (actor rank 0,
  which hosts the refit group's TCPStore), else None, "megatron": engine_kwargs' settings or
  None}``. Rollout workers (built with no ``is_master``): ``{"side": "rollout"}``; the rollout
  side may add keys.
* ``build_topology(n_actor, n_rollout, metadata)`` returns ``({"topology": [dict] * n_actor},
  {"topology": [dict] * n_rollout})``, one :class:`Topology` dict per worker: ``rank`` (its rank in
  the refit group: actor ``i`` is ``i``, rollout worker ``j`` is ``n_actor + j``), ``store``,
  ``trainer_ranks`` (``0 .. n_actor - 1``), ``inference_ranks`` (``n_actor .. n_actor + n_rollout -
  1``, in verl's order of the rollout workers: replica after replica, so ``inference_ranks[i]`` is TP
  rank ``i % tp`` of replica ``i // tp``, tritonreshard's convention), ``group`` (:data:`GROUP`),
  ``src_dtype`` (``"bfloat16"``: both of verl's exports cast floating shards to bf16) and
  ``megatron`` (``engine_kwargs``' Megatron settings as a dict, or None).
* ``init_process_group(topology=dict)`` keeps it as ``self.topology`` (a :class:`Topology`) and
  ``self.init_info`` (:meth:`Topology.init_info`: the group's fields of ``tritonreshard.vllm.init_info``
  for the rollout side's vLLM workers). Nothing joins there: the group meets inside the first sync
  (the actors' ``send_weights`` beside the rollout's ``receive_weights``) and lives until the process
  ends. verl calls the three before every sync; a changed topology is refused.

``send_weights(engine, global_steps)``: at the first sync, each rank's export becomes source
:class:`~tritonreshard.Layout` s and the rank joins as a :class:`~tritonreshard.RefitTrainer`; every
sync then waits for the readers of the last version (``fence``), writes the export into the arena
and publishes version ``global_steps + 1`` (verl's first sync is step 0, or the step it resumed at;
the rollout side installs the same version), refusing a step that does not follow the last one
before anything moves. Shards that can be the arena itself are bound to it at the first sync, and
later syncs copy nothing (:func:`export_source`). The store listens beyond loopback across hosts:
set ``TRITONRESHARD_GROUP_SECRET`` (64 hex digits) in every worker's environment.

verl hands the engine only to its ``delta_sharded`` backend (``workers/engine_workers.py:759``), so
:func:`wrap_update_weights` wraps ``ActorRolloutRefWorker.update_weights`` for this backend alone;
upstream, ``or getattr(self.checkpoint_engine, "consumes_engine", False)`` on that line makes the
wrap unnecessary, and the wrap then installs nothing.
"""
from __future__ import annotations

import atexit
import functools
import inspect
import socket
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
import verl
from verl.checkpoint_engine.base import CheckpointEngine, CheckpointEngineRegistry
from verl.workers import engine_workers

from ... import Layout, Meeting, RefitTrainer, Replicate, Timeouts
from ...engine.fsdp import FSDP2Source
from ...recipes import Megatron, megatron_bind, megatron_tensors, megatron_to_vllm
# The rollout side's module imports neither vLLM nor verl's rollout at its top (its worker extension
# is built on first use): one rule for the version of a step, written there.
from .rollout import receive_weights, version_for

__all__ = ["TritonreshardCheckpointEngine", "VerlRefitConfig", "Topology", "ShardSource", "export_source",
           "settings_problems", "wrap_update_weights", "install", "BACKEND", "GROUP", "KNOWN_VERL", "KNOWN_SIGNATURE"]

#: The backend's name in verl's registry (``rollout.checkpoint_engine.backend``).
BACKEND = "tritonreshard"
#: The refit group's name in its store.
GROUP = "verl"
#: The verl release and ``update_weights`` signature the wrap was written against.
KNOWN_VERL = "0.9.1"
KNOWN_SIGNATURE = "(self, global_steps: int = None, mode: str = 'auto')"
#: What both of verl's shard exports yield for floating parameters (they cast to bf16).
SRC_DTYPE = torch.bfloat16
_MARK = "__tritonreshard_wrapped__"


@dataclass(frozen=True)
class VerlRefitConfig:
    """``rollout.checkpoint_engine.engine_kwargs.tritonreshard`` (verl passes the same to the actor
    and the rollout side). ``store_host`` / ``store_port``: where actor rank 0 hosts the group's
    store (None: this node's address as Ray reports it, 127.0.0.1 outside Ray; 0: a free port).
    ``timeout`` / ``peer_timeout``: seconds, as :class:`~tritonreshard.Timeouts`' ``wait`` / ``peer``.
    ``megatron``: for a Megatron actor, its settings as ``trs.recipes.Megatron`` fields (``tp``,
    ``pp``, ``ep``, ``etp``, ``vocab_divisible_by``, ``vpp``): the vLLM workers need them before the
    first sync to build the Megatron recipe, and the actor checks them against its engine."""

    store_host: str | None = None
    store_port: int = 0
    timeout: float = 300.0
    peer_timeout: float = 30.0
    megatron: dict | None = None

    @classmethod
    def from_kwargs(cls, **kwargs) -> "VerlRefitConfig":
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
    hands each worker's ``init_process_group``, as a dict (:meth:`as_dict`) through Ray."""

    rank: int
    store: str
    trainer_ranks: tuple[int, ...]
    inference_ranks: tuple[int, ...]
    group: str = GROUP
    src_dtype: str = "bfloat16"
    megatron: dict | None = None

    def __post_init__(self):
        object.__setattr__(self, "trainer_ranks", tuple(self.trainer_ranks))
        object.__setattr__(self, "inference_ranks", tuple(self.inference_ranks))

    def as_dict(self) -> dict:
        return asdict(self)

    def init_info(self) -> dict:
        """The group's fields of ``tritonreshard.vllm.init_info`` (plain JSON types) that a vLLM
        worker joins with; the rollout side adds its replica."""
        info = {"store": self.store, "trainer_ranks": list(self.trainer_ranks),
                "inference_ranks": list(self.inference_ranks), "group": self.group, "src_dtype": self.src_dtype}
        if self.megatron is not None:
            info["megatron"] = dict(self.megatron)
        return info

    @property
    def world_size(self) -> int:
        return len(self.trainer_ranks) + len(self.inference_ranks)


@dataclass(frozen=True)
class ShardSource:
    """One actor rank's export as a refit source: ``layouts`` ``{name: Layout}`` over the trainer
    ranks, ``tensors`` ``{name: local shard}`` (views of what the export yielded, shaped
    ``layouts[name].local_shape(rank)``), ``exported`` ``{name in the export: name here}``, and how
    the shards can be the arena itself: ``fsdp2`` (a ``tritonreshard.engine.fsdp.FSDP2Source`` of
    the engine's module) or ``megatron`` (the ``trs.recipes.Megatron`` to ``megatron_bind`` with),
    both None when every sync must copy."""

    layouts: dict
    tensors: dict
    exported: dict
    fsdp2: Any = None
    megatron: Any = None


# ------------------------------------------------------------------------- export -> layouts
def _spec_problem(name: str, spec) -> str | None:
    """Why a ShardSpec carries no geometry this planner can serve (None when it does)."""
    if getattr(spec, "place", None) is not None:
        return (f"{name!r}: its ShardSpec places the shard explicitly (place={spec.place!r}), which is not a "
                f"DTensor layout")
    if getattr(spec, "to_hf_chunk", None) is not None or getattr(spec, "hf_slots", None) is not None:
        return f"{name!r}: its ShardSpec converts to other HF tensors (to_hf_chunk / hf_slots)"
    if spec.mesh is None and getattr(spec, "gather_group", None) is not None:
        return f"{name!r}: its ShardSpec has a gather_group but no mesh (its geometry is not in the spec)"
    return None


def _dtensor_layout(name: str, local: torch.Tensor, spec, trainer_ranks, problems: list[str]) -> Layout | None:
    """The layout a DTensor engine's ShardSpec describes, its mesh's torch ranks mapped onto
    ``trainer_ranks`` (actor rank ``r`` is refit rank ``trainer_ranks[r]``)."""
    why = _spec_problem(name, spec)
    if why is not None:
        problems.append(why)
        return None
    if spec.mesh is None:  # verl: "the local tensor already is the whole parameter"
        mesh, placements = list(trainer_ranks), [Replicate()]
    else:
        flat = spec.mesh.mesh.reshape(-1).tolist()
        if any(not 0 <= r < len(trainer_ranks) for r in flat):
            problems.append(f"{name!r}: its mesh ranks {flat} are not actor ranks 0..{len(trainer_ranks) - 1}")
            return None
        mesh = torch.tensor([trainer_ranks[r] for r in flat]).reshape(spec.mesh.mesh.shape).tolist()
        placements = list(spec.placements)
    try:  # narrow: the Layout's own checks name unsupported placements (_StridedShard, Partial)
        return Layout(tuple(spec.full_shape), mesh, placements, local.dtype)
    except ValueError as exc:
        problems.append(f"{name!r}: {exc}".replace("\n", " "))
        return None


def _megatron_setting(engine, megatron: dict | None, problems: list[str]) -> Megatron | None:
    """The configured Megatron settings, checked against the engine's own parallel sizes."""
    cfg = engine.engine_config
    have = dict(tp=cfg.tensor_model_parallel_size, pp=cfg.pipeline_model_parallel_size,
                ep=cfg.expert_model_parallel_size, etp=cfg.expert_tensor_parallel_size,
                vpp=cfg.virtual_pipeline_model_parallel_size or 1)
    if megatron is None:
        problems.append(f"a Megatron actor needs engine_kwargs.tritonreshard.megatron (the vLLM workers build "
                        f"the Megatron recipe from it before the first sync), e.g. megatron={have}")
        return None
    meg = Megatron(**megatron)
    mine = dict(tp=meg.tp, pp=meg.pp, ep=meg.ep, etp=meg.expert_tp, vpp=meg.vpp)
    have["etp"] = have["etp"] or have["tp"]  # None is "the tensor-parallel size" on both sides
    bad = [f"{k}={mine[k]} but the engine has {v}" for k, v in have.items() if mine[k] != v]
    if bad:
        problems.append("engine_kwargs.tritonreshard.megatron disagrees with the engine's config: " + ", ".join(bad))
    return meg


def _megatron_layouts(engine, meg: Megatron, trainer_ranks, rank: int, records, problems):
    """Megatron's ShardSpecs carry no geometry (verl's probe owns it), so the layouts are our
    Megatron recipe's. A record's name is its storage's in ``megatron_tensors`` (the local shard
    is a view of the parameter when it is bf16), else its own if the recipe has it."""
    spec = megatron_to_vllm(engine.model_config.hf_config, megatron=meg, tp=1, trainer_ranks=list(trainer_ranks),
                            inference_ranks=[max(trainer_ranks) + 1], src_dtype=SRC_DTYPE)
    ours = megatron_tensors(engine.module, megatron=meg, rank=trainer_ranks.index(rank))
    by_storage = {(t.data_ptr(), t.numel()): n for n, t in ours.items()}
    named, shards = {}, {}
    for name, local, sspec in records:
        if local.numel() == 0 and not getattr(sspec, "contributes", True):
            continue  # a parameter of another pipeline stage: verl's lockstep placeholder
        mine = by_storage.get((local.data_ptr(), local.numel())) or (name if name in spec.src else None)
        if mine is None:
            problems.append(f"{name!r} is neither a parameter of this rank's chunks nor a name of the Megatron "
                            f"recipe (Transformer-Engine names, global layer numbers and expert ids)")
            continue
        named[name], shards[mine] = mine, local
    layouts = {n: spec.src[n] for n in shards}
    bindable = set(shards) == set(ours) and all(
        (s.data_ptr(), s.numel()) == (ours[n].data_ptr(), ours[n].numel()) for n, s in shards.items()) and all(
        t.untyped_storage().nbytes() == t.numel() * t.element_size() for t in ours.values())
    return layouts, shards, named, bindable


def _fsdp2_binding(engine, source_tensors: dict, layouts: dict, trainer_ranks) -> FSDP2Source | None:
    """The engine's FSDP2 module as a source whose shards become the arena, when the export is
    exactly its parameters' local shards (same names, storage, dtype and layout; verl's export
    casts fp32 parameters to fresh bf16 tensors, which can't be)."""
    module = getattr(engine, "module", None)
    if not isinstance(module, torch.nn.Module) or getattr(engine, "_is_offload_param", False):
        return None
    try:  # narrow: a module that is not wholly fully_shard-managed is simply not bindable
        fs = FSDP2Source(module, rank_map=dict(enumerate(trainer_ranks)))
    except ValueError:
        return None
    same = set(fs) == set(source_tensors) and all(
        fs[n].data_ptr() == t.data_ptr() and fs[n].dtype == t.dtype and fs.layouts[n] == layouts[n]
        for n, t in source_tensors.items())
    return fs if same else None


def export_source(engine, *, trainer_ranks, rank: int, megatron: dict | None = None) -> ShardSource:
    """One pass of ``engine.get_per_tensor_param_shard()`` as this rank's refit source.

    DTensor engines (FSDP2, veomni, torchtitan): each ``ShardSpec``'s ``(full_shape, mesh,
    placements)`` is the layout (``mesh=None``: every trainer rank holds it whole). Megatron
    (``engine.engine_config.strategy == "megatron"``): the layouts of ``trs.recipes.megatron_to_vllm``
    for ``megatron`` (its settings). ``rank``: this rank's refit rank, one of ``trainer_ranks``.

    Zero-copy where the shards can be the arena: an FSDP2 engine whose export is its parameters'
    own local shards (bf16 parameters, no offload), or a Megatron one whose bf16 parameters each own
    their storage (no distributed optimizer's buffer, no offload). Raises one ``ValueError`` naming
    every parameter that can't be served (explicit placements, strided shards, a dtype that is not
    bf16, a shard whose size is not its layout's), before anything joins. The first pass holds the
    whole local export at once (fp32 parameters: one bf16 copy of this rank's shards, once)."""
    trainer_ranks = [int(r) for r in trainer_ranks]
    gen, _ = engine.get_per_tensor_param_shard()
    records = list(gen)
    problems: list[str] = []
    mega = getattr(getattr(engine, "engine_config", None), "strategy", None) == "megatron"
    meg = _megatron_setting(engine, megatron, problems) if mega else None
    if mega and meg is not None:
        layouts, flat, exported, bindable = _megatron_layouts(engine, meg, trainer_ranks, rank, records, problems)
    else:
        layouts, flat, exported, bindable = {}, {}, {}, False
        for name, local, spec in ([] if mega else records):
            lay = _dtensor_layout(name, local, spec, trainer_ranks, problems)
            if lay is not None:
                layouts[name], flat[name], exported[name] = lay, local, name
    tensors = {}
    for name, local in flat.items():
        lay = layouts[name]
        if local.dtype != SRC_DTYPE:
            problems.append(f"{name!r}: the export yielded {local.dtype}; verl's exports give {SRC_DTYPE}")
        elif local.numel() != lay.local_numel(rank):
            problems.append(f"{name!r}: the local shard has {local.numel()} elements, its layout {lay} places "
                            f"{lay.local_shape(rank)} on refit rank {rank}")
        else:
            tensors[name] = local.view(lay.local_shape(rank)) if local.is_contiguous() else local.reshape(
                lay.local_shape(rank))
    if not records:
        problems.append("get_per_tensor_param_shard() yielded no parameter")
    if problems:
        raise ValueError(f"tritonreshard verl backend (refit rank {rank}): " + "; ".join(problems))
    fsdp2 = None if mega else _fsdp2_binding(engine, tensors, layouts, trainer_ranks)
    # Offloading moves param.data off the arena between syncs: such parameters are copied each sync.
    bindable = bindable and not getattr(engine, "_is_offload_param", False)
    return ShardSource(layouts, tensors, exported, fsdp2=fsdp2, megatron=meg if bindable else None)


# ------------------------------------------------------------------------------------ backend
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
        return {"side": "actor", "rank": rank, "store": self._store if self.is_master else None,
                "megatron": self.config.megatron}

    @classmethod
    def build_topology(cls, actor_wg_world_size: int, rollout_world_size: int, metadata: list[dict]):
        """Every actor rank a trainer, every rollout worker an inference rank (module docstring).
        ``metadata``: the actors' ``prepare()`` then the rollout workers', as verl gathers them."""
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
        if problems:
            raise ValueError("tritonreshard verl backend build_topology: " + "; ".join(problems))
        meg = metadata[0].get("megatron")
        trainers, readers = tuple(range(n)), tuple(range(n, n + m))
        topo = [Topology(r, store, trainers, readers, megatron=meg).as_dict() for r in range(n + m)]
        return {"topology": topo[:n]}, {"topology": topo[n:]}

    def init_process_group(self, topology: dict):
        """Keep this worker's :class:`Topology`. A group already joined must see the same one
        (tritonreshard's group here is not elastic: replicas added or removed are refused)."""
        topo = Topology(**topology)
        if self.trainer is not None and topo != self.topology:
            raise ValueError(f"tritonreshard verl backend: the topology changed after the refit group formed "
                             f"({self.topology} -> {topo}); add or remove rollout replicas by restarting the job")
        self.topology = topo
        self.init_info = topo.init_info()

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
        version = self.trainer.publish()
        self.stats = {"tritonreshard/version": version, "tritonreshard/copied_bytes": copied,
                      "tritonreshard/send_s": time.perf_counter() - start}
        if global_steps is not None:  # verl's trackers log numbers; a sync without steps has none
            self.stats["tritonreshard/global_steps"] = global_steps
        return dict(self.stats)

    def _join(self, engine, start_version: int) -> int:
        """First sync: the export's layouts, then join the group as a trainer whose next version is
        ``start_version + 1``. Returns bytes copied into the arena (the whole local export, once)."""
        topo = self.topology
        src = export_source(engine, trainer_ranks=topo.trainer_ranks, rank=topo.rank, megatron=self.config.megatron)
        meeting = Meeting(rank=topo.rank, world_size=topo.world_size, store=topo.store, group=topo.group)
        timeouts = Timeouts(wait=self.config.timeout, peer=self.config.peer_timeout)
        tensors = src.fsdp2 if src.fsdp2 is not None else src.tensors
        self.trainer = RefitTrainer(tensors, src.layouts, meeting, timeouts=timeouts, start_version=start_version)
        atexit.register(self.close)
        if src.megatron is not None:  # the parameters train the arena from now on
            megatron_bind(engine.module, self.trainer.source_tensors, megatron=src.megatron,
                          rank=topo.trainer_ranks.index(topo.rank))
        self.source = src
        return sum(t.numel() * t.element_size() for t in src.tensors.values())

    def _write(self, engine) -> int:
        """Later syncs: once the readers finished the last version, each exported shard into its
        arena slot, skipped where the export already is that slot. A shard that no longer fits its
        slot aborts the group (its arena is part-written: no reader may take it for a version)."""
        self.trainer.fence()
        arena, exported, copied = self.trainer.source_tensors, self.source.exported, 0
        gen, _ = engine.get_per_tensor_param_shard()
        seen = set()
        for name, local, _spec in gen:
            mine = exported.get(name)
            if mine is None and local.numel() == 0:
                continue  # another pipeline stage's placeholder, as at the first sync
            slot = arena.get(mine)
            if slot is None or local.numel() != slot.numel() or local.dtype != slot.dtype:
                self._abort(f"{name!r} is not in the first sync's export or changed shape or dtype "
                                 f"({tuple(local.shape)} {local.dtype})")
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
        text = p.name
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


def install() -> bool:
    """Wrap verl's ``ActorRolloutRefWorker.update_weights`` (see :func:`wrap_update_weights`)."""
    return wrap_update_weights(engine_workers.ActorRolloutRefWorker, verl.__version__)
