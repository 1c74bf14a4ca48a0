"""The driver's side of the bench: :class:`BenchSession` spawns the ranks once (through the shared
:mod:`tritonreshard.apps.driver`) and runs refits on command; :func:`memcpy_seconds` is the speed
of light the refits are compared with (the driver's own copy of the same bytes).

With ``net="namespaces"`` the ranks run on the host harness (:mod:`tritonreshard.apps.hosts`):
:func:`open_hosts` makes it (the driver joins its switch at the gateway address and hosts the store
there), each rank is spawned on its host (``BenchConfig.host_index``), and the session puts its
``link_gbps`` on every host's link as a token bucket (:func:`set_rate`); :func:`link_counters` reads
the bytes each link carried from the kernel's counters."""
from __future__ import annotations

import json
import math
import subprocess
import time

import torch

from tritonreshard import secret_for_children
from tritonreshard.planning import plan_reshard

from ..driver import Driver
from .baselines import bcast_set, gather_set
from .config import BenchConfig
from .model import build_model, layouts
from .rank import rank_main

__all__ = ["BenchSession", "memcpy_seconds", "MEMCPY_CHUNK", "open_hosts", "set_rate", "link_counters"]


def open_hosts(cfg: BenchConfig):
    """The host harness for ``cfg`` (``net="namespaces"``): ``cfg.hosts`` hosts and the gateway,
    where the driver hosts the store. The group secret the ranks need (the store listens beyond
    loopback) goes into this process's environment, which the hosts' launchers pass on to the
    ranks (``Hosts(env=)`` would also write it into the launcher scripts, readable by anyone)."""
    from ..hosts import Hosts  # lazy: only net="namespaces" needs the harness

    secret_for_children()
    return Hosts(cfg.hosts, gateway=True)


def set_rate(hosts, gbps: float | None) -> None:
    """Every host's link at ``gbps`` gigabits/s each way (a token bucket), or as it is (None)."""
    for i in range(len(hosts)):
        hosts.rate(i, gbps)


def link_counters(hosts) -> dict[str, dict[str, int]]:
    """``{host name: {"rx": bytes, "tx": bytes}}``: what each host's link has carried so far, as the
    kernel counts it on the host's interface (payload, TCP/IP headers, the store's and gloo's own
    messages: everything that crossed)."""
    out = {}
    for h in hosts.hosts:
        text = subprocess.run(["ip", "-n", h.netns, "-s", "-j", "link", "show", "eth0"], capture_output=True,
                              text=True, check=True).stdout
        stats = json.loads(text)[0]["stats64"]
        out[h.name] = {"rx": int(stats["rx"]["bytes"]), "tx": int(stats["tx"]["bytes"])}
    return out


#: The most bytes one ``copy_`` of :func:`memcpy_seconds` moves: far beyond any cache (so the copy is
#: bandwidth-bound as a whole-buffer copy is), without the driver holding twice the bytes a refit
#: writes (8 GiB for cols-replicas at 1 GiB).
MEMCPY_CHUNK = 256 << 20


def memcpy_seconds(nbytes: int, repeats: int, warmup: int = 1, device: str = "cpu",
                   threads: int | None = None, buffers=None) -> list[float]:
    """Seconds to copy ``nbytes`` on ``device`` (pre-faulted buffers), ``repeats`` times: one
    ``dst.copy_(src)`` of ``min(nbytes, MEMCPY_CHUNK)`` bytes, repeated until ``nbytes`` are copied.
    ``threads``: torch intra-op threads for the CPU copy (default: torch's, i.e. all cores);
    ``buffers``: a ``(src, dst)`` pair to reuse (from an earlier call's set-up)."""
    old = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        dev = torch.device(device)
        src, dst = buffers if buffers is not None else _memcpy_buffers(nbytes, dev)
        chunk = src.numel()
        pieces = [(0, chunk)] * (nbytes // chunk) + ([(0, nbytes % chunk)] if nbytes % chunk else [])
        sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
        out = []
        for k in range(warmup + repeats):
            sync()
            t0 = time.monotonic()
            for lo, hi in pieces:
                dst[lo:hi].copy_(src[lo:hi])
            sync()
            if k >= warmup:
                out.append(time.monotonic() - t0)
        return out
    finally:
        torch.set_num_threads(old)


def _memcpy_buffers(nbytes: int, device):
    n = min(nbytes, MEMCPY_CHUNK)
    return (torch.ones(n, dtype=torch.uint8, device=device),   # filled: pages are faulted in
            torch.zeros(n, dtype=torch.uint8, device=device))


class BenchSession:
    """Spawned ranks set up once (endpoints, baselines, provenance), then run refits on command.

    ``refits(method, count)`` -> list of seconds (one per timed refit), ``verify(method)`` -> bool,
    ``memcpy(repeats)`` -> list of seconds of the driver's copy of the same bytes, ``close()``.
    Use as a context manager. ``dst_bytes``: destination bytes per refit.

    ``hosts`` (``net="namespaces"``): the host harness to run on (:func:`open_hosts`; the session
    sets its links to ``cfg.link_gbps`` and leaves it open); None: the session makes its own and
    closes it with the ranks.
    """

    def __init__(self, cfg: BenchConfig, on_progress=None, hosts=None):
        problems = cfg.problems()
        if hosts is not None and cfg.net != "namespaces":
            problems.append(f"hosts= is the host harness of net='namespaces', but net={cfg.net!r}")
        elif hosts is not None and (len(hosts) != cfg.hosts or hosts.gateway is None):
            problems.append(f"hosts= must be {cfg.hosts} hosts with a gateway (open_hosts), got {hosts!r} "
                            f"(gateway {hosts.gateway})")
        if problems:
            raise ValueError("invalid bench configuration:\n  - " + "\n  - ".join(problems))
        self.cfg = cfg
        self.model = build_model(cfg)
        _, dst = layouts(cfg, self.model)
        # Destination bytes: every inference rank's local shards (the plan writes each exactly once).
        self.dst_bytes = sum(lay.local_numel(r) * lay.itemsize for lay in dst.values() for r in lay.ranks)
        self.model_bytes = sum(math.prod(t.shape) * 2 for t in self.model)
        self._on_progress = on_progress
        self._n = 0
        self._progress_seen = 0
        self._memcpy_bufs = None
        self.closed = False
        self._driver = None
        self._own_hosts = cfg.net == "namespaces" and hosts is None
        self.hosts = open_hosts(cfg) if self._own_hosts else hosts
        try:
            place = {}
            if self.hosts is not None:
                set_rate(self.hosts, cfg.link_gbps)
                self._shm_before = {i: set(self.hosts.shm_files(i)) for i in range(len(self.hosts))}
                place = dict(store_host=self.hosts.gateway,
                             executable=lambda r: self.hosts[cfg.host_index(r)].python)
            self._driver = Driver("bench", cfg.world_size, rank_main, (cfg,), timeout=cfg.timeout, prefix="bench",
                                  role=cfg.role, **place)
            self._bstore = self._driver.pstore
            self._driver.start()
            self._wait(lambda: self._bstore.add("ready", 0) >= cfg.world_size, "set-up")
            self.rank_info = json.loads(self._bstore.get("info"))
        except BaseException:
            self.close(failed=True)
            raise

    def _poll_progress(self):
        if self._on_progress is None:
            return
        done = self._bstore.add("progress", 0)
        if done > self._progress_seen:
            self._on_progress(done - self._progress_seen)
            self._progress_seen = done

    def _wait(self, ready, what: str):
        self._driver.wait(ready, f"the bench's {what}", tick=self._poll_progress)

    def _command(self, cmd: dict) -> dict | None:
        if self.closed:
            raise RuntimeError("BenchSession is closed")
        n = self._n
        self._n += 1
        self._bstore.set(f"cmd/{n}", json.dumps(cmd))
        if cmd["op"] == "stop":
            return None
        key = f"res/{n}"
        self._wait(lambda: self._bstore.check([key]), f"{cmd['method']} refits")
        self._poll_progress()
        return json.loads(self._bstore.get(key))

    # -- measurements ------------------------------------------------------------------------
    def refits(self, method: str, count: int = 1, verify: bool = False, each_stats: bool = False) -> dict:
        """Runs ``count`` refits by ``method``; returns ``{"seconds": [...], "verified": bool?}``;
        ``each_stats``: also every rank's statistics after each refit (``"each_stats"``)."""
        if method not in self.cfg.worker_methods:
            raise ValueError(f"method={method!r} must be one of the configured {self.cfg.worker_methods}")
        return self._command({"op": "refit", "method": method, "count": int(count), "verify": bool(verify),
                              "each_stats": bool(each_stats)})

    def verify(self, method: str) -> bool:
        """Whether every inference rank holds ``method``'s last refit, bit for bit."""
        return self.verify_all([method])[method]

    def verify_all(self, methods) -> dict[str, bool]:
        """:meth:`verify` of each of ``methods``, in one pass over the destination shards."""
        methods = list(methods)
        cmd = {"op": "refit", "method": methods[0], "count": 0, "verify": True, "verify_methods": methods}
        return {m: bool(ok) for m, ok in self._command(cmd)["verified_methods"].items()}

    def memcpy(self, repeats: int, warmup: int = 1, threads: int | None = None) -> list[float]:
        """The driver copies ``dst_bytes`` (buffers allocated and faulted in once per session)."""
        if self._memcpy_bufs is None:
            self._memcpy_bufs = _memcpy_buffers(self.dst_bytes, self.cfg.device)
        out = memcpy_seconds(self.dst_bytes, repeats, warmup, self.cfg.device, threads, self._memcpy_bufs)
        if self._on_progress is not None:
            self._on_progress(warmup + repeats)
        return out

    def staging_bytes(self) -> int:
        """Measured (the engine tracks what each pull allocates): the sum over ranks of the most
        extra memory one pull allocated, over every refit so far."""
        stats = self._command({"op": "refit", "method": "tritonreshard", "count": 0, "stats": True})["stats"]
        return sum(s["staging_bytes"] for s in stats)

    def cross_host_bytes(self) -> int:
        """The engine's own accounting: bytes its ranks received from other hosts in the last refit."""
        stats = self._command({"op": "refit", "method": "tritonreshard", "count": 0, "stats": True})["stats"]
        return sum(s["cross_host_bytes"] for s in stats)

    def trainer_egress_bytes(self) -> int:
        """The engine's route: source bytes the trainers serve per refit (read from their arenas on
        their host, or sent to another host once per host)."""
        stats = self._command({"op": "refit", "method": "tritonreshard", "count": 0, "stats": True})["stats"]
        return sum(s["egress_bytes"] for s in stats)

    def baseline_cross_host_bytes(self) -> dict:
        """Bytes per refit the baselines move between hosts with the same placement: ``p2p`` sends
        every destination rank's own slices; ``gather_broadcast`` broadcasts each full tensor to
        every inference rank (counted as the bytes each rank on another host than the root
        receives)."""
        src, dst = layouts(self.cfg, self.model)
        host = {r: self.cfg.host_of(r) for r in range(self.cfg.world_size)}
        p2p = sum(op.numel * src[op.name].itemsize for op in plan_reshard(src, dst).ops
                  if host[op.src_rank] != host[op.dst_rank])
        gb = 0
        for t in self.model:
            root = gather_set(src[t.name])[0]
            full = math.prod(t.shape) * src[t.name].itemsize
            gb += full * sum(1 for r in bcast_set(src[t.name], dst[t.name]) if host[r] != host[root])
        return {"p2p": p2p, "gather_broadcast": gb}

    @property
    def plan_ops(self) -> int:
        return sum(i["plan_ops_dst"] for i in self.rank_info)

    @property
    def descriptors(self) -> int:
        return sum(i["descriptors"] for i in self.rank_info)

    # -- lifetime ----------------------------------------------------------------------------
    def close(self, failed: bool = False) -> list[str]:
        """Stops the ranks; returns the engine's /dev/shm entries that appeared meanwhile (a leak),
        on this machine and, on the host harness, in each host's own /dev/shm (``host1:trs-...``).
        A harness the session made is torn down, whatever happened."""
        if self.closed:
            return []
        self.closed = True
        self._memcpy_bufs = None
        leaked = []
        try:
            if self._driver is not None:
                if not failed:
                    self._n, n = self._n + 1, self._n
                    self._bstore.set(f"cmd/{n}", json.dumps({"op": "stop"}))
                leaked = self._driver.close(join=30.0 if not failed else 0.0)
                if self.hosts is not None:
                    leaked += [f"{self.hosts[i].name}:{n}" for i, before in self._shm_before.items()
                               for n in sorted(set(self.hosts.shm_files(i)) - before) if n.startswith("trs-")]
        finally:
            if self._own_hosts:
                self.hosts.close()
        return leaked

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        self.close(failed=exc_type is not None)
        return False
