"""tritonreshard.apps.kit: the helpers tests, examples and bench share do what their docstrings say.

* :func:`free_port` gives a port that can be bound and listened on;
* :func:`run_ranks`' hard timeout kills a hung child (its process is gone afterwards) and names it;
  a failing child's traceback reaches the parent; :func:`start_rank` + :func:`collect_ok` report
  the same way; :func:`expect` names a dead child;
* :func:`tiny_model` is the same model for the same seed (whatever the caller's RNG state, which it
  leaves alone), another for another seed, and what it saves loads back with transformers;
* :func:`hf_greedy` equals a hand-rolled argmax loop;
* importing the module imports neither transformers nor vLLM.
"""
import os
import queue
import socket
import subprocess
import sys
import time

import pytest
import torch
import torch.multiprocessing as mp

from tritonreshard.apps import kit

transformers = pytest.importorskip("transformers")


# --- children (module level: spawn pickles them by name) -----------------------------------------
def _hang_after_pid(rank, pid_dir):
    with open(os.path.join(pid_dir, f"{rank}.pid"), "w") as f:
        f.write(str(os.getpid()))
    if rank == 1:
        time.sleep(3600)
    return rank


def _fail_on_one(rank):
    if rank == 1:
        raise ValueError(f"boom from rank {rank}")
    return rank * 10


def _fail_then_time_out(rank):
    """Rank 1 fails at once (the cause); rank 0 fails later, as a peer timing out on it does."""
    if rank == 1:
        raise ValueError("the cause, at once")
    time.sleep(1.5)
    raise TimeoutError("timed out waiting for rank 1")


def _spawned_children() -> list[int]:
    """Pids of this process's live spawn children (not its resource tracker)."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                spawned = b"spawn_main" in f.read()
        except (OSError, ValueError, IndexError):  # gone meanwhile
            continue
        if ppid == os.getpid() and spawned:
            out.append(int(pid))
    return out


# --- port ----------------------------------------------------------------------------------------
def test_free_port_is_bindable_and_listenable():
    port = kit.free_port()
    assert 1024 <= port < 65536
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
        s.listen()
        assert s.getsockname()[1] == port


def test_free_port_stays_below_the_ephemeral_range():
    """Outgoing connections take their local ports from the kernel's ephemeral range; a port picked
    there and bound seconds later can meanwhile be one of theirs (a gloo connection's once was)."""
    lo, _ = kit._ephemeral_ports()
    ports = [kit.free_port() for _ in range(50)]
    assert all(max(1024, lo - 16384) <= p < lo for p in ports), (lo, ports)


def test_free_port_never_hands_out_a_port_twice():
    """A test takes its ports up front and binds them seconds later: once a probe socket closed the
    kernel may pick its port again, which once gave a store and a TP group the same port."""
    ports = [kit.free_port() for _ in range(300)]
    assert len(set(ports)) == len(ports)


# --- launcher ------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_run_ranks_hard_timeout_kills_the_hung_child_and_names_it(tmp_path):
    t0 = time.monotonic()
    # 15 s: rank 0's start and return with room on a loaded machine; rank 1 never returns.
    with pytest.raises(TimeoutError, match=r"ranks \[1\] did not finish within 15 s"):
        kit.run_ranks(_hang_after_pid, 2, args=(str(tmp_path),), timeout=15)
    assert time.monotonic() - t0 < 55  # the deadline, a join of the survivors, the kill: no more
    pid = int((tmp_path / "1.pid").read_text())
    with pytest.raises(ProcessLookupError):  # killed and reaped: not even a zombie is left
        os.kill(pid, 0)
    assert _spawned_children() == []


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_failing_child_s_traceback_is_reported():
    with pytest.raises(AssertionError) as err:
        kit.run_ranks(_fail_on_one, 2, timeout=60)
    msg = str(err.value)
    assert msg.startswith("rank 1 raised ValueError: boom from rank 1")
    assert "Traceback (most recent call last)" in msg and "_fail_on_one" in msg
    out = kit.run_ranks(_fail_on_one, 2, timeout=60, allow_errors=True)
    assert out[0] == ("ok", 0)
    status, (name, message, tb) = out[1]
    assert (status, name, message) == ("error", "ValueError", "boom from rank 1") and "_fail_on_one" in tb


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_the_first_error_is_reported_and_the_later_ones_named():
    """The lowest rank's error is often a timeout on the real failure: the first to arrive leads."""
    with pytest.raises(AssertionError) as err:
        kit.run_ranks(_fail_then_time_out, 2, timeout=60)
    msg = str(err.value)
    assert msg.startswith("rank 1 raised ValueError: the cause, at once\nthen\n"
                          "  rank 0 raised TimeoutError: timed out waiting for rank 1\n"), msg
    assert "_fail_then_time_out" in msg


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_start_rank_and_collect_ok_report_values_and_tracebacks():
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [kit.start_rank(ctx, _fail_on_one, r, (), results) for r in (0, 1)]
    try:
        with pytest.raises(AssertionError, match="rank 1 raised ValueError: boom from rank 1") as err:
            kit.collect_ok(results, [0, 1], timeout=60)
        assert "_fail_on_one" in str(err.value)
    finally:
        codes = kit.reap(procs, timeout=30)
    assert codes == [0, 0]  # the error was reported, not raised out of the process
    with pytest.raises(TimeoutError, match=r"ranks \[3\] did not finish"):
        kit.collect_ok(results, [3], timeout=0.2)


class _Proc:
    def __init__(self, alive, exitcode=None):
        self.alive, self.exitcode = alive, exitcode

    def is_alive(self):
        return self.alive


def test_expect_returns_the_message_and_names_a_dead_process():
    q = queue.Queue()
    q.put(("ready", 0, None))
    assert kit.expect(q, "ready", {0: _Proc(True)}) == ("ready", 0, None)
    q.put(("published", 0, None))
    with pytest.raises(RuntimeError, match="expected 'ready' from the trainers, got 'published'"):
        kit.expect(q, "ready", {0: _Proc(True)}, who="trainers")
    with pytest.raises(RuntimeError, match=r"trainers \[1\] exited \(codes \[-9\]\) while the driver waited"):
        kit.expect(q, "ready", {0: _Proc(True), 1: _Proc(False, -9)}, who="trainers")
    with pytest.raises(TimeoutError, match="no 'ready' from the trainers within 0.5 s"):
        kit.expect(q, "ready", {0: _Proc(True)}, timeout=0.5, who="trainers")


# --- models --------------------------------------------------------------------------------------
def _state(model):
    return {n: t.clone() for n, t in model.state_dict().items()}


def test_tiny_model_is_deterministic_for_a_seed_and_loads_back(tmp_path):
    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    a = kit.tiny_model(seed=3, path=str(tmp_path / "m"))
    assert torch.equal(torch.random.get_rng_state(), before)  # the caller's RNG is left alone
    torch.rand(5)  # another RNG state: the same model all the same
    b = kit.tiny_model(seed=3)
    c = kit.tiny_model(seed=4)
    sa, sb, sc = _state(a), _state(b), _state(c)
    assert sa.keys() == sb.keys() and all(torch.equal(sa[n], sb[n]) for n in sa)
    assert any(not torch.equal(sa[n], sc[n]) for n in sa)
    assert all(t.dtype == torch.float32 for t in sa.values()) and not a.training
    assert a.config.architectures == ["LlamaForCausalLM"] and a.config.vocab_size == kit.TINY["vocab_size"]
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "m"), dtype=torch.float32)
    sl = _state(loaded)
    assert sl.keys() == sa.keys() and all(torch.equal(sa[n], sl[n]) for n in sa)


def test_tiny_config_overrides_and_other_classes():
    cfg = kit.tiny_config("Qwen2Config", tie_word_embeddings=True, num_hidden_layers=1)
    assert type(cfg).__name__ == "Qwen2Config" and cfg.architectures == ["Qwen2ForCausalLM"]
    assert cfg.tie_word_embeddings and cfg.num_hidden_layers == 1 and cfg.hidden_size == 128
    own = kit.tiny_config("LlamaConfig", dict(hidden_size=64, num_attention_heads=2, vocab_size=50))
    assert (own.hidden_size, own.num_attention_heads, own.vocab_size) == (64, 2, 50)


def test_random_prompts_are_seeded_and_sized():
    p = kit.random_prompts(1000, [12, 13, 20], seed=1)
    assert [len(x) for x in p] == [12, 13, 20] and all(0 <= t < 1000 for x in p for t in x)
    assert p == kit.random_prompts(1000, [12, 13, 20], seed=1) and p != kit.random_prompts(1000, [12, 13, 20], seed=2)
    assert p[:2] == kit.random_prompts(1000, range(12, 14), seed=1)  # drawn in order: a prefix is the same


# --- greedy --------------------------------------------------------------------------------------
def test_hf_greedy_matches_a_hand_rolled_argmax_loop():
    model = kit.tiny_model(seed=0)
    prompts = kit.random_prompts(model.config.vocab_size, [5, 9], seed=1)
    got = kit.hf_greedy(model, prompts, 6)
    want = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            for _ in range(6):
                nxt = model(ids).logits[0, -1].argmax()
                ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
            want.append(ids[0, len(p):].tolist())
    assert got == want and all(len(g) == 6 for g in got)
    assert kit.mismatches(got, want) == 0


def test_mismatches_counts_differing_and_missing_tokens():
    assert kit.mismatches([[1, 2, 3], [4]], [[1, 9, 3], [4, 5]]) == 2
    assert kit.mismatches([], []) == 0


# --- imports -------------------------------------------------------------------------------------
def test_importing_the_kit_imports_neither_transformers_nor_vllm():
    probe = ("import sys, tritonreshard.apps, tritonreshard.apps.kit; "
             "print(sorted(m for m in ('transformers', 'vllm') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
