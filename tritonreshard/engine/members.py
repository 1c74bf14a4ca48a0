"""Who joins a group epoch, and whether they agree: every rank's :class:`Member` and its checks.

A rank's hello (:func:`hello`) is slim: its digests, group size, host and device, not its layouts.
The full planning inputs travel once per side (:func:`inputs_wanted`: from that side's first rank,
and from any rank whose digests differ, so the error can name what differs);
:func:`validate_members` then checks the whole group, without planning, and every rank raises the
same ``ValueError`` (:func:`group_error`) naming every problem.
"""
from __future__ import annotations

import hashlib
import operator
from dataclasses import dataclass, replace

from ..layout import Layout
from ..planning import BlockQuant
from ..transport import Codec, Delta, Dense
from . import rendezvous as rdv

__all__ = ["GroupInputs", "Member", "device_problems", "group_error", "hello", "input_differences", "inputs_digest",
           "inputs_wanted", "machine_problems", "side_inputs", "validate_members", "with_inputs"]


@dataclass(frozen=True)
class Member:
    """What a rank tells the group when it joins an epoch (no handles yet)."""

    rank: int
    pid: int
    host: str
    device: str
    src_layouts: dict | None = None
    dst_layouts: dict | None = None
    problems: tuple[str, ...] = ()
    #: Destination side: ``{dst name: (Part, ...)}`` (``plan_reshard``'s ``parts=``); ``{}`` for none.
    dst_parts: dict | None = None
    #: Destination side: ``{weight name: BlockQuant}`` of block-FP8 weights (``plan_quantized``'s ``quant=``).
    dst_quant: dict | None = None
    #: Filled in by :func:`hello`: the group size this rank was given and the digests of the
    #: planning inputs it brings (:func:`inputs_digest`; "" for a side it does not hold).
    world_size: int = 0
    src_digest: str = ""
    dst_digest: str = ""
    #: Digest of ``dst_quant`` (compared on its own: a quantization mismatch is named as such).
    quant_digest: str = ""
    #: How this rank's cross-host messages travel (every rank the same): ``Dense()`` or ``Delta(...)``.
    codec: Codec = Delta()
    #: What this rank shares memory with (:func:`~tritonreshard.engine.group.machine_identity`):
    #: ranks of one ``host`` must have the same ("" where unknown: not compared).
    machine: str = ""
    #: Trainer side: the version before its first ``publish()`` (every trainer of an epoch the same).
    start_version: int = 0

    def __repr__(self):
        roles = [r for r, on in (("trainer", self.src_layouts is not None),
                                 ("inference", self.dst_layouts is not None)) if on]
        return f"Member(rank={self.rank}, pid={self.pid}, host={self.host!r}, {'+'.join(roles)}, {self.device})"


rdv.register_plain(Member, BlockQuant, Dense, Delta)  # they travel through the store in each rank's hello


def inputs_digest(layouts: dict | None, parts: dict | None = None) -> str:
    """A digest of one side's planning inputs (layouts, and parts on the destination side): equal
    digests mean equal inputs, so ranks that each plan only their own part of the group's plan
    (``plan_reshard(..., rank=)``) provably plan from the same inputs. "" for a side not held.
    ``repr`` of a Layout / Part is exact (shape, mesh, placements, dtype)."""
    if layouts is None:
        return ""
    h = hashlib.sha256()
    for name in sorted(layouts):
        h.update(f"{name!r}={layouts[name]!r};".encode())
    for name in sorted(parts or {}):
        p = parts[name]
        h.update(f"parts {name!r}={tuple(p) if isinstance(p, list) else p!r};".encode())
    return h.hexdigest()


def _desc(layout) -> str:
    return "missing" if layout is None else str(layout) + f" {tuple(layout.shape)} {layout.dtype}"


def _parts_desc(parts) -> str:
    return "missing" if parts is None else "[" + ", ".join(map(str, parts)) + "]"


def _disagreements(holders: list[Member], get, label: str, describe, rule: str) -> list[str]:
    """One problem per (rank, name) where ``get(rank's member)`` differs from the first holder's."""
    ref, ref_map = holders[0], get(holders[0]) or {}
    out = []
    for m in holders[1:]:
        other = get(m) or {}
        for name in sorted(set(ref_map) | set(other)):
            a, b = ref_map.get(name), other.get(name)
            if a != b:
                out.append(f"rank {m.rank} joined with {label}[{name!r}]={describe(b)} but rank "
                           f"{ref.rank} has {describe(a)}: {rule}")
    return out


@dataclass(frozen=True)
class GroupInputs:
    """What every rank of an epoch agreed on (:func:`validate_members`): the planning inputs of
    :func:`~tritonreshard.planning.plan_rank` and the host map."""

    src_layouts: dict
    dst_layouts: dict
    parts: dict
    quant: dict
    hosts: dict


def group_error(world_size: int, problems) -> ValueError:
    """The one ``ValueError`` of a group that cannot refit, naming every problem (the same text on
    every rank, since every rank derives it from the same members)."""
    return ValueError(f"refit group {world_size} ranks: {len(problems)} problem(s), nothing was moved:\n  - "
                      + "\n  - ".join(problems))


def validate_members(members: list[Member], world_size: int, sides: tuple[str, ...] = ("src", "dst")) -> GroupInputs:
    """Check every rank's :class:`Member` (with its planning inputs) against the others; returns the
    agreed :class:`GroupInputs` or raises one ``ValueError`` listing every problem (each rank
    computes the same, so every rank raises the same). Plans nothing: the planner's own problems
    come from :func:`~tritonreshard.planning.plan_rank`.

    Ranks agree when their digests (:func:`inputs_digest`) and group sizes agree; the destination
    side's ``dst_parts`` and ``dst_quant`` are compared like its layouts. ``sides``: the sides the
    group must have (an elastic group's trainers meet without inference ranks: ``("src",)``)."""
    problems = [f"rank {m.rank}: {p}" for m in members for p in m.problems]
    sizes = {m.rank: m.world_size for m in members if m.world_size != world_size}
    if sizes:
        problems.append(f"rank(s) {sorted(sizes)} joined with world_size {sorted(set(sizes.values()))} but "
                        f"this group has {world_size} ranks: every rank must pass the same world_size")
    layouts = {}
    parts = quant = None
    for side in ("src", "dst"):
        holders = [m for m in members if getattr(m, f"{side}_layouts") is not None]
        role = "trainer" if side == "src" else "inference"
        if not holders:
            if side in sides:
                problems.append(f"no rank joined with {side}_layouts (no {role} side)")
            else:
                layouts[side] = {}
            continue
        ref_layouts = getattr(holders[0], f"{side}_layouts")
        if side == "dst":
            parts = holders[0].dst_parts or {}
        ref_digest = getattr(holders[0], f"{side}_digest")
        odd = [m for m in holders if getattr(m, f"{side}_digest") != ref_digest]
        if odd:  # say what differs, naming the layouts or parts (the digests alone say that something does)
            found = _disagreements([holders[0], *odd], operator.attrgetter(f"{side}_layouts"), f"{side}_layouts",
                                   _desc, f"every {role} rank must pass the same layouts")
            if side == "dst":
                found += _disagreements([holders[0], *odd], lambda m: m.dst_parts, "parts", _parts_desc,
                                        "every inference rank must pass the same parts")
            problems += found or [f"rank(s) {[m.rank for m in odd]} joined with {side} inputs of another digest "
                                  f"than rank {holders[0].rank}'s ({ref_digest[:12]}): every {role} rank must "
                                  f"pass the same layouts and parts"]
        if side == "dst":
            problems += _disagreements(holders, lambda m: m.dst_quant, "quant", repr,
                                       "every inference rank must pass the same quantization")
            quant = holders[0].dst_quant or {}
        ranks = {m.rank for m in holders}
        for name, lay in ref_layouts.items():
            if isinstance(lay, Layout):
                missing = sorted(set(lay.ranks) - ranks)
                if missing:
                    problems.append(f"{side}_layouts[{name!r}]={lay} places shards on rank(s) "
                                    f"{missing}, which did not join as {role} ranks")
        layouts[side] = ref_layouts
    odd = {m.rank: m.codec for m in members if m.codec != members[0].codec} if members else {}
    if odd:
        problems.append(f"rank(s) {sorted(odd)} joined with codec {sorted(set(map(repr, odd.values())))} but "
                        f"rank {members[0].rank} has {members[0].codec!r}: every rank must pass the same codec= "
                        f"(delta= / delta_anchor=)")
    problems += _start_problems([m for m in members if m.src_layouts is not None])
    hosts = {m.rank: m.host for m in members}
    problems += machine_problems(members)
    if problems:
        raise group_error(world_size, problems)
    return GroupInputs(layouts["src"], layouts["dst"], parts or {}, quant or {}, hosts)


def _start_problems(trainers: list[Member]) -> list[str]:
    """Trainers that start from different versions: their readers would wait for a version common
    to all their sources that never comes, or serve tensors of two versions side by side."""
    starts: dict[int, list[int]] = {}
    for m in trainers:
        starts.setdefault(m.start_version, []).append(m.rank)
    if len(starts) < 2:
        return []
    said = ", ".join(f"rank(s) {sorted(rs)} start_version={v}" for v, rs in sorted(starts.items()))
    return [f"the trainers start from different versions ({said}): every trainer of an epoch passes the same "
            f"start_version (after a partition or a restart: the newest version any of them published)"]


def machine_problems(members: list[Member]) -> list[str]:
    """Ranks that claim one host but share no memory (a wrong host map): one problem per such host,
    naming each machine and its ranks. Ranks of one host map each other's arenas by name or by fd; on
    two machines (or two containers with a /dev/shm each) that would fail deep in a transfer, or
    worse, so it is refused at hello."""
    out = []
    by_host: dict[str, dict[str, list[int]]] = {}
    for m in members:
        if m.machine:
            by_host.setdefault(m.host, {}).setdefault(m.machine, []).append(m.rank)
    for host, machines in sorted(by_host.items()):
        if len(machines) > 1:
            where = "; ".join(f"rank(s) {sorted(rs)} on machine {mach.split('/')[0]!r} ({mach})"
                              for mach, rs in sorted(machines.items(), key=lambda kv: min(kv[1])))
            out.append(f"host {host!r} is claimed by ranks that share no memory: {where}. Ranks of one host "
                       f"map each other's shared memory, so one host identity ($TRITONRESHARD_HOST, else the "
                       f"hostname) must not name two machines or two /dev/shm; give each its own")
    return out


def input_differences(ref: Member, other: Member, who: str) -> list[str]:
    """What ``other``'s destination inputs (layouts, parts, quantization) differ in from ``ref``'s,
    one problem per name (an elastic group's joiner against the replicas already in)."""
    rule = "every replica must bring the same layouts, dtypes, parts and quantization"
    out = []
    for label, get, describe in (("dst_layouts", lambda m: m.dst_layouts, _desc),
                                 ("parts", lambda m: m.dst_parts, _parts_desc),
                                 ("quant", lambda m: m.dst_quant, repr)):
        out += [p.replace(f"rank {other.rank} joined", f"{who} joined").replace(f"rank {ref.rank} has", "the group has")
                for p in _disagreements([ref, other], get, label, describe, rule)]
    return out


def device_problems(members: list[Member]) -> list[str]:
    """A group whose plan spans hosts (``RankPlan.several_hosts``) must use one kind of device: one
    point-to-point process group carries the cross-host bytes, gloo or NCCL, not both."""
    kinds = {m.rank: m.device.split(":")[0] for m in members}
    if len(set(kinds.values())) > 1:
        return [f"ranks on several hosts must all use cuda or all use cpu (the cross-host transfers run "
                f"over one NCCL or gloo group), got devices {kinds}"]
    return []


def _quant_digest(quant: dict | None) -> str:
    if quant is None:
        return ""
    return hashlib.sha256("".join(f"{n!r}={quant[n]!r};" for n in sorted(quant)).encode()).hexdigest()


def side_inputs(member: Member, side: str) -> tuple:
    if side == "src":
        return (member.src_layouts,)
    return (member.dst_layouts, member.dst_parts, member.dst_quant)


def inputs_wanted(hellos: list[Member]) -> list[tuple[str, int]]:
    """``(side, rank)`` whose full planning inputs the group fetches: each side's first rank, and
    any rank whose digests differ from it (every rank derives the same list from the hellos)."""
    out = []
    for side in ("src", "dst"):
        holders = [m for m in hellos if getattr(m, f"{side}_layouts") is not None]
        if not holders:
            continue
        key = (lambda m: (m.src_digest,)) if side == "src" else (lambda m: (m.dst_digest, m.quant_digest))
        out += [(side, m.rank) for m in holders if m is holders[0] or key(m) != key(holders[0])]
    return out


def with_inputs(hellos: list[Member], inputs: dict) -> list[Member]:
    """The hellos with their planning inputs: fetched ones as sent, the others the side's first
    rank's (their digests are equal to it)."""
    out = []
    for m in hellos:
        for side in ("src", "dst"):
            if getattr(m, f"{side}_layouts") is None:
                continue
            first = next(r for s, r in inputs if s == side)
            got = inputs.get((side, m.rank), inputs[(side, first)])
            if side == "src":
                m = replace(m, src_layouts=got[0])
            else:
                m = replace(m, dst_layouts=got[0], dst_parts=got[1], dst_quant=got[2])
        out.append(m)
    return out


def hello(member: Member, world_size: int) -> tuple[Member, Member]:
    """``member`` with its digests and group size, and the slim hello it sends (its layouts,
    parts and quantization left out: they travel once per side, see :func:`inputs_wanted`)."""
    member = replace(member, world_size=world_size, src_digest=inputs_digest(member.src_layouts),
                     dst_digest=inputs_digest(member.dst_layouts, member.dst_parts),
                     quant_digest=_quant_digest(member.dst_quant))
    slim = replace(member, src_layouts=None if member.src_layouts is None else {},
                   dst_layouts=None if member.dst_layouts is None else {}, dst_parts=None, dst_quant=None)
    return member, slim
