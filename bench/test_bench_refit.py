"""pytest-benchmark suite: refit GB/s of tritonreshard, next to memcpy and the baselines, per layout.

How to run (from the repo root)::

    python -m pytest bench/ --benchmark-enable                          # measure (5 rounds per case)
    python -m pytest bench/ --benchmark-enable --benchmark-json out.json
    python -m pytest bench/ --benchmark-disable                         # CI smoke: each case once, verified
    python -m pytest bench/ -k "cpu and fsdp-tp"                        # one case

Each case sets up its processes once (a module-scoped :class:`tritonreshard.apps.bench.BenchSession`:
trainer and inference ranks spawned, endpoints and baselines built), and every benchmark round is
one refit. pytest-benchmark's own timings include issuing the command to the ranks (a store round
trip, up to a few ms); ``extra_info`` has the ranks' own measurement, the one that matters:

* ``gbps``: destination bytes / median refit seconds (barrier -> every inference rank done),
* ``memcpy_gbps``: the driver's copy of the same bytes in the same session, and
  ``ratio_to_memcpy``,
* ``bytes``, ``tensors``, ``layout``, ``device`` (and ``refit_overhead_per_tensor_us`` for
  tritonreshard).

Every case ends by checking the destination shards bit for bit (provenance data, see
``apps/bench/provenance.py``). The cuda cases run where a GPU is present and are skipped otherwise.
``tritonreshard bench`` runs the same measurements from the command line with a table or JSON.
"""
import statistics

import pytest
import torch

from tritonreshard.apps.bench import BenchConfig, BenchSession

MiB = 1 << 20
HAS_CUDA = torch.cuda.is_available()

# name -> (config kwargs, methods benchmarked). The baselines are slow per tensor (gloo collectives),
# so the many-tensor case measures the engine only; `tritonreshard bench --tensors` compares all.
CASES = {
    "fsdp-tp-64MiB": (dict(size=64 * MiB, layout="fsdp-tp"), ("tritonreshard", "p2p", "gather_broadcast")),
    "cols-replicas-16MiB": (dict(size=16 * MiB, layout="cols-replicas"), ("tritonreshard", "p2p")),
    "colocated-16MiB": (dict(size=16 * MiB, layout="colocated", mode="inplace"), ("tritonreshard", "p2p")),
    "replicated-sources-16MiB": (dict(size=16 * MiB, layout="replicated-sources"), ("tritonreshard", "p2p")),
    "fsdp-tp-10000-tensors": (dict(size=16 * MiB, layout="fsdp-tp", tensors=10_000), ("tritonreshard",)),
}
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU"))]
ROUNDS = 5


@pytest.fixture(scope="module", params=DEVICES)
def device(request):
    return request.param


@pytest.fixture(scope="module", params=list(CASES))
def session(request, device):
    """One set of spawned ranks per (device, case), shared by every benchmark of the case."""
    kwargs, _ = CASES[request.param]
    s = BenchSession(BenchConfig(device=device, timeout=300.0, **kwargs))
    s.case = request.param
    s.memcpy_gbps = s.dst_bytes / statistics.median(s.memcpy(ROUNDS)) / 1e9
    yield s
    leaked = s.close()
    assert not leaked, f"/dev/shm entries left behind: {leaked}"


def _bench_method(benchmark, session, method):
    if method not in CASES[session.case][1]:
        pytest.skip(f"{method} is not benchmarked for {session.case}")
    seconds = []

    def one_refit():
        seconds.extend(session.refits(method, 1)["seconds"])

    one_refit()  # warm-up: first-touch of mapped arenas, descriptor tables, gloo connections
    seconds.clear()
    benchmark.pedantic(one_refit, rounds=ROUNDS, iterations=1)
    assert session.verify(method), f"{method}: destination shards differ from the trainers' last version"
    gbps = session.dst_bytes / statistics.median(seconds) / 1e9
    cfg = session.cfg
    benchmark.extra_info.update({
        "gbps": gbps, "memcpy_gbps": session.memcpy_gbps, "ratio_to_memcpy": gbps / session.memcpy_gbps,
        "bytes": session.dst_bytes, "tensors": len(session.model), "layout": cfg.layout,
        "device": cfg.device, "method": method, "seconds_median": statistics.median(seconds),
    })
    if method == "tritonreshard":
        extra = statistics.median(seconds) - session.dst_bytes / (session.memcpy_gbps * 1e9)
        benchmark.extra_info["refit_overhead_per_tensor_us"] = extra / len(session.model) * 1e6
        # Measured by the engine (what its pulls allocated), so this can fail: a pull that staged
        # its bytes through a temporary would show here.
        staging = session.staging_bytes()
        benchmark.extra_info["staging_bytes"] = staging
        assert staging == 0, f"pulls allocated {staging} bytes of staging"
    return gbps


def test_memcpy(benchmark, session):
    """The speed of light: the driver copies the same destination bytes in one copy_."""
    secs = []

    def copy():
        secs.extend(session.memcpy(1, warmup=0))

    benchmark.pedantic(copy, rounds=ROUNDS, iterations=1)
    gbps = session.dst_bytes / statistics.median(secs) / 1e9
    benchmark.extra_info.update({"gbps": gbps, "memcpy_gbps": session.memcpy_gbps, "bytes": session.dst_bytes,
                                 "layout": session.cfg.layout, "device": session.cfg.device, "method": "memcpy"})
    assert gbps > 0


def test_tritonreshard(benchmark, session):
    assert _bench_method(benchmark, session, "tritonreshard") > 0


def test_p2p(benchmark, session):
    assert _bench_method(benchmark, session, "p2p") > 0


def test_gather_broadcast(benchmark, session):
    assert _bench_method(benchmark, session, "gather_broadcast") > 0
