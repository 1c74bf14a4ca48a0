"""What travels between hosts, as the engine sends it: one rank's view of the group's host plan joined
from every host's part (:func:`join_host_parts`), and the point-to-point messages (:class:`Message`) of a
host plan (:func:`plan_messages`): transfers back to back in the sender's arena and in the receive
buffer travel as one message."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .boxes import RECV_ALIGN
from .hostplan import CrossTransfer, HostPlan, host_order, new_transfer
from ._gc import gc_paused

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
        # renumbered without dataclasses.replace (a group's join renumbers every host's transfers)
        everything += [new_transfer(t.index + base, t.name, t.src_rank, t.receiver, t.src_host, t.dst_host, t.box,
                                    t.dtype, t.offset, t.nbytes, t.contiguous) for t in transfers.get(h, ())]
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
    for s, n in zip(reversed(box), reversed(shape)):
        off += s.start * stride
        stride *= n
    return off


def plan_messages(hp: HostPlan, src_offsets: Mapping[tuple[int, str], int]) -> tuple[Message, ...]:
    """The messages of ``hp`` given where each source shard lives in its sender's arena.

    Transfers from one sender to one receiver that are back to back both in the sender's arena and
    in the receive buffer travel as one message (a whole arena needed on a host is one message per
    sender and receiver). Sender and receiver derive the same list from the same inputs.
    """
    missing = sorted({(t.src_rank, t.name) for t in hp.transfers} - set(src_offsets))
    if missing:
        raise ValueError(f"plan_messages: src_offsets has no arena offset for (rank, name) {missing[:8]}")
    out: list[Message] = []
    src_layouts = hp.src_layouts
    for t in sorted(hp.transfers, key=lambda t: (t.src_rank, t.receiver, t.offset)):
        lay = src_layouts[t.name]
        src = None
        if t.contiguous:
            src = src_offsets[(t.src_rank, t.name)] + _box_byte_offset(t.box, lay.local_shape(t.src_rank),
                                                                       lay.itemsize)
        last = out[-1] if out else None
        if (last is not None and src is not None and last.src_offset is not None
                and (last.sender, last.receiver) == (t.src_rank, t.receiver)
                and last.src_offset + last.nbytes == src and last.recv_offset + last.nbytes == t.offset):
            out[-1] = Message(last.sender, last.receiver, last.transfers + (t.index,), last.recv_offset,
                              last.nbytes + t.nbytes, last.src_offset)
        else:
            out.append(Message(t.src_rank, t.receiver, (t.index,), t.offset, t.nbytes, src))
    return tuple(out)
