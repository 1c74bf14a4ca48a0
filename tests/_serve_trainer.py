"""One FSDP trainer process of tests/test_vllm_serve.py, driven over stdin/stdout (JSON lines).

Usage: python _serve_trainer.py RANK STORE GROUP TRAIN_PATH OUT_DIR

Joins the refit group of a tiny Llama (the recipe's row shard ``RANK`` of every HF parameter, read
from ``TRAIN_PATH``) as ``tritonreshard.vllm.Trainer`` (rank 0 hosts the store), prints
``{"ready": rank}`` once the vLLM workers joined, then runs one command per stdin line:

* ``step K``: ``fence()``, then add seeded noise (seed from K and the rank) in the arena, publish;
* ``nofence K``: the same without ``fence()`` (a trainer that breaks the protocol);
* ``publish``: publish again without fence or change;
* ``fence T``: ``fence(timeout=T)`` alone, reporting whether it returned;
* ``stop``: leave.

Each reply is one JSON line; after a publish ``{"version": v, "shards": path}`` where ``path`` holds
this rank's shards as published (``torch.save``), so the test can rebuild the full weights.
"""
import json
import os
import sys

import torch

SIGMA = 0.02


def main(rank: int, store: str, group: str, train_path: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    from safetensors.torch import load_file
    from transformers import LlamaConfig

    import tritonreshard as trs
    import tritonreshard.vllm as trs_vllm

    cfg = LlamaConfig.from_pretrained(os.path.dirname(train_path) + "/model")
    full = load_file(train_path)
    trainers, inference = [0, 1], [2, 3]
    src = trs.recipes.hf_to_vllm(cfg, tp=2, trainer_ranks=trainers, inference_ranks=inference).src
    shards = {n: src[n].shard(full[n], rank).contiguous() for n in src}
    with trs_vllm.Trainer(cfg, shards, rank=rank, tp=2, trainer_ranks=trainers, inference_ranks=inference,
                          store=store, group=group, timeouts=trs.Timeouts(wait=120.0, peer=10.0)) as tr:
        reply({"ready": rank})
        for line in sys.stdin:
            cmd, *arg = line.split()
            if cmd == "stop":
                break
            if cmd == "fence":
                try:
                    tr.fence(timeout=float(arg[0]))
                    reply({"fenced": True})
                except TimeoutError as exc:
                    reply({"fenced": False, "error": str(exc)})
                continue
            if cmd == "step":
                tr.fence()
            if cmd in ("step", "nofence"):
                g = torch.Generator().manual_seed(1000 * int(arg[0]) + rank)
                for name in sorted(tr.tensors):
                    t = tr.tensors[name]
                    t.add_(torch.randn(t.shape, generator=g) * SIGMA)
            v = tr.publish()
            path = os.path.join(out_dir, f"shards-{group}-{rank}-{v}.pt")
            torch.save({n: t.clone() for n, t in tr.tensors.items()}, path)
            reply({"version": v, "shards": path})


def reply(obj) -> None:
    print(json.dumps(obj), flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5])
