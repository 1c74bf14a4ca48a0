"""A trainer process for a `vllm serve` refitted over HTTP (README: "Refitting `vllm serve`").

``--make-model DIR`` writes a tiny Llama (hidden 128, 2 layers, vocab 1000; random weights,
seed 0) with transformers: ``DIR`` is what the server loads (``--model DIR``). Then each of the
two trainer processes (``--rank 0`` and ``--rank 1``) holds its FSDP row shard (``Shard(0)``) of
every HF parameter in tritonreshard's shared arena, joins the refit group at ``--store`` (rank 0
hosts it) once the server's workers joined (``/init_weight_transfer_engine``), and for each of
``--steps`` steps waits for the last version to be read (``fence()``), changes its shard (seeded
noise: an evolution-strategies style step) and publishes. With the background pull (the default)
the server's workers pull each version as soon as it is published and the trainer's last
``fence()`` returns without any vLLM call; the trainer then exits, and ``/update_weights``
installs the version the workers hold.

    python examples/vllm_serve_trainer.py --make-model /tmp/tiny-llama
    python examples/vllm_serve_trainer.py --model /tmp/tiny-llama --rank 0 --store 127.0.0.1:29600 --steps 1
"""
from __future__ import annotations

import argparse
import os

import torch

TRAINERS, INFERENCE = [0, 1], [2, 3]
SIGMA = 0.02


def make_model(path: str) -> None:
    from tritonreshard.apps.kit import tiny_model

    tiny_model(seed=0, path=path)  # the tiny Llama of the examples and tests (kit.TINY)
    print(f"tiny Llama written to {path}")


def train(path: str, rank: int, store: str, steps: int, group: str, timeout: float) -> None:
    from transformers import AutoModelForCausalLM

    import tritonreshard as trs
    import tritonreshard.vllm as trs_vllm

    hf = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
    full = {n: p.detach() for n, p in hf.named_parameters()}
    src = trs.recipes.hf_to_vllm(hf.config, tp=len(INFERENCE), trainer_ranks=TRAINERS, inference_ranks=INFERENCE).src
    shards = {n: src[n].shard(full[n], rank).contiguous() for n in src}
    with trs_vllm.Trainer(hf.config, shards, rank=rank, tp=len(INFERENCE), trainer_ranks=TRAINERS,
                          inference_ranks=INFERENCE, store=store, group=group,
                          timeouts=trs.Timeouts(wait=timeout)) as tr:
        print(f"trainer {rank}: joined the refit group", flush=True)
        for step in range(1, steps + 1):
            tr.fence()  # every worker read the last version (with the background pull: at once)
            g = torch.Generator().manual_seed(1000 * step + rank)
            for name in sorted(tr.tensors):
                tr.tensors[name].add_(torch.randn(tr.tensors[name].shape, generator=g) * SIGMA)
            print(f"trainer {rank}: published version {tr.publish()}", flush=True)
        tr.fence()  # the workers hold the last version; it is theirs to install now
        print(f"trainer {rank}: every worker pulled version {tr.published}", flush=True)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--make-model", metavar="DIR", help="write the tiny Llama to DIR and exit")
    ap.add_argument("--model", metavar="DIR", help="the model folder the server loads")
    ap.add_argument("--rank", type=int, choices=TRAINERS, help="this trainer's rank in the refit group")
    ap.add_argument("--store", default="127.0.0.1:29600", help="host:port of the refit group's store (rank 0 hosts it)")
    ap.add_argument("--steps", type=int, default=1, help="versions to publish (default 1)")
    ap.add_argument("--group", default="vllm", help="the refit group's name (init_info's group)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for the server's workers")
    args = ap.parse_args(argv)
    if args.make_model:
        return make_model(args.make_model)
    if args.model is None or args.rank is None or args.steps < 1:
        ap.error("--model, --rank and --steps >= 1 are needed (or --make-model DIR)")
    torch.set_num_threads(1)
    train(os.path.abspath(args.model), args.rank, args.store, args.steps, args.group, args.timeout)


if __name__ == "__main__":
    main()
