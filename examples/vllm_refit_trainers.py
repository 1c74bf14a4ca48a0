"""The trainer processes of ``examples/vllm_refit.py``: FSDP trainers (global ranks :data:`TRAINERS`
of the refit group), each holding its row shards (``Shard(0)``) of the model's Hugging Face
parameters in tritonreshard's shared arena, perturbing them each step (an evolution-strategies style
update) and publishing a version; :class:`TrainerGroup` starts one group of them and talks to them
from the driver, over queues on one machine or over pipes to a host of the host harness
(``--net namespaces``).

:func:`trainer`, the processes' target, is a function of this module: a spawned trainer imports it
as ``vllm_refit_trainers.trainer`` (spawn passes the driver's ``sys.path`` on, and ``examples/`` is on
it), whichever script started the group (this example, bench/vllm_serve_bench.py, tests/_refit_batch.py).
"""
from __future__ import annotations

import multiprocessing.connection as mp_connection
import os
import pickle
import queue
import signal
import socket
import sys
import time

import torch
from vllm_models import TRACED, model_config
from vllm_refit_hosts import HOST_ENV

from tritonreshard.apps.kit import expect, free_port, reap

SEED = 0
SIGMA = 0.02          # perturbation per step, about the init std of the weights
TRAINERS = [0, 1]     # global ranks of the trainer processes in the refit group


def inference_ranks(tp: int) -> list[int]:
    """The global ranks of vLLM's ``tp`` workers in the refit group: after :data:`TRAINERS`."""
    return list(range(len(TRAINERS), len(TRAINERS) + tp))


def recipe(model: str, tp: int):
    """The recipe of ``model`` at TP ``tp`` between :data:`TRAINERS` and the vLLM workers: the
    hand-written one, or for :data:`TRACED` models the one traced from vLLM's loader (which the
    workers trace too: the refit group checks that both sides' layouts agree)."""
    import tritonreshard as trs

    kw = dict(tp=tp, trainer_ranks=TRAINERS, inference_ranks=inference_ranks(tp))
    if model in TRACED:
        from tritonreshard.vllm.trace import trace_recipe  # imports vLLM: only where a trace is asked for

        return trace_recipe(model_config(model), **kw)
    return trs.recipes.hf_to_vllm(model_config(model), **kw)


def perturb(t: torch.Tensor, frac: float, gen: torch.Generator) -> None:
    """One training step on ``t`` (in place): Gaussian noise of std SIGMA on every element when
    ``frac`` is 1; otherwise on ``max(1, round(frac * numel))`` elements drawn at random, the others
    keeping their exact bits (RL fine-tuning changes few weights per step). The noise on those is
    ``SIGMA / sqrt(frac)``: the same update norm as a full step, so greedy output still changes."""
    if frac >= 1.0:
        t.add_(torch.randn(t.shape, generator=gen) * SIGMA)
        return
    flat = t.view(-1)
    k = max(1, round(frac * flat.numel()))
    idx = torch.randperm(flat.numel(), generator=gen)[:k]
    flat.index_add_(0, idx, torch.randn(k, generator=gen, dtype=t.dtype) * (SIGMA / frac ** 0.5))


def trainer(rank: int, train_path: str, model: str, tp: int, store: str, group: str, commands, results,
            host: str | None = None, changed: float = 1.0) -> None:
    """One FSDP trainer: row shard ``rank`` of every HF parameter, perturbed in the shared arena
    (a ``changed`` fraction of each shard's elements per step). ``host``: this process's simulated
    host identity (``TRITONRESHARD_HOST``), set before its endpoint exists."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    torch.set_num_threads(1)
    if host is not None:
        os.environ[HOST_ENV] = host
    from safetensors.torch import load_file

    import tritonreshard as trs
    import tritonreshard.vllm as trs_vllm

    cfg = model_config(model)
    full = load_file(train_path)  # the training parameters (HF names)
    inference = inference_ranks(tp)
    # The recipe's source side: which HF parameters, and this rank's FSDP rows of each.
    spec = recipe(model, tp)
    src = spec.src
    shards = {n: src[n].shard(full[n], rank).contiguous() for n in src}
    # FSDP keeps buffers whole on every trainer (the recipe's Replicate sources): each trainer must
    # change its copy the same way, so their noise does not depend on the rank.
    whole = {n for n in src if not any(isinstance(p, trs.Shard) for p in src[n].placements)}
    joined = dict(rank=rank, trainer_ranks=TRAINERS, inference_ranks=inference, store=store, group=group,
                  timeouts=trs.Timeouts(wait=300.0))
    with (trs_vllm.Trainer.from_spec(spec, shards, **joined) if model in TRACED else
          trs_vllm.Trainer(cfg, shards, tp=tp, **joined)) as tr:
        results.put(("ready", rank, {"host": os.environ.get(HOST_ENV) or socket.gethostname(),
                                     "hostname": socket.gethostname()}))
        while True:
            cmd, arg = commands.get()
            if cmd == "stop":
                break
            if cmd == "fence":  # wait until every worker read the last version (its background pull)
                tr.fence()  # the cross-host sends are done too: their comparison time is this version's
                results.put(("fenced", rank, tr.stats.cross_host_encode_s))
                continue
            if cmd == "die":  # the fault: die while vLLM waits in update_weights for this version
                time.sleep(arg)
                os.kill(os.getpid(), signal.SIGKILL)
            # cmd == "step": every reader acked the last version, then write the arena in place.
            tr.fence()
            g = torch.Generator().manual_seed(SEED * 1000 + arg * 10 + rank)
            same = torch.Generator().manual_seed(SEED * 1000 + arg * 10 + len(TRAINERS))
            for name in sorted(tr.tensors):
                t = tr.tensors[name]
                perturb(t, changed, same if name in whole else g)
            v = tr.publish()
            at = time.time()  # when this version became readable (bench/vllm_serve_bench.py times pulls from it)
            results.put(("published", rank, (v, {n: t.clone() for n, t in tr.tensors.items()}, at)))


class TrainerGroup:
    """The trainer processes of one refit group (trainer rank 0 hosts its TCPStore on a free port).
    Each group has its own results queue: a dead group's unread messages hold tensors shared by
    processes that are gone. ``host``: the trainers' simulated host identity (None: this
    machine's); ``on``: a host harness (:class:`tritonreshard.apps.hosts.Hosts`) whose host 0 runs
    the trainers (and so the store, at that host's address), talking to this process over pipes
    (:class:`_Pipe`); ``changed``: the fraction of each tensor a step changes (see :func:`perturb`).
    ``args`` needs only ``model`` and ``tp`` (bench/vllm_serve_bench.py passes just those)."""

    def __init__(self, ctx, train_path, args, tag, *, host: str | None = None, on=None, changed: float = 1.0):
        self.store = f"{'127.0.0.1' if on is None else on.address(0)}:{free_port()}"
        self.tag = tag
        self.src = recipe(args.model, args.tp).src
        if on is None:
            self.results, self.commands = ctx.Queue(), {r: ctx.Queue() for r in TRAINERS}
            theirs = {r: (self.commands[r], self.results) for r in TRAINERS}
        else:  # per trainer: a command pipe (driver -> trainer) and a result pipe (trainer -> driver)
            pipes = {r: (ctx.Pipe(duplex=False), ctx.Pipe(duplex=False)) for r in TRAINERS}
            self.commands = {r: _Pipe(cmd[1]) for r, (cmd, _) in pipes.items()}
            self.results = _Inbox(res[0] for _, res in pipes.values())
            theirs = {r: (_Pipe(cmd[0]), _Pipe(res[1])) for r, (cmd, res) in pipes.items()}
        self.procs = {r: ctx.Process(target=trainer, args=(r, train_path, args.model, args.tp, self.store, tag,
                                                           *theirs[r], host, changed),
                                    daemon=True)
                      for r in TRAINERS}
        for p in self.procs.values():
            if on is None:
                p.start()
            else:  # host 0's launcher runs this Python there
                on.start(0, p)
        if on is not None:  # the trainers hold their ends: one that exits closes its result pipe
            for ends in theirs.values():
                for end in ends:
                    end.conn.close()

    def expect(self, kind):
        return expect(self.results, kind, self.procs, who="trainer rank(s)")

    def _all(self, cmd, arg, kind) -> dict:
        """``cmd`` to every trainer; {rank: its answer of ``kind``}."""
        for r in TRAINERS:
            self.commands[r].put((cmd, arg))
        return {r: got for _, r, got in (self.expect(kind) for _ in TRAINERS)}

    def step(self, step):
        """Every trainer perturbs its shards and publishes; returns {rank: its shards}."""
        published = self._all("step", step, "published")
        self.published_at = {r: at for r, (_, _, at) in published.items()}
        return {r: sh for r, (_, sh, _) in published.items()}

    def fence(self):
        """Every trainer waits until every vLLM worker pulled its last version (no vLLM call).
        Returns {trainer rank: seconds its last cross-host send spent comparing and encoding}."""
        return self._all("fence", None, "fenced")

    def stop(self):
        for r, p in self.procs.items():
            if p.is_alive():
                try:
                    self.commands[r].put(("stop", None))
                except OSError:  # its pipe's reader is gone: it exited meanwhile (reaped below)
                    pass
        if isinstance(self.results, _Inbox):
            # Reading on while they stop: a trainer blocked writing a message nobody asked for (the
            # step the fault interrupted) gets to its "stop" (a queue's feeder thread would hold it).
            deadline = time.monotonic() + 30
            while any(p.is_alive() for p in self.procs.values()) and time.monotonic() < deadline:
                try:
                    self.results.get(0.1)
                except queue.Empty:
                    pass
        reap(self.procs, timeout=30)
        if isinstance(self.results, _Inbox):
            for end in [*self.commands.values(), *self.results.conns]:
                getattr(end, "conn", end).close()


class _Pipe:
    """One end of a one-way pipe with a queue's ``put`` / ``get``: what the driver and a trainer on a
    host of the harness talk over (--net namespaces). A ``multiprocessing`` queue does not cross hosts:
    its lock is a POSIX semaphore named in the creator's /dev/shm, which the other host does not see,
    and it hands tensors over in shared memory. A pipe's ends are inherited at spawn, and its messages
    are pickled whole (tensors by value), as they would cross a network."""

    def __init__(self, conn):
        self.conn = conn

    def put(self, msg) -> None:
        self.conn.send_bytes(pickle.dumps(msg))

    def get(self):
        return pickle.loads(self.conn.recv_bytes())


class _Inbox:
    """The driver's ends of the trainers' result pipes, read as one queue: ``get(timeout)`` raises
    ``queue.Empty`` as :func:`tritonreshard.apps.kit.expect` expects. A trainer that exited closed its
    pipe, which then leaves the inbox (``expect`` names the trainer and its exit code)."""

    def __init__(self, conns):
        self.conns = list(conns)

    def get(self, timeout: float):
        for conn in mp_connection.wait(self.conns, timeout):
            try:
                return pickle.loads(conn.recv_bytes())
            except EOFError:
                self.conns.remove(conn)
        raise queue.Empty
