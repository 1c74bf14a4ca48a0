"""Refit a policy from a trainer to tensor-parallel inference ranks with tritonreshard.

One trainer process (global rank 0) trains a two-layer MLP; two inference processes (ranks 1, 2)
serve it tensor-parallel: ``w_in`` column-parallel (rows split), ``w_out`` row-parallel (columns
split). After every optimizer step the trainer publishes a version; each inference rank pulls it into
a shadow buffer in the background while it keeps serving the previous one, then swaps.

The pattern to copy into your own RL code:

    trainer                                   inference
    -------                                   ---------
    tr = trs.RefitTrainer(tensors, layouts,   inf = trs.RefitInference(layouts, rank, world_size,
                          rank, world_size,                            store, mode="shadow")
                          store)              loop:
    params = Parameters over tr.tensors         if inf.available_version() > inf.version:
    tr.publish()                    # v1            inf.start_pull()      # background
    loop:                                       generate on inf.tensors   # old weights meanwhile
        loss.backward()                         if inf.pull_done(): inf.swap()
        tr.fence()   # readers done with v
        opt.step()   # writes the arena
        tr.publish()                 # v+1

Every inference rank must pull every version: the trainer's ``fence()`` waits for all of them.
Run: ``python examples/rl_refit.py`` (CPU, a few seconds).
"""
import datetime
import io

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import tritonreshard as trs

STEPS = 5
WORLD = 3                      # rank 0 trains, ranks 1 and 2 serve
TRAINER, SERVERS = [0], [1, 2]
D, H = 8, 16

# The trainer holds whole tensors; the servers hold Megatron/vLLM-style TP shards.
SRC = {"w_in": trs.Layout((H, D), TRAINER, [trs.Replicate()]),
       "w_out": trs.Layout((D, H), TRAINER, [trs.Replicate()])}
DST = {"w_in": trs.Layout((H, D), SERVERS, [trs.Shard(0)]),    # column-parallel
       "w_out": trs.Layout((D, H), SERVERS, [trs.Shard(1)])}   # row-parallel


def trainer(addr: str) -> None:
    torch.manual_seed(0)
    init = {"w_in": torch.randn(H, D) / D ** 0.5, "w_out": torch.randn(D, H) / H ** 0.5}
    tr = trs.RefitTrainer(init, SRC, rank=0, world_size=WORLD, store=_store(addr))
    # Train on the arena itself: no copy per step, publish() only bumps the version.
    params = {n: torch.nn.Parameter(t) for n, t in tr.tensors.items()}
    opt = torch.optim.SGD(params.values(), lr=0.1)
    tr.publish()                                        # version 1: the initial weights
    x, y = torch.randn(64, D), torch.randn(64, D)
    for step in range(STEPS):
        loss = ((torch.relu(x @ params["w_in"].T) @ params["w_out"].T - y) ** 2).mean()
        opt.zero_grad()
        loss.backward()                                 # overlaps the inference ranks' pulls
        tr.fence()                                      # ...which must finish before we write
        opt.step()
        v = tr.publish()
        print(f"trainer: step {step} loss {loss.item():.4f} -> published version {v}")
    tr.fence()                                          # every server has read the last version
    _store(addr).set("final", _dumps({n: t.clone() for n, t in tr.tensors.items()}))
    _store(addr).wait(["served"])                       # keep the arena until the servers are done
    tr.close()


def inference(rank: int, addr: str) -> None:
    inf = trs.RefitInference(DST, rank=rank, world_size=WORLD, store=_store(addr), mode="shadow")
    inf.pull()                                          # version 1: wait for it, install it
    served = 0
    while inf.version < STEPS + 1:
        if inf.available_version() > inf.version:
            inf.start_pull()                            # background copy into the shadow buffers
            while not inf.pull_done():
                _generate(inf.tensors)                  # keep serving the previous version
                served += 1
            inf.swap()                                  # install the new version between steps
        else:
            _generate(inf.tensors)
    # Check: this rank's shards equal the trainer's final weights, sliced by the TP layout.
    final = _loads(_store(addr).get("final"))
    for name, layout in DST.items():
        assert torch.equal(inf.tensors[name], layout.shard(final[name], rank)), name
    print(f"inference rank {rank}: serving version {inf.version}, shards exact, "
          f"{served} generation steps ran while a refit was in flight", flush=True)
    inf.close()
    if _store(addr).add("served_count", 1) == len(SERVERS):
        _store(addr).set("served", "1")


def _generate(w):
    """Stand-in for one decode step of a TP engine (the all-reduce of w_out's partial sums is
    omitted: this example is about the weights, not the model)."""
    x = torch.randn(4, D)
    return torch.relu(x @ w["w_in"].T) @ w["w_out"].T


_stores = {}


def _store(addr: str) -> dist.TCPStore:
    if addr not in _stores:
        host, port = addr.rsplit(":", 1)
        _stores[addr] = dist.TCPStore(host, int(port), is_master=False,
                                      timeout=datetime.timedelta(seconds=30))
    return _stores[addr]


def _dumps(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _loads(data: bytes):
    return torch.load(io.BytesIO(data))


def _run(rank: int, addr: str) -> None:
    torch.set_num_threads(1)
    trainer(addr) if rank in TRAINER else inference(rank, addr)


if __name__ == "__main__":
    # The launcher owns the rendezvous store; every process connects to it as a client.
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    addr = f"127.0.0.1:{master.port}"
    from tritonreshard._rendezvous import secret_for_children

    secret_for_children()  # children inherit it; it never crosses the store
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_run, args=(r, addr)) for r in range(WORLD)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    codes = [p.exitcode for p in procs]
    for p in procs:
        if p.is_alive():
            p.kill()
    if any(c != 0 for c in codes):
        raise SystemExit(f"ranks exited with codes {codes}")
    print("done: every inference rank serves the trainer's final weights, bit for bit")
