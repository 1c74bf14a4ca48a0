"""A loader run on the meta device, its copies recorded as boxes: :class:`LoadTracer`.

A loader (vLLM's ``load_weights``) is fed meta tensors for the sources and meta scratch tensors
for its parameters, so nothing is allocated and no element is read. A ``TorchDispatchMode`` sees
every aten call: views keep their storage, offset and strides on the meta device, so every
``copy_`` into a parameter says exactly which source elements land where, as
:class:`~tritonreshard.recipes.boxes.Piece` boxes. What is no copy is recorded as such, never
guessed:

* ``copy_`` from a view of a source (narrow, select, unbind, chunk, transpose, permute, expand):
  a piece; ``fill_(0)`` / ``zero_()``: a zero piece; any other value or in-place op: a piece that
  is no copy;
* ``clone`` / ``contiguous`` / ``to(dtype)`` of a source view: a new tensor that still maps to the
  source (a cast is the refit's job too); zeros made by the loader (``zeros``, ``new_zeros``): zeros;
* any other op on a source (``cat``, ``mul``, ``index_select`` ...): values that are no copy
  (named by the op), so a parameter made of them is refused, not passed;
* a write into a parameter's view that is no box of it, or a read the tracer cannot express:
  *undecided*, with the reason; a caller refuses it (fail closed).

Cost: the loader's own Python and one dispatch per aten call; memory: the metadata. Neither grows
with the tensors' sizes.
"""
from __future__ import annotations

from collections.abc import Mapping

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .boxes import FILL, NOT_A_COPY, Written, copy_pieces, place

__all__ = ["LoadTracer"]

_aten = torch.ops.aten
# New tensors that hold their input's elements unchanged (a dtype cast counts: the refit casts too).
_SAME = {_aten.clone.default, _aten._to_copy.default, _aten.lift_fresh_copy.default}
# New tensors of zeros.
_ZEROS = {_aten.zeros.default, _aten.zeros_like.default, _aten.new_zeros.default}
_FILLS = {_aten.fill_.Scalar, _aten.fill_.Tensor, _aten.zero_.default}


def _key(t) -> int | None:
    return t.untyped_storage()._cdata if isinstance(t, torch.Tensor) and t.is_meta else None


def _view(t: torch.Tensor) -> tuple:
    return t.storage_offset(), tuple(t.shape), tuple(t.stride())


class _Map:
    """What a traced storage holds, as a function of its own contiguous index: ``kind`` is
    "flat" (source ``src``'s element ``base + flat index``), "affine" (``base + sum(i * coef)``
    over the multi-index of ``shape``), "fill", "nocopy" or "undecided" (``why``)."""

    __slots__ = ("kind", "src", "base", "shape", "coef", "why")

    def __init__(self, kind, src=-1, base=0, shape=(), coef=(), why=""):
        self.kind, self.src, self.base, self.shape, self.coef, self.why = kind, src, base, shape, coef, why

    def linear(self, view: tuple):
        """``(src, (base, weights), why)`` of a view of this storage: source element of view index
        ``v`` is ``base + sum(v * weights)``."""
        offset, sizes, strides = view
        if self.kind == "flat":
            return self.src, (self.base + offset, strides), ""
        if self.kind == "fill":
            return FILL, None, ""
        if self.kind == "nocopy":
            return NOT_A_COPY, None, self.why
        if self.kind == "affine":
            got = place(self.shape, offset, sizes, strides)
            if got is not None and all(m == 1 for *_, m in got[1]):
                starts, subs = got
                weights = [0] * len(sizes)
                for k, _, j, _ in subs:
                    weights[j] = self.coef[k]
                return self.src, (self.base + sum(a * c for a, c in zip(starts, self.coef, strict=True)), weights), ""
            return None, None, "a view of a copied source that is no box of it"
        return None, None, self.why


class LoadTracer(TorchDispatchMode):
    """Record what a loader writes into ``targets`` (``{name: meta tensor}``, contiguous) from
    ``sources`` (``{source id: meta tensor}``). After the loader ran, ``written[name]`` is a
    :class:`~tritonreshard.recipes.boxes.Written` of that target (its pieces, or why undecided).
    ``guard``: data pointers of real storages nothing may write (the served model's): a write
    raises ``RuntimeError``."""

    def __init__(self, sources: Mapping[int, torch.Tensor], targets: Mapping[str, torch.Tensor],
                 guard: set[int] = frozenset()):
        super().__init__()
        self.maps: dict[int, _Map] = {_key(t): _Map("flat", src=i) for i, t in sources.items()}
        self.written = {n: Written(tuple(t.shape)) for n, t in targets.items()}
        self.targets = {_key(t): self.written[n] for n, t in targets.items()}
        self.guard = guard
        # Every storage with a map stays alive while the tracer does: a freed one's address (its
        # key) would be a new tensor's, which would inherit its map.
        self._alive: list = [*sources.values(), *targets.values()]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if (func is _aten.copy_.default or func in _FILLS) and args[0].numel() == 0:
            pass  # writes nothing (vLLM fills an empty padding view on a rank that has no padding)
        elif func is _aten.copy_.default:
            self._copy(args[0], args[1])
        elif func in _FILLS:
            value = args[1] if len(args) > 1 else 0
            self._fill(args[0], value)
        else:
            self._other_writes(func, args, kwargs)
        out = func(*args, **kwargs)
        self._derive(func, args, kwargs, out)
        return out

    # ------------------------------------------------------------------------------ writes
    def _copy(self, dst: torch.Tensor, src) -> None:
        key = _key(dst)
        if key in self.maps:  # a loader writing into a source (gpt-oss zeroes a bias it was given)
            self.maps[key] = self._source_after_write(dst, "copied into")
            return
        target = self.targets.get(key)
        if target is None:
            self._refuse_live(dst, "copy_")
            return
        view = _view(dst)
        if not isinstance(src, torch.Tensor):
            target.write(None, f"copy_ from a {type(src).__name__}")
            return
        sview = _broadcast(_view(src), view[1])
        smap = self.maps.get(_key(src))
        if smap is None and _key(src) in self.targets:
            target.write(None, "a copy from another parameter")
            return
        if smap is None:  # a tensor the loader made from no source: whatever it holds is no copy
            target.write(copy_pieces(target.shape, view, NOT_A_COPY, None), "a view that is no box of the parameter")
            return
        s, linear, why = smap.linear(sview)
        if s is None:
            target.write(None, why)
            return
        target.write(copy_pieces(target.shape, view, s, linear), "a write into a view that is no box of the parameter")

    def _fill(self, dst: torch.Tensor, value) -> None:
        key = _key(dst)
        zero = not isinstance(value, torch.Tensor) and value == 0
        if key in self.maps:
            self.maps[key] = self._source_after_write(dst, "filled", zero)
            return
        target = self.targets.get(key)
        if target is None:
            self._refuse_live(dst, "fill_")
            return
        target.write(copy_pieces(target.shape, _view(dst), FILL if zero else NOT_A_COPY, None),
                     "a fill of a view that is no box of the parameter")

    def _other_writes(self, func, args, kwargs) -> None:
        for i, arg in enumerate(func._schema.arguments):
            if arg.alias_info is None or not arg.alias_info.is_write:
                continue
            t = args[i] if i < len(args) else kwargs.get(arg.name)
            if not isinstance(t, torch.Tensor):
                continue
            key = _key(t)
            if key in self.targets:
                self.targets[key].write(copy_pieces(self.targets[key].shape, _view(t), NOT_A_COPY, None),
                                        f"{func} on a view that is no box of the parameter")
            elif key in self.maps:
                self.maps[key] = _Map("nocopy", why=f"{func} wrote into it")
            else:
                self._refuse_live(t, str(func))

    def _source_after_write(self, t: torch.Tensor, how: str, zero: bool = False) -> _Map:
        whole = t.storage_offset() == 0 and t.is_contiguous() and t.numel() * t.element_size() == \
            t.untyped_storage().nbytes()
        if whole and zero:
            return _Map("fill")
        return _Map("undecided", why=f"the loader {how} part of a source it was given")

    def _refuse_live(self, t: torch.Tensor, what: str) -> None:
        if not t.is_meta and t.numel() and t.untyped_storage().data_ptr() in self.guard:
            raise RuntimeError(f"tritonreshard verify: vLLM's loader wrote into a served tensor ({what})")

    # ------------------------------------------------------------------------- new tensors
    def _derive(self, func, args, kwargs, out) -> None:
        if func.is_view:
            return  # a view: the same storage, the same map
        outs = [t for t in _tensors(out) if t.is_meta]
        if not outs:
            return
        inputs = [t for t in _tensors(args) if t.is_meta] + [t for t in _tensors(kwargs.values()) if t.is_meta]
        keys = {_key(t) for t in inputs}
        for t in outs:
            key = _key(t)
            if key in keys or key in self.maps or key in self.targets:
                continue  # an in-place op's result: its storage's map is as the write left it
            if func in _ZEROS or (func is _aten.full.default and args[1] == 0):
                self.maps[key] = _Map("fill")
                self._alive.append(t)
                continue
            traced = [x for x in inputs if _key(x) in self.maps or _key(x) in self.targets]
            if not traced:
                continue
            if func in _SAME and len(traced) == 1 and _key(traced[0]) in self.maps:
                self.maps[key] = self._same(self.maps[_key(traced[0])], traced[0], t)
            else:
                self.maps[key] = _Map("nocopy", why=str(func))
            self._alive.append(t)

    @staticmethod
    def _same(smap: _Map, src: torch.Tensor, out: torch.Tensor) -> _Map:
        if tuple(out.shape) != tuple(src.shape) or not out.is_contiguous():
            return _Map("undecided", why="a copy of a source into a tensor of another shape or order")
        s, linear, why = smap.linear(_view(src))
        if s is None:
            return _Map("undecided", why=why)
        if s < 0:
            return _Map("fill") if s == FILL else _Map("nocopy", why=why)
        base, weights = linear
        return _Map("affine", src=s, base=base, shape=tuple(src.shape), coef=tuple(weights))


def _tensors(obj):
    """The tensors in ``obj``: a tensor, or a list / tuple of them and of other values (what aten
    calls take and return; cheaper than a pytree walk on every call)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)) or type(obj).__name__ == "dict_values":
        for x in obj:
            if isinstance(x, torch.Tensor):
                yield x
            elif isinstance(x, (list, tuple)):
                yield from (y for y in x if isinstance(y, torch.Tensor))


def _broadcast(view: tuple, sizes: tuple) -> tuple:
    """A source view as ``copy_`` broadcasts it to ``sizes``: missing leading dims and size-1
    dims read the same element (stride 0)."""
    offset, ssizes, sstrides = view
    pad = len(sizes) - len(ssizes)
    ssizes, sstrides = (1,) * pad + tuple(ssizes), (0,) * pad + tuple(sstrides)
    # Not strict: a source of more dims than ``sizes`` is torch's to refuse once the copy runs (a
    # ValueError raised here would read as a name the loader does not know: vllm/trace.py).
    strides = tuple(0 if s == 1 and n != 1 else st for s, n, st in zip(ssizes, sizes, sstrides, strict=False))
    return offset, tuple(sizes), strides
