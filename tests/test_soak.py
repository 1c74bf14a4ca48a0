"""Soak: 2000 refits (1 trainer, 1 inference rank in shadow mode, small tensors) with flat memory
(RSS from /proc/self/status), file-descriptor and mapping counts in both processes: the numbers
after a warm-up are compared with the numbers at the end, with a small tolerance for RSS."""
import pytest
import torch
from _faults import fd_count, our_maps, rss_kib
from _mp import free_port, run_ranks

import tritonreshard as trs
from tritonreshard import Layout, Shard

pytestmark = pytest.mark.timeout(240)

REFITS, WARMUP = 2000, 200
RSS_TOLERANCE_KIB = 4096


def _soak_worker(rank, port):
    torch.set_num_threads(1)
    src = {"w": Layout((16, 8), [0], [Shard(0)]), "b": Layout((8,), [0], [Shard(0)], torch.bfloat16)}
    dst = {"w": Layout((16, 8), [1], [Shard(1)], torch.bfloat16), "b": Layout((8,), [1], [Shard(0)], torch.bfloat16)}
    kw = dict(meeting=trs.Meeting(rank=rank, world_size=2, store=f"127.0.0.1:{port}"), timeouts=trs.Timeouts(wait=60))
    samples = {}
    if rank == 0:
        ep = trs.RefitTrainer({"w": torch.zeros(16, 8), "b": torch.zeros(8, dtype=torch.bfloat16)}, src, **kw)
    else:
        ep = trs.RefitInference(dst, pull=trs.PullOptions(mode="shadow"), **kw)
    with ep:
        for v in range(1, REFITS + 1):
            if rank == 0:
                ep.fence()
                for t in ep.source_tensors.values():
                    t.fill_(v % 251)
                ep.publish()
            else:
                assert ep.pull() == v
                assert bool((ep.tensors["w"] == v % 251).all()), v
            if v in (WARMUP, REFITS):
                samples[v] = dict(rss=rss_kib(), fds=fd_count(), maps=len(our_maps()))
        if rank == 0:
            ep.fence()
    return samples


def test_soak_2000_refits_flat_memory_and_fds():
    out = run_ranks(_soak_worker, 2, args=(free_port(),), timeout=220)
    for rank, s in out.items():
        a, b = s[WARMUP], s[REFITS]
        print(f"rank {rank}: after {WARMUP} refits {a}, after {REFITS} {b}")
        assert b["fds"] == a["fds"], (rank, a, b)
        assert b["maps"] == a["maps"], (rank, a, b)
        assert b["rss"] - a["rss"] <= RSS_TOLERANCE_KIB, (rank, a, b)
