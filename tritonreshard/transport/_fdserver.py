"""Authenticated hand-out of file descriptors over a Unix socket (SCM_RIGHTS).

The owner of an arena runs one :class:`FdServer` thread on an abstract-namespace ``SOCK_SEQPACKET``
socket named after the arena's random id (no file to leak after a SIGKILL; the kernel drops the
name when the socket closes). It hands the arena's fd only to a client that proves it holds the
group secret, and proves the same back, so a process squatting the name can't feed a peer a fake
buffer either. Works without ptrace rights (no ``pidfd_getfd``).

Before that, each side reads the other's credentials from the kernel (``SO_PEERCRED``) and deals
only with a process of its own effective uid: abstract sockets have no permissions, so any local
user can connect or squat a name, and a group's processes all run as one user (named segments are
0600 too). A peer of another uid is refused before any nonce or MAC is exchanged, whatever secret
it holds, so a leaked secret alone does not let another local user in.

Protocol (one message per step; SEQPACKET keeps message boundaries):

0. server -> client: ``"DENY"`` and close, if the client runs as another uid
1. server -> client: ``MAGIC + nonce_s`` (32 random bytes)
2. client -> server: ``nonce_c + HMAC(secret, "client" | arena_id | nonce_s | nonce_c)``
3. server -> client: ``"DENY"`` and close, or
   ``"OKAY" + HMAC(secret, "server" | arena_id | nonce_s | nonce_c) + payload`` with the fds attached.
"""
from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import select
import socket
import struct
import threading

__all__ = ["FdServer", "request_fds", "as_secret_bytes"]

log = logging.getLogger(__name__)

MAGIC = b"TRS1"
NONCE = 32
MAC = 32
MAX_MSG = 64 * 1024
CONN_TIMEOUT_S = 5.0


def as_secret_bytes(secret) -> bytes:
    """Accept ``bytes`` or anything with ``__bytes__`` (e.g. ``GroupSecret``); reject short secrets."""
    if secret is None:
        raise ValueError("secret: the fd-passing transports need the group secret, got secret=None")
    b = bytes(secret)
    if len(b) < 16:
        raise ValueError(f"secret: need at least 16 bytes, got {len(b)} bytes")
    return b


def _peer_cred(sock: socket.socket) -> tuple[int, int, int]:
    """``(pid, uid, gid)`` of the process at the other end of a connected Unix socket."""
    return struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))


def _mac(secret: bytes, role: bytes, arena_id: str, nonce_s: bytes, nonce_c: bytes) -> bytes:
    return hmac.new(secret, role + b"|" + arena_id.encode() + b"|" + nonce_s + nonce_c,
                    hashlib.sha256).digest()


class FdServer:
    """Serve ``fds`` (kept open by the server until :meth:`stop`) plus a small ``payload``.

    ``max_clients``: stop by itself (closing the fds) after that many successful hand-outs
    (``None``: serve until :meth:`stop`).
    """

    def __init__(self, address: str, secret: bytes, arena_id: str, payload: bytes,
                 fds: list[int], max_clients: int | None = None):
        if len(payload) > MAX_MSG - 64:
            raise ValueError(f"FdServer: payload too large ({len(payload)} bytes)")
        self._secret = as_secret_bytes(secret)
        self._arena_id = arena_id
        self._payload = payload
        self._fds = list(fds)
        self._max = max_clients
        self.served = 0
        self.refused = 0
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        try:
            self._sock.bind(address)
            self._sock.listen(64)
            self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC)
        except BaseException:
            self._sock.close()
            raise
        self._stopped = False
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=f"trs-fdserver-{arena_id[:6]}",
                                        daemon=True)
        self._thread.start()

    def _run(self):
        while True:
            r, _, _ = select.select([self._sock, self._wake_r], [], [])
            if self._wake_r in r:
                return
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            with conn:
                conn.settimeout(CONN_TIMEOUT_S)
                try:
                    ok = self._serve_one(conn)
                except OSError as e:  # a client that hangs up or stalls only loses its own turn
                    log.debug("fd server %s: client error %s", self._arena_id[:6], e)
                    ok = False
            if ok:
                self.served += 1
                if self._max is not None and self.served >= self._max:
                    self.stop()
                    return
            else:
                self.refused += 1

    def _serve_one(self, conn: socket.socket) -> bool:
        pid, uid, _ = _peer_cred(conn)
        if uid != os.geteuid():
            log.warning("fd server %s: refused a client of another user (pid %d, uid %d; this server "
                        "serves uid %d only)", self._arena_id[:6], pid, uid, os.geteuid())
            conn.sendall(b"DENY")
            return False
        nonce_s = secrets.token_bytes(NONCE)
        conn.sendall(MAGIC + nonce_s)
        msg = conn.recv(NONCE + MAC + 1)  # no ancillary buffer: fds a client might send are dropped
        if len(msg) != NONCE + MAC:
            conn.sendall(b"DENY")
            return False
        nonce_c, mac = msg[:NONCE], msg[NONCE:]
        if not hmac.compare_digest(mac, _mac(self._secret, b"client", self._arena_id, nonce_s, nonce_c)):
            log.warning("fd server %s: refused a client with a bad group-secret proof", self._arena_id[:6])
            conn.sendall(b"DENY")
            return False
        with self._lock:
            if self._stopped:
                conn.sendall(b"DENY")
                return False
            reply = b"OKAY" + _mac(self._secret, b"server", self._arena_id, nonce_s, nonce_c) + self._payload
            socket.send_fds(conn, [reply], self._fds)
        return True

    def stop(self) -> None:
        """Stop serving and close the served fds. Idempotent; callable from the server thread."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
            os.write(self._wake_w, b"x")
            for fd in self._fds:
                os.close(fd)
            self._fds = []
        if threading.current_thread() is not self._thread:
            self._thread.join()
        self._sock.close()
        os.close(self._wake_r)
        os.close(self._wake_w)

    def __repr__(self):
        return f"FdServer(id={self._arena_id[:6]}…, served={self.served}, refused={self.refused})"


def request_fds(address: str, secret, arena_id: str, max_fds: int, timeout: float) -> tuple[bytes, list[int]]:
    """Client side: authenticate to the owner's server and receive ``(payload, fds)``.

    Raises ``PermissionError`` if the server refuses (wrong secret, or this process runs as another
    uid), runs as another uid, or fails to prove it holds the secret; ``ConnectionError`` if nobody
    serves ``address`` (owner gone, or arena already sealed).
    """
    secret = as_secret_bytes(secret)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    fds: list[int] = []
    try:
        sock.settimeout(timeout)
        def gone(why: str) -> ConnectionError:
            return ConnectionError(f"no fd server for arena {arena_id[:6]}…: the owner exited, or it already "
                                   f"sealed the arena (unlink) before this peer mapped it ({why})")

        try:
            sock.connect(address)
        except (FileNotFoundError, ConnectionRefusedError) as e:
            raise gone(e.strerror) from None
        pid, uid, _ = _peer_cred(sock)
        if uid != os.geteuid():  # a squatter of the name: don't talk to it at all
            raise PermissionError(
                f"fd server for arena {arena_id[:6]}… runs as uid {uid} (pid {pid}), not as this process's "
                f"uid {os.geteuid()}: refusing it")
        # A connect that raced the seal lands in the listening socket's queue just before it closes:
        # the server then resets the connection (or closes it) instead of greeting.
        try:
            hello = sock.recv(len(MAGIC) + NONCE + 1)
        except ConnectionResetError as e:
            raise gone(f"it closed this connection unanswered: {e.strerror}") from None
        if not hello:
            raise gone("it closed this connection unanswered")
        if hello == b"DENY":
            raise PermissionError(
                f"fd server for arena {arena_id[:6]}… refused this process: it serves only processes "
                f"of its own uid, this one runs as uid {os.geteuid()}")
        if len(hello) != len(MAGIC) + NONCE or not hello.startswith(MAGIC):
            raise ConnectionError(f"fd server for arena {arena_id[:6]}… sent an unexpected greeting")
        nonce_s = hello[len(MAGIC):]
        nonce_c = secrets.token_bytes(NONCE)
        sock.sendall(nonce_c + _mac(secret, b"client", arena_id, nonce_s, nonce_c))
        msg, fds, flags, _ = socket.recv_fds(sock, MAX_MSG, max_fds)
        if msg[:4] != b"OKAY":
            raise PermissionError(
                f"fd server for arena {arena_id[:6]}… refused this process: group secret mismatch")
        mac, payload = msg[4:4 + MAC], msg[4 + MAC:]
        if not hmac.compare_digest(mac, _mac(secret, b"server", arena_id, nonce_s, nonce_c)):
            raise PermissionError(
                f"fd server for arena {arena_id[:6]}… failed to prove it holds the group secret")
        if flags & socket.MSG_CTRUNC or len(fds) != max_fds:
            raise ConnectionError(f"fd server for arena {arena_id[:6]}… sent {len(fds)} fds, expected {max_fds}")
        out, fds = fds, []
        return payload, out
    finally:
        for fd in fds:  # only non-empty when we raise after receiving
            os.close(fd)
        sock.close()
