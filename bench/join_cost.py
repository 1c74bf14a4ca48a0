"""Where an inference rank's join of a refit group spends its time, at a real model's size, without vLLM.

What vLLM's ``init_weight_transfer_engine`` does after its ``verify=``: the recipe, the rank's
place, ``ServingRank.join`` -> ``RefitInference(...)`` (hello, inputs, rank plan, buffer set,
exports, mapping the trainers' arenas, descriptor tables, mapped/done). Two trainer processes
(``tritonreshard.vllm.Trainer``, random bf16 FSDP row shards of the recipe's sources, as
bench/refit_real_size.py's) and two inference processes (TP 2) that drive ``serving_rank(...)`` +
``place.join(...)`` directly, the seam's own calls.

The join's steps are its own figures (``RefitInference.join_stats.steps``: wall and the joining
thread's CPU ms each: hello, inputs, plan, alloc, exports, route, map, tables, done); around it the
benchmark times the recipe, the whole ``place.join`` (with its wait for the trainers' store) and,
after it, the first touch and the first pull, wall and process CPU time. This machine's cores may
be shared with a CI run: CPU time is the steadier figure. A phase that waits on other ranks (hello, exports,
mapped/done) counts their set-up too (the trainers fill their arenas inside the same epoch): its
wall minus its CPU is mostly waiting. After the join: the first touch of the mapped arenas (a read
of one byte per page) and the first pull (copies out of the mapped arenas).

``python bench/join_cost.py --config bench/configs/qwen3-1.7b.json --json``
(bench/configs/qwen3-tiny.json for a quick run).
"""
from __future__ import annotations

import argparse
import json
import queue
import socket
import sys
import time
import zlib
from pathlib import Path

import torch
import torch.multiprocessing as mp

HERE = Path(__file__).resolve().parent
TRAINERS, INFERENCE = [0, 1], [2, 3]
TP = 2
GROUP = "join-cost"
PAGE = 4096


def load_config(path: str):
    import transformers

    raw = json.loads(Path(path).read_text())
    raw.pop("_source", None)
    return transformers.AutoConfig.for_model(raw.pop("model_type"), **raw)


def spec_of(config):
    import tritonreshard as trs

    return trs.recipes.hf_to_vllm(config, tp=TP, trainer_ranks=TRAINERS, inference_ranks=INFERENCE,
                                  dtype=torch.bfloat16, src_dtype=torch.bfloat16)


def shard_values(name: str, shape, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()) * 1009 + rank * 101)
    return (torch.randn(tuple(shape), generator=g) * 0.02).to(torch.bfloat16)


def trainer(rank: int, config_path: str, store: str, results, stop) -> None:
    torch.set_num_threads(1)
    import tritonreshard as trs
    import tritonreshard.vllm as trs_vllm

    config = load_config(config_path)
    spec = spec_of(config)
    shards = {n: shard_values(n, lay.local_shape(rank), rank) for n, lay in spec.src.items()}
    with trs_vllm.Trainer(config, shards, tp=TP, rank=rank, trainer_ranks=TRAINERS, inference_ranks=INFERENCE,
                          store=store, group=GROUP, timeouts=trs.Timeouts(wait=600.0)) as tr:
        del shards
        tr.fence()
        tr.publish()  # version 1
        results.put(("trainer", rank, {"arena_bytes": sum(t.numel() * t.element_size()
                                                          for t in tr.tensors.values())}))
        stop.wait()


class Phases:
    """``{phase: [wall ms, cpu ms]}`` of the steps the benchmark times around the join."""

    def __init__(self):
        self.ms: dict[str, list[float]] = {}

    def add(self, name: str, w0: float, c0: float) -> None:
        self.ms[name] = [(time.perf_counter() - w0) * 1e3, (time.process_time() - c0) * 1e3]


def inference(tp_rank: int, config_path: str, store: str, results) -> None:
    torch.set_num_threads(1)
    import tritonreshard as trs
    import tritonreshard.vllm as trs_vllm
    from tritonreshard.serving import serving_rank

    ph = Phases()
    config = load_config(config_path)
    w0, c0 = time.perf_counter(), time.process_time()
    spec = spec_of(config)
    ph.add("recipe", w0, c0)
    init = trs_vllm.Trainer.INIT(store=store, trainer_ranks=TRAINERS, inference_ranks=INFERENCE,
                                 src_dtype="bfloat16", group=GROUP, timeout=600.0)
    place = serving_rank(init, spec, tp=TP, tp_rank=tp_rank)
    w0, c0 = time.perf_counter(), time.process_time()
    sub, join_ms = place.join(device=torch.device("cpu"), mode=trs.InPlace())
    ph.add("place.join (with store wait)", w0, c0)
    # The join's own steps (RefitInference.join_stats: wall and the joining thread's CPU ms each).
    steps = {name: [wall, cpu] for name, wall, cpu in sub.join_stats.steps}
    srcs = sub._inference.subscriber.sources  # a benchmark looks inside
    mapped = 0
    w0, c0 = time.perf_counter(), time.process_time()
    for s in srcs.buffers.values():
        base = s._arena._base
        mapped += base.numel()
        int(base[::PAGE].sum())  # one byte per page: the page faults of the first touch
    ph.add("first touch of mapped pages", w0, c0)
    w0, c0 = time.perf_counter(), time.process_time()
    v = sub.pull(timeout=600.0)
    ph.add(f"first pull (v{v})", w0, c0)
    results.put(("inference", tp_rank, {"phases": ph.ms, "join_ms": join_ms, "mapped_bytes": mapped,
                                        "buffer_bytes": place.buffer_bytes,
                                        "steps": steps}))
    sub.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=str(HERE / "configs" / "qwen3-1.7b.json"))
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    store = f"127.0.0.1:{free_port()}"
    ctx = mp.get_context("spawn")
    results, stop = ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=trainer, args=(r, args.config, store, results, stop), daemon=True)
             for r in TRAINERS]
    procs += [ctx.Process(target=inference, args=(i, args.config, store, results), daemon=True)
              for i in range(TP)]
    for p in procs:
        p.start()
    out = {"config": args.config, "trainers": {}, "inference": {}}
    try:
        while len(out["trainers"]) + len(out["inference"]) < len(procs):
            dead = [p for p in procs if p.exitcode not in (None, 0)]
            if dead:
                raise RuntimeError(f"process {dead[0].name} exited with {dead[0].exitcode}")
            try:
                kind, rank, value = results.get(timeout=1.0)
            except queue.Empty:  # poll the processes again
                continue
            out["trainers" if kind == "trainer" else "inference"][rank] = value
    finally:
        for p in procs[len(TRAINERS):]:  # readers close first, then the trainers stop
            p.join(timeout=60)
        stop.set()
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    if args.json:
        print(json.dumps(out, indent=1))
    else:
        for r, v in out["inference"].items():
            print(f"inference tp {r}: join {v['join_ms']:.0f} ms, mapped {v['mapped_bytes'] / 1e9:.2f} GB")
            for name, (w, c) in [*v["steps"].items(), *v["phases"].items()]:
                print(f"  {name:30s} {w:9.1f} wall {c:9.1f} cpu ms")


if __name__ == "__main__":
    sys.exit(main())
