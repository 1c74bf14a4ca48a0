"""Fixed or elastic: how a serving engine's TP ranks belong to the refit group, decided once.

:func:`membership` picks :class:`FixedGroup` or :class:`ElasticGroup` from a
:class:`~.schema.ServingInit` when an engine sets up; everything that differs between the two
lives here, behind one interface, and nothing else in the serving code tests ``elastic``:

* ``rank(tp, tp_rank)``: the global rank TP rank ``tp_rank`` of this engine joins as;
* ``endpoint_args()``: what the inference endpoint needs for this kind of group (its membership,
  ``trs.Fixed()`` with the ``world_size`` of a fixed group, ``trs.Elastic(replica=)`` of an elastic one);
* ``check_store(store)``: both sides elastic or neither (the trainers' epoch key in the store);
* ``asks_store(rank)``: whether that check can run before joining.

Called by :func:`~.layout.serving_rank` only.
"""
from __future__ import annotations

import time

from ..engine import Elastic, Fixed
from ..engine.elastic import epoch_key
from .schema import ServingInit

__all__ = ["FixedGroup", "ElasticGroup", "membership"]

_WHERE = "tritonreshard init_weight_transfer_engine"


class FixedGroup:
    """Every trainer and every replica's TP ranks meet once (``replica``: which replica this
    engine is, ``inference_ranks[replica * tp + tp_rank]``)."""

    elastic = False

    def __init__(self, init: ServingInit):
        self.init = init

    def rank(self, tp: int, tp_rank: int) -> int:
        init = self.init
        replicas = len(init.inference_ranks) // tp   # the recipe checked k * tp ranks
        if not 0 <= init.replica < replicas:
            raise ValueError(f"{_WHERE}: init_info replica={init.replica} but inference_ranks holds {replicas} "
                             f"replica(s) of TP-{tp}")
        return init.inference_ranks[init.replica * tp + tp_rank]

    def endpoint_args(self) -> dict:
        return {"world_size": len(self.init.trainer_ranks) + len(self.init.inference_ranks), "membership": Fixed()}

    @staticmethod
    def asks_store(rank: int) -> bool:
        return rank != 0  # rank 0 of a plain group hosts the store: nothing to ask yet

    def check_store(self, store) -> None:
        """A plain engine that finds the trainers' elastic epoch would wait in a meeting they never
        join. (One that starts before elastic trainers met cannot see them yet: it times out in the
        meeting.)"""
        if store.check([epoch_key(self.init.group)]):
            raise ValueError(f"{_WHERE}: the trainers of group {self.init.group!r} are elastic "
                             f"(tritonreshard.vllm.Trainer(elastic=True)) but init_info has elastic=False: "
                             f"pass init_info(elastic=True, replica=<this engine's index>, inference_ranks=<its "
                             f"own TP ranks>)")


class ElasticGroup:
    """The trainers meet alone and this engine joins while they run: ``inference_ranks`` are its
    own TP ranks (TP rank ``t`` joins as ``inference_ranks[t]``), ``replica`` its index among the
    engines."""

    elastic = True

    def __init__(self, init: ServingInit):
        self.init = init

    def rank(self, tp: int, tp_rank: int) -> int:
        # this engine's own ranks: the group's other engines are not known here
        if len(self.init.inference_ranks) != tp:
            raise ValueError(f"{_WHERE}: elastic init_info's inference_ranks are this engine's own TP ranks, "
                             f"{tp} of them, got {list(self.init.inference_ranks)}")
        return self.init.inference_ranks[tp_rank]

    def endpoint_args(self) -> dict:
        # joins the running group: meet, check, plan, map, admit (JoinStats)
        return {"membership": Elastic(replica=self.init.replica)}

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
                                 f"tritonreshard.vllm.Trainer(elastic=True)? (plain trainers wait for every "
                                 f"engine in their meeting)")
            time.sleep(0.05)


def membership(init: ServingInit) -> FixedGroup | ElasticGroup:
    """The group kind of ``init``, chosen once (the one ``elastic`` test of the serving side)."""
    return ElasticGroup(init) if init.elastic else FixedGroup(init)
