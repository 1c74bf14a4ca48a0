"""Fail-closed (``verify=``): a recipe checked against vLLM 0.32's own ``load_weights`` run on meta
tensors (its copies as boxes, compared element for element with the recipe plan's boxes), in this
process, on each TP rank's real vLLM model class (built on the meta device: the live-engine check is
in tests/test_vllm.py). Every layer is checked. Planted wrong recipes, each with vLLM's names and
load-format shapes right (the model check passes them: without verify they would serve), are each
refused, naming the parameter, the rank and the recipe: a swapped qkv split, two ranks' shards
exchanged, reversed experts, at the tiny sizes; at Qwen3-30B-A3B's real sizes (TP 8, the last
rank, 48 layers of 128 experts) one middle layer's experts reversed and a vocab padded as no
engine pads it. A loader the boxes cannot follow, or that is no copy, is refused, never passed."""
import dataclasses
import json
from pathlib import Path

import pytest
import torch
from test_recipes import _configs

import tritonreshard as trs

transformers = pytest.importorskip("transformers")
pytest.importorskip("vllm")
# Lazy (after the skip): these modules import vLLM.
from tritonreshard.vllm._model import check_model  # noqa: E402
from tritonreshard.vllm._verify import verify_model  # noqa: E402
from tritonreshard.vllm.trace import _as_tp_rank, rank_models  # noqa: E402

ARCH = {"llama": "LlamaForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM"}
INFERENCE = [2, 3]


def _setup(arch, ep=False):
    config = _configs()[arch]
    config.architectures = [ARCH[arch]]
    spec = trs.recipes.hf_to_vllm(config, tp=2, trainer_ranks=[0, 1], inference_ranks=INFERENCE, dtype=torch.float32,
                                  expert_parallel=ep)
    return spec, rank_models(config, 2, dtype=torch.float32, expert_parallel=ep)


def _replace(spec, name, *, parts=None, dst=None):
    new_parts = dict(spec.parts)
    new_dst = dict(spec.dst)
    if parts is not None:
        new_parts[name] = tuple(parts)
    if dst is not None:
        new_dst[name] = dst
    return dataclasses.replace(spec, parts=new_parts, dst=new_dst)


@pytest.mark.parametrize("arch,ep", [("llama", False), ("qwen3_moe", True), ("deepseek_v3", False)])
def test_hand_written_recipes_pass_on_every_rank(arch, ep):
    spec, models = _setup(arch, ep)
    for t, model in enumerate(models):
        with _as_tp_rank(2, t):
            stats = verify_model(model, spec, rank=INFERENCE[t], tp_rank=t)
        # Every parameter of every layer, and every element of each (the boxes cover them all).
        assert stats["verify_params"] == len(spec.dst)
        assert stats["verify_elements"] == sum(lay.local_numel(INFERENCE[t]) for lay in spec.dst.values())
        assert stats["verify_layers"] == list(range(spec_layers(spec)))
        assert stats["verify_cpu_ms"] > 0 and stats["verify_peak_bytes"] is not None


def spec_layers(spec) -> int:
    return 1 + max(int(n.split(".")[2]) for n in spec.dst if ".layers." in n)


def test_a_wrong_middle_layer_alone_is_refused():
    """No sample: a recipe wrong in one middle layer only (layer 3 of 6; the old default checked
    layers 0, 1 and 5) is refused, naming that layer's parameter."""
    config = _configs()["deepseek_v3"]
    config.num_hidden_layers, config.architectures = 6, [ARCH["deepseek_v3"]]
    spec = trs.recipes.hf_to_vllm(config, tp=2, trainer_ranks=[0, 1], inference_ranks=INFERENCE, dtype=torch.float32)
    w13 = "model.layers.3.mlp.experts.routed_experts.w13_weight"
    wrong = _replace(spec, w13, parts=_reversed_experts(spec, w13))
    (model,) = rank_models(config, 2, dtype=torch.float32, ranks=[1])
    with _as_tp_rank(2, 1), pytest.raises(ValueError, match=rf"TP rank 1\): verify failed.*: {w13} at \["):
        verify_model(model, wrong, rank=INFERENCE[1], tp_rank=1)


def _planted(arch):
    """Wrong recipes whose names and shapes match vLLM's: what the model check alone accepts."""
    if arch == "llama":
        spec, models = _setup("llama")
        qkv = "model.layers.0.self_attn.qkv_proj.weight"
        q, k, v = spec.parts[qkv]  # k's rows filled from v_proj and v's from k_proj
        swapped = _replace(spec, qkv, parts=[q, dataclasses.replace(k, src=v.src), dataclasses.replace(v, src=k.src)])
        o = "model.layers.1.self_attn.o_proj.weight"  # column shards of the two TP ranks exchanged
        lay = spec.dst[o]
        transposed = _replace(spec, o, dst=trs.Layout(lay.shape, INFERENCE[::-1], list(lay.placements), lay.dtype))
        return models, [(swapped, qkv), (transposed, o)]
    spec, models = _setup("qwen3_moe", ep=True)
    w13 = "model.layers.0.mlp.experts.routed_experts.w13_weight"
    return models, [(_replace(spec, w13, parts=_reversed_experts(spec, w13)), w13)]


def _reversed_experts(spec, w13):
    """``w13``'s parts with the experts in reverse order (gate and up halves each kept)."""
    E = spec.dst[w13].shape[0]
    return [trs.Part(p.src, [(e, e + 1), *p.dst[1:]], (E - 1 - e, *(p.src_start or (0,) * 3)[1:]))
            for p in spec.parts[w13] for e in range(E)]


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_planted_wrong_recipes_are_refused_naming_the_parameter(arch):
    models, planted = _planted(arch)
    for spec, name in planted:
        for t, model in enumerate(models):
            # Off (verify=False): the model check is all that runs, and it passes every plant.
            check_model(model, spec, rank=INFERENCE[t], tp_rank=t)
            with _as_tp_rank(2, t), pytest.raises(ValueError) as e:
                verify_model(model, spec, rank=INFERENCE[t], tp_rank=t)
            msg = str(e.value)
            assert f"verify failed, nothing was loaded: the recipe trs.recipes.hf_to_vllm({spec.model_type!r})" in msg
            assert f": {name} at [" in msg and "vLLM's own load_weights puts" in msg, msg


def test_verify_never_writes_the_served_parameters():
    """A real (not meta) vLLM model with its weights loaded: verify fills scratch copies only."""
    config = _configs()["llama"]
    config.architectures = ["LlamaForCausalLM"]
    spec = trs.recipes.hf_to_vllm(config, tp=1, trainer_ranks=[0, 1], inference_ranks=[2], dtype=torch.float32)
    (model,) = rank_models(config, 1, dtype=torch.float32, device="cpu")
    for i, p in enumerate(model.parameters()):
        p.data.fill_(i + 0.5)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    verify_model(model, spec, rank=2, tp_rank=0)
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())


def test_verify_is_an_init_info_field():
    info = trs.vllm.init_info(store="h:1", trainer_ranks=[0], inference_ranks=[1])
    assert info["verify"] is True
    assert trs.vllm.init_info(store="h:1", trainer_ranks=[0], inference_ranks=[1], verify="all")["verify"] == "all"
    for bad in ("some", 1, None):
        with pytest.raises(ValueError, match="verify must be True, False or 'all'"):
            trs.vllm.init_info(store="h:1", trainer_ranks=[0], inference_ranks=[1], verify=bad)


# ------------------------------------------------------------------------------- real sizes
REAL = Path(__file__).resolve().parent.parent / "bench" / "configs"


def _real(name):
    raw = json.loads((REAL / f"{name}.json").read_text())
    raw.pop("_source")
    return transformers.AutoConfig.for_model(raw.pop("model_type"), **raw)


@pytest.fixture(scope="module")
def qwen3_30b():
    """Qwen3-30B-A3B's published sizes (48 layers of 128 experts, vocab 151,936) at TP 8: its last
    rank's vLLM model on the meta device (nothing allocated), and the hand-written recipe."""
    config = _real("qwen3-30b-a3b")
    inference = list(range(8, 16))
    spec = trs.recipes.hf_to_vllm(config, tp=8, trainer_ranks=list(range(8)), inference_ranks=inference,
                                  dtype=torch.bfloat16, src_dtype=torch.bfloat16)
    (model,) = rank_models(config, 8, dtype=torch.bfloat16, ranks=[7])
    return spec, model


def test_real_size_middle_layer_experts_reversed_are_refused(qwen3_30b):
    spec, model = qwen3_30b
    w13 = "model.layers.24.mlp.experts.routed_experts.w13_weight"
    wrong = _replace(spec, w13, parts=_reversed_experts(spec, w13))
    with _as_tp_rank(8, 7):
        stats = verify_model(model, spec, rank=15, tp_rank=7)  # the hand-written recipe passes
        assert stats["verify_layers"] == list(range(48)) and stats["verify_pieces"] > 48 * 128
        with pytest.raises(ValueError, match=rf"TP rank 7\): verify failed.*: {w13} at \[0, 0, 0\] "):
            verify_model(model, wrong, rank=15, tp_rank=7)


def test_real_size_vocab_padded_wrong_is_refused(qwen3_30b):
    """151,936 rows are a multiple of 64 (vLLM's padding) and split 18,992 per rank over TP 8; a
    recipe that pads to 64 * tp (152,064) puts 19,008 rows on each rank: refused on the last rank by
    name, where the extra rows would be, before anything loads."""
    spec, model = qwen3_30b
    name = "model.embed_tokens.weight"
    lay = spec.dst[name]
    V, H = lay.shape
    padded = trs.Layout((V + 128, H), list(lay.ranks), list(lay.placements), lay.dtype)
    wrong = _replace(spec, name, dst=padded,
                     parts=[trs.Part(name, [(0, V), None]), trs.Part(None, [(V, V + 128), None])])
    with _as_tp_rank(8, 7), pytest.raises(ValueError) as e:
        verify_model(model, wrong, rank=15, tp_rank=7)
    assert f"TP rank 7): verify failed, nothing was loaded: {name}: vLLM's load format is (18992, {H}), " \
           f"the recipe" in str(e.value) and "(19008, 2048)" in str(e.value), str(e.value)
