"""Group / membership layer of the refit engine: who is in an epoch, liveness, the one wait.

Who calls what: every process of a refit group (trainers, inference ranks, colocated ranks) builds
one :class:`Group` per *epoch*; the set-up script (:mod:`~tritonreshard.engine.epoch`) exchanges
through it (:meth:`Group.exchange`, :meth:`Group.post` / :meth:`Group.fetch`), hands it the members
(:meth:`Group.admit`) and starts its heartbeats. The publisher, subscriber, sender and relay
register the control blocks and peers they share with the epoch's
:class:`~tritonreshard.engine.liveness.Liveness` and wait only through :meth:`Group.wait`.

Epochs: every key lives under ``trs/<name>/e<epoch>/`` in the store, so a new group (restarted
trainers at ``epoch + 1``) forms on the same store while the old epoch's keys are ignored. A dead
peer ends the epoch: every later wait of this group raises :class:`PeerDiedError` at once, and the
survivors form the next epoch (``RefitInference.rejoin``).

Host identity: a rank's host is ``$TRITONRESHARD_HOST`` if set, else the machine's hostname. Ranks
with different identities never share memory: their bytes cross through the relays (see
:mod:`~tritonreshard.planning.rank`).
"""
from __future__ import annotations

import os
import socket
import threading
import time

import torch.distributed as dist

from .. import _compat
from ..errors import PeerDiedError, RefitError
from ..transport import STATE_ABORT
from ..transport import wait as _wait
from . import rendezvous as rdv
from .liveness import Liveness
from .members import Member

__all__ = ["Group", "host_identity", "machine_identity", "connect", "check_timeout", "HOST_ENV"]

_compat.disarm_process_group_pin()  # before the job may call init_process_group (see there)

HOST_ENV = "TRITONRESHARD_HOST"


def host_identity() -> str:
    """This process's host identity: ``$TRITONRESHARD_HOST`` (simulated hosts), else the hostname."""
    return os.environ.get(HOST_ENV) or socket.gethostname()


def machine_identity() -> str:
    """What this process shares memory with: ``hostname/boot id/device of /dev/shm``. Two processes
    with equal ones read each other's shared memory (one kernel, one /dev/shm); a host identity
    (:func:`host_identity`) claimed by processes with different ones is a wrong host map (one label
    on two machines, or on two containers with a /dev/shm each), refused at hello before any byte
    moves. The hostname comes first so that an error can name the machine."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()[:8]
    except FileNotFoundError:  # not Linux: the hostname and /dev/shm have to do
        boot = "-"
    try:
        shm = os.stat("/dev/shm").st_dev
    except FileNotFoundError:
        shm = "-"
    return f"{socket.gethostname()}/{boot}/{shm}"


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



class Group:
    """One epoch of a refit group, seen from one rank.

    Args:
        base_store: the store shared by the group (see :func:`connect`); keys go under
            ``trs/<name>/e<epoch>/``.
        hosts_store: True if this process hosts ``base_store`` (it then outlives the others' reads).
        rank, world_size: this rank and the number of processes of the group.
        epoch: the group epoch (>= 0).
        timeout: seconds for each set-up step; peer_timeout: seconds without a heartbeat after
            which a peer on another host counts as dead (a local process counts as dead only once
            it exited, noticed at once; one that is alive but silent fails a wait on its timeout).
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

    # ------------------------------------------------------------------ exchange
    def exchange(self, key: str, obj) -> dict:
        """Every rank contributes ``obj``; returns ``{rank: obj}`` (collective)."""
        return {r: o for r, o in enumerate(rdv.all_gather_obj(self.store, key, self.rank, self.world_size,
                                                                obj, timeout=self.timeout))}

    def post(self, key: str, obj) -> None:
        """Write ``obj`` under ``key`` of this epoch, for the ranks that fetch it."""
        rdv.publish(self.store, key, obj)

    def fetch(self, key: str, what: str):
        """Wait (set-up timeout) for ``key`` of this epoch and read it; ``what`` names it in a timeout."""
        return rdv.fetch(self.store, key, timeout=self.timeout, what=what)

    def admit(self, members: dict[int, Member]) -> None:
        """The epoch's members, agreed: liveness can watch them (heartbeats start with
        :meth:`start_heartbeats`)."""
        self.members = dict(members)
        self.liveness = Liveness(self.rank, self.members, self.host, self.peer_timeout, self.store)

    @property
    def hosts(self) -> dict[int, str]:
        """``{rank: host identity}`` of this epoch's members."""
        return {r: m.host for r, m in self.members.items()}

    def start_heartbeats(self) -> None:
        self.liveness.start()

    def outlive_store_readers(self, key: str) -> None:
        """The store's host must not return (and perhaps exit) before every rank published ``key``,
        i.e. read everything it needs from the store. Other ranks return at once."""
        if not self.hosts_store:
            return
        for r in range(self.world_size):
            rdv.fetch(self.store, f"{key}/{r}", timeout=self.timeout, what=f"rank {r} to finish reading the store")

    # ------------------------------------------------------------------ liveness
    def dead_peers(self) -> list[int]:
        """Ranks of this epoch known dead now (no waiting): local processes that exited, and peers
        on other hosts whose heartbeat (the store's counter) stood still for ``peer_timeout``."""
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
                    # Only a relay on this host sets another host's rank: that rank died on the wire, or
                    # its host can no longer be reached (the relay's reason says which).
                    ranks = sorted(r for r, o in self.members.items() if o.host == m.host)
                    err = PeerDiedError(who, f"rank {self.rank}: rank {who} on host {m.host!r} (that host's ranks: "
                                             f"{ranks}) is dead or unreachable, as a relay on this host saw, "
                                             f"while waiting for {what}")
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
            silent = [why for why in map(self.liveness.silence, peers) if why] if self.liveness else []
            extra += "".join(f"; {why}" for why in silent)  # alive, not dead: the wait's own timeout ends it
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

