"""Execute a plan with all ranks in one process (tests, notebooks, debugging).

The cross-process engine runs the same :class:`~tritonreshard.kernels.DescriptorTable` per
destination rank over mapped arenas; here every rank's tensors live in this process, so one table
covers the whole plan and a Triton run is at most two launches (kernel variants) per dtype pair.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping

import torch

from .kernels import DescriptorTable, QuantizeTable, copy_backend

__all__ = ["execute_local", "check_shard", "writable_problem"]

_CACHE_SIZE = 16
_table_cache: OrderedDict[tuple, DescriptorTable] = OrderedDict()
_quant_tables: dict[tuple, QuantizeTable] = {}  # a quantized plan's second table, evicted with its key


def _sig(t: torch.Tensor) -> tuple:
    return (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype, t.device)


def check_shard(where: str, t, layout, rank: int, problems: list[str], *, of: str = "layout", device=None,
                writable: bool = False):
    """Check one rank's local shard ``t`` against ``layout``: a tensor, of ``layout.local_shape(rank)``
    and ``layout.dtype``, on ``device`` (when given), writable in place (when ``writable``). Appends a
    line naming ``where`` per problem; returns the tensor's device (None if it is no tensor). Shared
    by :func:`execute_local` and the engine's endpoints."""
    if not isinstance(t, torch.Tensor):
        problems.append(f"{where} is a {type(t).__name__}, not a torch.Tensor")
        return None
    want = tuple(layout.local_shape(rank))
    if tuple(t.shape) != want:
        problems.append(f"{where} has shape {tuple(t.shape)}, {of} says {want}")
    if t.dtype != layout.dtype:
        problems.append(f"{where} has dtype {t.dtype}, {of} says {layout.dtype}")
    if device is not None and t.device != device:
        problems.append(f"{where} is on {t.device}, other tensors are on {device}")
    if writable:
        why = writable_problem(t)
        if why:
            problems.append(f"{where} {why}")
    return t.device


def _check(param: str, shards, layouts, required, device, problems) -> torch.device | None:
    """Append a line to ``problems`` for each missing or mismatching tensor of ``required`` (pairs
    (rank, name)); returns the device of the first tensor seen if ``device`` is None."""
    if not isinstance(shards, Mapping):
        problems.append(f"{param} must be a mapping rank -> {{name: tensor}}, got {type(shards).__name__}")
        return device
    missing_ranks = sorted({r for r, _ in required if r not in shards})
    if missing_ranks:
        problems.append(f"{param} is missing rank(s) {missing_ranks}")
    for rank, name in required:
        if rank not in shards:
            continue
        tensors = shards[rank]
        where = f"{param}[{rank}][{name!r}]"
        if not isinstance(tensors, Mapping) or name not in tensors:
            problems.append(f"{where} is missing")
            continue
        seen = check_shard(where, tensors[name], layouts[name], rank, problems, device=device)
        device = device if device is not None else seen
    return device


def writable_problem(t: torch.Tensor) -> str | None:
    """Why the engine can't write ``t`` in place, or None."""
    if t.is_inference():
        return "is an inference tensor (created under torch.inference_mode) and cannot be written in place"
    if t.requires_grad and t.is_leaf and not isinstance(t, torch.nn.Parameter):
        return "requires grad; pass .detach() or a Parameter"
    if t.numel() > 1 and any(s == 0 and n > 1 for s, n in zip(t.stride(), t.shape, strict=True)):
        return f"has overlapping memory (stride {tuple(t.stride())}): writes would collide"
    return None


def _byte_span(t: torch.Tensor) -> tuple[int, int]:
    span = sum((n - 1) * abs(st) for n, st in zip(t.shape, t.stride(), strict=True)) + 1
    return t.data_ptr(), t.data_ptr() + span * t.element_size()


def _shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True when some element of ``a`` and some element of ``b`` occupy the same bytes."""
    if a.device != b.device or a.numel() == 0 or b.numel() == 0 or a.device.type == "meta":
        return False
    (a0, a1), (b0, b1) = _byte_span(a), _byte_span(b)
    if a1 <= b0 or b1 <= a0:
        return False
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr() or a.element_size() != b.element_size():
        return True  # conservative: spans overlap across different storages or dtypes
    # Same storage, same element size, spans overlap: compare element positions exactly (rare:
    # interleaved strided views, e.g. the even and odd columns of one buffer, don't overlap).
    n = max(a.storage_offset() + (a1 - a0) // a.element_size(), b.storage_offset() + (b1 - b0) // b.element_size())
    idx = torch.arange(n, device="cpu")
    ia = idx.as_strided(a.shape, a.stride(), a.storage_offset()).reshape(-1)
    ib = idx.as_strided(b.shape, b.stride(), b.storage_offset()).reshape(-1)
    return bool(torch.isin(ia, ib).any())


def _check_writable(out, src_shards, dst_req, src_req, problems) -> None:
    """Outputs must be writable, and must not share memory with each other or with a source."""
    def get(shards, r, n):
        t = shards.get(r) if isinstance(shards, Mapping) else None
        t = t.get(n) if isinstance(t, Mapping) else None
        return t if isinstance(t, torch.Tensor) else None

    outs = [(r, n, t) for r, n in dst_req if (t := get(out, r, n)) is not None]
    srcs = [(r, n, t) for r, n in src_req if (t := get(src_shards, r, n)) is not None]
    for i, (r, n, t) in enumerate(outs):
        why = writable_problem(t)
        if why:
            problems.append(f"out[{r}][{n!r}] {why}")
        for r2, n2, t2 in outs[:i]:
            if _shares_memory(t, t2):
                problems.append(f"out[{r}][{n!r}] shares memory with out[{r2}][{n2!r}]: writes would collide")
        for r2, n2, t2 in srcs:
            if _shares_memory(t, t2):
                problems.append(f"out[{r}][{n!r}] shares memory with src_shards[{r2}][{n2!r}]: the copy "
                                f"would read what it writes")


def execute_local(plan, src_shards, out=None, backend="auto") -> dict[int, dict[str, torch.Tensor]]:
    """Run ``plan`` with every rank's tensors in this process; returns ``{dst_rank: {name: tensor}}``.

    ``src_shards[rank][name]``: the local shard of a source rank (shape ``layout.local_shape(rank)``,
    the source layout's dtype, any strides), for every (rank, name) an op reads (``name`` is the
    op's ``src_name``: with ``parts=`` it differs from the destination's name). ``out``: the same
    nesting for every destination rank and name of the destination layouts, written in place and
    returned; if None, outputs are allocated (destination dtypes and local shapes, on the sources'
    device). ``backend``: a :class:`~tritonreshard.kernels.CopyBackend` or its name: ``"triton"``
    (compiled on CUDA, Triton's interpreter on CPU tensors), ``"torch"`` (``copy_`` per op),
    ``"auto"`` (triton on CUDA, torch on CPU).

    Block-quantized weights (a :class:`~tritonreshard.planning.QuantizedPlan`, e.g. a recipe with
    ``quantization="fp8-block"``): their ops go to a :class:`~tritonreshard.kernels.QuantizeTable`,
    which reads each 128x128 block whole from its sources and writes the e4m3 block and its scale
    in the same pass (the Triton backend interpreted on CPU tensors, like the copies).

    Zero fills of the plan (``plan.fills``: padding such as vocab rows past the real vocab) are
    written after the copies. Every input is validated before any data moves; all problems are reported in one
    ``ValueError``. The descriptor table is cached per (plan, tensor addresses/shapes/strides/dtypes), so repeated
    calls with the same ``out`` tensors (the refit pattern) skip building it. The cache (16 tables)
    holds references to the tensors it was built from; with ``out=None`` nothing is cached.
    """
    problems: list[str] = []
    chosen = copy_backend(backend, problems)
    src_req = sorted({(op.src_rank, op.src_name) for op in plan.ops})
    dst_req = sorted((r, name) for name, lay in plan.dst_layouts.items() for r in lay.ranks)
    device = _check("src_shards", src_shards, plan.src_layouts, src_req, None, problems)
    if out is not None:
        device = _check("out", out, plan.dst_layouts, dst_req, device, problems)
        _check_writable(out, src_shards, dst_req, src_req, problems)
    device = device or torch.device("cpu")
    if problems:
        raise ValueError("execute_local: invalid input:\n  " + "\n  ".join(problems))

    cacheable = out is not None  # fresh outputs have fresh addresses: a cached table would never hit
    if out is None:
        out = {}
        for rank, name in dst_req:
            lay = plan.dst_layouts[name]
            out.setdefault(rank, {})[name] = torch.empty(lay.local_shape(rank), dtype=lay.dtype, device=device)
    result = {rank: {name: out[rank][name] for r, name in dst_req if r == rank}
              for rank in sorted({r for r, _ in dst_req})}

    key = (plan,
           tuple(_sig(src_shards[r][n]) for r, n in src_req),
           tuple(_sig(out[r][n]) for r, n in dst_req))
    table, qtable = _table_cache.get(key), _quant_tables.get(key)
    if table is None:
        quant = plan.quant
        src = lambda op: src_shards[op.src_rank][op.src_name]  # noqa: E731
        dst = lambda op: out[op.dst_rank][op.name]  # noqa: E731
        table = DescriptorTable.build([op for op in plan.ops if op.name not in quant], src=src, dst=dst)
        if quant:
            qtable = QuantizeTable.build([op for op in plan.ops if op.name in quant], quant, src=src, dst=dst,
                                         scale=lambda r, n: out[r][n])
        if cacheable:  # (the table references its tensors, so the cache keeps them alive)
            _table_cache[key] = table
            if qtable is not None:
                _quant_tables[key] = qtable
            if len(_table_cache) > _CACHE_SIZE:
                old, _ = _table_cache.popitem(last=False)
                _quant_tables.pop(old, None)
    else:
        _table_cache.move_to_end(key)
    backend = chosen.for_device(device)  # "auto": the tensors' device decides, once
    backend.run(table)
    if qtable is not None:
        backend.run(qtable)
    for f in plan.fills:  # padding (e.g. vocab rows past the real vocab): no op writes it
        out[f.dst_rank][f.name][f.dst_slices].zero_()
    return result
