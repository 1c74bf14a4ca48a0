"""Partitions survived: the link between the trainers' host and the inference host is cut in the
middle of a refit, and restored; nobody restarts.

Two hosts of the host harness (:mod:`tritonreshard.apps.hosts`): trainers 0-1 on ``host0`` (rank 0
hosts the group's store, as torchrun's agent would on node 0), inference ranks 2-3 on ``host1``, one
bf16 weight split by rows, replicated on the inference side, over a link rated at ``link_gbps``
(so a transfer lasts long enough to be cut in its middle). Each round is one epoch:

* ``"transfer"``: whole transfers (``trs.Dense()``); the link is cut once the inference ranks
  served the round's second version, while the next one crosses;
* ``"delta"``: every transfer after an epoch's first a delta (``trs.Delta(force=True)``; every
  element changes each version, so a delta is as long as a whole transfer); cut the same way, while
  the round's third version crosses as a delta. A run's rounds are all ``"delta"`` or none: an
  inference endpoint keeps its codec across rejoins;
* ``"fence"``: whole transfers; once the inference ranks served the round's second version, the
  link is cut as soon as the trainers entered their next ``fence()`` (its sends in flight).

Every rank must fail within ``peer_timeout`` (plus a look) with one error naming the host it cannot
reach and that host's ranks; the inference ranks keep serving their last complete version (its digest
checked); nothing is left in either host's /dev/shm. Then the link is restored and the round's next
epoch forms in the same processes: the trainers open a new ``RefitTrainer(meeting=Meeting(epoch=k +
1), start_version=)`` from the newest version any of them published, the inference ranks
``rejoin()``. Its first transfer is whole (no delta starts from a base the receiver may lack); a
delta round's second is a delta again. The figures (time to the error, time to the next good
refit) are measured per round.

``python -m tritonreshard.apps.bench.partitions --rounds transfer,fence --repeats 2`` (or ``--rounds
delta,delta``) prints them; tests/test_partitions.py runs each case twice.
"""
from __future__ import annotations

import argparse
import datetime
import faulthandler
import hashlib
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

import tritonreshard as trs
from tritonreshard import Layout, Replicate, Shard

from ..hosts import Hosts
from ..kit import free_port

__all__ = ["PartitionConfig", "run_partitions", "CASES", "main"]

CASES = ("transfer", "delta", "fence")
TRAINERS, INFERENCE = (0, 1), (2, 3)
_SECRET = "7c" * 32


@dataclass(frozen=True)
class PartitionConfig:
    """``rounds``: the cases, in order (each one epoch, ended by a cut and a restore); ``shape``:
    the bf16 weight; ``link_gbps``: the link's rate; ``peer_timeout`` / ``wait_timeout``: the
    endpoints' ``trs.Timeouts``; ``timeout``: the whole run's hard limit."""
    rounds: tuple = ("transfer", "fence")
    shape: tuple = (2048, 1024)
    link_gbps: float = 0.1
    peer_timeout: float = 3.0
    wait_timeout: float = 60.0
    timeout: float = 400.0

    def __post_init__(self):
        problems = [f"rounds has {r!r}, not one of {CASES}" for r in self.rounds if r not in CASES]
        if not self.rounds:
            problems.append("rounds is empty")
        if "delta" in self.rounds and set(self.rounds) != {"delta"}:
            problems.append(f"rounds={self.rounds}: all 'delta' or none (an inference endpoint keeps its codec "
                            f"across rejoins, and every rank of an epoch must pass the same)")
        if not (self.link_gbps > 0):
            problems.append(f"link_gbps={self.link_gbps!r} must be > 0")
        if not (0 < self.peer_timeout < self.wait_timeout):
            problems.append(f"peer_timeout={self.peer_timeout!r} must be > 0 and < wait_timeout={self.wait_timeout!r}")
        if problems:
            raise ValueError("PartitionConfig: " + "; ".join(problems))


def _weight(shape, v: int) -> torch.Tensor:
    """Version ``v`` of the weight: fixed random finite bf16 bits plus ``v``, so every element
    changes every version (a forced delta carries all of them) and every version differs."""
    g = torch.Generator().manual_seed(7)
    bits = torch.randint(0x0100, 0x3E00, shape, generator=g, dtype=torch.int16) + v
    return bits.view(torch.bfloat16)


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()[:16]


def _wait_file(path: str, timeout: float, stop=None) -> None:
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"partitions: {path} did not appear within {timeout:g} s")
        if stop is not None and stop.is_set():
            raise RuntimeError(f"partitions: stopped while waiting for {path} (a rank failed)")
        time.sleep(0.02)


def _mark(mark: str, name: str) -> None:
    open(os.path.join(mark, name), "w").close()


def _agree(mark: str, k: int) -> int:
    """The version the trainers go on from after round ``k``: the newest any of them published. A
    trainer's publish does not wait for its sends, so a cut can leave one trainer a version ahead
    of the other; an epoch whose trainers start from different versions is refused at hello. A real
    trainer group agrees the same way (an all-reduce of the step over its own process group)."""
    versions = []
    for t in TRAINERS:
        with open(os.path.join(mark, f"version.{k}.{t}")) as f:
            versions.append(int(f.read()))
    return max(versions)


def _rank(rank: int, addr: str, port: int, cfg: PartitionConfig, mark: str) -> dict:
    """One rank of the scenario (see the module docstring). The test process talks to the ranks
    only through files in ``mark`` (a directory every host sees; not the network under test)."""
    faulthandler.enable()  # a native abort (a gloo thread) shows where it came from
    torch.set_num_threads(1)
    src = {"w": Layout(cfg.shape, TRAINERS, [Shard(0)], torch.bfloat16)}
    dst = {"w": Layout(cfg.shape, INFERENCE, [Replicate()], torch.bfloat16)}
    timeouts = trs.Timeouts(wait=cfg.wait_timeout, peer=cfg.peer_timeout)
    # Rank 0 hosts the store for the whole run: every epoch meets on it.
    store = dist.TCPStore(addr, port, 4, True, timeout=datetime.timedelta(seconds=cfg.wait_timeout),
                          wait_for_workers=False) if rank == 0 else f"{addr}:{port}"
    rounds = [*cfg.rounds, "last"]
    report = {"rounds": []}
    ep = None
    version = 0  # trainers: the last version published; inference ranks: the version served
    codec = trs.Delta(force=True) if "delta" in cfg.rounds else trs.Dense()
    for k, case in enumerate(rounds):
        meeting = trs.Meeting(rank=rank, world_size=4, store=store, host_store=None if rank == 0 else False,
                              epoch=k)
        r = {"case": case, "epoch": k, "error": None}
        if rank in TRAINERS:
            if k:  # they go on together from the newest version any of them published (see _agree)
                version = _agree(mark, k - 1)
            tr = trs.RefitTrainer({"w": src["w"].shard(_weight(cfg.shape, version), rank)}, src, meeting,
                                  start_version=version, codec=codec, timeouts=timeouts)
            try:
                for n in range(2 if case == "last" else 10_000):
                    if case == "fence":  # the driver cuts inside one of these fences
                        _mark(mark, f"fence.{k}.{rank}.{n}")
                    r["call"] = "fence"
                    tr.fence()
                    tr.tensors["w"].copy_(src["w"].shard(_weight(cfg.shape, tr.published + 1), rank))
                    r["call"] = "publish"
                    version = tr.publish()
                    r.setdefault("first", version)
                r["call"] = "fence"
                tr.fence()
            except (trs.PeerDiedError, trs.RefitError, TimeoutError) as exc:
                r["error"] = (type(exc).__name__, str(exc), time.time())
            r["shm"] = sorted(os.listdir("/dev/shm"))
            tr.close()
            with open(os.path.join(mark, f"version.{k}.{rank}"), "w") as f:
                f.write(str(version))
        else:
            if ep is None:
                ep = trs.RefitInference(dst, meeting, codec=codec, timeouts=timeouts)
            else:
                r["rejoin_at"] = time.time()
                assert ep.rejoin(k) == k
            r["transfers"] = []
            try:
                for _ in range(2 if case == "last" else 10_000):
                    v = ep.pull()
                    if _digest(ep.tensors["w"]) != _digest(_weight(cfg.shape, v)):
                        raise AssertionError(f"rank {rank}: version {v} is not the trainers' version {v}")
                    s = ep.stats
                    r["transfers"].append((v, s.cross_host_dense_bytes, s.cross_host_delta_bytes, time.time()))
                    _mark(mark, f"served.{k}.{rank}.{len(r['transfers'])}")
            # Any refit error is recorded (the test requires a PeerDiedError naming the host), so that
            # this rank still reports what it serves and the link is restored for the others.
            except (trs.PeerDiedError, trs.RefitError, TimeoutError) as exc:
                r["error"] = (type(exc).__name__, str(exc), time.time())
            # Whatever happened, what it serves is a complete version, bit for bit.
            r["served"] = (ep.version, _digest(ep.tensors["w"]) == _digest(_weight(cfg.shape, ep.version)))
            r["shm"] = sorted(os.listdir("/dev/shm"))
            version = ep.version
        report["rounds"].append(r)
        if case != "last":
            _mark(mark, f"failed.{k}.{rank}")
            _wait_file(os.path.join(mark, f"restored.{k}"), cfg.timeout)
    if ep is not None:
        ep.close()
    report["shm_at_end"] = sorted(os.listdir("/dev/shm"))
    if rank == 0:  # the store's host outlives everyone's use of it
        for other in range(1, 4):
            _wait_file(os.path.join(mark, f"done.{other}"), cfg.timeout)
    else:
        _mark(mark, f"done.{rank}")
    return report


def _driver(cfg: PartitionConfig, mark: str):
    def during(hosts, stop) -> list[dict]:
        """Cut and restore the link once per round, when the round's moment comes."""
        out = []
        for k, case in enumerate(cfg.rounds):
            for r in INFERENCE:  # versions flow: the inference ranks served two of this round
                _wait_file(os.path.join(mark, f"served.{k}.{r}.2"), cfg.timeout, stop)
            if case == "fence":  # then the trainers' next fences: cut inside them
                entered = {r: max(int(f.rsplit(".", 1)[1]) for f in os.listdir(mark) if f.startswith(f"fence.{k}.{r}."))
                           for r in TRAINERS}
                for r in TRAINERS:
                    _wait_file(os.path.join(mark, f"fence.{k}.{r}.{entered[r] + 1}"), cfg.timeout, stop)
            cut = time.time()
            hosts.cut(1)
            for r in (*TRAINERS, *INFERENCE):
                _wait_file(os.path.join(mark, f"failed.{k}.{r}"), cfg.wait_timeout + 30, stop)
            failed = time.time()
            shm = (hosts.shm_files(0), hosts.shm_files(1))
            hosts.restore(1)
            restored = time.time()
            _mark(mark, f"restored.{k}")
            out.append({"case": case, "cut": cut, "all_failed": failed, "restored": restored, "shm": shm})
        return out
    return during


def run_partitions(cfg: PartitionConfig = PartitionConfig()) -> dict:
    """Run the scenario on a fresh pair of hosts; returns ``{"ranks": {rank: report}, "cuts": [...],
    "shm_after": (host0's, host1's)}``. Needs what :class:`~tritonreshard.apps.hosts.Hosts` needs."""
    mark = tempfile.mkdtemp(prefix="trs-partitions-")
    try:
        with Hosts(2, env={"TRITONRESHARD_GROUP_SECRET": _SECRET}) as hosts:
            hosts.rate(1, cfg.link_gbps)
            res = hosts.run_ranks(_rank, [0, 0, 1, 1], args=(hosts.address(0), free_port(), cfg, mark),
                                  timeout=cfg.timeout, during=_driver(cfg, mark))
            cuts = res.pop("during")
            return {"ranks": res, "cuts": cuts, "shm_after": (hosts.shm_files(0), hosts.shm_files(1))}
    finally:
        shutil.rmtree(mark, ignore_errors=True)


def figures(result: dict) -> list[dict]:
    """Per round: what the inference ranks served, the seconds from the cut to each side's error,
    and from the restore to the first good refit of the next epoch (and whether it was whole)."""
    out = []
    ranks = result["ranks"]
    for k, cut in enumerate(result["cuts"]):
        inf = [ranks[r]["rounds"][k] for r in INFERENCE]
        nxt = [ranks[r]["rounds"][k + 1]["transfers"] for r in INFERENCE]
        out.append({
            "case": cut["case"],
            "served": sorted({i["served"][0] for i in inf}),
            "trainer_error_s": max(ranks[r]["rounds"][k]["error"][2] for r in TRAINERS) - cut["cut"],
            "inference_error_s": max(i["error"][2] for i in inf) - cut["cut"],
            "next_refit_s": max(t[0][3] for t in nxt) - cut["restored"],
            "next_whole": all(t[0][2] == 0 for t in nxt) and sum(t[0][1] for t in nxt) > 0,
        })
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tritonreshard.apps.bench.partitions",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", default="transfer,fence", help=f"comma-separated cases from {CASES} "
                    "(all 'delta' or none)")
    ap.add_argument("--repeats", type=int, default=1, help="run the rounds this many times in a row")
    ap.add_argument("--link-gbps", type=float, default=0.1)
    ap.add_argument("--peer-timeout", type=float, default=3.0)
    args = ap.parse_args(argv)
    cfg = PartitionConfig(rounds=tuple(args.rounds.split(",")) * args.repeats, link_gbps=args.link_gbps,
                          peer_timeout=args.peer_timeout)
    result = run_partitions(cfg)
    print(f"{'case':<9} {'served':<8} {'trainers err':>13} {'inference err':>14} {'next refit':>11}  next whole")
    for f in figures(result):
        print(f"{f['case']:<9} {str(f['served']):<8} {f['trainer_error_s']:>12.2f}s {f['inference_error_s']:>13.2f}s "
              f"{f['next_refit_s']:>10.2f}s  {f['next_whole']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
