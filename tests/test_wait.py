"""The one wait primitive (spin, then a futex sleep on the control block's doorbell), the per-pull
measurements (PullStats) and the measured staging figure.

Wake-up latencies are printed (the figure for the closing note), never asserted tight: the bounds
here only tell a working wake-up (microseconds) from none at all (the sleep's whole timeout).
"""
import statistics
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
from _mp import free_port, run_ranks
from _waits import wait_acked, wait_published

import tritonreshard as trs
from tritonreshard import Layout, Replicate, Shard
from tritonreshard.engine.sources import Sources
from tritonreshard.transport import create_control_block, open_control_block
from tritonreshard.transport import wait as _wait

pytestmark = pytest.mark.timeout(180)

SECRET = b"w" * 32
LONG = 30.0  # a sleep that nobody rings lasts this long; a rung one ends in microseconds


def test_futex_wait_returns_at_once_if_the_word_changed_and_on_a_ring():
    cb = create_control_block(1, 1)
    try:
        addr, value = cb.doorbell()
        t0 = time.monotonic()
        _wait.futex_wait(addr, value + 1, LONG)  # the word is not what the caller saw: no sleep
        assert time.monotonic() - t0 < LONG / 2
        woke = []

        def sleeper():
            a, v = cb.doorbell()
            t = time.monotonic()
            _wait.futex_wait(a, v, LONG)
            woke.append(time.monotonic() - t)

        th = threading.Thread(target=sleeper)
        th.start()
        time.sleep(0.2)
        cb.publish(1)  # rings the doorbell
        th.join(LONG + 5)
        assert woke and woke[0] < LONG / 2, woke
    finally:
        cb.close()


def _waiter(rank, handle, rounds):
    """Rank 1: wait for each version through the control block of rank 0 (another process)."""
    torch.set_num_threads(1)
    cb = open_control_block(handle, secret=SECRET, timeout=30)
    lat = []
    try:
        for v in range(1, rounds + 1):
            cb.ack(0, v)  # "ready for v"
            wait_published(cb, v, timeout=LONG)
            lat.append(time.monotonic_ns() - cb.published_ns)
    finally:
        cb.close()
    return lat


def test_wait_wakes_another_process_within_microseconds_not_a_poll_period():
    """Publisher and waiter in two processes; the waiter sleeps in the futex (its spin is long over
    when the version comes), so each wake-up is the futex path's latency."""
    rounds = 30
    cb = create_control_block(1, 1, secret=SECRET, expected_peers=1)
    try:
        import torch.multiprocessing as mp
        ctx = mp.get_context("spawn")
        with ctx.Pool(1) as pool:
            res = pool.apply_async(_waiter, (1, cb.export(), rounds))
            for v in range(1, rounds + 1):
                wait_acked(cb, v, timeout=LONG)
                time.sleep(0.005)  # the waiter is asleep in the futex by now
                cb.publish(v)
            lat_ns = res.get(timeout=120)
    finally:
        cb.close()
    lat_us = sorted(x / 1e3 for x in lat_ns)
    p50 = statistics.median(lat_us)
    print(f"futex wake-up across processes: p50 {p50:.1f} us, max {lat_us[-1]:.1f} us over {rounds}")
    assert lat_us[-1] < LONG * 1e6 / 2  # every one was woken, none slept out its timeout
    assert p50 < _wait.SLICE_S * 1e6  # woken, not found by a slice's timeout


# ------------------------------------------------------------------------------ staging, measured

class _StagingSources(Sources):
    """Deliberately stages: each pull clones every source view into a fresh tensor first (what a
    naive receiver would do). The copy then reads persistent buffers filled from those clones."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._staged = {}

    def view(self, read):
        self._staged[read] = (super().view(read), torch.empty(read.shape, dtype=read.dtype))
        return self._staged[read][1]

    def prepare(self, version):
        for src, buf in self._staged.values():
            buf.copy_(src.clone())


def _endpoint(sources, port):
    src = {"w": Layout((64, 32), [0], [Replicate()]), "b": Layout((33,), [0], [Replicate()], dtype=torch.bfloat16)}
    dst = {"w": Layout((64, 32), [0], [Shard(1)]), "b": Layout((33,), [0], [Replicate()], dtype=torch.bfloat16)}
    tensors = {"w": torch.arange(64 * 32, dtype=torch.float32).reshape(64, 32),
               "b": torch.arange(33, dtype=torch.float32).to(torch.bfloat16)}
    return trs.RefitEndpoint(meeting=trs.Meeting(rank=0, world_size=1, store=f"127.0.0.1:{port}"),
                             source=trs.SourceData(tensors, src),
                             destination=trs.DestinationData(dst), timeouts=trs.Timeouts(wait=30),
                             pull=trs.PullOptions(sources=sources)), tensors


@pytest.mark.parametrize("staged", [False, True])
def test_staging_bytes_is_measured_per_pull(staged):
    ep, tensors = _endpoint(_StagingSources if staged else Sources, free_port())
    with ep:
        for v in (1, 2):
            ep.fence()
            ep.source_tensors["w"].add_(1)
            assert ep.publish() == v
            assert ep.pull() == v
            assert torch.equal(ep.tensors["w"], tensors["w"] + v) and torch.equal(ep.tensors["b"], tensors["b"])
            stats = ep.last_pull
            assert isinstance(stats, trs.PullStats) and stats.version == v
            assert 0 <= stats.wait_ms <= stats.total_ms and 0 <= stats.copy_ms <= stats.total_ms
            assert stats.coordination_ms >= 0
        source_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
        if staged:  # every source byte was staged once per pull, and the figure says so
            assert ep.last_pull.staging_bytes >= source_bytes and ep.stats.staging_bytes >= source_bytes
        else:  # the plain path reads the arenas in place: nothing allocated
            assert ep.last_pull.staging_bytes == 0 and ep.stats.staging_bytes == 0



def test_the_staging_meter_imports_no_torch_dynamo():
    """The CPU staging meter is a TorchDispatchMode; torch wraps such modes in a lazy
    ``torch._dynamo`` import by default. A pull must not import it: it stalls the first pull, and
    imported after init_process_group it keeps the job's process group alive past
    destroy_process_group (see tritonreshard.engine.group)."""
    code = textwrap.dedent(f"""
        import sys, torch, tritonreshard as trs
        lay = {{"w": trs.Layout((8, 4), [0], [trs.Replicate()])}}
        with trs.RefitEndpoint(trs.Meeting(rank=0, world_size=1, store="127.0.0.1:{free_port()}"),
                               source=trs.SourceData({{"w": torch.ones(8, 4)}}, lay),
                               destination=trs.DestinationData(lay), timeouts=trs.Timeouts(wait=30)) as ep:
            ep.publish()
            ep.pull()
            assert torch.equal(ep.tensors["w"], torch.ones(8, 4))
        print("torch._dynamo" in sys.modules)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["False"]

def _poll_worker(rank, port):
    """pull(timeout=0) as a poll, in a loop, while the trainer is slow: the group survives it."""
    torch.set_num_threads(1)
    lay_src = {"w": Layout((4, 4), [0], [Replicate()])}
    lay_dst = {"w": Layout((4, 4), [1], [Replicate()])}
    kw = dict(meeting=trs.Meeting(rank=rank, world_size=2, store=f"127.0.0.1:{port}"), timeouts=trs.Timeouts(wait=60))
    if rank == 0:
        with trs.RefitTrainer({"w": torch.zeros(4, 4)}, lay_src, **kw) as tr:
            for v in (1, 2, 3):
                tr.fence()
                time.sleep(0.3)
                tr.source_tensors["w"].fill_(v)
                tr.publish()
            tr.fence()
        return {}
    polls = 0
    with trs.RefitInference(lay_dst, **kw) as inf:
        while inf.version < 3:
            try:
                inf.pull(timeout=0)
            except TimeoutError:
                polls += 1
            assert torch.equal(inf.tensors["w"], torch.full((4, 4), float(inf.version)))
        return {"polls": polls, "alive": inf.alive()}


def test_pull_with_timeout_zero_is_a_poll_that_never_kills_the_group():
    out = run_ranks(_poll_worker, 2, args=(free_port(),), timeout=120)
    assert out[1]["polls"] > 0 and out[1]["alive"], out
