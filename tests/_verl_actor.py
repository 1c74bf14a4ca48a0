"""The actor ranks of tests/test_verl_actor.py: verl 0.9.1's own FSDP engine (``FSDPEngineWithLMHead``,
built and initialised by verl's code from a saved tiny Llama) over 2 gloo processes, synced through
verl's ``ActorRolloutRefWorker.update_weights`` as wrapped by ``tritonreshard.frameworks.verl``.

Stubs, each a CUDA-only call (or a version clash) on this CPU machine; nothing else of verl is replaced:

* ``verl.workers.engine.fsdp.transformer_impl.get_device_id`` and ``verl.utils.fsdp_utils.get_device_id``
  -> ``"cpu"``: verl's platform falls back to CUDA without an accelerator, and its
  ``torch.cuda.current_device()`` raises on a CPU build of torch;
* ``verl.workers.engine.fsdp.utils.get_device_name`` -> ``"cpu"``: the device type of the FSDP
  device mesh (``create_device_mesh``), "cuda" by the same fallback;
* ``verl.workers.engine.fsdp.transformer_impl.log_gpu_memory_usage`` -> no-op: reads CUDA memory stats;
* ``verl.models.transformers.monkey_patch.is_trl_available`` -> False: verl patches TRL 0.27's
  ``AutoModelForCausalLMWithValueHead``, which the TRL installed here (1.16, for
  ``tritonreshard.frameworks.trl``) no longer has; the patch only concerns value-head models.

The worker itself is a stand-in object with verl's attributes (``config``, ``actor.engine``,
``checkpoint_engine``) passed as ``self`` to the class's real (wrapped) ``execute_checkpoint_engine``
and ``update_weights``: verl's ``Worker`` needs a Ray actor to be constructed.

The rollout replicas are not vLLM engines: each is one plain ``trs.RefitInference`` rank with the
recipe's vLLM layouts (``hf_to_vllm`` TP 1) in the variant's vLLM dtype, built from the init info
the actors' topology carries (its ``src_dtype``), as a vLLM worker's engine builds them. Replica 0
is refit rank 2 in every group; replica 1 (refit rank 3, elastic group only) is added after the
first sync and SIGKILLed before it reads the second.
"""
from __future__ import annotations

import asyncio
import importlib
import json
import logging
import os
import signal
import time
from types import SimpleNamespace

import torch

#: verl's ``FSDPEngineConfig.model_dtype`` names, and the torch dtypes of the parameters they give.
MODEL_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
#: verl's global_steps at the first sync: a run resumed at step 10 (a fresh run starts at 0).
FIRST_STEP = 10


def stub_cuda_only() -> None:
    import verl.models.transformers.monkey_patch as monkey_patch
    import verl.utils.fsdp_utils as fsdp_utils
    import verl.workers.engine.fsdp.transformer_impl as transformer_impl
    import verl.workers.engine.fsdp.utils as engine_fsdp_utils

    transformer_impl.get_device_id = fsdp_utils.get_device_id = lambda: "cpu"
    engine_fsdp_utils.get_device_name = lambda: "cpu"
    transformer_impl.log_gpu_memory_usage = lambda *a, **k: None
    monkey_patch.is_trl_available = lambda: False


def count_full_tensor() -> list:
    """Count ``DTensor.full_tensor`` calls in this process from now on: ``box[0]``."""
    from torch.distributed.tensor import DTensor

    box, original = [0], DTensor.full_tensor

    def full_tensor(self, *args, **kwargs):
        box[0] += 1
        return original(self, *args, **kwargs)

    DTensor.full_tensor = full_tensor
    return box


def build_engine(model_dir: str, model_dtype: str):
    """verl's FSDP2 actor engine, built by verl from ``model_dir`` (its ``initialize``: HF load,
    ``apply_fsdp2``, full state dict load, optimizer)."""
    import verl.workers.engine.fsdp.transformer_impl as transformer_impl
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig

    model = HFModelConfig(path=model_dir, load_tokenizer=False, use_remove_padding=False,
                          override_config={"attn_implementation": "eager"})
    engine = transformer_impl.FSDPEngineWithLMHead(
        model, FSDPEngineConfig(strategy="fsdp2", use_torch_compile=False, model_dtype=model_dtype),
        FSDPOptimizerConfig(lr=1e-2), CheckpointConfig())
    engine.initialize()
    return engine


def train_step(engine, rank: int, step: int) -> None:
    """One real optimizer step of verl's engine (its module and its optimizer) on random tokens."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    ids = torch.randint(0, engine.model_config.hf_config.vocab_size, (2, 8), generator=g)
    engine.module(input_ids=ids).logits.float().pow(2).mean().backward()
    engine.optimizer.step()
    engine.optimizer.zero_grad()


def worker_config(**over) -> object:
    """An ``actor_rollout_ref`` config as verl's actor worker holds it (OmegaConf)."""
    from omegaconf import OmegaConf

    cfg = {"hybrid_engine": False, "rollout": {"name": "vllm", "checkpoint_engine": {"backend": "tritonreshard"}}}
    for key, value in over.items():
        node = cfg
        *path, last = key.split(".")
        for p in path:
            node = node[p]
        node[last] = value
    return OmegaConf.create(cfg)


def one_sync(worker, n_actor: int, n_rollout: int, global_steps: int, on_topology=None) -> dict:
    """What verl's ``CheckpointEngineManager.update_weights`` does on the actor side of one sync:
    ``prepare`` on every rank (gathered here over the actors' gloo group; the rollout workers'
    metadata as they report it), ``build_topology``, ``init_process_group``, the worker's
    ``update_weights``, ``finalize``; the backend's methods through the worker's
    ``execute_checkpoint_engine``, as verl's manager calls them (both worker methods are the wrapped
    class methods). ``on_topology(backend)``: called between ``init_process_group`` and
    ``update_weights`` (where the rollout side gets its topology in verl)."""
    import torch.distributed as dist
    from verl.workers.engine_workers import ActorRolloutRefWorker

    backend, execute = worker.checkpoint_engine, ActorRolloutRefWorker.execute_checkpoint_engine
    mine = execute(worker, "prepare")
    metadata = [None] * n_actor
    dist.all_gather_object(metadata, mine)
    actor_kwargs, _ = type(backend).build_topology(n_actor, n_rollout, metadata + [{"side": "rollout"}] * n_rollout)
    execute(worker, "init_process_group", **{k: v[dist.get_rank()] for k, v in actor_kwargs.items()})
    if on_topology is not None:
        on_topology(backend)
    metrics = asyncio.run(ActorRolloutRefWorker.update_weights(worker, global_steps=global_steps))
    execute(worker, "finalize")
    return metrics


def local_shards(engine) -> dict:
    """What this rank holds of each parameter, read from the DTensors (``to_local``, no gather)
    with torch's own offsets: ``{name: (local shard in the parameter's dtype, global offset)}``."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    out = {}
    for name, p in engine.module.named_parameters():
        _, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, list(p.placements))
        out[name] = (p.to_local().detach().clone(), tuple(offset))
    return out


class _Warnings(logging.Handler):
    """The backend's warnings in this process (it names the rollout ranks it dropped)."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def mark(marks: str, variant: int, what: str) -> str:
    """The marker file of ``what`` in variant ``variant``: how the processes of the test keep verl's
    order without verl's manager (its ``ray.get`` waits for every worker of a sync)."""
    return os.path.join(marks, f"{variant}-{what}")


def _wait_for(path: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {path} after {timeout} s")
        time.sleep(0.02)


def _write_topology(marks: str, variant: int, backend) -> None:
    """Actor rank 0: the rollout side's init info of the topology (what verl hands the rollout
    workers), written whole before the readers look."""
    path = mark(marks, variant, "init_info")
    with open(path + ".tmp", "w") as f:
        json.dump(backend.init_info, f)
    os.replace(path + ".tmp", path)


def actor_rank(rank: int, model_dir: str, fsdp_port: int, variants: list, marks: str) -> dict:
    """Actor rank ``rank`` of 2: for each variant ``(model_dtype, vllm_dtype, store_port, elastic,
    rollouts)``, verl's engine and a ``"tritonreshard"`` backend from verl's registry, one sync per entry of
    ``rollouts`` (the number of rollout workers verl's manager holds at that sync), an optimizer step
    before each but the first. Rank 0 writes the topology's init info (``init_info``) before the
    first sync's ``update_weights``. After each sync, rank 0 marks ``synced-<version>``, and both wait, as
    verl's manager waits for the rollout side of the sync, for replica 0 to have read the version
    and (two rollout workers) for replica 1 to have joined, then record their readers and mark
    ``recorded-<version>-<rank>``; each marks ``fenced-<rank>`` at the end.
    Returns per variant and sync: the local shards, the sync's metrics and seconds, the trainer's
    identity and arena addresses, its readers then, the backend's ``dropped`` and the topology's
    ``src_dtype``; the backend's warnings and the ``full_tensor`` calls counted over the whole run."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{fsdp_port}", rank=rank, world_size=2)
    stub_cuda_only()
    full = count_full_tensor()
    importlib.import_module("tritonreshard.frameworks.verl")  # what verl does with custom_backend_module
    from verl.checkpoint_engine import CheckpointEngineRegistry

    warned = _Warnings()
    logging.getLogger("tritonreshard.frameworks.verl.actor").addHandler(warned)
    out = []
    for i, (model_dtype, _, store_port, elastic, rollouts) in enumerate(variants):
        engine = build_engine(model_dir, model_dtype)
        backend = CheckpointEngineRegistry.new("tritonreshard", is_master=rank == 0, bucket_size=1 << 20,
                                               store_host="127.0.0.1", store_port=store_port, timeout=120,
                                               elastic=elastic)
        worker = SimpleNamespace(config=worker_config(), actor=SimpleNamespace(engine=engine),
                                 checkpoint_engine=backend)
        runs = []
        for step, n_rollout in enumerate(rollouts):
            if step:
                train_step(engine, rank, step)
            start = time.perf_counter()
            metrics = one_sync(worker, 2, n_rollout, global_steps=FIRST_STEP + step,
                               on_topology=(lambda b, i=i: _write_topology(marks, i, b)) if rank == 0 else None)
            seconds, version, trainer = time.perf_counter() - start, metrics["tritonreshard/version"], backend.trainer
            if rank == 0:
                open(mark(marks, i, f"synced-{version}"), "w").close()
            for what in [f"read-{version}"] + (["joined"] if n_rollout == 2 else []):
                _wait_for(mark(marks, i, what), 150)
            runs.append({"metrics": metrics, "seconds": seconds, "shards": local_shards(engine), "trainer": id(trainer),
                         "arena": [t.data_ptr() for t in trainer.source_tensors.values()],
                         "readers": sorted(trainer.readers), "dropped": [r for r, _ in backend.dropped],
                         "src_dtype": backend.topology.src_dtype})
            open(mark(marks, i, f"recorded-{version}-{rank}"), "w").close()
        backend.trainer.fence()  # the readers took the last version before the arena goes away
        open(mark(marks, i, f"fenced-{rank}"), "w").close()
        backend.close()
        out.append(runs)
    dist.destroy_process_group()
    return {"variants": out, "full_tensor_calls": full[0], "warnings": warned.lines}


def _wait_listening(port: int, timeout: float) -> None:
    """Until actor rank 0's store listens: its first sync comes after verl's imports and engine
    build (tens of seconds here), and a TCPStore client that connects too early backs off for up
    to a minute between tries."""
    import socket

    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"nothing listens on 127.0.0.1:{port} after {timeout} s") from None
            time.sleep(0.2)


def _reader(rank: int, model_dir: str, variant: tuple, marks: str, i: int, replica: int):
    """A rollout rank of variant ``i``'s group: the vLLM layouts of ``hf_to_vllm`` TP 1 (the
    recipe's inference side) in the variant's vLLM dtype, from the trainers' dtype the topology's
    init info names (a vLLM worker's ``src_dtype``), poisoned with NaN; a fixed group's rank 2 of
    3, or replica ``replica`` of an elastic group, joining whenever it starts."""
    import transformers

    import tritonreshard as trs
    from tritonreshard.serving import SRC_DTYPES

    _, vllm_dtype, port, elastic, _ = variant
    _wait_for(mark(marks, i, "init_info"), 150)
    with open(mark(marks, i, "init_info")) as f:
        src_dtype = SRC_DTYPES[json.load(f)["src_dtype"]]
    cfg = transformers.AutoConfig.from_pretrained(model_dir)
    spec = trs.recipes.hf_to_vllm(cfg, tp=1, trainer_ranks=[0, 1], inference_ranks=[rank], dtype=vllm_dtype,
                                  src_dtype=src_dtype)
    _wait_listening(port, 150)
    poison = {n: torch.full(lay.local_shape(rank), float("nan"), dtype=vllm_dtype) for n, lay in spec.dst.items()}
    meeting = trs.Meeting(rank=rank, world_size=None if elastic else 3, store=f"127.0.0.1:{port}", group="verl")
    return trs.RefitInference.from_recipe(spec, meeting=meeting, tensors=poison, timeouts=trs.Timeouts(wait=150),
                                          pull=trs.PullOptions(mode="shadow", backend="torch"),
                                          membership=trs.Elastic(replica=replica) if elastic else None)


def inference_rank(rank: int, model_dir: str, variants: list, marks: str) -> list:
    """Replica 0 (refit rank 2), pulling every version of every variant's group (marking
    ``read-<version>``). Returns the tensors it read, per variant and sync."""
    torch.set_num_threads(1)
    pulled = []
    for i, variant in enumerate(variants):
        rollouts = variant[-1]
        with _reader(rank, model_dir, variant, marks, i, replica=0) as ep:
            for step in range(len(rollouts)):  # the sync of global_steps s publishes version s + 1
                v = FIRST_STEP + step + 1
                assert ep.pull(v) == v
                pulled.append({n: t.clone() for n, t in ep.tensors.items()})
                open(mark(marks, i, f"read-{v}"), "w").close()
            for actor in (0, 1):  # in the group until both actors are done: their readers stay put
                _wait_for(mark(marks, i, f"fenced-{actor}"), 150)
    return pulled


def removed_replica(rank: int, model_dir: str, variants: list, marks: str) -> None:
    """Replica 1 (refit rank 3) of the elastic variant: starts once the first sync published
    (verl's ``add_replicas`` before the second), reads the version it was admitted at if that is
    the first sync's, marks ``joined``, waits until both actors recorded their readers after the
    second sync, then SIGKILLs itself without reading that sync's version: the actors' next fence
    waits for its ack and must drop this rank instead. Saves ``marks/replica1.pt`` (its first
    version and what it read) first."""
    torch.set_num_threads(1)
    i = next(i for i, v in enumerate(variants) if v[3])
    first_sync = FIRST_STEP + 1
    _wait_for(mark(marks, i, f"synced-{first_sync}"), 200)
    ep = _reader(rank, model_dir, variants[i], marks, i, replica=1)
    first = ep.join_stats.first_version
    pulled = None
    if first == first_sync:  # admitted while the actors' arena held the first sync's version
        assert ep.pull(first) == first
        pulled = {n: t.clone() for n, t in ep.tensors.items()}
    torch.save({"first": first, "pulled": pulled}, os.path.join(marks, "replica1.pt"))
    open(mark(marks, i, "joined"), "w").close()
    for actor in (0, 1):
        _wait_for(mark(marks, i, f"recorded-{first_sync + 1}-{actor}"), 150)
    assert ep.available_version() == first_sync + 1 and ep.version < first_sync + 1
    os.kill(os.getpid(), signal.SIGKILL)  # mid-update: version published, not read, never acked


def refit_rank(rank: int, model_dir: str, fsdp_port: int, variants: list, marks: str) -> bytes:
    """Ranks 0 and 1: :func:`actor_rank`; rank 2: :func:`inference_rank`; rank 3:
    :func:`removed_replica` (it dies, returns nothing). The result as ``torch.save`` bytes
    (:func:`unpack`): tensors sent through a torch.multiprocessing queue are shared-memory handles
    that die with the process that made them."""
    import io

    if rank == 3:
        removed_replica(rank, model_dir, variants, marks)
    out = actor_rank(rank, model_dir, fsdp_port, variants, marks) if rank < 2 else inference_rank(
        rank, model_dir, variants, marks)
    buf = io.BytesIO()
    torch.save(out, buf)
    return buf.getvalue()


def unpack(data: bytes):
    import io

    return torch.load(io.BytesIO(data), weights_only=True)
