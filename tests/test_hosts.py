"""The host harness (``tritonreshard.apps.hosts``): hosts that are really apart on one machine.

Each property the cross-host tests rely on is checked here from the outside, with plain processes:
a host's name and address, its own /dev/shm, loopback that is its own, a cut link that passes
nothing and a restored one that passes again, the token bucket on both ends of a rated link, and a
teardown that leaves nothing behind, also after the harness's owner was SIGKILLed.
"""
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from tritonreshard.apps.hosts import Hosts, sweep

# A tiny TCP server and client without torch (fast to start): ``serve PORT ADDR`` accepts one
# connection and sends "hi"; ``connect ADDR PORT TIMEOUT`` prints what it got, or the error's name.
_NET = r"""
import socket, sys
if sys.argv[1] == "serve":
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((sys.argv[3], int(sys.argv[2]))); s.listen(); print("ready", flush=True)
    while True:
        c, _ = s.accept(); c.sendall(b"hi"); c.close()
else:
    try:
        c = socket.create_connection((sys.argv[2], int(sys.argv[3])), timeout=float(sys.argv[4]))
        print(c.recv(2).decode())
    except OSError as e:
        print(type(e).__name__)
"""


def _run(hosts, i, *argv, timeout=30):
    return subprocess.run([str(hosts[i].launcher), *argv], capture_output=True, text=True, timeout=timeout)


def _connect(hosts, i, addr, port, timeout=10.0):
    # A connection that must succeed gets 10 s: the server answers at once, but on a loaded machine
    # its process may wait that long for a CPU (only the cut link's test waits on purpose, and
    # names its own short timeout).
    return _run(hosts, i, sys.executable, "-c", _NET, "connect", addr, str(port), str(timeout)).stdout.strip()


def _netns():
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


#: The sleep the teardown test starts on a host: an argument of this test process's own (pgrep looks
#: at every process of the machine, and another run of this test may sleep beside it).
_SLEEP = f"321.{os.getpid()}"
_SLEEPING = f"^sleep {re.escape(_SLEEP)}$"


def _sleeping() -> bool:
    return subprocess.run(["pgrep", "-f", _SLEEPING], capture_output=True).returncode == 0


def _gone_within(seconds: float) -> bool:
    """Whether the sleep is gone within ``seconds``: a SIGKILLed process exits once the kernel
    runs it, which on a loaded machine is not at once."""
    deadline = time.monotonic() + seconds
    while _sleeping():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_each_host_has_its_name_address_shared_memory_and_loopback(two_hosts):
    h = two_hosts
    assert [_run(h, i, "hostname").stdout.strip() for i in (0, 1)] == ["host0", "host1"]
    assert "inet 10.77.0.2/24" in _run(h, 1, "ip", "-o", "addr", "show", "eth0").stdout
    # Names resolve as a cluster's DNS would (gloo finds its interface from the hostname).
    assert _run(h, 0, "getent", "hosts", "host1").stdout.split()[0] == "10.77.0.2"
    # /dev/shm is the host's own: what host0 writes there, host1 and the machine do not see.
    probe = _run(h, 0, "sh", "-c", "echo x > /dev/shm/trs-harness-probe && ls /dev/shm")
    assert probe.stdout.split() == ["trs-harness-probe"]
    try:
        assert _run(h, 1, "ls", "/dev/shm").stdout.split() == []
        assert h.shm_files(0) == ["trs-harness-probe"] and h.shm_files(1) == []
        assert not os.path.exists("/dev/shm/trs-harness-probe")
    finally:
        _run(h, 0, "rm", "/dev/shm/trs-harness-probe")
    server = h.popen(0, [sys.executable, "-c", _NET, "serve", "7777", "0.0.0.0"], stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout.readline().strip() == "ready"
        assert _connect(h, 1, "10.77.0.1", 7777) == "hi"                           # over the link
        assert _connect(h, 1, "127.0.0.1", 7777) == "ConnectionRefusedError"       # loopback is host1's own
        assert _connect(h, 0, "127.0.0.1", 7777) == "hi"
        h.cut(1)
        try:
            assert _connect(h, 1, "10.77.0.1", 7777, timeout=1.5) in ("TimeoutError", "OSError")
        finally:
            h.restore(1)
        assert _connect(h, 1, "10.77.0.1", 7777, timeout=10) == "hi"             # and back, same server
    finally:
        server.kill()
        server.wait(10)


def test_a_rated_link_has_a_token_bucket_each_way_and_none_once_lifted(two_hosts):
    h = two_hosts
    h.rate(1, 1)
    try:
        inside = _run(h, 1, "tc", "qdisc", "show", "dev", "eth0").stdout
        switch = subprocess.run(["tc", "-n", h.switch, "qdisc", "show", "dev", h[1].port],
                                capture_output=True, text=True).stdout
        assert "tbf" in inside and "rate 1Gbit" in inside, inside
        assert "tbf" in switch and "rate 1Gbit" in switch, switch
    finally:
        h.rate(1, None)
    assert "tbf" not in _run(h, 1, "tc", "qdisc", "show", "dev", "eth0").stdout


def test_teardown_leaves_nothing_also_when_the_owner_was_killed():
    from tritonreshard.apps.hosts import unavailable
    why = unavailable()
    if why:
        pytest.skip(why)
    # A process that makes hosts, starts a process on one, and is SIGKILLed: no close() ran.
    owner = subprocess.Popen(
        [sys.executable, "-c", "from tritonreshard.apps.hosts import Hosts; import time, sys; "
         f"h = Hosts(2); h.popen(1, ['sleep', '{_SLEEP}']); print(h.tag, h[1].shm, flush=True); time.sleep(300)"],
        stdout=subprocess.PIPE, text=True)
    tag, shm = owner.stdout.readline().split()
    assert f"{tag}-h1" in _netns() and os.path.ismount(shm)
    deadline = time.monotonic() + 30  # the sleep on host1 runs (so that its end below means something)
    while not _sleeping():
        assert time.monotonic() < deadline, "the sleep on host1 never started"
        time.sleep(0.05)
    owner.send_signal(signal.SIGKILL)
    owner.wait(10)
    assert f"{tag}-h1" in _netns()   # left behind ...
    removed = sweep()                # ... until the next harness (or anyone) sweeps
    assert f"{tag}-h0" in removed and f"{tag}-h1" in removed and f"{tag}-sw" in removed, removed
    assert tag not in _netns() and not os.path.exists(shm)
    # The sleep on host1 died with its host (sweep() SIGKILLs it; the kernel ends it when it runs).
    assert _gone_within(30), "the sleep on host1 outlived its host"
    # And a closed harness leaves nothing: no namespace, no mount, no directory.
    with Hosts(1) as h:
        tag, d = h.tag, h.dir
        h.popen(0, ["sleep", _SLEEP])
    assert tag not in _netns() and not d.exists()
    assert _gone_within(30), "the sleep on host0 outlived the closed harness"


def test_placement_on_a_host_the_harness_lacks_is_refused(two_hosts):
    with pytest.raises(ValueError, match=r"placement names hosts \[2, 5\]; this harness has 2"):
        two_hosts.run_ranks(print, [0, 2, 5])
