"""The trainer side of a serving refit group: :class:`ServingTrainer`, the same for every engine.

A :class:`~tritonreshard.RefitTrainer` whose source layouts come from the engine's registered recipe
(:mod:`~.registry`, keyed by the trainer class's :attr:`~ServingTrainer.ENGINE` and the trainers'
source: the same builder the engine's ranks use for their destination side), from a recipe of the
caller's own (:meth:`ServingTrainer.from_spec`) or from a framework's own description
(:meth:`ServingTrainer.from_weight_source`). An engine package names its trainer class by
subclassing (``ENGINE``, ``GROUP``). Engine-free: importing it imports no serving engine.
"""
from __future__ import annotations

from typing import ClassVar

from .. import Meeting, RefitTrainer
from ..engine import Elastic
from .membership import replicas_of
from .registry import recipe_for
from .schema import SRC_DTYPES, ServingInit, rank_problems, src_dtype_name
from .seam import RankLayout

__all__ = ["ServingTrainer", "join_as_trainer"]


def join_as_trainer(trainer: RefitTrainer, tensors, layouts, *, rank: int, world_size: int, store, group: str,
                    membership=None, codec=None, timeouts=None, adopt: bool = False) -> None:
    """Initialise ``trainer`` (an instance of a ``RefitTrainer`` subclass) as a serving group's
    trainer: the one construction of a trainer endpoint on the serving side. ``membership``,
    ``codec``, ``timeouts``: the endpoint's typed configs (``trs.Elastic()``, ``trs.Delta(anchor=)``,
    ``trs.Timeouts(wait=, peer=)``), the same as the engines' init info says in plain values;
    ``adopt``: the arena adopts a dict's plain tensors as it fills (``trs.SourceData``)."""
    RefitTrainer.__init__(trainer, tensors, layouts,
                          Meeting(rank=rank, world_size=world_size, store=store, group=group),
                          membership=membership, codec=codec, timeouts=timeouts, adopt=adopt)


def _first_dtype(shards):
    """The dtype of the first shard (``shards``: a dict of tensors or an ``nn.Module``)."""
    tensors = shards.values() if isinstance(shards, dict) else (p for _, p in shards.named_parameters())
    return next(iter(tensors)).dtype


class ServingTrainer(RefitTrainer):
    """Trainer side of a serving refit group: a :class:`~tritonreshard.RefitTrainer` whose source
    layouts are the ``src`` side of the recipe registered for ``(ENGINE, source)`` (the engines'
    ranks build the destination side of the same recipe from the served model's config).

    ``config``: the model's config (for an HF-named engine a ``transformers`` config of any
    ``model_type`` the recipes know). ``shards``: this rank's shards ``{parameter name: tensor of
    spec.src[name].local_shape(rank)}`` (FSDP row shards, ``Shard(0)`` over ``trainer_ranks``), or
    an ``nn.Module`` whose parameters are those shards. They are copied once into the shared arena
    and then *adopted*: every given tensor becomes a view of its arena shard (``t.data = view``)
    right after its copy (``trs.SourceData(adopt=True)``), so the process holds the shards once:
    each old storage is freed when the caller's other references go, and the freed heap is
    trimmed every 16 MiB as the arena fills (at Qwen3-1.7B a trainer holds 1.00x its shards'
    bytes after set-up, was 1.84x); and training them, or ``tensors``, writes what ``publish()``
    publishes. ``publish()`` refuses (``ValueError``) if one was re-pointed elsewhere since. Kept
    as a separate copy, the arena's and the caller's: a tensor that is a view of another (a slice of
    a bigger buffer: re-pointing it would free nothing and cut it off from its base; train
    ``tensors`` then) and a second name for a tensor already adopted under the first. Call
    ``fence()`` before changing the weights and ``publish()`` after. ``rank`` is this process's rank
    in the refit group (one of ``trainer_ranks``); ``store``, ``trainer_ranks``, ``inference_ranks``,
    ``group`` (None: ``GROUP``) are where it meets the engines, the same as their init info. ``src_dtype``: a
    name of :data:`~.schema.SRC_DTYPES` or its torch dtype (default: the shards' dtype). ``spec``
    is the recipe; the attribute ``src_dtype`` the name to pass to the engines' init info.

    ``megatron``: a ``trs.recipes.Megatron`` when the trainers are Megatron-Core ranks; ``shards`` are
    then ``trs.recipes.megatron_tensors(model_chunks, megatron=megatron, rank=r)`` and the recipe is
    the engine's ``"megatron"`` one (pass the same ``megatron`` to the init info).

    ``membership``: ``trs.Elastic()`` for the trainers of an elastic group (docs/elastic.md): they
    meet alone (``trainer_ranks`` must be ``0 .. n-1``, ``inference_ranks`` may be None) and engines
    join and leave while they run (``init_info(elastic=True, replica=i)``); ``fence()`` waits for
    the engines admitted now, never for one that left or died. ``tp`` only shapes the recipe's
    unused destination side then. ``codec``, ``timeouts``: the endpoint's (``trs.Delta(anchor=)`` or
    ``trs.Dense()``; ``trs.Timeouts(wait=, peer=)``), matching the init info's plain values.
    """

    #: The engine's key in the recipe registry (an engine's trainer class sets it).
    ENGINE: ClassVar[str | None] = None
    #: The group name when none is given (the engine's init info has the same default).
    GROUP: ClassVar[str] = ServingInit.GROUP
    #: The init info class whose checks the trainer's side of the meeting goes through.
    INIT: ClassVar[type] = ServingInit

    def __init__(self, config, shards, *, rank: int, tp: int, trainer_ranks, inference_ranks=None, store,
                 src_dtype=None, group: str | None = None, megatron=None, membership=None, codec=None,
                 timeouts=None):
        dtype = SRC_DTYPES.get(src_dtype, src_dtype) or _first_dtype(shards)
        init, world = self._meeting(dtype, tp=tp, trainer_ranks=trainer_ranks, inference_ranks=inference_ranks,
                                    store=store, group=group, membership=membership, megatron=megatron)
        self._build(init, config, shards, rank=rank, tp=tp, world_size=world, membership=membership, codec=codec,
                    timeouts=timeouts, adopt=True)

    @classmethod
    def _meeting(cls, dtype, *, tp: int, trainer_ranks, inference_ranks, store, group, membership,
                 **fields) -> tuple[ServingInit, int]:
        """The trainers' side of the init info (``INIT`` of these values and ``fields``) and the
        group's world size at the meeting: one ``ValueError`` naming every problem."""
        problems = []
        if cls.ENGINE is None:
            problems.append(f"{cls.__name__} names no engine: use an engine's trainer class (a subclass that "
                            f"sets ENGINE), or from_spec with a recipe of your own")
        if src_dtype_name(dtype) is None:
            problems.append(f"the shards' dtype must be one of {list(SRC_DTYPES)}, got {dtype}")
        trainer_ranks = [int(r) for r in trainer_ranks]
        readers, world = replicas_of(isinstance(membership, Elastic)).trainer_readers(
            trainer_ranks, inference_ranks, tp, problems)
        init = None
        if not problems:
            try:  # narrow: the init info's own checks, gathered into one message with the trainer's
                init = cls.INIT(store=store, trainer_ranks=trainer_ranks, inference_ranks=readers,
                                src_dtype=src_dtype_name(dtype), group=group or cls.GROUP, **fields)
            except ValueError as exc:
                problems.append(str(exc).removeprefix("init_info: "))
        if problems:
            raise ValueError(f"{cls.__name__}: " + "; ".join(problems))
        return init, world

    def _build(self, init: ServingInit, config, shards, *, rank: int, tp: int, world_size: int, **configs) -> None:
        """The registered recipe of ``(ENGINE, init.source)`` (only its source side matters here:
        the destination dtype is the engine's, chosen by its ranks), then join."""
        self.spec = recipe_for(init, RankLayout(engine=self.ENGINE, tp=tp, tp_rank=0, config=config),
                               **self._recipe_extra())
        self.src_dtype = init.src_dtype  # what the init info's src_dtype needs on the engines' side
        self.source = None
        self._join(shards, self.spec.src, rank=rank, world_size=world_size, store=init.store, group=init.group,
                   **configs)

    def _recipe_extra(self) -> dict:
        """What this trainer class passes to its engine's recipe builder beyond the init info."""
        return {}

    def _join(self, tensors, layouts, **kwargs) -> None:
        """Join the refit group as its trainer: ``__init__``, :meth:`from_spec` and an engine's own
        constructors all end here (:func:`join_as_trainer`)."""
        join_as_trainer(self, tensors, layouts, **kwargs)

    @classmethod
    def from_spec(cls, spec, shards, *, rank: int, trainer_ranks, inference_ranks, store, group: str | None = None,
                  **configs) -> ServingTrainer:
        """A trainer of a recipe of the engine's own (a ``trs.recipes.RecipeSpec`` whose ``src`` are
        this group's source layouts over ``trainer_ranks``): for a model no registered recipe
        knows, a spec built from ``trs.Layout`` / ``Shard`` / ``Replicate`` or traced, served
        through the same seam. ``shards``: ``{name: spec.src[name].local_shape(rank)}``, adopted
        by the arena as ``__init__``'s are."""
        trainer_ranks, inference_ranks = [int(r) for r in trainer_ranks], [int(r) for r in inference_ranks]
        problems = rank_problems(trainer_ranks, inference_ranks)
        if rank not in trainer_ranks:
            problems.append(f"rank={rank} is not one of trainer_ranks={trainer_ranks}")
        dtypes = {lay.dtype for lay in spec.src.values()}
        if len(dtypes) != 1 or src_dtype_name(next(iter(dtypes))) is None:
            problems.append(f"the sources' dtypes {sorted(map(str, dtypes))} must be one of {list(SRC_DTYPES)}, "
                            f"all the same (the init info's src_dtype)")
        if problems:
            raise ValueError(f"{cls.__name__}.from_spec: " + "; ".join(problems))
        self = cls.__new__(cls)
        self.spec, self.source, self.src_dtype = spec, None, src_dtype_name(dtypes.pop())
        self._join(shards, spec.src, rank=rank, world_size=len(trainer_ranks) + len(inference_ranks), store=store,
                   group=group or cls.GROUP, adopt=True, **configs)
        return self
