"""The inference side's receiving relay: boxes that cross into this host once, read by its ranks.

Who calls what: the set-up script builds a :class:`ReceivingRelay` for an inference rank whose route
receives (``route.receives``), over the epoch's :class:`~tritonreshard.engine.crosshost.CrossHost`;
the group exchanges its :attr:`~ReceivingRelay.exported` buffer, and the ranks of its host (itself
included) read it exactly like a trainer's arena.

The relay owns the receive buffer, an exported arena on its host with a control block of its own.
Per refit the relay thread waits until every rank reading the buffer acked the previous version,
tells its senders it is ready, waits for their announcements, receives, checks the headers, and
publishes the version on its control block.

Deltas: the receive buffer is the base of the cross-host deltas (see
:mod:`~tritonreshard.engine.sender`). The relay's "ready" names the version the buffer holds whole,
or 0 once it does not: the relay marks the base invalid before any byte of a refit lands and valid
again only after every byte arrived, the headers matched and the deltas were applied, so a refit
that fails or is interrupted is followed by a whole one (in a new epoch: a new relay, no base).
Readers see a version only when it is published, so none is ever served torn.

Failures: a relay that sees a peer die sets its control block's abort word to the dead rank, so the
ranks reading its buffer raise the same ``PeerDiedError`` (a cross-host rank cannot set an abort
word itself: see ``Group.check_abort``). Ranks with different host identities never map each
other's memory: only the route's boxes cross.
"""
from __future__ import annotations

import json
import threading

import torch

from ..errors import PeerDiedError, RefitError
from ..planning import BufferRef, Route
from ..transport import Codec, CrossHostCopy, Dense, create_arena, create_control_block
from .crosshost import FOREVER, CrossHost
from .sources import Exported, OwnBuffer

__all__ = ["ReceivingRelay"]

_KEPT = 4   # refits received() remembers: a reader serves at most two versions behind the buffer


class ReceivingRelay:
    """One rank's receive buffer and the thread that fills it (see the module docstring).

    Args:
        cross: the epoch's :class:`~tritonreshard.engine.crosshost.CrossHost`. route: this rank's
            route (``receives``, ``buffer_bytes``, ``buffer_readers``). device: of the buffer.
            codec: as the senders' (the group agreed on it at hello).
    """

    def __init__(self, cross: CrossHost, route: Route, device, *, codec: Codec = Dense()):
        group = cross.group
        self.group, self.rank, self.cross, self.route = group, group.rank, cross, route
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._buffer = self.control = None
        self.error: BaseException | None = None
        # {version: (bytes received as deltas, as whole, changed fraction of the words compared
        # with the base or None)} of the last few refits: see received().
        self._received: dict[int, tuple[int, int, float | None]] = {}
        #: The version the receive buffer holds whole (0: none, or a refit in progress or failed).
        self.base = 0
        try:
            self._buffer = create_arena(route.buffer_bytes, torch.device(device), secret=group.secret)
            self.control = create_control_block(group.world_size, group.world_size, secret=group.secret)
            group.liveness.beat_into(self.control)
            for r in route.buffer_readers:
                if r != self.rank:
                    group.liveness.watch(r, self.control)
            self.copy = CrossHostCopy(cross.link, [m for m in route.messages if m.receiver == self.rank],
                                      route.transfers,
                                      recv_buffer=self._buffer.tensor(0, (route.buffer_bytes,), torch.uint8),
                                      codec=codec)
        except BaseException:
            self.close()
            raise
        self.buffer = BufferRef("relay", self.rank)
        self.exported = (Exported(self.buffer, self._buffer.export(), self.control.export()),)

    def received(self, version: int) -> tuple[int, int, float | None]:
        """What crossed into this rank in the refit that brought ``version``: bytes as deltas, bytes
        whole, and the changed fraction of the words compared with the base (None: a whole
        transfer); ``(0, 0, None)`` for a version it did not receive.

        By version, not "the last refit": the relay receives version v + 1 as soon as every reader
        of its buffer acked v, so right after this rank's pull of v (or while a shadow pull waits
        for its swap) the buffer may already hold v + 1 or v + 2."""
        return self._received.get(version, (0, 0, None))

    @property
    def staging_bytes(self) -> int:
        """The receive buffer."""
        return self._buffer.nbytes if self._buffer is not None else 0

    def own(self) -> OwnBuffer:
        """The receive buffer as a copy source of this process (a receiver reads its own boxes)."""
        return OwnBuffer(self.buffer, self._buffer, self.control)

    def unlink(self) -> None:
        """After set-up: no new peer may map the buffer."""
        self._buffer.unlink()
        self.control.unlink()

    def start(self) -> None:
        """After set-up: the relay thread starts."""
        self._thread = threading.Thread(target=self._loop, daemon=True, name=f"trs-relay-{self.rank}")
        self._thread.start()

    def _loop(self):
        control, readers, senders = self.control, list(self.route.buffer_readers), list(self.route.senders)
        cross, k, last = self.cross, 0, 0
        try:
            cross.use_device()
            while True:
                k += 1
                self.group.wait(lambda last=last: all(control.acked_version(r) >= last for r in readers),
                                f"readers {readers} of rank {self.rank}'s receive buffer to ack version {last}",
                                FOREVER, peers=[r for r in readers if r != self.rank],
                                doorbell=control.doorbell, cancel=self._stop)
                for s in senders:
                    cross.send_signal(s, "ready", k, str(self.base))
                cross.wait_signals("sent", senders, k, f"senders {senders} to send refit {k}", self._stop)
                described = {s: json.loads(cross.signals.get("sent", s, k)) for s in senders}
                versions = {s: d["v"] for s, d in described.items()}
                v = versions[senders[0]]
                if set(versions.values()) != {v} or v <= last:
                    raise RefitError(f"rank {self.rank}: senders announced versions {versions} after "
                                     f"version {last}: they must send one newer version together")
                wrong = {s: d["base"] for s, d in described.items() if d["base"] not in (0, self.base)}
                if wrong:  # never applied to a buffer that does not hold their base
                    raise RefitError(f"rank {self.rank}: senders {sorted(wrong)} sent deltas against versions "
                                     f"{wrong}, the receive buffer holds {self.base or 'no whole version'}")
                self.base = 0   # from the first byte that lands until the last delta is applied
                cross.transfer(self.copy.start_recvs(described), senders,
                               f"the cross-host receives of version {v}", self._stop)
                self.copy.check_headers(v)
                self.copy.apply()
                if self._buffer.device.type == "cuda":
                    torch.cuda.current_stream(self._buffer.device).synchronize()
                got = self.copy.last_received
                record = (got["delta_bytes"], got["dense_bytes"],
                          got["changed"] / got["compared"] if got["compared"] else None)
                # A new dict, assigned once: received() reads it from the endpoint's thread.
                self._received = {**dict(list(self._received.items())[1 - _KEPT:]), v: record}
                self.base = last = v
                control.publish(v)
        except BaseException as exc:  # readers learn of it through the control block
            if isinstance(exc, RefitError) and self._stop.is_set():
                return
            self.error = exc
            # A dead peer ends the epoch and the readers learn who died; any other failure aborts them.
            if isinstance(exc, PeerDiedError):
                self.group.end(exc)
                self.control.abort(exc.rank)
            elif not self._stop.is_set():
                self.control.abort(self.rank)

    def abort(self) -> None:
        """This rank gives up on the epoch: the ranks reading its receive buffer stop waiting."""
        if self.control is not None:
            self.control.abort(self.rank)

    def close(self) -> None:
        """Stop the thread and release the buffer and control block (idempotent)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self.group.timeout + 1.0)
            self._thread = None
        if self.control is not None:
            self.control.close()
            self.control = None
        if self._buffer is not None:
            self._buffer.close()
            self._buffer = None
