"""The trainer side of a vLLM refit group: :class:`Trainer`, the serving seam's trainer under vLLM's name.

A :class:`~tritonreshard.serving.ServingTrainer` whose recipe is the one registered for engine
``"vllm"`` (:mod:`._recipes`: ``hf_to_vllm``, or ``megatron_to_vllm`` for Megatron-Core trainers),
in refit group ``"vllm"`` unless told otherwise, plus :meth:`Trainer.from_weight_source`: a trainer
fed by vLLM's own trainer-side description. Importing it does not import vLLM.
"""
from __future__ import annotations

from .. import Layout
from ..serving import SRC_DTYPES, ServingTrainer, rank_problems, src_dtype_name
from ._recipes import ENGINE, GROUP

__all__ = ["Trainer"]


class Trainer(ServingTrainer):
    """Trainer side of a vLLM refit group: :class:`tritonreshard.serving.ServingTrainer` (its
    arguments, ``spec``, ``src_dtype``) with vLLM's recipes, in refit group ``"vllm"`` unless told
    otherwise. The vLLM workers build the destination side of the same recipe from the served
    model's config; pass ``src_dtype`` to :func:`~tritonreshard.vllm.init_info`.

    The shards given are held once: copied into the shared arena, then adopted (each becomes a view
    of its arena shard, see :class:`~tritonreshard.serving.ServingTrainer`), so a trainer process
    holds 1x its shards' bytes, not 2x (a view of a bigger tensor stays a copy). Not so for
    :meth:`from_weight_source`: the framework keeps training its own tensors and each ``publish()``
    copies them in, so there the arena is a second copy."""

    ENGINE = ENGINE
    GROUP = GROUP

    @classmethod
    def from_weight_source(cls, source, *, rank: int, trainer_ranks, inference_ranks, store,
                           group: str | None = None, **configs) -> Trainer:
        """A trainer fed by vLLM's own trainer-side description (vLLM >= 0.33's
        ``vllm.distributed.weight_transfer.base.WeightSource``), with no recipe of its own.

        ``source.metadata`` declares every HF parameter (name, dtype, full shape, ``owners``,
        ``mesh_shape``, ``placements``: each becomes a layout by :meth:`trs.Layout.from_param_meta
        <tritonreshard.Layout.from_param_meta>` over ``trainer_ranks``), and ``source.iter_local()``
        yields this rank's pieces, exactly ``source.owned_names(t)`` in metadata order, where ``t``
        is this rank's index in ``trainer_ranks`` (vLLM's trainer rank). The engines' workers build
        the destination side from the served model's config as usual; their recipe reads the HF
        names, whatever the trainers' layouts. All parameters must share one dtype of
        :data:`~tritonreshard.serving.SRC_DTYPES` (the init info's ``src_dtype``).

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
                   store=store, group=group or cls.GROUP, **configs)
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
            if (lay is not None and rank in lay.ranks
                    and (tuple(t.shape), t.dtype) != (lay.local_shape(rank), lay.dtype)):
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
