"""No hangs, dead peers: every wait has a timeout naming what it waited for, and a SIGKILLed (or
stopped) peer is noticed within a bounded time and named.

Documented choices checked here: a dead *reader* makes the trainer's ``fence()`` raise
``PeerDiedError`` naming it (the refit fails clearly; readers are never dropped silently); a pull or
fence that times out fails only that call (the group stays usable, the next version arrives); a rank
that leaves with an exception sets the abort word, so its peers stop waiting at once.
"""
import gc
import os
import select
import signal
import time
from dataclasses import replace

import pytest
import torch
from _faults import die, fd_targets, our_fds, our_maps
from _mp import free_port, run_ranks

import tritonreshard as trs
from tritonreshard import Layout, Replicate
from tritonreshard.engine import rendezvous as rdv
from tritonreshard.engine.sources import Sources

pytestmark = pytest.mark.timeout(180)

SHAPE = (4, 6)


def value(v):
    return torch.arange(24, dtype=torch.float32).reshape(SHAPE) + 1000 * v


# ------------------------------------------------------------------------------ set-up timeouts

def test_setup_with_a_missing_rank_times_out_naming_the_key_and_rank():
    lay = {"w": Layout(SHAPE, [0], [Replicate()])}
    t0 = time.monotonic()
    with pytest.raises(TimeoutError) as info:  # rank 0 hosts the store; rank 1 never comes
        trs.RefitTrainer({"w": value(1)}, lay,
                         meeting=trs.Meeting(rank=0, world_size=2, store=f"127.0.0.1:{free_port()}"),
                         timeouts=trs.Timeouts(wait=1.5))
    assert time.monotonic() - t0 < 30
    msg = str(info.value)
    assert "'hello/1'" in msg and "from rank 1" in msg and "1.5 s" in msg, msg


def test_setup_without_a_store_times_out_naming_the_address():
    port = free_port()
    with pytest.raises(TimeoutError, match=f"TCPStore at 127.0.0.1:{port} within 1.5 s: connection refused: "
                                           "nothing listens on that port"):
        trs.RefitInference({"w": Layout(SHAPE, [1], [Replicate()])},
                           meeting=trs.Meeting(rank=1, world_size=2, store=f"127.0.0.1:{port}"),
                           timeouts=trs.Timeouts(wait=1.5))


def _unreachable_store_worker(rank, port):
    """On host1, host0's link cut: each store address fails, naming itself and why, within its
    timeout. ``(message, seconds)`` per address."""
    out = {}
    for addr in (f"10.77.0.1:{port}", f"10.77.0.2:{port}", f"no-such-host.invalid:{port}"):
        t0 = time.monotonic()
        try:
            trs.RefitInference({"w": Layout(SHAPE, [1], [Replicate()])},
                               meeting=trs.Meeting(rank=1, world_size=2, store=addr), timeouts=trs.Timeouts(wait=2.0))
        except TimeoutError as e:
            out[addr] = (str(e), time.monotonic() - t0)
    return out


def test_an_unreachable_rendezvous_fails_at_its_timeout_naming_the_address_and_why(two_hosts):
    """Across hosts that are really apart: a store behind a cut link, an address where nothing
    listens (host1's own), a name that does not resolve."""
    port = free_port()
    two_hosts.cut(0)
    try:
        res = two_hosts.run_ranks(_unreachable_store_worker, [1], args=(port,), timeout=60)[0]
    finally:
        two_hosts.restore(0)
    whys = {f"10.77.0.1:{port}": "no answer: the address is unreachable from this host",
            f"10.77.0.2:{port}": "connection refused: nothing listens on that port",
            f"no-such-host.invalid:{port}": "'no-such-host.invalid' does not resolve on this host ('host1')"}
    assert sorted(res) == sorted(whys), res
    for addr, why in whys.items():
        msg, took = res[addr]
        assert f"could not connect to the TCPStore at {addr} within 2 s: {why}" in msg, msg
        # the timeout, then at most 0.5 s to say why (torch's own retries overran it by up to 5 s);
        # the rest of the slack is for a loaded machine's scheduling
        assert took < 2.0 + 0.5 + 1.5, (addr, took)


# ------------------------------------------------------------------------------ wait timeouts

def _timeouts_worker(rank, port):
    torch.set_num_threads(1)
    store_kw = dict(meeting=trs.Meeting(rank=rank, world_size=2, store=f"127.0.0.1:{port}"),
                    timeouts=trs.Timeouts(wait=60))
    src = {"w": Layout(SHAPE, [0], [Replicate()])}
    dst = {"w": Layout(SHAPE, [1], [Replicate()])}
    report = {}
    if rank == 0:
        with trs.RefitTrainer({"w": value(1)}, src, **store_kw) as ep:
            store = ep.store
            ep.publish()
            with pytest.raises(TimeoutError):  # a poll: fails only itself
                ep.fence(timeout=0)
            t0 = time.monotonic()
            with pytest.raises(TimeoutError) as info:  # the reader doesn't pull yet
                ep.fence(timeout=1.0)
            report["fence_timeout"] = (str(info.value), time.monotonic() - t0)
            store.set("fence_timed_out", b"1")
            ep.fence()  # now it pulls version 1: the timed-out fence did not break the group
            store.wait(["pull_timed_out"])
            ep.source_tensors["w"].copy_(value(2))
            ep.publish()
            ep.fence()  # the reader's timed-out pulls did not break the group either
            ep.source_tensors["w"].copy_(value(3))
            ep.publish()
            t0 = time.monotonic()
            with pytest.raises(trs.RefitError) as info:  # the reader left with an error: no 60 s wait
                ep.fence()
            report["abort"] = (str(info.value), time.monotonic() - t0)
            store.set("trainer_done", b"1")
    else:
        ep = trs.RefitInference(dst, **store_kw)
        store = ep.store
        store.wait(["fence_timed_out"])
        assert ep.pull() == 1
        t0 = time.monotonic()
        with pytest.raises(TimeoutError) as info:  # nobody publishes version 2 yet
            ep.pull(timeout=1.0)
        report["pull_timeout"] = (str(info.value), time.monotonic() - t0)
        with pytest.raises(TimeoutError):  # a poll: fails only itself
            ep.pull(timeout=0)
        assert ep.version == 1 and torch.equal(ep.tensors["w"], value(1))
        assert ep.alive() and ep.dead_peers() == []
        store.set("pull_timed_out", b"1")
        assert ep.pull() == 2 and torch.equal(ep.tensors["w"], value(2))
        report["abandoned"] = ep.start_pull(version=9)  # never published: abandon it
        ep.discard()
        assert ep.version == 2
        with pytest.raises(RuntimeError, match="the reader gives up"):
            with ep:  # an exception leaves the with block: close(abort=True)
                raise RuntimeError("the reader gives up")
        store.wait(["trainer_done"])
    return report


def test_timeouts_fail_only_that_call_and_abort_stops_peers():
    out = run_ranks(_timeouts_worker, 2, args=(free_port(),), timeout=150)
    msg, took = out[0]["fence_timeout"]
    assert "rank 0: timed out after 1 s waiting for readers [1] to ack version 1" in msg, msg
    assert "still behind" in msg and "{1: 0}" in msg, msg
    msg, took = out[1]["pull_timeout"]
    assert "rank 1: timed out after 1 s waiting for sources [0] to publish version 2" in msg, msg
    assert "published: {0: 1}" in msg, msg
    assert out[1]["abandoned"] == 9
    msg, took = out[0]["abort"]
    assert "aborted" in msg and "rank 1 set the abort word" in msg, msg
    assert took < 20, f"the trainer waited {took:.1f} s after the reader aborted"


# ------------------------------------------------------------------------------ a trainer dies

TRAINER = 3  # not rank 0: rank 0 hosts the store, which the survivors still use afterwards


class _HeldSources(Sources):
    """The arenas on this host, but each copy (once it started) waits until the trainer is gone:
    the public seam for where source bytes come from, used to place the kill mid-copy."""

    hold = False

    def prepare(self, version):
        if not self.hold:
            return
        pid = self.group.members[TRAINER].pid
        self.group.store.set(f"copying/{self.group.rank}", b"1")
        # Until the kernel reports the trainer exited, all its threads included (its pidfd turns
        # readable then; /proc shows the leader a zombie a moment earlier, while threads still exit).
        fd, exited = os.pidfd_open(pid), select.poll()
        exited.register(fd, select.POLLIN)
        deadline = time.monotonic() + 60
        while not exited.poll(10) and time.monotonic() < deadline:
            pass
        os.close(fd)


def _dead_trainer_worker(rank, port):
    """Rank 3 trains; rank 0 and 1 serve in place, rank 2 in shadow mode. Version 1 arrives
    everywhere; then the trainer publishes version 2 and is SIGKILLed while ranks 0 and 2 copy it
    (their copy is held until the trainer is gone) and while rank 1 waits for version 3."""
    torch.set_num_threads(1)
    kw = dict(meeting=trs.Meeting(rank=rank, world_size=4, store=f"127.0.0.1:{port}"), timeouts=trs.Timeouts(wait=60))
    src = {"w": Layout(SHAPE, [TRAINER], [Replicate()])}
    dst = {"w": Layout(SHAPE, [0, 1, 2], [Replicate()])}
    if rank == TRAINER:
        ep = trs.RefitTrainer({"w": value(1)}, src, **kw)
        ep.publish()
        ep.fence()
        ep.source_tensors["w"].copy_(value(2))
        ep.publish()
        ep.store.wait(["copying/0", "copying/2", "waiting/1"])
        ep.store.set("killed_at", str(time.monotonic()).encode())
        die()
    # The survivors bring their own store, so the fd baseline includes its sockets and threads.
    base = rdv.connect_store(f"127.0.0.1:{port}", world_size=4, is_master=rank == 0, timeout=60)
    fds0 = fd_targets()
    mode = "shadow" if rank == 2 else "inplace"
    ep = trs.RefitInference(dst, replace(kw["meeting"], store=base),
                            pull=trs.PullOptions(mode=mode, sources=_HeldSources), timeouts=kw["timeouts"])
    store = ep.store
    assert ep.pull() == 1 and torch.equal(ep.tensors["w"], value(1))
    report = {}
    if rank in (0, 2):
        ep._inference.subscriber.sources.hold = True
    try:
        if rank == 1:
            store.set("waiting/1", b"1")
            ep.pull(version=3)  # waits; the trainer dies before this rank copies anything
        else:
            ep.pull()
        raise AssertionError("pull succeeded although the trainer died")
    except trs.PeerDiedError as exc:
        report["latency"] = time.monotonic() - float(store.get("killed_at"))
        report["error"], report["error_rank"] = str(exc), exc.rank
    report.update(version=ep.version, consistent=ep.consistent,
                  serving_is_v1=torch.equal(ep.tensors["w"], value(1)), dead_peers=ep.dead_peers(),
                  alive=ep.alive())
    with pytest.raises(trs.PeerDiedError, match="already ended"):  # the epoch is over for good
        ep.pull(timeout=5)
    ep.close()
    del ep
    gc.collect()
    report.update(our_fds=our_fds(), our_maps=our_maps(), fd_growth=sorted(fd_targets() - fds0))
    store.set(f"done/{rank}", b"1")
    if rank == 0:  # keep the store up until every survivor is done with it
        store.wait(["done/1", "done/2"])
    return report


def test_trainer_sigkilled_mid_pull_is_named_and_weights_stay_known():
    out = run_ranks(_dead_trainer_worker, 4, args=(free_port(),), timeout=150, victims=[TRAINER])
    for r, rep in out.items():
        assert rep["error_rank"] == TRAINER, rep
        assert f"rank {TRAINER} (pid" in rep["error"] and "died" in rep["error"], rep["error"]
        assert rep["version"] == 1, rep
        assert rep["dead_peers"] == [TRAINER] and rep["alive"] is False, rep
        # Liveness bound, generous for a loaded machine (a local dead pid is noticed at once).
        assert rep["latency"] < 10 + 20, rep
        assert rep["our_fds"] == [] and rep["our_maps"] == [], rep
        # (rank 0 hosts the store: its server holds one socket per connected client)
        assert [t for _, t in rep["fd_growth"] if r != 0 or "socket:" not in t] == [], rep
    assert "during the pull of version 2" in out[0]["error"]
    assert out[0]["consistent"] is False                       # in place, died mid-copy: torn
    assert "while waiting for sources [3] to publish version 3" in out[1]["error"]
    assert out[1]["consistent"] is True and out[1]["serving_is_v1"]  # in place, died before copying
    assert out[2]["consistent"] is True and out[2]["serving_is_v1"]  # shadow: still version 1, exact
    print("trainer death noticed after (s):", {r: round(rep["latency"], 3) for r, rep in out.items()})


# ------------------------------------------------------------------------------ a reader dies

def _dead_reader_worker(rank, port, how):
    torch.set_num_threads(1)
    kw = dict(meeting=trs.Meeting(rank=rank, world_size=2, store=f"127.0.0.1:{port}"),
              timeouts=trs.Timeouts(wait=60, peer=1.5))
    if rank == 1:
        ep = trs.RefitInference({"w": Layout(SHAPE, [1], [Replicate()])}, **kw)
        assert ep.pull() == 1
        ep.store.set("gone_at", str(time.monotonic()).encode())
        if how == "kill":
            die()
        os.kill(os.getpid(), signal.SIGSTOP)  # hung, not dead: alive per its pidfd, silent
        time.sleep(60)
        return {}
    with trs.RefitTrainer({"w": value(1)}, {"w": Layout(SHAPE, [0], [Replicate()])}, **kw) as ep:
        ep.publish()
        ep.fence()
        ep.store.wait(["gone_at"])
        ep.source_tensors["w"].copy_(value(2))
        ep.publish()
        # a dead reader: PeerDiedError at once; a stopped one only fails the fence on its own timeout
        with pytest.raises(trs.PeerDiedError if how == "kill" else TimeoutError) as info:
            ep.fence(timeout=None if how == "kill" else STOP_WAIT)
        latency = time.monotonic() - float(ep.store.get("gone_at"))
        rep = {"error": str(info.value), "rank": getattr(info.value, "rank", None), "latency": latency,
               "dead_peers": ep.dead_peers()}
        if how == "stop":
            os.kill(ep.members[1].pid, signal.SIGKILL)
        return rep


STOP_WAIT = 3.0  # the fence's timeout on the stopped reader (> peer_timeout=1.5 s: it is silent by then)


@pytest.mark.parametrize("how", ["kill", "stop"])
def test_reader_dead_fails_the_fence_at_once_and_a_stopped_one_on_its_timeout(how):
    out = run_ranks(_dead_reader_worker, 2, args=(free_port(), how), timeout=120, victims=[1])
    rep = out[0]
    assert "readers [1] to ack version 2" in rep["error"], rep
    if how == "kill":
        assert rep["rank"] == 1 and "rank 1 (pid" in rep["error"] and "died" in rep["error"], rep
        assert rep["latency"] < 20, rep
    else:  # SIGSTOPped: alive per its pidfd, so never dead; the fence times out and names it silent
        assert rep["dead_peers"] == [], rep
        assert f"timed out after {STOP_WAIT:g} s" in rep["error"], rep
        assert "rank 1 (pid" in rep["error"] and "is alive (stopped) but sent no heartbeat" in rep["error"], rep
        assert "peer_timeout=1.5 s): hung or starved" in rep["error"], rep
        assert STOP_WAIT <= rep["latency"] < STOP_WAIT + 20, rep
    print(f"reader {how}: noticed after {rep['latency']:.3f} s")
