"""Timing probe for bench/vllm_call_hops.py: a ``vllm.general_plugins`` entry point (installed by
that script into a temporary folder on the server's PYTHONPATH, never into the project) that wraps
vLLM 0.32's methods on the path of a weight-update call and appends one JSON line per event
(``time.monotonic()``: one clock for every process of the machine) to ``$TRS_HOPS_LOG``.

Events (``where``): ``api`` (the API server's ``AsyncLLM.<method>``, enter/exit), ``core`` (the
engine core's ``_handle_client_request`` of a utility call, enter; ``EngineCore.collective_rpc``,
enter/exit), ``exec`` (``MultiprocExecutor.collective_rpc``, enter/exit), ``worker`` (each worker's
``WorkerProc._execute_worker_rpc``, enter/exit). Only the weight-update methods are logged. With
``$TRS_HOPS_SPIN_S`` set it also sets vLLM's reader busy loop (``SpinCondition.busy_loop_s``).
"""
import functools
import json
import os
import time

METHODS = ("start_weight_update", "update_weights", "finish_weight_update")
_done = False


def _log(where, event, method, **extra):
    line = json.dumps({"t": time.monotonic(), "pid": os.getpid(), "where": where, "event": event,
                       "method": method, **extra}) + "\n"
    fd = os.open(os.environ["TRS_HOPS_LOG"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def _wrap(cls, name, where, method_of, is_async=False):
    orig = getattr(cls, name)
    if getattr(orig, "_trs_hops", False):
        return

    if is_async:
        @functools.wraps(orig)
        async def wrapper(*args, **kwargs):
            m = method_of(args, kwargs)
            if m in METHODS:
                _log(where, "enter", m)
            try:
                return await orig(*args, **kwargs)
            finally:
                if m in METHODS:
                    _log(where, "exit", m)
    else:
        @functools.wraps(orig)
        def wrapper(*args, **kwargs):
            m = method_of(args, kwargs)
            if m in METHODS:
                _log(where, "enter", m)
            try:
                return orig(*args, **kwargs)
            finally:
                if m in METHODS:
                    _log(where, "exit", m)
    wrapper._trs_hops = True
    setattr(cls, name, wrapper)


def _utility_method(args, kwargs):
    # EngineCoreProc._handle_client_request(self, request_type, request); a utility request is
    # (client_idx, call_id, method_name, args) and collective_rpc's args start with the method.
    _, request_type, request = args[:3]
    if getattr(request_type, "name", "") == "UTILITY" and request[2] == "collective_rpc" and request[3]:
        return request[3][0]
    return None


def _spin(seconds: float) -> None:
    """vLLM's shared-memory readers busy-loop ``busy_loop_s`` (1 s in 0.32, a constructor default
    with no setting) after each read before they sleep on the writer's notification: set it."""
    from vllm.distributed.device_communicators import shm_broadcast

    orig = shm_broadcast.SpinCondition.__init__

    @functools.wraps(orig)
    def init(self, is_reader, context, notify_address, busy_loop_s=1):
        orig(self, is_reader, context, notify_address, busy_loop_s=seconds)

    shm_broadcast.SpinCondition.__init__ = init


def register():
    global _done
    if _done or "TRS_HOPS_LOG" not in os.environ:
        return
    _done = True
    if os.environ.get("TRS_HOPS_SPIN_S"):
        _spin(float(os.environ["TRS_HOPS_SPIN_S"]))
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.engine.core import EngineCore, EngineCoreProc
    from vllm.v1.executor.multiproc_executor import MultiprocExecutor, WorkerProc

    for name in METHODS:
        _wrap(AsyncLLM, name, "api", lambda a, k, n=name: n, is_async=True)
    _wrap(EngineCoreProc, "_handle_client_request", "core-request", _utility_method)
    _wrap(EngineCore, "collective_rpc", "core", lambda a, k: a[1] if len(a) > 1 else k.get("method"))
    _wrap(MultiprocExecutor, "collective_rpc", "exec", lambda a, k: a[1] if len(a) > 1 else k.get("method"))
    _wrap(WorkerProc, "_execute_worker_rpc", "worker", lambda a, k: a[1][0])
