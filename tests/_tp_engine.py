"""A second serving engine, the smallest one: a plain torch module served with tensor parallelism.

It proves the serving seam (``tritonreshard.serving``): everything an engine shares comes from there
(the init info, the rank's place, the pull mode, the refit session, the trainer side), and the
engine writes only what is its own, as ``tritonreshard/vllm/`` does for vLLM:

* its recipe (:func:`recipe`): its parameter names and TP layouts, built with ``trs.Layout`` /
  ``Shard`` / ``Replicate`` directly (no ``hf_to_vllm``);
* its agreement (:meth:`TPEngine.agree`): an object all-gather over its own gloo TP group;
* its model check (:func:`check_model`) and its apply (:meth:`TPEngine.apply`: a copy into the
  module's parameters).

The model (:class:`TinyMLP`): ``embed`` (replicated), ``fc1`` column-parallel (``Shard(0)`` of its
weight and bias), ``fc2`` row-parallel (``Shard(1)`` of its weight, partial sums all-reduced, bias
replicated). Values are small integers in float32, so every sum is exact and the TP forward equals
the unsharded one bit for bit. Imports nothing of vLLM.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch import nn

import tritonreshard as trs
from tritonreshard.recipes import RecipeSpec
from tritonreshard.serving import ServingInit, failure_text, outcome, pull_mode, refit, serving_rank

VOCAB, HIDDEN, FFN = 64, 16, 32
TOKENS = torch.arange(12) * 5 % VOCAB

#: ``{name: (full shape, TP placement)}``: what the engine serves.
PARAMS = {"embed.weight": ((VOCAB, HIDDEN), trs.Replicate()),
          "fc1.weight": ((FFN, HIDDEN), trs.Shard(0)), "fc1.bias": ((FFN,), trs.Shard(0)),
          "fc2.weight": ((HIDDEN, FFN), trs.Shard(1)), "fc2.bias": ((HIDDEN,), trs.Replicate())}


class TinyMLP(nn.Module):
    """The unsharded model: ``fc2(relu(fc1(embed(tokens))))``, ``tokens`` int64 ``[n]`` -> float32 ``[n, HIDDEN]``."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.fc1, self.fc2 = nn.Linear(HIDDEN, FFN), nn.Linear(FFN, HIDDEN)

    def forward(self, tokens):
        return self.fc2(torch.relu(self.fc1(self.embed(tokens))))


def full_weights(version: int) -> dict[str, torch.Tensor]:
    """The trainers' weights at ``version``: small integers (exact sums), different every version."""
    g = torch.Generator().manual_seed(1000 + version)
    return {n: torch.randint(-2, 3, shape, generator=g).float() for n, (shape, _) in PARAMS.items()}


def recipe(trainer_ranks, inference_ranks) -> RecipeSpec:
    """The engine's own recipe: FSDP rows (``Shard(0)``) over the trainers, the TP layouts of
    :data:`PARAMS` over one engine's TP ranks, names the same on both sides."""
    src = {n: trs.Layout(shape, list(trainer_ranks), [trs.Shard(0)]) for n, (shape, _) in PARAMS.items()}
    dst = {n: trs.Layout(shape, list(inference_ranks), [p]) for n, (shape, p) in PARAMS.items()}
    return RecipeSpec(model_type="tiny-mlp", tp=len(inference_ranks), expert_parallel=False, src=src, dst=dst,
                      parts={})


class TPShard(nn.Module):
    """One TP rank's part of :class:`TinyMLP`: its parameters hold ``spec.dst[name].local_shape(rank)``."""

    def __init__(self, spec: RecipeSpec, rank: int):
        super().__init__()
        self.shards = nn.ParameterDict({n.replace(".", "_"): nn.Parameter(torch.zeros(lay.local_shape(rank)),
                                                                          requires_grad=False)
                                        for n, lay in spec.dst.items()})

    def param(self, name: str) -> torch.Tensor:
        return self.shards[name.replace(".", "_")]

    def forward(self, tokens, group):
        h = torch.relu(self.param("embed.weight")[tokens] @ self.param("fc1.weight").T + self.param("fc1.bias"))
        y = h @ self.param("fc2.weight").T
        dist.all_reduce(y, group=group)  # row-parallel: the partial sums of the TP ranks
        return y + self.param("fc2.bias")


def check_model(module: TPShard, spec: RecipeSpec, rank: int) -> None:
    """The engine's model check: every recipe destination is a parameter of this rank's shape."""
    bad = [n for n, lay in spec.dst.items() if tuple(module.param(n).shape) != tuple(lay.local_shape(rank))]
    if bad:
        raise ValueError(f"tiny engine: the module does not match its recipe: {bad}")


class TPEngine:
    """One TP rank of the engine. ``init``: the init info (a dict, as an engine's RPC carries it);
    ``tp_group``: the engine's own TP process group (gloo)."""

    def __init__(self, init: dict, *, tp_rank: int, tp: int, tp_group):
        init = ServingInit.from_dict(init)
        self.tp_group = tp_group
        self.spec = recipe(init.trainer_ranks, init.inference_ranks)
        place = serving_rank(init, self.spec, tp=tp, tp_rank=tp_rank)
        self.rank = place.rank
        self.module = TPShard(self.spec, self.rank)
        check_model(self.module, self.spec, self.rank)
        self.pull = pull_mode(init.prefetch, rank=self.rank)
        self.sub, self.join_ms = place.join(device=torch.device("cpu"), mode=self.pull.MODE)
        self.pull.start(self.sub)
        self.timeout, self.installed = init.timeout, 0

    def agree(self, version, error) -> list:
        outcomes = [None] * dist.get_world_size(self.tp_group)
        dist.all_gather_object(outcomes, outcome(self.rank, version, error), group=self.tp_group)
        return outcomes

    def fail(self, outcomes, cause) -> None:
        raise trs.RefitError(f"tiny engine refit failed ({failure_text(outcomes)})") from cause

    @torch.no_grad()
    def apply(self, bufs: dict[str, torch.Tensor]) -> dict:
        t0 = time.perf_counter()
        for name, buf in bufs.items():
            self.module.param(name).copy_(buf)
        return {"copy_ms": (time.perf_counter() - t0) * 1e3, "post_ms": 0.0}

    def refit(self, version: int | None = None) -> dict:
        stats = refit(self.sub, self.pull, requested=version, timeout=self.timeout, installed=self.installed,
                      agree=self.agree, apply=self.apply, fail=self.fail)
        self.installed = stats["version"]
        return stats

    def forward(self, tokens):
        return self.module(tokens, self.tp_group)

    def close(self) -> None:
        self.pull.stop()
        self.sub.close()


__all__ = ["TPEngine", "TinyMLP", "recipe", "full_weights", "check_model", "TOKENS", "PARAMS"]
