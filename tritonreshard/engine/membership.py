"""Who is in a refit group, chosen once per endpoint: :class:`Fixed` (every rank meets in every
epoch) or :class:`Elastic` (the trainers meet alone; inference replicas join, leave or die while
they run: :mod:`~tritonreshard.engine.elastic`).

Both subclass :class:`Membership` and answer its questions, asked by the endpoint and its trainer
side and never by testing a flag or a type: which problems its arguments have, how many ranks meet,
which epoch to meet in (first and after the trainers restarted), which set-up script runs, which
publisher a trainer runs and whether its arena stays open to newcomers. ``sides``: the roles of the
asking rank, a subset of ``{"trainer", "inference"}``.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

from .elastic import MAX_RANKS, ElasticPublisher, JoinerEpoch, TrainerEpoch, current_epoch
from .epoch import Epoch
from .group import Group
from .publisher import Publisher

__all__ = ["Elastic", "Fixed", "Membership"]


class Membership(ABC):
    """Who is in a refit group: the questions an endpoint asks its membership (every rank of a
    group passes the same kind). Subclasses are frozen dataclasses (they travel and compare)."""

    @abstractmethod
    def problems(self, sides: frozenset) -> list[str]:
        """What makes these arguments impossible for a rank with ``sides`` (empty when none)."""

    @abstractmethod
    def world_size(self, given, sides: frozenset):
        """How many ranks meet (``given``: the meeting's ``world_size``, maybe None)."""

    @abstractmethod
    def first_epoch(self, base_store, name: str, epoch: int | None, timeout: float, sides: frozenset) -> int:
        """The epoch a new endpoint meets in (``epoch``: the meeting's, maybe None)."""

    @abstractmethod
    def next_epoch(self, base_store, name: str, current: int, timeout: float) -> int:
        """The epoch ``rejoin()`` meets in by default."""

    @abstractmethod
    def make_epoch(self, group: Group, *, trainer, inference, device, name: str) -> Epoch:
        """The set-up script of one epoch of this rank."""

    @abstractmethod
    def publisher(self, group: Group, route, arena, *, sender=None) -> Publisher:
        """A trainer's publisher for one epoch."""

    @property
    @abstractmethod
    def open_arena(self) -> bool:
        """Whether a trainer's arena stays open to ranks that map it later (else it is unlinked
        once every reader of the epoch mapped it)."""


@dataclass(frozen=True)
class Fixed(Membership):
    """Every rank of the group (trainers and inference ranks, ``world_size`` of them) meets in each
    epoch; a rank that dies ends the epoch, and the survivors meet again in the next."""

    def problems(self, sides: frozenset) -> list[str]:
        return []

    def world_size(self, given, sides: frozenset):
        return given

    def first_epoch(self, base_store, name: str, epoch: int | None, timeout: float, sides: frozenset) -> int:
        return 0 if epoch is None else epoch

    def next_epoch(self, base_store, name: str, current: int, timeout: float) -> int:
        """The epoch ``rejoin()`` meets in by default: the next one."""
        return current + 1

    def make_epoch(self, group: Group, *, trainer, inference, device, name: str) -> Epoch:
        return Epoch(group, trainer=trainer, inference=inference, device=device)

    def publisher(self, group: Group, route, arena, *, sender=None) -> Publisher:
        return Publisher(group, route, arena, sender=sender)

    open_arena = False  # every reader of the epoch is known at set-up


@dataclass(frozen=True)
class Elastic(Membership):
    """An elastic group (every rank passes one): the trainers meet alone (their ``world_size`` is
    the trainer ranks) and admit inference replicas as they join. An inference rank gives
    ``replica``, its replica's index (an int >= 0, unique among the replicas in); its layouts name
    its replica's ranks (ranks no trainer uses, below ``MAX_RANKS``); its ``world_size`` is not
    used, and ``epoch=None`` joins the trainers' current epoch. Trainers leave ``replica`` None."""

    replica: int | None = None

    def __post_init__(self):
        r = self.replica
        if r is not None and (isinstance(r, bool) or not isinstance(r, int) or r < 0):
            raise ValueError(f"Elastic: replica must be an int >= 0 (this replica's index) or None (a trainer), "
                             f"got replica={r!r}")

    def problems(self, sides: frozenset) -> list[str]:
        if sides == {"trainer", "inference"}:
            return ["an elastic group's ranks are trainers or inference ranks, not both (no colocated rank)"]
        if "inference" in sides and self.replica is None:
            return ["an elastic inference rank needs its replica's index: membership=trs.Elastic(replica=i) "
                    "(an int >= 0)"]
        if "trainer" in sides and self.replica is not None:
            return [f"replica= is for an elastic group's inference ranks, not its trainers, got "
                    f"replica={self.replica!r}"]
        return []

    def world_size(self, given, sides: frozenset):
        # A joiner has no group size: the trainers' control blocks bound its rank.
        return MAX_RANKS if "trainer" not in sides else given

    def first_epoch(self, base_store, name: str, epoch: int | None, timeout: float, sides: frozenset) -> int:
        if epoch is None and "trainer" not in sides:  # the trainers' current epoch, once they met
            return current_epoch(base_store, name, timeout)
        return 0 if epoch is None else epoch

    def next_epoch(self, base_store, name: str, current: int, timeout: float) -> int:
        """The restarted trainers' epoch, once they met."""
        return current_epoch(base_store, name, timeout, after=current)

    def make_epoch(self, group: Group, *, trainer, inference, device, name: str) -> Epoch:
        if trainer is not None:
            return TrainerEpoch(group, trainer=trainer, device=device)
        return JoinerEpoch(group, inference=inference, device=device, replica=self.replica, name=name)

    def publisher(self, group: Group, route, arena, *, sender=None) -> Publisher:
        return ElasticPublisher(group, route, arena, sender=sender)

    open_arena = True  # readers join for the epoch's life: the arena is handed out until it ends

