"""The two sides of a refit rank: a trainer side and an inference side, each what its role owns.

* :class:`TrainerSide`: the arena (for the process's life), and per epoch its
  :class:`~tritonreshard.engine.publisher.Publisher` and, when its route sends to other hosts, its
  :class:`~tritonreshard.engine.sender.Sender`;
* :class:`InferenceSide`: the serving buffers (outliving epochs), and per epoch its receiving relay
  (:class:`~tritonreshard.engine.relay.ReceivingRelay`, when its route receives), its
  :class:`~tritonreshard.engine.sources.Sources` and its
  :class:`~tritonreshard.engine.subscriber.Subscriber`.

The set-up script (:class:`~tritonreshard.engine.epoch.Epoch`) calls each side's steps in order:
``prepare`` (rank plan) -> ``exported`` (exports) -> ``open_cross_host`` (relays) -> ``open`` ->
``start`` (done); ``close_epoch`` ends the epoch's parts, ``close`` the rest. A colocated rank has
both sides; they share nothing but the epoch's group and the buffers a subscriber reads in place.
"""
from __future__ import annotations

from ..planning import RankPlan, Route
from ..transport import Codec, Delta
from .config import PullOptions
from .epoch import StepClock
from .group import Group
from .membership import Fixed, Membership
from .publisher import Publisher, SourceArena
from .relay import ReceivingRelay
from .sender import Sender
from .subscriber import ServingBuffers, Subscriber

__all__ = ["InferenceSide", "TrainerSide"]


class TrainerSide:
    """A trainer rank's side. ``tensors``: its validated local shards; ``params``: parameters to
    re-point at the arena; ``fsdp2``: an FSDP2 source, see :class:`SourceArena`; ``codec``: how its
    cross-host sends travel (see :class:`Sender`); ``membership``: picks its publisher and whether its
    arena stays open to readers that join later."""

    def __init__(self, tensors: dict, *, params=None, start_version: int = 0, fsdp2=None, codec: Codec = Delta(),
                 membership: Membership = Fixed()):
        self._tensors, self._params, self._start, self._fsdp2 = tensors, params, start_version, fsdp2
        self._codec, self._membership = codec, membership
        self.arena: SourceArena | None = None
        self.publisher: Publisher | None = None
        self.sender: Sender | None = None

    def prepare(self, group: Group, rank_plan: RankPlan) -> None:
        """Rank plan step: the shards move into the arena once, in the group's buffer order."""
        self.make_arena(group, rank_plan.src_order)

    def make_arena(self, group: Group, order, readers: int | None = None) -> None:
        """The shards move into the arena once, in ``order``; ``readers``: see :class:`SourceArena`."""
        if self.arena is None and order:
            self.arena = SourceArena(group, order, self._tensors, params=self._params,
                                     start_version=self._start, fsdp2=self._fsdp2, readers=readers)
            self._tensors = self._params = None  # the arena holds them now

    @property
    def exported(self) -> tuple:
        return (self.arena.exported,) if self.arena is not None else ()

    def own_buffers(self) -> list:
        return [self.arena.own()] if self.arena is not None else []

    def open_cross_host(self, cross, route: Route) -> tuple:
        """Relays step: the sender, when this rank's route sends. Exports nothing."""
        if route.sends:
            self.sender = Sender(cross, route, arena=self.arena.flat, shard=self.arena.tensors, codec=self._codec)
        return ()

    def open(self, group: Group, route: Route, exported, *, own, clock=None) -> None:
        """The publisher (``clock``: the epoch's :class:`~.epoch.StepClock`, step ``open``)."""
        clock = clock if clock is not None else StepClock()
        if self.arena is not None:
            with clock("open"):
                self.publisher = self._membership.publisher(group, route, self.arena, sender=self.sender)

    def start(self) -> None:
        if self.arena is not None and not self._membership.open_arena:
            self.arena.unlink()
        if self.sender is not None:
            self.sender.start()

    @property
    def staging_bytes(self) -> int:
        return self.sender.staging_bytes if self.sender is not None else 0

    def abort(self) -> None:
        if self.arena is not None:
            self.arena.abort()

    def close_epoch(self) -> None:
        if self.sender is not None:
            self.sender.close()
            self.sender = None
        if self.publisher is not None:
            self.publisher.close()
        self.publisher = None

    def close(self) -> None:
        self.close_epoch()
        if self.arena is not None:
            self.arena.close()


class InferenceSide:
    """An inference rank's side. ``tensors``: given destination tensors (validated); ``device``: of
    its buffers; ``pull``: the endpoint's :class:`~tritonreshard.engine.config.PullOptions`, its
    backend resolved for ``device`` (its buffer mode, copy backend and :class:`Sources` class);
    ``codec``: its receiving relay's (see :class:`ReceivingRelay`)."""

    def __init__(self, rank: int, tensors: dict, *, device, pull: PullOptions, codec: Codec = Delta()):
        self.rank, self._tensors, self.device, self.pull = rank, tensors, device, pull
        self._codec = codec
        self.buffers: ServingBuffers | None = None
        self.relay: ReceivingRelay | None = None
        self.subscriber: Subscriber | None = None

    def prepare(self, group: Group, rank_plan: RankPlan) -> None:
        """Rank plan step: the serving buffers, once (they outlive epochs), in the buffer order."""
        self._quant = rank_plan.plan.quant
        if self.buffers is None and rank_plan.dst_order:
            self.buffers = ServingBuffers(self.rank, rank_plan.dst_layouts, rank_plan.dst_order,
                                          tensors=self._tensors, device=self.device, mode=self.pull.mode,
                                          fills=rank_plan.fills, layers=self.pull.layers)

    @property
    def exported(self) -> tuple:
        return ()

    def own_buffers(self) -> list:
        return [self.relay.own()] if self.relay is not None else []

    def open_cross_host(self, cross, route: Route) -> tuple:
        """Relays step: the receiving relay, when this rank's route receives; its buffer's handles."""
        if route.receives:
            self.relay = ReceivingRelay(cross, route, self.device, codec=self._codec)
            return self.relay.exported
        return ()

    def open(self, group: Group, route: Route, exported, *, own, clock=None) -> None:
        """Map what this rank reads and build its descriptor tables (``clock``: the epoch's
        :class:`~.epoch.StepClock`, steps ``map`` and ``tables``)."""
        if self.buffers is None:
            return
        clock = clock if clock is not None else StepClock()
        with clock("map"):
            sources = self.pull.sources(group, route, exported, own=own, device=self.device)
        try:
            with clock("tables"):
                self.subscriber = Subscriber(group, route, self.buffers, sources, backend=self.pull.backend,
                                             quant=self._quant)
        except BaseException:
            sources.close()
            raise

    def start(self) -> None:
        if self.relay is not None:
            self.relay.unlink()
            self.relay.start()

    @property
    def staging_bytes(self) -> int:
        return ((self.buffers.staging_bytes if self.buffers is not None else 0)
                + (self.relay.staging_bytes if self.relay is not None else 0))

    def abort(self) -> None:
        for part in (self.subscriber, self.relay):
            if part is not None:
                part.abort()

    def close_epoch(self) -> None:
        if self.subscriber is not None:
            self.subscriber.close()
            self.subscriber = None
        if self.relay is not None:
            self.relay.close()
            self.relay = None

    def close(self) -> None:
        self.close_epoch()
        if self.buffers is not None:
            self.buffers.release()
