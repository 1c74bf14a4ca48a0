"""``torchrun --nnodes 2`` across two hosts of the host harness: the run of docs/hosts.md ("Under
torchrun with several nodes"), each node a host with its own network, /dev/shm and hostname.

One ``python -m torch.distributed.run --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d
--rdzv-endpoint 10.77.0.1:PORT tests/_torchrun_refit.py`` per host, the rendezvous (and the job's
store, hosted by host0's agent) on host0, the same group secret in both environments. The script's
endpoints leave the store out and meet in the job's; trainers (global ranks 0-1) row shards,
inference ranks (2-3) column shards and replicas, three versions of provenance values compared bit
for bit by the ranks, who report what they served to a directory both hosts see (under /tmp).
"""
import json
import re
import signal
import subprocess
import sys
from pathlib import Path

import _torchrun_refit as script
import pytest

import tritonreshard as trs
from tritonreshard.planning import plan_hosts

ROOT = Path(__file__).resolve().parents[1]
PORT = 29500
pytestmark = pytest.mark.timeout(240)


def _torchrun(hosts, node: int, out: Path) -> subprocess.Popen:
    argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
            "--node-rank", str(node), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{hosts.address(0)}:{PORT}",
            "--max-restarts", "0", str(ROOT / "tests" / "_torchrun_refit.py"), str(out)]
    log = open(out / f"node{node}.log", "w")
    try:
        return hosts.popen(node, argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    finally:
        log.close()   # the child holds its own copy


def _logs(out: Path) -> str:
    return "".join(f"--- node{i}:\n" + (out / f"node{i}.log").read_text()[-4000:] for i in range(2))


def test_torchrun_two_nodes_on_two_hosts_refits_across_them(two_hosts, tmp_path):
    secret = two_hosts.env["TRITONRESHARD_GROUP_SECRET"]   # every process of both hosts has it
    assert re.fullmatch(r"[0-9a-f]{64}", secret)
    procs = []
    try:
        for i in range(2):
            procs.append(_torchrun(two_hosts, i, tmp_path))
        for p in procs:
            p.wait(timeout=180)
    except subprocess.TimeoutExpired:
        pytest.fail("torchrun did not finish within 180 s\n" + _logs(tmp_path))
    finally:
        for i, p in enumerate(procs):
            if p.poll() is None:   # a failure: SIGTERM (torchrun ends its workers), then the whole host
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    pass
                two_hosts.kill(i)
                p.wait(10)
    assert [p.returncode for p in procs] == [0, 0], _logs(tmp_path)
    reports = {}
    for f in tmp_path.glob("*.json"):
        rep = json.loads(f.read_text())
        reports[rep["rank"]] = rep
    assert sorted(reports) == [0, 1, 2, 3], _logs(tmp_path)
    # Trainers on host0 (torchrun's node 0: the first hostname; the rendezvous's host), inference ranks on host1.
    assert {r: (rep["host"], rep["group_rank"]) for r, rep in reports.items()} == {
        0: ("host0", 0), 1: ("host0", 0), 2: ("host1", 1), 3: ("host1", 1)}
    for r in (2, 3):   # every version, every tensor, bit for bit
        assert reports[r]["served"] == [{"w": True, "b": True}] * script.VERSIONS, reports[r]
    # What crossed is the host plan's bytes for host1, every refit, counted by the receivers.
    hp = plan_hosts(trs.plan_reshard(script.SRC, script.DST), {0: "host0", 1: "host0", 2: "host1", 3: "host1"})
    assert hp.cross_host_bytes == sum(lay.numel * lay.itemsize for lay in script.SRC.values())   # each byte once
    for v in range(script.VERSIONS):
        got = sum(reports[r]["cross_host_bytes"][v] for r in (2, 3))
        assert 0 < got <= hp.cross_host_bytes, (v, got, hp.cross_host_bytes)
    assert sum(reports[r]["cross_host_bytes"][0] for r in (2, 3)) == hp.cross_host_bytes
    assert two_hosts.shm_files(0) == two_hosts.shm_files(1) == []   # every arena and buffer unlinked
