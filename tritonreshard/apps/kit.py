"""The helpers tests, examples and bench share, each written once: a free port, the process launcher,
the tiny model, and greedy decoding.

Who calls what:

* the process that starts others (a test, an example's driver, a bench script): :func:`free_port` for
  a store or a server to listen on; :func:`run_ranks` to run ``fn(rank, *args)`` in spawned processes
  with a hard timeout, or :func:`start_rank` + :func:`collect_ok` for tests that start, kill and
  restart ranks themselves; :func:`expect` to wait for one message of its children's results queue
  while watching that they live; :func:`reap` in a ``finally`` (join with a timeout, then SIGKILL);
* a spawned rank: nothing (:func:`rank_entry` wraps its function and reports its result or traceback);
* whoever needs a Hugging Face model without a download: :func:`tiny_config` (default :data:`TINY`,
  the Llama of the vLLM examples and tests), :func:`tiny_model` (deterministic weights for a seed,
  optionally saved with ``save_pretrained``), :func:`random_prompts`;
* whoever compares an engine with transformers: :func:`hf_greedy` (transformers, the oracle),
  :func:`vllm_greedy` (a ``vllm.LLM``), :func:`mismatches`.

transformers and vLLM are imported inside the functions that need them: importing this module pulls in
neither (torch only). The library never imports ``tritonreshard.apps``.
"""
from __future__ import annotations

import queue
import random
import signal
import socket
import time
import traceback
from collections.abc import Iterable

import torch
import torch.multiprocessing as mp

__all__ = ["free_port", "rank_entry", "start_rank", "collect_ok", "run_ranks", "expect", "reap", "TINY",
           "tiny_config", "tiny_model", "random_prompts", "hf_greedy", "vllm_greedy", "mismatches"]


# ------------------------------------------------------------------------------------------- port
_HANDED_OUT: set[int] = set()  # every port free_port returned in this process


def _ephemeral_ports() -> tuple[int, int]:
    """The kernel's range for the local ports of outgoing connections (Linux; else its default)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = (int(v) for v in f.read().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that nobody listened on a moment ago, below the kernel's ephemeral
    range where it can (any outgoing connection's local port comes from that range: the kernel's
    pick for port 0, used here before, once became a gloo connection's while a test waited to bind
    its store there, and twelve tests failed with "Address already in use"), and never one this
    process was handed before: a test that takes several ports and binds them later (a store per
    round, a TP group's port) gets distinct ones. Another process may still bind it first; a store
    that can bind port 0 itself (``TCPStore(host, 0, ...)``) needs no free port at all."""
    lo, _ = _ephemeral_ports()
    below = range(max(1024, lo - 16384), lo)
    for _ in range(1000 if len(below) >= 1024 else 0):
        port = random.choice(below)
        if port in _HANDED_OUT:
            continue
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:  # in use, or lingering
                continue
        _HANDED_OUT.add(port)
        return port
    while True:  # no room below the ephemeral range: the kernel's pick
        with socket.socket() as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port


# --------------------------------------------------------------------------------------- launcher
def rank_entry(fn, rank: int, args, results) -> None:
    """What a spawned rank runs: ``fn(rank, *args)``, its result put on ``results`` as
    ``(rank, "ok", value)``, or its exception as ``(rank, "error", (type name, message, traceback))``.
    Module level, so that spawn pickles it by name; ``fn``'s value must pickle too."""
    try:
        results.put((rank, "ok", fn(rank, *args)))
    except BaseException as exc:  # reported to the parent, which fails with it
        results.put((rank, "error", (type(exc).__name__, str(exc), traceback.format_exc())))


def start_rank(ctx, fn, rank: int, args, results):
    """Start one rank now: a daemon process of ``ctx`` (``torch.multiprocessing.get_context("spawn")``)
    running ``fn(rank, *args)`` through :func:`rank_entry`, whose result or exception goes to
    ``results`` (a ``ctx.Queue()``). Returns the started process. For tests that start, kill and
    restart ranks themselves; collect with :func:`collect_ok`, and :func:`reap` in a ``finally``."""
    p = ctx.Process(target=rank_entry, args=(fn, rank, tuple(args), results), daemon=True)
    p.start()
    return p


def _failed(rank, value, others: dict | None = None) -> AssertionError:
    """The AssertionError for ``rank``'s exception (its traceback), naming the ``others`` that
    raised too (``{rank: (type, message, traceback)}``) by their message's first line."""
    name, msg, tb = value
    lines = [f"rank {rank} raised {name}: {msg}"]
    if others:
        lines.append("then")
        lines += [f"  rank {r} raised {n}: {m.splitlines()[0] if m else ''}" for r, (n, m, _) in others.items()]
    return AssertionError("\n".join([*lines, tb]))


def collect_ok(results, ranks, timeout: float) -> dict:
    """``{rank: value}`` of the ranks started with :func:`start_rank`, read from ``results`` until
    every one of ``ranks`` reported; a rank that raised fails with an AssertionError carrying its
    traceback, and ranks still silent after ``timeout`` seconds fail with a TimeoutError naming them.
    The processes are the caller's to :func:`reap`."""
    out = {}
    deadline = time.monotonic() + timeout
    while not set(ranks) <= set(out):
        try:
            rank, status, value = results.get(timeout=max(0.1, deadline - time.monotonic()))
        except queue.Empty:
            raise TimeoutError(f"ranks {sorted(set(ranks) - set(out))} did not finish "
                               f"within {timeout:g} s") from None
        if status != "ok":
            raise _failed(rank, value)
        out[rank] = value
    return out


def run_ranks(fn, nprocs: int, args=(), timeout: float = 120.0, allow_errors: bool = False,
              victims=()) -> dict:
    """Run ``fn(rank, *args)`` for ranks ``0 .. nprocs-1`` in spawned processes; return
    ``{rank: value}``.

    Hard timeout: ranks that did not report within ``timeout`` seconds are SIGKILLed and the call
    raises a TimeoutError naming them; a rank that died without a report raises a RuntimeError with
    its exit code. A rank's exception fails the call with its traceback (the first to arrive, which
    is most often the cause; the later ones are named after it), or with ``allow_errors`` is
    returned as ``("error", (type, message, traceback))`` (the others then as ``("ok", value)``).
    Ranks in ``victims`` must die of SIGKILL (fault injection): they report nothing, their exit code
    is checked, and only the survivors are returned. No process outlives the call.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=rank_entry, args=(fn, r, tuple(args), results), daemon=True)
             for r in range(nprocs)]
    for p in procs:
        p.start()
    out: dict = {}
    survivors = set(range(nprocs)) - set(victims)
    deadline = time.monotonic() + timeout
    try:
        while not survivors <= set(out):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"ranks {sorted(survivors - set(out))} did not finish within "
                                   f"{timeout:g} s")
            try:
                rank, status, value = results.get(timeout=min(remaining, 0.5))
            except queue.Empty:
                gone = [r for r in sorted(survivors - set(out)) if not procs[r].is_alive()]
                if gone:
                    time.sleep(0.5)  # its report may still be in the pipe
                    while not results.empty():
                        rank, status, value = results.get()
                        out[rank] = (status, value)
                    gone = [r for r in gone if r not in out]
                    if gone:
                        raise RuntimeError(f"ranks {gone} died without a report, exit codes "
                                           f"{[procs[r].exitcode for r in gone]}") from None
                continue
            out[rank] = (status, value)
        for r in victims:
            procs[r].join(max(1.0, deadline - time.monotonic()))
            assert procs[r].exitcode == -signal.SIGKILL, \
                f"rank {r} exit code {procs[r].exitcode}, expected SIGKILL"
    finally:
        # Survivors that reported exit on their own; at the deadline nobody waits any longer.
        reap(procs, timeout=max(0.1, min(10.0, deadline - time.monotonic())))
        results.close()
    out = {r: v for r, v in out.items() if r in survivors}
    if not allow_errors:
        # The first error to arrive is most often the cause (a rank that failed at once), the
        # later ones its peers timing out on it: report that one, and name the rest.
        errors = {r: v for r, (s, v) in out.items() if s == "error"}
        if errors:
            first, *later = errors
            raise _failed(first, errors[first], {r: errors[r] for r in later})
        return {r: v for r, (s, v) in out.items()}
    return out


def expect(results, kind: str, procs: dict, timeout: float = 300.0, who: str = "process(es)"):
    """The next message on ``results``, a tuple whose first item must be ``kind``; meanwhile, once a
    second, any process of ``procs`` (``{key: process}``) that exited raises a RuntimeError naming
    it and its exit code, and after ``timeout`` seconds a TimeoutError. ``who`` names ``procs`` in
    those messages ("trainer rank(s)"). A message of another kind raises: the protocol is in step."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            msg = results.get(timeout=1.0)
        except queue.Empty:
            dead = [k for k, p in procs.items() if not p.is_alive()]
            if dead:
                raise RuntimeError(f"{who} {dead} exited (codes {[procs[k].exitcode for k in dead]}) "
                                   f"while the driver waited for {kind!r}") from None
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {kind!r} from the {who} within {timeout:g} s") from None
            continue
        if msg[0] != kind:
            raise RuntimeError(f"expected {kind!r} from the {who}, got {msg[0]!r}")
        return msg


def reap(procs, timeout: float = 10.0) -> list:
    """Join every process of ``procs`` (an iterable of processes, or a dict of them) for up to
    ``timeout`` seconds each, SIGKILL the ones still alive and join them; returns the exit codes in
    order (``-signal.SIGKILL`` for a killed one). For a ``finally``: no process outlives it."""
    procs = list(procs.values()) if isinstance(procs, dict) else list(procs)
    for p in procs:
        p.join(timeout)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(10)
    return [p.exitcode for p in procs]


# ----------------------------------------------------------------------------------------- models
#: The tiny Llama of the vLLM examples and tests: hidden 128, 4 heads (2 KV heads, head_dim 32),
#: vocab 1000, 2 layers, untied embeddings; 2.6 M parameters, 10 MB of float32.
TINY = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=1000,
            num_hidden_layers=2, intermediate_size=256, tie_word_embeddings=False, max_position_embeddings=256)


def tiny_config(cls: str = "LlamaConfig", fields: dict | None = None, **overrides):
    """A transformers config of class ``cls`` (a name in ``transformers``: "LlamaConfig",
    "Qwen3MoeConfig", ...) from ``fields`` (default :data:`TINY`) updated by ``overrides``, with
    ``architectures`` set to its ``...ForCausalLM`` (what vLLM reads to pick the model)."""
    import transformers  # lazy: importing the kit must not import transformers (seconds, and optional)

    fields = dict(TINY if fields is None else fields, **overrides)
    return getattr(transformers, cls)(**fields, architectures=[cls.replace("Config", "ForCausalLM")])


def tiny_model(config=None, *, seed: int = 0, path: str | None = None):
    """``AutoModelForCausalLM.from_config(config)`` (default :func:`tiny_config`) in float32 and eval
    mode, its random weights drawn after ``torch.manual_seed(seed)``: the same model for the same
    seed, whatever the caller's RNG state (which it leaves as it was). Saved with ``save_pretrained``
    to ``path`` (a folder vLLM and ``from_pretrained`` load) when given. Nothing is downloaded."""
    from transformers import AutoModelForCausalLM  # lazy, as in tiny_config

    config = tiny_config() if config is None else config
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config).float().eval()
    if path is not None:
        model.save_pretrained(path)
    return model


def random_prompts(vocab_size: int, lengths: Iterable[int], *, seed: int) -> list[list[int]]:
    """One prompt of token ids in ``[0, vocab_size)`` per entry of ``lengths`` (that many tokens),
    drawn in order from a ``torch.Generator`` seeded with ``seed``: the same prompts everywhere."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=g).tolist() for n in lengths]


# ----------------------------------------------------------------------------------------- greedy
def hf_greedy(model, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """transformers' greedy continuation of each prompt (token ids), exactly ``max_tokens`` new
    tokens each, one prompt at a time (no padding): the oracle an engine's greedy tokens must equal
    with the same weights. ``model``: a causal LM on the CPU (float32 for exact comparisons)."""
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = model.generate(torch.tensor([p]), max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                                 do_sample=False, pad_token_id=0)
            out.append(ids[0, len(p):].tolist())
    return out


def vllm_greedy(llm, prompts: list[list[int]], max_tokens: int, lora_request=None) -> list[list[int]]:
    """A ``vllm.LLM``'s greedy continuation of each prompt (token ids in, token ids out), exactly
    ``max_tokens`` tokens each; with ``lora_request`` (a ``LoRARequest``) through that adapter."""
    from vllm import SamplingParams  # lazy: vLLM is optional, and only its callers have it
    from vllm.inputs import TokensPrompt

    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, min_tokens=max_tokens, detokenize=False)
    kw = {} if lora_request is None else {"lora_request": lora_request}
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False, **kw)
    return [list(o.outputs[0].token_ids) for o in outs]


def mismatches(got: list[list[int]], want: list[list[int]]) -> int:
    """Tokens that differ between two lists of continuations: positions with different ids plus the
    difference in length of each pair (a missing or extra token counts once)."""
    return sum(a != b for g, w in zip(got, want, strict=True) for a, b in zip(g, w, strict=False)) + sum(
        abs(len(g) - len(w)) for g, w in zip(got, want, strict=True))
