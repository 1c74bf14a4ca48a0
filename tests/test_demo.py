"""The RL refit demo and the standalone example, end to end in subprocesses (spawned ranks, hard
timeouts), on the CPU."""
import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tritonreshard.apps import demo

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def _shm() -> set:
    # sem.mp-* are multiprocessing semaphores; the demo never creates any, but a concurrent pytest
    # session on the same machine does, so they would make this check flaky.
    if not os.path.isdir("/dev/shm"):
        return set()
    return {n for n in os.listdir("/dev/shm") if not n.startswith("sem.mp-")}


def _run_demo(*extra, timeout=240, env=None):
    cmd = [sys.executable, "-m", "tritonreshard.apps.demo", "--json", "--timeout", "180", *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env={**os.environ, **(env or {})})


@pytest.mark.parametrize("mode", ["shadow", "inplace"])
def test_demo_runs_and_verifies(tmp_path, mode):
    before = _shm()
    png = tmp_path / "demo.png"
    steps = 5
    out = _run_demo("--steps", str(steps), "--mode", mode, "--png", str(png))
    assert out.returncode == 0, out.stderr[-5000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert tuple(summary) == demo.SUMMARY_KEYS
    assert summary["verified"] is True
    assert summary["steps"] == steps
    assert summary["refits"] == steps  # one refit per published version after the first
    for key in ("reward_first", "reward_last"):
        assert math.isfinite(summary[key]) and 0.0 <= summary[key] <= 1.0, summary
    assert summary["refit_ms_p50"] > 0 and math.isfinite(summary["refit_ms_p50"])
    assert 0 <= summary["max_inference_stall_ms"] < 60_000
    # Every inference rank receives its TP shards: at least the whole model once (replicated
    # tensors count once per rank).
    assert summary["bytes_per_refit"] > 0
    assert 0 <= summary["staleness_max"] <= 2
    assert png.is_file() and png.stat().st_size > 10_000
    assert _shm() - before == set(), "the demo left /dev/shm entries behind"


def test_demo_failing_rank_is_named(tmp_path):
    before = _shm()
    out = _run_demo("--steps", "4", "--fault", "crash-trainer:3")
    assert out.returncode != 0
    assert "rank 1 (trainer 1) exited with code 1: RuntimeError: injected failure" in out.stderr, out.stderr[-3000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert tuple(summary) == demo.SUMMARY_KEYS + demo.FAILURE_KEYS
    assert summary["error"].startswith("rank 1 (trainer 1)"), summary["error"]
    assert _shm() - before == set(), "a failed run left /dev/shm entries behind"


def test_demo_rejects_bad_arguments(capsys):
    parser = demo.add_arguments(argparse.ArgumentParser())
    assert demo.run(parser.parse_args(["--inference", "3", "--steps", "0"])) == 2
    err = capsys.readouterr().err
    assert "--inference=3" in err and "--steps=0" in err
    for bad in ("kill-trainer:1", "kill-trainer:7", "explode:2", "kill-inference:x"):
        assert demo.run(parser.parse_args(["--steps", "5", "--fault", bad])) == 2
        assert f"--fault={bad!r}" in capsys.readouterr().err
    assert demo.run(parser.parse_args(["--peer-timeout", "0"])) == 2
    assert "--peer-timeout=0" in capsys.readouterr().err


def test_example_rl_refit():
    before = _shm()
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "rl_refit.py")], capture_output=True,
                         text=True, timeout=180, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-5000:]
    assert "bit for bit" in out.stdout
    assert _shm() - before == set()
