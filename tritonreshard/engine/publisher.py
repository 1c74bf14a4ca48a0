"""Publisher: the trainer side of a refit group (arena, publish, fence).

Who calls what (a trainer rank; :class:`tritonreshard.RefitTrainer` builds one)::

    pub.fence()          # every rank that reads this arena acked the last version
    optimizer.step()     # on pub.tensors (the arena: no copy per step)
    pub.publish()        # -> version start_version + 1, + 2, ...

One arena per rank holds all its local shards, same-geometry shards back to back (the torch backend
coalesces their copies). Next to it, a control block: the published version, one ack word per
reader, heartbeats, the abort word and the doorbell that wakes waiters.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .group import Group, check_timeout
from .rendezvous import register_plain
from ..planning import Plan
from ..transport import create_arena, create_control_block, pack_offsets

__all__ = ["Publisher", "Exports"]


@dataclass(frozen=True)
class Exports:
    """What a rank hands the group at set-up: its arena and control block handles (None for a rank
    without a source side) and the byte offset of each shard in the arena."""

    rank: int
    arena: object | None = None
    control: object | None = None
    offsets: dict = field(default_factory=dict)


register_plain(Exports)  # it travels through the store at set-up


class Publisher:
    """Trainer side of one rank for one group epoch.

    Args:
        group: the rank's :class:`~tritonreshard.engine.group.Group` (joined: ``group.members`` is set).
        plan: the group's plan.
        tensors: ``{name: local shard}`` (validated by the endpoint), all on one device; copied into
            the arena once. ``params``: ``{name: nn.Parameter}`` re-pointed at the arena views.
        start_version: the version before the first ``publish()`` (a restarted trainer resumes its
            numbering from a checkpoint).
        fsdp2: a :class:`~tritonreshard.engine.fsdp.FSDP2Source` when ``tensors`` are a ``fully_shard``
            model's shards: each moves into the arena with FSDP's padding (``rebind``).
    """

    def __init__(self, group: Group, plan: Plan, tensors: dict, *, params=None, start_version: int = 0,
                 fsdp2=None):
        self.group, self.rank = group, group.rank
        self.published = int(start_version)
        self._fenced_version = 0  # what fence() waits for: nothing read from this arena yet
        self.readers = tuple(plan.readers_of(self.rank))
        names = sorted(tensors, key=lambda n: (tuple(tensors[n].shape), str(tensors[n].dtype),
                                               repr(plan.dst_layouts.get(n)), n))
        def room(n):  # FSDP2 all-gathers its padded shard, so the arena holds the padding too
            return fsdp2.padded_numel(n) if fsdp2 is not None else tensors[n].numel()
        sizes = [room(n) * tensors[n].element_size() for n in names]
        offsets, total = pack_offsets(sizes)
        self.device = next(iter(tensors.values())).device if tensors else torch.device("cpu")
        self._arena = self._control = None
        self.tensors: dict[str, torch.Tensor] = {}
        self._arena = create_arena(max(total, 1), self.device, secret=group.secret)
        self._control = create_control_block(group.world_size, group.world_size, secret=group.secret)
        for name, off, size in zip(names, offsets, sizes):
            t = tensors[name]
            if fsdp2 is not None:  # FSDP2 all-gathers and steps on the arena from now on
                view = fsdp2.rebind(name, self._arena.tensor(off, size // t.element_size(), t.dtype))
            else:
                view = self._arena.tensor(off, t.shape, t.dtype)
                view.copy_(t)  # the one copy: afterwards training runs on the arena
            self.tensors[name] = view
            if params and name in params:
                params[name].data = view
        self._control.publish(self.published)
        self.exports = Exports(self.rank, self._arena.export(), self._control.export(), dict(zip(names, offsets)))
        #: Cross-host sends of a group spanning hosts (set by the endpoint; see ``_crosshost``).
        self.cross = None
        group.beat_into(self._control)
        for r in self.readers:
            if r != self.rank:
                group.watch(r, self._control)

    @property
    def arena_bytes(self) -> torch.Tensor:
        """The whole arena as a flat uint8 tensor (offsets as in ``exports.offsets``)."""
        return self._arena.tensor(0, (self._arena.nbytes,), torch.uint8)

    @property
    def control(self):
        """This rank's control block (read by its readers; the colocated subscriber reads it too)."""
        return self._control

    def unlink(self) -> None:
        """After set-up: no new peer may map the arena."""
        self._arena.unlink()
        self._control.unlink()

    def publish(self) -> int:
        """After ``optimizer.step()``: publish the arena's contents as the next version; returns it.

        On CUDA every stream's work on the device is finished first (``torch.cuda.synchronize``),
        so the version word never runs ahead of the data, whichever stream wrote it.
        """
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.published += 1
        self._fenced_version = self.published
        self._control.publish(self.published)
        if self.cross is not None:
            self.cross.published(self.published)
        return self.published

    def fence(self, timeout: float | None = None) -> None:
        """Before changing the weights again: wait until every rank that reads this arena acked the
        last published version (only those readers).

        Raises PeerDiedError if a reader died (the refit fails clearly: nothing is dropped
        silently), RefitError if a reader aborted, TimeoutError naming the readers still behind. A
        timeout fails only this call: ``fence(timeout=0)`` is a poll.
        """
        timeout = check_timeout("fence", timeout, self.group.timeout)
        v, control, readers = self._fenced_version, self._control, list(self.readers)

        def behind():
            return {r: control.acked_version(r) for r in readers if control.acked_version(r) < v}

        self.group.wait(lambda: not behind(), f"readers {readers} to ack version {v}", timeout,
                        peers=[r for r in readers if r != self.rank], controls=[control],
                        doorbell=control.doorbell,
                        status=lambda: f"still behind, rank: acked version = {behind()}")
        if self.cross is not None:  # readers on other hosts: the sends to their relays completed
            self.cross.fence(timeout)

    def fenced(self) -> bool:
        """True when every reader acked the last published version (no waiting)."""
        return (all(self._control.acked_version(r) >= self._fenced_version for r in self.readers)
                and (self.cross is None or self.cross.fenced()))

    def abort(self) -> None:
        if self._control is not None:
            self._control.abort(self.rank)

    def close(self) -> None:
        """Release the arena and the control block (idempotent)."""
        self.tensors = {}
        if self._control is not None:
            self._control.close()
            self._control = None
        if self._arena is not None:
            self._arena.close()
            self._arena = None
