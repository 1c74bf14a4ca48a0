"""The demo's driver: spawn one process per rank through the shared :mod:`tritonreshard.apps.driver`,
show progress, restart a failed trainer group (``--restart``), stop the ranks after a failure, and
collect what the report needs (:class:`RunOutcome`).

Every spawned rank runs :func:`rank_main`: its role's own process group, then
:func:`.trainer.run_trainer` or :func:`.inference.run_inference`.
"""
from __future__ import annotations

import datetime
import json
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from tqdm import tqdm

from ..driver import Driver, RankError, RankFailed
from .config import RunConfig
from .inference import run_inference
from .trainer import run_trainer

__all__ = ["drive", "rank_main", "RunOutcome", "MAX_RESTARTS"]

MAX_RESTARTS = 3  # --restart: trainer-group restarts per run before a failure ends it


@dataclass
class RunOutcome:
    """What a run left for the report: ``store`` (the driver's store, under the demo's prefix, with
    every record the ranks wrote), each rank's last ``pids``, one dict per trainer-group restart
    (``recoveries``), ``/dev/shm`` entries that appeared (``leaked``), and for a failed run one line
    per failure (``failure_lines``; None if the run succeeded) and the ranks the driver had to
    terminate. ``started``: ``time.perf_counter()`` when the ranks were about to start."""

    store: object
    pids: dict[int, int]
    recoveries: list[dict]
    leaked: list[str]
    failure_lines: list[str] | None
    terminated: list[int]
    started: float


def drive(rc: RunConfig) -> RunOutcome:
    """Runs the demo's ranks to the end (or to a failure the driver cannot restart from)."""
    world = rc.world_size
    drv = Driver("demo", world, rank_main, (rc,), timeout=rc.timeout, prefix="demo", role=rc.role)
    started = time.perf_counter()
    bar = tqdm(total=rc.steps, desc="refit demo", unit="step", file=sys.stderr, dynamic_ncols=True)
    progress = _Progress(drv.pstore, rc, bar, drv.alive)
    failure = None            # RankFailed / TimeoutError that ended the run
    recoveries = []           # one dict per trainer-group restart
    terminated: list[int] = []
    still_running: list[int] = []
    grace = rc.peer_timeout + 10.0  # how long survivors get to notice a failure and exit
    deadline = time.monotonic() + rc.timeout
    leaked: list[str] = []
    standby = _Standby(drv, rc, recoveries)

    def tick():
        progress()
        standby()

    try:
        drv.start()
        while True:
            try:
                # With --restart a failure is acted on at once (the old trainers are stopped anyway);
                # the report of a failed run reads every rank's error again at the end.
                drv.wait(lambda: not drv.alive(), "the demo's ranks to finish", tick=tick,
                         timeout=max(0.0, deadline - time.monotonic()), settle=0.0 if rc.restart else 5.0)
                break
            except RankFailed as exc:
                if _can_restart(rc, exc.errors, recoveries):
                    recoveries.append(_restart_trainers(drv, rc, exc.errors, bar))
                    continue
                failure = exc
            except TimeoutError as exc:
                failure, still_running = exc, drv.alive()
            break
        if isinstance(failure, RankFailed):
            # Ranks waiting on the store (trajectories, the end of the run) stop at once; ranks in
            # the engine or a collective notice the failure themselves.
            first = failure.errors[0].rank
            drv.abort(f"rank {first} ({rc.role(first)}) failed")
            try:
                drv.wait(lambda: not drv.alive(), "the other ranks to notice the failure and exit",
                         timeout=grace, watch=[])
            except TimeoutError:
                terminated = drv.stop()
    finally:
        bar.close()
        leaked = drv.close()

    lines = None
    if isinstance(failure, RankFailed):
        lines = [drv.describe(e) for e in drv.failures()]
        if terminated:
            lines.append(f"rank(s) {terminated} still running {grace:g} s after the first failure were "
                         f"terminated")
    elif failure is not None:
        lines = [f"{failure}; ranks still running then: {still_running}"]
    return RunOutcome(store=drv.pstore, pids=drv.pids(), recoveries=recoveries, leaked=leaked,
                      failure_lines=lines, terminated=terminated, started=started)


class _Standby:
    """--restart: spare trainer processes (:meth:`Driver.standby`) with the interpreter up and
    torch and tritonreshard imported, so that a restart costs neither (about 2 s here: most of a
    restart spawned from scratch). They are started once every rank is up (and again after the
    first refit of each restarted group), not beside ranks that are importing, whose CPU they would
    take; none once no restart is left."""

    def __init__(self, drv: Driver, rc: RunConfig, recoveries: list):
        self.drv, self.rc, self.recoveries = drv, rc, recoveries

    def __call__(self) -> None:
        drv, rc = self.drv, self.rc
        if not rc.restart or drv.spares or len(self.recoveries) >= MAX_RESTARTS:
            return
        dstore = drv.pstore
        if self.recoveries:
            refits = int(dstore.add("refits_done", 0))  # a version of the newest trainers installed
            ready = refits > 0 and json.loads(dstore.get(f"refit/{refits}"))["epoch"] >= self.recoveries[-1]["epoch"]
        else:
            ready = int(dstore.add("ranks_up", 0)) >= rc.world_size
        if ready:  # torch._dynamo: the optimizer's constructor imports it (1 s here)
            drv.standby(rc.trainers, imports=("torch._dynamo",))


class _Progress:
    """The progress bar's tick: the phase before step 1; then per trainer step the reward, the
    version the trainers published (``trained``), the version the inference group serves
    (``served``) and the last refit's time; after the last step, what is left: the last refits, the
    last probes, then the ranks stopping (``alive()``: the ranks still running)."""

    def __init__(self, dstore, rc: RunConfig, bar, alive):
        self.dstore, self.rc, self.bar, self.alive = dstore, rc, bar, alive
        self.steps, self.refits, self.fields, self.shown = 0, 0, {}, None

    def _show(self, status: str = "", new_steps: int = 0) -> None:
        text = "; ".join(p for p in (", ".join(f"{k}={v}" for k, v in self.fields.items()), status) if p)
        if text != self.shown:
            self.shown = text
            self.bar.set_postfix_str(text, refresh=not new_steps)
        if new_steps:
            self.bar.update(new_steps)  # one refresh: "60/60" shows with its step's "trained=v61"

    def __call__(self) -> None:
        dstore, rc = self.dstore, self.rc
        phase = _phase(dstore, rc.world_size)
        if phase is not None:
            self._show(phase)
            return
        done, before = int(dstore.add("steps_done", 0)), self.steps
        while self.steps < done and dstore.check([f"step/{self.steps + 1}"]):
            self.steps += 1
            m = json.loads(dstore.get(f"step/{self.steps}"))
            self.fields.update(reward=f"{m['reward']:.3f}", trained=f"v{m['version']}")
        new = self.steps - before
        refits = int(dstore.add("refits_done", 0))
        if refits > self.refits:
            self.refits = refits
            r = json.loads(dstore.get(f"refit/{refits}"))
            self.fields.update(served=f"v{r['version']}", refit_ms=f"{r['pull_ms']:.1f}")
        if self.steps < rc.steps:
            self._show(new_steps=new)
        # Every step is done and the bar is full, but the run is not over: say what it waits for.
        elif dstore.check(["inference_summary"]):
            ok = json.loads(dstore.get("inference_summary"))["verified"]
            self._show(f"{'verified' if ok else 'NOT verified'}; stopping ranks: {len(self.alive())}/"
                       f"{rc.world_size} still running", new)
        elif refits < rc.steps:
            self._show(f"inference installs the last version (v{rc.steps + 1})", new)
        else:
            self._show("checking the last probes", new)


def _phase(dstore, world: int) -> str | None:
    """What the demo is doing before its first step (for the progress bar), None after."""
    if dstore.check(["step/1"]):
        return None
    up = int(dstore.add("ranks_up", 0))
    if up < world:
        return f"starting processes: {up}/{world} up"
    if not dstore.check(["pulled/1"]):
        return "forming the refit group; the inference ranks pull version 1"
    return "generating the first rollouts; trainer step 1"


def _can_restart(rc: RunConfig, errors: list[RankError], recoveries) -> bool:
    """--restart: only trainers failed (the inference group serves on), and restarts remain."""
    return (rc.restart and len(recoveries) < MAX_RESTARTS
            and all(e.rank in rc.trainer_ranks for e in errors))


def _restart_trainers(drv: Driver, rc: RunConfig, errors: list[RankError], bar) -> dict:
    """The trainer group failed: stop what is left of it, then start new trainer processes in the next
    group epoch; they resume from their last complete checkpoint, and the inference processes (still
    serving their last complete version) join that epoch."""
    failed_at, detected_at = min(e.time for e in errors), time.time()
    bar.write(f"tritonreshard demo: {'; '.join(drv.describe(e) for e in errors)}; restarting the trainer "
              f"group from its last checkpoint (the inference processes keep serving)", file=sys.stderr)
    # The other trainers' state is in their checkpoints, so they are stopped at once (SIGTERM: their
    # endpoints close) rather than given time to notice: one waiting in fence() for a version the
    # inference group will never ack would not notice before its timeout.
    drv.stop(rc.trainer_ranks, grace=5.0)
    stopped_at = time.time()
    epoch = int(drv.pstore.add("trainer_epoch", 1))  # the ranks of that epoch read it when they start
    drv.start(rc.trainer_ranks)
    return {"failed_at": failed_at, "detected_at": detected_at, "stopped_at": stopped_at, "epoch": epoch,
            "launches": sorted({drv.launches[r]["how"] for r in rc.trainer_ranks}),
            "errors": [drv.describe(e) for e in errors]}


def rank_main(rank: int, store, dstore, rc: RunConfig) -> None:
    """Every spawned rank (run by the shared driver, which records a failure under ``error/<rank>``).

    Each role has its own default process group (trainers: ``pg-trainers-e<epoch>``, inference:
    ``pg-inference``), never one spanning both: restarted trainers form a new group of their own,
    while the inference processes' tensor-parallel group lives on. The refit endpoints meet in the
    driver's store under ``refit``; every epoch of the refit group keeps its keys apart inside it."""
    timeout = datetime.timedelta(seconds=rc.timeout)
    if rc.device == "cuda":
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    entered = time.time()  # a restart's breakdown: the new process runs the rank from here
    trainer = rank < rc.trainers
    epoch = int(dstore.add("trainer_epoch", 0)) if trainer else 0
    if trainer:
        dstore.set(f"entered/{epoch}/{rank}", repr(entered))
    pg_name = f"pg-trainers-e{epoch}" if trainer else "pg-inference"
    group_rank = rank if trainer else rank - rc.trainers
    dist.init_process_group(rc.dist_backend, store=dist.PrefixStore(pg_name, store), rank=group_rank,
                            world_size=rc.trainers if trainer else rc.inference, timeout=timeout)
    dstore.add("ranks_up", 1)
    refit_store = dist.PrefixStore("refit", store)
    try:
        if trainer:
            run_trainer(rank, rc, refit_store, dstore, epoch, device)
        else:
            run_inference(rank, rc, refit_store, dstore, device)
    finally:
        dist.destroy_process_group()
