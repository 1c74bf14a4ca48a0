"""Liveness of local peers: a pidfd says when a peer's process exited (a zombie too), from any
thread at once, and the answer stays right after the epoch's liveness closed."""
import os
import signal
import subprocess
import sys
import threading
import time

import torch.distributed as dist

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
