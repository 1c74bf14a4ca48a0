"""gpt-oss (``model_type="gpt_oss"``) has no recipe, and the trace says why: vLLM 0.32's own
``GptOssForCausalLM.load_weights``, traced in this process (tritonreshard.vllm.trace) at TP 1, 2 and
expert parallel, transposes the routed experts' weights, which no box expresses.

* the tracer refuses exactly the experts' ``w13_weight`` and ``w2_weight`` of every layer, each named
  as a transpose of its HF source; everything else (sinks, attention, router, biases, embeddings)
  traces as boxes, ``w2_bias`` as a zero box on TP rank 1 (vLLM zeroes it off rank 0);
* ``hf_to_vllm`` of a gpt-oss config says so in its one ``ValueError``;
* the tracer feeds gpt-oss's fused experts as its checkpoints hold them (what ``save_pretrained``
  writes), not split per expert as for the other MoE families.
"""
import re

import pytest
import torch

import tritonreshard as trs
from tritonreshard.recipes.trace import checkpoint_views, encode, spec_from_trace

transformers = pytest.importorskip("transformers")

TRAINERS = [0, 1]
LAYERS = 2
EXPERT = "model.layers.{}.mlp.experts.routed_experts.{}"
# vLLM parameter -> the HF tensor it holds transposed.
TRANSPOSED = {EXPERT.format(i, w): f"model.layers.{i}.mlp.experts.{hf}" for i in range(LAYERS)
              for w, hf in (("w13_weight", "gate_up_proj"), ("w2_weight", "down_proj"))}


def tiny_config():
    """A tiny gpt-oss vLLM builds on the CPU as it is, no patch of its MoE backend choice.

    vLLM 0.32 builds an unquantized MoE layer only with a kernel it picks
    (fused_moe/oracle/unquantized.py); on the CPU the one that takes float32 is
    CPUUnquantizedExperts (X86CPUUnquantizedExperts wants bfloat16 and AMX), and it wants the hidden
    size and each rank's intermediate size divisible by 32: at intermediate 16 (8 per rank at TP 2)
    no backend is picked ("No Unquantized MoE backend supports the deployment configuration"). Not
    swigluoai nor the expert biases: it takes both. Hence intermediate 64 (32 per rank at TP 2).

    What load_weights fills does not depend on that choice: UnquantizedFusedMoEMethod.create_weights
    registers the same names (w13_weight, w13_bias, w2_weight, w2_bias) in the layer's dtype for every
    backend; their shapes change only through maybe_roundup_sizes (FlashInfer TRT-LLM rounds the
    intermediate size up to 128, ROCm AITER to 64 / 128, DeepEP all2all the hidden size), and neither
    the CPU kernel nor Triton (what CUDA picks for swigluoai) rounds anything."""
    config = transformers.GptOssConfig(vocab_size=100, hidden_size=32, intermediate_size=64,
                                       num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
                                       head_dim=8, num_local_experts=4, num_experts_per_tok=2)
    config.architectures = ["GptOssForCausalLM"]
    assert config.layer_types == ["sliding_attention", "full_attention"]
    return config


@pytest.fixture(scope="module")
def vllm_trace():
    """tritonreshard.vllm.trace (imports vLLM: once for the module)."""
    pytest.importorskip("vllm")
    from tritonreshard.vllm import trace

    return trace


# Problems are joined by "; " (raise_problems); a transposed one reads, by name:
_TRANSPOSE = re.compile(r"(\S+): no split of one dim into source boxes reproduces every rank: its loader transposes "
                        r"\(every element is copied, but each TP rank holds its box of \['(\S+)'\] as "
                        r"box\.permute\(0, 2, 1\)\), which the planner's boxes \(step-1 slices in the source's order "
                        r"of dims, never transposed\) cannot express")


@pytest.mark.parametrize("tp,ep", [(1, False), (2, False), (2, True)])
def test_the_tracer_refuses_exactly_the_transposed_expert_weights(vllm_trace, tp, ep):
    config = tiny_config()
    with pytest.raises(ValueError) as e:
        vllm_trace.trace_recipe(config, tp=tp, trainer_ranks=TRAINERS, inference_ranks=list(range(2, 2 + tp)),
                                dtype=torch.float32, expert_parallel=ep)
    msg = str(e.value)
    prefix = f"trace of 'gpt_oss', tp={tp}: "
    assert msg.startswith(prefix), msg
    refused = {}
    for problem in msg[len(prefix):].split("; "):
        m = _TRANSPOSE.fullmatch(problem)
        assert m, problem
        refused[m.group(1)] = m.group(2)
    assert refused == TRANSPOSED


def test_everything_else_traces_as_boxes_w2_bias_a_zero_box_off_rank_0(vllm_trace):
    """The rest of gpt-oss at TP 2: its boxes, from the same loader, with the expert weights' HF
    sources left out (and so their vLLM parameters, which nothing then reaches)."""
    config = tiny_config()
    sources = {n: lay for n, lay in vllm_trace.hf_sources(config, TRAINERS).items() if n not in TRANSPOSED.values()}
    codes = {n: encode(i, lay.shape) for i, (n, lay) in enumerate(sources.items())}
    fed = {n: t.clone() for n, t in codes.items()}
    models = vllm_trace.rank_models(config, 2, dtype=torch.float32)
    traced = vllm_trace.vllm_load(models, codes, "gpt_oss")
    # vLLM's loader zeroes down_proj_bias in place on TP rank 1: on a copy, not on what was fed.
    assert [n for n in codes if not torch.equal(codes[n], fed[n])] == []
    traced = [{n: t for n, t in per.items() if n not in TRANSPOSED} for per in traced]
    spec = spec_from_trace("gpt_oss", sources, traced, tp=2, inference_ranks=[2, 3],
                           dtypes={n: p.dtype for n, p in models[0].named_parameters()})
    for i in range(LAYERS):
        w2_bias = EXPERT.format(i, "w2_bias")
        assert spec.dst[w2_bias].placements == (trs.Shard(0),) and spec.dst[w2_bias].shape == (8, 32)
        assert spec.parts[w2_bias] == (trs.Part(f"model.layers.{i}.mlp.experts.down_proj_bias", ((0, 4), None)),
                                       trs.Part(None, ((4, 8), None), (4, 0)))
        assert bool((traced[1][w2_bias] == 0).all())
        assert spec.dst[f"model.layers.{i}.attn.sinks"].placements == (trs.Shard(0),)
    assert set(spec.dst) == {n for n, _ in models[0].named_parameters()} - set(TRANSPOSED)


def test_hf_to_vllm_says_why_gpt_oss_has_no_recipe():
    with pytest.raises(ValueError) as e:
        trs.recipes.hf_to_vllm(tiny_config(), tp=2, trainer_ranks=TRAINERS, inference_ranks=[2, 3])
    msg = str(e.value)
    assert msg.startswith("hf_to_vllm: config.model_type='gpt_oss' has no recipe; known: ['deepseek_v2'"), msg
    for part in ("gpt_oss has none, nor can tracing vLLM's loader make one, because vLLM's gpt-oss loader transposes "
                 "the routed experts' weights", "w13_weight and w2_weight", "box.permute(0, 2, 1)",
                 "zeroing of w2_bias on TP ranks > 0 is a zero box, no obstacle"):
        assert part in msg, part
    assert "trace_recipe" not in msg  # no hint to trace it: the trace refuses it


def test_checkpoint_views_are_what_save_pretrained_writes(tmp_path):
    """What the tracer (and verify=) feeds vLLM for gpt-oss is, name for name and bit for bit, the
    checkpoint transformers writes: the fused experts whole, [E, H, 2I] and [E, I, H]."""
    from safetensors.torch import load_file

    model = transformers.AutoModelForCausalLM.from_config(tiny_config())
    full = {n: p.detach().clone() for n, p in model.named_parameters()}
    model.save_pretrained(tmp_path)
    written = {}
    for f in sorted(tmp_path.glob("*.safetensors")):
        written.update(load_file(f))
    views = {k: v for n, t in full.items() for k, v in checkpoint_views(n, t, "gpt_oss")}
    assert sorted(views) == sorted(written) and set(TRANSPOSED.values()) <= set(views)
    assert [k for k in written if not torch.equal(views[k], written[k])] == []
