"""``tritonreshard bench``: refit throughput of the engine against memcpy and two baselines.

What moves: a Llama-shaped bf16 state dict of ``--size`` bytes (``qkv``, ``o``, ``gate_up``,
``down``, two norms per layer, embedding, lm_head, final norm; layers and hidden size scale with the
size, the embedding absorbs the rest) from trainer processes to inference processes. Layouts
(``--layout``)::

    fsdp-tp             T trainers Shard(0) (FSDP rows)  ->  I inference ranks, tensor parallel:
                        qkv Shard(0, blocks=(h,h,h)), gate_up Shard(0, blocks=(i,i)), o/down Shard(1),
                        embed/lm_head Shard(0) (vocab parallel), norms Replicate
    cols-replicas       T trainers Shard(1) (column shards)  ->  I ranks holding every tensor whole
    colocated           the fsdp-tp layouts on the same processes (ranks 0..max(T,I)-1 are trainer
                        and/or inference; one RefitEndpoint with both sides per process)
    replicated-sources  T trainers as DP x FSDP, mesh [[0..T/2-1],[T/2..T-1]] [Replicate(), Shard(0)]
                        ->  I ranks tensor parallel

Methods, all on the same bytes in one run (destination bytes = the sum of every inference rank's
local shards):

* ``memcpy``: the driver process copies that many bytes in one ``copy_`` of a big buffer (all cores,
  torch's threads): the machine's speed of light.
* ``tritonreshard``: ``RefitEndpoint``: trainers ``publish()``, every inference rank ``pull()``s.
* ``p2p``: ``torch.distributed.batch_isend_irecv`` over the same plan's ops (gloo on CPU, NCCL on
  GPU): sources send each op's slice (packed when not contiguous), destinations receive into a
  temporary (or straight into a contiguous destination slice) and copy into the shard.
* ``gather_broadcast``: per tensor, gather the full tensor on the first trainer, broadcast it to
  every inference rank, each inference rank copies out its shard (the serialized flow).

Timing of one refit: trainers write the next version's weights (untimed), every rank meets in a gloo
barrier, reads ``time.monotonic()`` (CLOCK_MONOTONIC: one clock for every process of the machine),
runs the method and reads the clock again; the refit's time is max(end) - min(start) over all ranks.
``seconds`` is the median over ``--repeats`` refits after ``--warmup``. For ``tritonreshard``,
``coordination_ms`` is the median of (refit time - the slowest inference rank's copy), the copy as
the engine measures it (``last_pull.copy_ms``: its descriptor-table copy, device sync included), and
``staging_bytes`` the extra memory the pulls allocated as the engine measured it (``staging_bytes``
of each rank: the most one pull took), summed over the ranks.

Provenance: every element's bf16 bits are a hash of (tensor name, global index) XOR a key of the
version, with the top exponent bit clear (finite values). Every refit changes every weight, so after
the timed refits each inference rank checks its shards bit for bit: a stale, misplaced or unwritten
element fails ``verified``.

Processes: the shared driver (:mod:`.driver`) hosts a TCPStore and spawns one process per rank
(``torch.set_num_threads(1)``); ranks run commands from the store (:class:`BenchSession`, also used by ``bench/test_bench_refit.py``)
so one set-up serves many measurements. Entry points for ``tritonreshard bench``: :func:`add_arguments`
and :func:`run`.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import re
import statistics
import sys
import time
import zlib
from dataclasses import dataclass
from itertools import product

from tritonreshard.planning import fmt_bytes as _fmt_bytes

from .driver import Driver, RankFailed, wait_key

__all__ = ["add_arguments", "run"]

METHODS = ("memcpy", "tritonreshard", "p2p", "gather_broadcast")
WORKER_METHODS = ("tritonreshard", "p2p", "gather_broadcast")
LAYOUTS = ("fsdp-tp", "cols-replicas", "colocated", "replicated-sources")
_DEFAULT_TRAINERS = {"fsdp-tp": 2, "cols-replicas": 4, "colocated": 4, "replicated-sources": 4}
_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
          "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4, "tb": 1000**4}


def parse_size(text) -> int:
    """``"256MiB"``, ``"1GiB"``, ``"64MB"``, ``"1e6"`` or a plain int -> bytes."""
    if isinstance(text, int):
        return text
    if str(text).strip().startswith("-"):
        raise ValueError(f"--size={text!r} must be a positive number of bytes, e.g. 256MiB")
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"--size={text!r}: use bytes as an int or a number with a unit "
                         f"(KiB, MiB, GiB, KB, MB, GB), e.g. 256MiB")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


# ============================================================================================
# The model and its layouts (pure Python; every process derives the same from the config)
# ============================================================================================
@dataclass(frozen=True)
class BenchConfig:
    """Everything a bench session needs; picklable (it is each spawned rank's argument)."""

    size: int = 1 << 30
    layout: str = "fsdp-tp"
    trainers: int | None = None
    inference: int = 4
    tensors: int | None = None
    backend: str = "auto"
    device: str = "cpu"
    mode: str = "shadow"
    timeout: float = 600.0
    hosts: int = 1

    @property
    def num_trainers(self) -> int:
        return self.trainers if self.trainers is not None else _DEFAULT_TRAINERS[self.layout]

    @property
    def trainer_ranks(self) -> tuple[int, ...]:
        return tuple(range(self.num_trainers))

    @property
    def inference_ranks(self) -> tuple[int, ...]:
        first = 0 if self.layout == "colocated" else self.num_trainers
        return tuple(range(first, first + self.inference))

    def host_of(self, rank: int) -> str | None:
        """Simulated host identity of ``rank`` (``$TRITONRESHARD_HOST``) when ``hosts > 1``: the
        trainers on host 0, the inference ranks spread over hosts 1..N-1 in contiguous blocks.
        None with one host: every rank keeps the machine's own identity."""
        if self.hosts <= 1:
            return None
        if rank in self.trainer_ranks:
            return "host0"
        i = self.inference_ranks.index(rank)
        return f"host{1 + i * (self.hosts - 1) // self.inference}"

    @property
    def world_size(self) -> int:
        return len(set(self.trainer_ranks) | set(self.inference_ranks))

    def problems(self) -> list[str]:
        p = []
        if self.layout not in LAYOUTS:
            p.append(f"--layout={self.layout!r} must be one of {', '.join(LAYOUTS)}")
        if self.size < 1 << 16:
            p.append(f"--size={self.size} bytes is too small (at least 64 KiB)")
        if self.num_trainers < 1 or self.inference < 1:
            p.append(f"--trainers={self.num_trainers} and --inference={self.inference} must be >= 1")
        if self.layout == "replicated-sources" and (self.num_trainers < 2 or self.num_trainers % 2):
            p.append(f"--layout=replicated-sources needs an even --trainers >= 2 (a 2 x T/2 DP x FSDP "
                     f"mesh), got {self.num_trainers}")
        if self.tensors is not None and self.tensors < 9:
            p.append(f"--tensors={self.tensors} must be >= 9 (one layer plus embeddings)")
        if self.mode not in ("shadow", "inplace"):
            p.append(f"--mode={self.mode!r} must be shadow or inplace")
        if self.backend not in ("auto", "torch", "triton"):
            p.append(f"--backend={self.backend!r} must be torch or triton")
        if self.device not in ("cpu", "cuda"):
            p.append(f"--device={self.device!r} must be cpu or cuda")
        if not isinstance(self.hosts, int) or self.hosts < 1:
            p.append(f"--hosts={self.hosts!r} must be an int >= 1")
        elif self.hosts > 1 and self.layout == "colocated":
            p.append(f"--hosts={self.hosts} puts the trainers on host 0 and the inference ranks elsewhere, "
                     f"but --layout=colocated runs both on the same processes")
        elif self.hosts > 1 and self.inference < self.hosts - 1:
            p.append(f"--hosts={self.hosts} spreads the inference ranks over {self.hosts - 1} host(s), "
                     f"but --inference={self.inference}")
        return p


@dataclass(frozen=True)
class _TensorSpec:
    name: str
    shape: tuple[int, ...]
    kind: str   # qkv, o, gate_up, down, norm, embed


def _layer_numel(h: int, i: int) -> int:
    return 3 * h * h + h * h + 2 * i * h + i * h + 2 * h


def _ffn(h: int, align: int) -> int:
    return max(align, -(-(8 * h // 3) // align) * align)


def _model(cfg: BenchConfig) -> list[_TensorSpec]:
    """A Llama-shaped model of ``cfg.size`` bytes of bf16 (within one embedding row), with
    ``cfg.tensors`` tensors when given (many small layers; extra 1-D tensors make the count exact)."""
    elems = cfg.size // 2
    if cfg.tensors is None:
        layers = max(1, round((elems / 196608) ** (1 / 3)))  # Llama proportions: hidden ~ 128 x layers
        align = 64 if elems >= 1 << 22 else 8
        extra = 0
    else:
        layers = max(1, (cfg.tensors - 3) // 6)
        extra = cfg.tensors - 3 - 6 * layers
        align = 8
    budget = 0.94 * elems / layers  # ~6% for embedding and lm_head, as in Llama-2-7B
    h = max(align, int(math.sqrt(budget / 12)) // align * align)
    while h > align and _layer_numel(h, _ffn(h, align)) > budget:
        h -= align
    while _layer_numel(h + align, _ffn(h + align, align)) <= budget:
        h += align
    i = _ffn(h, align)
    out = []
    for layer in range(layers):
        p = f"layers.{layer}."
        out += [_TensorSpec(p + "attn.qkv.weight", (3 * h, h), "qkv"),
                _TensorSpec(p + "attn.o.weight", (h, h), "o"),
                _TensorSpec(p + "mlp.gate_up.weight", (2 * i, h), "gate_up"),
                _TensorSpec(p + "mlp.down.weight", (h, i), "down"),
                _TensorSpec(p + "input_norm.weight", (h,), "norm"),
                _TensorSpec(p + "post_norm.weight", (h,), "norm")]
    out += [_TensorSpec(f"extra.{k}.bias", (h,), "norm") for k in range(extra)]
    out.append(_TensorSpec("norm.weight", (h,), "norm"))
    rest = max(2 * h, elems - sum(math.prod(t.shape) for t in out))
    vocab = max(1, rest // (2 * h))
    out.append(_TensorSpec("embed.weight", (vocab + (rest - 2 * vocab * h) // h, h), "embed"))
    out.append(_TensorSpec("lm_head.weight", (vocab, h), "embed"))
    return out


def _tp_placement(t: _TensorSpec, trs):
    h = t.shape[-1] if t.kind != "down" else t.shape[0]
    if t.kind == "qkv":
        return trs.Shard(0, blocks=(h, h, h))
    if t.kind == "gate_up":
        return trs.Shard(0, blocks=(t.shape[0] // 2, t.shape[0] // 2))
    if t.kind in ("o", "down"):
        return trs.Shard(1)
    if t.kind == "embed":
        return trs.Shard(0)
    return trs.Replicate()


def _layouts(cfg: BenchConfig, model: list[_TensorSpec]):
    """(src_layouts, dst_layouts) of the configured layout."""
    import torch

    import tritonreshard as trs
    bf16 = torch.bfloat16
    tr, inf = list(cfg.trainer_ranks), list(cfg.inference_ranks)
    src, dst = {}, {}
    for t in model:
        if cfg.layout in ("fsdp-tp", "colocated"):
            src[t.name] = trs.Layout(t.shape, tr, [trs.Shard(0)], bf16)
            dst[t.name] = trs.Layout(t.shape, inf, [_tp_placement(t, trs)], bf16)
        elif cfg.layout == "cols-replicas":
            src[t.name] = trs.Layout(t.shape, tr, [trs.Shard(len(t.shape) - 1)], bf16)
            dst[t.name] = trs.Layout(t.shape, inf, [trs.Replicate()], bf16)
        elif cfg.layout == "replicated-sources":
            half = len(tr) // 2
            src[t.name] = trs.Layout(t.shape, [tr[:half], tr[half:]], [trs.Replicate(), trs.Shard(0)], bf16)
            dst[t.name] = trs.Layout(t.shape, inf, [_tp_placement(t, trs)], bf16)
        else:
            raise ValueError(f"unknown layout {cfg.layout!r}")
    return src, dst


# ============================================================================================
# Provenance data
# ============================================================================================
_MASK = 0xBFFF  # clear the top exponent bit: every value is finite (|x| < 2), no NaN payloads


def _version_key(v: int) -> int:
    assert 0 <= v < 1 << 15, "too many refits for the version key"
    return (v & 0x3FFF) | ((v >> 14) << 15)


def _to_int16(bits):
    import torch
    return torch.where(bits >= 1 << 15, bits - (1 << 16), bits).to(torch.int16)


def _key16(v: int) -> int:
    k = _version_key(v)
    return k - (1 << 16) if k >= 1 << 15 else k


def _hash_bits(layout, rank: int, name: str, device, cache: dict | None = None):
    """int16 bits of ``rank``'s local shard at version 0: a hash of (name, global index).
    ``cache``: global-index tensors by (layout, rank), shared by tensors of equal layouts."""
    key = (layout, rank)
    idx = cache.get(key) if cache is not None else None
    if idx is None:
        idx = _global_index(layout, rank, device) * 0x9E3779B1
        if cache is not None:
            cache[key] = idx
    seed = zlib.crc32(name.encode()) & 0xFFFFFF
    h = (idx + seed * 0x85EBCA6B) & 0xFFFFFFFF
    h ^= h >> 15
    h = (h * 0x2C1B3C6D) & 0xFFFFFFFF
    h ^= h >> 12
    return _to_int16((h >> 8) & _MASK)


def _global_index(layout, rank: int, device):
    """int64 global flat index of every element of ``rank``'s local shard."""
    import torch
    shape = layout.local_shape(rank)
    idx = torch.zeros((), dtype=torch.int64, device=device)
    stride = 1
    for d in reversed(range(len(layout.shape))):
        segs = layout.segments(rank)[d]
        coord = torch.cat([torch.arange(s, e, dtype=torch.int64, device=device) for s, e, _ in segs]) \
            if segs else torch.zeros(0, dtype=torch.int64, device=device)
        view = [1] * len(shape)
        view[d] = -1
        idx = idx + (coord * stride).view(view)
        stride *= layout.shape[d]
    return idx.expand(shape).contiguous() if shape else idx


def _blocks(layout, rank: int):
    """(global slices, local slices) of every rectangular block of ``rank``'s local shard."""
    for combo in product(*layout.segments(rank)):
        yield (tuple(slice(s, e) for s, e, _ in combo), tuple(slice(lo, lo + e - s) for s, e, lo in combo))


# ============================================================================================
# Baselines (each rank's side)
# ============================================================================================
def _bytes(t):
    """A contiguous tensor's bytes as uint8 (gloo collectives have no int16, NCCL neither)."""
    import torch
    return t.reshape(-1).view(torch.uint8)


class _P2P:
    """``batch_isend_irecv`` of the plan's ops; local ops (colocated ranks) are copies."""

    @staticmethod
    def _wire(view, comm_device, staged: list, sending: bool):
        """The tensor the wire reads or writes for ``view``: itself when contiguous on the comm
        device, else a staging buffer recorded in ``staged`` as (copy destination, copy source)."""
        import torch
        if view.is_contiguous() and view.device == comm_device:
            return view
        buf = torch.empty(view.shape, dtype=view.dtype, device=comm_device)
        staged.append((buf, view) if sending else (view, buf))
        return buf

    def __init__(self, plan, rank: int, src: dict, dst: dict, comm_device):
        import torch.distributed as dist
        self.packs, self.unpacks, self.local, self.p2p_ops = [], [], [], []
        for op in plan.ops:
            if op.numel == 0 or rank not in (op.src_rank, op.dst_rank):
                continue
            if op.src_rank == op.dst_rank:
                self.local.append((dst[op.name][op.dst_slices], src[op.name][op.src_slices]))
            elif op.src_rank == rank:
                buf = self._wire(src[op.name][op.src_slices], comm_device, self.packs, sending=True)
                self.p2p_ops.append(dist.P2POp(dist.isend, _bytes(buf), op.dst_rank))
            else:
                buf = self._wire(dst[op.name][op.dst_slices], comm_device, self.unpacks, sending=False)
                self.p2p_ops.append(dist.P2POp(dist.irecv, _bytes(buf), op.src_rank))

    def step(self) -> None:
        import torch.distributed as dist
        for buf, view in self.packs:
            buf.copy_(view)
        if self.p2p_ops:
            for work in dist.batch_isend_irecv(self.p2p_ops):
                work.wait()
        for view, buf in self.unpacks:
            view.copy_(buf)
        for d, s in self.local:
            d.copy_(s)


class _GatherBroadcast:
    """Per tensor: gather on the first trainer, broadcast to every inference rank, slice locally."""

    def __init__(self, model, src_layouts, dst_layouts, rank, src: dict, dst: dict, groups, comm_device):
        import torch
        self.rank, self.src, self.dst, self.device = rank, src, dst, comm_device
        self.steps = []
        biggest = 1
        for t in model:
            s_lay, d_lay = src_layouts[t.name], dst_layouts[t.name]
            gset, bset = _gather_set(s_lay), _bcast_set(s_lay, d_lay)
            self.steps.append((t, s_lay, d_lay, gset, bset, groups.get(gset), groups.get(bset)))
            biggest = max(biggest, math.prod(t.shape))
        need = any(rank in g or rank in b for _, _, _, g, b, _, _ in self.steps)
        self.full = torch.empty(biggest, dtype=torch.int16, device=comm_device) if need else None
        max_local = max((s_lay.local_numel(r) for _, s_lay, _, g, _, _, _ in self.steps for r in g), default=1)
        is_root = any(rank == step[3][0] for step in self.steps)
        most = max(len(step[3]) for step in self.steps)
        self.slots = [torch.empty(max_local, dtype=torch.int16, device=comm_device) for _ in range(most)] \
            if is_root else []
        self.pad = torch.empty(max_local, dtype=torch.int16, device=comm_device)

    def step(self) -> None:
        import torch
        import torch.distributed as dist
        rank = self.rank
        for t, s_lay, d_lay, gset, bset, ggroup, bgroup in self.steps:
            root = gset[0]
            numel = math.prod(t.shape)
            full = self.full[:numel].view(t.shape) if self.full is not None else None
            if rank in gset:
                mine = self.src[t.name].view(-1).view(torch.int16)
                if len(gset) > 1:
                    n = max(s_lay.local_numel(r) for r in gset)
                    send = mine
                    if mine.numel() != n or mine.device != self.device:
                        send = self.pad[:n]
                        send[:mine.numel()].copy_(mine)
                    slots = [s[:n] for s in self.slots[:len(gset)]] if rank == root else None
                    dist.gather(send.view(torch.uint8), [x.view(torch.uint8) for x in slots] if slots else None,
                                dst=root, group=ggroup)  # gloo collectives have no int16
                    pieces = {r: slots[k] for k, r in enumerate(gset)} if rank == root else {}
                else:
                    pieces = {rank: mine}
                if rank == root:
                    for r, flat in pieces.items():
                        shard = flat[:s_lay.local_numel(r)].view(s_lay.local_shape(r))
                        for g, loc in _blocks(s_lay, r):
                            full[g].copy_(shard[loc])
            if rank in bset and len(bset) > 1:
                dist.broadcast(full.view(torch.uint8), src=root, group=bgroup)
            if rank in d_lay.ranks:
                out = self.dst[t.name].view(torch.int16)
                for g, loc in _blocks(d_lay, rank):
                    out[loc].copy_(full[g])


def _gather_set(s_lay) -> tuple[int, ...]:
    """One source rank per distinct shard (the first replica), in mesh order: who a trainer-0 gather
    collects from (one DP replica's FSDP group)."""
    seen, out = set(), []
    for r in s_lay.ranks:
        segs = s_lay.segments(r)
        if segs not in seen:
            seen.add(segs)
            out.append(r)
    return tuple(out)


def _bcast_set(s_lay, d_lay) -> tuple[int, ...]:
    return tuple(sorted({_gather_set(s_lay)[0], *d_lay.ranks}))


# ============================================================================================
# One rank
# ============================================================================================
class _Rank:
    def __init__(self, rank: int, cfg: BenchConfig, store):
        import torch
        import torch.distributed as dist

        from tritonreshard import RefitEndpoint
        self.rank, self.cfg = rank, cfg
        host = cfg.host_of(rank)
        if host is not None:  # the engine reads it when the endpoint joins its group
            os.environ["TRITONRESHARD_HOST"] = host
        timeout = datetime.timedelta(seconds=cfg.timeout)
        if cfg.device == "cuda":
            self.device = torch.device("cuda", rank % torch.cuda.device_count())
            torch.cuda.set_device(self.device)
            nccl = torch.cuda.device_count() >= cfg.world_size
        else:
            self.device, nccl = torch.device("cpu"), False
        dist.init_process_group("cpu:gloo,cuda:nccl" if nccl else "gloo", store=dist.PrefixStore("pg", store),
                                rank=rank, world_size=cfg.world_size, timeout=timeout)
        self.cpu_group = dist.new_group(backend="gloo") if nccl else None
        # CUDA tensors without one GPU per rank go through the CPU (gloo): NCCL needs distinct GPUs.
        self.comm_device = self.device if (nccl or cfg.device == "cpu") else torch.device("cpu")
        self.transport = "nccl" if nccl else ("gloo" if cfg.device == "cpu" else "gloo (CPU-staged)")

        self.model = _model(cfg)
        self.src_layouts, self.dst_layouts = _layouts(cfg, self.model)
        self.is_src = rank in cfg.trainer_ranks
        self.is_dst = rank in cfg.inference_ranks
        # Every rank creates every subgroup, in the same order (new_group is collective).
        groups = {}
        for t in self.model:
            s, d = self.src_layouts[t.name], self.dst_layouts[t.name]
            for ranks in (_gather_set(s), _bcast_set(s, d)):
                if len(ranks) > 1 and ranks not in groups:
                    groups[ranks] = dist.new_group(list(ranks))

        cache = {}
        self.src_base = {t.name: _hash_bits(self.src_layouts[t.name], rank, t.name, self.device, cache)
                         for t in self.model} if self.is_src else {}
        self.dst_base = {t.name: _hash_bits(self.dst_layouts[t.name], rank, t.name, self.device, cache)
                         for t in self.model} if self.is_dst else {}
        del cache
        initial = {n: b.view(torch.bfloat16).clone() for n, b in self.src_base.items()} if self.is_src else None
        self.ep = RefitEndpoint(rank=rank, world_size=cfg.world_size, store=dist.PrefixStore("refit", store),
                                src_tensors=initial, src_layouts=self.src_layouts if self.is_src else None,
                                dst_layouts=self.dst_layouts if self.is_dst else None, mode=cfg.mode,
                                device=self.device, backend=cfg.backend, timeout=cfg.timeout)
        del initial
        self.plan = self.ep.plan  # the same plan every rank derived (no second planning pass)
        self.src = self.ep.source_tensors if self.is_src else {}
        # Each baseline writes its own destination set (allocated and faulted in now), so every
        # method's result can be verified after the interleaved rounds.
        self.bufs = {m: {t.name: torch.zeros(self.dst_layouts[t.name].local_shape(rank), dtype=torch.bfloat16,
                                             device=self.device) for t in self.model} if self.is_dst else {}
                     for m in ("p2p", "gather_broadcast")}
        self.p2p = _P2P(self.plan, rank, self.src, self.bufs["p2p"], self.comm_device)
        self.gb = _GatherBroadcast(self.model, self.src_layouts, self.dst_layouts, rank, self.src,
                                   self.bufs["gather_broadcast"], groups, self.comm_device)
        self.version = 0
        self.last = {}
        self.last_pull_max = self.last_coordination = 0.0

    def _barrier(self):
        import torch.distributed as dist
        dist.barrier(group=self.cpu_group)

    def _sync(self):
        if self.device.type == "cuda":
            import torch
            torch.cuda.synchronize(self.device)

    def refit(self, method: str) -> float:
        """One timed refit by ``method`` (collective: every rank calls it). Returns seconds."""
        import torch
        import torch.distributed as dist
        self.version += 1
        key = _key16(self.version)
        if self.is_src:
            if self.ep.published:
                self.ep.fence()  # readers of the previous version are done with the arena
            for name, base in self.src_base.items():
                torch.bitwise_xor(base, key, out=self.src[name].view(torch.int16))
        self._sync()
        self._barrier()
        t0 = time.monotonic()
        if method == "tritonreshard":
            if self.is_src:
                self.ep.publish()
            if self.is_dst:
                self.ep.pull()
        elif method == "p2p":
            self.p2p.step()
        elif method == "gather_broadcast":
            self.gb.step()
        else:
            raise ValueError(f"unknown method {method!r}")
        self._sync()
        t1 = time.monotonic()
        ours = method == "tritonreshard" and self.is_dst
        # The engine's own split of this rank's pull: the descriptor-table copy (device sync
        # included) and the pull as a whole (start to ack).
        copy = self.ep.last_pull.copy_ms / 1e3 if ours else 0.0
        pull = self.ep.last_pull.total_ms / 1e3 if ours else 0.0
        times = [torch.zeros(4, dtype=torch.float64) for _ in range(self.cfg.world_size)]
        dist.all_gather(times, torch.tensor([t0, t1, pull, copy], dtype=torch.float64), group=self.cpu_group)
        self.last[method] = self.version
        self.last_pull_max = max(float(t[2]) for t in times)
        seconds = max(float(t[1]) for t in times) - min(float(t[0]) for t in times)
        # Coordination: what the refit took beyond its slowest copy (publishing, waking the
        # readers, the post-copy checks, the acks). Only the engine's refit has it.
        self.last_coordination = seconds - max(float(t[3]) for t in times) if method == "tritonreshard" else 0.0
        return seconds

    def verify(self, method: str) -> bool:
        """Every element of this rank's destination shards equals the last refit's version, bit for bit."""
        import torch
        if not self.is_dst:
            return True
        if method not in self.last:
            return False
        tensors = self.ep.tensors if method == "tritonreshard" else self.bufs[method]
        key = _key16(self.last[method])
        return all(torch.equal(tensors[n].view(torch.int16), torch.bitwise_xor(base, key))
                   for n, base in self.dst_base.items())

    def stats(self) -> dict:
        """Measured after refits: the most extra memory one of this rank's pulls allocated."""
        return {"rank": self.rank, "staging_bytes": int(self.ep.staging_bytes),
                "cross_host_bytes": int(self.ep.cross_host_bytes)}

    def info(self) -> dict:
        return {"rank": self.rank,
                "descriptors": int(self.ep.num_descriptors) if self.is_dst else 0,
                "handles_opened": int(self.ep.handles_opened),
                "plan_ops_dst": len(self.plan.ops_for_dst(self.rank)), "bytes_per_refit": int(self.ep.bytes_per_refit)
                if self.is_dst else 0, "backend": self.ep.backend, "transport": self.transport}

    def close(self):
        self.ep.close()


def _worker(rank: int, store, bstore, cfg: BenchConfig) -> None:
    """Every spawned rank (run by the shared driver, which records a failure under ``error/<rank>``):
    set up, then serve commands from the store."""
    import torch.distributed as dist

    r = _Rank(rank, cfg, store)
    try:
        infos = [None] * cfg.world_size
        dist.all_gather_object(infos, r.info(), group=r.cpu_group)
        if rank == 0:
            bstore.set("info", json.dumps(infos))
        bstore.add("ready", 1)
        n = 0
        while True:
            key = f"cmd/{n}"
            wait_key(bstore, key, cfg.timeout)
            cmd = json.loads(bstore.get(key))
            if cmd["op"] == "stop":
                break
            secs, pulls, coords = [], [], []
            for _ in range(cmd["count"]):
                secs.append(r.refit(cmd["method"]))
                pulls.append(r.last_pull_max)
                coords.append(r.last_coordination)
                if rank == 0:
                    bstore.add("progress", 1)
            result = {"seconds": secs, "pull_seconds_max": pulls, "coordination_seconds": coords}
            if cmd.get("verify"):
                oks = [None] * cfg.world_size
                dist.all_gather_object(oks, r.verify(cmd["method"]), group=r.cpu_group)
                result["verified"] = all(oks)
                result["verified_ranks"] = [i for i, ok in enumerate(oks) if not ok]
            if cmd.get("stats"):
                stats = [None] * cfg.world_size
                dist.all_gather_object(stats, r.stats(), group=r.cpu_group)
                result["stats"] = stats
            if rank == 0:
                bstore.set(f"res/{n}", json.dumps(result))
            n += 1
        r.close()
        dist.barrier(group=r.cpu_group)
        dist.destroy_process_group()
    except BaseException:
        r.ep.close(abort=True)
        raise


def _bench_role(cfg: BenchConfig, rank: int) -> str:
    sides = [s for s, ranks in (("trainer", cfg.trainer_ranks), ("inference", cfg.inference_ranks)) if rank in ranks]
    return " + ".join(sides)


# ============================================================================================
# Driver side
# ============================================================================================


def memcpy_seconds(nbytes: int, repeats: int, warmup: int = 1, device: str = "cpu",
                   threads: int | None = None, buffers=None) -> list[float]:
    """Seconds of ``dst.copy_(src)`` of ``nbytes`` (pre-faulted buffers) on ``device``, ``repeats`` times.
    ``threads``: torch intra-op threads for the CPU copy (default: torch's, i.e. all cores);
    ``buffers``: a ``(src, dst)`` pair to reuse (from an earlier call's set-up)."""
    import torch
    old = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        dev = torch.device(device)
        src, dst = buffers if buffers is not None else _memcpy_buffers(nbytes, dev)
        sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
        out = []
        for k in range(warmup + repeats):
            sync()
            t0 = time.monotonic()
            dst.copy_(src)
            sync()
            if k >= warmup:
                out.append(time.monotonic() - t0)
        return out
    finally:
        torch.set_num_threads(old)


def _memcpy_buffers(nbytes: int, device):
    import torch
    return (torch.ones(nbytes, dtype=torch.uint8, device=device),   # filled: pages are faulted in
            torch.zeros(nbytes, dtype=torch.uint8, device=device))


class BenchSession:
    """Spawned ranks set up once (endpoints, baselines, provenance), then run refits on command.

    ``refits(method, count)`` -> list of seconds (one per timed refit), ``verify(method)`` -> bool,
    ``memcpy(repeats)`` -> list of seconds of the driver's copy of the same bytes, ``close()``.
    Use as a context manager. ``dst_bytes``: destination bytes per refit.
    """

    def __init__(self, cfg: BenchConfig, on_progress=None):
        problems = cfg.problems()
        if problems:
            raise ValueError("invalid bench configuration:\n  - " + "\n  - ".join(problems))
        self.cfg = cfg
        self.model = _model(cfg)
        _, dst = _layouts(cfg, self.model)
        # Destination bytes: every inference rank's local shards (the plan writes each exactly once).
        self.dst_bytes = sum(lay.local_numel(r) * lay.itemsize for lay in dst.values() for r in lay.ranks)
        self.model_bytes = sum(math.prod(t.shape) * 2 for t in self.model)
        self._on_progress = on_progress
        self._n = 0
        self._progress_seen = 0
        self._memcpy_bufs = None
        self.closed = False
        self._driver = Driver("bench", cfg.world_size, _worker, (cfg,), timeout=cfg.timeout, prefix="bench",
                              role=lambda r: _bench_role(cfg, r))
        self._bstore = self._driver.pstore
        try:
            self._driver.start()
            self._wait(lambda: self._bstore.add("ready", 0) >= cfg.world_size, "set-up")
            self.rank_info = json.loads(self._bstore.get("info"))
        except BaseException:
            self.close(failed=True)
            raise

    def _poll_progress(self):
        if self._on_progress is None:
            return
        done = self._bstore.add("progress", 0)
        if done > self._progress_seen:
            self._on_progress(done - self._progress_seen)
            self._progress_seen = done

    def _wait(self, ready, what: str):
        self._driver.wait(ready, f"the bench's {what}", tick=self._poll_progress)

    def _command(self, cmd: dict) -> dict | None:
        if self.closed:
            raise RuntimeError("BenchSession is closed")
        n = self._n
        self._n += 1
        self._bstore.set(f"cmd/{n}", json.dumps(cmd))
        if cmd["op"] == "stop":
            return None
        key = f"res/{n}"
        self._wait(lambda: self._bstore.check([key]), f"{cmd['method']} refits")
        self._poll_progress()
        return json.loads(self._bstore.get(key))

    # -- measurements ------------------------------------------------------------------------
    def refits(self, method: str, count: int = 1, verify: bool = False) -> dict:
        """Runs ``count`` refits by ``method``; returns ``{"seconds": [...], "verified": bool?}``."""
        if method not in WORKER_METHODS:
            raise ValueError(f"method={method!r} must be one of {WORKER_METHODS}")
        return self._command({"op": "refit", "method": method, "count": int(count), "verify": bool(verify)})

    def verify(self, method: str) -> bool:
        return bool(self._command({"op": "refit", "method": method, "count": 0, "verify": True})["verified"])

    def memcpy(self, repeats: int, warmup: int = 1, threads: int | None = None) -> list[float]:
        """The driver copies ``dst_bytes`` (buffers allocated and faulted in once per session)."""
        if self._memcpy_bufs is None:
            self._memcpy_bufs = _memcpy_buffers(self.dst_bytes, self.cfg.device)
        out = memcpy_seconds(self.dst_bytes, repeats, warmup, self.cfg.device, threads, self._memcpy_bufs)
        if self._on_progress is not None:
            self._on_progress(warmup + repeats)
        return out

    def staging_bytes(self) -> int:
        """Measured (the engine tracks what each pull allocates): the sum over ranks of the most
        extra memory one pull allocated, over every refit so far."""
        stats = self._command({"op": "refit", "method": "tritonreshard", "count": 0, "stats": True})["stats"]
        return sum(s["staging_bytes"] for s in stats)

    def cross_host_bytes(self) -> int:
        """The engine's own accounting: bytes its ranks received from other hosts in the last refit."""
        stats = self._command({"op": "refit", "method": "tritonreshard", "count": 0, "stats": True})["stats"]
        return sum(s["cross_host_bytes"] for s in stats)

    def baseline_cross_host_bytes(self) -> dict:
        """Bytes per refit the baselines move between hosts with the same placement: ``p2p`` sends
        every destination rank's own slices; ``gather_broadcast`` broadcasts each full tensor to
        every inference rank (counted as the bytes each rank on another host than the root
        receives)."""
        import tritonreshard as trs
        src, dst = _layouts(self.cfg, self.model)
        host = {r: self.cfg.host_of(r) for r in range(self.cfg.world_size)}
        p2p = sum(op.numel * src[op.name].itemsize for op in trs.plan_reshard(src, dst).ops
                  if host[op.src_rank] != host[op.dst_rank])
        gb = 0
        for t in self.model:
            root = _gather_set(src[t.name])[0]
            full = math.prod(t.shape) * src[t.name].itemsize
            gb += full * sum(1 for r in _bcast_set(src[t.name], dst[t.name]) if host[r] != host[root])
        return {"p2p": p2p, "gather_broadcast": gb}

    @property
    def plan_ops(self) -> int:
        return sum(i["plan_ops_dst"] for i in self.rank_info)

    @property
    def descriptors(self) -> int:
        return sum(i["descriptors"] for i in self.rank_info)

    # -- lifetime ----------------------------------------------------------------------------
    def close(self, failed: bool = False) -> list[str]:
        """Stops the ranks; returns the engine's /dev/shm entries that appeared meanwhile (a leak)."""
        if self.closed:
            return []
        self.closed = True
        self._memcpy_bufs = None
        if not failed:
            self._n, n = self._n + 1, self._n
            self._bstore.set(f"cmd/{n}", json.dumps({"op": "stop"}))
        return self._driver.close(join=30.0 if not failed else 0.0)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        self.close(failed=exc_type is not None)
        return False


# ============================================================================================
# CLI
# ============================================================================================
def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Adds the bench options to ``parser`` (used by ``tritonreshard bench``)."""
    parser.add_argument("--size", default="1GiB",
                        help="bytes of the bf16 model (256MiB, 1GiB, a plain int; default 1GiB). On "
                             "--device cuda the model lives in GPU memory: trainer arenas and inference "
                             "shards are on the GPUs (rank %% device count)")
    parser.add_argument("--layout", choices=LAYOUTS, default="fsdp-tp",
                        help="fsdp-tp: FSDP rows -> tensor parallel (default); cols-replicas: column shards "
                             "-> whole tensors on every inference rank; colocated: fsdp-tp with trainers and "
                             "inference on the same processes; replicated-sources: DP x FSDP -> TP")
    parser.add_argument("--trainers", type=int, default=None,
                        help="trainer processes (default 2 for fsdp-tp, 4 otherwise)")
    parser.add_argument("--inference", type=int, default=4, help="inference processes (default 4)")
    parser.add_argument("--tensors", type=int, default=None,
                        help="number of tensors (many small layers, same total size), e.g. 10000 to "
                             "measure the per-tensor overhead of a refit")
    parser.add_argument("--repeats", type=int, default=10, help="timed refits per method (default 10)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed refits per method first (default 2)")
    parser.add_argument("--backend", choices=("torch", "triton"), default=None,
                        help="engine copy backend (default: torch on cpu, triton on cuda)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--mode", choices=("shadow", "inplace"), default="shadow",
                        help="engine mode: pull into a spare buffer set and swap (default), or in place")
    parser.add_argument("--methods", default=",".join(METHODS),
                        help=f"comma-separated subset of {','.join(METHODS)} (default: all)")
    parser.add_argument("--timeout", type=float, default=600.0,
                        help="seconds for set-up and for each command's refits; also bounds every wait")
    parser.add_argument("--hosts", type=int, default=1,
                        help="simulate N hosts on this machine (a TRITONRESHARD_HOST per rank): trainers on "
                             "host 0, inference ranks spread over hosts 1..N-1; the JSON adds cross_host_bytes "
                             "per method (default 1: every rank on this host)")
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last stdout line")
    return parser


def _config(args) -> BenchConfig:
    return BenchConfig(size=parse_size(args.size), layout=args.layout, trainers=args.trainers,
                       inference=args.inference, tensors=args.tensors, backend=args.backend or "auto",
                       device=args.device, mode=args.mode, timeout=args.timeout, hosts=args.hosts)


def _result(seconds: list[float], nbytes: int) -> dict:
    s = statistics.median(seconds)
    return {"seconds": s, "gbps": nbytes / s / 1e9, "seconds_min": min(seconds), "seconds_all": seconds}


def measure(session: BenchSession, methods, repeats: int, warmup: int) -> dict:
    """Runs every method on ``session``; returns the JSON object ``tritonreshard bench --json`` prints."""
    import torch
    cfg, nbytes = session.cfg, session.dst_bytes
    workers = [m for m in methods if m in WORKER_METHODS]
    for m in workers:
        if warmup:
            session.refits(m, warmup)
    # Rounds interleave the methods (memcpy included), so load from anything else on the machine
    # hits every method alike instead of skewing the ratios.
    secs = {m: [] for m in methods}
    pulls, coords = [], []
    for _ in range(repeats):
        if "memcpy" in methods:
            secs["memcpy"] += session.memcpy(1, warmup=0 if secs["memcpy"] else max(1, warmup))
        for m in workers:
            r = session.refits(m, 1)
            secs[m] += r["seconds"]
            if m == "tritonreshard":
                pulls += r["pull_seconds_max"]
                coords += r["coordination_seconds"]
    results = {}
    for m in methods:
        results[m] = _result(secs[m], nbytes)
        if m in WORKER_METHODS:
            results[m]["verified"] = session.verify(m)
    if "memcpy" in results:
        results["memcpy"]["threads"] = torch.get_num_threads() if cfg.device == "cpu" else None
        if cfg.device == "cpu":
            one = _result(session.memcpy(max(3, repeats // 2), 1, threads=1), nbytes)
            results["memcpy"]["gbps_1thread"] = one["gbps"]
    if pulls:
        results["tritonreshard"]["pull_seconds_max"] = statistics.median(pulls)
        # Per refit: refit time minus the slowest rank's copy; the median and the spread.
        results["tritonreshard"]["coordination_ms"] = 1e3 * statistics.median(coords)
        results["tritonreshard"]["coordination_ms_all"] = [1e3 * c for c in coords]
    if "tritonreshard" in results:
        results["tritonreshard"]["staging_bytes"] = session.staging_bytes()
        results["tritonreshard"]["cross_host_bytes"] = session.cross_host_bytes()
    for m, b in session.baseline_cross_host_bytes().items():
        if m in results:
            results[m]["cross_host_bytes"] = b
    out = {"bytes": nbytes, "results": results}
    ours = results.get("tritonreshard")
    if ours:
        ours["descriptors"] = session.descriptors
        if "memcpy" in results:
            ours["ratio_to_memcpy"] = ours["gbps"] / results["memcpy"]["gbps"]
            # What the refit costs beyond copying its bytes at memcpy speed, per tensor.
            extra = ours["seconds"] - nbytes / (results["memcpy"]["gbps"] * 1e9)
            ours["overhead_per_tensor_us"] = extra / len(session.model) * 1e6
        for b in ("p2p", "gather_broadcast"):
            if b in results:
                ours[f"speedup_vs_{b}"] = results[b]["seconds"] / ours["seconds"]
    if "memcpy" in results:
        for m, r in results.items():
            r.setdefault("ratio_to_memcpy", r["gbps"] / results["memcpy"]["gbps"])
    transport = session.rank_info[0]["transport"]
    out.update({
        "layout": cfg.layout, "trainers": cfg.num_trainers, "inference": cfg.inference, "device": cfg.device,
        "mode": cfg.mode, "backend": session.rank_info[-1]["backend"], "baseline_transport": transport,
        "model_bytes": session.model_bytes, "tensors": len(session.model), "plan_ops": session.plan_ops,
        "repeats": repeats, "warmup": warmup, "processes": cfg.world_size, "hosts": cfg.hosts,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__,
                    "python": platform.python_version(),
                    "gpu": torch.cuda.get_device_name(0) if cfg.device == "cuda" else None},
    })
    return out


def _table(out: dict) -> str:
    res = out["results"]
    lines = [f"tritonreshard bench: {out['layout']}, {out['trainers']} trainer(s) -> {out['inference']} inference "
             f"rank(s), {out['device']}, {out['backend']} backend, {out['mode']} mode; "
             f"{_fmt_bytes(out['model_bytes'])} bf16 model in {out['tensors']} tensors, "
             f"{_fmt_bytes(out['bytes'])} written per refit; median of {out['repeats']} "
             f"(after {out['warmup']} warm-up)"]
    ours = res.get("tritonreshard")
    rows = [("method", "median ms", "GB/s", "x memcpy", "tritonreshard speed-up", "verified")]
    for m in METHODS:
        if m not in res:
            continue
        r = res[m]
        ratio = f"{r['ratio_to_memcpy']:.2f}" if "ratio_to_memcpy" in r else "-"
        speed = f"{r['seconds'] / ours['seconds']:.1f}x" if ours and m != "tritonreshard" else "-"
        ver = {True: "yes", False: "NO"}.get(r.get("verified"), "-")
        rows.append((m, f"{r['seconds'] * 1e3:.2f}", f"{r['gbps']:.2f}", ratio, speed, ver))
    w = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        lines.append("  " + "  ".join(c.ljust(w[0]) if i == 0 else c.rjust(w[i]) for i, c in enumerate(row)))
    if ours:
        coord = f"coordination {ours['coordination_ms']:.3f} ms per refit (beyond the slowest copy), " \
            if "coordination_ms" in ours else ""
        lines.append(f"tritonreshard: {coord}staging bytes {ours['staging_bytes']} (measured), "
                     f"{ours['descriptors']} descriptors "
                     f"over the inference ranks" + (f", overhead beyond memcpy {ours['overhead_per_tensor_us']:.1f} "
                                                    f"us per tensor" if "overhead_per_tensor_us" in ours else ""))
    if out.get("hosts", 1) > 1:
        cross = ", ".join(f"{m} {_fmt_bytes(res[m]['cross_host_bytes'])}" for m in METHODS
                          if "cross_host_bytes" in res.get(m, {}))
        lines.append(f"{out['hosts']} simulated hosts (trainers on host0): bytes across hosts per refit: "
                     f"{cross} (model {_fmt_bytes(out['model_bytes'])})")
    lines.append(f"baselines over {out['baseline_transport']}; {out['processes']} processes on "
                 f"{out['machine']['cpus']} CPUs")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Runs the bench; returns the exit code (0: measured and every method verified)."""
    try:
        cfg = _config(args)
    except ValueError as exc:
        print(f"tritonreshard bench: {exc}", file=sys.stderr)
        return 2
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    problems = cfg.problems()
    bad = [m for m in methods if m not in METHODS]
    if bad:
        problems.append(f"--methods has unknown {bad}; choose from {','.join(METHODS)}")
    if args.repeats < 1 or args.warmup < 0:
        problems.append(f"--repeats={args.repeats} must be >= 1 and --warmup={args.warmup} >= 0")
    if cfg.device == "cuda":
        import torch
        if not torch.cuda.is_available():
            problems.append("--device=cuda but torch.cuda.is_available() is False")
    if problems:
        print("tritonreshard bench: invalid arguments:\n  - " + "\n  - ".join(problems), file=sys.stderr)
        return 2

    from tqdm import tqdm
    total = len(methods) * args.repeats + len([m for m in methods if m in WORKER_METHODS]) * args.warmup
    if "memcpy" in methods:
        total += max(1, args.warmup) + (max(3, args.repeats // 2) + 1 if args.device == "cpu" else 0)
    bar = tqdm(total=total, desc=f"bench {cfg.layout} {_fmt_bytes(cfg.size)}", unit="refit", file=sys.stderr,
               dynamic_ncols=True)
    leaked: list[str] = []
    try:
        bar.set_postfix_str(f"setting up {cfg.world_size} processes")
        session = BenchSession(cfg, on_progress=bar.update)
        try:
            bar.set_postfix_str("")
            out = measure(session, methods, args.repeats, args.warmup)
        finally:
            leaked = session.close(failed=sys.exc_info()[0] is not None)
    except (RankFailed, TimeoutError) as exc:
        bar.close()
        print(f"tritonreshard bench failed: {exc}", file=sys.stderr)
        return 1
    finally:
        bar.close()
    if leaked:
        print(f"tritonreshard bench: /dev/shm entries appeared during the run: {leaked}", file=sys.stderr)
    out["shm_leaked"] = leaked
    print(_table(out))
    if args.json:
        print(json.dumps(out))
    ok = all(r.get("verified", True) for r in out["results"].values()) and not leaked
    return 0 if ok else 1
