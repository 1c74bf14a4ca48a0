"""The endpoints' typed configs: each validated once where it is made, each role taking only its
side's, and the earlier flat keywords as one-release aliases that warn and mean the same."""
import warnings

import pytest

import tritonreshard as trs
from tritonreshard import Layout, Shard
from tritonreshard.engine.config import options
from tritonreshard.transport import codec_for

DST = {"w": Layout((4,), 1, [Shard(0)])}


def test_each_config_names_every_problem_at_once():
    with pytest.raises(ValueError, match=r"Timeouts: wait must be > 0 seconds, got wait=0; peer must be > 0 "
                                         r"seconds, got peer='x'"):
        trs.Timeouts(wait=0, peer="x")
    with pytest.raises(ValueError, match=r"PullOptions: mode must be 'shadow' or 'inplace', got mode='x'; backend "
                                         r"must be 'auto', 'torch' or 'triton', got backend='y'; sources must be"):
        trs.PullOptions(mode="x", backend="y", sources=dict)
    with pytest.raises(ValueError, match=r"Delta: anchor must be an int >= 1 .* got anchor=0; force must be True "
                                         r"or False, got force=1"):
        trs.Delta(anchor=0, force=1)
    with pytest.raises(ValueError, match=r"Elastic: replica must be an int >= 0"):
        trs.Elastic(replica=-1)
    with pytest.raises(ValueError, match=r"delta must be one of \['auto', 'off', 'always'\], got delta='on'; "
                                         r"delta_anchor must be an int >= 1"):
        codec_for("on", 0)


def test_the_string_spelling_names_the_same_codec():
    assert codec_for("off") == trs.Dense() and codec_for("auto", 8) == trs.Delta(anchor=8)
    assert codec_for("always") == trs.Delta(force=True)
    assert [c.mode for c in (trs.Dense(), trs.Delta(), trs.Delta(force=True))] == ["off", "auto", "always"]
    # One interface: the sender asks whether a receiver gets deltas, never which mode it is.
    assert not trs.Dense().sends_delta(0)
    assert trs.Delta(anchor=3).sends_delta(1) and not trs.Delta(anchor=3).sends_delta(2)


def test_a_config_of_the_wrong_type_is_named():
    with pytest.raises(ValueError, match=r"codec must be a Dense or Delta, got codec='auto'; timeouts must be a "
                                         r"Timeouts, got timeouts=5"):
        trs.RefitInference(DST, rank=0, world_size=1, timeouts=5, codec="auto")


def test_role_problems_of_a_membership_are_named_before_joining():
    with pytest.raises(ValueError, match=r"an elastic inference rank needs its replica's index"):
        trs.RefitInference(DST, rank=0, store="127.0.0.1:9", membership=trs.Elastic())
    with pytest.raises(ValueError, match=r"replica= is for an elastic group's inference ranks, not its trainers"):
        trs.RefitTrainer({}, DST, rank=0, world_size=1, membership=trs.Elastic(replica=0))
    with pytest.raises(ValueError, match=r"not both \(no colocated rank\)"):
        trs.RefitEndpoint(src_tensors={}, src_layouts=DST, dst_layouts=DST, rank=0, world_size=1,
                          membership=trs.Elastic(replica=0))


def test_old_keywords_warn_once_and_mean_the_same_configs():
    legacy = dict(timeout=5, peer_timeout=2, elastic=True, replica=1, delta="always", delta_anchor=4, mode="inplace",
                  backend="torch", device="cpu")
    accepts = frozenset(legacy) | {"sources"}
    with pytest.warns(DeprecationWarning) as seen:
        got = options("RefitInference", accepts, legacy)
    assert len(seen) == 1 and __file__ == seen[0].filename  # one warning, pointing at the caller
    text = str(seen[0].message)
    assert "timeout=, peer_timeout=, elastic=, replica=, delta=, delta_anchor=, mode=, backend=, device=" in text
    assert "timeouts=trs.Timeouts" in text and "membership=trs.Elastic" in text and "pull=trs.PullOptions" in text
    assert got.timeouts == trs.Timeouts(wait=5, peer=2) and got.membership == trs.Elastic(replica=1)
    assert got.codec == trs.Delta(anchor=4, force=True)
    assert got.pull == trs.PullOptions(mode="inplace", backend="torch", device="cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the new spelling warns nothing
        assert options("RefitInference", accepts, {}) == options("RefitInference", accepts, {}, codec=trs.Delta())


def test_old_keywords_with_bad_values_name_every_problem_and_mixing_is_refused():
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError) as e:
        trs.RefitInference(DST, rank=0, world_size=1, mode="x", backend="y", timeout=-1, delta="sparse", elastic=1)
    for part in ("mode must be 'shadow' or 'inplace'", "backend must be", "wait must be > 0 seconds",
                 "delta must be one of", "elastic must be a bool"):
        assert part in str(e.value), (part, str(e.value))
    with pytest.raises(TypeError, match=r"give timeouts as the config object or as the old keywords, not both"):
        trs.RefitInference(DST, rank=0, world_size=1, timeout=5, timeouts=trs.Timeouts())
