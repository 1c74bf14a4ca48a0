"""The new families refitted live into a real vLLM TP=2 engine (vllm-cpu 0.32): one engine per family,
``examples/vllm_refit.py`` with its tiny model, two refits from two FSDP trainer processes, vLLM's
greedy tokens equal to transformers' after each (and changed by each). Skips where vLLM is not
installed. The per-tensor exactness of every family is tests/test_families.py's (in-process)."""
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="vLLM not installed (pip install -e '.[vllm]')")


def _run_example(*args, timeout):
    """One live engine: examples/vllm_refit.py with ``args``; returns its JSON summary."""
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND="0|1")
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "vllm_refit.py"), *args, "--json"],
                          capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    lines = proc.stdout.strip().splitlines()
    # A string, not a tuple: pytest shortens a tuple's repr to a line, which cut the worker's error off.
    assert lines and lines[-1].startswith("{"), (f"exit {proc.returncode}\n--- stdout\n{proc.stdout[-3000:]}\n"
                                                 f"--- stderr\n{proc.stderr[-6000:]}")
    summary = json.loads(lines[-1])
    assert proc.returncode == 0 and summary["ok"], (summary, proc.stderr[-4000:])
    return summary


@needs_vllm
@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("model", ["tiny-phi3", "tiny-mixtral", "tiny-glm4-moe", "tiny-gemma3"])
def test_family_refits_live_greedy_exact(model):
    summary = _run_example("--model", model, "--tp", "2", "--refits", "2", timeout=540)
    assert summary["refits"] == 2 and summary["tp"] == 2
    assert summary["tokens_compared"] == 3 * 3 * 8 and summary["mismatches"] == 0
    g = summary["greedy"]
    assert g[0] != g[1] and g[1] != g[2]  # each refit changed what vLLM generates
