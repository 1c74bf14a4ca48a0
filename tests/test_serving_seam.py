"""The serving seam carries a second engine: a plain torch module served with TP=2 (``_tp_engine``).

Two trainer processes (``ServingTrainer.from_spec``) publish two versions to an engine of two TP
processes that uses only ``tritonreshard.serving`` and its own agreement, model check and apply:
after each refit its shards equal the trainers' full tensors sharded (bit-exact), its TP forward
equals the unsharded module's, in background-pull and inline-pull mode, and no engine process ever
imported vLLM. Also the init info's one schema: vLLM's is the same dataclass, and every check runs
once, at construction.
"""
import dataclasses
import sys
import time

import pytest
import torch
import torch.distributed as dist
from _mp import free_port, run_ranks
from _tp_engine import ENGINE as TINY
from _tp_engine import TOKENS, TinyMLP, TinyTrainer, TPEngine, full_weights, recipe

import tritonreshard as trs
from tritonreshard.serving import (
    BackgroundPull,
    InlinePull,
    RankLayout,
    ServingInit,
    ServingTrainer,
    UpdateInfo,
    recipe_for,
    registered,
    schema,
)

TRAINERS, ENGINE = [0, 1], [2, 3]
VERSIONS = 2


def _trainer(rank: int, init: dict) -> dict:
    spec = recipe(TRAINERS, ENGINE)
    shards = {n: lay.shard(t, rank).clone() for n, t in full_weights(1).items() for lay in [spec.src[n]]}
    meet = dict(rank=rank, trainer_ranks=TRAINERS, inference_ranks=ENGINE, store=init["store"], group=init["group"],
                timeouts=trs.Timeouts(wait=60))
    # The engine's trainer class finds the recipe in the registry, as the engine's ranks do; from_spec
    # takes one given.
    tr = TinyTrainer(None, shards, tp=len(ENGINE), **meet) if init["prefetch"] else \
        ServingTrainer.from_spec(spec, shards, **meet)
    assert tr.spec == spec
    try:
        for v in range(1, VERSIONS + 1):
            tr.fence()
            if v > 1:  # the "optimizer step", in place in the arena
                for n, t in full_weights(v).items():
                    tr.tensors[n].copy_(spec.src[n].shard(t, rank))
            assert tr.publish() == v
        tr.fence()  # every engine rank acked the last version
    finally:
        tr.close()
    return {"src_dtype": tr.src_dtype}


def _engine(rank: int, init: dict, tp_port: int) -> dict:
    tp_rank = rank - len(TRAINERS)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{tp_port}", rank=tp_rank, world_size=len(ENGINE))
    engine = TPEngine(init, tp_rank=tp_rank, tp=len(ENGINE), tp_group=dist.group.WORLD)
    report = {"pull": type(engine.pull).__name__, "refits": []}
    try:
        for v in range(1, VERSIONS + 1):
            if init["prefetch"]:  # let the background pull finish: the refit then only applies
                deadline = time.monotonic() + 60
                while engine.sub.version < v:
                    assert time.monotonic() < deadline, f"version {v} was never prefetched"
                    time.sleep(0.005)
            stats = engine.refit(UpdateInfo(version=v))
            full = full_weights(v)
            for n, lay in engine.spec.dst.items():
                assert torch.equal(engine.module.param(n), lay.shard(full[n], engine.rank)), (n, v)
            ref = TinyMLP()
            ref.load_state_dict(full)
            with torch.no_grad():
                assert torch.equal(engine.forward(TOKENS), ref(TOKENS)), v
            report["refits"].append((stats["version"], stats["prefetched"]))
    finally:
        engine.close()
        dist.destroy_process_group()
    report["vllm_imported"] = any(m == "vllm" or m.startswith("vllm.") for m in sys.modules)
    return report


def _rank(rank: int, inits: list, tp_ports: list) -> list:
    torch.set_num_threads(1)
    out = []
    for init, tp_port in zip(inits, tp_ports, strict=True):
        out.append(_trainer(rank, init) if rank in TRAINERS else _engine(rank, init, tp_port))
    return out


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_plain_torch_engine_refits_bit_exact_through_the_seam():
    inits = [ServingInit(store=f"127.0.0.1:{free_port()}", trainer_ranks=TRAINERS, inference_ranks=ENGINE,
                         group=f"tiny-{mode}", prefetch=prefetch, timeout=60).to_dict()
             for mode, prefetch in (("background", True), ("inline", False))]
    out = run_ranks(_rank, len(TRAINERS) + len(ENGINE), args=(inits, [free_port(), free_port()]), timeout=150)
    for r in TRAINERS:
        assert [o["src_dtype"] for o in out[r]] == ["float32", "float32"]
    for r in ENGINE:
        background, inline = out[r]
        assert background["pull"] == BackgroundPull.__name__ and inline["pull"] == InlinePull.__name__
        assert background["refits"] == [(1, True), (2, True)]   # pulled before the refit asked
        assert inline["refits"] == [(1, False), (2, False)]     # pulled inside the refit
        assert not background["vllm_imported"] and not inline["vllm_imported"]


def test_vllm_init_info_is_the_one_schema():
    """``init_info`` is ``ServingInit(...).to_dict()``: same fields, same defaults, every problem in
    one ValueError at construction; vLLM's payload class adds no field of its own."""
    from tritonreshard.vllm import init_info

    ok = dict(store="127.0.0.1:9", trainer_ranks=[0, 1], inference_ranks=[2, 3])
    assert init_info(**ok) == ServingInit(**ok, group="vllm").to_dict()
    assert ServingInit.from_dict(init_info(**ok)) == ServingInit(**ok, group="vllm")
    assert ServingInit(**ok).group == "refit"  # the serving layer's default names no engine
    with pytest.raises(ValueError) as e:
        ServingInit(store="x", trainer_ranks=[0, 1], inference_ranks=[1], src_dtype="int8", prefetch=1,
                    elastic="no", replica=-1, delta_anchor=0, megatron={"tp": 2}, timeout="soon", trace="yes")
    for part in ("store must be 'host:port'", "overlap", "src_dtype must be", "prefetch must be True or False",
                 "elastic must be True or False", "delta_anchor must be", "megatron must be a trs.recipes.Megatron",
                 "timeout must be a number", "trace must be True or False"):
        assert part in str(e.value), part
    with pytest.raises(ValueError, match=r"unknown keys \['stor'\]"):
        ServingInit.from_dict({**ok, "stor": "x"})
    frozen = ServingInit(**ok)
    with pytest.raises(dataclasses.FrozenInstanceError):
        frozen.store = "elsewhere:1"
    assert frozen.trainer_ranks == (0, 1) and isinstance(frozen.to_dict()["trainer_ranks"], list)
    assert schema.SRC_DTYPES is __import__("tritonreshard.vllm", fromlist=["SRC_DTYPES"]).SRC_DTYPES


def test_vllm_payload_class_is_a_serving_init():
    pytest.importorskip("vllm")
    from vllm.distributed.weight_transfer.base import WeightTransferInitInfo

    from tritonreshard.vllm._worker import TritonreshardInitInfo

    info = TritonreshardInitInfo(store="127.0.0.1:9", trainer_ranks=[0], inference_ranks=[1])
    assert isinstance(info, ServingInit) and isinstance(info, WeightTransferInitInfo)
    assert dataclasses.fields(TritonreshardInitInfo) == dataclasses.fields(ServingInit)
    assert "__annotations__" not in TritonreshardInitInfo.__dict__ or not TritonreshardInitInfo.__annotations__


def test_the_registry_picks_each_engines_recipe_and_traces_only_when_asked(monkeypatch):
    """Recipes come from the registry by ``(engine, source)``: vLLM's ``"hf"`` builder keeps a
    hand-written recipe, traces vLLM's loader for a model type without one only with
    ``init_info(trace=True)``, and refuses a quantized trace; an engine nobody registered gets one
    ValueError naming what is registered. (The tracer here is a recorder: the real one, vLLM's, is
    tests/test_families_live.py's tiny-granite.)"""
    from types import SimpleNamespace

    import tritonreshard.vllm  # noqa: F401  (registers ("vllm", "hf") and ("vllm", "megatron"))
    import tritonreshard.vllm.trace as vllm_trace
    from tritonreshard.apps.kit import tiny_config  # a config with a recipe: the tests' tiny Llama

    ok = dict(store="127.0.0.1:9", trainer_ranks=[0, 1], inference_ranks=[2, 3])
    calls = []

    def tracer(config, **kw):
        calls.append((config.model_type, kw))
        return "traced"

    monkeypatch.setattr(vllm_trace, "trace_recipe", tracer)
    assert {("vllm", "hf"), ("vllm", "megatron"), (TINY, "hf")} <= set(registered())
    granite = SimpleNamespace(model_type="granite")
    layout = RankLayout(engine="vllm", tp=2, tp_rank=0, config=granite, dtype=torch.bfloat16)
    assert recipe_for(ServingInit(**ok, trace=True), layout, stats=None) == "traced"
    assert calls == [("granite", dict(tp=2, trainer_ranks=[0, 1], inference_ranks=[2, 3], dtype=torch.bfloat16,
                                      src_dtype=torch.float32, expert_parallel=False, stats=None))]
    with pytest.raises(ValueError, match="model_type='granite' has no recipe"):  # not asked: no trace
        recipe_for(ServingInit(**ok), layout)
    llama = recipe_for(ServingInit(**ok, trace=True), dataclasses.replace(layout, config=tiny_config()))
    assert llama.model_type == "llama" and len(calls) == 1  # a recipe is kept, never traced
    with pytest.raises(ValueError) as e:
        recipe_for(ServingInit(**ok, trace=True), dataclasses.replace(layout, quantization="fp8-block"))
    assert str(e.value) == ("init_info(trace=True) for model_type='granite': the engine serves "
                            "quantization='fp8-block', and traced recipes lay out unquantized parameters only")
    with pytest.raises(ValueError, match=r"no recipe for engine 'sglang' with 'hf' trainers: registered \["):
        recipe_for(ServingInit(**ok), dataclasses.replace(layout, engine="sglang"))
    assert recipe_for(ServingInit(**ok), RankLayout(engine=TINY, tp=2, tp_rank=1)) == recipe([0, 1], [2, 3])


def test_the_seam_is_an_abc_and_the_serving_layer_names_no_engine():
    """An engine implements the five methods (a class that misses one cannot be made), and
    ``tritonreshard/serving/`` names no vLLM call, class or default."""
    import pathlib

    from tritonreshard.serving import ServingEngine

    class Half(ServingEngine):
        def rank_layout(self, init):
            return RankLayout(engine=TINY, tp=1, tp_rank=0)

    with pytest.raises(TypeError, match="abstract"):
        Half()
    assert TPEngine.__abstractmethods__ == frozenset()
    root = pathlib.Path(trs.__file__).parent / "serving"
    said = {p.name: [n for n, line in enumerate(p.read_text().splitlines(), 1) if "vllm" in line.lower()]
            for p in sorted(root.glob("*.py"))}
    assert not any(said.values()), said
