"""Liveness: is a peer of this epoch still there? One answer for peers on this host and on others.

* **This host**: a peer is dead when its process exited, and only then: a pidfd (``pidfd_open``,
  opened when the epoch's members are known) turns readable when it exits, zombies included, and
  never names a reused pid; where there is none (not Linux, or a kernel before 5.3), ``/proc/<pid>``
  says so. A peer that is alive but stopped heart-beating for ``peer_timeout`` seconds is *not*
  dead: a loaded machine starves live processes (the whole VM, or the process, not running for
  seconds), and a false death would end the epoch. It is *silent* (:meth:`Liveness.silence`): a
  wait on it that runs out of its own timeout says so (hung or starved), and only then fails. The
  pidfd matters after a copy: right after a large CPU copy evicted the caches, reading ``/proc``
  took ~100 us where a poll of the pidfd takes ~20 us (measured on the 2-core CI machine), and the
  post-copy check is on every pull's critical path. Heartbeats go into every block this rank reads
  or owns (``beat_into``); this rank watches the blocks its peers beat into (``watch``).
* **Other hosts** (only ranks of a cross-host route, ``watch_remote``): a counter per rank in the
  group's store, bumped every heartbeat. A peer whose counter stood still for ``peer_timeout`` of
  this rank's own looking is dead (a stretch in which this rank itself did not run, or did not look,
  counts at most a quarter of it: a machine that paused both must not make the peer look silent).
  One that set ``closed/<rank>`` left (a clean close: gone at once for a wait that needs it, but not
  for a transfer it already completed, see ``dead_reason(closed_is_gone=)``). Pids and pidfds play
  no part across hosts (another host's pid means nothing here). A store that does not answer for
  ``peer_timeout`` (a call in flight that long, or failing that long: a partition between this rank
  and the store's host, or that host lost) makes every peer on another host unreachable: a wait
  that needs one fails naming that peer's host and its ranks, within ``peer_timeout``, instead of
  running out its own timeout.

Two threads per rank: one beats into shared memory (never blocked by the network), one into the
store, and reads the counters of the peers a wait asked about (so a wait never blocks on the store
either: it reads what that thread last saw). Who calls what: the :class:`~tritonreshard.engine.group.Group` owns
one :class:`Liveness` per epoch; the publisher, subscriber and relay register the blocks and peers
they share; every wait asks :meth:`Liveness.dead_reason` through ``Group.wait``.
"""
from __future__ import annotations

import errno
import os
import select
import threading
import time

import torch.distributed as dist

__all__ = ["Liveness", "HEARTBEAT_S", "proc_state"]

#: Heartbeat period (shared memory and store alike).
HEARTBEAT_S = 0.2
# How often a waiter reads one cross-host peer's counter (a store round trip each).
_LOOK_S = 0.5
# The most one interval between two looks at a cross-host peer adds to its silence (and at most a
# quarter of peer_timeout): when this rank itself was starved, or nobody waited, for longer, the
# peer's counter is given the benefit of the doubt.
_GAP_S = 4 * _LOOK_S


def proc_state(pid: int) -> str | None:
    """One-letter state of a process of this host, or None when it no longer exists."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return data[data.rfind(b")") + 2:][:1].decode()


class Liveness:
    """Heartbeats out, and who is dead, for one rank in one epoch.

    Args:
        rank: this rank. members: ``{rank: Member}`` of the epoch (pid and host of each).
        host: this rank's host identity. peer_timeout: seconds without a heartbeat before a peer on
        another host counts as dead, and one on this host (alive) as silent. store: the epoch's store (cross-host
        counters live under ``live/``).
    """

    def __init__(self, rank: int, members: dict, host: str, peer_timeout: float, store):
        self.rank, self.members, self.host, self.peer_timeout = rank, members, host, peer_timeout
        self._store = dist.PrefixStore("live/", store)
        self._beat: list = []                # control blocks this rank heart-beats into
        self._watch: dict[int, object] = {}  # local peer -> a block that peer heart-beats into
        self._remote: tuple[int, ...] = ()   # peers on other hosts (store counters)
        self._counts: dict[int, tuple[int, float, float]] = {}  # remote peer -> (counter, silent s, last look)
        self._looked: dict[int, tuple[float, str | None]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._store_thread: threading.Thread | None = None
        self._wanted: dict[int, float] = {}        # remote peer -> when a wait last asked about it
        self._call_since: float | None = None      # a store call in flight since (monotonic)
        self._failing_since: float | None = None   # store calls failing since (monotonic)
        # Local peers' pidfds: readable once the process exited. None where the platform has none.
        self._exits: dict[int, select.poll | None] = {}
        self._poll_lock = threading.Lock()
        self._fds: list[int] = []
        self._exit_fds: dict[int, int] = {}  # local peer -> its pidfd
        for r, m in members.items():
            if r != rank and m.host == host:
                self._exits[r] = self._exit_poll(r, m.pid)

    def _exit_poll(self, peer: int, pid: int):
        if not hasattr(os, "pidfd_open"):
            return None
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:  # already gone: a pidfd can't say more than /proc will
            return None
        except OSError as exc:  # ENOSYS (a kernel before 5.3) or a sandbox that refuses it
            if exc.errno in (errno.ENOSYS, errno.EPERM):
                return None
            raise
        self._fds.append(fd)
        self._exit_fds[peer] = fd
        poll = select.poll()
        poll.register(fd, select.POLLIN)
        return poll

    def _exited(self, peer: int, pid: int) -> str | None:
        """``"died"`` / ``"died (zombie)"`` when the local ``peer`` exited, else None."""
        with self._poll_lock:  # a poll object may not be polled by two threads at once, nor closed meanwhile
            poll = self._exits.get(peer)
            exited = poll is not None and any(ev & select.POLLIN for _, ev in poll.poll(0))
        if poll is not None:
            if not exited:
                return None
            state = proc_state(pid)  # once, for the message: a zombie waits for its parent
            return "died (zombie)" if state == "Z" else "died"
        state = proc_state(pid)
        if state is None or state in "ZX":
            return "died" + (" (zombie)" if state == "Z" else "")
        return None

    # ------------------------------------------------------------------ registration
    def beat_into(self, control) -> None:
        """Heartbeat into ``control`` (a block whose owner or readers watch this rank)."""
        self._beat.append(control)

    def watch(self, peer: int, control) -> None:
        """``peer`` (on this host) heart-beats into ``control``."""
        self._watch[peer] = control

    def watch_remote(self, peers) -> None:
        """``peers`` are on other hosts: this rank beats into the store, and reads their counters."""
        self._remote = tuple(sorted(set(self._remote) | set(peers)))

    @property
    def remote(self) -> tuple[int, ...]:
        return self._remote

    def add_peer(self, member) -> None:
        """A peer that joined after the epoch met (an elastic group's reader, on this host): from now
        on it is watched like the members (its pidfd opened now)."""
        self.members = {**self.members, member.rank: member}
        if member.host == self.host and member.rank != self.rank:
            with self._poll_lock:
                if self._stop.is_set():  # closed: no pidfd may outlive close()
                    return
                self._forget_exit(member.rank)
                self._exits[member.rank] = self._exit_poll(member.rank, member.pid)

    def forget(self, peer: int) -> None:
        """A peer that left or died: no longer watched (its pidfd closed)."""
        self._watch.pop(peer, None)
        with self._poll_lock:
            self._forget_exit(peer)
        self.members = {r: m for r, m in self.members.items() if r != peer}

    def _forget_exit(self, peer: int) -> None:
        self._exits.pop(peer, None)
        fd = self._exit_fds.pop(peer, None)
        if fd is not None:
            self._fds.remove(fd)
            os.close(fd)

    # ------------------------------------------------------------------ beating
    def start(self) -> None:
        self._beat_once()
        if self._remote:
            self._store_call(lambda: self._store.add(f"hb/{self.rank}", 1))
        self._thread = threading.Thread(target=self._loop, daemon=True, name=f"trs-heartbeat-{self.rank}")
        self._thread.start()
        self._store_thread = threading.Thread(target=self._store_loop, daemon=True,
                                              name=f"trs-heartbeat-store-{self.rank}")
        self._store_thread.start()

    def _beat_once(self) -> None:
        for c in self._beat:
            c.heartbeat(self.rank)

    def _loop(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            self._beat_once()

    def _store_call(self, fn):
        """``fn()`` (one store round trip), timed: a call in flight, or calls failing, for longer
        than ``peer_timeout`` make the peers on other hosts unreachable (:meth:`_unreachable`)."""
        self._call_since = time.monotonic()
        try:
            out = fn()
        except (RuntimeError, dist.DistError):
            if self._failing_since is None:
                self._failing_since = self._call_since
            raise
        finally:
            self._call_since = None
        self._failing_since = None
        return out

    def _store_loop(self) -> None:
        """Beat into the store, and read the counters of the peers a wait asked about within the last
        two looks (no wait, no traffic beyond the beat). A failing store is retried every beat: the
        waits see how long it failed, and a healed partition is used again as soon as it answers."""
        while not self._stop.wait(HEARTBEAT_S):
            if not self._remote:
                continue
            try:
                self._store_call(lambda: self._store.add(f"hb/{self.rank}", 1))
                now = time.monotonic()
                with self._lock:
                    due = [p for p, asked in self._wanted.items() if now - asked < 2 * _LOOK_S
                           and now - self._looked.get(p, (-1e9, None))[0] >= _LOOK_S]
                for peer in due:
                    reason = self._look(peer, now)
                    with self._lock:
                        self._looked[peer] = (now, reason)
            except (RuntimeError, dist.DistError):  # unreachable, or its host is gone: the waits say so
                continue

    # ------------------------------------------------------------------ asking
    def dead_reason(self, peer: int, *, closed_is_gone: bool = True) -> str | None:
        """Why ``peer`` counts as dead, or None. ``closed_is_gone=False``: a cross-host peer that
        closed cleanly is not dead (a sender closes right after its send completed, perhaps before
        our receive saw it complete; the transfer itself fails if it cannot finish)."""
        m = self.members[peer]
        if m.host == self.host:
            exited = self._exited(peer, m.pid)
            return f"rank {peer} (pid {m.pid}) {exited}" if exited else None
        if peer not in self._remote:
            return None
        return self._remote_reason(peer, closed_is_gone)

    def silent_s(self, peer: int) -> float:
        """Seconds since a local ``peer`` that is alive last heart-beat (0.0: not watched, gone, or
        never beat). Its silence is no death (see the module): what a hang is, the caller decides."""
        m = self.members.get(peer)
        control = self._watch.get(peer)
        if m is None or m.host != self.host or control is None or self._exited(peer, m.pid):
            return 0.0
        beat = control.last_heartbeat_ns(peer)
        return (time.monotonic_ns() - beat) / 1e9 if beat > 0 else 0.0

    def silence(self, peer: int) -> str | None:
        """Why a local ``peer`` that is alive looks hung, or None: it sent no heartbeat for more than
        ``peer_timeout`` (for a wait's timeout message; a silent peer is not dead, see the module)."""
        age = self.silent_s(peer)
        if age <= self.peer_timeout:
            return None
        pid = self.members[peer].pid
        state = {"T": "stopped", "t": "stopped (traced)", "D": "in uninterruptible sleep", "R": "running",
                 "S": "sleeping"}.get(proc_state(pid) or "", "alive")
        return (f"rank {peer} (pid {pid}) is alive ({state}) but sent no heartbeat for {age:.1f} s "
                f"(peer_timeout={self.peer_timeout:g} s): hung or starved")

    def _remote_reason(self, peer: int, closed_is_gone: bool) -> str | None:
        """What the store thread last saw of ``peer`` (asking it to keep looking); never a store call
        here, so a wait is never stuck on an unreachable store."""
        now = time.monotonic()
        with self._lock:
            self._wanted[peer] = now
            _, reason = self._looked.get(peer, (-1e9, None))
        unreachable = self._unreachable(peer, now)
        if unreachable:
            return unreachable
        if reason is not None and reason.endswith("closed its endpoint") and not closed_is_gone:
            return None
        return reason

    def store_silent_s(self, now: float | None = None) -> float:
        """Seconds the store has not answered this rank (a call in flight, or calls failing, that
        long) at ``now`` (monotonic; default: now); 0.0 while it answers."""
        since, failing = self._call_since, self._failing_since
        now = time.monotonic() if now is None else now
        return max(now - since if since is not None else 0.0, now - failing if failing is not None else 0.0)

    def _host_ranks(self, host: str) -> list[int]:
        return sorted(r for r, m in self.members.items() if m.host == host)

    def _unreachable(self, peer: int, now: float) -> str | None:
        """Why ``peer`` cannot be reached when the store has not answered for ``peer_timeout``."""
        age = self.store_silent_s(now)
        if age <= self.peer_timeout:
            return None
        host = self.members[peer].host
        return (f"host {host!r} (ranks {self._host_ranks(host)}) is unreachable from this rank's host "
                f"{self.host!r}: the group's store has not answered for {age:.1f} s (peer_timeout="
                f"{self.peer_timeout:g} s; a partition between the hosts, or that host lost), so rank {peer} "
                f"cannot be heard")

    def _look(self, peer: int, now: float) -> str | None:
        m = self.members[peer]
        if self._store_call(lambda: self._store.check([f"closed/{peer}"])):
            return f"rank {peer} (pid {m.pid} on host {m.host!r}) closed its endpoint"
        count = self._store_call(lambda: self._store.add(f"hb/{peer}", 0))
        with self._lock:
            seen, silent, last = self._counts.get(peer, (None, 0.0, now))
            if count != seen:
                self._counts[peer] = (count, 0.0, now)
                return None
            silent += min(now - last, _GAP_S, self.peer_timeout / 4)  # what this rank saw: its stalls count little
            self._counts[peer] = (count, silent, now)
        if silent > self.peer_timeout:
            return (f"rank {peer} (pid {m.pid} on host {m.host!r}, whose ranks are {self._host_ranks(m.host)}) "
                    f"sent no heartbeat for {silent:.1f} s (peer_timeout={self.peer_timeout:g} s): that host "
                    f"is lost, or cut off from the group's store")
        return None

    # ------------------------------------------------------------------ lifetime
    def close(self) -> None:
        """Stop beating (idempotent); cross-host peers learn at once that this rank closed."""
        if self._stop.is_set():
            return
        self._stop.set()
        for t in (self._thread, self._store_thread):
            if t is not None:
                t.join(1.0)
        self._thread = self._store_thread = None
        # An unreachable store would hold this call for its whole timeout (behind the store thread's
        # call in flight): the peers learn of the close from the silence instead.
        if self._remote and self.store_silent_s() == 0.0:
            try:
                self._store.set(f"closed/{self.rank}", "1")
            except (RuntimeError, dist.DistError):  # the store's host is gone (perhaps the dead peer)
                pass
        self._beat.clear()
        self._watch.clear()
        with self._poll_lock:
            self._exits.clear()
            for fd in self._fds:
                os.close(fd)
            self._fds = []
            self._exit_fds.clear()

    def outlive_store_users(self, users, timeout: float) -> None:
        """The store's host: return once each of ``users`` (ranks that still read the store for
        signals or heartbeats) closed or is dead, or after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        users = [u for u in users if u != self.rank]
        # Looked at here, not by the store thread (stopped by now), and every user on another host,
        # not only the peers this rank watched: a user it never exchanged bytes with, on a host lost
        # at once, would otherwise keep the store's host here for the whole timeout.
        looked = -1e9
        while users and time.monotonic() < deadline:
            now = time.monotonic()
            look = now - looked >= _LOOK_S
            if look:
                looked = now
            users = [u for u in users if not self._store.check([f"closed/{u}"]) and not (
                self.dead_reason(u) if self.members[u].host == self.host else look and self._look(u, now))]
            time.sleep(_LOOK_S / 5)
