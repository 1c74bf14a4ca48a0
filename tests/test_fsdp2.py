"""FSDP2 as the refit source: a real ``fully_shard`` model over 2 gloo processes refits into 2
inference processes with no hand-written layouts; FSDP keeps training on the arena."""
import pytest
import torch
from _mp import free_port, run_ranks

import tritonreshard as trs
from tritonreshard import Layout, Replicate, Shard

TRAINERS, INFERENCE, WORLD, STEPS = [0, 1], [2, 3], 4, 3


def _model():
    torch.manual_seed(0)
    # Uneven rows on purpose: 7 rows over 2 FSDP ranks (4 + 3: rank 1's shard is padded by FSDP),
    # 3 rows (2 + 1), a 1-D bias of 7.
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))


def _dst_layouts():
    tp = lambda shape, p: Layout(shape, INFERENCE, [p])  # noqa: E731
    return {"0.weight": tp((7, 5), Shard(0)), "0.bias": tp((7,), Shard(0)),
            "2.weight": tp((3, 7), Shard(1)), "2.bias": tp((3,), Replicate())}


def _train_step(model, opt, rank, step):
    g = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randn(4, 5, generator=g)
    model(x).pow(2).sum().backward()
    opt.step()
    opt.zero_grad()


def _rank(rank, store, fsdp_port):
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    if rank in TRAINERS:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{fsdp_port}", rank=rank,
                                world_size=len(TRAINERS))
        try:
            from tritonreshard.engine import fsdp as _fsdp

            partial = _model()
            fully_shard(partial[0])  # 2.weight / 2.bias stay plain tensors: named, before anything moves
            with pytest.raises(ValueError, match=r"'2.weight' is not managed by fully_shard.*'2.bias'"):
                _fsdp.FSDP2Source(partial)
            model, twin = _model(), _model()
            for m in (model, twin):  # twin: the same model and steps without tritonreshard
                fully_shard(m[0])
                fully_shard(m[2])
                fully_shard(m)
            opt = torch.optim.Adam(model.parameters(), lr=1e-2)
            twin_opt = torch.optim.Adam(twin.parameters(), lr=1e-2)
            history = []
            with trs.RefitTrainer(model, None, trs.Meeting(rank=rank, world_size=WORLD, store=store)) as tr:
                arena = {n: p._local_tensor.data_ptr() for n, p in model.named_parameters()}
                assert {n: t.data_ptr() for n, t in tr.source_tensors.items()} == arena
                assert tr.plan.src_layouts["0.weight"] == Layout((7, 5), TRAINERS, [Shard(0)])
                for step in range(1, STEPS + 1):
                    tr.fence()
                    _train_step(model, opt, rank, step)
                    _train_step(twin, twin_opt, rank, step)
                    assert tr.publish() == step
                    # Still on the arena: the optimizer stepped the arena, FSDP all-gathered from it.
                    assert {n: p._local_tensor.data_ptr() for n, p in model.named_parameters()} == arena
                    full = {n: p.full_tensor().detach() for n, p in model.named_parameters()}
                    twin_full = {n: p.full_tensor() for n, p in twin.named_parameters()}
                    for n in full:  # training on the arena is bit-identical to plain FSDP2
                        assert torch.equal(full[n].view(torch.int32), twin_full[n].view(torch.int32)), (n, step)
                    history.append({n: t.numpy() for n, t in full.items()})  # by value through the queue
                tr.fence()
            return history
        finally:
            dist.destroy_process_group()
    got = []
    with trs.RefitInference(_dst_layouts(), trs.Meeting(rank=rank, world_size=WORLD, store=store)) as inf:
        for step in range(1, STEPS + 1):
            assert inf.pull() == step
            got.append({n: t.clone().numpy() for n, t in inf.tensors.items()})
    return got


@pytest.mark.slow
def test_fully_shard_model_refits_exactly_and_keeps_training_on_the_arena():
    out = run_ranks(_rank, WORLD, args=(f"127.0.0.1:{free_port()}", free_port()), timeout=300)
    out = {r: [{n: torch.from_numpy(a) for n, a in d.items()} for d in hist] for r, hist in out.items()}
    assert out[0][0]["0.weight"].shape == (7, 5)
    for step in range(STEPS):
        full = out[0][step]
        for n in full:  # both trainers see the same full parameters
            assert torch.equal(full[n], out[1][step][n])
        if step:
            assert not torch.equal(full["0.weight"], out[0][step - 1]["0.weight"])  # it trains
        for r in INFERENCE:
            for n, lay in _dst_layouts().items():
                want = lay.shard(full[n], r)
                assert torch.equal(out[r][step][n].view(torch.int32), want.view(torch.int32)), (r, n, step)


def test_fsdp2_source_rejects_plain_modules_clearly():
    from tritonreshard.engine import fsdp as _fsdp

    assert not _fsdp.is_fsdp2(torch.nn.Linear(2, 2))
