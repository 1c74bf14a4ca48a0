"""``tritonreshard bench`` end to end: a small run in a subprocess (spawned ranks, hard timeout).

Asserts the JSON shape and correctness (verified, no staging measured), and invariants of the
figures (0 <= coordination <= refit time, per refit), never wall-clock bounds or ratios: machines
are noisy.
"""
import json
import os
import subprocess
import sys

import pytest

RUNNER = ("import argparse, sys, tritonreshard.apps.bench as b\n"
          "if __name__ == '__main__':\n"
          "    p = argparse.ArgumentParser(); b.add_arguments(p)\n"
          "    raise SystemExit(b.run(p.parse_args(sys.argv[1:])))\n")


def _bench(tmp_path, *args, timeout=240):
    script = tmp_path / "run_bench.py"  # a file, not -c: spawned ranks re-import the main module
    script.write_text(RUNNER)
    shm_before = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    out = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, f"stdout:\n{out.stdout}\nstderr:\n{out.stderr[-4000:]}"
    shm_after = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    assert not {n for n in shm_after - shm_before if n.startswith("trs-")}, "bench left shared memory behind"
    return out


def _check_shape(data):
    assert set(data) >= {"bytes", "results"}
    assert isinstance(data["bytes"], int) and data["bytes"] > 0
    res = data["results"]
    assert set(res) == {"memcpy", "tritonreshard", "p2p", "gather_broadcast"}
    for name, r in res.items():
        assert r["seconds"] > 0 and r["gbps"] > 0, name
        assert r["gbps"] == pytest.approx(data["bytes"] / r["seconds"] / 1e9), name
    ours = res["tritonreshard"]
    assert ours["verified"] is True
    # Measured by the engine (what its pulls allocated), so a pull that staged would show here.
    assert isinstance(ours["staging_bytes"], int) and ours["staging_bytes"] == 0
    # Coordination: each refit's time minus its slowest copy. The copy happens inside the refit's
    # window, so every value lies in [0, that refit's time].
    coord = ours["coordination_ms_all"]
    assert len(coord) == len(ours["seconds_all"])
    for c, s in zip(coord, ours["seconds_all"], strict=True):
        assert 0 <= c <= 1e3 * s, (c, s)
    assert min(coord) <= ours["coordination_ms"] <= max(coord)
    assert res["p2p"]["verified"] is True and res["gather_broadcast"]["verified"] is True


def test_bench_json(tmp_path):
    out = _bench(tmp_path, "--size", "8MiB", "--repeats", "3", "--warmup", "1", "--json")
    data = json.loads(out.stdout.strip().splitlines()[-1])
    _check_shape(data)
    assert data["layout"] == "fsdp-tp" and data["trainers"] == 2 and data["inference"] == 4
    # Destination bytes: every TP shard once, plus the replicated norms on every inference rank.
    assert data["bytes"] >= data["model_bytes"]
    assert "refit" in out.stderr  # the progress bar goes to stderr


@pytest.mark.parametrize("layout", ["cols-replicas", "colocated", "replicated-sources", "megatron-tp-pp"])
def test_bench_layouts(tmp_path, layout):
    out = _bench(tmp_path, "--size", "2MiB", "--layout", layout, "--repeats", "2", "--warmup", "1",
                 "--mode", "inplace", "--json")
    data = json.loads(out.stdout.strip().splitlines()[-1])
    _check_shape(data)
    assert data["layout"] == layout


def test_bench_table_and_many_tensors(tmp_path):
    out = _bench(tmp_path, "--size", "2MiB", "--tensors", "300", "--repeats", "2", "--warmup", "0",
                 "--methods", "memcpy,tritonreshard")
    assert "tritonreshard" in out.stdout and "GB/s" in out.stdout and "x memcpy" in out.stdout
    assert "300 tensors" in out.stdout


def test_bench_rejects_bad_arguments(tmp_path):
    script = tmp_path / "run_bench.py"
    script.write_text(RUNNER)
    out = subprocess.run([sys.executable, str(script), "--size", "lots", "--json"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 2 and "--size" in out.stderr
    out = subprocess.run([sys.executable, str(script), "--layout", "replicated-sources", "--trainers", "3"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "even --trainers" in out.stderr
    out = subprocess.run([sys.executable, str(script), "--update-lr", "1e-6"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2 and "needs --hosts >= 2" in out.stderr
    out = subprocess.run([sys.executable, str(script), "--update-lr", "1e-6,fast", "--hosts", "2"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 2 and "got 'fast'" in out.stderr


def test_parse_size_and_model():
    from tritonreshard.apps import bench
    from tritonreshard.apps.bench.model import build_model
    assert bench.parse_size("256MiB") == 256 << 20
    assert bench.parse_size("1GiB") == 1 << 30
    assert bench.parse_size("1000") == 1000 and bench.parse_size(4096) == 4096
    with pytest.raises(ValueError, match="--size"):
        bench.parse_size("12 parsecs")
    for size in ("8MiB", "256MiB", "1GiB"):
        cfg = bench.BenchConfig(size=bench.parse_size(size))
        total = sum(2 * t.shape[0] * (t.shape[1] if len(t.shape) > 1 else 1) for t in build_model(cfg))
        assert abs(total - cfg.size) <= 2 * 4096, size   # within an embedding row
    cfg = bench.BenchConfig(size=bench.parse_size("16MiB"), tensors=10_000)
    assert len(build_model(cfg)) == 10_000


def test_bench_refuses_what_does_not_fit_before_starting_anything(tmp_path):
    """The estimate is checked before any process starts: a refusal names the estimate and its parts,
    what is available and a --size that fits (the available memory comes from the override)."""
    script = tmp_path / "run_bench.py"
    script.write_text(RUNNER)
    env = dict(os.environ, TRITONRESHARD_MEMORY_AVAILABLE=str(6 << 30))
    out = subprocess.run([sys.executable, str(script), "--layout", "cols-replicas"], capture_output=True, text=True,
                         timeout=60, env=env)
    assert out.returncode == 2, out.stderr
    err = out.stderr.strip()
    assert err.startswith("tritonreshard bench: not enough memory: --layout cols-replicas --size 1GiB needs about ")
    assert "6.0 GiB is available ($TRITONRESHARD_MEMORY_AVAILABLE" in err
    assert "Try --size 128MiB" in err and "engine buffer sets 2.0 GiB" in err and "p2p receive staging" in err
    assert "refit" not in err  # no progress bar: nothing started
    assert len(err.splitlines()) == 1


def test_memory_estimate_counts_what_the_ranks_allocate():
    from tritonreshard.apps import bench
    from tritonreshard.apps.bench.memory import PROCESS_BYTES, estimate, refusal
    cfg = bench.BenchConfig(size=64 << 20, layout="cols-replicas")
    est = estimate(cfg)
    inf = est.ranks[cfg.inference_ranks[0]]
    # Every inference rank holds the whole model: 2 engine sets (shadow), one set per baseline, and
    # p2p receives every column block into a temporary (a column slice is not contiguous).
    model = sum(2 * t.shape[0] * (t.shape[1] if len(t.shape) > 1 else 1) for t in bench.model.build_model(cfg))
    assert inf["engine buffer sets"] == 2 * model and inf["baseline destination sets"] == 2 * model
    assert inf["p2p receive staging"] <= model and inf["process"] == PROCESS_BYTES
    light = estimate(bench.BenchConfig(size=64 << 20, layout="cols-replicas", mode="inplace",
                                       methods=("memcpy", "tritonreshard")))
    assert "baseline destination sets" not in light.ranks[cfg.inference_ranks[0]]
    assert light.ranks[cfg.inference_ranks[0]]["engine buffer sets"] == model
    assert light.total < est.total
    assert refusal(cfg, available=(1 << 40, "plenty")) is None
    assert "Try --size" in refusal(bench.BenchConfig(layout="cols-replicas"), available=(8 << 30, "a test"))


def test_link_gbps_option():
    """--link-gbps: a simulated link between hosts (the engine's $TRITONRESHARD_SIMULATED_LINK_GBPS)."""
    from tritonreshard.apps import bench
    from tritonreshard.apps.bench.config import parse_gbps
    assert parse_gbps(None) == [None] and parse_gbps("1,2.5,inf") == [1.0, 2.5, None]
    for bad in ("0", "fast", "1,-2"):
        with pytest.raises(ValueError, match=r"--link-gbps=.*gigabits/s > 0 or 'inf'"):
            parse_gbps(bad)
    assert bench.BenchConfig(hosts=2, link_gbps=1.0).problems() == []
    assert bench.BenchConfig(hosts=2, link_gbps=0.0).problems() == ["--link-gbps=0.0 must be gigabits/s > 0"]
    assert "needs --hosts >= 2" in bench.BenchConfig(link_gbps=1.0).problems()[0]


def test_net_option_names_every_problem_before_any_work(monkeypatch, tmp_path):
    """--net namespaces (the host harness): what it needs is named with the other problems, before
    anything starts, and a machine without the harness is told why and what runs instead."""
    from tritonreshard.apps import bench, hosts
    from tritonreshard.apps.bench.config import environment_problems
    assert bench.BenchConfig(hosts=2, net="namespaces", link_gbps=1.0).problems() == []
    assert bench.BenchConfig(net="namespaces").problems() == [
        "--net=namespaces makes the hosts of --hosts: it needs --hosts >= 2, got 1"]
    assert "not supported there" in bench.BenchConfig(hosts=2, net="namespaces", device="cuda").problems()[0]
    assert bench.BenchConfig(hosts=2, net="wires").problems() == ["--net='wires' must be one of labels, namespaces"]
    cfg = bench.BenchConfig(hosts=2, net="namespaces")
    monkeypatch.setattr(hosts, "unavailable", lambda: "the host harness needs root (a test)")
    assert environment_problems(cfg, str(tmp_path / "no" / "x.png")) == [
        "--net=namespaces: the host harness needs root (a test); --net=labels runs without it (a slower link "
        "is then simulated)",
        f"--png={str(tmp_path / 'no' / 'x.png')!r}: folder {str(tmp_path / 'no')!r} does not exist"]
    assert environment_problems(bench.BenchConfig(hosts=2)) == []   # labels: nothing to check
    script = tmp_path / "run_bench.py"
    script.write_text(RUNNER)
    out = subprocess.run([sys.executable, str(script), "--hosts", "2", "--png", str(tmp_path / "x.png")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--png=" in out.stderr and "draws the rows of --update-lr" in out.stderr


def _parse(*argv):
    import argparse

    from tritonreshard.apps import bench
    p = argparse.ArgumentParser(prog="tritonreshard bench")
    bench.add_arguments(p)
    return p, p.parse_args(list(argv))


def test_codec_option_is_checked_before_anything_runs(capsys):
    """--codec: the library's string spelling (off / auto / always, what ``codec_for`` takes), off
    by default, named in --help; a value it does not know, a codec with one host, and a codec with
    --update-lr (which runs all three) or --quantize are refused with the problem named, exit 2."""
    from tritonreshard.apps.bench import BenchConfig, run
    from tritonreshard.apps.bench.cli import _config
    from tritonreshard.apps.bench.config import CODECS, DEFAULT_CODEC
    from tritonreshard.transport import DELTA_MODES, Delta, Dense, codec_for
    assert set(CODECS) == set(DELTA_MODES) and DEFAULT_CODEC == "off"
    assert [type(codec_for(c)) for c in CODECS] == [Dense, Delta, Delta] and codec_for("always").force
    p, args = _parse("--hosts", "2")
    assert args.codec is None and _config(args).delta == "off"   # the default the help names
    for codec in CODECS:
        assert _config(_parse("--hosts", "2", "--codec", codec)[1]).delta == codec
    text = " ".join(p.format_help().split())
    assert "--codec {off,auto,always}" in text and "Default off: trs.Dense(), every byte every refit" in text
    assert "auto: trs.Delta(), the library's default" in text and "always: trs.Delta(force=True)" in text
    with pytest.raises(SystemExit) as exc:
        _parse("--hosts", "2", "--codec", "delta")
    assert exc.value.code == 2 and "argument --codec: invalid choice: 'delta'" in capsys.readouterr().err
    assert BenchConfig(hosts=2, delta="always").problems() == []
    assert BenchConfig(hosts=2, delta="sparse").problems() == ["--codec='sparse' must be one of off, auto, always"]
    assert BenchConfig(delta="auto").problems() == [
        "--codec=auto encodes what crosses hosts: it needs --hosts >= 2 (on one host nothing crosses), got 1"]
    assert run(_parse("--codec", "always")[1]) == 2
    assert "--codec=always encodes what crosses hosts" in capsys.readouterr().err
    assert run(_parse("--codec", "off", "--hosts", "2", "--update-lr", "1e-6")[1]) == 2
    assert "--update-lr runs every codec (off, auto, always)" in capsys.readouterr().err
    assert run(_parse("--codec", "auto", "--quantize", "fp8-block")[1]) == 2
    assert "--quantize runs in this process" in capsys.readouterr().err


def test_memory_estimate_counts_the_delta_codec():
    """A delta codec keeps a snapshot of what each trainer sends and encodes / decodes it with
    temporaries of DELTA_WORK times the message: counted, so a run that would not fit is refused."""
    from tritonreshard.apps.bench import BenchConfig
    from tritonreshard.apps.bench.memory import DELTA_WORK, estimate
    off = estimate(BenchConfig(size=8 << 20, hosts=2))
    always = estimate(BenchConfig(size=8 << 20, hosts=2, delta="always"))
    for r in (0, 1):   # the trainers
        assert "delta snapshot" not in off.ranks[r]
        assert always.ranks[r]["delta snapshot"] == always.ranks[r]["arena"]
        assert always.ranks[r]["delta encoding"] == DELTA_WORK * always.ranks[r]["arena"]
    largest = max(always.ranks[r]["arena"] for r in (0, 1))
    assert always.ranks[2]["delta decoding"] == DELTA_WORK * largest   # host1's receiver: a whole arena
    assert always.total > off.total


def test_bench_codec_reaches_the_engine_across_two_hosts(tmp_path):
    """--hosts 2 (labels: two host identities over loopback) with --codec off and always: the
    result names the codec (table and JSON), both verify bit for bit, and the engine's cross-host
    bytes differ: off moves every destination byte, always a delta of every refit (the provenance
    bits change every element by a version key: a bitmask and an int8 difference per element)."""
    crossed = {}
    for codec in ("off", "always"):
        out = _bench(tmp_path, "--hosts", "2", "--codec", codec, "--size", "2MiB", "--trainers", "1", "--inference",
                     "1", "--methods", "tritonreshard", "--repeats", "2", "--warmup", "1", "--json")
        data = json.loads(out.stdout.strip().splitlines()[-1])
        ours = data["results"]["tritonreshard"]
        assert data["codec"] == codec and data["hosts"] == 2 and ours["verified"] is True, data
        header = out.stdout.splitlines()[0]
        assert f"codec {codec} ({'trs.Dense()' if codec == 'off' else 'trs.Delta(force=True)'})" in header, header
        crossed[codec] = ours["cross_host_bytes"]
        if codec == "off":
            assert crossed[codec] == data["bytes"], data   # one inference rank on host1: every byte it holds
    assert 0 < crossed["always"] < 0.75 * crossed["off"], crossed
