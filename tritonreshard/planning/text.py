"""How plans print: slices, global indices and byte sizes, one way for every printer (plans, host
plans, the CLI, the bench and the pictures)."""
from __future__ import annotations

__all__ = ["fmt_bytes", "fmt_global", "fmt_slices"]


def fmt_slices(slices) -> str:
    """``[0:4, 2:6]`` for a tuple of slices."""
    return "[" + ", ".join(f"{s.start}:{s.stop}" for s in slices) + "]"


def fmt_global(index) -> str:
    """A global index given per dim as intervals: ``[0:2+4:6, -]`` (``-``: empty)."""
    dims = []
    for intervals in index:
        dims.append("+".join(f"{a}:{b}" for a, b in intervals) if intervals else "-")
    return "[" + ", ".join(dims) + "]"


def fmt_bytes(n: float) -> str:
    """``512 B``, ``1.5 KiB``, ... ``2.0 TiB``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(n) < 1024 or unit == "PiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
