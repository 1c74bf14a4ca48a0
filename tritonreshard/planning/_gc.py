"""Planning makes hundreds of thousands of small, long-lived objects (ops, boxes, transfers) at
frontier scale, and none of them form reference cycles. CPython's cyclic collector runs every few
hundred allocations and rescans the growing young generations each time: at Qwen3-235B scale that
was 40% of a host part's planning time. The planners pause it while they run (reference counting
still frees everything; the collector runs again at the next allocation threshold afterwards)."""
from __future__ import annotations

import functools
import gc


def gc_paused(fn):
    """``fn`` runs with the cyclic garbage collector paused (it is re-enabled after, also on error,
    and only if it was enabled: nesting and callers that disabled it themselves are unaffected)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if not gc.isenabled():
            return fn(*args, **kwargs)
        gc.disable()
        try:
            return fn(*args, **kwargs)
        finally:
            gc.enable()

    return wrapper
