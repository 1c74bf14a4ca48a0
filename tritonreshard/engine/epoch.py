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

__all__ = ["Epoch"]


class Epoch:
    """One rank's set-up of one group epoch and what it produced: the group, the rank plan, the
    route and the cross-host link. ``trainer`` / ``inference``: the endpoint's sides (or None);
    they outlive the epoch, the parts they open in it do not (:meth:`close`)."""

    #: The sides the group must have (an elastic group's trainers meet alone: ``("src",)``).
    required_sides: tuple[str, ...] = ("src", "dst")
    #: How long this rank's join took, step by step (an elastic joiner's
    #: :class:`~tritonreshard.engine.elastic.JoinStats`); None for an epoch that every rank meets in.
    join_stats = None

    def __init__(self, group: Group, *, trainer=None, inference=None, device=None):
        self.group, self.trainer, self.inference, self.device = group, trainer, inference, device
        self.rank_plan: RankPlan | None = None
        self.route: Route | None = None
        self.cross: CrossHost | None = None
        #: Cross-host transfers this rank fetched at set-up (its own sends; its host's it planned).
        self.fetched_transfers = 0

    @property
    def sides(self) -> list:
        return [s for s in (self.trainer, self.inference) if s is not None]

    def set_up(self, member: Member) -> None:
        """Every set-up step (see the module docstring), in order."""
        group = self.group
        rp = self.agree(member)                                   # 1-3: hello, inputs, rank plan
        for side in self.sides:                                   #      (arena, serving buffers)
            side.prepare(group, rp)
        exported = self._exports()                                # 4: exports
        offsets = {(b.owner, n): o for b, e in exported.items() for n, o in e.offsets.items()}
        part = rp.host_part(offsets)
        self.route = route = self._transfers(rp, part, offsets)  # 5: transfers -> the route
        if route.spans_hosts:
            exported.update(self._relays(route))                 # 6: relays
        for side in self.sides:                                   #    publisher, subscriber (maps)
            side.open(group, route, exported, own=self._own_buffers())
        group.exchange("mapped", True)                            # 7: mapped
        self._done()                                              # 8: done

    def agree(self, member: Member) -> RankPlan:
        """Steps 1-3 (hello, inputs, rank plan): the group agrees on its inputs, or every rank raises
        the same ValueError; returns this rank's plan."""
        hellos = self._hello(member)
        agreed = self._inputs(member, hellos)
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
