"""Every module of the library and every ``tests/_*.py`` helper imports in a fresh interpreter, and a
missing dependency is named by the module that needs it.

CI once passed only because the machine's own Python shipped ``orjson``, which verl's imports need and
no install step named: a user's fresh venv then failed at collection with an error that named verl's
file, not ours. This probe imports each module in turn in a subprocess of the test environment and
reports, per module, the missing package and the file whose import asked for it.
"""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"

PROBE = r"""
import importlib, json, pathlib, sys, traceback
root, tests = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
sys.path.insert(0, str(tests))
names = ["tritonreshard.kernels"]
for path in sorted((root / "tritonreshard").rglob("*.py")):
    parts = path.relative_to(root).with_suffix("").parts
    names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
names += sorted(p.stem for p in tests.glob("_*.py"))
report = {}
for name in names:
    try:
        importlib.import_module(name)
    except ImportError as err:  # the probe's job: name each module a missing package breaks, all at once
        frames = traceback.extract_tb(err.__traceback__)
        frames = [f for f in frames if not f.filename.startswith("<frozen")] or frames
        ours = [f for f in frames if f.filename.startswith(str(root)) and "-packages" not in f.filename] or frames
        mine, at = ours[-1], frames[-1]
        report[name] = f"{err} (our {mine.filename}:{mine.lineno}, at {at.filename}:{at.lineno})"
    else:
        report[name] = None
print(json.dumps(report))
"""


def test_every_library_module_and_test_helper_imports_naming_what_is_missing():
    out = subprocess.run([sys.executable, "-c", PROBE, str(ROOT), str(TESTS)], capture_output=True, text=True,
                         timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    # The walk reached what it is for (else nothing below could fail): the framework adapters and
    # the test helpers, verl's and vLLM's among them.
    for name in ("tritonreshard.frameworks.trl", "tritonreshard.frameworks.verl.actor",
                 "tritonreshard.frameworks.verl.rollout", "tritonreshard.vllm", "_verl_actor", "_tp_engine"):
        assert name in report, sorted(report)
    assert len([n for n in report if n.startswith("_")]) == len(list(TESTS.glob("_*.py")))
    failed = {name: why for name, why in report.items() if why is not None}
    assert not failed, "modules that do not import:\n" + "\n".join(f"  {n}: {w}" for n, w in failed.items())
