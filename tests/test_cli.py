"""The ``tritonreshard plan`` command: seed example text, picture and clear errors."""
import subprocess
import sys

import torch

from tritonreshard.apps.cli import main, parse_layout_spec
from tritonreshard import Replicate, Shard


def test_plan_prints_the_seed_example(capsys):
    assert main(["plan", "--shape", "8x8", "--src", "2:S(0)", "--dst", "4:S(1)"]) == 0
    out = capsys.readouterr().out
    assert "8 ops" in out and "[S(1)]@(2,3,4,5)" in out
    assert out.count("32 B") >= 8


def test_plan_png_is_written(tmp_path):
    png = tmp_path / "plan.png"
    assert main(["plan", "--png", str(png), "--src", "4:S(1)", "--dst", "4:R"]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_spec_grammar():
    lay = parse_layout_spec("2x2@4:R,S(0,[4,4])", (8, 3), torch.float32)
    assert lay.ranks == (4, 5, 6, 7) and lay.placements == (Replicate(), Shard(0, (4, 4)))


def test_bad_spec_is_a_clear_error(capsys):
    assert main(["plan", "--src", "2:Q(0)"]) == 2
    assert "--src='2:Q(0)'" in capsys.readouterr().err


def test_console_script_runs():
    out = subprocess.run([sys.executable, "-m", "tritonreshard.apps.cli", "plan"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "8 ops" in out.stdout
