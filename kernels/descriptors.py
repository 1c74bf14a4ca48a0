"""A rank's transfer ops -> descriptor tables for the gather kernels, built once and reused every refit.

Who calls what: a destination rank (or :func:`tritonreshard.execute_local`, for all ranks of one
process) calls :meth:`DescriptorTable.build` once with callables that return torch views: the source
rank's full local shard (possibly a view into an arena mapped from another process) and this rank's
local shard. Every refit it then calls :meth:`DescriptorTable.run`, which is at most two kernel
launches (one per kernel variant, see ``tritonreshard.kernels.gather``) per (source dtype,
destination dtype) group, whatever the number of tensors and source ranks. A CUDA launch goes to the
current stream of the tables' device.

A table holds raw addresses: the tensors behind the views must stay allocated (and mapped) as long as
the table is used. The table keeps references to the views, which keeps torch-owned storage alive;
memory mapped by a transport must be kept mapped by its owner.
"""
from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch

from . import gather as _k
from .backends import copy_backend

__all__ = ["DescriptorTable", "Entry", "Region"]


@dataclass(frozen=True)
class Region:
    """One row of the kernel's table: a rectangular region after collapsing dims that are contiguous
    in both source and destination (<= 4 dims). Offsets are in bytes from the first element of the
    source rank's full local shard / the destination rank's local shard; strides are in elements."""

    shape: tuple[int, ...]
    src_strides: tuple[int, ...]
    dst_strides: tuple[int, ...]
    src_offset: int
    dst_offset: int
    src_addr: int = field(repr=False)
    dst_addr: int = field(repr=False)
    itemsize_src: int = field(repr=False)
    itemsize_dst: int = field(repr=False)


@dataclass(frozen=True)
class Entry:
    """One transfer op as the table sees it (readable; ``src_view``/``dst_view`` are the exact torch
    views the op copies between, useful to step through one entry)."""

    index: int
    name: str
    src_rank: int
    dst_rank: int
    shape: tuple[int, ...]
    src_dtype: torch.dtype
    dst_dtype: torch.dtype
    src_slices: tuple[slice, ...]
    dst_slices: tuple[slice, ...]
    regions: tuple[Region, ...]
    src_view: torch.Tensor = field(repr=False, compare=False)
    dst_view: torch.Tensor = field(repr=False, compare=False)

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    def __str__(self) -> str:
        sl = lambda ss: "[" + ", ".join(f"{s.start}:{s.stop}" for s in ss) + "]"  # noqa: E731
        head = (f"[{self.index}] {self.name!r} r{self.src_rank}{sl(self.src_slices)} -> "
                f"r{self.dst_rank}{sl(self.dst_slices)} shape {self.shape} "
                f"{_dtname(self.src_dtype)}->{_dtname(self.dst_dtype)}")
        if not self.regions:
            return head + " (empty: no region)"
        lines = [head]
        for r in self.regions:
            lines.append(f"      src +{r.src_offset}B strides {r.src_strides} | dst +{r.dst_offset}B "
                         f"strides {r.dst_strides} | region {r.shape}")
        return "\n".join(lines)


def _dtname(dt: torch.dtype) -> str:
    return str(dt).removeprefix("torch.")


def _collapse(shape: Sequence[int], ss: Sequence[int], ds: Sequence[int]) -> list[tuple[int, int, int]]:
    """Drop size-1 dims, order dims by destination stride (so the inner dim is the destination's
    contiguous one: coalesced writes), merge neighbours contiguous in both. Returns (n, ss, ds) outer
    first; [] if the region is empty."""
    if any(n == 0 for n in shape):
        return []
    dims = [(n, s, d) for n, s, d in zip(shape, ss, ds, strict=True) if n != 1]
    dims.sort(key=lambda t: t[2], reverse=True)  # stable: ties keep their order
    merged: list[tuple[int, int, int]] = []
    for n, s, d in dims:
        if merged and merged[-1][1] == n * s and merged[-1][2] == n * d:
            pn = merged[-1][0]
            merged[-1] = (pn * n, s, d)
        else:
            merged.append((n, s, d))
    return merged or [(1, 1, 1)]


def _regions(src_view: torch.Tensor, dst_view: torch.Tensor, src_base: int, dst_base: int) -> list[Region]:
    shape, ss, ds = list(src_view.shape), list(src_view.stride()), list(dst_view.stride())
    sb, db = src_view.element_size(), dst_view.element_size()
    if sb not in (1, 2, 4, 8):  # same-dtype copy of a wide element (complex128): 8-byte words
        k = sb // 8
        shape, ss, ds = shape + [k], [s * k for s in ss] + [1], [d * k for d in ds] + [1]
        sb = db = 8
    dims = _collapse(shape, ss, ds)
    if not dims:
        return []
    lead, dims = dims[:-_k.MAX_DIMS], dims[-_k.MAX_DIMS:]
    dims = [(1, 0, 0)] * (_k.MAX_DIMS - len(dims)) + dims
    out = []
    for idx in itertools.product(*(range(n) for n, _, _ in lead)):
        so = sum(i * s for i, (_, s, _) in zip(idx, lead, strict=True))
        do = sum(i * d for i, (_, _, d) in zip(idx, lead, strict=True))
        sa, da = src_view.data_ptr() + so * sb, dst_view.data_ptr() + do * db
        out.append(Region(tuple(n for n, _, _ in dims), tuple(s for _, s, _ in dims),
                          tuple(d for _, _, d in dims), sa - src_base, da - dst_base, sa, da, sb, db))
    return out


class _Group:
    """The launches of one (src dtype, dst dtype) group: at most one per kernel variant, whatever the
    number of regions (see ``tritonreshard.kernels.plan_launches``)."""

    def __init__(self, key, regions: list[Region], device: torch.device):
        self.key = key
        boxes = [(r.src_addr, r.dst_addr, r.shape, r.src_strides, r.dst_strides) for r in regions]
        self.launches = _k.plan_launches(key, boxes, device)
        self.num_regions = len(regions)
        self.num_tiles = sum(lc.num_tiles for lc in self.launches)

    def launch(self) -> None:
        for lc in self.launches:
            lc.launch()


def _span(t: torch.Tensor) -> int:
    """Elements from a view's first to one past its last element."""
    return sum((n - 1) * st for n, st in zip(t.shape, t.stride(), strict=True)) + 1


def _torch_copies(entries: Sequence[Entry]) -> list:
    """The torch backend's copies: runs of consecutive entries that differ only by a constant
    address step (same-geometry tensors packed back to back, as the refit engine lays them out)
    become one strided ``copy_`` with an extra leading dim. A model of 10,000 small tensors then
    costs a few dozen torch calls per refit instead of one per tensor."""
    pairs, run = [], []

    def key(e):
        s, d = e.src_view, e.dst_view
        return (s.dtype, d.dtype, tuple(s.shape), s.stride(), d.stride(),
                s.untyped_storage().data_ptr(), d.untyped_storage().data_ptr())

    def step(a, b):
        return (b.src_view.data_ptr() - a.src_view.data_ptr(), b.dst_view.data_ptr() - a.dst_view.data_ptr())

    def flush():
        if len(run) == 1:
            pairs.append((run[0].dst_view.copy_, run[0].src_view))
        elif run:
            s, d = run[0].src_view, run[0].dst_view
            ds, dd = (x // v.element_size() for x, v in zip(step(run[0], run[1]), (s, d), strict=True))
            sv = s.as_strided((len(run), *s.shape), (ds, *s.stride()), s.storage_offset())
            dv = d.as_strided((len(run), *d.shape), (dd, *d.stride()), d.storage_offset())
            pairs.append((dv.copy_, sv))
        run.clear()

    for e in entries:
        if run and key(e) == key(run[0]):
            ss, sd = step(run[-1], e)
            ok = (sd > 0 and ss % e.src_view.element_size() == 0 and sd % e.dst_view.element_size() == 0
                  and sd >= _span(e.dst_view) * e.dst_view.element_size()  # no overlapping writes
                  and ss > 0 and (len(run) == 1 or (ss, sd) == step(run[0], run[1])))
            if ok:
                run.append(e)
                continue
        flush()
        run.append(e)
    flush()
    return pairs


class DescriptorTable:
    """Descriptor tables of a batch of transfer ops, grouped per dtype pair; see the module doc.

    ``len(table)`` entries (one per op), ``table.num_launches`` kernel launches per Triton run,
    ``bytes_read`` / ``bytes_written`` per run, ``str(table)`` a readable dump, ``table.entries`` the
    per-op :class:`Entry` records.
    """

    def __init__(self, entries: Sequence[Entry], device: torch.device):
        self.entries: tuple[Entry, ...] = tuple(entries)
        self.device = device
        self._pairs = _torch_copies([e for e in self.entries if e.numel])
        self.bytes_read = sum(e.numel * e.src_view.element_size() for e in self.entries)
        self.bytes_written = sum(e.numel * e.dst_view.element_size() for e in self.entries)

    @functools.cached_property
    def _groups(self) -> list[_Group]:
        """The Triton launches, planned when first needed: the torch backend runs ``_pairs`` only,
        and a pull that builds a table per streamed layer on CPU spent most of each build here."""
        by_key: dict = {}
        for e in self.entries:
            if e.regions:
                key = _k.group_key(e.src_dtype, e.dst_dtype)
                if key[0] == "copy":  # wide elements (complex128) are copied as 8-byte words
                    key = ("copy", e.regions[0].itemsize_src)
                by_key.setdefault(key, []).extend(e.regions)
        return [_Group(key, regs, self.device) for key, regs in by_key.items()]

    @classmethod
    def build(
        cls,
        ops: Iterable,
        src: Callable[[object], torch.Tensor],
        dst: Callable[[object], torch.Tensor],
    ) -> DescriptorTable:
        """Build the table of ``ops`` (``TransferOp``s).

        ``src(op)``: the full local shard of ``op.name`` on ``op.src_rank`` (any strides, any view);
        ``dst(op)``: the local shard of ``op.name`` on ``op.dst_rank`` that receives the data. The op's
        slices are applied here. Raises one ``ValueError`` listing every mismatch (slice shapes,
        devices) and ``NotImplementedError`` for dtype pairs the kernel cannot convert.
        """
        problems, unsupported, entries = [], [], []
        device = None
        for i, op in enumerate(ops):
            # Detached aliases: copies into a Parameter (e.g. an engine's weights) are not autograd ops.
            s_full, d_full = src(op).detach(), dst(op).detach()
            where = f"op {i} ({op.name!r} r{op.src_rank}->r{op.dst_rank})"
            try:
                s_view, d_view = s_full[tuple(op.src_slices)], d_full[tuple(op.dst_slices)]
                if getattr(op, "src_dims", None) is not None:
                    # A transposed op reads its box through permute: a strided view, which the
                    # regions (and torch's copy_) take as it is.
                    s_view = s_view.permute(op.src_dims)
            except IndexError as exc:
                problems.append(f"{where}: slices do not fit the tensors "
                                f"(src {tuple(s_full.shape)}, dst {tuple(d_full.shape)}): {exc}")
                continue
            if tuple(s_view.shape) != tuple(d_view.shape) or tuple(s_view.shape) != tuple(op.shape):
                problems.append(f"{where}: src slice has shape {tuple(s_view.shape)}, dst slice "
                                f"{tuple(d_view.shape)}, op says {tuple(op.shape)}")
                continue
            if device is None:
                device = d_full.device
            if d_full.device != device:
                problems.append(f"{where}: dst on {d_full.device}, other dsts on {device}")
            if s_full.device.type != device.type:
                problems.append(f"{where}: src on {s_full.device}, dst on {device}")
            if not _k.supported_conversion(s_full.dtype, d_full.dtype):
                if s_full.dtype != d_full.dtype or s_full.element_size() % 8:
                    unsupported.append(f"{where}: {s_full.dtype} -> {d_full.dtype}")
                    continue
            regions = _regions(s_view, d_view, s_full.data_ptr(), d_full.data_ptr())
            entries.append(Entry(i, op.name, op.src_rank, op.dst_rank, tuple(op.shape), s_full.dtype,
                                 d_full.dtype, tuple(op.src_slices), tuple(op.dst_slices),
                                 tuple(regions), s_view, d_view))
        if problems:
            raise ValueError("cannot build descriptor table:\n  " + "\n  ".join(problems))
        if unsupported:
            raise NotImplementedError(
                "dtype conversions the gather kernels do not implement (same dtype of any width, or "
                "float32/bfloat16/float16 pairs):\n  " + "\n  ".join(unsupported))
        return cls(entries, device if device is not None else torch.device("cpu"))

    def subset(self, indices: Iterable[int]) -> DescriptorTable:
        """A table of some entries only (e.g. ``table.subset([3]).run()`` to step through entry 3)."""
        return DescriptorTable([self.entries[i] for i in indices], self.device)

    def run(self, backend="triton") -> None:
        """Execute every entry with ``backend`` (a :class:`~tritonreshard.kernels.CopyBackend` or its
        name): ``"triton"``: :meth:`launch`; ``"torch"``: :meth:`copy`; ``"auto"``: by the table's device."""
        copy_backend(backend).run(self)

    def launch(self) -> None:
        """Execute every entry with the kernels: one launch per (dtype group, kernel variant)
        (compiled on CUDA, Triton's interpreter on CPU tensors)."""
        for g in self._groups:
            g.launch()

    def copy(self) -> None:
        """Execute every entry with torch: ``dst_view.copy_(src_view)`` per coalesced run of entries
        (the fast CPU path; equal bits except NaN payloads, see ``tritonreshard.kernels.gather``)."""
        for copy_, s in self._pairs:
            copy_(s)

    def __len__(self) -> int:
        return len(self.entries)

    @property
    def num_torch_copies(self) -> int:
        """``copy_`` calls per :meth:`copy` (same-geometry entries are coalesced)."""
        return len(self._pairs)

    @property
    def num_launches(self) -> int:
        """Kernel launches per :meth:`launch`: one per (dtype group, kernel variant) with
        work; at most ``2 x`` the number of dtype groups, whatever the number of tensors."""
        return sum(1 for g in self._groups for lc in g.launches if lc.num_tiles)

    @property
    def num_regions(self) -> int:
        return sum(g.num_regions for g in self._groups)

    @property
    def num_tiles(self) -> int:
        return sum(g.num_tiles for g in self._groups)

    def __str__(self) -> str:
        head = (f"DescriptorTable: {len(self)} entries, {self.num_regions} regions, {self.num_tiles} "
                f"tiles, {self.num_launches} launch(es) on {self.device}, {self.bytes_read} B read, "
                f"{self.bytes_written} B written")
        groups = [f"  launch {lc.variant} {g.key}: {lc.num_regions} regions, {lc.num_tiles} tiles"
                  for g in self._groups for lc in g.launches]
        return "\n".join([head, *groups, *(str(e) for e in self.entries)])

    def __repr__(self) -> str:
        return (f"<DescriptorTable {len(self)} entries, {self.num_launches} launches, "
                f"{self.bytes_written} B written>")
