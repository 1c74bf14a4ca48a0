"""Liveness of local peers: a pidfd says when a peer's process exited (a zombie too), from any
thread at once, and the answer stays right after the epoch's liveness closed. A peer that is alive
but silent (stopped, starved, hung) is never dead: a wait on it fails on its own timeout."""
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch.distributed as dist

import tritonreshard as trs
from tritonreshard.engine import Member
from tritonreshard.engine.liveness import Liveness


def _liveness(child_pid: int) -> Liveness:
    members = {0: Member(0, os.getpid(), "h", "cpu"), 1: Member(1, child_pid, "h", "cpu")}
    return Liveness(0, members, "h", peer_timeout=60.0, store=dist.HashStore())


def test_a_local_peer_is_dead_once_it_exited_even_unreaped_and_from_many_threads_at_once():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    live = _liveness(child.pid)
    try:
        errors, answers = [], []

        def ask():
            try:
                for _ in range(3000):
                    answers.append(live.dead_reason(1))
            except Exception as exc:  # noqa: BLE001 - any error here is the failure under test
                errors.append(exc)

        threads = [threading.Thread(target=ask) for _ in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == [] and set(answers) == {None}
        os.kill(child.pid, signal.SIGKILL)  # not reaped yet: a zombie
        deadline = time.monotonic() + 10
        while live.dead_reason(1) is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert live.dead_reason(1) == f"rank 1 (pid {child.pid}) died (zombie)"
        live.close()  # its pidfds are closed; /proc still answers
        assert live.dead_reason(1) == f"rank 1 (pid {child.pid}) died (zombie)"
    finally:
        child.kill()
        child.wait()
        live.close()


# ------------------------------------------------------------------ starved is not dead

def _group_watching(child_pid: int, peer_timeout: float):
    """Rank 0 of a 2-rank group whose rank 1 is ``child_pid``; rank 1's heartbeat slot in a real
    control block (this process writes it for the child: only its silence matters here)."""
    from tritonreshard.engine.group import Group
    from tritonreshard.transport import create_control_block

    group = Group(dist.HashStore(), rank=0, world_size=2, timeout=5.0, peer_timeout=peer_timeout)
    group.admit({0: Member(0, os.getpid(), group.host, "cpu"), 1: Member(1, child_pid, group.host, "cpu")})
    control = create_control_block(0, 2)
    control.heartbeat(1)  # its last beat: from now on, silent
    group.liveness.watch(1, control)
    return group, control


@pytest.mark.timeout(60)
def test_a_stopped_peer_is_silent_not_dead_a_hung_one_fails_the_wait_on_its_timeout_a_killed_one_at_once():
    """Load starves live processes (a CI run beside other jobs saw an 11 s silence): a peer that is
    alive per its pidfd is never dead for a missing heartbeat. SIGSTOPped for 3x peer_timeout and
    continued, it was never dead; a wait on it ends on the wait's own timeout, naming it silent;
    killed, the next look says so."""
    peer_timeout = 0.3
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    group, control = _group_watching(child.pid, peer_timeout)
    try:
        os.kill(child.pid, signal.SIGSTOP)
        stopped_until = time.monotonic() + 3 * peer_timeout
        while time.monotonic() < stopped_until:
            assert group.dead_peers() == [] and group.liveness.dead_reason(1) is None
            time.sleep(0.02)
        silent = group.liveness.silence(1)
        assert silent.startswith(f"rank 1 (pid {child.pid}) is alive (stopped) but sent no heartbeat for "), silent
        assert silent.endswith(f"(peer_timeout={peer_timeout:g} s): hung or starved"), silent
        os.kill(child.pid, signal.SIGCONT)  # alive and running again: still a member, never ended
        assert group.dead_peers() == [] and group.ended is None
        # Hung (alive, no progress): the wait fails on its own timeout, not peer_timeout, and names it.
        t0 = time.monotonic()
        with pytest.raises(TimeoutError) as info:
            group.wait(lambda: False, "rank 1 to ack version 2", 1.0, peers=[1], controls=[control])
        assert time.monotonic() - t0 >= 1.0
        msg = str(info.value)
        assert msg.startswith("rank 0: timed out after 1 s waiting for rank 1 to ack version 2; "), msg
        assert f"rank 1 (pid {child.pid}) is alive (" in msg and "hung or starved" in msg, msg
        assert group.ended is None  # a timeout fails that call only
        # Killed: dead at the next look, however fresh its heartbeat.
        control.heartbeat(1)
        child.kill()
        with pytest.raises(trs.PeerDiedError) as info:
            group.wait(lambda: False, "rank 1 to ack version 2", 30.0, peers=[1], controls=[control])
        assert str(info.value) == (f"rank 0: rank 1 (pid {child.pid}) died (zombie) while waiting for "
                                   f"rank 1 to ack version 2"), info.value
        assert time.monotonic() - t0 < 1.0 + 20  # at once (generous: a loaded CI box)
    finally:
        child.kill()
        child.wait()
        group.close()
        control.close()
        control.unlink()


@pytest.mark.timeout(60)
def test_a_cross_host_peer_is_dead_after_peer_timeout_of_looking_and_a_stall_of_ours_does_not_count():
    """A cross-host peer's counter that stands still for peer_timeout of this rank's looking is dead;
    a stretch in which this rank did not look (it was starved, or nobody waited) counts little."""
    store = dist.HashStore()
    members = {0: Member(0, os.getpid(), "h0", "cpu"), 1: Member(1, 12345, "h1", "cpu")}
    live = Liveness(0, members, "h0", peer_timeout=1.0, store=store)
    live.watch_remote([1])
    try:
        dist.PrefixStore("live/", store).add("hb/1", 1)  # rank 1 beat once, then went silent
        live.start()
        assert live.dead_reason(1) is None            # asked: the store thread starts looking
        time.sleep(0.6)
        assert live.dead_reason(1) is None            # first look: the counter is new
        time.sleep(3.0)                               # nobody asked (this rank "stalled") for 3x peer_timeout
        assert live.dead_reason(1) is None, "our own stall made a peer dead"
        deadline = time.monotonic() + 30
        while live.dead_reason(1) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        reason = live.dead_reason(1)
        assert reason.startswith("rank 1 (pid 12345 on host 'h1', whose ranks are [1]) sent no heartbeat for "), reason
        assert reason.endswith("(peer_timeout=1 s): that host is lost, or cut off from the group's store"), reason
    finally:
        live.close()


class _Partitioned(dist.Store):
    """A store whose calls hang (``mode="hang"``, a partition: TCP retransmits until the store's
    timeout) or fail (``"fail"``, its host gone) once cut; a HashStore otherwise."""

    def __init__(self):
        super().__init__()
        self.inner, self.mode, self.release = dist.HashStore(), None, threading.Event()

    def _cut(self):
        if self.mode == "hang":
            self.release.wait(60)
        elif self.mode == "fail":
            raise dist.DistNetworkError("Connection reset by peer")

    def add(self, key, value):
        self._cut()
        return self.inner.add(key, value)

    def check(self, keys):
        self._cut()
        return self.inner.check(keys)

    def set(self, key, value):
        self._cut()
        return self.inner.set(key, value)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["hang", "fail"])
def test_a_store_that_does_not_answer_makes_the_other_hosts_unreachable_without_blocking_a_wait(mode):
    """Cut off from the group's store, this rank can hear no peer on another host: after peer_timeout
    each of them is unreachable, named with its host and that host's ranks. The wait that asks is
    never blocked on the store itself (the store thread is), and local heartbeats go on."""
    store = _Partitioned()
    members = {0: Member(0, os.getpid(), "h0", "cpu"), 1: Member(1, 12345, "h1", "cpu"),
               2: Member(2, 12346, "h1", "cpu")}
    live = Liveness(0, members, "h0", peer_timeout=1.0, store=store)
    live.watch_remote([1, 2])
    live.start()
    try:
        assert live.dead_reason(1) is None
        store.mode = mode
        deadline = time.monotonic() + 30
        while live.dead_reason(2) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        reason = live.dead_reason(2)
        assert reason.startswith("host 'h1' (ranks [1, 2]) is unreachable from this rank's host 'h0': the group's "
                                 "store has not answered for "), reason
        assert "so rank 2 cannot be heard" in reason, reason
        store.mode = None     # healed: heard again at the next beat
        store.release.set()
        deadline = time.monotonic() + 30
        while live.dead_reason(2) is not None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert live.dead_reason(2) is None
    finally:
        store.mode = None
        store.release.set()
        live.close()
