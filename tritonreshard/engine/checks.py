"""An endpoint's arguments and local tensors, checked before the rank joins its group.

Problems found here travel in the rank's hello, so every rank of the group raises the same one
``ValueError`` (arguments that make joining impossible raise at once). The shards themselves are
checked by :func:`~tritonreshard.execute.check_shard`, as ``execute_local``'s inputs are.
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, replace

import torch

from ..execute import check_shard
from ..layout import Layout, Part
from ..planning import BlockQuant
from . import fsdp as _fsdp

__all__ = ["DestinationData", "LocalInputs", "SourceData", "argument_problems", "default_rank", "fsdp_source",
           "local_destinations", "local_inputs", "local_parts", "local_sources", "short"]


def short(obj, limit: int = 120) -> str:
    """``repr(obj)``, cut at ``limit`` characters (for messages)."""
    text = repr(obj)
    return text if len(text) <= limit else text[:limit] + "..."


def argument_problems(rank, world_size, src: SourceData | None, dst: DestinationData | None) -> list[str]:
    """Problems that make joining a group impossible (raised at once, not sent in the hello):
    ``rank`` / ``world_size`` as the launcher's defaults and the membership resolved them, and the
    sides' data. The configs (meeting, timeouts, pull options, membership, codec) checked their own
    values when they were made."""
    bad = []
    if not isinstance(world_size, int) or world_size < 1:
        bad.append(f"world_size must be a positive int (trs.Meeting(world_size=) or $WORLD_SIZE), "
                   f"got world_size={world_size!r}")
    elif not isinstance(rank, int) or not 0 <= rank < world_size:
        bad.append(f"rank must be in [0, {world_size}), got rank={rank!r}")
    if src is None and dst is None:
        bad.append("give a source (trainer side), a destination (inference side) or both")
    if src is not None and src.tensors is None:
        bad.append("the trainer side needs its tensors, got tensors=None")
    if src is not None and src.layouts is None:
        bad.append("the trainer side needs its layouts (only a fully_shard model brings its own), got layouts=None")
    v = src.start_version if src is not None else 0
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        bad.append(f"start_version must be an int >= 0, got start_version={v!r}")
    if dst is not None and dst.layouts is None:
        bad.append("the inference side needs its layouts, got layouts=None" + (
            f" (parts describe destinations: give them with the layouts, got parts={short(dst.parts)})"
            if dst.parts is not None else ""))
    return bad


def local_sources(rank: int, tensors, layouts) -> tuple[dict, list[str]]:
    """This rank's source shards ``{name: tensor}`` and every problem with them (checked like
    ``execute_local``'s inputs)."""
    if layouts is None:
        return {}, []
    if not isinstance(tensors, Mapping) or not isinstance(layouts, Mapping):
        return {}, [f"src_tensors and src_layouts must be mappings name -> tensor / Layout, got "
                    f"{type(tensors).__name__} and {type(layouts).__name__}"]
    problems, devices, mine = [], set(), {}
    for name, lay in layouts.items():
        if not isinstance(lay, Layout):
            problems.append(f"src_layouts[{name!r}] is {type(lay).__name__}, not a trs.Layout")
            continue
        holds = rank in lay.ranks
        t = tensors.get(name)
        if t is None:
            if holds:
                problems.append(f"src_tensors has no {name!r}, but src_layouts[{name!r}]={lay} places "
                                f"a shard of shape {lay.local_shape(rank)} on rank {rank}")
            continue
        if not holds:
            problems.append(f"src_tensors[{name!r}] is given but src_layouts[{name!r}]={lay} does not "
                            f"place it on rank {rank}")
            continue
        device = check_shard(f"src_tensors[{name!r}]", t, lay, rank, problems, of=f"src_layouts[{name!r}]")
        if device is not None:
            devices.add(device)
            mine[name] = t
    extra = sorted(set(tensors) - set(layouts))
    if extra:
        problems.append(f"src_tensors has names without a layout in src_layouts: {extra}")
    if len(devices) > 1:
        problems.append(f"src_tensors live on several devices {sorted(map(str, devices))}; one arena "
                        f"per rank needs them on one device")
    return mine, problems


def local_destinations(rank: int, tensors, layouts, device):
    """This rank's given destination tensors, their device, and every problem with them."""
    if layouts is None:
        return {}, torch.device(device) if device is not None else torch.device("cpu"), []
    if not isinstance(layouts, Mapping):
        return {}, torch.device("cpu"), [f"dst_layouts must be a mapping, got {type(layouts).__name__}"]
    tensors = {} if tensors is None else tensors
    if not isinstance(tensors, Mapping):
        return {}, torch.device("cpu"), [f"dst_tensors must be a mapping, got {type(tensors).__name__}"]
    if device is None:
        given = {t.device for t in tensors.values() if isinstance(t, torch.Tensor)}
        device = next(iter(given)) if len(given) == 1 else torch.device("cpu")
    device = torch.device(device)
    if device.type not in ("cpu", "cuda"):
        return {}, torch.device("cpu"), [f"device must be cpu or cuda, got device={str(device)!r} (from "
                                         f"the argument or the dst_tensors' device)"]
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    problems, out = [], {}
    for name, lay in layouts.items():
        if not isinstance(lay, Layout):
            problems.append(f"dst_layouts[{name!r}] is {type(lay).__name__}, not a trs.Layout")
            continue
        t = tensors.get(name)
        if rank not in lay.ranks or t is None:
            continue
        if check_shard(f"dst_tensors[{name!r}]", t, lay, rank, problems, of=f"dst_layouts[{name!r}]",
                       device=device, writable=True) is not None:
            out[name] = t
    extra = sorted(set(tensors) - set(layouts))
    if extra:
        problems.append(f"dst_tensors has names without a layout in dst_layouts: {extra}")
    return out, device, problems


def local_parts(parts) -> tuple[dict, list[str]]:
    """``parts`` as ``{dst name: (Part, ...)}`` (plain data: it travels in the rank's hello and is
    compared with the other inference ranks'), and the problems found. Boxes are checked against
    the layouts by ``plan_reshard`` when the group meets."""
    if parts is None:
        return {}, []
    if not isinstance(parts, Mapping):
        return {}, [f"parts must be a mapping dst name -> [trs.Part, ...], got {type(parts).__name__} "
                    f"(parts={short(parts)})"]
    out, problems = {}, []
    for name, ps in parts.items():
        if isinstance(ps, (Part, str, bytes)) or not isinstance(ps, (list, tuple)) or not all(
                isinstance(p, Part) for p in ps):
            problems.append(f"parts[{name!r}] must be a list of trs.Part, got {short(ps)}")
            continue
        out[name] = tuple(ps)
    return out, problems


def default_rank(rank, world_size):
    """``rank`` / ``world_size`` given, else torch.distributed's (if initialised), else the
    launcher's ``$RANK`` / ``$WORLD_SIZE`` (torchrun sets them)."""
    dist = torch.distributed
    if rank is None:
        if dist.is_available() and dist.is_initialized():
            rank = dist.get_rank()
        elif os.environ.get("RANK", "").isdigit():
            rank = int(os.environ["RANK"])
    if world_size is None:
        if dist.is_available() and dist.is_initialized():
            world_size = dist.get_world_size()
        elif os.environ.get("WORLD_SIZE", "").isdigit():
            world_size = int(os.environ["WORLD_SIZE"])
    return rank, world_size


@dataclass(frozen=True)
class SourceData:
    """A trainer side's data (``trs.SourceData``, the ``source=`` of a colocated
    :class:`~tritonreshard.RefitEndpoint`; :class:`~tritonreshard.RefitTrainer` takes the same as
    its arguments): ``tensors``, this rank's shards (``{name: tensor}``, an ``nn.Module`` or a
    ``fully_shard`` FSDP2 model, which brings its layouts); ``layouts``, the trainer group's global
    layouts ``{name: Layout}`` (None with an FSDP2 model); ``start_version``, the version before its
    first ``publish()``; ``adopt``: a dict's plain tensors are re-pointed at the arena too, each
    right after its copy, as parameters are (not a view of another tensor, nor a second name of
    one), so the caller's storage goes as the arena fills. Checked (the shards against the layouts
    too) when the rank joins."""

    tensors: object
    layouts: object = None
    start_version: int = 0
    adopt: bool = False


@dataclass(frozen=True)
class DestinationData:
    """An inference side's data (``trs.DestinationData``, the ``destination=`` of a colocated
    :class:`~tritonreshard.RefitEndpoint`; :class:`~tritonreshard.RefitInference` takes the same as
    its arguments): the inference group's global ``layouts``, optional ``tensors`` to write,
    ``parts`` and block-FP8 ``quant``. Checked against each other when the rank joins."""

    layouts: object
    tensors: object = None
    parts: object = None
    quant: object = None


def fsdp_source(src: SourceData | None) -> tuple[SourceData | None, object]:
    """A fully_shard model brings its layouts, and FSDP2 keeps training on the arena (see fsdp):
    ``src`` with its tensors as an FSDP2 source, and that source (None for other tensors)."""
    if src is None:
        return None, None
    tensors = src.tensors
    if isinstance(tensors, torch.nn.Module) and _fsdp.is_fsdp2(tensors):
        tensors = _fsdp.FSDP2Source(tensors)
    if not isinstance(tensors, _fsdp.FSDP2Source):  # (also one built with a rank_map)
        return src, None
    return replace(src, tensors=tensors, layouts=tensors.layouts if src.layouts is None else src.layouts), tensors


@dataclass(frozen=True)
class LocalInputs:
    """A rank's checked local inputs: its source shards and the parameters to re-point at the
    arena, its destination tensors and device, parts and quantization as they travel in its hello,
    and every problem found (they travel in the hello too)."""

    src: dict
    params: dict
    dst: dict
    dst_device: torch.device
    parts: dict | None
    quant: dict | None
    problems: list


def local_inputs(rank: int, src: SourceData | None, dst: DestinationData | None, device) -> LocalInputs:
    tensors, params = (src.tensors if src is not None else None), {}
    if isinstance(tensors, torch.nn.Module):  # its parameters are re-pointed at the arena
        params = dict(tensors.named_parameters())
        tensors = {n: p.data for n, p in params.items()}
    elif isinstance(tensors, Mapping):  # an optimizer steps these objects: re-pointed too, or its steps are lost
        params = {n: t for n, t in tensors.items() if isinstance(t, torch.nn.Parameter) or (
            isinstance(t, torch.Tensor) and t.is_leaf and t.requires_grad)}
        if src.adopt:  # the other tensors too, once each; a view would free nothing and lose its base
            seen = {id(t) for t in params.values()}
            for n, t in tensors.items():
                if isinstance(t, torch.Tensor) and t._base is None and id(t) not in seen:
                    params[n] = t
                    seen.add(id(t))
    src_map, problems = local_sources(rank, tensors, src.layouts if src is not None else None)
    dst_map, dst_device, more = local_destinations(rank, dst.tensors if dst is not None else None,
                                                   dst.layouts if dst is not None else None, device)
    problems += more
    if dst is None:
        return LocalInputs(src_map, params, dst_map, dst_device, None, None, problems)
    parts, more = local_parts(dst.parts)
    problems += more
    quant = dst.quant
    if quant is not None and (not isinstance(quant, dict) or not all(
            isinstance(k, str) and isinstance(v, BlockQuant) for k, v in quant.items())):
        problems.append(f"quant must be a dict name -> trs.planning.BlockQuant, got {short(quant)}")
        quant = None
    return LocalInputs(src_map, params, dst_map, dst_device, parts, dict(quant or {}), problems)
