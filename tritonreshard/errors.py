"""The engine's errors, at the bottom of the tree: every layer may import them, none imports upward.

Bad user input is a ``ValueError`` (naming every problem at once, before any byte moves); these are
the failures of a refit that was well formed.
"""
from __future__ import annotations

__all__ = ["RefitError", "PeerDiedError"]


class RefitError(RuntimeError):
    """A refit could not complete (a peer aborted, a source changed weights during a pull, ...)."""


class PeerDiedError(RefitError):
    """A peer process of the refit group is gone; this group's epoch is over. ``rank`` names it."""

    def __init__(self, rank: int, message: str):
        super().__init__(message)
        self.rank = rank
