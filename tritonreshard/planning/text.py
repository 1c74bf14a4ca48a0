"""How plans print: slices, global indices, byte sizes and tables, one way for every printer (plans,
host plans, the CLI, the bench and the pictures)."""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from itertools import islice

__all__ = ["fmt_box", "fmt_bytes", "fmt_global", "fmt_ranks", "fmt_slices", "render_table"]


def fmt_slices(slices) -> str:
    """``[0:4, 2:6]`` for a tuple of slices."""
    return "[" + ", ".join(f"{s.start}:{s.stop}" for s in slices) + "]"


def fmt_box(box) -> str:
    """``[0:4, 2:6]`` for a box given per dim as ``(start, stop)``."""
    return "[" + ", ".join(f"{a}:{b}" for a, b in box) + "]"


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


def fmt_ranks(ranks) -> str:
    """``{0,1,4}``."""
    return "{" + ",".join(map(str, ranks)) + "}"


def render_table(headers: Sequence[str], rows: Iterable[Sequence[str]], *, max_rows: int | None = None,
                 sections: Sequence[tuple[str, int]] | None = None, right: bool = False) -> list[str]:
    """``headers`` and ``rows`` (cells already formatted) as lines of aligned columns, indented two
    spaces: left-aligned (listings of ops) or, with ``right``, right-aligned (byte matrices, where
    numbers line up by their last digit).

    ``max_rows`` caps the rows shown (``None``: all). Rows come in ``sections`` (``(noun, count)``
    in row order; default one section of ``"rows"``, which needs ``rows`` to be a sequence); each
    section with hidden rows ends the table with ``... N more <noun>``, so a capped table says what
    it left out. ``rows`` may be a generator: only the rows shown are formatted, which keeps the
    table of a plan with many thousand ops cheap.
    """
    if sections is None:
        sections = (("rows", len(rows)),)
    shown = list(islice(rows, max_rows))
    cells = [tuple(headers)] + [tuple(r) for r in shown]
    widths = [max(len(r[i]) for r in cells) for i in range(len(cells[0]))]
    pad = str.rjust if right else str.ljust
    lines = ["  " + "  ".join(pad(c, w) for c, w in zip(r, widths, strict=True)).rstrip() for r in cells]
    start = 0
    for noun, count in sections:
        hidden = count - max(0, min(len(shown) - start, count))
        if hidden:
            lines.append(f"  ... {hidden} more {noun}")
        start += count
    return lines
