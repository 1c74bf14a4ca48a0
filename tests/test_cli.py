"""The ``tritonreshard plan`` command: seed example text, picture and clear errors."""
import json
import subprocess
import sys

import torch

from tritonreshard import Replicate, Shard
from tritonreshard.apps.cli import main, parse_layout_spec


def test_plan_prints_the_seed_example(capsys):
    assert main(["plan", "--shape", "8x8", "--src", "2:S(0)", "--dst", "4:S(1)"]) == 0
    out = capsys.readouterr().out
    assert "8 ops" in out and "[S(1)]@(2,3,4,5)" in out
    assert out.count("32 B") >= 8


def test_plan_png_is_written(tmp_path, capsys):
    png = tmp_path / "plan.png"
    assert main(["plan", "--png", str(png), "--src", "4:S(1)", "--dst", "4:R"]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert f"wrote {png}" in capsys.readouterr().out


def test_spec_grammar():
    lay = parse_layout_spec("2x2@4:R,S(0,[4,4])", (8, 3), torch.float32)
    assert lay.ranks == (4, 5, 6, 7) and lay.placements == (Replicate(), Shard(0, (4, 4)))
    # ",bal": vLLM's expert placement (numpy.array_split), and str() of a layout parses back
    bal = parse_layout_spec("4:S(0,bal)", (6, 2), torch.float32)
    assert bal.placements == (Shard(0, balanced=True),)
    assert [bal.local_shape(r)[0] for r in range(4)] == [2, 2, 1, 1]
    packed = parse_layout_spec("2:S(0,[3,5],bal)", (8, 2), torch.float32)
    assert packed.placements == (Shard(0, (3, 5), balanced=True),) and str(packed.placements[0]) == "S(0,[3,5],bal)"


def test_bad_spec_is_a_clear_error(capsys):
    assert main(["plan", "--src", "2:Q(0)"]) == 2
    assert "--src='2:Q(0)'" in capsys.readouterr().err


def test_console_script_runs():
    out = subprocess.run([sys.executable, "-m", "tritonreshard.apps.cli", "plan"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "8 ops" in out.stdout


def test_plan_into_a_closed_pipe_is_quiet():
    """``tritonreshard plan ... | head -1``: the reader leaves early; no BrokenPipeError traceback."""
    proc = subprocess.Popen([sys.executable, "-m", "tritonreshard.apps.cli", "plan", "--shape", "512x512",
                             "--src", "64:S(0)", "--dst", "64:S(1)", "--all-ops"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    first = proc.stdout.readline()
    proc.stdout.close()  # like head: read one line, then go away (4096 ops: far more than a pipe buffer)
    err = proc.stderr.read().decode()
    proc.wait(timeout=120)
    assert first.startswith(b"source"), first
    assert "Traceback" not in err and "BrokenPipeError" not in err, err
    assert proc.returncode == 141


def test_negative_size_reaches_the_size_check(capsys, tmp_path):
    """``--size -5MiB`` is a bad size, not a missing argument (argparse's reading of a leading '-')."""
    from tritonreshard.apps.cli import main as cli_main
    assert cli_main(["bench", "--size", "-5MiB"]) == 2
    err = capsys.readouterr().err
    assert "--size='-5MiB' must be a positive number of bytes" in err, err
    assert "expected one argument" not in err


def test_help_has_no_markup(capsys):
    import pytest
    texts = []
    for argv in ([], ["plan"], ["demo"], ["bench"]):
        with pytest.raises(SystemExit) as exc:
            main([*argv, "--help"])
        assert exc.value.code == 0
        texts.append(capsys.readouterr().out)
    for text in texts:
        assert "``" not in text and ":func:" not in text, text[:400]
    assert "tritonreshard demo: an asynchronous RL loop" in texts[2]


def test_plan_says_which_dtype_its_bytes_count(capsys):
    assert main(["plan", "--src-dtype", "fp32", "--dst-dtype", "bf16"]) == 0
    out = capsys.readouterr().out
    assert "count destination bytes (torch.bfloat16); send counts source bytes (torch.float32)" in out
    assert main(["plan"]) == 0
    assert "count destination bytes" not in capsys.readouterr().out  # one dtype: nothing to say


def test_plan_bad_png_is_one_line(tmp_path, capsys):
    bad = tmp_path / "missing" / "plan.png"
    assert main(["plan", "--png", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "does not exist" in err and str(bad) in err, err
    assert not bad.parent.exists()


def test_plan_refuses_a_shape_past_int64(capsys):
    """Once planned as "2980232238769.5 GiB": sizes past int64 wrap in torch and in the kernels."""
    assert main(["plan", "--shape", "99999999999999999999x8"]) == 2
    captured = capsys.readouterr()
    assert "shape=(99999999999999999999, 8)" in captured.err and "past int64" in captured.err
    assert "GiB" not in captured.out + captured.err


def test_plan_prints_tib_and_pib(capsys):
    assert main(["plan", "--shape", "1048576x1048576", "--src", "1:R", "--dst", "1:R"]) == 0
    assert "4.0 TiB" in capsys.readouterr().out
    assert main(["plan", "--shape", "1073741824x1048576", "--src", "1:R", "--dst", "1:R"]) == 0
    assert "4.0 PiB" in capsys.readouterr().out


# What the command loads before it answers: help and argument errors come back without torch or
# Triton (seconds to import on a busy machine). Checked through sys.modules, never a wall clock.
LOAD_PROBE = r"""
import contextlib, io, json, sys
from tritonreshard.apps.cli import main
out = {}
for argv in ([], ["--help"], ["plan", "--help"], ["demo", "--help"], ["bench", "--help"], ["plan", "--bogus"],
             ["demo", "--steps", "x"], ["plan", "--shape", "8y8", "--src", "2:Q(0)", "--dst", "4x:S(5)"]):
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        try:
            rc = main(argv)
        except SystemExit as exc:
            rc = exc.code
    out[" ".join(argv)] = {"rc": rc, "err": err.getvalue(),
                           "heavy": sorted(m for m in ("torch", "triton", "numpy", "matplotlib") if m in sys.modules)}
print(json.dumps(out))
"""


def test_help_and_argument_errors_load_neither_torch_nor_triton():
    out = subprocess.run([sys.executable, "-c", LOAD_PROBE], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout.strip().splitlines()[-1])
    for argv, r in res.items():
        assert r["heavy"] == [], f"`tritonreshard {argv}` loaded {r['heavy']}"
        assert r["rc"] == (0 if argv.endswith("--help") else 2), (argv, r)
    # The syntax errors of every flag, in one message.
    err = res["plan --shape 8y8 --src 2:Q(0) --dst 4x:S(5)"]["err"]
    assert "--shape='8y8'" in err and "--src='2:Q(0)'" in err and "--dst='4x:S(5)'" in err, err


def test_bad_specs_report_every_problem_naming_each_flag(capsys):
    assert main(["plan", "--src", "2:S(2)", "--dst", "4:S(5)"]) == 2
    err = capsys.readouterr().err
    assert "--src='2:S(2)': placements[0]=S(2): shard dim 2 is out of range for shape=(8, 8)" in err, err
    assert "--dst='4:S(5)': placements[0]=S(5): shard dim 5 is out of range for shape=(8, 8)" in err, err
    # A bad --png joins the specs' problems instead of waiting for them to be fixed.
    assert main(["plan", "--src", "2:S(2)", "--png", "/nonexistent-dir/p.png"]) == 2
    err = capsys.readouterr().err
    assert "--src='2:S(2)'" in err and "--png" in err, err
    # The shape's problem is named once, for --shape, not once per spec.
    assert main(["plan", "--shape", "99999999999999999999x8"]) == 2
    err = capsys.readouterr().err
    assert err.count("past int64") == 1 and "--shape: shape=(99999999999999999999, 8)" in err, err


def test_help_texts_say_what_the_options_do(capsys):
    import pytest
    for argv in (["bench"], ["demo"]):
        with pytest.raises(SystemExit):
            main([*argv, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        if argv == ["bench"]:
            assert "--device {cpu,cuda} where the weights live" in text, text
        else:
            assert "--seed SEED seed of the policy's initial weights" in text, text
            # --fault with --restart: a trainer fault is survived and the run can exit 0.
            assert "Without --restart every fault makes the demo exit 1" in text, text
            assert "With --restart a trainer fault" in text and "it exits 0 if every version" in text, text
