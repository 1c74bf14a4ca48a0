"""Resource hygiene: no /dev/shm entries (``trs-*``), file descriptors or mappings of ours are left
after a normal close, after an exception (a set-up that failed validation, a pull that raised),
in the survivors of a SIGKILLed peer (see ``test_timeouts``), and after SIGTERM / SIGINT of a driver
process that runs a refit group.

With the group secret (every engine endpoint has one) CPU arenas are memfds: no /dev/shm name at all.
Named mode (``/dev/shm/trs-<id>``) is what the transport uses without a secret; both are checked.

Signal-safe shutdown pattern (what the driver below does, and all the engine needs): turn SIGTERM
into ``SystemExit`` (SIGINT already raises ``KeyboardInterrupt``) so ``with RefitEndpoint(...)``
blocks and ``finally`` clauses run: ``close(abort=True)`` sets the abort word, peers stop waiting at
once, and the driver terminates and joins its children in its own ``finally``.
"""
import gc
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from _faults import fd_targets, our_fds, our_maps, shm_entries, wait_no_new_shm
from _mp import free_port

import tritonreshard as trs
from tritonreshard import Layout, Replicate
from tritonreshard.engine import rendezvous as rdv
from tritonreshard.transport import create_arena, create_control_block, open_arena, open_control_block

pytestmark = pytest.mark.timeout(180)

SECRET = rdv.GroupSecret.generate()


def _settle_cuda():
    """Create the CUDA context of every visible device now, if there is one. A context opens fds
    (/dev/nvidia*, eventfds, pipes) that stay open for the life of the process; without this the fd
    check would pass or fail depending on whether an earlier test (or the engine under test) happened
    to create it first."""
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            torch.zeros(1, device=f"cuda:{i}")
            torch.cuda.synchronize(i)


def snapshot():
    _settle_cuda()
    gc.collect()
    return fd_targets(), len(our_maps())


def assert_clean(before, names=()):
    gc.collect()
    fds, maps = snapshot()
    # A leak is an fd that appeared; one that closed meanwhile (an earlier test's object collected
    # now) is not ours to report, and would make the result depend on test order.
    assert not fds - before[0], f"fds leaked: {sorted(fds - before[0])}"
    assert our_fds() == [] and our_maps() == [], (our_fds(), our_maps())
    for n in names:
        assert not os.path.exists(f"/dev/shm/{n}"), f"/dev/shm/{n} leaked"


def _transport_round(secret):
    arena = create_arena(4096, secret=secret)
    ctl = create_control_block(2, 2, secret=secret)
    peer = open_arena(arena.export(), secret=secret, timeout=5)
    pctl = open_control_block(ctl.export(), secret=secret, timeout=5)
    names = [arena.handle.segment_name, ctl.handle.segment_name]
    x = arena.tensor(0, (8,), torch.float32)
    x.copy_(torch.arange(8.0))
    assert torch.equal(peer.tensor(0, (8,), torch.float32), torch.arange(8.0))
    pctl.ack(1, 3)
    assert ctl.acked_version(1) == 3
    del x
    arena.unlink()
    ctl.unlink()
    for a in (peer, pctl, arena, ctl):
        a.close()
    return names


@pytest.mark.parametrize("secret", [None, SECRET], ids=["named", "memfd"])
def test_transport_close_releases_everything(secret):
    _transport_round(secret)  # warm-up: lazily opened library files don't count
    before = snapshot()
    names = _transport_round(secret)
    assert_clean(before, names)


@pytest.mark.parametrize("secret", [None, SECRET], ids=["named", "memfd"])
def test_transport_failed_open_releases_everything(secret):
    arena = create_arena(4096, secret=secret)
    before = snapshot()
    handle = arena.export()
    for _ in range(3):
        with pytest.raises((PermissionError, ValueError, FileNotFoundError)):
            if secret is None:
                arena.unlink()
                open_arena(handle)
            else:
                open_arena(handle, secret=rdv.GroupSecret.generate(), timeout=5)
    arena.close()
    gc.collect()
    assert our_fds() == [] and our_maps() == []
    assert fd_targets() <= before[0]
    assert not os.path.exists(f"/dev/shm/{handle.segment_name}")


def _endpoint(store, src_tensors=None, dst_tensors=None, **kw):
    lay = {"w": Layout((4, 6), [0], [Replicate()])}
    src = {"w": torch.arange(24.0).reshape(4, 6)} if src_tensors is None else src_tensors
    args = dict(meeting=trs.Meeting(rank=0, world_size=1, store=store, group=f"g{time.monotonic_ns()}"),
                source=trs.SourceData(src, lay),
                destination=trs.DestinationData({"w": Layout((4, 6), [0], [Replicate()], torch.bfloat16)},
                                                tensors=dst_tensors),
                timeouts=trs.Timeouts(wait=5))
    args.update(kw)
    return trs.RefitEndpoint(**args)


def test_endpoint_close_and_error_paths_release_everything():
    store = rdv.connect_store(f"127.0.0.1:{free_port()}", world_size=1, is_master=True, timeout=10)
    for mode in ("shadow", "inplace"):  # warm-up
        with _endpoint(store, pull=trs.PullOptions(mode=mode)) as ep:
            ep.publish()
            ep.pull()
    del ep
    before = snapshot()
    for mode in ("shadow", "inplace"):
        # normal close
        with _endpoint(store, pull=trs.PullOptions(mode=mode)) as ep:
            ep.publish()
            assert ep.pull() == 1
        del ep
        assert_clean(before)
        # a pull that raised (nothing publishes version 5), then close through __exit__
        with pytest.raises(TimeoutError, match="version 5"):
            with _endpoint(store, pull=trs.PullOptions(mode=mode)) as ep:
                ep.publish()
                ep.pull(version=5, timeout=0.3)
        del ep
        assert_clean(before)
        # set-up failed validation: wrong shard shape, bad destination
        with pytest.raises(ValueError, match="nothing was moved"):
            _endpoint(store, pull=trs.PullOptions(mode=mode), src_tensors={"w": torch.zeros(4, 5)})
        with pytest.raises(ValueError, match="nothing was moved"):
            _endpoint(store, pull=trs.PullOptions(mode=mode), dst_tensors={"w": torch.zeros(4, 6)})
        assert_clean(before)


# ------------------------------------------------------------------------------ driver signals

DRIVER = textwrap.dedent('''
    import os, signal, sys, time
    import torch
    import torch.multiprocessing as mp
    import tritonreshard as trs
    from tritonreshard import Layout, Shard

    def sigterm_to_exit(*_):
        raise SystemExit(128 + signal.SIGTERM)

    def member(rank, port, ready):
        signal.signal(signal.SIGTERM, sigterm_to_exit)
        torch.set_num_threads(1)
        kw = dict(meeting=trs.Meeting(rank=rank, world_size=2, store=f"127.0.0.1:{port}"),
                  timeouts=trs.Timeouts(wait=30))
        if rank == 0:
            lay = {"w": Layout((64, 8), [0], [Shard(0)])}
            with trs.RefitTrainer({"w": torch.zeros(64, 8)}, lay, **kw) as ep:
                while True:
                    ep.fence()
                    ep.source_tensors["w"].add_(1)
                    ep.publish()
        else:
            with trs.RefitInference({"w": Layout((64, 8), [1], [Shard(1)])}, **kw) as ep:
                while True:
                    v = ep.pull()
                    if v == 3:
                        ready.set()

    if __name__ == "__main__":
        signal.signal(signal.SIGTERM, sigterm_to_exit)
        ctx = mp.get_context("spawn")
        ready = ctx.Event()
        port = int(sys.argv[1])
        procs = [ctx.Process(target=member, args=(r, port, ready)) for r in range(2)]
        try:
            for p in procs:
                p.start()
            print("PIDS", " ".join(str(p.pid) for p in procs), flush=True)
            print("READY" if ready.wait(120) else "NOT READY", flush=True)
            while True:
                time.sleep(0.1)
        finally:
            for p in procs:
                if p.is_alive():
                    p.terminate()
            for p in procs:
                p.join(20)
                if p.is_alive():
                    p.kill()
                    p.join()
            print("EXIT", [p.exitcode for p in procs], flush=True)
''')


def _gone(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        return state in ("Z", "X")
    except FileNotFoundError:
        return True


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_driver_signal_leaves_nothing_behind(tmp_path, sig):
    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    before = shm_entries()
    # The driver gets Ctrl-C's default action even when this test runs in a background job (a shell
    # starts those with SIGINT ignored, children inherit it, and Python then never installs its
    # KeyboardInterrupt handler).
    proc = subprocess.Popen([sys.executable, str(script), str(free_port())], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=tmp_path,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        pids = [int(x) for x in proc.stdout.readline().split()[1:]]
        assert len(pids) == 2, proc.stderr.read()
        line = proc.stdout.readline().strip()
        assert line == "READY", f"the members never reached version 3: {line!r}"
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid in locals().get("pids", []):
            if not _gone(pid):
                os.kill(pid, signal.SIGKILL)
    assert "EXIT" in out, (out, err)
    # Both members closed through SystemExit (128+15), not killed at the deadline.
    assert out.strip().splitlines()[-1] == "EXIT [143, 143]", (out, err)
    deadline = time.monotonic() + 10
    while not all(_gone(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(_gone(p) for p in pids), f"driver children {pids} still running"
    assert wait_no_new_shm(before) == set()
    assert "Traceback" not in err or "SystemExit" in err or "KeyboardInterrupt" in err, err
