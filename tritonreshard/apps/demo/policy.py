"""The demo's policy and task: a tiny autoregressive MLP policy, its dense and tensor-parallel
forwards, the reward, and helpers that turn sharded parameters back into full ones.

Model (``V`` vocab, ``L`` positions, ``D`` model width, ``H`` hidden width)::

    x      = tok[prompt[t]] + prev[out[t-1]] + pos[t]                  (out[-1] = BOS = V)
    a      = silu(gate(rms(x) * norm1)) * up(rms(x) * norm1)           gate_up: [2H, D], packed
    x      = x + a @ down.T + down_bias                                down: [D, H]
    logits = (rms(x) * norm2) @ lm_head.T                              lm_head: [V, D]

Task: given a prompt of ``L`` random tokens, emit ``L`` tokens with ``out[t] = (prompt[t] + t + 1)
% V``; the reward of a sequence is the fraction of positions that follow the rule.

Layouts: trainers hold every parameter split by rows (``Shard(0)``, FSDP style). Inference ranks
hold a tensor-parallel layout: ``gate_up`` column-parallel with its gate and up halves split
independently (``Shard(0, blocks=(H, H))``), ``down`` row-parallel (``Shard(1)``), ``lm_head``
vocab-parallel (``Shard(0)``) and everything else replicated.

Everything here is plain torch; the process groups are passed in by the callers (:mod:`.trainer`,
:mod:`.inference`).
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tritonreshard.layout import Layout, Replicate, Shard


@dataclass(frozen=True)
class PolicyConfig:
    vocab: int = 16
    length: int = 6
    dim: int = 64
    hidden: int = 256

    @property
    def bos(self) -> int:
        return self.vocab

    def shapes(self) -> dict[str, tuple[int, ...]]:
        V, L, D, H = self.vocab, self.length, self.dim, self.hidden
        return {
            "embed.tok": (V, D),
            "embed.prev": (V + 1, D),
            "embed.pos": (L, D),
            "norm1.weight": (D,),
            "mlp.gate_up": (2 * H, D),
            "mlp.down": (D, H),
            "mlp.down_bias": (D,),
            "norm2.weight": (D,),
            "lm_head": (V, D),
        }


def init_params(cfg: PolicyConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Full (unsharded) float32 initial parameters, identical on every rank for the same seed."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in cfg.shapes().items():
        if name.startswith("norm"):
            out[name] = torch.ones(shape)
        elif name.endswith("bias"):
            out[name] = torch.zeros(shape)
        else:
            fan_in = shape[-1]
            out[name] = torch.randn(shape, generator=g) / math.sqrt(fan_in)
    return out


def trainer_layouts(cfg: PolicyConfig, trainer_ranks: tuple[int, ...]) -> dict[str, Layout]:
    """FSDP-style: every parameter split by rows over the trainer group."""
    return {n: Layout(s, trainer_ranks, [Shard(0)]) for n, s in cfg.shapes().items()}


def inference_layouts(cfg: PolicyConfig, tp_ranks: tuple[int, ...]) -> dict[str, Layout]:
    """Tensor-parallel serving layout (what a vLLM-style engine holds)."""
    H = cfg.hidden
    tp = {
        "mlp.gate_up": Shard(0, blocks=(H, H)),  # column-parallel, gate and up halves split apart
        "mlp.down": Shard(1),                     # row-parallel: partial sums, then all-reduce
        "lm_head": Shard(0),                      # vocab-parallel: all-gather the logits
    }
    return {n: Layout(s, tp_ranks, [tp.get(n, Replicate())]) for n, s in cfg.shapes().items()}


# --------------------------------------------------------------------------------------------
# Task
# --------------------------------------------------------------------------------------------
def target(cfg: PolicyConfig, prompts: torch.Tensor) -> torch.Tensor:
    """The tokens the rule asks for: ``(prompt[t] + t + 1) % V``. prompts: [B, L] int64."""
    t = torch.arange(cfg.length, device=prompts.device)
    return (prompts + t + 1) % cfg.vocab


def reward(cfg: PolicyConfig, prompts: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
    """Fraction of positions that follow the rule, per sequence: [B] float32."""
    return (actions == target(cfg, prompts)).float().mean(dim=1)


def prev_tokens(cfg: PolicyConfig, actions: torch.Tensor) -> torch.Tensor:
    """Teacher-forced previous tokens ``[BOS, a0, ..., a_{L-2}]`` for a batch of actions [B, L]."""
    return _shift_right(actions, cfg.bos)


def _shift_right(actions: torch.Tensor, bos: int) -> torch.Tensor:
    return torch.cat([torch.full_like(actions[:, :1], bos), actions[:, :-1]], dim=1)


def probe_inputs(cfg: PolicyConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Fixed probe batch (prompts, previous tokens), [8, L] each, the same on every rank."""
    g = torch.Generator().manual_seed(1234)
    prompts = torch.randint(0, cfg.vocab, (8, cfg.length), generator=g)
    prev = prev_tokens(cfg, torch.randint(0, cfg.vocab, (8, cfg.length), generator=g))
    return prompts, prev


# --------------------------------------------------------------------------------------------
# Forwards
# --------------------------------------------------------------------------------------------
def _rms(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def dense_forward(p: dict[str, torch.Tensor], prompts: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
    """Logits [..., V] from full weights ``p``; prompts / prev: int64 of the same shape [...]."""
    pos = torch.arange(prompts.shape[-1], device=prompts.device) if prompts.dim() > 1 else None
    x = p["embed.tok"][prompts] + p["embed.prev"][prev]
    x = x + (p["embed.pos"][pos] if pos is not None else 0)
    h = _rms(x) * p["norm1.weight"]
    gate, up = (h @ p["mlp.gate_up"].T).chunk(2, dim=-1)
    x = x + (F.silu(gate) * up) @ p["mlp.down"].T + p["mlp.down_bias"]
    return (_rms(x) * p["norm2.weight"]) @ p["lm_head"].T


def tp_forward(w: dict[str, torch.Tensor], prompts: torch.Tensor, prev: torch.Tensor,
               pos: torch.Tensor, group, comm) -> torch.Tensor:
    """Tensor-parallel logits [B, V] for one position per row, from this rank's TP shards ``w``.

    Called by every rank of the TP ``group`` with the same inputs (prompts, prev, pos: [B] int64).
    ``gate_up``'s local rows are this rank's piece of the gate block followed by its piece of the
    up block, so ``chunk(2)`` splits them exactly as the dense forward splits the full matrix.
    ``comm`` provides ``all_reduce(t, group)`` / ``all_gather_cat(t, dim, group)`` (they stage
    through the CPU where the backend needs it).
    """
    x = w["embed.tok"][prompts] + w["embed.prev"][prev] + w["embed.pos"][pos]
    h = _rms(x) * w["norm1.weight"]
    gate, up = (h @ w["mlp.gate_up"].T).chunk(2, dim=-1)
    partial = (F.silu(gate) * up) @ w["mlp.down"].T
    x = x + comm.all_reduce(partial, group) + w["mlp.down_bias"]
    local_logits = (_rms(x) * w["norm2.weight"]) @ w["lm_head"].T
    return comm.all_gather_cat(local_logits, -1, group)


def policy_loss(p: dict[str, torch.Tensor], prompts: torch.Tensor, actions: torch.Tensor,
                advantages: torch.Tensor, denom: int) -> torch.Tensor:
    """REINFORCE with group-relative advantages: ``-sum_i adv_i * log pi(a_i | prompt_i) / denom``.

    prompts, actions: [B, L] int64; advantages: [B]; ``denom``: the global batch size, so the
    trainers' summed gradients are the gradient of the global mean.
    """
    bos = p["lm_head"].shape[0]  # BOS is the extra row of embed.prev, index V
    logits = dense_forward(p, prompts, _shift_right(actions, bos))
    logp = torch.log_softmax(logits, dim=-1).gather(-1, actions.unsqueeze(-1)).squeeze(-1).sum(-1)
    return -(advantages * logp).sum() / denom


def group_advantages(rewards: torch.Tensor, group: int) -> torch.Tensor:
    """GRPO-style: reward minus its group's mean, over the group's std (rewards: [B], B % group == 0)."""
    r = rewards.view(-1, group)
    return ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-4)).view(-1)


# --------------------------------------------------------------------------------------------
# Sharded <-> full
# --------------------------------------------------------------------------------------------
def place_local(layout: Layout, rank: int, local: torch.Tensor, full: torch.Tensor) -> None:
    """Write ``rank``'s local shard into its place in the ``full`` tensor (inverse of ``shard``)."""
    segs = layout.segments(rank)
    if any(len(s) == 0 for s in segs):
        return
    # A rank holds the cartesian product of its per-dim segments.
    def rec(d, dst, src):
        if d == len(segs):
            dst.copy_(src)
            return
        for g0, g1, off in segs[d]:
            rec(d + 1, dst.narrow(d, g0, g1 - g0), src.narrow(d, off, g1 - g0))
    rec(0, full, local)


def gather_full(layouts: dict[str, Layout], local: dict[str, torch.Tensor], rank: int, group,
                comm) -> dict[str, torch.Tensor]:
    """All-gather every parameter's shards over ``group`` (the layout's mesh, in mesh order) into
    full CPU float32 tensors. Pure copies: the result is bit-identical to the global tensors."""
    out = {}
    for name, lay in layouts.items():
        shards = comm.all_gather_padded(local[name].detach(), [lay.local_shape(r) for r in lay.ranks], group)
        full = torch.empty(lay.shape, dtype=lay.dtype)
        for r, s in zip(lay.ranks, shards, strict=True):
            place_local(lay, r, s.cpu(), full)
        out[name] = full
    return out


def weights_digest(full: dict[str, torch.Tensor]) -> str:
    """SHA-1 over the bytes of every full parameter, in name order."""
    h = hashlib.sha1()
    for name in sorted(full):
        h.update(name.encode())
        h.update(full[name].detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def probe(cfg: PolicyConfig, full: dict[str, torch.Tensor]) -> torch.Tensor:
    """The verification forward: dense, CPU, float32, single-threaded by the caller. Trainer and
    inference both call exactly this on bit-identical weights, so the logits match bit for bit."""
    prompts, prev = probe_inputs(cfg)
    with torch.no_grad():
        return dense_forward({k: v.cpu() for k, v in full.items()}, prompts, prev)


def tensor_digest(t: torch.Tensor) -> str:
    return hashlib.sha1(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


class Comm:
    """Collectives over gloo or nccl; with gloo, CUDA tensors are staged through the CPU."""

    def __init__(self, device: torch.device, backend: str):
        self.device = device
        self.stage = device.type == "cuda" and backend == "gloo"

    def _to_comm(self, t):
        return t.cpu() if self.stage else t

    def all_reduce(self, t: torch.Tensor, group) -> torch.Tensor:
        c = self._to_comm(t.contiguous()).clone()
        dist.all_reduce(c, group=group)
        return c.to(t.device)

    def all_reduce_min(self, t: torch.Tensor, group) -> torch.Tensor:
        c = self._to_comm(t.contiguous()).clone()
        dist.all_reduce(c, op=dist.ReduceOp.MIN, group=group)
        return c.to(t.device)

    def all_reduce_max(self, t: torch.Tensor, group) -> torch.Tensor:
        c = self._to_comm(t.contiguous()).clone()
        dist.all_reduce(c, op=dist.ReduceOp.MAX, group=group)
        return c.to(t.device)

    def all_gather_cat(self, t: torch.Tensor, dim: int, group) -> torch.Tensor:
        c = self._to_comm(t.contiguous())
        parts = [torch.empty_like(c) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, c, group=group)
        return torch.cat(parts, dim=dim).to(t.device)

    def all_gather_padded(self, t: torch.Tensor, shapes, group) -> list[torch.Tensor]:
        """All-gather tensors of differing shapes (``shapes`` in group order) via a padded flat buffer."""
        n = max(math.prod(s) for s in shapes)
        flat = torch.zeros(n, dtype=t.dtype, device=t.device)
        flat[: t.numel()] = t.reshape(-1)
        flat = self._to_comm(flat)
        parts = [torch.empty_like(flat) for _ in shapes]
        dist.all_gather(parts, flat, group=group)
        return [p[: math.prod(s)].view(s) for p, s in zip(parts, shapes, strict=True)]

    def broadcast(self, t: torch.Tensor, src: int, group) -> torch.Tensor:
        c = self._to_comm(t.contiguous()).clone()
        dist.broadcast(c, src=src, group=group)
        return c.to(t.device)
