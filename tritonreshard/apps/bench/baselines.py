"""The two baselines, each rank's side, on the same bytes as the engine's refit:

* :class:`P2P`: ``torch.distributed.batch_isend_irecv`` over the plan's ops (gloo on CPU, NCCL on
  GPU): sources send each op's slice (packed when not contiguous), destinations receive into a
  temporary (or straight into a contiguous destination slice) and copy into the shard;
* :class:`GatherBroadcast`: per tensor, gather the full tensor on the first trainer, broadcast it to
  every inference rank, each inference rank copies out its shard (the serialized flow).

:func:`gather_set` and :func:`bcast_set` name the ranks of each tensor's gather and broadcast (the
subgroups every rank creates, and what the cross-host accounting counts).
"""
from __future__ import annotations

import math
from itertools import product

import torch
import torch.distributed as dist

from tritonreshard.layout import Layout
from tritonreshard.planning import Plan

__all__ = ["P2P", "GatherBroadcast", "gather_set", "bcast_set"]


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as uint8 (gloo collectives have no int16, NCCL neither)."""
    return t.reshape(-1).view(torch.uint8)


def _blocks(layout: Layout, rank: int):
    """(global slices, local slices) of every rectangular block of ``rank``'s local shard."""
    for combo in product(*layout.segments(rank)):
        yield (tuple(slice(s, e) for s, e, _ in combo), tuple(slice(lo, lo + e - s) for s, e, lo in combo))


class P2P:
    """``batch_isend_irecv`` of the plan's ops; local ops (colocated ranks) are copies."""

    @staticmethod
    def _wire(view, comm_device, staged: list, sending: bool):
        """The tensor the wire reads or writes for ``view``: itself when contiguous on the comm
        device, else a staging buffer recorded in ``staged`` as (copy destination, copy source)."""
        if view.is_contiguous() and view.device == comm_device:
            return view
        buf = torch.empty(view.shape, dtype=view.dtype, device=comm_device)
        staged.append((buf, view) if sending else (view, buf))
        return buf

    def __init__(self, plan: Plan, rank: int, src: dict, dst: dict, comm_device):
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
        for buf, view in self.packs:
            buf.copy_(view)
        if self.p2p_ops:
            for work in dist.batch_isend_irecv(self.p2p_ops):
                work.wait()
        for view, buf in self.unpacks:
            view.copy_(buf)
        for d, s in self.local:
            d.copy_(s)


class GatherBroadcast:
    """Per tensor: gather on the first trainer, broadcast to every inference rank, slice locally."""

    def __init__(self, model, src_layouts, dst_layouts, rank, src: dict, dst: dict, groups, comm_device):
        self.rank, self.src, self.dst, self.device = rank, src, dst, comm_device
        self.steps = []
        biggest = 1
        for t in model:
            s_lay, d_lay = src_layouts[t.name], dst_layouts[t.name]
            gset, bset = gather_set(s_lay), bcast_set(s_lay, d_lay)
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


def gather_set(s_lay: Layout) -> tuple[int, ...]:
    """One source rank per distinct shard (the first replica), in mesh order: who a trainer-0 gather
    collects from (one DP replica's FSDP group)."""
    seen, out = set(), []
    for r in s_lay.ranks:
        segs = s_lay.segments(r)
        if segs not in seen:
            seen.add(segs)
            out.append(r)
    return tuple(out)


def bcast_set(s_lay: Layout, d_lay: Layout) -> tuple[int, ...]:
    return tuple(sorted({gather_set(s_lay)[0], *d_lay.ranks}))
