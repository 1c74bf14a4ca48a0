"""The refit engine: processes meet in a group, each takes its route, publishes or pulls.

* :mod:`.rendezvous`: the store (``torch.distributed.TCPStore``), the group secret, plain-data exchange;
* :mod:`.members`: who joins an epoch (:class:`Member`) and whether they agree (:func:`validate_members`);
* :mod:`.group`: one epoch of a group: membership, liveness, the one wait, the exchange primitive;
* :mod:`.epoch`: the set-up script: every step of an epoch's set-up, in order, once;
* :mod:`.elastic`: elastic groups: trainers that admit joiners, inference ranks that join, leave or die;
* :mod:`.sides`: a rank's trainer side and inference side;
* :mod:`.publisher`: a trainer rank's arena, ``publish`` and ``fence``;
* :mod:`.sender`: a trainer rank's cross-host sends;
* :mod:`.subscriber`: an inference rank's buffers and pulls;
* :mod:`.relay`: an inference rank's receiving relay (boxes that cross into its host);
* :mod:`.crosshost`: the point-to-point link and signals a group spanning hosts shares;
* :mod:`.sources`: where a pull's bytes come from (arenas and relay buffers on this host);
* :mod:`.liveness`: heartbeats and dead peers; :mod:`.checks`: an endpoint's arguments;
* :mod:`.config`: an endpoint's typed configs (:class:`Meeting`, :class:`Timeouts`,
  :class:`PullOptions`); :mod:`.membership`: a :class:`Membership`, :class:`Fixed` or
  :class:`Elastic`; :mod:`.modes`: a :class:`BufferMode`, :class:`Shadow`, :class:`InPlace` or :class:`Spare`, and a
  :class:`LayerSink`; the
  copy backends (:class:`CopyBackend`) are :mod:`tritonreshard.kernels.backends`'s;
* :mod:`.fsdp`: FSDP2 models as sources;
* :mod:`.endpoint`: :class:`RefitTrainer`, :class:`RefitInference`, :class:`RefitEndpoint`.
"""
from ..kernels import AutoBackend, CopyBackend, TorchBackend, TritonBackend
from .checks import DestinationData, SourceData
from .config import Meeting, PullOptions, Timeouts
from .endpoint import PullStats, RefitEndpoint, RefitInference, RefitStats, RefitTrainer
from .members import GroupInputs, Member, validate_members
from .membership import Elastic, Fixed, Membership
from .modes import BufferMode, InPlace, LayerSink, Shadow, Spare
from .rendezvous import secret_for_children

__all__ = ["AutoBackend", "BufferMode", "CopyBackend", "DestinationData", "Elastic", "Fixed", "GroupInputs", "InPlace",
           "LayerSink", "Meeting", "Member", "Membership", "PullOptions", "PullStats", "RefitEndpoint",
           "RefitInference", "RefitStats", "RefitTrainer", "Shadow", "SourceData", "Spare", "Timeouts", "TorchBackend",
           "TritonBackend", "secret_for_children", "validate_members"]
