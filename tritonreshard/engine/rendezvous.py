"""Rendezvous helpers: thin wrappers over ``torch.distributed.TCPStore``.

Which rank calls what: every process calls ``connect_store`` (exactly one with ``is_master=True``),
then ``group_secret`` once, then ``publish``/``fetch``/``all_gather_obj`` with the same keys.

TCPStore semantics relied on (torch 2.13): the constructor's ``timeout`` bounds connecting (and,
with ``wait_for_workers``, the master waiting for ``world_size`` clients) and is the default for
``get``/``wait``; ``store.wait(keys, timedelta)`` takes a per-call timeout, so ``fetch`` waits with
its own timeout first and only then ``get``s (which then returns at once).

**Where a TCPStore listens.** The store has no authentication: anyone who can reach its port can
read and write every key. torch 2.13's master ignores its ``host`` argument when it listens: created
as ``TCPStore("127.0.0.1", ...)`` (or ``"localhost"``) it binds ``[::]:port``, i.e. every
interface, IPv4 included (``ss -ltn`` shows ``*:port``); so do the stores of
``init_process_group`` (``env://``, ``tcp://``) and torchrun's agent store. Only a listening socket
handed in (``master_listen_fd``) stays on loopback, so :func:`connect_store` binds one itself when
the master's host is a loopback address or ``localhost``.

**The group secret** is taken from the environment (``TRITONRESHARD_GROUP_SECRET``, hex) when the
launcher set it (:func:`secret_for_children`), which never crosses the network. Otherwise rank 0
puts a fresh one in the store, and only where the store listens on loopback alone; every rank
checks this before it writes or reads the secret, by this rule:

* a ``HashStore`` (in-process) never listens: fine;
* a ``TCPStore`` (under any ``PrefixStore``) reached at a host that is not a loopback address or
  ``localhost`` listens beyond loopback by definition;
* one reached over loopback is in this network namespace: every listening socket of its port in
  ``/proc/net/tcp`` and ``/proc/net/tcp6`` must be bound to a loopback address (``[::]`` / ``*``
  is every interface); none found counts as beyond loopback;
* any other store (``FileStore``, a custom one) can't be inspected and counts as beyond loopback.
"""
from __future__ import annotations

import ipaddress
import os
import pickle
import secrets
import socket
import sys
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


def _is_loopback_host(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:  # a host name: it may resolve anywhere
        return False
    return ip.is_loopback or (ip.version == 6 and ip.ipv4_mapped is not None and ip.ipv4_mapped.is_loopback)


def _loopback_listener(host: str, port: int) -> socket.socket:
    """A socket listening on ``host``'s loopback address only (torch's own master listens on every
    interface whatever its host argument)."""
    family, bind_addr = (socket.AF_INET6, "::1") if ":" in host else (socket.AF_INET, "127.0.0.1")
    if host not in ("localhost", "::1"):
        bind_addr = host  # 127.x.y.z, or an IPv4-mapped one
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as torch's own listener
        sock.bind((bind_addr, port))
        sock.listen(socket.SOMAXCONN)
    except OSError:
        sock.close()
        raise
    return sock


def connect_store(addr: str | None = None, *, world_size: int, is_master: bool,
                  timeout: float = 60.0, wait_for_workers: bool = False) -> dist.TCPStore:
    """Connect to (master: start) the group's TCPStore.

    ``addr`` is ``"host:port"``; ``None`` reads ``MASTER_ADDR``/``MASTER_PORT`` as torchrun sets
    them. The master may pass port 0 and read ``store.port``. ``world_size`` counts every process
    that connects, the master included. A master whose host is a loopback address or ``localhost``
    listens there only; any other host: on every interface (torch's default).
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
    role = "start" if is_master else "connect to"
    port_n, listen_fd = int(port), None
    bare = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if is_master and _is_loopback_host(bare):
        try:
            sock = _loopback_listener(bare, port_n)
        except OSError as e:
            raise TimeoutError(f"connect_store: could not {role} the TCPStore at {host}:{port}: "
                               f"{e.strerror}") from None
        port_n, listen_fd = sock.getsockname()[1], sock.detach()  # the store closes it, even on failure
    try:
        return dist.TCPStore(host, port_n, world_size, is_master, _td(timeout),
                             wait_for_workers=wait_for_workers, master_listen_fd=listen_fd)
    except (RuntimeError, dist.DistError) as e:
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


def _listening_addresses(port: int) -> list[str]:
    """Local addresses of the sockets listening on TCP ``port`` in this network namespace."""
    out = []
    for path, width in (("/proc/net/tcp", 4), ("/proc/net/tcp6", 16)):
        if not os.path.exists(path):  # no IPv6 in this kernel
            continue
        with open(path) as f:
            lines = f.read().splitlines()[1:]
        for line in lines:
            cols = line.split()
            local, state = cols[1], cols[3]
            addr_hex, _, port_hex = local.partition(":")
            if state != "0A" or int(port_hex, 16) != port:  # 0A: LISTEN
                continue
            # The kernel prints each 32-bit word of the address in host byte order.
            raw = b"".join(int(addr_hex[i:i + 8], 16).to_bytes(4, sys.byteorder)
                           for i in range(0, len(addr_hex), 8))
            out.append(str(ipaddress.ip_address(raw[:width])))
    return out


def _beyond_loopback(store: dist.Store) -> str | None:
    """Why ``store`` counts as listening beyond loopback (see the module docstring), or None."""
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    if isinstance(store, dist.HashStore):
        return None
    if not isinstance(store, dist.TCPStore):
        return f"a {type(store).__name__} can't be checked"
    host, port = store.host, store.port
    if not _is_loopback_host(host):
        return f"it is reached at {host}:{port}, not over loopback"
    addrs = _listening_addresses(port)
    if not addrs:
        return f"no socket listening on port {port} is visible in /proc/net/tcp{{,6}}"
    wide = sorted({a for a in addrs if not _is_loopback_host(a)})
    if wide:
        shown = ", ".join("every interface" if ipaddress.ip_address(a).is_unspecified else a for a in wide)
        return f"the TCPStore on port {port} listens on {shown}"
    return None


def group_secret(store: dist.Store, *, is_master: bool, timeout: float,
                 key: str = SECRET_KEY) -> GroupSecret:
    """The group's secret: from ``$TRITONRESHARD_GROUP_SECRET`` if set, else created by the master
    and put in ``store``, which must listen on loopback only (every rank checks; ``ValueError``
    otherwise).

    Never log the value; the returned object redacts itself.
    """
    env = os.environ.get(SECRET_ENV)
    if env:
        try:
            return GroupSecret(bytes.fromhex(env))
        except ValueError:
            raise ValueError(f"group_secret: ${SECRET_ENV} must be >= 32 hex digits") from None
    reason = _beyond_loopback(store)
    if reason is not None:
        raise ValueError(
            f"group_secret: refusing to pass the group secret through a store that listens beyond "
            f"loopback ({reason}): anyone who reaches it could read the secret. Set ${SECRET_ENV} "
            f"(64 hex digits) in every rank's environment: call tritonreshard.secret_for_children() "
            f"in the launcher before it spawns the ranks, or export it before torchrun, e.g. "
            f"{SECRET_ENV}=$(python -c 'import secrets; print(secrets.token_hex(32))')")
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
