"""Refit a policy from a trainer to tensor-parallel inference ranks with tritonreshard.

One trainer process (global rank 0) trains a two-layer MLP; two inference processes (ranks 1, 2)
serve it tensor-parallel: ``w_in`` column-parallel (rows split), ``w_out`` row-parallel (columns
split). After every optimizer step the trainer publishes a version; each inference rank pulls it into
a shadow buffer in the background while it keeps serving the previous one, then swaps.

The pattern to copy into your own RL code:

    trainer                                   inference
    -------                                   ---------
    tr = trs.RefitTrainer(tensors, layouts,   inf = trs.RefitInference(layouts,
        trs.Meeting(rank, world_size))            trs.Meeting(rank, world_size),
                                                  pull=trs.PullOptions(mode="shadow"))
    params = Parameters over tr.tensors       loop:
    tr.publish()                    # v1        if inf.available_version() > inf.version:
    loop:                                           inf.start_pull()      # background
        loss.backward()                         generate on inf.tensors   # old weights meanwhile
        tr.fence()   # readers done with v      if inf.pull_done(): inf.swap()
        opt.step()   # writes the arena
        tr.publish()                 # v+1

Every inference rank must pull every version: the trainer's ``fence()`` waits for all of them.

Inside a torch.distributed job (the usual case), with ``store`` left out, the endpoints meet in the
job's own store (the default process group's). That store listens on every interface, so the group
secret must come from the environment (tritonreshard refuses to put it in such a store): export one
for the whole job. Run it either way:

    TRITONRESHARD_GROUP_SECRET=$(python -c "import secrets; print(secrets.token_hex(32))") \
        torchrun --standalone --nproc-per-node 3 examples/rl_refit.py
    python examples/rl_refit.py      # spawns the 3 ranks itself (trs.secret_for_children())

(CPU, a few seconds.)
"""
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import tritonreshard as trs
from tritonreshard.apps.kit import free_port, reap

STEPS = 5
WORLD = 3                      # rank 0 trains, ranks 1 and 2 serve
TRAINER, SERVERS = [0], [1, 2]
D, H = 8, 16

# The trainer holds whole tensors; the servers hold Megatron/vLLM-style TP shards.
SRC = {"w_in": trs.Layout((H, D), TRAINER, [trs.Replicate()]),
       "w_out": trs.Layout((D, H), TRAINER, [trs.Replicate()])}
DST = {"w_in": trs.Layout((H, D), SERVERS, [trs.Shard(0)]),    # column-parallel
       "w_out": trs.Layout((D, H), SERVERS, [trs.Shard(1)])}   # row-parallel


def say(line: str) -> None:
    """One whole line in one write: several processes share this stdout, and a line written in
    pieces (text, then newline, by separate flushes) can run into another process's line."""
    os.write(sys.stdout.fileno(), (line + "\n").encode())


def trainer() -> dict:
    torch.manual_seed(0)
    init = {"w_in": torch.randn(H, D) / D ** 0.5, "w_out": torch.randn(D, H) / H ** 0.5}
    with trs.RefitTrainer(init, SRC, trs.Meeting(rank=0, world_size=WORLD)) as tr:  # store: the job's
        # Train on the arena itself: no copy per step, publish() only bumps the version.
        params = {n: torch.nn.Parameter(t) for n, t in tr.tensors.items()}
        opt = torch.optim.SGD(params.values(), lr=0.1)
        tr.publish()                                    # version 1: the initial weights
        x, y = torch.randn(64, D), torch.randn(64, D)
        for step in range(STEPS):
            loss = ((torch.relu(x @ params["w_in"].T) @ params["w_out"].T - y) ** 2).mean()
            opt.zero_grad()
            loss.backward()                             # overlaps the inference ranks' pulls
            tr.fence()                                  # ...which must finish before we write
            opt.step()
            v = tr.publish()
            say(f"trainer: step {step} loss {loss.item():.4f} -> published version {v}")
        tr.fence()                                      # every server has read the last version
        final = {n: t.detach().clone() for n, t in tr.tensors.items()}
        _share_final(final)
        dist.barrier()                                  # keep the arena until the servers are done
    return final


def inference(rank: int) -> None:
    with trs.RefitInference(DST, trs.Meeting(rank=rank, world_size=WORLD), pull=trs.PullOptions(mode="shadow")) as inf:
        inf.pull()                                      # version 1: wait for it, install it
        served = 0
        while inf.version < STEPS + 1:
            if inf.available_version() > inf.version:
                inf.start_pull()                        # background copy into the shadow buffers
                while not inf.pull_done():
                    _generate(inf.tensors)              # keep serving the previous version
                    served += 1
                inf.swap()                              # install the new version between steps
            else:
                _generate(inf.tensors)
        # Check: this rank's shards equal the trainer's final weights, sliced by the TP layout.
        final = _share_final(None)
        for name, layout in DST.items():
            assert torch.equal(inf.tensors[name], layout.shard(final[name], rank)), name
        say(f"inference rank {rank}: serving version {inf.version}, shards equal the trainer's bit for bit, "
            f"{served} generation steps ran while a refit was in flight")
        dist.barrier()


def _share_final(final):
    """The trainer's final weights to every rank (a broadcast over the job's process group)."""
    out = {}
    for name, layout in SRC.items():
        t = final[name] if final is not None else torch.empty(layout.shape, dtype=layout.dtype)
        dist.broadcast(t, src=TRAINER[0])
        out[name] = t
    return out


def _generate(w):
    """Stand-in for one decode step of a TP engine (the all-reduce of w_out's partial sums is
    omitted: this example is about the weights, not the model)."""
    x = torch.randn(4, D)
    return torch.relu(x @ w["w_in"].T) @ w["w_out"].T


def main() -> None:
    """One rank of the job: torchrun (or ``_spawn`` below) set RANK, WORLD_SIZE, MASTER_ADDR/PORT."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo")   # the job's process group; the refit endpoints reuse its store
    rank = dist.get_rank()
    assert dist.get_world_size() == WORLD, f"run with {WORLD} processes, got {dist.get_world_size()}"
    try:
        if rank in TRAINER:
            trainer()
            say("done: every inference rank serves the trainer's final weights, bit for bit")
        else:
            inference(rank)
    finally:
        dist.destroy_process_group()


def _child(rank: int, port: int) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    main()


def _spawn() -> None:
    """Without torchrun: start the 3 ranks the way it would (rank 0's process group hosts the store)."""
    port = free_port()
    trs.secret_for_children()  # children inherit the group secret; it never crosses the store
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_child, args=(r, port)) for r in range(WORLD)]
    for p in procs:
        p.start()
    codes = reap(procs, timeout=120)  # a rank still running then is killed
    if any(c != 0 for c in codes):
        raise SystemExit(f"ranks exited with codes {codes}")


if __name__ == "__main__":
    main() if "TORCHELASTIC_RUN_ID" in os.environ or "RANK" in os.environ else _spawn()
