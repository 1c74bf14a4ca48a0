"""Waits the tests need on a bare control block (the engine waits through ``Group.wait``): each is
the engine's one wait primitive, ``tritonreshard.transport.wait.wait_until``, on the block's doorbell."""
from __future__ import annotations

import time

from tritonreshard.transport.wait import wait_until


def _wait(cb, done, timeout: float, what: str) -> None:
    def check():
        reason = cb.abort_reason()
        if reason:
            raise RuntimeError(f"aborted while waiting for {what}: {reason}")
    if not wait_until(done, cb.doorbell, time.monotonic() + timeout, check):
        raise TimeoutError(f"timed out after {timeout:.3g} s waiting for {what}")


def wait_published(cb, min_version: int, timeout: float) -> int:
    """Reader: wait until ``cb.published_version >= min_version``; returns it."""
    _wait(cb, lambda: cb.published_version >= min_version, timeout,
          f"published_version >= {min_version} (now {cb.published_version})")
    return cb.published_version


def wait_acked(cb, version: int, timeout: float) -> None:
    """Publisher: wait until every reader acked ``version`` (or later)."""
    try:
        _wait(cb, lambda: all(v >= version for v in cb.acked_versions()), timeout,
              f"all {cb.n_readers} readers to ack version {version}")
    except TimeoutError as e:
        behind = [i for i, v in enumerate(cb.acked_versions()) if v < version]
        raise TimeoutError(f"{e}; readers still behind: {behind}") from None


def poll_until(predicate, timeout: float, *, what: str) -> None:
    """Poll ``predicate`` (no doorbell to sleep on) until true; TimeoutError names ``what``."""
    if not wait_until(predicate, lambda: None, time.monotonic() + timeout):
        raise TimeoutError(f"timed out after {timeout:.3g} s waiting for {what}")
