"""Issue 6, Faults: the demo with a rank SIGKILLed mid-refit (``--fault kill-trainer:K`` /
``kill-inference:K``), end to end in a subprocess with a hard timeout, on the CPU."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tritonreshard.apps import demo
from tritonreshard.transport import SHM_PREFIX

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow
PEER_TIMEOUT = 5.0


def _shm() -> set:
    """Our own /dev/shm names only: other programs' entries (psm_*, sem.mp-*) come and go."""
    if not os.path.isdir("/dev/shm"):
        return set()
    return {n for n in os.listdir("/dev/shm") if n.startswith(SHM_PREFIX)}


def _alive(pid: int) -> bool:
    """True if ``pid`` is still one of the demo's ranks (a reused pid running something else is not)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return b"multiprocessing" in cmd


def _run_fault(fault: str, steps: int = 3):
    before = _shm()
    cmd = [sys.executable, "-m", "tritonreshard.apps.demo", "--json", "--timeout", "150", "--steps", str(steps),
           "--peer-timeout", str(PEER_TIMEOUT), "--fault", fault]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert out.returncode == 1, (out.returncode, out.stderr[-5000:])
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert tuple(summary) == demo.SUMMARY_KEYS + demo.FAILURE_KEYS
    assert summary["fault"] == fault and summary["verified"] is False
    assert isinstance(summary["error"], str) and summary["error"]
    assert _shm() - before == set(), "a fault left /dev/shm entries behind"
    assert len(summary["pids"]) == 6
    survivors = [p for p in summary["pids"] if _alive(p)]
    assert not survivors, f"demo ranks still running after the driver exited: {survivors}"
    return out, summary


def test_kill_trainer_keeps_last_complete_version():
    k = 2
    out, s = _run_fault(f"kill-trainer:{k}")
    assert "tritonreshard demo failed: rank 0 (trainer 0) exited with code -9: killed by SIGKILL" in out.stderr, \
        out.stderr[-3000:]
    assert s["error"].startswith("rank 0 (trainer 0)")
    # The kill lands once the inference group started pulling K. A pull of K that completed (copied,
    # checked and acked) before the trainer died is a complete version; one still in flight is
    # rejected by the post-copy liveness check. So the group serves K-1 or K, the same version on
    # every rank, consistent, its gathered weights checked against the trainers' digest.
    served = s["inference_version"]
    assert served in (k - 1, k), s
    assert s["inference_consistent"] is True, s
    assert s["error"].count(f"the inference group serves version {served}") == 4, s["error"]
    # Every survivor noticed within the bound (peer_timeout), with a generous margin for a busy CI box.
    assert s["detect_ms"] is not None and 0 <= s["detect_ms"] < 1e3 * (PEER_TIMEOUT + 10), s


def test_kill_inference_fails_the_refit_clearly():
    k = 2
    out, s = _run_fault(f"kill-inference:{k}")
    dead = "rank 2 (inference, TP rank 0)"
    assert f"tritonreshard demo failed: {dead} exited with code -9: killed by SIGKILL" in out.stderr, \
        out.stderr[-3000:]
    # The trainers' fence names the dead reader instead of waiting for it forever.
    assert "PeerDiedError" in s["error"] and "rank 2 (pid" in s["error"], s["error"]
    assert s["detect_ms"] is not None and 0 <= s["detect_ms"] < 1e3 * (PEER_TIMEOUT + 10), s
