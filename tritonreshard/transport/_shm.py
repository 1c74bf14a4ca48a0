"""CPU transport: POSIX shared memory, viewed as torch tensors with ``torch.frombuffer``.

Two ways to share, chosen by whether the owner has the group secret:

* ``shm-fd`` (secret given, preferred): the segment is an anonymous ``memfd`` (labelled
  ``trs-<id>``, never in /dev/shm), handed to peers over the owner's authenticated fd server.
  Nothing has a name, so nothing can leak after a SIGKILL; ``unlink()`` stops the server and closes
  the owner's extra fd once every peer mapped it (or automatically after ``expected_peers``).
* ``shm-name`` (no secret): ``/dev/shm/trs-<32 hex>`` created ``O_CREAT|O_EXCL|O_NOFOLLOW`` with mode
  0600 (``fchmod`` again, whatever the umask), opened by peers by name (they refuse segments owned
  by another uid or with a wider mode). ``unlink()`` removes the name once every peer mapped it;
  ``close()`` also does. A survivor removes a dead owner's name with ``unlink_segment(handle)``.

CPython's ``mmap`` keeps its own dup of the fd; both the fd and the mapping go away when the mmap
is closed, which ``close()`` does at once if no view is alive, else when the last view dies
(``mmap.close()`` would raise ``BufferError`` while torch holds the buffer).
"""
from __future__ import annotations

import json
import logging
import mmap
import os
import secrets
import socket
import stat

import torch

from ._base import Arena, ArenaHandle, new_handle
from ._fdserver import FdServer, as_secret_bytes, request_fds

__all__ = ["ShmArena", "unlink_segment", "SHM_DIR"]

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
_PAGE = mmap.PAGESIZE


def _alloc_size(nbytes: int) -> int:
    return max(_PAGE, (nbytes + _PAGE - 1) // _PAGE * _PAGE)


def unlink_segment(handle: ArenaHandle) -> bool:
    """Remove the /dev/shm name of ``handle`` if it still exists (e.g. its owner was SIGKILLed).

    Safe to call from any process of the group, any number of times. Returns True if a name was
    removed. Handles of the fd-passing kinds have no name: returns False.
    """
    if handle.kind != "shm-name":
        return False
    try:
        os.unlink(os.path.join(SHM_DIR, handle.segment_name))
        return True
    except FileNotFoundError:
        return False


class ShmArena(Arena):
    """Shared-memory arena on ``torch.device('cpu')``. Build with ``create`` / ``open``."""

    def __init__(self, handle: ArenaHandle, mm: mmap.mmap, is_owner: bool,
                 path: str | None = None, server: FdServer | None = None):
        self._handle = handle
        self._device = torch.device("cpu")
        self.is_owner = is_owner
        self._mm = mm
        self._path = path          # owner, shm-name: the /dev/shm entry to unlink
        self._server = server      # owner, shm-fd: the fd server (holds the memfd)
        # torch.frombuffer keeps a reference to the object it is given but not a buffer export, so
        # mmap.close() would unmap under live views (segfault). A memoryview holds an export on the
        # mmap for as long as it lives, and torch keeps the memoryview alive with the storage: while
        # any view exists, mmap.close() raises BufferError instead of unmapping.
        self._base = torch.frombuffer(memoryview(mm), dtype=torch.uint8, count=handle.nbytes) \
            if handle.nbytes else torch.empty(0, dtype=torch.uint8)

    @classmethod
    def create(cls, nbytes: int, *, secret=None, expected_peers: int | None = None) -> ShmArena:
        if nbytes < 0:
            raise ValueError(f"create_arena: nbytes must be >= 0, got nbytes={nbytes}")
        arena_id = secrets.token_hex(16)
        alloc = _alloc_size(nbytes)
        if secret is not None:
            return cls._create_fd(arena_id, nbytes, alloc, as_secret_bytes(secret), expected_peers)
        if expected_peers is not None:
            raise ValueError("create_arena: expected_peers needs secret= (fd passing); with named "
                             "shared memory call arena.unlink() once every peer mapped it")
        return cls._create_named(arena_id, nbytes, alloc)

    @classmethod
    def _create_named(cls, arena_id, nbytes, alloc):
        handle = new_handle("shm-name", arena_id, nbytes, alloc, "cpu")
        path = os.path.join(SHM_DIR, handle.segment_name)
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        try:
            os.fchmod(fd, 0o600)
            mode = stat.S_IMODE(os.fstat(fd).st_mode)
            assert mode == 0o600, f"shm segment mode {oct(mode)} after fchmod"
            os.ftruncate(fd, alloc)
            mm = mmap.mmap(fd, alloc, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.unlink(path)
            raise
        finally:
            os.close(fd)
        return cls(handle, mm, True, path=path)

    @classmethod
    def _create_fd(cls, arena_id, nbytes, alloc, secret, expected_peers):
        handle = new_handle("shm-fd", arena_id, nbytes, alloc, "cpu")
        fd = os.memfd_create(handle.segment_name, os.MFD_CLOEXEC)
        try:
            os.fchmod(fd, 0o600)
            os.ftruncate(fd, alloc)
            mm = mmap.mmap(fd, alloc, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise
        arena = None
        try:
            arena = cls(handle, mm, True)
            payload = json.dumps({"alloc_nbytes": alloc}).encode()
            if expected_peers == 0:
                os.close(fd)
                return arena
            # The server owns fd from here on and closes it in stop().
            arena._server = FdServer(handle.socket_address, secret, arena_id, payload, [fd],
                                     max_clients=expected_peers)
            fd = -1
            return arena
        except BaseException:
            if fd >= 0:
                os.close(fd)
            if arena is not None:
                arena.close()
            raise

    @classmethod
    def open(cls, handle: ArenaHandle, *, secret=None, timeout: float = 10.0) -> ShmArena:
        try:
            return cls._open(handle, secret=secret, timeout=timeout)
        except (FileNotFoundError, ConnectionError) as exc:
            here = socket.gethostname()
            if handle.hostname == here:
                raise
            # Not gone: never here. A name in /dev/shm, or an abstract socket, is only this host's.
            raise ConnectionError(
                f"open_arena: {handle!r} belongs to a process on host {handle.hostname!r}, and this process "
                f"is on host {here!r}: another host's shared memory cannot be mapped (a host map that puts "
                f"the two on one host is wrong) ({exc})") from None

    @classmethod
    def _open(cls, handle: ArenaHandle, *, secret, timeout: float) -> ShmArena:
        if handle.kind == "shm-name":
            fd = cls._open_named(handle)
        elif handle.kind == "shm-fd":
            if secret is None:
                raise ValueError(f"open_arena: {handle!r} is passed by fd and needs secret=")
            _, fds = request_fds(handle.socket_address, secret, handle.arena_id, 1, timeout)
            fd = fds[0]
        else:
            raise ValueError(f"open_arena: ShmArena can't open kind={handle.kind!r}")
        try:
            st = os.fstat(fd)
            if st.st_size < handle.alloc_nbytes:
                raise ValueError(f"open_arena: segment of {handle!r} has {st.st_size} bytes, "
                                 f"expected {handle.alloc_nbytes}")
            mm = mmap.mmap(fd, handle.alloc_nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        return cls(handle, mm, False)

    @staticmethod
    def _open_named(handle: ArenaHandle) -> int:
        path = os.path.join(SHM_DIR, handle.segment_name)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
        except FileNotFoundError:
            raise FileNotFoundError(
                f"open_arena: shared memory of {handle!r} is gone: its owner already unlinked it "
                f"(before this peer mapped it) or exited") from None
        st = os.fstat(fd)
        problems = []
        if st.st_uid != os.getuid():
            problems.append(f"owned by uid {st.st_uid}, this process runs as uid {os.getuid()}")
        if stat.S_IMODE(st.st_mode) != 0o600:
            problems.append(f"mode {oct(stat.S_IMODE(st.st_mode))}, expected 0o600")
        if problems:
            os.close(fd)
            raise PermissionError(f"open_arena: refusing shared memory of {handle!r}: " + "; ".join(problems))
        return fd

    def _unlink(self) -> None:
        if self._path is not None:
            path, self._path = self._path, None
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass  # a survivor's unlink_segment got there first
        if self._server is not None:
            server, self._server = self._server, None
            server.stop()

    def _close(self) -> None:
        if self.is_owner:
            self._unlink()
        mm, self._mm = self._mm, None
        try:
            mm.close()
        except BufferError:
            # Views are alive: the mmap (and its fd) is released when the last one is collected.
            log.debug("%r: views still alive; unmapping when they are dropped", self)
