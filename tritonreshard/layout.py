"""Layouts: how a global tensor is split over a mesh of ranks.

Pure Python (torch is imported only for dtypes and DTensor interop): no device, no Triton.

A :class:`Layout` is a global ``shape``, a ``mesh`` of distinct global ranks (an N-D grid) and one
placement per mesh dim. ``Shard(d)`` splits tensor dim ``d`` over that mesh dim the way DTensor and
``torch.chunk`` do: with ``chunk = ceil(n / k)``, shard ``i`` covers ``[min(i*chunk, n),
min((i+1)*chunk, n))``, so trailing shards may be short or empty. ``Shard(d, blocks=(b0, b1, ...))``
says dim ``d`` is a concatenation of blocks (fused QKV, gate/up): every block is split on its own
and a rank's local shard is its piece of each block, concatenated in order. Several mesh dims may
shard the same tensor dim; they split in mesh-dim order, mesh dim 0 outermost (as DTensor does).
``Shard(d, balanced=True)`` splits like ``numpy.array_split`` instead: the first ``n % k`` shards
hold ``n // k + 1`` elements, the others ``n // k`` (vLLM's "linear" expert placement, which
``torch.chunk`` differs from when ``n % k != 0``: 6 experts over 4 ranks are 2,2,1,1, not 2,2,2,0).
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property, lru_cache
from itertools import product
from typing import Any

import torch

__all__ = ["Shard", "Replicate", "Layout", "Placement", "Part"]

#: Largest mesh accepted (an int mesh would otherwise materialise any number of ranks).
MAX_RANKS = 1 << 20

_INT64_MAX = (1 << 63) - 1

# A segment of one tensor dim that a rank holds: global [start, stop) placed at local offset `local`.
Segment = tuple[int, int, int]


@dataclass(frozen=True)
class Shard:
    """Split tensor dim ``dim`` across one mesh dim (``torch.chunk`` semantics).

    ``blocks``: optional sizes of the concatenated blocks along ``dim`` (must sum to
    ``shape[dim]``); each block is split independently. ``balanced``: split like
    ``numpy.array_split`` (the first ``n % k`` shards one element longer) rather than
    ``torch.chunk``; vLLM places MoE experts this way under expert parallelism.
    """

    dim: int
    blocks: tuple[int, ...] | None = None
    balanced: bool = False

    def __post_init__(self):
        if self.blocks is not None:
            object.__setattr__(self, "blocks", tuple(self.blocks))

    def __str__(self) -> str:
        bal = ",bal" if self.balanced else ""
        if self.blocks is None:
            return f"S({self.dim}{bal})"
        return f"S({self.dim},[{','.join(map(str, self.blocks))}]{bal})"


@dataclass(frozen=True)
class Replicate:
    """Every rank along the mesh dim holds the whole extent."""

    def __str__(self) -> str:
        return "R"


Placement = Shard | Replicate


def _chunk_bounds(n: int, k: int, i: int) -> tuple[int, int]:
    """[start, stop) of chunk ``i`` of ``k`` over ``n`` elements, as ``torch.chunk`` / DTensor."""
    chunk = -(-n // k) if n else 0
    return min(i * chunk, n), min((i + 1) * chunk, n)


def _balanced_bounds(n: int, k: int, i: int) -> tuple[int, int]:
    """[start, stop) of piece ``i`` of ``k`` over ``n`` elements, as ``numpy.array_split`` and
    vLLM's ``determine_expert_map`` ("linear"): the first ``n % k`` pieces are one longer."""
    base, rem = divmod(n, k)
    start = i * base + min(i, rem)
    return start, start + base + (i < rem)


def _normalize_mesh(mesh: Any) -> tuple[tuple[int, ...], tuple[int, ...], list[str]]:
    """Returns (mesh_shape, flat ranks in row-major order, problems)."""
    problems: list[str] = []
    if hasattr(mesh, "mesh") and hasattr(mesh, "device_type"):  # torch DeviceMesh
        mesh = mesh.mesh
    if isinstance(mesh, torch.Tensor) or type(mesh).__module__ == "numpy":
        mesh = mesh.tolist()
    if isinstance(mesh, bool) or not isinstance(mesh, (int, Sequence)) or isinstance(mesh, (str, bytes)):
        return (), (), [f"mesh must be an int, a sequence of ranks or a nested sequence, got {mesh!r}"]
    if isinstance(mesh, int):
        if mesh < 1:
            return (), (), [f"mesh={mesh!r}: a mesh needs at least one rank"]
        if mesh > MAX_RANKS:
            return (), (), [f"mesh={mesh!r}: at most {MAX_RANKS} ranks are supported"]
        return (mesh,), tuple(range(mesh)), []

    shape: list[int] = []
    level: Any = mesh
    while isinstance(level, Sequence) and not isinstance(level, (str, bytes)):
        shape.append(len(level))
        if not level:
            break
        level = level[0]
    flat: list[int] = []

    def walk(node: Any, depth: int) -> None:
        if depth == len(shape):
            if isinstance(node, bool) or not isinstance(node, int):
                problems.append(f"mesh={mesh!r}: rank {node!r} is not an int")
            elif node < 0:
                problems.append(f"mesh={mesh!r}: rank {node} is negative")
            else:
                flat.append(node)
            return
        if not isinstance(node, Sequence) or isinstance(node, (str, bytes)) or len(node) != shape[depth]:
            problems.append(f"mesh={mesh!r} is ragged: expected {shape[depth]} entries at depth {depth}")
            return
        for child in node:
            walk(child, depth + 1)

    walk(mesh, 0)
    if 0 in shape:
        problems.append(f"mesh={mesh!r}: a mesh needs at least one rank")
    if problems:
        return tuple(shape), tuple(flat), problems
    seen: set[int] = set()
    dups = sorted({r for r in flat if r in seen or seen.add(r)})  # O(n): meshes can be large
    if dups:
        problems.append(f"mesh={mesh!r} has duplicate ranks {dups}")
    return tuple(shape), tuple(flat), problems


def _convert_placement(p: Any) -> Placement | None:
    """Our placements pass through; torch.distributed.tensor's Shard / Replicate are converted."""
    if isinstance(p, (Shard, Replicate)):
        return p
    name = type(p).__name__
    module = type(p).__module__
    if module.startswith("torch.distributed"):
        if name == "Shard" and hasattr(p, "dim"):
            return Shard(int(p.dim))
        if name == "Replicate":
            return Replicate()
    return None


@lru_cache(maxsize=4096)
def segments_by_mesh_index(shape: tuple[int, ...], mesh_shape: tuple[int, ...],
                            placements: tuple[Placement, ...]) -> tuple:
    """Segments of every mesh position (row-major), shared by all layouts of the same geometry:
    a model's layers repeat a few shapes, so big state dicts compute each geometry once."""
    out = []
    for coord in product(*(range(n) for n in mesh_shape)):
        per_dim = []
        for d, n in enumerate(shape):
            splits = [md for md, p in enumerate(placements) if isinstance(p, Shard) and p.dim == d]
            first = placements[splits[0]] if splits else None
            blocks = first.blocks if first is not None and first.blocks is not None else (n,)
            segs: list[Segment] = []
            base, local = 0, 0
            for b in blocks:
                lo, hi = 0, b
                for md in splits:  # mesh dim 0 outermost: split the current piece again
                    bounds = _balanced_bounds if placements[md].balanced else _chunk_bounds
                    s, e = bounds(hi - lo, mesh_shape[md], coord[md])
                    lo, hi = lo + s, lo + e
                if hi > lo:
                    segs.append((base + lo, base + hi, local))
                    local += hi - lo
                base += b
            per_dim.append(tuple(segs))
        out.append(tuple(per_dim))
    return tuple(out)


def _check_shape(shape, dtype, problems: list[str]) -> tuple[int, ...]:
    """``shape`` as a tuple of ints (``()`` if it is not one), with a problem for each thing wrong
    with it or ``dtype``."""
    try:
        shape_t = tuple(int(s) for s in shape)
    except (TypeError, ValueError):
        shape_t = ()
        problems.append(f"shape={shape!r} must be a sequence of non-negative ints")
    if any(s < 0 for s in shape_t):
        problems.append(f"shape={shape!r} has a negative size")
    if not isinstance(dtype, torch.dtype):
        problems.append(f"dtype={dtype!r} must be a torch.dtype")
    else:
        # Element counts, strides and byte offsets are int64 in torch and in the kernels: past that
        # they wrap, so such a tensor cannot exist (and its plan would print nonsense sizes).
        nbytes = math.prod(shape_t) * dtype.itemsize
        huge = [d for d, n in enumerate(shape_t) if n > _INT64_MAX]
        if huge:
            problems.append(f"shape={shape_t!r}: shape[{huge[0]}]={shape_t[huge[0]]} is past int64 (2**63 - 1)")
        elif nbytes > _INT64_MAX:
            problems.append(f"shape={shape_t!r} of {dtype} is {nbytes} bytes ({math.prod(shape_t)} "
                            f"elements): more than int64 sizes and offsets hold (2**63 - 1)")
    return shape_t


def _convert_placements(placements, shape_t: tuple[int, ...], problems: list[str]) -> list[Placement]:
    """The placements as this module's (shard dims made non-negative), with a problem for each one
    that is unsupported or does not fit ``shape_t``; those are left out."""
    converted: list[Placement] = []
    for i, p in enumerate(placements):
        c = _convert_placement(p)
        if c is None:
            problems.append(
                f"placements[{i}]={p!r} is not a supported placement (use trs.Shard(dim) or "
                f"trs.Replicate(); Partial and strided shards are not supported)")
            continue
        if isinstance(c, Shard):
            ndim = len(shape_t)
            if not isinstance(c.dim, int) or not -ndim <= c.dim < ndim:
                problems.append(f"placements[{i}]={c}: shard dim {c.dim} is out of range for "
                                f"shape={shape_t} ({ndim} dims)")
                continue
            if c.dim < 0:
                c = Shard(c.dim + ndim, c.blocks, c.balanced)
            if not isinstance(c.balanced, bool):
                problems.append(f"placements[{i}]={c!r}: balanced must be a bool")
            if c.blocks is not None:
                if any((not isinstance(b, int)) or b < 0 for b in c.blocks) or not c.blocks:
                    problems.append(f"placements[{i}]={c}: blocks must be non-negative ints")
                elif sum(c.blocks) != shape_t[c.dim]:
                    problems.append(f"placements[{i}]={c}: blocks sum to {sum(c.blocks)} but "
                                    f"shape[{c.dim}]={shape_t[c.dim]}")
        converted.append(c)
    return converted


def _check_same_split_per_dim(converted: list[Placement], problems: list[str]) -> None:
    """Every mesh dim sharding one tensor dim gives the same blocks and the same ``balanced``."""
    by_dim: dict[int, set] = {}
    split_by_dim: dict[int, set] = {}
    for c in converted:
        if isinstance(c, Shard):
            by_dim.setdefault(c.dim, set()).add(c.blocks)
            split_by_dim.setdefault(c.dim, set()).add(c.balanced)
    for d, bl in sorted(by_dim.items()):
        if len(bl) > 1:
            problems.append(f"placements shard dim {d} with conflicting blocks "
                            f"{sorted(bl, key=str)}; every mesh dim sharding it must give the same blocks")
    for d, bal in sorted(split_by_dim.items()):
        if len(bal) > 1:  # one rule per tensor dim keeps nested splits easy to reason about
            problems.append(f"placements shard dim {d} both balanced and not; every mesh dim sharding "
                            f"it must give the same balanced=")


def _nest(flat: tuple[int, ...], shp: tuple[int, ...]):
    """The flat ranks as nested tuples of mesh shape ``shp``."""
    if len(shp) == 1:
        return tuple(flat)
    step = len(flat) // shp[0]
    return tuple(_nest(flat[i * step:(i + 1) * step], shp[1:]) for i in range(shp[0]))


@dataclass(frozen=True, init=False)
class Layout:
    """A global tensor of ``shape`` and ``dtype`` placed on ``mesh`` with one placement per mesh dim.

    Args:
        shape: global shape, e.g. ``(8, 8)``.
        mesh: an int ``n`` (ranks ``0..n-1``), a sequence of global ranks, a nested sequence / array
            (N-D mesh) of distinct global ranks, or a torch ``DeviceMesh``.
        placements: one ``Shard`` / ``Replicate`` per mesh dim (torch.distributed.tensor's are
            accepted and converted).
        dtype: element type (a ``torch.dtype``).

    Raises ``ValueError`` listing every problem at once (duplicate ranks, placement count, shard
    dim out of range, blocks not summing to the dim, unknown placement types, ...).

    ``str(layout)`` is short, e.g. ``[S(0)]@(0,1)``; ``repr`` is exact.
    """

    shape: tuple[int, ...]
    mesh: tuple
    placements: tuple[Placement, ...]
    dtype: torch.dtype = torch.float32
    mesh_shape: tuple[int, ...] = field(repr=False, compare=False)
    ranks: tuple[int, ...] = field(repr=False, compare=False)

    def __init__(self, shape, mesh, placements, dtype=torch.float32):
        problems: list[str] = []
        shape_t = _check_shape(shape, dtype, problems)
        mesh_shape, ranks, mesh_problems = _normalize_mesh(mesh)
        problems += mesh_problems
        if isinstance(placements, (Shard, Replicate)) or not isinstance(placements, Sequence):
            placements = [placements]
        converted = _convert_placements(placements, shape_t, problems)
        if mesh_shape and len(placements) != len(mesh_shape):
            problems.append(f"placements has {len(placements)} entries but mesh has "
                            f"{len(mesh_shape)} dims (mesh shape {mesh_shape})")
        _check_same_split_per_dim(converted, problems)
        if problems:
            raise ValueError("invalid Layout:\n  - " + "\n  - ".join(problems))

        object.__setattr__(self, "shape", shape_t)
        object.__setattr__(self, "mesh", _nest(ranks, mesh_shape))
        object.__setattr__(self, "placements", tuple(converted))
        object.__setattr__(self, "dtype", dtype)
        object.__setattr__(self, "mesh_shape", mesh_shape)
        object.__setattr__(self, "ranks", ranks)

    # -- construction from torch objects -------------------------------------------------------
    @classmethod
    def from_dtensor(cls, dtensor) -> Layout:
        """The layout of a ``torch.distributed.tensor.DTensor`` (FSDP2 parameters are DTensors):
        its global shape, dtype, device mesh ranks and placements."""
        return cls(tuple(dtensor.shape), dtensor.device_mesh, tuple(dtensor.placements), dtensor.dtype)

    @classmethod
    def from_param_meta(cls, meta, ranks) -> Layout:
        """The layout vLLM's trainer-side ``ParamMeta`` describes (vLLM >= 0.33,
        ``vllm.distributed.weight_transfer.base``): ``ParamMeta(name, dtype, shape, owners=,
        mesh_shape=, placements=)``, what ``WeightSource.iter_local()`` yields on each owner.

        ``owners`` are trainer ranks (vLLM's ``TrainerInitInfo.rank``), ``None`` for every trainer
        rank; ``mesh_shape`` lays them out row-major (default ``(len(owners),)``); ``placements``
        holds one ``Replicate`` / ``Shard(dim)`` per mesh axis, ``None`` for replicated. vLLM's
        ``Shard`` splits like ``torch.chunk``, outer mesh axis first when two axes shard one dim:
        exactly this module's ``Shard(dim)``. ``ranks``: the refit-group rank of each trainer rank
        (``ranks[r]`` for trainer rank ``r``; an int ``n`` is ``range(n)``), e.g. the
        ``trainer_ranks`` of :class:`tritonreshard.vllm.Trainer`. A 0.32 ``ParamMeta`` (no
        ownership fields) is replicated on every trainer rank.

        Duck-typed: vLLM is not imported. Raises ``ValueError`` naming the parameter and every
        problem (owners not among ``ranks``, a mesh that does not cover the owners, a placement
        count that is not the mesh's, an unknown placement, ...).
        """
        name = getattr(meta, "name", "?")
        problems: list[str] = []
        if isinstance(ranks, int) and not isinstance(ranks, bool):
            ranks = range(ranks)
        if isinstance(ranks, (str, bytes)) or not isinstance(ranks, Sequence) or any(
                isinstance(r, bool) or not isinstance(r, int) for r in ranks):
            raise ValueError(f"Layout.from_param_meta({name!r}): ranks must be an int or a sequence of "
                             f"refit-group ranks (one per trainer rank), got {ranks!r}")
        ranks = tuple(ranks)
        owners, mesh_shape, placements = (getattr(meta, a, None) for a in ("owners", "mesh_shape", "placements"))
        if owners is None:
            if mesh_shape is not None or placements is not None:
                problems.append(f"mesh_shape={mesh_shape!r} / placements={placements!r} without owners")
            owners = tuple(range(len(ranks)))
        owners = tuple(owners)
        bad = [o for o in owners if isinstance(o, bool) or not isinstance(o, int) or not 0 <= o < len(ranks)]
        if bad:
            problems.append(f"owners {list(bad)} are not trainer ranks 0..{len(ranks) - 1} (ranks={list(ranks)})")
        if not owners:
            problems.append("owners is empty")
        mesh_shape = (len(owners),) if mesh_shape is None else tuple(mesh_shape)
        if math.prod(mesh_shape) != len(owners) or any(isinstance(d, bool) or not isinstance(d, int) or d <= 0
                                                       for d in mesh_shape):
            problems.append(f"mesh_shape={mesh_shape} does not lay out its {len(owners)} owners")
        converted: list[Placement] = []
        for i, p in enumerate((Replicate(),) * len(mesh_shape) if placements is None else tuple(placements)):
            kind = type(p).__name__  # vLLM's own Replicate / Shard(dim), ours, or torch's
            if isinstance(p, (Shard, Replicate)) and not (isinstance(p, Shard) and (p.blocks or p.balanced)):
                converted.append(p)
            elif kind == "Replicate":
                converted.append(Replicate())
            elif kind == "Shard" and isinstance(getattr(p, "dim", None), int):
                converted.append(Shard(p.dim))
            else:
                problems.append(f"placements[{i}]={p!r} is neither Replicate nor Shard(dim)")
        ndim = len(tuple(getattr(meta, "shape", ())))
        problems += [f"placements[{i}]: shard dim {p.dim} of a {ndim}-D tensor" for i, p in enumerate(converted)
                     if isinstance(p, Shard) and not 0 <= p.dim < ndim]
        if placements is not None and len(tuple(placements)) != len(mesh_shape):
            problems.append(f"{len(tuple(placements))} placements for a {len(mesh_shape)}-D mesh {mesh_shape}")
        if problems:
            raise ValueError(f"Layout.from_param_meta({name!r}): " + "; ".join(problems))
        flat = [ranks[o] for o in owners]

        def nest(items, shp):
            if len(shp) == 1:
                return list(items)
            step = len(items) // shp[0]
            return [nest(items[i * step:(i + 1) * step], shp[1:]) for i in range(shp[0])]

        try:
            return cls(tuple(meta.shape), nest(flat, mesh_shape), converted, meta.dtype)
        except ValueError as exc:
            raise ValueError(f"Layout.from_param_meta({name!r}): {exc}") from None

    # -- queries --------------------------------------------------------------------------------
    def __str__(self) -> str:
        def fmt(m):
            return "(" + ",".join(fmt(x) if isinstance(x, tuple) else str(x) for x in m) + ")"
        return "[" + ",".join(map(str, self.placements)) + "]@" + fmt(self.mesh)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @cached_property
    def _coords(self) -> dict[int, tuple[int, ...]]:
        coords = {}
        for flat_index, rank in enumerate(self.ranks):
            c, rem = [], flat_index
            for size in reversed(self.mesh_shape):
                c.append(rem % size)
                rem //= size
            coords[rank] = tuple(reversed(c))
        return coords

    def _check_rank(self, rank: int) -> None:
        if rank not in self._coords:
            raise ValueError(f"rank={rank} is not in this layout's mesh {self.ranks}")

    def segments(self, rank: int) -> tuple[tuple[Segment, ...], ...]:
        """Per tensor dim, the ``(global_start, global_stop, local_offset)`` segments ``rank`` holds,
        in local order (one segment per block; empty segments dropped)."""
        self._check_rank(rank)
        return self._segments_cache[rank]

    @cached_property
    def _segments_cache(self) -> dict[int, tuple[tuple[Segment, ...], ...]]:
        per_index = segments_by_mesh_index(self.shape, self.mesh_shape, self.placements)
        return dict(zip(self.ranks, per_index, strict=True))

    def local_shape(self, rank: int) -> tuple[int, ...]:
        """Shape of ``rank``'s local shard (a dim may be 0 for empty trailing shards)."""
        return tuple(sum(e - s for s, e, _ in segs) for segs in self.segments(rank))

    def local_numel(self, rank: int) -> int:
        return math.prod(self.local_shape(rank))

    def shard(self, tensor: torch.Tensor, rank: int) -> torch.Tensor:
        """``rank``'s local shard of the global ``tensor`` (a new contiguous tensor).

        Useful for tests and set-up; refits never gather or slice full tensors.
        """
        if tuple(tensor.shape) != self.shape:
            raise ValueError(f"tensor.shape={tuple(tensor.shape)} does not match layout shape={self.shape}")
        out = tensor
        for d, segs in enumerate(self.segments(rank)):
            if not segs:
                out = out.narrow(d, 0, 0)
            elif len(segs) == 1:
                out = out.narrow(d, segs[0][0], segs[0][1] - segs[0][0])
            else:
                out = torch.cat([out.narrow(d, s, e - s) for s, e, _ in segs], dim=d)
        return out.clone(memory_format=torch.contiguous_format)

    def with_dtype(self, dtype: torch.dtype) -> Layout:
        return Layout(self.shape, self.mesh, self.placements, dtype)


@dataclass(frozen=True, init=False)
class Part:
    """Box ``dst`` of a destination tensor's global index comes from source tensor ``src``.

    Args:
        src: the source tensor's name (a key of the plan's source layouts), or ``None`` for padding
            that the refit fills with zeros, or a tuple of names of *aliases*: source tensors that
            hold the same global data (equal global shape and dtype, split into the same regions),
            e.g. Megatron's tied ``("embedding.word_embeddings.weight", "output_layer.weight")``
            on its first and last pipeline stages. Every rank holding any of them is a replica of
            the box: the planner spreads the reads over all of them (and the host planner reads a
            copy on the destination's host where there is one); each op names the alias it reads
            (``op.src_name``). A rank listed by several aliases reads the first. A tuple of one
            name is that name.
        dst: one ``(start, stop)`` per destination dim (a ``slice`` or ``None`` also works; ``None``
            is the whole dim, resolved against the destination's shape when planning).
        src_start: where the box begins in the source's global index, one int per source dim
            (default: the origin), in the source's own order of dims.
        src_dims: for each destination dim, the source dim it runs along (a permutation of
            ``range(ndim)``; default ``None``, the identity): the box is ``src[box].permute(src_dims)``,
            where ``box`` spans ``src_start[src_dims[k]] : + (stop - start)`` of destination dim ``k``
            along source dim ``src_dims[k]``. A loader that transposes (vLLM's gpt-oss experts hold
            ``gate_up_proj`` ``[E, H, 2I]`` as ``[E, 2I, H]``: ``src_dims=(0, 2, 1)``) is one part.
            Single-host plans only: cross-host and FP8-quantized plans refuse a transposed part.

    Given to :func:`~tritonreshard.plan_reshard` as ``parts={dst_name: [Part, ...]}``; the parts of one
    destination must tile its global shape exactly (a hole or an overlap is a ``ValueError``).
    """

    src: str | tuple[str, ...] | None
    dst: tuple[tuple[int, int] | None, ...]
    src_start: tuple[int, ...] | None = None
    src_dims: tuple[int, ...] | None = None

    def __init__(self, src, dst, src_start=None, src_dims=None):
        def ints(seq, what):
            if isinstance(seq, (str, bytes)) or not isinstance(seq, Sequence) or any(
                    isinstance(x, bool) or not isinstance(x, int) for x in seq):
                raise TypeError(f"Part({what}): expected a sequence of ints, got {seq!r}")
            return tuple(int(x) for x in seq)

        def norm(iv):
            if iv is None:
                return None
            if isinstance(iv, slice):
                if iv.step not in (None, 1) or iv.start is None or iv.stop is None:
                    raise ValueError(f"Part(dst=...): slice {iv!r} needs a start, a stop and step 1")
                return ints((iv.start, iv.stop), f"dst={dst!r}")
            pair = ints(iv, f"dst={dst!r}: each dim is (start, stop), a slice or None")
            if len(pair) != 2:
                raise TypeError(f"Part(dst={dst!r}): each dim is (start, stop), a slice or None, got {iv!r}")
            return pair

        if isinstance(src, (list, tuple)) and src and all(isinstance(n, str) for n in src):
            src = src[0] if len(src) == 1 else tuple(src)
        elif src is not None and not isinstance(src, str):
            raise TypeError(f"Part(src={src!r}) must be a source tensor name (str), a non-empty tuple of "
                            f"names of aliases (copies of one tensor), or None for padding")
        if isinstance(dst, (str, bytes)) or not isinstance(dst, Sequence):
            raise TypeError(f"Part(dst={dst!r}) must be a sequence of (start, stop) per dim")
        object.__setattr__(self, "src", src)
        object.__setattr__(self, "dst", tuple(norm(iv) for iv in dst))
        object.__setattr__(self, "src_start",
                           None if src_start is None else ints(src_start, f"src_start={src_start!r}"))
        if src_dims is not None:
            src_dims = ints(src_dims, f"src_dims={src_dims!r}")
            if sorted(src_dims) != list(range(len(self.dst))):
                raise ValueError(f"Part(src_dims={src_dims!r}): must be a permutation of range({len(self.dst)}) "
                                 f"(the destination's dims), one source dim per destination dim")
            if src_dims == tuple(range(len(src_dims))):
                src_dims = None   # the identity is the default: one spelling, one digest
        object.__setattr__(self, "src_dims", src_dims)

    @property
    def sources(self) -> tuple[str, ...]:
        """The source names the box may be read from: ``()`` for padding, one name, or the aliases."""
        return () if self.src is None else (self.src,) if isinstance(self.src, str) else self.src

    def __str__(self) -> str:
        box = ", ".join(":" if iv is None else f"{iv[0]}:{iv[1]}" for iv in self.dst)
        if self.src is None:
            return f"[{box}] <- zeros"
        at = "" if self.src_start is None or not any(self.src_start) else f" @{list(self.src_start)}"
        perm = "" if self.src_dims is None else f".permute({', '.join(map(str, self.src_dims))})"
        return f"[{box}] <- {' or '.join(self.sources)}{perm}{at}"
