"""The seam between tritonreshard and a serving engine, written down: :class:`ServingEngine`.

A serving engine implements five methods, the only things that differ between engines:

* :meth:`~ServingEngine.rank_layout`: describe this rank (:class:`RankLayout`: the engine's name
  in the recipe registry, TP size and rank, device, the served model's config, dtype,
  quantization, expert parallelism);
* :meth:`~ServingEngine.check`: check the engine's own model against the recipe this rank got,
  before it joins (a mismatch is refused, never served);
* :meth:`~ServingEngine.agree`: gather every TP rank's ``(rank, version, error)`` over the
  engine's own TP group;
* :meth:`~ServingEngine.apply`: copy a pulled version into the engine's parameters;
* :meth:`~ServingEngine.fail`: report an agreed failure (raise it, or, where the engine's RPC
  cannot take an exception on every rank, raise on one rank and return on the others).

and may implement three more (none does anything by default): :meth:`~ServingEngine.direct_tensors`
(the parameters an inline pull may write directly, with no buffer: those in load format),
:meth:`~ServingEngine.layer_sink` (the rest, streamed a layer at a time into load-format tensors
the engine hands over and post-processes) and :meth:`~ServingEngine.writing_served` (told just
before such a pull writes them); it inherits the rest, the same for every engine:
:meth:`~ServingEngine.join_group` (the recipe from the registry, the rank's place, the check,
the pull mode, the join), :meth:`~ServingEngine.start_pulling`, :meth:`~ServingEngine.refit`
(check, agree, obtain, agree, apply: all TP ranks or none) and :meth:`~ServingEngine.leave_group`.
It is generic over its init info (a :class:`~.schema.ServingInit` subclass: an engine adds its
fields and checks) and its update info (:class:`UpdateInfo` or a subclass), as an engine's own
weight-transfer interface usually is.

Implemented by the engine packages built on it (their weight-transfer engine, their LoRA slot)
and by the plain torch engine of ``tests/_tp_engine.py``; docs/code-layout.md ("Adding a serving engine") lists
the files an engine touches. Importing this module imports no engine.
"""
from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import torch

from .. import RefitInference
from ..engine import LayerSink
from .layout import ServingRank, serving_rank
from .pull import BackgroundPull, DirectPull, InlinePull, pull_mode
from .registry import recipe_for
from .schema import ServingInit
from .session import refit

__all__ = ["ServingEngine", "RankLayout", "UpdateInfo", "Joined"]


@dataclass
class UpdateInfo:
    """What one refit is asked: ``version`` to install (None: the newest any TP rank pulled or is
    pulling, else the next one published) and ``timeout`` in seconds (None: the init info's)."""

    version: int | None = None
    timeout: float | None = None


@dataclass(frozen=True)
class RankLayout:
    """One engine rank, as the seam needs it. ``engine``: the engine's key in the recipe registry
    (:func:`~.registry.register_recipe`); ``tp`` / ``tp_rank``: its TP size and rank; ``device``:
    where its buffers live; ``config``: the served model's config (a ``transformers`` config for an
    HF-named engine; whatever the engine's builder reads); ``dtype``: the served parameters' dtype;
    ``quantization``: the recipe's (e.g. ``"fp8-block"``); ``expert_parallel``: experts split over
    the TP ranks instead of sharded."""

    engine: str
    tp: int
    tp_rank: int
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    config: object = None
    dtype: torch.dtype | None = None
    quantization: str | None = None
    expert_parallel: bool = False


@dataclass
class Joined:
    """What a rank holds once it joined: its place (rank, recipe, group kind), its inference
    endpoint, its pull mode, the version of this group it serves (0: none yet), the refit's
    default timeout, how long joining took, and the destinations the pull writes in the engine's
    own parameters (``direct``: a :class:`~.pull.DirectPull`'s; empty for the other modes)."""

    place: ServingRank
    sub: RefitInference
    pull: BackgroundPull | InlinePull | DirectPull
    timeout: float
    join_ms: float
    installed: int = 0
    direct: frozenset = frozenset()
    layers: LayerSink | None = None
    streamed: frozenset = frozenset()   # the destinations the layer sink streams
    # Fixed at the join: the bytes of the one buffer set (every destination neither written directly
    # nor streamed), of the largest streamed group (the most load-format memory the engine holds at
    # once for them), and of what each pull writes straight into the engine's parameters / streams.
    set_bytes: int = 0
    layer_bytes: int = 0
    direct_bytes: int = 0
    streamed_bytes: int = 0

    @property
    def spec(self):
        return self.place.spec

    @property
    def rank(self) -> int:
        return self.place.rank


TInit = TypeVar("TInit", bound=ServingInit)
TUpdate = TypeVar("TUpdate", bound=UpdateInfo)


class ServingEngine(ABC, Generic[TInit, TUpdate]):
    """One rank of a serving engine in a refit group (see the module docstring). Subclasses set
    ``init_info_cls`` / ``update_info_cls`` and implement the five abstract methods; ``joined`` is
    None until :meth:`join_group` succeeded."""

    init_info_cls: type = ServingInit
    update_info_cls: type = UpdateInfo
    joined: Joined | None = None

    # ------------------------------------------------------------------ what an engine writes
    @abstractmethod
    def rank_layout(self, init: TInit) -> RankLayout:
        """This rank, for the recipe registry and the join."""

    @abstractmethod
    def check(self, place: ServingRank) -> None:
        """Refuse (``ValueError``) when the engine's own model does not match ``place.spec`` on
        ``place.rank``; runs once, before joining."""

    @abstractmethod
    def agree(self, version: int | None, error: BaseException | None) -> list[tuple]:
        """Every TP rank's ``(rank, version, error text)`` (:func:`~.session.outcome` makes one),
        gathered over the engine's TP group in TP rank order; every TP rank calls it together."""

    @abstractmethod
    def apply(self, tensors: dict[str, torch.Tensor]) -> dict:
        """Copy ``{dst name: this rank's shard}`` into the engine's parameters; returns the time
        split in ms (at least ``copy_ms`` and ``post_ms``)."""

    @abstractmethod
    def fail(self, outcomes: Sequence[tuple], cause: BaseException | None) -> None:
        """Report the agreed failure of a refit (:func:`~.session.failure_text` says why): raise,
        or return on the ranks that must not (the refit then returns None there)."""

    # ------------------------------------------------------------------ what an engine may write
    def direct_tensors(self, place: ServingRank) -> dict[str, torch.Tensor]:
        """``{dst name: the engine's parameter}`` that an inline pull may write directly (the
        :class:`~.pull.DirectPull` of ``prefetch=False, direct=True``): parameters whose live tensor
        *is* this rank's load-format shard (shape ``place.spec.dst[name].local_shape(place.rank)``,
        its dtype, contiguous) and that the engine serves without post-processing. Called once,
        after :meth:`check`. None by default: every destination goes through the buffer set."""
        return {}

    def layer_sink(self, place: ServingRank, direct: dict[str, torch.Tensor]) -> LayerSink | None:
        """For a direct pull, the destinations not in ``direct`` that the engine takes a layer at a
        time (a :class:`~tritonreshard.engine.modes.LayerSink`: ``groups`` of dst names, ``open(g)``
        hands over their load-format tensors, ``close(g)`` post-processes them): no buffer set for
        them, one layer of load-format memory at a time. Called once, after :meth:`direct_tensors`.
        None by default: they go through the buffer set and :meth:`apply`."""
        return None

    def writing_served(self) -> None:
        """Called on every TP rank just before a direct pull may write :meth:`direct_tensors`:
        until the refit's apply returns, the engine's weights may be part old, part new (an engine
        that can refuse to serve marks them so). Nothing by default."""

    # ------------------------------------------------------------------ what the seam does
    def join_group(self, init: TInit, *, logger: logging.Logger | None = None,
                   served: Callable[[], int] = lambda: 0, **extra) -> Joined:
        """Join the refit group ``init`` describes: the recipe of ``rank_layout(init).engine`` for
        ``init.source`` (``extra`` goes to its builder), this rank's place, :meth:`check`, the pull
        mode (background, inline or direct, chosen once from ``init.prefetch``, ``init.direct`` and
        :meth:`direct_tensors`; ``logger`` / ``served``: where and with which served version a
        background failure is logged) and the endpoint. The pull starts with :meth:`start_pulling`
        (an engine may first agree that every rank joined)."""
        if self.joined is not None:
            raise RuntimeError(f"{type(self).__name__}: already joined a refit group (leave_group first)")
        layout = self.rank_layout(init)
        place = serving_rank(init, recipe_for(init, layout, **extra), tp=layout.tp, tp_rank=layout.tp_rank)
        self.check(place)
        direct = dict(self.direct_tensors(place)) if init.direct and not init.prefetch else {}
        layers = self.layer_sink(place, direct) if init.direct and not init.prefetch else None
        pull = pull_mode(init.prefetch, direct=bool(direct) or layers is not None, rank=place.rank, logger=logger,
                         served=served)
        streamed = frozenset(n for g in layers.groups for n in g) if layers is not None else frozenset()
        sizes = dict(set_bytes=place.set_bytes(direct.keys() | streamed), layer_bytes=place.layer_bytes(layers),
                     direct_bytes=place.buffer_bytes - place.set_bytes(direct),
                     streamed_bytes=place.buffer_bytes - place.set_bytes(streamed))
        set_bytes, layer_bytes = sizes["set_bytes"], sizes["layer_bytes"]
        needed = pull.BUFFER_SETS * set_bytes + layer_bytes
        if init.max_refit_bytes is not None and needed > init.max_refit_bytes:
            mode = ("background pull (prefetch=True)" if pull.BACKGROUND else
                    f"direct pull (prefetch=False; of {len(place.spec.dst)} parameters {len(direct)} written in "
                    f"place, {len(streamed)} a layer at a time)" if pull.WRITES_SERVED else
                    "inline pull (prefetch=False)")
            raise ValueError(f"init_info max_refit_bytes={init.max_refit_bytes}: the refit of rank {place.rank} "
                             f"needs {needed} bytes beside the engine's weights with the {mode}: "
                             f"{pull.BUFFER_SETS} buffer set(s) ({pull.MODE}) of {set_bytes} bytes"
                             + (f" and its largest layer, {layer_bytes} bytes" if layers is not None else ""))
        sub, join_ms = place.join(device=layout.device, mode=pull.MODE, tensors=direct or None, layers=layers)
        self.joined = Joined(place, sub, pull, init.timeout, join_ms, direct=frozenset(direct), layers=layers,
                             streamed=streamed, **sizes)
        return self.joined

    def start_pulling(self) -> None:
        """Start the background pull (nothing for an inline pull)."""
        self.joined.pull.start(self.joined.sub)

    def refit(self, update: TUpdate) -> dict | None:
        """Install ``update.version`` on every TP rank or on none (every TP rank calls it together):
        :func:`~.session.refit` with this engine's agreement, apply and failure. Returns its stats,
        or None where :meth:`fail` returned; ``direct_bytes`` / ``streamed_bytes``: what the pull
        wrote in the engine's own parameters / a layer at a time into the tensors it handed over
        (a direct pull), never copied again by the apply."""
        j = self.joined
        # What a direct pull wrote is in the engine's parameters already (or was streamed into them
        # layer by layer): the apply gets the rest.
        apply = self.apply if not (j.direct or j.streamed) else lambda bufs: self.apply(
            {n: t for n, t in bufs.items() if n not in j.direct and n not in j.streamed})
        stats = refit(j.sub, j.pull, requested=update.version, timeout=j.timeout if update.timeout is None else
                      update.timeout, installed=j.installed, agree=self.agree, apply=apply, fail=self.fail,
                      writing=self.writing_served)
        if stats is not None:
            j.installed = stats["version"]
            # of the pull's bytes, those it wrote straight into the engine's parameters (a direct pull)
            # or into the load-format tensors the engine handed over a layer at a time
            stats["direct_bytes"], stats["streamed_bytes"] = j.direct_bytes, j.streamed_bytes
        return stats

    def leave_group(self, *, abort: bool = False) -> None:
        """Stop the pull and leave the group (``abort``: after a failed set-up); a no-op when not joined."""
        j, self.joined = self.joined, None
        if j is not None:
            j.pull.stop()
            j.sub.close(abort=abort)
