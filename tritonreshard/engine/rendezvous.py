"""Rendezvous helpers: thin wrappers over ``torch.distributed.TCPStore``.

Which rank calls what: every process calls ``connect_store`` (exactly one with ``is_master=True``),
then ``group_secret`` once, then ``publish``/``fetch``/``all_gather_obj`` with the same keys.
Modules whose dataclasses travel through the store call ``register_plain`` at import.

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

**Store values are plain data, never pickles.** ``publish`` writes JSON of plain types (None, bool,
int, float, str, bytes, list, tuple, dict with any such keys, ``torch.dtype``, ``slice``) and of
dataclasses registered with :func:`register_plain`; ``fetch`` rebuilds them through their
constructors (so their validation runs) and refuses anything else. With the environment secret,
every value carries an HMAC-SHA256 over (key, payload) under a key derived from the secret, and
``fetch`` refuses a value without a valid one. Without it the secret is in the store anyway, so
values are plain JSON: anyone who reaches the store can change them (never run code through them).
The MAC covers the key as the caller names it (inside a ``PrefixStore``: without the prefix), so a
signed value could only be replayed under the same key of another namespace of the same secret.
"""
from __future__ import annotations

import base64
import binascii
import dataclasses
import hashlib
import hmac
import inspect
import ipaddress
import json
import os
import secrets
import socket
import sys
import threading
from datetime import timedelta
from functools import lru_cache
from typing import Any

import torch
import torch.distributed as dist

from ..layout import Layout, Part, Replicate, Shard
from ..transport import ArenaHandle

__all__ = ["GroupSecret", "connect_store", "publish", "fetch", "all_gather_obj", "group_secret",
           "SECRET_ENV", "SECRET_KEY", "secret_for_children", "register_plain", "StoreValueError", "reach"]

SECRET_ENV = "TRITONRESHARD_GROUP_SECRET"
SECRET_KEY = "trs/group_secret"
_SECRET_BYTES = 32

# Store value headers: the first line says how to read the rest (and that it is ours).
_PLAIN = b"trs-plain-1\n"
_SIGNED = b"trs-signed-1\n"   # then 64 hex digits of HMAC-SHA256, "\n", the JSON payload
_MAC_HEX = 64
_VALUE_KEY_LABEL = b"tritonreshard store values v1"  # the fd servers use the secret itself


class GroupSecret:
    """Per-group shared secret. ``bytes(s)`` gives the key; ``repr``/``str`` never show it."""

    __slots__ = ("_b",)

    def __init__(self, value: bytes):
        if not isinstance(value, (bytes, bytearray)) or len(value) < 16:
            raise ValueError("GroupSecret: need at least 16 bytes of key material")
        self._b = bytes(value)

    @classmethod
    def generate(cls) -> GroupSecret:
        return cls(secrets.token_bytes(_SECRET_BYTES))

    def __bytes__(self) -> bytes:
        return self._b

    def __eq__(self, other):
        return isinstance(other, GroupSecret) and hmac.compare_digest(self._b, other._b)

    def __hash__(self):
        return hash((GroupSecret, len(self._b)))

    def __repr__(self) -> str:
        return "GroupSecret(<redacted>)"

    __str__ = __repr__

    def __reduce__(self):  # picklable, e.g. as an argument of a spawned process
        return (GroupSecret, (self._b,))


class StoreValueError(ValueError):
    """A store value that ``fetch`` refuses: not a tritonreshard plain value (e.g. a pickle), a type
    that is not registered, or (with the environment secret) a missing or wrong MAC."""


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


def reach(host: str, port: int, timeout: float) -> str | None:
    """One plain TCP connection to ``host:port`` (closed at once: a store accepts a connection that
    says nothing), at most ``timeout`` s. None when accepted, else why not from this host: refused
    (nothing listens), no answer (a cut link, a firewall that drops), no route, a name that does not
    resolve."""
    here = socket.gethostname()
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except socket.gaierror as e:
        return f"{host!r} does not resolve on this host ({here!r}): {e.strerror}"
    except ConnectionRefusedError:
        return "connection refused: nothing listens on that port (the store's process has not started, or exited)"
    except TimeoutError:
        return ("no answer: the address is unreachable from this host (a link down, a firewall that drops "
                "packets, or no such machine on this network)")
    except OSError as e:  # EHOSTUNREACH, ENETUNREACH
        return f"{e.strerror or e} from this host ({here!r})"
    return None


def _client(host: str, port: int, world_size: int, timeout: float, wait_for_workers: bool) -> dist.TCPStore | None:
    """torch's client connect, given up at ``timeout`` (None then, or when torch failed sooner):
    torch retries with a growing random delay that runs seconds past its own timeout, so it runs on
    a thread of its own (the constructor releases the GIL) that is left to end by itself; a store
    it gets after that is dropped."""
    got: list[dist.TCPStore] = []

    def connect() -> None:
        try:
            got.append(dist.TCPStore(host, port, world_size, False, _td(timeout), wait_for_workers=wait_for_workers))
        except (RuntimeError, dist.DistError):
            pass  # the caller says why, from a connection of its own

    worker = threading.Thread(target=connect, name=f"tritonreshard-connect-{host}:{port}", daemon=True)
    worker.start()
    worker.join(timeout)
    return got[0] if got else None


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
    failed = f"connect_store: could not {role} the TCPStore at {host}:{port} within {timeout:.3g} s"
    if is_master:
        try:
            return dist.TCPStore(host, port_n, world_size, True, _td(timeout),
                                 wait_for_workers=wait_for_workers, master_listen_fd=listen_fd)
        except (RuntimeError, dist.DistError) as e:
            raise TimeoutError(f"{failed}: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    if (store := _client(host, port_n, world_size, timeout, wait_for_workers)) is not None:
        return store
    # torch says only that it timed out: one plain connection says why the address could not be
    # reached (never a loop of them: a stream of connections that close at once stalls torch's
    # libuv store, and other ranks' connects to it with it).
    why = reach(bare, port_n, 0.5) or "it accepts connections now, but not within the timeout"
    raise TimeoutError(f"{failed}: {why}")


# ---------------------------------------------------------------------------- plain values
_REGISTRY: dict[str, type] = {}     # wire name -> class
_PARAMS: dict[type, tuple[str, ...]] = {}  # class -> its constructor's parameter names
_DTYPES = {str(v).removeprefix("torch."): v for v in vars(torch).values() if isinstance(v, torch.dtype)}


def register_plain(*classes: type) -> None:
    """Let frozen dataclasses travel through ``publish``/``fetch``.

    A value travels as its class's wire name (``module.qualname``) and, for each parameter of the
    constructor, the attribute of that name; ``fetch`` calls the constructor again, so validation in
    ``__init__``/``__post_init__`` runs on what arrives. Decoding never looks a class up by anything
    but this registry. Called at import by the module that defines the class.
    """
    problems, ok = [], {}
    for cls in classes:
        if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
            problems.append(f"{cls!r} is not a dataclass")
            continue
        name = f"{cls.__module__}.{cls.__qualname__}"
        if not cls.__dataclass_params__.frozen:
            problems.append(f"{name} is not frozen (values read from the store must not change)")
            continue
        fields = {f.name for f in dataclasses.fields(cls)}
        params = inspect.signature(cls).parameters.values()
        odd = [p.name for p in params if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD, p.POSITIONAL_ONLY)
               or p.name not in fields]
        if odd:
            problems.append(f"{name}: constructor parameters {odd} are not keyword parameters named "
                            f"after fields")
            continue
        ok[name] = (cls, tuple(p.name for p in params))
    if problems:  # nothing registered: a half-registered batch would fail later, far from here
        raise ValueError("register_plain: " + "; ".join(problems))
    for name, (cls, params) in ok.items():
        _REGISTRY[name], _PARAMS[cls] = cls, params


register_plain(Layout, Shard, Replicate, Part, ArenaHandle)


def _encode(obj: Any, path: str) -> Any:
    t = type(obj)
    if obj is None or t in (bool, int, float, str):
        return obj
    if t is list:
        return [_encode(x, f"{path}[{i}]") for i, x in enumerate(obj)]
    if t is tuple:
        return {"$": "tuple", "items": [_encode(x, f"{path}[{i}]") for i, x in enumerate(obj)]}
    if t is dict:
        return {"$": "dict", "items": [[_encode(k, f"{path} key {k!r}"), _encode(v, f"{path}[{k!r}]")]
                                       for k, v in obj.items()]}
    if t is bytes:
        return {"$": "bytes", "b64": base64.b64encode(obj).decode()}
    if t is torch.dtype:
        return {"$": "dtype", "name": str(obj).removeprefix("torch.")}
    if t is slice:
        return {"$": "slice", "start": _encode(obj.start, f"{path}.start"),
                "stop": _encode(obj.stop, f"{path}.stop"), "step": _encode(obj.step, f"{path}.step")}
    if t in _PARAMS:
        return {"$": "obj", "type": f"{t.__module__}.{t.__qualname__}",
                "fields": {n: _encode(getattr(obj, n), f"{path}.{n}") for n in _PARAMS[t]}}
    raise TypeError(f"{path} is a {t.__module__}.{t.__qualname__}, not a plain value (None, bool, int, "
                    f"float, str, bytes, list, tuple, dict, torch.dtype, slice or a dataclass "
                    f"registered with register_plain)")


class _Malformed(Exception):
    """Raised inside ``_decode``; ``fetch`` turns it into a StoreValueError naming the key."""


def _decode(node: Any) -> Any:
    if node is None or type(node) in (bool, int, float, str):
        return node
    if type(node) is list:
        return [_decode(x) for x in node]
    if type(node) is not dict:
        raise _Malformed(f"unexpected JSON {type(node).__name__}")
    tag = node.get("$")
    want = {"tuple": {"items"}, "dict": {"items"}, "bytes": {"b64"}, "dtype": {"name"},
            "slice": {"start", "stop", "step"}, "obj": {"type", "fields"}}.get(tag)
    if want is None or set(node) != want | {"$"}:
        raise _Malformed(f"unknown node {sorted(node)} with tag {tag!r}")
    if tag in ("tuple", "dict") and type(node["items"]) is not list:
        raise _Malformed(f"{tag} items are not a list")
    if tag == "tuple":
        return tuple(_decode(x) for x in node["items"])
    if tag == "dict":
        out = {}
        for pair in node["items"]:
            if type(pair) is not list or len(pair) != 2:
                raise _Malformed("a dict item is not a [key, value] pair")
            k = _decode(pair[0])
            try:
                hash(k)
            except TypeError:
                raise _Malformed(f"unhashable dict key of type {type(k).__name__}") from None
            out[k] = _decode(pair[1])
        return out
    if tag == "bytes":
        try:
            return base64.b64decode(node["b64"], validate=True)
        except (binascii.Error, TypeError, ValueError):
            raise _Malformed("bad base64 in bytes") from None
    if tag == "dtype":
        dtype = _DTYPES.get(node["name"]) if type(node["name"]) is str else None
        if dtype is None:
            raise _Malformed(f"unknown dtype {node['name']!r}")
        return dtype
    if tag == "slice":
        return slice(_decode(node["start"]), _decode(node["stop"]), _decode(node["step"]))
    cls = _REGISTRY.get(node["type"]) if type(node["type"]) is str else None
    if cls is None:
        raise _Malformed(f"type {node['type']!r} is not registered with register_plain")
    if type(node["fields"]) is not dict:
        raise _Malformed(f"fields of {node['type']} are not an object")
    kwargs = {n: _decode(v) for n, v in node["fields"].items()}
    try:
        return cls(**kwargs)  # the constructor validates what arrived
    except (TypeError, ValueError) as e:
        raise _Malformed(f"{node['type']} refused its fields: {e}") from None


@lru_cache(maxsize=8)
def _parse_env_secret(env: str) -> GroupSecret:
    try:
        return GroupSecret(bytes.fromhex(env))
    except ValueError:
        raise ValueError(f"${SECRET_ENV} must be >= 32 hex digits") from None


def _env_secret() -> GroupSecret | None:
    env = os.environ.get(SECRET_ENV)
    return _parse_env_secret(env) if env else None


@lru_cache(maxsize=8)
def _value_key(secret: GroupSecret) -> bytes:
    """The MAC key of store values: derived, so that it differs from what the fd servers use."""
    return hmac.new(bytes(secret), _VALUE_KEY_LABEL, hashlib.sha256).digest()


def _value_mac(secret: GroupSecret, key: str, payload: bytes) -> bytes:
    k = key.encode()
    return hmac.new(_value_key(secret), len(k).to_bytes(8, "big") + k + payload, hashlib.sha256).digest()


def publish(store: dist.Store, key: str, obj: Any) -> None:
    """Write ``obj`` (small metadata only; a plain value, see the module docstring) under ``key``,
    with a MAC when ``$TRITONRESHARD_GROUP_SECRET`` is set. ``TypeError`` names what is not plain."""
    payload = json.dumps(_encode(obj, f"publish {key!r}: value"), separators=(",", ":")).encode()
    secret = _env_secret()
    if secret is None:
        store.set(key, _PLAIN + payload)
    else:
        store.set(key, _SIGNED + _value_mac(secret, key, payload).hex().encode() + b"\n" + payload)


def _read_value(key: str, raw: bytes) -> Any:
    secret = _env_secret()
    if raw.startswith(_SIGNED):
        mac_hex, payload = raw[len(_SIGNED):len(_SIGNED) + _MAC_HEX], raw[len(_SIGNED) + _MAC_HEX + 1:]
        if secret is not None and not hmac.compare_digest(mac_hex, _value_mac(secret, key, payload).hex().encode()):
            raise StoreValueError(f"store key {key!r}: the value is forged or corrupted (its MAC does not "
                                  f"match the group secret from ${SECRET_ENV})")
        # Without the environment secret this process can't check the MAC; it reads the value as
        # plain JSON, which is all a group without it gets.
    elif raw.startswith(_PLAIN):
        if secret is not None:
            raise StoreValueError(f"store key {key!r}: the value is forged or corrupted (it has no MAC, "
                                  f"and every rank with ${SECRET_ENV} set signs its values)")
        payload = raw[len(_PLAIN):]
    else:
        raise StoreValueError(f"store key {key!r}: the value is not a tritonreshard plain value (it "
                              f"starts with {raw[:12]!r}); refusing it (store values are never unpickled)")
    try:
        return _decode(json.loads(payload))
    except (ValueError, RecursionError, _Malformed) as e:  # JSON errors are ValueErrors
        raise StoreValueError(f"store key {key!r}: the value is not a tritonreshard plain value ({e})") from None


def fetch(store: dist.Store, key: str, *, timeout: float, what: str | None = None) -> Any:
    """Wait up to ``timeout`` s for ``key`` and decode it. ``TimeoutError`` names key and ``what``;
    ``StoreValueError`` if the value is not a plain value or (with the environment secret) its MAC
    is missing or wrong."""
    try:
        store.wait([key], _td(timeout))
    except (RuntimeError, dist.DistError) as e:
        if "timeout" not in str(e).lower() and "timed out" not in str(e).lower():
            raise
        desc = f" ({what})" if what else ""
        raise TimeoutError(f"timed out after {timeout:.3g} s waiting for store key {key!r}{desc}") from None
    return _read_value(key, store.get(key))


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


# ---------------------------------------------------------------------------- the group secret
def secret_for_children() -> None:
    """Launcher (before spawning a group's processes): put a fresh group secret in this process's
    environment, which spawned children inherit, so the secret never goes through the store.
    Keeps one that is already set."""
    os.environ.setdefault(SECRET_ENV, secrets.token_hex(_SECRET_BYTES))


def _listeners(port: int) -> list[tuple[str, int]]:
    """``(local address, owner uid)`` of the sockets listening on TCP ``port`` in this network
    namespace (``/proc/net/tcp{,6}``: the uid is the socket's creator's)."""
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
            out.append((str(ipaddress.ip_address(raw[:width])), int(cols[7])))
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
    listeners = _listeners(port)
    addrs = [a for a, _ in listeners]
    if not addrs:
        return f"no socket listening on port {port} is visible in /proc/net/tcp{{,6}}"
    # A loopback store of another user (an HTTP call may name any port): its secret, and so the
    # weights this process would read, would be that user's.
    others = sorted({uid for _, uid in listeners if uid != os.geteuid()})
    if others:
        return (f"the TCPStore on port {port} belongs to uid {', '.join(map(str, others))}, not to this "
                f"process's uid {os.geteuid()}")
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
    try:
        env = _env_secret()
    except ValueError as e:
        raise ValueError(f"group_secret: {e}") from None
    if env is not None:
        return env
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

