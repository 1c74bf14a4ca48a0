"""examples/debug_8x8.py runs as a plain script and shows what it promises."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_debug_8x8_runs(tmp_path):
    env = dict(os.environ, DEBUG_8X8_OUT=str(tmp_path), MPLBACKEND="Agg")
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "debug_8x8.py")], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    for part in ["Plan: 1 tensor(s), 8 ops", "DescriptorTable: 2 entries", "float32->bfloat16",
                 "inference rank 5 (local shape (8, 2))", "r1:62", "provenance OK", "single entry OK",
                 "triton backend:"]:
        assert part in out, part
