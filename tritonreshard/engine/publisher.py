"""The trainer side of a refit group: the arena its shards live in, ``publish`` and ``fence``.

Who calls what (a trainer rank; :class:`tritonreshard.RefitTrainer` builds both)::

    arena = SourceArena(group, rank_plan.src_order, tensors)  # once: the shards move into an exported arena
    pub = Publisher(group, route, arena, sender=sender)      # each epoch, with the rank's route
    pub.fence()          # every reader of this arena acked the last version (and sends completed)
    optimizer.step()     # on arena.tensors (no copy per step)
    pub.publish()        # -> version start_version + 1, + 2, ...

One arena per rank holds all its local shards, in the group's buffer order
(:func:`~tritonreshard.planning.tensor_order`: same-geometry shards back to back, as the readers'
buffers are, so their copies differ by a constant address step). Next to it a control block: the published version, one
ack word per reader, heartbeats, the abort word and the doorbell that wakes waiters.
"""
from __future__ import annotations

import torch

from ..planning import BufferRef, Route
from ..transport import create_arena, create_control_block, pack_offsets
from .group import Group, check_timeout
from .heap import release_freed_heap
from .sources import Exported, OwnBuffer

__all__ = ["Publisher", "SourceArena"]

#: Re-pointed bytes between two trims of the C heap while an arena fills: the peak is the shards
#: once plus this much (a trim walks the heap: 0.26 ms measured after a 4 MiB free in a 1.6 GiB heap,
#: about 30 ms over a 1.6 GiB arena).
_TRIM_EVERY = 16 << 20


class SourceArena:
    """A trainer rank's local shards in one exported arena, with its control block.

    Args:
        group: the rank's group (joined). order: the names of ``tensors`` in the group's buffer
            order (``RankPlan.src_order``).
        tensors: ``{name: local shard}`` (validated by the endpoint), all on one device; copied into
            the arena once. ``params``: ``{name: nn.Parameter}`` re-pointed at the arena views.
        start_version: the version before the first ``publish()`` (a restarted trainer resumes its
            numbering from a checkpoint); readers see it at once.
        fsdp2: a :class:`~tritonreshard.engine.fsdp.FSDP2Source` when ``tensors`` are a
            ``fully_shard`` model's shards: each moves into the arena with FSDP's padding (``rebind``).
        readers: an elastic group's trainer: ack, heartbeat, join and admission words for every
            rank below ``readers`` (None: the group's ranks, no join words).
    """

    def __init__(self, group: Group, order, tensors: dict, *, params=None, start_version: int = 0, fsdp2=None,
                 readers: int | None = None):
        self.rank = group.rank
        names = list(order)
        assert set(names) == set(tensors), (names, sorted(tensors))

        def room(n):  # FSDP2 all-gathers its padded shard, so the arena holds the padding too
            return fsdp2.padded_numel(n) if fsdp2 is not None else tensors[n].numel()
        sizes = [room(n) * tensors[n].element_size() for n in names]
        offsets, total = pack_offsets(sizes)
        self.device = next(iter(tensors.values())).device if tensors else torch.device("cpu")
        self.arena = self.control = None
        self.tensors: dict[str, torch.Tensor] = {}
        self.bound: dict[str, torch.Tensor] = {}  # the caller's parameters re-pointed at the arena
        try:
            self.arena = create_arena(max(total, 1), self.device, secret=group.secret)
            n = group.world_size if readers is None else readers  # elastic: join words for every rank < readers
            self.control = create_control_block(n, n, secret=group.secret, joins=readers is not None)
        except BaseException:
            self.close()
            raise
        freed = 0
        for name, off, size in zip(names, offsets, sizes, strict=True):
            t = tensors[name]
            if fsdp2 is not None:  # FSDP2 all-gathers and steps on the arena from now on
                view = fsdp2.rebind(name, self.arena.tensor(off, size // t.element_size(), t.dtype))
            else:
                view = self.arena.tensor(off, t.shape, t.dtype)
                view.copy_(t.detach())  # the one copy: afterwards training runs on the arena
            self.tensors[name] = view
            if params and name in params:
                params[name].data = view  # its old storage goes once the caller holds it nowhere else
                self.bound[name] = params[name]
                freed += size
                if freed >= _TRIM_EVERY and self.device.type == "cpu":
                    # The old storage of most shards was on the C heap, which the arena (shared
                    # memory) never reuses: handed back as the arena fills, the peak stays near
                    # the shards once, not twice.
                    release_freed_heap()
                    freed = 0
        if freed and self.device.type == "cpu":
            release_freed_heap()
        self.control.publish(int(start_version))
        self.buffer = BufferRef("arena", self.rank)
        self.offsets = dict(zip(names, offsets, strict=True))
        self.exported = Exported(self.buffer, self.arena.export(), self.control.export(), dict(self.offsets))

    def check_bound(self) -> None:
        """Before a publish: every re-pointed parameter must still be a view of its arena shard.
        One re-pointed again since (``param.data = ...``, ``load_state_dict(assign=True)``,
        ``module.to(...)``) trains memory no reader sees: one ``ValueError`` names them all."""
        gone = [n for n, p in self.bound.items() if p.data_ptr() != self.tensors[n].data_ptr()
                or p.shape != self.tensors[n].shape or p.stride() != self.tensors[n].stride()]
        if gone:
            raise ValueError(f"publish (rank {self.rank}): {gone} no longer are views of the trainer's arena "
                             f"(re-pointed since the trainer bound them), so what trains them would never be "
                             f"published; train the trainer's tensors, or make a new trainer from the new tensors")

    @property
    def flat(self) -> torch.Tensor:
        """The whole arena as a flat uint8 tensor (offsets as in ``offsets``)."""
        return self.arena.tensor(0, (self.arena.nbytes,), torch.uint8)

    def own(self) -> OwnBuffer:
        """This arena as a copy source of this process (a colocated rank reads its own shards)."""
        return OwnBuffer(self.buffer, self.arena, self.control)

    def unlink(self) -> None:
        """After set-up: no new peer may map the arena."""
        self.arena.unlink()
        self.control.unlink()

    def abort(self) -> None:
        if self.control is not None:
            self.control.abort(self.rank)

    def close(self) -> None:
        """Release the arena and the control block (idempotent)."""
        self.tensors, self.bound = {}, {}
        if self.control is not None:
            self.control.close()
            self.control = None
        if self.arena is not None:
            self.arena.close()
            self.arena = None


class Publisher:
    """Trainer side of one rank for one epoch: ``publish`` and ``fence`` over its route.

    Args:
        group: the epoch's group. route: this rank's route (``fenced``: the readers on this host).
        arena: the rank's :class:`SourceArena`. sender: the rank's
            :class:`~tritonreshard.engine.sender.Sender` when its route sends to other hosts, else
            None. The publisher tells it each version (``sender.published``) and the fence asks it
            (``sender.sent``, ``sender.doorbell``, ``sender.raise_error``); nothing else passes.
    """

    def __init__(self, group: Group, route: Route, arena: SourceArena, *, sender=None):
        self.group, self.rank, self.route, self.arena = group, group.rank, route, arena
        self.sender = sender
        self.published = arena.control.published_version
        self._fenced_version = 0  # what fence() waits for: nothing read from this arena yet
        group.liveness.beat_into(arena.control)
        for r in route.fenced:
            if r != self.rank:
                group.liveness.watch(r, arena.control)

    def publish(self) -> int:
        """After ``optimizer.step()``: publish the arena's contents as the next version; returns it.

        On CUDA every stream's work on the device is finished first (``torch.cuda.synchronize``),
        so the version word never runs ahead of the data, whichever stream wrote it.
        """
        if self.arena.device.type == "cuda":
            torch.cuda.synchronize(self.arena.device)
        self.published += 1
        self._fenced_version = self.published
        self.arena.control.publish(self.published)
        if self.sender is not None:
            self.sender.published(self.published)
        return self.published

    def fence(self, timeout: float | None = None) -> None:
        """Before changing the weights again: wait until every rank on this host that reads the
        arena acked the last published version, and the sends to other hosts completed.

        Raises PeerDiedError if a reader died (the refit fails clearly: nothing is dropped
        silently), RefitError if a reader aborted, TimeoutError naming the readers still behind. A
        timeout fails only this call: ``fence(timeout=0)`` is a poll.
        """
        timeout = check_timeout("fence", timeout, self.group.timeout)
        v, control, readers, sender = self._fenced_version, self.arena.control, list(self.route.fenced), self.sender

        def behind():
            return {r: control.acked_version(r) for r in readers if control.acked_version(r) < v}

        def done():
            return not behind() and (sender is None or sender.sent(v))

        def doorbell():  # acks ring the arena's control block; the sender rings its own bell
            return control.doorbell() if sender is None or behind() else sender.doorbell()

        def status():
            out = f"still behind, rank: acked version = {behind()}"
            return out + (f"; cross-host sends to {list(self.route.receivers)} "
                          f"{'done' if sender.sent(v) else 'pending'}" if sender is not None else "")

        what = f"readers {readers} to ack version {v}" + (
            f" and the sends to ranks {list(self.route.receivers)}" if sender is not None else "")
        self.group.wait(done, what, timeout, peers=[r for r in readers if r != self.rank], controls=[control],
                        doorbell=doorbell, status=status)
        if sender is not None:
            sender.raise_error()

    @property
    def readers(self) -> dict[int, int]:
        """The ranks that read this arena, ``{rank: first version}``: every reader the route fences
        reads from version 1 (an elastic publisher's readers come and go)."""
        return {r: 1 for r in self.route.fenced if r != self.rank}

    @property
    def dropped(self) -> list[tuple[int, str]]:
        """``(rank, why)`` of every reader dropped this epoch: none here, where a dead reader fails
        the fence instead (an elastic publisher drops readers that leave or die)."""
        return []

    def close(self) -> None:
        """End this epoch's publishing (nothing runs in the background here)."""
