"""Frontier scale: inference replicas and per-rank planning.

* A recipe over ``k * tp`` inference ranks is ``k`` replicas of TP-``tp``: rank ``i`` holds exactly
  what a single TP group's rank ``i % tp`` holds, every replica refits bit for bit through the engine
  (one host, and two hosts of the host harness where one host holds both replicas and receives each
  byte once).
* ``plan_reshard(..., rank=r)`` is exactly the whole plan's ops with source or destination ``r``
  (property-tested on random layouts, replicated sources and overlapping meshes included).
* Ranks that disagree on their planning inputs still raise one and the same ``ValueError``.
"""
import contextlib
import math

import pytest
import torch
import torch.distributed as dist
from _mp import free_port, run_ranks
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tritonreshard as trs
from tritonreshard import Layout, Part, Replicate, Shard
from tritonreshard.engine import Member, validate_members
from tritonreshard.engine.members import inputs_digest
from tritonreshard.planning import plan_hosts, plan_rank, replicas

pytestmark = pytest.mark.timeout(300)

TRAINERS = [0, 1]


def _llama(tp, k, trainers=TRAINERS, dtype=torch.float32):
    transformers = pytest.importorskip("transformers")
    # vocab 100 pads to 128 (zero rows on the last TP rank); GQA: 4 heads, 2 KV heads, so TP-4
    # replicates KV heads inside a TP group too.
    config = transformers.LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    first = max(trainers) + 1
    return trs.recipes.hf_to_vllm(config, tp=tp, trainer_ranks=trainers,
                                  inference_ranks=list(range(first, first + k * tp)), dtype=dtype,
                                  src_dtype=torch.float32)


def _slice(plan, rank):
    return (tuple(op for op in plan.ops if rank in (op.src_rank, op.dst_rank)),
            tuple(f for f in plan.fills if f.dst_rank == rank))


# ---------------------------------------------------------------------------------------- recipes
@pytest.mark.parametrize("tp,k", [(1, 3), (2, 2), (4, 2)])
def test_replica_ranks_hold_what_one_tp_group_holds(tp, k):
    one, many = _llama(tp, 1), _llama(tp, k)
    first = max(TRAINERS) + 1
    assert set(one.dst) == set(many.dst) and one.parts == many.parts
    for name, lay in many.dst.items():
        assert lay.ranks == tuple(range(first, first + k * tp))
        for i in range(k * tp):
            assert lay.segments(first + i) == one.dst[name].segments(first + i % tp), (name, i)
            assert lay.local_shape(first + i) == one.dst[name].local_shape(first + i % tp)
    whole, single = many.plan(), one.plan()
    # Each replica reads what the single group reads (same boxes, same sources), once per replica.
    def boxes(ops):
        return sorted((op.name, op.src_name, op.src_rank, tuple((x.start, x.stop) for x in op.src_slices),
                       tuple((x.start, x.stop) for x in op.dst_slices)) for op in ops)

    for i in range(k * tp):
        assert boxes(whole.ops_for_dst(first + i)) == boxes(single.ops_for_dst(first + i % tp)), i
    assert whole.stats.total_bytes == k * single.stats.total_bytes
    assert whole.stats.fill_bytes == k * single.stats.fill_bytes > 0
    with pytest.raises(ValueError, match=r"inference_ranks has 5 ranks, not a multiple of tp=2"):
        trs.recipes.hf_to_vllm(_config(), tp=2, trainer_ranks=TRAINERS, inference_ranks=[2, 3, 4, 5, 6])


def _config():
    transformers = pytest.importorskip("transformers")
    return transformers.LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=8)


def test_replicated_trainers_balance_reads_and_hosts_receive_once():
    """HSDP trainers (2 replicas x FSDP-2) -> 2 inference replicas of TP-2: the trainers' egress is
    balanced over trainer replicas, and with one host per inference replica each host receives
    each byte it needs once; with both replicas on one host that host still receives it once."""
    spec = _llama(2, 2, trainers=[0, 1, 2, 3])
    src = {n: Layout(lay.shape, [[0, 1], [2, 3]], [Replicate(), Shard(0)], lay.dtype) for n, lay in spec.src.items()}
    plan = trs.plan_reshard(src, spec.dst, spec.parts)
    send = plan.stats.send_bytes
    assert set(send) == {0, 1, 2, 3}
    assert max(send.values()) <= 1.25 * sum(send.values()) / 4, send
    model = sum(lay.numel * lay.itemsize for lay in src.values())
    trainers = {r: "t" for r in range(4)}
    for where in ({4: "b", 5: "b", 6: "c", 7: "c"}, {4: "b", 5: "b", 6: "b", 7: "b"}):
        hp = plan_hosts(plan, {**trainers, **where})
        into = {}
        for t in hp.transfers:
            into[where[t.receiver]] = into.get(where[t.receiver], 0) + t.nbytes
        # Every inference host needs every source byte (the vocab padding never crosses): once each.
        assert into == {h: model for h in set(where.values())}, into


# ------------------------------------------------------------------------------ per-rank planning
@contextlib.contextmanager
def _knobs(**kw):
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(replicas, "KNOBS", replicas.Knobs(**kw))
        yield


def _placements(draw, ndim, mesh_ndim):
    out = []
    for _ in range(mesh_ndim):
        d = draw(st.integers(-1, ndim - 1))
        out.append(Replicate() if d < 0 else Shard(d))
    return out


@st.composite
def _case(draw):
    n_tensors = draw(st.integers(1, 3))
    src, dst, parts = {}, {}, {}
    for i in range(n_tensors):
        ndim = draw(st.integers(1, 3))
        shape = tuple(draw(st.integers(0, 9)) for _ in range(ndim))
        layouts = []
        for _side in ("src", "dst"):
            mesh_shape = draw(st.sampled_from([(1,), (2,), (3,), (4,), (2, 2), (2, 3), (3, 2)]))
            first = draw(st.integers(0, 6))
            ranks = list(range(first, first + math.prod(mesh_shape)))
            if draw(st.booleans()):
                ranks.reverse()
            mesh = ranks if len(mesh_shape) == 1 else [ranks[j:j + mesh_shape[1]]
                                                        for j in range(0, len(ranks), mesh_shape[1])]
            layouts.append(Layout(shape, mesh, _placements(draw, ndim, len(mesh_shape)),
                                  draw(st.sampled_from([torch.float32, torch.bfloat16]))))
        src[f"t{i}"], dst[f"t{i}"] = layouts
        if draw(st.integers(0, 2)) == 0:   # read from the tensor or a copy of it on other ranks (aliases)
            lay, shift = layouts[0], draw(st.sampled_from([3, 10]))   # 3: the meshes may overlap
            copy = Layout(lay.shape, torch.tensor(lay.ranks).reshape(lay.mesh_shape).add(shift).tolist(),
                          lay.placements, lay.dtype)
            if all(lay.segments(r) == copy.segments(r) for r in set(lay.ranks) & set(copy.ranks)):
                src[f"c{i}"] = copy
                parts[f"t{i}"] = [Part(draw(st.sampled_from([(f"t{i}", f"c{i}"), (f"c{i}", f"t{i}")])),
                                       [None] * len(lay.shape))]
    return src, dst, parts


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(case=_case(), min_split=st.sampled_from([1, 8, 4096]), slack=st.sampled_from([1.0, 1.05, 3.0]))
def test_property_rank_plans_are_exactly_slices_of_the_whole_plan(case, min_split, slack):
    src, dst, parts = case
    with _knobs(min_split_bytes=min_split, slack=slack):
        whole = trs.plan_reshard(src, dst, parts)
        ranks = sorted({r for lay in (*src.values(), *dst.values()) for r in lay.ranks})
        union = set()
        for r in ranks + [99]:   # 99: in no mesh, so it has nothing to do
            mine = trs.plan_reshard(src, dst, parts, rank=r)
            assert mine.rank == r and (mine.ops, mine.fills) == _slice(whole, r), r
            union.update(mine.ops)
        assert union == set(whole.ops)


def test_recipe_rank_plans_are_slices_with_parts_fills_and_replicas():
    spec = _llama(4, 2)
    whole = spec.plan()
    assert whole.rank is None and "'s part" not in whole.summary()
    for r in range(2 + 8):
        mine = spec.plan(rank=r)
        assert (mine.ops, mine.fills) == _slice(whole, r), r
        assert f"rank {r}'s part" in mine.summary()
    with pytest.raises(ValueError, match=r"rank=-1 must be None"):
        spec.plan(rank=-1)


def test_megatron_tied_embedding_rank_plans_are_slices():
    """Megatron's tied embedding on two stages is one aliased part: every rank's plan (plain and
    block-FP8) is its slice of the whole, and both stages serve the embedding's reads."""
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen2Config(vocab_size=300, hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                                      head_dim=128, intermediate_size=256, num_hidden_layers=2,
                                      tie_word_embeddings=True)
    for quantization in (None, "fp8-block"):
        spec = trs.recipes.megatron_to_vllm(config, megatron=trs.recipes.Megatron(tp=2, pp=2), tp=2, trainer_ranks=4,
                                            inference_ranks=[4, 5], quantization=quantization)
        whole = spec.plan()
        assert {(op.src_name, op.src_rank) for op in whole.ops if op.name == "model.embed_tokens.weight"} == {
            ("embedding.word_embeddings.weight", 0), ("embedding.word_embeddings.weight", 1),
            ("output_layer.weight", 2), ("output_layer.weight", 3)}
        for r in range(6):
            assert (spec.plan(rank=r).ops, spec.plan(rank=r).fills) == _slice(whole, r), (quantization, r)


def test_rank_plan_cost_follows_the_rank_not_the_world():
    """More replicas add destination ranks; one destination rank's plan has the same ops."""
    a, b = _llama(2, 2), _llama(2, 8)
    assert len(a.plan(rank=2).ops) == len(b.plan(rank=2).ops)
    assert len(b.plan(rank=0).ops) == 4 * len(a.plan(rank=0).ops)   # a trainer serves each replica


# --------------------------------------------------------------------------- agreement (digests)
def _members(dst_for_rank2=None, world=3, parts2=None):
    src = {"w": Layout((4, 4), [0], [Replicate()])}
    dst = {"w": Layout((4, 4), [1, 2], [Shard(0)])}
    d2 = dst_for_rank2 or dst

    def member(rank, s, d, parts, ws=world):
        m = Member(rank, 100 + rank, "h", "cpu", s, d, (), parts, world_size=ws,
                   src_digest=inputs_digest(s), dst_digest=inputs_digest(d, parts))
        return m
    return [member(0, src, None, None), member(1, None, dst, {}), member(2, None, d2, parts2 or {})]


def test_disagreement_is_one_and_the_same_error_on_every_rank():
    ok = _members()
    agreed = validate_members(ok, 3)
    plans = [plan_rank(agreed.src_layouts, agreed.dst_layouts, agreed.hosts, r, parts=agreed.parts,
                       quant=agreed.quant).plan for r in range(3)]
    assert [p.rank for p in plans] == [0, 1, 2] and sum(len(p.ops_for_dst(r)) for r, p in enumerate(plans)) == 2
    bad_cases = [
        (_members(dst_for_rank2={"w": Layout((4, 4), [1, 2], [Shard(1)])}),
         "rank 2 joined with dst_layouts['w']=[S(1)]@(1,2)"),
        (_members(parts2={"w": [Part("w", [None, None])]}), "rank 2 joined with parts['w']="),
        # Equal-looking inputs of another digest (a rank that hashed something else) are named too.
        ([*_members()[:2], Member(2, 102, "h", "cpu", None, _members()[2].dst_layouts, (), {}, world_size=3,
                                  dst_digest="0" * 64)], "rank(s) [2] joined with dst inputs of another digest"),
        ([*_members()[:2], Member(2, 102, "h", "cpu", None, _members()[2].dst_layouts, (), {}, world_size=4,
                                  dst_digest=_members()[2].dst_digest)], "rank(s) [2] joined with world_size [4]"),
    ]
    for members, expect in bad_cases:
        # Every rank checks the same members (in any order they arrived): one and the same error.
        messages = set()
        for order in (members, members[::-1]):
            with pytest.raises(ValueError) as e:
                validate_members(sorted(order, key=lambda m: m.rank), 3)
            messages.add(str(e.value))
        assert len(messages) == 1, messages
        assert expect in messages.pop()


def test_trainers_that_start_from_different_versions_are_refused_naming_each():
    """After a partition one trainer may have published a version more than another (a publish does
    not wait for its sends); an epoch they form with what each was at would leave their readers
    waiting for a version common to both that never comes. Refused at hello, naming each."""
    src = {"w": Layout((4, 4), [0, 1], [Shard(0)])}
    dst = {"w": Layout((4, 4), [2], [Replicate()])}

    def member(rank, s, d, start=0):
        return Member(rank, 100 + rank, "h", "cpu", s, d, (), None if d is None else {}, world_size=3,
                      src_digest=inputs_digest(s), dst_digest=inputs_digest(d, {}), start_version=start)
    assert validate_members([member(0, src, None, 6), member(1, src, None, 6), member(2, None, dst)], 3)
    with pytest.raises(ValueError) as e:
        validate_members([member(0, src, None, 6), member(1, src, None, 7), member(2, None, dst)], 3)
    assert ("the trainers start from different versions (rank(s) [0] start_version=6, rank(s) [1] "
            "start_version=7): every trainer of an epoch passes the same start_version") in str(e.value), str(e.value)


def _start_worker(rank, port):
    src = {"w": Layout((4, 4), [0, 1], [Shard(0)])}
    dst = {"w": Layout((4, 4), [2], [Replicate()])}
    meeting = trs.Meeting(rank=rank, world_size=3, store=f"127.0.0.1:{port}")
    if rank == 2:
        trs.RefitInference(dst, meeting, timeouts=trs.Timeouts(wait=30))
    else:
        trs.RefitTrainer({"w": torch.zeros(2, 4)}, src, meeting, start_version=6 + rank, timeouts=trs.Timeouts(wait=30))


def test_the_endpoint_tells_the_group_its_start_version():
    out = run_ranks(_start_worker, 3, args=(free_port(),), timeout=120, allow_errors=True)
    for r in range(3):
        kind, err = out[r]
        assert kind == "error" and err[0] == "ValueError", out[r]
        assert "rank(s) [0] start_version=6, rank(s) [1] start_version=7" in err[1], err[1]


@pytest.mark.parametrize("hosts", [{0: "a", 1: "a", 2: "b", 3: "b", 4: "c", 5: "c"},
                                   {0: "a", 1: "b", 2: "b", 3: "c", 4: "c", 5: "a"},
                                   {0: "a", 1: "b", 2: "a", 3: "b", 4: "a", 5: "b"}],
                         ids=["trainers-apart", "mixed", "colocated"])
def test_routes_across_hosts_from_host_parts_are_the_whole_plans_routes(hosts):
    """On several hosts each rank plans only its host (its own plan and its host's destination
    ranks'), each host posts its part's transfers, and every rank's route (reads, fences, sends,
    receives, buffers, messages), from the summaries and its own sends only, is the one the whole
    plan gives."""
    from test_route import assert_route_is, reference_route, routes_of

    spec = _llama(2, 2)   # two replicas of TP-2 on ranks 2..5, FP32 trainers 0, 1
    world = 6
    whole = spec.plan()
    offsets, pos = {}, {}
    for n in sorted(spec.src):   # arenas: each rank's shards back to back, in name order
        for r in spec.src[n].ranks:
            offsets[(r, n)] = pos.get(r, 0)
            pos[r] = pos.get(r, 0) + -(-spec.src[n].local_numel(r) * spec.src[n].itemsize // 256) * 256
    src, dst = dict(spec.src), dict(spec.dst)
    routes = routes_of(src, dst, hosts, offsets, parts=dict(spec.parts))
    assert sorted(routes) == list(range(world))
    for r in range(world):
        assert_route_is(routes[r], reference_route(whole, hosts, r, offsets))
        # Planned from its host's ranks only: never an op between two ranks off its host.
        rp = plan_rank(src, dst, hosts, r, parts=dict(spec.parts))
        assert all(hosts[r] in (hosts[op.src_rank], hosts[op.dst_rank]) for op in rp.plan.ops)
    assert any(route.sends for route in routes.values())


def _join_all(members, world):
    """Every rank's first set-up steps (``Epoch.agree``) on one store (threads): ``{rank: rank
    plan or the ValueError text}`` and the store's keys as the ranks left them."""
    import threading

    from tritonreshard.engine import rendezvous as rdv
    from tritonreshard.engine.epoch import Epoch
    from tritonreshard.engine.group import Group

    master = rdv.connect_store("127.0.0.1:0", world_size=1, is_master=True, timeout=30)
    out = {}

    def run(m):
        store = rdv.connect_store(f"127.0.0.1:{master.port}", world_size=1, is_master=False, timeout=30)
        epoch = Epoch(Group(store, rank=m.rank, world_size=world, timeout=30, name="slim"))
        try:
            out[m.rank] = epoch.agree(m)   # hello, inputs, rank plan
        except ValueError as exc:
            out[m.rank] = str(exc)
        finally:
            epoch.close()
    threads = [threading.Thread(target=run, args=(m,)) for m in members]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out, dist.PrefixStore("trs/slim/e0/", master)   # the epoch's keys, as Group names them


def test_the_hello_carries_digests_and_the_inputs_travel_once_per_side():
    spec = _llama(2, 2)
    world = 6

    def member(r, dst=spec.dst):
        if r in TRAINERS:
            return Member(r, 100 + r, "h", "cpu", dict(spec.src))
        return Member(r, 100 + r, "h", "cpu", None, dict(dst), (), dict(spec.parts))
    out, store = _join_all([member(r) for r in range(world)], world)
    assert all(out[r].rank == r for r in range(world)), out
    raw = {k: store.get(k) for k in [f"hello/{r}" for r in range(world)]}
    assert all(b"placements" not in v and b"Shard" not in v for v in raw.values())
    assert max(map(len, raw.values())) < 2048   # digests, not layouts
    have = {k: store.check([k]) for k in
            ["inputs/src/0", "inputs/src/1", "inputs/dst/2", "inputs/dst/3", "inputs/dst/5"]}
    assert have == {"inputs/src/0": True, "inputs/src/1": False, "inputs/dst/2": True, "inputs/dst/3": False,
                    "inputs/dst/5": False}
    # A rank that disagrees sends its inputs too: one error, the same on every rank, naming them.
    other = {**spec.dst, "lm_head.weight": Layout(spec.dst["lm_head.weight"].shape, [2, 3, 4, 5],
                                                  [Replicate()], spec.dst["lm_head.weight"].dtype)}
    out, store = _join_all([member(r) for r in range(5)] + [member(5, other)], world)
    assert len(set(out.values())) == 1 and isinstance(out[0], str), out
    assert "rank 5 joined with dst_layouts['lm_head.weight']=[R]@(2,3,4,5)" in out[0]
    assert store.check(["inputs/dst/5"]) and not store.check(["inputs/dst/4"])


# ------------------------------------------------------------------------ engine: replicas, exact
def _full(name_id, layout, version):
    n = math.prod(layout.shape)
    return (torch.arange(n, dtype=torch.float64) + 1000 * version + 100000 * name_id).reshape(layout.shape)


def _shards(src, rank, version):
    ids = {n: i + 1 for i, n in enumerate(sorted(src))}
    return {n: lay.shard(_full(ids[n], lay, version).to(lay.dtype), rank) for n, lay in src.items()
            if rank in lay.ranks}


def _bits(t):
    return t.contiguous().view(torch.uint8)


def _replica_worker(rank, world, addr, port, tp, k, versions):
    torch.set_num_threads(1)
    spec = _llama(tp, k)
    kwargs = dict(meeting=trs.Meeting(rank=rank, world_size=world, store=f"{addr}:{port}"),
                  timeouts=trs.Timeouts(wait=90))
    trainer = rank in TRAINERS
    if trainer:
        ep = trs.RefitTrainer.from_recipe(spec, _shards(spec.src, rank, 1), **kwargs)
    else:
        poison = {n: torch.full(lay.local_shape(rank), float("nan"), dtype=lay.dtype)
                  for n, lay in spec.dst.items()}
        ep = trs.RefitInference.from_recipe(spec, tensors=poison, pull=trs.PullOptions(mode="shadow"), **kwargs)
    report = {"checked": 0, "plan_rank": ep.plan.rank}
    with ep:
        # The same replica's TP rank in a single TP group: what this rank must hold, bit for bit.
        single = _llama(tp, 1)
        me = None if trainer else TRAINERS[-1] + 1 + (rank - TRAINERS[-1] - 1) % tp
        for v in range(1, versions + 1):
            if trainer:
                ep.fence()
                if v > 1:
                    for n, t in _shards(spec.src, rank, v).items():
                        ep.source_tensors[n].copy_(t)
                assert ep.publish() == v
                continue
            assert (ep.start_pull() if v > 1 else ep.pull()) == v
            if v > 1:
                assert ep.swap() == v
            want = _expected(single, me, v)
            assert sorted(ep.tensors) == sorted(want)
            for n, t in ep.tensors.items():
                assert not torch.isnan(t).any(), (rank, n, v)
                assert torch.equal(_bits(t), _bits(want[n])), (rank, n, v)
            report["checked"] += 1
        if trainer:
            ep.fence()
        st = ep.stats
        report["cross_host_bytes"] = st.cross_host_bytes
        report["cross_host_split"] = (st.cross_host_dense_bytes, st.cross_host_delta_bytes, st.cross_host_changed)
    return report


def _expected(single, dst_rank, version):
    """What TP rank ``dst_rank`` of one TP group holds at ``version`` (vLLM's shapes, zero padding)."""
    plan = single.plan()
    out = trs.execute_local(plan, {r: _shards(single.src, r, version) for r in TRAINERS}, backend="torch")
    return out[dst_rank]


def test_two_replicas_refit_bit_exact_through_the_engine():
    tp, k = 2, 2
    world = len(TRAINERS) + k * tp
    out = run_ranks(_replica_worker, world, args=(world, "127.0.0.1", free_port(), tp, k, 2), timeout=280)
    assert all(out[r]["checked"] == 2 for r in range(2, world))
    # One host: every rank planned only its own part.
    assert [out[r]["plan_rank"] for r in range(world)] == list(range(world))


def test_two_replicas_on_another_host_refit_bit_exact_each_byte_crossing_once(two_hosts):
    """Trainers on host0, both replicas on host1 of the host harness (a network, /dev/shm and
    hostname each): each source byte crosses into host1 once per refit, then fans out there."""
    tp, k = 2, 2
    world = len(TRAINERS) + k * tp
    out = two_hosts.run_ranks(_replica_worker, [0, 0, 1, 1, 1, 1],
                              args=(world, two_hosts.address(0), free_port(), tp, k, 2), timeout=280)
    assert all(out[r]["checked"] == 2 for r in range(2, world))
    spec = _llama(tp, k)
    model = sum(lay.numel * lay.itemsize for lay in spec.src.values())
    got = {r: (out[r]["cross_host_bytes"], out[r]["cross_host_split"]) for r in range(2, world)}
    assert sum(b for b, _ in got.values()) == model, (f"model {model} B; per rank (bytes, (dense, delta, changed)): "
                                                      f"{got}")


# ---------------------------------------------------------------------- traffic model and the CLI
@pytest.mark.parametrize("hosts", [None, {0: "a", 1: "a", 2: "b", 3: "b", 4: "c", 5: "c"},
                                   {0: "a", 1: "b", 2: "b", 3: "b", 4: "c", 5: "c"}])
def test_traffic_model_matches_the_plan_and_the_host_plan(hosts):
    """Where the whole plan can be made, the model's bytes are the plan's (one host) and the host
    plan's (each host's ingress, each sender's cross-host bytes)."""
    spec = _llama(2, 2)
    plan = spec.plan()
    t = trs.planning.refit_traffic(spec.src, spec.dst, spec.parts, hosts)
    host_of = hosts or {r: "h" for r in range(6)}
    hp = plan_hosts(plan, host_of)
    assert t.in_within == {r: b for r, b in plan.stats.recv_bytes.items()}
    ingress = {}
    for x in hp.transfers:
        ingress[host_of[x.receiver]] = ingress.get(host_of[x.receiver], 0) + x.nbytes
    assert {h: b for h, b in t.host_ingress.items() if b} == ingress
    assert {r: b for r, b in t.out_across.items() if b} == \
        {r: sum(x.nbytes for x in hp.transfers if x.src_rank == r) for r in {x.src_rank for x in hp.transfers}}
    assert sum(t.in_across.values()) == hp.cross_host_bytes
    if hosts is None:
        assert t.out_within == plan.stats.send_bytes
        assert t.pieces == {r: len(plan.ops_for_dst(r)) + len(plan.ops_for_src(r)) for r in range(6)}


def _config_of(fields):
    from types import SimpleNamespace
    return SimpleNamespace(**fields)


def test_plan_model_mode_prints_the_lower_bound_and_says_it_is_a_model(tmp_path, capsys):
    from tritonreshard.apps.cli import main
    cfg = {"model_type": "llama", "vocab_size": 100, "hidden_size": 32, "intermediate_size": 48,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8}
    path = tmp_path / "config.json"
    path.write_text(__import__("json").dumps(cfg))
    argv = ["plan", "--model", str(path), "--trainers", "2", "--tp", "2", "--replicas", "2", "--hosts-of", "2",
            "--link", "h100-nvlink,ib-400g"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "MODEL, not a measurement" in out and "FSDP-2 trainers -> 2 replica(s) x TP-2" in out
    # Trainers on host0, each replica on its own host: each receives the model once, over IB.
    spec = trs.recipes.hf_to_vllm(_config_of(cfg), tp=2, trainer_ranks=[0, 1], inference_ranks=[2, 3, 4, 5],
                                  dtype=torch.bfloat16, src_dtype=torch.bfloat16)
    model = sum(lay.numel * 2 for lay in spec.src.values())
    t = trs.planning.refit_traffic(spec.src, spec.dst, spec.parts, {r: f"host{r // 2}" for r in range(6)})
    busiest = max(max(t.out_across.values()), max(t.in_across.values()))
    assert t.host_ingress == {"host1": model, "host2": model}
    assert f"lower bound of one refit: {busiest / 50e9:.3f} s" in out and "ib-400g, 50 GB/s" in out
    links = tmp_path / "links.json"
    links.write_text('{"within": {"name": "fast", "GBps": 1000}, "across": {"name": "slow", "GBps": 1}}')
    assert main(argv[:-1] + [str(links)]) == 0
    assert f"lower bound of one refit: {busiest / 1e9:.3f} s" in capsys.readouterr().out
    assert main(["plan", "--model", str(path), "--trainers", "0", "--tp", "3", "--link", "warp-drive"]) == 2
    err = capsys.readouterr().err
    assert "--trainers must be a positive int, got 0" in err


def test_plan_model_mode_prints_each_modes_refit_memory_and_what_fits(tmp_path, capsys):
    """The refit's extra memory per inference GPU, per mode, is the mode's buffer sets times the
    bytes the busiest inference rank pulls (a vLLM worker serves its own parameters: every set is
    extra; a RefitInference serves one of its own), and each GPU size says what is left or that
    the mode does not fit; a bad size is refused by name."""
    from tritonreshard.apps.cli import main
    from tritonreshard.planning import fmt_bytes
    from tritonreshard.serving import BackgroundPull, InlinePull
    cfg = {"model_type": "llama", "vocab_size": 100, "hidden_size": 32, "intermediate_size": 48,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8}
    path = tmp_path / "config.json"
    path.write_text(__import__("json").dumps(cfg))
    spec = trs.recipes.hf_to_vllm(_config_of(cfg), tp=2, trainer_ranks=[0, 1], inference_ranks=[2, 3],
                                  dtype=torch.bfloat16, src_dtype=torch.bfloat16)
    weights = max(sum(math.prod(lay.local_shape(r)) * 2 for lay in spec.dst.values() if r in lay.ranks)
                  for r in (2, 3))
    gib = weights * 2.5 / 2**30   # room for the weights and one more set, not two
    assert main(["plan", "--model", str(path), "--trainers", "2", "--tp", "2", "--gpu-gib", f"{gib!r}"]) == 0
    out = capsys.readouterr().out
    assert f"weights {fmt_bytes(weights)}; beside them:" in out
    lines = {line.split("  ")[1].strip(): line for line in out.splitlines() if line.startswith("  vLLM")
             or line.startswith("  RefitInference")}
    for name, sets in (("vLLM, background pull (prefetch on, default)", BackgroundPull.BUFFER_SETS),
                       ("vLLM, prefetch off, direct=False", InlinePull.BUFFER_SETS),
                       ("RefitInference, Shadow()", 1), ("RefitInference, InPlace()", 0)):
        line = next(v for k, v in lines.items() if k.startswith(name))
        assert f"{sets}x = {fmt_bytes(sets * weights)}" in line, line
        assert ("does not fit" in line) == (sets >= 2), line
    # The direct pull of a dense unquantized model on CUDA writes every parameter in place.
    line = next(v for k, v in lines.items() if k.startswith("vLLM, direct pull (prefetch off; CUDA)"))
    assert "0.00x = 0 B" in line and "does not fit" not in line, line
    # With MoE experts (their kernel format is post-processed) it streams one experts layer at a time.
    moe = {"model_type": "qwen3_moe", "vocab_size": 100, "hidden_size": 32, "intermediate_size": 48,
           "moe_intermediate_size": 16, "num_experts": 4, "num_experts_per_tok": 2, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "mlp_only_layers": [1],
           "decoder_sparse_step": 1, "norm_topk_prob": True}
    path.write_text(__import__("json").dumps(moe))
    import transformers  # here, not at the top: the rest of this module runs without it

    spec = trs.recipes.hf_to_vllm(transformers.Qwen3MoeConfig(**{k: v for k, v in moe.items() if k != "model_type"}),
                                  tp=2, trainer_ranks=[0, 1], inference_ranks=[2, 3], dtype=torch.bfloat16,
                                  src_dtype=torch.bfloat16)
    experts = [n for n in spec.dst if ".experts." in n]
    layer = max(sum(math.prod(spec.dst[n].local_shape(r)) * 2 for n in experts if n.startswith(f"model.layers.{i}."))
                for i in range(2) for r in (2, 3))
    assert experts and layer > 0
    assert main(["plan", "--model", str(path), "--trainers", "2", "--tp", "2"]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if "vLLM, direct pull" in ln)
    assert f"= {fmt_bytes(layer)}" in line, (line, layer)
    with pytest.raises(SystemExit) as exit_:
        main(["plan", "--model", str(path), "--gpu-gib", "80,-1"])
    assert exit_.value.code == 2 and "--gpu-gib" in capsys.readouterr().err


# ------------------------------------------------------------------------------- bench --replicas
def test_bench_replicas_trainer_egress_once_per_replica_and_once_per_host(tmp_path):
    """``tritonreshard bench --layout fsdp-tp --replicas 2``: on one host the trainers serve each
    replica once (the plan's reads: twice the model); with both replicas on one other host
    (``--hosts 2``) the engine's route sends the model into that host once, and the replicas fan it
    out there."""
    import json
    import subprocess
    import sys

    from tritonreshard.apps.bench.config import BenchConfig
    from tritonreshard.apps.bench.model import build_model, layouts

    cfg = BenchConfig(size=1 << 20, layout="fsdp-tp", trainers=2, inference=4, replicas=2)
    src, dst = layouts(cfg, build_model(cfg))
    model = sum(lay.numel * lay.itemsize for lay in src.values())
    # On one host every rank reads the trainers' arenas itself: each replica reads the model once,
    # plus, for the tensors replicated within TP (norms), one more copy per extra TP rank.
    norms = sum(lay.numel * lay.itemsize for n, lay in dst.items() if lay.placements == (Replicate(), Replicate()))
    assert 0 < norms < model / 100
    assert sum(trs.plan_reshard(src, dst).stats.send_bytes.values()) == 2 * (model + norms)
    assert dst["embed.weight"].mesh == ((2, 3), (4, 5))
    assert "--inference=4 is not a multiple of --replicas=3" in " ".join(
        BenchConfig(layout="fsdp-tp", replicas=3).problems())
    assert "--replicas=2 needs a TP layout" in " ".join(BenchConfig(layout="cols-replicas", replicas=2).problems())

    script = tmp_path / "run_bench.py"   # a file, not -c: spawned ranks re-import the main module
    script.write_text("import argparse, sys, tritonreshard.apps.bench as b\n"
                      "if __name__ == '__main__':\n"
                      "    p = argparse.ArgumentParser(); b.add_arguments(p)\n"
                      "    raise SystemExit(b.run(p.parse_args(sys.argv[1:])))\n")
    out = subprocess.run([sys.executable, str(script), "--layout", "fsdp-tp", "--replicas", "2", "--hosts", "2",
                          "--size", "1MiB", "--methods", "tritonreshard", "--repeats", "2", "--warmup", "1",
                          "--json"], capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-4000:]
    data = json.loads(out.stdout.strip().splitlines()[-1])
    ours = data["results"]["tritonreshard"]
    assert ours["verified"] is True and data["replicas"] == 2 and data["model_bytes"] == model
    assert ours["trainer_egress_bytes"] == ours["cross_host_bytes"] == model
    assert "trainers' egress per refit: 1023.8 KiB for 2 inference replica(s)" in out.stdout


def test_vllm_init_info_names_the_replica_and_checks_it():
    """Each engine (one per replica) gets the same ranks and its own ``replica``; its workers join as
    ``inference_ranks[replica * tp + tp rank]`` (checked against vLLM's TP size in the worker)."""
    from tritonreshard.vllm import init_info

    infos = [init_info(store="127.0.0.1:9", trainer_ranks=[0, 1], inference_ranks=[2, 3, 4, 5], replica=i)
             for i in range(2)]
    assert [i["replica"] for i in infos] == [0, 1] and infos[0]["inference_ranks"] == [2, 3, 4, 5]
    with pytest.raises(ValueError) as e:
        init_info(store="nohost", trainer_ranks=[0, 1], inference_ranks=[2, 3], replica=2)
    assert "replica=2 must be an int in [0, number of replicas)" in str(e.value)
    assert "store must be 'host:port'" in str(e.value)
