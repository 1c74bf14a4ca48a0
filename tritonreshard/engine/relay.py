"""Cross-host refits: a sender's sends and a relay's receive buffer, driven by the rank's route.

Every rank of a group whose plan reads across hosts builds a :class:`Relay` (the point-to-point
process group is collective), from its :class:`~tritonreshard.engine.route.Route`:

* **sender** (``route.sends``): after each ``publish`` the sender thread waits until each of its
  receivers is ready for the next refit, announces the version, and sends its boxes straight from
  the arena (``DistLink``: gloo / NCCL point-to-point). The publisher's ``fence`` waits for those
  sends (the arena may change once they completed): the thread rings the arena's doorbell.
* **relay** (``route.receives``): owns the receive buffer, an exported arena on its host with a
  control block of its own. Per refit the relay thread waits until every rank reading the buffer
  acked the previous version, tells its senders it is ready, waits for their announcements,
  receives, checks the headers, and publishes the version on its control block. Ranks of its host
  read the buffer exactly like a trainer's arena.

Ranks with different host identities never map each other's memory: only the route's boxes cross.

Readiness crosses hosts as :class:`Signals`: small JSON messages pushed to the receiving rank's queue
in the group's store. One thread per rank blocks in ``queue_pop`` on a connection of its own (no
polling) and rings a :class:`~tritonreshard.transport.wait.Doorbell`; the sender and relay threads
wait on it with ``Group.wait``, like every other wait of the engine. A data transfer is only posted
when both ends are ready, so the process group's timeout bounds the transfer itself, never the time a
trainer trains or an inference rank waits to pull.

Failures: a peer on another host that dies closes its connections, so a pending transfer fails at once
and becomes :class:`PeerDiedError` naming it; between transfers cross-host peers are watched through
their store heartbeats (:mod:`~tritonreshard.engine.liveness`). The epoch ends. A relay that sees it
sets its control block's abort word to the dead rank, so the ranks reading its buffer raise the same
``PeerDiedError`` (a cross-host rank cannot set an abort word itself: see ``Group.check_abort``).
"""
from __future__ import annotations

import datetime
import json
import threading

import torch
import torch.distributed as dist

from ..errors import PeerDiedError, RefitError
from ..transport import CrossHostCopy, DistLink, create_arena, create_control_block
from ..transport.wait import Doorbell
from .group import Group
from .route import BufferRef, Exported, OwnBuffer, Route

__all__ = ["Relay", "Signals"]

_FOREVER = float("inf")   # a sender / relay waits as long as training or serving takes
_STORE_WAIT = datetime.timedelta(days=365)  # a blocked queue_pop ends by a message, never by timing out


def _clone(store):
    """A new connection to the same store and namespace (``PrefixStore.clone`` keeps the prefix):
    a blocked ``queue_pop`` holds its connection, so the rank's other store calls must not queue
    behind it."""
    out = store.clone()
    out.set_timeout(_STORE_WAIT)
    return out


class Signals:
    """This rank's cross-host signals, through the group's store.

    ``send(rank, kind, k, value)`` pushes one to ``rank``'s queue; ``has(kind, peers, k)`` says
    whether each of ``peers`` sent it; :attr:`bell` rings when one arrives. A thread of its own
    pops this rank's queue on a separate connection; ``close()`` pushes a stop to it.
    """

    def __init__(self, store, rank: int):
        self.rank = rank
        self._store = dist.PrefixStore("signals/", store)
        self._queue = _clone(self._store)
        self.bell = Doorbell()
        self._seen: dict[tuple[str, int, int], str] = {}
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, daemon=True, name=f"trs-signals-{rank}")
        self._thread.start()

    def send(self, rank: int, kind: str, k: int, value: str = "") -> None:
        self._store.queue_push(f"q/{rank}", json.dumps([kind, self.rank, k, value]))

    def has(self, kind: str, peers, k: int) -> bool:
        return self.error is not None or all((kind, p, k) in self._seen for p in peers)

    def get(self, kind: str, peer: int, k: int) -> str:
        return self._seen[(kind, peer, k)]

    def raise_error(self, what: str) -> None:
        if self.error is not None:
            raise RefitError(f"rank {self.rank}: the group's store failed while waiting for {what}: "
                             f"{self.error}") from None

    def _loop(self) -> None:
        try:
            while True:
                kind, frm, k, value = json.loads(self._queue.queue_pop(f"q/{self.rank}", True))
                if kind == "stop" and frm == self.rank:
                    return
                self._seen[(str(kind), int(frm), int(k))] = str(value)
                self.bell.ring()
        except (RuntimeError, dist.DistError, ValueError) as exc:  # the store's host is gone; a bad message
            self.error = exc
            self.bell.ring()

    def close(self) -> None:
        if self._thread.is_alive():
            try:
                self.send(self.rank, "stop", 0)
            except (RuntimeError, dist.DistError):  # the store is gone: the popping thread saw it too
                pass
            self._thread.join(5.0)


class Relay:
    """One rank's cross-host part of one group epoch (see the module docstring).

    Args:
        group: the epoch's group. route: this rank's route (``spans_hosts``).
        arena: this rank's :class:`~tritonreshard.engine.publisher.SourceArena` (a sender reads it),
            or None. device: this rank's device (cpu -> gloo, cuda -> NCCL; every rank of a
            cross-host group uses the same kind).

    Built by every rank of the group; the endpoint exchanges :attr:`exported` and calls
    :meth:`start` after set-up.
    """

    def __init__(self, group: Group, route: Route, *, arena=None, device=None):
        self.group, self.rank, self.route = group, group.rank, route
        device = torch.device(device if device is not None else "cpu")
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._buffer = self.control = None
        self.link = self.signals = None
        self._arena = arena
        self.error: BaseException | None = None
        try:
            self.link = DistLink(group.base_store, rank=self.rank, world_size=group.world_size, device=device,
                                 timeout=group.timeout, prefix=f"trs/{group.name}/e{group.epoch}/dist/")
            recv = None
            if route.buffer_bytes:
                self._buffer = create_arena(route.buffer_bytes, device, secret=group.secret)
                self.control = create_control_block(group.world_size, group.world_size, secret=group.secret)
                recv = self._buffer.tensor(0, (route.buffer_bytes,), torch.uint8)
                group.liveness.beat_into(self.control)
                for r in route.buffer_readers:
                    if r != self.rank:
                        group.liveness.watch(r, self.control)
            self.copy = CrossHostCopy(self.link, route.messages, route.transfers,
                                      arena=arena.flat if route.sends else None,
                                      shard=arena.tensors if route.sends else None, recv_buffer=recv)
            group.liveness.watch_remote(set(route.receivers) | set(route.senders))
            if route.sends or route.receives:
                self.signals = Signals(group.store, self.rank)
        except BaseException:
            self.close()
            raise
        self.buffer = BufferRef("relay", self.rank)
        self.exported = (Exported(self.buffer, self._buffer.export(), self.control.export()),) if self._buffer else ()
        # Sender state: versions published, and the last one whose sends completed.
        self._bell = Doorbell()
        self._queued: list[int] = []
        self._sent_version = 0
        self._send_error: BaseException | None = None
        self.bytes_received = 0          # cross-host bytes this rank received in its last refit

    @property
    def staging_bytes(self) -> int:
        """The receive buffer plus any send packing buffer this rank allocated."""
        return (self._buffer.nbytes if self._buffer is not None else 0) + self.copy.send_staging_bytes

    def own(self) -> OwnBuffer | None:
        """The receive buffer as a copy source of this process (a receiver reads its own boxes)."""
        return OwnBuffer(self.buffer, self._buffer, self.control) if self._buffer is not None else None

    def unlink(self) -> None:
        if self._buffer is not None:
            self._buffer.unlink()
            self.control.unlink()

    def start(self) -> None:
        """After set-up: the sender and relay threads start."""
        if self.route.sends:
            self._threads.append(threading.Thread(target=self._send_loop, daemon=True,
                                                  name=f"trs-send-{self.rank}"))
        if self.route.receives:
            self._threads.append(threading.Thread(target=self._relay_loop, daemon=True,
                                                  name=f"trs-relay-{self.rank}"))
        for t in self._threads:
            t.start()

    # ------------------------------------------------------------------ helpers
    def _wait_signals(self, kind: str, peers, k: int, what: str) -> None:
        signals = self.signals
        self.group.wait(lambda: signals.has(kind, peers, k), what, _FOREVER, peers=peers,
                        doorbell=signals.bell.doorbell, cancel=self._stop)
        signals.raise_error(what)

    def _transfer(self, pending, peers, what: str) -> None:
        def check():
            if self._stop.is_set():
                raise RefitError(f"rank {self.rank}: endpoint closed during {what}")
            self.group.check_peers(peers, what, closed_is_gone=False)
        pending.wait(check=check)

    def _use_device(self) -> None:
        if self.link.device.type == "cuda":  # NCCL calls and syncs of this thread go to our GPU
            torch.cuda.set_device(self.link.device)

    def _fail(self, exc: BaseException) -> None:
        """A sender / relay thread failed. A dead peer ends the epoch and the readers of our buffer
        learn who died; any other failure (not a close) aborts the buffer's readers."""
        if isinstance(exc, PeerDiedError):
            self.group.end(exc)
            if self.control is not None:
                self.control.abort(exc.rank)
        elif self.control is not None and not self._stop.is_set():
            self.control.abort(self.rank)

    # ------------------------------------------------------------------ sender
    def published(self, version: int) -> None:
        """Publisher, right after publishing ``version``: queue its sends."""
        self._queued.append(version)
        self._bell.ring()

    def sent(self, version: int) -> bool:
        """True when the sends of ``version`` completed (or the sender failed: see
        :meth:`raise_send_error`)."""
        return self._sent_version >= version or self._send_error is not None

    def raise_send_error(self) -> None:
        if self._send_error is not None:
            raise self._send_error

    def _send_loop(self):
        receivers, k = list(self.route.receivers), 0
        try:
            self._use_device()
            while True:
                self.group.wait(lambda: bool(self._queued), "a version to send", _FOREVER,
                                doorbell=self._bell.doorbell, cancel=self._stop)
                v = self._queued.pop(0)
                k += 1
                self._wait_signals("ready", receivers, k, f"receivers {receivers} to be ready for version {v}")
                for r in receivers:
                    self.signals.send(r, "sent", k, str(v))
                self._transfer(self.copy.start_sends(v), receivers, f"the sends of version {v}")
                self._sent_version = v
                self._arena.control.ring()  # the fence waits on the arena's doorbell
        except BaseException as exc:  # handed to fence(), which raises it in the trainer's thread
            if isinstance(exc, RefitError) and self._stop.is_set():
                return
            self._fail(exc)
            self._send_error = exc
            self._arena.control.ring()

    # ------------------------------------------------------------------ relay
    def _relay_loop(self):
        control, readers, senders = self.control, list(self.route.buffer_readers), list(self.route.senders)
        k, last = 0, 0
        try:
            self._use_device()
            while True:
                k += 1
                self.group.wait(lambda: all(control.acked_version(r) >= last for r in readers),
                                f"readers {readers} of rank {self.rank}'s receive buffer to ack version {last}",
                                _FOREVER, peers=[r for r in readers if r != self.rank],
                                doorbell=control.doorbell, cancel=self._stop)
                for s in senders:
                    self.signals.send(s, "ready", k)
                self._wait_signals("sent", senders, k, f"senders {senders} to send refit {k}")
                versions = {s: int(self.signals.get("sent", s, k)) for s in senders}
                v = versions[senders[0]]
                if set(versions.values()) != {v} or v <= last:
                    raise RefitError(f"rank {self.rank}: senders announced versions {versions} after "
                                     f"version {last}: they must send one newer version together")
                self._transfer(self.copy.start_recvs(), senders, f"the cross-host receives of version {v}")
                self.copy.check_headers(v)
                if self._buffer.device.type == "cuda":
                    torch.cuda.current_stream(self._buffer.device).synchronize()
                self.bytes_received = self.copy.bytes_received_per_refit
                last = v
                control.publish(v)
        except BaseException as exc:  # readers learn of it through the control block
            if isinstance(exc, RefitError) and self._stop.is_set():
                return
            self.error = exc
            self._fail(exc)

    # ------------------------------------------------------------------ lifetime
    def abort(self) -> None:
        """This rank gives up on the epoch: the ranks reading its receive buffer stop waiting."""
        if self.control is not None:
            self.control.abort(self.rank)

    def close(self) -> None:
        """Stop the threads and release the buffer, control block and process group (idempotent).

        Signals and heartbeats go through the group's store, so the process hosting it stays until
        every rank with cross-host peers closed (or is dead) before it returns."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._bell.ring()
        for t in self._threads:
            t.join(self.group.timeout + 1.0)
        self._threads = []
        if self.signals is not None:
            self.signals.close()
        if self.group.hosts_store and self.route.host_plan is not None:
            hp = self.route.host_plan
            users = sorted({t.src_rank for t in hp.transfers} | {t.receiver for t in hp.transfers})
            self.group.liveness.outlive_store_users(users, self.group.timeout)
        if self.link is not None:
            self.link.close()
            self.link = None
        if self.control is not None:
            self.control.close()
            self.control = None
        if self._buffer is not None:
            self._buffer.close()
            self._buffer = None
