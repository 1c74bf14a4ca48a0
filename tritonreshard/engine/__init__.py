"""The refit engine: processes meet in a group, each takes its route, publishes or pulls.

* :mod:`.rendezvous`: the store (``torch.distributed.TCPStore``), the group secret, plain-data exchange;
* :mod:`.group`: one epoch of a group: who is in it, the agreed plan, liveness, the one wait;
* :mod:`.publisher`: a trainer rank's arena, ``publish`` and ``fence``;
* :mod:`.subscriber`: an inference rank's buffers and pulls;
* :mod:`.relay`: cross-host sends and receive buffers;
* :mod:`.fsdp`: FSDP2 models as sources;
* :mod:`.endpoint`: :class:`RefitEndpoint`, composing the above.
"""
from .endpoint import PullStats, RefitEndpoint, RefitInference, RefitStats, RefitTrainer
from .rendezvous import secret_for_children

__all__ = ["PullStats", "RefitEndpoint", "RefitInference", "RefitStats", "RefitTrainer", "secret_for_children"]
