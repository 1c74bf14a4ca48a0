"""Pictures of a plan: who holds what, who needs what, what each destination receives.

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
from tritonreshard.planning import Plan, fmt_bytes as _fmt_bytes

__all__ = ["draw_plan", "check_figure_path"]

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
    """Ranks grouped by identical regions: [(ranks, rectangles)]."""
    groups: dict = {}
    for r in layout.ranks:
        segs = layout.segments(r)
        if all(segs) or not segs:
            groups.setdefault(segs, []).append(r)
    out = []
    for segs, ranks in groups.items():
        rects = _rect_2d([tuple((a, b) for a, b, _ in s) for s in segs])
        out.append((ranks, rects))
    return out


def draw_plan(plan: Plan, path: str, name: str | None = None, title: str | None = None) -> str:
    """Draw ``plan`` for tensor ``name`` (default: the first) to the image file ``path``; returns it."""
    # Lazy: matplotlib is heavy to import and only a picture needs it (the ``tritonreshard`` command
    # and the demo import this module whether or not they draw).
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    name = name if name is not None else plan.names[0]
    if name not in plan.dst_layouts:
        raise ValueError(f"name={name!r} is not in the plan; it moves {list(plan.names)}")
    dst = plan.dst_layouts[name]
    parts = plan.parts.get(name)
    src = dst if parts is not None else plan.src_layouts[name]
    all_ranks = sorted(set(plan.src_ranks) | set(plan.dst_ranks))
    cmap = plt.get_cmap("tab20" if len(all_ranks) > 10 else "tab10")
    color = {r: cmap(i % cmap.N) for i, r in enumerate(all_ranks)}
    rows, cols = _view_extent(src.shape)
    aspect_rc = max(rows, 1) / max(cols, 1)

    dst_ranks = list(dst.ranks)[:_MAX_DST_PANELS]
    fig = plt.figure(figsize=(4.2 * 3, 4.2 + 3.2), constrained_layout=True)
    grid = fig.add_gridspec(2, max(3, len(dst_ranks)), height_ratios=[1.3, 1])
    ax_src = fig.add_subplot(grid[0, 0])
    ax_dst = fig.add_subplot(grid[0, 1])
    ax_mat = fig.add_subplot(grid[0, 2:] if len(dst_ranks) > 3 else grid[0, 2])

    def setup(ax, nrows, ncols, heading):
        ax.set_xlim(0, max(ncols, 1))
        ax.set_ylim(max(nrows, 1), 0)
        ax.set_aspect("equal" if 0.05 < aspect_rc < 20 else "auto")
        ax.set_title(heading, fontsize=10)
        ax.set_xlabel("dim 1" if len(src.shape) > 1 else "dim 0", fontsize=8)
        ax.set_ylabel("dim 0" if len(src.shape) > 1 else "", fontsize=8)
        ax.tick_params(labelsize=7)
        if max(nrows, ncols) <= 16:
            ax.set_xticks(range(ncols + 1))
            ax.set_yticks(range(nrows + 1))
            ax.grid(True, color="white", linewidth=0.6)

    def paint(ax, groups, prefix):
        for ranks, rects in groups:
            label = prefix + ",".join(map(str, ranks))
            for (r0, r1), (c0, c1) in rects:
                ax.add_patch(Rectangle((c0, r0), c1 - c0, r1 - r0, facecolor=color[ranks[0]],
                                       edgecolor="black", linewidth=1.0, alpha=0.85))
                ax.text((c0 + c1) / 2, (r0 + r1) / 2, label, ha="center", va="center", fontsize=8,
                        wrap=True)

    if parts is None:
        setup(ax_src, rows, cols, f"{name} {tuple(src.shape)}: source owners\n{src}")
        paint(ax_src, _owner_groups(src), "src ")
    else:
        setup(ax_src, rows, cols, f"{_short(name)} {tuple(dst.shape)}\nbuilt from {len(parts)} part(s)")
        pcolor = plt.get_cmap("Pastel1")
        sources = sorted({p.src for p in parts if p.src is not None})
        for p in parts:
            label = "zeros" if p.src is None else _short(p.src)
            if p.src is not None and p.src_start and any(p.src_start):  # a replica's source rows
                label += f" @{list(p.src_start)}"
            face = "white" if p.src is None else pcolor(sources.index(p.src) % pcolor.N)
            for (r0, r1), (c0, c1) in _rect_2d([(iv,) for iv in p.dst]):
                ax_src.add_patch(Rectangle((c0, r0), c1 - c0, r1 - r0, facecolor=face, edgecolor="black",
                                           linewidth=1.0, hatch="//" if p.src is None else None))
                ax_src.text((c0 + c1) / 2, (r0 + r1) / 2, label, ha="center", va="center", fontsize=7)
    setup(ax_dst, rows, cols, f"destination owners\n{dst}")
    paint(ax_dst, _owner_groups(dst), "dst ")

    for i, d in enumerate(dst_ranks):
        ax = fig.add_subplot(grid[1, i])
        lr, lc = _view_extent(dst.local_shape(d))
        setup(ax, lr, lc, f"rank {d} receives {dst.local_shape(d)}")
        for op in plan.ops_for_dst(d):
            if op.name != name:
                continue
            label = f"from {op.src_rank}" if parts is None else f"{_short(op.src_name)}\nfrom {op.src_rank}"
            for (r0, r1), (c0, c1) in _rect_2d([((s.start, s.stop),) for s in op.dst_slices]):
                ax.add_patch(Rectangle((c0, r0), c1 - c0, r1 - r0, facecolor=color[op.src_rank],
                                       edgecolor="black", linewidth=1.0, alpha=0.85))
                ax.text((c0 + c1) / 2, (r0 + r1) / 2, label, ha="center", va="center", fontsize=7)
        for f in plan.fills_for_dst(d):
            if f.name != name:
                continue
            for (r0, r1), (c0, c1) in _rect_2d([((s.start, s.stop),) for s in f.dst_slices]):
                ax.add_patch(Rectangle((c0, r0), c1 - c0, r1 - r0, facecolor="white", edgecolor="black",
                                       linewidth=1.0, hatch="//"))
                ax.text((c0 + c1) / 2, (r0 + r1) / 2, "zeros", ha="center", va="center", fontsize=7)

    st = plan.stats
    srcs, dsts = list(plan.src_ranks), list(plan.dst_ranks)
    matrix = [[st.pair_bytes.get((s, d), 0) for d in dsts] for s in srcs]
    peak = max((v for row in matrix for v in row), default=0) or 1
    # vmax above the peak keeps the darkest cell light enough for black labels.
    ax_mat.imshow(matrix, cmap="Blues", vmin=0, vmax=peak * 1.6, aspect="auto")
    ax_mat.set_xticks(range(len(dsts)), [str(d) for d in dsts], fontsize=7)
    ax_mat.set_yticks(range(len(srcs)), [str(s) for s in srcs], fontsize=7)
    ax_mat.set_xlabel("destination rank", fontsize=8)
    ax_mat.set_ylabel("source rank", fontsize=8)
    ax_mat.set_title(f"bytes between ranks (all {len(plan.names)} tensor(s))\n"
                     f"{st.num_ops} ops, {_fmt_bytes(st.total_bytes)}, local {_fmt_bytes(st.local_bytes)}",
                     fontsize=10)
    if len(srcs) * len(dsts) <= 144:
        for i, row in enumerate(matrix):
            for j, v in enumerate(row):
                ax_mat.text(j, i, _fmt_bytes(v) if v else ".", ha="center", va="center", fontsize=7)
    fig.suptitle(title or plan.summary(), fontsize=11)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path



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
