"""verl 0.9.1's actor side through tritonreshard (``tritonreshard.frameworks.verl``): the
``"tritonreshard"`` checkpoint-engine backend publishing each actor rank's own shards.

Live: verl's own FSDP engine (``FSDPEngineWithLMHead``, built by verl from a saved tiny Llama, FSDP2
over 2 gloo processes; the CUDA-only calls stubbed are named in tests/_verl_actor.py) synced through
verl's ``ActorRolloutRefWorker.update_weights`` as the package wraps it (an optimizer step of verl's
own optimizer between syncs), read back by vLLM-layout inference ranks in processes of their own
(the recipe's inference side, ``hf_to_vllm`` TP 1: not vLLM engines) and compared bit for bit with
the actors' own shards; ``DTensor.full_tensor`` is counted (0) and so are the bytes each rank
copies. The actors send their parameters' own dtype (the topology's ``src_dtype``) and the reader's
copy casts to its vLLM dtype: fp32 parameters into a float32 reader in a fixed group
(``elastic=False``), two syncs, bit for bit fp32; fp32 parameters into a bf16 reader, one sync,
equal to verl's own bf16 cast of them; bf16 parameters into a bf16 reader in an elastic group (the
default), three syncs as verl's manager changes its replicas: replica 0 alone, replica 1 added,
replica 1 removed after it was SIGKILLed before reading the second sync's version.

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
from _mp import free_port, run_ranks

import tritonreshard as trs

pytest.importorskip("verl")
transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.timeout(240)

BF16, FP32 = torch.bfloat16, torch.float32
#: ``(model_dtype, the reader's vLLM dtype, elastic, rollout workers at each sync)``: verl's manager adds
#: replica 1 before the elastic group's second sync and removes it (dead) before the third.
VARIANTS = [("fp32", FP32, False, (1, 1)), ("fp32", BF16, False, (1,)), ("bf16", BF16, True, (1, 2, 1))]


def _llama():
    # Uneven FSDP rows on purpose: vocab 301 over 2 ranks (151 + 150), GQA (4 heads, 2 KV heads).
    return transformers.LlamaConfig(vocab_size=301, hidden_size=48, intermediate_size=72, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=12,
                                    tie_word_embeddings=False, max_position_embeddings=64)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bits, for comparisons in which NaN equals itself and -0.0 differs from 0.0."""
    return t.view({4: torch.int32, 2: torch.int16}[t.element_size()])


def _assemble(shards: dict, shapes: dict) -> dict:
    """The full tensors, in the shards' dtype, put together here from both ranks' ``(local,
    offset)`` (the test's own reference: the library never builds them)."""
    dtype = next(iter(shards[0].values()))[0].dtype
    full = {n: torch.full(shapes[n], float("nan"), dtype=dtype) for n in shapes}
    for rank_shards in shards:
        for n, (local, offset) in rank_shards.items():
            full[n][tuple(slice(o, o + s) for o, s in zip(offset, local.shape, strict=True))] = local
    assert not any(torch.isnan(t).any() for t in full.values())
    return full


def test_fsdp_engine_publishes_its_own_shards_through_the_wrapped_update_weights(tmp_path):
    """The actors announce their parameters' dtype in verl's topology and publish FSDP2's own local
    shards in it, bound to the arena at the first sync (later syncs copy nothing); the reader's copy
    casts once, to its vLLM dtype. fp32 parameters reach a float32 reader bit for bit (verl's own
    export would have sent bf16), and a bf16 reader as verl's bf16 cast of them. The elastic group
    keeps its trainers and arenas while replica 1 comes and dies; the sync after its death drops
    rank 3 by name, waits for nobody else, and replica 0 reads every version."""
    cfg = _llama()
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path / "model")
    (tmp_path / "marks").mkdir()
    from _verl_actor import MODEL_DTYPES, refit_rank, unpack

    variants = [(dtype, vllm_dtype, free_port(), elastic, rollouts) for dtype, vllm_dtype, elastic, rollouts
                in VARIANTS]
    out = {r: unpack(v) for r, v in run_ranks(refit_rank, 4, args=(str(tmp_path / "model"), free_port(), variants,
                                                                   str(tmp_path / "marks")),
                                                timeout=230, victims=(3,)).items()}
    pulled = out[2]
    assert out[0]["full_tensor_calls"] == 0 and out[1]["full_tensor_calls"] == 0
    wanted, at = [], 0
    for i, (dtype, vllm_dtype, _, _, rollouts) in enumerate(variants):
        src_dtype = MODEL_DTYPES[dtype]
        spec = trs.recipes.hf_to_vllm(cfg, tp=1, trainer_ranks=[0, 1], inference_ranks=[2], dtype=vllm_dtype,
                                      src_dtype=src_dtype)
        shapes, plan = {n: lay.shape for n, lay in spec.src.items()}, spec.plan()
        for step in range(len(rollouts)):
            runs = [out[r]["variants"][i][step] for r in (0, 1)]
            assert [run["src_dtype"] for run in runs] == [str(src_dtype).removeprefix("torch.")] * 2  # the topology's
            full = _assemble([run["shards"] for run in runs], shapes)
            assert {t.dtype for t in full.values()} == {src_dtype}
            srcs = {r: {n: lay.shard(full[n], r) for n, lay in spec.src.items() if r in lay.ranks} for r in (0, 1)}
            want = trs.execute_local(plan, srcs, backend="torch")[2]
            wanted.append(want)
            got = pulled[at + step]
            assert set(got) == set(want) and {t.dtype for t in got.values()} == {vllm_dtype}
            for n in want:
                assert torch.equal(_bits(got[n]), _bits(want[n])), (dtype, step, n)
            if src_dtype == FP32 and vllm_dtype == FP32:  # fp32 as trained: not what a bf16 wire leaves of it
                # (vLLM pads the vocabulary rows: the first ones are the model's)
                assert all(torch.equal(got[n][:len(full[n])], full[n]) for n in ("model.embed_tokens.weight",
                                                                                  "lm_head.weight"))
                assert not torch.equal(got["lm_head.weight"], got["lm_head.weight"].to(BF16).to(FP32))
            if src_dtype == FP32 and vllm_dtype == BF16:  # the copy's cast is verl's export's, bit for bit
                bf16 = trs.recipes.hf_to_vllm(cfg, tp=1, trainer_ranks=[0, 1], inference_ranks=[2], dtype=BF16,
                                              src_dtype=BF16)
                cast = {r: {n: lay.shard(full[n].to(BF16), r) for n, lay in bf16.src.items() if r in lay.ranks}
                        for r in (0, 1)}
                verl_cast = trs.execute_local(bf16.plan(), cast, backend="torch")[2]
                assert all(torch.equal(_bits(got[n]), _bits(verl_cast[n])) for n in want)
            for r, run in zip((0, 1), runs, strict=True):
                m = run["metrics"]
                local = sum(t.numel() * t.element_size() for t, _ in run["shards"].values())
                assert m["tritonreshard/version"] == 11 + step and m["tritonreshard/global_steps"] == 10 + step
                copies = local if step == 0 else 0  # the arena is FSDP2's own shard, in any dtype
                assert m["tritonreshard/copied_bytes"] == copies, (dtype, step, r, m)
        if len(rollouts) > 1:
            # verl's optimizer stepped between the syncs: the second version differs from the first
            # (the optimizer wrote the arena itself)
            first, second = pulled[at], pulled[at + 1]
            assert not torch.equal(first["model.embed_tokens.weight"], second["model.embed_tokens.weight"]), dtype
        at += len(rollouts)
    # The elastic group as verl's manager changed its replicas: the same trainer and arena on each
    # actor at every sync (no rejoin); replica 1 admitted for the second sync, then dropped by name.
    e = next(i for i, v in enumerate(VARIANTS) if v[2])
    elastic = [out[r]["variants"][e] for r in (0, 1)]
    for r, runs in zip((0, 1), elastic, strict=True):
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
        want = wanted[sum(len(v[3]) for v in VARIANTS[:e])]
        assert all(torch.equal(_bits(replica1["pulled"][n]), _bits(want[n])) for n in want)
    print("per variant, rank, sync: (bytes copied, send_weights s, whole sync s)",
          {f"{dtype}->{vllm_dtype}": [[(run["metrics"]["tritonreshard/copied_bytes"],
                                         round(run["metrics"]["tritonreshard/send_s"], 4), round(run["seconds"], 4))
                                        for run in out[r]["variants"][i]] for r in (0, 1)]
           for i, (dtype, vllm_dtype, *_) in enumerate(variants)})


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
                 "'fp32': the export yielded torch.float32; this actor sends torch.bfloat16"):
        assert part in msg, (part, msg)
    assert "'ok'" not in msg


def test_fp32_parameters_are_never_sent_as_verls_bf16_copy(verl_actor):
    """An engine whose parameters are fp32 but whose export only has verl's bf16 casts of them (no
    FSDP2 module to read them from under those names) is refused by name: the vLLM workers would
    get bf16 values labelled as the actor's weights. The dtype announced in the topology is checked
    against the parameters, and parameters of two dtypes are refused naming both."""
    from torch.distributed.tensor import Shard
    from verl.workers.engine.spec import ShardSpec

    mesh = _Mesh([0, 1])
    records = [("w", torch.zeros(6, dtype=BF16), ShardSpec((4, 3), mesh, (Shard(0),))),
               ("b", torch.zeros(2, dtype=BF16), ShardSpec((4,), mesh, (Shard(0),)))]
    engine = SimpleNamespace(get_per_tensor_param_shard=lambda: (iter(list(records)), None),
                             module=torch.nn.Linear(3, 4), engine_config=SimpleNamespace(strategy="fsdp2"))
    assert verl_actor.source_dtype(engine) == torch.float32
    with pytest.raises(ValueError) as e:
        verl_actor.export_source(engine, trainer_ranks=[0, 1], rank=1)
    msg = str(e.value)
    for part in ("'w': verl's export cast it to torch.bfloat16, and the module has no tensor of that name and size",
                 "'b': verl's export cast it", "a bf16 copy of torch.float32 weights is not sent"):
        assert part in msg, (part, msg)
    records[:] = [(n, t.float(), spec) for n, t, spec in records]  # an export that keeps fp32: served as it is
    assert set(verl_actor.export_source(engine, trainer_ranks=[0, 1], rank=1).tensors) == {"w", "b"}
    with pytest.raises(ValueError, match=r"announced src_dtype torch.bfloat16 in verl's topology \(prepare\), but its "
                                         r"parameters are torch.float32"):
        verl_actor.export_source(engine, trainer_ranks=[0, 1], rank=1, src_dtype=BF16)
    mixed = SimpleNamespace(module=torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2).bfloat16()))
    with pytest.raises(ValueError, match=r"parameters are float32: \['0.weight', '0.bias'\]; bfloat16: "
                                         r"\['1.weight', '1.bias'\]; the refit sends one dtype"):
        verl_actor.source_dtype(mixed)


def test_the_wrap_knows_one_verl_and_one_signature(verl_actor):
    import verl
    from verl.workers.engine_workers import ActorRolloutRefWorker

    assert verl.__version__ == verl_actor.KNOWN_VERL
    assert getattr(ActorRolloutRefWorker.update_weights, "__tritonreshard_wrapped__", False)  # import installed it
    assert str(inspect.signature(ActorRolloutRefWorker.update_weights)) == verl_actor.KNOWN_SIGNATURE
    from verl.single_controller.base.decorator import MAGIC_ATTR

    execute = ActorRolloutRefWorker.execute_checkpoint_engine
    assert getattr(execute, "__tritonreshard_wrapped__", False) and hasattr(execute, MAGIC_ATTR)  # verl's dispatch
    assert str(inspect.signature(execute)) == verl_actor.KNOWN_EXECUTE_SIGNATURE
    assert verl_actor.wrap_execute_checkpoint_engine(ActorRolloutRefWorker) is False  # once

    class Async:
        async def execute_checkpoint_engine(self, method: str, *args, **kwargs):
            return None

    with pytest.raises(ValueError, match=r"Async.execute_checkpoint_engine\(self, method: str, \*args, \*\*kwargs\) "
                                         r"\(async: True\); the wrap knows"):
        verl_actor.wrap_execute_checkpoint_engine(Async)

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

    class Executor:  # verl's execute_checkpoint_engine: the backend's method by name
        def execute_checkpoint_engine(self, method: str, *args, **kwargs):
            return getattr(self.checkpoint_engine, method)(*args, **kwargs)

    assert verl_actor.wrap_execute_checkpoint_engine(Executor) is True
    other = SimpleNamespace(checkpoint_engine=SimpleNamespace(prepare=lambda: {"other": 1}))
    assert Executor.execute_checkpoint_engine(other, "prepare") == {"other": 1}
    model = torch.nn.Linear(2, 2).bfloat16()
    mine = SimpleNamespace(checkpoint_engine=ours, actor=SimpleNamespace(engine=SimpleNamespace(module=model)))
    assert Executor.execute_checkpoint_engine(mine, "prepare")["src_dtype"] == "bfloat16"  # handed over first
    assert ours.actor_engine is mine.actor.engine


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
    bare = actor.prepare()  # verl's prepare without the engine: the topology can't say the dtype
    assert bare["src_dtype"] is None
    with pytest.raises(ValueError, match=r"actor rank\(s\) \[0\] reported no src_dtype: verl ran prepare\(\) without "
                                         r"handing the backend its training engine \(the wrap of "
                                         r"ActorRolloutRefWorker"):
        cls.build_topology(1, 0, [bare])
    actor.actor_engine = SimpleNamespace(module=torch.nn.Linear(2, 2))  # as the wrap hands it over: fp32
    meta = actor.prepare()
    assert meta == {"side": "actor", "rank": 0, "store": "127.0.0.1:29999", "megatron": None, "elastic": False,
                    "src_dtype": "float32"}
    a, b = cls.build_topology(1, 2, [meta, {"side": "rollout"}, {"side": "rollout"}])
    assert [t["rank"] for t in a["topology"] + b["topology"]] == [0, 1, 2]
    assert b["topology"][1] == {"rank": 2, "store": "127.0.0.1:29999", "trainer_ranks": (0,),
                                "inference_ranks": (1, 2), "group": "verl", "src_dtype": "float32", "megatron": None,
                                "elastic": False}
    with pytest.raises(ValueError, match=r"metadata sides \['rollout', 'actor'\]"):
        cls.build_topology(1, 1, [{"side": "rollout"}, meta])
    with pytest.raises(ValueError, match=r"the actors report elastic=\[False, True\]"):
        cls.build_topology(2, 0, [meta, {**meta, "rank": 1, "elastic": True}])
    with pytest.raises(ValueError, match=r"the actors report src_dtype=\['float32', 'bfloat16'\]: one of"):
        cls.build_topology(2, 0, [meta, {**meta, "rank": 1, "store": None, "src_dtype": "bfloat16"}])
    actor.init_process_group(**{k: v[0] for k, v in a.items()})
    gathered = ((f"w{i}", torch.zeros(2)) for i in range(3))
    with pytest.raises(ValueError, match="gathered tensors.*nothing was read"):
        asyncio.run(actor.send_weights(gathered, global_steps=1))
    assert next(gathered)[0] == "w0"  # not one tensor was taken from verl's generator
    assert actor.init_info == {"store": "127.0.0.1:29999", "trainer_ranks": [0], "inference_ranks": [1, 2],
                               "group": "verl", "src_dtype": "float32"}
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
    actor.actor_engine = SimpleNamespace(module=torch.nn.Linear(2, 2).bfloat16())
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
