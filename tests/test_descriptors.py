"""Torch-backend coalescing: same-geometry entries at a constant address step become one copy."""
import pytest
import torch
from tritonreshard.kernels import DescriptorTable

from tritonreshard import Layout, Replicate, Shard, plan_reshard


def flat_views(flat, shapes, dtype, gap=0):
    out, pos = [], 0
    for shape in shapes:
        n = torch.Size(shape).numel()
        out.append(flat[pos:pos + n].view(shape))
        pos += n + gap
    return out


@pytest.mark.parametrize("src_gap, dst_gap, expect_runs", [(0, 0, 1), (3, 5, 1)])
def test_packed_same_geometry_tensors_coalesce_and_stay_exact(src_gap, dst_gap, expect_runs):
    n, shape = 50, (4, 6)
    names = [f"t{i:03d}" for i in range(n)]
    src_l = {m: Layout(shape, 2, [Shard(0)]) for m in names}
    dst_l = {m: Layout(shape, [2, 3], [Shard(1)], torch.bfloat16) for m in names}
    plan = plan_reshard(src_l, dst_l)
    src_flat = torch.arange(2 * n * 12 + 2 * n * src_gap, dtype=torch.float32)
    src = {r: dict(zip(names, flat_views(src_flat[r * (n * (12 + src_gap)):], [(2, 6)] * n, torch.float32, src_gap),
                       strict=True))
           for r in (0, 1)}
    dst_flat = torch.full((n * (12 + dst_gap),), float("nan"), dtype=torch.bfloat16)
    dst = dict(zip(names, flat_views(dst_flat, [(4, 3)] * n, torch.bfloat16, dst_gap), strict=True))
    ops = sorted(plan.ops_for_dst(2), key=lambda op: (op.src_rank, op.name))
    table = DescriptorTable.build(ops, src=lambda op: src[op.src_rank][op.name], dst=lambda op: dst[op.name])
    assert len(table) == 2 * n
    assert table.num_torch_copies == 2 * expect_runs  # one run per source rank
    table.run("torch")
    for m in names:
        full = torch.cat([src[0][m], src[1][m]])
        assert torch.equal(dst[m], full[:, :3].to(torch.bfloat16)), m
    if dst_gap:  # the gaps between packed tensors were never written
        gaps = torch.cat([dst_flat[(i + 1) * 12 + i * dst_gap:(i + 1) * (12 + dst_gap)] for i in range(n)])
        assert torch.isnan(gaps.float()).all()


def test_irregular_steps_and_mixed_shapes_are_not_coalesced():
    src_l = {"a": Layout((4,), [0], [Replicate()]), "b": Layout((4,), [0], [Replicate()]),
             "c": Layout((4,), [0], [Replicate()]), "d": Layout((5,), [0], [Replicate()])}
    dst_l = {k: Layout(v.shape, [1], [Replicate()]) for k, v in src_l.items()}
    plan = plan_reshard(src_l, dst_l)
    s = torch.arange(40, dtype=torch.float32)
    src = {"a": s[0:4], "b": s[4:8], "c": s[20:24], "d": s[30:35]}   # steps 4, then 16: no run past b
    d = torch.full((40,), -1.0)
    dst = {"a": d[0:4], "b": d[4:8], "c": d[8:12], "d": d[12:17]}
    table = DescriptorTable.build(plan.ops_for_dst(1), src=lambda op: src[op.name], dst=lambda op: dst[op.name])
    assert table.num_torch_copies == 3   # (a, b) coalesce; c breaks the step; d has another shape
    table.run("torch")
    for k in src:
        assert torch.equal(dst[k], src[k])
    assert (d[17:] == -1).all()
