"""How an inference rank holds its weights while it pulls: a :class:`BufferMode`, chosen once.

* :class:`Shadow`: two buffer sets; a pull writes the spare one (in the background if asked) and a
  swap installs it, so generation goes on meanwhile and a failed pull leaves the serving weights as
  they were;
* :class:`InPlace`: one buffer set, written by the pull itself (pause generation meanwhile); a pull
  that fails part-way leaves it torn (``consistent = False``);
* :class:`Spare`: one buffer set that nothing serves from (an engine copies each version out of it
  into its own parameters at install); pulls, background ones too, write it, and one that fails
  part-way tears the set, never the engine's weights. Half of :class:`Shadow`'s memory, for a
  caller that reads the set only between pulls (the serving seam's background pull).

Beside the mode, an in-place pull may stream some destinations through a :class:`LayerSink`
(``PullOptions(layers=)``): no buffer for them; each pull hands over their tensors a group at a
time (``open``), writes them, and gives them back (``close``), so an engine that post-processes
each layer (vLLM's layerwise reload) needs one layer of memory, not a set.

The serving buffers and the subscriber ask the mode (how many sets, which one a pull writes,
whether a failed pull tears them, whether a pull may run in the background) and never compare its
name. The string spellings (``"shadow"``, ``"inplace"``) are accepted where a mode enters from a
user (``PullOptions(mode=)``, the command line) and turned into these objects there, by
:func:`buffer_mode`; :class:`Spare` has none (the serving seam chooses it; pass the object).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar, Protocol, runtime_checkable

import torch

from ..kernels.backends import choose_by_name

__all__ = ["BUFFER_MODE_NAMES", "BufferMode", "InPlace", "LayerSink", "Shadow", "Spare", "buffer_mode"]


class BufferMode(ABC):
    """An inference rank's buffer mode. Subclasses are frozen dataclasses without fields: every
    instance of one is equal to every other."""

    #: The string spelling (``mode=``).
    name: ClassVar[str]

    @property
    @abstractmethod
    def sets(self) -> int:
        """How many buffer sets the rank holds."""

    @abstractmethod
    def spare(self, serving: int) -> int:
        """The set a pull writes while set ``serving`` serves."""

    @property
    @abstractmethod
    def tears(self) -> bool:
        """Whether a pull that fails part-way leaves the serving weights torn."""

    @property
    @abstractmethod
    def background(self) -> bool:
        """Whether a pull may run in the background (``start_pull`` ... ``swap``)."""

    def __str__(self) -> str:
        return self.name


@dataclass(frozen=True)
class Shadow(BufferMode):
    """Two buffer sets: pull into the spare one, then swap (one reference assignment)."""

    name: ClassVar[str] = "shadow"
    sets: ClassVar[int] = 2
    tears: ClassVar[bool] = False
    background: ClassVar[bool] = True

    def spare(self, serving: int) -> int:
        return 1 - serving


@dataclass(frozen=True)
class InPlace(BufferMode):
    """One buffer set, the serving one, written by each pull."""

    name: ClassVar[str] = "inplace"
    sets: ClassVar[int] = 1
    tears: ClassVar[bool] = True
    background: ClassVar[bool] = False

    def spare(self, serving: int) -> int:
        return serving


@dataclass(frozen=True)
class Spare(BufferMode):
    """One buffer set, written by every pull (in the background too) and read by the caller only
    between pulls: it copies each installed version out into weights of its own, so a pull that
    fails part-way tears this set (``consistent = False``) and never what is served."""

    name: ClassVar[str] = "spare"
    sets: ClassVar[int] = 1
    tears: ClassVar[bool] = True
    background: ClassVar[bool] = True

    def spare(self, serving: int) -> int:
        return serving


# Spare is left out on purpose: its contract (read the set only between pulls) is the serving
# seam's, which passes the object; a user's string picks one of the self-contained modes.
_BY_NAME = {m.name: m for m in (Shadow(), InPlace())}
#: The string spellings :func:`buffer_mode` accepts.
BUFFER_MODE_NAMES = tuple(_BY_NAME)


def buffer_mode(value, problems: list[str] | None = None, *, param: str = "mode") -> BufferMode | None:
    """``value`` as a :class:`BufferMode`: a mode as it is, a name of :data:`BUFFER_MODE_NAMES` as its
    mode (:func:`~tritonreshard.kernels.backends.choose_by_name`: with ``problems`` a bad value is
    appended there, without it is a ``ValueError``)."""
    return choose_by_name(value, BufferMode, _BY_NAME, "'shadow' or 'inplace'", problems, param)


@runtime_checkable
class LayerSink(Protocol):
    """Destinations an in-place pull streams a group at a time into tensors handed over at pull
    time (``PullOptions(layers=)``), instead of buffers it holds.

    ``groups``: the destination names, a sequence of groups in pull order (each name of this rank
    once; none also given as ``tensors=``). Each pull, after the rest: for each group ``g``,
    ``open(g)`` returns ``{name: tensor}`` for every name of the group (this rank's shard: its
    shape, dtype and device, contiguous), the pull writes them (the plan's zero fills included),
    waits for the copy, drops every reference it took to them, and calls ``close(g)`` (a sink may
    then hand the same memory to the next group). A pull that fails part-way leaves the groups before
    it written and the rest as they were (the mode tears: ``consistent = False``); ``close`` is not
    called for the group it failed in."""

    groups: Sequence[Sequence[str]]

    def open(self, group: int) -> Mapping[str, torch.Tensor]: ...

    def close(self, group: int) -> None: ...
