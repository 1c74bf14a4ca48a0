"""An inference process of the demo: one TP rank serving the policy and refitting it.

The serving loop of :class:`InferenceRank`, every TP rank in lockstep:

1. :meth:`~InferenceRank.boundary`: at each rollout boundary one MIN all-reduce makes every TP rank
   take the same decision (newest version, pull done / failed, demo aborting, trainer epoch);
2. :meth:`~InferenceRank.stop`: a failed pull (without ``--restart``) or an aborting demo: settle
   the pull together (:meth:`~InferenceRank.settle_pull`: installed if complete on every TP rank,
   else discarded), verify what the group serves, record it and why, raise
   :class:`InferenceGroupStopped`;
3. :meth:`~InferenceRank.follow_trainers`: ``--restart``: the trainers failed or a new trainer
   epoch is up: settle the pull the same way, keep serving, ``rejoin()`` that epoch;
4. :meth:`~InferenceRank.refit_shadow` / :meth:`~InferenceRank.refit_inplace`: swap in a finished
   background pull and start the next one / pull in place while generation waits;
5. :meth:`~InferenceRank.record_refit`: the slowest rank's pull and stall, the verification probe;
6. :meth:`~InferenceRank.rollout`: one batch of trajectories on the serving weights.
"""
from __future__ import annotations

import json
import os
import pickle
import sys
import time
from dataclasses import dataclass

import torch

from tritonreshard import Meeting, PullOptions, RefitInference, Timeouts, plan_reshard

from ..driver import poll_until
from .config import RunConfig
from .faults import fault_at, kill_self
from .policy import (
    Comm,
    PolicyConfig,
    gather_full,
    inference_layouts,
    reward,
    tp_forward,
    trainer_layouts,
    weights_digest,
)
from .verify import ProbeChecks, verify_served

__all__ = ["run_inference", "InferenceRank", "InferenceGroupStopped"]

IGROUP = None  # the TP collectives run on the inference role's default process group


class InferenceGroupStopped(RuntimeError):
    """The inference group stopped refitting together; ``noticed_at``: when it noticed (wall time)."""

    def __init__(self, message: str, noticed_at: float):
        super().__init__(message)
        self.noticed_at = noticed_at


@dataclass(frozen=True)
class Boundary:
    """What every TP rank agreed on at a rollout boundary (MINs over the group, so one rank's
    "no" is everyone's), and this rank's own view of an abort."""

    latest: int        # newest version every rank can pull
    all_done: bool     # every rank's background pull finished
    all_finished: bool  # every rank serves the final version, nothing in flight
    all_ok: bool       # no rank's pull failed
    go_on: bool        # no rank saw the driver's abort
    epoch: int         # the trainer epoch every rank can join
    aborted: bool      # this rank saw the driver's abort


def run_inference(rank: int, rc: RunConfig, refit_store, dstore, device: torch.device) -> None:
    """Inference ``rank`` (TP rank ``rank - rc.trainers``): pulls version 1, then serves and
    refits until the final version is installed and verified; records the summary (TP rank 0)."""
    r = InferenceRank(rank, rc, refit_store, dstore, device)
    try:
        r.first_pull()
        r.serve()
        r.finish()
    finally:
        r.close()


class InferenceRank:
    """One TP rank's state across the serving loop (see the module docstring for the steps)."""

    def __init__(self, rank: int, rc: RunConfig, refit_store, dstore, device: torch.device):
        self.rank, self.rc, self.dstore, self.device = rank, rc, dstore, device
        self.cfg = PolicyConfig()
        self.comm = Comm(device, rc.comm_backend)
        self.leader = rank == rc.trainers  # TP rank 0
        self.dst_layouts = inference_layouts(self.cfg, rc.inference_ranks)
        self.plan_bytes = plan_reshard(trainer_layouts(self.cfg, rc.trainer_ranks),
                                       self.dst_layouts).stats.total_bytes
        self.pid = os.getpid()
        self.checks = ProbeChecks()  # the leader's verification record
        self.gen = torch.Generator().manual_seed(rc.seed * 1000 + 17)
        self.sample_gen = torch.Generator().manual_seed(rc.seed * 1000 + 23)
        self.batch_id = 0
        self.refits = 0
        self.pulling = None          # version being pulled into the shadow (all TP ranks agree)
        self.orphaned = False        # --restart: the trainers' epoch ended; wait for the next one
        self.final_version = None
        self.max_stall = 0.0
        self.inf = RefitInference(self.dst_layouts, Meeting(rank=rank, world_size=rc.world_size, store=refit_store),
                                  pull=PullOptions(mode=rc.mode, device=device, backend=rc.backend),
                                  timeouts=Timeouts(wait=rc.timeout, peer=rc.peer_timeout))

    # -- the loop -------------------------------------------------------------------------------
    def first_pull(self) -> None:
        """Waits (up to the timeout) for version 1, the trainers' initial weights, and verifies it."""
        self.inf.pull()
        assert self.inf.version == 1, self.inf.version
        if self.leader:
            self.dstore.set("pulled/1", "1")
        self.verify()

    def serve(self) -> None:
        """Rollout boundaries and batches until every TP rank serves the final version."""
        inf = self.inf
        while True:
            b = self.boundary()
            if not b.go_on or (not b.all_ok and not self.rc.restart):
                self.stop(b)
            latest = b.latest
            if not b.all_ok or b.epoch > inf.epoch:
                latest = self.follow_trainers(b.epoch)
            if b.all_finished:
                return
            refit = None
            if self.orphaned:
                pass  # nothing to pull until the new trainers are up
            elif inf.mode.background:
                refit = self.refit_shadow(latest, b.all_done)
            elif latest > inf.version:
                refit = self.refit_inplace(latest)
            if refit is not None:
                self.record_refit(*refit)
            if self.leader:
                self.checks.check(self.dstore, block=False)
            self.rollout()

    def boundary(self) -> Boundary:
        """Every TP rank, at a rollout boundary: one MIN all-reduce of what each rank sees."""
        inf, dstore = self.inf, self.dstore
        if self.final_version is None and dstore.check(["final_version"]):
            self.final_version = int(dstore.get("final_version"))
        done = self.pulling is not None and inf.pull_done()
        failed = done and inf.pull_error() is not None
        aborted = dstore.check(["abort"])  # the driver saw a rank fail and is stopping the demo
        # The trainers' epoch the driver started last, if its rank 0 is up to meet us.
        epoch = int(dstore.add("trainer_epoch", 0))
        epoch = epoch if dstore.check([f"trainers_up/{epoch}"]) else inf.epoch
        latest = inf.version if self.orphaned else inf.available_version()
        finished = self.final_version is not None and inf.version == self.final_version and self.pulling is None
        state = torch.tensor([latest, int(done), int(finished), int(not failed), int(not aborted), epoch],
                             dtype=torch.int64)
        latest, all_done, all_finished, all_ok, go_on, epoch = self.comm.all_reduce_min(state, IGROUP).tolist()
        return Boundary(latest, bool(all_done), bool(all_finished), bool(all_ok), bool(go_on), epoch, aborted)

    def stop(self, b: Boundary) -> None:
        """Some TP rank's pull failed, or another rank of the demo did: the group settles its pull
        (:meth:`settle_pull`: installed if complete on every TP rank, else discarded), so it serves
        one complete version, verifies and records it, then raises."""
        noticed = time.time()
        pulling = self.pulling
        cause, why = self.settle_pull()
        if cause is None:
            cause = (f"another TP rank's pull of version {pulling} failed" if not b.all_ok else
                     f"the demo is stopping ({self.dstore.get('abort').decode()})" if b.aborted else
                     "another TP rank saw the demo stop")
        what = "refit stopped" if pulling is None else f"refit of version {pulling} stopped"
        self.fail_group(what, cause, noticed, why)

    def follow_trainers(self, epoch: int) -> int:
        """--restart: the trainers failed (a pull says so, or the driver already started new ones).
        Settle the pull together (:meth:`settle_pull`), keep serving, and join the new epoch once its trainers are up;
        this process and its weights live on. Returns the newest version to pull."""
        inf = self.inf
        self.settle_pull()
        self.orphaned = True
        if epoch > inf.epoch:
            inf.rejoin(epoch=epoch)
            self.orphaned = False
            return inf.available_version()
        return inf.version

    def refit_shadow(self, latest: int, all_done: bool) -> tuple[float, float] | None:
        """Swaps in a pull every rank finished, then starts pulling ``latest`` in the background.
        Returns (stall seconds, install time) if a version was swapped in."""
        inf, refit = self.inf, None
        if self.pulling is not None and all_done:
            t = time.perf_counter()
            serving = inf.swap()
            refit = (time.perf_counter() - t, time.time())
            if serving != self.pulling:
                raise RuntimeError(f"rank {self.rank}: swapped in version {serving}, expected {self.pulling}")
            self.pulling = None
        if self.pulling is None and latest > inf.version:
            if self.leader and fault_at(self.rc, "kill-inference", inf.version + 1):
                kill_self(self.dstore, self.rank, self.rc)
            started = inf.start_pull()
            if started != inf.version + 1:
                # The fence keeps the trainers at most one version ahead of the slowest pull, so
                # every TP rank starts on the same version.
                raise RuntimeError(f"rank {self.rank}: start_pull() returned {started}, expected "
                                   f"{inf.version + 1}")
            self.pulling = started
            if self.leader:
                self.dstore.set(f"pull_started/{started}", "1")
        return refit

    def refit_inplace(self, latest: int) -> tuple[float, float]:
        """Pulls into the serving weights while generation waits; every rank's pull must succeed
        (decided together), else the group stops. Returns (stall seconds, install time)."""
        inf = self.inf
        if self.leader and fault_at(self.rc, "kill-inference", inf.version + 1):
            kill_self(self.dstore, self.rank, self.rc)
        if self.leader:
            self.dstore.set(f"pull_started/{inf.version + 1}", "1")
        t = time.perf_counter()
        cause = None
        try:
            inf.pull()
        except Exception as e:  # noqa: BLE001 -- torn: inf.consistent is False now; decided together below
            cause = e
        refit = (time.perf_counter() - t, time.time())
        ok = self.comm.all_reduce_min(torch.tensor([int(cause is None)], dtype=torch.int64), IGROUP)
        if not int(ok):
            self.fail_group(f"in-place refit of version {latest} failed", cause or "another TP rank's pull failed",
                            time.time(), f"the in-place pull of version {latest} failed: the serving tensors "
                            f"may be torn (consistent is False where its copy had started)")
        return refit

    def record_refit(self, stall: float, installed_at: float) -> None:
        """Every TP rank after installing a version: the slowest rank decides both the refit time
        and the stall; the verification gather and probe are not counted in either."""
        inf = self.inf
        self.refits += 1
        pull_s, stall_t = self.comm.all_reduce_max(
            torch.tensor([inf.last_pull.total_ms / 1e3, stall], dtype=torch.float64), IGROUP).tolist()
        tp_diff = self.verify()
        if self.leader:
            self.max_stall = max(self.max_stall, stall_t)
            self.dstore.set(f"refit/{self.refits}", json.dumps({
                "version": inf.version, "pull_ms": 1e3 * pull_s, "stall_ms": 1e3 * stall_t,
                "tp_max_abs_diff": tp_diff, "epoch": inf.epoch, "time": installed_at}))
            self.dstore.add("refits_done", 1)

    def rollout(self) -> None:
        """One batch of trajectories on the serving weights (re-read: ``swap()`` replaces the dict);
        the leader puts it in the store as ``traj/<batch>``."""
        cfg, rc, device = self.cfg, self.rc, self.device
        w = self.inf.tensors
        version = self.inf.version
        n_rows = rc.prompts * rc.group
        prompts = torch.randint(0, cfg.vocab, (rc.prompts, cfg.length), generator=self.gen)
        prompts = prompts.repeat_interleave(rc.group, 0).to(device)
        actions = torch.empty_like(prompts)
        prev = torch.full((n_rows,), cfg.bos, dtype=torch.int64, device=device)
        with torch.no_grad():
            for t in range(cfg.length):
                pos = torch.full((n_rows,), t, dtype=torch.int64, device=device)
                logits = tp_forward(w, prompts[:, t], prev, pos, IGROUP, self.comm)
                # Sample on one rank and broadcast: TP ranks must continue the same sequences.
                a = torch.multinomial(torch.softmax(logits.float().cpu(), -1), 1,
                                      generator=self.sample_gen).squeeze(1)
                a = self.comm.broadcast(a.to(device), 0, IGROUP)  # TP rank 0 of the inference group
                actions[:, t] = a
                prev = a
        if self.leader:
            r = reward(cfg, prompts, actions)
            self.dstore.set(f"traj/{self.batch_id}", pickle.dumps({
                "version": version, "prompts": prompts.cpu().to(torch.int8).numpy(),
                "actions": actions.cpu().to(torch.int8).numpy(), "rewards": r.cpu().numpy()}))
        self.batch_id += 1

    # -- verification and the end -----------------------------------------------------------------
    def verify(self) -> float:
        return verify_served(self.rank, self.cfg, self.inf, self.dst_layouts, IGROUP, self.comm, self.leader,
                             self.checks)

    def finish(self) -> None:
        """After the final version: wait for the last probes, record the summary and this pid."""
        inf, checks = self.inf, self.checks
        if self.leader:
            checks.check(self.dstore, block=True, timeout=self.rc.timeout)
            if checks.bad:
                print(f"rank {self.rank}: probe mismatch for versions {checks.bad}", file=sys.stderr)
        ours = torch.tensor([int(inf.stats.bytes_per_refit), int(inf.stats.staging_bytes)], dtype=torch.int64)
        total, staging = self.comm.all_reduce(ours, IGROUP).tolist()
        if self.leader:
            self.dstore.set("inference_summary", json.dumps({
                "refits": self.refits, "verified": not checks.bad and len(checks.verified) == self.refits + 1,
                "verified_versions": len(checks.verified), "bad_versions": checks.bad,
                "max_stall_ms": 1e3 * self.max_stall, "bytes_per_refit": int(total) or self.plan_bytes,
                "plan_bytes": self.plan_bytes, "staging_bytes": int(staging), "final_version": inf.version,
                "batches": self.batch_id}))
        self.dstore.set(f"pid/{self.rank}", json.dumps({"start": self.pid, "end": os.getpid()}))

    def close(self) -> None:
        """Runs whatever happened (a peer died, the group stopped): record what this rank serves,
        close the endpoint, and let the trainers free their arena once every rank is closed."""
        self.dstore.set(f"inference_state/{self.rank}",
                        json.dumps({"version": self.inf.version, "consistent": self.inf.consistent}))
        self.inf.close()
        if self.dstore.add("inference_closed_count", 1) == len(self.rc.inference_ranks):
            self.dstore.set("inference_closed", "1")

    # -- failures -------------------------------------------------------------------------------
    def settle_pull(self) -> tuple[BaseException | None, str]:
        """Every TP rank together, after the group decided to stop or to follow new trainers: the
        fault contract (docs/guarantees.md). Each rank waits for its pull in flight to end (its
        waits are bounded); if every TP rank's pull succeeded, the version is complete (every byte
        copied while every source was alive and still at that version, then acked) and is swapped
        in, verified and recorded like any refit; if any failed, every rank discards it. Returns
        (this rank's pull error or None, why the group serves what it serves)."""
        inf, version = self.inf, self.pulling
        if version is None:
            return None, (f"no pull was in flight: version {inf.version}, installed after every TP rank's pull "
                          f"of it completed, is the last complete one")
        poll_until(inf.pull_done, timeout=2 * self.rc.timeout, what=f"the pull of version {version} to end")
        cause = inf.pull_error()
        mine = torch.zeros(self.rc.inference, dtype=torch.int64)
        mine[self.rank - self.rc.trainers] = int(cause is not None)
        failed = [i for i, f in enumerate(self.comm.all_reduce(mine, IGROUP).tolist()) if f]
        if failed:
            inf.discard()
            self.pulling = None
            err = "" if cause is None else f" (here: {type(cause).__name__})"
            return cause, (f"the pull of version {version} failed on TP rank(s) {failed}{err}: torn or "
                           f"unvouched, discarded on every TP rank; version {inf.version}, the last complete "
                           f"one, is served")
        t = time.perf_counter()
        inf.swap()
        stall = time.perf_counter() - t
        self.pulling = None
        self.record_refit(stall, time.time())
        return None, (f"every TP rank's pull of version {version} completed (copied while every source "
                      f"was alive and at version {version}, then acked): complete, so installed and served")

    def fail_group(self, what: str, cause, noticed: float, why: str) -> None:
        """Every TP rank, together, after the group decided to stop: check what the group serves
        (all ranks on one version, none torn, and the gathered weights' digest equal to the digest
        the trainers published for that version), record it as ``inference_final``, then raise."""
        inf, comm, dstore = self.inf, self.comm, self.dstore
        vmin, neg_vmax, cons = comm.all_reduce_min(
            torch.tensor([inf.version, -inf.version, int(inf.consistent)], dtype=torch.int64), IGROUP).tolist()
        ours = torch.tensor([int(inf.stats.bytes_per_refit), int(inf.stats.staging_bytes)], dtype=torch.int64)
        total, staging = comm.all_reduce(ours, IGROUP).tolist()
        full = gather_full(self.dst_layouts, inf.tensors, self.rank, IGROUP, comm)
        same = vmin == -neg_vmax
        if self.leader:
            sha = weights_digest(full)
            key = f"probe/{vmin}"  # the trainers published it before they published vmin
            ref = pickle.loads(dstore.get(key))["weights_sha1"] if dstore.check([key]) else None
            dstore.set("inference_final", json.dumps({
                "version": vmin if same else None,
                "consistent": None if ref is None else bool(cons and same and sha == ref),
                "weights_sha1": sha, "expected_sha1": ref, "refits": self.refits, "why": why,
                "bytes_per_refit": int(total) or self.plan_bytes, "staging_bytes": int(staging)}))
        if not isinstance(cause, str):
            cause = str(cause).splitlines()[0] if str(cause) else type(cause).__name__
        raise InferenceGroupStopped(f"{what}: {cause}; the inference group serves version "
                                    f"{vmin if same else (vmin, -neg_vmax)}", noticed)
