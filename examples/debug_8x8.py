# %% [markdown]
# # Debugging a reshard, step by step: the 8x8 seed example
#
# Two training ranks hold row halves of an 8x8 fp32 weight; four inference ranks (2..5) want column
# quarters in bf16. This notebook (percent format: open it in VS Code / Jupytext, or run it as a plain
# script) builds the plan, draws it, dumps the descriptor table the gather kernel reads, runs the
# kernel in Triton's interpreter on the CPU, and checks every element's provenance.

# %%
import os
import tempfile
import time

import torch

import tritonreshard as trs
from tritonreshard import execute_local
from tritonreshard.kernels import DescriptorTable

# CUDA tensors run the compiled kernels; the CPU tensors of this notebook run the same kernels in
# Triton's interpreter (exact, slow: fine for 8x8).
print("CUDA available:", torch.cuda.is_available())

# %% [markdown]
# ## 1. Layouts and plan

# %%
src_layouts = {"w": trs.Layout((8, 8), 2, [trs.Shard(0)])}
dst_layouts = {"w": trs.Layout((8, 8), [2, 3, 4, 5], [trs.Shard(1)], dtype=torch.bfloat16)}
plan = trs.plan_reshard(src_layouts, dst_layouts)
print(plan)

# %% [markdown]
# ## 2. The picture (if `tritonreshard.apps.viz` is available)

# %%
try:
    from tritonreshard.apps.viz import draw_plan
except ImportError as exc:  # viz is optional (matplotlib)
    print("no picture:", exc)
else:
    png = os.path.join(os.environ.get("DEBUG_8X8_OUT", tempfile.gettempdir()), "debug_8x8_plan.png")
    draw_plan(plan, png)
    print("plan picture written to", png)

# %% [markdown]
# ## 3. Sources with provenance, and one rank's descriptor table
#
# Each source rank holds its shard of `arange(64).reshape(8, 8)`: an element's value *is* its global
# flat index (exact in bf16 up to 256). Inference rank 3 builds its table once, from views of the
# sources' shards (in the multi-process engine those views point into mapped arenas).

# %%
global_w = torch.arange(64, dtype=torch.float32).reshape(8, 8)
src_shards = {r: {"w": src_layouts["w"].shard(global_w, r)} for r in src_layouts["w"].ranks}
out = {r: {"w": torch.full(dst_layouts["w"].local_shape(r), float("nan"), dtype=torch.bfloat16)}
       for r in dst_layouts["w"].ranks}

rank = 3
table = DescriptorTable.build(plan.ops_for_dst(rank), src=lambda op: src_shards[op.src_rank][op.name],
                              dst=lambda op: out[op.dst_rank][op.name])
print(table)

# %% [markdown]
# ## 4. Run the kernel (interpreter on CPU), for all ranks at once, and time both backends

# %%
t0 = time.perf_counter()
execute_local(plan, src_shards, out=out, backend="triton")
t_triton = time.perf_counter() - t0
ref = {r: {"w": torch.empty_like(out[r]["w"])} for r in out}
t0 = time.perf_counter()
execute_local(plan, src_shards, out=ref, backend="torch")
t_torch = time.perf_counter() - t0
print(f"triton backend: {t_triton * 1e3:.1f} ms   torch backend: {t_torch * 1e3:.2f} ms")
for r in out:
    assert torch.equal(out[r]["w"], ref[r]["w"]), r

# %% [markdown]
# ## 5. Provenance: each inference rank's block, per element "source rank : global index"

# %%
for r in dst_layouts["w"].ranks:
    got = out[r]["w"]
    src_of = torch.full(got.shape, -1, dtype=torch.int64)
    for op in plan.ops_for_dst(r):
        src_of[op.dst_slices] = op.src_rank
    print(f"inference rank {r} (local shape {tuple(got.shape)}):")
    for i in range(got.shape[0]):
        print("   " + "  ".join(f"r{int(src_of[i, j])}:{int(got[i, j]):2d}" for j in range(got.shape[1])))
    want = dst_layouts["w"].shard(global_w, r).to(torch.bfloat16)
    assert torch.equal(got, want), f"rank {r} differs"
    assert (src_of >= 0).all(), f"rank {r} has elements no op wrote"
print("provenance OK: every element came from the expected global index")

# %% [markdown]
# ## 6. Step through a single descriptor
#
# `table.entries[i]` has the op, its regions (offsets, strides, shape after collapsing dims) and the
# exact torch views it copies between. Run it alone with `table.subset([i])`.

# %%
i = 1
entry = table.entries[i]
print(entry)
entry.dst_view.fill_(float("nan"))
table.subset([i]).run("triton")
print("dst view after running entry", i, "alone:\n", entry.dst_view)
assert torch.equal(entry.dst_view, entry.src_view.to(entry.dst_dtype))
print("single entry OK")
