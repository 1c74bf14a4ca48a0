"""An endpoint's typed configuration, one small frozen dataclass per concern, each validated once
where it is made:

* :class:`Timeouts`: how long set-up and each wait may take, and when a silent peer counts as dead;
* :class:`PullOptions`: how an inference rank pulls (buffer mode, copy backend, device, sources);
* membership (:class:`~tritonreshard.engine.membership.Fixed` / ``Elastic``) and the cross-host
  codec (:class:`~tritonreshard.transport.codec.Dense` / ``Delta``) live with the code that acts on
  them.

The endpoints' earlier flat keywords (``timeout=``, ``mode=``, ``elastic=``, ``delta=``, ...) are
one-release aliases: :func:`options` maps them onto these objects and warns once per call.
"""
from __future__ import annotations

import os
import sys
import warnings
from dataclasses import dataclass

from ..transport import Codec, Delta, Dense, codec_for, delta_problems
from .membership import Elastic, Fixed, Membership
from .sources import Sources

__all__ = ["Options", "PullOptions", "Timeouts", "options"]


def _seconds(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


@dataclass(frozen=True)
class Timeouts:
    """``wait``: seconds for set-up and for each wait (fence, waiting for a version), the default of
    every call's ``timeout=``; ``peer``: seconds without a heartbeat after which a peer on another
    host counts as dead (a local peer counts as dead once its process exited, noticed at once; one
    alive but silent for ``peer`` is named in a wait's timeout error, see ``engine.liveness``)."""

    wait: float = 60.0
    peer: float = 10.0

    def __post_init__(self):
        problems = [f"{name} must be > 0 seconds, got {name}={value!r}"
                    for name, value in (("wait", self.wait), ("peer", self.peer)) if not _seconds(value)]
        if problems:
            raise ValueError("Timeouts: " + "; ".join(problems))


@dataclass(frozen=True)
class PullOptions:
    """How an inference rank pulls.

    ``mode``: ``"shadow"`` (pull into a second buffer set, then ``swap``: generation goes on
    meanwhile) or ``"inplace"`` (write the serving tensors: pause generation meanwhile).
    ``backend``: ``"triton"`` (compiled on CUDA, interpreter on CPU: for debugging), ``"torch"``
    (torch copies over the same descriptors; fast on CPU) or ``"auto"`` (triton on CUDA, torch on
    CPU). ``device``: of the destination buffers (default: the given tensors' device, else cpu).
    ``sources``: where source bytes come from, a subclass of
    :class:`~tritonreshard.engine.sources.Sources` (default: this host's arenas and relay buffers,
    mapped once and read in place)."""

    mode: str = "shadow"
    backend: str = "auto"
    device: object = None
    sources: type = Sources

    def __post_init__(self):
        problems = []
        if self.mode not in ("shadow", "inplace"):
            problems.append(f"mode must be 'shadow' or 'inplace', got mode={self.mode!r}")
        if self.backend not in ("auto", "torch", "triton"):
            problems.append(f"backend must be 'auto', 'torch' or 'triton', got backend={self.backend!r}")
        if not (isinstance(self.sources, type) and issubclass(self.sources, Sources)):
            problems.append(f"sources must be a subclass of trs.engine.sources.Sources, got sources={self.sources!r}")
        if problems:
            raise ValueError("PullOptions: " + "; ".join(problems))


@dataclass(frozen=True)
class Options:
    """What :func:`options` resolved for one endpoint: every concern's object."""

    membership: Membership
    codec: Codec
    timeouts: Timeouts
    pull: PullOptions


#: The flat keywords of earlier releases, by the config that replaces them.
_LEGACY = {"timeout": "timeouts", "peer_timeout": "timeouts", "elastic": "membership", "replica": "membership",
           "delta": "codec", "delta_anchor": "codec", "mode": "pull", "backend": "pull", "device": "pull",
           "sources": "pull"}
_NEW = {"timeouts": "timeouts=trs.Timeouts(wait=, peer=)", "membership": "membership=trs.Elastic(replica=)",
        "codec": "codec=trs.Delta(anchor=) or trs.Dense()", "pull": "pull=trs.PullOptions(mode=, backend=, device=, sources=)"}
_PKG = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _caller_stacklevel() -> int:
    """The stack level of the first frame outside this package: the user's call, whatever subclass
    (``tritonreshard.vllm.Trainer``, ...) it went through."""
    level, frame = 1, sys._getframe(1)
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_PKG + os.sep):
        level, frame = level + 1, frame.f_back
    return level


def options(who: str, accepts: frozenset, legacy: dict, *, membership=None, codec=None, timeouts=None,
            pull=None) -> Options:
    """Resolve one endpoint's configs: the given objects, else the earlier flat keywords in
    ``legacy`` (a ``DeprecationWarning`` naming each), else the defaults. ``accepts``: the flat
    keywords this role had (any other is a ``TypeError`` naming it, as for any unknown keyword).
    Bad values: one ``ValueError`` naming every problem."""
    unknown = sorted(set(legacy) - accepts)
    if unknown:
        raise TypeError(f"{who}() got unexpected keyword argument(s) {', '.join(map(repr, unknown))}")
    given = {"membership": membership, "codec": codec, "timeouts": timeouts, "pull": pull}
    both = sorted({_LEGACY[k] for k in legacy if given[_LEGACY[k]] is not None})
    if both:
        raise TypeError(f"{who}(): give {' or '.join(both)} as the config object or as the old keywords, not both")
    if legacy:
        warnings.warn(f"{who}: the keyword(s) {', '.join(f'{k}=' for k in legacy)} are deprecated and go in the "
                      f"next release; use {', '.join(sorted({_NEW[_LEGACY[k]] for k in legacy}))}",
                      DeprecationWarning, stacklevel=_caller_stacklevel())
    problems = []
    built = {name: _from_legacy(name, legacy, problems) if given[name] is None and any(
        _LEGACY[k] == name for k in legacy) else given[name] for name in given}
    types = {"membership": (Fixed, Elastic), "codec": (Dense, Delta), "timeouts": (Timeouts,), "pull": (PullOptions,)}
    for name, value in built.items():
        if value is not None and not isinstance(value, types[name]):
            problems.append(f"{name} must be a {' or '.join(t.__name__ for t in types[name])}, got {name}={value!r}")
    if problems:
        raise ValueError(f"{who}: " + "; ".join(problems))
    return Options(built["membership"] or Fixed(), built["codec"] or Delta(), built["timeouts"] or Timeouts(),
                   built["pull"] or PullOptions())


def _from_legacy(name: str, legacy: dict, problems: list):
    """The config ``name`` from the earlier flat keywords (None, with its problems, when bad)."""
    kw = {k: legacy[k] for k in legacy if _LEGACY[k] == name}
    if name == "codec":
        found = delta_problems(kw.get("delta", "auto"), kw.get("delta_anchor", 64))
        problems += found
        return None if found else codec_for(kw.get("delta", "auto"), kw.get("delta_anchor", 64))
    if name == "membership":
        elastic = kw.get("elastic", False)
        if not isinstance(elastic, bool):
            problems.append(f"elastic must be a bool, got elastic={elastic!r}")
            return None
        if not elastic:
            if kw.get("replica") is not None:
                problems.append(f"replica= is for an elastic group's inference ranks (elastic=True with layouts), "
                                f"got replica={kw['replica']!r}")
            return Fixed()
        cls, args = Elastic, {"replica": kw.get("replica")}
    elif name == "timeouts":
        cls, args = Timeouts, {"wait": kw.get("timeout", 60.0), "peer": kw.get("peer_timeout", 10.0)}
    else:
        cls, args = PullOptions, {k: kw[k] for k in ("mode", "backend", "device", "sources") if k in kw}
    try:  # narrow: the config's own checks, gathered with the others' into one message
        return cls(**args)
    except ValueError as exc:
        problems.append(str(exc).split(": ", 1)[-1])
        return None
