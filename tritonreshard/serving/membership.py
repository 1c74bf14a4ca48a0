"""Fixed or elastic: how a serving engine's TP ranks belong to the refit group, decided once.

:func:`replicas_of` picks :class:`FixedReplicas` or :class:`ElasticReplicas` from the init info's
``elastic`` (:attr:`~.schema.ServingInit.replicas`), and the trainer side picks from the kind of
its membership (``trs.Fixed()`` / ``trs.Elastic()``): everything that differs between the two on
the serving side lives here, behind one interface, and nothing else in the serving code tests
``elastic``:

* ``init_problems(replica, trainers, readers)``: the init info's checks of ``replica`` and the ranks;
* ``trainer_readers(trainer_ranks, inference_ranks, tp, problems)``: on the trainer side, the
  inference ranks of the trainers' recipe and the group's world size at the meeting;
* ``rank(tp, tp_rank)``: the global rank TP rank ``tp_rank`` of this engine joins as;
* ``world_size()``: the group's size at the meeting (None: an elastic joiner has none);
* ``membership()``: the endpoint's membership, ``trs.Fixed()`` or ``trs.Elastic(replica=)``;
* ``check_store(store)``: both sides elastic or neither (the trainers' epoch key in the store);
* ``asks_store(rank)``: whether that check can run before joining.
"""
from __future__ import annotations

import time

from ..engine import Elastic, Fixed
from ..engine.elastic import MAX_RANKS, epoch_key

__all__ = ["FixedReplicas", "ElasticReplicas", "replicas_of"]

_WHERE = "tritonreshard init_info"


class FixedReplicas:
    """Every trainer and every replica's TP ranks meet once (``replica``: which replica this
    engine is, ``inference_ranks[replica * tp + tp_rank]``)."""

    elastic = False

    def __init__(self, init):
        self.init = init

    @staticmethod
    def init_problems(replica, trainers, readers) -> list[str]:
        if isinstance(replica, bool) or not isinstance(replica, int) or not 0 <= replica < max(1, len(readers)):
            return [f"replica={replica!r} must be an int in [0, number of replicas)"]
        return []

    @staticmethod
    def trainer_readers(trainer_ranks: list[int], inference_ranks, tp: int, problems: list[str]):
        """``(inference ranks of the recipe, the group's world size at the meeting)``: every
        engine's TP ranks meet with the trainers."""
        if inference_ranks is None:
            problems.append("inference_ranks is needed (every engine's TP ranks), unless the membership is "
                            "trs.Elastic()")
            return [], 0
        readers = [int(r) for r in inference_ranks]
        return readers, len(trainer_ranks) + len(readers)

    def rank(self, tp: int, tp_rank: int) -> int:
        init = self.init
        replicas = len(init.inference_ranks) // tp   # the recipe checked k * tp ranks
        if not 0 <= init.replica < replicas:
            raise ValueError(f"{_WHERE}: replica={init.replica} but inference_ranks holds {replicas} "
                             f"replica(s) of TP-{tp}")
        return init.inference_ranks[init.replica * tp + tp_rank]

    def world_size(self) -> int:
        return len(self.init.trainer_ranks) + len(self.init.inference_ranks)

    @staticmethod
    def membership() -> Fixed:
        return Fixed()

    @staticmethod
    def asks_store(rank: int) -> bool:
        return rank != 0  # rank 0 of a plain group hosts the store: nothing to ask yet

    def check_store(self, store) -> None:
        """A plain engine that finds the trainers' elastic epoch would wait in a meeting they never
        join. (One that starts before elastic trainers met cannot see them yet: it times out in the
        meeting.)"""
        if store.check([epoch_key(self.init.group)]):
            raise ValueError(f"{_WHERE}: the trainers of group {self.init.group!r} are elastic "
                             f"(membership=trs.Elastic()) but init_info has elastic=False: pass init_info("
                             f"elastic=True, replica=<this engine's index>, inference_ranks=<its own TP ranks>)")


class ElasticReplicas:
    """The trainers meet alone and this engine joins while they run: ``inference_ranks`` are its
    own TP ranks (TP rank ``t`` joins as ``inference_ranks[t]``), ``replica`` its index among the
    engines."""

    elastic = True

    def __init__(self, init):
        self.init = init

    @staticmethod
    def init_problems(replica, trainers, readers) -> list[str]:
        problems = []
        if isinstance(replica, bool) or not isinstance(replica, int) or replica < 0:  # the others are not known here
            problems.append(f"replica={replica!r} must be an int >= 0 (this engine's index among the elastic "
                            f"group's engines)")
        big = [r for r in readers + trainers if not 0 <= r < MAX_RANKS]
        if big:
            problems.append(f"ranks {big} are outside an elastic group's [0, {MAX_RANKS})")
        return problems

    @staticmethod
    def trainer_readers(trainer_ranks: list[int], inference_ranks, tp: int, problems: list[str]):
        """The trainers are the group's world; the recipe's destination side is not used (each
        engine builds its own), so any ranks do."""
        if trainer_ranks != list(range(len(trainer_ranks))):
            problems.append(f"an elastic group's trainers are its world: trainer_ranks must be "
                            f"{list(range(len(trainer_ranks)))}, got {trainer_ranks}")
        readers = list(range(len(trainer_ranks), len(trainer_ranks) + tp)) if inference_ranks is None else \
            [int(r) for r in inference_ranks]
        return readers, len(trainer_ranks)

    def rank(self, tp: int, tp_rank: int) -> int:
        # this engine's own ranks: the group's other engines are not known here
        if len(self.init.inference_ranks) != tp:
            raise ValueError(f"{_WHERE}: elastic init_info's inference_ranks are this engine's own TP ranks, "
                             f"{tp} of them, got {list(self.init.inference_ranks)}")
        return self.init.inference_ranks[tp_rank]

    @staticmethod
    def world_size() -> None:
        return None  # the trainers' control blocks bound a joiner's rank (trs.Elastic)

    def membership(self) -> Elastic:
        # joins the running group: meet, check, plan, map, admit (JoinStats)
        return Elastic(replica=self.init.replica)

    @staticmethod
    def asks_store(rank: int) -> bool:
        return True

    def check_store(self, store) -> None:
        """An elastic group's trainers post their epoch under
        :func:`~tritonreshard.engine.elastic.epoch_key` once they met; an elastic engine that does
        not find it within the timeout says whom it waited for."""
        init = self.init
        key, deadline = epoch_key(init.group), time.monotonic() + init.timeout
        while not store.check([key]):
            if time.monotonic() >= deadline:
                raise ValueError(f"{_WHERE}: init_info has elastic=True but no elastic trainers of group "
                                 f"{init.group!r} met at {init.store} within {init.timeout:g} s: are the trainers "
                                 f"membership=trs.Elastic()? (plain trainers wait for every engine in their "
                                 f"meeting)")
            time.sleep(0.05)


def replicas_of(elastic: bool) -> type[FixedReplicas] | type[ElasticReplicas]:
    """The kind of group, chosen once (the one ``elastic`` test of the serving side): the init
    info asks it with its ``elastic``, the trainer side with ``isinstance(membership, trs.Elastic)``."""
    return ElasticReplicas if elastic else FixedReplicas
