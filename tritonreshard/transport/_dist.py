"""The cross-host data path: a host plan's messages over torch.distributed point-to-point.

Only bytes that must leave a host travel here (see :mod:`tritonreshard.planning.hosts`); everything within
a host stays on the shared-memory / CUDA IPC arenas. A :class:`DistLink` is one rank's process group
over the refit group's ranks (gloo for CPU tensors, NCCL for CUDA tensors), created on the group's
store under its own prefix, so it neither needs nor disturbs a default process group.
:class:`CrossHostCopy` binds one rank's messages to memory:

* sender (a source rank): after ``publish`` it calls ``start_sends(version)``, which packs any
  non-contiguous box into the (counted) send staging buffer and posts one header and the data
  messages per receiver straight from its arena; ``fence`` then waits for them with
  ``wait(pending)``: once they completed, the arena may change again.
* receiver (a destination-host rank): ``start_recvs(version)`` posts the receives into its receive
  buffer; the rank pulls its local ops meanwhile (the network and the local copies overlap), then
  ``wait(pending)`` checks every header names ``version``. Ranks on the receiver's host then read
  the buffer through the ordinary arena path.

Deltas (a :class:`~tritonreshard.transport.codec.Delta` codec, :mod:`~tritonreshard.transport.delta`): the sender keeps
a snapshot of the bytes it last sent in each message, and ``prepare_sends(version, bases)`` encodes
each message to a receiver whose buffer holds exactly that last version (its *base*) as only the
words that changed; any other receiver (no base, another base, an anchor due every ``codec.anchor``
versions) gets the message whole. The descriptors it returns travel ahead of the bytes (the engine
sends them with its "sent" signal), so the receiver posts receives of the right sizes:
``start_recvs(described)`` receives dense messages straight into its buffer and sparse ones into
payloads of their own, and ``apply()`` writes those into the buffer once every byte arrived and the
headers (version, base, bytes) matched. ``commit_sends()`` moves the snapshot on after the sends
completed. Whether a delta pays at all is the codec's question to the sender's
:class:`~tritonreshard.transport.codec.LinkModel`, which the copy feeds with what it measures: its
whole sends (posting to completion) and its delta encodes. Where deltas do not pay, the sender
keeps no snapshot up to date (a copy of every byte sent, for nothing) and its receivers get whole
transfers until they pay again.

Failures: a peer that dies closes its connections, so a pending send or receive fails at once and
becomes :class:`PeerDiedError` naming that peer; a silent peer is bounded by ``timeout`` (the process
group's timeout too). A link whose exchange failed is broken: later exchanges raise at once, since
messages in flight can no longer be matched (the group's epoch is over).
"""
from __future__ import annotations

import datetime
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..errors import PeerDiedError
from . import delta as dc
from .codec import Codec, Delta, Dense, LinkModel
from .wait import Doorbell, wait_until

__all__ = ["DistLink", "CrossHostCopy", "PendingExchange", "LinkError"]


_WHOLE = Dense()   # how a message travels to a receiver that gets no deltas this refit
_HEADER_WORDS = 3   # (version, base version, bytes) per (sender, receiver) pair and refit (base 0: whole)


class LinkError(RuntimeError):
    """The cross-host link cannot be used (broken by an earlier failure, or closed)."""


class DistLink:
    """One rank's cross-host process group.

    Args:
        store: the refit group's ``torch.distributed.Store`` (a ``PrefixStore`` of it is used).
        rank, world_size: this rank and the group size (the layouts' global ranks).
        device: ``cpu`` -> gloo, ``cuda[:N]`` -> NCCL (tensors on that device).
        timeout: seconds any one send / receive may take before the peer counts as hung.
        prefix: the store namespace (include the group's name and epoch, so a new group on the same
            store never meets an old one's keys).
        simulated_gbps: a test hook, None in use: each :meth:`post` with sends first sleeps their
            bytes / this rate (gigabits per second), so that a fast link (loopback) behaves like
            a slower one for the receivers and for the sender's own measurements (the engine sets it
            from ``$TRITONRESHARD_SIMULATED_LINK_GBPS``; ``tritonreshard bench --link-gbps``).

    Every rank of the group must create its link (the process group connects lazily, per pair).
    """

    def __init__(self, store, *, rank: int, world_size: int, device="cpu", timeout: float = 60.0,
                 prefix: str = "trs-dist/", simulated_gbps: float | None = None):
        device = torch.device(device)
        bad = []
        if simulated_gbps is not None and (isinstance(simulated_gbps, bool)
                                           or not isinstance(simulated_gbps, (int, float))
                                           or not simulated_gbps > 0):
            bad.append(f"simulated_gbps must be None or gigabits/s > 0, got simulated_gbps={simulated_gbps!r}")
        if device.type not in ("cpu", "cuda"):
            bad.append(f"device must be cpu or cuda, got device={str(device)!r}")
        if not (isinstance(timeout, (int, float)) and timeout > 0):
            bad.append(f"timeout must be > 0 seconds, got timeout={timeout!r}")
        if not (isinstance(world_size, int) and world_size >= 1 and isinstance(rank, int)
                and 0 <= rank < world_size):
            bad.append(f"rank must be in [0, world_size), got rank={rank!r}, world_size={world_size!r}")
        if bad:
            raise ValueError("DistLink: " + "; ".join(bad))
        self.rank, self.world_size, self.device, self.timeout = rank, world_size, device, float(timeout)
        self.simulated_gbps = simulated_gbps
        self.broken: str | None = None
        self._closed = False
        pstore = dist.PrefixStore(prefix, store)
        td = datetime.timedelta(seconds=self.timeout)
        if device.type == "cuda":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = td
            self.pg = dist.ProcessGroupNCCL(pstore, rank, world_size, opts)
        else:
            self.pg = dist.ProcessGroupGloo(pstore, rank, world_size, td)

    @property
    def backend(self) -> str:
        return "nccl" if self.device.type == "cuda" else "gloo"

    def _check(self, what: str) -> None:
        if self._closed:
            raise LinkError(f"rank {self.rank}: {what}: the cross-host link is closed")
        if self.broken:
            raise LinkError(f"rank {self.rank}: {what}: the cross-host link is broken ({self.broken}); "
                            f"a new group epoch is needed")

    def post(self, sends: Sequence[tuple[int, torch.Tensor]], recvs: Sequence[tuple[int, torch.Tensor]],
             tag: int = 0) -> PendingExchange:
        """Post ``sends`` (peer, contiguous tensor) and ``recvs`` (peer, contiguous tensor) without
        waiting. Messages between one pair match in the order they were posted."""
        self._check("post")
        if self.simulated_gbps is not None and sends:
            # Before posting, so the receivers see the bytes late, as over a slower link.
            time.sleep(sum(t.numel() * t.element_size() for _, t in sends) * 8 / (self.simulated_gbps * 1e9))
        works = []
        for peer, t in recvs:
            works.append((peer, "receive from", self.pg.recv([t], peer, tag)))
        for peer, t in sends:
            works.append((peer, "send to", self.pg.send([t], peer, tag)))
        return PendingExchange(self, works)

    def close(self) -> None:
        """Release the process group. Idempotent. Pending operations of a broken link are abandoned
        (their peers see the connection close)."""
        if self._closed:
            return
        self._closed = True
        if self.device.type == "cuda" and self.broken:
            self.pg.abort()  # a hung NCCL kernel must not outlive the link
        self.pg = None


class PendingExchange:
    """Posted sends / receives of one refit; ``wait`` them (once).

    Completion rings a :class:`~tritonreshard.transport.wait.Doorbell`, so the wait is the engine's
    one wait (a futex sleep), not a poll: on CPU a waiter thread sees the gloo works finish (a gloo
    work whose peer died never reports completion through polling; its ``wait()`` raises at once),
    on CUDA the works' futures ring it when NCCL completes them.
    """

    def __init__(self, link: DistLink, works):
        self._link, self._works = link, works
        self._done = threading.Event()
        self._error: tuple[int, str, BaseException] | None = None
        self._waited = False
        self.bell = Doorbell()
        if link.device.type == "cpu":
            self._thread = threading.Thread(target=self._wait_gloo, name=f"trs-dist-wait-{link.rank}",
                                            daemon=True)
            self._thread.start()
        else:
            torch.futures.collect_all([w.get_future() for _, _, w in works]).then(lambda _: self.bell.ring())

    def _wait_gloo(self):
        for peer, what, w in self._works:
            try:
                w.wait()
            except RuntimeError as exc:  # gloo: connection closed / timed out; names no rank itself
                self._error = (peer, what, exc)
                break
        self._done.set()
        self.bell.ring()

    def done(self) -> bool:
        if self._link.device.type == "cpu":
            return self._done.is_set()
        return all(w.is_completed() for _, _, w in self._works)

    def doorbell(self) -> tuple[int, int]:
        return self.bell.doorbell()

    def wait(self, timeout: float | None = None, check: Callable[[], None] | None = None) -> None:
        """Block until every posted operation completed. ``check`` (e.g. the group's liveness check,
        which raises ``PeerDiedError``) runs while waiting. Raises ``PeerDiedError`` naming the peer
        whose connection failed, ``TimeoutError`` naming the peers still pending. Any failure
        breaks the link: messages in flight can no longer be matched."""
        if self._waited:
            return
        link = self._link
        timeout = link.timeout if timeout is None else timeout
        try:
            if not wait_until(self.done, self.doorbell, time.monotonic() + timeout, check):
                pending = sorted({p for p, _, w in self._works if not w.is_completed()})
                raise TimeoutError(f"rank {link.rank}: cross-host {link.backend} transfers with ranks "
                                   f"{pending} did not complete within {timeout:g} s")
            if self._error is not None:
                peer, what, exc = self._error
                first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                raise PeerDiedError(peer, f"rank {link.rank}: cross-host {what} rank {peer} failed: {first}")
            if link.device.type == "cuda":
                for _, _, w in self._works:
                    w.wait()  # orders the current stream after the NCCL stream
        except BaseException as exc:
            link.broken = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            raise
        finally:
            self._waited = True


@dataclass(frozen=True)
class _Route:
    peer: int
    messages: tuple  # of Message


class CrossHostCopy:
    """One rank's side of a host plan's messages, bound to memory once at set-up.

    Args:
        link: this rank's :class:`DistLink`.
        messages: ``plan_messages(host_plan, src_offsets)`` (the same on every rank).
        transfers: ``host_plan.transfers``.
        arena: sender side: this rank's arena as a flat ``uint8`` tensor (offsets of ``messages``).
        shard: sender side: ``name -> this rank's local shard`` (views into ``arena``), for packing
            the boxes that are not one range of it.
        recv_buffer: receiver side: this rank's receive buffer, a flat ``uint8`` tensor of
            ``host_plan.buffer_bytes[rank]`` bytes.
        codec: :class:`~tritonreshard.transport.codec.Dense` (every message whole) or
            :class:`~tritonreshard.transport.codec.Delta` (per message the smallest encoding of
            :mod:`~tritonreshard.transport.delta`, dense included; a whole transfer every
            ``anchor`` versions).
        link_model: the sender's measurements that a ``Delta()`` codec weighs (default: a new
            :class:`~tritonreshard.transport.codec.LinkModel`); tests pass one with known figures.

    ``send_staging_bytes`` is the packing buffer this rank allocated (0 when every box it sends is
    one range of its arena).
    """

    def __init__(self, link: DistLink, messages, transfers, *, arena: torch.Tensor | None = None,
                 shard: Mapping[str, torch.Tensor] | None = None, recv_buffer: torch.Tensor | None = None,
                 codec: Codec = Dense(), link_model: LinkModel | None = None):
        rank = link.rank
        self.link = link
        self._sends = [m for m in messages if m.sender == rank]
        self._recvs = [m for m in messages if m.receiver == rank]
        problems = []
        if self._sends and arena is None:
            problems.append(f"rank {rank} sends {len(self._sends)} message(s) but arena is None")
        if self._recvs and recv_buffer is None:
            problems.append(f"rank {rank} receives {len(self._recvs)} message(s) but recv_buffer is None")
        for name, t in (("arena", arena), ("recv_buffer", recv_buffer)):
            if t is not None and (t.dtype != torch.uint8 or t.dim() != 1 or not t.is_contiguous()):
                problems.append(f"{name} must be a flat contiguous uint8 tensor, got {t.dtype} {tuple(t.shape)}")
            if t is not None and t.device.type != link.device.type:
                problems.append(f"{name} is on {t.device}, the link's device is {link.device}")
        if recv_buffer is not None and self._recvs:
            need = max(m.recv_offset + m.nbytes for m in self._recvs)
            if recv_buffer.numel() < need:
                problems.append(f"recv_buffer has {recv_buffer.numel()} bytes, the messages need {need}")
        if arena is not None:
            over = [m for m in self._sends if m.src_offset is not None and m.src_offset + m.nbytes > arena.numel()]
            if over:
                problems.append(f"arena has {arena.numel()} bytes; message(s) read up to "
                                f"{max(m.src_offset + m.nbytes for m in over)}")
        if not isinstance(codec, (Dense, Delta)):
            problems.append(f"codec must be a Dense() or Delta(...), got codec={codec!r}")
        if link_model is not None and not isinstance(link_model, LinkModel):
            problems.append(f"link_model must be None or a LinkModel, got link_model={link_model!r}")
        if problems:
            raise ValueError("CrossHostCopy: " + "; ".join(problems))
        self.codec = codec
        self.link_model = link_model if link_model is not None else LinkModel()

        # Sender: one view per message, straight into the arena or into the packing buffer.
        packed = [m for m in self._sends if m.src_offset is None]
        self.send_staging_bytes = sum(m.nbytes for m in packed)
        self._pack = torch.empty(self.send_staging_bytes, dtype=torch.uint8, device=link.device)
        self._pack_jobs = []   # (box view of the shard, packing-buffer view of the box's shape)
        self._send_views: list[tuple[int, torch.Tensor]] = []
        pos = 0
        for m in self._sends:
            if m.src_offset is not None:
                self._send_views.append((m.receiver, arena[m.src_offset:m.src_offset + m.nbytes]))
                continue
            (i,) = m.transfers
            t = transfers[i]
            src = shard[t.name][t.box]
            view = self._pack[pos:pos + m.nbytes]
            self._pack_jobs.append((src, view.view(t.dtype).view(t.shape)))
            self._send_views.append((m.receiver, view))
            pos += m.nbytes
        self._recv_views = [(m.sender, recv_buffer[m.recv_offset:m.recv_offset + m.nbytes]) for m in self._recvs]
        self.receivers = tuple(sorted({m.receiver for m in self._sends}))
        self.senders = tuple(sorted({m.sender for m in self._recvs}))
        self._send_bytes = {p: sum(m.nbytes for m in self._sends if m.receiver == p) for p in self.receivers}
        self._recv_bytes = {p: sum(m.nbytes for m in self._recvs if m.sender == p) for p in self.senders}
        self._headers_in = {p: torch.zeros(_HEADER_WORDS, dtype=torch.int64, device=link.device)
                            for p in self.senders}
        self._headers_out = {p: torch.zeros(_HEADER_WORDS, dtype=torch.int64, device=link.device)
                             for p in self.receivers}

        # Deltas: each message compared in words of its elements' width (bits, not values).
        def word(m):
            return dc.word_size(*(transfers[i].dtype.itemsize for i in m.transfers), m.nbytes, m.recv_offset,
                                m.src_offset or 0)
        self._send_word = [word(m) for m in self._sends]
        self._recv_word = [word(m) for m in self._recvs]
        self._snap: torch.Tensor | None = None      # sender: what it last sent, allocated at the first delta
        self._snap_views: list[torch.Tensor] = []
        self._last_sent = {p: 0 for p in self.receivers}   # the version the snapshot holds for p's messages
        self._deltas = {p: 0 for p in self.receivers}      # deltas to p since its last whole transfer
        self._out: tuple | None = None             # (version, {receiver: descriptor}, [Encoded per message])
        self._posted_at: float | None = None       # the link model's clock when the sends were posted
        self._in: tuple | None = None              # (version, {sender: descriptor}, [payload or None])
        #: Receiver, after ``apply()``: what its last refit received. ``delta_bytes`` / ``dense_bytes``:
        #: bytes received as sparse encodings / whole messages; ``changed`` / ``compared``: words
        #: that changed among the words compared with the base (the whole ones were not).
        self.last_received = {"delta_bytes": 0, "dense_bytes": 0, "changed": 0, "compared": 0}

    @property
    def bytes_sent_per_refit(self) -> int:
        return sum(self._send_bytes.values())

    @property
    def bytes_received_per_refit(self) -> int:
        return sum(self._recv_bytes.values())

    @property
    def num_messages(self) -> int:
        return len(self._sends) + len(self._recvs)

    @property
    def snapshot_bytes(self) -> int:
        """The sender's snapshot of what it last sent (0 until its first transfer with deltas on)."""
        return self._snap.numel() if self._snap is not None else 0

    def prepare_sends(self, version: int, bases: Mapping[int, int] | None = None) -> dict[int, dict]:
        """Sender, after publishing ``version``: pack, then encode each receiver's messages.

        ``bases``: ``{receiver: the version its buffer holds whole}`` (0: none). A receiver whose
        base is the version this rank last sent it, with deltas on and no anchor due, gets deltas
        against the snapshot; any other gets its messages whole. Returns ``{receiver: descriptor}``
        (JSON-able: ``v``, ``base`` (0: whole), ``enc``: ``[kind, bytes, entries, changed, words]``
        per message, ``changed`` -1 where nothing was compared), for the receiver's ``start_recvs``.
        """
        bases = bases or {}
        for src, dst in self._pack_jobs:
            dst.copy_(src)
        if self.link.device.type == "cuda":
            torch.cuda.current_stream(self.link.device).synchronize()  # data before NCCL reads it
        model, total = self.link_model, self.bytes_sent_per_refit
        use = {p: self.codec.sends_delta(self._deltas[p], model, total) and bases.get(p, 0) > 0
               and bases[p] == self._last_sent[p] for p in self.receivers}
        encs, compared, encoded, seconds = [], 0, 0, 0.0
        for i, (p, view) in enumerate(self._send_views):
            if not use[p]:
                encs.append(_WHOLE.encode(view, None, self._send_word[i]))
                continue
            t0 = model.clock()
            encs.append(self.codec.encode(view, self._snap_views[i], self._send_word[i]))
            seconds += model.clock() - t0
            compared, encoded = compared + view.numel(), encoded + encs[-1].nbytes
        if compared:
            model.delta_encoded(compared, seconds, encoded)
        if self.link.device.type == "cuda":
            torch.cuda.current_stream(self.link.device).synchronize()  # payloads before NCCL reads them
        out = {p: {"v": version, "base": bases[p] if use[p] else 0, "enc": []} for p in self.receivers}
        for (p, _), e in zip(self._send_views, encs, strict=True):
            out[p]["enc"].append([e.kind, e.nbytes, e.entries, e.changed, e.words])
        self._out = (version, out, encs)
        return out

    def start_sends(self, version: int) -> PendingExchange | None:
        """Sender, right after publishing ``version`` (and ``prepare_sends``; without it, every
        message travels whole): post the header and data messages to every receiver. None when
        this rank sends nothing."""
        if not self._sends:
            return None
        if self._out is None or self._out[0] != version:
            self.prepare_sends(version)
        _, described, encs = self._out
        sends = []
        for p in self.receivers:
            h = self._headers_out[p]
            d = described[p]
            h[0], h[1], h[2] = version, d["base"], sum(e[1] for e in d["enc"])
            sends.append((p, h))
        for (p, view), e in zip(self._send_views, encs, strict=True):
            if e.nbytes:
                sends.append((p, view if e.kind == dc.DENSE else e.payload))
        self._posted_at = self.link_model.clock()
        return self.link.post(sends, [])

    def commit_sends(self) -> None:
        """Sender, once the sends of the prepared version completed (the receivers hold it): the
        snapshot becomes that version (a whole message is copied, a delta applied to it, as the
        receiver did). A :class:`Dense` codec keeps no snapshot, nor does a ``Delta`` one while
        deltas do not pay (its receivers then get whole transfers, as they hold no base it has).
        Call it right after the sends completed: a whole transfer's time, posting to now, is the
        link model's measurement of the link."""
        if self._out is None:
            return
        version, described, encs = self._out
        self._out = None
        model, total = self.link_model, self.bytes_sent_per_refit
        if self._posted_at is not None and not any(described[p]["base"] for p in self.receivers):
            model.whole_sent(total, model.clock() - self._posted_at)
        self._posted_at = None
        if not (self.codec.keeps_snapshot and self.codec.wants_delta(model, total)):
            for p in self.receivers:   # no base this rank holds: whole until deltas pay again
                self._last_sent[p], self._deltas[p] = 0, 0
            return
        if self._snap is None:
            self._snap = torch.empty(sum(v.numel() for _, v in self._send_views), dtype=torch.uint8,
                                     device=self.link.device)
            pos = 0
            for _, v in self._send_views:
                self._snap_views.append(self._snap[pos:pos + v.numel()])
                pos += v.numel()
        seconds = 0.0   # applying the deltas: the receivers' work too, before their readers pull
        for (_, view), snap, e in zip(self._send_views, self._snap_views, encs, strict=True):
            if e.kind == dc.DENSE:
                snap.copy_(view)
            else:
                t0 = model.clock()
                dc.decode(e.kind, e.payload, snap, e.word, e.entries)
                seconds += model.clock() - t0
        if any(described[p]["base"] for p in self.receivers):
            model.delta_applied(sum(v.numel() for p, v in self._send_views if described[p]["base"]), seconds)
        for p in self.receivers:
            self._last_sent[p] = version
            self._deltas[p] = self._deltas[p] + 1 if described[p]["base"] else 0

    def start_recvs(self, described: Mapping[int, dict] | None = None) -> PendingExchange | None:
        """Receiver: post the header and data receives from every sender. ``described``:
        ``{sender: its prepare_sends descriptor for this rank}`` (None: every message whole).
        Whole messages land in the buffer; sparse ones in payloads of their own, written into the
        buffer by :meth:`apply`, so a transfer that fails leaves the buffer's untouched parts as
        they were. None when this rank receives nothing."""
        if not self._recvs:
            return None
        described = described or {}
        problems = []
        for p in self.senders:
            d = described.get(p)
            n = sum(1 for m in self._recvs if m.sender == p)
            if d is not None and len(d["enc"]) != n:
                problems.append(f"sender {p} described {len(d['enc'])} messages, this rank receives {n}")
        if problems:
            self.link.broken = "bad descriptors"
            raise RuntimeError(f"rank {self.link.rank}: " + "; ".join(problems))
        nth = {p: iter(described[p]["enc"]) if p in described else None for p in self.senders}
        payloads, recvs = [], [(p, self._headers_in[p]) for p in self.senders]
        for i, (p, view) in enumerate(self._recv_views):
            w = self._recv_word[i]
            e = next(nth[p]) if nth[p] is not None else [dc.DENSE, view.numel(), 0, -1, view.numel() // w]
            kind, nbytes = int(e[0]), int(e[1])
            if kind == dc.DENSE:
                if nbytes != view.numel():
                    self.link.broken = "bad descriptors"
                    raise RuntimeError(f"rank {self.link.rank}: sender {p} described a whole message of "
                                       f"{nbytes} bytes, this rank expects {view.numel()}")
                payloads.append(None)
                recvs.append((p, view))
            else:
                buf = torch.empty(nbytes, dtype=torch.uint8, device=self.link.device)
                payloads.append(buf)
                if nbytes:
                    recvs.append((p, buf))
        self._in = ({p: described.get(p) for p in self.senders}, payloads)
        return self.link.post([], recvs)

    def check_headers(self, version: int) -> None:
        """Receiver, after the receives completed: every sender sent ``version`` against the
        base it described, and the bytes it described. Raises ``RuntimeError`` (a protocol
        mismatch, never silently accepted)."""
        described = self._in[0] if self._in is not None else {}
        bad, want = {}, {}
        for p in self.senders:
            d = described.get(p)
            expect = (version, d["base"], sum(int(e[1]) for e in d["enc"])) if d else (version, 0, self._recv_bytes[p])
            got = tuple(int(x) for x in self._headers_in[p].tolist())
            if got != expect:
                bad[p], want[p] = got, expect
        if bad:
            self.link.broken = f"header mismatch {bad}"
            self._in = None
            raise RuntimeError(f"rank {self.link.rank}: cross-host headers (version, base, bytes) {bad} != "
                               f"expected {want}: sender and receiver disagree on the refit")

    def apply(self) -> None:
        """Receiver, after ``check_headers``: write the sparse payloads into the buffer (the base
        they were encoded against) and tally :attr:`last_received`."""
        described, payloads = self._in if self._in is not None else ({}, [None] * len(self._recvs))
        self._in = None
        nth = {p: iter(d["enc"]) if d else None for p, d in described.items()}
        tally = {"delta_bytes": 0, "dense_bytes": 0, "changed": 0, "compared": 0}
        for i, ((p, view), payload) in enumerate(zip(self._recv_views, payloads, strict=True)):
            e = next(nth[p]) if nth.get(p) is not None else None
            if payload is None:
                tally["dense_bytes"] += view.numel()
            else:
                dc.decode(int(e[0]), payload, view, self._recv_word[i], int(e[2]))
                tally["delta_bytes"] += payload.numel()
            if e is not None and int(e[3]) >= 0:
                tally["changed"] += int(e[3])
                tally["compared"] += int(e[4])
        self.last_received = tally
