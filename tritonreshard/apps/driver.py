"""The process driver the demo and the bench share: spawn one process per rank around a TCPStore the
driver hosts, watch them, report one clear error per failed rank, stop them, check shared memory.

Which process calls what:

* the driver: ``Driver(name, world_size, target, args, timeout)``, ``start()``, then ``wait(ready,
  what)`` as often as it likes (returns when ``ready()`` is true; raises :class:`RankFailed` as soon
  as a rank exited non-zero or recorded an error, :class:`TimeoutError` after ``timeout``), and
  ``close()`` in a ``finally`` (SIGTERM to survivors, SIGKILL after a grace period, then a check
  that no engine segment appeared in ``/dev/shm``);
* every rank: ``target(rank, store, pstore, *args)`` runs inside :func:`_rank_entry`, which turns
  SIGTERM into ``SystemExit`` (so ``with``/``finally`` blocks close endpoints), connects to the
  driver's store, and when ``target`` raises records one line (``error/<rank>``: the exception type
  and message, plus the full traceback for ``--debug``-style reporting) and exits with code 1 without
  printing a traceback. Ranks wait on store keys with :func:`wait_key`;
* spares: ``standby(n)`` starts processes that import what a rank needs and wait; a later
  ``start(ranks)`` turns them into those ranks at once (a restart without the interpreter's start
  and ``import torch``); ``launches`` records how each rank's process was launched.

:func:`poll_until` is the one polling loop of the applications (driver and ranks alike).

Memory: an application estimates its peak from what each rank will allocate and calls
:func:`memory_shortage` before it starts any process (a rank the kernel kills for memory dies
minutes in, with nothing but a SIGKILL to show). A rank that dies of SIGKILL anyway is reported as
"out of memory" when the kernel log or an OOM-kill counter (the cgroup's, the machine's) says so,
and with the out-of-memory killer as its probable cause otherwise (:func:`sigkill_cause`).
"""
from __future__ import annotations

import datetime
import importlib
import json
import multiprocessing.spawn as mp_spawn
import os
import re
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tritonreshard import secret_for_children

__all__ = ["Driver", "RankFailed", "RankError", "poll_until", "wait_key", "our_shm_entries",
           "one_line", "available_memory", "memory_shortage", "oom_kill_counts", "sigkill_cause",
           "fmt_gib", "MEMORY_ENV", "sigterm_exits"]

SHM_PREFIX = "trs-"  # the engine's named segments; other programs' entries (psm_*, sem.mp-*) are not ours


def our_shm_entries() -> set[str]:
    """The engine's named segments in /dev/shm (its fd-passed segments have no name at all)."""
    try:
        return {n for n in os.listdir("/dev/shm") if n.startswith(SHM_PREFIX)}
    except FileNotFoundError:
        return set()


# -- memory ------------------------------------------------------------------------------------
#: Overrides what :func:`available_memory` reads (bytes, a plain integer): for a machine whose
#: /proc/meminfo or cgroup files do not tell the truth, or a test.
MEMORY_ENV = "TRITONRESHARD_MEMORY_AVAILABLE"
_UNLIMITED = 1 << 60  # cgroup v1 writes "no limit" as a huge number (9223372036854771712)


def fmt_gib(n: float) -> str:
    return f"{n / (1 << 30):.1f} GiB" if n >= 1000 << 20 else f"{n / (1 << 20):.0f} MiB"


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def _cgroup_dirs() -> list[tuple[str, str, str, str]]:
    """(directory, limit file, usage file, version) of this process's memory cgroup and its
    parents, innermost first; a directory that is not visible here (a container's own namespace
    shows its cgroup as the root) is skipped."""
    out = []
    for line in (_read("/proc/self/cgroup") or "").splitlines():
        num, ctrl, path = (line.split(":", 2) + ["", ""])[:3]
        if num == "0" and ctrl == "":
            base, files = "/sys/fs/cgroup", ("memory.max", "memory.current", "2")
        elif "memory" in ctrl.split(","):
            base, files = "/sys/fs/cgroup/memory", ("memory.limit_in_bytes", "memory.usage_in_bytes", "1")
        else:
            continue
        parts = [p for p in path.split("/") if p]
        for k in range(len(parts), -1, -1):
            d = os.path.join(base, *parts[:k])
            if os.path.exists(os.path.join(d, files[0])):
                out.append((d, *files))
    return out


def available_memory() -> tuple[int, str]:
    """(bytes the applications may still allocate, where the figure comes from): MemAvailable of
    /proc/meminfo, or less when a memory cgroup of this process has a limit (limit - usage).
    ``$TRITONRESHARD_MEMORY_AVAILABLE`` (bytes) overrides both."""
    forced = os.environ.get(MEMORY_ENV)
    if forced:
        return int(forced), f"${MEMORY_ENV}"
    avail, how = None, ""
    for line in (_read("/proc/meminfo") or "").splitlines():
        if line.startswith("MemAvailable:"):
            avail, how = int(line.split()[1]) * 1024, "MemAvailable in /proc/meminfo"
    for d, limit_file, usage_file, _version in _cgroup_dirs():
        limit, usage = (_read(os.path.join(d, limit_file)) or "").strip(), _read(os.path.join(d, usage_file))
        if not limit.isdigit() or int(limit) >= _UNLIMITED or usage is None:
            continue  # "max" (v2) or the huge v1 number: no limit here
        room = max(0, int(limit) - int(usage))
        if avail is None or room < avail:
            avail, how = room, f"the memory cgroup's limit {fmt_gib(int(limit))} less {fmt_gib(int(usage))} in use"
    if avail is None:
        return 1 << 62, "unknown (no /proc/meminfo)"
    return avail, how


def memory_shortage(need: int, *, headroom: float = 0.1, available: tuple[int, str] | None = None) -> str | None:
    """None when ``need`` bytes fit in what is available less ``headroom`` (a share kept for the
    rest of the machine), else the part of a refusal that says what is available."""
    avail, how = available or available_memory()
    if need <= avail * (1 - headroom):
        return None
    return f"{fmt_gib(avail)} is available ({how}; the check leaves {headroom:.0%} of it to the rest of the machine)"


def oom_kill_counts() -> dict[str, int]:
    """OOM kills counted so far: the machine's (``oom_kill`` in /proc/vmstat) and each memory
    cgroup's of this process (``memory.events`` in v2, ``memory.oom_control`` in v1)."""
    out = {}
    for line in (_read("/proc/vmstat") or "").splitlines():
        if line.startswith("oom_kill "):
            out["the machine's oom_kill count (/proc/vmstat)"] = int(line.split()[1])
    for d, _, _, version in _cgroup_dirs():
        text = _read(os.path.join(d, "memory.events" if version == "2" else "memory.oom_control")) or ""
        for line in text.splitlines():
            if line.startswith("oom_kill "):
                out[f"the cgroup's oom_kill count ({d})"] = int(line.split()[1])
    return out


def _kernel_log() -> str | None:
    """The kernel log, when this process may read it (``dmesg`` often may not)."""
    try:
        out = subprocess.run(["dmesg"], capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout if out.returncode == 0 else None


def sigkill_cause(pid: int, counts_before: dict[str, int], counts_after: dict[str, int],
                  kernel_log: str | None) -> str:
    """Why process ``pid`` died of SIGKILL, as the end of "killed by SIGKILL": the kernel log naming
    it wins, then an OOM-kill counter that rose while it ran; else what the evidence allows (the
    driver did not send it: :meth:`Driver.stop` records the ranks it kills)."""
    for line in (kernel_log or "").splitlines():
        if re.search(rf"Killed process {pid}\b", line):
            what = line.split("]", 1)[-1].split(" total-vm")[0].strip()
            return f": out of memory (kernel log: {what})"
    rose = [f"{k} rose by {counts_after[k] - counts_before[k]}" for k in counts_after
            if k in counts_before and counts_after[k] > counts_before[k]]
    if rose:
        return f": likely out of memory ({'; '.join(rose)} during the run)"
    if kernel_log is None and not counts_after:
        return (": probably out of memory (the usual sender of SIGKILL is the kernel's out-of-memory "
                "killer; neither the kernel log nor an OOM-kill counter is readable here to confirm it)")
    return (": not by the out-of-memory killer as far as this machine tells (the kernel log and the "
            "OOM-kill counters show none); something else sent it")


def poll_until(ready: Callable[[], bool], *, timeout: float, what: str, tick: Callable[[], None] | None = None,
               interval: float = 0.02) -> None:
    """Returns once ``ready()`` is true; calls ``tick()`` between tries (progress, or a liveness check
    that raises); raises ``TimeoutError`` naming ``what`` after ``timeout`` seconds.

    The apps poll a TCPStore or a process table, never a hot path: the sleep starts at 1 ms and
    doubles up to ``interval``, so a quick answer is seen quickly and a long wait costs a round trip
    every ``interval`` at most (a blocking ``store.wait`` with a short timeout would log a warning
    per expiry)."""
    deadline = time.monotonic() + timeout
    sleep = 1e-3
    while True:
        if tick is not None:
            tick()
        if ready():
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(sleep)
        sleep = min(2 * sleep, interval)


def wait_key(pstore, key: str, timeout: float, check: Callable[[], None] | None = None) -> None:
    """A rank waits for ``key`` in the driver's store; stops at once when the driver set ``abort``
    (another rank failed), and calls ``check()`` (e.g. a liveness probe of refit peers) meanwhile."""
    def tick():
        if pstore.check(["abort"]):
            raise RuntimeError(f"stopped waiting for {key!r}: {pstore.get('abort').decode()}")
        if check is not None:
            check()
    poll_until(lambda: pstore.check([key]), timeout=timeout, what=repr(key), tick=tick)


# Messages of a collective whose peer process died, as gloo phrases them: name the cause, not the text.
_PEER_LOST = re.compile(r"Connection closed by peer|Connection reset by peer|Broken pipe|"
                        r"connection was closed|Socket Timeout|ECONNRESET", re.IGNORECASE)


_LOST = "a collective lost its connection to a peer process (it died or stopped)"
#: Errors that only report another rank's failure (``RankError.detail`` prefixes): a report lists
#: them after the failures that caused them, whatever the order they were recorded in (a rank that
#: fails records its error after its own clean-up, which its peers may notice first).
ECHOES = ("PeerDiedError:", "InferenceGroupStopped:", f"RuntimeError: {_LOST}")


def one_line(exc: BaseException) -> str:
    """``Type: message`` on one line (the first line of the message; gloo's long "connection closed
    by peer ... GLHF" becomes a plain statement of what it means)."""
    msg = str(exc).strip()
    if _PEER_LOST.search(msg):
        msg = _LOST
    first = msg.splitlines()[0] if msg else ""
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


@dataclass(frozen=True)
class RankError:
    """One failed rank. ``detail``: one line (the rank's own error, or how it died); ``time``: when it
    noticed the failure or died (wall clock); ``traceback``: the rank's full traceback, if it wrote one."""

    rank: int
    exitcode: int | None
    detail: str
    time: float
    traceback: str = ""

    @property
    def echo(self) -> bool:
        """True if this only reports another rank's failure (see :data:`ECHOES`)."""
        return self.detail.startswith(ECHOES)


class RankFailed(RuntimeError):
    """Raised by :meth:`Driver.wait` when ranks failed; ``errors``: one :class:`RankError` each,
    causes first, then echoes (each group earliest first)."""

    def __init__(self, errors: list[RankError], describe: Callable[[RankError], str]):
        self.errors = errors
        super().__init__("; ".join(describe(e) for e in errors))


def _rank_entry(target, rank: int, port: int, prefix: str, timeout: float, args: tuple,
                store_host: str = "127.0.0.1") -> None:
    def _sigterm(signum, frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, _sigterm)
    torch.set_num_threads(1)
    store = dist.TCPStore(store_host, port, is_master=False, timeout=datetime.timedelta(seconds=timeout))
    pstore = dist.PrefixStore(prefix, store)
    try:
        target(rank, store, pstore, *args)
    except SystemExit as e:
        _quiet_exit()
        if e.code in (0, None):
            raise
        pstore.set(f"error/{rank}", json.dumps({"time": time.time(), "detail": f"stopped (exit code {e.code})",
                                                 "traceback": ""}))
        raise
    except BaseException as e:  # noqa: BLE001 -- recorded for the driver, then the rank exits 1
        _quiet_exit()
        # "time": when this rank noticed the failure (an exception may carry an earlier moment).
        noticed = getattr(e, "noticed_at", None) or time.time()
        pstore.set(f"error/{rank}", json.dumps({"time": noticed, "detail": one_line(e),
                                                 "traceback": traceback.format_exc()}))
        # The driver prints one line per rank; a traceback here would be printed by multiprocessing
        # for every rank, echoes included. TRITONRESHARD_DEBUG=1 keeps the tracebacks on stderr.
        if os.environ.get("TRITONRESHARD_DEBUG"):
            traceback.print_exc()
        sys.exit(1)
    _quiet_exit()


def _standby_entry(conn, imports: tuple[str, ...], target, port: int, prefix: str, timeout: float,
                   args: tuple) -> None:
    """A spare process (:meth:`Driver.standby`): the interpreter is up, ``torch``, this module and
    ``target``'s module are imported (unpickling ``target`` imported it), and ``imports`` too (what
    the rank imports lazily); it waits for the rank it is to become, then runs it as a freshly
    spawned rank would. The driver closing its end first (it never needed this one, or it died)
    ends it quietly."""
    for name in imports:
        importlib.import_module(name)
    try:
        rank = conn.recv()
    except EOFError:
        return
    finally:
        conn.close()
    _rank_entry(target, rank, port, prefix, timeout, args)


def _quiet_exit() -> None:
    """The rank's endpoints are closed: a SIGTERM from now on just ends the process (a SystemExit
    raised inside the interpreter's exit hooks would only print an ignored-exception report)."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def sigterm_exits() -> None:
    """SIGTERM of the driver raises SystemExit(143), so its ``finally`` / ``with`` blocks stop the
    ranks and sweep what they left (the default action would kill the driver and orphan them).
    Only from the main thread, and only where nobody installed a handler of their own."""
    if threading.current_thread() is threading.main_thread() and \
            signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        def _exit(signum, frame):
            raise SystemExit(128 + signum)
        signal.signal(signal.SIGTERM, _exit)


class Driver:
    """Hosts a TCPStore and spawns ``world_size`` ranks running ``target(rank, store, pstore,
    *args)`` (``pstore``: the store under ``prefix``). ``role(rank)`` names a rank in messages. Use
    as a context manager, or call :meth:`close` in a ``finally``.

    Ranks on other hosts (``tritonreshard.apps.hosts``, network namespaces of this machine):
    ``store_host`` is the address they reach the store at (torch's master listens on every
    interface; default ``127.0.0.1``, this host), and ``executable(rank)`` the interpreter spawn
    execs for a rank (a host's launcher, ``Hosts[i].python``; None: this Python). Spares
    (:meth:`standby`) do not know their rank when they start, so they are this host's only."""

    def __init__(self, name: str, world_size: int, target, args: tuple = (), *, timeout: float,
                 prefix: str | None = None, role: Callable[[int], str] | None = None,
                 store_host: str = "127.0.0.1", executable: Callable[[int], str | None] | None = None):
        self.name, self.world_size, self.timeout = name, world_size, timeout
        self.prefix = prefix or name
        self.role = role or (lambda r: f"rank {r}")
        self.store_host, self._executable = store_host, executable
        self._target, self._args = target, args
        self._shm_before = our_shm_entries()
        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=timeout))
        self.pstore = dist.PrefixStore(self.prefix, self.store)
        self.procs: dict[int, object] = {}      # rank -> its current process
        self.exited_at: dict[int, float] = {}  # pid -> wall time the driver saw it exit
        self.closed = False
        self._oom_before = oom_kill_counts()  # a SIGKILLed rank: did the OOM killer count one meanwhile?
        self._killed: set[int] = set()        # pids the driver itself SIGKILLed (stop())
        self._sigkill_causes: dict[int, str] = {}
        self._spares: list[tuple[object, object]] = []  # (process, pipe end): standby()'s, not yet a rank
        self.launches: dict[int, dict] = {}  # rank -> how its current process was launched (start())
        sigterm_exits()

    # -- processes ------------------------------------------------------------------------------
    def start(self, ranks=None) -> None:
        """Starts ``ranks`` (default: all): each in a spare process of :meth:`standby` while one is
        left (no interpreter start, no imports), else a freshly spawned one. A rank started again
        (a restart) gets a new process. :attr:`launches` says, per rank, which (``"standby"`` or
        ``"spawn"``), its pid and when (``time.time()``) the process was created."""
        secret_for_children()  # children inherit it through the environment; it never crosses the store
        for r in (range(self.world_size) if ranks is None else ranks):
            self.pstore.delete_key(f"error/{r}")  # a restarted rank's predecessor's error is history
            spare = self._take_spare()
            if spare is not None:
                (p, conn), how = spare, "standby"
                conn.send(r)
                conn.close()
            else:
                p = mp.get_context("spawn").Process(
                    target=_rank_entry, name=f"trs-{self.name}-rank{r}",
                    args=(self._target, r, self.store.port, self.prefix, self.timeout, self._args, self.store_host))
                p.created_at, how = time.time(), "spawn"
                exe = self._executable(r) if self._executable is not None else None
                if exe is None:
                    p.start()
                else:  # spawn execs the interpreter it is told: a host's launcher execs this Python there
                    saved = mp_spawn.get_executable()
                    mp_spawn.set_executable(str(exe))
                    try:
                        p.start()
                    finally:
                        mp_spawn.set_executable(saved)
            self.procs[r] = p
            self.launches[r] = {"how": how, "pid": p.pid, "created_at": p.created_at}

    def standby(self, n: int, imports: tuple[str, ...] = ()) -> list[int]:
        """Starts ``n`` spare processes now, each importing what a rank needs (``target``'s module,
        and ``imports``: modules the rank would import later) and then waiting: a later
        :meth:`start` turns one into a rank at once (a restart then costs neither the interpreter's
        start nor ``import torch``, about 2 s here). Spares never used end at :meth:`close` (or
        when the driver dies: their pipe closes). Returns their pids."""
        if self._executable is not None or self.store_host != "127.0.0.1":
            raise ValueError(f"Driver.standby: spares start on this host before they know their rank; "
                             f"this driver places ranks elsewhere (store_host={self.store_host!r}, executable=)")
        secret_for_children()  # a spare's environment is the one a spawned rank would get
        ctx = mp.get_context("spawn")
        for i in range(n):
            reader, writer = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_standby_entry, name=f"trs-{self.name}-standby{i}",
                            args=(reader, tuple(imports), self._target, self.store.port, self.prefix, self.timeout,
                                  self._args))
            p.created_at = time.time()
            p.start()
            reader.close()  # the spare holds it; it reads EOF once the driver's end closes
            self._spares.append((p, writer))
        return [p.pid for p, _ in self._spares[-n:]] if n else []

    @property
    def spares(self) -> int:
        """Spare processes of :meth:`standby` not yet started as a rank."""
        return len(self._spares)

    def _take_spare(self):
        """A spare still alive (one that died waiting is dropped), or None."""
        while self._spares:
            p, conn = self._spares.pop(0)
            if p.is_alive():
                return p, conn
            conn.close()
            p.join(timeout=1)
        return None

    def exitcodes(self) -> dict[int, int | None]:
        """rank -> exit code (None: running). Reading ``exitcode`` reaps: a dead rank is no zombie."""
        codes = {r: p.exitcode for r, p in self.procs.items()}
        now = time.time()
        for r, c in codes.items():
            if c is not None:
                self.exited_at.setdefault(self.procs[r].pid, now)
        return codes

    def alive(self) -> list[int]:
        return [r for r, c in self.exitcodes().items() if c is None]

    def pids(self) -> dict[int, int]:
        return {r: p.pid for r, p in self.procs.items()}

    # -- errors ---------------------------------------------------------------------------------
    def _get(self, key: str):
        return json.loads(self.pstore.get(key)) if self.pstore.check([key]) else None

    def error(self, rank: int, code: int | None = None) -> RankError | None:
        """What went wrong with ``rank``: its recorded error, else how it died; None if nothing did."""
        rec = self._get(f"error/{rank}")
        if code is None:
            code = self.procs[rank].exitcode
        if rec is not None:
            return RankError(rank, code, rec["detail"], rec["time"], rec.get("traceback", ""))
        if code in (None, 0):
            return None
        when = self.exited_at.get(self.procs[rank].pid, time.time())
        if code < 0:
            detail = f"killed by {signal.Signals(-code).name}"
            kill = self._get("fault/kill")
            if kill is not None and kill["pid"] == self.procs[rank].pid:
                when, detail = kill["time"], detail + f" (--fault {kill['fault']})"
            elif code == -signal.SIGKILL and self.procs[rank].pid not in self._killed:
                pid = self.procs[rank].pid
                if pid not in self._sigkill_causes:  # once: the kernel log and counters do not change back
                    self._sigkill_causes[pid] = sigkill_cause(pid, self._oom_before, oom_kill_counts(), _kernel_log())
                detail += self._sigkill_causes[pid]
        else:
            detail = f"exited with code {code}"
        return RankError(rank, code, detail, when)

    def describe(self, e: RankError) -> str:
        """One line: ``rank 1 (trainer 1) exited with code 1: RuntimeError: ...``."""
        how = " (still running)" if e.exitcode is None else f" exited with code {e.exitcode}"
        detail = "" if e.detail == f"exited with code {e.exitcode}" else f": {e.detail}"
        return f"rank {e.rank} ({self.role(e.rank)}){how}{detail}"

    def failures(self, ranks=None) -> list[RankError]:
        """Every failed rank among ``ranks`` (default all): causes first, then echoes, each group
        earliest first."""
        codes = self.exitcodes()
        errs = [self.error(r, codes[r]) for r in (codes if ranks is None else ranks)]
        return sorted((e for e in errs if e is not None), key=lambda e: (e.echo, e.time, e.rank))

    def abort(self, reason: str) -> None:
        """Ranks waiting in :func:`wait_key` stop at once."""
        self.pstore.set("abort", reason)

    # -- waiting --------------------------------------------------------------------------------
    def wait(self, ready: Callable[[], bool], what: str, *, timeout: float | None = None,
             tick: Callable[[], None] | None = None, watch=None, settle: float = 5.0) -> None:
        """Returns once ``ready()``; raises :class:`RankFailed` when a rank of ``watch`` (default all)
        failed, ``TimeoutError`` after ``timeout`` (default: the driver's). ``settle``: seconds a rank
        that recorded its error gets to exit before the error is raised (so that it carries the exit
        code and the errors other ranks record meanwhile); 0 for a caller that acts at once."""
        def check():
            if tick is not None:
                tick()
            errs = self.failures(watch)
            if errs:
                # A rank records its error, then exits: give it a moment, so the report has its
                # exit code and the other ranks' errors that arrive meanwhile.
                for e in errs:
                    if e.exitcode is None and settle > 0:
                        self.procs[e.rank].join(timeout=settle)
                raise RankFailed(self.failures(watch), self.describe)
        poll_until(ready, timeout=self.timeout if timeout is None else timeout, what=what, tick=check)

    # -- lifetime -------------------------------------------------------------------------------
    def stop(self, ranks=None, grace: float = 5.0) -> list[int]:
        """SIGTERM to the running ``ranks`` (SystemExit in the rank: its endpoints close), SIGKILL to
        any still running after ``grace`` s. Returns the ranks that had to be stopped."""
        procs = {r: p for r, p in self.procs.items() if ranks is None or r in ranks}
        stopped = [r for r, p in procs.items() if p.is_alive()]
        for r in stopped:
            procs[r].terminate()
        deadline = time.monotonic() + grace
        for p in procs.values():
            p.join(timeout=max(0.0, deadline - time.monotonic()))
        for p in procs.values():
            if p.is_alive():
                self._killed.add(p.pid)
                p.kill()
                p.join(timeout=5)
        self.exitcodes()
        return stopped

    def close(self, join: float = 10.0) -> list[str]:
        """Joins the ranks (``join`` s), stops any left, and returns the engine segments (``trs-*``)
        that appeared in ``/dev/shm`` meanwhile. The ranks get the group secret from :meth:`start`,
        so the engine hands its segments over as memfds and names none, even for a rank that is
        SIGKILLed: any name here is a leak to report. None is removed, because a name cannot tell
        whose it is (another run on the machine may own it)."""
        if self.closed:
            return []
        self.closed = True
        for _, conn in self._spares:  # never became ranks: their pipe's EOF ends them
            conn.close()
        for p, _ in self._spares:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        self._spares = []
        deadline = time.monotonic() + join
        for p in self.procs.values():
            p.join(timeout=max(0.0, deadline - time.monotonic()))
        self.stop()
        return sorted(our_shm_entries() - self._shm_before)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        self.close(join=0.0 if exc_type is not None else 10.0)
        return False
