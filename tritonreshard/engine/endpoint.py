"""Refit endpoints: trainer ranks publish versions, inference ranks pull them, across processes.

Who calls what::

    # every trainer process (source rank)
    tr = trs.RefitTrainer(tensors, layouts, trs.Meeting(rank=r, world_size=W, store="127.0.0.1:29600"))
    for step in ...:
        tr.fence()            # readers of this rank's arena finished the last version
        optimizer.step()      # on tr.tensors (arena-backed: no copy per step)
        tr.publish()

    # every inference process (destination rank)
    inf = trs.RefitInference(layouts, trs.Meeting(rank=r, world_size=W, store="127.0.0.1:29600"))
    inf.pull()                # or start_pull() ... pull_done() ... swap() in shadow mode
    weights = inf.tensors     # re-read after every swap

A constructor takes its side's data (a colocated :class:`RefitEndpoint`: ``source=trs.SourceData``
and ``destination=trs.DestinationData``), where the rank meets (``trs.Meeting``) and one typed
config per concern, each made (and validated) once and handed in whole: ``membership``
(``trs.Fixed()`` or ``trs.Elastic(replica=)``), ``codec`` (``trs.Delta()`` or ``trs.Dense()``),
``timeouts`` (``trs.Timeouts``) and, on the inference side, ``pull`` (``trs.PullOptions``). Each
role's constructor takes only its side's arguments: any other keyword is a ``TypeError``.

An endpoint is a composition, data flowing one way:

* :class:`~tritonreshard.engine.epoch.Epoch` (one per epoch): the set-up script over a
  :class:`~tritonreshard.engine.group.Group` (membership, liveness, the one wait): validation of
  the whole group (a bad rank makes *every* rank raise the same ``ValueError`` before any data
  moves), the rank's plan and :class:`~tritonreshard.planning.Route` (what it reads, sends, relays
  and fences; one host is a route with no transfers);
* a :class:`~tritonreshard.engine.sides.TrainerSide` (arena, publisher, cross-host sender) and/or an
  :class:`~tritonreshard.engine.sides.InferenceSide` (serving buffers, sources, subscriber,
  receiving relay).

:class:`RefitTrainer` has the trainer side's methods, :class:`RefitInference` the inference side's,
:class:`RefitEndpoint` (colocated ranks) both; all three share the group's (``members``, ``epoch``,
``alive``, ``dead_peers``, ``store``, ``stats``, ``close``).

Every refit: the trainer bumps its published version. An inference rank waits until all of its
sources published the same version, runs its descriptor table (one gather-kernel launch per dtype
group on CUDA, torch copies on CPU), checks that no source moved on or died meanwhile, and acks the
version to each source. The trainer's ``fence`` waits for those acks, and only for the ranks that
read its arena.

Failures are scoped (see also the README): a pull or fence that times out or is abandoned fails
that call only; a dead peer ends the group's epoch (:class:`~tritonreshard.PeerDiedError`); an
inference rank keeps serving its last complete version and joins the trainers' next epoch with
``rejoin()``.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, replace

import torch

from ..errors import RefitError
from ..kernels import CopyBackend
from ..recipes import RecipeSpec
from .checks import DestinationData, SourceData, argument_problems, default_rank, fsdp_source, local_inputs, short
from .config import Meeting, Options, options
from .elastic import JoinStats
from .epoch import Epoch
from .group import Group, check_timeout, connect, host_identity, machine_identity
from .members import Member
from .modes import BufferMode
from .sides import InferenceSide, TrainerSide
from .subscriber import PullStats, Subscriber

__all__ = ["RefitEndpoint", "RefitTrainer", "RefitInference", "RefitStats", "PullStats"]


@dataclass(frozen=True)
class RefitStats:
    """What an endpoint measured and holds, as of now (``ep.stats``).

    ``pulls``: successful pulls; ``bytes_per_refit``: destination bytes this rank writes per refit;
    ``num_descriptors``: rows of its descriptor table; ``num_copies``: work items per pull (kernel
    launches on the triton backend, coalesced ``copy_`` calls on torch); ``handles_opened``: peer
    buffers mapped (one per peer, never one per tensor); ``staging_bytes``: the most extra memory
    one pull allocated, as measured, plus the cross-host receive and packing buffers and a sender's
    snapshot of what it last sent (cross-host deltas);
    ``cross_host_bytes``: bytes this rank received from other hosts in the refit of the version it
    serves (``version``: its receive buffer may already hold a newer one; summed over the ranks: the
    bytes per refit that crossed between hosts); ``setup_transfers``: cross-host
    transfers this rank fetched at set-up (the ones it sends: never another rank's).
    ``cross_host_delta_bytes`` / ``cross_host_dense_bytes``: of ``cross_host_bytes``, the bytes that
    came as deltas / as whole messages; ``cross_host_changed``: the fraction of the elements compared
    with the receive buffer's base that changed (None when that refit came whole);
    ``cross_host_encode_s``: a trainer's last cross-host send, seconds spent comparing with its
    snapshot and encoding the deltas.
    """

    pulls: int = 0
    bytes_per_refit: int = 0
    num_descriptors: int = 0
    num_copies: int = 0
    handles_opened: int = 0
    staging_bytes: int = 0
    cross_host_bytes: int = 0
    setup_transfers: int = 0
    cross_host_delta_bytes: int = 0
    cross_host_dense_bytes: int = 0
    cross_host_changed: float | None = None
    cross_host_encode_s: float = 0.0


class _Rank:
    """What every refit rank has, whatever its role: construction and set-up of its group epoch,
    the group's properties, statistics and lifetime. Roles add their side's methods
    (:class:`_TrainerMethods`, :class:`_InferenceMethods`); their constructors say which arguments
    each side takes.

    Where it meets (every role): ``meeting``, a ``trs.Meeting(rank=, world_size=, store=,
    host_store=, group=, epoch=)`` (see :class:`~tritonreshard.engine.config.Meeting`; default
    ``trs.Meeting()``: the launcher's rank, world size and store, as torchrun sets them).

    Its configs (every role; each validated where it is made):
        membership: ``trs.Fixed()`` (default) or ``trs.Elastic(replica=)`` (see
            :mod:`~tritonreshard.engine.membership`; every rank passes the same kind).
        codec: cross-host transfers only: ``trs.Delta()`` (default: each host gets only the elements
            that changed since the version its receive buffer holds, when that is smaller and
            finding them costs less than sending whole, as each sender measures its link and its
            detection; bits compared, exact; a whole transfer every ``anchor`` versions) or
            ``trs.Dense()`` (every byte every refit). Every rank passes the same (see docs/hosts.md).
        timeouts: ``trs.Timeouts(wait=60, peer=10)``: set-up and each wait; a silent peer's death.
        pull (inference side): ``trs.PullOptions(mode=, backend=, device=, sources=)``.
    """

    def __init__(self, src: SourceData | None, dst: DestinationData | None, opts: Options):
        self._released = True  # until set-up succeeded far enough to need closing (see close())
        sides = frozenset(n for n, side in (("trainer", src), ("inference", dst)) if side is not None)
        where, membership = opts.meeting, opts.membership
        rank, world_size = default_rank(where.rank, membership.world_size(where.world_size, sides))
        src, fsdp2 = fsdp_source(src)
        bad = argument_problems(rank, world_size, src, dst) + membership.problems(sides)
        if bad:  # nothing to tell the group: these make joining it impossible
            raise ValueError(f"{type(self).__name__}: " + "; ".join(bad))
        self.rank, self.world_size = rank, world_size
        local = local_inputs(rank, src, dst, opts.pull.device)
        self.device = local.dst_device if dst is not None else (
            next(iter(local.src.values())).device if local.src else torch.device("cpu"))
        # The copy backend is resolved once, here, where the device is known ("auto": by the device).
        self._opts = replace(opts, pull=opts.pull.for_device(self.device))
        self._member = Member(rank, os.getpid(), host_identity(), str(self.device),
                              dict(src.layouts) if src is not None else None,
                              dict(dst.layouts) if dst is not None else None, tuple(local.problems),
                              local.parts, dst_quant=local.quant, codec=opts.codec,
                              machine=machine_identity(), start_version=src.start_version if src is not None else 0)
        self._base_store, self._hosts_store = connect(where.store, rank=rank, world_size=world_size,
                                                      timeout=self.timeout, host_store=where.host_store)
        self._trainer = TrainerSide(local.src, params=local.params, start_version=src.start_version, fsdp2=fsdp2,
                                    codec=opts.codec, membership=membership) if src is not None else None
        self._inference = InferenceSide(rank, local.dst, device=local.dst_device, pull=self._opts.pull,
                                        codec=opts.codec) if dst is not None else None
        epoch = membership.first_epoch(self._base_store, where.group, where.epoch, self.timeout, sides)
        self._epoch = self._make_epoch(self._new_group(epoch, self.timeout))
        # From here on every handle and resource is released by close(), also when set-up fails.
        self._released = False
        try:
            self._epoch.set_up(self._member)  # every rank raises the same ValueError for a bad group
        except BaseException:
            self.close(abort=True)
            raise

    def _make_epoch(self, group: Group) -> Epoch:
        return self._opts.membership.make_epoch(group, trainer=self._trainer, inference=self._inference,
                                                device=self.device, name=self._opts.meeting.group)

    def _new_group(self, epoch: int, timeout: float) -> Group:
        return Group(self._base_store, rank=self.rank, world_size=self.world_size, epoch=epoch,
                     name=self._opts.meeting.group, timeout=timeout, peer_timeout=self.peer_timeout,
                     hosts_store=self._hosts_store)

    # ------------------------------------------------------------------ its configs
    @property
    def timeout(self) -> float:
        """Seconds for set-up and each wait, the default of every call's ``timeout=`` (``timeouts.wait``)."""
        return float(self._opts.timeouts.wait)

    @property
    def peer_timeout(self) -> float:
        """Seconds of silence after which a peer on another host counts as dead (``timeouts.peer``)."""
        return float(self._opts.timeouts.peer)

    @property
    def mode(self) -> BufferMode:
        """The buffer mode (``pull.mode``: ``trs.Shadow()`` or ``trs.InPlace()``; ``str()``: its name)."""
        return self._opts.pull.mode

    @property
    def backend(self) -> CopyBackend:
        """The copy backend of this rank's pulls (``pull.backend``, resolved for ``device``)."""
        return self._opts.pull.backend

    # ------------------------------------------------------------------ the group
    @property
    def group(self) -> Group:
        """This epoch's :class:`~tritonreshard.engine.group.Group`."""
        return self._epoch.group

    @property
    def epoch(self) -> int:
        return self.group.epoch

    @property
    def store(self):
        """This epoch's namespace in the group's store (``trs/<group>/e<epoch>/``): for an
        application's own keys next to the engine's."""
        return self.group.store

    @property
    def members(self) -> dict[int, Member]:
        """``{rank: Member(rank, pid, host, device, ...)}`` of this epoch."""
        return dict(self.group.members)

    @property
    def plan(self):
        """The :class:`~tritonreshard.planning.Plan` this rank planned from this epoch (its own ops;
        on several hosts also its host's destination ranks')."""
        rp = self._epoch.rank_plan
        return rp.plan if rp is not None else None

    @property
    def route(self):
        """This rank's :class:`~tritonreshard.planning.Route` this epoch."""
        return self._epoch.route

    @property
    def host_plan(self):
        """This rank's view of the host plan (its host's local ops, fan-out and receives, and the
        transfers it sends; never the other hosts' transfers), None when the group is on one host."""
        route = self.route
        return route.host_plan if route is not None and route.spans_hosts else None

    def dead_peers(self) -> list[int]:
        """Ranks of this epoch known dead now, without waiting (see ``Group.dead_peers``)."""
        self._check_open("dead_peers")
        dead = self.group.dead_peers()
        if self.group.ended is not None and self.group.ended.rank not in dead:
            dead = sorted([*dead, self.group.ended.rank])
        return dead

    def alive(self) -> bool:
        """True while this epoch has no dead peer (a cheap check: no waiting, no side effects)."""
        return not self.dead_peers()

    @property
    def stats(self) -> RefitStats:
        """What this endpoint measured and holds now (see :class:`RefitStats`)."""
        inf = self._inference
        sub = inf.subscriber if inf is not None else None
        bufs = inf.buffers if inf is not None else None
        relay = inf.relay if inf is not None else None
        # The refit of the version this rank serves, not a newer one its receive buffer holds.
        delta, dense, changed = relay.received(bufs.version) if relay is not None else (0, 0, None)
        return RefitStats(
            pulls=bufs.pulls if bufs is not None else 0,
            bytes_per_refit=sub.bytes_per_refit if sub is not None else 0,
            num_descriptors=sub.num_descriptors if sub is not None else 0,
            num_copies=sub.num_copies if sub is not None else 0,
            handles_opened=sub.sources.handles_opened if sub is not None and sub.sources is not None else 0,
            staging_bytes=sum(side.staging_bytes for side in (self._trainer, inf) if side is not None),
            cross_host_bytes=delta + dense,
            setup_transfers=self._epoch.fetched_transfers,
            cross_host_delta_bytes=delta,
            cross_host_dense_bytes=dense,
            cross_host_changed=changed,
            cross_host_encode_s=self._trainer.sender.detect_s if self._trainer is not None
            and self._trainer.sender is not None else 0.0)

    # ------------------------------------------------------------------ lifetime
    def _check_open(self, what):
        if self._released:
            raise RuntimeError(f"{what}: this endpoint (rank {self.rank}) is closed")

    def close(self, abort: bool = False) -> None:
        """Release everything (arenas, mappings, control blocks, threads). Idempotent; safe after an
        exception or a peer's death. ``abort=True`` also sets the abort word in every control block
        this rank shares, so peers stop waiting for it at once (their epoch is over)."""
        if getattr(self, "_released", True):
            return
        self._released = True
        sides = [s for s in (self._inference, self._trainer) if s is not None]
        if abort:
            for side in sides:
                side.abort()
        self._epoch.close()
        for side in sides:
            side.close()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        self.close(abort=exc_type is not None)
        return False

    def __del__(self):
        if not getattr(self, "_released", True):
            self.close()

    def __repr__(self):
        roles = [r for r, side in (("trainer", getattr(self, "_trainer", None)),
                                   ("inference", getattr(self, "_inference", None))) if side is not None]
        return (f"<{type(self).__name__} rank {self.rank}/{self.world_size} epoch {self.group.epoch} "
                f"{'+'.join(roles) or '-'} {' '.join(self._state())} mode={self.mode} backend={self.backend}>")

    def _state(self) -> list[str]:
        """What ``repr`` shows of each role this class has (each role's methods add theirs)."""
        return []


class _TrainerMethods:
    """The trainer side's methods (a rank with a source side)."""

    @property
    def tensors(self) -> dict[str, torch.Tensor]:
        """The arena-backed local shards (train on these)."""
        self._check_open("tensors")
        return self.source_tensors

    @property
    def source_tensors(self) -> dict[str, torch.Tensor]:
        """The arena-backed local shards (also on a colocated rank, whose ``tensors`` are the
        serving weights)."""
        arena = self._trainer.arena if self._trainer is not None else None
        return dict(arena.tensors) if arena is not None else {}

    def _state(self) -> list[str]:
        return [*super()._state(), f"published={self.published}"]

    @property
    def published(self) -> int:
        """The last version published (``start_version`` before the first)."""
        pub = self._trainer.publisher if self._trainer is not None else None
        return pub.published if pub is not None else 0

    def _pub(self, what):
        self._check_open(what)
        pub = self._trainer.publisher if self._trainer is not None else None
        if pub is None:
            raise ValueError(f"{what}: rank {self.rank} has no source side (no source= was given)")
        return pub

    def publish(self) -> int:
        """After ``optimizer.step()``: publish the arena's contents as a new version. Returns the
        version. Call ``fence()`` before changing the weights again. ``ValueError`` (nothing
        published) if a parameter the trainer re-pointed at its arena was re-pointed elsewhere since."""
        pub = self._pub("publish")
        self._trainer.arena.check_bound()
        return pub.publish()

    def fence(self, timeout: float | None = None) -> None:
        """Before the next ``optimizer.step()``: wait until every rank that reads this rank's arena
        acked the last published version (see ``Publisher.fence``; in an elastic group the readers
        admitted now, never one that left or died)."""
        self._pub("fence").fence(timeout)

    @property
    def readers(self) -> dict[int, int]:
        """The ranks that read this rank's arena now. An elastic group's trainer: ``{rank: first
        version}`` of the readers it admitted (joiners come and go); else ``{rank: 1}`` of its route's."""
        return self._pub("readers").readers

    @property
    def dropped(self) -> list[tuple[int, str]]:
        """An elastic group's trainer: ``(rank, why)`` of every reader dropped this epoch (left or
        died); [] in other groups, where a dead reader fails the fence instead."""
        return self._pub("dropped").dropped


class _InferenceMethods:
    """The inference side's methods (a rank with a destination side)."""

    @property
    def tensors(self) -> dict[str, torch.Tensor]:
        """The serving weights (in shadow mode a new dict after each ``swap``; re-read it)."""
        self._check_open("tensors")
        return self._buffers.tensors if self._buffers is not None else {}

    @property
    def _buffers(self):
        return self._inference.buffers if self._inference is not None else None

    def _sub(self, what) -> Subscriber:
        self._check_open(what)
        if self._buffers is None:
            raise ValueError(f"{what}: rank {self.rank} has no destination side (no destination= was "
                             f"given, or its layouts place nothing on this rank)")
        if self._inference.subscriber is None:
            raise RefitError(f"{what}: rank {self.rank} reads from no group epoch now (its last epoch "
                             f"ended; call rejoin())")
        return self._inference.subscriber

    def _state(self) -> list[str]:
        return [*super()._state(), f"version={self.version}"]

    @property
    def version(self) -> int:
        """The version being served (0: none yet)."""
        return self._buffers.version if self._buffers is not None else 0

    @property
    def consistent(self) -> bool:
        """In-place mode: False after a pull that failed part-way (torn)."""
        return self._buffers.consistent if self._buffers is not None else True

    @property
    def join_stats(self) -> JoinStats | None:
        """How long this rank's last join (or rejoin) took, step by step, its ``steps`` wall and CPU
        ms each (:class:`~tritonreshard.engine.epoch.JoinStats`); None until set up."""
        return self._epoch.join_stats

    @property
    def last_pull(self) -> PullStats | None:
        """The last successful pull, measured (wait, copy, total ms, staging)."""
        return self._buffers.last_pull if self._buffers is not None else None

    def available_version(self) -> int:
        """The newest version every source of this rank has published."""
        return self._sub("available_version").available_version()

    def pull(self, version: int | None = None, timeout: float | None = None) -> int:
        """Wait for and install the next version (default: the newest available, at least one newer
        than the serving version). Returns the version now served.

        Shadow mode pulls into the spare buffer set and swaps; in-place mode writes the serving
        tensors (pause generation meanwhile). A failure fails this pull only (the group stays
        usable, ``pull(timeout=0)`` is a poll): shadow mode keeps serving the previous version,
        in-place mode sets ``consistent = False`` if the copy had started.
        """
        sub = self._sub("pull")
        return sub.pull(version, check_timeout("pull", timeout, self.timeout))

    def start_pull(self, version: int | None = None, timeout: float | None = None) -> int:
        """Shadow mode: start pulling ``version`` (default: the next) into the spare buffer set in a
        background thread, while generation goes on with the serving weights. Returns the version."""
        return self._sub("start_pull").start_pull(version, check_timeout("start_pull", timeout, self.timeout))

    def pull_done(self) -> bool:
        """Shadow mode: True when the background pull finished (successfully or not)."""
        sub = self._inference.subscriber if self._inference is not None else None
        return sub is not None and sub.pull_done()

    @property
    def pulling(self) -> bool:
        """Shadow mode: a background pull is in flight (or finished and not yet swapped)."""
        sub = self._inference.subscriber if self._inference is not None else None
        return sub is not None and sub.pulling

    def pull_error(self) -> BaseException | None:
        """Shadow mode, once ``pull_done()``: the background pull's error, or None if it succeeded.
        Lets a TP group agree (e.g. by an all-reduce) to swap together or not at all."""
        return self._sub("pull_error").pull_error()

    def discard(self) -> None:
        """Shadow mode: abandon the pull in flight or drop a finished one without installing it
        (the serving weights and ``version`` stay); fails that pull only."""
        sub = self._inference.subscriber if self._inference is not None else None
        if sub is not None:
            sub.discard(self.timeout)

    def swap(self, timeout: float | None = None) -> int:
        """Shadow mode: wait for the background pull and install it as the serving weights (one
        reference assignment). Re-raises the pull's error, leaving the serving weights untouched."""
        sub = self._sub("swap")
        return sub.swap(self.timeout * 2 if timeout is None else timeout)

    def rejoin(self, epoch: int | None = None, timeout: float | None = None) -> int:
        """After its trainers died, or a partition ended the epoch: join the group's next epoch
        (default ``self.epoch + 1``) formed by the restarted (or reconnected) trainers, without
        restarting this process.

        The serving weights and ``version`` stay as they are until a later pull; any pull in
        flight is discarded. Blocks until every rank of the new epoch met (``timeout``: the
        endpoint's). Returns the new epoch. On failure (e.g. a timeout) this rank reads from no
        epoch, keeps serving, and may call ``rejoin`` again. A trainer restarts as a new process
        with ``trs.Meeting(epoch=)`` instead.
        """
        self._check_open("rejoin")
        if self._trainer is not None or self._buffers is None:
            raise ValueError(f"rejoin: only an inference-only endpoint rejoins (rank {self.rank} has "
                             f"{'a trainer side' if self._trainer is not None else 'no inference side'}); "
                             f"a trainer restarts as a new process with trs.Meeting(epoch=)")
        if epoch is None:  # the next one (elastic: the restarted trainers', once they met)
            epoch = self._opts.membership.next_epoch(self._base_store, self._opts.meeting.group, self.group.epoch,
                                                     check_timeout("rejoin", timeout, self.timeout))
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch <= self.group.epoch:
            raise ValueError(f"rejoin: epoch must be an int > the current epoch {self.group.epoch}, "
                             f"got epoch={epoch!r}")
        timeout = check_timeout("rejoin", timeout, self.timeout)
        self._epoch.close()
        self._epoch = self._make_epoch(self._new_group(epoch, timeout))
        try:
            self._epoch.set_up(self._member)
        except BaseException:  # what the failed set-up opened goes; the serving buffers stay
            self._epoch.close()
            raise
        self.group.timeout = self.timeout
        return epoch


def _recipe_spec(spec, what: str):
    if not isinstance(spec, RecipeSpec):
        raise ValueError(f"{what}: spec must be a trs.recipes.RecipeSpec (from trs.recipes.hf_to_vllm), "
                         f"got spec={short(spec)}")
    return spec


class RefitEndpoint(_InferenceMethods, _TrainerMethods, _Rank):
    """One process of a refit group with a source side (trainer), a destination side (inference),
    or both (colocated meshes): every method of :class:`RefitTrainer` and :class:`RefitInference`.
    Use those for one role.

    ``source``: the trainer side's data, a ``trs.SourceData(tensors, layouts, start_version=)`` (as
    :class:`RefitTrainer` takes them). ``destination``: the inference side's, a
    ``trs.DestinationData(layouts, tensors=, parts=, quant=)`` (as :class:`RefitInference` takes
    them). Where it meets (``meeting``) and its configs: see :class:`_Rank`."""

    def __init__(self, meeting: Meeting = Meeting(), *, source: SourceData | None = None,
                 destination: DestinationData | None = None, membership=None, codec=None, timeouts=None, pull=None):
        found = [f"{name} must be a trs.{cls.__name__} or None, got {name}={short(value)}"
                 for name, value, cls in (("source", source, SourceData), ("destination", destination, DestinationData))
                 if value is not None and not isinstance(value, cls)]
        opts = options(type(self).__name__, meeting=meeting, membership=membership, codec=codec, timeouts=timeouts,
                       pull=pull, found=found)
        super().__init__(source, destination, opts)

    @property
    def tensors(self) -> dict[str, torch.Tensor]:
        """Destination side: the serving weights (in shadow mode a new dict after each ``swap``;
        re-read it). A trainer-only endpoint: the arena-backed local shards."""
        self._check_open("tensors")
        return self._buffers.tensors if self._buffers is not None else self.source_tensors


class RefitTrainer(_TrainerMethods, _Rank):
    """Trainer (source) side of a refit group: ``publish``, ``fence``, ``published``, ``tensors``.

    ``tensors``: this rank's local shards ``{name: tensor}`` or an ``nn.Module`` whose named
    parameters are the local shards (or a ``fully_shard`` FSDP2 model, which brings its layouts:
    ``layouts`` may then be None). They are copied into the exported arena once; a module's
    parameters, and a dict's ``nn.Parameter`` and ``requires_grad`` leaf values, are re-pointed at the
    arena (``param.data``), so an optimizer on them trains the arena with no copy per step. Other
    tensors stay where they were (train ``tensors``, the arena), unless ``adopt``: then a dict's
    plain tensors are re-pointed too (see ``trs.SourceData``). Shapes must equal ``layouts[name].
    local_shape(rank)``, dtypes match. ``layouts``: the trainer group's global layouts (same on every rank).
    ``start_version``: the version before the first ``publish()`` (a restarted trainer continues the
    numbering of its checkpoint). Where it meets (``meeting``, a ``trs.Meeting``) and its configs
    (``membership``, ``codec``, ``timeouts``): see :class:`_Rank`. A keyword of the inference side
    (``quant``, ``pull``, ...) is a ``TypeError``.
    """

    def __init__(self, tensors, layouts, meeting: Meeting = Meeting(), *, start_version: int = 0, membership=None,
                 codec=None, timeouts=None, adopt: bool = False):
        opts = options(type(self).__name__, meeting=meeting, membership=membership, codec=codec, timeouts=timeouts)
        super().__init__(SourceData(tensors, layouts, start_version, adopt), None, opts)

    @classmethod
    def from_recipe(cls, spec, tensors, **kwargs) -> RefitTrainer:
        """The trainer side of a recipe (``trs.recipes.hf_to_vllm``): ``tensors`` are this rank's
        shards of the HF parameters, ``{name: tensor}`` with ``spec.src[name].local_shape(rank)``
        (or the ``nn.Module`` holding them). Same as ``RefitTrainer(tensors, spec.src, **kwargs)``."""
        return cls(tensors, _recipe_spec(spec, "RefitTrainer.from_recipe").src, **kwargs)


class RefitInference(_InferenceMethods, _Rank):
    """Inference (destination) side of a refit group: ``pull`` (or ``start_pull`` ... ``swap``),
    ``version``, ``tensors``, ``rejoin``, ...

    ``layouts``: the inference group's global layouts ``{name: Layout}`` (same on every inference
    rank). ``tensors``: optional tensors to write (e.g. the engine's parameters): the serving buffer
    set in in-place mode, the first of the two sets in shadow mode. ``parts``: optional ``{dst name:
    [trs.Part, ...]}`` as for :func:`~tritonreshard.plan_reshard`: a destination built from other
    sources (HF q/k/v -> vLLM ``qkv_proj``) or padded with zeros (``Part(None, box)``, e.g. vocab rows
    past the real vocab), zeroed once when the buffers are set up, never per pull; every inference
    rank passes the same. ``quant``: optional ``{weight name: BlockQuant}`` of block-FP8 weights (a
    recipe's ``spec.quant``): each pull reads every 128x128 block whole and writes its FP8 values and
    scale in the same pass. Recipes give all three: :meth:`from_recipe`. ``pull``:
    ``trs.PullOptions(mode=, backend=, device=, sources=)``. Where it meets (``meeting``, a
    ``trs.Meeting``) and its other configs (``membership``, ``codec``, ``timeouts``): see
    :class:`_Rank`. A trainer-side keyword (``start_version``, ...) is a ``TypeError``.
    """

    def __init__(self, layouts, meeting: Meeting = Meeting(), *, tensors=None, parts=None, quant=None, membership=None,
                 codec=None, timeouts=None, pull=None):
        opts = options(type(self).__name__, meeting=meeting, membership=membership, codec=codec, timeouts=timeouts,
                       pull=pull)
        super().__init__(None, DestinationData(layouts, tensors, parts, quant), opts)

    @classmethod
    def from_recipe(cls, spec, **kwargs) -> RefitInference:
        """The inference side of a recipe (``trs.recipes.hf_to_vllm``): vLLM's parameters
        (``spec.dst``) built from the HF ones by ``spec.parts``. Same as
        ``RefitInference(spec.dst, parts=spec.parts, quant=spec.quant, **kwargs)``; ``tensors=`` may be
        the engine's parameters (``{vLLM name: tensor}``). With ``quantization="fp8-block"`` each pull
        writes the FP8 weights and their scales (``quant``: see :func:`~tritonreshard.planning.plan_quantized`)."""
        spec = _recipe_spec(spec, "RefitInference.from_recipe")
        return cls(spec.dst, parts=spec.parts, quant=spec.quant or None, **kwargs)
