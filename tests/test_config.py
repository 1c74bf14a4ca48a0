"""The endpoints' typed configs: each validated once where it is made, each role taking only its
side's; the modes (membership, codec, buffer mode, copy backend) are objects, and the earlier flat
keywords are gone."""
import pytest
import torch

import tritonreshard as trs
from tritonreshard import Layout, Shard
from tritonreshard.transport import codec_for

DST = {"w": Layout((4,), 1, [Shard(0)])}


def test_each_config_names_every_problem_at_once():
    with pytest.raises(ValueError, match=r"Timeouts: wait must be > 0 seconds, got wait=0; peer must be > 0 "
                                         r"seconds, got peer='x'"):
        trs.Timeouts(wait=0, peer="x")
    with pytest.raises(ValueError, match=r"PullOptions: mode must be 'shadow' or 'inplace' \(or a trs.BufferMode\), "
                                         r"got mode='x'; backend must be 'auto', 'torch' or 'triton' \(or a "
                                         r"trs.CopyBackend\), got backend='y'; sources must be"):
        trs.PullOptions(mode="x", backend="y", sources=dict)
    with pytest.raises(ValueError, match=r"Delta: anchor must be an int >= 1 .* got anchor=0; force must be True "
                                         r"or False, got force=1"):
        trs.Delta(anchor=0, force=1)
    with pytest.raises(ValueError, match=r"Elastic: replica must be an int >= 0"):
        trs.Elastic(replica=-1)
    with pytest.raises(ValueError, match=r"delta must be one of \['auto', 'off', 'always'\], got delta='on'; "
                                         r"delta_anchor must be an int >= 1"):
        codec_for("on", 0)


class _Sink:
    """A layer sink as an engine writes one: groups of names, open, close."""

    def __init__(self, groups):
        self.groups = groups

    def open(self, group):
        return {}

    def close(self, group):
        pass


def test_a_layer_sink_needs_the_protocol_and_an_in_place_pull():
    """``PullOptions(layers=)`` takes a ``trs.LayerSink`` with ``InPlace()`` only (it streams into
    tensors the engine serves from while the pull runs); the buffers name every sink group entry
    that is not a destination of the rank, twice in the groups, or given as a tensor too."""
    from tritonreshard.engine.subscriber import ServingBuffers

    assert isinstance(_Sink([["w"]]), trs.LayerSink)
    with pytest.raises(ValueError, match=r"layers must be None or a trs.engine.modes.LayerSink"):
        trs.PullOptions(mode="inplace", layers=[["w"]])
    for mode in (trs.Shadow(), trs.Spare()):
        with pytest.raises(ValueError, match=rf"it needs mode=trs.InPlace\(\), got mode={mode}"):
            trs.PullOptions(mode=mode, layers=_Sink([["w"]]))
    assert trs.PullOptions(mode="inplace", layers=_Sink([["w"]])).layers.groups == [["w"]]
    layouts = {n: Layout((4,), [0], [Shard(0)]) for n in ("a", "b", "c")}
    with pytest.raises(ValueError) as e:
        ServingBuffers(0, layouts, ["a", "b", "c"], tensors={"c": torch.zeros(4)}, device="cpu",
                       mode=trs.InPlace(), layers=_Sink([["a", "x"], ["a", "c"]]))
    assert ("PullOptions(layers=): 'x' (group 0) is not a destination of this rank; 'a' is in groups 0 and 1; "
            "'c' (group 1) is given as tensors= too") in str(e.value)
    bufs = ServingBuffers(0, layouts, ["a", "b", "c"], device="cpu", mode=trs.InPlace(), layers=_Sink([["a"], ["c"]]))
    assert set(bufs.tensors) == {"b"} and bufs.names == ["a", "b", "c"] and bufs.streamed == {"a": 0, "c": 1}


def test_the_string_spelling_names_the_same_codec():
    assert codec_for("off") == trs.Dense() and codec_for("auto", 8) == trs.Delta(anchor=8)
    assert codec_for("always") == trs.Delta(force=True)
    assert [c.mode for c in (trs.Dense(), trs.Delta(), trs.Delta(force=True))] == ["off", "auto", "always"]
    # One interface: the sender asks whether a receiver gets deltas, never which mode it is.
    assert not trs.Dense().sends_delta(0)
    assert trs.Delta(anchor=3).sends_delta(1) and not trs.Delta(anchor=3).sends_delta(2)


def test_a_config_of_the_wrong_type_is_named():
    with pytest.raises(ValueError, match=r"codec must be a Codec \(trs.Delta\(\) or trs.Dense\(\)\), got codec='auto'; "
                                         r"timeouts must be a trs.Timeouts, got timeouts=5"):
        trs.RefitInference(DST, meeting=trs.Meeting(rank=0, world_size=1), timeouts=5, codec="auto")


def test_role_problems_of_a_membership_are_named_before_joining():
    with pytest.raises(ValueError, match=r"an elastic inference rank needs its replica's index"):
        trs.RefitInference(DST, meeting=trs.Meeting(rank=0, store="127.0.0.1:9"), membership=trs.Elastic())
    with pytest.raises(ValueError, match=r"replica= is for an elastic group's inference ranks, not its trainers"):
        trs.RefitTrainer({}, DST, meeting=trs.Meeting(rank=0, world_size=1), membership=trs.Elastic(replica=0))
    with pytest.raises(ValueError, match=r"not both \(no colocated rank\)"):
        trs.RefitEndpoint(source=trs.SourceData({}, DST), destination=trs.DestinationData(DST),
                          meeting=trs.Meeting(rank=0, world_size=1), membership=trs.Elastic(replica=0))


def test_old_flat_keywords_are_unexpected_keywords():
    # One spelling per concern: the flat keywords of earlier releases are gone, as any unknown keyword.
    for kw in ("timeout", "peer_timeout", "elastic", "replica", "delta", "delta_anchor", "mode", "backend", "device",
               "sources", "rank", "world_size", "store", "host_store", "group", "epoch"):
        with pytest.raises(TypeError, match=f"unexpected keyword argument '{kw}'"):
            trs.RefitInference(DST, **{kw: None})
        with pytest.raises(TypeError, match=f"unexpected keyword argument '{kw}'"):
            trs.RefitTrainer({}, DST, **{kw: None})
    for kw in ("src_tensors", "src_layouts", "dst_layouts", "dst_tensors", "parts", "quant", "start_version",
               "timeout", "rank"):
        with pytest.raises(TypeError, match=f"unexpected keyword argument '{kw}'"):
            trs.RefitEndpoint(**{kw: None})


def test_meeting_names_every_problem_at_once_and_defaults_to_the_launchers():
    assert trs.Meeting() == trs.Meeting(rank=None, world_size=None, store=None, host_store=None, group="default",
                                        epoch=None)
    with pytest.raises(ValueError) as e:
        trs.Meeting(rank=-1, world_size=0, store="nowhere", host_store=1, group="", epoch=True)
    text = str(e.value)
    assert text.startswith("Meeting: ")
    for part in ("rank must be an int >= 0 or None, got rank=-1", "world_size must be an int >= 1 or None, got "
                 "world_size=0", "epoch must be an int >= 0 or None, got epoch=True", "store must be 'host:port', a "
                 "torch.distributed.Store or None, got store='nowhere'", "host_store must be True, False or None",
                 "group must be a non-empty str, got group=''"):
        assert part in text, (part, text)
    with pytest.raises(AttributeError):
        trs.Meeting().rank = 3  # frozen


def test_wrong_kinds_of_sides_and_meeting_are_named_together():
    with pytest.raises(ValueError) as e:
        trs.RefitEndpoint({"rank": 0}, source={"w": 1}, destination=DST, pull="inplace")
    text = str(e.value)
    for part in ("source must be a trs.SourceData or None, got source={'w': 1}", "destination must be a "
                 "trs.DestinationData or None", "meeting must be a trs.Meeting, got meeting={'rank': 0}",
                 "pull must be a trs.PullOptions, got pull='inplace'"):
        assert part in text, (part, text)


def test_modes_and_backends_are_objects_chosen_once():
    pull = trs.PullOptions(mode="inplace", backend="torch")
    assert pull == trs.PullOptions(mode=trs.InPlace(), backend=trs.TorchBackend())  # the names become the objects
    assert isinstance(pull.mode, trs.BufferMode) and isinstance(pull.backend, trs.CopyBackend)
    assert (str(pull.mode), str(pull.backend)) == ("inplace", "torch")
    assert (trs.Shadow().sets, trs.Shadow().spare(0), trs.Shadow().spare(1)) == (2, 1, 0)
    assert (trs.InPlace().sets, trs.InPlace().spare(0), trs.InPlace().tears, trs.Shadow().tears) == (1, 0, True, False)
    assert trs.Shadow().background and not trs.InPlace().background
    # "auto" is resolved where the device is known, once.
    auto = trs.PullOptions()
    assert auto.backend == trs.AutoBackend()
    assert auto.for_device("cpu").backend == trs.TorchBackend()
    assert auto.for_device("cuda").backend == trs.TritonBackend()
    assert trs.PullOptions(backend="triton").for_device("cpu").backend == trs.TritonBackend()


def test_membership_and_codec_are_base_classes():
    from tritonreshard.engine.membership import Membership
    from tritonreshard.transport import Codec
    assert all(isinstance(m, Membership) for m in (trs.Fixed(), trs.Elastic(replica=0)))
    assert all(isinstance(c, Codec) for c in (trs.Dense(), trs.Delta()))
    with pytest.raises(TypeError):
        Membership()  # abstract: its kinds answer its questions
    with pytest.raises(TypeError):
        Codec()
