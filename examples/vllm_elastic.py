"""Two vLLM engines in one elastic refit group: the second joins mid-run, the first leaves mid-run.

The tiny Llama of ``vllm_refit.py`` (built locally, no downloads). Two FSDP trainer processes are an
elastic group's trainers (``tritonreshard.vllm.Trainer(..., membership=trs.Elastic())``): they meet alone and
keep publishing. Two vLLM engines (``LLM``, TP=1 each, started concurrently, each in its own
process) join through vLLM's own ``init_weight_transfer_engine`` with
``init_info(elastic=True, replica=i, inference_ranks=[its rank])`` whenever the script decides:

* engine A (replica 0) joins and is refitted to version 1;
* engine B (replica 1) joins after version 2 was published (first refused twice: an init_info
  without ``elastic=True``, and replica index 0, which A holds), then both are refitted on their own
  schedules: B skips version 3;
* A's ``shutdown_weight_transfer_engine`` runs and its process exits; the trainers publish two more
  versions (their ``fence()`` must stop waiting for A) and B is refitted to each.

After every refit the engine's greedy tokens (float32) must equal transformers' with the trainers'
weights. Run: ``python examples/vllm_elastic.py --json`` (the last stdout line is a JSON summary:
``checks``, ``mismatches``, ``join_ms``, ``first_refit_ms``, ...).
"""
from __future__ import annotations

import argparse
import json
import os
import queue
import shutil
import signal
import sys
import tempfile
import time
import traceback

# Each engine runs in one process (no engine-core process of its own: the fastest start, and a
# kill takes everything of it); the KV cache in GiB (the default fraction fails on small machines).
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from vllm_refit import SEED, SIGMA, model_config, training_tensors  # noqa: E402

from tritonreshard.apps.kit import free_port, hf_greedy, mismatches, random_prompts, reap, tiny_model, vllm_greedy  # noqa: E402

TRAINERS = [0, 1]            # the elastic group's world: the trainers alone
ENGINE_RANKS = {0: [2], 1: [3]}   # replica -> its TP ranks (TP=1)
GROUP = "vllm-elastic"
WAIT_S = 600.0               # the longest any single wait may take (an engine start on a loaded 2-core machine)


def trainer(rank: int, train_path: str, store: str, commands, results) -> None:
    """One FSDP trainer of the elastic group: row shard ``rank`` of every HF parameter."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    torch.set_num_threads(1)
    from safetensors.torch import load_file

    import tritonreshard as trs
    import tritonreshard.vllm as trs_vllm

    cfg = model_config("tiny")
    full = load_file(train_path)
    src = trs.recipes.hf_to_vllm(cfg, tp=1, trainer_ranks=TRAINERS, inference_ranks=ENGINE_RANKS[0]).src
    shards = {n: src[n].shard(full[n], rank).contiguous() for n in src}
    with trs_vllm.Trainer(cfg, shards, rank=rank, tp=1, trainer_ranks=TRAINERS, store=store, group=GROUP,
                          membership=trs.Elastic(), timeouts=trs.Timeouts(wait=300.0, peer=10.0)) as tr:
        results.put(("ready", rank, None))
        while True:
            cmd, step = commands.get()
            if cmd == "stop":
                break
            t0 = time.perf_counter()
            tr.fence()  # every engine admitted now acked the last version (never one that left)
            fence_ms = (time.perf_counter() - t0) * 1e3
            g = torch.Generator().manual_seed(SEED * 1000 + step * 10 + rank)
            for name in sorted(tr.tensors):
                t = tr.tensors[name]
                t.add_(torch.randn(t.shape, generator=g) * SIGMA)
            v = tr.publish()
            results.put(("published", rank, (v, {n: t.clone() for n, t in tr.tensors.items()},
                                             sorted(tr.readers), [r for r, _ in tr.dropped], fence_ms)))


def _engine_info(worker):
    e = worker.weight_transfer_engine
    js = e.join_stats
    return {"join_ms": e.join_ms, "steps_ms": None if js is None else
            {k: getattr(js, k) for k in ("meet_ms", "check_ms", "plan_ms", "map_ms", "admit_ms")},
            "first_version": None if js is None else js.first_version}


def _worker_stats(worker):
    return dict(worker.weight_transfer_engine.stats)


def engine(replica: int, model_dir: str, prompts, max_tokens: int, commands, results) -> None:
    """One vLLM engine (TP=1) driven by commands: init (join), refit, shutdown (leave), stop."""
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = str(replica % (os.cpu_count() or 1))
    t0 = time.perf_counter()
    from vllm import LLM

    import tritonreshard.vllm as trs_vllm

    llm = LLM(model_dir, tensor_parallel_size=1, dtype="float32", enforce_eager=True, skip_tokenizer_init=True,
              max_model_len=128, max_num_seqs=4, seed=SEED, weight_transfer_config={"backend": trs_vllm.BACKEND},
              worker_extension_cls=trs_vllm.WORKER_EXTENSION)
    results.put(("started", replica, {"start_s": round(time.perf_counter() - t0, 1)}))
    try:
        while True:
            cmd, arg = commands.get()
            if cmd == "stop":
                break
            if cmd == "init":
                t0 = time.perf_counter()
                try:
                    llm.collective_rpc("init_weight_transfer_engine", kwargs={"init_info": arg})
                except Exception as exc:  # an expected refusal, reported to the driver  # noqa: BLE001
                    msg = str(exc)
                    results.put(("init", replica, {"error": msg[msg.find("tritonreshard"):]}))
                    continue
                ms = (time.perf_counter() - t0) * 1e3
                results.put(("init", replica, {"rpc_ms": round(ms, 1), **llm.collective_rpc(_engine_info)[0]}))
            elif cmd == "refit":
                t0 = time.perf_counter()
                llm.collective_rpc("start_weight_update")
                llm.collective_rpc("update_weights", kwargs={"update_info": {"version": arg}})
                llm.collective_rpc("finish_weight_update")
                ms = (time.perf_counter() - t0) * 1e3
                llm.reset_prefix_cache()  # cached KV was computed with the previous weights
                results.put(("refit", replica, {"version": arg, "refit_ms": round(ms, 2),
                                                "stats": llm.collective_rpc(_worker_stats)[0],
                                                "greedy": vllm_greedy(llm, prompts, max_tokens)}))
            elif cmd == "shutdown":
                llm.collective_rpc("shutdown_weight_transfer_engine")
                results.put(("left", replica, None))
    except Exception:  # noqa: BLE001  the driver reports it instead of waiting for its timeout
        results.put(("error", replica, traceback.format_exc()))
        raise


class Driver:
    """The processes of the run, each waited for with a timeout and killed at the end."""

    def __init__(self, ctx):
        self.ctx, self.results, self.procs, self.commands = ctx, ctx.Queue(), {}, {}
        self.gone = set()  # processes that exit on purpose (an engine that left)
        self.pending = []  # messages that came before the driver asked for them

    def start(self, key, target, args, daemon):
        self.commands[key] = self.ctx.Queue()
        p = self.ctx.Process(target=target, args=(*args, self.commands[key], self.results), daemon=daemon)
        p.start()
        self.procs[key] = p

    def send(self, key, cmd, arg=None):
        self.commands[key].put((cmd, arg))

    def expect(self, kind, who, timeout=WAIT_S):
        """The message ``kind`` from ``who`` (an engine's replica or a trainer rank); the processes
        answer in any order, so others are kept for later. Any process's error raises at once."""
        for i, msg in enumerate(self.pending):
            if (msg[0], msg[1]) == (kind, who):
                return self.pending.pop(i)[2]
        deadline = time.monotonic() + timeout
        while True:
            try:
                msg = self.results.get(timeout=1.0)
            except queue.Empty:
                dead = [k for k, p in self.procs.items() if not p.is_alive() and k not in self.gone]
                if dead:
                    raise RuntimeError(f"{dead} exited (codes {[self.procs[k].exitcode for k in dead]}) while "
                                       f"the driver waited for {kind!r}") from None
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no {kind!r} within {timeout:g} s") from None
                continue
            if msg[0] == "error":
                raise RuntimeError(f"engine {msg[1]} failed while the driver waited for {kind!r}: {msg[2]}")
            if (msg[0], msg[1]) == (kind, who):
                return msg[2]
            self.pending.append(msg)

    def stop_all(self):
        for key, p in self.procs.items():
            if p.is_alive():
                self.send(key, "stop")
        reap(self.procs, timeout=60)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=2, help="prompts compared after each refit (default 2)")
    ap.add_argument("--max-tokens", type=int, default=8, help="greedy tokens per prompt (default 8)")
    ap.add_argument("--json", action="store_true", help="print a JSON summary as the last stdout line")
    args = ap.parse_args(argv)
    from safetensors.torch import save_file

    import tritonreshard as trs
    import tritonreshard.vllm as trs_vllm

    cfg = model_config("tiny")
    model_dir = tempfile.mkdtemp(prefix="trs-vllm-elastic-")
    hf = tiny_model(cfg, seed=SEED, path=model_dir)
    train_path = model_dir.rstrip("/") + "-train.safetensors"
    save_file({n: t.contiguous() for n, t in training_tensors(hf).items()}, train_path)
    prompts = random_prompts(cfg.vocab_size, range(12, 12 + args.prompts), seed=SEED + 1)
    src = trs.recipes.hf_to_vllm(cfg, tp=1, trainer_ranks=TRAINERS, inference_ranks=ENGINE_RANKS[0]).src
    store = f"127.0.0.1:{free_port()}"
    shm_before = {f for f in os.listdir("/dev/shm") if f.startswith("trs-")}
    summary = {"checks": [], "tokens_compared": 0, "mismatches": 0, "refused": {}, "readers": {}, "fence_ms": {}}
    oracle = {}  # version -> transformers' greedy tokens with the trainers' weights

    trs.secret_for_children()  # trainers and engines inherit the group secret; it never crosses the store
    d = Driver(mp.get_context("spawn"))
    try:
        t0 = time.perf_counter()
        for replica in ENGINE_RANKS:  # both engines start now, concurrently: their start is the cost
            d.start(("engine", replica), engine, (replica, model_dir, prompts, args.max_tokens), daemon=False)
        for r in TRAINERS:
            d.start(("trainer", r), trainer, (r, train_path, store), daemon=True)
        for r in TRAINERS:
            d.expect("ready", r)
        summary["engine_start_s"] = [d.expect("started", replica)["start_s"] for replica in ENGINE_RANKS]
        print(f"trainers met; engines started in {summary['engine_start_s']} s "
              f"({time.perf_counter() - t0:.1f} s wall)", flush=True)

        def info(replica, **kw):
            kw = {"elastic": True, "replica": replica, "inference_ranks": ENGINE_RANKS[replica], **kw}
            return trs_vllm.init_info(store=store, trainer_ranks=TRAINERS, group=GROUP, timeout=120.0,
                                      peer_timeout=10.0, **kw)

        def join(replica):
            d.send(("engine", replica), "init", info(replica))
            out = d.expect("init", replica)
            assert "error" not in out, out["error"]
            summary.setdefault("join", {})[replica] = out
            print(f"engine {replica} joined: init_weight_transfer_engine {out['rpc_ms']} ms (the join itself "
                  f"{out['join_ms']:.1f} ms: {out['steps_ms']}), admitted at version {out['first_version']}",
                  flush=True)

        def publish(step):
            for r in TRAINERS:
                d.send(("trainer", r), "step", step)
            shards, readers = {}, None
            for r in TRAINERS:
                v, sh, readers, dropped, fence_ms = d.expect("published", r)
                shards[r] = sh
                summary["fence_ms"].setdefault(v, []).append(round(fence_ms, 2))
            summary["readers"][v] = readers
            weights = {n: torch.cat([shards[r][n] for r in TRAINERS]) for n in shards[TRAINERS[0]]}
            assert all(any(isinstance(p, trs.Shard) for p in src[n].placements) for n in weights)
            hf.load_state_dict(weights, strict=True)
            oracle[v] = hf_greedy(hf, prompts, args.max_tokens)
            return v

        def refit(replica, v):
            d.send(("engine", replica), "refit", v)
            out = d.expect("refit", replica)
            want = oracle[v]
            bad = mismatches(out["greedy"], want)
            summary["tokens_compared"] += sum(len(w) for w in want)
            summary["mismatches"] += bad
            summary["checks"].append({"engine": replica, "version": v, "refit_ms": out["refit_ms"],
                                      "prefetched": out["stats"]["prefetched"], "greedy": out["greedy"],
                                      "mismatches": bad})
            print(f"engine {replica}, version {v}: refit {out['refit_ms']} ms; vLLM greedy "
                  f"{'==' if not bad else '!='} transformers greedy", flush=True)

        join(0)
        refit(0, publish(1))
        v2 = publish(2)
        # Refused, each with one clear error, while the group goes on: a plain init_info against
        # elastic trainers, and replica index 0, which engine A holds.
        for what, kw in (("not_elastic", dict(elastic=False, inference_ranks=[2, 3], replica=1)),
                         ("replica_in_use", dict(replica=0, inference_ranks=ENGINE_RANKS[1]))):
            d.send(("engine", 1), "init", info(kw.pop("replica"), **kw))
            summary["refused"][what] = d.expect("init", 1).get("error")
            print(f"engine 1 refused ({what}): {summary['refused'][what]}", flush=True)
        t0 = time.perf_counter()
        join(1)
        refit(1, v2)
        summary["first_refit_ms"] = summary["checks"][-1]["refit_ms"]
        summary["join_to_first_refit_ms"] = round((time.perf_counter() - t0) * 1e3, 1)
        refit(0, v2)
        refit(0, publish(3))        # engine B skips version 3
        v4 = publish(4)
        refit(1, v4)
        refit(0, v4)
        d.send(("engine", 0), "shutdown")  # engine A leaves mid-run ...
        d.expect("left", 0)
        d.gone.add(("engine", 0))
        d.send(("engine", 0), "stop")       # ... and its process exits
        d.procs[("engine", 0)].join(WAIT_S)
        refit(1, publish(5))
        refit(1, publish(6))        # publishing 6 fenced version 5, which engine A never read
    finally:
        d.stop_all()
        shutil.rmtree(model_dir, ignore_errors=True)
        os.unlink(train_path)
    summary["exit_codes"] = {f"{k[0]} {k[1]}": p.exitcode for k, p in d.procs.items()}
    summary["shm_left"] = sorted({f for f in os.listdir("/dev/shm") if f.startswith("trs-")} - shm_before)
    greedy = {(c["engine"], c["version"]): c["greedy"] for c in summary["checks"]}
    summary["versions_differ"] = len({json.dumps(oracle[v]) for v in oracle}) == len(oracle)
    summary["ok"] = bool(summary["mismatches"] == 0 and len(greedy) == 8 and summary["versions_differ"]
                         and all(summary["refused"].values()) and not summary["shm_left"])
    if args.json:
        print(json.dumps(summary), flush=True)
    return summary


if __name__ == "__main__":
    sys.exit(0 if main()["ok"] else 1)
