"""An endpoint's typed configuration, one small frozen dataclass per concern, each validated once
where it is made (one ``ValueError`` naming every problem):

* :class:`Meeting`: where a rank meets its group (rank, group size, store, group name, epoch);
* :class:`Timeouts`: how long set-up and each wait may take, and when a silent peer counts as dead;
* :class:`PullOptions`: how an inference rank pulls (buffer mode, copy backend, device, sources);
* membership (a :class:`~tritonreshard.engine.membership.Membership`: ``Fixed`` / ``Elastic``), the
  cross-host codec (a :class:`~tritonreshard.transport.codec.Codec`: ``Dense`` / ``Delta``), the
  buffer mode (:mod:`~tritonreshard.engine.modes`) and the copy backend
  (:mod:`~tritonreshard.kernels.backends`) live with the code that acts on them.

:func:`options` gathers one endpoint's configs, defaults included, into :class:`Options`.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch.distributed as dist

from ..kernels import AutoBackend, CopyBackend, copy_backend
from ..transport import Codec, Delta
from .membership import Fixed, Membership
from .modes import BufferMode, LayerSink, Shadow, buffer_mode
from .sources import Sources

__all__ = ["Meeting", "Options", "PullOptions", "Timeouts", "options"]


def _seconds(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


def _count(value, low: int) -> bool:
    """``value`` is None or an int (not a bool) >= ``low``."""
    return value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= low)


def _store_problem(store) -> str | None:
    if store is None or isinstance(store, dist.Store):
        return None
    if isinstance(store, str):
        host, sep, port = store.rpartition(":")
        if sep and host and port.isdigit():
            return None
    return f"store must be 'host:port', a torch.distributed.Store or None, got store={store!r}"


@dataclass(frozen=True)
class Meeting:
    """Where a rank meets its refit group (every role). Each field left None takes the launcher's
    value when the endpoint is made, as torchrun sets them:

    ``rank``: this process's global rank (the ranks used in the layouts' meshes). None: the
    initialised torch.distributed group's rank, else ``$RANK``. ``world_size``: number of processes
    in the refit group (trainers + inference ranks; a colocated process counts once). None:
    torch.distributed's world size, else ``$WORLD_SIZE``. ``store``: ``"host:port"`` of the group's
    TCPStore, a ``torch.distributed.Store``, or None: the initialised process group's store, else
    ``MASTER_ADDR``/``MASTER_PORT`` (as a client under torchrun, whose agent hosts that store).
    ``host_store``: with ``store="host:port"``: rank 0 hosts the store (None/True) or everyone
    connects as a client (False: a driver hosts it, e.g. so it outlives restarted ranks).
    ``group``: namespace of this group's keys in the store. ``epoch``: the group epoch (>= 0; None:
    0, or an elastic joiner's trainers' current one); keys live under ``trs/<group>/e<epoch>/``, so
    a new group forms on the same store while old keys are ignored.
    """

    rank: int | None = None
    world_size: int | None = None
    store: object = None
    host_store: bool | None = None
    group: str = "default"
    epoch: int | None = None

    def __post_init__(self):
        problems = [f"{name} must be an int >= {low} or None, got {name}={value!r}"
                    for name, value, low in (("rank", self.rank, 0), ("world_size", self.world_size, 1),
                                             ("epoch", self.epoch, 0)) if not _count(value, low)]
        store = _store_problem(self.store)
        if store:
            problems.append(store)
        if self.host_store is not None and not isinstance(self.host_store, bool):
            problems.append(f"host_store must be True, False or None, got host_store={self.host_store!r}")
        if not isinstance(self.group, str) or not self.group:
            problems.append(f"group must be a non-empty str, got group={self.group!r}")
        if problems:
            raise ValueError("Meeting: " + "; ".join(problems))


@dataclass(frozen=True)
class Timeouts:
    """``wait``: seconds for set-up and for each wait (fence, waiting for a version), the default of
    every call's ``timeout=``; ``peer``: seconds without a heartbeat after which a peer on another
    host counts as dead (a local peer counts as dead once its process exited, noticed at once; one
    alive but silent for ``peer`` is named in a wait's timeout error, see ``engine.liveness``)."""

    wait: float = 60.0
    peer: float = 10.0

    def __post_init__(self):
        problems = [f"{name} must be > 0 seconds, got {name}={value!r}"
                    for name, value in (("wait", self.wait), ("peer", self.peer)) if not _seconds(value)]
        if problems:
            raise ValueError("Timeouts: " + "; ".join(problems))


@dataclass(frozen=True)
class PullOptions:
    """How an inference rank pulls.

    ``mode``: a :class:`~tritonreshard.engine.modes.BufferMode`: ``trs.Shadow()`` (pull into a second
    buffer set, then ``swap``: generation goes on meanwhile) or ``trs.InPlace()`` (write the serving
    tensors: pause generation meanwhile). ``backend``: a :class:`~tritonreshard.kernels.CopyBackend`:
    ``trs.TritonBackend()`` (compiled on CUDA, interpreter on CPU: for debugging),
    ``trs.TorchBackend()`` (torch copies over the same descriptors; fast on CPU) or
    ``trs.AutoBackend()`` (triton on CUDA, torch on CPU; resolved once, where the endpoint knows its
    device: :meth:`for_device`). Both also take their names (``mode="inplace"``, ``backend="torch"``),
    turned into the objects here. ``device``: of the destination buffers (default: the given
    tensors' device, else cpu). ``sources``: where source bytes come from, a subclass of
    :class:`~tritonreshard.engine.sources.Sources` (default: this host's arenas and relay buffers,
    mapped once and read in place). ``layers``: a :class:`~tritonreshard.engine.modes.LayerSink`
    whose destinations each pull streams a group at a time into tensors the sink hands over,
    holding no buffer for them (with ``trs.InPlace()`` only)."""

    mode: BufferMode = Shadow()
    backend: CopyBackend = AutoBackend()
    device: object = None
    sources: type = Sources
    layers: object = None

    def __post_init__(self):
        problems: list[str] = []
        mode, backend = buffer_mode(self.mode, problems), copy_backend(self.backend, problems)
        if not (isinstance(self.sources, type) and issubclass(self.sources, Sources)):
            problems.append(f"sources must be a subclass of trs.engine.sources.Sources, got sources={self.sources!r}")
        if self.layers is not None and not isinstance(self.layers, LayerSink):
            problems.append(f"layers must be None or a trs.engine.modes.LayerSink (groups, open, close), got "
                            f"layers={self.layers!r}")
        elif self.layers is not None and mode is not None and (mode.sets != 1 or mode.background):
            problems.append(f"layers= streams into the tensors an engine serves while the pull runs: it needs "
                            f"mode=trs.InPlace(), got mode={mode}")
        if problems:
            raise ValueError("PullOptions: " + "; ".join(problems))
        object.__setattr__(self, "mode", mode)  # frozen: the names become their objects once, here
        object.__setattr__(self, "backend", backend)

    def for_device(self, device) -> PullOptions:
        """These options with the backend that runs on ``device`` (``AutoBackend`` resolved)."""
        return replace(self, backend=self.backend.for_device(device))


@dataclass(frozen=True)
class Options:
    """What :func:`options` resolved for one endpoint: every concern's object."""

    meeting: Meeting
    membership: Membership
    codec: Codec
    timeouts: Timeouts
    pull: PullOptions


#: What each config must be, in messages.
_KINDS = {"meeting": "trs.Meeting", "membership": "Membership (trs.Fixed() or trs.Elastic(replica=))",
          "codec": "Codec (trs.Delta() or trs.Dense())", "timeouts": "trs.Timeouts", "pull": "trs.PullOptions"}
_TYPES = {"meeting": Meeting, "membership": Membership, "codec": Codec, "timeouts": Timeouts, "pull": PullOptions}


def options(who: str, *, meeting=None, membership=None, codec=None, timeouts=None, pull=None,
            found=()) -> Options:
    """One endpoint's configs: the given objects, else the defaults (``Meeting()``, ``Fixed()``,
    ``Delta()``, ``Timeouts()``, ``PullOptions()``). A value of the wrong type: one ``ValueError``
    naming every one, after ``found`` (the problems the caller found in its other arguments' types).
    Each config checked its own values when it was made."""
    given = {"meeting": meeting, "membership": membership, "codec": codec, "timeouts": timeouts, "pull": pull}
    problems = [*found] + [f"{name} must be a {_KINDS[name]}, got {name}={value!r}" for name, value in given.items()
                           if value is not None and not isinstance(value, _TYPES[name])]
    if problems:
        raise ValueError(f"{who}: " + "; ".join(problems))
    return Options(meeting or Meeting(), membership or Fixed(), codec or Delta(), timeouts or Timeouts(),
                   pull or PullOptions())
