"""The trainer side of a serving refit group: :class:`ServingTrainer`, the same for every engine.

A :class:`~tritonreshard.RefitTrainer` whose source layouts come from a recipe
(``trs.recipes.hf_to_vllm`` / ``megatron_to_vllm``, their ``src`` side), from an engine's own
recipe (:meth:`ServingTrainer.from_spec`) or from a framework's own description
(:meth:`ServingTrainer.from_weight_source`). Nothing here is engine-specific: the
serving engines build the destination side of the same recipe from their served model.
``tritonreshard.vllm.Trainer`` is this class under vLLM's name. Engine-free: importing it imports
no serving engine.
"""
from __future__ import annotations

from .. import Layout, RefitTrainer, recipes
from ..engine import Elastic, Fixed
from .schema import SRC_DTYPES, endpoint_configs, rank_problems, src_dtype_name

__all__ = ["ServingTrainer", "join_as_trainer"]


def join_as_trainer(trainer: RefitTrainer, tensors, layouts, *, elastic: bool = False, **kwargs) -> None:
    """Initialise ``trainer`` (an instance of a ``RefitTrainer`` subclass: :class:`ServingTrainer`,
    vLLM's ``LoraTrainer``) as a serving group's trainer. The serving side speaks the init info's
    plain values (``elastic=``, ``delta=``, ``delta_anchor=``, ``timeout=``, ``peer_timeout=``, the
    same on the trainers and in every engine's init info); they become the endpoint's typed configs
    here, once. Every other keyword is ``RefitTrainer``'s."""
    spelled = {k: kwargs.pop(k) for k in ("delta", "delta_anchor", "timeout", "peer_timeout") if k in kwargs}
    configs = endpoint_configs(**spelled)
    if not {"delta", "delta_anchor"} & set(spelled):
        configs.pop("codec")
    if not {"timeout", "peer_timeout"} & set(spelled):
        configs.pop("timeouts")
    RefitTrainer.__init__(trainer, tensors, layouts, membership=Elastic() if elastic else Fixed(), **configs,
                          **kwargs)


def _first_dtype(shards):
    """The dtype of the first shard (``shards``: a dict of tensors or an ``nn.Module``)."""
    tensors = shards.values() if isinstance(shards, dict) else (p for _, p in shards.named_parameters())
    return next(iter(tensors)).dtype


def _membership(trainer_ranks: list[int], inference_ranks, tp: int, elastic, problems: list[str]):
    """Fixed or elastic on the trainer side, decided here once: ``(inference_ranks for the
    recipe, the group's world size at the meeting)``."""
    if not isinstance(elastic, bool):
        problems.append(f"elastic must be True or False, got elastic={elastic!r}")
        return [], 0
    if elastic:
        if trainer_ranks != list(range(len(trainer_ranks))):
            problems.append(f"an elastic group's trainers are its world: trainer_ranks must be "
                            f"{list(range(len(trainer_ranks)))}, got {trainer_ranks}")
        # The recipe's destination side is not used (each engine builds its own); any ranks do.
        readers = list(range(len(trainer_ranks), len(trainer_ranks) + tp)) if inference_ranks is None else \
            [int(r) for r in inference_ranks]
        return readers, len(trainer_ranks)
    if inference_ranks is None:
        problems.append("inference_ranks is needed (every engine's TP ranks), unless elastic=True")
        return [], 0
    readers = [int(r) for r in inference_ranks]
    return readers, len(trainer_ranks) + len(readers)


class ServingTrainer(RefitTrainer):
    """Trainer side of a serving refit group: a :class:`~tritonreshard.RefitTrainer` whose source
    layouts are ``trs.recipes.hf_to_vllm(config, tp=tp, ...).src`` (the engines' workers build the
    destination side of the same recipe from the served model's config).

    ``config``: the model's ``transformers`` config (any ``model_type`` the recipes know: llama,
    mistral, qwen2, qwen3, qwen3_moe, deepseek_v2, deepseek_v3). ``shards``: this rank's FSDP row shards ``{HF parameter name:
    tensor of spec.src[name].local_shape(rank)}`` (``Shard(0)`` over ``trainer_ranks``), copied once
    into the shared arena; train on ``tensors`` afterwards (or pass an ``nn.Module`` whose parameters
    are those shards: they are re-pointed at the arena). Call ``fence()`` before changing the
    weights and ``publish()`` after; the engines' workers pull from the arena. ``rank`` is this
    process's rank in the refit group (one of ``trainer_ranks``). ``src_dtype``: a name of
    :data:`~.schema.SRC_DTYPES` or its torch dtype (default: the shards' dtype). ``spec`` is the
    recipe; the attribute ``src_dtype`` the name to pass to the engines' init info.

    ``megatron``: a ``trs.recipes.Megatron`` when the trainers are Megatron-Core ranks; ``shards`` are
    then ``trs.recipes.megatron_tensors(model_chunks, megatron=megatron, rank=r)`` and the spec is
    ``trs.recipes.megatron_to_vllm`` (pass the same ``megatron`` to the init info).

    ``elastic``: the trainers of an elastic group (docs/elastic.md): they meet alone
    (``trainer_ranks`` must be ``0 .. n-1``, ``inference_ranks`` may be None) and engines join and
    leave while they run (``init_info(elastic=True, replica=i)``); ``fence()`` waits for the engines
    admitted now, never for one that left or died. ``tp`` only shapes the recipe's unused
    destination side here: the source layouts are the same for every ``tp``.
    """

    def __init__(self, config, shards, *, rank: int, tp: int, trainer_ranks, inference_ranks=None, store,
                 src_dtype=None, group: str = "vllm", megatron=None, elastic: bool = False, **kwargs):
        dtype = SRC_DTYPES.get(src_dtype, src_dtype) or _first_dtype(shards)
        problems = []
        if src_dtype_name(dtype) is None:
            problems.append(f"the shards' dtype must be one of {list(SRC_DTYPES)}, got {dtype}")
        trainer_ranks = [int(r) for r in trainer_ranks]
        inference_ranks, world = _membership(trainer_ranks, inference_ranks, tp, elastic, problems)
        problems += rank_problems(trainer_ranks, inference_ranks)
        if problems:
            raise ValueError(f"{type(self).__name__}: " + "; ".join(problems))
        # Only the source side matters here; the destination dtype is the engine's, chosen by its workers.
        if megatron is not None:
            self.spec = recipes.megatron_to_vllm(config, megatron=megatron, tp=tp, trainer_ranks=trainer_ranks,
                                                 inference_ranks=inference_ranks, src_dtype=dtype)
        else:
            self.spec = recipes.hf_to_vllm(config, tp=tp, trainer_ranks=trainer_ranks,
                                           inference_ranks=inference_ranks, src_dtype=dtype)
        self.src_dtype = src_dtype_name(dtype)  # what the init info's src_dtype needs on the engines' side
        self.source = None
        self._join(shards, self.spec.src, rank=rank, world_size=world, store=store, group=group,
                   elastic=elastic, **kwargs)

    def _join(self, tensors, layouts, *, elastic: bool = False, **kwargs) -> None:
        """Join the refit group as its trainer: the one construction of a ``RefitTrainer`` on the
        serving side (``__init__``, :meth:`from_spec` and :meth:`from_weight_source` all end here).
        The serving side's spelling (``elastic=``, ``delta=``, ``delta_anchor=``, ``timeout=``,
        ``peer_timeout=``: the init info's) becomes the endpoint's configs here, once."""
        join_as_trainer(self, tensors, layouts, elastic=elastic, **kwargs)

    @classmethod
    def from_spec(cls, spec, shards, *, rank: int, trainer_ranks, inference_ranks, store, group: str = "vllm",
                  **kwargs) -> "ServingTrainer":
        """A trainer of a recipe of the engine's own (a ``trs.recipes.RecipeSpec`` whose ``src`` are
        this group's source layouts over ``trainer_ranks``): an engine whose parameter names no
        ``hf_to_vllm`` recipe knows builds its spec from ``trs.Layout`` / ``Shard`` / ``Replicate``
        and serves it through the same seam. ``shards``: ``{name: spec.src[name].local_shape(rank)}``."""
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
                   group=group, **kwargs)
        return self

    @classmethod
    def from_weight_source(cls, source, *, rank: int, trainer_ranks, inference_ranks, store, group: str = "vllm",
                           **kwargs) -> "ServingTrainer":
        """A trainer fed by vLLM's own trainer-side description (vLLM >= 0.33's
        ``vllm.distributed.weight_transfer.base.WeightSource``), with no recipe of its own.

        ``source.metadata`` declares every HF parameter (name, dtype, full shape, ``owners``,
        ``mesh_shape``, ``placements``: each becomes a layout by :meth:`trs.Layout.from_param_meta
        <tritonreshard.Layout.from_param_meta>` over ``trainer_ranks``), and ``source.iter_local()``
        yields this rank's pieces, exactly ``source.owned_names(t)`` in metadata order, where ``t``
        is this rank's index in ``trainer_ranks`` (vLLM's trainer rank). The engines' workers build
        the destination side from the served model's config as usual; their recipe reads the HF
        names, whatever the trainers' layouts. All parameters must share one dtype of
        :data:`~.schema.SRC_DTYPES` (the init info's ``src_dtype``).

        ``publish()`` waits for ``fence()`` and takes a fresh ``iter_local()`` pass into the arena
        before publishing: the framework keeps training its own tensors. Duck-typed: vLLM is not
        imported. Bad input: one ``ValueError`` naming every problem, before joining the group.
        """
        where = f"{cls.__name__}.from_weight_source"
        trainer_ranks, inference_ranks = [int(r) for r in trainer_ranks], [int(r) for r in inference_ranks]
        missing = [a for a in ("metadata", "owned_names", "iter_local") if not hasattr(source, a)]
        if missing:
            raise ValueError(f"{where}: source {type(source).__name__} has no {missing} "
                             f"(a vLLM >= 0.33 WeightSource has them)")
        problems = []
        if getattr(source, "implements_iter_local", lambda: True)() is False:
            problems.append(f"source {type(source).__name__} does not implement iter_local (each owner's pieces)")
        if rank not in trainer_ranks:
            problems.append(f"rank={rank} is not one of trainer_ranks={trainer_ranks}")
        problems += rank_problems(trainer_ranks, inference_ranks)
        layouts = {}
        for meta in source.metadata:
            try:
                layouts[meta.name] = Layout.from_param_meta(meta, trainer_ranks)
            except ValueError as exc:
                problems.append(str(exc))
        dtypes = {lay.dtype for lay in layouts.values()}
        if not source.metadata:
            problems.append("source.metadata declares no parameter")
        elif len(dtypes) > 1 or any(src_dtype_name(d) is None for d in dtypes):
            problems.append(f"the parameters' dtypes {sorted(map(str, dtypes))} must be one of {list(SRC_DTYPES)}, "
                            f"all the same (init_info's src_dtype)")
        if problems:
            raise ValueError(f"{where}: " + "; ".join(problems))
        self = cls.__new__(cls)
        self.spec, self.source = None, source
        self._trainer_index, self._source_rank = trainer_ranks.index(rank), rank
        self._layouts = layouts
        self.src_dtype = src_dtype_name(dtypes.pop())
        self._join(self._pass(), layouts, rank=rank, world_size=len(trainer_ranks) + len(inference_ranks),
                   store=store, group=group, **kwargs)
        return self

    def _pass(self) -> dict:
        """One ``iter_local()`` pass of the source, checked against ``owned_names`` and the layouts."""
        want = list(self.source.owned_names(self._trainer_index))
        got = dict(self.source.iter_local())
        problems = []
        if list(got) != want:
            problems.append(f"iter_local yielded {list(got)}, owned_names({self._trainer_index}) is {want}")
        for name, t in got.items():
            lay = self._layouts.get(name)
            rank = self._source_rank
            if lay is not None and rank in lay.ranks and (tuple(t.shape), t.dtype) != (lay.local_shape(rank), lay.dtype):
                problems.append(f"{name}: iter_local yielded {t.dtype} of shape {tuple(t.shape)}, its ParamMeta "
                                f"places {lay.dtype} of {lay.local_shape(rank)} on trainer rank {self._trainer_index}")
        if problems:
            raise ValueError(f"{type(self).__name__}.from_weight_source (rank {self._source_rank}): "
                             + "; ".join(problems))
        return got

    def publish(self) -> int:
        """Publish the arena as the next version; a trainer made by :meth:`from_weight_source`
        first waits for its readers (``fence()``) and copies a fresh ``iter_local()`` pass in."""
        if self.source is not None:
            self.fence()
            arena = self.tensors
            for name, t in self._pass().items():
                arena[name].copy_(t)
        return super().publish()
