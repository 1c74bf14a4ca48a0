"""What a serving engine is told when it joins a refit group: :class:`ServingInit`, written once.

The one schema of an engine's init info, its defaults and its checks: an engine's own payload
class *is* a :class:`ServingInit` (a subclass adds the engine's base class, its default group and
any fields of its own, with their checks in :meth:`ServingInit.problems`), its driver builds one and
sends :meth:`ServingInit.to_dict`, and every rank rebuilds it from that dict. Also here:
:data:`SRC_DTYPES`, the one table of the trainers' dtypes, and the two checks the trainer side
shares with it (:func:`rank_problems`, :func:`src_dtype_problems`). Pure Python: no engine is
imported.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from types import MappingProxyType
from typing import ClassVar

import torch

from ..engine import Timeouts
from ..recipes import Megatron
from ..transport import codec_for, delta_problems
from .membership import replicas_of

__all__ = ["ServingInit", "SRC_DTYPES", "endpoint_configs", "src_dtype_name", "rank_problems", "src_dtype_problems"]

# The trainers' parameter dtypes a serving engine accepts, by the name that crosses the wire in the
# init info (a plain dict: an engine's RPC carries names, not torch dtypes). The one table: the init
# info, the trainers and the workers all read it.
SRC_DTYPES = MappingProxyType({"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16})


def endpoint_configs(delta: str = "auto", delta_anchor: int = 64, timeout: float = 60.0,
                     peer_timeout: float = 10.0) -> dict:
    """The serving side's spelling (plain values, as the init info carries them and the trainers
    take them: ``delta=``, ``delta_anchor=``, ``timeout=``, ``peer_timeout=``) as the endpoint's
    typed configs, ``{"codec": ..., "timeouts": ...}``; each checks its values once, here."""
    return {"codec": codec_for(delta, delta_anchor), "timeouts": Timeouts(wait=timeout, peer=peer_timeout)}


def src_dtype_name(dtype) -> str | None:
    """The :data:`SRC_DTYPES` name of torch ``dtype`` (None: not one the engines accept)."""
    return next((n for n, d in SRC_DTYPES.items() if d == dtype), None)


def src_dtype_problems(src_dtype) -> list[str]:
    """``src_dtype`` is a name of :data:`SRC_DTYPES` (else one problem)."""
    if isinstance(src_dtype, str) and src_dtype in SRC_DTYPES:
        return []
    return [f"src_dtype must be one of {list(SRC_DTYPES)}, got src_dtype={src_dtype!r}"]


def rank_problems(trainer_ranks, inference_ranks) -> list[str]:
    """The trainers and the inference ranks are distinct ranks of one group (else one problem).
    Both are lists of ints; every entry point of the serving side (init info, trainers, LoRA)
    runs this one check."""
    if set(trainer_ranks) & set(inference_ranks):
        return [f"trainer_ranks={list(trainer_ranks)} and inference_ranks={list(inference_ranks)} overlap"]
    return []


def _int_list(value, what: str, problems: list[str]) -> tuple[int, ...]:
    try:
        return tuple(int(r) for r in value)
    except (TypeError, ValueError):
        problems.append(f"{what}={value!r} must be a list of int ranks")
        return ()


def _number(value, what: str, problems: list[str]) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        problems.append(f"{what} must be a number of seconds, got {what}={value!r}")
        return 0.0


def _megatron_dict(value, problems: list[str]) -> dict | None:
    """``megatron`` as it crosses the wire: None, or every field of a ``trs.recipes.Megatron``
    (what :meth:`ServingInit.to_dict` writes; a partial dict is refused, not completed with defaults
    the trainers may not have used)."""
    if value is None:
        return None
    if isinstance(value, Megatron):
        return dataclasses.asdict(value)
    names = {f.name for f in dataclasses.fields(Megatron)}
    if isinstance(value, dict) and set(value) == names:
        try:
            return dataclasses.asdict(Megatron(**value))
        except ValueError as exc:
            problems.append(f"megatron={value!r}: {exc}")
            return None
    problems.append(f"megatron must be a trs.recipes.Megatron or None (on the wire: all its fields "
                    f"{sorted(names)}), got megatron={value!r}")
    return None


@dataclass(frozen=True)
class ServingInit:
    """One serving engine's place in a refit group (what its init call gets, as a plain dict).

    ``store``: ``"host:port"`` of the group's TCPStore (trainer rank 0 hosts it). ``trainer_ranks``:
    the trainers' global ranks. ``inference_ranks``: every replica's TP ranks, replica after replica
    (``inference_ranks[i]`` is TP rank ``i % tp`` of replica ``i // tp``); with ``elastic`` this
    engine's own TP ranks only. ``src_dtype``: the trainers' dtype, a name of :data:`SRC_DTYPES`.
    ``group``: the refit group's name (None: the class's :attr:`GROUP`; an engine's subclass sets
    its own). ``timeout`` / ``peer_timeout``: seconds (the endpoint's). ``replica``: which replica
    this engine is (fixed groups: ``0 <= replica < number of replicas``; elastic: its index among
    the engines, any int >= 0). ``megatron``: a ``trs.recipes.Megatron`` (or its fields: stored as a
    dict, it crosses the wire as one) when the trainers are Megatron-Core ranks (:attr:`source` is
    then ``"megatron"``, else ``"hf"``: the recipe registry's key). ``prefetch``: pull each
    published version in the background (:class:`~.pull.BackgroundPull`) or inside the refit
    (:class:`~.pull.InlinePull`). ``direct``: with ``prefetch=False``, the pull writes the engine's
    parameters directly wherever the engine says they are in load format
    (:meth:`~.seam.ServingEngine.direct_tensors`: those the engine serves without post-processing,
    e.g. every parameter of an unquantized model on CUDA): no buffer for them; a pull
    that fails part-way then leaves the engine's weights part old, part new until a refit succeeds
    (:class:`~.pull.DirectPull`). ``direct=False`` pulls into one buffer set and keeps serving the
    previous version on a failure. Ignored with ``prefetch=True``. ``delta``, ``delta_anchor``: the
    cross-host deltas, as the trainers'. ``elastic``: join an elastic group while it runs
    (:mod:`~.membership`). ``verify``: once, before joining, each worker checks that the recipe
    puts every element where the engine's own loader puts it, and refuses on a mismatch: ``True``
    every parameter of every layer,
    ``False`` off; ``"all"`` is kept as a synonym of ``True`` (it was every layer when ``True``
    sampled). ``trace``: a model type with no hand-written recipe (``trs.recipes.RECIPES``) gets one
    traced from the engine's own loader by each worker, once, before ``verify``; the trainers pass
    the same trace (``ServingTrainer.from_spec(trace_recipe(...), ...)``). A type with a recipe
    keeps it. ``max_refit_bytes``: the most memory the refit may hold on each rank beside the
    engine's own weights (its buffer sets); a pull mode that needs more is refused when the rank
    joins, before anything is allocated, naming the mode, the bytes it needs and the budget (None:
    no budget).

    These are the wire's plain values (the init info crosses an engine's RPC and HTTP as JSON); the
    endpoint's typed configs are made from them once (:attr:`configs`, :attr:`replicas`). Every
    check runs once, at construction: one ``ValueError`` naming every problem (a subclass adds its
    own in :meth:`problems`). Ranks are stored as tuples of ints, timeouts as floats; :meth:`to_dict`
    is the plain JSON dict (lists).
    """

    #: The group name when none is given: an engine's subclass names its own.
    GROUP: ClassVar[str] = "refit"

    store: str
    trainer_ranks: tuple[int, ...]
    inference_ranks: tuple[int, ...]
    src_dtype: str = "float32"
    group: str | None = None
    timeout: float = 60.0
    peer_timeout: float = 10.0
    replica: int = 0   # which replica (engine) these workers are: inference_ranks[replica * tp + tp rank]
    megatron: dict | None = None  # trs.recipes.Megatron's fields: the trainers are Megatron-Core ranks
    prefetch: bool = True  # pull each published version in the background (serving.pull)
    direct: bool = True    # prefetch=False: write the engine's load-format parameters directly (serving.pull)
    delta: str = "auto"    # cross-host deltas, as the trainers'
    delta_anchor: int = 64
    elastic: bool = False  # join an elastic group: inference_ranks are this engine's own TP ranks
    verify: bool | str = True  # check the recipe against the engine's own loader once, before joining
    trace: bool = False    # no hand-written recipe for the model type: trace one from the engine's loader
    max_refit_bytes: int | None = None  # the refit's memory budget per rank beside the engine's weights

    def __post_init__(self):
        normal: dict = {}
        problems = self.problems(normal)
        if problems:
            raise ValueError("init_info: " + "; ".join(problems))
        # Frozen: the normalized values are set once, here, as dataclasses' own __init__ does.
        for name, value in normal.items():
            object.__setattr__(self, name, value)

    def problems(self, normal: dict) -> list[str]:
        """Every problem of these values, and into ``normal`` the normalized ones (ranks as tuples,
        timeouts as floats, ``megatron`` as a dict, the default group). A subclass adds its own
        fields' problems to the base's."""
        problems = list(delta_problems(self.delta, self.delta_anchor))
        trainers = _int_list(self.trainer_ranks, "trainer_ranks", problems)
        readers = _int_list(self.inference_ranks, "inference_ranks", problems)
        for name in ("elastic", "prefetch", "direct", "trace"):
            if not isinstance(getattr(self, name), bool):
                problems.append(f"{name} must be True or False, got {name}={getattr(self, name)!r}")
        budget = self.max_refit_bytes
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 0):
            problems.append(f"max_refit_bytes must be None or an int >= 0 (bytes), got max_refit_bytes={budget!r}")
        if not (isinstance(self.verify, bool) or self.verify == "all"):
            problems.append(f"verify must be True, False or 'all', got verify={self.verify!r}")
        megatron = _megatron_dict(self.megatron, problems)
        if isinstance(self.elastic, bool):  # the kind's own checks of replica and ranks (membership)
            problems += replicas_of(self.elastic).init_problems(self.replica, trainers, readers)
        problems += rank_problems(trainers, readers)
        if not isinstance(self.store, str) or ":" not in self.store:
            problems.append(f"store must be 'host:port', got store={self.store!r}")
        group = type(self).GROUP if self.group is None else self.group
        if not isinstance(group, str) or not group:
            problems.append(f"group must be a non-empty str, got group={self.group!r}")
        problems += src_dtype_problems(self.src_dtype)
        timeout = _number(self.timeout, "timeout", problems)
        peer_timeout = _number(self.peer_timeout, "peer_timeout", problems)
        normal.update(trainer_ranks=trainers, inference_ranks=readers, megatron=megatron, timeout=timeout,
                      peer_timeout=peer_timeout, group=group)
        return problems

    @property
    def configs(self) -> dict:
        """The endpoint's codec and timeouts of this init info (:func:`endpoint_configs`)."""
        return endpoint_configs(self.delta, self.delta_anchor, self.timeout, self.peer_timeout)

    @property
    def replicas(self):
        """How this engine's TP ranks belong to the group, fixed or elastic (:mod:`~.membership`),
        chosen once from ``elastic``."""
        return replicas_of(self.elastic)(self)

    @property
    def source(self) -> str:
        """What the trainers hold, the recipe registry's source key: ``"megatron"`` (Megatron-Core
        ranks) or ``"hf"`` (FSDP row shards of the HF parameters)."""
        return "hf" if self.megatron is None else "megatron"

    @property
    def dtype(self) -> torch.dtype:
        """The trainers' torch dtype (``SRC_DTYPES[src_dtype]``)."""
        return SRC_DTYPES[self.src_dtype]

    @property
    def megatron_config(self) -> Megatron | None:
        """``megatron`` as a ``trs.recipes.Megatron`` (None: the trainers hold HF shards)."""
        return None if self.megatron is None else Megatron(**self.megatron)

    def to_dict(self) -> dict:
        """The plain JSON dict that crosses an engine's RPC / HTTP (``cls(**d)`` rebuilds it)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["trainer_ranks"], out["inference_ranks"] = list(self.trainer_ranks), list(self.inference_ranks)
        out["megatron"] = None if self.megatron is None else dict(self.megatron)
        return out

    @classmethod
    def from_dict(cls, data) -> ServingInit:
        """The init info of a plain dict (one :meth:`to_dict` made, or its JSON). Unknown keys are
        one ``ValueError`` naming them."""
        if isinstance(data, cls):
            return data
        if not isinstance(data, dict):
            raise ValueError(f"init_info must be a dict, got {type(data).__name__}")
        fields = dataclasses.fields(cls)
        names = {f.name for f in fields}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"init_info: unknown keys {unknown} (known: {sorted(names)})")
        missing = sorted(f.name for f in fields if f.default is dataclasses.MISSING and f.name not in data)
        if missing:
            raise ValueError(f"init_info: missing keys {missing}")
        return cls(**data)
