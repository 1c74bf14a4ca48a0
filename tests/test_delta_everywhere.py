"""Cross-host delta refits with everything that exists: FP8-block destinations, inference replicas,
Megatron sources and recipes (issue 29, item 5).

One spawn of 10 processes on four hosts of the host harness (tritonreshard.apps.hosts: a network,
/dev/shm and hostname each; processes 0-1 on host0, 2-3 on host1, 4-7 on host2, 8-9 on host3) runs
three refit groups, one after the other, each with its own ranks (``CASES``: which process is which
rank of the group, so that each group's ranks sit on the hosts it needs):

* ``fp8``: ``hf_to_vllm`` (Llama) with ``quantization="fp8-block"``, 3 FSDP trainers on host0 and
  host1 (k/v's 128 rows split 43/43/42: blocks read from several trainers) to 2 replicas of vLLM
  TP 2 on host2 (one shadow, one in place). The receiving relays hold bf16, the deltas apply to
  them, and each pull quantizes from there; the replicas share the host's relays: each byte crosses once.
* ``megatron``: ``megatron_to_vllm`` (Qwen2, tied embeddings: fused QKV with bias, fused gate-up,
  the last stage's copy of the embedding) from Megatron TP 2 x PP 2, each pipeline stage on a host
  of its own (host0, host1), to 2 replicas of vLLM TP 2 on two more hosts (host2, host3): each
  receiving host has its own base.
* ``moe``: ``megatron_to_vllm`` (Qwen3-MoE: layer 0 experts over EP 2, layer 1 dense) to vLLM TP 2
  with one replica's TP ranks on two hosts (host2, host3; the other replica on host2): host3, holding
  only TP rank 1, needs half of each row-parallel shard, boxes the trainers pack before sending.

The Megatron sources are built from full Megatron-format tensors with the recipe's own source
layouts (test_megatron checks those layouts against real Megatron-Core). Version 1 crosses whole;
every later version is an Adam-sized bf16 step (1e-6 per element, the sign random, as in
test_delta_refit: about 2% of the bf16 elements change) and must cross as deltas only (no dense
byte, at most 10% of the whole). Each version's figures are read from ``ep.stats`` only once the
relays already hold the next version: they must be the served version's refit, not the relay's
newest. The ranks send back the bits they pulled; the parent compares every destination, bit for
bit, with the recipe's plan executed from scratch on that version's tensors (``execute_local`` into poisoned outputs;
test_fp8 checks its FP8 weights and scales against the reference quantizer and vLLM's).
"""
from __future__ import annotations

import functools
import io
import zlib

import pytest
import torch
from _mp import free_port
from _waits import poll_until

import tritonreshard as trs
from tritonreshard.planning import plan_hosts
from tritonreshard.recipes import Megatron

pytestmark = pytest.mark.timeout(300)

VERSIONS = 4
FP8 = torch.float8_e4m3fn
PLACEMENT = [0, 0, 1, 1, 2, 2, 2, 2, 3, 3]   # process -> harness host (hostname host<i>)
V = 300     # the Megatron cases' vocab: Megatron pads it to 512 rows at tp 2


def _llama():
    transformers = pytest.importorskip("transformers")
    return transformers.LlamaConfig(vocab_size=100, hidden_size=256, intermediate_size=256, num_hidden_layers=1,
                                    num_attention_heads=2, num_key_value_heads=1, head_dim=128)


def _qwen2():
    transformers = pytest.importorskip("transformers")
    return transformers.Qwen2Config(vocab_size=V, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                    intermediate_size=96, num_hidden_layers=4, max_position_embeddings=64,
                                    tie_word_embeddings=True)


def _qwen3_moe():
    transformers = pytest.importorskip("transformers")
    return transformers.Qwen3MoeConfig(vocab_size=V, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                       head_dim=16, intermediate_size=96, num_hidden_layers=2,
                                       max_position_embeddings=64, num_experts=4, num_experts_per_tok=2,
                                       moe_intermediate_size=32, norm_topk_prob=True, tie_word_embeddings=False,
                                       mlp_only_layers=[1])


_BF16 = dict(dtype=torch.bfloat16, src_dtype=torch.bfloat16)

# name -> (the recipe, {rank of the group: process}, {inference rank: pull mode})
CASES = {
    "fp8": (lambda: trs.recipes.hf_to_vllm(_llama(), tp=2, trainer_ranks=[0, 1, 2], inference_ranks=[3, 4, 5, 6],
                                           quantization="fp8-block", **_BF16),
            {0: 0, 1: 1, 2: 2, 3: 4, 4: 5, 5: 6, 6: 7},          # trainers on host0-1, replicas on host2
            {3: "shadow", 4: "shadow", 5: "inplace", 6: "inplace"}),
    "megatron": (lambda: trs.recipes.megatron_to_vllm(_qwen2(), megatron=Megatron(tp=2, pp=2), tp=2, trainer_ranks=4,
                                                      inference_ranks=[4, 5, 6, 7], **_BF16),
                 {0: 0, 1: 1, 2: 2, 3: 3, 4: 4, 5: 5, 6: 8, 7: 9},   # stages on host0, host1; replicas host2, host3
                 {4: "shadow", 5: "shadow", 6: "inplace", 7: "inplace"}),
    "moe": (lambda: trs.recipes.megatron_to_vllm(_qwen3_moe(), megatron=Megatron(tp=2, pp=1, ep=2, etp=1), tp=2,
                                                 trainer_ranks=4, inference_ranks=[4, 5, 6, 7], **_BF16),
            {0: 0, 1: 1, 2: 2, 3: 3, 4: 4, 5: 8, 6: 5, 7: 6},      # replica 0: TP 0 on host2, TP 1 on host3
            {4: "shadow", 5: "inplace", 6: "inplace", 7: "shadow"}),
}


def hosts_of(case: str) -> dict[int, str]:
    """``{rank: hostname}`` of the case's group: the harness host of the rank's process."""
    return {r: f"host{PLACEMENT[p]}" for r, p in CASES[case][1].items()}
TIED = ("embedding.word_embeddings.weight", "output_layer.weight")


def _tied(spec) -> bool:
    """Megatron with tied embeddings and pp > 1: the last stage's copy is an alias of the embedding."""
    return any(p.src == TIED for p in spec.parts.get("model.embed_tokens.weight", ()))


@functools.cache
def recipe(case: str):
    """The case's RecipeSpec, made in the test's process and handed to the ranks (pickled): a rank
    then never imports transformers, which costs more CPU than the refits themselves."""
    return CASES[case][0]()


def full_tensors(case: str, spec, v: int) -> dict[str, torch.Tensor]:
    """Every source's global tensor at version ``v``: bf16 weights with std 0.02 after ``v - 1``
    Adam-sized steps (replayed, so every process derives the same bits). Megatron keeps the last
    stage's copy of a tied embedding equal to the first stage's."""
    out = {}
    for name, lay in spec.src.items():
        if name == TIED[1] and _tied(spec):
            continue
        g = torch.Generator().manual_seed(zlib.crc32(f"{case}/{name}".encode()))
        w = (torch.randn(lay.shape, generator=g) * 0.02).to(torch.bfloat16)
        for step in range(2, v + 1):
            g = torch.Generator().manual_seed(zlib.crc32(f"{case}/{name}/{step}".encode()))
            w = (w.float() - 1e-6 * torch.sign(torch.randn(lay.shape, generator=g))).to(torch.bfloat16)
        out[name] = w
    if _tied(spec):
        out[TIED[1]] = out[TIED[0]]
    return out


def shards(spec, full: dict, rank: int) -> dict[str, torch.Tensor]:
    return {n: lay.shard(full[n], rank).contiguous() for n, lay in spec.src.items() if rank in lay.ranks}


def poisoned(spec, rank: int) -> dict[str, torch.Tensor]:
    """Outputs an unwritten element shows in: NaN (0x7F bytes for e4m3)."""
    return {n: (torch.full(lay.local_shape(rank), 0x7F, dtype=torch.uint8).view(FP8) if lay.dtype == FP8
                else torch.full(lay.local_shape(rank), float("nan"), dtype=lay.dtype))
            for n, lay in spec.dst.items() if rank in lay.ranks}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


# ------------------------------------------------------------------------------------- the ranks
def _worker(proc, specs, ports):
    torch.set_num_threads(1)
    out = {}
    for (case, (_, procs, modes)), port in zip(CASES.items(), ports, strict=True):
        ranks = {p: r for r, p in procs.items()}
        if proc not in ranks:
            continue
        rank, spec = ranks[proc], specs[case]
        store = f"host{PLACEMENT[procs[0]]}:{port}"   # on the group's rank 0
        kw = dict(meeting=trs.Meeting(rank=rank, world_size=len(procs), store=store, group=case),
                  timeouts=trs.Timeouts(wait=60))
        if rank not in modes:
            with trs.RefitTrainer.from_recipe(spec, shards(spec, full_tensors(case, spec, 1), rank), **kw) as tr:
                for v in range(1, VERSIONS + 1):
                    tr.fence()
                    if v > 1:
                        for n, t in shards(spec, full_tensors(case, spec, v), rank).items():
                            tr.source_tensors[n].copy_(t)
                    assert tr.publish() == v
                tr.fence()
                out[case] = {"staging": tr.stats.staging_bytes}
            continue
        pulled, stats = [], []
        with trs.RefitInference.from_recipe(spec, tensors=poisoned(spec, rank),
                                            pull=trs.PullOptions(mode=modes[rank], backend="torch"), **kw) as ep:
            for v in range(1, VERSIONS + 1):
                if modes[rank] == "shadow" and v > 1:
                    assert ep.start_pull() == v and ep.swap() == v
                else:
                    assert ep.pull() == v
                if v < VERSIONS:   # the stats are the served version's, also once the relays hold the next
                    poll_until(lambda v=v: ep.available_version() > v, 60, what=f"rank {rank}: version {v + 1}")
                s = ep.stats
                stats.append((s.cross_host_bytes, s.cross_host_delta_bytes, s.cross_host_dense_bytes,
                              s.cross_host_changed))
                pulled.append({n: _bits(t).clone() for n, t in ep.tensors.items()})
        out[case] = {"pulled": pulled, "stats": stats}
    buf = io.BytesIO()   # bytes, not tensors: a queue passes tensors as handles that die with this process
    torch.save(out, buf)
    return buf.getvalue()


@pytest.fixture(scope="module")
def runs(four_hosts):
    """``{case: {rank: what the group's rank reported}}``."""
    ports = [free_port() for _ in CASES]
    out = four_hosts.run_ranks(_worker, PLACEMENT, args=({case: recipe(case) for case in CASES}, ports), timeout=240)
    out = {p: torch.load(io.BytesIO(b)) for p, b in out.items()}
    assert all(four_hosts.shm_files(i) == [] for i in range(4))   # every arena and buffer unlinked
    return {case: {r: out[p][case] for r, p in procs.items()} for case, (_, procs, _) in CASES.items()}


# ------------------------------------------------------------------------------------- the checks
def _check_bits(case: str, runs: dict) -> None:
    """Every inference rank's every version equals the recipe's plan run from scratch, bit for bit."""
    _, _, modes = CASES[case]
    spec = recipe(case)
    plan = spec.plan()
    for v in range(1, VERSIONS + 1):
        full = full_tensors(case, spec, v)
        src = {r: shards(spec, full, r) for r in plan.src_ranks}
        want = trs.execute_local(plan, src, out={r: poisoned(spec, r) for r in modes}, backend="torch")
        for r in modes:
            got = runs[case][r]["pulled"][v - 1]
            assert sorted(got) == sorted(want[r])
            for n, w in want[r].items():
                assert torch.equal(got[n], _bits(w)), (case, v, r, n)


def _check_deltas(case: str, runs: dict, whole: dict[str, int]) -> None:
    """Per receiving host: version 1 crossed whole (``whole[host]`` bytes: each byte once, however
    many replicas the host serves), every later version as deltas only (a few % of the elements
    changed), at most 10% of the whole."""
    _, _, modes = CASES[case]
    hosts = hosts_of(case)
    assert sorted(whole) == sorted({hosts[r] for r in modes})
    for host in sorted(whole):
        ranks = [r for r in modes if hosts[r] == host]
        for v in range(VERSIONS):
            got = [runs[case][r]["stats"][v] for r in ranks]   # (bytes, delta, dense, changed) per rank
            total = sum(g[0] for g in got)
            assert total == sum(g[1] + g[2] for g in got)
            if v == 0:
                assert total == whole[host] and all(g[1] == 0 and g[3] is None for g in got), (case, host, got)
            else:
                receivers = [g for g in got if g[0]]
                assert receivers and all(g[2] == 0 and 0.005 < g[3] < 0.2 for g in receivers), (case, host, v, got)
                assert 0 < total <= 0.10 * whole[host], (case, host, v, total, whole[host])


def _ingress(case: str) -> dict[str, int]:
    """The planner's bytes into each receiving host per refit (each byte a host needs, once)."""
    return dict(plan_hosts(recipe(case).plan(), hosts_of(case)).traffic().host_ingress)


def _megatron_bytes(spec) -> int:
    """Every Megatron byte that feeds vLLM, once: the tied embedding from either copy, never
    Megatron's padded vocab rows."""
    total = 0
    for name, lay in spec.src.items():
        if name == TIED[1] and _tied(spec):
            continue   # the tied copy: an alias of the embedding
        total += lay.numel * lay.itemsize
        if name in TIED:
            total -= (lay.shape[0] - V) * lay.shape[1] * lay.itemsize
    return total


def test_fp8_block_destinations_quantize_the_delta_refitted_relay_exactly(runs):
    """The replicas on host2 pull FP8 weights and block scales quantized from the relay buffers the
    deltas were applied to: every version equals quantizing that version from scratch."""
    spec = recipe("fp8")
    assert sum(lay.dtype == FP8 for lay in spec.dst.values()) == 4   # qkv, o, gate_up, down: e4m3
    # k's 128 rows come from all three trainers: one block quantized from several trainers' boxes.
    plan = spec.plan()
    k = [op for op in plan.ops if op.src_name.endswith("k_proj.weight")]
    assert all({op.src_rank for op in k if op.dst_rank == d} == {0, 1, 2} for d in plan.dst_ranks)
    _check_bits("fp8", runs)


def test_replicas_on_one_host_receive_each_byte_once_as_deltas(runs):
    spec = recipe("fp8")
    model = sum(lay.numel * lay.itemsize for lay in spec.src.values())   # every HF byte is read on host2
    _check_deltas("fp8", runs, {"host2": model})
    # Two replicas, and the two TP ranks of each, split the host's receives: nobody got it all.
    assert all(0 < runs["fp8"][r]["stats"][0][0] < model for r in (3, 4, 5, 6))
    # The trainers' snapshots: one copy of the bytes they send across hosts (no packing buffer here).
    assert sum(runs["fp8"][r]["staging"] for r in (0, 1, 2)) == model


def test_megatron_tp_pp_into_replicas_on_two_hosts_each_with_its_own_base(runs):
    """Megatron TP 2 x PP 2 (each stage on its host; tied embeddings: either copy is read) to one
    replica on host2 and one on host3: each host gets version 1 whole, then deltas against its
    own relays, from both stages' hosts."""
    _check_bits("megatron", runs)
    model = _megatron_bytes(recipe("megatron"))
    _check_deltas("megatron", runs, {"host2": model, "host3": model})
    assert _ingress("megatron") == {"host2": model, "host3": model}
    # The trainers keep one snapshot per receiving host (each host's base): two copies of the model.
    assert sum(runs["megatron"][r]["staging"] for r in range(4)) == 2 * model


def test_megatron_experts_into_a_tp_group_split_over_hosts(runs):
    """Megatron TP 2 x EP 2 (MoE layer 0, dense layer 1) to vLLM TP 2 with replica 0's TP ranks on
    host2 and host3 (replica 1 on host2): host3 needs half of every row-parallel shard, boxes the trainers
    pack before sending, and those packed boxes cross as deltas too."""
    _check_bits("moe", runs)
    model = _megatron_bytes(recipe("moe"))
    ingress = _ingress("moe")
    assert ingress["host2"] == model and 0 < ingress["host3"] < model
    _check_deltas("moe", runs, ingress)
    # Packing buffers on the trainers: their staging is more than their snapshots of what they send.
    assert sum(runs["moe"][r]["staging"] for r in range(4)) > sum(ingress.values())
