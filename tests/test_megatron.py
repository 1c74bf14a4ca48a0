"""Megatron-Core -> vLLM: real megatron-core 0.19 ``GPTModel`` chunks, built on CPU over gloo, refitted
into vLLM's TP layouts bit for bit.

One spawn of 6 processes serves every case: ranks 0-3 are the Megatron world (TP x PP x DP x EP
re-initialised per case), ranks 4-5 a vLLM TP=2 inference group for the engine cases. Each trainer
fills its parameters with values keyed by what Megatron says they are (stage, TP / EP coordinates,
local name: replicas equal, shards distinct, dummy vocab rows junk) and reports its raw local
parameters, its coordinates and ``megatron_tensors``. The parent then

* rebuilds the full Hugging Face tensors from the raw shards with its own conversion (not the
  library's: qkv de-interleaved per query group, fc1 split into gate/up per TP rank, experts by
  global id) and checks them against a real transformers model's parameter names and shapes;
* refits the Megatron shards with ``megatron_to_vllm`` + ``execute_local`` into vLLM TP 1, 2 and 4 and
  compares, bit for bit, with ``hf_to_vllm`` + ``execute_local`` from those HF tensors;
* for the engine cases, compares what the inference ranks pulled (two versions) with the same.
"""
from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import torch
from _mp import free_port, run_ranks

import tritonreshard as trs
from tritonreshard.recipes import Megatron, megatron_vocab_size

pytest.importorskip("megatron.core")
transformers = pytest.importorskip("transformers")

MEG_WORLD = 4
INF = [4, 5]
V = 300  # pads to 384 (Megatron tp 1), 512 (tp 2), 320 (vLLM)


def _hf_config(kind):
    common = dict(vocab_size=V, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  intermediate_size=96, num_hidden_layers=4, max_position_embeddings=64)
    if kind == "llama":
        return transformers.LlamaConfig(**common, tie_word_embeddings=False)
    if kind == "qwen2":
        return transformers.Qwen2Config(**{k: v for k, v in common.items() if k != "head_dim"},
                                        tie_word_embeddings=True)
    if kind == "qwen3":
        return transformers.Qwen3Config(**common, tie_word_embeddings=False)
    if kind in ("qwen3_moe", "qwen3_moe_mixed"):
        return transformers.Qwen3MoeConfig(**dict(common, num_hidden_layers=2), num_experts=4, num_experts_per_tok=2,
                                           moe_intermediate_size=32, norm_topk_prob=True, tie_word_embeddings=False,
                                           mlp_only_layers=[1] if kind == "qwen3_moe_mixed" else [])
    raise AssertionError(kind)


# (name, HF family, Megatron settings, refit through the engine too)
CASES = [
    ("llama-tp2-pp2", "llama", Megatron(tp=2, pp=2), False),
    ("llama-pp2-vpp2-dp2", "llama", Megatron(tp=1, pp=2, vpp=2), True),   # interleaved virtual stages
    ("qwen2-tied-tp2-pp2", "qwen2", Megatron(tp=2, pp=2), True),
    ("qwen2-tied-tp1-dp4", "qwen2", Megatron(tp=1, pp=1, vocab_divisible_by=64), False),
    ("qwen3-tp2-pp2", "qwen3", Megatron(tp=2, pp=2), False),
    ("qwen3-tp2-dp2", "qwen3", Megatron(tp=2, pp=1), False),
    ("moe-tp2-ep2-etp1", "qwen3_moe", Megatron(tp=2, pp=1, ep=2, etp=1), True),   # expert-DP 2
    ("moe-tp2-ep2-etp2", "qwen3_moe", Megatron(tp=2, pp=1, ep=2), False),         # expert-TP 2
    ("moe-tp1-pp2-ep2", "qwen3_moe", Megatron(tp=1, pp=2, ep=2, etp=1), False),
    ("moe-mixed-tp2-ep2", "qwen3_moe_mixed", Megatron(tp=2, pp=1, ep=2, etp=1), False),  # layer 1 dense
]


# ------------------------------------------------------------------------------------- workers
def _gen(*key) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def _build(cfg, meg: Megatron) -> list:
    """This rank's real GPTModel chunks for ``cfg`` under ``meg`` (local layer spec, CPU init): one,
    or ``meg.vpp`` virtual pipeline chunks."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    ps.destroy_model_parallel()
    vpp = meg.vpp if meg.vpp > 1 else None
    ps.initialize_model_parallel(meg.tp, meg.pp, expert_model_parallel_size=meg.ep,
                                 expert_tensor_parallel_size=meg.etp, virtual_pipeline_model_parallel_size=vpp)
    moe = cfg.model_type == "qwen3_moe"
    tc = TransformerConfig(
        num_layers=cfg.num_hidden_layers, hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads,
        num_query_groups=cfg.num_key_value_heads, kv_channels=cfg.hidden_size // cfg.num_attention_heads,
        ffn_hidden_size=cfg.intermediate_size, gated_linear_unit=True, activation_func=torch.nn.functional.silu,
        normalization="RMSNorm", add_bias_linear=False, add_qkv_bias=cfg.model_type == "qwen2",
        qk_layernorm=cfg.model_type in ("qwen3", "qwen3_moe"), use_cpu_initialization=True,
        tensor_model_parallel_size=meg.tp, pipeline_model_parallel_size=meg.pp, pipeline_dtype=torch.float32,
        expert_model_parallel_size=meg.ep, expert_tensor_parallel_size=meg.etp,
        virtual_pipeline_model_parallel_size=vpp,
        **(dict(num_moe_experts=cfg.num_experts, moe_ffn_hidden_size=cfg.moe_intermediate_size,
                moe_router_topk=cfg.num_experts_per_tok, moe_token_dispatcher_type="allgather",
                moe_grouped_gemm=False) if moe else {}))
    if moe and cfg.mlp_only_layers:  # dense and MoE layers mixed: Megatron's per-layer pattern
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

        tc.moe_layer_freq = [int(i not in cfg.mlp_only_layers) for i in range(cfg.num_hidden_layers)]
        spec = get_gpt_decoder_block_spec(tc, use_transformer_engine=False, normalization="RMSNorm")
    else:
        spec = get_gpt_layer_local_spec(num_experts=cfg.num_experts if moe else None, moe_grouped_gemm=False,
                                        qk_layernorm=tc.qk_layernorm, normalization="RMSNorm")
    return [GPTModel(tc, spec, vocab_size=megatron_vocab_size(cfg.vocab_size, meg), max_sequence_length=64,
                     pre_process=ps.is_pipeline_first_stage(ignore_virtual=vpp is None, vp_stage=v),
                     post_process=ps.is_pipeline_last_stage(ignore_virtual=vpp is None, vp_stage=v),
                     share_embeddings_and_output_weights=cfg.tie_word_embeddings, position_embedding_type="rope",
                     vp_stage=v if vpp else None)
            for v in range(meg.vpp)]


def _coords() -> dict:
    from megatron.core import parallel_state as ps

    return dict(tp=ps.get_tensor_model_parallel_rank(), pp=ps.get_pipeline_model_parallel_rank(),
                dp=ps.get_data_parallel_rank(), ep=ps.get_expert_model_parallel_rank(),
                etp=ps.get_expert_tensor_parallel_rank(), edp=ps.get_expert_data_parallel_rank())


@torch.no_grad()
def _fill(model, c: dict, case: str, chunk: int) -> None:
    """Values keyed by what a parameter is: replicas (DP, expert-DP, the tied copy) equal, shards
    distinct, every element random (Megatron's dummy vocab rows too)."""
    for name, p in model.named_parameters():
        if ".local_experts." in name:
            key = (case, name, c["pp"], chunk, c["ep"], c["etp"])
        elif name == "output_layer.weight" and model.share_embeddings_and_output_weights:
            key = (case, "embedding.word_embeddings.weight", 0, 0, c["tp"])   # Megatron keeps the copies equal
        else:
            key = (case, name, c["pp"], chunk, c["tp"] if getattr(p, "tensor_model_parallel", False) else -1)
        p.copy_(torch.randn(p.shape, generator=_gen(*key)))


def _chunk_prefix(meg: Megatron, v: int) -> str:
    """How the test keys a virtual chunk's raw parameters (Megatron names layers per chunk from 0)."""
    return f"chunk{v}." if meg.vpp > 1 else ""


PROMPT = [[3, 17, 250, 299, 0, 42, 7, 128, 64, 5]]


@torch.no_grad()
def _forward(model) -> torch.Tensor:
    """Megatron's own forward on CPU (pp = 1): this rank's vocab-parallel logits [1, s, V_m / tp].
    CPU patches, here only: the rotary cache moves to ``torch.cuda.current_device()``, dropout forks
    the CUDA RNG tracker, and the causal mask is given explicitly."""
    import contextlib

    from megatron.core.tensor_parallel import random as mrandom

    torch.cuda.current_device = lambda: "cpu"
    mrandom.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    ids = torch.tensor(PROMPT)
    s = ids.shape[1]
    model.eval()
    return model(ids, torch.arange(s)[None], torch.ones(1, 1, s, s, dtype=torch.bool).triu(1)).clone()


def _spec(kind, meg, tp, **kw):
    return trs.recipes.megatron_to_vllm(_hf_config(kind), megatron=meg, tp=tp, trainer_ranks=MEG_WORLD,
                                        inference_ranks=INF if tp == 2 else list(range(100, 100 + tp)),
                                        dtype=torch.float32, src_dtype=torch.float32, **kw)


def _negated(tensors):
    return {n: -t for n, t in tensors.items()}


def _worker(rank, ports):
    torch.set_num_threads(1)
    out = {}
    if rank >= MEG_WORLD:  # a vLLM TP rank of the engine cases: pull two versions
        for (case, kind, meg, engine), port in zip(CASES, ports[:-1], strict=True):  # ports[-1]: the gloo group
            if not engine:
                continue
            spec = _spec(kind, meg, 2)
            poison = {n: torch.full(lay.local_shape(rank), float("nan")) for n, lay in spec.dst.items()}
            meeting = trs.Meeting(rank=rank, world_size=MEG_WORLD + 2, store=f"127.0.0.1:{port}", group=case)
            with trs.RefitInference.from_recipe(spec, meeting=meeting, timeouts=trs.Timeouts(wait=60),
                                                pull=trs.PullOptions(mode="inplace"), tensors=poison) as inf:
                pulled = []
                for v in (1, 2):
                    assert inf.pull() == v
                    pulled.append({n: t.clone() for n, t in inf.tensors.items()})
            out[case] = pulled
        return _serialized(out)

    import warnings

    warnings.filterwarnings("ignore")
    import torch.distributed as dist

    # CPU patch (tests only): with tied embeddings and pp > 1 Megatron moves the weight to CUDA for
    # the first/last-stage all-reduce that makes the copies equal; gloo reduces CPU tensors as well.
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{ports[-1]}", rank=rank, world_size=MEG_WORLD)
    try:
        for (case, kind, meg, engine), port in zip(CASES, ports[:-1], strict=True):
            cfg = _hf_config(kind)
            chunks = _build(cfg, meg)
            c = _coords()
            for v, chunk in enumerate(chunks):
                _fill(chunk, c, case, v)
            model = chunks[0] if meg.vpp == 1 else torch.nn.ModuleList(chunks)
            mt = trs.recipes.megatron_tensors(chunks if meg.vpp > 1 else model, megatron=meg, rank=rank)
            # Without copying: every entry is a view of a parameter's own memory.
            storages = {p.data_ptr() for p in model.parameters()}
            assert all(t.data_ptr() in storages and not t.requires_grad for t in mt.values())
            assert len({t.data_ptr() for t in mt.values()}) == len(mt)
            report = {"logits": _forward(model) if meg.pp == 1 else None, "coords": c,
                      "raw": {_chunk_prefix(meg, v) + n: p.detach().clone() for v, chunk in enumerate(chunks)
                              for n, p in chunk.named_parameters()},
                      "mt": {n: t.detach().clone() for n, t in mt.items()},
                      "layer_numbers": [[layer.layer_number for layer in chunk.decoder.layers] for chunk in chunks]}
            if engine:
                spec = _spec(kind, meg, 2)
                meeting = trs.Meeting(rank=rank, world_size=MEG_WORLD + 2, store=f"127.0.0.1:{port}", group=case)
                with trs.RefitTrainer.from_recipe(spec, mt, meeting=meeting, timeouts=trs.Timeouts(wait=60)) as tr:
                    # Megatron trains on the arena from now on: no copy per step.
                    trs.recipes.megatron_bind(chunks, tr.source_tensors, megatron=meg, rank=rank)
                    for v in (1, 2):
                        tr.fence()  # every rank, also one nobody reads, keeps the versions in step
                        if v == 2:  # the "optimizer step", on Megatron's own parameters
                            with torch.no_grad():
                                for p in model.parameters():
                                    p.neg_()
                        assert tr.publish() == v
                    tr.fence()
            out[case] = report
    finally:
        dist.destroy_process_group()
    return _serialized(out)


def _serialized(out) -> bytes:
    """Bytes, not tensors: a queue passes tensors as shared-memory handles that die with this process."""
    buf = io.BytesIO()
    torch.save(out, buf)
    return buf.getvalue()


@pytest.fixture(scope="module")
def megatron_runs():
    ports = [free_port() for _ in range(len(CASES) + 1)]
    out = run_ranks(_worker, MEG_WORLD + len(INF), args=(ports,), timeout=420)
    return {r: torch.load(io.BytesIO(b)) for r, b in out.items()}


# ------------------------------------------------------------------- the test's own conversion
def _to_hf(cfg, meg: Megatron, reports: dict) -> dict[str, torch.Tensor]:
    """Full HF tensors from every rank's raw local Megatron parameters (independent of the library)."""
    L, H, nq, nkv = cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads
    hd, qpg = H // nq, nq // nkv
    per = L // (meg.pp * meg.vpp)
    pf_first, pf_last = _chunk_prefix(meg, 0), _chunk_prefix(meg, meg.vpp - 1)

    def dense(pp):  # ranks of stage pp with DP rank 0, by TP rank
        rs = {r["coords"]["tp"]: r for r in reports.values() if r["coords"]["pp"] == pp and r["coords"]["dp"] == 0}
        return [rs[t]["raw"] for t in range(meg.tp)]

    hf = {}
    first, last = dense(0), dense(meg.pp - 1)
    hf["model.embed_tokens.weight"] = torch.cat([s[pf_first + "embedding.word_embeddings.weight"] for s in first])[:V]
    if not cfg.tie_word_embeddings:
        hf["lm_head.weight"] = torch.cat([s[pf_last + "output_layer.weight"] for s in last])[:V]
    hf["model.norm.weight"] = last[0][pf_last + "decoder.final_layernorm.weight"]
    for i in range(L):
        k, j = divmod(i, per)   # virtual chunk k of L / (pp * vpp) layers: stage k % pp, its chunk k // pp
        stage = k % meg.pp
        sh, pre, m = dense(stage), f"model.layers.{i}", f"{_chunk_prefix(meg, k // meg.pp)}decoder.layers.{j}"
        for suffix in ("weight", "bias"):
            key = f"{m}.self_attention.linear_qkv.{suffix}"
            if key not in sh[0]:
                continue
            qkv = torch.cat([s[key] for s in sh]).reshape(nkv, qpg + 2, hd, *sh[0][key].shape[1:])
            hf[f"{pre}.self_attn.q_proj.{suffix}"] = qkv[:, :qpg].reshape(nq * hd, *qkv.shape[3:])
            hf[f"{pre}.self_attn.k_proj.{suffix}"] = qkv[:, qpg].reshape(nkv * hd, *qkv.shape[3:])
            hf[f"{pre}.self_attn.v_proj.{suffix}"] = qkv[:, qpg + 1].reshape(nkv * hd, *qkv.shape[3:])
        hf[f"{pre}.self_attn.o_proj.weight"] = torch.cat([s[f"{m}.self_attention.linear_proj.weight"] for s in sh], 1)
        if f"{m}.self_attention.q_layernorm.weight" in sh[0]:
            hf[f"{pre}.self_attn.q_norm.weight"] = sh[0][f"{m}.self_attention.q_layernorm.weight"]
            hf[f"{pre}.self_attn.k_norm.weight"] = sh[0][f"{m}.self_attention.k_layernorm.weight"]
        hf[f"{pre}.input_layernorm.weight"] = sh[0][f"{m}.input_layernorm.weight"]
        hf[f"{pre}.post_attention_layernorm.weight"] = sh[0][f"{m}.pre_mlp_layernorm.weight"]
        if f"{m}.mlp.router.weight" in sh[0]:
            hf[f"{pre}.mlp.gate.weight"] = sh[0][f"{m}.mlp.router.weight"]
            E, etp, ep = cfg.num_experts, meg.expert_tp, meg.ep
            gu, dn = [], []
            for e in range(E):
                owner, local = divmod(e, E // ep)
                rs = {r["coords"]["etp"]: r["raw"] for r in reports.values() if r["coords"]["pp"] == stage
                      and r["coords"]["ep"] == owner and r["coords"]["edp"] == 0}
                fc1 = [rs[t][f"{m}.mlp.experts.local_experts.{local}.linear_fc1.weight"] for t in range(etp)]
                half = fc1[0].shape[0] // 2
                gu.append(torch.cat([f[:half] for f in fc1] + [f[half:] for f in fc1]))
                dn.append(torch.cat([rs[t][f"{m}.mlp.experts.local_experts.{local}.linear_fc2.weight"]
                                     for t in range(etp)], 1))
            hf[f"{pre}.mlp.experts.gate_up_proj"] = torch.stack(gu)
            hf[f"{pre}.mlp.experts.down_proj"] = torch.stack(dn)
        else:
            fc1 = [s[f"{m}.mlp.linear_fc1.weight"] for s in sh]
            half = fc1[0].shape[0] // 2
            hf[f"{pre}.mlp.gate_proj.weight"] = torch.cat([f[:half] for f in fc1])
            hf[f"{pre}.mlp.up_proj.weight"] = torch.cat([f[half:] for f in fc1])
            hf[f"{pre}.mlp.down_proj.weight"] = torch.cat([s[f"{m}.mlp.linear_fc2.weight"] for s in sh], 1)
    return hf


def _bits(t):
    return t.contiguous().view(torch.int32)


def _vllm_from_hf(cfg, hf, tp, expert_parallel=False):
    spec = trs.recipes.hf_to_vllm(cfg, tp=tp, trainer_ranks=[0], inference_ranks=INF if tp == 2 else
                                  list(range(100, 100 + tp)), dtype=torch.float32, src_dtype=torch.float32,
                                  expert_parallel=expert_parallel)
    return trs.execute_local(spec.plan(), {0: hf}, backend="torch")


def _poisoned(spec):
    return {r: {n: torch.full(lay.local_shape(r), float("nan")) for n, lay in spec.dst.items()}
            for r in next(iter(spec.dst.values())).ranks}


# ------------------------------------------------------------------------------------- tests
@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("case,kind,meg,engine", CASES, ids=[c[0] for c in CASES])
def test_megatron_shards_refit_into_vllm_bit_for_bit(megatron_runs, case, kind, meg, engine):
    cfg = _hf_config(kind)
    reports = {r: out[case] for r, out in megatron_runs.items() if r < MEG_WORLD}
    per = cfg.num_hidden_layers // (meg.pp * meg.vpp)
    for rep in reports.values():  # Megatron numbers layers globally, 1-based (interleaved with vpp)
        assert rep["layer_numbers"] == [[(v * meg.pp + rep["coords"]["pp"]) * per + j + 1 for j in range(per)]
                                        for v in range(meg.vpp)]
    hf = _to_hf(cfg, meg, reports)
    # The conversion yields exactly a real transformers model's parameters ...
    model = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    assert {n: tuple(p.shape) for n, p in model.named_parameters()} == {n: tuple(t.shape) for n, t in hf.items()}
    if meg.pp == 1:  # ... and the same function: Megatron's own forward equals transformers' on them
        missing, unexpected = model.load_state_dict(hf, strict=False)
        assert not unexpected and set(missing) <= {"lm_head.weight"} and (not missing or cfg.tie_word_embeddings)
        with torch.no_grad():
            want = model(torch.tensor(PROMPT)).logits
        tps = sorted((rep["coords"]["tp"], rep["logits"]) for rep in reports.values() if rep["coords"]["dp"] == 0)
        got = torch.cat([lg for _, lg in tps], -1)[..., :V]
        torch.testing.assert_close(got, want, atol=2e-3, rtol=1e-4)
    shards = {r: rep["mt"] for r, rep in reports.items()}
    for tp in (1, 2, 4):
        for ep in ((False, True) if kind.startswith("qwen3_moe") and tp > 1 else (False,)):
            spec = _spec(kind, meg, tp, expert_parallel=ep)
            # megatron_tensors gives every rank exactly its sources, of the layouts' local shapes.
            for r, mt in shards.items():
                mine = {n: lay.local_shape(r) for n, lay in spec.src.items() if r in lay.ranks}
                assert {n: tuple(t.shape) for n, t in mt.items()} == mine, (case, r)
            plan = spec.plan()
            got = trs.execute_local(plan, shards, out=_poisoned(spec), backend="torch")
            want = _vllm_from_hf(cfg, hf, tp, ep)
            assert sorted(got) == sorted(want)
            for r in want:
                assert sorted(got[r]) == sorted(want[r])
                for n, w in want[r].items():
                    assert torch.equal(_bits(got[r][n]), _bits(w)), (case, tp, ep, r, n)
            if cfg.tie_word_embeddings and meg.pp > 1:  # the last stage's copy, by its own name, serves reads too
                stage = {p: {r for r, rep in reports.items() if rep["coords"]["pp"] == p} for p in (0, meg.pp - 1)}
                readers = {n: {op.src_rank for op in plan.ops if op.src_name == n}
                           for n in ("embedding.word_embeddings.weight", "output_layer.weight")}
                assert readers == {"embedding.word_embeddings.weight": stage[0],
                                   "output_layer.weight": stage[meg.pp - 1]}, readers
                emb = [op for op in plan.ops if op.name == "model.embed_tokens.weight"]
                half = sum(op.numel for op in emb if op.src_name == "output_layer.weight")
                total = sum(op.numel for op in emb)
                assert 0.4 * total <= half <= 0.6 * total, (half, total)  # aliases: the reads spread over both
            dp = MEG_WORLD // (meg.tp * meg.pp)
            if dp > 1:  # DP replicas share the reads
                assert len({op.src_rank for op in plan.ops}) == MEG_WORLD


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_engine_agrees_with_execute_local(megatron_runs):
    for case, kind, meg, engine in CASES:
        if not engine:
            continue
        spec = _spec(kind, meg, 2)
        shards = {r: out[case]["mt"] for r, out in megatron_runs.items() if r < MEG_WORLD}
        for v, src in ((1, shards), (2, {r: _negated(t) for r, t in shards.items()})):
            want = trs.execute_local(spec.plan(), src, out=_poisoned(spec), backend="torch")
            for r in INF:
                pulled = megatron_runs[r][case][v - 1]
                assert sorted(pulled) == sorted(want[r])
                for n, w in want[r].items():
                    assert torch.equal(_bits(pulled[n]), _bits(w)), (case, v, r, n)


def test_bad_megatron_settings_name_every_problem():
    with pytest.raises(ValueError) as err:
        Megatron(tp=0, pp=1.5, etp=-1)
    assert all(s in str(err.value) for s in ("tp=0", "pp=1.5", "etp=-1"))
    with pytest.raises(ValueError) as err:
        trs.recipes.megatron_to_vllm(_hf_config("qwen3_moe"), megatron=Megatron(tp=4, pp=3, ep=3, etp=2), tp=2,
                                     trainer_ranks=list(range(12)), inference_ranks=[12, 13])
    msg = str(err.value)
    for s in ("num_hidden_layers=2 is not divisible by pp=3", "num_key_value_heads=2 (query groups) is not divisible",
              "num_experts=4 is not divisible by ep=3", "etp*ep=2*3 does not divide tp*dp=4*1"):
        assert s in msg, msg
    with pytest.raises(ValueError) as err:
        trs.recipes.megatron_to_vllm(_hf_config("llama"), megatron=Megatron(tp=7, pp=2), tp=2,
                                     trainer_ranks=list(range(12)), inference_ranks=[12, 13])
    msg = str(err.value)
    for s in ("world 12 (len(trainer_ranks)) is not divisible by tp*pp=7*2", "num_attention_heads=4 is not divisible",
              "intermediate_size=96 is not divisible by Megatron tp=7"):
        assert s in msg, msg


def test_megatron_vocab_padding_depends_on_tp():
    assert megatron_vocab_size(300, Megatron(tp=1)) == 384
    assert megatron_vocab_size(300, Megatron(tp=2)) == 512
    cfg = _hf_config("llama")
    cfg.vocab_size = 100  # 256 rows over Megatron tp 2: TP rank 1 holds only dummy rows
    spec = trs.recipes.megatron_to_vllm(cfg, megatron=Megatron(tp=2), tp=2, trainer_ranks=2, inference_ranks=[2, 3])
    emb = spec.src["embedding.word_embeddings.weight"]
    assert emb.shape == (256, 64) and emb.local_shape(1) == (128, 64)
    readers = {op.src_rank for op in spec.plan().ops if op.src_name == "embedding.word_embeddings.weight"}
    assert readers == {0}


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_vllm_engine_refit_from_megatron_moe_ranks():
    """examples/megatron_refit.py --model tiny-qwen3-moe: real Megatron-Core TP 2 x PP 2 x EP 2 ranks
    (expert TP 1; q/k norms; layer 1 a dense MLP, the other three MoE layers of 8 experts) refit a
    live vLLM TP=2 engine through the backend (``Trainer(megatron=...)``, ``init_info(megatron=...)``):
    after each of 2 refits vLLM's greedy tokens equal transformers' on the trainers' weights
    (converted back from Megatron's shards by the example, not by the recipe), and each refit
    changed them. One engine covers the dense path too (attention, the dense layer, embeddings)."""
    pytest.importorskip("vllm")
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND="0|1")
    proc = subprocess.run([sys.executable, str(root / "examples" / "megatron_refit.py"), "--model", "tiny-qwen3-moe",
                           "--megatron-tp", "2", "--megatron-pp", "2", "--megatron-ep", "2", "--megatron-etp", "1",
                           "--refits", "2", "--json"], capture_output=True, text=True, timeout=540, env=env, cwd=root)
    lines = proc.stdout.strip().splitlines()
    assert lines and lines[-1].startswith("{"), (proc.returncode, proc.stdout[-3000:], proc.stderr[-4000:])
    summary = json.loads(lines[-1])
    assert proc.returncode == 0 and summary["ok"], (summary, proc.stderr[-4000:])
    assert summary["refits"] == 2 and summary["tokens_compared"] == 3 * 3 * 8 and summary["mismatches"] == 0
    g = summary["greedy"]
    assert g[0] != g[1] and g[1] != g[2]
    # vLLM's own experts step ran for each of the 3 MoE layers on every refit (see docs/vllm.md).
    assert [w["experts_processed"] for w in summary["worker"]] == [3, 3]
    # Each vLLM TP rank pulls exactly its shards: Megatron's 24 dummy vocab rows never move, and vLLM's
    # 24 padding rows of embed_tokens and lm_head (on TP rank 1) are zero-filled there, not pulled.
    spec = _tiny_moe_spec()
    full = [sum(torch.Size(lay.local_shape(r)).numel() for lay in spec.dst.values()) * 4 for r in (4, 5)]
    assert summary["worker_bytes"] == [full[0], full[1] - 2 * 24 * 128 * 4], summary["worker_bytes"]
    left = [f for f in os.listdir("/dev/shm") if f.startswith("trs-")]
    assert left == [], left


def _tiny_moe_spec():
    cfg = transformers.Qwen3MoeConfig(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                      vocab_size=1000, num_hidden_layers=4, intermediate_size=256, num_experts=8,
                                      num_experts_per_tok=2, moe_intermediate_size=48, decoder_sparse_step=1,
                                      mlp_only_layers=[1], tie_word_embeddings=False)
    return trs.recipes.megatron_to_vllm(cfg, megatron=Megatron(tp=2, pp=2, ep=2, etp=1), tp=2, trainer_ranks=4,
                                        inference_ranks=[4, 5], dtype=torch.float32, src_dtype=torch.float32)


def test_init_info_carries_megatron_as_a_plain_dict():
    import tritonreshard.vllm as trs_vllm

    meg = Megatron(tp=2, pp=2, ep=2, etp=1, vocab_divisible_by=64)
    info = trs_vllm.init_info(store="127.0.0.1:1", trainer_ranks=range(8), inference_ranks=[8, 9], megatron=meg)
    assert info["megatron"] == dict(tp=2, pp=2, ep=2, etp=1, vocab_divisible_by=64, vpp=1)  # what crosses vLLM's RPC
    assert Megatron(**info["megatron"]) == meg
    assert trs_vllm.init_info(store="127.0.0.1:1", trainer_ranks=[0], inference_ranks=[1])["megatron"] is None
    with pytest.raises(ValueError, match="megatron must be a trs.recipes.Megatron"):
        trs_vllm.init_info(store="127.0.0.1:1", trainer_ranks=[0], inference_ranks=[1], megatron={"tp": 2})


def _module(**params_and_children):
    m = torch.nn.Module()
    for k, v in params_and_children.items():
        if isinstance(v, torch.nn.Module):
            m.add_module(k, v)
        elif k == "layer_number":
            m.layer_number = v
        else:
            m.register_parameter(k, torch.nn.Parameter(torch.zeros(v)))
    return m


def test_megatron_tensors_refuses_what_it_cannot_map_by_name():
    # The names Megatron gives learned position embeddings and grouped-GEMM experts (TEGroupedMLP's
    # linear_fc1.weight{e}, the legacy GroupedMLP's weight1), in a plain module tree.
    layer = _module(layer_number=1, mlp=_module(experts=_module(linear_fc1=_module(weight0=2), weight1=2)))
    model = _module(embedding=_module(word_embeddings=_module(weight=2), position_embeddings=_module(weight=2)),
                    decoder=_module(layers=torch.nn.ModuleList([layer])))
    with pytest.raises(ValueError) as err:
        trs.recipes.megatron_tensors(model, megatron=Megatron(), rank=0)
    msg = str(err.value)
    assert "embedding.position_embeddings.weight: no vLLM destination" in msg
    assert "decoder.layers.0.mlp.experts.linear_fc1.weight0: grouped-GEMM experts are not supported" in msg
    assert "decoder.layers.0.mlp.experts.weight1: grouped-GEMM experts are not supported" in msg
    with pytest.raises(ValueError, match="megatron_bind .*tensors has no 'embedding.word_embeddings.weight'"):
        trs.recipes.megatron_bind(_module(embedding=_module(word_embeddings=_module(weight=2))), {},
                                  megatron=Megatron(), rank=0)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_megatron_into_replicas_holds_what_one_tp_group_holds(megatron_runs):
    """Issue 19's replicas compose with Megatron sources: 2 replicas of vLLM TP-2 (4 ranks) get, bit
    for bit, what the single TP-2 group's rank of the same TP index gets, from real Megatron shards
    (TP2 x PP2 with tied embeddings, and MoE with expert-DP)."""
    for case, kind, meg in (("qwen2-tied-tp2-pp2", "qwen2", Megatron(tp=2, pp=2)),
                            ("moe-tp2-ep2-etp1", "qwen3_moe", Megatron(tp=2, pp=1, ep=2, etp=1))):
        shards = {r: out[case]["mt"] for r, out in megatron_runs.items() if r < MEG_WORLD}
        one = _spec(kind, meg, 2)
        many = trs.recipes.megatron_to_vllm(_hf_config(kind), megatron=meg, tp=2, trainer_ranks=MEG_WORLD,
                                            inference_ranks=[*INF, 6, 7], dtype=torch.float32,
                                            src_dtype=torch.float32)
        want = trs.execute_local(one.plan(), shards, out=_poisoned(one), backend="torch")
        got = trs.execute_local(many.plan(), shards, out=_poisoned(many), backend="torch")
        for r, like in ((4, 4), (5, 5), (6, 4), (7, 5)):
            assert sorted(got[r]) == sorted(want[like])
            for n, w in want[like].items():
                assert torch.equal(_bits(got[r][n]), _bits(w)), (case, r, n)


def test_megatron_recipe_passes_fp8_quantization_through():
    """``quantization=`` gives the Megatron recipe exactly hf_to_vllm's block-FP8 destinations (the
    quantizer reads Megatron's rows where hf_to_vllm would read HF rows), and its refusals."""
    cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                                   head_dim=128, intermediate_size=256, num_hidden_layers=2)
    meg = Megatron(tp=2, pp=2)
    kw = dict(tp=2, trainer_ranks=MEG_WORLD, inference_ranks=INF, dtype=torch.bfloat16, src_dtype=torch.bfloat16,
              quantization="fp8-block")
    spec = trs.recipes.megatron_to_vllm(cfg, megatron=meg, **kw)
    hf = trs.recipes.hf_to_vllm(cfg, **kw)
    assert spec.quant and spec.quant == hf.quant and spec.dst == hf.dst
    plan = spec.plan()
    assert {op.src_name for op in plan.ops if op.name == "model.layers.0.self_attn.qkv_proj.weight"} == \
        {"decoder.layers.0.self_attention.linear_qkv.weight"}
    with pytest.raises(ValueError, match="validate_fp8_block_shape"):
        trs.recipes.megatron_to_vllm(_hf_config("llama"), megatron=meg, **kw)


def test_tied_copy_on_the_last_stage_keeps_megatron_name():
    """Tied embeddings, pp > 1: the last stage's ``output_layer.weight`` is a source by Megatron's own
    name (``megatron_tensors`` renames nothing), on the last stage's ranks, and an alias of the first
    stage's embedding: one part names both, and the planner spreads the reads over the two copies."""
    meg = Megatron(tp=2, pp=2)
    spec = _spec("qwen2", meg, 2)
    emb, out = spec.src["embedding.word_embeddings.weight"], spec.src["output_layer.weight"]
    assert emb.shape == out.shape == (512, 64) and set(emb.ranks) == {0, 1} and set(out.ranks) == {2, 3}
    first, last = "embedding.word_embeddings.weight", "output_layer.weight"
    reads = [p for p in spec.parts["model.embed_tokens.weight"] if p.src is not None]
    assert [(p.src, p.dst, p.src_start) for p in reads] == [((first, last), ((0, 300), (0, 64)), (0, 0))]
    # Megatron TP shards of 256 rows (real rows [0, 256) and [256, 300)): every piece a vLLM rank reads
    # (fp32: each at least two 4 KiB parts) is cut in half between the two copies.
    ops = [op for op in spec.plan().ops if op.name == "model.embed_tokens.weight"]
    assert {(op.src_name, op.src_rank) for op in ops} == {(first, 0), (first, 1), (last, 2), (last, 3)}
    assert sum(op.numel for op in ops if op.src_name == first) == sum(op.numel for op in ops) // 2
    # A last stage's model (no pre_process) lists output_layer.weight: it keeps that name.
    model = _module(output_layer=_module(weight=(512, 64)), decoder=_module(final_layernorm=_module(weight=64)))
    model.share_embeddings_and_output_weights, model.pre_process = True, False
    names = trs.recipes.megatron_tensors(model, megatron=meg, rank=2)
    assert sorted(names) == ["decoder.final_layernorm.weight", "output_layer.weight"]
