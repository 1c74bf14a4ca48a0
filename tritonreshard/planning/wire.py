"""What travels between hosts, as the engine sends it: one rank's view of the group's host plan joined
from every host's part (:func:`join_host_parts`), and the point-to-point messages (:class:`Message`) of a
host plan (:func:`plan_messages`): transfers back to back in the sender's arena and in the receive
buffer travel as one message."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ._gc import gc_paused
from .boxes import RECV_ALIGN
from .hostplan import CrossTransfer, HostPlan, host_order, renumbered

__all__ = ["Message", "join_host_parts", "plan_messages"]


@gc_paused
def join_host_parts(part: HostPlan, host: str, transfers: Mapping[str, Sequence[CrossTransfer]], *,
                    align: int = RECV_ALIGN) -> HostPlan:
    """One rank's view of the group's host plan, from its own host's ``part`` (``plan_hosts(...,
    host=host)``, numbered from ``first_index=0``) and every destination host's transfers
    (``{host: that host's part's transfers}``, each numbered from 0, as the hosts' ranks made
    them), renumbered host after host in :func:`host_order`. Equal to the whole host plan in its
    transfers and receive buffers, and in everything on ``host`` (local ops, fan-out, fences,
    receives); the other hosts' local and fan-out ops are not in it."""
    everything: list[CrossTransfer] = []
    shift = 0
    for h in host_order(part.hosts):
        base = len(everything)
        if h == host:
            shift = base
        everything += renumbered(transfers.get(h, ()), base)
    buffers: dict[int, int] = {}
    for t in everything:   # a buffer ends where its last box does, rounded up (as _lay_out_buffers)
        buffers[t.receiver] = max(buffers.get(t.receiver, 0), -(-(t.offset + t.nbytes) // align) * align)
    return part.joined(tuple(everything), buffers, shift)


@dataclass(frozen=True)
class Message:
    """One point-to-point message of a refit: ``sender`` -> ``receiver``, ``nbytes`` bytes landing at
    byte ``recv_offset`` of the receiver's buffer, carrying ``transfers`` (indices, back to back).

    ``src_offset``: byte offset of the bytes in the sender's arena when they are one range there
    (sent straight from the arena); ``None`` when the sender packs its single, non-contiguous box
    first.
    """

    sender: int
    receiver: int
    transfers: tuple[int, ...]
    recv_offset: int
    nbytes: int
    src_offset: int | None


def _box_byte_offset(box: tuple[slice, ...], shape: tuple[int, ...], itemsize: int) -> int:
    off, stride = 0, itemsize
    for s, n in zip(reversed(box), reversed(shape), strict=True):
        off += s.start * stride
        stride *= n
    return off


def plan_messages(hp: HostPlan, src_offsets: Mapping[tuple[int, str], int], *,
                  rank: int | None = None) -> tuple[Message, ...]:
    """The messages of ``hp`` given where each source shard lives in its sender's arena.

    Transfers from one sender to one receiver that are back to back both in the sender's arena and
    in the receive buffer travel as one message (a whole arena needed on a host is one message per
    sender and receiver). Sender and receiver derive the same list from the same inputs.

    ``rank``: only the messages ``rank`` sends or receives (the same messages as in the whole list:
    a message never mixes sender / receiver pairs), for a rank whose joined view holds every host's
    transfers (a trainer's: half a million at Qwen3-235B scale, where it sends a few thousand).
    """
    transfers = hp.transfers if rank is None else [t for t in hp.transfers if rank in (t.src_rank, t.receiver)]
    missing = sorted({(t.src_rank, t.name) for t in transfers} - set(src_offsets))
    if missing:
        raise ValueError(f"plan_messages: src_offsets has no arena offset for (rank, name) {missing[:8]}")
    runs: list[list] = []   # [sender, receiver, transfer indices, recv_offset, nbytes, src_offset]
    src_layouts = hp.src_layouts
    shapes: dict[tuple[str, int], tuple] = {}
    for t in sorted(transfers, key=lambda t: (t.src_rank, t.receiver, t.offset)):
        src = None
        if t.contiguous:
            lay = src_layouts[t.name]
            shape = shapes.get((t.name, t.src_rank))
            if shape is None:
                shape = shapes[(t.name, t.src_rank)] = tuple(lay.local_shape(t.src_rank))
            src = src_offsets[(t.src_rank, t.name)] + _box_byte_offset(t.box, shape, lay.itemsize)
        last = runs[-1] if runs else None
        if (last is not None and src is not None and last[5] is not None
                and last[0] == t.src_rank and last[1] == t.receiver
                and last[5] + last[4] == src and last[3] + last[4] == t.offset):
            last[2].append(t.index)
            last[4] += t.nbytes
        else:
            runs.append([t.src_rank, t.receiver, [t.index], t.offset, t.nbytes, src])
    return tuple(Message(s, r, tuple(ix), ro, nb, so) for s, r, ix, ro, nb, so in runs)
