"""The serving seam carries a second engine: a plain torch module served with TP=2 (``_tp_engine``).

Two trainer processes (``ServingTrainer.from_spec``) publish two versions to an engine of two TP
processes that uses only ``tritonreshard.serving`` and its own agreement, model check and apply:
after each refit its shards equal the trainers' full tensors sharded (bit-exact), its TP forward
equals the unsharded module's, in background-pull, inline-pull and direct-pull mode (the pull
writes the module's parameters themselves), and no engine process ever imported vLLM. The
background pull's one buffer set (``trs.Spare()``) under a refit: a refit that arrives mid-pull
waits for it and installs it bit-exact, the newest pulled version wins over an older one asked
for, and a pull that fails part-way is reported while the engine keeps serving its installed
version. A direct pull that fails part-way tears the engine, which refuses to serve until the next
refit. Also the init info's one schema: vLLM's is the same dataclass, and every check
runs once, at construction.
"""
import dataclasses
import math
import os
import sys
import time

import pytest
import torch
import torch.distributed as dist
from _mp import free_port, run_ranks
from _tp_engine import ENGINE as TINY
from _tp_engine import TOKENS, PackedTPEngine, TinyMLP, TinyTrainer, TPEngine, full_weights, recipe

import tritonreshard as trs
from tritonreshard.serving import (
    BackgroundPull,
    DirectPull,
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


def _gate(gate: str, group: str, version: int) -> str:
    return os.path.join(gate, f"{group}-go{version}")


def _open_gate(gate: str, group: str, version: int) -> None:
    """The engine lets the trainers publish ``version`` (they would otherwise publish it as soon as
    the background pull acked the one before, racing the refit of that one)."""
    open(_gate(gate, group, version), "w").close()


def _wait_gate(gate: str, group: str, version: int) -> None:
    deadline = time.monotonic() + 60
    while not os.path.exists(_gate(gate, group, version)):
        assert time.monotonic() < deadline, f"the engine never let version {version} be published"
        time.sleep(0.005)


def _trainer(rank: int, init: dict, gate: str) -> dict:
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
            if v > 1 and init["prefetch"]:
                _wait_gate(gate, init["group"], v)
            tr.fence()
            if v > 1:  # the "optimizer step", in place in the arena
                for n, t in full_weights(v).items():
                    tr.tensors[n].copy_(spec.src[n].shard(t, rank))
            assert tr.publish() == v
        tr.fence()  # every engine rank acked the last version
    finally:
        tr.close()
    return {"src_dtype": tr.src_dtype}


def _engine(rank: int, init: dict, tp_port: int, gate: str) -> dict:
    tp_rank = rank - len(TRAINERS)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{tp_port}", rank=tp_rank, world_size=len(ENGINE))
    kind = PackedTPEngine if init["group"].endswith("-layered") else TPEngine
    engine = kind(init, tp_rank=tp_rank, tp=len(ENGINE), tp_group=dist.group.WORLD)
    report = {"pull": type(engine.pull).__name__, "refits": [], "direct_bytes": [], "streamed_bytes": []}
    # The module's parameters, as they were before any refit: a direct pull writes these very tensors.
    ptrs = {n: engine.module.param(n).data_ptr() for n in engine.spec.dst}
    if kind is PackedTPEngine:  # fc1 is served packed, streamed through the layer sink, never pulled in place
        ptrs = {n: p for n, p in ptrs.items() if n not in PackedTPEngine.PACKED}
        packed = engine.fc1_packed.data_ptr()
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
                assert torch.equal(engine.served(n), lay.shard(full[n], engine.rank)), (n, v)
            ref = TinyMLP()
            ref.load_state_dict(full)
            with torch.no_grad():
                assert torch.equal(engine.forward(TOKENS), ref(TOKENS)), v
            report["refits"].append((stats["version"], stats["prefetched"]))
            report["direct_bytes"].append(stats["direct_bytes"])
            report["streamed_bytes"].append(stats["streamed_bytes"])
            report["pulled_into_params"] = all(engine.sub.tensors[n].data_ptr() == p for n, p in ptrs.items())
            assert {n: engine.module.param(n).data_ptr() for n in ptrs} == ptrs  # nothing re-allocated
            if kind is PackedTPEngine:
                assert engine.fc1_packed.data_ptr() == packed
                assert not set(PackedTPEngine.PACKED) & set(engine.sub.tensors)
                report["sink"] = (engine.events, engine.peak_open, engine.open_bytes)
            if engine.tp_rank == 0:
                _open_gate(gate, init["group"], v + 1)
    finally:
        engine.close()
        dist.destroy_process_group()
    report["vllm_imported"] = any(m == "vllm" or m.startswith("vllm.") for m in sys.modules)
    return report


def _rank(rank: int, inits: list, tp_ports: list, gate: str) -> list:
    torch.set_num_threads(1)
    out = []
    for init, tp_port in zip(inits, tp_ports, strict=True):
        out.append(_trainer(rank, init, gate) if rank in TRAINERS else _engine(rank, init, tp_port, gate))
    return out


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_plain_torch_engine_refits_bit_exact_through_the_seam(tmp_path):
    modes = (("background", True, True), ("inline", False, False), ("direct", False, True),
             ("layered", False, True))
    inits = [ServingInit(store=f"127.0.0.1:{free_port()}", trainer_ranks=TRAINERS, inference_ranks=ENGINE,
                         group=f"tiny-{mode}", prefetch=prefetch, direct=direct, timeout=60).to_dict()
             for mode, prefetch, direct in modes]
    out = run_ranks(_rank, len(TRAINERS) + len(ENGINE), args=(inits, [free_port() for _ in modes], str(tmp_path)),
                    timeout=150)
    for r in TRAINERS:
        assert [o["src_dtype"] for o in out[r]] == ["float32"] * len(modes)
    spec = recipe(TRAINERS, ENGINE)
    for r in ENGINE:
        background, inline, direct, layered = out[r]
        assert (background["pull"], inline["pull"], direct["pull"], layered["pull"]) == (
            BackgroundPull.__name__, InlinePull.__name__, DirectPull.__name__, DirectPull.__name__)
        assert background["refits"] == [(1, True), (2, True)]   # pulled before the refit asked
        assert inline["refits"] == direct["refits"] == layered["refits"] == [(1, False), (2, False)]
        # Only the direct pulls wrote the module's parameters themselves: every byte of this rank's
        # shards; the layered one streamed fc1 (post-processed) through its sink, one group at a time.
        nbytes = {n: math.prod(lay.local_shape(r)) * lay.itemsize for n, lay in spec.dst.items()}
        fc1 = sum(nbytes[n] for n in PackedTPEngine.PACKED)
        assert direct["pulled_into_params"] and direct["direct_bytes"] == [sum(nbytes.values())] * 2, direct
        assert layered["pulled_into_params"] and layered["direct_bytes"] == [sum(nbytes.values()) - fc1] * 2
        assert layered["streamed_bytes"] == [fc1] * 2 and layered["sink"] == ([("open", 0), ("close", 0)] * 2, fc1, 0)
        assert not background["pulled_into_params"] and not inline["pulled_into_params"]
        assert background["direct_bytes"] == inline["direct_bytes"] == [0, 0]
        assert not any(o["vllm_imported"] for o in out[r])


SLOW_S = 1.0  # the background pulls of versions 2 and 4 stall this long part-way: a refit arrives meanwhile


def _inject_faults(box: list) -> None:
    """In an engine process: the background pulls of versions 2, 4 and 6 write part of the set, then
    stall (a slow copy); the one of version 5 writes part of it, then fails (a torn set).
    ``box[0]``: the engine, whose one buffer set that is."""
    from tritonreshard.engine.sources import Sources

    prepare, done = Sources.prepare, set()

    def faulty(self, version):
        if version in (2, 4, 5, 6) and version not in done:
            done.add(version)
            next(iter(box[0].sub.tensors.values())).fill_(-7.0)  # the copy's first part: not this version
            if version == 5:
                raise RuntimeError("injected: the copy of version 5 stopped part-way")
            time.sleep(SLOW_S)
        prepare(self, version)

    Sources.prepare = faulty


def _until(what: str, ok) -> None:
    deadline = time.monotonic() + 60
    while not ok():
        assert time.monotonic() < deadline, what
        time.sleep(0.005)


def _scenario_trainer(rank: int, init: dict, gate: str) -> None:
    spec = recipe(TRAINERS, ENGINE)
    shards = {n: lay.shard(t, rank).clone() for n, t in full_weights(1).items() for lay in [spec.src[n]]}
    tr = TinyTrainer(None, shards, tp=len(ENGINE), rank=rank, trainer_ranks=TRAINERS, inference_ranks=ENGINE,
                     store=init["store"], group=init["group"], timeouts=trs.Timeouts(wait=60))
    try:
        for v in range(1, 7):
            if v > 1:
                _wait_gate(gate, init["group"], v)
            tr.fence()
            for n, t in full_weights(v).items():
                tr.tensors[n].copy_(spec.src[n].shard(t, rank))
            assert tr.publish() == v
        tr.fence()
    finally:
        tr.close()


def _scenario_engine(rank: int, init: dict, tp_port: int, gate: str) -> dict:
    box = []
    _inject_faults(box)
    tp_rank = rank - len(TRAINERS)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{tp_port}", rank=tp_rank, world_size=len(ENGINE))
    engine = TPEngine(init, tp_rank=tp_rank, tp=len(ENGINE), tp_group=dist.group.WORLD)
    box.append(engine)
    sub, group, out = engine.sub, init["group"], {}

    def serves(v):  # the engine's own parameters are exactly version v's shards
        full = full_weights(v)
        return all(torch.equal(engine.module.param(n), lay.shard(full[n], engine.rank))
                   for n, lay in engine.spec.dst.items())

    def open_gate(v):
        if tp_rank == 0:
            _open_gate(gate, group, v)

    def holds(v):
        _until(f"version {v} was never pulled", lambda: sub.version == v and not sub.pulling)

    def refused(info):
        try:
            engine.refit(info)
        except trs.RefitError as exc:
            return str(exc)
        raise AssertionError(f"the refit {info} was installed")

    try:
        out["sets"], out["mode"] = engine.pull.BUFFER_SETS, sub.mode
        # The set holds version 1 complete, no pull in flight: a refit naming it installs it.
        holds(1)
        st = engine.refit(UpdateInfo(version=1))
        out["v1"] = (st["version"], st["prefetched"], serves(1))
        # A refit arriving while the pull of version 2 is part-way waits for it and installs it.
        open_gate(2)
        _until("the pull of version 2 never started", lambda: sub.pulling)
        st = engine.refit(UpdateInfo())
        out["v2"] = (st["version"], st["prefetched"], st["wait_ms"] >= SLOW_S * 1e3 / 2, serves(2))
        # While a refit session holds the lock, the watcher starts no pull, even with version 3 published.
        with engine.pull.session():
            open_gate(3)
            _until("version 3 was never published", lambda: sub.available_version() == 3)
            time.sleep(0.2)
            out["held_off"] = (sub.pulling, sub.version)
        # The newest wins: a refit naming version 3, held complete, while version 4 is being pulled
        # over it waits for that pull and is refused, naming 4; the engine still serves 2 exactly.
        holds(3)
        open_gate(4)
        _until("the pull of version 4 never started", lambda: sub.pulling)
        out["v3"] = (refused(UpdateInfo(version=3)), serves(2))
        st = engine.refit(UpdateInfo())
        out["v4"] = (st["version"], st["prefetched"], serves(4))
        # The pull of version 5 fails part-way: the next refit reports it, the engine serves 4 exactly;
        # the refit after that pulls 5 again, inline.
        open_gate(5)
        _until("the pull of version 5 never failed", lambda: not sub.consistent and not sub.pulling)
        out["v5_failed"] = (refused(UpdateInfo()), serves(4), sub.version)
        st = engine.refit(UpdateInfo())
        out["v5"] = (st["version"], st["prefetched"], serves(5), sub.consistent)
        # A pull that finished before the refit asked counts as prefetched, even where the watcher
        # (kept out by the lock here, as a refit keeps it out) has not marked the set as holding it.
        open_gate(6)
        _until("the pull of version 6 never started", lambda: sub.pulling)
        with engine.pull.session():
            _until("the pull of version 6 never finished", sub.pull_done)
            out["pulled6"] = (engine.pull.pulled(sub, 6), engine.pull.pulled(sub, 5), sub.version)
        st = engine.refit(UpdateInfo())
        out["v6"] = (st["version"], st["prefetched"], serves(6))
    finally:
        engine.close()
        dist.destroy_process_group()
    return out


def _scenario_rank(rank: int, init: dict, tp_port: int, gate: str):
    torch.set_num_threads(1)
    return _scenario_trainer(rank, init, gate) if rank in TRAINERS else _scenario_engine(rank, init, tp_port, gate)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_the_background_pull_has_one_set_and_a_refit_installs_only_complete_versions(tmp_path):
    """One buffer set per rank (``trs.Spare()``), never read while a pull writes it: a refit that
    arrives mid-pull waits and installs that version bit-exact; the watcher starts no pull while a
    refit holds the lock; the newest pulled version wins (an older one asked for is refused, naming
    it); a pull that fails part-way is reported by the next refit, the engine's weights untouched,
    and the version is pulled again by the refit after that."""
    init = ServingInit(store=f"127.0.0.1:{free_port()}", trainer_ranks=TRAINERS, inference_ranks=ENGINE,
                       group="tiny-spare", prefetch=True, timeout=60).to_dict()
    out = run_ranks(_scenario_rank, len(TRAINERS) + len(ENGINE), args=(init, free_port(), str(tmp_path)),
                    timeout=150)
    for r in ENGINE:
        o = out[r]
        assert (o["sets"], o["mode"]) == (1, trs.Spare()), o
        assert o["v1"] == (1, True, True), o
        assert o["v2"] == (2, False, True, True), o   # waited for the background pull: "pulled now"
        assert o["held_off"] == (False, 2), o
        assert "this rank already pulled version 4, published after it" in o["v3"][0], o
        assert "install 4 (or pass no version)" in o["v3"][0] and o["v3"][1], o
        assert o["v4"] == (4, True, True), o
        failed, kept, held = o["v5_failed"]
        assert "the background pull of version 5 failed: RuntimeError: injected" in failed, o
        assert kept and held == 4, o
        assert o["v5"] == (5, False, True, True), o
        assert o["pulled6"] == (True, False, 5) and o["v6"] == (6, True, True), o


def _direct_trainer(rank: int, init: dict) -> None:
    spec = recipe(TRAINERS, ENGINE)
    shards = {n: lay.shard(t, rank).clone() for n, t in full_weights(1).items() for lay in [spec.src[n]]}
    tr = TinyTrainer(None, shards, tp=len(ENGINE), rank=rank, trainer_ranks=TRAINERS, inference_ranks=ENGINE,
                     store=init["store"], group=init["group"], timeouts=trs.Timeouts(wait=60))
    try:
        for v in (1, 2):
            tr.fence()
            for n, t in full_weights(v).items():
                tr.tensors[n].copy_(spec.src[n].shard(t, rank))
            assert tr.publish() == v
        tr.fence()  # TP rank 1's pull of version 2 failed once: its second one acks it
    finally:
        tr.close()


def _direct_engine(rank: int, init: dict, tp_port: int) -> dict:
    from tritonreshard.engine.sources import Sources

    tp_rank = rank - len(TRAINERS)
    box: list = []
    if tp_rank == 1:  # this rank's first pull of version 2 writes part of a parameter, then stops
        prepare, done = Sources.prepare, set()

        def faulty(self, version):
            if version == 2 and not done:
                done.add(version)
                box[0].module.param("fc1.weight").data.fill_(-7.0)
                raise RuntimeError("injected: the direct pull of version 2 stopped part-way")
            prepare(self, version)

        Sources.prepare = faulty
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{tp_port}", rank=tp_rank, world_size=len(ENGINE))
    engine = TPEngine(init, tp_rank=tp_rank, tp=len(ENGINE), tp_group=dist.group.WORLD)
    box.append(engine)
    out = {"pull": type(engine.pull).__name__, "set_bytes": engine.joined.set_bytes}

    def serves(v):
        full = full_weights(v)
        return all(torch.equal(engine.module.param(n), lay.shard(full[n], engine.rank))
                   for n, lay in engine.spec.dst.items())

    try:
        out["v1"] = (engine.refit(UpdateInfo())["version"], serves(1), engine.torn)
        try:
            engine.refit(UpdateInfo())
            out["failed"] = None
        except trs.RefitError as exc:
            out["failed"] = str(exc)
        try:  # every TP rank refuses to serve what may be part old, part new
            engine.forward(TOKENS)
            out["served_torn"] = True
        except RuntimeError as exc:
            out["served_torn"] = str(exc)
        out["torn"] = (engine.torn, engine.sub.consistent, engine.sub.version)
        st = engine.refit(UpdateInfo())  # pulls version 2 whole where it was torn
        ref = TinyMLP()
        ref.load_state_dict(full_weights(2))
        with torch.no_grad():
            out["v2"] = (st["version"], serves(2), engine.torn, torch.equal(engine.forward(TOKENS), ref(TOKENS)))
    finally:
        engine.close()
        dist.destroy_process_group()
    return out


def _direct_rank(rank: int, init: dict, tp_port: int):
    torch.set_num_threads(1)
    return _direct_trainer(rank, init) if rank in TRAINERS else _direct_engine(rank, init, tp_port)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_direct_pull_that_fails_tears_the_engine_which_refuses_to_serve_until_a_refit_succeeds():
    """The direct pull's price, shown: it holds no buffer, and a pull that stops part-way on one TP
    rank leaves the engine's weights part old, part new. The refit fails on every rank naming the
    rank and the cause, every rank was told before the pull (``writing_served``) and refuses to
    serve, and the next refit pulls the version whole where it was torn: bit-exact, forward equal
    to the unsharded module's."""
    init = ServingInit(store=f"127.0.0.1:{free_port()}", trainer_ranks=TRAINERS, inference_ranks=ENGINE,
                       group="tiny-direct-fail", prefetch=False, timeout=60).to_dict()
    out = run_ranks(_direct_rank, len(TRAINERS) + len(ENGINE), args=(init, free_port()), timeout=150)
    for r in ENGINE:
        o = out[r]
        assert (o["pull"], o["set_bytes"]) == (DirectPull.__name__, 0), o
        assert o["v1"] == (1, True, False), o
        assert f"rank {ENGINE[1]}: RuntimeError: injected: the direct pull of version 2" in o["failed"], o
        assert "a direct pull failed part-way" in o["served_torn"], o
        assert o["v2"] == (2, True, False, True), o
    # TP rank 0 pulled version 2 whole (its weights: new, the other rank's: torn); rank 1's set is torn.
    assert out[ENGINE[0]]["torn"] == (True, True, 2) and out[ENGINE[1]]["torn"] == (True, False, 1)


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


def test_a_refit_that_does_not_fit_its_budget_is_refused_at_the_join_naming_mode_bytes_and_budget():
    """``max_refit_bytes``: the pull mode's buffer sets times the bytes this rank pulls must fit, or
    the join refuses before any store is asked or any buffer allocated (no store listens here: the
    refusal comes first), naming the rank, the mode, the bytes needed and the budget; a budget that
    fits goes on to the store. Bad budgets are refused with the init info's other problems."""
    spec = recipe(TRAINERS, ENGINE)
    rank = ENGINE[1]
    weights = sum(math.prod(lay.local_shape(rank)) * lay.itemsize for lay in spec.dst.values())
    for prefetch, sets, mode in ((True, 1, "background pull (prefetch=True): 1 buffer set(s) (spare)"),
                                 (False, 1, "inline pull (prefetch=False): 1 buffer set(s) (inplace)")):
        init = ServingInit(store=f"127.0.0.1:{free_port()}", trainer_ranks=TRAINERS, inference_ranks=ENGINE,
                           prefetch=prefetch, direct=False, timeout=2, max_refit_bytes=sets * weights - 1).to_dict()
        with pytest.raises(ValueError) as e:
            TPEngine(init, tp_rank=1, tp=len(ENGINE), tp_group=None)
        assert (f"max_refit_bytes={sets * weights - 1}: the refit of rank {rank} needs {sets * weights} bytes "
                f"beside the engine's weights with the {mode} of {weights} bytes") in str(e.value), e.value
        with pytest.raises(Exception) as e:   # fits: on to the store, where nothing listens
            TPEngine({**init, "max_refit_bytes": sets * weights}, tp_rank=1, tp=len(ENGINE), tp_group=None)
        assert "max_refit_bytes" not in str(e.value), e.value
    # The direct pull writes every parameter of this engine in place: it needs nothing, so a budget of 0 fits.
    direct = ServingInit(store=f"127.0.0.1:{free_port()}", trainer_ranks=TRAINERS, inference_ranks=ENGINE,
                         prefetch=False, timeout=2, max_refit_bytes=0).to_dict()
    with pytest.raises(Exception) as e:
        TPEngine(direct, tp_rank=1, tp=len(ENGINE), tp_group=None)
    assert "max_refit_bytes" not in str(e.value), e.value
    with pytest.raises(ValueError) as e:
        ServingInit(store="x", trainer_ranks=[0], inference_ranks=[1], max_refit_bytes=-1, prefetch="no")
    assert "max_refit_bytes must be None or an int >= 0 (bytes), got max_refit_bytes=-1" in str(e.value)
    assert "prefetch must be True or False" in str(e.value)


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
