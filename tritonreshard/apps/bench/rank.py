"""One rank of the bench: its set-up (:class:`Rank`: process group, endpoint, baselines, provenance
bits) and the command loop it serves (:func:`rank_main`, what the shared driver spawns).

Commands come from the driver's store as ``cmd/<n>`` (``{"op": "refit", "method", "count",
"verify"?, "stats"?}`` or ``{"op": "stop"}``); rank 0 answers each under ``res/<n>``.

Timing of one refit (:meth:`Rank.refit`): trainers write the next version's weights (untimed), every
rank meets in a gloo barrier, reads ``time.monotonic()`` (one clock for every process of the
machine), runs the method and reads the clock again; the refit's time is max(end) - min(start)
over all ranks.
"""
from __future__ import annotations

import datetime
import json
import os
import socket
import sys
import time

import torch
import torch.distributed as dist

from tritonreshard import DestinationData, Meeting, PullOptions, RefitEndpoint, SourceData, Timeouts
from tritonreshard.engine.crosshost import LINK_GBPS_ENV
from tritonreshard.transport import codec_for

from ..driver import wait_key
from .baselines import P2P, GatherBroadcast, bcast_set, gather_set
from .config import BenchConfig
from .model import build_model, layouts
from .provenance import check_bits, fill_bits, key16
from .updates import AdamShard, expected_shard

__all__ = ["Rank", "rank_main"]


class Rank:
    """This process's side of every method, set up once: the process group (gloo, or NCCL with one
    GPU per rank), the engine's endpoint, both baselines with destination buffers of their own, and
    the provenance bits of this rank's shards."""

    def __init__(self, rank: int, cfg: BenchConfig, store):
        self.rank, self.cfg = rank, cfg
        host = cfg.host_of(rank)
        if cfg.net == "namespaces":
            # A host of the harness: the engine's host identity is the hostname, as on real nodes,
            # and the link's rate is the harness's token bucket, not a sleep of the engine's.
            if socket.gethostname() != host:
                raise RuntimeError(f"rank {rank} should run on {host}, but its hostname is {socket.gethostname()!r}")
        else:
            if host is not None:  # the engine reads it when the endpoint joins its group
                os.environ["TRITONRESHARD_HOST"] = host
            if cfg.link_gbps is not None:  # read when the endpoint opens its cross-host link
                os.environ[LINK_GBPS_ENV] = repr(float(cfg.link_gbps))
        timeout = datetime.timedelta(seconds=cfg.timeout)
        if cfg.device == "cuda":
            self.device = torch.device("cuda", rank % torch.cuda.device_count())
            torch.cuda.set_device(self.device)
            nccl = torch.cuda.device_count() >= cfg.world_size
        else:
            self.device, nccl = torch.device("cpu"), False
        dist.init_process_group("cpu:gloo,cuda:nccl" if nccl else "gloo", store=dist.PrefixStore("pg", store),
                                rank=rank, world_size=cfg.world_size, timeout=timeout)
        self.cpu_group = dist.new_group(backend="gloo") if nccl else None
        # CUDA tensors without one GPU per rank go through the CPU (gloo): NCCL needs distinct GPUs.
        self.comm_device = self.device if (nccl or cfg.device == "cpu") else torch.device("cpu")
        self.transport = "nccl" if nccl else ("gloo" if cfg.device == "cpu" else "gloo (CPU-staged)")

        self.model = build_model(cfg)
        self.src_layouts, self.dst_layouts = layouts(cfg, self.model)
        self.is_src = rank in cfg.trainer_ranks
        self.is_dst = rank in cfg.inference_ranks
        self.methods = cfg.worker_methods
        # Every rank creates every subgroup, in the same order (new_group is collective).
        groups = {}
        if "gather_broadcast" in self.methods:
            for t in self.model:
                s, d = self.src_layouts[t.name], self.dst_layouts[t.name]
                for ranks in (gather_set(s), bcast_set(s, d)):
                    if len(ranks) > 1 and ranks not in groups:
                        groups[ranks] = dist.new_group(list(ranks))

        # The trainers' version-0 bits go straight into the arena (the endpoint copies them in
        # once); from then on each refit moves the arena to the next version in place.
        initial = None
        self.adam = {}   # --update-lr: each shard's master weights and update signs
        if self.is_src:
            initial = {}
            for t in self.model:
                lay = self.src_layouts[t.name]
                if rank not in lay.ranks:  # megatron-tp-pp: another pipeline stage's tensor
                    continue
                initial[t.name] = torch.empty(lay.local_shape(rank), dtype=torch.bfloat16, device=self.device)
                if cfg.update_lr is not None:
                    self.adam[t.name] = AdamShard(lay, rank, t.name, cfg.update_lr, self.device)
                    self.adam[t.name].write(initial[t.name], 0)
                else:
                    fill_bits(initial[t.name], lay, rank, t.name)
        self.ep = RefitEndpoint(Meeting(rank=rank, world_size=cfg.world_size, store=dist.PrefixStore("refit", store)),
                                source=SourceData(initial, self.src_layouts) if self.is_src else None,
                                destination=DestinationData(self.dst_layouts) if self.is_dst else None,
                                pull=PullOptions(mode=cfg.mode, device=self.device, backend=cfg.backend),
                                timeouts=Timeouts(wait=cfg.timeout), codec=codec_for(cfg.delta))
        del initial
        self.plan = self.ep.plan  # the same plan every rank derived (no second planning pass)
        self.src = self.ep.source_tensors if self.is_src else {}
        # Each baseline writes its own destination set (allocated and faulted in now), so every
        # method's result can be verified after the interleaved rounds.
        self.bufs = {m: {t.name: torch.zeros(self.dst_layouts[t.name].local_shape(rank), dtype=torch.bfloat16,
                                             device=self.device) for t in self.model} if self.is_dst else {}
                     for m in ("p2p", "gather_broadcast") if m in self.methods}
        self.p2p = P2P(self.plan, rank, self.src, self.bufs["p2p"], self.comm_device) \
            if "p2p" in self.methods else None
        self.gb = GatherBroadcast(self.model, self.src_layouts, self.dst_layouts, rank, self.src,
                                  self.bufs["gather_broadcast"], groups, self.comm_device) \
            if "gather_broadcast" in self.methods else None
        self.version = 0
        self.last = {}
        self.last_pull_max = self.last_coordination = 0.0

    def _barrier(self):
        dist.barrier(group=self.cpu_group)

    def _sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def refit(self, method: str) -> float:
        """One timed refit by ``method`` (collective: every rank calls it). Returns seconds."""
        if method not in self.methods:
            raise ValueError(f"method {method!r} was not set up (BenchConfig.methods={self.cfg.methods})")
        self.version += 1
        # The arena holds version - 1 (only this rank writes it): XOR moves every element to version.
        delta = key16(self.version - 1) ^ key16(self.version)
        if self.is_src:
            if self.ep.published:
                self.ep.fence()  # readers of the previous version are done with the arena
            for name in self.src:
                if self.adam:
                    self.adam[name].write(self.src[name], self.version)
                else:
                    self.src[name].view(torch.int16).bitwise_xor_(delta)
        self._sync()
        self._barrier()
        t0 = time.monotonic()
        if method == "tritonreshard":
            if self.is_src:
                self.ep.publish()
            if self.is_dst:
                self.ep.pull()
        elif method == "p2p":
            self.p2p.step()
        elif method == "gather_broadcast":
            self.gb.step()
        else:
            raise ValueError(f"unknown method {method!r}")
        self._sync()
        t1 = time.monotonic()
        ours = method == "tritonreshard" and self.is_dst
        # The engine's own split of this rank's pull: the descriptor-table copy (device sync
        # included) and the pull as a whole (start to ack).
        copy = self.ep.last_pull.copy_ms / 1e3 if ours else 0.0
        pull = self.ep.last_pull.total_ms / 1e3 if ours else 0.0
        times = [torch.zeros(4, dtype=torch.float64) for _ in range(self.cfg.world_size)]
        dist.all_gather(times, torch.tensor([t0, t1, pull, copy], dtype=torch.float64), group=self.cpu_group)
        self.last[method] = self.version
        self.last_pull_max = max(float(t[2]) for t in times)
        seconds = max(float(t[1]) for t in times) - min(float(t[0]) for t in times)
        # Coordination: what the refit took beyond its slowest copy (publishing, waking the
        # readers, the post-copy checks, the acks). Only the engine's refit has it.
        self.last_coordination = seconds - max(float(t[3]) for t in times) if method == "tritonreshard" else 0.0
        return seconds

    def verify(self, methods) -> dict[str, bool]:
        """For each of ``methods``: every element of this rank's destination shards equals the last
        refit of that method, bit for bit (one pass of the hash serves every method)."""
        if not self.is_dst:
            return {m: True for m in methods}
        if self.cfg.update_lr is not None:   # the engine alone (BenchConfig.problems)
            good = "tritonreshard" in self.last and all(
                torch.equal(self.ep.tensors[t.name].cpu().view(torch.int16),
                            expected_shard(self.dst_layouts[t.name], self.rank, t.name, self.cfg.update_lr,
                                           self.last["tritonreshard"]).view(torch.int16))
                for t in self.model)
            return {m: good for m in methods}
        ok = {m: m in self.last for m in methods}
        checked = [m for m in methods if ok[m]]
        sets = {m: self.ep.tensors if m == "tritonreshard" else self.bufs[m] for m in checked}
        keys = [key16(self.last[m]) for m in checked]
        for t in self.model:
            res = check_bits([sets[m][t.name] for m in checked], keys, self.dst_layouts[t.name], self.rank, t.name)
            for m, good in zip(checked, res, strict=True):
                ok[m] = ok[m] and good
        return ok

    def stats(self) -> dict:
        """Measured after refits: the most extra memory one of this rank's pulls allocated."""
        s = self.ep.stats
        return {"rank": self.rank, "staging_bytes": int(s.staging_bytes),
                "cross_host_bytes": int(s.cross_host_bytes), "egress_bytes": self._egress(),
                "delta_bytes": int(s.cross_host_delta_bytes), "dense_bytes": int(s.cross_host_dense_bytes),
                "changed": s.cross_host_changed, "encode_s": float(s.cross_host_encode_s)}

    def _egress(self) -> int:
        """Source bytes this trainer serves per refit, as its route moves them: read from its arena
        by ranks of its host, plus what it sends to other hosts (once per host, not per reader)."""
        if not self.is_src:
            return 0
        route, src = self.ep.route, self.src_layouts
        local = (route.host_plan.local_ops if route.spans_hosts else self.plan.ops_for_src(self.rank))
        read = sum(op.numel * src[op.src_name].itemsize for op in local
                   if op.src_rank == self.rank and op.dst_rank != self.rank)
        return int(read + sum(t.nbytes for t in route.sends))

    def info(self) -> dict:
        return {"rank": self.rank,
                "descriptors": int(self.ep.stats.num_descriptors) if self.is_dst else 0,
                "handles_opened": int(self.ep.stats.handles_opened),
                "plan_ops_dst": len(self.plan.ops_for_dst(self.rank)),
                "bytes_per_refit": int(self.ep.stats.bytes_per_refit) if self.is_dst else 0,
                "backend": self.ep.backend.name, "transport": self.transport}

    def close(self):
        self.ep.close()


def rank_main(rank: int, store, bstore, cfg: BenchConfig) -> None:
    """Every spawned rank (run by the shared driver, which records a failure under ``error/<rank>``):
    set up, then serve commands from the store."""
    r = Rank(rank, cfg, store)
    try:
        infos = [None] * cfg.world_size
        dist.all_gather_object(infos, r.info(), group=r.cpu_group)
        if rank == 0:
            bstore.set("info", json.dumps(infos))
        bstore.add("ready", 1)
        n = 0
        while True:
            key = f"cmd/{n}"
            wait_key(bstore, key, cfg.timeout)
            cmd = json.loads(bstore.get(key))
            if cmd["op"] == "stop":
                break
            result = _refits(r, cmd, bstore)
            if rank == 0:
                bstore.set(f"res/{n}", json.dumps(result))
            n += 1
        r.close()
        dist.barrier(group=r.cpu_group)
        dist.destroy_process_group()
    except BaseException:
        r.ep.close(abort=True)  # peers waiting on this rank's endpoint stop at once; the error goes on
        raise
    # Done, and everything closed (endpoint, process groups; the engine's segments are memfds): exit
    # now. The interpreter's teardown with torch loaded takes 2 s or more per process on a busy
    # 2-core machine and releases nothing the kernel does not, and a session's close waits for it.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _refits(r: Rank, cmd: dict, bstore) -> dict:
    """One ``refit`` command, on every rank (collective): ``count`` timed refits, then the
    verification and the engine's statistics if asked for. Rank 0 counts progress."""
    world = r.cfg.world_size
    secs, pulls, coords, each = [], [], [], []
    for _ in range(cmd["count"]):
        secs.append(r.refit(cmd["method"]))
        pulls.append(r.last_pull_max)
        coords.append(r.last_coordination)
        if cmd.get("each_stats"):   # untimed: after the refit's clock stopped
            stats = [None] * world
            dist.all_gather_object(stats, r.stats(), group=r.cpu_group)
            each.append(stats)
        if r.rank == 0:
            bstore.add("progress", 1)
    result = {"seconds": secs, "pull_seconds_max": pulls, "coordination_seconds": coords, "each_stats": each}
    if cmd.get("verify"):
        methods = cmd.get("verify_methods") or [cmd["method"]]
        oks = [None] * world
        dist.all_gather_object(oks, r.verify(methods), group=r.cpu_group)
        result["verified_methods"] = {m: all(ok[m] for ok in oks) for m in methods}
        result["verified"] = all(result["verified_methods"].values())
        result["verified_ranks"] = [i for i, ok in enumerate(oks) if not all(ok.values())]
    if cmd.get("stats"):
        stats = [None] * world
        dist.all_gather_object(stats, r.stats(), group=r.cpu_group)
        result["stats"] = stats
    return result
