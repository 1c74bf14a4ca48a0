"""Security: shared buffers are readable by the same user only, names are unguessable, a process
outside the group can't attach to a real engine arena, fd servers deal only with their own uid, the
group secret never shows up in logs, reprs or error messages, and what a rank reads from the store
is plain data (never unpickled), authenticated when the secret comes from the environment.
"""
import dataclasses
import datetime
import hashlib
import hmac
import io
import json
import logging
import os
import re
import secrets
import socket
import stat
import subprocess
import sys
import threading

import pytest
import torch
import torch.distributed as dist
from _mp import free_port, run_ranks

import tritonreshard as trs
from tritonreshard import Layout, Part, Replicate, Shard
from tritonreshard.engine import Member
from tritonreshard.engine import rendezvous as rdv
from tritonreshard.engine.sources import Exported
from tritonreshard.planning import BufferRef
from tritonreshard.transport import ArenaHandle, create_arena, create_control_block, open_arena, open_control_block

pytestmark = pytest.mark.timeout(180)


def test_named_segments_are_0600_and_ids_have_128_random_bits():
    arena, ctl = create_arena(1000), create_control_block(2, 2)
    try:
        for h in (arena.handle, ctl.handle):
            assert h.kind == "shm-name"
            st = os.stat(f"/dev/shm/{h.segment_name}")
            assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == os.getuid()
            assert re.fullmatch(r"trs-[0-9a-f]{32}", h.segment_name)  # 32 hex digits = 128 bits
            assert h.arena_id not in repr(h) and h.arena_id not in repr(arena)
    finally:
        arena.close()
        ctl.close()
    ids = {create_arena(1).handle.arena_id for _ in range(20)}  # (closed when collected)
    assert len(ids) == 20
    other_run = subprocess.run(
        [sys.executable, "-c", "from tritonreshard.transport import create_arena as c; a = c(1); "
                               "print(a.handle.arena_id); a.close()"],
        capture_output=True, text=True, timeout=120, check=True).stdout.strip()
    assert re.fullmatch(r"[0-9a-f]{32}", other_run) and other_run not in ids | {arena.handle.arena_id}


def test_memfd_arenas_have_no_name_and_refuse_a_wrong_secret():
    secret = rdv.GroupSecret.generate()
    before = set(os.listdir("/dev/shm"))
    arena = create_arena(4096, secret=secret)
    ctl = create_control_block(1, 1, secret=secret)
    try:
        assert arena.handle.kind == "shm-fd" and not os.path.exists(f"/dev/shm/{arena.handle.segment_name}")
        assert not {e for e in set(os.listdir("/dev/shm")) - before if e.startswith("trs-")}
        for bad in (rdv.GroupSecret.generate(), b"x" * 32):
            with pytest.raises(PermissionError, match="group secret mismatch"):
                open_arena(arena.export(), secret=bad, timeout=5)
            with pytest.raises(PermissionError, match="group secret mismatch"):
                open_control_block(ctl.export(), secret=bad, timeout=5)
        with pytest.raises(ValueError, match="needs secret"):
            open_arena(arena.export(), timeout=5)
        with pytest.raises(ValueError, match="at least 16 bytes"):
            open_arena(arena.export(), secret=b"short", timeout=5)
        peer = open_arena(arena.export(), secret=secret, timeout=5)  # the owner still serves members
        peer.close()
    finally:
        arena.close()
        ctl.close()


def _attack_worker(rank, port, secret_hex):
    """Ranks 0 (trainer) and 1, 2 (inference) form the group, with the secret from the environment
    (so it is not in the store). Rank 3 is not a member: it reads the trainer's handles from the
    store (which has no authentication) and tries to map them with a guessed secret."""
    torch.set_num_threads(1)
    log = io.StringIO()
    handler = logging.StreamHandler(log)
    logging.getLogger().addHandler(handler)
    logging.getLogger().setLevel(logging.DEBUG)
    if rank != 3:
        os.environ[rdv.SECRET_ENV] = secret_hex
    else:  # the outsider has no secret (not even one a parent process left in the environment)
        os.environ.pop(rdv.SECRET_ENV, None)
    kw = dict(meeting=trs.Meeting(rank=rank, world_size=3, store=f"127.0.0.1:{port}"), timeouts=trs.Timeouts(wait=60))
    src = {"w": Layout((4, 6), [0], [Replicate()])}
    dst = {"w": Layout((4, 6), [1, 2], [Replicate()])}
    report = {}
    if rank == 3:
        store = rdv.connect_store(f"127.0.0.1:{port}", world_size=3, is_master=False, timeout=60)
        prefixed = torch.distributed.PrefixStore("trs/default/e0/", store)
        (exports,) = rdv.fetch(prefixed, "exports/0", timeout=60)  # the trainer's arena, as exchanged
        guess = rdv.GroupSecret.generate()
        errors = []
        for opener, handle in ((open_arena, exports.arena), (open_control_block, exports.control)):
            try:
                opener(handle, secret=guess, timeout=10).close()
                errors.append(("opened", ""))
            except Exception as exc:  # noqa: BLE001 - the type is what we check
                errors.append((type(exc).__name__, str(exc)))
        report["errors"] = errors
        report["secret_in_store"] = prefixed.check([rdv.SECRET_KEY])
        prefixed.set("attacked", "1")  # a raw signal: rank 3 can't sign a value
    elif rank == 0:
        with trs.RefitTrainer({"w": torch.arange(24.0).reshape(4, 6)}, src, **kw) as ep:
            ep.publish()
            ep.fence()
            report["texts"] = [repr(ep), str(ep), repr(ep.group), repr(ep.group.secret), str(ep.group.secret),
                               repr(ep._trainer.arena.exported), repr(ep._trainer.arena.control), str(ep.route),
                               repr(ep.route), repr(ep.members), str(ep.plan), repr(ep.plan)]
    else:
        if rank == 2:  # maps the trainer's arena only after the attack: the owner must still serve it
            gather = rdv.all_gather_obj

            def delayed(store, prefix, *args, **kwargs):
                out = gather(store, prefix, *args, **kwargs)
                if prefix == "exports":
                    store.wait(["attacked"], datetime.timedelta(seconds=60))
                return out
            rdv.all_gather_obj = delayed
        with trs.RefitInference(dst, **kw) as ep:
            assert ep.pull() == 1
            report["exact"] = torch.equal(ep.tensors["w"], torch.arange(24.0).reshape(4, 6))
            report["texts"] = [repr(ep), repr(ep.route),
                               repr(ep._inference.subscriber.sources.controls), repr(ep.last_pull)]
    # A set-up that fails: its message must not carry the secret either.
    try:
        trs.RefitInference({"w": "not a layout"},
                           meeting=trs.Meeting(rank=0, world_size=1, store=f"127.0.0.1:{free_port()}"),
                           timeouts=trs.Timeouts(wait=5))
    except Exception as exc:  # noqa: BLE001
        report["setup_error"] = f"{type(exc).__name__}: {exc}"
    logging.getLogger().removeHandler(handler)
    report["log"] = log.getvalue()
    return report


def test_outsider_cannot_attach_and_the_secret_never_leaks():
    secret = rdv.GroupSecret.generate()
    secret_hex = bytes(secret).hex()
    out = run_ranks(_attack_worker, 4, args=(free_port(), secret_hex), timeout=150)
    errors = out[3]["errors"]
    assert [e[0] for e in errors] == ["PermissionError", "PermissionError"], errors
    assert all("group secret mismatch" in e[1] for e in errors), errors
    assert out[3]["secret_in_store"] is False
    assert out[1]["exact"] and out[2]["exact"]  # the owner kept serving the real members
    assert "refused a client with a bad group-secret proof" in out[0]["log"]
    forbidden = [secret_hex, secret_hex.upper(), repr(bytes(secret))[2:-1]]
    for r, rep in out.items():
        blob = "\n".join(rep.get("texts", []) + [rep["log"], rep.get("setup_error", ""),
                                                 *[m for _, m in rep.get("errors", [])]])
        for f in forbidden:
            assert f not in blob, f"rank {r} leaked the group secret"
    assert "GroupSecret(<redacted>)" in out[0]["texts"]


def test_group_secret_redacts_itself():
    s = rdv.GroupSecret.generate()
    for text in (repr(s), str(s), f"{s}", f"{s!r}", repr([s]), repr({"k": s})):
        assert bytes(s).hex() not in text and "redacted" in text
    with pytest.raises(ValueError) as info:
        rdv.GroupSecret(b"short")
    assert "short" not in str(info.value)


OTHER_UID = 65534  # nobody


def _as_other_uid(work) -> dict:
    """Run ``work()`` (-> a JSON-able dict) in a forked child that dropped to uid ``OTHER_UID``; its
    result, or the exception it raised, comes back through a pipe."""
    if os.geteuid() != 0:
        pytest.skip("needs root to run a process as another uid (setuid)")
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: no pytest, no return; it only reports and exits
        status = 0
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(OTHER_UID)
            os.setuid(OTHER_UID)
            out = {"ok": work()}
        except BaseException as exc:  # noqa: BLE001 - reported to the parent, which checks it
            out = {"error": [type(exc).__name__, str(exc)]}
        try:
            os.write(w, json.dumps(out).encode())
        finally:
            os._exit(status)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        data = f.read()
    _, code = os.waitpid(pid, 0)
    assert code == 0 and data, f"child exited with {code}"
    return json.loads(data)


def _raw_fd_client(handle, secret) -> str:
    """A client written from the protocol in ``transport/_fdserver.py`` that knows the secret (no
    checks of its own): what the server says to it."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as c:
        c.settimeout(5)
        c.connect(handle.socket_address)
        hello = c.recv(64)
        if hello == b"DENY":
            return "denied at the greeting"
        nonce_s, nonce_c = hello[4:], secrets.token_bytes(32)
        proof = hmac.new(bytes(secret), b"client|" + handle.arena_id.encode() + b"|" + nonce_s + nonce_c,
                         hashlib.sha256).digest()
        c.sendall(nonce_c + proof)
        msg, fds, _, _ = socket.recv_fds(c, 65536, 1)
        for fd in fds:
            os.close(fd)
        return f"{msg[:4].decode()} with {len(fds)} fd(s)"


def test_fd_server_refuses_another_uid_even_with_the_secret(caplog):
    secret = rdv.GroupSecret.generate()
    arena = create_arena(4096, secret=secret)
    try:
        handle = arena.export()
        caplog.set_level(logging.WARNING)
        assert _raw_fd_client(handle, secret) == "OKAY with 1 fd(s)"  # the same uid: served
        out = _as_other_uid(lambda: _raw_fd_client(handle, secret))
        assert out == {"ok": "denied at the greeting"}, out
        assert "refused a client of another user" in caplog.text and f"uid {OTHER_UID}" in caplog.text
        assert "bad group-secret proof" not in caplog.text
        out = _as_other_uid(lambda: open_arena(handle, secret=secret, timeout=5).close() or "opened")
        assert out.get("error", [None])[0] == "PermissionError", out  # the library's client says why
        peer = open_arena(handle, secret=secret, timeout=5)  # the owner still serves its own uid
        peer.tensor(0, (4,), torch.uint8).fill_(7)
        assert torch.equal(arena.tensor(0, (4,), torch.uint8), torch.full((4,), 7, dtype=torch.uint8))
        peer.close()
    finally:
        arena.close()


def test_a_client_refuses_an_fd_server_of_another_uid():
    """A process of another uid squats the abstract name of an arena's fd server: the client
    refuses it before it sends anything (not even its proof of the secret)."""
    arena_id = secrets.token_hex(16)
    handle = ArenaHandle(kind="shm-fd", arena_id=arena_id, nbytes=4096, alloc_nbytes=4096, device="cpu",
                         owner_pid=os.getpid(), hostname=socket.gethostname())
    ready_r, ready_w = os.pipe()

    def squat():
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as srv:
            srv.bind(handle.socket_address)
            srv.listen(1)
            os.write(ready_w, b"x")
            conn, _ = srv.accept()
            with conn:
                conn.settimeout(10)
                return {"received": len(conn.recv(4096))}  # 0: the client hung up without a word

    result = {}

    def client():
        os.read(ready_r, 1)
        try:
            open_arena(handle, secret=rdv.GroupSecret.generate(), timeout=5)
        except PermissionError as exc:
            result["error"] = str(exc)

    t = threading.Thread(target=client)
    t.start()
    out = _as_other_uid(squat)
    t.join(30)
    os.close(ready_r)
    os.close(ready_w)
    assert f"runs as uid {OTHER_UID}" in result.get("error", ""), result
    assert out == {"ok": {"received": 0}}, out


# ---------------------------------------------------------------------------- store values
class _Payload:
    """Unpickling this creates ``path``: the stand-in for any code an attacker would run."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def _plain_hello(store_key, monkeypatch, member) -> bytes:
    """What an outsider without the environment secret can write: a well-formed, unsigned value."""
    with monkeypatch.context() as m:
        m.delenv(rdv.SECRET_ENV, raising=False)
        scratch = dist.HashStore()
        rdv.publish(scratch, store_key, member)
        return scratch.get(store_key)


@pytest.mark.parametrize("attack", ["pickle", "unsigned-json", "tampered-json"])
def test_a_group_join_refuses_a_forged_hello_and_never_unpickles(tmp_path, monkeypatch, attack):
    """Someone who can write to the store plants rank 1's hello before rank 0 joins a real group:
    a pickle that would create a file when unpickled, or (with the environment secret) a JSON hello
    without a MAC or with its payload changed. Rank 0's join refuses it, naming the key."""
    marker = tmp_path / "pwned"
    probe = tmp_path / "probe"
    pickle_bytes = __import__("pickle").dumps(_Payload(str(marker)))
    __import__("pickle").loads(__import__("pickle").dumps(_Payload(str(probe)))).close()
    assert probe.exists()  # the payload is live: unpickling it runs code
    fake = Member(1, 4242, "h", "cpu", None, {"w": Layout((4, 6), [1], [Replicate()])})
    if attack == "pickle":
        monkeypatch.delenv(rdv.SECRET_ENV, raising=False)
        planted, why = pickle_bytes, "not a tritonreshard plain value"
    else:
        monkeypatch.setenv(rdv.SECRET_ENV, secrets.token_hex(32))
        planted, why = _plain_hello("hello/1", monkeypatch, fake), "forged or corrupted"
        if attack == "tampered-json":
            scratch = dist.HashStore()
            rdv.publish(scratch, "hello/1", fake)  # signed with the group's secret ...
            planted = scratch.get("hello/1").replace(b"4242", b"4243")  # ... then changed on the way
    base = rdv.connect_store("127.0.0.1:0", world_size=1, is_master=True, timeout=10)
    dist.PrefixStore("trs/default/e0/", base).set("hello/1", planted)  # the group's namespace
    with pytest.raises(ValueError, match=f"store key 'hello/1': the value is {why}") as info:
        trs.RefitTrainer({"w": torch.zeros(4, 6)}, {"w": Layout((4, 6), [0], [Replicate()])},
                         meeting=trs.Meeting(rank=0, world_size=2, store=base), timeouts=trs.Timeouts(wait=10))
    assert isinstance(info.value, rdv.StoreValueError)
    assert not marker.exists()


def _same(a, b) -> bool:
    """Equal, and of the same types all the way down (1 is not True, a tuple is not a list)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(ka, kb) and _same(a[ka], b[kb]) for ka, kb in zip(a, b, strict=True))
    return a == b


def _round_trip_values(arena, control):
    lay2d = Layout((8, 6), [[0, 1], [2, 3]], [Shard(0, blocks=(4, 4)), Replicate()], torch.bfloat16)
    parts = {"qkv": (Part("q", [(0, 4), None]), Part("k", [slice(4, 6), (0, 6)], (2, 0)),
                     Part(None, [(6, 8), None]))}
    member = Member(3, 1234, "host-a", "cuda:1", {"w": lay2d, "b": Layout((5,), [0, 1], [Shard(0)])},
                    {"qkv": Layout((8, 6), [2, 3], [Shard(1)], torch.float16)}, ("a problem", "another"), parts)
    return [
        None, True, False, 0, -7, 2 ** 80, 1.5, -0.0, float("inf"), "", "héllo\n\"$\"", b"", bytes(range(256)),
        [], (), (1,), [1, (2, [3, (4,)])], {}, {1: "int key", "1": "str key", (1, "a"): None, None: [],
                                                 b"k": {"$": "looks like a tag"}},
        {True: 0, False: 1},  # apart: in one dict True and 1 are the same key
        {"$": "dict", "items": []},  # a user dict shaped like a node stays a dict
        *[getattr(torch, n) for n in ("float32", "bfloat16", "float8_e4m3fn", "int64", "bool", "complex64")],
        slice(None), slice(1, 9, 2), slice(-1, None, None),
        Shard(0), Shard(1, (2, 3)), Replicate(), lay2d, parts["qkv"][1], member,
        BufferRef("arena", 0), Exported(BufferRef("arena", 2), arena.export(), control.export(), {"w": 0, "b": 256}),
        Exported(BufferRef("relay", 4), arena.export(), control.export()), arena.export(),
        {"members": {0: member}, "exports": (Exported(BufferRef("arena", 5), arena.export(), control.export()),)},
    ]


@pytest.mark.parametrize("env_secret", [False, True])
def test_every_plain_type_round_trips_exactly(monkeypatch, env_secret):
    if env_secret:
        monkeypatch.setenv(rdv.SECRET_ENV, secrets.token_hex(32))
    else:
        monkeypatch.delenv(rdv.SECRET_ENV, raising=False)
    arena, control = create_arena(1024, secret=b"s" * 32), create_control_block(2, 2, secret=b"s" * 32)
    try:
        values = _round_trip_values(arena, control)
        store = dist.HashStore()
        for i, v in enumerate(values):
            rdv.publish(store, f"v/{i}", v)
            raw = store.get(f"v/{i}")
            assert raw.startswith(b"trs-signed-1\n" if env_secret else b"trs-plain-1\n")
            got = rdv.fetch(store, f"v/{i}", timeout=1)
            assert _same(got, v), (v, got)
        assert _same(rdv.all_gather_obj(store, "g", 0, 1, values, timeout=1), [values])
    finally:
        arena.close()
        control.close()


def test_store_values_refuse_what_is_not_plain(monkeypatch):
    monkeypatch.delenv(rdv.SECRET_ENV, raising=False)
    store = dist.HashStore()

    def refused(raw, *needles):
        store.set("k", raw)
        with pytest.raises(rdv.StoreValueError) as info:
            rdv.fetch(store, "k", timeout=1)
        for n in ("store key 'k'", *needles):
            assert n in str(info.value), str(info.value)

    head = b"trs-plain-1\n"
    refused(__import__("pickle").dumps({"a": 1}), "not a tritonreshard plain value", "never unpickled")
    refused(b"", "not a tritonreshard plain value")
    refused(head + b"{not json", "not a tritonreshard plain value")
    refused(head + b'{"a": 1}', "unknown node")
    refused(head + b'{"$": "obj", "type": "os.system", "fields": {}}', "'os.system' is not registered")
    refused(head + b'{"$": "obj", "type": "builtins.dict", "fields": {}}', "not registered")
    refused(head + b'{"$": "dtype", "name": "__class__"}', "unknown dtype")
    refused(head + b'{"$": "bytes", "b64": "***"}', "bad base64")
    refused(head + b'{"$": "dict", "items": [[[1], 2]]}', "unhashable")
    refused(head + b"[" * 100000 + b"]" * 100000, "not a tritonreshard plain value")
    # The constructor runs, so a class's own validation refuses what it would refuse from a caller.
    bad_kind = {"$": "obj", "type": "tritonreshard.transport._base.ArenaHandle",
                "fields": {"kind": "pickle", "arena_id": "x", "nbytes": 1, "alloc_nbytes": 1, "device": "cpu",
                           "owner_pid": 1, "hostname": "h"}}
    refused(head + json.dumps(bad_kind).encode(), "refused its fields", "kind must be one of")
    bad_layout = {"$": "obj", "type": "tritonreshard.layout.Layout",
                  "fields": {"shape": {"$": "tuple", "items": [4]}, "mesh": [0, 0], "placements": [],
                             "dtype": {"$": "dtype", "name": "float32"}}}
    refused(head + json.dumps(bad_layout).encode(), "refused its fields", "duplicate ranks")
    with pytest.raises(TypeError, match=r"publish 'k': value\[1\]\['t'\] is a torch.Tensor, not a plain value"):
        rdv.publish(store, "k", [1, {"t": torch.zeros(1)}])


def test_with_the_env_secret_every_value_is_authenticated(monkeypatch):
    monkeypatch.setenv(rdv.SECRET_ENV, secrets.token_hex(32))
    store = dist.HashStore()
    value = {"w": 512, "buffer": BufferRef("arena", 1)}
    rdv.publish(store, "exports/1", value)
    signed = store.get("exports/1")
    assert rdv.fetch(store, "exports/1", timeout=1) == value

    def forged(key, raw, why):
        store.set(key, raw)
        with pytest.raises(rdv.StoreValueError, match=f"store key '{key}': the value is forged or corrupted.*{why}"):
            rdv.fetch(store, key, timeout=1)

    forged("exports/1", signed.replace(b"512", b"513"), "MAC does not match")      # payload changed
    forged("exports/2", signed, "MAC does not match")                             # moved to another key
    mac_at = len(b"trs-signed-1\n")
    flipped = signed[:mac_at] + (b"0" if signed[mac_at:mac_at + 1] != b"0" else b"1") + signed[mac_at + 1:]
    forged("exports/1", flipped, "MAC does not match")                            # MAC changed
    forged("exports/1", b"trs-plain-1\n" + signed.split(b"\n", 2)[2], "no MAC")   # MAC stripped
    monkeypatch.setenv(rdv.SECRET_ENV, secrets.token_hex(32))                    # another group's secret
    forged("exports/1", signed, "MAC does not match")


def test_register_plain_names_every_problem():
    @dataclasses.dataclass
    class Mutable:
        x: int

    @dataclasses.dataclass(frozen=True, init=False)
    class OddInit:
        x: int

        def __init__(self, *args):
            object.__setattr__(self, "x", args[0])

    with pytest.raises(ValueError) as info:
        rdv.register_plain(Mutable, OddInit, dict)
    msg = str(info.value)
    assert "Mutable is not frozen" in msg and "OddInit: constructor parameters ['args']" in msg
    assert "<class 'dict'> is not a dataclass" in msg

    @dataclasses.dataclass(frozen=True)
    class Fine:
        x: tuple
        y: dict = dataclasses.field(default_factory=dict)

    store = dist.HashStore()
    with pytest.raises(TypeError, match="not a plain value"):
        rdv.publish(store, "k", Fine((1,)))
    rdv.register_plain(Fine)
    rdv.publish(store, "k", Fine((1, torch.int8), {2: b"x"}))
    assert _same(rdv.fetch(store, "k", timeout=1), Fine((1, torch.int8), {2: b"x"}))


@pytest.mark.skipif(os.geteuid() != 0, reason="starting a store as another uid needs root")
def test_a_loopback_store_of_another_uid_hands_out_no_secret(monkeypatch):
    """An HTTP call (vLLM's /init_weight_transfer_engine) may name any store: one that another user
    of this machine started on loopback would hand a server without $TRITONRESHARD_GROUP_SECRET that
    user's secret, and then that user's weights. Such a store is refused, naming its uid; a store
    on another host always was (it listens beyond loopback)."""
    monkeypatch.delenv("TRITONRESHARD_GROUP_SECRET", raising=False)
    port = free_port()
    other = subprocess.Popen(
        # Imported as root (the interpreter's files may be root's alone), then the store is made as
        # uid 65534: a listening socket belongs to the uid that created it.
        [sys.executable, "-c", "import os, time; from tritonreshard.engine import rendezvous as rdv; "
         "os.setgid(65534); os.setuid(65534); "
         f"s = rdv.connect_store('127.0.0.1:{port}', world_size=2, is_master=True); "
         "print('ready', flush=True); time.sleep(120)"],
        stdout=subprocess.PIPE, text=True)
    try:
        assert other.stdout.readline().strip() == "ready"
        store = rdv.connect_store(f"127.0.0.1:{port}", world_size=2, is_master=False, timeout=10)
        with pytest.raises(ValueError, match=rf"the TCPStore on port {port} belongs to uid 65534, not to this "
                                             rf"process's uid 0"):
            rdv.group_secret(store, is_master=False, timeout=5)
    finally:
        other.kill()
        other.wait(10)
