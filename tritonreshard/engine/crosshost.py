"""What every rank of a group spanning hosts shares for the cross-host path: the link and the signals.

Every rank of a group whose plan reads across hosts opens one :class:`CrossHost` at set-up (the
point-to-point process group, :class:`~tritonreshard.transport.DistLink`, is collective), even a
rank without transfers. Its trainer side's :class:`~tritonreshard.engine.sender.Sender` and its
inference side's :class:`~tritonreshard.engine.relay.ReceivingRelay` both use it.

Readiness crosses hosts as :class:`Signals`: small JSON messages pushed to the receiving rank's queue
in the group's store. One thread per rank blocks in ``queue_pop`` on a connection of its own (no
polling) and rings a :class:`~tritonreshard.transport.wait.Doorbell`; the sender and relay threads
wait on it with ``Group.wait``, like every other wait of the engine. A data transfer is only posted
when both ends are ready, so the process group's timeout bounds the transfer itself, never the time a
trainer trains or an inference rank waits to pull.

A slower link can be simulated on one machine, as hosts are (``$TRITONRESHARD_HOST``):
``$TRITONRESHARD_SIMULATED_LINK_GBPS`` (a test hook, for benches; unset in use) makes every
cross-host send of this rank first sleep its bytes / that rate (``DistLink(simulated_gbps=)``).

Failures: a peer on another host that dies closes its connections, so a pending transfer fails at
once and becomes :class:`~tritonreshard.PeerDiedError` naming it; between transfers cross-host peers
are watched through their store heartbeats (:mod:`~tritonreshard.engine.liveness`). A partition
closes nothing: signals travel on a connection of their own, never queued behind a call the cut link
holds, and a send that blocks fails after twice ``peer_timeout`` (by then the liveness names the
unreachable host), so no thread of an epoch, and no close joining one, waits on a cut link for the
store's timeout.
"""
from __future__ import annotations

import datetime
import json
import math
import os
import threading

import torch
import torch.distributed as dist

from ..errors import RefitError
from ..planning import Route
from ..transport import DistLink
from ..transport.wait import Doorbell
from .group import Group

__all__ = ["CrossHost", "Signals", "FOREVER", "LINK_GBPS_ENV", "simulated_link_gbps"]

LINK_GBPS_ENV = "TRITONRESHARD_SIMULATED_LINK_GBPS"


def simulated_link_gbps() -> float | None:
    """``$TRITONRESHARD_SIMULATED_LINK_GBPS`` as gigabits/s (None: unset, empty or ``inf``: the link as it is)."""
    text = os.environ.get(LINK_GBPS_ENV, "").strip()
    try:
        gbps = float(text) if text else math.inf
    except ValueError:
        gbps = math.nan
    if not gbps > 0:
        raise ValueError(f"${LINK_GBPS_ENV} must be gigabits/s > 0 (a simulated link rate), got {text!r}")
    return None if math.isinf(gbps) else gbps

FOREVER = float("inf")   # a sender / relay waits as long as training or serving takes
_STORE_WAIT = datetime.timedelta(days=365)  # a blocked queue_pop ends by a message, never by timing out


def _clone(store, timeout: datetime.timedelta = _STORE_WAIT):
    """A new connection to the same store and namespace (``PrefixStore.clone`` keeps the prefix):
    a blocked call holds its connection, so the rank's other store calls must not queue behind it."""
    out = store.clone()
    out.set_timeout(timeout)
    return out


class Signals:
    """This rank's cross-host signals, through the group's store.

    ``send(rank, kind, k, value)`` pushes one to ``rank``'s queue; ``has(kind, peers, k)`` says
    whether each of ``peers`` sent it; :attr:`bell` rings when one arrives. A thread of its own
    pops this rank's queue on a separate connection; ``close()`` pushes a stop to it.

    Sends go over a connection of their own. On the group's shared connection a send queued behind
    whatever call was in flight there (a liveness look, a wait for a key), and over a cut link that
    call holds the connection for the store's whole timeout: the relay's "ready" waited there, and
    the epoch's close that joined the relay with it. A push waits for no answer; should it block
    (the connection's buffers full over a cut link), it fails after ``send_timeout`` seconds.
    """

    def __init__(self, store, rank: int, *, send_timeout: float):
        self.rank = rank
        self._store = dist.PrefixStore("signals/", store)
        self._queue = _clone(self._store)
        self._send = _clone(self._store, datetime.timedelta(seconds=send_timeout))
        self.bell = Doorbell()
        self._seen: dict[tuple[str, int, int], str] = {}
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, daemon=True, name=f"trs-signals-{rank}")
        self._thread.start()

    def send(self, rank: int, kind: str, k: int, value: str = "") -> None:
        self._send.queue_push(f"q/{rank}", json.dumps([kind, self.rank, k, value]))

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

    def close(self, *, store_answers: bool = True) -> None:
        """Stop the popping thread. ``store_answers=False`` (the store has not answered this rank
        lately: a partition) sends no stop, which would only wait for its timeout: the thread then
        stays blocked on its own connection until the store's host closes it (that process exits),
        and holds nothing else."""
        if self._thread.is_alive() and store_answers:
            try:
                self.send(self.rank, "stop", 0)
            except (RuntimeError, dist.DistError):  # the store is gone or cut off: nothing to stop it with
                return
            self._thread.join(5.0)


class CrossHost:
    """This rank's link to the other hosts for one epoch: the point-to-point process group and,
    when the rank sends or receives, its :class:`Signals`.

    Args:
        group: the epoch's group. route: this rank's route (``spans_hosts``). device: this rank's
            device (cpu -> gloo, cuda -> NCCL; every rank of a cross-host group uses one kind).
    """

    def __init__(self, group: Group, route: Route, device):
        self.group, self.rank, self.route = group, group.rank, route
        self.link = self.signals = None
        gbps = simulated_link_gbps()   # before anything is opened: a bad value is a plain ValueError
        try:
            self.link = DistLink(group.base_store, rank=self.rank, world_size=group.world_size,
                                 device=torch.device(device if device is not None else "cpu"),
                                 timeout=group.timeout, prefix=f"trs/{group.name}/e{group.epoch}/dist/",
                                 simulated_gbps=gbps)
            group.liveness.watch_remote(set(route.receivers) | set(route.senders))
            if route.sends or route.receives:
                # Twice peer_timeout: by then the liveness has named an unreachable host (send_signal).
                self.signals = Signals(group.store, self.rank, send_timeout=2 * group.peer_timeout)
        except BaseException:
            self.close()
            raise

    def use_device(self) -> None:
        """In a sender / relay thread: NCCL calls and syncs of this thread go to the link's GPU."""
        if self.link.device.type == "cuda":
            torch.cuda.set_device(self.link.device)

    def send_signal(self, to: int, kind: str, k: int, value: str = "") -> None:
        """Send a signal to rank ``to``; a store that does not answer (a partition) becomes the
        liveness's PeerDiedError naming ``to``'s host and its ranks, any other store failure a
        RefitError."""
        try:
            self.signals.send(to, kind, k, value)
        except (RuntimeError, dist.DistError) as exc:
            what = f"the store to take signal {kind!r} {k} for rank {to}"
            self.group.check_peers([to], what, closed_is_gone=False)
            raise RefitError(f"rank {self.rank}: the group's store failed while waiting for {what}: {exc}") from None

    def wait_signals(self, kind: str, peers, k: int, what: str, cancel: threading.Event) -> None:
        signals = self.signals
        self.group.wait(lambda: signals.has(kind, peers, k), what, FOREVER, peers=peers,
                        doorbell=signals.bell.doorbell, cancel=cancel)
        signals.raise_error(what)

    def transfer(self, pending, peers, what: str, cancel: threading.Event) -> None:
        """Wait for posted sends / receives; a closed endpoint or a dead peer ends the wait."""
        def check():
            if cancel.is_set():
                raise RefitError(f"rank {self.rank}: endpoint closed during {what}")
            self.group.check_peers(peers, what, closed_is_gone=False)
        pending.wait(check=check)

    def close(self) -> None:
        """Release the signals and the process group (idempotent; after the sender and relay
        threads stopped). Signals and heartbeats go through the group's store, so the process
        hosting it stays until every rank with cross-host peers closed (or is dead)."""
        if self.signals is not None:
            self.signals.close(store_answers=self.group.liveness.store_silent_s() == 0.0)
            self.signals = None
        if self.link is not None:
            if self.group.hosts_store:
                self.group.liveness.outlive_store_users(self.route.cross_host_ranks, self.group.timeout)
            self.link.close()
            self.link = None
