"""How cross-host messages travel: whole every refit (:class:`Dense`) or as exact deltas against
what the receiver holds (:class:`Delta`). One object, chosen once at set-up; the sender asks it
two questions (may this receiver get deltas? how is this message encoded?) and never looks at a
mode string.

Every rank of a group passes the same codec (it travels in the rank's hello and is compared: a
codec mismatch is named before any data moves). The string spelling (``delta="auto" | "off" |
"always"``, ``delta_anchor=``) that vLLM's init info and the CLI carry is :func:`codec_for`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Union

import torch

from . import delta as dc

__all__ = ["Codec", "DELTA_MODES", "Delta", "Dense", "codec_for", "delta_problems"]

#: The string spellings of a codec (``codec_for``): sparse when smaller, never, always (tests).
DELTA_MODES = ("auto", "off", "always")


@dataclass(frozen=True)
class Dense:
    """Every cross-host message travels whole, every refit; the sender keeps no snapshot."""

    #: The sender keeps a copy of what it last sent (the deltas' base).
    keeps_snapshot: ClassVar[bool] = False

    @property
    def mode(self) -> str:
        """The string spelling (``delta=``)."""
        return "off"

    def sends_delta(self, deltas_since_whole: int) -> bool:
        """Whether a receiver whose base is what this rank last sent it gets deltas now."""
        return False

    def encode(self, new: torch.Tensor, old: torch.Tensor, word: int) -> dc.Encoded:
        return dc.Encoded(dc.DENSE, new.numel(), new.numel() // word, word, -1)


@dataclass(frozen=True)
class Delta:
    """Each receiver gets only the elements that changed since the version its buffer holds (bits
    compared, exact; :mod:`~tritonreshard.transport.delta`), per message the smallest encoding,
    whole included.

    ``anchor``: a whole transfer every that many versions (an int >= 1); ``force``: a sparse
    encoding even where whole is smaller (tests: every encoding decoded)."""

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

    def sends_delta(self, deltas_since_whole: int) -> bool:
        return deltas_since_whole + 1 < self.anchor

    def encode(self, new: torch.Tensor, old: torch.Tensor, word: int) -> dc.Encoded:
        return dc.encode(new, old, word, force_sparse=self.force)


Codec = Union[Dense, Delta]


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
