"""Bad input, fuzzed: whatever garbage reaches the public API, the answer is a ValueError or TypeError
naming the parameter, raised before any byte moves (outputs are poisoned and compared after the
error). Never a crash, a hang, another exception type or a partial write.

Covers ``trs.Layout``, ``trs.plan_reshard``, the CLI spec parser and ``main(["plan", ...])``,
``trs.execute_local`` (wrong shapes / dtypes / devices / missing ranks / overlapping or read-only
outputs) and, in-process, a one-rank colocated ``RefitEndpoint`` (rank 0 is trainer and inference).
"""
import contextlib
import io

import pytest
import torch
from _mp import free_port
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

import tritonreshard as trs
from tritonreshard import Layout, Replicate, Shard
from tritonreshard.apps.cli import main, parse_layout_spec

pytestmark = pytest.mark.timeout(300)

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
SLOW_FUZZ = settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))

ints = st.integers(-3, 9)
garbage = st.one_of(
    st.none(), st.booleans(), ints, st.floats(allow_nan=True), st.text(max_size=4), st.binary(max_size=3),
    st.just(torch.float32), st.just(object()), st.just(torch.zeros(2)), st.just({"a": 1}),
    st.lists(ints, max_size=3), st.tuples(ints, st.text(max_size=2)),
)
placement = st.one_of(
    st.builds(Shard, ints), st.builds(Shard, ints, st.lists(ints, max_size=3).map(tuple)),
    st.builds(Shard, ints, st.none(), st.one_of(st.booleans(), garbage)),
    st.just(Replicate()), garbage,
    st.builds(Shard, garbage),
)
shape = st.one_of(st.lists(ints, max_size=3).map(tuple), garbage)
mesh = st.one_of(ints, st.lists(ints, max_size=4), st.lists(st.lists(ints, max_size=3), max_size=3),
                 st.lists(garbage, max_size=3), garbage)
dtype = st.one_of(st.sampled_from([torch.float32, torch.bfloat16, torch.int8, torch.float64]), garbage)
placements = st.one_of(st.lists(placement, max_size=3), placement)


def _build_shard_or_error(make):
    """Shard/Replicate construction itself may refuse garbage; that is fine if it's a clear error."""
    try:
        return make()
    except (TypeError, ValueError) as exc:
        assert str(exc)
        return None


LAYOUT_PARAMS = ("shape", "mesh", "placements", "dtype")


@FUZZ
@given(shape, mesh, placements, dtype)
def test_layout_garbage_is_value_or_type_error(shp, msh, pls, dt):
    try:
        lay = Layout(shp, msh, pls, dt)
    except (ValueError, TypeError) as exc:
        # One ValueError lists every problem, each naming the parameter it is about.
        assert type(exc) is ValueError, repr(exc)
        head, *problems = str(exc).split("\n  - ")
        assert head == "invalid Layout:" and problems, str(exc)
        assert all(p.startswith(LAYOUT_PARAMS) for p in problems), str(exc)
        named = {p.split("=")[0].split("[")[0].split(" ")[0] for p in problems}
        if not isinstance(dt, torch.dtype):
            assert "dtype" in named and f"dtype={dt!r}" in str(exc), str(exc)
        if shp is None or isinstance(shp, (bool, int, float)):  # not a sequence at all
            assert "shape" in named, str(exc)
        if msh is None or isinstance(msh, (bool, float, dict)):
            assert "mesh" in named, str(exc)
        return
    # A layout that was accepted is usable on every rank.
    for r in lay.ranks:
        assert len(lay.local_shape(r)) == len(lay.shape)
    assert str(lay) and repr(lay)


@FUZZ
@given(st.builds(lambda: None) | garbage, ints)
def test_shard_construction_garbage(blocks, dim):
    _build_shard_or_error(lambda: Shard(dim, blocks))


valid_layout = st.builds(
    lambda n, k, pl, dt, first: Layout((n, 3), list(range(first, first + k)), [pl], dt),
    st.integers(0, 7), st.integers(1, 4), st.sampled_from([Shard(0), Shard(1), Shard(0, balanced=True), Replicate()]),
    st.sampled_from([torch.float32, torch.bfloat16, torch.int8]), st.integers(0, 3))
layout_dicts = st.one_of(
    st.dictionaries(st.sampled_from(["a", "b", "c"]), valid_layout, max_size=3),
    st.dictionaries(st.one_of(st.text(max_size=2), ints), st.one_of(valid_layout, garbage), max_size=2),
    garbage,
)


@FUZZ
@given(layout_dicts, layout_dicts)
def test_plan_reshard_mismatched_dicts(src, dst):
    try:
        plan = trs.plan_reshard(src, dst)
    except (ValueError, TypeError) as exc:
        assert str(exc)
        assert any(p in str(exc) for p in ("src_layouts", "dst_layouts")), str(exc)
        return
    assert set(plan.names) == set(dst)


spec_text = st.one_of(
    st.text(alphabet="0123456789x@:SR(),[]-bal ", max_size=16),
    st.from_regex(r"\A-?\d{1,2}(x\d{1,2}){0,2}(@-?\d{1,3})?:((S\(-?\d(,\[\d{0,2}(,\d{0,2}){0,2}\])?(,bal)?\)|R),?){0,3}\Z"),
    st.text(max_size=8),
)


@FUZZ
@given(spec_text, st.lists(st.integers(0, 9), min_size=1, max_size=3))
@example("0@@:", [0])  # once an int() error that named nothing
@example("2@1x:S(0)", [4])
def test_cli_spec_parser(spec, shp):
    try:
        lay = parse_layout_spec(spec, tuple(shp), torch.float32)
    except ValueError as exc:
        # Every problem names its flag: --src for the spec, --shape for the shape's.
        problems = str(exc).split("\n  - ")
        problems = problems[1:] if problems[0] == "invalid arguments:" else problems
        assert all(p.startswith(("--src=", "--shape:")) for p in problems), str(exc)
        return
    assert isinstance(lay, Layout)


@SLOW_FUZZ
@given(spec_text, spec_text, st.sampled_from(["8x8", "0", "3x5x2", "x", "-1x4", "12", "4x"]),
       st.sampled_from(["fp32", "bf16", "int8", "fp8"]))
def test_cli_main_plan_never_tracebacks(src, dst, shp, dt):
    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        try:
            rc = main(["plan", "--shape", shp, "--src", src, "--dst", dst, "--src-dtype", dt])
        except SystemExit as exc:  # argparse's own usage errors
            rc = exc.code
    assert rc in (0, 2), (rc, err.getvalue())
    if rc == 2:
        assert "error" in err.getvalue() and "Traceback" not in err.getvalue()


def test_cli_huge_mesh_is_a_clear_error():
    with pytest.raises(ValueError, match="--src"):
        parse_layout_spec("99999999999:S(0)", (8,), torch.float32)
    with pytest.raises(ValueError, match="--src"):
        parse_layout_spec("99999x99999x99999:R,R,R", (8,), torch.float32)


# ---------------------------------------------------------------------------------------------
# execute_local: destinations the engine can't write

SRC = {"w": Layout((5, 4), 2, [Shard(0)]), "b": Layout((3,), 2, [Replicate()], torch.bfloat16)}
DST = {"w": Layout((5, 4), [2, 3, 4], [Shard(1)], torch.bfloat16), "b": Layout((3,), [2, 3, 4], [Shard(0)],
                                                                              torch.bfloat16)}
PLAN = trs.plan_reshard(SRC, DST)
SENTINEL = -12345.0


def _sources():
    return {r: {n: lay.shard(torch.arange(lay.numel, dtype=torch.float32).reshape(lay.shape).to(lay.dtype), r)
                for n, lay in SRC.items()} for r in SRC["w"].ranks}


def _outs():
    return {r: {n: torch.full(lay.local_shape(r), SENTINEL, dtype=lay.dtype) for n, lay in DST.items()}
            for r in DST["w"].ranks}


def _corrupt(outs, kind, rank, name):
    t = outs[rank][name]
    if not isinstance(t, torch.Tensor):
        return outs
    if kind == "shape":
        outs[rank][name] = torch.full((t.shape[0] + 1,) + tuple(t.shape[1:]), SENTINEL, dtype=t.dtype)
    elif kind == "dtype":
        outs[rank][name] = torch.full(t.shape, SENTINEL, dtype=torch.float16)
    elif kind == "missing_rank":
        del outs[rank]
    elif kind == "missing_name":
        del outs[rank][name]
    elif kind == "not_tensor":
        outs[rank][name] = t.tolist()
    elif kind == "device":
        outs[rank][name] = torch.empty(t.shape, dtype=t.dtype, device="meta")
    elif kind == "expanded" and t.numel() <= 1:  # nothing to expand: corrupt the shape instead
        outs[rank][name] = torch.full((2,) * t.dim(), SENTINEL, dtype=t.dtype)
    elif kind == "expanded":  # one memory location for many elements
        outs[rank][name] = torch.full((1,) * t.dim(), SENTINEL, dtype=t.dtype).expand(t.shape)
    elif kind == "alias":  # two destinations share memory
        other = next((r for r in outs if r != rank and isinstance(outs[r], dict) and name in outs[r]), None)
        if other is not None:
            outs[rank][name] = outs[other][name]
        else:
            del outs[rank][name]
    elif kind == "inference":
        with torch.inference_mode():
            outs[rank][name] = torch.full(t.shape, SENTINEL, dtype=t.dtype)
    elif kind == "requires_grad":
        outs[rank][name] = t.clone().requires_grad_(t.dtype.is_floating_point)
    elif kind == "not_mapping":
        outs[rank] = t
    return outs


KINDS = ["shape", "dtype", "missing_rank", "missing_name", "not_tensor", "device", "expanded", "alias",
         "inference", "requires_grad", "not_mapping"]


def _snapshot(outs):
    return {(r, n): t.detach().clone() for r, d in outs.items() if isinstance(d, dict)
            for n, t in d.items() if isinstance(t, torch.Tensor) and t.device.type != "meta"}


@FUZZ
@given(st.lists(st.tuples(st.sampled_from(KINDS), st.sampled_from([2, 3, 4]), st.sampled_from(["w", "b"])),
                min_size=1, max_size=3), st.sampled_from(["torch", "auto"]))
def test_execute_local_rejects_unwritable_outputs_before_writing(faults, backend):
    outs = _outs()
    faults = list({(r, n): k for k, r, n in faults}.items())  # one fault per destination tensor
    for (rank, name), kind in faults:
        if rank in outs and isinstance(outs[rank], dict) and name in outs[rank]:
            outs = _corrupt(outs, kind, rank, name)
    before = _snapshot(outs)
    with pytest.raises((ValueError, TypeError)) as info:
        trs.execute_local(PLAN, _sources(), out=outs, backend=backend)
    assert "out" in str(info.value), str(info.value)
    for key, t in before.items():  # nothing was written anywhere, including valid outputs
        r, n = key
        assert torch.equal(outs[r][n].detach(), t), f"out[{r}][{n!r}] was written before the error"


def test_execute_local_names_every_problem_at_once():
    outs = _corrupt(_corrupt(_outs(), "expanded", 2, "w"), "alias", 3, "b")
    with pytest.raises(ValueError) as info:
        trs.execute_local(PLAN, _sources(), out=outs)
    msg = str(info.value)
    assert "out[2]['w']" in msg and "overlapping memory" in msg
    assert "out[3]['b']" in msg and "shares memory with out[" in msg


def test_execute_local_rejects_outputs_overlapping_sources():
    src = {"w": Layout((4, 4), [0], [Replicate()])}
    dst = {"w": Layout((4, 4), [1], [Replicate()])}
    plan = trs.plan_reshard(src, dst)
    x = torch.arange(16.0).reshape(4, 4)
    with pytest.raises(ValueError, match=r"out\[1\]\['w'\] shares memory with src_shards\[0\]\['w'\]"):
        trs.execute_local(plan, {0: {"w": x}}, out={1: {"w": x.t()}})
    assert torch.equal(x, torch.arange(16.0).reshape(4, 4))


def test_execute_local_interleaved_outputs_are_fine():
    # Strided views that interleave in one storage do not overlap: no false alarm.
    src = {"w": Layout((4, 4), [0], [Replicate()])}
    dst = {"w": Layout((4, 4), [1, 2], [Shard(1)])}
    plan = trs.plan_reshard(src, dst)
    full = torch.full((4, 4), SENTINEL)
    a, b = full[:, 0::2], full[:, 1::2]
    g = torch.arange(16.0).reshape(4, 4)
    trs.execute_local(plan, {0: {"w": g}}, out={1: {"w": a}, 2: {"w": b}})
    assert torch.equal(a, g[:, :2]) and torch.equal(b, g[:, 2:])


@FUZZ
@given(st.sampled_from(["shape", "dtype", "not_tensor", "missing_rank", "missing_name", "not_mapping"]),
       st.sampled_from([0, 1]), st.just("w"))  # (a replica nobody reads from isn't checked)
def test_execute_local_bad_sources(kind, rank, name):
    srcs = _sources()
    t = srcs[rank][name]
    if kind == "shape":
        srcs[rank][name] = t[:-1]
    elif kind == "dtype":
        srcs[rank][name] = t.to(torch.float64)
    elif kind == "not_tensor":
        srcs[rank][name] = None
    elif kind == "missing_rank":
        del srcs[rank]
    elif kind == "missing_name":
        del srcs[rank][name]
    else:
        srcs[rank] = [t]
    outs = _outs()
    before = _snapshot(outs)
    with pytest.raises((ValueError, TypeError), match="src_shards"):
        trs.execute_local(PLAN, srcs, out=outs)
    assert all(torch.equal(outs[r][n], v) for (r, n), v in before.items())


@FUZZ
@given(garbage, garbage)
def test_execute_local_garbage_arguments(src, out):
    assume(out is not None)
    with pytest.raises((ValueError, TypeError)):
        trs.execute_local(PLAN, src, out=out)


# ---------------------------------------------------------------------------------------------
# A one-rank colocated RefitEndpoint: the engine's own validation, in-process.

LAY = {"w": Layout((4, 6), [0], [Replicate()])}
DLAY = {"w": Layout((4, 6), [0], [Replicate()], torch.bfloat16)}


def _endpoint(src_tensors=None, dst_tensors=None, **kw):
    src = {"w": torch.arange(24.0).reshape(4, 6)} if src_tensors is None else src_tensors
    args = dict(meeting=trs.Meeting(rank=0, world_size=1, store=f"127.0.0.1:{free_port()}"),
                source=trs.SourceData(src, LAY), destination=trs.DestinationData(DLAY, tensors=dst_tensors),
                timeouts=trs.Timeouts(wait=5))
    args.update(kw)
    return trs.RefitEndpoint(**args)


def _bad_dst(kind):
    good = torch.full((4, 6), SENTINEL, dtype=torch.bfloat16)
    if kind == "shape":
        return good[:, :5].clone()
    if kind == "dtype":
        return good.float()
    if kind == "device":
        return torch.empty(4, 6, dtype=torch.bfloat16, device="meta")
    if kind == "expanded":
        return torch.full((1, 6), SENTINEL, dtype=torch.bfloat16).expand(4, 6)
    if kind == "inference":
        with torch.inference_mode():
            return torch.full((4, 6), SENTINEL, dtype=torch.bfloat16)
    if kind == "requires_grad":
        return good.requires_grad_()
    if kind == "not_tensor":
        return [[0.0] * 6] * 4
    raise AssertionError(kind)


@SLOW_FUZZ
@given(st.sampled_from(["shape", "dtype", "device", "expanded", "inference", "requires_grad", "not_tensor"]),
       st.sampled_from(["shadow", "inplace"]))
def test_endpoint_rejects_bad_destinations_before_moving_data(kind, mode):
    t = _bad_dst(kind)
    before = t.detach().clone() if isinstance(t, torch.Tensor) and t.device.type != "meta" else None
    with pytest.raises(ValueError, match=r"dst_tensors") as info:
        _endpoint(dst_tensors={"w": t}, pull=trs.PullOptions(mode=mode))
    assert "nothing was moved" in str(info.value)
    if before is not None:
        assert torch.equal(t.detach(), before)


@SLOW_FUZZ
@given(st.sampled_from(["shape", "dtype", "not_tensor", "extra", "missing"]))
def test_endpoint_rejects_bad_sources(kind):
    good = torch.arange(24.0).reshape(4, 6)
    src = {"shape": {"w": good[:3]}, "dtype": {"w": good.double()}, "not_tensor": {"w": good.tolist()},
           "extra": {"w": good, "v": good}, "missing": {}}[kind]
    with pytest.raises(ValueError, match="src_tensors"):
        _endpoint(src_tensors=src)


@pytest.mark.parametrize("make, key", [
    (lambda: dict(timeouts=trs.Timeouts(wait=-1)), "wait"), (lambda: dict(timeouts=trs.Timeouts(wait="5")), "wait"),
    (lambda: dict(timeouts=trs.Timeouts(peer=0)), "peer"), (lambda: dict(pull=trs.PullOptions(mode=None)), "mode"),
    (lambda: dict(meeting=trs.Meeting(world_size=0)), "world_size"),
    (lambda: dict(meeting=trs.Meeting(rank=-1)), "rank"),
    (lambda: dict(meeting=trs.Meeting(rank="0")), "rank"), (lambda: dict(meeting={"rank": 0}), "meeting"),
    (lambda: dict(pull=trs.PullOptions(backend=3)), "backend"),
    (lambda: dict(source=trs.SourceData({"w": torch.zeros(4, 6)}, None)), "layouts"),
    (lambda: dict(timeouts=5), "timeouts"), (lambda: dict(pull="inplace"), "pull"),
    (lambda: dict(timeouts=None, peer_timeout=0), "peer_timeout"),  # an old flat keyword: unexpected
])
def test_endpoint_bad_arguments(make, key):
    with pytest.raises((ValueError, TypeError)) as info:
        _endpoint(**make())
    assert key in str(info.value)


def test_endpoint_bad_call_arguments_name_the_parameter():
    with _endpoint(pull=trs.PullOptions(mode="inplace")) as ep:
        ep.publish()
        for bad in ("1", 1.5, None, True):
            if bad is None:
                continue
            with pytest.raises((ValueError, TypeError), match="version"):
                ep.pull(version=bad)
        for bad in (-1, "2", float("nan"), True):
            with pytest.raises((ValueError, TypeError), match="timeout"):
                ep.pull(timeout=bad)
            with pytest.raises((ValueError, TypeError), match="timeout"):
                ep.fence(timeout=bad)
        assert ep.consistent and ep.version == 0
        assert ep.pull() == 1 and ep.consistent
        assert torch.equal(ep.tensors["w"], torch.arange(24.0).reshape(4, 6).bfloat16())


# -- parts=: garbage mappings and boxes --------------------------------------------------------------
interval = st.one_of(st.none(), st.tuples(ints, ints), st.builds(slice, ints, ints), garbage)
valid_interval = st.one_of(st.none(), st.tuples(ints, ints), st.builds(slice, ints, ints))
part = st.one_of(
    st.builds(trs.Part, st.sampled_from(["a", "b", "c", None]), st.lists(valid_interval, max_size=3),
              st.one_of(st.none(), st.lists(ints, max_size=3))),
    garbage,
)


@FUZZ
@given(st.one_of(st.none(), garbage), st.one_of(garbage, st.lists(interval, max_size=3)), garbage)
def test_part_construction_garbage(src, dst, start):
    try:
        trs.Part(src, dst, start)
    except (ValueError, TypeError) as exc:
        assert "Part(" in str(exc), str(exc)


@FUZZ
@given(layout_dicts, layout_dicts,
       st.one_of(st.dictionaries(st.one_of(st.sampled_from(["a", "b", "c"]), ints, st.text(max_size=2), st.none()),
                                 st.one_of(st.lists(part, max_size=3), garbage), max_size=3), garbage))
def test_plan_reshard_garbage_parts(src, dst, parts):
    try:
        plan = trs.plan_reshard(src, dst, parts)
    except (ValueError, TypeError) as exc:
        assert any(p in str(exc) for p in ("src_layouts", "dst_layouts", "parts", "Part(")), str(exc)
        return
    assert set(plan.names) == set(dst)
    covered = sum(op.numel for op in plan.ops) + sum(f.numel for f in plan.fills)
    assert covered == sum(lay.local_numel(r) for lay in dst.values() for r in lay.ranks)
