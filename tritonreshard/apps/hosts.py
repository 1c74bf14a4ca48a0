"""Hosts that are really apart, on one machine: a network namespace, an address, a private /dev/shm
and a hostname each, joined by veth links through a switch, with links that can be rate-limited and
cut. Tests and bench run their cross-host ranks on it (:class:`Hosts`); nothing in the library
imports it.

What one host is (``Hosts(n)``: hosts ``host0 .. host{n-1}``):

* **network**: its own network namespace (``ip netns``), with ``lo`` and one interface ``eth0``
  at ``10.77.0.{i+1}/24``, the end of a veth pair whose other end sits on a bridge in a namespace of
  its own (the switch; nothing of it touches the machine's own network). A host reaches another
  host only through its link, and never 127.0.0.1 of another host: loopback is per namespace;
* **memory**: its own mount namespace per process with a tmpfs of the host's bind-mounted on
  ``/dev/shm`` (every process of a host sees the same one, no process of another host sees it);
* **name**: its own UTS namespace with hostname ``host{i}``, and a private ``/etc/hosts`` naming every
  host's address, as a cluster's DNS would: tritonreshard's host identity is the hostname, as on real
  nodes, and gloo finds its interface from it. ``TRITONRESHARD_HOST`` is removed from the environment;
* **processes**, optionally (``pid_namespace=True``): its own pid namespace, shared by the host's
  processes (held by a ``sleep`` that is its pid 1) with its own ``/proc``, so that pids and pidfds
  of one host mean nothing on another: the first processes of two hosts get the same pids.

Links: :meth:`Hosts.rate` puts a token bucket (``tc qdisc ... tbf``) on both directions of a host's
link; :meth:`Hosts.cut` sets the switch's end of it down (no packet passes either way, nothing is
reset: TCP connections stall as over a pulled cable) and :meth:`Hosts.restore` brings it back;
:meth:`Hosts.kill` SIGKILLs every process in a host's network namespace at once (a node lost).

Processes: :meth:`Hosts.run_ranks` runs ``fn(rank, *args)`` with rank ``r`` on host
``placement[r]``, as :func:`tritonreshard.apps.kit.run_ranks` does on one host (hard timeout,
tracebacks, victims), spawned through a small per-host launcher that enters the host's namespaces and
then execs this Python; :meth:`Hosts.start` starts any spawned process there, and :meth:`Hosts.popen`
runs any command on a host.

Teardown: :meth:`Hosts.close` (also the context manager's exit, and at interpreter exit) kills the
hosts' processes, deletes the namespaces (their links go with them), unmounts the tmpfs and removes
the launchers. A process killed before it could (SIGKILL, a CI timeout) leaves namespaces named with
its pid: the next ``Hosts`` sweeps every ``trs-<pid>-*`` whose pid is gone.

Needs root (CAP_NET_ADMIN, CAP_SYS_ADMIN), ``ip`` and ``tc`` (iproute2), ``nsenter``, ``unshare`` and
``mount`` (util-linux); :func:`unavailable` says what is missing, for a test's skip reason.
"""
from __future__ import annotations

import atexit
import itertools
import multiprocessing.connection as mp_connection
import multiprocessing.resource_tracker as mp_resource_tracker
import multiprocessing.spawn as mp_spawn
import os
import pickle
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch.multiprocessing as mp

__all__ = ["Hosts", "HostProcessError", "unavailable", "sweep", "SUBNET", "GATEWAY"]

#: The hosts' subnet, inside the harness's own namespaces only (never on the machine's network).
SUBNET = "10.77.0"
#: This machine's address on the switch, with ``Hosts(gateway=True)``.
GATEWAY = f"{SUBNET}.254"
_RUN = Path("/run/tritonreshard-hosts")
_PREFIX = "trs-"
_COUNTER = itertools.count()
_TOOLS = ("ip", "tc", "nsenter", "unshare", "mount", "umount")


class HostProcessError(RuntimeError):
    """A rank on a host died without a report, or did not report in time."""


def unavailable() -> str | None:
    """Why hosts cannot be made here (a skip reason), or None when they can: not root, a tool
    missing, or the kernel refusing a network namespace."""
    if os.geteuid() != 0:
        return "the host harness needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN for network and mount namespaces)"
    missing = [t for t in _TOOLS if shutil.which(t) is None]
    if missing:
        return f"the host harness needs {', '.join(missing)} (iproute2, util-linux)"
    name = f"{_PREFIX}{os.getpid()}-probe{next(_COUNTER)}"
    made = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot make a network namespace: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return None


def _sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    out = subprocess.run(list(argv), capture_output=True, text=True)
    if check and out.returncode != 0:
        raise RuntimeError(f"host harness: `{shlex.join(argv)}` failed ({out.returncode}): {out.stderr.strip()}")
    return out


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep() -> list[str]:
    """Delete what harnesses of dead processes left (namespaces, tmpfs, launchers): everything named
    ``trs-<pid>-*`` whose pid is gone. Returns what it removed."""
    removed = []
    for line in _sh("ip", "netns", "list").stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        m = re.match(rf"{_PREFIX}(\d+)-", name)
        if m and not _pid_alive(int(m.group(1))):
            _kill_netns(name)
            _sh("ip", "netns", "del", name, check=False)
            removed.append(name)
    if _RUN.is_dir():
        for d in _RUN.iterdir():
            m = re.match(rf"{_PREFIX}(\d+)-", d.name)
            if m and not _pid_alive(int(m.group(1))):
                _remove_dir(d)
                removed.append(str(d))
    return removed


def _kill_netns(name: str) -> list[int]:
    pids = [int(p) for p in _sh("ip", "netns", "pids", name, check=False).stdout.split()]
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return pids


def _remove_dir(d: Path) -> None:
    for sub in sorted(d.glob("*/shm")):
        _sh("umount", "-l", str(sub), check=False)
    shutil.rmtree(d, ignore_errors=True)


@dataclass(frozen=True)
class Host:
    """One host of a :class:`Hosts`: its index, hostname, address, network namespace, the switch's
    interface for its link, the directory behind its /dev/shm and its launcher."""
    index: int
    name: str
    address: str
    netns: str
    port: str
    shm: Path
    launcher: Path
    python: Path


class Hosts:
    """``n`` hosts on this machine, really apart (see the module docstring). A context manager;
    :meth:`close` tears everything down and is safe to call twice.

    Args:
        n: how many hosts (``host0 .. host{n-1}``, addresses ``10.77.0.1 ..``).
        pid_namespace: give each host its own pid namespace too (all its processes in it).
        shm_size: each host's /dev/shm (tmpfs ``size=``).
        env: environment added to every process on every host (e.g. ``TRITONRESHARD_GROUP_SECRET``).
        gateway: also link this machine's own network namespace to the switch, at :data:`GATEWAY`
            (``10.77.0.254``), for a driver that runs here and serves the hosts (a bench's store). Its
            link is not a host's: rates and cuts of a host apply to what that host exchanges with it.
    """

    def __init__(self, n: int, *, pid_namespace: bool = False, shm_size: str = "4g", env: dict | None = None,
                 gateway: bool = False):
        why = unavailable()
        if why:
            raise RuntimeError(f"host harness: {why}")
        if n < 1 or n > 200:
            raise ValueError(f"Hosts: n={n} must be 1 .. 200")
        sweep()
        self.tag = f"{_PREFIX}{os.getpid()}-{next(_COUNTER)}"
        self.pid_namespace = pid_namespace
        self.env = dict(env or {})
        self.dir = _RUN / self.tag
        self.switch = f"{self.tag}-sw"
        self.hosts: list[Host] = []
        self._closed = False
        self._procs: list = []
        self._inits: list = []  # the processes holding the hosts' pid namespaces
        self._popens: list = []  # popen()'s
        self.gateway = GATEWAY if gateway else None
        self._gateway_dev = f"t{os.getpid() % 100000}x{next(_COUNTER)}g" if gateway else None
        atexit.register(self.close)
        try:
            self._make(n, shm_size)
        except BaseException:
            self.close()
            raise

    # ---------------------------------------------------------------------------------- set-up
    def _make(self, n: int, shm_size: str) -> None:
        self.dir.mkdir(parents=True)
        _sh("ip", "netns", "add", self.switch)
        _sh("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
        _sh("ip", "-n", self.switch, "link", "set", "br0", "up")
        etc_hosts = self.dir / "hosts"
        etc_hosts.write_text("127.0.0.1 localhost\n" + "".join(
            f"{SUBNET}.{i + 1} host{i}\n" for i in range(n)))
        for i in range(n):
            host = Host(index=i, name=f"host{i}", address=f"{SUBNET}.{i + 1}", netns=f"{self.tag}-h{i}",
                        port=f"p{i}", shm=self.dir / f"h{i}" / "shm", launcher=self.dir / f"h{i}" / "run",
                        python=self.dir / f"h{i}" / "python")
            _sh("ip", "netns", "add", host.netns)
            self.hosts.append(host)
            # Created in the root namespace under names unique to this harness, then moved and renamed.
            a, b = f"t{os.getpid() % 100000}x{i}a", f"t{os.getpid() % 100000}x{i}b"
            _sh("ip", "link", "add", a, "type", "veth", "peer", "name", b)
            _sh("ip", "link", "set", a, "netns", host.netns)
            _sh("ip", "link", "set", b, "netns", self.switch)
            _sh("ip", "-n", host.netns, "link", "set", a, "name", "eth0")
            _sh("ip", "-n", self.switch, "link", "set", b, "name", host.port)
            _sh("ip", "-n", host.netns, "addr", "add", f"{host.address}/24", "dev", "eth0")
            _sh("ip", "-n", host.netns, "link", "set", "eth0", "up")
            _sh("ip", "-n", host.netns, "link", "set", "lo", "up")
            _sh("ip", "-n", self.switch, "link", "set", host.port, "master", "br0")
            _sh("ip", "-n", self.switch, "link", "set", host.port, "up")
            host.shm.mkdir(parents=True)
            _sh("mount", "-t", "tmpfs", "-o", f"size={shm_size},mode=1777", f"{host.netns}-shm", str(host.shm))
            self._write_launcher(host, etc_hosts)
        if self.gateway:
            here, there = self._gateway_dev, self._gateway_dev + "s"
            _sh("ip", "link", "add", here, "type", "veth", "peer", "name", there)
            _sh("ip", "link", "set", there, "netns", self.switch)
            _sh("ip", "-n", self.switch, "link", "set", there, "master", "br0")
            _sh("ip", "-n", self.switch, "link", "set", there, "up")
            _sh("ip", "addr", "add", f"{self.gateway}/24", "dev", here)
            _sh("ip", "link", "set", here, "up")

    def _write_launcher(self, host: Host, etc_hosts: Path) -> None:
        """A script that runs its arguments on ``host``: enter its network namespace, then a new mount
        and UTS namespace (and pid namespace) where its tmpfs is /dev/shm, ``/etc/hosts`` names every
        host, and the hostname is the host's; then exec."""
        inner = 'mount --bind "$0" /dev/shm && mount --bind "$1" /etc/hosts && hostname "$2" && shift 2 && exec "$@"'
        enter = [f"--net=/run/netns/{host.netns}"]
        if self.pid_namespace:
            # The host's pid namespace is held by its pid 1 (a sleep); nsenter forks into it and
            # waits, and /proc is remounted so that it shows the host's processes only.
            init = self._pid_init(host)
            enter.append(f"--pid=/proc/{init}/ns/pid")
            inner = "mount -t proc proc /proc && " + inner
        argv = ["nsenter", *enter, "--", "unshare", "--mount", "--uts",
                "--propagation", "private", "--", "/bin/sh", "-c", inner,
                str(host.shm), str(etc_hosts), host.name]
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.env.items())
        host.launcher.write_text(
            "#!/bin/sh\n"
            f"# runs its arguments on {host.name} ({host.address}) of the host harness {self.tag}\n"
            f"unset TRITONRESHARD_HOST\n"
            + (f"export {env}\n" if env else "")
            + f'exec {shlex.join(argv)} "$@"\n')
        host.launcher.chmod(0o700)  # it may hold the group secret (env=)
        # What spawn execs as "the interpreter": this Python, on the host.
        host.python.write_text(f'#!/bin/sh\nexec {shlex.quote(str(host.launcher))} '
                               f'{shlex.quote(sys.executable)} "$@"\n')
        host.python.chmod(0o700)

    def _pid_init(self, host: Host) -> int:
        """Start the process that holds ``host``'s pid namespace (its pid 1); returns its pid here."""
        p = subprocess.Popen(["nsenter", f"--net=/run/netns/{host.netns}", "--", "unshare", "--pid", "--fork",
                              "--kill-child", "sleep", "infinity"])
        self._inits.append(p)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # the sleep is unshare's child, in the new namespace
            kids = Path(f"/proc/{p.pid}/task/{p.pid}/children")
            pids = kids.read_text().split() if kids.exists() else []
            if pids:
                return int(pids[0])
            time.sleep(0.01)
        raise RuntimeError(f"host harness: the pid namespace of {host.name} did not start within 10 s")

    # -------------------------------------------------------------------------------- queries
    def __len__(self) -> int:
        return len(self.hosts)

    def __getitem__(self, i: int) -> Host:
        return self.hosts[i]

    @property
    def names(self) -> list[str]:
        return [h.name for h in self.hosts]

    def address(self, i: int) -> str:
        return self.hosts[i].address

    @property
    def gateway_interface(self) -> str | None:
        """This machine's interface on the switch (``gateway=True``; None without), for what must
        listen where the hosts reach it (``GLOO_SOCKET_IFNAME`` of a process of this machine)."""
        return self._gateway_dev

    def shm_files(self, i: int) -> list[str]:
        """What host ``i``'s /dev/shm holds now (its tmpfs, seen from outside)."""
        return sorted(os.listdir(self.hosts[i].shm))

    def __repr__(self) -> str:
        return f"Hosts({self.tag}: " + ", ".join(f"{h.name}={h.address}" for h in self.hosts) + ")"

    # ---------------------------------------------------------------------------------- links
    def rate(self, i: int, gbps: float | None) -> None:
        """Limit host ``i``'s link to ``gbps`` gigabits/s each way (a token bucket on both ends of
        the veth), or lift the limit (None)."""
        h = self.hosts[i]
        for ns, dev in ((h.netns, "eth0"), (self.switch, h.port)):
            _sh("tc", "-n", ns, "qdisc", "del", "dev", dev, "root", check=False)
            if gbps is not None:
                rate_bytes = gbps * 1e9 / 8
                # The bucket must hold a 64 KiB GSO segment and about 4 ms of traffic at the rate.
                burst = max(256 * 1024, int(rate_bytes * 0.004))
                _sh("tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate", f"{gbps * 1000:.0f}mbit",
                    "burst", str(burst), "latency", "200ms")

    def cut(self, i: int) -> None:
        """Cut host ``i``'s link: the switch's end goes down (both directions stop; no reset)."""
        _sh("ip", "-n", self.switch, "link", "set", self.hosts[i].port, "down")

    def restore(self, i: int) -> None:
        """Bring host ``i``'s link back up."""
        _sh("ip", "-n", self.switch, "link", "set", self.hosts[i].port, "up")

    def kill(self, i: int) -> list[int]:
        """SIGKILL every process on host ``i`` at once (a node lost); returns their pids."""
        return _kill_netns(self.hosts[i].netns)

    # ------------------------------------------------------------------------------ processes
    def popen(self, i: int, argv: Sequence[str], **kwargs) -> subprocess.Popen:
        """``subprocess.Popen(argv)`` on host ``i`` (``argv[0]`` found on PATH there)."""
        proc = subprocess.Popen([str(self.hosts[i].launcher), *argv], **kwargs)
        # Killed by close() by pid too: it may enter the host's namespace just after close() listed
        # the namespace's processes (the launcher execs all the way down: the pid is the command's).
        self._popens.append(proc)
        return proc

    def run_ranks(self, fn, placement: Sequence[int], args=(), timeout: float = 120.0, *,
                  allow_errors: bool = False, victims=(), during=None) -> dict:
        """Run ``fn(rank, *args)`` for every rank ``r`` of ``placement`` on host ``placement[r]``, in
        processes spawned there; return ``{rank: value}``. As
        :func:`tritonreshard.apps.kit.run_ranks`: a hard timeout SIGKILLs the silent ranks and
        raises naming them; a rank's exception fails the call with its traceback unless
        ``allow_errors`` (then ``("error", (type, message, traceback))`` or ``("ok", value)``);
        ``victims`` must die of SIGKILL and report nothing. ``during(hosts, stop)``, if given, runs in
        a thread of this process while the ranks run (e.g. cut a link at a moment) and returns what it
        measured, returned as ``result["during"]`` (its exception fails the call); ``stop`` (a
        ``threading.Event``) is set when the call ends early (a rank failed), so it can give up.

        Each rank reports over a pipe of its own (a queue's lock would be a semaphore in the
        parent's /dev/shm, which a host does not see), pickled whole (tensors by value)."""
        ctx = mp.get_context("spawn")
        bad = [p for p in placement if not 0 <= p < len(self.hosts)]
        if bad:
            raise ValueError(f"Hosts.run_ranks: placement names hosts {sorted(set(bad))}; this harness has "
                             f"{len(self.hosts)}")
        procs, pipes = self._spawn(ctx, fn, placement, args)
        out: dict = {}
        survivors = set(range(len(placement))) - set(victims)
        deadline = time.monotonic() + timeout
        stop, during_out = threading.Event(), {}
        watcher = self._start_during(during, stop, during_out) if during else None
        try:
            pending = dict(enumerate(pipes))
            while not survivors <= set(out):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise HostProcessError(
                        f"ranks {sorted(survivors - set(out))} (hosts "
                        f"{[self.hosts[placement[r]].name for r in sorted(survivors - set(out))]}) did not finish "
                        f"within {timeout:g} s")
                ready = mp_connection.wait(list(pending.values()), timeout=min(remaining, 0.5))
                for conn in ready:
                    rank = next(r for r, c in pending.items() if c is conn)
                    del pending[rank]
                    try:
                        out[rank] = pickle.loads(conn.recv_bytes())
                    except EOFError:
                        if rank in survivors:
                            procs[rank].join(5)
                            raise HostProcessError(
                                f"rank {rank} on {self.hosts[placement[rank]].name} died without a report, "
                                f"exit code {procs[rank].exitcode}") from None
            for r in victims:
                procs[r].join(max(1.0, deadline - time.monotonic()))
                if procs[r].exitcode != -signal.SIGKILL:
                    raise AssertionError(f"rank {r} exit code {procs[r].exitcode}, expected SIGKILL")
            if watcher is not None:
                # Every rank reported: what during() still waits for will not come.
                stop.set()
                watcher.join(max(0.1, min(30.0, deadline - time.monotonic())))
                rank_failed = any(v[0] == "error" for v in out.values())
                if "error" in during_out and not rank_failed:  # a rank's error is the cause: below
                    raise during_out["error"]
                if watcher.is_alive():
                    raise HostProcessError("during() did not return within 30 s of the ranks' end")
        finally:
            stop.set()
            for p in procs:
                p.join(max(0.1, min(10.0, deadline - time.monotonic())))
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join(10)
            for c in pipes:
                c.close()
        out = {r: v for r, v in out.items() if r in survivors}
        if during is not None:
            out["during"] = during_out.get("value")
        if allow_errors:
            return out
        errors = {r: v[1] for r, v in out.items() if r != "during" and v[0] == "error"}
        if errors:
            raise self._first_error(errors, placement)
        return {r: (v if r == "during" else v[1]) for r, v in out.items()}

    def _start_during(self, during, stop, out: dict) -> threading.Thread:
        """Run ``during(self, stop)`` in a thread; its value or exception lands in ``out``."""
        def run():
            try:
                out["value"] = during(self, stop)
            except BaseException as exc:  # handed to run_ranks' caller
                out["error"] = exc
        watcher = threading.Thread(target=run, daemon=True, name="hosts-during")
        watcher.start()
        return watcher

    def _first_error(self, errors: dict, placement) -> AssertionError:
        """The error of the rank that failed first (most often the cause), naming the later ones."""
        first = min(errors, key=lambda r: errors[r][3])
        name, msg, tb, _ = errors[first]
        later = "".join(f"\n  then rank {r} raised {errors[r][0]}: "
                        f"{errors[r][1].splitlines()[0] if errors[r][1] else ''}"
                        for r in sorted(errors) if r != first)
        return AssertionError(f"rank {first} on {self.hosts[placement[first]].name} raised {name}: {msg}{later}\n{tb}")

    def _spawn(self, ctx, fn, placement, args) -> tuple[list, list]:
        """Start rank ``r`` on host ``placement[r]``; returns the processes and their report pipes."""
        procs, pipes = [], []
        for rank, h in enumerate(placement):
            recv, send = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_host_rank_entry, args=(fn, rank, tuple(args), send), daemon=True)
            self.start(h, p)
            send.close()
            procs.append(p)
            pipes.append(recv)
        return procs, pipes

    def start(self, i: int, process) -> None:
        """``process.start()`` on host ``i``: a process of a ``spawn`` context (``multiprocessing`` or
        ``torch.multiprocessing``), killed by :meth:`close` if still alive. What it talks over must
        cross hosts: pipes, not queues (a queue's lock is a semaphore in this machine's /dev/shm)."""
        # Started here, on this machine, before a host's launcher is the executable: spawn starts it
        # on first use with that executable, so it would live (and die) on host i.
        mp_resource_tracker.ensure_running()
        # spawn execs the interpreter it is told; this host's launcher execs it inside the host.
        saved = mp_spawn.get_executable()
        mp_spawn.set_executable(str(self.hosts[i].python))
        try:
            process.start()
        finally:
            mp_spawn.set_executable(saved)
        self._procs.append(process)

    # ------------------------------------------------------------------------------- teardown
    def close(self) -> None:
        """Kill every process on the hosts, delete the namespaces and links, unmount and remove
        the hosts' tmpfs and launchers. Idempotent; runs at interpreter exit too."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        for h in self.hosts:
            _kill_netns(h.netns)
        for p in self._procs:
            if p.is_alive():
                p.kill()
            p.join(5)
        for p in [*self._popens, *self._inits]:
            p.kill()
            p.wait(5)
        for h in self.hosts:
            _sh("ip", "netns", "del", h.netns, check=False)
        if self._gateway_dev:  # its peer goes with the switch, and it with its peer
            _sh("ip", "link", "del", self._gateway_dev, check=False)
        _sh("ip", "netns", "del", self.switch, check=False)
        _remove_dir(self.dir)

    def __enter__(self) -> Hosts:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _host_rank_entry(fn, rank: int, args, conn) -> None:
    """What a rank spawned on a host runs: ``fn(rank, *args)``, reported over ``conn`` as
    ``("ok", value)`` or ``("error", (type, message, traceback, time of the error))``."""
    try:
        report = ("ok", fn(rank, *args))
    except BaseException as exc:  # reported to the parent, which fails with it
        report = ("error", (type(exc).__name__, str(exc), traceback.format_exc(), time.monotonic()))
    conn.send_bytes(pickle.dumps(report))
    conn.close()
