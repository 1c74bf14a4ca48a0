"""gpt-oss (``model_type="gpt_oss"``): vLLM 0.32's own ``GptOssForCausalLM.load_weights``, run in this
process (tritonreshard.vllm.trace) at TP 1, 2, 4 and expert parallel (2, 4), transposes the routed experts'
weights (``w13_weight`` / ``w2_weight`` hold their HF boxes as ``box.permute(0, 2, 1)``): transposed
parts (``Part(src_dims=(0, 2, 1))``) express that.

* the hand-written recipe (tritonreshard/recipes/gpt_oss.py) refits random tensors exactly as vLLM's
  own loader loads them, on every rank, bit for bit;
* the trace of the same loader gives the same recipe (``recipe_differences`` empty), with exactly
  the experts' ``w13_weight`` and ``w2_weight`` of every layer transposed parts; ``w2_bias`` a zero
  box on TP rank 1 (vLLM zeroes it off rank 0);
* the Triton executor (interpreted on the CPU) copies a transposed op exactly;
* plans across hosts and FP8 plans refuse a transposed part by name, at planning time;
* the tracer feeds gpt-oss's fused experts as its checkpoints hold them (what ``save_pretrained``
  writes), not split per expert as for the other MoE families.
"""

import pytest
import torch

import tritonreshard as trs
from tritonreshard.recipes.trace import checkpoint_views

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
    swigluoai nor the expert biases: it takes both. Hence intermediate 128 (32 per rank at TP 4). Its
    attention divides the KV heads over TP and never replicates them: 4 KV heads for TP 4.

    What load_weights fills does not depend on that choice: UnquantizedFusedMoEMethod.create_weights
    registers the same names (w13_weight, w13_bias, w2_weight, w2_bias) in the layer's dtype for every
    backend; their shapes change only through maybe_roundup_sizes (FlashInfer TRT-LLM rounds the
    intermediate size up to 128, ROCm AITER to 64 / 128, DeepEP all2all the hidden size), and neither
    the CPU kernel nor Triton (what CUDA picks for swigluoai) rounds anything."""
    config = transformers.GptOssConfig(vocab_size=100, hidden_size=32, intermediate_size=128,
                                       num_hidden_layers=LAYERS, num_attention_heads=8, num_key_value_heads=4,
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


CASES = [(1, False), (2, False), (4, False), (2, True), (4, True)]


def _refit(spec, full):
    """The refit of ``full`` (HF tensors) through ``spec``'s own plan: FSDP shards in, every rank out."""
    src = {r: {n: lay.shard(full[n], r) for n, lay in spec.src.items()} for r in TRAINERS}
    return trs.execute_local(spec.plan(), src, backend="torch")


def _recipe(tp, ep):
    return trs.recipes.hf_to_vllm(tiny_config(), tp=tp, trainer_ranks=TRAINERS, inference_ranks=list(range(2, 2 + tp)),
                                  dtype=torch.float32, expert_parallel=ep)


@pytest.mark.parametrize("tp,ep", CASES)
def test_the_recipe_refits_exactly_what_vllms_loader_loads(vllm_trace, tp, ep):
    spec = _recipe(tp, ep)
    torch.manual_seed(tp + 10 * ep)
    full = {n: torch.randn(lay.shape) for n, lay in spec.src.items()}
    got = _refit(spec, full)
    models = vllm_trace.rank_models(tiny_config(), tp, dtype=torch.float32, expert_parallel=ep)
    vllm = vllm_trace.vllm_load(models, full, "gpt_oss")   # vLLM's own load_weights, per rank
    for t in range(tp):
        r = 2 + t
        assert sorted(got[r]) == sorted(vllm[t])
        differ = [n for n, w in vllm[t].items() if not torch.equal(got[r][n], w)]
        assert differ == [], (t, differ)
    if tp == 2 and not ep:  # vLLM zeroes w2_bias off rank 0: so does the recipe's zero box
        assert bool((got[3][EXPERT.format(0, "w2_bias")] == 0).all())


@pytest.mark.parametrize("tp,ep", CASES)
def test_the_trace_is_the_recipe_with_the_expert_weights_transposed(vllm_trace, tp, ep):
    traced = vllm_trace.trace_recipe(tiny_config(), tp=tp, trainer_ranks=TRAINERS,
                                     inference_ranks=list(range(2, 2 + tp)), dtype=torch.float32, expert_parallel=ep)
    transposed = {n: p[0].src for n, p in traced.parts.items() if any(x.src_dims is not None for x in p)}
    assert transposed == TRANSPOSED
    assert all(traced.parts[n] == (trs.Part(src, [None] * 3, src_dims=(0, 2, 1)),) for n, src in TRANSPOSED.items())
    assert vllm_trace.recipe_differences(traced, _recipe(tp, ep)) == []
    if tp == 2 and not ep:
        for i in range(LAYERS):
            w2_bias = EXPERT.format(i, "w2_bias")
            assert traced.dst[w2_bias].placements == (trs.Shard(0),) and traced.dst[w2_bias].shape == (8, 32)
            assert traced.parts[w2_bias] == (trs.Part(f"model.layers.{i}.mlp.experts.down_proj_bias", ((0, 4), None)),
                                             trs.Part(None, ((4, 8), None)))


def test_a_transposed_part_prints_and_is_checked():
    p = trs.Part("g", [None, (0, 4), None], src_start=(0, 0, 2), src_dims=(0, 2, 1))
    assert str(p) == "[:, 0:4, :] <- g.permute(0, 2, 1) @[0, 0, 2]"
    assert trs.Part("g", [None, None], src_dims=(0, 1)) == trs.Part("g", [None, None])  # the identity is the default
    with pytest.raises(ValueError, match="permutation of range"):
        trs.Part("g", [None, None], src_dims=(0, 0))
    with pytest.raises(TypeError):
        trs.Part("g", [None, None], src_dims="ab")
    # The engine's ranks compare their planning inputs by digest, and parts travel through the store:
    # both carry the permutation.
    from tritonreshard.engine.members import inputs_digest
    from tritonreshard.engine.rendezvous import _decode, _encode

    lay = {"w": trs.Layout((3, 4), [0], [trs.Replicate()])}
    other = trs.Part("g", [None, (0, 4), None], (0, 0, 2))
    assert inputs_digest(lay, {"w": (p,)}) != inputs_digest(lay, {"w": (other,)})
    assert _decode(_encode(p, "p")) == p
    # The source box runs along the source's dims: a destination [5, 3] reads a [3, 5] source box.
    src = {"g": trs.Layout((3, 4), [0], [trs.Replicate()])}
    with pytest.raises(ValueError, match=r"source box \[0:4, 0:3\] is outside"):
        trs.plan_reshard(src, {"w": trs.Layout((3, 4), [1], [trs.Replicate()])},
                         {"w": [trs.Part("g", [None, None], src_dims=(1, 0))]})


def _transposed_plan(dst_dtype=torch.float32):
    src = {"g": trs.Layout((4, 6, 10), TRAINERS, [trs.Shard(0)])}
    dst = {"w": trs.Layout((4, 10, 6), [2, 3], [trs.Shard(1)], dst_dtype)}
    return src, dst, {"w": [trs.Part("g", [None] * 3, src_dims=(0, 2, 1))]}


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_execute_local_copies_a_transposed_op_exactly(backend):
    src, dst, parts = _transposed_plan(torch.bfloat16)
    plan = trs.plan_reshard(src, dst, parts)
    assert {op.src_dims for op in plan.ops} == {(0, 2, 1)} and ".permute(0, 2, 1)" in str(plan.ops[0])
    assert plan.stats.total_bytes == 4 * 10 * 6 * 2   # the same bytes as untransposed
    full = torch.randn(4, 6, 10)
    got = trs.execute_local(plan, {r: {"g": src["g"].shard(full, r)} for r in TRAINERS}, backend=backend)
    want = full.permute(0, 2, 1).to(torch.bfloat16)
    for r in (2, 3):
        assert torch.equal(got[r]["w"], dst["w"].shard(want, r)), r
    # A rank's own plan holds exactly the whole plan's ops it takes part in, permutation and all.
    assert set(trs.plan_reshard(src, dst, parts, rank=2).ops) == set(plan.ops_for_dst(2))


def test_a_transposed_box_spread_over_replicas_is_exact():
    """Reads of a replicated source are split over its replicas along one destination dim: each
    piece keeps its permutation and reads its own run of the source."""
    src = {"g": trs.Layout((2, 64, 128), [0, 1, 4], [trs.Replicate()])}
    dst = {"w": trs.Layout((2, 96, 64), [2, 3], [trs.Shard(2)])}
    parts = {"w": [trs.Part("g", [None] * 3, src_start=(0, 0, 32), src_dims=(0, 2, 1))]}
    plan = trs.plan_reshard(src, dst, parts)
    assert len({op.src_rank for op in plan.ops}) > 1 and len(plan.ops) > 2   # spread, and split
    full = torch.randn(2, 64, 128)
    got = trs.execute_local(plan, {r: {"g": full} for r in (0, 1, 4)}, backend="torch")
    for r in (2, 3):
        assert torch.equal(got[r]["w"], dst["w"].shard(full[:, :, 32:].permute(0, 2, 1).contiguous(), r)), r


def test_plans_across_hosts_and_fp8_plans_refuse_a_transposed_part():
    from tritonreshard.planning import BlockQuant, plan_hosts, plan_quantized, plan_rank

    src, dst, parts = _transposed_plan()
    hosts = {0: "a", 1: "a", 2: "b", 3: "b"}
    with pytest.raises(ValueError, match=r"plan_hosts: 1 destination\(s\) are built from transposed parts.*\['w'\]"):
        plan_hosts(trs.plan_reshard(src, dst, parts), hosts)
    with pytest.raises(ValueError, match=r"plan_rank\(rank=2\): .*across hosts.*\['w'\]"):
        plan_rank(src, dst, hosts, 2, parts=parts)
    plan_hosts(trs.plan_reshard(src, dst, parts), dict.fromkeys(hosts, "a"))   # one host: planned as it is
    with pytest.raises(ValueError, match=r"gpt_oss.*quantization='fp8-block' is not laid out"):
        trs.recipes.hf_to_vllm(tiny_config(), tp=2, trainer_ranks=TRAINERS, inference_ranks=[2, 3],
                               quantization="fp8-block")
    fsrc = {"g": trs.Layout((2, 128, 128), TRAINERS, [trs.Shard(0)])}
    fdst = {"w": trs.Layout((2, 128, 128), [2], [trs.Replicate()], torch.float8_e4m3fn),
            "w_scale": trs.Layout((2, 1, 1), [2], [trs.Replicate()])}
    quant = {"w": BlockQuant("w_scale", rows=(128,))}
    with pytest.raises(ValueError, match=r"plan_quantized: \['w'\] are built from transposed parts"):
        plan_quantized(fsrc, fdst, {"w": [trs.Part("g", [None] * 3, src_dims=(0, 2, 1))]}, quant)


def test_the_recipe_says_every_size_vllm_cannot_split():
    config = tiny_config()
    config.num_local_experts = 3
    config.intermediate_size = 63
    with pytest.raises(ValueError) as e:
        trs.recipes.hf_to_vllm(config, tp=2, trainer_ranks=TRAINERS, inference_ranks=[2, 3])
    assert "intermediate_size" in str(e.value) and "63" in str(e.value)
    with pytest.raises(ValueError) as e:
        trs.recipes.hf_to_vllm(config, tp=2, trainer_ranks=TRAINERS, inference_ranks=[2, 3], expert_parallel=True)
    assert "num_local_experts" in str(e.value) and "3" in str(e.value)


def test_more_ranks_than_kv_heads_is_refused_as_vllm_cannot_build_it(vllm_trace):
    """vLLM's gpt-oss attention gives each rank ``num_key_value_heads // tp`` KV heads: at TP 4 over
    2 it builds an attention of none and fails. The recipe refuses that by name, before anything
    moves, where the other families replicate KV heads."""
    config = tiny_config()
    config.num_key_value_heads = 2
    with pytest.raises(ValueError, match=r"tp=4 > num_key_value_heads=2 \(vLLM's gpt-oss attention divides"):
        trs.recipes.hf_to_vllm(config, tp=4, trainer_ranks=TRAINERS, inference_ranks=list(range(2, 6)))
    with pytest.raises(ZeroDivisionError):  # vLLM itself, with the same config: "integer modulo by zero"
        vllm_trace.rank_models(config, 4, dtype=torch.float32)


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
