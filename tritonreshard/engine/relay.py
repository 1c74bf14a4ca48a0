"""Cross-host refits inside the engine: senders, relays and the subscriber's sources.

Built by the endpoint for one group epoch when its plan has ranks on several hosts (host identity:
``$TRITONRESHARD_HOST``, else the hostname; see ``tritonreshard.engine.group``). Every rank derives the
same :class:`~tritonreshard.planning.hosts.HostPlan`; then, per rank:

* **sender** (a source rank with transfers): after each ``publish`` a sender thread waits until
  each of its receivers is ready for the next refit, then sends its messages straight from the
  arena (``DistLink``: gloo / NCCL point-to-point). ``fence`` waits for those sends (the arena may
  change once they completed) and for the ranks on its own host that read the arena directly.
* **relay** (a receiving rank): owns the receive buffer, an exported arena on its host, with a
  control block of its own. A relay thread, per refit: waits until every rank reading the buffer
  acked the previous version, announces that it is ready, receives, checks the headers, and
  publishes the version on its control block. Ranks of its host read the buffer exactly like a
  trainer's arena (:class:`HostSources`): wait for the published version, copy, ack.
* the **subscriber** reads its local ops from source arenas on its host and its fan-out ops from
  the relays' buffers, through one descriptor table.

Ranks with different host identities never map each other's memory: arenas and control blocks are
only opened within a host, and only the host plan's messages cross.

Readiness goes through the group's store (one small key per rank and refit), so a data transfer
is only posted when both ends are ready: the process group's timeout bounds the transfer itself,
never the time a trainer trains or an inference rank waits to pull.

Failures: a peer on another host that dies closes its connections, so a pending send / receive fails
at once and becomes :class:`PeerDiedError` naming it; between transfers (a trainer training, an
inference rank not pulling yet) cross-host peers are watched through heartbeat counters in the
store, so one that stops counting for ``peer_timeout`` seconds is declared dead, and one that closed
its endpoint is gone at once. Each wait watches only the peers it needs: a relay waiting for its
host's readers to ack is not ended by a sender that finished and closed meanwhile. The epoch ends. A
relay that sees it sets its control block's abort word to the dead rank, so the ranks reading its
buffer raise the same ``PeerDiedError`` (a cross-host rank cannot set an abort word itself: see
``Group.check_abort``).
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..errors import PeerDiedError, RefitError
from .group import Group
from .rendezvous import register_plain
from ..planning import HostPlan, plan_hosts, plan_messages
from .subscriber import LocalSources
from ..transport import create_arena, create_control_block, open_arena, open_control_block
from ..transport import CrossHostCopy, DistLink

__all__ = ["CrossHost", "HostSources", "RelayExports", "spans_hosts"]

_SLICE_S = 0.2      # reader waits run in slices, so close() and a dead epoch stop them
_POLL_MAX_S = 2e-3  # the longest gap between two looks at a readiness key in the store
_HEARTBEAT_S = 0.2  # cross-host heartbeats: a counter in the store per rank
_LOOK_S = 0.5       # how often a waiting thread reads its cross-host peers' counters


def spans_hosts(plan, hosts) -> bool:
    """True when some op of ``plan`` reads across host identities."""
    return any(hosts[op.src_rank] != hosts[op.dst_rank] for op in plan.ops)


@dataclass(frozen=True)
class RelayExports:
    """A receiving rank's buffer and control block handles (None for other ranks)."""

    rank: int
    arena: object | None = None
    control: object | None = None


register_plain(RelayExports)  # it travels through the store at set-up


class CrossHost:
    """One rank's cross-host part of one group epoch (see the module docstring).

    Args:
        group: the epoch's group (joined; ``group.members`` carry the host identities).
        plan: the group's plan; exports: ``{rank: Exports}`` (arena offsets of every source).
        publisher: this rank's publisher, or None. device: this rank's device (cpu -> gloo,
            cuda -> NCCL; every rank of a cross-host group must use the same kind).

    Every rank of the group builds one (the process group is collective), then the endpoint
    exchanges :attr:`exports`, calls :meth:`open_relays`, and :meth:`start` after set-up.
    """

    def __init__(self, group: Group, plan, exports: dict, *, publisher=None, device=None):
        self.group, self.rank = group, group.rank
        hosts = {r: m.host for r, m in group.members.items()}
        offsets = {(r, n): o for r, e in exports.items() for n, o in e.offsets.items()}
        self.hp: HostPlan = plan_hosts(plan, hosts, src_offsets=offsets)
        messages = plan_messages(self.hp, offsets)
        device = torch.device(device if device is not None else "cpu")
        self._store = dist.PrefixStore("crosshost/", group.store)
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._arena = self._control = None
        self.link = None
        self.relay_exports: dict[int, RelayExports] = {}
        self.error: BaseException | None = None
        try:
            self.link = DistLink(group.base_store, rank=self.rank, world_size=group.world_size, device=device,
                                 timeout=group.timeout, prefix=f"trs/{group.name}/e{group.epoch}/dist/")
            nbytes = self.hp.buffer_bytes.get(self.rank, 0)
            recv = None
            if nbytes:
                self._arena = create_arena(nbytes, device, secret=group.secret)
                self._control = create_control_block(group.world_size, group.world_size, secret=group.secret)
                recv = self._arena.tensor(0, (nbytes,), torch.uint8)
                group.beat_into(self._control)
                for r in self.hp.buffer_readers(self.rank):
                    if r != self.rank:
                        group.watch(r, self._control)
            sends = self.hp.sends_of(self.rank)
            self.copy = CrossHostCopy(self.link, messages, self.hp.transfers,
                                      arena=publisher.arena_bytes if sends else None,
                                      shard=publisher.tensors if sends else None, recv_buffer=recv)
        except BaseException:
            self.close()
            raise
        self.exports = RelayExports(self.rank, self._arena.export() if self._arena else None,
                                    self._control.export() if self._control else None)
        self.publisher = publisher
        if publisher is not None:  # cross-host readers never ack the arena: its sends stand for them
            publisher.readers = self.hp.local_readers_of(self.rank)
        # Sender state: refits published (k, version) and the last one whose sends completed.
        self._cv = threading.Condition()
        self._queued: list[tuple[int, int]] = []
        self._seq = 0
        self._sent_seq = 0
        self._send_error: BaseException | None = None
        # Cross-host liveness: peer -> (last counter seen, when it last changed).
        self._peers_xh = tuple(sorted(set(self.copy.receivers) | set(self.copy.senders)))
        self._beats: dict[int, tuple[int, float]] = {}
        self._next_look = 0.0
        # Relay state.
        self.relayed_version = 0
        self.bytes_received = 0          # cross-host bytes this rank received in its last refit
        self.bytes_sent = 0              # ... and sent

    @property
    def control(self):
        """The relay's control block (None unless this rank receives)."""
        return self._control

    @property
    def staging_bytes(self) -> int:
        """The receive buffer plus any send packing buffer this rank allocated."""
        return (self._arena.nbytes if self._arena is not None else 0) + self.copy.send_staging_bytes

    def open_relays(self, relay_exports: dict) -> None:
        self.relay_exports = dict(relay_exports)

    def unlink(self) -> None:
        if self._arena is not None:
            self._arena.unlink()
            self._control.unlink()

    def start(self) -> None:
        """After set-up: the sender and relay threads start."""
        if self.copy.receivers:
            self._threads.append(threading.Thread(target=self._send_loop, daemon=True,
                                                  name=f"trs-xh-send-{self.rank}"))
        if self.copy.senders:
            self._threads.append(threading.Thread(target=self._relay_loop, daemon=True,
                                                  name=f"trs-xh-relay-{self.rank}"))
        if self._peers_xh:
            self._threads.append(threading.Thread(target=self._heartbeat_loop, daemon=True,
                                                  name=f"trs-xh-heartbeat-{self.rank}"))
        for t in self._threads:
            t.start()

    def _heartbeat_loop(self):
        while not self._stop.wait(_HEARTBEAT_S):
            try:
                self._store.add(f"hb/{self.rank}", 1)
            except (RuntimeError, dist.DistError):  # the store's host is gone: nothing left to tell
                return

    # ------------------------------------------------------------------ helpers
    def _check(self, what: str, peers, *, closed_is_gone: bool = True) -> None:
        """Raise if this rank closed, the epoch ended, or one of ``peers`` (the cross-host ranks
        the wait needs: a peer that left does not matter to a wait that never hears from it) is
        gone. ``closed_is_gone=False`` during a transfer: a sender closes right after its sends
        completed, possibly before our receive did; a transfer that cannot finish fails in the
        transport itself."""
        if self._stop.is_set():
            raise RefitError(f"rank {self.rank}: endpoint closed while waiting for {what}")
        self.group.check_peers((), what)  # raises once the epoch ended
        now = time.monotonic()
        if now < self._next_look:
            return
        self._next_look = now + _LOOK_S
        for p in peers:
            reason = self._silent(p, now, closed_is_gone)
            if reason:
                raise PeerDiedError(p, f"rank {self.rank}: {reason} while waiting for {what}")

    def _silent(self, p: int, now: float, closed_is_gone: bool = True) -> str | None:
        """Why cross-host peer ``p`` is gone (it closed its endpoint, or its store counter stood
        still for ``peer_timeout``), or None. Call at most every ``_LOOK_S``."""
        m = self.group.members[p]
        if closed_is_gone and self._store.check([f"closed/{p}"]):
            return f"rank {p} (pid {m.pid} on host {m.host!r}) closed its endpoint"
        count = self._store.add(f"hb/{p}", 0)
        seen, since = self._beats.get(p, (None, now))
        if count != seen:
            self._beats[p] = (count, now)
        elif now - since > self.group.peer_timeout:
            return (f"rank {p} (pid {m.pid} on host {m.host!r}) sent no heartbeat for {now - since:.1f} s "
                    f"(peer_timeout={self.group.peer_timeout:g} s)")
        return None

    def _store_wait(self, keys: list[str], what: str, peers) -> None:
        # Polled (a round trip each), not store.wait in slices: a timed-out wait logs a warning
        # each time, and these waits last as long as a training step or an idle inference rank.
        sleep = 20e-6
        while not self._store.check(keys):
            self._check(what, peers)
            time.sleep(sleep)
            sleep = min(sleep * 2, _POLL_MAX_S)

    def _use_device(self) -> None:
        if self.link.device.type == "cuda":  # NCCL calls and syncs of this thread go to our GPU
            torch.cuda.set_device(self.link.device)

    def _fail(self, exc: BaseException) -> None:
        """A sender / relay thread failed. A dead peer ends the epoch and the readers of our buffer
        learn who died; any other failure (not a close) aborts the buffer's readers."""
        if isinstance(exc, PeerDiedError):
            self.group.end(exc)
            if self._control is not None:
                self._control.abort(exc.rank)
        elif self._control is not None and not self._stop.is_set():
            self._control.abort(self.rank)

    # ------------------------------------------------------------------ sender
    def published(self, version: int) -> None:
        """Publisher, right after publishing ``version``: queue its sends."""
        if not self.copy.receivers:
            return
        with self._cv:
            self._seq += 1
            self._queued.append((self._seq, version))
            self._cv.notify_all()

    def _send_loop(self):
        try:
            self._use_device()
            while True:
                with self._cv:
                    while not self._queued and not self._stop.is_set():
                        self._cv.wait(_SLICE_S)
                    if self._stop.is_set():
                        return
                    k, v = self._queued.pop(0)
                receivers = list(self.copy.receivers)
                self._store_wait([f"ready/{r}/{k}" for r in receivers],
                                 f"receivers {receivers} to be ready for version {v}", receivers)
                self._store.set(f"sent/{self.rank}/{k}", str(v))
                pending = self.copy.start_sends(v)
                pending.wait(check=lambda: self._check(f"the sends of version {v}", receivers,
                                                       closed_is_gone=False))
                with self._cv:
                    self._sent_seq = k
                    self.bytes_sent = self.copy.bytes_sent_per_refit
                    self._cv.notify_all()
        except BaseException as exc:  # handed to fence(), which raises it in the trainer's thread
            self._fail(exc)
            with self._cv:
                self._send_error = exc
                self._cv.notify_all()

    def fence(self, timeout: float) -> None:
        """Publisher's fence: wait until the sends of every published version completed."""
        if not self.copy.receivers:
            return
        deadline = time.monotonic() + timeout
        with self._cv:
            target = self._seq
            while self._sent_seq < target and self._send_error is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"rank {self.rank}: timed out after {timeout:g} s waiting for the "
                                       f"cross-host sends to ranks {list(self.copy.receivers)}")
                self._cv.wait(min(left, _SLICE_S))
            if self._send_error is not None:
                raise self._send_error

    def fenced(self) -> bool:
        with self._cv:
            return self._sent_seq >= self._seq and self._send_error is None

    # ------------------------------------------------------------------ relay
    def _relay_loop(self):
        control, readers = self._control, [r for r in self.hp.buffer_readers(self.rank)]
        k, last = 0, 0
        try:
            self._use_device()
            while True:
                k += 1
                what = f"readers {readers} of rank {self.rank}'s receive buffer to ack version {last}"
                while not all(control.acked_version(r) >= last for r in readers):
                    try:
                        self.group.wait(lambda: all(control.acked_version(r) >= last for r in readers), what,
                                        _SLICE_S, peers=[r for r in readers if r != self.rank],
                                        doorbell=control.doorbell)
                    except TimeoutError:  # readers pull when they choose; look at stop / the epoch again
                        self._check(what, ())  # the readers are on this host: group.wait watches them
                self._store.set(f"ready/{self.rank}/{k}", "1")
                senders = list(self.copy.senders)
                self._store_wait([f"sent/{s}/{k}" for s in senders], f"senders {senders} to send refit {k}",
                                 senders)
                versions = {s: int(self._store.get(f"sent/{s}/{k}")) for s in senders}
                v = versions[senders[0]]
                if set(versions.values()) != {v} or v <= last:
                    raise RefitError(f"rank {self.rank}: senders announced versions {versions} after "
                                     f"version {last}: they must send one newer version together")
                pending = self.copy.start_recvs()
                pending.wait(check=lambda: self._check(f"the cross-host receives of version {v}", senders,
                                                       closed_is_gone=False))
                self.copy.check_headers(v)
                if self._arena.device.type == "cuda":
                    torch.cuda.current_stream(self._arena.device).synchronize()
                self.bytes_received = self.copy.bytes_received_per_refit
                self.relayed_version = last = v
                control.publish(v)
        except BaseException as exc:  # readers learn of it through the control block
            self.error = exc
            self._fail(exc)

    # ------------------------------------------------------------------ lifetime
    def abort(self) -> None:
        """This rank gives up on the epoch: the ranks reading its receive buffer stop waiting."""
        if self._control is not None:
            self._control.abort(self.rank)

    def close(self) -> None:
        """Stop the threads and release the buffer, control block and process group (idempotent).

        Readiness and heartbeats go through the group's store, so the process hosting it stays
        until every rank with cross-host peers closed (or is dead) before it returns."""
        if self._stop.is_set():
            return
        self._stop.set()
        for t in self._threads:
            t.join(self.group.timeout + 1.0)
        self._threads = []
        if self._peers_xh:
            try:
                self._store.set(f"closed/{self.rank}", "1")
            except (RuntimeError, dist.DistError):  # the store's host is gone (perhaps the dead peer)
                pass
        if self.group.hosts_store:
            self._outlive_store_users()
        if self.link is not None:
            self.link.close()
            self.link = None
        if self._control is not None:
            self._control.close()
            self._control = None
        if self._arena is not None:
            self._arena.close()
            self._arena = None

    def _outlive_store_users(self) -> None:
        users = [r for r in sorted(self.group.members) if r != self.rank
                 and (self.hp.sends_of(r) or self.hp.recvs_of(r))]
        deadline = time.monotonic() + self.group.timeout
        self._beats.clear()
        while users and time.monotonic() < deadline:
            now = time.monotonic()
            # _silent: closed, or no heartbeat for peer_timeout
            users = [r for r in users if not self.group.dead_reason(r) and not self._silent(r, now)]
            time.sleep(_LOOK_S / 5)


class HostSources(LocalSources):
    """A subscriber's sources in a cross-host group: source arenas on its host (local ops) and the
    relays' receive buffers (fan-out ops), each with its control block. Same seam as
    :class:`~tritonreshard.engine.subscriber.LocalSources`."""

    def __init__(self, group: Group, exports: dict, ranks, *, local=None, device=None, cross: CrossHost):
        hp, rank = cross.hp, group.rank
        super().__init__(group, exports, hp.local_sources_of(rank), local=local, device=device)
        self.cross = cross
        self._fan = {f.op: cross.hp.transfers[f.transfer] for f in hp.fanout_for_dst(rank)}
        self._relay_arenas: dict[int, object] = {}
        self._relay_controls: dict[int, object] = {}
        try:
            for r in sorted({f.receiver for f in hp.fanout_for_dst(rank)}):
                if r == rank:
                    self._relay_controls[r] = cross.control
                    continue
                e = cross.relay_exports[r]
                self._relay_arenas[r] = open_arena(e.arena, secret=group.secret, device=device,
                                                   timeout=group.timeout)
                self._relay_controls[r] = open_control_block(e.control, secret=group.secret, timeout=group.timeout)
        except BaseException:
            self.close()
            raise
        for r, c in self._relay_controls.items():
            self.controls[f"relay {r}"] = c

    @property
    def remote(self) -> dict:
        out = {s: c for s, c in self.controls.items() if isinstance(s, int) and s != self.group.rank}
        out.update({r: c for r, c in self._relay_controls.items() if r != self.group.rank})
        return out

    @property
    def handles_opened(self) -> int:
        return super().handles_opened + len(self._relay_arenas)

    def ops(self, plan, rank):
        return self.cross.hp.local_ops_for_dst(rank) + tuple(self._fan)

    def order_key(self, op):
        t = self._fan.get(op)
        if t is None:
            return (0, op.src_rank, self.exports[op.src_rank].offsets[op.src_name])
        return (1, t.receiver, t.offset)

    def view(self, op, plan):
        t = self._fan.get(op)
        if t is None:
            return super().view(op, plan)
        if t.receiver == self.group.rank:
            return self.cross._arena.tensor(t.offset, t.shape, t.dtype)
        return self._relay_arenas[t.receiver].tensor(t.offset, t.shape, t.dtype)

    def close(self) -> None:
        for r, c in self._relay_controls.items():
            self.controls.pop(f"relay {r}", None)
            if r != self.group.rank:  # our own relay's block belongs to CrossHost
                c.close()
        self._relay_controls.clear()
        for a in self._relay_arenas.values():
            a.close()
        self._relay_arenas.clear()
        super().close()
