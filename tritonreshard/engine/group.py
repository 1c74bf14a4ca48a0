"""Group / membership layer of the refit engine: rendezvous, validation, liveness, the one wait.

Who calls what: every process of a refit group (trainers, inference ranks, colocated ranks) builds
one :class:`Group` per *epoch* and calls, in this order, ``join`` (roles and layouts -> the plan,
validated identically on every rank), ``exchange("exports", ...)`` (arena handles), and
``finish_setup`` (everyone mapped what it needs; heartbeats start). The publisher, subscriber and
relay register the control blocks and peers they share with the epoch's
:class:`~tritonreshard.engine.liveness.Liveness` and wait only through :meth:`Group.wait`.

Epochs: every key lives under ``trs/<name>/e<epoch>/`` in the store, so a new group (restarted
trainers at ``epoch + 1``) forms on the same store while the old epoch's keys are ignored. A dead
peer ends the epoch: every later wait of this group raises :class:`PeerDiedError` at once, and the
survivors form the next epoch (``RefitInference.rejoin``).

Host identity: a rank's host is ``$TRITONRESHARD_HOST`` if set, else the machine's hostname. Ranks
with different identities never share memory: their bytes cross through the relay (see
:mod:`~tritonreshard.engine.route`).
"""
from __future__ import annotations

import hashlib
import os
import socket
import threading
import time
from dataclasses import dataclass, replace

import torch.distributed as dist

if dist.is_available() and not dist.is_initialized():
    # torch.distributed.nn's functions take ``group.WORLD`` as a default argument, evaluated when
    # the module is first imported. Imported after init_process_group (torch.optim's first step
    # and torch._dynamo import it), they keep the job's process group, and its gloo threads, alive
    # past destroy_process_group; those threads then release tensors during interpreter shutdown
    # and abort the process ("terminate called without an active exception"). Imported now, the
    # defaults are None. Not imported when a group already exists: that would pin it.
    import torch.distributed.nn  # noqa: F401

from ..errors import PeerDiedError, RefitError
from . import rendezvous as rdv
from .liveness import Liveness
from ..transport import wait as _wait
from ..layout import Layout
from ..planning import BlockQuant, Plan, QuantizedPlan, merge_plans, plan_quantized
from ..transport import STATE_ABORT

__all__ = ["Group", "Member", "host_identity", "connect", "inputs_digest",
           "HOST_ENV"]

HOST_ENV = "TRITONRESHARD_HOST"


def host_identity() -> str:
    """This process's host identity: ``$TRITONRESHARD_HOST`` (simulated hosts), else the hostname."""
    return os.environ.get(HOST_ENV) or socket.gethostname()


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
    #: Filled in by :meth:`Group.join`: the group size this rank was given and the digests of the
    #: planning inputs it brings (:func:`inputs_digest`; "" for a side it does not hold).
    world_size: int = 0
    src_digest: str = ""
    dst_digest: str = ""
    #: Digest of ``dst_quant`` (compared on its own: a quantization mismatch is named as such).
    quant_digest: str = ""

    def __repr__(self):
        roles = [r for r, on in (("trainer", self.src_layouts is not None),
                                 ("inference", self.dst_layouts is not None)) if on]
        return f"Member(rank={self.rank}, pid={self.pid}, host={self.host!r}, {'+'.join(roles)}, {self.device})"


rdv.register_plain(Member, BlockQuant)  # they travel through the store in each rank's hello


def connect(store, *, rank: int, world_size: int, timeout: float, host_store: bool | None):
    """The base store of a refit group, and whether this process hosts it.

    * a ``torch.distributed.Store``: used as is (never hosted by us);
    * ``None``: torch.distributed's default store when a process group is initialised (reuse the
      job's store), else ``MASTER_ADDR``/``MASTER_PORT``, as a client when torchrun's agent hosts
      it (``TORCHELASTIC_USE_AGENT_STORE``), so there is no port clash with the launcher;
    * ``"host:port"``: rank 0 hosts it unless ``host_store=False`` (a driver hosts it, e.g. so the
      store outlives restarted trainers).
    """
    if isinstance(store, dist.Store):
        return store, False
    if store is None:
        if dist.is_available() and dist.is_initialized():
            return dist.distributed_c10d._get_default_store(), False
        agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() in ("1", "true")
        hosts = (rank == 0 and not agent) if host_store is None else bool(host_store)
        return rdv.connect_store(None, world_size=world_size, is_master=hosts, timeout=timeout), hosts
    hosts = rank == 0 if host_store is None else bool(host_store)
    return rdv.connect_store(store, world_size=world_size, is_master=hosts, timeout=timeout), hosts


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


def validate_members(members: list[Member], world_size: int, rank: int | None = None) -> Plan:
    """The group's plan from every rank's :class:`Member`; raises one ``ValueError`` listing every
    problem (each rank computes the same, so every rank raises the same).

    The destination side's ``dst_parts`` (recipes: q/k/v -> qkv, padded vocab, ...) go into
    ``plan_reshard`` with the layouts, so every rank derives the same plan; inference ranks that
    disagree on them are rejected like ranks that disagree on layouts.

    Ranks agree when their digests (:func:`inputs_digest`) and group sizes agree; only then is
    the plan made. With ``rank``, it is ``rank``'s plan only (``plan_reshard(..., rank=)``: the ops
    it reads and serves) on one host; on several hosts, that merged with the per-rank plans of the
    destination ranks on ``rank``'s host (:func:`~tritonreshard.planning.merge_plans`): every op
    into its host, what its host's part of the host plan needs, and never another host's ops."""
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
            problems.append(f"no rank joined with {side}_layouts (no {role} side)")
            continue
        ref_layouts = getattr(holders[0], f"{side}_layouts")
        if side == "dst":
            parts = holders[0].dst_parts or {}
        ref_digest = getattr(holders[0], f"{side}_digest")
        odd = [m for m in holders if getattr(m, f"{side}_digest") != ref_digest]
        if odd:  # say what differs, naming the layouts or parts (the digests alone say that something does)
            found = _disagreements([holders[0], *odd], lambda m: getattr(m, f"{side}_layouts"), f"{side}_layouts",
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
    plan = None
    host = {m.rank: m.host for m in members}
    one_host = len(set(host.values())) == 1
    if not problems:
        try:
            plan = plan_quantized(layouts["src"], layouts["dst"], parts or None, quant or None, rank=rank)
            if rank is not None and not one_host:
                plan = _host_inputs(plan, layouts, parts, quant, host, rank)
        except (ValueError, TypeError) as exc:
            problems.append(str(exc))
    if problems:
        raise ValueError(f"refit group {world_size} ranks: {len(problems)} problem(s), "
                         f"nothing was moved:\n  - " + "\n  - ".join(problems))
    if not one_host:
        # One point-to-point process group carries the cross-host bytes: gloo or NCCL, not both. A
        # rank plans only its host's part, so the rule is the group's, not its own plan's (every
        # rank sees the same members, so every rank raises).
        kinds = {m.rank: m.device.split(":")[0] for m in members}
        if len(set(kinds.values())) > 1:
            raise ValueError(f"refit group {world_size} ranks: ranks on several hosts must all use cuda or all "
                             f"use cpu (the cross-host transfers run over one NCCL or gloo group), got "
                             f"devices {kinds}; nothing was moved")
    return plan


def _host_inputs(own: Plan, layouts: dict, parts, quant, host: dict, rank: int) -> Plan:
    """What rank ``rank`` of a group on several hosts plans from: its own plan merged with the
    per-rank plans of the destination ranks on its host (every op into its host: the input of its
    host's part of the host plan, ``plan_hosts(..., host=)``), never the other hosts' ops. The
    cross-host transfers of the other hosts come from their ranks (:func:`~.route.build_route`)."""
    dst_ranks = sorted({r for lay in layouts["dst"].values() for r in lay.ranks})
    plans = [own] + [plan_quantized(layouts["src"], layouts["dst"], parts or None, quant or None, rank=d)
                     for d in dst_ranks if d != rank and host.get(d) == host[rank]]
    merged = merge_plans(plans)
    return QuantizedPlan(merged, own.dst_layouts, own.quant) if isinstance(own, QuantizedPlan) else merged


def _quant_digest(quant: dict | None) -> str:
    if quant is None:
        return ""
    return hashlib.sha256("".join(f"{n!r}={quant[n]!r};" for n in sorted(quant)).encode()).hexdigest()


def _side_inputs(member: Member, side: str) -> tuple:
    if side == "src":
        return (member.src_layouts,)
    return (member.dst_layouts, member.dst_parts, member.dst_quant)


def _inputs_wanted(hellos: list[Member]) -> list[tuple[str, int]]:
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


def _with_inputs(hellos: list[Member], inputs: dict) -> list[Member]:
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


class Group:
    """One epoch of a refit group, seen from one rank.

    Args:
        base_store: the store shared by the group (see :func:`connect`); keys go under
            ``trs/<name>/e<epoch>/``.
        hosts_store: True if this process hosts ``base_store`` (it then outlives the others' reads).
        rank, world_size: this rank and the number of processes of the group.
        epoch: the group epoch (>= 0).
        timeout: seconds for each set-up step; peer_timeout: seconds without a heartbeat after
            which a peer counts as dead (a local process that is gone is noticed at once).
    """

    def __init__(self, base_store, *, rank: int, world_size: int, epoch: int = 0, name: str = "default",
                 timeout: float = 60.0, peer_timeout: float = 10.0, hosts_store: bool = False):
        self.rank, self.world_size, self.epoch, self.name = rank, world_size, epoch, name
        self.timeout, self.peer_timeout = float(timeout), float(peer_timeout)
        self.base_store, self.hosts_store = base_store, hosts_store
        #: This epoch's namespace in the store: a public seam for applications' own keys.
        self.store = dist.PrefixStore(f"trs/{name}/e{epoch}/", base_store)
        self.secret = rdv.group_secret(self.store, is_master=rank == 0, timeout=self.timeout)
        self.host = host_identity()
        self.members: dict[int, Member] = {}
        #: Who is alive (set up by ``join``; the publisher, subscriber and relay register with it).
        self.liveness: Liveness | None = None
        self.ended: PeerDiedError | None = None
        self._closed = threading.Event()
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ set-up
    def join(self, member: Member) -> Plan:
        """Phase 1: gather every rank's :class:`Member`, validate, return this rank's plan (see
        :func:`validate_members`; every rank raises the same ValueError).

        The hello is slim: every rank sends its digests, group size, host and device, not its
        layouts. The full inputs travel once per side, from that side's first rank (and, only when
        digests disagree, from the ranks that disagree, so the error can name what differs); equal
        digests mean equal inputs, so the others take the first rank's."""
        member = replace(member, world_size=self.world_size,
                         src_digest=inputs_digest(member.src_layouts),
                         dst_digest=inputs_digest(member.dst_layouts, member.dst_parts),
                         quant_digest=_quant_digest(member.dst_quant))
        slim = replace(member, src_layouts=None if member.src_layouts is None else {},
                       dst_layouts=None if member.dst_layouts is None else {}, dst_parts=None, dst_quant=None)
        hellos = rdv.all_gather_obj(self.store, "hello", self.rank, self.world_size, slim, timeout=self.timeout)
        wanted = _inputs_wanted(hellos)
        for side, r in wanted:
            if r == self.rank:
                rdv.publish(self.store, f"inputs/{side}/{r}", _side_inputs(member, side))
        inputs = {(side, r): rdv.fetch(self.store, f"inputs/{side}/{r}", timeout=self.timeout,
                                       what=f"the {side} planning inputs of rank {r}")
                  for side, r in wanted}
        members = _with_inputs(hellos, inputs)
        self.members = {m.rank: m for m in members}
        rdv.publish(self.store, f"hello-read/{self.rank}", True)
        try:
            plan = validate_members(members, self.world_size, self.rank)
        except (ValueError, NotImplementedError):
            self._outlive_store_readers("hello-read")  # so every rank reads the hellos and raises too
            raise
        self.liveness = Liveness(self.rank, self.members, self.host, self.peer_timeout, self.store)
        return plan

    @property
    def hosts(self) -> dict[int, str]:
        """``{rank: host identity}`` of this epoch's members."""
        return {r: m.host for r, m in self.members.items()}

    def exchange(self, key: str, obj) -> dict:
        """Every rank contributes ``obj``; returns ``{rank: obj}``."""
        return {r: o for r, o in enumerate(rdv.all_gather_obj(self.store, key, self.rank, self.world_size,
                                                                obj, timeout=self.timeout))}

    def finish_setup(self) -> None:
        """Last set-up step: everyone mapped what it needs; heartbeats start."""
        self.exchange("mapped", True)
        rdv.publish(self.store, f"setup-done/{self.rank}", True)
        self._outlive_store_readers("setup-done")
        self.liveness.start()

    def _outlive_store_readers(self, key: str) -> None:
        """The store's host must not return (and perhaps exit) before every rank published ``key``,
        i.e. read everything it needs from the store. Other ranks return at once."""
        if not self.hosts_store:
            return
        for r in range(self.world_size):
            rdv.fetch(self.store, f"{key}/{r}", timeout=self.timeout, what=f"rank {r} to finish reading the store")

    # ------------------------------------------------------------------ liveness
    def dead_peers(self) -> list[int]:
        """Ranks of this epoch known dead now (no waiting): local processes that are gone, and peers
        whose heartbeat (shared memory or store) is older than ``peer_timeout``."""
        return [r for r in sorted(self.members) if r != self.rank and self.liveness.dead_reason(r)]

    def check_peers(self, peers, what: str, *, closed_is_gone: bool = True) -> None:
        """Raise PeerDiedError if the epoch ended or one of ``peers`` is dead (ending the epoch)."""
        if self.ended is not None:
            raise PeerDiedError(self.ended.rank, f"rank {self.rank}: epoch {self.epoch} already ended "
                                f"({self.ended}) while waiting for {what}")
        self.raise_if_dead(peers, f"while waiting for {what}", closed_is_gone=closed_is_gone)

    def raise_if_dead(self, peers, when: str, *, closed_is_gone: bool = True) -> None:
        """Raise PeerDiedError naming the first of ``peers`` that is dead, ``when`` saying what this
        rank was doing; a death ends the epoch."""
        for peer in peers:
            reason = self.liveness.dead_reason(peer, closed_is_gone=closed_is_gone)
            if reason:
                err = PeerDiedError(peer, f"rank {self.rank}: {reason} {when}")
                self.end(err)
                raise err

    def check_abort(self, controls, what: str) -> None:
        for c in controls:
            if c.state == STATE_ABORT:
                who = c.abort_rank
                m = self.members.get(who)
                if m is not None and m.host != self.host:
                    # Only a relay on this host sets another host's rank: that rank died on the wire.
                    err = PeerDiedError(who, f"rank {self.rank}: rank {who} on host {m.host!r} died (seen by "
                                             f"a relay on this host) while waiting for {what}")
                    self.end(err)
                    raise err
                raise RefitError(f"rank {self.rank}: the group was aborted ({c.abort_reason()}) "
                                 f"while waiting for {what}")

    def end(self, err: PeerDiedError) -> None:
        """Mark this epoch over (first cause wins): later waits raise at once."""
        with self._lock:
            if self.ended is None:  # a copy without traceback: it must not pin the pull's frames
                self.ended = PeerDiedError(err.rank, str(err))

    # ------------------------------------------------------------------ the one wait
    def wait(self, done, what: str, timeout: float, *, peers=(), controls=(), doorbell=None,
             status=None, cancel: threading.Event | None = None, closed_is_gone: bool = True) -> None:
        """Wait until ``done()``: spin briefly, then sleep on ``doorbell()`` (a futex word that every
        relevant state change rings: a control block's, or a :class:`~tritonreshard.transport.wait.Doorbell`
        rung by the thread that saw a store signal or a transfer complete).

        Raises PeerDiedError if one of ``peers`` died, RefitError if one of ``controls`` carries the
        abort word, the group was closed or ``cancel`` was set, and TimeoutError naming ``what``
        (and ``status()``) after ``timeout`` seconds. ``timeout=0`` checks once: a poll, which fails
        only itself. ``closed_is_gone=False``: a cross-host peer that closed cleanly is not dead
        (waiting for a transfer it already finished).
        """
        def check():
            if self._closed.is_set():
                raise RefitError(f"rank {self.rank}: endpoint closed while waiting for {what}")
            if cancel is not None and cancel.is_set():
                raise RefitError(f"rank {self.rank}: abandoned while waiting for {what}")
            self.check_peers(peers, what, closed_is_gone=closed_is_gone)
            self.check_abort(controls, what)

        if self.ended is not None:  # the epoch is over: nothing of it can be waited for any more
            self.check_peers((), what)
        if not _wait.wait_until(done, doorbell or (lambda: None), time.monotonic() + timeout, check):
            extra = f" ({status()})" if status else ""
            raise TimeoutError(f"rank {self.rank}: timed out after {timeout:g} s waiting for {what}{extra}")

    # ------------------------------------------------------------------ lifetime
    def close(self) -> None:
        """Stop heart-beating and end every wait of this rank (idempotent). Control blocks belong
        to the publisher / subscriber / relay."""
        self._closed.set()
        if self.liveness is not None:
            self.liveness.close()

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    def __repr__(self):
        state = "ended" if self.ended else ("closed" if self._closed.is_set() else "open")
        return f"<Group {self.name!r} epoch {self.epoch} rank {self.rank}/{self.world_size} {state}>"


def check_timeout(what: str, timeout, default: float) -> float:
    """``timeout`` of a call (None: the endpoint's), checked before anything waits."""
    if timeout is None:
        return default
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout >= 0:
        raise ValueError(f"{what}: timeout must be a number of seconds >= 0 (0: check once), got "
                         f"timeout={timeout!r}")
    return float(timeout)

