"""verl 0.9.1's own weight sync beside tritonreshard's backend, on the same FSDP2 actor: what each
actor rank pays per sync.

A benchmark script, not a test (a few minutes on 2 cores): ``python bench/verl_vs_naive.py``
(``--steps 4 --model-dtype fp32 bf16 --bucket-mb 2048 --json out.json``).

**The actor**: verl's own FSDP engine (``FSDPEngineWithLMHead``, built and initialised by verl from a
saved Llama: hidden 512, 4 layers, 8 heads / 4 KV heads, MLP 1408, vocab 32000, untied; 44.6M
parameters), FSDP2 over 2 gloo processes on the CPU, as tests/_verl_actor.py builds it (its stubs of
verl's CUDA-only calls, named there). An optimizer step of verl's own optimizer before every sync
but the first, then both syncs of the same weights, one after the other, in alternating order
(even steps verl first, odd steps ours first).

**(a) verl's path** (``naive``, and what every backend but ``delta_sharded`` starts from):
``engine.get_per_tensor_param()`` (each parameter ``full_tensor()``: FSDP2's all-gather of the whole
tensor on every rank, in the parameters' dtype) streamed through verl's own ``BucketedWeightSender``
into its bucket (shared memory off CUDA, ``update_weights_bucket_megabytes``, verl's default 2048),
as verl's vLLM ``ServerAdapter.update_weights`` does for the vLLM worker on the rank's GPU. The
receiving side is verl's own ``BucketedWeightReceiver`` (in the rollout process, one per actor rank),
copying each tensor out of the bucket as vLLM's loader would. Sender and receiver are loaded from
verl's file ``bucketed_weight_transfer.py`` (it imports neither vLLM nor verl's rollout package),
with one stub: its device module (``get_torch_device``: verl falls back to ``torch.cuda`` on a CPU
machine, whose ``synchronize`` a CPU build refuses) is a no-op namespace and ``is_support_ipc`` False.

**(b) tritonreshard's path**: ``ActorRolloutRefWorker.update_weights`` as
``tritonreshard.frameworks.verl`` wraps it, into ``TritonreshardCheckpointEngine.send_weights``
with the engine: each rank's own shards (``get_per_tensor_param_shard()``) written into its arena and
published; one reader (refit rank 2, the recipe's vLLM layouts at TP 1) pulls each version.

**Per actor rank and sync**: wall and CPU time (``time.process_time``, every thread of the process),
``full_tensor`` calls and the bytes they built, bytes copied into the transport buffer (the bucket,
the arena), the peak resident set above the one before (``VmHWM`` reset through
``/proc/self/clear_refs``, as ``tritonreshard.vllm._cost.Cost`` does) and what stays resident after
(``held``: the first sync of ours allocates the arena there). Every rank collects its garbage before
the barrier that starts a sync, so no rank waits inside a sync's collectives for another's collector.
The copy bandwidth of ``torch`` on the same rank is measured once, beside them.

**Exact**: after each step the rollout process checks that both actor ranks' gathered tensors
arrived equal through (a), and that what the reader pulled through (b) is, bit for bit, the recipe's
mapping of (a)'s tensors cast to bf16 (verl's shard export casts the same way).
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import importlib
import importlib.util
import json
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT / "tests"))  # _verl_actor: verl's FSDP engine on the CPU, its stubs named there

BF16 = torch.bfloat16
ACTORS, READER = (0, 1), 2
MB = 1 << 20


def llama_config():
    import transformers

    return transformers.LlamaConfig(vocab_size=32000, hidden_size=512, intermediate_size=1408, num_hidden_layers=4,
                                    num_attention_heads=8, num_key_value_heads=4, head_dim=64,
                                    tie_word_embeddings=False, max_position_embeddings=256)


def bucketed_transfer():
    """verl's ``bucketed_weight_transfer`` module, loaded from its file (the package around it imports
    vLLM), with its device module a no-op (see the module docstring)."""
    spec = importlib.util.find_spec("verl")
    path = Path(spec.submodule_search_locations[0]) / "workers/rollout/vllm_rollout/bucketed_weight_transfer.py"
    module_spec = importlib.util.spec_from_file_location("verl_bucketed_weight_transfer", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)

    def nothing(*args, **kwargs):
        return None

    module.get_torch_device = lambda: SimpleNamespace(synchronize=nothing, empty_cache=nothing, ipc_collect=nothing)
    module.is_support_ipc = lambda: False
    return module


def count_full_tensor() -> dict:
    """Count ``DTensor.full_tensor`` calls and the bytes they return, in this process from now on."""
    from torch.distributed.tensor import DTensor

    box, original = {"calls": 0, "bytes": 0}, DTensor.full_tensor

    def full_tensor(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        box["calls"] += 1
        box["bytes"] += out.nbytes
        return out

    DTensor.full_tensor = full_tensor
    return box


def memcpy_gbps(nbytes: int) -> float:
    """``torch``'s copy of ``nbytes`` on this rank, best of 3."""
    src, dst = torch.ones(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
    best = min(_timed(lambda: dst.copy_(src)) for _ in range(3))
    return nbytes / best / 1e9


class Measured:
    """``tritonreshard.vllm._cost.Cost`` without its ``gc.collect()`` on entry: the ranks collect
    (and trim) before the barrier that starts a sync (:func:`settle`), so that neither waits in the
    sync's first collective for the other's garbage collection. Wall and CPU time, the peak resident
    set above the one before (``VmHWM`` reset through ``/proc/self/clear_refs``), and what stays
    resident after, collected and trimmed."""

    def __enter__(self) -> Measured:
        from tritonreshard.vllm import _cost

        self._cost = _cost
        self._measured = _cost._reset_peak()
        self._before = _cost._status().get("VmRSS")
        self._t0, self._c0 = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc) -> None:
        ms, cpu_ms = (time.perf_counter() - self._t0) * 1e3, (time.process_time() - self._c0) * 1e3
        peak = self._cost._status().get("VmHWM")
        settle()
        after = self._cost._status().get("VmRSS")
        ok = self._measured and None not in (self._before, peak, after)
        self.stats = {"sync_ms": ms, "sync_cpu_ms": cpu_ms,
                      "sync_peak_bytes": max(0, peak - self._before) if ok else None,
                      "sync_held_bytes": after - self._before if ok else None}


def settle() -> None:
    """Garbage collected, and the C heap's free pages handed back (``malloc_trim``)."""
    from tritonreshard.vllm._cost import _trim

    gc.collect()
    _trim()


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


# ------------------------------------------------------------------------------ the actor ranks
def naive_sync(engine, bwt, handle: str, bucket_mb: int, full: dict) -> dict:
    """(a): verl's gathered tensors through verl's bucket sender (module docstring)."""
    sent, calls, gathered = [0], full["calls"], full["bytes"]

    def counted(gen):
        for name, tensor in gen:
            sent[0] += tensor.nbytes
            yield name, tensor

    with Measured() as cost:
        gen, _ = engine.get_per_tensor_param()
        sender = bwt.BucketedWeightSender(zmq_handle=handle, bucket_size_mb=bucket_mb, use_shm=True)
        asyncio.run(sender.async_send_weights(counted(gen)))
    return {**cost.stats, "full_tensor_calls": full["calls"] - calls,
            "full_tensor_bytes": full["bytes"] - gathered, "copied_bytes": sent[0]}


def ours_sync(worker, step: int, full: dict) -> dict:
    """(b): the wrapped ``update_weights`` into tritonreshard's backend, the way verl's manager runs
    one sync on the actor side (tests/_verl_actor.py's ``one_sync``)."""
    from _verl_actor import one_sync

    calls, gathered = full["calls"], full["bytes"]
    with Measured() as cost:
        metrics = one_sync(worker, len(ACTORS), 1, global_steps=step)
    return {**cost.stats, "full_tensor_calls": full["calls"] - calls,
            "full_tensor_bytes": full["bytes"] - gathered, "copied_bytes": metrics["tritonreshard/copied_bytes"],
            "version": metrics["tritonreshard/version"]}


def order(step: int) -> tuple[str, str]:
    return ("naive", "tritonreshard") if step % 2 == 0 else ("tritonreshard", "naive")


def actor_rank(rank: int, model_dir: str, fsdp_port: int, store_port: int, handles: list, barrier, opts: dict) -> dict:
    import torch.distributed as dist
    from _verl_actor import build_engine, stub_cuda_only, train_step, worker_config

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{fsdp_port}", rank=rank, world_size=len(ACTORS))
    stub_cuda_only()
    bwt = bucketed_transfer()
    full = count_full_tensor()
    importlib.import_module("tritonreshard.frameworks.verl")  # what verl does with custom_backend_module
    from verl.checkpoint_engine import CheckpointEngineRegistry

    engine = build_engine(model_dir, opts["model_dtype"])
    params = list(engine.module.parameters())
    backend = CheckpointEngineRegistry.new("tritonreshard", is_master=rank == 0, bucket_size=opts["bucket_mb"] * MB,
                                           store_host="127.0.0.1", store_port=store_port, timeout=300)
    worker = SimpleNamespace(config=worker_config(), actor=SimpleNamespace(engine=engine), checkpoint_engine=backend)
    facts = {"params": sum(p.numel() for p in params),
             "param_dtype": str(params[0].dtype).replace("torch.", ""),
             "local_bytes": sum(p.to_local().nbytes for p in params),
             "memcpy_gbps": memcpy_gbps(64 * MB)}
    rows = []
    barrier.wait(timeout=opts["timeout"])
    for step in range(opts["steps"]):
        if step:
            train_step(engine, rank, step)
        for path in order(step):
            settle()  # before the barrier: what the optimizer step freed goes back; no rank collects in the sync
            barrier.wait(timeout=opts["timeout"])  # the rollout side listens / waits
            row = naive_sync(engine, bwt, handles[rank], opts["bucket_mb"], full) if path == "naive" else \
                ours_sync(worker, step, full)
            barrier.wait(timeout=opts["timeout"])  # the rollout side has it
            rows.append({"rank": rank, "step": step, "path": path, **row})
    backend.trainer.fence()  # the reader has taken the last version (the barrier said so) before the arena goes
    backend.close()
    dist.destroy_process_group()
    return {"rows": rows, **facts}


# ----------------------------------------------------------------------------- the rollout side
def receive(bwt, handle: str, into: dict) -> None:
    """verl's receiver for one actor rank: each tensor copied out of the bucket (vLLM's loader
    copies into its parameters the same way), before the sender may reuse it."""

    def on_bucket(weights, is_last):
        for name, tensor in weights:
            if name in into:
                into[name].copy_(tensor)
            else:
                into[name] = tensor.clone()

    bwt.BucketedWeightReceiver(zmq_handle=handle, device=torch.device("cpu"), use_shm=True).receive_weights(
        on_bucket_received=on_bucket)


def rollout_rank(model_dir: str, store_port: int, handles: list, barrier, opts: dict) -> dict:
    import transformers
    import zmq
    from _verl_actor import MODEL_DTYPES, _wait_listening

    import tritonreshard as trs

    torch.set_num_threads(1)
    # The receivers connect before the senders bind (as a vLLM worker's does): retry every 2 ms,
    # not ZMQ's default 100 ms, so that the wait does not count in the actors' sync time.
    zmq.Context.instance().setsockopt(zmq.RECONNECT_IVL, 2)
    bwt = bucketed_transfer()
    cfg = transformers.AutoConfig.from_pretrained(model_dir)
    # The actors publish in their own dtype (fp32 or bf16); the reader's copy casts once to bf16.
    spec = trs.recipes.hf_to_vllm(cfg, tp=1, trainer_ranks=list(ACTORS), inference_ranks=[READER], dtype=BF16,
                                  src_dtype=MODEL_DTYPES[opts["model_dtype"]])
    plan = spec.plan()
    received = [{} for _ in ACTORS]
    reader, exact = None, []
    barrier.wait(timeout=opts["timeout"])
    for step in range(opts["steps"]):
        for path in order(step):
            if path == "naive":
                threads = [threading.Thread(target=receive, args=(bwt, handles[r], received[r])) for r in ACTORS]
                for t in threads:
                    t.start()
                barrier.wait(timeout=opts["timeout"])
                for t in threads:
                    t.join(opts["timeout"])
                    assert not t.is_alive(), "verl's receiver did not finish"
            else:
                barrier.wait(timeout=opts["timeout"])
                if reader is None:  # joins with the actors' first sync
                    _wait_listening(store_port, opts["timeout"])
                    poison = {n: torch.full(lay.local_shape(READER), float("nan"), dtype=BF16)
                              for n, lay in spec.dst.items()}
                    meeting = trs.Meeting(rank=READER, world_size=len(ACTORS) + 1, store=f"127.0.0.1:{store_port}",
                                          group="verl")
                    reader = trs.RefitInference.from_recipe(spec, meeting=meeting, tensors=poison,
                                                            timeouts=trs.Timeouts(wait=opts["timeout"]),
                                                            pull=trs.PullOptions(mode="inplace", backend="torch"))
                assert reader.pull(step + 1) == step + 1  # verl's sync of global_steps s is version s + 1
            barrier.wait(timeout=opts["timeout"])
        exact.append(_same(received, spec, plan, reader.tensors))
    reader.close()
    return {"exact": exact, "received_bytes": sum(t.nbytes for t in received[0].values())}


def _same(received: list, spec, plan, pulled: dict) -> dict:
    """Both actor ranks' gathered tensors equal, and the reader's tensors the recipe's mapping of
    them in bf16, bit for bit."""
    import tritonreshard as trs

    ranks_agree = all(torch.equal(received[0][n], received[1][n]) for n in received[0])
    full = {n: t.to(BF16) for n, t in received[0].items()}
    srcs = {r: {n: lay.shard(full[n], r) for n, lay in spec.src.items() if r in lay.ranks} for r in ACTORS}
    want = trs.execute_local(plan, srcs, backend="torch")[READER]
    pulled_equal = sorted(want) == sorted(pulled) and all(
        torch.equal(want[n].view(torch.int16), pulled[n].view(torch.int16)) for n in want)
    return {"actor_ranks_agree": ranks_agree, "pulled_equals_gathered": pulled_equal}


def refit_rank(rank: int, model_dir: str, fsdp_port: int, store_port: int, handles: list, barrier, opts: dict):
    if rank in ACTORS:
        return actor_rank(rank, model_dir, fsdp_port, store_port, handles, barrier, opts)
    return rollout_rank(model_dir, store_port, handles, barrier, opts)


# ------------------------------------------------------------------------------------ the driver
def run(model_dtype: str, opts: dict, workdir: str) -> dict:
    import multiprocessing as mp

    from tritonreshard.apps.kit import free_port, run_ranks

    model_dir = os.path.join(workdir, "model")
    if not os.path.isdir(model_dir):
        import transformers

        torch.manual_seed(0)
        transformers.LlamaForCausalLM(llama_config()).save_pretrained(model_dir)
    handles = [f"ipc://{workdir}/verl-bucket-{model_dtype}-{r}.sock" for r in ACTORS]
    barrier = mp.get_context("spawn").Barrier(len(ACTORS) + 1)
    opts = {**opts, "model_dtype": model_dtype}
    out = run_ranks(refit_rank, len(ACTORS) + 1, args=(model_dir, free_port(), free_port(), handles, barrier, opts),
                    timeout=opts["timeout"] * 3)
    return {"model_dtype": model_dtype, "actors": [out[r] for r in ACTORS], "rollout": out[READER]}


def _mb(n) -> str:
    return "n/a" if n is None else f"{n / MB:.1f}"


def table(result: dict) -> str:
    """One row per actor rank, step and path; then the medians of the steps after the first."""
    head = ("rank", "step", "path", "wall ms", "CPU ms", "full_tensor", "gathered MB", "copied MB", "peak MB",
            "held MB")
    lines = [head]
    rows = [row for actor in result["actors"] for row in actor["rows"]]
    for r in sorted(rows, key=lambda x: (x["rank"], x["step"], x["path"] != "naive")):
        lines.append((r["rank"], r["step"], _name(r["path"]), f"{r['sync_ms']:.0f}", f"{r['sync_cpu_ms']:.0f}",
                      r["full_tensor_calls"], _mb(r["full_tensor_bytes"]), _mb(r["copied_bytes"]),
                      _mb(r["sync_peak_bytes"]), _mb(r["sync_held_bytes"])))
    for rank in ACTORS:
        for path in ("naive", "tritonreshard"):
            later = [r for r in rows if r["rank"] == rank and r["path"] == path and r["step"] > 0]
            if later:
                med = {k: statistics.median(r[k] for r in later) for k in ("sync_ms", "sync_cpu_ms")}
                peak = [r["sync_peak_bytes"] for r in later if r["sync_peak_bytes"] is not None]
                lines.append((rank, "median 1+", _name(path), f"{med['sync_ms']:.0f}", f"{med['sync_cpu_ms']:.0f}",
                              later[0]["full_tensor_calls"], _mb(later[0]["full_tensor_bytes"]),
                              _mb(later[0]["copied_bytes"]), _mb(statistics.median(peak) if peak else None), ""))
    widths = [max(len(str(line[i])) for line in lines) for i in range(len(head))]
    text = ["| " + " | ".join(str(c).ljust(w) for c, w in zip(line, widths, strict=True)) + " |" for line in lines]
    text.insert(1, "| " + " | ".join("-" * w for w in widths) + " |")
    return "\n".join(text)


def _name(path: str) -> str:
    return "verl naive" if path == "naive" else "tritonreshard"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4, help="syncs of each path (the first before any step)")
    parser.add_argument("--model-dtype", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"],
                        help="verl's FSDPEngineConfig.model_dtype (fp32: verl's default for training)")
    parser.add_argument("--bucket-mb", type=int, default=2048,
                        help="verl's rollout.checkpoint_engine.update_weights_bucket_megabytes (default: verl's)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds any one wait may take")
    parser.add_argument("--json", help="write every measurement here")
    args = parser.parse_args(argv)
    opts = {"steps": args.steps, "bucket_mb": args.bucket_mb, "timeout": args.timeout}
    cfg = llama_config()
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs visible, torch {torch.__version__}; "
          f"Llama hidden {cfg.hidden_size}, {cfg.num_hidden_layers} layers, vocab {cfg.vocab_size}; "
          f"FSDP2 over {len(ACTORS)} gloo ranks; bucket {args.bucket_mb} MB", flush=True)
    results = []
    with tempfile.TemporaryDirectory(prefix="trs-verl-bench-") as workdir:
        for model_dtype in args.model_dtype:
            start = time.perf_counter()
            result = run(model_dtype, opts, workdir)
            results.append(result)
            a = result["actors"][0]
            print(f"\nmodel_dtype={model_dtype}: {a['params'] / 1e6:.1f}M parameters ({a['param_dtype']}), "
                  f"{_mb(a['local_bytes'])} MB of them on each rank; torch copy on rank 0: "
                  f"{a['memcpy_gbps']:.2f} GB/s; run {time.perf_counter() - start:.0f} s")
            print(table(result))
            print(f"exact, per step: {result['rollout']['exact']}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    ok = all(all(e.values()) for r in results for e in r["rollout"]["exact"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
