"""FSDP2 (``torch.distributed.fsdp.fully_shard``) models as refit sources.

Who calls what: a trainer rank hands its ``fully_shard`` model to :class:`~tritonreshard.RefitTrainer`
(which wraps it in :class:`FSDP2Source`), or builds ``FSDP2Source(model)`` itself. The source

* reads each parameter's layout from its DTensor (global shape, device-mesh ranks, ``Shard(0)``), so
  no layouts are written by hand;
* gives the engine each parameter's local shard (unpadded, ``layout.local_shape(rank)``);
* moves each shard into memory the engine provides (an arena view), once: :meth:`FSDP2Source.rebind`
  re-points FSDP2's padded flat ``_sharded_param_data`` (what FSDP all-gathers from) and the sharded
  DTensor's ``_local_tensor`` (what the optimizer updates) at that memory, so training continues on
  the arena and every published version is read there with no copy per step.

FSDP2 internals this relies on (torch 2.13, ``_fully_shard/_fsdp_param.py``): an ``FSDPParam`` keeps
``_sharded_param_data`` (1-D, ``padded_sharded_param_size`` elements: dim-0 chunks padded to the first
chunk's size) and ``sharded_param._local_tensor = padded.narrow(shard_dim, 0, length)``;
``all_gather_inputs`` reads ``_sharded_param_data``, and ``reset_sharded_param`` (lazy init) keeps both
when they share a storage. Both views are derived from one arena block, so they do.
"""
from __future__ import annotations

import math
from collections.abc import Iterator, Mapping

import torch

from ..layout import Layout

__all__ = ["is_fsdp2", "FSDP2Source"]


def is_fsdp2(module) -> bool:
    """True when ``module`` or one of its submodules was wrapped by ``fully_shard``."""
    # Lazy (here and below): torch.distributed.fsdp imports torch.distributed.nn, which pins a job's
    # process group when first imported after init_process_group (see engine/group.py). A model
    # that is an FSDP2 module has imported it already.
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, torch.nn.Module) and any(isinstance(m, FSDPModule) for m in module.modules())


def _fsdp_params(module: torch.nn.Module) -> dict[str, object]:
    """``{parameter name: FSDPParam}`` over every ``fully_shard`` group inside ``module``."""
    from torch.distributed.fsdp import FSDPModule  # lazy: see is_fsdp2

    names = {id(p): n for n, p in module.named_parameters()}
    out = {}
    for m in module.modules():
        if not isinstance(m, FSDPModule):
            continue
        group = m._get_fsdp_state()._fsdp_param_group
        for fp in (group.fsdp_params if group is not None else ()):
            name = names.get(id(fp.sharded_param))
            if name is not None:
                out[name] = fp
    return out


class FSDP2Source(Mapping):
    """A ``fully_shard`` model's local shards as a refit source: ``{name: local shard}``.

    Args:
        module: the model after ``fully_shard`` (parameters are DTensors sharded on dim 0).
        rank_map: optional ``{device-mesh rank: refit-group rank}`` when the FSDP process group's
            ranks are not the trainers' ranks in the refit group (default: the same numbers).

    ``layouts``: ``{name: Layout}`` read from the DTensors. Raises ``ValueError`` naming every
    parameter that is not an FSDP2-managed DTensor sharded on dim 0, or that is not in its sharded
    state (call it between steps, not inside forward/backward).
    """

    def __init__(self, module: torch.nn.Module, rank_map: Mapping[int, int] | None = None):
        from torch.distributed.tensor import DTensor  # lazy: see is_fsdp2

        self._fsdp = _fsdp_params(module)
        problems, layouts, shards = [], {}, {}
        for name, p in module.named_parameters():
            fp = self._fsdp.get(name)
            if fp is None or not isinstance(p, DTensor):
                problems.append(f"parameter {name!r} is not managed by fully_shard (a {type(p.data).__name__}); "
                                f"fully_shard the module that owns it or give layouts by hand")
                continue
            if fp.sharded_state.name != "SHARDED":  # (ShardedState moved between torch versions)
                problems.append(f"parameter {name!r} is in FSDP state {fp.sharded_state.name}, not SHARDED")
                continue
            if fp.fsdp_placement.dim != 0 or fp.offload_to_cpu:
                problems.append(f"parameter {name!r}: only Shard(0) without CPU offload is supported, "
                                f"got {fp.fsdp_placement} (offload_to_cpu={fp.offload_to_cpu})")
                continue
            lay = Layout.from_dtensor(p)
            if rank_map is not None:
                missing = [r for r in lay.ranks if r not in rank_map]
                if missing:
                    problems.append(f"rank_map has no entry for device-mesh rank(s) {missing} of {name!r}")
                    continue
                mesh = torch.tensor([rank_map[r] for r in lay.ranks]).reshape(lay.mesh_shape).tolist()
                lay = Layout(lay.shape, mesh, lay.placements, lay.dtype)
            layouts[name] = lay
            shards[name] = p._local_tensor
        if problems:
            raise ValueError("FSDP2Source: " + "; ".join(problems))
        self.layouts: dict[str, Layout] = layouts
        self._shards = shards

    # Mapping protocol: the engine reads the local shards like a {name: tensor} dict.
    def __getitem__(self, name: str) -> torch.Tensor:
        return self._shards[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._shards)

    def __len__(self) -> int:
        return len(self._shards)

    def padded_numel(self, name: str) -> int:
        """Elements the arena must hold for ``name``: FSDP2's padded shard (dim-0 chunks are padded
        to the first chunk's size, which FSDP all-gathers), at least the local shard."""
        return math.prod(self._fsdp[name].padded_sharded_param_size)

    def rebind(self, name: str, block: torch.Tensor) -> torch.Tensor:
        """Move ``name``'s shard into ``block`` (1-D, ``padded_numel(name)`` elements of its dtype,
        contiguous; e.g. an arena view) and make FSDP2 use it from now on. Returns the unpadded
        local shard view (``layout.local_shape(rank)``), which is what a refit reads.

        Called once per parameter at set-up, between training steps."""
        fp = self._fsdp[name]
        local = self._shards[name]
        if block.dim() != 1 or block.numel() != self.padded_numel(name) or block.dtype != local.dtype \
                or not block.is_contiguous():
            raise ValueError(f"rebind({name!r}): block must be a contiguous 1-D {local.dtype} tensor of "
                             f"{self.padded_numel(name)} elements, got {tuple(block.shape)} {block.dtype}")
        block.copy_(fp._sharded_param_data.reshape(-1))  # the one copy (padding included: zeros)
        padded = block.view(fp.padded_sharded_param_size)
        view = padded.narrow(0, 0, local.size(0) if local.numel() > 0 else 0)
        # The optimizer steps sharded_param (its _local_tensor); all-gathers read _sharded_param_data.
        fp._sharded_param_data = block
        fp.sharded_param._local_tensor = view
        self._shards[name] = view
        return view
