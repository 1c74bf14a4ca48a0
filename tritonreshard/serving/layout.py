"""One serving TP rank's place: :func:`serving_rank`, :class:`ServingRank`.

What every engine rank computes when it joins, from its :class:`~.schema.ServingInit`, its recipe
(:mod:`~.registry`) and its TP size and rank:

* the global rank it joins as and the group kind (:mod:`~.membership`, chosen once);
* :meth:`ServingRank.join`: the one place the serving side constructs a
  :class:`~tritonreshard.RefitInference`.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from .. import Meeting, PullOptions, RefitInference
from ..engine.rendezvous import connect_store
from .membership import ElasticReplicas, FixedReplicas
from .schema import ServingInit

__all__ = ["ServingRank", "serving_rank"]


@dataclass(frozen=True)
class ServingRank:
    """TP rank ``tp_rank`` of a TP-``tp`` engine in a refit group: ``rank`` is its global rank,
    ``spec`` the recipe (``spec.dst[name].local_shape(rank)`` is this rank's shard of ``name``;
    ``spec.parts`` how it is built from the sources; ``spec.quant`` optional),
    ``group`` the group kind (:attr:`~.schema.ServingInit.replicas`)."""

    init: ServingInit
    spec: object
    tp: int
    tp_rank: int
    rank: int
    group: FixedReplicas | ElasticReplicas = field(compare=False, repr=False)

    @property
    def buffer_bytes(self) -> int:
        """Bytes of one whole buffer set on this rank (every destination's shard)."""
        return self.set_bytes()

    def set_bytes(self, direct=()) -> int:
        """Bytes of one buffer set on this rank when the names in ``direct`` are written in the
        engine's own parameters (what a refit costs in memory beyond the engine's weights, per set)."""
        return sum(lay.local_numel(self.rank) * lay.itemsize for n, lay in self.spec.dst.items() if n not in direct)

    def layer_bytes(self, layers) -> int:
        """Bytes of the largest group a layer sink streams on this rank (0 for None)."""
        if layers is None:
            return 0
        return max((sum(self.spec.dst[n].local_numel(self.rank) * self.spec.dst[n].itemsize for n in g)
                    for g in layers.groups), default=0)

    def join(self, *, device, mode, tensors=None, layers=None) -> tuple[RefitInference, float]:
        """Check the store (both sides elastic or neither), then join the refit group: the
        inference endpoint of this rank in buffer ``mode`` (``trs.Spare()``: one set, for the
        background pull; ``trs.InPlace()``: one, which ``tensors``, ``{dst name: the engine's
        parameter}``, replace where given, and a ``layers`` sink's destinations skip), and how long
        joining took in ms. The one
        construction of a ``RefitInference`` on the serving side; every engine calls it."""
        init = self.init
        if self.group.asks_store(self.rank):
            self.group.check_store(connect_store(init.store, world_size=1, is_master=False, timeout=init.timeout))
        t0 = time.perf_counter()
        # What RefitInference.from_recipe does, for any spec with ``dst`` / ``parts`` (/ ``quant``):
        # a RecipeSpec, LoRA's LoraSpec, an engine's own.
        meeting = Meeting(rank=self.rank, world_size=self.group.world_size(), store=init.store, group=init.group)
        sub = RefitInference(self.spec.dst, meeting, tensors=tensors, parts=self.spec.parts,
                             quant=getattr(self.spec, "quant", None) or None,
                             pull=PullOptions(mode=mode, device=device, layers=layers),
                             membership=self.group.membership(), **init.configs)
        return sub, (time.perf_counter() - t0) * 1e3


def serving_rank(init: ServingInit, spec, *, tp: int, tp_rank: int) -> ServingRank:
    """Where TP rank ``tp_rank`` of a TP-``tp`` engine joins: ``ValueError`` when ``init`` and
    ``tp`` disagree (a replica the ranks do not hold; an elastic engine's ranks not ``tp``)."""
    group = init.replicas
    return ServingRank(init=init, spec=spec, tp=tp, tp_rank=tp_rank, rank=group.rank(tp, tp_rank), group=group)
