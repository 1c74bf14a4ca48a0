"""Refit a Hugging Face Llama from 2 FSDP trainers into 4 vLLM-style tensor-parallel ranks.

A tiny Llama is built locally from a ``transformers`` config (no download) with 8 query heads and 2
KV heads, so at TP=4 every KV head is replicated on 2 ranks, and a vocab of 1000 that vLLM pads to
1024. ``trs.recipes.hf_to_vllm`` gives the trainers' layouts (FSDP rows of the HF parameters), the
inference ranks' layouts (vLLM's ``named_parameters()`` per TP rank: fused ``qkv_proj`` and
``gate_up_proj``, padded vocab) and the validated plan. ``trs.execute_local`` runs the plan with every
rank in this process (the cross-process engine runs the same plan over shared arenas).

Each TP rank's shards are then checked by running a tensor-parallel forward, the way vLLM computes
it: vocab-parallel embedding, column-parallel qkv / gate_up on local heads, row-parallel o_proj /
down_proj whose partial sums are all-reduced, and a vocab-parallel lm_head. Its logits must match the
trainer's HF model (float32; the TP forward adds partial sums in another order, hence a tolerance).
This runs after a training step, twice, reusing the same destination buffers.

Run: ``python examples/llama_refit.py`` (CPU, seconds). ``--plan-7b`` also times planning a
7B-shaped Llama (32 layers) for TP=8.
"""
import argparse
import time

import torch
import torch.nn.functional as F
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

import tritonreshard as trs
from tritonreshard.apps.kit import tiny_model

TRAINERS = [0, 1]          # FSDP: each holds Shard(0) rows of every HF parameter
INFERENCE = [2, 3, 4, 5]   # TP ranks 0..3 of one vLLM engine
TP = len(INFERENCE)


def tp_forward(config, shards, cos, sin, ids):
    """Logits of ``ids`` [B, T] computed from the TP shards ``shards[tp_rank][vLLM name]`` only.

    Per-rank matmuls on local shards; an all-reduce is a sum over ranks; the vocab-parallel lm_head's
    outputs are concatenated (and the padding columns dropped)."""
    nq, nkv = config.num_attention_heads, config.num_key_value_heads
    hd, eps, V = config.head_dim, config.rms_norm_eps, config.vocab_size
    q_loc, kv_loc = nq // TP, max(1, nkv // TP)

    def rms(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w

    emb = [s["model.embed_tokens.weight"] for s in shards]
    rows = emb[0].shape[0]
    x = sum(F.embedding((ids - r * rows).clamp(0, rows - 1), e)
            * ((ids >= r * rows) & (ids < (r + 1) * rows))[..., None]
            for r, e in enumerate(emb))
    B, T, _ = x.shape
    mask = torch.full((T, T), float("-inf")).triu(1)
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        h = rms(x, shards[0][p + "input_layernorm.weight"])
        partial = []
        for s in shards:
            qkv = h @ s[p + "self_attn.qkv_proj.weight"].T
            q, k, v = qkv.split([q_loc * hd, kv_loc * hd, kv_loc * hd], dim=-1)
            q = q.view(B, T, q_loc, hd).transpose(1, 2)
            k = k.view(B, T, kv_loc, hd).transpose(1, 2)
            v = v.view(B, T, kv_loc, hd).transpose(1, 2)
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            k, v = (t.repeat_interleave(q_loc // kv_loc, dim=1) for t in (k, v))
            att = torch.softmax(q @ k.transpose(-1, -2) / hd ** 0.5 + mask, dim=-1) @ v
            partial.append(att.transpose(1, 2).reshape(B, T, q_loc * hd) @ s[p + "self_attn.o_proj.weight"].T)
        x = x + sum(partial)                      # all-reduce of the row-parallel o_proj
        h = rms(x, shards[0][p + "post_attention_layernorm.weight"])
        partial = []
        for s in shards:
            gate, up = (h @ s[p + "mlp.gate_up_proj.weight"].T).chunk(2, dim=-1)
            partial.append((F.silu(gate) * up) @ s[p + "mlp.down_proj.weight"].T)
        x = x + sum(partial)                      # all-reduce of the row-parallel down_proj
    x = rms(x, shards[0]["model.norm.weight"])
    return torch.cat([x @ s["lm_head.weight"].T for s in shards], dim=-1)[..., :V]


def plan_7b():
    config = LlamaConfig(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=32)
    t0 = time.perf_counter()
    spec = trs.recipes.hf_to_vllm(config, tp=8, trainer_ranks=list(range(8)), inference_ranks=list(range(8, 16)))
    plan = spec.plan()
    cold = time.perf_counter() - t0
    t0 = time.perf_counter()
    spec = trs.recipes.hf_to_vllm(config, tp=8, trainer_ranks=list(range(8)), inference_ranks=list(range(8, 16)))
    spec.plan()
    cached = time.perf_counter() - t0
    print(f"7B-shaped Llama, FSDP 8 -> TP 8: recipe + plan {cold * 1e3:.1f} ms cold, {cached * 1e3:.1f} ms cached; "
          f"{plan.summary()}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--plan-7b", action="store_true", help="also time planning a 7B-shaped Llama for TP=8")
    args = ap.parse_args()
    if args.plan_7b:
        plan_7b()

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=2, head_dim=8, tie_word_embeddings=False)
    model = tiny_model(config, seed=0)  # float32, random weights of seed 0, built locally
    spec = trs.recipes.hf_to_vllm(config, tp=TP, trainer_ranks=TRAINERS, inference_ranks=INFERENCE,
                                  dtype=torch.float32)
    plan = spec.plan()
    print(plan.table(max_ops=8))

    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    ids = torch.randint(0, config.vocab_size, (2, 12))
    out = {r: {n: torch.full(lay.local_shape(r), float("nan")) for n, lay in spec.dst.items()} for r in INFERENCE}
    for step in range(2):
        model.train()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        full = dict(model.named_parameters())
        # What each FSDP trainer holds after the step: its rows of every HF parameter.
        trainer_shards = {r: {n: lay.shard(full[n].detach(), r) for n, lay in spec.src.items()} for r in TRAINERS}
        t0 = time.perf_counter()
        trs.execute_local(plan, trainer_shards, out=out)
        ms = (time.perf_counter() - t0) * 1e3

        pad = spec.dst["lm_head.weight"]
        for r in INFERENCE:  # padding rows past the real vocab are zero on the last rank
            lo = INFERENCE.index(r) * pad.local_shape(r)[0]
            tail = out[r]["lm_head.weight"][max(0, config.vocab_size - lo):]
            assert torch.equal(tail, torch.zeros_like(tail)), r
        model.eval()
        with torch.no_grad():
            want = model(input_ids=ids).logits
            pos = torch.arange(ids.shape[1])[None]
            cos, sin = model.model.rotary_emb(want, pos)
            got = tp_forward(config, [out[r] for r in INFERENCE], cos, sin, ids)
        err = (got - want).abs().max().item()
        assert err < 1e-4, f"step {step}: TP forward differs from the trainer's model by {err}"
        print(f"step {step}: loss {loss.item():.4f}, refit {ms:.2f} ms, TP forward on ranks {INFERENCE} "
              f"matches the HF model (max |diff| {err:.2e})")


if __name__ == "__main__":
    main()
