"""Refit endpoints: trainer ranks publish versions, inference ranks pull them, across processes.

Who calls what::

    # every trainer process (source rank)
    tr = trs.RefitTrainer(tensors, layouts, rank=r, world_size=W, store="127.0.0.1:29600")
    for step in ...:
        tr.fence()            # readers of this rank's arena finished the last version
        optimizer.step()      # on tr.tensors (arena-backed: no copy per step)
        tr.publish()

    # every inference process (destination rank)
    inf = trs.RefitInference(layouts, rank=r, world_size=W, store="127.0.0.1:29600")
    inf.pull()                # or start_pull() ... pull_done() ... swap() in shadow mode
    weights = inf.tensors     # re-read after every swap

Set-up, once: ranks meet in a torch.distributed ``TCPStore`` and exchange roles and layouts; every
rank validates the whole group and derives the same plan, and a bad rank makes *every* rank raise the
same ``ValueError`` before any data moves. Each trainer then places all its local shards in one
exported arena (CPU shared memory, or CUDA memory exported through cuda-python) with a control block
(version, acks, heartbeats); inference ranks map the arenas of the trainers they read from (one
handle per peer, not per tensor) and build their descriptor tables once.

Every refit: the trainer bumps its published version. An inference rank waits until all of its
sources published the same version, runs its descriptor table (one gather-kernel launch per dtype
group on CUDA, torch copies on CPU), checks that no source moved on or died meanwhile, and acks the
version to each source. The trainer's ``fence`` waits for those acks, and only for the ranks that
read its arena.

Guarantees (see also the README):

* shadow mode (default): pulls go to a second buffer set; ``swap()`` installs it with one reference
  assignment. A failed pull leaves the serving weights and ``version`` untouched.
* in-place mode: pulls write the serving tensors. A pull that fails part-way leaves them torn:
  ``consistent`` becomes False (and ``version`` stays at the last complete version) until a later
  pull succeeds.
* every wait has a timeout and names what it waited for; a dead peer (its process gone, or no
  heartbeat for ``peer_timeout`` seconds) raises :class:`PeerDiedError` naming its rank.
"""
from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from . import _fsdp
from . import _rendezvous as rdv
from ._descriptors import DescriptorTable
from .execute import writable_problem
from .layout import Layout
from .plan import Plan, plan_reshard
from .transport import (create_arena, create_control_block, open_arena, open_control_block,
                        pack_offsets)

__all__ = ["RefitEndpoint", "RefitTrainer", "RefitInference", "RefitError", "PeerDiedError"]

_HEARTBEAT_S = 0.2
_LIVENESS_CHECK_S = 0.05


class RefitError(RuntimeError):
    """A refit could not complete (a peer aborted, a source changed weights during a pull, ...)."""


class PeerDiedError(RefitError):
    """A peer process of the refit group is gone. ``rank`` names it."""

    def __init__(self, rank: int, message: str):
        super().__init__(message)
        self.rank = rank


@dataclass(frozen=True)
class _Hello:
    """What a rank tells the group at set-up (phase 1: no handles yet)."""

    rank: int
    pid: int
    host: str
    device: str
    src_layouts: dict | None
    dst_layouts: dict | None
    problems: tuple[str, ...] = ()


@dataclass(frozen=True)
class _Exports:
    """Phase 2: a source rank's arena and control block handles and where each shard lives."""

    rank: int
    arena: object | None
    control: object | None
    offsets: dict = field(default_factory=dict)


def _proc_state(pid: int) -> str | None:
    """One-letter state of a local process, or None when it no longer exists."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return data[data.rfind(b")") + 2:][:1].decode()


def _connect(store, rank: int, world_size: int, timeout: float, group: str):
    if isinstance(store, torch.distributed.Store):
        base = store
    else:
        base = rdv.connect_store(store, world_size=world_size, is_master=rank == 0, timeout=timeout)
    return base, torch.distributed.PrefixStore(f"trs/{group}/", base)


def _timeout_arg(what: str, timeout, default: float) -> float:
    """``timeout`` of a call (None: the endpoint's), checked before anything waits."""
    if timeout is None:
        return default
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout >= 0:
        raise ValueError(f"{what}: timeout must be a number of seconds >= 0 (0: check once), got "
                         f"timeout={timeout!r}")
    return float(timeout)


class RefitEndpoint:
    """One process of a refit group: a source side (trainer), a destination side (inference), or
    both (colocated meshes). Use :class:`RefitTrainer` / :class:`RefitInference` for one role.

    Args:
        rank: this process's global rank (the ranks used in the layouts' meshes).
        world_size: number of processes in the refit group (trainers + inference ranks; a colocated
            process counts once).
        store: ``"host:port"`` of the group's TCPStore (rank 0 hosts it), a ``torch.distributed.Store``,
            or None for ``MASTER_ADDR``/``MASTER_PORT`` from the environment.
        src_tensors: source side: ``{name: local shard}`` or an ``nn.Module`` whose named parameters
            are the local shards. They are copied into the exported arena once; a module's
            parameters are re-pointed at the arena (``param.data``), so training runs on it with no
            copy per step. Shapes must equal ``src_layouts[name].local_shape(rank)``, dtypes match.
        src_layouts: source side: ``{name: Layout}`` of the whole trainer group (same on every trainer).
        dst_layouts: destination side: ``{name: Layout}`` of the whole inference group.
        dst_tensors: destination side, optional: tensors to write (e.g. the engine's parameters);
            the serving buffer set in in-place mode, the first of the two sets in shadow mode.
        mode: ``"shadow"`` (pull into a second buffer set, then ``swap``) or ``"inplace"``.
        device: device of the destination buffers (default: the ``dst_tensors``' device, else cpu).
        backend: ``"triton"`` (compiled on CUDA, interpreter on CPU: for debugging), ``"torch"``
            (torch copies over the same descriptors; fast on CPU) or ``"auto"``.
        timeout: seconds for set-up and for each wait (fence, waiting for a version).
        peer_timeout: seconds without a heartbeat after which a peer counts as dead (a local peer
            whose process is gone is noticed at once).
        group: namespace of this group's keys in the store.
    """

    def __init__(self, *, rank: int, world_size: int, store=None, src_tensors=None, src_layouts=None,
                 dst_layouts=None, dst_tensors=None, mode: str = "shadow", device=None,
                 backend: str = "auto", timeout: float = 60.0, peer_timeout: float = 10.0,
                 group: str = "default"):
        self._closed = True  # until set-up succeeded far enough to need closing (see close())
        # FSDP2 hook (1 of 3; see tritonreshard/_fsdp.py): a fully_shard model brings its layouts.
        if isinstance(src_tensors, torch.nn.Module) and _fsdp.is_fsdp2(src_tensors):
            src_tensors = _fsdp.FSDP2Source(src_tensors)
        self._fsdp2 = src_tensors if isinstance(src_tensors, _fsdp.FSDP2Source) else None
        if self._fsdp2 is not None and src_layouts is None:
            src_layouts = self._fsdp2.layouts
        bad = []
        if not isinstance(world_size, int) or world_size < 1:
            bad.append(f"world_size must be a positive int, got world_size={world_size!r}")
        elif not isinstance(rank, int) or not 0 <= rank < world_size:
            bad.append(f"rank must be in [0, {world_size}), got rank={rank!r}")
        if mode not in ("shadow", "inplace"):
            bad.append(f"mode must be 'shadow' or 'inplace', got mode={mode!r}")
        if backend not in ("auto", "torch", "triton"):
            bad.append(f"backend must be 'auto', 'torch' or 'triton', got backend={backend!r}")
        if src_layouts is None and dst_layouts is None:
            bad.append("give src_layouts (trainer side), dst_layouts (inference side) or both")
        if (src_tensors is None) != (src_layouts is None):
            bad.append("src_tensors and src_layouts go together (the trainer side needs both)")
        if not (isinstance(timeout, (int, float)) and timeout > 0):
            bad.append(f"timeout must be > 0 seconds, got timeout={timeout!r}")
        if not (isinstance(peer_timeout, (int, float)) and peer_timeout > 0):
            bad.append(f"peer_timeout must be > 0 seconds, got peer_timeout={peer_timeout!r}")
        if bad:  # nothing to tell the group: these make joining it impossible
            raise ValueError("RefitEndpoint: " + "; ".join(bad))

        self.rank, self.world_size, self.mode = rank, world_size, mode
        self.timeout, self.peer_timeout = float(timeout), float(peer_timeout)
        self._module_params: dict[str, torch.nn.Parameter] = {}
        src_map, problems = self._local_sources(src_tensors, src_layouts)
        dst_map, dst_device, dst_problems = self._local_destinations(dst_tensors, dst_layouts, device)
        problems += dst_problems
        self.device = dst_device if dst_layouts is not None else (
            next(iter(src_map.values())).device if src_map else torch.device("cpu"))
        self.backend = backend if backend != "auto" else ("triton" if self.device.type == "cuda" else "torch")

        self._store_base, self._store = _connect(store, rank, world_size, self.timeout, group)
        self._secret = rdv.group_secret(self._store, is_master=rank == 0, timeout=self.timeout)

        # Phase 1: roles and layouts. Every rank validates the whole group identically, so a bad
        # rank makes every rank raise the same error before any data moves.
        hello = _Hello(rank, os.getpid(), socket.gethostname(), str(self.device),
                       dict(src_layouts) if src_layouts is not None else None,
                       dict(dst_layouts) if dst_layouts is not None else None, tuple(problems))
        hellos = rdv.all_gather_obj(self._store, "hello", rank, world_size, hello, timeout=self.timeout)
        self._peers = {h.rank: h for h in hellos}
        rdv.publish(self._store, f"hello-read/{rank}", True)
        try:
            self.plan = self._validate_group(hellos)
        except (ValueError, NotImplementedError):
            self._outlive_store_readers("hello-read")  # so every rank reads the hellos and raises too
            raise

        # Phase 2: arenas. Every handle and resource from here on is released by close().
        self._closed = self._released = False
        self._arena = self._control = None
        self._peer_arenas: dict[int, object] = {}
        self._peer_controls: dict[int, object] = {}
        self._tables: list[DescriptorTable] = []
        self._stop = threading.Event()
        self._hb_thread = None
        self._pull_thread = None
        self._pull_result: tuple[int, BaseException | None] | None = None
        self.version = 0                # destination: version being served
        self.published = 0              # source: last version published
        self.consistent = True          # destination, in-place mode: False after a torn pull
        self.last_pull_seconds = float("nan")
        self.pulls = 0
        self.staging_bytes = 0          # bytes the refit path allocated (by construction none)
        try:
            self._setup(src_map, dst_map, dst_device)
        except BaseException:
            self.close(abort=True)
            raise

    # ------------------------------------------------------------------ local validation
    def _local_sources(self, tensors, layouts):
        if layouts is None:
            return {}, []
        problems = []
        if isinstance(tensors, torch.nn.Module):
            self._module_params = dict(tensors.named_parameters())
            tensors = {n: p.data for n, p in self._module_params.items()}
        if not isinstance(tensors, Mapping) or not isinstance(layouts, Mapping):
            return {}, [f"src_tensors and src_layouts must be mappings name -> tensor / Layout, got "
                        f"{type(tensors).__name__} and {type(layouts).__name__}"]
        devices = set()
        mine = {}
        for name, lay in layouts.items():
            if not isinstance(lay, Layout):
                problems.append(f"src_layouts[{name!r}] is {type(lay).__name__}, not a trs.Layout")
                continue
            holds = self.rank in lay.ranks
            t = tensors.get(name)
            if t is None:
                if holds:
                    problems.append(f"src_tensors has no {name!r}, but src_layouts[{name!r}]={lay} places "
                                    f"a shard of shape {lay.local_shape(self.rank)} on rank {self.rank}")
                continue
            if not isinstance(t, torch.Tensor):
                problems.append(f"src_tensors[{name!r}] is {type(t).__name__}, not a torch.Tensor")
                continue
            if not holds:
                problems.append(f"src_tensors[{name!r}] is given but src_layouts[{name!r}]={lay} does not "
                                f"place it on rank {self.rank}")
                continue
            want = lay.local_shape(self.rank)
            if tuple(t.shape) != want:
                problems.append(f"src_tensors[{name!r}] has shape {tuple(t.shape)}, "
                                f"src_layouts[{name!r}].local_shape({self.rank}) is {want}")
            if t.dtype != lay.dtype:
                problems.append(f"src_tensors[{name!r}] has dtype {t.dtype}, src_layouts[{name!r}] says {lay.dtype}")
            devices.add(t.device)
            mine[name] = t
        extra = sorted(set(tensors) - set(layouts))
        if extra:
            problems.append(f"src_tensors has names without a layout in src_layouts: {extra}")
        if len(devices) > 1:
            problems.append(f"src_tensors live on several devices {sorted(map(str, devices))}; one arena "
                            f"per rank needs them on one device")
        return mine, problems

    def _local_destinations(self, tensors, layouts, device):
        if layouts is None:
            return {}, torch.device(device) if device is not None else torch.device("cpu"), []
        problems = []
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
        out = {}
        for name, lay in layouts.items():
            if not isinstance(lay, Layout):
                problems.append(f"dst_layouts[{name!r}] is {type(lay).__name__}, not a trs.Layout")
                continue
            if self.rank not in lay.ranks:
                continue
            t = tensors.get(name)
            if t is None:
                continue
            want = lay.local_shape(self.rank)
            if not isinstance(t, torch.Tensor):
                problems.append(f"dst_tensors[{name!r}] is {type(t).__name__}, not a torch.Tensor")
                continue
            if tuple(t.shape) != want:
                problems.append(f"dst_tensors[{name!r}] has shape {tuple(t.shape)}, "
                                f"dst_layouts[{name!r}].local_shape({self.rank}) is {want}")
            if t.dtype != lay.dtype:
                problems.append(f"dst_tensors[{name!r}] has dtype {t.dtype}, dst_layouts[{name!r}] says {lay.dtype}")
            if t.device != device:
                problems.append(f"dst_tensors[{name!r}] is on {t.device}, device is {device}")
            why = writable_problem(t)
            if why:
                problems.append(f"dst_tensors[{name!r}] {why}")
            out[name] = t
        extra = sorted(set(tensors) - set(layouts))
        if extra:
            problems.append(f"dst_tensors has names without a layout in dst_layouts: {extra}")
        return out, device, problems

    # ------------------------------------------------------------------ group validation
    def _validate_group(self, hellos) -> Plan:
        problems = [f"rank {h.rank}: {p}" for h in hellos for p in h.problems]
        plans = {}
        for side in ("src", "dst"):
            holders = [h for h in hellos if getattr(h, f"{side}_layouts") is not None]
            role = "trainer" if side == "src" else "inference"
            if not holders:
                problems.append(f"no rank joined with {side}_layouts (no {role} side)")
                continue
            ref = holders[0]
            ref_layouts = getattr(ref, f"{side}_layouts")
            for h in holders[1:]:
                other = getattr(h, f"{side}_layouts")
                for name in sorted(set(ref_layouts) | set(other)):
                    a, b = ref_layouts.get(name), other.get(name)
                    if a != b:
                        problems.append(
                            f"rank {h.rank} joined with {side}_layouts[{name!r}]={_desc(b)} but rank "
                            f"{ref.rank} has {_desc(a)}: every {role} rank must pass the same layouts")
            members = {h.rank for h in holders}
            for name, lay in ref_layouts.items():
                if isinstance(lay, Layout):
                    missing = sorted(set(lay.ranks) - members)
                    if missing:
                        problems.append(f"{side}_layouts[{name!r}]={lay} places shards on rank(s) "
                                        f"{missing}, which did not join as {role} ranks")
            plans[side] = ref_layouts
        if not problems:
            try:
                plan = plan_reshard(plans["src"], plans["dst"])
            except (ValueError, TypeError) as exc:
                problems.append(str(exc))
        if problems:
            raise ValueError(f"refit group {self.world_size} ranks: {len(problems)} problem(s), "
                             f"nothing was moved:\n  - " + "\n  - ".join(problems))
        cross = sorted({(op.src_rank, op.dst_rank) for op in plan.ops
                        if self._peers[op.src_rank].host != self._peers[op.dst_rank].host})
        if cross:  # every rank sees the same pairs, so every rank raises
            raise NotImplementedError(f"refit across hosts is not supported yet (pairs {cross[:8]}): every "
                                      f"source and destination rank must share one machine")
        return plan

    # ------------------------------------------------------------------ set-up
    def _setup(self, src_map, dst_map, dst_device):
        plan, rank = self.plan, self.rank
        self._src_layouts = plan.src_layouts if rank in plan.src_ranks else {}
        self._dst_layouts = {n: l for n, l in plan.dst_layouts.items() if rank in l.ranks}
        self._readers = tuple(r for r in plan.readers_of(rank))
        self._sources = plan.sources_of(rank)
        exports = _Exports(rank, None, None)
        self._src_views: dict[str, torch.Tensor] = {}
        if rank in plan.src_ranks:
            # Same-geometry shards back to back, so the torch backend can coalesce their copies.
            names = sorted(src_map, key=lambda n: (tuple(src_map[n].shape), str(src_map[n].dtype),
                                                   repr(plan.dst_layouts.get(n)), n))
            sizes = [(self._fsdp2.padded_numel(n) if self._fsdp2 else src_map[n].numel()) * src_map[n].element_size()
                     for n in names]  # FSDP2 hook (2 of 3): room for FSDP's padded shard
            offsets, total = pack_offsets(sizes)
            src_device = next(iter(src_map.values())).device if src_map else torch.device("cpu")
            self._arena = create_arena(max(total, 1), src_device, secret=self._secret)
            self._control = create_control_block(self.world_size, self.world_size, secret=self._secret)
            for name, off, size in zip(names, offsets, sizes):
                if self._fsdp2 is not None:  # FSDP2 hook (3 of 3): FSDP all-gathers and steps on the arena from now on
                    n_el = size // src_map[name].element_size()
                    view = self._fsdp2.rebind(name, self._arena.tensor(off, n_el, src_map[name].dtype))
                else:
                    view = self._arena.tensor(off, src_map[name].shape, src_map[name].dtype)
                    view.copy_(src_map[name])  # the one copy: afterwards training runs on the arena
                self._src_views[name] = view
                if name in self._module_params:
                    self._module_params[name].data = view
            exports = _Exports(rank, self._arena.export(), self._control.export(), dict(zip(names, offsets)))
        exported = rdv.all_gather_obj(self._store, "exports", rank, self.world_size, exports,
                                      timeout=self.timeout)
        self._exports = {e.rank: e for e in exported}

        # Destination side: map each source's arena once, build descriptor tables once per buffer set.
        self._buffers: list[dict[str, torch.Tensor]] = []
        if self._dst_layouts:
            for s in self._sources:
                if s == rank:
                    continue
                e = self._exports[s]
                self._peer_arenas[s] = open_arena(e.arena, secret=self._secret, device=dst_device,
                                                  timeout=self.timeout)
                self._peer_controls[s] = open_control_block(e.control, secret=self._secret,
                                                            timeout=self.timeout)
            n_sets = 2 if self.mode == "shadow" else 1
            # One flat allocation per buffer set, same-geometry shards back to back (as in the
            # trainers' arenas): copies of equal shards then differ by a constant address step.
            geo = {n: (l.local_shape(rank), str(l.dtype), repr(plan.src_layouts[n]), n)
                   for n, l in self._dst_layouts.items()}
            order = sorted(self._dst_layouts, key=geo.__getitem__)
            for i in range(n_sets):
                own = [n for n in order if not (i == 0 and n in dst_map)]
                sizes = [self._dst_layouts[n].local_numel(rank) * self._dst_layouts[n].itemsize for n in own]
                offsets, total = pack_offsets(sizes)
                flat = torch.zeros(total, dtype=torch.uint8, device=dst_device)
                bufs = {n: dst_map[n] for n in order if i == 0 and n in dst_map}
                for n, off, size in zip(own, offsets, sizes):
                    lay = self._dst_layouts[n]
                    bufs[n] = flat[off:off + size].view(lay.dtype).view(lay.local_shape(rank))
                self._buffers.append({n: bufs[n] for n in order})
            dst_pos = {n: i for i, n in enumerate(order)}
            ops = sorted(plan.ops_for_dst(rank), key=lambda op: (
                op.src_rank, self._exports[op.src_rank].offsets[op.name], dst_pos[op.name],
                tuple(s.start for s in op.dst_slices)))
            src_full = {}

            def src_view(op):
                key = (op.src_rank, op.name)
                if key not in src_full:
                    if op.src_rank == rank:
                        src_full[key] = self._src_views[op.name]
                    else:
                        lay = plan.src_layouts[op.name]
                        src_full[key] = self._peer_arenas[op.src_rank].tensor(
                            self._exports[op.src_rank].offsets[op.name], lay.local_shape(op.src_rank), lay.dtype)
                return src_full[key]

            for bufs in self._buffers:
                self._tables.append(DescriptorTable.build(ops, src=src_view, dst=lambda op, b=bufs: b[op.name]))
            self._serving = 0
        # Everyone mapped what it needs: owners stop handing their arenas out.
        rdv.all_gather_obj(self._store, "mapped", rank, self.world_size, True, timeout=self.timeout)
        rdv.publish(self._store, f"setup-done/{rank}", True)
        self._outlive_store_readers("setup-done")
        if self._arena is not None:
            self._arena.unlink()
            self._control.unlink()
        self._heartbeat()
        self._hb_thread = threading.Thread(target=self._heartbeat_loop, name=f"trs-heartbeat-{rank}",
                                           daemon=True)
        self._hb_thread.start()

    def _outlive_store_readers(self, key: str) -> None:
        """Rank 0 hosts the TCPStore: before it may return (and perhaps exit), wait until every rank
        published ``key``, i.e. read everything it needs from the store. Other ranks return at once."""
        if self.rank != 0:
            return
        for r in range(self.world_size):
            rdv.fetch(self._store, f"{key}/{r}", timeout=self.timeout, what=f"rank {r} to finish reading the store")

    # ------------------------------------------------------------------ liveness
    def _heartbeat(self):
        if self._control is not None:
            self._control.heartbeat(self.rank)
        for c in self._peer_controls.values():
            c.heartbeat(self.rank)

    def _heartbeat_loop(self):
        while not self._stop.wait(_HEARTBEAT_S):
            self._heartbeat()

    def _dead_reason(self, peer: int, control) -> str | None:
        """Why ``peer`` counts as dead, or None. ``control`` is a block ``peer`` heartbeats into."""
        h = self._peers[peer]
        if h.host == socket.gethostname():
            state = _proc_state(h.pid)
            if state is None or state in "ZX":
                return f"rank {peer} (pid {h.pid}) died" + (" (zombie)" if state == "Z" else "")
        beat = control.last_heartbeat_ns(peer)
        age = (time.monotonic_ns() - beat) / 1e9
        if beat > 0 and age > self.peer_timeout:
            return f"rank {peer} (pid {h.pid}) sent no heartbeat for {age:.1f} s (peer_timeout={self.peer_timeout:g} s)"
        return None

    def _wait(self, predicate, what: str, timeout: float, peers: Mapping[int, object], status=None):
        """Poll ``predicate`` until true; raise PeerDiedError / RefitError / TimeoutError naming ``what``."""
        deadline = time.monotonic() + timeout
        next_check, sleep = 0.0, 20e-6
        while True:
            if predicate():
                return
            now = time.monotonic()
            if now >= next_check:
                next_check = now + _LIVENESS_CHECK_S
                for peer, control in peers.items():
                    reason = self._dead_reason(peer, control)
                    if reason:
                        raise PeerDiedError(peer, f"rank {self.rank}: {reason} while waiting for {what}")
                    if control.state == 2:  # STATE_ABORT: a peer gave up on this group
                        raise RefitError(f"rank {self.rank}: the group was aborted ({control.abort_reason()}) "
                                         f"while waiting for {what}")
                if self._stop.is_set():
                    raise RefitError(f"rank {self.rank}: endpoint closed while waiting for {what}")
            if now >= deadline:
                extra = f" ({status()})" if status else ""
                raise TimeoutError(f"rank {self.rank}: timed out after {timeout:g} s waiting for {what}{extra}")
            time.sleep(min(sleep, max(0.0, deadline - now)))
            sleep = min(sleep * 2, 2e-3)

    # ------------------------------------------------------------------ source side
    @property
    def tensors(self) -> dict[str, torch.Tensor]:
        """Source side: the arena-backed local shards (train on these). Destination side: the serving
        weights (in shadow mode a new dict after each ``swap``; re-read it)."""
        if self._dst_layouts:
            return dict(self._buffers[self._serving])
        return dict(self._src_views)

    @property
    def source_tensors(self) -> dict[str, torch.Tensor]:
        return dict(self._src_views)

    def publish(self) -> int:
        """Source side, after ``optimizer.step()``: publish the arena's contents as a new version.

        Returns the version (1, 2, ...). Call ``fence()`` before changing the weights again.
        """
        self._check_open("publish")
        if self._control is None:
            raise ValueError(f"publish: rank {self.rank} has no source side (src_layouts was not given)")
        if self._arena.device.type == "cuda":
            torch.cuda.current_stream(self._arena.device).synchronize()  # data before the version
        self.published += 1
        self._control.publish(self.published)
        return self.published

    def fence(self, timeout: float | None = None) -> None:
        """Source side, before the next ``optimizer.step()``: wait until every rank that reads this
        rank's arena acked the last published version. Waits only for those readers.

        Raises PeerDiedError if a reader died (the refit fails clearly: nothing is dropped silently),
        TimeoutError naming the readers still behind after ``timeout`` (default: the endpoint's).
        """
        self._check_open("fence")
        if self._control is None:
            raise ValueError(f"fence: rank {self.rank} has no source side (src_layouts was not given)")
        timeout = _timeout_arg("fence", timeout, self.timeout)
        v, control = self.published, self._control
        readers = [r for r in self._readers]
        behind = lambda: {r: control.acked_version(r) for r in readers if control.acked_version(r) < v}  # noqa: E731
        self._wait(lambda: not behind(), f"readers {readers} to ack version {v}",
                   self.timeout if timeout is None else timeout,
                   {r: control for r in readers if r != self.rank},
                   status=lambda: f"still behind, rank: acked version = {behind()}")

    # ------------------------------------------------------------------ destination side
    def available_version(self) -> int:
        """Destination side: the newest version every source of this rank has published."""
        self._check_open("available_version")
        versions = [self._source_control(s).published_version for s in self._sources]
        return min(versions) if versions else 0

    def _source_control(self, s):
        return self._control if s == self.rank else self._peer_controls[s]

    def _pull_into(self, slot: int, version: int, timeout: float) -> None:
        sources = {s: self._source_control(s) for s in self._sources}
        remote = {s: c for s, c in sources.items() if s != self.rank}
        published = lambda: {s: c.published_version for s, c in sources.items()}  # noqa: E731
        self._wait(lambda: all(v >= version for v in published().values()),
                   f"sources {list(sources)} to publish version {version}", timeout, remote,
                   status=lambda: f"published: {published()}")
        ahead = {s: v for s, v in published().items() if v != version}
        if ahead:
            raise RefitError(f"rank {self.rank}: sources moved past version {version} before it was read "
                             f"({ahead}); a trainer published without fence()")
        t0 = time.perf_counter()
        if self.mode == "inplace":  # from here on a failure leaves the serving tensors torn
            self.consistent = False
        self._tables[slot].run(self.backend)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        # The copy is only valid if no source changed or died while it ran (a dead trainer's
        # memory stays mapped, but the version it was publishing can no longer be vouched for).
        for s, c in remote.items():
            reason = self._dead_reason(s, c)
            if reason:
                raise PeerDiedError(s, f"rank {self.rank}: {reason} during the pull of version {version}")
        moved = {s: v for s, v in published().items() if v != version}
        if moved:
            raise RefitError(f"rank {self.rank}: sources published {moved} during the pull of version "
                             f"{version}; the copy may be torn")
        for c in sources.values():
            c.ack(self.rank, version)
        self.last_pull_seconds = time.perf_counter() - t0
        self.pulls += 1

    def _next_version(self, version):
        if version is not None:
            if isinstance(version, bool) or not isinstance(version, int):
                raise ValueError(f"version must be an int (or None: the newest), got version={version!r}")
            if version <= self.version:
                raise ValueError(f"version={version} must be newer than the serving version {self.version}")
            return version
        return max(self.available_version(), self.version + 1)

    def pull(self, version: int | None = None, timeout: float | None = None) -> int:
        """Destination side: wait for and install the next version (default: the newest available,
        at least one newer than the serving version). Returns the version now served.

        Shadow mode pulls into the spare buffer set and swaps; in-place mode writes the serving
        tensors (pause generation meanwhile). On failure the error names the rank and what failed;
        shadow mode keeps serving the previous version, in-place mode sets ``consistent = False``.
        """
        self._check_open("pull")
        self._check_dst("pull")
        timeout = _timeout_arg("pull", timeout, self.timeout)
        if self.mode == "shadow":
            self.start_pull(version, timeout)
            return self.swap()
        target = self._next_version(version)
        try:
            self._pull_into(0, target, timeout)
        except BaseException:
            self._abort()
            raise
        self.consistent = True
        self.version = target
        return target

    def start_pull(self, version: int | None = None, timeout: float | None = None) -> int:
        """Shadow mode: start pulling ``version`` (default: the next) into the spare buffer set in a
        background thread, while generation goes on with the serving weights. Returns the version."""
        self._check_open("start_pull")
        self._check_dst("start_pull")
        if self.mode != "shadow":
            raise ValueError(f"start_pull needs mode='shadow' (this endpoint has mode={self.mode!r}); "
                             f"in-place pulls are synchronous: use pull()")
        if self._pull_thread is not None:
            return self._pull_target
        timeout = _timeout_arg("start_pull", timeout, self.timeout)
        target = self._next_version(version)
        spare = 1 - self._serving
        self._pull_target, self._pull_result = target, None

        def run():
            try:
                self._pull_into(spare, target, timeout)
                self._pull_result = (target, None)
            except BaseException as exc:  # handed to swap(), which re-raises it in the caller
                self._pull_result = (target, exc)

        self._pull_thread = threading.Thread(target=run, name=f"trs-pull-{self.rank}", daemon=True)
        self._pull_thread.start()
        return target

    def pull_done(self) -> bool:
        """Shadow mode: True when the background pull finished (successfully or not)."""
        return self._pull_thread is not None and not self._pull_thread.is_alive()

    @property
    def pulling(self) -> bool:
        return self._pull_thread is not None

    def pull_error(self) -> BaseException | None:
        """Shadow mode, once ``pull_done()``: the background pull's error, or None if it succeeded.
        Lets a TP group agree (e.g. by an all-reduce) to swap together or not at all."""
        if not self.pull_done():
            raise ValueError("pull_error: no finished pull (call start_pull and wait for pull_done)")
        return self._pull_result[1]

    def discard(self) -> None:
        """Shadow mode: drop a finished background pull without installing it (the serving weights
        and ``version`` stay as they are), e.g. because another TP rank's pull failed."""
        if self._pull_thread is None:
            return
        self._pull_thread.join(self.timeout)
        if self._pull_thread.is_alive():
            raise TimeoutError(f"rank {self.rank}: discard timed out waiting for the pull of version "
                               f"{self._pull_target}")
        self._pull_thread = None
        self._pull_result = None

    def swap(self, timeout: float | None = None) -> int:
        """Shadow mode: wait for the background pull and install it as the serving weights (one
        reference assignment). Re-raises the pull's error, leaving the serving weights untouched."""
        self._check_open("swap")
        if self._pull_thread is None:
            raise ValueError("swap: no pull in flight (call start_pull first)")
        self._pull_thread.join(self.timeout * 2 if timeout is None else timeout)
        if self._pull_thread.is_alive():
            raise TimeoutError(f"rank {self.rank}: swap timed out waiting for the pull of version {self._pull_target}")
        self._pull_thread = None
        target, exc = self._pull_result
        if exc is not None:
            self._abort()
            raise exc
        self._serving = 1 - self._serving
        self.version = target
        return target

    # ------------------------------------------------------------------ stats and lifetime
    @property
    def bytes_per_refit(self) -> int:
        """Destination bytes this rank writes per refit."""
        return self._tables[0].bytes_written if self._tables else 0

    @property
    def num_descriptors(self) -> int:
        return len(self._tables[0]) if self._tables else 0

    @property
    def num_copies(self) -> int:
        """Work items per pull: kernel launches (triton backend) or coalesced ``copy_`` calls (torch)."""
        if not self._tables:
            return 0
        t = self._tables[0]
        return t.num_launches if self.backend == "triton" else t.num_torch_copies

    @property
    def handles_opened(self) -> int:
        """Peer arenas mapped (one per source peer, never one per tensor)."""
        return len(self._peer_arenas)

    def _check_open(self, what):
        if self._closed:
            raise RuntimeError(f"{what}: this endpoint (rank {self.rank}) is closed")

    def _check_dst(self, what):
        if not self._dst_layouts:
            raise ValueError(f"{what}: rank {self.rank} has no destination side (dst_layouts was not given "
                             f"or places nothing on this rank)")

    def _abort(self):
        """Tell every control block we touch that this rank gave up, so peers stop waiting at once."""
        for c in [self._control, *self._peer_controls.values()]:
            if c is not None and c._slots is not None:
                c.abort(self.rank)

    def close(self, abort: bool = False) -> None:
        """Release everything (arenas, mappings, control blocks, threads). Idempotent; safe after an
        exception or a peer's death. ``abort=True`` also tells peers to stop waiting for this rank."""
        if getattr(self, "_released", True):
            return
        self._released = True
        self._closed = True
        self._stop.set()
        if abort:
            self._abort()
        if self._hb_thread is not None:
            self._hb_thread.join(1.0)
        if self._pull_thread is not None:
            self._pull_thread.join(self.timeout)
        self._tables.clear()
        self._buffers = []
        self._src_views = {}
        for c in self._peer_controls.values():
            c.close()
        self._peer_controls.clear()
        for a in self._peer_arenas.values():
            a.close()
        self._peer_arenas.clear()
        if self._control is not None:
            self._control.close()
            self._control = None
        if self._arena is not None:
            self._arena.close()
            self._arena = None

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        self.close(abort=exc_type is not None)
        return False

    def __del__(self):
        if not getattr(self, "_released", True):
            self.close()

    def __repr__(self):
        roles = [r for r, on in (("trainer", bool(self._src_views)), ("inference", bool(self._dst_layouts))) if on]
        return (f"<{type(self).__name__} rank {self.rank}/{self.world_size} {'+'.join(roles) or '-'} "
                f"published={self.published} version={self.version} mode={self.mode} backend={self.backend}>")


def _desc(layout) -> str:
    return "missing" if layout is None else str(layout) + f" {tuple(layout.shape)} {layout.dtype}"


class RefitTrainer(RefitEndpoint):
    """Trainer (source) side of a refit group; see :class:`RefitEndpoint` for the arguments.

    ``tensors``: this rank's local shards ``{name: tensor}`` or an ``nn.Module``; ``layouts``: the
    trainer group's global layouts (same on every trainer rank).
    """

    def __init__(self, tensors, layouts, *, rank: int, world_size: int, store=None, **kwargs):
        super().__init__(rank=rank, world_size=world_size, store=store, src_tensors=tensors,
                         src_layouts=layouts, **kwargs)


class RefitInference(RefitEndpoint):
    """Inference (destination) side of a refit group; see :class:`RefitEndpoint` for the arguments.

    ``layouts``: the inference group's global layouts (same on every inference rank); ``tensors``:
    optional tensors to write (e.g. the engine's parameters).
    """

    def __init__(self, layouts, *, rank: int, world_size: int, store=None, mode: str = "shadow",
                 tensors=None, **kwargs):
        super().__init__(rank=rank, world_size=world_size, store=store, dst_layouts=layouts,
                         dst_tensors=tensors, mode=mode, **kwargs)
