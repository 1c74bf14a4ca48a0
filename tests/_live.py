"""The live servers test files share (conftest.py's session fixtures): one ``vllm serve`` per
configuration, started once per test session, whichever files use it.

Files run in name order, so the server's first user is tests/test_vllm_serve.py (its checks count
the server's log lines and versions from its start); later users (tests/test_vllm_trl.py) make no
assumption about what ran before, and keep ``srv.hf`` holding the weights the server serves
(:func:`hf_greedy` with the weights they installed) and leave no refit group joined.
"""
import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch
from _mp import free_port

TINY = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=1000,
            num_hidden_layers=2, intermediate_size=256, tie_word_embeddings=False, max_position_embeddings=256)
PROMPTS = [[11, 22, 33, 44, 55, 66, 77, 88, 99, 111, 222, 333], [5, 6, 7, 8, 9, 10, 500, 600, 700, 800, 900]]
MAX_TOKENS = 8
START_TIMEOUT_S = 240
#: The environment as the session began (conftest.py imports this module first): the servers start
#: from it, not from ``os.environ`` as it is when a file first asks for one. Tests that run vLLM in
#: this process (the recipe and tracer checks) leave vLLM's own settings there (``VLLM_DIST_IDENT``,
#: ``LD_PRELOAD``, ``LOCAL_WORLD_SIZE``, ``OMP_NUM_THREADS``...), which a server must not inherit.
SESSION_ENV = dict(os.environ)


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


@contextlib.contextmanager
def llama_server():
    """One live ``vllm serve`` of a tiny Llama (TP=2, float32, tritonreshard's backend and worker
    extension, vLLM's RL routes), up and healthy; ended with its whole process group on exit,
    also on failure. ``srv.hf`` is the transformers model of what it serves (callers that refit it
    keep it so: :func:`hf_greedy` with the weights they installed)."""
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
    env = dict(SESSION_ENV, VLLM_SERVER_DEV_MODE="1", VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="0|1",
               VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS="20", TRITONRESHARD_GROUP_SECRET=secret)
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir, "--host", "127.0.0.1",
           "--port", str(port), "--tensor-parallel-size", "2", "--dtype", "float32", "--enforce-eager",
           "--skip-tokenizer-init", "--max-model-len", "128", "--max-num-seqs", "4", "--seed", "0",
           "--weight-transfer-config", json.dumps({"backend": "tritonreshard"}),
           "--worker-extension-cls", "tritonreshard.vllm.WorkerExtension",
           # what TRL's own `trl vllm-serve` sets, as docs/frameworks.md's command does (without
           # processed logprobs GRPOTrainer's importance-sampling correction is biased)
           "--logprobs-mode", "processed_logprobs", "--max-logprobs", "-1"]
    log_path = os.path.join(tmp, "server.log")
    with open(log_path, "wb") as log:
        # Its own process group, so teardown ends the server with all of its engine and worker
        # processes; not its own session: a session is a scheduling group of its own (the kernel's
        # autogroup), and there vLLM's readers, spinning 1 s after each message, held every update
        # call for that second while this session computed (docs/vllm.md, "The 1 s update call").
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=tmp, process_group=0)
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
            print(f"vLLM left {len(left)} shared-memory segment(s) of its processes, removed: {left}")
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)


def _stop(proc) -> list[str]:
    """Stop the server as a user would (SIGTERM to the API server: it shuts its engine and workers
    down), SIGKILL whatever of its process group outlives 60 s, and remove the shared-memory segments its
    processes had mapped that vLLM left behind (its CPU TP communicator's ``vllm_dist_*``, its message
    queues' ``psm_*``: 680 MB were left once). Our trainers' arenas (``trs-*``), which the workers map
    too, are the trainers' to unlink. Returns the names removed."""
    segments = sorted({line.split()[-1] for pid in _group(proc.pid) for line in _maps(pid)
                       if " /dev/shm/" in line and "/dev/shm/trs-" not in line})
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # stragglers of the group, if any
    except ProcessLookupError:
        pass
    proc.wait(10)
    left = [s for s in segments if os.path.exists(s)]
    for path in left:
        os.unlink(path)
    return left


def _group(pgid: int) -> list[int]:
    """The pids of process group ``pgid`` (the server and every process it started)."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:  # gone meanwhile
                continue
            if int(fields[2]) == pgid:  # field 5 of stat: the process group id
                pids.append(int(entry))
    return pids


def _maps(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/maps") as f:
            return f.read().splitlines()
    except OSError:
        return []


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


