"""What a set-up step costs this process, measured, not computed: :class:`Cost`.

Wall and CPU time (``time.process_time``: this machine's cores are shared, and a busy neighbour
stretches wall time, not CPU time), and resident memory from ``/proc/self/status``: the peak
(``VmHWM``, reset first through ``/proc/self/clear_refs``, so it is this step's peak, not the
process's) above the resident set before, and what is still resident after. Where the kernel
refuses the reset (no ``/proc``, another OS), the memory figures are None: unmeasured, never guessed.
"""
from __future__ import annotations

import gc
import time

from ..engine.heap import release_freed_heap

__all__ = ["Cost"]


def _status() -> dict[str, int]:
    """``VmRSS`` and ``VmHWM`` in bytes ({} without /proc)."""
    try:
        with open("/proc/self/status") as f:
            return {k: int(v.split()[0]) * 1024 for k, v in (line.split(":", 1) for line in f)
                    if k in ("VmRSS", "VmHWM")}
    except OSError:
        return {}


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # 5: reset the peak resident set size to the current one (proc(5))
        return True
    except OSError:
        return False


class Cost:
    """``with Cost() as c: ...``, then ``c.stats(prefix)``: ``{prefix_ms, prefix_cpu_ms,
    prefix_peak_bytes, prefix_held_bytes}`` (peak: the largest resident set during the block above
    the one before it; held: resident after the block, garbage collected, above before)."""

    def __enter__(self) -> Cost:
        gc.collect()
        self._measured = _reset_peak()
        self._before = _status().get("VmRSS")
        self._t0, self._c0 = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc) -> None:
        self.ms = (time.perf_counter() - self._t0) * 1e3
        self.cpu_ms = (time.process_time() - self._c0) * 1e3
        peak = _status().get("VmHWM")
        gc.collect()
        release_freed_heap()  # what the step freed is then not counted as held
        after = _status().get("VmRSS")
        ok = self._measured and None not in (self._before, peak, after)
        self.peak_bytes = max(0, peak - self._before) if ok else None
        self.held_bytes = after - self._before if ok else None

    def stats(self, prefix: str) -> dict:
        return {f"{prefix}_ms": round(self.ms, 1), f"{prefix}_cpu_ms": round(self.cpu_ms, 1),
                f"{prefix}_peak_bytes": self.peak_bytes, f"{prefix}_held_bytes": self.held_bytes}
