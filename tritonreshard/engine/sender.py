"""The trainer side's cross-host sender: after each publish, its boxes go to the relays of other hosts.

Who calls what: the set-up script builds a :class:`Sender` for a trainer rank whose route sends
(``route.sends``), over the epoch's :class:`~tritonreshard.engine.crosshost.CrossHost`; its
:class:`~tritonreshard.engine.publisher.Publisher` tells it each version (:meth:`Sender.published`)
and the fence asks it (:meth:`Sender.sent`, :meth:`Sender.doorbell`, :meth:`Sender.raise_error`).

Per version the sender thread waits until each of its receivers is ready for the next refit,
announces the version, and sends its boxes straight from the arena (``DistLink``: gloo / NCCL
point-to-point); the arena may change once they completed, so the thread then rings its own
doorbell, on which the fence sleeps.
"""
from __future__ import annotations

import threading

import torch

from ..errors import PeerDiedError, RefitError
from ..planning import Route
from ..transport import CrossHostCopy
from ..transport.wait import Doorbell
from .crosshost import FOREVER, CrossHost

__all__ = ["Sender"]


class Sender:
    """Sends one trainer rank's boxes to other hosts, one version after another.

    Args:
        cross: the epoch's :class:`~tritonreshard.engine.crosshost.CrossHost`. route: this rank's
            route (``sends``, ``messages``). arena: the rank's flat arena (``uint8``) and ``shard``:
            its shards (views into it), for boxes that are not one range of it.
    """

    def __init__(self, cross: CrossHost, route: Route, *, arena: torch.Tensor, shard: dict):
        self.group, self.rank, self.cross = cross.group, cross.rank, cross
        self.receivers = list(route.receivers)
        self.copy = CrossHostCopy(cross.link, [m for m in route.messages if m.sender == self.rank],
                                  route.transfers, arena=arena, shard=shard)
        self._stop = threading.Event()
        self._bell = Doorbell()            # rung when a version's sends completed (or failed)
        self._queued: list[int] = []
        self._sent_version = 0
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None

    @property
    def staging_bytes(self) -> int:
        """The packing buffer (boxes that are not one range of the arena)."""
        return self.copy.send_staging_bytes

    def start(self) -> None:
        """After set-up: the sender thread starts."""
        self._thread = threading.Thread(target=self._loop, daemon=True, name=f"trs-send-{self.rank}")
        self._thread.start()

    # ------------------------------------------------------------------ the publisher's hook
    def published(self, version: int) -> None:
        """Publisher, right after publishing ``version``: queue its sends."""
        self._queued.append(version)
        self._bell.ring()

    def sent(self, version: int) -> bool:
        """True when the sends of ``version`` completed (or the sender failed: see
        :meth:`raise_error`)."""
        return self._sent_version >= version or self._error is not None

    def doorbell(self):
        """The word the fence sleeps on while the sends are pending."""
        return self._bell.doorbell()

    def raise_error(self) -> None:
        """The fence, after its wait: re-raise the sender's failure in the trainer's thread."""
        if self._error is not None:
            raise self._error

    # ------------------------------------------------------------------ the thread
    def _loop(self):
        receivers, k, cross = self.receivers, 0, self.cross
        try:
            cross.use_device()
            while True:
                self.group.wait(lambda: bool(self._queued), "a version to send", FOREVER,
                                doorbell=self._bell.doorbell, cancel=self._stop)
                v = self._queued.pop(0)
                k += 1
                cross.wait_signals("ready", receivers, k, f"receivers {receivers} to be ready for version {v}",
                                   self._stop)
                for r in receivers:
                    cross.signals.send(r, "sent", k, str(v))
                cross.transfer(self.copy.start_sends(v), receivers, f"the sends of version {v}", self._stop)
                self._sent_version = v
                self._bell.ring()
        except BaseException as exc:  # handed to fence(), which raises it in the trainer's thread
            if isinstance(exc, RefitError) and self._stop.is_set():
                return
            if isinstance(exc, PeerDiedError):
                self.group.end(exc)
            self._error = exc
            self._bell.ring()

    def close(self) -> None:
        """Stop the thread (idempotent); the link belongs to the epoch's CrossHost."""
        self._stop.set()
        self._bell.ring()
        if self._thread is not None:
            self._thread.join(self.group.timeout + 1.0)
            self._thread = None
