"""Compiled or interpreted, chosen per launch from the tensors' device, never from the environment.

``triton.jit`` decides "interpreter or compiler" once, when a function is decorated, from
``TRITON_INTERPRET``; setting that variable to run CPU tensors would switch every other library's
Triton kernels to the interpreter too, and reading ``torch.cuda.is_available()`` at import would
initialise CUDA (no fork afterwards). So the kernels here are always built as real
:class:`~triton.runtime.jit.JITFunction` objects (what ``triton.jit`` builds without the variable;
what the compile gate compiles), and :func:`interpreted` derives, on first use, an interpreted twin
of a kernel whose calls to the other ``@jit`` helpers of its module resolve to interpreted twins too.
"""
from __future__ import annotations

import threading
import types

from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

__all__ = ["interpreted", "jit"]

_lock = threading.Lock()
_twins: dict[int, InterpretedFunction] = {}


def jit(fn=None, **kwargs):
    """``triton.jit`` that always compiles (ignores ``TRITON_INTERPRET``); same keyword arguments."""
    if fn is None:
        return lambda f: JITFunction(f, **kwargs)
    return JITFunction(fn, **kwargs)


def interpreted(kernel: JITFunction) -> InterpretedFunction:
    """The interpreted twin of ``kernel`` (built once per module, cached).

    The twin runs ``kernel``'s Python source in a copy of its module's globals in which every
    ``JITFunction`` is replaced by an ``InterpretedFunction`` over the same source, so nested helper
    calls are interpreted as well; the module itself, and ``triton.jit`` for everyone else, are left
    alone. (While an interpreted launch runs, Triton's interpreter patches ``triton.language``
    in-process, as it always does.)
    """
    twin = _twins.get(id(kernel))
    if twin is not None:
        return twin
    with _lock:
        if id(kernel) not in _twins:
            module_globals = kernel.fn.__globals__
            twin_globals = dict(module_globals)
            made = {}
            for name, value in module_globals.items():
                if isinstance(value, JITFunction):
                    f = value.fn
                    copy = types.FunctionType(f.__code__, twin_globals, f.__name__, f.__defaults__, f.__closure__)
                    copy.__kwdefaults__ = f.__kwdefaults__
                    copy.__module__ = f.__module__
                    copy.__qualname__ = f.__qualname__
                    twin_globals[name] = made[id(value)] = InterpretedFunction(copy)
            for jid, twin in made.items():
                _twins.setdefault(jid, twin)
        return _twins[id(kernel)]
