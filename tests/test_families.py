"""The families of :mod:`tritonreshard.recipes.families` (Mixtral, Phi-3, GLM-4.5 MoE, Gemma 3) and
:mod:`~tritonreshard.recipes.hybrid` (Qwen3-Next, Qwen3.5 and Qwen3.5-MoE), every tensor of every TP
rank checked bit for bit against what vLLM 0.32's own ``load_weights`` puts there. (vLLM's Qwen3.5
module imports torchvision, which has no CPU build here: the probe gets tests/_standin's.)

The reference is vLLM itself: a tiny model of each family is built from its transformers config,
refilled with provenance-coded values (every element distinct), saved with ``save_pretrained`` (so
vLLM reads the checkpoint format transformers writes: Mixtral's per-expert ``w1``/``w3``/``w2``,
GLM's per-expert ``gate_proj``..., Phi-3's fused ``qkv_proj``), and loaded at TP 1, 2 and 4 (and
expert parallel) by ``tests/_vllm_probe.py``, one probe run for every case. The refit's output, from
the same model's transformers 5 parameters over FSDP trainers, must equal each rank's
``named_parameters()``: the same names, shapes, dtypes and bits.
"""
import json
import subprocess
from pathlib import Path

import pytest
import torch

import tritonreshard as trs

transformers = pytest.importorskip("transformers")

TRAINERS = [0, 1]
COMMON = dict(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
# The hybrids': a gated-DeltaNet layer then a gated full-attention one, 4 key / 8 value linear heads
HYBRID = dict(COMMON, head_dim=8, linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=8,
              linear_value_head_dim=8, linear_conv_kernel_dim=4, layer_types=["linear_attention", "full_attention"])


def _configs():
    return {
        # 6 experts: over 4 EP ranks vLLM places 2, 2, 1, 1
        "mixtral": transformers.MixtralConfig(intermediate_size=16, head_dim=8, num_local_experts=6,
                                              num_experts_per_tok=2, **COMMON),
        "phi3": transformers.Phi3Config(intermediate_size=48, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                        **COMMON),
        "glm4_moe": transformers.Glm4MoeConfig(intermediate_size=48, moe_intermediate_size=16, head_dim=8,
                                               n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
                                               first_k_dense_replace=1, partial_rotary_factor=0.5,
                                               attention_bias=True, use_qk_norm=True, n_group=1, topk_group=1,
                                               **COMMON),
        "gemma3": transformers.Gemma3TextConfig(intermediate_size=48, head_dim=8, sliding_window=16, **COMMON),
        "gemma3_untied": transformers.Gemma3TextConfig(intermediate_size=48, head_dim=8, sliding_window=16,
                                                       attention_bias=True, tie_word_embeddings=False, **COMMON),
        # the hybrid: one block of in_proj_qkvz / in_proj_ba, interleaved by key-head group; experts
        "qwen3_next": transformers.Qwen3NextConfig(
            intermediate_size=48, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
            shared_expert_intermediate_size=16, **HYBRID),
        # Qwen3.5: the same hybrid with separate in_proj_qkv / z / b / a (vLLM fuses them in blocks), dense
        "qwen3_5": transformers.Qwen3_5TextConfig(intermediate_size=48, **HYBRID),
        # Qwen3.5-MoE: every layer routed experts and a gated shared expert
        "qwen3_5_moe": transformers.Qwen3_5MoeTextConfig(
            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16,
            **HYBRID),
    }


ARCHITECTURES = {"mixtral": "MixtralForCausalLM", "phi3": "Phi3ForCausalLM", "glm4_moe": "Glm4MoeForCausalLM",
                 "gemma3": "Gemma3ForCausalLM", "gemma3_untied": "Gemma3ForCausalLM",
                 "qwen3_next": "Qwen3NextForCausalLM", "qwen3_5": "Qwen3_5ForCausalLM",
                 "qwen3_5_moe": "Qwen3_5MoeForCausalLM"}

# (family, tp, expert parallel, vLLM dtype): TP 1, 2, 4 for each (4 > the 2 KV heads: replicated KV
# heads, for Phi-3 from its fused qkv_proj), EP where there are experts (Mixtral's uneven), and
# one bfloat16 run for the dtypes (GLM's float32 router).
REAL_CASES = [(f, tp, False, "float32") for f in ARCHITECTURES for tp in (1, 2, 4)] + [
    ("mixtral", 2, True, "float32"), ("mixtral", 4, True, "float32"), ("glm4_moe", 2, True, "float32"),
    ("glm4_moe", 4, True, "float32"), ("glm4_moe", 2, False, "bfloat16"), ("phi3", 4, False, "bfloat16"),
    ("qwen3_next", 2, True, "float32"), ("qwen3_next", 4, True, "float32"), ("qwen3_next", 2, False, "bfloat16"),
    ("qwen3_5", 2, False, "bfloat16"), ("qwen3_5_moe", 2, True, "float32")]


def _hf_model(config):
    """A real HF model whose parameters (and GLM's e_score_correction_bias buffer) hold distinct
    values (provenance), exactly representable in float32."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    offset = 0
    tensors = list(model.named_parameters()) + [(n, b) for n, b in model.named_buffers()
                                                 if n.endswith("e_score_correction_bias")]
    with torch.no_grad():
        for _, p in tensors:
            p.copy_((torch.arange(p.numel(), dtype=torch.float32) + offset).reshape(p.shape) / 1024)
            offset += p.numel()
    return model, {n: p.detach().clone() for n, p in tensors}


def _refit(spec, full):
    plan = spec.plan()
    src = {r: {n: lay.shard(full[n], r) for n, lay in spec.src.items()} for r in TRAINERS}
    out = {r: {n: torch.full(lay.local_shape(r), float("nan"), dtype=lay.dtype) for n, lay in spec.dst.items()}
           for r in next(iter(spec.dst.values())).ranks}
    return trs.execute_local(plan, src, out=out, backend="torch")


def _spec(arch, tp, ep, dtype):
    return trs.recipes.hf_to_vllm(_configs()[arch], tp=tp, trainer_ranks=TRAINERS,
                                  inference_ranks=list(range(2, 2 + tp)), dtype=getattr(torch, dtype),
                                  expert_parallel=ep)


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_sources_are_the_hf_parameters(arch):
    """The source side is exactly the transformers model's tensors (names and global shapes)."""
    _, full = _hf_model(_configs()[arch])
    spec = _spec(arch, 2, False, "float32")
    assert {n: tuple(t.shape) for n, t in full.items()} == {n: lay.shape for n, lay in spec.src.items()}


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_checkpoint_views_are_what_save_pretrained_writes(arch, tmp_path):
    """What verify= and the tracer feed vLLM's load_weights (checkpoint_views of the trainers'
    in-memory tensors) is, name for name and bit for bit, the checkpoint transformers itself writes
    (Mixtral: its experts' w1/w3/w2 and block_sparse_moe, renamed in memory by transformers 5)."""
    from safetensors.torch import load_file

    from tritonreshard.recipes.trace import checkpoint_views

    config = _configs()[arch]
    model, full = _hf_model(config)
    model.save_pretrained(tmp_path)
    written = {}
    for f in sorted(tmp_path.glob("*.safetensors")):
        written.update(load_file(f))
    views = {k: v for n, t in full.items() for k, v in checkpoint_views(n, t, config.model_type)}
    assert sorted(views) == sorted(written)
    assert [k for k in written if not torch.equal(views[k], written[k])] == []
    if arch == "mixtral":  # not vacuous: without the model type, the in-memory names are fed
        assert not set(k for n, t in full.items() for k, _ in checkpoint_views(n, t)) & {
            k for k in written if ".experts." in k}


@pytest.fixture(scope="module")
def real_vllm(tmp_path_factory):
    """``{case: [each TP rank's named_parameters()]}`` from one run of tests/_vllm_probe.py."""
    # Lazy: the probe's Python and the free ports are this fixture's alone.
    import sys

    from _mp import free_port
    from _torchvision import probe_env

    root = tmp_path_factory.mktemp("families-probe")
    for arch in ARCHITECTURES:
        config = _configs()[arch]
        config.architectures = [ARCHITECTURES[arch]]
        model, _ = _hf_model(config)
        model.save_pretrained(root / arch)
        from safetensors.torch import load_file  # lazy: only this fixture reads the checkpoint back
        torch.save(load_file(root / arch / "model.safetensors"), root / arch / "full.pt")
    ordered = sorted(REAL_CASES, key=lambda c: -c[1])  # largest worlds first (see test_recipes.real_vllm)
    cases = [dict(model_dir=str(root / arch), world=tp, port=free_port(), ep=ep, dtype=dtype,
                  out=str(root / f"{arch}-tp{tp}-ep{int(ep)}-{dtype}")) for arch, tp, ep, dtype in ordered]
    (root / "cases.json").write_text(json.dumps(cases))
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("_vllm_probe.py")), str(root / "cases.json")],
                          capture_output=True, text=True, timeout=780, env=probe_env())
    from _vllm_probe import NO_VLLM

    if proc.returncode == 3 and proc.stdout.startswith(NO_VLLM):  # the probe's own check of the import
        pytest.skip(f"`import vllm` fails: {proc.stdout[len(NO_VLLM):].strip()}")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return {c: [torch.load(f"{case['out']}.{r}.pt") for r in range(c[1])]
            for c, case in zip(ordered, cases, strict=True)}


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("arch,tp,ep,dtype", REAL_CASES)
def test_family_equals_real_vllm_load_weights(real_vllm, arch, tp, ep, dtype):
    """vLLM itself (TP over gloo, its own load_weights) holds exactly what the refit writes, on
    every rank: names, shapes, dtypes, bits."""
    _, full = _hf_model(_configs()[arch])
    spec = _spec(arch, tp, ep, dtype)
    got = _refit(spec, full)
    compared = 0
    for tp_rank in range(tp):
        vllm, mine = real_vllm[arch, tp, ep, dtype][tp_rank], got[2 + tp_rank]
        assert sorted(vllm) == sorted(mine), f"rank {tp_rank}: names differ"
        for name, w in vllm.items():
            assert w.dtype == mine[name].dtype and w.shape == mine[name].shape, (tp_rank, name, w.dtype, w.shape)
            assert torch.equal(w.view(torch.uint8), mine[name].view(torch.uint8)), (tp_rank, name)
            compared += 1
    assert compared == tp * len(spec.dst)
    print(f"{arch} tp={tp} ep={ep} {dtype}: {compared} tensors equal")


def test_problems_are_reported_at_once():
    with pytest.raises(ValueError) as e:
        trs.recipes.hf_to_vllm(_configs()["glm4_moe"], tp=3, trainer_ranks=TRAINERS, inference_ranks=[2, 3, 4],
                               quantization="fp8-block")
    msg = str(e.value)
    for part in ("glm4_moe", "num_attention_heads=4 is not divisible by tp=3", "padded vocab 128",
                 "the experts' intermediate size=16 is not divisible by tp=3", "not laid out for glm4_moe"):
        assert part in msg, part
    with pytest.raises(ValueError, match="expert_parallel=True but phi3 has no experts"):
        trs.recipes.hf_to_vllm(_configs()["phi3"], tp=2, trainer_ranks=TRAINERS, inference_ranks=[2, 3],
                               expert_parallel=True)
    with pytest.raises(ValueError) as e:  # Qwen3-Next: the linear heads too, all at once
        trs.recipes.hf_to_vllm(_configs()["qwen3_next"], tp=8, trainer_ranks=TRAINERS, inference_ranks=list(range(8)))
    msg = str(e.value)
    for part in ("linear_num_key_heads=4 is not divisible by tp=8", "num_attention_heads=4 is not divisible by tp=8",
                 "tp=8 is greater than num_experts=4"):
        assert part in msg, part
