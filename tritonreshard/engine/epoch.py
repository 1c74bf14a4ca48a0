"""One group epoch's set-up, as one script: every step once, in order, on every rank.

:meth:`Epoch.set_up` runs the steps below; each is a collective exchange through the group's store
(under ``trs/<group>/e<epoch>/``) or a pure planning step, and a rank that fails one raises before
anything moves (the store's host first waits until every rank read what it needs):

1. **hello**: every rank's slim :class:`~tritonreshard.engine.members.Member` (digests, host, device);
2. **inputs**: the planning inputs, once per side (and from ranks whose digests differ), then
   :func:`~tritonreshard.engine.members.validate_members`: every rank raises the same ValueError;
3. **rank plan**: :func:`~tritonreshard.planning.plan_rank` (pure); the sides set up what outlives
   epochs (the trainer's arena, the inference rank's serving buffers) in its buffer order;
4. **exports**: the arenas' handles and shard offsets;
5. **transfers** (several hosts only): each host's lowest rank posts its host's part of the host
   plan as the other hosts need it: a summary per host and, per sending rank, the transfers it
   sends. A rank fetches the summaries and its own sends, never another rank's; then its
   :class:`~tritonreshard.planning.Route` (``RankPlan.route``, pure);
6. **relays** (a group whose plan crosses hosts): the point-to-point link (collective), the trainer
   side's sender and the inference side's receiving relay, and the relays' buffer handles; then the
   publisher and the subscriber, which maps what it reads;
7. **mapped**: every rank mapped what it needs;
8. **done**: owners stop handing out their buffers, heartbeats and the cross-host threads start.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass

from ..planning import HostPlan, RankPlan, Route, host_outbox, plan_rank
from .crosshost import CrossHost
from .group import Group
from .members import (
    Member,
    device_problems,
    group_error,
    hello,
    inputs_wanted,
    side_inputs,
    validate_members,
    with_inputs,
)

__all__ = ["Epoch", "JoinStats", "StepClock"]


@dataclass(frozen=True)
class JoinStats:
    """How long a rank's join took, in milliseconds, step by step: ``meet`` (hello: every rank
    there; an elastic joiner: the posted group read from the store), ``check`` (the inputs and their
    validation), ``plan``, ``map`` (buffer set, exports, route, mapping the arenas, descriptor
    tables), ``admit`` (mapped/done; an elastic joiner: admission); ``first_version``: the first
    version it was admitted to read (0: any). ``steps``: the finer split, ``(step, wall ms, CPU ms of
    the joining thread)`` each (wall far above CPU: waiting for other ranks or for a core)."""

    meet_ms: float
    check_ms: float
    plan_ms: float
    map_ms: float
    admit_ms: float
    first_version: int
    steps: tuple = ()

    @property
    def total_ms(self) -> float:
        return self.meet_ms + self.check_ms + self.plan_ms + self.map_ms + self.admit_ms

    def steps_text(self) -> str:
        """``"hello 5.1/1.2, plan 16.0/8.1, ..."``: each step's wall/CPU ms, for a log line."""
        return ", ".join(f"{name} {wall:.1f}/{cpu:.1f}" for name, wall, cpu in self.steps)


class StepClock:
    """Wall and thread CPU time of a set-up's named steps, in ms (a step timed twice adds up).
    Thread CPU, not process CPU: an engine's other threads do not count against the join."""

    def __init__(self):
        self.ms: dict[str, tuple[float, float]] = {}

    @contextmanager
    def __call__(self, name: str):
        wall, cpu = time.perf_counter(), time.thread_time()
        try:
            yield
        finally:
            w, c = self.ms.get(name, (0.0, 0.0))
            self.ms[name] = (w + (time.perf_counter() - wall) * 1e3, c + (time.thread_time() - cpu) * 1e3)

    def wall(self, *names: str) -> float:
        return sum(self.ms.get(n, (0.0, 0.0))[0] for n in names)

    def steps(self) -> tuple:
        return tuple((n, w, c) for n, (w, c) in self.ms.items())


class Epoch:
    """One rank's set-up of one group epoch and what it produced: the group, the rank plan, the
    route and the cross-host link. ``trainer`` / ``inference``: the endpoint's sides (or None);
    they outlive the epoch, the parts they open in it do not (:meth:`close`)."""

    #: The sides the group must have (an elastic group's trainers meet alone: ``("src",)``).
    required_sides: tuple[str, ...] = ("src", "dst")
    #: How long this rank's set-up took, step by step (:class:`JoinStats`); None until it is done.
    join_stats: JoinStats | None = None

    def __init__(self, group: Group, *, trainer=None, inference=None, device=None):
        self.group, self.trainer, self.inference, self.device = group, trainer, inference, device
        self.rank_plan: RankPlan | None = None
        self.route: Route | None = None
        self.cross: CrossHost | None = None
        #: Cross-host transfers this rank fetched at set-up (its own sends; its host's it planned).
        self.fetched_transfers = 0
        self.clock = StepClock()

    @property
    def sides(self) -> list:
        return [s for s in (self.trainer, self.inference) if s is not None]

    def set_up(self, member: Member) -> None:
        """Every set-up step (see the module docstring), in order, each timed (:attr:`join_stats`)."""
        group, clock = self.group, self.clock
        rp = self.agree(member)                                   # 1-3: hello, inputs, rank plan
        with clock("alloc"):                                      #      (arena, serving buffers)
            for side in self.sides:
                side.prepare(group, rp)
        with clock("exports"):
            exported = self._exports()                            # 4: exports
        with clock("route"):
            offsets = {(b.owner, n): o for b, e in exported.items() for n, o in e.offsets.items()}
            part = rp.host_part(offsets)
            self.route = route = self._transfers(rp, part, offsets)  # 5: transfers -> the route
        if route.spans_hosts:
            with clock("relays"):
                exported.update(self._relays(route))             # 6: relays
        for side in self.sides:                                   #    publisher, subscriber (maps)
            side.open(group, route, exported, own=self._own_buffers(), clock=clock)
        with clock("done"):
            group.exchange("mapped", True)                        # 7: mapped
            self._done()                                          # 8: done
        self.join_stats = JoinStats(meet_ms=clock.wall("hello"), check_ms=clock.wall("inputs"),
                                    plan_ms=clock.wall("plan"), admit_ms=clock.wall("done"),
                                    map_ms=clock.wall("alloc", "exports", "route", "relays", "map", "tables", "open"),
                                    first_version=0, steps=clock.steps())

    def agree(self, member: Member) -> RankPlan:
        """Steps 1-3 (hello, inputs, rank plan): the group agrees on its inputs, or every rank raises
        the same ValueError; returns this rank's plan."""
        clock = self.clock
        with clock("hello"):
            hellos = self._hello(member)
        with clock("inputs"):
            agreed = self._inputs(member, hellos)
        with clock("plan"):
            self.rank_plan = self._rank_plan(agreed)
        return self.rank_plan

    # ------------------------------------------------------------------ the steps
    def _hello(self, member: Member) -> list[Member]:
        full, slim = hello(member, self.group.world_size)
        self._member = full
        return list(self.group.exchange("hello", slim).values())

    def _inputs(self, member: Member, hellos: list[Member]):
        group, full = self.group, self._member
        wanted = inputs_wanted(hellos)
        for side, r in wanted:
            if r == group.rank:
                group.post(f"inputs/{side}/{r}", side_inputs(full, side))
        inputs = {(side, r): group.fetch(f"inputs/{side}/{r}", f"the {side} planning inputs of rank {r}")
                  for side, r in wanted}
        members = with_inputs(hellos, inputs)
        group.post(f"hello-read/{group.rank}", True)
        self._members = {m.rank: m for m in members}
        try:
            return validate_members(members, group.world_size, self.required_sides)  # every rank raises the same
        except ValueError:
            group.outlive_store_readers("hello-read")  # so every rank reads the hellos and raises too
            raise

    def _rank_plan(self, agreed) -> RankPlan:
        group = self.group
        try:
            try:
                rp = plan_rank(agreed.src_layouts, agreed.dst_layouts, agreed.hosts, group.rank,
                               parts=agreed.parts, quant=agreed.quant)
            except (ValueError, TypeError) as exc:  # the planner's problems, named like the group's
                raise group_error(group.world_size, [str(exc)]) from None
            bad = device_problems(list(self._members.values())) if rp.several_hosts else []
            if bad:
                raise group_error(group.world_size, bad)
        except (ValueError, NotImplementedError):
            group.outlive_store_readers("hello-read")
            raise
        group.admit(self._members)
        return rp

    def _exports(self) -> dict:
        mine = self.trainer.exported if self.trainer is not None else ()
        return _merged(self.group.exchange("exports", mine))

    def _transfers(self, rp: RankPlan, part: HostPlan, offsets) -> Route:
        """Each host's lowest rank posts what its host's part tells the other hosts; every rank
        fetches the other hosts' summaries and the transfers it sends, nothing else."""
        if not rp.several_hosts:
            return rp.route(offsets, part)
        group, rank = self.group, self.group.rank
        summary, outbox = host_outbox(part, rp.host)
        if rank == min(r for r, h in group.hosts.items() if h == rp.host):
            for sender, transfers in outbox.items():
                group.post(f"transfers/{rp.host}/from/{sender}", transfers)
            group.post(f"transfers/{rp.host}", summary)
        summaries = {h: group.fetch(f"transfers/{h}", f"host {h!r}'s cross-host transfers")
                     for h in rp.host_names if h != rp.host}
        sends = {h: tuple(group.fetch(f"transfers/{h}/from/{rank}", f"the transfers rank {rank} sends to host {h!r}"))
                 for h, s in summaries.items() if rank in s.senders}
        self.fetched_transfers = sum(len(ts) for ts in sends.values())
        return rp.route(offsets, part, summaries, sends)

    def _relays(self, route: Route) -> dict:
        """Every rank opens the link (collective); senders and receiving relays open on it."""
        self.cross = CrossHost(self.group, route, self.device)
        mine = ()
        for side in self.sides:
            mine += side.open_cross_host(self.cross, route)
        return _merged(self.group.exchange("relays", mine))

    def _own_buffers(self) -> dict:
        """The buffers this process owns, read in place by its own subscriber (colocated ranks)."""
        own = [b for side in self.sides for b in side.own_buffers()]
        return {b.buffer: b for b in own}

    def _done(self) -> None:
        group = self.group
        group.post(f"setup-done/{group.rank}", True)
        group.outlive_store_readers("setup-done")
        group.start_heartbeats()
        for side in self.sides:  # everyone mapped what it needs: owners stop handing buffers out
            side.start()

    # ------------------------------------------------------------------ lifetime
    def close(self) -> None:
        """End the epoch on this rank: waits end, the sides' parts of it close, then the link."""
        self.group.close()
        for side in self.sides:
            side.close_epoch()
        if self.cross is not None:
            self.cross.close()
            self.cross = None


def _merged(exchanged: dict) -> dict:
    """``{BufferRef: Exported}`` from an exchange of each rank's tuple of exported buffers."""
    return {e.buffer: e for es in exchanged.values() for e in es}
