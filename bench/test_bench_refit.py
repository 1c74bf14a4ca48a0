"""pytest-benchmark suite: refit GB/s of tritonreshard, next to memcpy and the baselines, per layout.

How to run (from the repo root)::

    python -m pytest bench/ --benchmark-enable                          # measure (5 rounds per case)
    python -m pytest bench/ --benchmark-enable --benchmark-json out.json
    pytest-benchmark compare before.json out.json                       # two commits, side by side
    python -m pytest bench/ --benchmark-disable                         # CI smoke: each case once, verified
    python -m pytest bench/ -k "cpu and fsdp-tp"                        # one case

Each case sets up its processes once (a module-scoped :class:`tritonreshard.apps.bench.BenchSession`:
trainer and inference ranks spawned, endpoints and baselines built), and every benchmark round is
one refit. What a round's time is: exactly what ``tritonreshard bench`` times, the ranks' own
measurement of the refit (every rank meets in a barrier, then max(end) - min(start) over the ranks,
on one monotonic clock), not the driver's round trip through the store that asks for it (a few ms
more: 40 ms instead of 11.5 ms for fsdp-tp at 64 MiB on 2 busy cores). pytest-benchmark is given a
clock (:class:`RefitClock`) that advances by those seconds only, so its own table, its
``--benchmark-json`` and ``pytest-benchmark compare`` show the ranks' figures. ``memcpy`` is the
driver's copy of the same bytes, timed the same way as in ``tritonreshard bench``.

What still differs from ``tritonreshard bench`` (the terminal summary says it too): 5 rounds after
one warm-up refit instead of ``--repeats 10 --warmup 2``, and each method's rounds in a row instead
of interleaved with the other methods'.

``extra_info`` (kept in the JSON): ``gbps`` (destination bytes / median seconds), ``memcpy_gbps``
(the driver's copy of the same bytes in the same session) and ``ratio_to_memcpy``, ``bytes``,
``tensors``, ``layout``, ``device``, ``method``, ``seconds_median``, ``timed`` (what a round is),
and for tritonreshard ``refit_overhead_per_tensor_us`` and ``staging_bytes``. With
``--benchmark-enable`` the terminal summary ends with one row per benchmark: GB/s, memcpy GB/s of
the same session and the ratio (``bench/conftest.py``).

Every case ends by checking the destination shards bit for bit (provenance data, see
``apps/bench/provenance.py``). The cuda cases run where a GPU is present and are skipped otherwise.
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
# What one round's time is, per row of the terminal summary and in the JSON's extra_info["timed"].
TIMED_REFIT = "ranks: barrier -> last rank done (as the CLI)"
TIMED_MEMCPY = "driver: copy_ of the same bytes (as the CLI)"


@pytest.fixture(scope="module", params=DEVICES)
def device(request):
    return request.param


@pytest.fixture(scope="module", params=list(CASES))
def session(request, device):
    """One set of spawned ranks per (device, case), shared by every benchmark of the case; the ranks
    set up only the methods the case benchmarks."""
    kwargs, methods = CASES[request.param]
    s = BenchSession(BenchConfig(device=device, timeout=300.0, methods=("memcpy", *methods), **kwargs))
    s.case = request.param
    s.memcpy_gbps = s.dst_bytes / statistics.median(s.memcpy(ROUNDS)) / 1e9
    yield s
    leaked = s.close()
    assert not leaked, f"/dev/shm entries left behind: {leaked}"


class RefitClock:
    """pytest-benchmark's timer for these benchmarks: it stands still while the driver talks to the
    ranks and advances by the seconds the ranks measured (:meth:`advance`), so a round's duration is
    the refit's own time, as ``tritonreshard bench`` reports it."""

    __name__ = "RefitClock"  # how pytest-benchmark names the timer in its JSON

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def _rounds(benchmark, measure_one) -> list[float]:
    """``ROUNDS`` benchmark rounds of ``measure_one()`` (-> the seconds it measured), timed by those
    seconds; returns them."""
    clock, seconds = RefitClock(), []

    def one():
        s = measure_one()
        seconds.append(s)
        clock.advance(s)

    # pytest-benchmark (4 and 5) reads the fixture's timer when it builds each round's runner; the
    # check below fails loudly should a release stop doing so (its figures would be the driver's).
    benchmark._timer = clock
    benchmark.pedantic(one, rounds=ROUNDS, iterations=1)
    if not benchmark.disabled:
        assert benchmark.stats.stats.data == seconds, "pytest-benchmark did not time the rounds with RefitClock"
    return seconds


def _record(refit_rows, benchmark, session, method, seconds, timed):
    gbps = session.dst_bytes / statistics.median(seconds) / 1e9
    cfg = session.cfg
    benchmark.extra_info.update({
        "gbps": gbps, "memcpy_gbps": session.memcpy_gbps, "ratio_to_memcpy": gbps / session.memcpy_gbps,
        "bytes": session.dst_bytes, "tensors": len(session.model), "layout": cfg.layout,
        "device": cfg.device, "method": method, "seconds_median": statistics.median(seconds), "timed": timed,
    })
    if not benchmark.disabled:  # the terminal summary lists measurements, not smoke runs
        refit_rows.append({"case": f"{cfg.device}-{session.case}", **benchmark.extra_info})
    return gbps


def _bench_method(refit_rows, benchmark, session, method):
    if method not in CASES[session.case][1]:
        pytest.skip(f"{method} is not benchmarked for {session.case}")
    session.refits(method, 1)  # warm-up: first-touch of mapped arenas, descriptor tables, gloo connections
    seconds = _rounds(benchmark, lambda: session.refits(method, 1)["seconds"][0])
    assert session.verify(method), f"{method}: destination shards differ from the trainers' last version"
    gbps = _record(refit_rows, benchmark, session, method, seconds, TIMED_REFIT)
    if method == "tritonreshard":
        extra = statistics.median(seconds) - session.dst_bytes / (session.memcpy_gbps * 1e9)
        benchmark.extra_info["refit_overhead_per_tensor_us"] = extra / len(session.model) * 1e6
        # Measured by the engine (what its pulls allocated), so this can fail: a pull that staged
        # its bytes through a temporary would show here.
        staging = session.staging_bytes()
        benchmark.extra_info["staging_bytes"] = staging
        assert staging == 0, f"pulls allocated {staging} bytes of staging"
    return gbps


def test_memcpy(refit_rows, benchmark, session):
    """The speed of light: the driver copies the same destination bytes (as tritonreshard bench does)."""
    seconds = _rounds(benchmark, lambda: session.memcpy(1, warmup=0)[0])
    assert _record(refit_rows, benchmark, session, "memcpy", seconds, TIMED_MEMCPY) > 0


def test_tritonreshard(refit_rows, benchmark, session):
    assert _bench_method(refit_rows, benchmark, session, "tritonreshard") > 0


def test_p2p(refit_rows, benchmark, session):
    assert _bench_method(refit_rows, benchmark, session, "p2p") > 0


def test_gather_broadcast(refit_rows, benchmark, session):
    assert _bench_method(refit_rows, benchmark, session, "gather_broadcast") > 0


# ---------------------------------------------------------------- cross-host deltas
@pytest.fixture(scope="module")
def delta_session():
    """Two simulated hosts, every refit an Adam-sized bf16 update at lr 1e-6 (``bench --update-lr``).
    ``delta="always"``: the delta path itself is what this times. ``auto`` sends whole over this
    loopback, where detection costs more than the bytes it saves (docs/hosts.md, "When a delta
    pays"; ``tritonreshard bench --update-lr 1e-6 --link-gbps inf,1`` shows both)."""
    s = BenchSession(BenchConfig(size=16 * MiB, layout="fsdp-tp", trainers=2, inference=2, hosts=2, timeout=300.0,
                                 update_lr=1e-6, methods=("tritonreshard",), delta="always"))
    yield s
    leaked = s.close()
    assert not leaked, f"/dev/shm entries left behind: {leaked}"


def test_tritonreshard_cross_host_delta(benchmark, delta_session):
    """A refit across two hosts that sends only the elements that changed (the first, whole, is the
    warm-up). ``extra_info``: the cross-host bytes per refit against the model's, and their ratio."""
    s = delta_session
    s.refits("tritonreshard", 1)
    crossed = []

    def one():
        r = s.refits("tritonreshard", 1, each_stats=True)
        crossed.append(sum(x["cross_host_bytes"] for x in r["each_stats"][0]))
        return r["seconds"][0]

    seconds = _rounds(benchmark, one)
    assert s.verify("tritonreshard"), "destination shards differ from the trainers' last version"
    ratio = statistics.median(crossed) / s.model_bytes
    benchmark.extra_info.update({"cross_host_bytes": statistics.median(crossed), "dense_bytes": s.model_bytes,
                                 "delta_ratio": ratio, "seconds_median": statistics.median(seconds)})
    assert 0 < ratio <= 0.10, ratio
