"""A stand-in ``torchvision`` for the probe processes that build vLLM 0.32's Qwen3.5 models.

vLLM's ``models/qwen3_5.py`` imports ``models/qwen3_vl.py`` at module scope, which imports
transformers' Qwen2-VL image processor, which imports torchvision: a text model cannot even be
resolved without it. The registry has no CPU build of torchvision for torch 2.13 (only
``0.28.0+cu130``, whose ``_C.so`` needs ``libtorch_cuda.so``), so the probes that load Qwen3.5
put this folder's parent on ``PYTHONPATH`` (tests/_torchvision.py), never the test process.

Every ``torchvision.*`` module and attribute resolves, and calling anything raises: the text
models' loaders and forward never touch images, and a use would fail loudly, never silently.
"""
import importlib.abc
import importlib.machinery
import sys
import types

__version__ = "0.0.0+stand-in"


class _Absent:
    """Any attribute of the stand-in: usable in annotations and as a base class, raising when called."""

    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attr: str) -> "_Absent":
        return _Absent(f"{self._name}.{attr}")

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"{self._name}: torchvision is a stand-in here (tests/_standin), nothing runs")

    def __mro_entries__(self, bases):
        return (object,)

    def __or__(self, other):
        return object

    __ror__ = __or__


class _Module(types.ModuleType):
    def __getattr__(self, attr: str) -> _Absent:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Absent(f"{self.__name__}.{attr}")


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Every ``torchvision.<sub>`` import: an empty package whose attributes are :class:`_Absent`."""

    def find_spec(self, name, path, target=None):
        if name.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        return _Module(spec.name)

    def exec_module(self, module):
        module.__path__ = []


sys.meta_path.insert(0, _Finder())
sys.modules[__name__].__class__ = _Module
