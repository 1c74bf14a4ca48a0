"""Recipes traced from vLLM 0.32's own loader (tritonreshard.vllm.trace), in this process: meta
tensors through each TP rank's ``load_weights``, every copy recorded as a box, compressed into the
planner's boxes.

* for every registered family (``TRACED``; tests/test_families.py's among them), the traced recipe has
  the same effect as the hand-written one: the same sources, the same destinations (names, dtypes,
  each rank's local shape) and every element of every destination on every rank from the same source
  element, each recipe's own plan run;
* Granite (no hand-written recipe) refitted exactly through the trace alone, against vLLM's own
  ``load_weights`` of the same random tensors on every rank;
* a loader that is no copy, sources vLLM leaves out, parameters nothing reaches, a config vLLM does
  not serve, names vLLM's loader does not know: one ``ValueError`` each, naming every problem."""
import pytest
import torch
from test_families import _configs as _family_configs
from test_recipes import _configs

import tritonreshard as trs
from tritonreshard.recipes import RECIPES
from tritonreshard.recipes.metatrace import LoadTracer
from tritonreshard.recipes.trace import encode, spec_from_trace

transformers = pytest.importorskip("transformers")
pytest.importorskip("vllm")
# Lazy (after the skip): this module imports vLLM.
from tritonreshard.vllm.trace import hf_sources, rank_models, recipe_differences, trace_recipe, vllm_load  # noqa: E402

TRAINERS = [0, 1]


def _architecture(config):
    return transformers.AutoModelForCausalLM._model_mapping[type(config)].__name__


def tiny_config(model_type):
    """test_recipes' or test_families' tiny config of ``model_type`` where one has it, else
    transformers' defaults at tiny sizes."""
    config = next((c for c in [*_configs().values(), *_family_configs().values()] if c.model_type == model_type), None)
    if model_type == "gpt_oss":  # vLLM builds it on the CPU at these sizes only (test_gpt_oss.tiny_config)
        from test_gpt_oss import tiny_config as gpt_oss_config

        config = gpt_oss_config()
    if config is None:
        config = transformers.AutoConfig.for_model(
            model_type, vocab_size=100, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8, moe_intermediate_size=16, num_experts=4,
            num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2)
    config.architectures = [_architecture(config)]
    return config


def _moe(config):
    return any(getattr(config, k, None) for k in ("num_experts", "n_routed_experts", "num_local_experts"))


# Every registered family is traced here, the families of tests/test_families.py too (the tracer
# feeds checkpoint names: Mixtral's block_sparse_moe and per-expert w1/w3/w2, checked there against
# save_pretrained).
TRACED = sorted(RECIPES)
CASES = [(t, tp, False) for t in TRACED for tp in (1, 2, 4)] + \
    [(t, 2, True) for t in TRACED if _moe(tiny_config(t))]
# vLLM 0.32's qwen3_5 module imports torchvision, which has no CPU build here: these types are traced
# in a process of their own with tests/_standin's (tests/_trace_probe.py), never in this one.
NEEDS_TORCHVISION = {"qwen3_5_text", "qwen3_5_moe_text"}


@pytest.mark.parametrize("model_type,tp,ep", [c for c in CASES if c[0] not in NEEDS_TORCHVISION])
def test_traced_recipe_equals_the_hand_written_one(model_type, tp, ep):
    traced_equals_hand_written(model_type, tp, ep)


@pytest.fixture(scope="module")
def probed(tmp_path_factory):
    """``{"type-tp-ep": None, or the failed check's message}`` for the NEEDS_TORCHVISION cases, from
    one run of tests/_trace_probe.py."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    from _torchvision import probe_env

    root = tmp_path_factory.mktemp("trace-probe")
    (root / "cases.json").write_text(json.dumps([c for c in CASES if c[0] in NEEDS_TORCHVISION]))
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("_trace_probe.py")), str(root / "cases.json"),
                           str(root / "out.json")], capture_output=True, text=True, timeout=600, env=probe_env())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads((root / "out.json").read_text())


@pytest.mark.parametrize("model_type,tp,ep", [c for c in CASES if c[0] in NEEDS_TORCHVISION])
def test_traced_recipe_equals_the_hand_written_one_in_a_probe(probed, model_type, tp, ep):
    assert probed[f"{model_type}-{tp}-{ep}"] is None, probed[f"{model_type}-{tp}-{ep}"]


def traced_equals_hand_written(model_type: str, tp: int, ep: bool) -> None:
    """The traced recipe of test_families' / test_recipes' tiny ``model_type`` has the same effect as
    the hand-written one, and the comparison is not vacuous; an ``AssertionError`` otherwise."""
    config = tiny_config(model_type)
    inference = list(range(2, 2 + tp))
    kw = dict(tp=tp, trainer_ranks=TRAINERS, inference_ranks=inference, dtype=torch.float32, expert_parallel=ep)
    hand = trs.recipes.hf_to_vllm(config, **kw)
    stats = {}
    traced = trace_recipe(config, **kw, stats=stats)
    assert recipe_differences(traced, hand) == []
    assert stats["hand_written"] and stats["trace_ms"] > 0
    # Not vacuous: the same recipe with the sources of two same-sized boxes of one destination
    # exchanged differs (the comparison sees elements, not names and shapes). Two sources, or, where
    # the checkpoint is fused already (Phi-3's qkv_proj), two regions of one.
    def extent(n, p):
        return tuple(size if d is None else d[1] - d[0] for d, size in zip(p.dst, hand.dst[n].shape, strict=True))

    name, i, j = next((n, i, j) for n, ps in hand.parts.items() for i in range(len(ps)) for j in range(i)
                      if ps[i].src and ps[j].src and (ps[i].src, ps[i].src_start) != (ps[j].src, ps[j].src_start)
                      and extent(n, ps[i]) == extent(n, ps[j]))
    plist = list(hand.parts[name])
    plist[i], plist[j] = (trs.Part(plist[j].src, plist[i].dst, plist[j].src_start),
                          trs.Part(plist[i].src, plist[j].dst, plist[i].src_start))
    wrong = trs.recipes.RecipeSpec(hand.model_type, tp, ep, hand.src, hand.dst, {**hand.parts, name: tuple(plist)})
    assert any(name in d for d in recipe_differences(traced, wrong))


def test_traced_destinations_take_the_engines_dtype():
    """A bfloat16 engine's parameters are bfloat16 (vLLM builds its model under that default dtype),
    and so are the traced recipe's destinations: the same as the hand-written recipe's (before, the
    trace built its models in float32 and gave float32 destinations for a bfloat16 engine)."""
    config = tiny_config("qwen3_moe")
    kw = dict(tp=2, trainer_ranks=TRAINERS, inference_ranks=[2, 3], dtype=torch.bfloat16)
    traced = trace_recipe(config, **kw)
    assert {lay.dtype for lay in traced.dst.values()} == {torch.bfloat16}
    assert recipe_differences(traced, trs.recipes.hf_to_vllm(config, **kw)) == []


def _refit(spec, full):
    """The refit of ``full`` (HF tensors) through ``spec``'s own plan: FSDP shards in, every rank out."""
    src = {r: {n: lay.shard(full[n], r) for n, lay in spec.src.items()} for r in TRAINERS}
    return trs.execute_local(spec.plan(), src, backend="torch")


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_granite_refits_exactly_through_the_trace_alone(tp):
    config = transformers.GraniteConfig(vocab_size=100, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, embedding_multiplier=12.0,
                                        residual_multiplier=0.22, attention_multiplier=0.0078125, logits_scaling=8.0)
    config.architectures = ["GraniteForCausalLM"]
    assert "granite" not in RECIPES
    inference = list(range(2, 2 + tp))
    with pytest.raises(ValueError, match=r"model_type='granite' has no recipe; known: \[.*trace_recipe"):
        trs.recipes.hf_to_vllm(config, tp=tp, trainer_ranks=TRAINERS, inference_ranks=inference)
    spec = trace_recipe(config, tp=tp, trainer_ranks=TRAINERS, inference_ranks=inference, dtype=torch.float32)
    torch.manual_seed(tp)
    full = {n: torch.randn(lay.shape) for n, lay in spec.src.items()}
    got = _refit(spec, full)
    vllm = vllm_load(rank_models(config, tp, dtype=torch.float32), full)  # vLLM's own load_weights, per rank
    for t, r in enumerate(inference):
        assert sorted(got[r]) == sorted(vllm[t])
        for name, w in vllm[t].items():
            assert torch.equal(got[r][name].double(), w), (t, name)
    if tp > 1:  # one rank holds everything: every destination is traced as Replicate
        assert all(spec.dst[n].placements[-1].blocks for n in spec.dst if n.endswith("qkv_proj.weight"))


def _sources():
    return {"a": trs.Layout((4, 2), TRAINERS, [trs.Shard(0)]), "b": trs.Layout((4, 2), TRAINERS, [trs.Shard(0)])}


def _traced(loader, w_shape=(4, 2)):
    """What ``loader(w, b, a_src, b_src)`` writes into meta parameters ``w`` and ``b`` from meta
    sources ``a`` and ``b`` (ids 0, 1), recorded by the tracer vLLM's loaders run under: one rank."""
    srcs = {0: torch.empty(4, 2, device="meta"), 1: torch.empty(4, 2, device="meta")}
    params = {"w": torch.empty(w_shape, device="meta"), "b": torch.empty(4, 2, device="meta")}
    tracer = LoadTracer(srcs, params)
    with tracer, torch.no_grad():
        loader(params["w"], params["b"], srcs[0], srcs[1])
    return [tracer.written]


DTYPES = {"w": torch.float32, "b": torch.float32}


def test_a_loader_that_is_no_copy_is_refused_by_name():
    for what, make in (("scaled", lambda a, b: a * 0.5), ("summed", lambda a, b: a + b), ("negated", lambda a, b: -a),
                       ("shifted", lambda a, b: a + 2), ("made", lambda a, b: torch.ones_like(a))):
        traced = _traced(lambda w, bp, a, b, make=make: (w.copy_(make(a, b)), bp.copy_(b)))
        with pytest.raises(ValueError) as e:
            spec_from_trace("m", _sources(), traced, tp=1, inference_ranks=[2], dtypes=DTYPES)
        assert "w: its loader is not a copy on TP rank 0" in str(e.value), what
    # Scaled in place after a copy: the scaled rows are no copy either.
    traced = _traced(lambda w, bp, a, b: (w.copy_(a), w[1:3].mul_(2), bp.copy_(b)))
    with pytest.raises(ValueError, match="w: its loader is not a copy on TP rank 0"):
        spec_from_trace("m", _sources(), traced, tp=1, inference_ranks=[2], dtypes=DTYPES)
    # Left out, and not reached: both named in the one error.
    traced = _traced(lambda w, bp, a, b: None)
    del traced[0]["b"]
    with pytest.raises(ValueError) as e:
        spec_from_trace("m", _sources(), traced, tp=1, inference_ranks=[2], dtypes=DTYPES)
    msg = str(e.value)
    assert "vLLM parameters no source reached (in part or whole): ['w']" in msg
    assert "sources vLLM's loader left out (their names do not match its parameters): ['a', 'b']" in msg
    # What the boxes cannot follow (a parameter copied from another) is refused with the reason, never guessed.
    traced = _traced(lambda w, bp, a, b: (w.copy_(a), bp.copy_(w)))
    with pytest.raises(ValueError, match=r"b: what its loader does on TP rank 0 is no box copy the trace can "
                                         r"follow \(a copy from another parameter\)"):
        spec_from_trace("m", _sources(), traced, tp=1, inference_ranks=[2], dtypes=DTYPES)


@pytest.mark.parametrize("contiguous", [False, True])
def test_a_transposing_loader_is_one_transposed_part(contiguous):
    """A loader that copies a transposed view, or a contiguous copy of one (vLLM's gpt-oss experts,
    tests/test_gpt_oss.py): a transposed part, whose plan copies exactly that; a reshape is no box
    of the source in any order of dims, and the trace says no split fits."""
    def loader(w, bp, a, b):
        w.copy_(a.t().contiguous() if contiguous else a.t())
        bp.copy_(b)

    spec = spec_from_trace("m", _sources(), _traced(loader, (2, 4)), tp=1, inference_ranks=[2], dtypes=DTYPES)
    assert spec.dst["w"].shape == (2, 4)
    assert spec.parts["w"] == (trs.Part("a", (None, None), src_dims=(1, 0)),)
    assert str(spec.parts["w"][0]) == "[:, :] <- a.permute(1, 0)"
    full = {"a": encode(0, (4, 2)).float(), "b": encode(1, (4, 2)).float()}
    shards = {r: {n: spec.src[n].shard(t, r) for n, t in full.items()} for r in TRAINERS}
    got = trs.execute_local(spec.plan(), shards, backend="torch")
    assert torch.equal(got[2]["w"], full["a"].t()) and torch.equal(got[2]["b"], full["b"])
    with pytest.raises(ValueError) as e:  # reshaped: no order of dims fits either
        spec_from_trace("m", _sources(), _traced(lambda w, bp, a, b: (w.copy_(a.reshape(2, 4)), bp.copy_(b)), (2, 4)),
                        tp=1, inference_ranks=[2], dtypes=DTYPES)
    assert str(e.value) == "trace of 'm', tp=1: w: no split of one dim into source boxes reproduces every rank"


def test_bad_config_and_names_fail_with_every_problem_before_anything_moves():
    config = transformers.LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    config.architectures = ["NoSuchForCausalLM"]
    with pytest.raises(ValueError) as e:
        trace_recipe(config, tp=0, trainer_ranks=[], inference_ranks=[2, 3, 4])
    msg = str(e.value)
    for part in ("config.architectures=['NoSuchForCausalLM']: vLLM serves none of them", "LlamaForCausalLM",
                 "tp=0 must be a positive int", "trainer_ranks=[] must be a non-empty list"):
        assert part in msg, part
    config.architectures = ["LlamaForCausalLM"]
    models = rank_models(config, 2, dtype=torch.float32)
    full = {n: encode(i, lay.shape) for i, (n, lay) in enumerate(hf_sources(config, TRAINERS).items())}
    renamed = {n.replace("self_attn.", "attention.").replace("mlp.", "feed_forward."): t for n, t in full.items()}
    with pytest.raises(ValueError) as e:
        vllm_load(models, renamed)
    msg = str(e.value)
    assert "LlamaForCausalLM.load_weights refuses 7 tensor(s), their names do not match" in msg, msg
    assert "model.layers.0.attention.q_proj.weight" in msg and "model.layers.0.feed_forward.down_proj.weight" in msg
