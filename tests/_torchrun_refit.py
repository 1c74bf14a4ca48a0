"""The refit script tests/test_torchrun_hosts.py runs under ``torchrun --nnodes 2 --nproc-per-node 2``
on two hosts of the host harness: the script of docs/hosts.md ("Under torchrun with several nodes"),
nothing in it about hosts. The endpoints leave ``store`` (and rank, world size) out: they meet in
the job's store, which node 0's torchrun agent hosts. Global ranks 0-1 train (row shards), 2-3
serve (column shards of ``w``, replicas of ``b``); every version's values encode (element, version,
tensor), and each inference rank compares what it serves with them bit for bit.

Each rank writes one JSON line to ``<out>/<rank>.json`` (``out``: argv[1], a directory both hosts
see): its hostname, its node's ``GROUP_RANK``, and on an inference rank what it served (exact or
not, per version) and ``ep.stats.cross_host_bytes`` per version.
"""
import json
import os
import socket
import sys

import torch
from _provenance import provenance

import tritonreshard as trs
from tritonreshard import Layout, Replicate, Shard

VERSIONS = 3
SRC = {"w": Layout((16, 12), [0, 1], [Shard(0)]), "b": Layout((12,), [0, 1], [Replicate()])}
DST = {"w": Layout((16, 12), [2, 3], [Shard(1)]), "b": Layout((12,), [2, 3], [Replicate()])}
TAGS = {"w": 0, "b": 1}


def full(name: str, v: int) -> torch.Tensor:
    """Tensor ``name`` at version ``v``: element i encodes (i, v, name), exact in float32."""
    return provenance(SRC[name].shape, v, TAGS[name], versions=VERSIONS + 1, tags=len(TAGS)).float()


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


def main(out_dir: str) -> None:
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    report = {"rank": rank, "host": socket.gethostname(), "group_rank": int(os.environ["GROUP_RANK"])}
    timeouts = trs.Timeouts(wait=60)
    if rank in SRC["w"].ranks:
        shards = {n: lay.shard(full(n, 1), rank) for n, lay in SRC.items()}
        with trs.RefitTrainer(shards, SRC, timeouts=timeouts) as tr:   # rank, world, store: the job's
            for v in range(1, VERSIONS + 1):
                tr.fence()
                for n, t in tr.source_tensors.items():
                    t.copy_(SRC[n].shard(full(n, v), rank))
                assert tr.publish() == v
            tr.fence()
    else:
        served, cross = [], []
        with trs.RefitInference(DST, timeouts=timeouts) as ep:
            for v in range(1, VERSIONS + 1):
                assert ep.pull() == v
                served.append({n: bool(torch.equal(_bits(t), _bits(DST[n].shard(full(n, v), rank))))
                               for n, t in ep.tensors.items()})
                cross.append(ep.stats.cross_host_bytes)
        report.update(served=served, cross_host_bytes=cross)
    with open(os.path.join(out_dir, f"{rank}.json"), "w") as f:
        f.write(json.dumps(report) + "\n")


if __name__ == "__main__":
    main(sys.argv[1])
