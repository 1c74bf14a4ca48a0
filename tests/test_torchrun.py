"""The engine inside an existing torch.distributed job and under torchrun: it reuses the job's store
(no second TCPStore, no clash with the launcher's MASTER_PORT) and takes rank / world size from the
job when they are not given."""
import os
import secrets
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from _mp import free_port, run_ranks

import tritonreshard as trs
from tritonreshard import Layout, Replicate, Shard
from tritonreshard.engine import rendezvous as rdv

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.timeout(240)

SRC = {"w": Layout((6, 4), [0], [Replicate()])}
DST = {"w": Layout((6, 4), [1, 2], [Shard(0)])}


def value(v):
    return torch.arange(24, dtype=torch.float32).reshape(6, 4) + 1000 * v


def _job_worker(rank, port):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=3)
    try:
        exact = []
        if rank == 0:
            # rank, world, store: the job's
            with trs.RefitTrainer({"w": value(1)}, SRC, timeouts=trs.Timeouts(wait=60)) as tr:
                for v in (1, 2):
                    tr.fence()
                    tr.source_tensors["w"].copy_(value(v))
                    tr.publish()
                tr.fence()
        else:
            with trs.RefitInference(DST, timeouts=trs.Timeouts(wait=60)) as inf:
                for v in (1, 2):
                    assert inf.pull() == v
                    exact.append(torch.equal(inf.tensors["w"], DST["w"].shard(value(v), rank)))
        t = torch.tensor([rank])
        dist.all_reduce(t)  # the job's own group still works
        return {"exact": exact, "sum": int(t)}
    finally:
        dist.destroy_process_group()


def test_inside_an_initialised_process_group_reuses_its_store_and_ranks(monkeypatch):
    # The job's store listens on every interface: the group secret comes from the environment.
    monkeypatch.setenv(rdv.SECRET_ENV, secrets.token_hex(32))
    out = run_ranks(_job_worker, 3, args=(free_port(),), timeout=180)
    assert out[1]["exact"] == [True, True] and out[2]["exact"] == [True, True], out
    assert all(r["sum"] == 3 for r in out.values())


SCRIPT = textwrap.dedent('''
    import os, torch, tritonreshard as trs
    from tritonreshard import Layout, Replicate, Shard
    src = {"w": Layout((6, 4), [0], [Replicate()])}
    dst = {"w": Layout((6, 4), [1, 2], [Shard(0)])}
    rank = int(os.environ["RANK"])
    full = lambda v: torch.arange(24.0).reshape(6, 4) + 1000 * v
    if rank == 0:
        with trs.RefitTrainer({"w": full(1)}, src, timeouts=trs.Timeouts(wait=60)) as tr:   # store: torchrun's own
            tr.publish()
            tr.fence()
    else:
        with trs.RefitInference(dst, timeouts=trs.Timeouts(wait=60)) as inf:
            assert inf.pull() == 1
            assert torch.equal(inf.tensors["w"], dst["w"].shard(full(1), rank))
            print(f"rank {rank} exact", flush=True)
''')


def test_under_torchrun_no_port_clash_with_the_launchers_store(tmp_path):
    script = tmp_path / "refit_under_torchrun.py"
    script.write_text(SCRIPT)
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3",
                          str(script)], capture_output=True, text=True, timeout=200, cwd=ROOT,
                         env={**os.environ, rdv.SECRET_ENV: secrets.token_hex(32)})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "rank 1 exact" in out.stdout and "rank 2 exact" in out.stdout, out.stdout


_PIN_CHECK = textwrap.dedent("""
    import os, sys
    import torch, torch.distributed as dist
    def gloo_threads():
        comms = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
        return sum(c.startswith(("pt_gloo", "gloo")) for c in comms)
    if sys.argv[1] == "before":
        import tritonreshard
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    if sys.argv[1] == "after":
        import tritonreshard
    if sys.argv[1] == "before":
        # A training step: torch.optim imports torch._dynamo (and torch.distributed.nn) lazily here.
        p = torch.nn.Parameter(torch.ones(3))
        opt = torch.optim.SGD([p], lr=0.1)
        p.sum().backward()
        opt.step()
    t = torch.ones(4)
    dist.broadcast(t, 0)
    alive = gloo_threads()
    dist.destroy_process_group()
    print(alive, gloo_threads())
""")


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads thread names from /proc")
@pytest.mark.parametrize("when", ["before", "after"])
def test_destroy_process_group_still_ends_the_jobs_gloo_threads(when):
    """A job that imports tritonreshard, trains a step and destroys its process group has no gloo
    thread left: a thread left behind releases tensors during interpreter shutdown and aborts the
    process. Imported before init_process_group, tritonreshard disarms torch's trap (the optimizer's
    lazy imports would pin the group); imported after (no training step here: that alone pins the
    group, whatever is imported), it must not pin the group itself."""
    out = subprocess.run([sys.executable, "-c", _PIN_CHECK, when], capture_output=True, text=True,
                         timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    during, after = map(int, out.stdout.split())
    assert during > 0, "the check saw no gloo thread at all: it would prove nothing"
    assert after == 0, f"{after} gloo threads outlived destroy_process_group"
