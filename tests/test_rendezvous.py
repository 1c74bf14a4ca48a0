"""Rendezvous helpers over TCPStore: connect, publish/fetch with named timeouts, all-gather, secret
(and where the store listens when it is passed through it)."""
from __future__ import annotations

import datetime
import multiprocessing as mp
import pickle
import socket
import threading
import time

import pytest
import torch.distributed as dist

from tritonreshard.apps.kit import free_port, reap
from tritonreshard.engine.rendezvous import (
    SECRET_ENV,
    SECRET_KEY,
    all_gather_obj,
    connect_store,
    fetch,
    group_secret,
    publish,
)

CHILD_TIMEOUT_S = 30


@pytest.fixture
def master():
    store = connect_store("127.0.0.1:0", world_size=1, is_master=True, timeout=10)
    yield store


def _client(master):
    return connect_store(f"127.0.0.1:{master.port}", world_size=1, is_master=False, timeout=10)


def test_publish_fetch_roundtrip(master):
    c = _client(master)
    publish(master, "meta/0", {"shape": (3, 4), "dtype": "bf16"})
    assert fetch(c, "meta/0", timeout=1) == {"shape": (3, 4), "dtype": "bf16"}


def test_fetch_timeout_names_key_and_what(master):
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=r"0.2 s waiting for store key 'handles/3' \(arena handle of rank 3\)"):
        fetch(master, "handles/3", timeout=0.2, what="arena handle of rank 3")
    assert time.monotonic() - t0 < 5


def test_connect_store_bad_input_and_env(monkeypatch, master):
    with pytest.raises(ValueError, match="addr must be 'host:port'"):
        connect_store("localhost", world_size=1, is_master=False)
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    with pytest.raises(ValueError, match="MASTER_ADDR"):
        connect_store(None, world_size=1, is_master=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(master.port))
    c = connect_store(None, world_size=1, is_master=False, timeout=5)
    publish(master, "k", 1)
    assert fetch(c, "k", timeout=1) == 1


def test_a_client_before_its_master_waits_and_keeps_its_whole_timeout():
    """A client that starts first waits for the master (torch's connect, on a thread given up at
    the timeout); the store it gets has the whole timeout for every later get/wait."""
    port = free_port()
    got = {}
    client = threading.Thread(target=lambda: got.setdefault(
        "store", connect_store(f"127.0.0.1:{port}", world_size=2, is_master=False, timeout=20)))
    client.start()
    time.sleep(1.5)  # the client's attempts are refused meanwhile
    master = connect_store(f"127.0.0.1:{port}", world_size=2, is_master=True, timeout=20)
    client.join(30)
    assert not client.is_alive() and got["store"].timeout == datetime.timedelta(seconds=20)
    publish(master, "k", 7)
    assert fetch(got["store"], "k", timeout=5) == 7


def test_group_secret_created_once_shared_and_redacted(master, monkeypatch):
    monkeypatch.delenv(SECRET_ENV, raising=False)
    s = group_secret(master, is_master=True, timeout=1)
    s2 = group_secret(_client(master), is_master=False, timeout=1)
    assert s == s2 and len(bytes(s)) == 32
    raw = bytes(s)
    for text in (repr(s), str(s), f"{s}", repr([s])):
        assert raw.hex() not in text and "redacted" in text
    assert pickle.loads(pickle.dumps(s)) == s


def test_group_secret_from_env_never_touches_store(master, monkeypatch):
    monkeypatch.setenv(SECRET_ENV, "ab" * 32)
    s = group_secret(master, is_master=True, timeout=1)
    assert bytes(s) == b"\xab" * 32
    assert not master.check(["trs/group_secret"])


def test_group_secret_timeout(master, monkeypatch):
    monkeypatch.delenv(SECRET_ENV, raising=False)
    with pytest.raises(TimeoutError, match="group secret from the master"):
        group_secret(master, is_master=False, timeout=0.1, key="trs/other_secret")


def _gather_child(q, port, rank, world):
    store = connect_store(f"127.0.0.1:{port}", world_size=world, is_master=False, timeout=20)
    q.put(all_gather_obj(store, "round0", rank, world, {"rank": rank}, timeout=20))


@pytest.mark.slow
def test_all_gather_across_processes():
    world = 3
    store = connect_store("127.0.0.1:0", world_size=world, is_master=True, timeout=20)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_gather_child, args=(q, store.port, r, world), daemon=True)
             for r in (1, 2)]
    for p in procs:
        p.start()
    try:
        mine = all_gather_obj(store, "round0", 0, world, {"rank": 0}, timeout=CHILD_TIMEOUT_S)
        theirs = [q.get(timeout=CHILD_TIMEOUT_S) for _ in procs]
    finally:
        reap(procs, CHILD_TIMEOUT_S)
    expected = [{"rank": r} for r in range(world)]
    assert mine == expected and theirs == [expected, expected]
    assert all(p.exitcode == 0 for p in procs)


def test_all_gather_bad_rank(master):
    with pytest.raises(ValueError, match=r"rank must be in \[0, 2\), got rank=2"):
        all_gather_obj(master, "x", 2, 2, None, timeout=1)


def _non_loopback_address() -> str:
    """An address of this machine outside 127/8 (the route a datagram would take; nothing is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.123", 9))
        except OSError:
            pytest.skip("this machine has no non-loopback IPv4 address")
        addr = s.getsockname()[0]
    if addr.startswith("127."):
        pytest.skip("this machine has no non-loopback IPv4 address")
    return addr


def _reachable(addr: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(2)
        return s.connect_ex((addr, port)) == 0


def test_a_loopback_master_listens_on_loopback_only():
    """torch's own master listens on every interface whatever its host; connect_store's doesn't."""
    outside = _non_loopback_address()
    torch_master = dist.TCPStore("127.0.0.1", 0, 1, True, datetime.timedelta(seconds=10), wait_for_workers=False)
    assert _reachable(outside, torch_master.port)  # what the rule below is about
    for host in ("127.0.0.1", "localhost"):
        ours = connect_store(f"{host}:0", world_size=1, is_master=True, timeout=10)
        assert not _reachable(outside, ours.port) and _reachable("127.0.0.1", ours.port)
        publish(ours, "k", 1)
        assert fetch(connect_store(f"{host}:{ours.port}", world_size=1, is_master=False, timeout=10),
                     "k", timeout=1) == 1


def test_group_secret_never_goes_into_a_store_that_listens_beyond_loopback(monkeypatch):
    monkeypatch.delenv(SECRET_ENV, raising=False)
    wide = dist.TCPStore("127.0.0.1", 0, 1, True, datetime.timedelta(seconds=10), wait_for_workers=False)
    clients = [dist.PrefixStore("trs/default/e0/", wide),
               connect_store(f"127.0.0.1:{wide.port}", world_size=1, is_master=False, timeout=10),
               connect_store(f"{_non_loopback_address()}:{wide.port}", world_size=1, is_master=False, timeout=10)]
    for i, store in enumerate(clients):
        with pytest.raises(ValueError) as info:
            group_secret(store, is_master=i == 0, timeout=1)
        msg = str(info.value)
        assert SECRET_ENV in msg and "tritonreshard.secret_for_children()" in msg, msg
        assert "beyond loopback" in msg, msg
    assert "listens on every interface" in str(pytest.raises(ValueError, group_secret, wide, is_master=True,
                                                             timeout=1).value)
    assert not wide.check([SECRET_KEY]) and not clients[0].check([SECRET_KEY])
    monkeypatch.setenv(SECRET_ENV, "cd" * 32)  # the launcher's secret: any store is fine
    assert bytes(group_secret(wide, is_master=True, timeout=1)) == b"\xcd" * 32
    monkeypatch.delenv(SECRET_ENV)
    assert group_secret(dist.HashStore(), is_master=True, timeout=1)  # in-process: listens nowhere


def test_group_secret_refuses_a_store_it_cannot_inspect(monkeypatch, tmp_path):
    monkeypatch.delenv(SECRET_ENV, raising=False)
    with pytest.raises(ValueError, match=f"FileStore can't be checked.*{SECRET_ENV}"):
        group_secret(dist.FileStore(str(tmp_path / "store"), 1), is_master=True, timeout=1)
