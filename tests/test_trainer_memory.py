"""A serving trainer holds its shards once: the caller's tensors become views of the arena.

One trainer process (``ServingTrainer.from_spec``, the path ``trs_vllm.Trainer`` shares) is given
96 MiB of plain float32 shards, 4 MiB each (as most of a model's: on the heap, below glibc's mmap
threshold, so freed ones stay resident unless the trainer trims the heap), and one inference
process pulls them. Measured in the trainer: its
caller's tensors share storage with the arena (``data_ptr``), writing them is what the inference
rank pulls, and the process's resident memory grows by about 1x the shards' bytes, not 2x (the
copy the arena used to keep beside the caller's tensors), at its peak too: each tensor is adopted
right after its copy and the freed heap trimmed as the arena fills (the peak was 2x while the
caller's tensors were adopted only once the arena was full). A slice of a bigger tensor is not
adopted (re-pointing it frees nothing): it stays a copy, and the measurement sees it.
"""
import ctypes
import gc

import pytest
import torch
from _mp import free_port, run_ranks

import tritonreshard as trs
from tritonreshard.engine.heap import release_freed_heap
from tritonreshard.recipes import RecipeSpec
from tritonreshard.serving import ServingTrainer

ROWS, COLS = 1 << 10, 1 << 10  # 4 MiB of float32 each
NAMES = tuple(f"layers.{i}.weight" for i in range(24))
SHARD_BYTES = len(NAMES) * ROWS * COLS * 4


def _spec() -> RecipeSpec:
    src = {n: trs.Layout((ROWS, COLS), [0], [trs.Shard(0)], torch.float32) for n in NAMES}
    dst = {n: trs.Layout((ROWS, COLS), [1], [trs.Shard(0)], torch.float32) for n in NAMES}
    return RecipeSpec("plain", 1, False, src, dst, {})


def _resident() -> int:
    """Private anonymous plus shared-memory resident bytes (``/proc/self/status``): the caller's
    tensors are anonymous memory, the arena shared memory. Not smaps' ``Private_*``: an arena page a
    reader has mapped too counts as shared there."""
    fields = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return sum(int(fields[k].split()[0]) * 1024 for k in ("RssAnon", "RssShmem"))


def _reset_peak() -> bool:
    """Make ``VmHWM`` the current resident set (proc(5), ``clear_refs`` 5); False where refused."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _rss(key: str) -> int:
    fields = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return int(fields[key].split()[0]) * 1024


def _values(i: int, version: int) -> torch.Tensor:
    return torch.full((ROWS, COLS), float(10 * i + version))


def _published(version: int) -> list:
    return [[float(10 * i + version)] for i in range(len(NAMES))]


def _trainer(store: str, keep_base: bool) -> dict:
    # The shards on the heap, as in a trainer that freed bigger temporaries before (glibc then raises
    # its mmap threshold to up to 32 MiB): freed, they stay resident unless the heap is trimmed.
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is not None:
        mallopt(-3, 64 << 20)  # M_MMAP_THRESHOLD
    gc.collect()
    before = _resident()
    if keep_base:  # the caller's shards are slices of one tensor it keeps: nothing to free
        whole = torch.cat([_values(i, 0) for i in range(len(NAMES))])
        shards = dict(zip(NAMES, whole.split(ROWS), strict=True))
    else:
        shards = {n: _values(i, 0) for i, n in enumerate(NAMES)}
    gc.collect()
    # The 24 temporaries torch.cat joined are freed on the heap, and stay resident where something
    # allocated after them pins the heap's top (a fresh-clone CI once measured 3.0x, not 2x): they
    # are this test's, not the trainer's.
    release_freed_heap()
    peak_from = _rss("VmRSS") if _reset_peak() else None   # the shards exist: the peak above them
    tr = ServingTrainer.from_spec(_spec(), shards, rank=0, trainer_ranks=[0], inference_ranks=[1], store=store,
                                  group="memory", timeouts=trs.Timeouts(wait=60))
    try:
        gc.collect()
        growth = _resident() - before
        peak = _rss("VmHWM") - peak_from if peak_from is not None else None
        arena = tr.tensors
        shared = [n for n in NAMES if shards[n].data_ptr() == arena[n].data_ptr()]
        assert tr.publish() == 1
        tr.fence()
        with torch.no_grad():  # the "optimizer step" on the caller's own tensors
            for i, n in enumerate(NAMES):
                shards[n].copy_(_values(i, 2))
        assert tr.publish() == 2
        tr.fence()
    finally:
        tr.close()
    return {"growth": growth, "shared": shared, "peak": peak}


def _inference(store: str) -> list:
    seen = []
    with trs.RefitInference(_spec().dst, trs.Meeting(rank=1, world_size=2, store=store, group="memory"),
                            timeouts=trs.Timeouts(wait=60)) as ep:
        for v in (1, 2):
            assert ep.pull(v) == v
            seen.append([ep.tensors[n].unique().tolist() for n in NAMES])
    return seen


def _rank(rank: int, store: str, keep_base: bool):
    torch.set_num_threads(1)
    return _trainer(store, keep_base) if rank == 0 else _inference(store)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("keep_base", [False, True], ids=["own-tensors", "slices-of-one"])
def test_the_trainer_holds_its_shards_once(keep_base):
    out = run_ranks(_rank, 2, args=(f"127.0.0.1:{free_port()}", keep_base), timeout=150)
    trainer, seen = out[0], out[1]
    ratio = trainer["growth"] / SHARD_BYTES
    if keep_base:  # slices are not adopted: the caller's tensor and the arena both live
        assert trainer["shared"] == [], trainer
        assert 1.8 < ratio < 2.3, ratio
        assert seen == [_published(0), _published(0)]  # writing the slices changed nothing published
    else:
        assert trainer["shared"] == list(NAMES), trainer
        assert 0.8 < ratio < 1.3, ratio
        # While the arena filled, above the caller's shards: the 16 MiB between two trims and the
        # runtime's set-up (0.20x measured; trimmed only once the arena is full, 0.99x: the arena
        # and the caller's freed storage both resident).
        if trainer["peak"] is not None:
            print(f"peak while filling, above the caller's shards: {trainer['peak'] / SHARD_BYTES:.2f}x the shards")
            assert trainer["peak"] / SHARD_BYTES < 0.5, trainer
        assert seen == [_published(0), _published(2)]  # the caller's writes are what was published
