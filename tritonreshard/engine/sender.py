"""The trainer side's cross-host sender: after each publish, its boxes go to the relays of other hosts.

Who calls what: the set-up script builds a :class:`Sender` for a trainer rank whose route sends
(``route.sends``), over the epoch's :class:`~tritonreshard.engine.crosshost.CrossHost`; its
:class:`~tritonreshard.engine.publisher.Publisher` tells it each version (:meth:`Sender.published`)
and the fence asks it (:meth:`Sender.sent`, :meth:`Sender.doorbell`, :meth:`Sender.raise_error`).

Per version the sender thread waits until each of its receivers is ready for the next refit,
announces the version, and sends its boxes straight from the arena (``DistLink``: gloo / NCCL
point-to-point); the arena may change once they completed, so the thread then rings its own
doorbell, on which the fence sleeps.

Deltas (a ``Delta`` codec, see :mod:`~tritonreshard.transport.codec`): each receiver's "ready" names the
version its buffer holds whole (its base, 0 for none). When that is the version this rank last sent
it, the sender encodes only the words that changed against its snapshot of what it sent, and its
"sent" signal carries the descriptors (version, base, per message its encoding and size), so the
receiver posts receives of the right sizes. Whether a delta pays at all is weighed per transfer
(``Delta()``, "auto"): the sender's :class:`~tritonreshard.transport.codec.LinkModel` times its
whole sends (the link) and its encodes (detection), and where finding what changed costs more than
sending every byte, the transfer is whole and the snapshot is not kept up. Anything else (a receiver that skipped a
version or lost its base, a new epoch: a new sender, whose snapshot is empty; an anchor every ``codec.anchor``
versions) travels whole. The snapshot is one copy of the bytes this rank sends to other hosts, on
the arena's device: on CUDA the comparison then runs at device-memory speed with no copy over PCIe,
and on CPU it is host memory like the arena. It moves on only once the sends completed.
"""
from __future__ import annotations

import json
import threading
import time

import torch

from ..errors import PeerDiedError, RefitError
from ..planning import Route
from ..transport import Codec, CrossHostCopy, Dense
from ..transport.wait import Doorbell
from .crosshost import FOREVER, CrossHost

__all__ = ["Sender"]


class Sender:
    """Sends one trainer rank's boxes to other hosts, one version after another.

    Args:
        cross: the epoch's :class:`~tritonreshard.engine.crosshost.CrossHost`. route: this rank's
            route (``sends``, ``messages``). arena: the rank's flat arena (``uint8``) and ``shard``:
            its shards (views into it), for boxes that are not one range of it. codec: how its
            messages travel (:class:`~tritonreshard.transport.codec.Dense` or ``Delta``; see the
            module docstring).
    """

    def __init__(self, cross: CrossHost, route: Route, *, arena: torch.Tensor, shard: dict, codec: Codec = Dense()):
        self.group, self.rank, self.cross = cross.group, cross.rank, cross
        self.receivers = list(route.receivers)
        self.copy = CrossHostCopy(cross.link, [m for m in route.messages if m.sender == self.rank],
                                  route.transfers, arena=arena, shard=shard, codec=codec)
        #: The last version's encoding time (seconds: comparing with the snapshot and compacting).
        self.detect_s = 0.0
        self._stop = threading.Event()
        self._bell = Doorbell()            # rung when a version's sends completed (or failed)
        self._queued: list[int] = []
        self._sent_version = 0
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None

    @property
    def staging_bytes(self) -> int:
        """The packing buffer (boxes that are not one range of the arena) and the snapshot of what
        this rank last sent (with deltas on)."""
        return self.copy.send_staging_bytes + self.copy.snapshot_bytes

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
                bases = {r: int(cross.signals.get("ready", r, k)) for r in receivers}
                t0 = time.perf_counter()
                described = self.copy.prepare_sends(v, bases)
                self.detect_s = time.perf_counter() - t0
                for r in receivers:
                    cross.send_signal(r, "sent", k, json.dumps(described[r]))
                cross.transfer(self.copy.start_sends(v), receivers, f"the sends of version {v}", self._stop)
                self.copy.commit_sends()
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
