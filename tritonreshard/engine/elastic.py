"""Elastic groups: inference replicas join a running group, leave it or die, and nobody stops.

An elastic group (``elastic=True`` on every rank) meets in two parts:

* **the trainers** meet alone (``world_size`` = the trainer ranks), as one epoch
  (:class:`TrainerEpoch`): they agree on their layouts, make their arenas in
  :func:`~tritonreshard.planning.source_order`, and rank 0 posts what a joiner needs
  (:class:`ElasticGroup`: the source layouts, the trainers' members and exported arenas) and the
  epoch's number under ``trs/<group>/elastic/epoch``. The arenas keep being handed out (to
  processes of the same uid that prove the group secret) for the epoch's life;
* **every inference rank joins** (:class:`JoinerEpoch`), replica by replica, whenever it starts:
  *meet* (read the posted group), *check* (its rank, its replica index, its layouts against the
  replicas already in, one ``ValueError`` naming every problem), *plan* (its own reads only:
  ``plan_rank`` for its rank), *map* (the arenas it reads, its descriptor tables) and *admit* (each
  source admits it, :meth:`~tritonreshard.engine.subscriber.Subscriber.join`).

A join redoes the joiner's share only: the trainers plan nothing and map nothing; each trainer it
reads admits it through its control block (a join word the reader writes, an admission word the
trainer's admitter thread writes: :class:`ElasticPublisher`), and from then on fences it. The other
replicas do nothing at all.

Versions: a trainer admits a reader at the version its arena holds while that version is stable
(published, and the fence that ends it not yet returned), else at the next one. A reader reads from
the newest version any of its sources admitted it at, and acks the one before to the others, so no
fence waits for a version the reader never reads and no reader reads an arena being written.

Leaving: a reader that closes clears its join words (the trainers drop it at once); one that dies
(its pidfd says it exited) is dropped by the trainers' admitter threads and fences at once; one
that is alive but silent (hung, or starved by a loaded machine) only once its silence outlasted the
wait timeout (``Timeouts(wait=)``), not ``peer_timeout``: a fence meanwhile may time out. ``fence()`` never waits for a
dropped reader, and never raises for one: the group goes on. A trainer that dies still ends the epoch: the replicas
``rejoin()`` the restarted trainers' next epoch through the same join.

Elastic groups run on one host (their readers map the trainers' arenas in place).
"""
from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from dataclasses import dataclass

import numpy as np
import torch.distributed as dist

from ..layout import Layout
from ..planning import Route, plan_rank, source_order
from ..transport import wait as _wait
from . import rendezvous as rdv
from .epoch import Epoch, JoinStats
from .group import Group, check_timeout
from .liveness import proc_state
from .members import Member, group_error, input_differences, inputs_digest
from .publisher import Publisher

__all__ = ["ElasticGroup", "ElasticPublisher", "JoinStats", "JoinerEpoch", "MAX_RANKS", "TrainerEpoch",
           "current_epoch", "epoch_key", "replica_template"]

logger = logging.getLogger(__name__)

#: Ranks an elastic group's trainers have ack, heartbeat, join and admission words for: every
#: rank of an elastic group (trainers and readers) is below it. 256 KiB of control block per trainer.
MAX_RANKS = 1024


@dataclass(frozen=True)
class ElasticGroup:
    """What an elastic group's trainers post for joiners (trainer rank 0, once per epoch)."""

    epoch: int
    src_layouts: dict
    members: tuple
    exported: tuple


rdv.register_plain(ElasticGroup)


def epoch_key(name: str) -> str:
    """The base-store key holding an elastic group's current epoch (posted by trainer rank 0)."""
    return f"trs/{name}/elastic/epoch"


def current_epoch(base_store, name: str, timeout: float, *, after: int = -1) -> int:
    """The epoch of group ``name``'s trainers, once it is later than ``after`` (waits up to
    ``timeout`` seconds: restarted trainers post theirs when they met)."""
    key = epoch_key(name)
    deadline = time.monotonic() + timeout
    while True:
        epoch = rdv.fetch(base_store, key, timeout=max(0.0, deadline - time.monotonic()),
                          what=f"elastic group {name!r}'s trainers to meet")
        if epoch > after:
            return epoch
        if time.monotonic() >= deadline:
            raise TimeoutError(f"timed out after {timeout:g} s waiting for elastic group {name!r}'s trainers "
                               f"to meet in an epoch after {after}")
        time.sleep(0.01)


def replica_template(layouts: dict) -> dict:
    """A replica's layouts with its ranks renumbered 0, 1, ... in order: what every replica of an
    elastic group must bring alike (shapes, dtypes, meshes, placements), whatever its ranks."""
    ranks = sorted({r for lay in layouts.values() for r in lay.ranks})
    pos = {r: i for i, r in enumerate(ranks)}
    return {n: Layout(lay.shape, np.array([pos[r] for r in lay.ranks]).reshape(lay.mesh_shape).tolist(),
                      lay.placements, lay.dtype) for n, lay in layouts.items()}


# ---------------------------------------------------------------------------------------- trainers
class ElasticPublisher(Publisher):
    """An elastic group's trainer side for one epoch: ``publish`` and ``fence`` over the readers it
    admitted, and an admitter thread that admits joiners and drops leavers and the dead.

    ``readers``: ``{rank: first version}`` of the readers admitted now; ``dropped``: ``(rank, why)``
    of every reader dropped this epoch."""

    def __init__(self, group: Group, route: Route, arena, *, sender=None):
        super().__init__(group, route, arena, sender=sender)
        self._lock = threading.Lock()
        self._stable = False  # the arena holds the published version, and the fence ending it has not returned
        self._admitted: dict[int, tuple[int, int]] = {}  # reader -> (pid, first version)
        self.admissions = 0
        self._drops: list[tuple[int, str]] = []
        self._next_reap = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"trs-admit-{self.rank}")
        self._thread.start()

    @property
    def readers(self) -> dict[int, int]:
        with self._lock:
            return {r: v for r, (_, v) in sorted(self._admitted.items())}

    @property
    def dropped(self) -> list[tuple[int, str]]:
        with self._lock:
            return list(self._drops)

    def _run(self) -> None:
        control = self.arena.control
        while not self._stop.is_set():
            addr, value = control.doorbell()
            with self._lock:
                if self._stop.is_set():
                    return
                self._scan()
                self._reap()
            _wait.futex_wait(addr, value, _wait.SLICE_S)

    def _scan(self) -> None:
        """Admit every reader that asked and is not in; drop every one that left (lock held)."""
        control, live = self.arena.control, self.group.liveness
        joins = control.join_requests()
        for r, (pid, _) in list(self._admitted.items()):
            if joins[r] != pid:  # it cleared its join word (or another process took the rank)
                self._drop(r, f"rank {r} (pid {pid}) left", dead=False)
        for r in np.flatnonzero(joins).tolist():
            if r in self._admitted or r == self.rank:
                continue
            pid = int(joins[r])
            version = self.published if self._stable else self.published + 1
            live.add_peer(Member(r, pid, live.host, "reader"))
            live.watch(r, control)
            control.admit(r, version)
            self._admitted[r] = (pid, version)
            self.admissions += 1

    def _reap(self, force: bool = False) -> None:
        """Drop admitted readers that died or hung (lock held; at most every ``SLICE_S``)."""
        now = time.monotonic()
        if not force and now < self._next_reap:
            return
        self._next_reap = now + _wait.SLICE_S
        self._scan()  # one that cleared its join word and then exited left: it did not die
        for r in list(self._admitted):
            live = self.group.liveness
            reason = live.dead_reason(r)
            if not reason and live.silent_s(r) > self.group.timeout:  # hung for a whole wait timeout
                reason = f"{live.silence(r)}; dropped after the wait timeout ({self.group.timeout:g} s)"
            if reason:
                self._drop(r, reason, dead=True)

    def _drop(self, r: int, why: str, *, dead: bool) -> None:
        pid, _ = self._admitted.pop(r)
        self.arena.control.drop(r, pid if dead else None)
        self.group.liveness.forget(r)
        self._drops.append((r, why))

    def publish(self) -> int:
        with self._lock:  # a reader admitted from here on reads this version
            version = super().publish()
            self._stable = True
        return version

    def fence(self, timeout: float | None = None) -> None:
        """Wait until every admitted reader that reads the last published version acked it. Readers
        that leave or die meanwhile are dropped (never waited for, never an error)."""
        timeout = check_timeout("fence", timeout, self.group.timeout)
        v, control = self._fenced_version, self.arena.control

        def behind():
            return {r: control.acked_version(r) for r, (_, first) in self._admitted.items()
                    if first <= v and control.acked_version(r) < v}

        def done():
            with self._lock:
                self._reap()
                if behind():
                    return False
                self._stable = False  # from here the trainer may write the arena: admit at the next version
                return True

        def status():
            with self._lock:
                return f"still behind, rank: acked version = {behind()}"

        self.group.wait(done, f"the readers rank {self.rank} admitted to ack version {v}", timeout,
                        controls=[control], doorbell=control.doorbell, status=status)

    def close(self) -> None:
        """Stop the admitter thread (idempotent)."""
        self._stop.set()
        self.arena.control.ring()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(5.0)
        self._thread = None


class TrainerEpoch(Epoch):
    """An elastic group's trainers meet (hello, inputs, arenas, exports), without inference ranks;
    rank 0 posts the group for joiners, then the epoch's number."""

    required_sides = ("src",)

    def set_up(self, member: Member) -> None:
        group = self.group
        hellos = self._hello(member)
        agreed = self._inputs(member, hellos)
        if len(set(agreed.hosts.values())) > 1:
            group.outlive_store_readers("hello-read")
            raise group_error(group.world_size, [f"an elastic group runs on one host, its trainers are on hosts "
                                                 f"{sorted(set(agreed.hosts.values()))}"])
        group.admit(self._members)
        self.trainer.make_arena(group, source_order(agreed.src_layouts, group.rank), readers=MAX_RANKS)
        exported = self._exports()
        self.route = Route(rank=group.rank, host=group.host, spans_hosts=False, reads=(), fills=(), fenced=(),
                           sends=(), receives=(), buffer_bytes=0, buffer_readers=(), messages=())
        self.trainer.open(group, self.route, exported, own={})
        if group.rank == 0:
            group.post("elastic/group", ElasticGroup(group.epoch, agreed.src_layouts, tuple(hellos),
                                                     tuple(exported.values())))
        group.exchange("mapped", True)  # every trainer admits readers before the epoch is announced
        if group.rank == 0:
            rdv.publish(group.base_store, epoch_key(group.name), group.epoch)
        self._done()

    def close(self) -> None:
        if self.trainer.publisher is not None:
            self.trainer.publisher.close()  # no admission after this rank's liveness closed
        super().close()


# ---------------------------------------------------------------------------------------- joiners
def _claim(store, key: str, mine: str, what: str) -> str | None:
    """Claim ``key`` for this process (value ``mine``: ``pid rank replica host``); None when claimed,
    else who holds it. A holder on this host whose process is gone left a stale claim: taken over."""
    my_pid, _, _, my_host = mine.split(" ", 3)
    for _ in range(3):
        cur = store.compare_set(key, "", mine).decode()
        if cur == mine:
            return None
        pid, rank, replica, host = cur.split(" ", 3)
        if (pid, host) == (my_pid, my_host):
            store.set(key, mine)  # this process's own (a rejoin)
            return None
        state = proc_state(int(pid)) if host == my_host else "?"
        if state is not None and state not in "ZX":
            return f"{what} is already in use by rank {rank} of replica {replica} (pid {pid} on host {host!r})"
        store.compare_set(key, cur, "")  # a dead holder's claim
    return f"{what} is contested (its claim changed three times while this rank tried to take it)"


class JoinerEpoch(Epoch):
    """An elastic group's inference rank joins the trainers' epoch (see the module docstring).

    ``replica``: this rank's replica index; its replica is the ranks its layouts place shards on.
    After :meth:`set_up`, ``join_stats`` says how long each step took (:class:`JoinStats`)."""

    def __init__(self, group: Group, *, inference, device=None, replica: int, name: str):
        super().__init__(group, inference=inference, device=device)
        self.replica, self.name = replica, name
        self.join_stats: JoinStats | None = None
        self._claims: list[tuple[str, str]] = []

    def set_up(self, member: Member) -> None:
        group, clock = self.group, time.perf_counter
        t0 = clock()
        info = group.fetch("elastic/group", f"elastic group {self.name!r}'s trainers of epoch {group.epoch}")
        t1 = clock()
        problems, hosts = self._problems(member, info)
        if problems:
            raise self._error(problems)
        t2 = clock()
        try:
            rp = plan_rank(info.src_layouts, member.dst_layouts, hosts, group.rank, parts=member.dst_parts,
                           quant=member.dst_quant)
        except (ValueError, TypeError, NotImplementedError) as exc:  # the planner's problems, named as the group's
            raise self._error([str(exc)]) from None
        t3 = clock()
        problems = self._template_problems(member) or self._claim(member)
        if problems:
            raise self._error(problems)
        t4 = clock()
        group.admit({**{m.rank: m for m in info.members}, member.rank: member})
        self.rank_plan = rp
        self.inference.prepare(group, rp)
        exported = {e.buffer: e for e in info.exported}
        offsets = {(b.owner, n): o for b, e in exported.items() for n, o in e.offsets.items()}
        self.route = rp.local_route(offsets)  # its own reads: no host plan (it fences nobody, sends nothing)
        self.inference.open(group, self.route, exported, own={})
        t5 = clock()
        sub = self.inference.subscriber
        first = sub.join(group.timeout) if sub is not None else 0
        t6 = clock()
        group.start_heartbeats()
        ms = [(b - a) * 1e3 for a, b in ((t0, t1), (t1, t2), (t2, t3), (t3, t4), (t4, t5), (t5, t6))]
        self.join_stats = JoinStats(meet_ms=ms[0], check_ms=ms[1] + ms[3], plan_ms=ms[2], map_ms=ms[4], admit_ms=ms[5],
                               first_version=first)

    def _error(self, problems) -> ValueError:
        return ValueError(f"elastic group {self.name!r} epoch {self.group.epoch}: replica {self.replica} rank "
                          f"{self.group.rank} can't join: {len(problems)} problem(s), nothing was moved:\n  - "
                          + "\n  - ".join(problems))

    def _problems(self, member: Member, info: ElasticGroup) -> tuple[list[str], dict]:
        """The joiner's own problems and the group's host map (trainers and this replica)."""
        rank, problems = self.group.rank, [*member.problems]
        trainers = {m.rank: m for m in info.members}
        replica_ranks = sorted({r for lay in (member.dst_layouts or {}).values() for r in lay.ranks})
        if rank in trainers:
            problems.append(f"rank {rank} is a trainer rank of this group (trainers: {sorted(trainers)})")
        clash = sorted(set(replica_ranks) & set(trainers))
        if clash and rank not in trainers:
            problems.append(f"the replica's layouts place shards on trainer rank(s) {clash}")
        if rank not in replica_ranks:
            problems.append(f"rank {rank} holds no shard of its replica's layouts (ranks {replica_ranks})")
        big = [r for r in replica_ranks if r >= MAX_RANKS]
        if big:
            problems.append(f"an elastic group's ranks must be below {MAX_RANKS}, the replica has ranks {big}")
        other = sorted({m.host for m in trainers.values()} - {member.host})
        if other:
            problems.append(f"an elastic group runs on one host: this rank is on {member.host!r}, trainers on "
                            f"{other}")
        hosts = {r: m.host for r, m in trainers.items()}
        hosts.update({r: member.host for r in replica_ranks})
        return problems, hosts

    def _template_problems(self, member: Member) -> list[str]:
        """This replica's inputs against the first replica's of the epoch (that one posts them)."""
        tmpl = replica_template(member.dst_layouts)
        quant = dict(sorted((member.dst_quant or {}).items()))
        digest = hashlib.sha256((inputs_digest(tmpl, member.dst_parts) + repr(quant)).encode()).hexdigest()
        store = self.group.store
        if not store.check([f"elastic/template/{digest}"]):
            self.group.post(f"elastic/template/{digest}", (tmpl, member.dst_parts or {}, quant))
        ref = store.compare_set("elastic/template", "", digest).decode()
        if ref == digest:
            return []
        layouts, parts, ref_quant = self.group.fetch(f"elastic/template/{ref}", "the group's replica template")
        mine = Member(member.rank, member.pid, member.host, member.device, dst_layouts=tmpl,
                      dst_parts=member.dst_parts or {}, dst_quant=quant)
        first = Member(-1, 0, member.host, member.device, dst_layouts=layouts, dst_parts=parts, dst_quant=ref_quant)
        return input_differences(first, mine, f"replica {self.replica} (rank {member.rank}, renumbered)") or [
            f"replica {self.replica}'s inputs differ from the group's (digest {digest[:12]} != {ref[:12]})"]

    def _claim(self, member: Member) -> list[str]:
        """Claim this rank and its place in replica ``replica``; refused by name when in use."""
        base, rank = self.group.base_store, self.group.rank
        ranks = sorted({r for lay in member.dst_layouts.values() for r in lay.ranks})
        mine = f"{os.getpid()} {rank} {self.replica} {member.host}"
        for key, what in ((f"trs/{self.name}/elastic/rank/{rank}", f"rank {rank}"),
                          (f"trs/{self.name}/elastic/replica/{self.replica}/{ranks.index(rank)}",
                           f"replica {self.replica} (its rank #{ranks.index(rank)})")):
            held = _claim(base, key, mine, what)
            if held:
                self.release()
                return [held]
            self._claims.append((key, mine))
        return []

    def release(self) -> None:
        """Give this rank's claims back (a clean leave)."""
        for key, mine in self._claims:
            self.group.base_store.compare_set(key, mine, "")
        self._claims = []

    def close(self) -> None:
        super().close()
        if not self._claims:
            return
        store = self.group.base_store
        tcp = isinstance(store, dist.TCPStore)
        # A store that went away with its trainers (the end of a job) fails every round trip, and
        # torch logs each failure with its C++ stack before raising: one plain connection asks first.
        gone = rdv.reach(store.host.strip("[]"), store.port, 0.5) if tcp else None
        if gone is None:
            try:
                self.release()
                return
            except (dist.DistNetworkError, dist.DistStoreError) as exc:  # it went away since the look
                gone = str(exc).splitlines()[0]
        self._claims = []
        logger.warning("tritonreshard (rank %s): the refit group's store at %s is gone (%s), as when its trainers "
                       "exit at the end of a job; this rank's claims in it went with it", self.group.rank,
                       f"{store.host}:{store.port}" if tcp else type(store).__name__, gone)
