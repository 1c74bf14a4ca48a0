"""CUDA transport: device memory exported to peer processes on the same host (cuda-python driver API).

* ``cuda-vmm`` (preferred): ``cuMemCreate`` with ``CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR``
  (size rounded up to the recommended granularity), mapped locally with
  ``cuMemAddressReserve``/``cuMemMap``/``cuMemSetAccess``. The exported fd goes to peers through the
  owner's authenticated fd server (SCM_RIGHTS), so no ptrace rights (``pidfd_getfd``) are needed.
  Peers ``cuMemImportFromShareableHandle`` + map + grant access to *their* device.
* ``cuda-ipc`` (fallback where VMM or POSIX-fd handles are unsupported): ``cuMemAlloc`` +
  ``cuIpcGetMemHandle``; the 64-byte IPC handle also travels only over the authenticated socket.

Device pointers become torch tensors through ``__cuda_array_interface__``; torch keeps the
wrapper object alive for as long as any view exists and the wrapper's finalizer unmaps/frees, so
views never dangle (same rule as the CPU transport, see ``_base``).

``cuda.bindings`` is imported lazily: this module imports on machines without a GPU.
"""
from __future__ import annotations

import ctypes
import json
import logging
import os
import secrets
import threading
import weakref

import torch

from ._base import Arena, ArenaHandle, new_handle
from ._fdserver import FdServer, as_secret_bytes, request_fds

__all__ = ["CudaArena"]

log = logging.getLogger(__name__)
_IPC_HANDLE_BYTES = 64


def _driver():
    # Lazy: cuda-python's driver bindings load libcuda, which a CPU-only machine does not have.
    from cuda.bindings import driver
    return driver


def _check(result, what: str):
    """cuda-python returns ``(CUresult, *values)``; raise on error, return the value(s)."""
    drv = _driver()
    err, vals = (result[0], result[1:]) if isinstance(result, tuple) else (result, ())
    if err != drv.CUresult.CUDA_SUCCESS:
        _, name = drv.cuGetErrorName(err)
        name = name.decode() if isinstance(name, bytes) else str(name)
        raise RuntimeError(f"{what} failed with {name} (pid {os.getpid()})")
    if not vals:
        return None
    return vals[0] if len(vals) == 1 else vals


class _PrimaryContext:
    """Retained primary context of one device (the one torch uses), pushed around driver calls."""

    def __init__(self, ordinal: int):
        drv = _driver()
        _check(drv.cuInit(0), "cuInit")
        self.ordinal = ordinal
        self.dev = _check(drv.cuDeviceGet(ordinal), f"cuDeviceGet({ordinal})")
        self.ctx = _check(drv.cuDevicePrimaryCtxRetain(self.dev), f"cuDevicePrimaryCtxRetain({ordinal})")
        self._released = False

    def __enter__(self):
        _check(_driver().cuCtxPushCurrent(self.ctx), "cuCtxPushCurrent")
        return self

    def __exit__(self, *exc):
        _check(_driver().cuCtxPopCurrent(), "cuCtxPopCurrent")
        return False

    def attribute(self, name: str) -> int:
        drv = _driver()
        return _check(drv.cuDeviceGetAttribute(getattr(drv.CUdevice_attribute, name), self.dev),
                      f"cuDeviceGetAttribute({name})")

    def release(self):
        if not self._released:
            self._released = True
            _check(_driver().cuDevicePrimaryCtxRelease(self.dev), "cuDevicePrimaryCtxRelease")


def _vmm_supported(ctx: _PrimaryContext) -> bool:
    return bool(ctx.attribute("CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED")) and \
        bool(ctx.attribute("CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED"))


def _access_desc(ordinal: int):
    drv = _driver()
    desc = drv.CUmemAccessDesc()
    desc.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    desc.location.id = ordinal
    desc.flags = drv.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    return desc


def _map_vmm(mem_handle, size: int, ordinal: int) -> int:
    """Reserve VA, map ``mem_handle`` there and grant ``ordinal`` read/write access; returns the ptr."""
    drv = _driver()
    ptr = _check(drv.cuMemAddressReserve(size, 0, 0, 0), "cuMemAddressReserve")
    try:
        _check(drv.cuMemMap(ptr, size, 0, mem_handle, 0), "cuMemMap")
        try:
            _check(drv.cuMemSetAccess(ptr, size, [_access_desc(ordinal)], 1), "cuMemSetAccess")
        except BaseException:
            drv.cuMemUnmap(ptr, size)
            raise
    except BaseException:
        drv.cuMemAddressFree(ptr, size)
        raise
    return int(ptr)


class _DeviceMemory:
    """Owns one mapping; exposes it as ``__cuda_array_interface__`` (1-D uint8).

    ``torch.as_tensor`` keeps this object alive while views exist; the finalizer runs the release
    steps (unmap, free, release context) when the last reference goes.
    """

    def __init__(self, ptr: int, nbytes: int, release_steps: list, ordinal: int | None = None):
        self.ptr = ptr
        self._finalizer = weakref.finalize(self, _run_release_steps, release_steps)
        if ordinal is None:  # where the memory lives, in this process's device numbering
            drv = _driver()
            ordinal = int(_check(drv.cuPointerGetAttribute(
                drv.CUpointer_attribute.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, ptr),
                "cuPointerGetAttribute(DEVICE_ORDINAL)"))
        self.ordinal = ordinal
        self.__cuda_array_interface__ = {
            "shape": (nbytes,), "typestr": "|u1", "data": (ptr, False),
            "version": 3, "strides": None, "stream": None,
        }


def _run_release_steps(steps):
    # Cleanup during GC/interpreter exit: report, never raise (nothing could catch it).
    for what, fn in steps:
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - finalizer
            log.warning("tritonreshard cuda arena cleanup: %s failed: %s", what, e)


class CudaArena(Arena):
    """Device-memory arena. Build with ``create`` (owner) / ``open`` (peer)."""

    def __init__(self, handle, mem: _DeviceMemory, is_owner: bool, server: FdServer | None):
        self._handle = handle
        self.is_owner = is_owner
        self._server = server
        self._lock = threading.Lock()
        # torch.as_tensor moves a __cuda_array_interface__ object to the device it is given (CPU
        # by default), so name the device the memory lives on (for an imported allocation: the
        # owner's GPU in this process's numbering), and check that nothing was copied.
        base = torch.as_tensor(mem, device=torch.device("cuda", mem.ordinal))
        if base.data_ptr() != mem.ptr:
            raise RuntimeError(f"{handle!r}: torch copied the arena instead of viewing it")
        self._base = base[: handle.nbytes]
        self._device = base.device

    @classmethod
    def create(cls, nbytes: int, device: torch.device, *, secret, expected_peers: int | None = None,
               mode: str = "auto") -> CudaArena:
        if nbytes < 0:
            raise ValueError(f"create_arena: nbytes must be >= 0, got nbytes={nbytes}")
        if mode not in ("auto", "vmm", "ipc"):
            raise ValueError(f"create_arena: cuda_mode must be 'auto', 'vmm' or 'ipc', got {mode!r}")
        secret = as_secret_bytes(secret)
        ordinal = device.index if device.index is not None else torch.cuda.current_device()
        ctx = _PrimaryContext(ordinal)
        try:
            if mode == "auto":
                mode = "vmm" if _vmm_supported(ctx) else "ipc"
            with ctx:
                make = cls._create_vmm if mode == "vmm" else cls._create_ipc
                handle, mem, ipc_raw, fd = make(ctx, nbytes)
        except BaseException:
            ctx.release()
            raise
        # From here on mem's finalizer owns the device memory and the context reference.
        return cls._serve(handle, mem, secret, expected_peers, ipc_raw, fd)

    @classmethod
    def _create_vmm(cls, ctx, nbytes):
        drv = _driver()
        fd_type = drv.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        prop = drv.CUmemAllocationProp()
        prop.type = drv.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = ctx.ordinal
        prop.requestedHandleTypes = fd_type
        gran = _check(drv.cuMemGetAllocationGranularity(
            prop, drv.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED),
            "cuMemGetAllocationGranularity")
        alloc = max(1, -(-nbytes // gran)) * gran
        handle = new_handle("cuda-vmm", secrets.token_hex(16), nbytes, alloc, f"cuda:{ctx.ordinal}")
        mem_handle = _check(drv.cuMemCreate(alloc, prop, 0), f"cuMemCreate({alloc} bytes on cuda:{ctx.ordinal})")
        steps = [("cuMemRelease", lambda: _check(drv.cuMemRelease(mem_handle), "cuMemRelease")),
                 ("cuDevicePrimaryCtxRelease", ctx.release)]
        fd = -1
        try:
            fd = int(_check(drv.cuMemExportToShareableHandle(mem_handle, fd_type, 0),
                            "cuMemExportToShareableHandle(POSIX_FILE_DESCRIPTOR)"))
            ptr = _map_vmm(mem_handle, alloc, ctx.ordinal)
        except BaseException:
            if fd >= 0:
                os.close(fd)
            _run_release_steps(steps[:1])  # the caller releases the context
            raise
        steps = _unmap_steps(ctx, ptr, alloc) + steps
        try:
            mem = _DeviceMemory(ptr, alloc, steps, ctx.ordinal)
        except BaseException:
            os.close(fd)
            raise
        return handle, mem, b"", fd

    @classmethod
    def _create_ipc(cls, ctx, nbytes):
        drv = _driver()
        alloc = max(nbytes, 1)
        handle = new_handle("cuda-ipc", secrets.token_hex(16), nbytes, alloc, f"cuda:{ctx.ordinal}")
        ptr = _check(drv.cuMemAlloc(alloc), f"cuMemAlloc({alloc} bytes on cuda:{ctx.ordinal})")
        steps = [_sync_step(ctx),
                 ("cuMemFree", _in_ctx(ctx, lambda: _check(drv.cuMemFree(ptr), "cuMemFree"))),
                 ("cuDevicePrimaryCtxRelease", ctx.release)]
        try:
            ipc = _check(drv.cuIpcGetMemHandle(ptr), "cuIpcGetMemHandle")
            raw = ctypes.string_at(ipc.getPtr(), _IPC_HANDLE_BYTES)
        except BaseException:
            _run_release_steps(steps[1:2])
            raise
        return handle, _DeviceMemory(int(ptr), alloc, steps, ctx.ordinal), raw, None

    @classmethod
    def _serve(cls, handle, mem, secret, expected_peers, ipc_raw: bytes, fd: int | None):
        payload = json.dumps({"alloc_nbytes": handle.alloc_nbytes, "ipc": ipc_raw.hex()}).encode()
        fds = [] if fd is None else [fd]
        server = None
        try:
            if expected_peers != 0:
                server = FdServer(handle.socket_address, secret, handle.arena_id, payload, fds,
                                  max_clients=expected_peers)  # owns fd from here on
        finally:
            if server is None and fd is not None:
                os.close(fd)
        try:
            return cls(handle, mem, True, server)
        except BaseException:
            if server is not None:
                server.stop()
            raise

    @classmethod
    def open(cls, handle: ArenaHandle, *, secret, device: torch.device | None = None,
             timeout: float = 10.0) -> CudaArena:
        """Map the owner's arena; ``device`` is the local device that will access it (default: current)."""
        if handle.kind not in ("cuda-vmm", "cuda-ipc"):
            raise ValueError(f"open_arena: CudaArena can't open kind={handle.kind!r}")
        nfds = 1 if handle.kind == "cuda-vmm" else 0
        payload, fds = request_fds(handle.socket_address, secret, handle.arena_id, nfds, timeout)
        meta = json.loads(payload)
        ordinal = device.index if device is not None and device.index is not None \
            else torch.cuda.current_device()
        drv = _driver()
        mem = None
        try:
            ctx = _PrimaryContext(ordinal)
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        try:
            with ctx:
                if handle.kind == "cuda-vmm":
                    fd_type = drv.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
                    try:
                        mem_handle = _check(drv.cuMemImportFromShareableHandle(fds[0], fd_type),
                                            "cuMemImportFromShareableHandle")
                    finally:
                        os.close(fds[0])  # the imported handle holds its own reference
                    alloc = int(meta["alloc_nbytes"])
                    try:
                        ptr = _map_vmm(mem_handle, alloc, ordinal)
                    finally:
                        # The mapping keeps the memory alive; the handle is not needed any more.
                        _check(drv.cuMemRelease(mem_handle), "cuMemRelease")
                    steps = _unmap_steps(ctx, ptr, alloc) + [("cuDevicePrimaryCtxRelease", ctx.release)]
                else:
                    ipc = drv.CUipcMemHandle()
                    raw = bytes.fromhex(meta["ipc"])
                    assert len(raw) == _IPC_HANDLE_BYTES
                    ctypes.memmove(ipc.getPtr(), raw, _IPC_HANDLE_BYTES)
                    ptr = int(_check(drv.cuIpcOpenMemHandle(
                        ipc, drv.CUipcMem_flags.CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS), "cuIpcOpenMemHandle"))
                    alloc = int(meta["alloc_nbytes"])
                    dptr = drv.CUdeviceptr(ptr)
                    steps = [_sync_step(ctx),
                             ("cuIpcCloseMemHandle",
                              _in_ctx(ctx, lambda: _check(drv.cuIpcCloseMemHandle(dptr), "cuIpcCloseMemHandle"))),
                             ("cuDevicePrimaryCtxRelease", ctx.release)]
                mem = _DeviceMemory(ptr, alloc, steps)  # from here on its finalizer owns cleanup
        except BaseException:
            if mem is not None:
                raise
            ctx.release()
            raise
        return cls(handle, mem, False, None)

    def _unlink(self) -> None:
        with self._lock:
            server, self._server = self._server, None
        if server is not None:
            server.stop()

    def _close(self) -> None:
        if self.is_owner:
            self._unlink()
        # Dropping _base (done by Arena.close) drops our reference to the _DeviceMemory; the
        # unmap runs as soon as no user view is left.


def _in_ctx(ctx: _PrimaryContext, fn):
    def run():
        with ctx:
            fn()
    return run


def _sync_step(ctx):
    # Kernels still queued on any stream may read the arena: drain the device before unmapping.
    drv = _driver()
    return ("cuCtxSynchronize", _in_ctx(ctx, lambda: _check(drv.cuCtxSynchronize(), "cuCtxSynchronize")))


def _unmap_steps(ctx, ptr: int, size: int):
    drv = _driver()
    return [_sync_step(ctx),
            ("cuMemUnmap", _in_ctx(ctx, lambda: _check(drv.cuMemUnmap(ptr, size), "cuMemUnmap"))),
            ("cuMemAddressFree", _in_ctx(ctx, lambda: _check(drv.cuMemAddressFree(ptr, size), "cuMemAddressFree")))]
