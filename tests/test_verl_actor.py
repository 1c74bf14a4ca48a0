"""verl 0.9.1's actor side through tritonreshard (``tritonreshard.frameworks.verl``): the
``"tritonreshard"`` checkpoint-engine backend publishing each actor rank's own shards.

Live: verl's own FSDP engine (``FSDPEngineWithLMHead``, built by verl from a saved tiny Llama, FSDP2
over 2 gloo processes; the CUDA-only calls stubbed are named in tests/_verl_actor.py) synced through
verl's ``ActorRolloutRefWorker.update_weights`` as the package wraps it (an optimizer step of verl's
own optimizer between syncs), read back by vLLM-layout inference ranks in processes of their own
(the recipe's inference side, ``hf_to_vllm`` TP 1: not vLLM engines) and compared bit for bit with
the actors' own shards; ``DTensor.full_tensor`` is counted (0) and so are the bytes each rank
copies. fp32 parameters in a fixed group (``elastic=False``), two syncs; bf16 parameters in an
elastic group (the default), three syncs as verl's manager changes its replicas: replica 0 alone,
replica 1 added, replica 1 removed after it was SIGKILLed before reading the second sync's version.

Megatron by interface: verl's Megatron engine needs Megatron-Bridge 0.5.2 (its export index is the
bridge's conversion tasks), which is not on PyPI, so the engine can't be built here. Its real
``get_per_tensor_param_shard`` runs on a real megatron-core GPTModel (TP 2 over gloo, CPU) with the
index built as verl's ``build_export_index`` builds it for pp = 1.

verl is installed with ``--no-deps`` next to CI's torch, transformers and vLLM (.ci/run says why).
"""
from __future__ import annotations

import asyncio
import inspect
import math
from types import SimpleNamespace

import pytest
import torch

import tritonreshard as trs

from _mp import free_port, run_ranks

pytest.importorskip("verl")
transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.timeout(240)

BF16 = torch.bfloat16
#: ``(model_dtype, elastic, rollout workers at each sync)``: verl's manager adds replica 1 before the
#: elastic group's second sync and removes it (dead) before the third.
VARIANTS = [("fp32", False, (1, 1)), ("bf16", True, (1, 2, 1))]


def _llama():
    # Uneven FSDP rows on purpose: vocab 301 over 2 ranks (151 + 150), GQA (4 heads, 2 KV heads).
    return transformers.LlamaConfig(vocab_size=301, hidden_size=48, intermediate_size=72, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=12,
                                    tie_word_embeddings=False, max_position_embeddings=64)


def _assemble(shards: dict, shapes: dict) -> dict:
    """The full tensors, put together here from both ranks' ``(local, offset)`` (the test's own
    reference: the library never builds them)."""
    full = {n: torch.full(shapes[n], float("nan"), dtype=BF16) for n in shapes}
    for rank_shards in shards:
        for n, (local, offset) in rank_shards.items():
            full[n][tuple(slice(o, o + s) for o, s in zip(offset, local.shape))] = local
    assert not any(torch.isnan(t).any() for t in full.values())
    return full


def test_fsdp_engine_publishes_its_own_shards_through_the_wrapped_update_weights(tmp_path):
    """fp32 parameters (verl's training default): verl's export casts each shard to a fresh bf16
    tensor, copied once per sync into the arena. bf16 parameters: the export is FSDP2's own local
    shards, bound to the arena at the first sync, so later syncs copy nothing. The elastic group
    keeps its trainers and arenas while replica 1 comes and dies; the sync after its death drops
    rank 3 by name, waits for nobody else, and replica 0 reads every version."""
    cfg = _llama()
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path / "model")
    (tmp_path / "marks").mkdir()
    from _verl_actor import refit_rank, unpack

    variants = [(dtype, free_port(), elastic, rollouts) for dtype, elastic, rollouts in VARIANTS]
    out = {r: unpack(v) for r, v in run_ranks(refit_rank, 4, args=(str(tmp_path / "model"), free_port(), variants,
                                                                   str(tmp_path / "marks")),
                                                timeout=220, victims=(3,)).items()}
    pulled = out[2]
    spec = trs.recipes.hf_to_vllm(cfg, tp=1, trainer_ranks=[0, 1], inference_ranks=[2], dtype=BF16, src_dtype=BF16)
    assert out[0]["full_tensor_calls"] == 0 and out[1]["full_tensor_calls"] == 0
    shapes = {n: lay.shape for n, lay in spec.src.items()}
    plan = spec.plan()
    wanted, at = [], 0
    for i, (dtype, _, elastic, rollouts) in enumerate(variants):
        for step in range(len(rollouts)):
            runs = [out[r]["variants"][i][step] for r in (0, 1)]
            full = _assemble([run["shards"] for run in runs], shapes)
            srcs = {r: {n: lay.shard(full[n], r) for n, lay in spec.src.items() if r in lay.ranks} for r in (0, 1)}
            want = trs.execute_local(plan, srcs, backend="torch")[2]
            wanted.append(want)
            got = pulled[at + step]
            assert set(got) == set(want)
            for n in want:
                assert torch.equal(got[n].view(torch.int16), want[n].view(torch.int16)), (dtype, step, n)
            for r, run in zip((0, 1), runs):
                m = run["metrics"]
                local = sum(t.numel() for t, _ in run["shards"].values()) * 2
                assert m["tritonreshard/version"] == 11 + step and m["tritonreshard/global_steps"] == 10 + step
                copies = local if step == 0 or dtype == "fp32" else 0  # bf16: the arena is FSDP2's shard
                assert m["tritonreshard/copied_bytes"] == copies, (dtype, step, r, m)
        # verl's optimizer stepped between the syncs: the second version differs from the first (with
        # bf16 parameters, the optimizer wrote the arena itself)
        first, second = pulled[at], pulled[at + 1]
        assert not torch.equal(first["model.embed_tokens.weight"], second["model.embed_tokens.weight"]), dtype
        at += len(rollouts)
    # The elastic group as verl's manager changed its replicas: the same trainer and arena on each
    # actor at every sync (no rejoin); replica 1 admitted for the second sync, then dropped by name.
    elastic = [out[r]["variants"][1] for r in (0, 1)]
    for r, runs in zip((0, 1), elastic):
        assert len({run["trainer"] for run in runs}) == 1 and len({tuple(run["arena"]) for run in runs}) == 1, r
        assert [run["readers"] for run in runs[1:]] == [[2, 3], [2]], (r, [run["readers"] for run in runs])
        assert runs[-1]["dropped"] == [3] and sum(run["metrics"]["tritonreshard/dropped"] for run in runs) == 1, r
        assert runs[-1]["metrics"]["tritonreshard/readers"] == 1
        assert any("dropped rollout rank(s) [3] from the refit group" in w and "rank 3 (pid" in w
                   for w in out[r]["warnings"]), out[r]["warnings"]
        # the fence after rank 3's death did not wait for it (the wait timeout is 120 s)
        assert runs[2]["seconds"] < 60, runs[2]["seconds"]
    replica1 = torch.load(tmp_path / "marks" / "replica1.pt", weights_only=True)
    assert replica1["first"] in (11, 12)  # admitted at the version the arena held, or at the next
    if replica1["first"] == 11:  # what it read is that version, bit for bit
        want = wanted[len(VARIANTS[0][2])]
        assert all(torch.equal(replica1["pulled"][n].view(torch.int16), want[n].view(torch.int16)) for n in want)
    print("per variant, rank, sync: (bytes copied, send_weights s, whole sync s)",
          {dtype: [[(run["metrics"]["tritonreshard/copied_bytes"], round(run["metrics"]["tritonreshard/send_s"], 4),
                     round(run["seconds"], 4)) for run in out[r]["variants"][i]] for r in (0, 1)]
           for i, (dtype, *_) in enumerate(variants)})


# ------------------------------------------------------------------------------ Megatron: by interface
def _megatron_rank(rank: int, port: int) -> dict:
    """A real megatron-core GPTModel (local layer spec, bf16 parameters, TP 2 over gloo), exported
    by verl's own ``MegatronEngine.get_per_tensor_param_shard``. Stubs: ``load_megatron_model_to_gpu``
    (no-op: moves offloaded parameters to the GPU) and ``get_device_id`` ("cpu") in verl's Megatron
    engine module; the export index is built here as ``build_export_index`` builds it for pp = 1."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    import verl.workers.engine.megatron.transformer_impl as mimpl
    from verl.workers.engine.megatron.delta_export import McoreParamExport
    from verl.workers.engine.spec import ShardSpec

    from tritonreshard.frameworks.verl import export_source

    mimpl.load_megatron_model_to_gpu = lambda *a, **k: None
    mimpl.get_device_id = lambda: "cpu"
    ps.initialize_model_parallel(2, 1)
    cfg = _llama()
    tc = TransformerConfig(num_layers=2, hidden_size=48, num_attention_heads=4, num_query_groups=2, kv_channels=12,
                           ffn_hidden_size=72, gated_linear_unit=True, activation_func=torch.nn.functional.silu,
                           normalization="RMSNorm", add_bias_linear=False, use_cpu_initialization=True,
                           tensor_model_parallel_size=2, params_dtype=BF16, pipeline_dtype=BF16)
    model = GPTModel(tc, get_gpt_layer_local_spec(normalization="RMSNorm"), vocab_size=512, max_sequence_length=64,
                     position_embedding_type="rope").bfloat16()  # every parameter bf16, as verl's Float16Module
    tp_group = ps.get_tensor_model_parallel_group()
    index = [McoreParamExport(name, p, ShardSpec(full_shape=tuple(p.shape), place=0, gather_group=tp_group)
                              if getattr(p, "tensor_model_parallel", False) else ShardSpec(full_shape=tuple(p.shape)),
                              probe=None, module=None) for name, p in model.named_parameters()]
    engine = SimpleNamespace(module=[model], model_config=SimpleNamespace(hf_config=cfg),
                             _mcore_export_index=lambda: index,
                             engine_config=SimpleNamespace(strategy="megatron", tensor_model_parallel_size=2,
                                                           pipeline_model_parallel_size=1, expert_model_parallel_size=1,
                                                           expert_tensor_parallel_size=None,
                                                           virtual_pipeline_model_parallel_size=None))
    engine.get_per_tensor_param_shard = mimpl.MegatronEngine.get_per_tensor_param_shard.__get__(engine)
    meg = dict(tp=2, pp=1, vocab_divisible_by=128)
    src = export_source(engine, trainer_ranks=[0, 1], rank=rank, megatron=meg)
    ours = trs.recipes.megatron_tensors([model], megatron=trs.recipes.Megatron(**meg), rank=rank)
    problems = []
    try:
        export_source(engine, trainer_ranks=[0, 1], rank=rank, megatron=dict(tp=1))
    except ValueError as exc:
        problems.append(str(exc))
    dist.destroy_process_group()
    return {"layouts": {n: str(lay) for n, lay in src.layouts.items()}, "bound": src.megatron is not None,
            "same": {n: torch.equal(src.tensors[n].view(torch.int16), ours[n].reshape(src.tensors[n].shape)
                                    .view(torch.int16)) and src.tensors[n].data_ptr() == ours[n].data_ptr()
                     for n in ours},
            "names": sorted(src.tensors), "ours": sorted(ours), "problems": problems}


def test_megatron_engine_export_maps_onto_the_megatron_recipe():
    out = run_ranks(_megatron_rank, 2, args=(free_port(),), timeout=200)
    spec = trs.recipes.megatron_to_vllm(_llama(), megatron=trs.recipes.Megatron(tp=2), tp=1, trainer_ranks=[0, 1],
                                        inference_ranks=[2])
    for r in (0, 1):
        o = out[r]
        assert o["names"] == o["ours"] == sorted(spec.src), r  # every recipe source, from verl's export
        assert all(o["same"].values()), [n for n, ok in o["same"].items() if not ok]
        assert o["layouts"] == {n: str(spec.src[n]) for n in spec.src}
        assert o["bound"], "bf16 parameters that own their storage can be the arena"
        assert "megatron disagrees with the engine's config: tp=1 but the engine has 2" in o["problems"][0]


# ------------------------------------------------------------------------------------ bad input
@pytest.fixture(scope="module")
def verl_actor():
    return pytest.importorskip("tritonreshard.frameworks.verl.actor")


class _Mesh:
    """The two attributes of a DeviceMesh the layout reads (no process group needed here)."""

    def __init__(self, ranks):
        self.mesh, self.device_type = torch.tensor(ranks), "cpu"


def test_a_shardspec_the_planner_cannot_serve_is_refused_naming_each_parameter(verl_actor):
    from torch.distributed.tensor import Partial, Shard
    from torch.distributed.tensor.placement_types import _StridedShard
    from verl.workers.engine.spec import ShardSpec

    mesh = _Mesh([0, 1])
    records = [("ok", torch.zeros(6, dtype=BF16), ShardSpec((4, 3), mesh, (Shard(0),))),
               ("strided", torch.zeros(6, dtype=BF16), ShardSpec((4, 3), mesh, (_StridedShard(0, split_factor=2),))),
               ("partial", torch.zeros(12, dtype=BF16), ShardSpec((4, 3), mesh, (Partial(),))),
               ("placed", torch.zeros(6, dtype=BF16), ShardSpec((4, 3), place=6, gather_group=object())),
               ("grouped", torch.zeros(6, dtype=BF16), ShardSpec((2, 3), gather_group=object())),
               ("short", torch.zeros(5, dtype=BF16), ShardSpec((4, 3), mesh, (Shard(0),))),
               ("fp32", torch.zeros(6), ShardSpec((4, 3), mesh, (Shard(0),)))]
    engine = SimpleNamespace(get_per_tensor_param_shard=lambda: (iter(records), None),
                             engine_config=SimpleNamespace(strategy="fsdp2"))
    with pytest.raises(ValueError) as e:
        verl_actor.export_source(engine, trainer_ranks=[0, 1], rank=1)
    msg = str(e.value)
    for part in ("'strided'", "_StridedShard", "'partial'", "Partial", "'placed': its ShardSpec places the shard",
                 "'grouped': its ShardSpec has a gather_group but no mesh", "'short': the local shard has 5 elements",
                 "'fp32': the export yielded torch.float32"):
        assert part in msg, (part, msg)
    assert "'ok'" not in msg


def test_the_wrap_knows_one_verl_and_one_signature(verl_actor):
    import verl
    from verl.workers.engine_workers import ActorRolloutRefWorker

    assert verl.__version__ == verl_actor.KNOWN_VERL
    assert getattr(ActorRolloutRefWorker.update_weights, "__tritonreshard_wrapped__", False)  # import installed it
    assert str(inspect.signature(ActorRolloutRefWorker.update_weights)) == verl_actor.KNOWN_SIGNATURE

    class Other:
        async def update_weights(self, global_steps: int = None, mode: str = "auto", extra=None):
            return {}

    with pytest.raises(ValueError) as e:
        verl_actor.wrap_update_weights(Other, "0.9.2")
    for part in ("verl 0.9.2", "Other.update_weights(self, global_steps: int = None, mode: str = 'auto', extra = None)",
                 f"knows verl {verl_actor.KNOWN_VERL}", verl_actor.KNOWN_SIGNATURE):
        assert part in str(e.value), (part, str(e.value))

    class Upstream:  # verl with the one-line fix: it reads consumes_engine itself, no wrap
        async def update_weights(self, global_steps: int = None, mode: str = "auto"):
            return getattr(self.checkpoint_engine, "consumes_engine", False)

    before = Upstream.update_weights
    assert verl_actor.wrap_update_weights(Upstream, "0.10.0") is False and Upstream.update_weights is before


def test_the_wrap_changes_nothing_for_other_backends_and_checks_settings_first(verl_actor):
    calls = []

    class Worker:
        async def update_weights(self, global_steps: int = None, mode: str = "auto"):
            calls.append((global_steps, mode))
            return {"verl": True}

    assert verl_actor.wrap_update_weights(Worker, verl_actor.KNOWN_VERL) is True
    assert verl_actor.wrap_update_weights(Worker, verl_actor.KNOWN_VERL) is False  # once
    other = SimpleNamespace(checkpoint_engine=SimpleNamespace(), config=None)
    assert asyncio.run(Worker.update_weights(other, global_steps=3, mode="nccl")) == {"verl": True}
    assert calls == [(3, "nccl")]

    from _verl_actor import worker_config

    sent = []
    ours = verl_actor.TritonreshardCheckpointEngine(bucket_size=1, is_master=True)

    async def send(engine, global_steps=None):
        sent.append(engine)

    ours.send_weights = send
    bad = SimpleNamespace(checkpoint_engine=ours, actor=SimpleNamespace(engine="engine"),
                          config=worker_config(**{"hybrid_engine": True, "rollout.name": "sglang"}))
    with pytest.raises(ValueError) as e:
        asyncio.run(Worker.update_weights(bad, global_steps=1, mode="naive"))
    for part in ("update_weights(mode='naive')", "trainer.v1.trainer_mode", "actor_rollout_ref.hybrid_engine=True",
                 "actor_rollout_ref.rollout.name='sglang'", "nothing was sent"):
        assert part in str(e.value), (part, str(e.value))
    assert sent == [] and calls == [(3, "nccl")]
    good = SimpleNamespace(checkpoint_engine=ours, actor=SimpleNamespace(engine="engine"), config=worker_config())
    asyncio.run(Worker.update_weights(good, global_steps=2))
    assert sent == ["engine"] and calls == [(3, "nccl")]


def test_the_backend_refuses_bad_config_gathered_tensors_and_a_changed_topology(verl_actor):
    from verl.checkpoint_engine import CheckpointEngineRegistry

    cls = CheckpointEngineRegistry.get("tritonreshard")
    assert cls is verl_actor.TritonreshardCheckpointEngine and cls.consumes_engine is True
    with pytest.raises(ValueError) as e:
        cls(bucket_size=1, is_master=True, store_port=70000, timeout=0, megatron={"tp": 0}, colour="red", elastic="yes")
    for part in ("store_port=70000", "timeout=0", "megatron={'tp': 0}", "unknown key 'colour'",
                 "elastic='yes' must be True or False"):
        assert part in str(e.value), (part, str(e.value))
    # A fixed group (elastic=False): every rollout worker a rank of the first sync's meeting.
    actor = cls(bucket_size=1, is_master=True, store_host="127.0.0.1", store_port=29999, elastic=False)
    meta = actor.prepare()
    assert meta == {"side": "actor", "rank": 0, "store": "127.0.0.1:29999", "megatron": None, "elastic": False}
    a, b = cls.build_topology(1, 2, [meta, {"side": "rollout"}, {"side": "rollout"}])
    assert [t["rank"] for t in a["topology"] + b["topology"]] == [0, 1, 2]
    assert b["topology"][1] == {"rank": 2, "store": "127.0.0.1:29999", "trainer_ranks": (0,),
                                "inference_ranks": (1, 2), "group": "verl", "src_dtype": "bfloat16", "megatron": None,
                                "elastic": False}
    with pytest.raises(ValueError, match=r"metadata sides \['rollout', 'actor'\]"):
        cls.build_topology(1, 1, [{"side": "rollout"}, meta])
    with pytest.raises(ValueError, match=r"the actors report elastic=\[False, True\]"):
        cls.build_topology(2, 0, [meta, {**meta, "rank": 1, "elastic": True}])
    actor.init_process_group(**{k: v[0] for k, v in a.items()})
    gathered = ((f"w{i}", torch.zeros(2)) for i in range(3))
    with pytest.raises(ValueError, match="gathered tensors.*nothing was read"):
        asyncio.run(actor.send_weights(gathered, global_steps=1))
    assert next(gathered)[0] == "w0"  # not one tensor was taken from verl's generator
    assert actor.init_info == {"store": "127.0.0.1:29999", "trainer_ranks": [0], "inference_ranks": [1, 2],
                               "group": "verl", "src_dtype": "bfloat16"}
    actor.trainer = SimpleNamespace(published=11)  # as if the group had formed at global_steps 10
    with pytest.raises(ValueError) as e:  # verl's add_replicas: a fixed group can't follow
        actor.init_process_group(**{k: v[0] for k, v in cls.build_topology(1, 3, [meta] + [{"side": "rollout"}] * 3)[0]
                                    .items()})
    for part in ("topology changed after the refit group formed (inference_ranks: (1, 2) -> (1, 2, 3))",
                 "this refit group is fixed (engine_kwargs elastic=False)", "nothing was changed"):
        assert part in str(e.value), (part, str(e.value))
    assert actor.topology.inference_ranks == (1, 2)
    with pytest.raises(ValueError, match=r"global_steps=12 is version 13, but this rank's last version is 11.*nothing"):
        asyncio.run(actor.send_weights(SimpleNamespace(get_per_tensor_param_shard=None), global_steps=12))
    actor.trainer = None
    assert math.isfinite(actor.config.timeout)


def test_an_elastic_actor_follows_replica_changes_and_refuses_any_other(verl_actor):
    """The default: the actors meet alone, so verl's add_replicas / remove_replicas (another number
    of rollout workers at the next sync's build_topology) leave the actors' topology as it was; a
    change of the actors' number or of the Megatron settings is refused naming old and new."""
    cls = verl_actor.TritonreshardCheckpointEngine
    actor = cls(bucket_size=1, is_master=True, store_host="127.0.0.1", store_port=29999)
    meta = actor.prepare()
    assert meta["elastic"] is True and actor.config.elastic is True
    a, b = cls.build_topology(1, 2, [meta, {"side": "rollout"}, {"side": "rollout"}])
    assert a["topology"][0]["rank"] == 0 and a["topology"][0]["inference_ranks"] == ()
    assert [t["rank"] for t in b["topology"]] == [None, None]  # a replica's ranks follow from its index
    actor.init_process_group(**{k: v[0] for k, v in a.items()})
    assert actor.init_info == {"store": "127.0.0.1:29999", "trainer_ranks": [0], "group": "verl",
                               "src_dtype": "bfloat16", "elastic": True}
    formed = actor.trainer = SimpleNamespace(published=11)
    for n_rollout in (4, 0, 6):  # replicas added, all removed, added again: nothing to follow here
        actor.init_process_group(**{k: v[0] for k, v in cls.build_topology(
            1, n_rollout, [meta] + [{"side": "rollout"}] * n_rollout)[0].items()})
        assert actor.trainer is formed and actor.topology.trainer_ranks == (0,)
    other = {**meta, "rank": 1, "store": None, "megatron": {"tp": 2}}
    grown = cls.build_topology(2, 2, [{**meta, "megatron": {"tp": 2}}, other] + [{"side": "rollout"}] * 2)[0]
    with pytest.raises(ValueError) as e:
        actor.init_process_group(**{k: v[0] for k, v in grown.items()})
    for part in ("(refit rank 0): the topology changed after the refit group formed",
                 "trainer_ranks: (0,) -> (0, 1)", "megatron: None -> {'tp': 2}",
                 "a change of the actor world size, the Megatron settings", "needs a restart of the job"):
        assert part in str(e.value), (part, str(e.value))
    assert actor.topology.trainer_ranks == (0,) and actor.trainer is formed
    actor.trainer = None
