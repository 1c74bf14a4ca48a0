"""Partitions survived, on hosts that are really apart (``tritonreshard.apps.bench.partitions``).

The link between the trainers' host and the inference host is cut in the middle of a whole transfer,
in the middle of a delta, and during a fence; each case twice, in the same processes (an epoch per
round). Every promise of docs/guarantees.md ("Across hosts") is checked on every round: one
PeerDiedError per rank naming the host it cannot reach and that host's ranks, within the configured
timeout; the inference ranks still serve their last complete version, bit for bit; nothing in either
host's /dev/shm; after the restore the next epoch forms without a process restarted, its first
transfer whole (no delta from a base the receiver may lack) and, for deltas, its next one a delta.
"""
import pytest

from tritonreshard.apps.bench.partitions import INFERENCE, TRAINERS, PartitionConfig, figures, run_partitions
from tritonreshard.apps.hosts import unavailable

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(autouse=True)
def _needs_hosts():
    why = unavailable()
    if why:
        pytest.skip(why)


def _check(cfg: PartitionConfig, result: dict) -> None:
    ranks, cuts = result["ranks"], result["cuts"]
    assert [c["case"] for c in cuts] == list(cfg.rounds)
    for k, cut in enumerate(cuts):
        assert cut["shm"] == ([], []), cut          # nothing in either host's /dev/shm while cut
        for r in (*TRAINERS, *INFERENCE):
            rd = ranks[r]["rounds"][k]
            assert rd["error"] is not None, (k, r, rd)
            kind, msg, when = rd["error"]
            other, theirs = ("host1", "[2, 3]") if r in TRAINERS else ("host0", "[0, 1]")
            assert kind == "PeerDiedError" and f"host '{other}'" in msg and theirs in msg, (k, r, msg)
            assert when - cut["cut"] < cfg.wait_timeout, (k, r, when - cut["cut"])  # within the timeout
            assert rd["shm"] == [], (k, r, rd["shm"])
        for r in INFERENCE:
            version, exact = ranks[r]["rounds"][k]["served"]
            assert exact and version >= 2, (k, r, ranks[r]["rounds"][k]["served"])
            nxt = ranks[r]["rounds"][k + 1]["transfers"]
            assert nxt[0][2] == 0, (k, r, nxt[0])     # the new epoch's first transfer: whole
            if "delta" in cfg.rounds:
                assert any(t[2] > 0 for t in nxt[1:]), (k, r, nxt)   # then deltas again
        if cut["case"] == "fence":
            assert all(ranks[r]["rounds"][k]["call"] == "fence" for r in TRAINERS)
    for f in figures(result):
        assert f["next_whole"], f
    assert result["shm_after"] == ([], [])
    assert all(ranks[r]["shm_at_end"] == [] for r in ranks)


def test_cut_mid_transfer_and_during_a_fence_twice_each():
    cfg = PartitionConfig(rounds=("transfer", "fence", "transfer", "fence"))
    _check(cfg, run_partitions(cfg))


def test_cut_mid_delta_twice():
    cfg = PartitionConfig(rounds=("delta", "delta"))
    _check(cfg, run_partitions(cfg))
