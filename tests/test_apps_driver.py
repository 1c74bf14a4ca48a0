"""The applications' shared process driver (apps/driver.py): one line per failed rank, abort
reaches waiting ranks, a killed rank is named, and SIGTERM of the driver leaves no rank behind.
Spawned processes with hard timeouts."""
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

import tritonreshard.apps.driver as driver_mod
from tritonreshard import PeerDiedError
from tritonreshard.apps.driver import (
    MEMORY_ENV,
    Driver,
    RankFailed,
    available_memory,
    memory_shortage,
    one_line,
    sigkill_cause,
    wait_key,
)

pytestmark = pytest.mark.slow


def _target(rank, store, pstore, mode):
    pstore.set(f"pid/{rank}", str(os.getpid()))
    if mode == "raise" and rank == 0:
        raise ValueError("bad input on rank 0\nsecond line that must not show")
    if mode == "kill" and rank == 0:
        os.kill(os.getpid(), signal.SIGKILL)
    if mode == "echo-first" and rank == 0:  # the cause, recorded after its peer's echo of it
        pstore.set("failing", "1")
        wait_key(pstore, "echoed", timeout=60)
        time.sleep(0.2)
        raise ValueError("the cause")
    if mode == "echo-first" and rank == 1:
        wait_key(pstore, "failing", timeout=60)
        try:
            raise PeerDiedError(0, "rank 1: rank 0 died while waiting for version 3")
        finally:
            pstore.set("echoed", "1")
    wait_key(pstore, "never", timeout=120)


def _role(rank):
    return f"worker {rank}"


def test_one_line_names_a_lost_peer():
    gloo = RuntimeError("[../gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:1. "
                        "This is typically caused by a remote worker crashing. GLHF!")
    assert one_line(gloo) == "RuntimeError: a collective lost its connection to a peer process (it died or stopped)"
    assert one_line(ValueError("a\nb")) == "ValueError: a"
    assert one_line(KeyError()) == "KeyError"


def test_failed_rank_is_one_line_and_abort_stops_the_others(capfd):
    with Driver("t", 2, _target, ("raise",), timeout=120, role=_role) as drv:
        drv.start()
        with pytest.raises(RankFailed) as exc:
            drv.wait(lambda: False, "nothing")
        assert str(exc.value) == "rank 0 (worker 0) exited with code 1: ValueError: bad input on rank 0"
        assert [e.rank for e in exc.value.errors] == [0]
        assert "Traceback" in exc.value.errors[0].traceback  # kept for debugging, never printed
        drv.abort("rank 0 failed")
        drv.wait(lambda: not drv.alive(), "rank 1 to stop", watch=[])
        err = drv.error(1)
        assert err.exitcode == 1 and err.detail == "RuntimeError: stopped waiting for 'never': rank 0 failed"
    assert "Traceback" not in capfd.readouterr().err


def test_report_lists_causes_before_their_echoes():
    """Rank 1's PeerDiedError is recorded before rank 0's own error (a failing rank records after
    its clean-up, which peers may notice first): the report still starts with rank 0's."""
    with Driver("t", 2, _target, ("echo-first",), timeout=120, role=_role) as drv:
        drv.start()
        drv.wait(lambda: not drv.alive(), "both ranks to fail", watch=[])
        errors = drv.failures()
        assert [e.rank for e in errors] == [0, 1], errors
        assert errors[0].detail == "ValueError: the cause" and not errors[0].echo
        assert errors[1].echo and errors[1].time < errors[0].time  # recorded first, listed second


def _standby_target(rank, store, pstore, mode):
    pstore.set(f"ran/{rank}", f"{os.getpid()} {int('colorsys' in sys.modules)}")


def test_spares_become_ranks_and_unused_ones_end_at_close():
    """standby(): spare processes import ahead (``imports``), and start() turns them into ranks (the
    same pids, the rank's target run in them); a rank with no spare left is spawned; a spare never
    used ends at close(), with no process left."""
    with Driver("t", 3, _standby_target, ("spare",), timeout=120, role=_role) as drv:
        spares = drv.standby(2, imports=("colorsys",))
        assert drv.spares == 2 and len(set(spares)) == 2
        drv.start()
        assert drv.spares == 0
        assert [drv.launches[r]["how"] for r in range(3)] == ["standby", "standby", "spawn"]
        assert [drv.procs[r].pid for r in (0, 1)] == spares
        drv.wait(lambda: not drv.alive(), "the ranks to finish")
        ran = [drv.pstore.get(f"ran/{r}").decode().split() for r in range(3)]
        assert [pid for pid, _ in ran] == [str(drv.procs[r].pid) for r in range(3)]
        assert [imported for _, imported in ran[:2]] == ["1", "1"]  # the spares imported it ahead
        unused = drv.standby(1)
    with pytest.raises(ProcessLookupError):  # ended and reaped by close()
        os.kill(unused[0], 0)


def test_killed_rank_is_named():
    with Driver("t", 2, _target, ("kill",), timeout=120, role=_role) as drv:
        drv.start()
        with pytest.raises(RankFailed) as exc:
            drv.wait(lambda: False, "nothing")
        # The rank killed itself (no OOM kill counted): the report says SIGKILL and what it knows.
        assert str(exc.value).startswith("rank 0 (worker 0) exited with code -9: killed by SIGKILL: ")
        stopped = drv.stop()
        assert stopped == [1] and drv.alive() == []


def test_killed_rank_with_an_oom_kill_counted_is_likely_out_of_memory(monkeypatch):
    """The cgroup's (or the machine's) OOM-kill counter rose while the rank ran: the report says so."""
    counts = iter([{"the cgroup's oom_kill count (/sys/fs/cgroup/x)": 3}])
    monkeypatch.setattr(driver_mod, "oom_kill_counts",
                        lambda: next(counts, {"the cgroup's oom_kill count (/sys/fs/cgroup/x)": 4}))
    monkeypatch.setattr(driver_mod, "_kernel_log", lambda: None)  # dmesg: not permitted
    with Driver("t", 2, _target, ("kill",), timeout=120, role=_role) as drv:
        drv.start()
        with pytest.raises(RankFailed) as exc:
            drv.wait(lambda: False, "nothing")
        assert str(exc.value) == ("rank 0 (worker 0) exited with code -9: killed by SIGKILL: likely out of memory "
                                  "(the cgroup's oom_kill count (/sys/fs/cgroup/x) rose by 1 during the run)")
        drv.stop()


def test_sigkill_cause_says_what_the_evidence_allows():
    log = ("[ 7.1] eth0: link up\n"
           "[ 132.6] Out of memory: Killed process 4242 (python3) total-vm:9000kB, anon-rss:8000kB, file-rss:0kB\n")
    assert sigkill_cause(4242, {}, {}, log) == (": out of memory (kernel log: Out of memory: Killed process 4242 "
                                                "(python3))")
    assert sigkill_cause(424, {}, {}, log).startswith(": not by the out-of-memory killer")  # 424 is not 4242
    machine = "the machine's oom_kill count (/proc/vmstat)"
    assert sigkill_cause(1, {machine: 0}, {machine: 2}, None) == \
        f": likely out of memory ({machine} rose by 2 during the run)"
    assert sigkill_cause(1, {}, {}, None).startswith(": probably out of memory (the usual sender")
    assert sigkill_cause(1, {machine: 5}, {machine: 5}, "").startswith(": not by the out-of-memory killer")


def test_available_memory_reads_the_machine_or_the_override(monkeypatch):
    monkeypatch.delenv(MEMORY_ENV, raising=False)
    avail, how = available_memory()
    assert avail > 0 and ("MemAvailable" in how or "cgroup" in how)
    monkeypatch.setenv(MEMORY_ENV, str(1 << 30))
    assert available_memory() == (1 << 30, f"${MEMORY_ENV}")
    assert memory_shortage(900 << 20) is None  # fits with 10% to spare
    assert memory_shortage(1000 << 20) == (f"1.0 GiB is available (${MEMORY_ENV}; the check leaves 10% of it to "
                                           f"the rest of the machine)")


DRIVER_SCRIPT = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {tests!r})
    from test_apps_driver import _target, _role
    from tritonreshard.apps.driver import Driver
    if __name__ == "__main__":
        drv = Driver("t", 2, _target, ("wait",), timeout=120, role=_role)
        try:
            drv.start()
            drv.wait(lambda: drv.pstore.check(["pid/0", "pid/1"]), "the ranks")
            print(drv.pstore.get("pid/0").decode(), drv.pstore.get("pid/1").decode(), flush=True)
            time.sleep(120)
        finally:
            drv.close(join=0.0)
""")


def test_sigterm_of_the_driver_stops_every_rank(tmp_path):
    script = tmp_path / "driver.py"
    script.write_text(DRIVER_SCRIPT.format(tests=os.path.dirname(__file__)))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert len(pids) == 2, proc.stderr.read()[-3000:]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 143
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    deadline = time.monotonic() + 10
    while any(os.path.exists(f"/proc/{p}") for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in pids if os.path.exists(f"/proc/{p}")], "ranks outlived their driver"
