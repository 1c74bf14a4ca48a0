"""How copies run: Triton's kernels or torch's ops, one :class:`CopyBackend` object chosen once.

The tables of this package (:class:`~tritonreshard.kernels.DescriptorTable`,
:class:`~tritonreshard.kernels.QuantizeTable`) and the delta codec's compare-and-compact
(:mod:`~tritonreshard.kernels.delta`) each have a Triton path and a torch path over the same data.
Which one runs is asked of the backend, never decided by comparing a name:

* :class:`TritonBackend`: the kernels (compiled on CUDA tensors, Triton's interpreter on CPU
  tensors: exact and slow, for debugging);
* :class:`TorchBackend`: torch ops over the same descriptors (the fast CPU path);
* :class:`AutoBackend`: Triton on CUDA, torch on CPU. Where the device is known once (an endpoint's
  buffers, ``execute_local``'s tensors) it is resolved there (:meth:`CopyBackend.for_device`);
  asked directly, it picks per table or message from its device.

The string spellings (``"auto"``, ``"triton"``, ``"torch"``) are accepted where a backend enters
from a user (``PullOptions(backend=)``, ``execute_local(backend=)``, ``table.run("torch")``, the
command line) and turned into these objects there, by :func:`copy_backend`.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch

from .delta import TorchDeltaScan, TritonDeltaScan

__all__ = ["AutoBackend", "BACKEND_NAMES", "CopyBackend", "TorchBackend", "TritonBackend", "choose_by_name",
           "copy_backend"]

#: The kernels index a message's words with int32 positions: longer messages compare with torch.
_TRITON_SCAN_WORDS = 2 ** 31


class CopyBackend(ABC):
    """Which implementation runs a table's copies and the delta codec's comparisons. Subclasses are
    frozen dataclasses without fields: every instance of one is equal to every other."""

    #: The string spelling (``backend=``).
    name: ClassVar[str]

    @abstractmethod
    def for_device(self, device) -> CopyBackend:
        """The backend that runs on ``device`` (a concrete backend: itself)."""

    @abstractmethod
    def run(self, table) -> None:
        """Run every entry of ``table`` (a ``DescriptorTable`` or a ``QuantizeTable``)."""

    @abstractmethod
    def work_items(self, table) -> int:
        """Work items per :meth:`run` of a ``DescriptorTable``: kernel launches or coalesced ``copy_`` calls."""

    @abstractmethod
    def delta_scan(self, new_words: torch.Tensor, old_words: torch.Tensor, nmask: int):
        """The delta codec's compare-and-compact of one message (:mod:`~tritonreshard.kernels.delta`)."""

    def prepare(self, table):
        """``table`` (a ``DescriptorTable``) with what :meth:`run` needs planned now: a table plans
        its Triton launches when first asked, and a pull that ran that would count their
        descriptors as its staging. Returns the table."""
        self.work_items(table)
        return table

    def __str__(self) -> str:
        return self.name


@dataclass(frozen=True)
class TritonBackend(CopyBackend):
    """Triton's kernels: one launch per (dtype group, kernel variant), compiled on CUDA tensors and
    interpreted on CPU tensors."""

    name: ClassVar[str] = "triton"

    def for_device(self, device) -> CopyBackend:
        return self

    def run(self, table) -> None:
        table.launch()

    def work_items(self, table) -> int:
        return table.num_launches

    def delta_scan(self, new_words, old_words, nmask):
        scan = TritonDeltaScan if new_words.numel() < _TRITON_SCAN_WORDS else TorchDeltaScan
        return scan(new_words, old_words, nmask)


@dataclass(frozen=True)
class TorchBackend(CopyBackend):
    """torch ops over the same descriptors (``copy_`` per coalesced run of entries)."""

    name: ClassVar[str] = "torch"

    def for_device(self, device) -> CopyBackend:
        return self

    def run(self, table) -> None:
        table.copy()

    def work_items(self, table) -> int:
        return table.num_torch_copies

    def delta_scan(self, new_words, old_words, nmask):
        return TorchDeltaScan(new_words, old_words, nmask)


@dataclass(frozen=True)
class AutoBackend(CopyBackend):
    """Triton on CUDA, torch elsewhere (the Triton interpreter is exact but slow)."""

    name: ClassVar[str] = "auto"

    def for_device(self, device) -> CopyBackend:
        return TritonBackend() if torch.device(device).type == "cuda" else TorchBackend()

    def run(self, table) -> None:
        self.for_device(table.device).run(table)

    def work_items(self, table) -> int:
        return self.for_device(table.device).work_items(table)

    def delta_scan(self, new_words, old_words, nmask):
        return self.for_device(new_words.device).delta_scan(new_words, old_words, nmask)


_BY_NAME = {b.name: b for b in (AutoBackend(), TritonBackend(), TorchBackend())}
#: The string spellings :func:`copy_backend` accepts.
BACKEND_NAMES = tuple(_BY_NAME)


def choose_by_name(value, kind: type, by_name: dict, spelled: str, problems: list[str] | None, param: str):
    """``value`` as a ``kind`` object (a mode or a backend, chosen once where it enters): a ``kind``
    as it is, a name of ``by_name`` as its object. Anything else: with ``problems``, None and a line
    naming ``param``, the names (``spelled``) and the value appended to it (callers gather every
    problem into one ``ValueError``); without, that ``ValueError``."""
    if isinstance(value, kind):
        return value
    if isinstance(value, str) and value in by_name:
        return by_name[value]
    problem = f"{param} must be {spelled} (or a trs.{kind.__name__}), got {param}={value!r}"
    if problems is None:
        raise ValueError(problem)
    problems.append(problem)
    return None


def copy_backend(value, problems: list[str] | None = None, *, param: str = "backend") -> CopyBackend | None:
    """``value`` as a :class:`CopyBackend`: a backend as it is, a name of :data:`BACKEND_NAMES` as
    its backend (:func:`choose_by_name`)."""
    return choose_by_name(value, CopyBackend, _BY_NAME, "'auto', 'torch' or 'triton'", problems, param)
