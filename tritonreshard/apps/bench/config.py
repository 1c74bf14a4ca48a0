"""The bench's configuration: :class:`BenchConfig` (every spawned rank's argument, so frozen and
picklable), the methods and layouts it knows, :func:`parse_size` for ``--size`` and :func:`parse_gbps`
for ``--link-gbps`` (here, below both the command line and :mod:`.deltas`, which parse it)."""
from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["BenchConfig", "environment_problems", "parse_size", "parse_gbps", "METHODS", "WORKER_METHODS", "LAYOUTS",
           "NETS", "CODECS", "DEFAULT_CODEC"]

METHODS = ("memcpy", "tritonreshard", "p2p", "gather_broadcast")
WORKER_METHODS = ("tritonreshard", "p2p", "gather_broadcast")  # run by the spawned ranks (memcpy: the driver)
#: How ``--hosts N`` makes hosts: ``labels``: every rank on this machine, a ``$TRITONRESHARD_HOST``
#: each (no root needed; a slower link is a sleep); ``namespaces``: the host harness
#: (:mod:`tritonreshard.apps.hosts`: a network namespace, /dev/shm and hostname per host, real TCP
#: through a switch, a slower link a tbf token bucket; root only)
NETS = ("labels", "namespaces")
#: ``--codec``: how the engine's cross-host messages travel, the library's string spelling
#: (``delta=``, :func:`tritonreshard.transport.codec_for`) -> its typed config. ``off``: every byte,
#: every refit; ``auto``: a delta where finding what changed costs less than sending whole (the
#: trainers' measured link and detection speeds decide; the library's default); ``always``: a delta
#: every refit after the first, whatever the link (tests). (Here, not imported from the transport:
#: ``--help`` and the argument checks load no torch.)
CODECS = {"off": "trs.Dense()", "auto": "trs.Delta()", "always": "trs.Delta(force=True)"}
#: The plain run's codec: the provenance bits change every element every refit, by a version key
#: that a delta compresses to about 56% (a bitmask and one int8 difference per element), so with a
#: delta codec the bench would time the encoder on a change no training step makes, not the moving
#: of every byte. ``--update-lr`` runs all three.
DEFAULT_CODEC = "off"
LAYOUTS = ("fsdp-tp", "cols-replicas", "colocated", "replicated-sources", "megatron-tp-pp")
_DEFAULT_TRAINERS = {"fsdp-tp": 2, "cols-replicas": 4, "colocated": 4, "replicated-sources": 4, "megatron-tp-pp": 4}
_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
          "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4, "tb": 1000**4}


def parse_size(text) -> int:
    """``"256MiB"``, ``"1GiB"``, ``"64MB"``, ``"1e6"`` or a plain int -> bytes."""
    if isinstance(text, int):
        return text
    if str(text).strip().startswith("-"):
        raise ValueError(f"--size={text!r} must be a positive number of bytes, e.g. 256MiB")
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"--size={text!r}: use bytes as an int or a number with a unit "
                         f"(KiB, MiB, GiB, KB, MB, GB), e.g. 256MiB")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def parse_gbps(text) -> list[float | None]:
    """``--link-gbps``: ``"1,10,inf"`` -> ``[1.0, 10.0, None]`` (None: the link as it is); None -> ``[None]``."""
    if text is None:
        return [None]
    out = []
    for part in str(text).split(","):
        try:
            gbps = float(part)
        except ValueError:
            gbps = float("nan")
        if not gbps > 0:
            raise ValueError(f"--link-gbps={text!r}: each value must be gigabits/s > 0 or 'inf', got {part.strip()!r}")
        out.append(None if gbps == float("inf") else gbps)
    return out


@dataclass(frozen=True)
class BenchConfig:
    """Everything a bench session needs; picklable (it is each spawned rank's argument)."""

    size: int = 1 << 30
    layout: str = "fsdp-tp"
    trainers: int | None = None
    inference: int = 4
    tensors: int | None = None
    backend: str = "auto"
    device: str = "cpu"
    mode: str = "shadow"
    timeout: float = 600.0
    hosts: int = 1
    #: inference replicas (vLLM data parallel): the inference ranks are ``replicas`` TP groups of
    #: ``inference // replicas`` ranks each, in order (TP layouts only)
    replicas: int = 1
    #: the methods a session will run; the ranks set up (and allocate for) only these
    methods: tuple[str, ...] = METHODS
    #: None: every refit changes every element (provenance bits); a learning rate: every refit is an
    #: Adam-sized bf16 update of that size (:mod:`.updates`), as in RL fine-tuning; ``"random"``:
    #: every refit draws fresh weights (a full random change)
    update_lr: float | str | None = None
    #: the engine's cross-host codec (``RefitEndpoint(codec=)``) in its string spelling (``delta=``,
    #: ``--codec``: one of :data:`CODECS`); default :data:`DEFAULT_CODEC` (see there).
    #: ``--update-lr`` (:mod:`.deltas`) runs "off", "auto" and "always" side by side on RL-sized updates
    delta: str = DEFAULT_CODEC
    #: a slower link (gigabits/s) between hosts, None: the link as it is. ``net="labels"``: each
    #: rank sets ``$TRITONRESHARD_SIMULATED_LINK_GBPS`` (the engine's test hook: every cross-host
    #: send first sleeps its bytes / this rate); ``net="namespaces"``: a token bucket of this rate on
    #: every host's link (``Hosts.rate``), under real TCP
    link_gbps: float | None = None
    #: how the hosts are made (:data:`NETS`)
    net: str = "labels"

    @property
    def worker_methods(self) -> tuple[str, ...]:
        """The methods the spawned ranks run (memcpy is the driver's)."""
        return tuple(m for m in self.methods if m in WORKER_METHODS)

    @property
    def num_trainers(self) -> int:
        return self.trainers if self.trainers is not None else _DEFAULT_TRAINERS[self.layout]

    @property
    def trainer_ranks(self) -> tuple[int, ...]:
        return tuple(range(self.num_trainers))

    @property
    def inference_ranks(self) -> tuple[int, ...]:
        first = 0 if self.layout == "colocated" else self.num_trainers
        return tuple(range(first, first + self.inference))

    def host_index(self, rank: int) -> int:
        """The host ``rank`` runs on: the trainers on host 0, the inference ranks spread over hosts
        1..N-1 in contiguous blocks (0 with one host)."""
        if self.hosts <= 1 or rank in self.trainer_ranks:
            return 0
        i = self.inference_ranks.index(rank)
        return 1 + i * (self.hosts - 1) // self.inference

    def host_of(self, rank: int) -> str | None:
        """Host identity of ``rank`` when ``hosts > 1``: ``host{host_index(rank)}``, which is
        ``$TRITONRESHARD_HOST`` with ``net="labels"`` and the host harness's hostname with
        ``net="namespaces"``. None with one host: every rank keeps the machine's own identity."""
        return f"host{self.host_index(rank)}" if self.hosts > 1 else None

    @property
    def world_size(self) -> int:
        return len(set(self.trainer_ranks) | set(self.inference_ranks))

    def problems(self) -> list[str]:
        p = []
        if self.layout not in LAYOUTS:
            p.append(f"--layout={self.layout!r} must be one of {', '.join(LAYOUTS)}")
        bad = [m for m in self.methods if m not in METHODS]
        if bad or not self.methods:
            p.append(f"--methods={','.join(self.methods)!r}: choose one or more of {','.join(METHODS)}")
        if self.size < 1 << 16:
            p.append(f"--size={self.size} bytes is too small (at least 64 KiB)")
        if self.num_trainers < 1 or self.inference < 1:
            p.append(f"--trainers={self.num_trainers} and --inference={self.inference} must be >= 1")
        if self.layout == "replicated-sources" and (self.num_trainers < 2 or self.num_trainers % 2):
            p.append(f"--layout=replicated-sources needs an even --trainers >= 2 (a 2 x T/2 DP x FSDP "
                     f"mesh), got {self.num_trainers}")
        if self.layout == "megatron-tp-pp" and (self.num_trainers < 2 or self.num_trainers % 2):
            p.append(f"--layout=megatron-tp-pp needs an even --trainers >= 2 (Megatron TP 2 x PP T/2), "
                     f"got {self.num_trainers}")
        if self.tensors is not None and self.tensors < 9:
            p.append(f"--tensors={self.tensors} must be >= 9 (one layer plus embeddings)")
        if self.mode not in ("shadow", "inplace"):
            p.append(f"--mode={self.mode!r} must be shadow or inplace")
        if self.backend not in ("auto", "torch", "triton"):
            p.append(f"--backend={self.backend!r} must be torch or triton")
        if self.device not in ("cpu", "cuda"):
            p.append(f"--device={self.device!r} must be cpu or cuda")
        if not isinstance(self.replicas, int) or self.replicas < 1:
            p.append(f"--replicas={self.replicas!r} must be an int >= 1")
        elif self.replicas > 1 and self.layout not in ("fsdp-tp", "replicated-sources"):
            p.append(f"--replicas={self.replicas} needs a TP layout (fsdp-tp, replicated-sources), got "
                     f"--layout={self.layout}")
        elif self.inference % self.replicas:
            p.append(f"--inference={self.inference} is not a multiple of --replicas={self.replicas} "
                     f"(each replica is a TP group of inference // replicas ranks)")
        if not isinstance(self.hosts, int) or self.hosts < 1:
            p.append(f"--hosts={self.hosts!r} must be an int >= 1")
        elif self.hosts > 1 and self.layout == "colocated":
            p.append(f"--hosts={self.hosts} puts the trainers on host 0 and the inference ranks elsewhere, "
                     f"but --layout=colocated runs both on the same processes")
        elif self.hosts > 1 and self.inference < self.hosts - 1:
            p.append(f"--hosts={self.hosts} spreads the inference ranks over {self.hosts - 1} host(s), "
                     f"but --inference={self.inference}")
        if self.update_lr is not None and self.update_lr != "random" and not (
                isinstance(self.update_lr, float) and 0 < self.update_lr < 1):
            p.append(f"--update-lr={self.update_lr!r} must be a learning rate in (0, 1) or 'random'")
        if self.update_lr is not None and self.methods != ("tritonreshard",):
            p.append("--update-lr measures the engine alone (methods=('tritonreshard',))")
        if self.link_gbps is not None and (isinstance(self.link_gbps, bool)
                                           or not isinstance(self.link_gbps, (int, float))
                                           or not 0 < self.link_gbps < float("inf")):
            p.append(f"--link-gbps={self.link_gbps!r} must be gigabits/s > 0")
        elif self.link_gbps is not None and self.hosts < 2:
            p.append(f"--link-gbps={self.link_gbps} slows the link between hosts: it needs --hosts >= 2, "
                     f"got {self.hosts}")
        if self.net not in NETS:
            p.append(f"--net={self.net!r} must be one of {', '.join(NETS)}")
        elif self.net == "namespaces" and self.hosts < 2:
            p.append(f"--net=namespaces makes the hosts of --hosts: it needs --hosts >= 2, got {self.hosts}")
        elif self.net == "namespaces" and self.device != "cpu":
            p.append(f"--net=namespaces runs on CPU tensors over gloo; --device={self.device} is not supported there")
        if not isinstance(self.delta, str) or self.delta not in CODECS:
            p.append(f"--codec={self.delta!r} must be one of {', '.join(CODECS)}")
        elif self.delta != "off" and isinstance(self.hosts, int) and self.hosts < 2:
            p.append(f"--codec={self.delta} encodes what crosses hosts: it needs --hosts >= 2 (on one host "
                     f"nothing crosses), got {self.hosts}")
        return p

    def role(self, rank: int) -> str:
        """``rank`` as the driver names it in messages (a colocated rank is both)."""
        sides = [s for s, ranks in (("trainer", self.trainer_ranks), ("inference", self.inference_ranks))
                 if rank in ranks]
        return " + ".join(sides)


def environment_problems(cfg: BenchConfig, png: str | None = None) -> list[str]:
    """What this machine lacks for ``cfg``'s run, found before any work: the host harness that
    ``net="namespaces"`` needs (root, iproute2, util-linux), and a folder and format for ``png``."""
    out = []
    if cfg.net == "namespaces":
        from ..hosts import unavailable  # lazy: it imports torch; only the harness needs it
        why = unavailable()
        if why:
            out.append(f"--net=namespaces: {why}; --net=labels runs without it (a slower link is then simulated)")
    if png:
        from ..viz import check_figure_path  # lazy: matplotlib only for a picture
        try:
            check_figure_path(png)
        except ValueError as exc:
            out.append(str(exc))
    return out
