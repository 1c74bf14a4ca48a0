"""The RL refit demo and the standalone example, end to end in subprocesses (spawned ranks, hard
timeouts), on the CPU."""
import argparse
import json
import math
import os
import re
import secrets
import subprocess
import sys
from pathlib import Path

import pytest

from tritonreshard.apps import demo
from tritonreshard.apps.driver import our_shm_entries

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def _shm() -> set:
    # Only the engine's own names: other programs (psm_*, sem.mp-* of a concurrent run) come and go.
    return our_shm_entries()


def _run_demo(*extra, timeout=240, env=None):
    cmd = [sys.executable, "-m", "tritonreshard.apps.demo", "--json", "--timeout", "240", *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env={**os.environ, **(env or {})})


@pytest.mark.parametrize("mode", ["shadow", "inplace"])
def test_demo_runs_and_verifies(tmp_path, mode):
    before = _shm()
    png = tmp_path / "demo.png"
    steps = 5
    out = _run_demo("--steps", str(steps), "--mode", mode, "--png", str(png))
    assert out.returncode == 0, out.stderr[-5000:]
    lines = out.stdout.strip().splitlines()
    summary = json.loads(lines[-1])
    assert tuple(summary) == demo.SUMMARY_KEYS
    assert summary["verified"] is True
    # The summary line and where the picture went are on stdout, the progress on stderr.
    assert any(line.startswith(f"tritonreshard demo: {steps} steps") for line in lines), out.stdout
    assert f"wrote {png}" in out.stdout
    assert "starting 6 processes" in out.stderr
    assert summary["recoveries"] == 0 and summary["recovery_ms"] is None
    assert isinstance(summary["staging_bytes"], int) and summary["staging_bytes"] >= 0
    assert len(set(summary["inference_pids"])) == 4
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
    # One line per failed rank: no rank's traceback, no gloo text, in the output or the JSON.
    assert "Traceback" not in out.stderr and "Traceback" not in summary["error"], out.stderr[-3000:]
    assert "gloo" not in out.stderr and "GLHF" not in summary["error"]
    failed = [int(m.group(1)) for m in re.finditer(r"^(?:tritonreshard demo failed: |  )rank (\d+) \(",
                                                    out.stderr, re.M)]
    assert failed and failed[0] == 1 and len(failed) == len(set(failed)), out.stderr[-3000:]
    assert _shm() - before == set(), "a failed run left /dev/shm entries behind"


def test_demo_restarts_trainers_and_keeps_inference_processes():
    """--restart: trainer rank 0 SIGKILLed while the inference group pulls version 4; the trainer
    group restarts from its checkpoint, the same inference processes join the new epoch, and every
    refit (before and after) verifies bit for bit."""
    before = _shm()
    steps = 10
    out = _run_demo("--steps", str(steps), "--fault", "kill-trainer:4", "--restart", "--peer-timeout", "5",
                    timeout=420)
    assert out.returncode == 0, out.stderr[-5000:]
    s = json.loads(out.stdout.strip().splitlines()[-1])
    assert tuple(s) == demo.SUMMARY_KEYS
    assert s["verified"] is True and s["steps"] == steps, s
    assert s["recoveries"] == 1, s
    assert s["recovery_ms"] is not None and s["recovery_ms"] > 0, s
    # The breakdown, not a wall time: the parts are in order and add up to the whole, and the new
    # trainers ran in the spares the driver had started (no interpreter start, no imports), so
    # launching them is no part of the restart's time but a pipe message.
    parts = s["recovery_parts_ms"]
    assert list(parts) == ["detect", "stop", "launch", "resume", "step", "refit"], parts
    assert all(v >= 0 for v in parts.values()), parts
    assert sum(parts.values()) == pytest.approx(s["recovery_ms"], abs=1e-3), (parts, s["recovery_ms"])
    assert s["recovery_launch"] == "standby", s
    # Version 4's pull was broken by the kill and dropped, so one refit fewer than versions
    # published after the first; every installed version verified (``verified`` above).
    assert steps - 1 <= s["refits"] <= steps, s
    # The driver checked that each inference rank reported the same pid at its start and its end,
    # and these are the processes it spawned at the start (one per TP rank).
    assert len(set(s["inference_pids"])) == 4
    assert "restarting the trainer group" in out.stderr
    assert _shm() - before == set(), "a restart left /dev/shm entries behind"


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
    assert demo.run(parser.parse_args(["--restart", "--mode", "inplace"])) == 2
    assert "--restart needs --mode=shadow" in capsys.readouterr().err


def test_demo_bad_png_path_fails_first(tmp_path, capsys):
    """A figure path that cannot be written is reported at once, in one line, before any process starts."""
    parser = demo.add_arguments(argparse.ArgumentParser())
    missing = tmp_path / "no" / "such" / "folder" / "demo.png"
    assert demo.run(parser.parse_args(["--png", str(missing)])) == 2
    err = capsys.readouterr().err
    assert f"--png={str(missing)!r}" in err and "does not exist" in err and "Traceback" not in err
    assert demo.run(parser.parse_args(["--png", str(tmp_path / "demo.txt")])) == 2
    assert ".png" in capsys.readouterr().err


def test_demo_refuses_when_its_processes_do_not_fit(monkeypatch, capsys):
    """Checked before any process starts, from the available memory (here the override)."""
    from tritonreshard.apps.driver import MEMORY_ENV
    parser = demo.add_arguments(argparse.ArgumentParser())
    monkeypatch.setenv(MEMORY_ENV, str(1 << 30))
    assert demo.run(parser.parse_args([])) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("tritonreshard demo: not enough memory: 6 processes (2 trainers x 300 MiB, 4 inference x "
                          "224 MiB, the driver 320 MiB) need about 1.8 GiB at their peak, and 1.0 GiB is available")
    assert "--trainers 1 --inference 1, need about 844 MiB" in err and "starting" not in err
    monkeypatch.setenv(MEMORY_ENV, str(64 << 30))
    assert demo.cli.memory_refusal(parser.parse_args([])) is None


def _check_example_output(out):
    assert out.returncode == 0, out.stderr[-5000:]
    lines = out.stdout.splitlines()
    # Whole lines only: every line is one of the example's own, none run into another.
    kinds = ("trainer: step ", "inference rank ", "done: ")
    assert all(line.startswith(kinds) for line in lines), out.stdout
    assert sum(line.startswith("trainer: step ") for line in lines) == 5
    assert sorted(line.split(":")[0] for line in lines if line.startswith("inference rank ")) == \
        ["inference rank 1", "inference rank 2"]
    assert all(line.count("bit for bit") <= 1 for line in lines)
    assert lines.count("done: every inference rank serves the trainer's final weights, bit for bit") == 1


def test_example_rl_refit():
    before = _shm()
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "rl_refit.py")], capture_output=True,
                         text=True, timeout=180, cwd=ROOT)
    _check_example_output(out)
    assert _shm() - before == set()


def test_example_rl_refit_under_torchrun():
    """``TRITONRESHARD_GROUP_SECRET=... torchrun --standalone --nproc-per-node 3 examples/rl_refit.py``:
    the endpoints meet in the job's own store (the launcher's rendezvous and the default process
    group), no port clash. That store listens on every interface, so the secret comes from the
    environment, as the example's docstring says."""
    before = _shm()
    env = {**os.environ, "TRITONRESHARD_GROUP_SECRET": secrets.token_hex(32)}
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3",
                          str(ROOT / "examples" / "rl_refit.py")], capture_output=True, text=True, timeout=240,
                         cwd=ROOT, env=env)
    _check_example_output(out)
    assert _shm() - before == set()


@pytest.mark.parametrize("example", sorted(p.name for p in (ROOT / "examples").glob("*.py")))
def test_examples_import_nothing_private(example):
    """Examples are what users copy: they use the public API only."""
    import ast
    tree = ast.parse((ROOT / "examples" / example).read_text())
    private = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tritonreshard"):
            names = node.module.split(".") + [a.name for a in node.names]
            private += [n for n in names if n.startswith("_")]
        elif isinstance(node, ast.Import):
            private += [p for a in node.names if a.name.startswith("tritonreshard")
                        for p in a.name.split(".") if p.startswith("_")]
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "trs":
            if node.attr.startswith("_"):
                private.append(node.attr)
    assert private == [], private
