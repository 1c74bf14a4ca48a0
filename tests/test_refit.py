"""The cross-process refit engine: trainers publish, inference ranks pull, every version exact.

Each test spawns real processes (shared-memory arenas, TCPStore rendezvous) under a hard timeout.
Data is provenance-encoded (``_provenance``): element ``i`` of tensor ``name`` at version ``v``
holds a value that encodes (``i``, ``v``, the name) and that both the source's and the destination's
dtype hold exactly, so every destination element and every version differ, and a stale, misplaced or
missing element is caught exactly, casts included.
"""
import os

import pytest
import torch
from _mp import free_port, run_ranks
from _provenance import provenance

import tritonreshard as trs
from tritonreshard import Layout, Replicate, Shard

pytestmark = pytest.mark.timeout(240)


def global_value(name_id: int, src_lay: Layout, version: int, dst_lay: Layout | None = None) -> torch.Tensor:
    """The full tensor at ``version``, exact in the source's and the destination's dtype."""
    dtypes = (src_lay.dtype,) + ((dst_lay.dtype,) if dst_lay is not None else ())
    return provenance(src_lay.shape, version, name_id, dtypes=dtypes)


def expected_local(name_id, src_lay, dst_lay, rank, version):
    full = global_value(name_id, src_lay, version, dst_lay).to(src_lay.dtype)
    return dst_lay.shard(full, rank).to(dst_lay.dtype)


def _worker(rank, world, port, scenario):
    torch.set_num_threads(1)
    src, dst = scenario["src"], scenario["dst"]
    ids = {n: i for i, n in enumerate(sorted(dst))}
    trainer = rank in scenario["trainers"]
    infer = rank in scenario["inference"]
    versions = scenario.get("versions", 3)
    mode = scenario.get("mode", "shadow")
    kwargs = dict(meeting=trs.Meeting(rank=rank, world_size=world, store=f"127.0.0.1:{port}"),
                  timeouts=trs.Timeouts(wait=60))
    if trainer:
        tensors = {n: lay.shard(global_value(ids.get(n, 0), lay, 1, dst.get(n)).to(lay.dtype), rank)
                   for n, lay in src.items() if rank in lay.ranks}
        kwargs.update(source=trs.SourceData(tensors, src))
    if infer:
        kwargs.update(destination=trs.DestinationData(dst), pull=trs.PullOptions(mode=mode))
    report = {}
    with trs.RefitEndpoint(**kwargs) as ep:
        report["handles"] = ep.stats.handles_opened
        report["descriptors"] = ep.stats.num_descriptors
        for v in range(1, versions + 1):
            if trainer:
                ep.fence()
                if v > 1:  # the "optimizer step": new weights, in place in the arena
                    for n, t in ep.source_tensors.items():
                        lay = src[n]
                        t.copy_(lay.shard(global_value(ids[n], lay, v, dst.get(n)).to(lay.dtype), rank))
                assert ep.publish() == v
            if infer:
                if mode == "shadow" and v > 1:
                    before = ep.tensors
                    assert ep.start_pull() == v
                    while not ep.pull_done():
                        pass
                    # The serving weights are untouched until swap().
                    for n, t in before.items():
                        assert torch.equal(t, expected_local(ids[n], src[n], dst[n], rank, v - 1)), (n, v)
                    assert ep.swap() == v
                else:
                    assert ep.pull() == v
                assert ep.version == v and ep.consistent
                for n, t in ep.tensors.items():
                    want = expected_local(ids[n], src[n], dst[n], rank, v)
                    assert t.dtype == dst[n].dtype
                    assert torch.equal(t, want), f"rank {rank} {n} v{v}:\n{t}\n!=\n{want}"
        if trainer:
            ep.fence()
        report["staging"] = ep.stats.staging_bytes
    return report


def run_scenario(scenario, world):
    return run_ranks(_worker, world, args=(world, free_port(), scenario), timeout=200)


def shm_entries():
    return {e for e in os.listdir("/dev/shm") if e.startswith("trs-")}


def test_seed_rows_to_columns_every_version_exact():
    before = shm_entries()
    src = {"w": Layout((8, 8), 2, [Shard(0)])}
    dst = {"w": Layout((8, 8), [2, 3, 4, 5], [Shard(1)])}
    out = run_scenario(dict(src=src, dst=dst, trainers={0, 1}, inference={2, 3, 4, 5}, versions=4), 6)
    for r in (2, 3, 4, 5):
        assert out[r]["handles"] == 2 and out[r]["descriptors"] == 2 and out[r]["staging"] == 0
    assert shm_entries() == before


def test_in_place_mode_and_several_tensors_with_blocks_and_cast():
    h = 6
    src = {"qkv": Layout((3 * h, 5), 2, [Shard(0)], torch.float32),
           "o": Layout((5, h), 2, [Shard(0)], torch.float32),
           "norm": Layout((5,), 2, [Replicate()], torch.float32)}
    dst = {"qkv": Layout((3 * h, 5), [2, 3, 4], [Shard(0, blocks=(h, h, h))], torch.bfloat16),
           "o": Layout((5, h), [2, 3, 4], [Shard(1)], torch.float16),
           "norm": Layout((5,), [2, 3, 4], [Replicate()], torch.float32)}
    run_scenario(dict(src=src, dst=dst, trainers={0, 1}, inference={2, 3, 4}, mode="inplace"), 5)


def test_columns_to_replicas():
    src = {"w": Layout((8, 8), 4, [Shard(1)])}
    dst = {"w": Layout((8, 8), [4, 5], [Replicate()])}
    out = run_scenario(dict(src=src, dst=dst, trainers={0, 1, 2, 3}, inference={4, 5}), 6)
    assert out[4]["handles"] == 4


def test_colocated_meshes_copy_locally():
    # Ranks 0 and 1 train (rows) and serve (columns); rank 2 only serves.
    src = {"w": Layout((6, 9), 2, [Shard(0)])}
    dst = {"w": Layout((6, 9), [0, 1, 2], [Shard(1)])}
    out = run_scenario(dict(src=src, dst=dst, trainers={0, 1}, inference={0, 1, 2}), 3)
    assert out[0]["handles"] == 1 and out[2]["handles"] == 2


def test_replicated_sources_dp_by_fsdp():
    src = {"w": Layout((16, 4), [[0, 1], [2, 3]], [Replicate(), Shard(0)])}
    dst = {"w": Layout((16, 4), [4, 5], [Shard(1)])}
    run_scenario(dict(src=src, dst=dst, trainers={0, 1, 2, 3}, inference={4, 5}), 6)


def _mismatch_worker(rank, world, port):
    src = {"w": Layout((8, 8), 2, [Shard(0)])}
    dst = {"w": Layout((8, 8), [2, 3], [Shard(1)])}
    kwargs = dict(meeting=trs.Meeting(rank=rank, world_size=world, store=f"127.0.0.1:{port}"),
                  timeouts=trs.Timeouts(wait=60))
    if rank < 2:
        t = src["w"].shard(torch.zeros(8, 8), rank)
        ep = trs.RefitTrainer({"w": t}, src, **kwargs)
    elif rank == 3:  # joins believing the destination is row-sharded
        ep = trs.RefitInference({"w": Layout((8, 8), [2, 3], [Shard(0)])}, **kwargs)
    else:
        ep = trs.RefitInference(dst, **kwargs)
    ep.close()


def test_mismatched_layout_fails_on_every_rank_before_data_moves():
    before = shm_entries()
    out = run_ranks(_mismatch_worker, 4, args=(4, free_port()), timeout=120, allow_errors=True)
    for r in range(4):
        status, value = out[r]
        assert status == "error", f"rank {r} did not fail: {value}"
        name, message, _ = value
        assert name == "ValueError"
        assert "rank 3 joined with dst_layouts['w']=[S(0)]@(2,3)" in message
        assert "rank 2 has [S(1)]@(2,3)" in message and "nothing was moved" in message
    assert shm_entries() == before


def _bad_tensor_worker(rank, world, port):
    src = {"w": Layout((4, 4), [0], [Replicate()])}
    kwargs = dict(meeting=trs.Meeting(rank=rank, world_size=world, store=f"127.0.0.1:{port}"),
                  timeouts=trs.Timeouts(wait=60))
    if rank == 0:
        trs.RefitTrainer({"w": torch.zeros(4, 3, dtype=torch.float16)}, src, **kwargs)
    else:
        trs.RefitInference({"w": Layout((4, 4), [1], [Replicate()])}, **kwargs)


def test_wrong_shard_shape_and_dtype_named_on_every_rank():
    out = run_ranks(_bad_tensor_worker, 2, args=(2, free_port()), timeout=120, allow_errors=True)
    for r in range(2):
        status, (name, message, _) = out[r]
        assert status == "error" and name == "ValueError"
        assert "rank 0: src_tensors['w'] has shape (4, 3), src_layouts['w'] says (4, 4)" in message
        assert "rank 0: src_tensors['w'] has dtype torch.float16" in message


def test_bad_arguments_are_rejected_before_joining():
    with pytest.raises(ValueError, match="mode must be 'shadow' or 'inplace'.*backend must be"):
        trs.RefitInference({"w": Layout((4,), 1, [Shard(0)])}, meeting=trs.Meeting(rank=0, world_size=1),
                           pull=trs.PullOptions(mode="x", backend="y"))
    with pytest.raises(ValueError, match=r"rank must be in \[0, 2\), got rank=5"):
        trs.RefitInference({"w": Layout((4,), 1, [Shard(0)])}, meeting=trs.Meeting(rank=5, world_size=2))


TRAINER_METHODS = {"publish", "fence", "published", "source_tensors"}
INFERENCE_METHODS = {"pull", "start_pull", "pull_done", "pulling", "pull_error", "discard", "swap", "version",
                     "consistent", "last_pull", "available_version", "rejoin"}
SHARED = {"tensors", "stats", "close", "members", "epoch", "alive", "dead_peers", "store"}


def test_each_role_has_its_side_only_and_a_colocated_rank_both():
    """Roles are built from sides, not by hiding methods: a trainer cannot pull, an inference
    rank cannot publish; a colocated RefitEndpoint does both."""
    def public(cls):
        return {n for n in dir(cls) if not n.startswith("_")}
    assert TRAINER_METHODS | SHARED <= public(trs.RefitTrainer)
    assert not INFERENCE_METHODS & public(trs.RefitTrainer)
    assert INFERENCE_METHODS | SHARED <= public(trs.RefitInference)
    assert not TRAINER_METHODS & public(trs.RefitInference)
    assert TRAINER_METHODS | INFERENCE_METHODS | SHARED <= public(trs.RefitEndpoint)
    # Each role's constructor takes its side's arguments only: another side's is a TypeError naming it.
    with pytest.raises(TypeError, match="got an unexpected keyword argument 'dst_layouts'"):
        trs.RefitTrainer({}, {}, meeting=trs.Meeting(rank=0, world_size=1), dst_layouts={})
    for kw in ("mode", "quant", "sources", "pull", "parts"):
        with pytest.raises(TypeError, match=f"'{kw}'"):
            trs.RefitTrainer({}, {}, meeting=trs.Meeting(rank=0, world_size=1), **{kw: None})
    with pytest.raises(TypeError, match="'start_version'"):
        trs.RefitInference({}, meeting=trs.Meeting(rank=0, world_size=1), start_version=3)


def test_module_parameters_move_into_the_arena_once_and_train_there():
    # One process, both sides (a colocated rank): the module's parameters become arena views, the
    # optimizer updates them in place, and every pull (cast to bf16) sees exactly that version.
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    src = {"weight": Layout((3, 4), [0], [Replicate()]), "bias": Layout((3,), [0], [Replicate()])}
    dst = {k: Layout(v.shape, [0], [Replicate()], torch.bfloat16) for k, v in src.items()}
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with trs.RefitEndpoint(meeting=trs.Meeting(rank=0, world_size=1, store=f"127.0.0.1:{free_port()}"),
                           source=trs.SourceData(model, src), destination=trs.DestinationData(dst)) as ep:
        arena_ptrs = {n: t.data_ptr() for n, t in ep.source_tensors.items()}
        for step in range(1, 4):
            ep.fence()
            model(torch.randn(2, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
            assert ep.publish() == step and ep.pull() == step
            assert {n: p.data_ptr() for n, p in model.named_parameters()} == arena_ptrs  # no copy per step
            for n, p in model.named_parameters():
                assert torch.equal(ep.tensors[n], p.detach().to(torch.bfloat16)), (n, step)
