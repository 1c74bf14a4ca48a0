"""Fail-closed (``verify=``): a recipe checked against vLLM 0.32's own ``load_weights`` of the same
integer-coded full tensors, in this process, on each TP rank's real vLLM model class (built on the
meta device: the live-engine check is in tests/test_vllm.py). Three planted wrong recipes, each with
vLLM's names and load-format shapes right (the model check passes them: without verify they would
serve), are each refused, naming the parameter and the recipe."""
import dataclasses

import pytest
import torch

import tritonreshard as trs
from test_recipes import _configs

pytest.importorskip("vllm")
# Lazy (after the skip): these modules import vLLM.
from tritonreshard.vllm._model import check_model  # noqa: E402
from tritonreshard.vllm._verify import verify_model  # noqa: E402
from tritonreshard.vllm.trace import rank_models  # noqa: E402

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
        stats = verify_model(model, spec, rank=INFERENCE[t], tp_rank=t, sample="all")
        assert stats["verify_params"] == len(spec.dst) and stats["verify_peak_bytes"] > 0
    # The default sample: every structure's first layer, the last layer, everything outside the layers.
    units = verify_units(spec, True)
    assert sum(map(len, units)) == len(spec.dst)  # 2-3 layers: the sample is all of them here
    stats = verify_model(models[0], spec, rank=INFERENCE[0], tp_rank=0)
    assert stats["verify_params"] == len(spec.dst)


def test_sample_takes_each_structure_once_and_the_last_layer():
    config = _configs()["deepseek_v3"]
    config.num_hidden_layers = 6  # layer 0 dense, 1-5 MoE
    spec = trs.recipes.hf_to_vllm(config, tp=2, trainer_ranks=[0, 1], inference_ranks=INFERENCE)
    layers = [{int(n.split(".")[2]) for n in u if ".layers." in n} for u in verify_units(spec, True)]
    assert [sorted(x) for x in layers if x] == [[0], [1], [5]]
    assert len(verify_units(spec, "all")) == 6 + 3  # six layers, embed, norm, lm_head


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
    E = spec.dst[w13].shape[0]
    src = spec.parts[w13][0].src
    reversed_experts = [trs.Part(src, [(e, e + 1), None, None], (E - 1 - e, 0, 0)) for e in range(E)]
    return models, [(_replace(spec, w13, parts=reversed_experts), w13)]


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_planted_wrong_recipes_are_refused_naming_the_parameter(arch):
    models, planted = _planted(arch)
    for spec, name in planted:
        for t, model in enumerate(models):
            # Off (verify=False): the model check is all that runs, and it passes every plant.
            check_model(model, spec, rank=INFERENCE[t], tp_rank=t)
            with pytest.raises(ValueError) as e:
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
    verify_model(model, spec, rank=2, tp_rank=0, sample="all")
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())


def test_verify_is_an_init_info_field():
    info = trs.vllm.init_info(store="h:1", trainer_ranks=[0], inference_ranks=[1])
    assert info["verify"] is True
    assert trs.vllm.init_info(store="h:1", trainer_ranks=[0], inference_ranks=[1], verify="all")["verify"] == "all"
    for bad in ("some", 1, None):
        with pytest.raises(ValueError, match="verify must be True, False or 'all'"):
            trs.vllm.init_info(store="h:1", trainer_ranks=[0], inference_ranks=[1], verify=bad)
