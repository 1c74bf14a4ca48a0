"""The compile gate: every kernel configuration the launcher can produce compiles for Hopper (sm_90)
and is built for copy speed. No GPU needed: Triton's own ahead-of-time path (``triton.compile`` of
an ``ASTSource`` for ``GPUTarget("cuda", 90, 32)``) and the ``ptxas`` / ``cuobjdump`` Triton ships.

The configurations are not a hand-kept list: for every ``(variant, key)`` of
``kernels.launch_configs()`` the real table builder (``plan_launches``) makes a launch, and its
``call()`` (what ``launch()`` passes to the kernel) goes through Triton's own argument binder and
specialisation, exactly as a CUDA launch would, before it is compiled. Fails on a compile error, a
same-dtype copy without 128-bit global loads and stores, any spill (cubin stack > 0), or more than
``MAX_REGS`` registers.
"""
from __future__ import annotations

import re
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import JITFunction, create_function_from_signature

from tritonreshard import kernels

TARGET = GPUTarget("cuda", 90, 32)
MAX_REGS = 128  # 64K registers per SM: <= 128 keeps >= 4 blocks of 4 warps resident per SM
CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"

# A 128-bit global access in PTX: .v4 of 32-bit words, .v2 of 64-bit words, or .b128.
_V128 = r"(\.v4\.[bsuf]32|\.v2\.[bsuf]64|\.b128)"


def _example_boxes(key):
    """Regions that make the builder produce both variants for ``key``: one aligned contiguous
    wide row (``"rows"``) and one strided narrow region (``"tiles"``). Addresses are only numbers
    here (nothing is launched); they are 16-byte aligned like any allocation."""
    sb, db = (key[1], key[1]) if key[0] == "copy" else (key[1].itemsize, key[2].itemsize)
    n = 2 * kernels.ROWS_TILE_BYTES // min(sb, db)
    wide = (1 << 20, 1 << 30, (1, 1, 2, n), (0, 0, n, 1), (0, 0, n, 1))
    narrow = (1 << 21, 1 << 31, (1, 1, 3, 5), (0, 0, 1, 3), (0, 0, 5, 1))
    return [wide, narrow]


def compile_spec(launch: kernels.GatherLaunch):
    """What ``JITFunction.run`` would compile for ``launch`` on an sm_90 device: the launch's own
    arguments through Triton's binder (signature, pointer alignment, int specialisation, options)."""
    kernel, _grid, args, kwargs = launch.call()
    backend = make_backend(TARGET)
    kwargs = dict(kwargs, debug=False)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound_args, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound_args, specialization, options)
    return ASTSource(kernel, signature, constexprs, attrs), options


def resource_usage(cubin: bytes) -> dict:
    """``{"REG": n, "STACK": n, ...}`` of the cubin (the largest over its functions), from the
    shipped cuobjdump."""
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "k.cubin"
        path.write_bytes(cubin)
        out = subprocess.run([str(CUOBJDUMP), "--dump-resource-usage", str(path)], check=True,
                             capture_output=True, text=True, timeout=60).stdout
    usage: dict = {}
    for k, v in re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", out):  # the worst over all functions
        usage[k] = max(usage.get(k, 0), int(v))
    assert "REG" in usage and "STACK" in usage, out
    return usage


def configurations():
    """``[(variant, key, launch)]`` for every configuration, built by the launcher's own code."""
    found = {}
    for key in kernels.group_keys():
        for launch in kernels.plan_launches(key, _example_boxes(key), "cpu"):
            found[(launch.variant, launch.key)] = launch
    assert set(found) == set(kernels.launch_configs()), "example regions must reach every variant"
    return [(v, k, found[(v, k)]) for v, k in kernels.launch_configs()]


def _name(variant, key) -> str:
    if key[0] == "copy":
        return f"{variant}-copy{8 * key[1]}"
    return f"{variant}-{str(key[1]).removeprefix('torch.')}-{str(key[2]).removeprefix('torch.')}"


def _compile(item):
    variant, key, launch = item
    src, options = compile_spec(launch)
    compiled = triton.compile(src, target=TARGET, options=options.__dict__)
    return _name(variant, key), key, compiled.asm["ptx"], resource_usage(compiled.asm["cubin"])


@pytest.fixture(scope="module")
def compiled():
    if not CUOBJDUMP.exists():
        pytest.fail(f"Triton's cuobjdump is missing at {CUOBJDUMP}")
    # Two workers: ptxas runs as a subprocess, so even CI's two cores overlap most of the time.
    with ThreadPoolExecutor(max_workers=2) as pool:
        return list(pool.map(_compile, configurations()))


def problems_of(name: str, key, ptx: str, usage: dict) -> list[str]:
    """Why one compiled configuration is not built for copy speed ([] if it is)."""
    problems = []
    if usage["STACK"] > 0 or usage.get("LOCAL", 0) > 0:
        problems.append(f"{name}: spills ({usage})")
    if usage["REG"] > MAX_REGS:
        problems.append(f"{name}: {usage['REG']} registers > {MAX_REGS}")
    if key[0] == "copy":
        for op in ("ld", "st"):
            if not re.search(rf"\b{op}\.global(\.[a-z0-9_]+)*?{_V128}\b", ptx):
                problems.append(f"{name}: no 128-bit global {op} in the PTX")
    return problems


def test_every_launch_configuration_compiles_for_sm90_fast(compiled):
    problems, table = [], []
    for name, key, ptx, usage in compiled:
        table.append(f"{name:28s} REG {usage['REG']:4d}  STACK {usage['STACK']}")
        problems += problems_of(name, key, ptx, usage)
    print("\n".join(table))
    assert len(compiled) == len(kernels.launch_configs())
    assert not problems, "\n".join(problems)


@triton.jit
def _scalar_copy_kernel(src_ptr, dst_ptr, n, stride, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(dst_ptr + offs, tl.load(src_ptr + offs * stride, mask=mask), mask=mask)


def test_gate_flags_a_copy_without_128_bit_accesses():
    """The checks can fail: a copy with a run-time stride and length compiles to scalar accesses."""
    if not isinstance(_scalar_copy_kernel, JITFunction):  # TRITON_INTERPRET=1 in the environment
        kernel = JITFunction(_scalar_copy_kernel.fn)
    else:
        kernel = _scalar_copy_kernel
    signature = {"src_ptr": "*i16", "dst_ptr": "*i16", "n": "i32", "stride": "i32", "BLOCK": "constexpr"}
    aligned = {(0,): [["tt.divisibility", 16]], (1,): [["tt.divisibility", 16]]}
    src = ASTSource(kernel, signature, constexprs={"BLOCK": 1024}, attrs=aligned)
    compiled = triton.compile(src, target=TARGET)
    problems = problems_of("scalar", ("copy", 2), compiled.asm["ptx"], resource_usage(compiled.asm["cubin"]))
    # (the store is scalar too: its mask compares against a run-time n of unknown divisibility)
    assert problems == ["scalar: no 128-bit global ld in the PTX", "scalar: no 128-bit global st in the PTX"]


# --------------------------------------------------------------------------------- block-FP8 quantizer


def quantize_configurations():
    """``[(name, launch)]`` for every :func:`kernels.quantize_launch_configs` entry, each launch made by
    the real table builder (``QuantizeTable`` over a plan whose blocks span two trainers)."""
    from tritonreshard import Layout, Shard
    from tritonreshard.planning import BlockQuant, plan_quantized

    out = []
    for dtype, block, ue8m0, rule in kernels.quantize_launch_configs():
        src = {"w": Layout((256, 256), [0, 1, 2], [Shard(0)], dtype)}
        q = BlockQuant("s", (256,), block, ue8m0, rule)
        dst = {"w": Layout((256, 256), [3], [Shard(0)], torch.float8_e4m3fn),
               "s": Layout((2, 2), [3], [Shard(0)], torch.float32)}
        plan = plan_quantized(src, dst, None, {"w": q})
        shards = {r: torch.zeros(src["w"].local_shape(r), dtype=dtype) for r in range(3)}
        outs = {"w": torch.empty(256, 256, dtype=torch.float8_e4m3fn), "s": torch.empty(2, 2)}
        table = kernels.QuantizeTable.build(plan.ops, plan.quant, src=lambda op, shards=shards: shards[op.src_rank],
                                            dst=lambda op, outs=outs: outs["w"], scale=lambda r, n, outs=outs: outs[n])
        (launch,) = table.launches
        out.append((f"quantize-{str(dtype).removeprefix('torch.')}{'-ue8m0' if ue8m0 else ''}-{rule}", launch))
    return out


def _compile_quantize(item):
    name, launch = item
    src, options = compile_spec(launch)
    compiled = triton.compile(src, target=TARGET, options=options.__dict__)
    return name, compiled.asm["ptx"], resource_usage(compiled.asm["cubin"])


def test_quantize_kernel_compiles_for_sm90_fast_and_exact():
    """Every quantizer configuration: no spills, <= MAX_REGS registers, 128-bit source loads and
    destination stores, the hardware's round-to-nearest-even saturating fp32 -> e4m3 conversion and
    IEEE (not approximate) division for the scale."""
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(_compile_quantize, quantize_configurations()))
    problems, table = [], []
    for name, ptx, usage in results:
        table.append(f"{name:36s} REG {usage['REG']:4d}  STACK {usage['STACK']}")
        problems += problems_of(name, ("quantize",), ptx, usage)
        if not re.search(rf"\bld\.global(\.[a-z0-9_]+)*?{_V128}\b", ptx):
            problems.append(f"{name}: no 128-bit global ld in the PTX")
        if not re.search(rf"\bst\.global(\.[a-z0-9_]+)*?{_V128}\b", ptx):
            problems.append(f"{name}: no 128-bit global st in the PTX")
        if "cvt.rn.satfinite.e4m3x2.f32" not in ptx:
            problems.append(f"{name}: no cvt.rn.satfinite.e4m3x2.f32 in the PTX")
        if not re.search(r"\bdiv\.rn\.f32\b", ptx) or re.search(r"\bdiv\.(approx|full)\.f32\b", ptx):
            problems.append(f"{name}: the scale is not an IEEE division (div.rn.f32)")
    print("\n".join(table))
    assert len(results) == len(kernels.quantize_launch_configs())
    assert not problems, "\n".join(problems)


# ------------------------------------------------------------------------------ delta compare/compact


def _compile_delta(item):
    name, wd, launch = item
    src, options = compile_spec(launch)
    compiled = triton.compile(src, target=TARGET, options=options.__dict__)
    return f"delta-{name}-{str(wd).removeprefix('torch.')}", compiled.asm["ptx"], resource_usage(compiled.asm["cubin"])


def test_delta_kernels_compile_for_sm90_fast():
    """Both passes of the delta codec's compare-and-compact, for every word dtype, as the wrappers
    launch them: no spills, <= MAX_REGS registers, and 128-bit loads of the new and snapshot words
    (a message of a multiple of 16 words: Triton specialises the length, so the masked loads stay
    vectors)."""
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(_compile_delta, kernels.delta_launch_configs()))
    problems, table = [], []
    for name, ptx, usage in results:
        table.append(f"{name:28s} REG {usage['REG']:4d}  STACK {usage['STACK']}")
        problems += problems_of(name, ("delta",), ptx, usage)
        if not re.search(rf"\bld\.global(\.[a-z0-9_]+)*?{_V128}\b", ptx):
            problems.append(f"{name}: no 128-bit global ld in the PTX")
    print("\n".join(table))
    assert len(results) == 2 * len(kernels.DELTA_WORDS)
    assert not problems, "\n".join(problems)
