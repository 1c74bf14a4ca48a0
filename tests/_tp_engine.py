"""A second serving engine, the smallest one: a plain torch module served with tensor parallelism.

It proves the serving seam (``tritonreshard.serving``): the engine implements
:class:`~tritonreshard.serving.ServingEngine` and everything an engine shares comes from there (the
init info, the recipe registry, the rank's place, the pull mode, the refit session, the trainer
side); the engine writes only what is its own, as ``tritonreshard/vllm/`` does for vLLM:

* its recipe (:func:`recipe`), registered as ``("tiny-mlp", "hf")``: its parameter names and TP
  layouts, built with ``trs.Layout`` / ``Shard`` / ``Replicate`` directly (no ``hf_to_vllm``); its
  trainer class (:class:`TinyTrainer`) finds it through the registry as the engine does;
* its rank's layout (:meth:`TPEngine.rank_layout`);
* its agreement (:meth:`TPEngine.agree`): an object all-gather over its own gloo TP group;
* its model check (:meth:`TPEngine.check`) and its apply (:meth:`TPEngine.apply`: a copy into
  the module's parameters);
* the parameters a direct pull writes (:meth:`TPEngine.direct_tensors`: all of them, they are the
  load format) and what a direct pull that failed leaves (:meth:`TPEngine.writing_served`: the
  engine refuses to run its forward until a refit succeeds).

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
from tritonreshard.serving import (
    RankLayout,
    ServingEngine,
    ServingInit,
    ServingTrainer,
    UpdateInfo,
    failure_text,
    outcome,
    register_recipe,
)

ENGINE = "tiny-mlp"
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
    return RecipeSpec(model_type=ENGINE, tp=len(inference_ranks), expert_parallel=False, src=src, dst=dst,
                      parts={})


def _registered_recipe(init: ServingInit, layout: RankLayout) -> RecipeSpec:
    """The registry's builder: the same recipe for the trainers and the engine's ranks."""
    return recipe(init.trainer_ranks, init.inference_ranks)


register_recipe(ENGINE, "hf", _registered_recipe)


class TinyTrainer(ServingTrainer):
    """The engine's trainer class: its recipe comes from the registry, as vLLM's ``Trainer``'s does."""

    ENGINE = ENGINE
    GROUP = "tiny"


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


class TPEngine(ServingEngine[ServingInit, UpdateInfo]):
    """One TP rank of the engine. ``init``: the init info (a dict, as an engine's RPC carries it);
    ``tp_group``: the engine's own TP process group (gloo)."""

    def __init__(self, init: dict, *, tp_rank: int, tp: int, tp_group):
        self.tp_group, self.tp, self.tp_rank = tp_group, tp, tp_rank
        self.module = None
        self.torn = False  # a direct pull may have written part of a version: refuse to serve
        joined = self.join_group(ServingInit.from_dict(init))
        self.spec, self.rank, self.sub, self.pull = joined.spec, joined.rank, joined.sub, joined.pull
        self.start_pulling()

    def rank_layout(self, init: ServingInit) -> RankLayout:
        return RankLayout(engine=ENGINE, tp=self.tp, tp_rank=self.tp_rank)

    def check(self, place) -> None:
        """The engine's model check: every recipe destination is a parameter of this rank's shape."""
        self.module = TPShard(place.spec, place.rank)
        bad = [n for n, lay in place.spec.dst.items()
               if tuple(self.module.param(n).shape) != tuple(lay.local_shape(place.rank))]
        if bad:
            raise ValueError(f"tiny engine: the module does not match its recipe: {bad}")

    def agree(self, version, error) -> list:
        outcomes = [None] * dist.get_world_size(self.tp_group)
        dist.all_gather_object(outcomes, outcome(self.rank, version, error), group=self.tp_group)
        return outcomes

    def fail(self, outcomes, cause) -> None:
        raise trs.RefitError(f"tiny engine refit failed ({failure_text(outcomes)})") from cause

    def direct_tensors(self, place) -> dict[str, torch.Tensor]:
        """Every parameter: the module serves the load format as it is."""
        return {n: self.module.param(n).data for n in place.spec.dst}

    def writing_served(self) -> None:
        self.torn = True

    @torch.no_grad()
    def apply(self, bufs: dict[str, torch.Tensor]) -> dict:
        t0 = time.perf_counter()
        for name, buf in bufs.items():
            self.module.param(name).copy_(buf)
        self.torn = False
        return {"copy_ms": (time.perf_counter() - t0) * 1e3, "post_ms": 0.0}

    def forward(self, tokens):
        if self.torn:
            raise RuntimeError("tiny engine: a direct pull failed part-way; refit before serving")
        return self.module(tokens, self.tp_group)

    def served(self, name: str) -> torch.Tensor:
        """What the engine serves for ``name``, in load format."""
        return self.module.param(name)

    def close(self) -> None:
        self.leave_group()


class PackedTPEngine(TPEngine):
    """The engine with one post-processed layer, as vLLM's CPU backend repacks its linear layers:
    ``fc1`` is served packed (its weight transposed, ``[HIDDEN, FFN / tp]``, in a tensor of its own;
    the load-format parameters are dropped once packed), so a direct pull writes only ``embed`` and
    ``fc2`` in place and streams ``fc1`` through its layer sink: ``open`` makes fresh load-format
    tensors (vLLM's layerwise reload materializes a layer so), ``close`` packs them into the
    served tensor's storage and drops them. ``events`` records the sink's calls; ``peak_open``
    the most load-format bytes it held at once."""

    PACKED = ("fc1.weight", "fc1.bias")

    def check(self, place) -> None:
        super().check(place)
        w = self.module.param("fc1.weight")
        self.fc1_packed = w.detach().T.contiguous()
        self.events, self.open_bytes, self.peak_open, self._open = [], 0, 0, {}

    def direct_tensors(self, place) -> dict[str, torch.Tensor]:
        return {n: t for n, t in super().direct_tensors(place).items() if n not in self.PACKED}

    def layer_sink(self, place, direct):
        return _FC1Sink(self, place)

    def _pack(self, weight: torch.Tensor, bias: torch.Tensor) -> None:
        self.fc1_packed.copy_(weight.T)  # the served tensor's storage: its address never changes
        self.module.param("fc1.bias").data.copy_(bias)

    @torch.no_grad()
    def apply(self, bufs: dict[str, torch.Tensor]) -> dict:
        split = super().apply({n: t for n, t in bufs.items() if n != "fc1.weight"})
        if "fc1.weight" in bufs:
            self._pack(bufs["fc1.weight"], bufs["fc1.bias"])
        return split

    def served(self, name: str) -> torch.Tensor:
        return self.fc1_packed.T if name == "fc1.weight" else super().served(name)

    def forward(self, tokens):
        if self.torn:
            raise RuntimeError("tiny engine: a direct pull failed part-way; refit before serving")
        m = self.module
        h = torch.relu(m.param("embed.weight")[tokens] @ self.fc1_packed + m.param("fc1.bias"))
        y = h @ m.param("fc2.weight").T
        dist.all_reduce(y, group=self.tp_group)
        return y + m.param("fc2.bias")


class _FC1Sink:
    """:class:`PackedTPEngine`'s layer sink: one group, ``fc1``."""

    def __init__(self, engine: PackedTPEngine, place):
        self.engine, self.place = engine, place
        self.groups = [list(PackedTPEngine.PACKED)]

    def open(self, group: int) -> dict[str, torch.Tensor]:
        e, rank = self.engine, self.place.rank
        e._open = {n: torch.empty(self.place.spec.dst[n].local_shape(rank)) for n in self.groups[group]}
        e.open_bytes += sum(t.numel() * t.element_size() for t in e._open.values())
        e.peak_open = max(e.peak_open, e.open_bytes)
        e.events.append(("open", group))
        return e._open

    def close(self, group: int) -> None:
        e = self.engine
        e._pack(e._open["fc1.weight"], e._open["fc1.bias"])
        e.open_bytes -= sum(t.numel() * t.element_size() for t in e._open.values())
        e._open = {}
        e.events.append(("close", group))


__all__ = ["TPEngine", "PackedTPEngine", "TinyTrainer", "TinyMLP", "recipe", "full_weights", "TOKENS", "PARAMS",
           "ENGINE"]
