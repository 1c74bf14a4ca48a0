"""How cross-host messages travel: whole every refit (:class:`Dense`) or as exact deltas against
what the receiver holds (:class:`Delta`), both a :class:`Codec`. One object, chosen once at set-up;
the sender asks it two questions (may this receiver get deltas? how is this message encoded?) and
never looks at a mode string or the codec's type.

``Delta()`` ("auto") also weighs the link against detection: comparing and encoding a byte costs
time (on CPU about 0.7 s/GB of one core at an Adam step, ``bench/delta_detect.py``: slower than a
loopback link), so a delta pays only where the link is slower
than finding what changed. The codec is chosen once and frozen; what it weighs is measured per
sender, by a :class:`LinkModel` (mutable, one per sending rank) that the codec's questions take.

Every rank of a group passes the same codec (it travels in the rank's hello and is compared: a
codec mismatch is named before any data moves). The string spelling (``delta="auto" | "off" |
"always"``, ``delta_anchor=``) that vLLM's init info and the CLI carry is :func:`codec_for`.
"""
from __future__ import annotations

import statistics
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch

from . import delta as dc

__all__ = ["Codec", "DELTA_MODES", "Delta", "Dense", "LinkModel", "codec_for", "delta_problems"]

#: The string spellings of a codec (``codec_for``): sparse when it pays, never, always (tests).
DELTA_MODES = ("auto", "off", "always")


class LinkModel:
    """One sender's measured speeds: of its link (bytes/s of its recent whole sends) and of
    detection (bytes/s of its recent deltas: comparing and compacting, then applying to a copy of the
    base as the receiver does, :meth:`delta_applied`), with the fraction of
    the compared bytes its recent deltas carried. :meth:`prefers_delta` weighs them.

    The rule, per transfer of ``n`` bytes: a delta costs ``n / detect + f * n / link`` (find what
    changed, send the fraction ``f`` that is left), whole costs ``n / link``; the delta is chosen
    when it costs less, so ``n`` cancels: ``detect * (1 - f) > link``. What is not known yet is
    measured first, in the order refits give it:

    * no link figure: whole (the first transfer is whole anyway: no base). The first whole send
      of a link is not counted: the process group (gloo, NCCL) connects each pair at its first
      message, so that send times the connection, not the bytes.
    * link known, detection not: the delta, to measure it (then the rule decides). A
      calibration encode at set-up would not do: detection's cost depends on what changed (0.2
      s/GB when nothing did, 1.4 s/GB at 17% changed, on one CPU core), which only a real version shows.
      The first delta encode of a sender is not counted either (its fraction is): it is the first
      to touch the encoder's working memory, the size of what it compares, so it pays the page
      faults that later encodes find already done (the allocator keeps what they freed; 1.4x the
      time of a warm encode for 32 MiB on CPU), and on CUDA the allocator's first reservations and
      the kernels' compilation. Counted, it makes detection look slower than it is, and ``auto``
      would send whole where the delta pays (measured across a 3 Gbit/s link of the host harness:
      0.19 GB/s cold, 0.30 warm, against the link's 0.19). So the second delta measures detection.
    * every ``reprobe`` whole sends in a row after a delta measurement: the delta once more, as
      the updates (``f``) and the machine's load change.

    Transfers under ``min_bytes`` are not weighed (always the delta, as bytes decide): their time
    is fixed costs (signals, a round trip, thread wake-ups, ~1 ms either way), not their bytes, so
    rates measured there say nothing about the link and either choice costs the same.

    Estimates are medians of the last ``window`` measurements (a refit on a loaded machine can
    take twice the usual). While deltas are sent, the link is measured again only at the anchors
    (``Delta(anchor=)``: whole transfers). ``link_bps`` / ``detect_bps`` / ``fraction``: starting
    estimates (tests, or a link known in advance), each used until it is measured; ``clock``:
    seconds, monotonic (tests inject one). Not thread-safe: its sender's thread alone uses it.
    """

    def __init__(self, *, link_bps: float | None = None, detect_bps: float | None = None, fraction: float = 0.0,
                 window: int = 8, min_bytes: int = 1 << 20, reprobe: int = 64,
                 clock: Callable[[], float] = time.perf_counter):
        problems = []
        for name, v in (("link_bps", link_bps), ("detect_bps", detect_bps)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0):
                problems.append(f"{name} must be None or bytes/s > 0, got {name}={v!r}")
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 <= fraction <= 1:
            problems.append(f"fraction must be in [0, 1] (a delta's bytes over the bytes compared), got "
                            f"fraction={fraction!r}")
        for name, v, low in (("window", window, 1), ("min_bytes", min_bytes, 0), ("reprobe", reprobe, 1)):
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                problems.append(f"{name} must be an int >= {low}, got {name}={v!r}")
        if not callable(clock):
            problems.append(f"clock must be a callable returning seconds, got clock={clock!r}")
        if problems:
            raise ValueError("LinkModel: " + "; ".join(problems))
        self.clock, self.min_bytes, self.reprobe = clock, min_bytes, reprobe
        self._start = (link_bps, detect_bps, float(fraction))
        self._link, self._detect, self._fraction = (deque(maxlen=window) for _ in range(3))
        self._connected = link_bps is not None   # a starting figure: no first send to discard
        self._warm = detect_bps is not None      # nor a first encode
        self._wholes_since_delta = 0
        self._encoded: tuple[int, float] | None = None   # the last counted encode, until its apply

    @property
    def link_bps(self) -> float | None:
        """The link's bytes/s (median of the recent whole sends; before any, the starting figure or None)."""
        return statistics.median(self._link) if self._link else self._start[0]

    @property
    def detect_bps(self) -> float | None:
        """Detection's bytes/s (median of the recent delta encodes; before any, the starting figure or None)."""
        return statistics.median(self._detect) if self._detect else self._start[1]

    @property
    def fraction(self) -> float:
        """The recent deltas' bytes over the bytes they compared (median; before any, the starting figure)."""
        return statistics.median(self._fraction) if self._fraction else self._start[2]

    def whole_sent(self, nbytes: int, seconds: float) -> None:
        """A whole transfer of ``nbytes`` completed in ``seconds`` (posting to completion)."""
        if not self._connected:
            self._connected = True
            return
        if nbytes >= self.min_bytes and seconds > 0:
            self._link.append(nbytes / seconds)
            self._wholes_since_delta += 1

    def delta_encoded(self, compared: int, seconds: float, encoded: int) -> None:
        """Encoding ``compared`` bytes against the snapshot took ``seconds`` and gave ``encoded``
        bytes to send (whole messages among them included)."""
        self._encoded = None
        if compared >= self.min_bytes and seconds > 0:
            if self._warm:
                self._detect.append(compared / seconds)
                self._encoded = (compared, seconds)
            self._warm = True
            self._fraction.append(min(1.0, encoded / compared))
        self._wholes_since_delta = 0

    def delta_applied(self, compared: int, seconds: float) -> None:
        """Applying the last encoded delta (of ``compared`` bytes) to a copy of the base took
        ``seconds``: the sender's own snapshot update, the same work the receiver does before its
        readers can pull. Detection's figure for that delta becomes encode plus apply: at CPU
        encode speeds near a 10 Gbit/s link, the apply is what decides."""
        if self._encoded is not None and self._encoded[0] == compared and seconds > 0:
            self._detect[-1] = compared / (self._encoded[1] + seconds)
        self._encoded = None

    def prefers_delta(self, nbytes: int) -> bool:
        """Whether a transfer of ``nbytes`` should travel as a delta (see the class docstring)."""
        if nbytes < self.min_bytes:
            return True
        link, detect = self.link_bps, self.detect_bps
        if link is None:
            return False
        if detect is None or self._wholes_since_delta >= self.reprobe:
            return True
        return detect * (1.0 - self.fraction) > link

    def __repr__(self) -> str:
        def gbs(v):
            return "?" if v is None else f"{v / 1e9:.3g} GB/s"
        return (f"LinkModel(link {gbs(self.link_bps)}, detection {gbs(self.detect_bps)}, "
                f"delta {100 * self.fraction:.3g}% of compared)")


class Codec(ABC):
    """How cross-host messages travel: the questions a sender and a receiving relay ask (every
    rank of a group passes the same codec). Subclasses are frozen dataclasses (they travel in the
    rank's hello and compare)."""

    #: The sender keeps a copy of what it last sent (the deltas' base).
    keeps_snapshot: ClassVar[bool]

    @property
    @abstractmethod
    def mode(self) -> str:
        """The string spelling (``delta=``: one of :data:`DELTA_MODES`)."""

    @abstractmethod
    def wants_delta(self, link: LinkModel | None = None, nbytes: int = 0) -> bool:
        """Whether deltas pay for this sender (so it keeps a base: the snapshot)."""

    @abstractmethod
    def sends_delta(self, deltas_since_whole: int, link: LinkModel | None = None, nbytes: int = 0) -> bool:
        """Whether a receiver whose base is what this rank last sent it gets deltas now."""

    @abstractmethod
    def encode(self, new: torch.Tensor, old: torch.Tensor, word: int) -> dc.Encoded:
        """One message's encoding against ``old`` (flat uint8, ``word``-byte words)."""


@dataclass(frozen=True)
class Dense(Codec):
    """Every cross-host message travels whole, every refit; the sender keeps no snapshot."""

    keeps_snapshot: ClassVar[bool] = False

    @property
    def mode(self) -> str:
        return "off"

    def wants_delta(self, link: LinkModel | None = None, nbytes: int = 0) -> bool:
        return False

    def sends_delta(self, deltas_since_whole: int, link: LinkModel | None = None, nbytes: int = 0) -> bool:
        return False

    def encode(self, new: torch.Tensor, old: torch.Tensor, word: int) -> dc.Encoded:
        return dc.Encoded(dc.DENSE, new.numel(), new.numel() // word, word, -1)


@dataclass(frozen=True)
class Delta(Codec):
    """Each receiver gets only the elements that changed since the version its buffer holds (bits
    compared, exact; :mod:`~tritonreshard.transport.delta`), per message the smallest encoding,
    whole included, on a transfer where finding them costs less than sending whole (the sender's
    :class:`LinkModel`; otherwise the transfer is whole, with no comparison).

    ``anchor``: a whole transfer every that many versions (an int >= 1); ``force``: a delta on
    every transfer, whatever the link, and a sparse encoding even where whole is smaller (tests:
    every encoding decoded)."""

    anchor: int = 64
    force: bool = False
    keeps_snapshot: ClassVar[bool] = True

    def __post_init__(self):
        problems = []
        if isinstance(self.anchor, bool) or not isinstance(self.anchor, int) or self.anchor < 1:
            problems.append(f"anchor must be an int >= 1 (a whole transfer every that many versions), got "
                            f"anchor={self.anchor!r}")
        if not isinstance(self.force, bool):
            problems.append(f"force must be True or False, got force={self.force!r}")
        if problems:
            raise ValueError("Delta: " + "; ".join(problems))

    @property
    def mode(self) -> str:
        return "always" if self.force else "auto"

    def wants_delta(self, link: LinkModel | None = None, nbytes: int = 0) -> bool:
        """``force``, or no ``link`` to weigh (bytes decide), or ``link.prefers_delta(nbytes)``:
        ``nbytes`` is what the sender sends per refit."""
        return self.force or link is None or link.prefers_delta(nbytes)

    def sends_delta(self, deltas_since_whole: int, link: LinkModel | None = None, nbytes: int = 0) -> bool:
        """Deltas pay (:meth:`wants_delta`) and no anchor is due (after ``anchor - 1`` deltas)."""
        return deltas_since_whole + 1 < self.anchor and self.wants_delta(link, nbytes)

    def encode(self, new: torch.Tensor, old: torch.Tensor, word: int) -> dc.Encoded:
        return dc.encode(new, old, word, force_sparse=self.force)



def delta_problems(delta, anchor) -> list[str]:
    """Problems of a ``delta=`` / ``delta_anchor=`` pair, the string spelling (empty when valid)."""
    out = []
    if not isinstance(delta, str) or delta not in DELTA_MODES:
        out.append(f"delta must be one of {list(DELTA_MODES)}, got delta={delta!r}")
    if isinstance(anchor, bool) or not isinstance(anchor, int) or anchor < 1:
        out.append(f"delta_anchor must be an int >= 1 (a whole transfer every that many versions), "
                   f"got delta_anchor={anchor!r}")
    return out


def codec_for(delta: str = "auto", anchor: int = 64) -> Codec:
    """The codec a ``delta=`` / ``delta_anchor=`` pair names (``ValueError`` naming both problems)."""
    problems = delta_problems(delta, anchor)
    if problems:
        raise ValueError("; ".join(problems))
    return Dense() if delta == "off" else Delta(anchor=anchor, force=delta == "always")
