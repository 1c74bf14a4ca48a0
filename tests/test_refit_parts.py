"""The cross-process engine runs ``parts=`` plans: recipes (HF -> vLLM) and hand-made parts.

Trainers hold HF-named source shards, inference ranks vLLM-named destinations built from them
(q/k/v -> qkv_proj, gate/up -> gate_up_proj, padded vocab). Each rank's result must equal
``execute_local`` of the same plan bit for bit, padding must be zero, and destinations start
poisoned (NaN) so a missed element shows. Data is provenance-encoded (``_provenance``) and
changes every version: element ``i`` of source ``name`` at version ``v`` encodes (``i``, ``v``, the
name), exact in the source's dtype and in every destination dtype (bfloat16 ``a_mid`` included, so
its ``src_start`` offset shows), and every element and version differ.
"""

import pytest
import torch
from _mp import free_port, run_ranks
from _provenance import provenance

import tritonreshard as trs
from tritonreshard import Layout, Part, Replicate, Shard
from tritonreshard.planning import plan_hosts

pytestmark = pytest.mark.timeout(300)

TRAINERS = [0, 1]


def _full(name_id: int, layout: Layout, version: int, dtypes=(), tags: int = 64) -> torch.Tensor:
    """Source ``name_id`` at ``version``: exact in ``layout.dtype`` and each of ``dtypes``."""
    return provenance(layout.shape, version, name_id, dtypes=(layout.dtype, *dtypes), tags=tags)


def _src_shards(src: dict, rank: int, version: int, dst: dict | None = None) -> dict:
    """This rank's source shards at ``version``, exact in every destination dtype of ``dst`` too."""
    ids = {n: i + 1 for i, n in enumerate(sorted(src))}
    dtypes = {lay.dtype for lay in (dst or {}).values()}
    return {n: lay.shard(_full(ids[n], lay, version, dtypes, tags=len(ids) + 1).to(lay.dtype), rank)
            for n, lay in src.items() if rank in lay.ranks}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _check(rank, plan, tensors, want, fills, v):
    assert sorted(tensors) == sorted(want[rank]), rank
    for n, t in tensors.items():
        w = want[rank][n]
        assert t.dtype == w.dtype and t.shape == w.shape, (rank, n)
        assert not torch.isnan(t).any(), f"rank {rank} {n} v{v}: NaN (poison) left"
        assert torch.equal(_bits(t), _bits(w)), f"rank {rank} {n} v{v}:\n{t}\n!=\n{w}"
    for f in fills:
        filled = _bits(tensors[f.name][f.dst_slices])
        assert torch.equal(filled, torch.zeros_like(filled)), f


def _worker(rank, world, port, src, dst, parts, mode, versions, use_from_recipe, spec, addr="127.0.0.1"):
    """One rank; ``addr``: the store's host (rank 0's address on the host harness)."""
    torch.set_num_threads(1)
    plan = trs.plan_reshard(src, dst, parts)
    kwargs = dict(meeting=trs.Meeting(rank=rank, world_size=world, store=f"{addr}:{port}"),
                  timeouts=trs.Timeouts(wait=90))
    trainer = rank in plan.src_ranks
    report = {"fills": 0, "checked": 0}
    if trainer:
        shards = _src_shards(src, rank, 1, dst)
        ep = (trs.RefitTrainer.from_recipe(spec, shards, **kwargs) if use_from_recipe
              else trs.RefitTrainer(shards, src, **kwargs))
    else:
        poison = {n: torch.full(lay.local_shape(rank), float("nan"), dtype=lay.dtype)
                  for n, lay in dst.items() if rank in lay.ranks}
        kwargs.update(tensors=poison, pull=trs.PullOptions(mode=mode))
        ep = (trs.RefitInference.from_recipe(spec, **kwargs) if use_from_recipe
              else trs.RefitInference(dst, parts=parts, **kwargs))
    with ep:
        fills = plan.fills_for_dst(rank)
        report["fills"] = sum(f.numel for f in fills)
        if not trainer:
            # Padding is zeroed at set-up (no pull ever writes it); the rest is still poison.
            for f in fills:
                assert not ep.tensors[f.name][f.dst_slices].any()
            if mode == "inplace":
                assert all(torch.isnan(t).any() for t in ep.tensors.values())
        for v in range(1, versions + 1):
            if trainer:
                ep.fence()
                if v > 1:  # the "optimizer step": new weights, in place in the arena
                    for n, t in _src_shards(src, rank, v, dst).items():
                        ep.source_tensors[n].copy_(t)
                assert ep.publish() == v
                continue
            # Every rank's expected output, computed here from the full sources of version v.
            want = trs.execute_local(plan, {r: _src_shards(src, r, v, dst) for r in plan.src_ranks}, backend="torch")
            if mode == "shadow" and v > 1:
                assert ep.start_pull() == v
                assert ep.swap() == v
            else:
                assert ep.pull() == v
            assert ep.version == v and ep.consistent
            _check(rank, plan, ep.tensors, want, fills, v)
            report["checked"] += 1
        if trainer:
            ep.fence()
        report["cross_host_bytes"] = ep.stats.cross_host_bytes
    return report


def _tiny_llama_spec(tp):
    transformers = pytest.importorskip("transformers")
    # vocab 100 pads to 128 in vLLM: rank tp-1 holds zero rows; GQA (4 heads, 2 KV heads).
    config = transformers.LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    inference = list(range(len(TRAINERS), len(TRAINERS) + tp))
    return trs.recipes.hf_to_vllm(config, tp=tp, trainer_ranks=TRAINERS, inference_ranks=inference,
                                  dtype=torch.float32, src_dtype=torch.float32)


@pytest.mark.parametrize("mode,tp,from_recipe,versions", [("shadow", 2, True, 3), ("inplace", 4, False, 2)])
def test_llama_recipe_refits_bit_exact_through_the_engine(mode, tp, from_recipe, versions):
    spec = _tiny_llama_spec(tp)
    plan = spec.plan()
    assert any(op.src_name != op.name for op in plan.ops) and plan.fills  # the recipe's features are used
    assert {"model.layers.0.self_attn.qkv_proj.weight", "model.embed_tokens.weight"} <= set(spec.dst)
    world = len(TRAINERS) + tp
    out = run_ranks(_worker, world, args=(world, free_port(), spec.src, spec.dst, spec.parts, mode, versions,
                                          from_recipe, spec), timeout=280)
    inference = range(len(TRAINERS), world)
    assert all(out[r]["checked"] == versions for r in inference)
    assert out[world - 1]["fills"] > 0  # the last TP rank holds the vocab padding


def _hand_layouts(n_inf):
    inf = list(range(2, 2 + n_inf))
    src = {"a": Layout((6, 4), TRAINERS, [Shard(0)]),
           "b": Layout((3, 4), TRAINERS, [Replicate()])}
    dst = {"ab": Layout((12, 4), inf, [Shard(0)]),                       # a | b | zeros
           "a_mid": Layout((4, 4), inf, [Shard(1)], dtype=torch.bfloat16),  # a again, rows 1..4, cast
           "b": Layout((3, 4), inf, [Replicate()])}                       # namesake, no parts
    parts = {"ab": [Part("a", [(0, 6), None]), Part("b", [(6, 9), None]), Part(None, [(9, 12), None])],
             "a_mid": [Part("a", [(0, 4), (0, 4)], src_start=(1, 0))]}
    return src, dst, parts


@pytest.mark.parametrize("mode", ["shadow", "inplace"])
def test_hand_made_parts_with_padding_and_a_reused_source(mode):
    src, dst, parts = _hand_layouts(2)
    plan = trs.plan_reshard(src, dst, parts)
    assert {op.src_name for op in plan.ops if op.name in ("ab", "a_mid")} == {"a", "b"}
    assert sum(f.numel for f in plan.fills) == 3 * 4  # rows 9..12 of ab, on rank 3
    # The workers compare with execute_local of the same plan; check that reference against the
    # provenance itself, so a plan that lost src_start or misplaced a part cannot pass on both sides.
    want = trs.execute_local(plan, {r: _src_shards(src, r, 1, dst) for r in plan.src_ranks}, backend="torch")
    a, b = (_full(i, src[n], 1, (torch.bfloat16,), tags=3).float() for i, n in ((1, "a"), (2, "b")))
    full_ab = torch.cat([a, b, torch.zeros(3, 4)])
    for r in (2, 3):
        assert torch.equal(want[r]["ab"], dst["ab"].shard(full_ab, r))
        assert torch.equal(want[r]["a_mid"], dst["a_mid"].shard(a[1:5].to(torch.bfloat16), r))  # src_start=(1, 0)
        assert torch.equal(want[r]["b"], b)
    out = run_ranks(_worker, 4, args=(4, free_port(), src, dst, parts, mode, 2, False, None), timeout=200)
    assert out[2]["checked"] == out[3]["checked"] == 2
    assert out[3]["fills"] == 12 and out[2]["fills"] == 0


def _disagree_worker(rank, world, port):
    src, dst, parts = _hand_layouts(2)
    kwargs = dict(meeting=trs.Meeting(rank=rank, world_size=world, store=f"127.0.0.1:{port}"),
                  timeouts=trs.Timeouts(wait=60))
    if rank < 2:
        ep = trs.RefitTrainer(_src_shards(src, rank, 1), src, **kwargs)
    elif rank == 3:  # believes ab's padding is only 2 rows, and passes a non-Part for a_mid
        bad = dict(parts, ab=[Part("a", [(0, 6), None]), Part("b", [(6, 9), None]), Part(None, [(9, 11), None]),
                              Part("b", [(11, 12), None])],
                   a_mid=["a"])
        ep = trs.RefitInference(dst, parts=bad, **kwargs)
    else:
        ep = trs.RefitInference(dst, parts=parts, **kwargs)
    ep.close()


def test_inference_ranks_disagreeing_on_parts_fail_on_every_rank_naming_both():
    out = run_ranks(_disagree_worker, 4, args=(4, free_port()), timeout=120, allow_errors=True)
    for r in range(4):
        status, value = out[r]
        assert status == "error", f"rank {r} did not fail: {value}"
        name, message, _ = value
        assert name == "ValueError" and "nothing was moved" in message
        assert "rank 3: parts['a_mid'] must be a list of trs.Part, got ['a']" in message
        assert ("rank 3 joined with parts['ab']=[[0:6, :] <- a, [6:9, :] <- b, [9:11, :] <- zeros, "
                "[11:12, :] <- b] but rank 2 has [[0:6, :] <- a, [6:9, :] <- b, [9:12, :] <- zeros]") in message


def test_parts_and_recipe_arguments_are_checked_before_joining():
    src, dst, parts = _hand_layouts(1)
    with pytest.raises(ValueError, match=r"the inference side needs its layouts, got layouts=None \(parts describe "
                                         r"destinations: give them with the layouts"):
        trs.RefitEndpoint(meeting=trs.Meeting(rank=0, world_size=1), source=trs.SourceData(_src_shards(src, 0, 1), src),
                          destination=trs.DestinationData(None, parts=parts))
    with pytest.raises(ValueError, match=r"RefitInference.from_recipe: spec must be a trs.recipes.RecipeSpec.*"
                                         r"got spec=\{'ab'"):
        trs.RefitInference.from_recipe(dst, meeting=trs.Meeting(rank=0, world_size=1))
    with pytest.raises(ValueError, match=r"RefitTrainer.from_recipe: spec must be"):
        trs.RefitTrainer.from_recipe(src, {}, meeting=trs.Meeting(rank=0, world_size=1))


@pytest.mark.parametrize("recipe", [False, True], ids=["hand-made", "llama-tp2"])
def test_parts_plans_across_two_hosts(recipe, two_hosts):
    """Trainers on host0, inference ranks on host1 of the host harness (a network, /dev/shm and
    hostname each): the renamed, cast and padded parts arrive through the cross-host relays bit for
    bit, padding stays zero (it never crosses), and each source byte an inference host needs
    crosses once per refit."""
    if recipe:
        spec = _tiny_llama_spec(2)
        src, dst, parts = spec.src, spec.dst, spec.parts
    else:
        src, dst, parts = _hand_layouts(2)
    plan = trs.plan_reshard(src, dst, parts)
    hosts = {0: "host0", 1: "host0", 2: "host1", 3: "host1"}
    out = two_hosts.run_ranks(_worker, [0, 0, 1, 1], args=(4, free_port(), src, dst, parts, "shadow", 2, False, None,
                                                           two_hosts.address(0)), timeout=280)
    assert out[2]["checked"] == out[3]["checked"] == 2
    assert out[2]["fills"] + out[3]["fills"] == sum(f.numel for f in plan.fills) > 0
    # The engine's own accounting equals the host plan's: at most every source byte, once.
    hp = plan_hosts(plan, hosts)
    source_bytes = sum(lay.numel * lay.dtype.itemsize for lay in src.values())
    assert 0 < out[2]["cross_host_bytes"] + out[3]["cross_host_bytes"] == hp.cross_host_bytes <= source_bytes


def test_transposed_parts_refit_bit_exact_through_the_engine():
    """gpt-oss's routed experts are transposed parts (``Part(src_dims=(0, 2, 1))``): the engine's
    single-host pull reads them through ``permute`` as ``execute_local`` does (which
    tests/test_gpt_oss.py checks against vLLM's own loader), on every TP rank."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GptOssConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=4,
                                       num_experts_per_tok=2)
    spec = trs.recipes.hf_to_vllm(config, tp=2, trainer_ranks=TRAINERS, inference_ranks=[2, 3], dtype=torch.float32)
    assert any(op.src_dims is not None for op in spec.plan().ops)
    out = run_ranks(_worker, 4, args=(4, free_port(), spec.src, spec.dst, spec.parts, "shadow", 2, True, spec),
                    timeout=200)
    assert out[2]["checked"] == out[3]["checked"] == 2
