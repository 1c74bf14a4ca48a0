"""The library never imports its applications: importing every library module in a fresh interpreter
loads no ``tritonreshard.apps`` module (nor matplotlib, which only the apps' pictures need)."""
import subprocess
import sys
from pathlib import Path

import tritonreshard

ROOT = Path(__file__).resolve().parents[1]

PROBE = r"""
import importlib, json, pkgutil, sys
import tritonreshard, tritonreshard.kernels
names = []
# kernels/ lives outside the tritonreshard/ folder (mapped by the package config): walk it too.
for pkg in (tritonreshard, tritonreshard.kernels):
    names.append(pkg.__name__)
    for info in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
        if info.name == "tritonreshard.apps" or info.name.startswith("tritonreshard.apps."):
            continue
        importlib.import_module(info.name)
        names.append(info.name)
loaded = sorted(m for m in sys.modules if m == "tritonreshard.apps" or m.startswith("tritonreshard.apps.")
                or m.split(".")[0] == "matplotlib")
print(json.dumps({"imported": names, "loaded": loaded}))
"""


def test_library_never_imports_the_apps():
    import json
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    # The walk really covered the library's layers (else the check below could not fail).
    for mod in ("tritonreshard.plan", "tritonreshard.layout", "tritonreshard.execute", "tritonreshard.kernels"):
        assert mod in res["imported"], res["imported"]
    assert any(m.startswith("tritonreshard.transport") for m in res["imported"]), res["imported"]
    assert res["loaded"] == [], f"library modules pulled in application modules: {res['loaded']}"


def test_apps_folder_is_the_apps_package():
    import tritonreshard.apps as apps
    import tritonreshard.apps.cli as cli
    assert Path(apps.__file__).resolve().parent == ROOT / "apps"
    assert Path(cli.__file__).resolve() == ROOT / "apps" / "cli.py"
    # Nothing of the applications remains inside the library folder.
    lib = Path(tritonreshard.__file__).resolve().parent
    assert not {"cli.py", "demo.py", "bench.py", "viz.py", "_policy.py"} & {p.name for p in lib.iterdir()}
