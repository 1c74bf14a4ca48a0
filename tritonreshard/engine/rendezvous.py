"""Rendezvous helpers: thin wrappers over ``torch.distributed.TCPStore``.

Which rank calls what: every process calls ``connect_store`` (exactly one with ``is_master=True``),
then ``publish``/``fetch``/``all_gather_obj`` with the same keys, and ``group_secret`` once.

TCPStore semantics relied on (torch 2.13): the constructor's ``timeout`` bounds connecting (and,
with ``wait_for_workers``, the master waiting for ``world_size`` clients) and is the default for
``get``/``wait``; ``store.wait(keys, timedelta)`` takes a per-call timeout, so ``fetch`` waits with
its own timeout first and only then ``get``s (which then returns at once).

The store has no authentication: anyone who can reach its port can read every key. The group
secret is therefore taken from the environment (``TRITONRESHARD_GROUP_SECRET``, hex) when the
launcher set it, which never crosses the network; only otherwise does the master put a fresh
secret in the store (bind the store to 127.0.0.1 for single-host groups then).
"""
from __future__ import annotations

import os
import pickle
import secrets
from datetime import timedelta
from typing import Any

import torch.distributed as dist

__all__ = ["GroupSecret", "connect_store", "publish", "fetch", "all_gather_obj", "group_secret",
           "SECRET_ENV", "SECRET_KEY", "secret_for_children"]

SECRET_ENV = "TRITONRESHARD_GROUP_SECRET"
SECRET_KEY = "trs/group_secret"
_SECRET_BYTES = 32


class GroupSecret:
    """Per-group shared secret. ``bytes(s)`` gives the key; ``repr``/``str`` never show it."""

    __slots__ = ("_b",)

    def __init__(self, value: bytes):
        if not isinstance(value, (bytes, bytearray)) or len(value) < 16:
            raise ValueError("GroupSecret: need at least 16 bytes of key material")
        self._b = bytes(value)

    @classmethod
    def generate(cls) -> "GroupSecret":
        return cls(secrets.token_bytes(_SECRET_BYTES))

    def __bytes__(self) -> bytes:
        return self._b

    def __eq__(self, other):
        import hmac
        return isinstance(other, GroupSecret) and hmac.compare_digest(self._b, other._b)

    def __hash__(self):
        return hash((GroupSecret, len(self._b)))

    def __repr__(self) -> str:
        return "GroupSecret(<redacted>)"

    __str__ = __repr__

    def __reduce__(self):  # picklable, e.g. as an argument of a spawned process
        return (GroupSecret, (self._b,))


def _td(seconds: float) -> timedelta:
    return timedelta(seconds=seconds)


def connect_store(addr: str | None = None, *, world_size: int, is_master: bool,
                  timeout: float = 60.0, wait_for_workers: bool = False) -> dist.TCPStore:
    """Connect to (master: start) the group's TCPStore.

    ``addr`` is ``"host:port"``; ``None`` reads ``MASTER_ADDR``/``MASTER_PORT`` as torchrun sets
    them. The master may pass port 0 and read ``store.port``. ``world_size`` counts every process
    that connects, the master included.
    """
    if addr is None:
        host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
        if not host or not port:
            raise ValueError("connect_store: addr=None needs MASTER_ADDR and MASTER_PORT in the "
                             f"environment, got MASTER_ADDR={host!r} MASTER_PORT={port!r}")
    else:
        host, sep, port = addr.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"connect_store: addr must be 'host:port', got addr={addr!r}")
    if world_size < 1:
        raise ValueError(f"connect_store: world_size must be >= 1, got world_size={world_size}")
    try:
        return dist.TCPStore(host, int(port), world_size, is_master, _td(timeout),
                             wait_for_workers=wait_for_workers)
    except (RuntimeError, dist.DistError) as e:
        role = "start" if is_master else "connect to"
        raise TimeoutError(f"connect_store: could not {role} the TCPStore at {host}:{port} within "
                           f"{timeout:.3g} s: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None


def publish(store: dist.Store, key: str, obj: Any) -> None:
    """Pickle ``obj`` (small metadata only) under ``key``."""
    store.set(key, pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def fetch(store: dist.Store, key: str, *, timeout: float, what: str | None = None) -> Any:
    """Wait up to ``timeout`` s for ``key`` and unpickle it. ``TimeoutError`` names key and ``what``."""
    try:
        store.wait([key], _td(timeout))
    except (RuntimeError, dist.DistError) as e:
        if "timeout" not in str(e).lower() and "timed out" not in str(e).lower():
            raise
        desc = f" ({what})" if what else ""
        raise TimeoutError(f"timed out after {timeout:.3g} s waiting for store key {key!r}{desc}") from None
    return pickle.loads(store.get(key))


def all_gather_obj(store: dist.Store, prefix: str, rank: int, world: int, obj: Any, *,
                   timeout: float) -> list:
    """Every rank of ``world`` calls this with its ``obj``; all get the list ordered by rank.

    ``prefix`` must be unique per call (e.g. include a round number): keys are ``prefix/rank``.
    """
    if not 0 <= rank < world:
        raise ValueError(f"all_gather_obj: rank must be in [0, {world}), got rank={rank}")
    publish(store, f"{prefix}/{rank}", obj)
    return [fetch(store, f"{prefix}/{r}", timeout=timeout, what=f"all_gather {prefix!r} from rank {r}")
            for r in range(world)]


def secret_for_children() -> None:
    """Launcher (before spawning a group's processes): put a fresh group secret in this process's
    environment, which spawned children inherit, so the secret never goes through the store.
    Keeps one that is already set."""
    os.environ.setdefault(SECRET_ENV, secrets.token_hex(_SECRET_BYTES))


def group_secret(store: dist.Store, *, is_master: bool, timeout: float,
                 key: str = SECRET_KEY) -> GroupSecret:
    """The group's secret: from ``$TRITONRESHARD_GROUP_SECRET`` if set, else created by the master.

    Never log the value; the returned object redacts itself.
    """
    env = os.environ.get(SECRET_ENV)
    if env:
        try:
            return GroupSecret(bytes.fromhex(env))
        except ValueError:
            raise ValueError(f"group_secret: ${SECRET_ENV} must be >= 32 hex digits") from None
    if is_master:
        s = GroupSecret.generate()
        store.set(key, bytes(s))
        return s
    try:
        store.wait([key], _td(timeout))
    except (RuntimeError, dist.DistError):
        raise TimeoutError(f"timed out after {timeout:.3g} s waiting for store key {key!r} "
                           f"(the group secret from the master)") from None
    return GroupSecret(store.get(key))
