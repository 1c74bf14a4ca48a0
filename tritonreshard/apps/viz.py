"""Pictures of a plan: who holds what, who needs what, what each destination receives; and of a
cross-host bench run: the hosts, their links and what crossed them (:func:`draw_links`).

``draw_plan(plan, "plan.png")`` draws, for one tensor (viewed on its first two dims):

* the global tensor colored by source owner (replicas share a label such as ``0,4``); for a
  destination built from parts (q/k/v -> qkv), the destination's boxes labeled with the source each
  comes from (or ``zeros``) instead;
* the global tensor colored by destination owner;
* each destination rank's local shard, with the region every op writes, colored by the source
  rank it comes from;
* the matrix of bytes between source and destination ranks (all tensors of the plan).
"""
from __future__ import annotations

import os

from tritonreshard.layout import Layout
from tritonreshard.planning import Plan
from tritonreshard.planning import fmt_bytes as _fmt_bytes

__all__ = ["draw_plan", "draw_links", "check_figure_path"]

_MAX_DST_PANELS = 8


def _rect_2d(intervals_per_dim):
    """Project a box (per-dim interval lists) onto (rows, cols) rectangles of a 2-D view."""
    if len(intervals_per_dim) == 0:
        return [((0, 1), (0, 1))]
    if len(intervals_per_dim) == 1:
        return [((0, 1), iv) for iv in intervals_per_dim[0]]
    return [(r, c) for r in intervals_per_dim[0] for c in intervals_per_dim[1]]


def _short(name: str) -> str:
    """``model.layers.0.self_attn.k_proj.weight`` -> ``k_proj.weight`` (labels must fit a box)."""
    return ".".join(name.split(".")[-2:])


def _view_extent(shape):
    if len(shape) == 0:
        return 1, 1
    if len(shape) == 1:
        return 1, shape[0]
    return shape[0], shape[1]


def _owner_groups(layout: Layout):
    """Ranks grouped by the rectangles they hold in the 2-D view: [(ranks, rectangles)]. Ranks whose
    regions differ only in dims past the first two (``S(2)`` of a 3-D tensor) share one group, so
    their labels are not drawn on top of each other."""
    groups: dict = {}
    for r in layout.ranks:
        segs = layout.segments(r)
        if all(segs) or not segs:
            rects = tuple(_rect_2d([tuple((a, b) for a, b, _ in s) for s in segs[:2]]))
            groups.setdefault(rects, []).append(r)
    return [(ranks, list(rects)) for rects, ranks in groups.items()]


def _shape_text(shape) -> str:
    """``(16, 2, 4)`` -> ``16x2x4``, folded onto two lines when long (a panel title must fit its panel)."""
    text = "x".join(map(str, shape)) or "scalar"
    if len(text) <= 18:
        return text
    half = (len(shape) + 1) // 2
    return "x".join(map(str, shape[:half])) + "x\n" + "x".join(map(str, shape[half:]))


def draw_plan(plan: Plan, path: str, name: str | None = None, title: str | None = None) -> str:
    """Draw ``plan`` for tensor ``name`` (default: the first) to the image file ``path``; returns it.

    Tensors of more than two dims are drawn on dims 0 and 1; regions that differ only in later dims
    share a box, labeled with every rank they stand for. Only the figure's own canvas is used:
    matplotlib's global backend (a notebook's inline one, a desktop window) is left as it is."""
    fig = _figure(plan, name, title)
    fig.savefig(path, dpi=110)
    return path


def _figure(plan: Plan, name: str | None, title: str | None):
    # Lazy: matplotlib is heavy to import and only a picture needs it (the ``tritonreshard`` command
    # and the demo import this module whether or not they draw). A bare Figure, not pyplot: pyplot
    # would pick (or need forcing to) a global backend; a Figure saves through Agg by itself.
    import matplotlib
    from matplotlib.figure import Figure

    name = name if name is not None else plan.names[0]
    if name not in plan.dst_layouts:
        raise ValueError(f"name={name!r} is not in the plan; it moves {list(plan.names)}")
    dst = plan.dst_layouts[name]
    parts = plan.parts.get(name)
    src = dst if parts is not None else plan.src_layouts[name]
    all_ranks = sorted(set(plan.src_ranks) | set(plan.dst_ranks))
    cmap = matplotlib.colormaps["tab20" if len(all_ranks) > 10 else "tab10"]
    panels = _Panels(src.shape, {r: cmap(i % cmap.N) for i, r in enumerate(all_ranks)})
    rows, cols = panels.rows, panels.cols
    hidden = len(src.shape) - 2  # dims past the 2-D view

    dst_ranks = list(dst.ranks)[:_MAX_DST_PANELS]
    # Each rank panel gets at least 2.1 in, so its two-line title never reaches its neighbour's.
    fig = Figure(figsize=(max(4.2 * 3, 2.1 * len(dst_ranks)), 4.2 + 3.2), layout="constrained")
    outer = fig.add_gridspec(2, 1, height_ratios=[1.3, 1])
    top = outer[0].subgridspec(1, 3)
    bottom = outer[1].subgridspec(1, max(3, len(dst_ranks)))
    ax_src = fig.add_subplot(top[0, 0])
    ax_dst = fig.add_subplot(top[0, 1])
    ax_mat = fig.add_subplot(top[0, 2])

    if parts is None:
        panels.setup(ax_src, rows, cols, f"{name} {_shape_text(src.shape)}: source owners\n{src}")
        panels.paint(ax_src, _owner_groups(src), "src ")
    else:
        panels.setup(ax_src, rows, cols, f"{_short(name)} {_shape_text(dst.shape)}\nbuilt from {len(parts)} part(s)")
        _draw_parts(panels, ax_src, parts)
    panels.setup(ax_dst, rows, cols, f"destination owners\n{dst}")
    panels.paint(ax_dst, _owner_groups(dst), "dst ")
    for i, d in enumerate(dst_ranks):
        _draw_received(panels, fig.add_subplot(bottom[0, i]), plan, name, d, bool(parts))
    _draw_matrix(ax_mat, plan)
    heading = title or plan.summary()
    if hidden > 0:
        dims = "dim 2" if hidden == 1 else f"dims 2-{len(src.shape) - 1}"
        heading += f"\n{name} is drawn on dims 0 and 1; {dims} not shown"
    fig.suptitle(heading, fontsize=11)
    return fig


class _Panels:
    """How every panel of one picture is set up, labeled and painted: the drawn tensor's 2-D view
    (``rows`` x ``cols`` of ``shape``) and one colour per rank."""

    def __init__(self, shape, color: dict):
        self.shape, self.color = shape, color
        self.rows, self.cols = _view_extent(shape)
        self.aspect_rc = max(self.rows, 1) / max(self.cols, 1)

    def setup(self, ax, nrows, ncols, heading):
        # Lazy, as every matplotlib import here: only a picture needs it (see _figure).
        from matplotlib.ticker import MaxNLocator, MultipleLocator

        ax.set_xlim(0, max(ncols, 1))
        ax.set_ylim(max(nrows, 1), 0)
        ax.set_aspect("equal" if 0.05 < self.aspect_rc < 20 else "auto")
        ax.set_title(heading, fontsize=9)
        ax.set_xlabel("dim 1" if len(self.shape) > 1 else "dim 0", fontsize=8)
        ax.set_ylabel("dim 0" if len(self.shape) > 1 else "", fontsize=8)
        ax.tick_params(labelsize=7)
        # At most ~8 labelled ticks per axis: every integer overlaps in a narrow panel.
        ax.xaxis.set_major_locator(MaxNLocator(8, integer=True, steps=[1, 2, 4, 5, 10]))
        ax.yaxis.set_major_locator(MaxNLocator(8, integer=True, steps=[1, 2, 4, 5, 10]))
        if max(nrows, ncols) <= 16:  # a grid line per element while elements are big enough to see
            ax.xaxis.set_minor_locator(MultipleLocator(1))
            ax.yaxis.set_minor_locator(MultipleLocator(1))
            ax.tick_params(which="minor", length=0)
            ax.grid(True, which="both", color="white", linewidth=0.6)

    @staticmethod
    def label(ax, r0, r1, c0, c1, nrows, ncols, text, size):
        # A tall strip narrower than its label (a column shard among many) gets a vertical label.
        # (Equal aspect: a panel's longer side sets the scale, so width / that side is its share.)
        vertical = (c1 - c0) / max(nrows, ncols, 1) < 0.2 and (r1 - r0) > (c1 - c0)
        ax.text((c0 + c1) / 2, (r0 + r1) / 2, text, ha="center", va="center", fontsize=size,
                rotation=90 if vertical else 0)

    def paint(self, ax, groups, prefix):
        from matplotlib.patches import Rectangle  # lazy: only a picture needs matplotlib (see _figure)

        for ranks, rects in groups:
            text = prefix + ",".join(map(str, ranks))
            for (r0, r1), (c0, c1) in rects:
                ax.add_patch(Rectangle((c0, r0), c1 - c0, r1 - r0, facecolor=self.color[ranks[0]],
                                       edgecolor="black", linewidth=1.0, alpha=0.85))
                self.label(ax, r0, r1, c0, c1, self.rows, self.cols, text, 8)


def _draw_parts(panels: _Panels, ax, parts) -> None:
    """A destination built from parts: each part's boxes, labeled with its source (or ``zeros``)."""
    # Lazy, as every matplotlib import here: only a picture needs it (see _figure).
    import matplotlib
    from matplotlib.patches import Rectangle

    pcolor = matplotlib.colormaps["Pastel1"]
    sources = sorted({p.sources for p in parts if p.src is not None})   # aliases: one colour
    for p in parts:
        text = "zeros" if p.src is None else " or ".join(map(_short, p.sources))
        if p.src is not None and p.src_start and any(p.src_start):  # a replica's source rows
            text += f" @{list(p.src_start)}"
        face = "white" if p.src is None else pcolor(sources.index(p.sources) % pcolor.N)
        for (r0, r1), (c0, c1) in _rect_2d([(iv,) for iv in p.dst]):
            ax.add_patch(Rectangle((c0, r0), c1 - c0, r1 - r0, facecolor=face, edgecolor="black",
                                   linewidth=1.0, hatch="//" if p.src is None else None))
            panels.label(ax, r0, r1, c0, c1, panels.rows, panels.cols, text, 7)


def _draw_received(panels: _Panels, ax, plan: Plan, name: str, d: int, has_parts: bool) -> None:
    """Destination rank ``d``'s local shard of ``name``: what each op (or fill) writes there."""
    from matplotlib.patches import Rectangle  # lazy: only a picture needs matplotlib (see _figure)

    dst = plan.dst_layouts[name]
    lr, lc = _view_extent(dst.local_shape(d))
    panels.setup(ax, lr, lc, f"rank {d} receives\n{_shape_text(dst.local_shape(d))}")
    # One box per rectangle of the view: ops that differ only in hidden dims share it, and its
    # label names every source (``from 0,1``) instead of stacking labels on one spot.
    boxes: dict = {}
    for op in plan.ops_for_dst(d):
        if op.name == name:
            for rect in _rect_2d([((s.start, s.stop),) for s in op.dst_slices]):
                boxes.setdefault(rect, {}).setdefault(op.src_name if has_parts else "", []).append(op.src_rank)
    for f in plan.fills_for_dst(d):
        if f.name == name:
            for rect in _rect_2d([((s.start, s.stop),) for s in f.dst_slices]):
                boxes.setdefault(rect, {}).setdefault(None, [])  # None: zero-filled
    for ((r0, r1), (c0, c1)), by_src in boxes.items():
        texts = ["zeros" if src_name is None else
                 (f"{_short(src_name)}\n" if src_name else "") + "from " + ",".join(map(str, dict.fromkeys(ranks)))
                 for src_name, ranks in by_src.items()]
        first = next((ranks[0] for ranks in by_src.values() if ranks), None)
        fill = dict(facecolor="white", hatch="//") if first is None else dict(facecolor=panels.color[first], alpha=0.85)
        ax.add_patch(Rectangle((c0, r0), c1 - c0, r1 - r0, edgecolor="black", linewidth=1.0, **fill))
        panels.label(ax, r0, r1, c0, c1, lr, lc, "\n".join(texts), 7)


def _draw_matrix(ax, plan: Plan) -> None:
    """The bytes between every source and destination rank, over all the plan's tensors."""
    st = plan.stats
    srcs, dsts = list(plan.src_ranks), list(plan.dst_ranks)
    matrix = [[st.pair_bytes.get((s, d), 0) for d in dsts] for s in srcs]
    peak = max((v for row in matrix for v in row), default=0) or 1
    # vmax above the peak keeps the darkest cell light enough for black labels.
    ax.imshow(matrix, cmap="Blues", vmin=0, vmax=peak * 1.6, aspect="auto")
    ax.set_xticks(range(len(dsts)), [str(d) for d in dsts], fontsize=7)
    ax.set_yticks(range(len(srcs)), [str(s) for s in srcs], fontsize=7)
    ax.set_xlabel("destination rank", fontsize=8)
    ax.set_ylabel("source rank", fontsize=8)
    ax.set_title(f"bytes between ranks (all {len(plan.names)} tensor(s))\n"
                 f"{st.num_ops} ops, {_fmt_bytes(st.total_bytes)}, local {_fmt_bytes(st.local_bytes)}",
                 fontsize=9)
    if len(srcs) * len(dsts) <= 144:
        for i, row in enumerate(matrix):
            for j, v in enumerate(row):
                ax.text(j, i, _fmt_bytes(v) if v else ".", ha="center", va="center", fontsize=7)


def draw_links(run: dict, path: str) -> str:
    """Draw a cross-host deltas run (``tritonreshard bench --update-lr ... --json``'s object) to the
    image file ``path``; returns it. One panel per row (learning rate and link rate): the hosts
    around their switch, each link labeled with its rate and, per session (``delta="off"``,
    ``"auto"``, ``"always"``), the bytes that crossed it per refit: the engine's payload and, from
    the host harness, the wire (the kernel's counters). Every number is the run's own."""
    fig = _links_figure(run)
    fig.savefig(path, dpi=110)
    return path


def _links_figure(run: dict):
    from matplotlib.figure import Figure  # lazy: see _figure
    from matplotlib.patches import Circle, FancyBboxPatch

    rows, n = run["rows"], run["hosts"]
    # host 0 (the trainers) on the left, the inference hosts stacked on the right; each link's
    # label above its host's box
    ys = [0.0] + [1.3 * ((n - 2) / 2 - k) for k in range(n - 1)]
    span = max(abs(y) for y in ys)
    fig = Figure(figsize=(7.5, (1.9 + 1.25 * span) * len(rows) + 0.6), layout="constrained")
    axes = fig.subplots(len(rows), 1, squeeze=False)[:, 0]
    for ax, row in zip(axes, rows, strict=True):
        ax.set_xlim(-1.55, 1.55)
        ax.set_ylim(-span - 0.25, span + 0.95)
        ax.set_aspect("equal")
        ax.axis("off")
        ax.add_patch(Circle((0, 0), 0.13, facecolor="0.85", edgecolor="black", zorder=2))
        ax.text(0, 0, "switch", ha="center", va="center", fontsize=6.5, zorder=3)
        link = link_name(row)
        for i, y in enumerate(ys):
            name = f"host{i}"
            x = -1.15 if i == 0 else 1.15
            ax.plot([0, x], [0, y], color="tab:blue", linewidth=2, zorder=1)
            who = run.get("placement", {}).get(name, {})
            sub = "; ".join(f"{k} {','.join(map(str, v))}" for k, v in who.items() if v)
            ax.add_patch(FancyBboxPatch((x - 0.34, y - 0.15), 0.68, 0.3, boxstyle="round,pad=0.02",
                                        facecolor="white", edgecolor="black", zorder=2))
            ax.text(x, y, name + (f"\n{sub}" if sub else ""), ha="center", va="center", fontsize=7, zorder=3)
            lines = [f"{link} each way; per refit:"]
            for d, figures in row["links"].items():
                f = figures[name]
                wire = f" (wire {_fmt_bytes(f['wire'])})" if "wire" in f else ""
                lines.append(f"{d}: {_fmt_bytes(f['payload'])}{wire}")
            ax.text(x, y + 0.55, "\n".join(lines), ha="center", va="center", fontsize=6.5, zorder=3,
                    bbox=dict(facecolor="white", edgecolor="none", alpha=0.85))
        auto = row["auto_picked"] if row["auto_picked"] == "whole" else \
            f"{row['auto_picked']} ({_fmt_bytes(row['auto_bytes'])})"
        ax.set_title(f"lr {row['lr']}, every link {link}: auto sent {auto}; refit off / auto / always "
                     f"{row['refit_ms_off']:.0f} / {row['refit_ms_auto']:.0f} / {row['refit_ms_delta']:.0f} ms"
                     f"{'' if row['verified'] else ' (NOT VERIFIED)'}", fontsize=8)
    how = "network namespaces (real TCP, tbf rates)" if run.get("net") == "namespaces" else \
        "labels on one machine (loopback, simulated rates)"
    fig.suptitle(f"{run['layout']}, {_fmt_bytes(run['size'])} bf16 over {n} hosts: {how}\n"
                 f"payload: the engine's cross-host bytes; wire: the kernel's counters of the host's interface",
                 fontsize=9)
    return fig


def link_name(row: dict) -> str:
    """A bench row's link as the table and the picture name it: its rate, or the link as it is."""
    if row["link_gbps"] is not None:
        return f"{row['link_gbps']:g} Gb/s"
    return "loopback" if row.get("net") == "labels" else "unlimited"


def check_figure_path(path: str, what: str = "--png") -> None:
    """Raises ``ValueError`` naming ``what`` when a figure cannot be saved to ``path`` (a format
    matplotlib does not write, a missing or read-only folder): checked before any work, so a run
    never fails at its very end."""
    from matplotlib.figure import Figure  # lazy, as in draw_plan: only a picture needs matplotlib

    problems = []
    ext = os.path.splitext(path)[1].lower().lstrip(".")
    formats = Figure().canvas.get_supported_filetypes()
    if ext not in formats:
        problems.append(f"{what}={path!r}: the file name must end in one of "
                        f"{', '.join('.' + f for f in sorted(formats))}")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        problems.append(f"{what}={path!r}: folder {folder!r} does not exist")
    elif not os.access(folder, os.W_OK):
        problems.append(f"{what}={path!r}: folder {folder!r} is not writable")
    elif os.path.isdir(path):
        problems.append(f"{what}={path!r} is a folder; give a file name")
    if problems:
        raise ValueError("; ".join(problems))
