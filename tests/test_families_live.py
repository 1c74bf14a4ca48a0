"""The new families refitted live into a real vLLM TP=2 engine (vllm-cpu 0.32): one engine per family,
``examples/vllm_refit.py`` with its tiny model, two refits (Qwen3-Next: one) from two FSDP trainer processes, vLLM's
greedy tokens equal to the reference after each (and changed by each). The reference is
transformers' float32 greedy, except for the hybrid Qwen3-Next, which vllm-cpu runs only in
bfloat16: there it is a second vLLM engine started from the same weights saved as a checkpoint
(vLLM's own loader). gpt-oss's routed experts are transposed parts (vLLM holds them as
``box.permute(0, 2, 1)``). Granite has no hand-written recipe: both sides trace theirs from vLLM's
loader (the workers with ``init_info(trace=True)``), and the group checks they agree.

Left out of CI for time, run by hand: Mixtral (``--model tiny-mixtral``), GLM-4.5 MoE
(``--model tiny-glm4-moe``; gpt-oss covers routed experts live) and Gemma 3 (``--model tiny-gemma3``;
tests/test_vllm.py's Qwen2 covers tied embeddings live). Every tensor of each is
tests/test_families.py's (in-process). Skips where vLLM is not installed."""
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
@pytest.mark.parametrize("model", ["tiny-phi3", "tiny-gpt-oss", "tiny-qwen3-next", "tiny-granite"])
def test_family_refits_live_greedy_exact(model):
    # Qwen3-Next's reference is an engine start per version (26-31 s each here): one refit in CI.
    refits = 1 if model == "tiny-qwen3-next" else 2
    summary = _run_example("--model", model, "--tp", "2", "--refits", str(refits), timeout=540)
    assert summary["refits"] == refits and summary["tp"] == 2
    g = summary["greedy"]
    assert len(g) == refits + 1 and all(a != b for a, b in zip(g, g[1:]))  # each refit changed what vLLM generates
    traced = [w["trace_ms"] for w in summary["worker"]]
    assert all(t is not None and t > 0 for t in traced) if model == "tiny-granite" else traced == [None] * refits
    if model == "tiny-qwen3-next":  # bfloat16: the refitted version against a fresh engine of the same weights
        assert (summary["dtype"], summary["reference"]) == ("bfloat16", "vllm")
        assert len(summary["reference_engine_s"]) == refits
        assert summary["tokens_compared"] == refits * 3 * 8 and summary["mismatches"] == 0
    else:  # float32: the checkpoint and each refitted version against transformers
        assert (summary["dtype"], summary["reference"]) == ("float32", "transformers")
        assert summary["tokens_compared"] == (refits + 1) * 3 * 8 and summary["mismatches"] == 0
