"""Transport layer: shared buffers ("arenas") behind one small protocol.

Owner side (one arena per rank holding all its local shards)::

    arena = create_arena(nbytes, device, secret=group_secret)   # cpu -> shared memory, cuda -> VMM/IPC
    w = arena.tensor(offset, shape, dtype)                       # view, no copy
    handle = arena.export()                                      # small, picklable, no secret inside
    ...publish handle through the store; wait until every peer reports it mapped...
    arena.unlink()                                               # no new peers from here on
    arena.close()

Peer side::

    peer = open_arena(handle, secret=group_secret)               # maps the owner's arena
    src = peer.tensor(offset, shape, dtype)
    peer.close()

Lifetimes: ``close()`` is idempotent and safe in ``finally``; views keep the mapping alive and it
is released when the last view is dropped (see ``_base``). A survivor removes a dead owner's
named segment with ``unlink_segment(handle)``; fd-passed arenas have no name to leak.
"""
from __future__ import annotations

import torch

from ._base import ALIGN, SHM_PREFIX, Arena, ArenaHandle, align_up, pack_offsets
from ._control import STATE_ABORT, STATE_CLOSED, STATE_OK, ControlBlock, create_control_block, open_control_block
from ._dist import CrossHostCopy, DistLink, LinkError, PendingExchange
from ._shm import ShmArena, unlink_segment
from .codec import DELTA_MODES, Codec, Delta, Dense, LinkModel, codec_for, delta_problems

__all__ = [
    "CrossHostCopy", "DistLink", "LinkError", "PendingExchange", "Codec", "Dense", "Delta", "codec_for",
    "DELTA_MODES", "LinkModel", "delta_problems",
    "ALIGN", "SHM_PREFIX", "Arena", "ArenaHandle", "ControlBlock", "STATE_ABORT", "STATE_CLOSED",
    "STATE_OK", "align_up", "create_arena", "create_control_block", "open_arena",
    "open_control_block", "pack_offsets", "unlink_segment",
]


def create_arena(nbytes: int, device: torch.device | str = "cpu", *, secret=None,
                 expected_peers: int | None = None, cuda_mode: str = "auto") -> Arena:
    """Owner: allocate an exportable arena of ``nbytes`` bytes on ``device``.

    * ``device`` cpu: POSIX shared memory. With ``secret`` (the group secret, bytes or
      ``GroupSecret``) the memory is an anonymous memfd passed to peers over an authenticated Unix
      socket (kind ``shm-fd``); without it, a mode-0600 ``/dev/shm/trs-<random>`` entry (``shm-name``).
    * ``device`` cuda[:N]: device memory exported via VMM POSIX fds (``cuda_mode='vmm'``) or legacy
      CUDA IPC (``'ipc'``); ``'auto'`` picks VMM where the device supports it. Needs ``secret``.
    * ``expected_peers``: for the fd-passing kinds, stop serving after that many peers mapped it
      (equivalent to calling ``unlink()`` then). ``None``: serve until ``unlink()``/``close()``.

    Memory contents are not initialised.
    """
    device = torch.device(device)
    if device.type == "cpu":
        return ShmArena.create(nbytes, secret=secret, expected_peers=expected_peers)
    if device.type == "cuda":
        from ._cuda import CudaArena  # lazy: the CUDA transport needs cuda-python (CUDA machines only)
        if secret is None:
            raise ValueError("create_arena: CUDA arenas are handed out over the authenticated fd "
                             "server and need secret= (the group secret)")
        return CudaArena.create(nbytes, device, secret=secret, expected_peers=expected_peers,
                                mode=cuda_mode)
    raise NotImplementedError(f"create_arena: no transport for device={str(device)!r} yet")


def open_arena(handle: ArenaHandle, *, secret=None, device: torch.device | str | None = None,
               timeout: float = 10.0) -> Arena:
    """Peer: map the arena described by ``handle`` (from the owner's ``export()``).

    ``secret`` is required for the fd-passing kinds (``shm-fd``, ``cuda-*``). ``device`` (CUDA
    only) is the local device that will access the memory (default: the current device).
    ``timeout`` bounds the exchange with the owner's fd server.
    """
    if not isinstance(handle, ArenaHandle):
        raise ValueError(f"open_arena: handle must be an ArenaHandle, got {type(handle).__name__}")
    if handle.kind.startswith("shm-"):
        return ShmArena.open(handle, secret=secret, timeout=timeout)
    from ._cuda import CudaArena  # lazy: the CUDA transport needs cuda-python (CUDA machines only)
    if secret is None:
        raise ValueError(f"open_arena: {handle!r} needs secret= (the group secret)")
    return CudaArena.open(handle, secret=secret,
                          device=None if device is None else torch.device(device), timeout=timeout)
