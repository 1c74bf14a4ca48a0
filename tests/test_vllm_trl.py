"""TRL 1.16's ``VLLMClient`` with its weight sync through tritonreshard (tritonreshard.frameworks.trl).

Against the real trl package: the client is TRL's class, its weight-sync methods keep TRL's
signatures, and ``install()`` swaps the class TRL's trainers build. Live on the session's
``vllm serve`` (tests/_live.py, tiny Llama, TP=2, CPU): TRL's own client refuses the CPU, ours
refits the server through TRL's calls (``update_model_params`` -> ``update_named_params``,
``update_named_param``, ``weight_update``) with greedy tokens equal to transformers' after each
update, and bad updates are refused before anything is served. README.md's GRPO fragment runs as
pasted on the same server: TRL's own ``GRPOTrainer``, two steps, synced exactly.
"""
import copy
import inspect
import re
from pathlib import Path

import pytest
import torch
from _live import PROMPTS, hf_greedy
from _mp import free_port

trl_client = pytest.importorskip("trl.generation.vllm_client", reason="trl not installed (pip install -e '.[trl]')")
import trl.generation.vllm_generation as trl_generation  # noqa: E402  (after the skip: trl is optional)

from tritonreshard.frameworks.trl import VLLMClient, install  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SYNC = ("init_communicator", "update_named_param", "update_named_params", "update_model_params", "weight_update",
        "reset_prefix_cache", "close_communicator")


def _params(fn):
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


def test_the_client_is_trls_with_trls_weight_sync_signatures():
    """A drop-in: TRL's class (generation and chat are TRL's own), every weight-sync method with
    TRL's parameters and defaults, and TRL's constructor parameters first, ours keyword-only after."""
    assert issubclass(VLLMClient, trl_client.VLLMClient)
    for name in SYNC:
        assert _params(getattr(VLLMClient, name)) == _params(getattr(trl_client.VLLMClient, name)), name
    for name in ("generate", "chat", "get_sequence_logprobs", "check_server"):
        assert getattr(VLLMClient, name) is getattr(trl_client.VLLMClient, name), name
    theirs, ours = _params(trl_client.VLLMClient.__init__), _params(VLLMClient.__init__)
    assert ours[:len(theirs)] == theirs
    assert {kind for _, kind, _ in ours[len(theirs):]} == {inspect.Parameter.KEYWORD_ONLY}


def test_install_swaps_the_class_trls_trainers_build():
    """GRPO's server mode builds ``trl.generation.vllm_generation.VLLMClient``: one line swaps it."""
    before = trl_generation.VLLMClient
    try:
        assert install() is before
        assert trl_generation.VLLMClient is VLLMClient
    finally:
        trl_generation.VLLMClient = before


def _train(model, step: int) -> None:
    """One optimizer step on a next-token loss over seeded tokens: the weights TRL would sync."""
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=g)
    opt = torch.optim.SGD(model.parameters(), lr=2.0)
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_trl_client_refits_vllm_serve_on_cpu(llama_server, monkeypatch):
    srv = llama_server
    srv.ok("/shutdown_weight_transfer_engine")  # a group an earlier file joined (a no-op if none)
    # The server's workers and this trainer sign the group's store values with one secret.
    monkeypatch.setenv("TRITONRESHARD_GROUP_SECRET", srv.env["TRITONRESHARD_GROUP_SECRET"])
    theirs = trl_client.VLLMClient(base_url=srv.url, group_port=free_port())
    with pytest.raises(NotImplementedError, match="needs a CUDA device"):
        theirs.init_communicator(device="cpu")  # TRL's own: NCCL only

    from transformers import GPT2Config

    with pytest.raises(ValueError) as e:  # every problem at once, nothing joined
        VLLMClient(base_url=srv.url, group_port=free_port(), hf_config=GPT2Config()).init_communicator("meta")
    assert "model_type 'gpt2' has no recipe" in str(e.value) and "device meta" in str(e.value), e.value

    client = VLLMClient(base_url=srv.url, group_port=free_port())
    client.init_communicator(device="cpu")
    model = copy.deepcopy(srv.hf)
    try:
        assert client.world_size == 3 and client.version == 0
        served = srv.greedy()
        with pytest.raises(ValueError, match="must name every parameter"):
            client.update_named_param("model.norm.weight", model.model.norm.weight.data)
        for step in (1, 2):
            _train(model, step)
            client.update_model_params(model)  # TRL's sync: update_named_params over every parameter
            client.reset_prefix_cache()
            want = hf_greedy(srv, model.state_dict())
            assert want != served, "the step must change greedy decoding, or the check would be empty"
            assert srv.greedy() == want and srv.weight_version() == str(step)
            served = want
        _refusals(client, srv, model, served)
        _partial_updates(client, srv, model)
    finally:
        client.close_communicator()
    assert client.trainer is None
    assert srv.greedy() == hf_greedy(srv)  # the server serves on, with the last version installed


def _refusals(client, srv, model, served):
    """Bad updates: refused, and the server keeps serving the last complete version."""
    norm = model.model.norm.weight.data
    with pytest.raises(ValueError) as e:  # before any tensor is read
        client.update_named_params([("model.norm.weight", "float32", [7]), ("lm_head.bias", "float32", [3]),
                                    ("model.embed_tokens.weight", "int8", [1000, 128])], iter([]))
    text = str(e.value)
    assert "model.norm.weight: shape [7]" in text and "'lm_head.bias'" in text and "dtype 'int8'" in text, text
    names = [n for n, _ in model.named_parameters()]
    meta = [(n, "float32", list(p.shape)) for n, p in model.named_parameters()]
    # The iterator breaks its metadata part way: the buffer is mixed, so nothing is published.
    stream = ((n, p.data + 1.0) for n, p in model.named_parameters() if n != names[3])
    with pytest.raises(ValueError, match="nothing of this update is served"):
        client.update_named_params(meta, stream)
    assert srv.greedy() == served and srv.weight_version() == "2"
    with pytest.raises(ValueError, match="must name every parameter"):
        client.update_named_param("model.norm.weight", norm)


def _partial_updates(client, srv, model):
    """After a whole update, a partial one (TRL's per-parameter path) and a ``weight_update`` block."""
    client.update_model_params(model)  # whole again (the failed one left the buffer mixed)
    assert srv.weight_version() == "3"
    with torch.no_grad():
        model.model.norm.weight.mul_(-1.0)
    client.update_named_param("model.norm.weight", model.model.norm.weight.data)
    assert srv.weight_version() == "4" and srv.greedy() == hf_greedy(srv, model.state_dict())
    with torch.no_grad():
        model.lm_head.weight.mul_(0.5)
        model.model.layers[0].mlp.down_proj.weight.mul_(-1.0)
    with client.weight_update():  # two parameters, one version
        client.update_named_param("lm_head.weight", model.lm_head.weight.data)
        client.update_named_param("model.layers.0.mlp.down_proj.weight",
                                  model.model.layers[0].mlp.down_proj.weight.data)
    assert srv.weight_version() == "5" and srv.greedy() == hf_greedy(srv, model.state_dict())
    assert srv.greedy([PROMPTS[1]]) == hf_greedy(srv)[1:]


def _readme_grpo() -> tuple[int, str]:
    """README.md's GRPO fragment: (the file's line of its first code line, its code)."""
    text = (ROOT / "README.md").read_text()
    found = [(text.count("\n", 0, m.start(1)) + 1, m.group(1))
             for m in re.finditer(r"^```python\n(.*?)^```", text, re.S | re.M) if "GRPOTrainer(" in m.group(1)]
    assert len(found) == 1, f"README.md: {len(found)} python blocks build a GRPOTrainer, one expected"
    return found[0]


def _run(code: str, line: int, ns: dict) -> None:
    """``code`` in ``ns``, compiled at its own line of README.md (a traceback names the README's line)."""
    exec(compile("\n" * (line - 1) + code, str(ROOT / "README.md"), "exec"), ns)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_readmes_grpo_fragment_trains_through_vllm_serve(llama_server, monkeypatch, tmp_path):
    """README.md's GRPO fragment as pasted, but for the server's URL, a free group port and a
    temporary output folder: TRL's own ``GRPOTrainer`` trains two steps through our client. TRL syncs
    before each generation (steps 0 and 1), so after ``train()`` the server serves step 1's weights,
    not step 2's, and ``sync_weights()`` installs step 2's: greedy tokens equal transformers' on
    each, and each step changes them (or the check would be empty)."""
    from transformers import TrainerCallback

    srv = llama_server
    srv.ok("/shutdown_weight_transfer_engine")  # a group an earlier file joined (a no-op if none)
    monkeypatch.setenv("TRITONRESHARD_GROUP_SECRET", srv.env["TRITONRESHARD_GROUP_SECRET"])
    monkeypatch.setattr(trl_generation, "VLLMClient", trl_generation.VLLMClient)  # the fragment's install(), undone
    line, code = _readme_grpo()
    for old, new in (('"http://localhost:8000"', repr(srv.url)), ('"/tmp/grpo-tiny"', repr(str(tmp_path / "grpo"))),
                     ("vllm_group_port=51216", f"vllm_group_port={free_port()}")):
        assert code.count(old) == 1, f"README.md:{line}: {old} not once in the GRPO fragment"
        code = code.replace(old, new)
    build, train, sync = re.split(r"^(trainer\.train\(\)\n)", code, flags=re.M)
    assert sync.startswith("trainer.vllm_generation.sync_weights()") and sync.count("\n") == 1, sync

    weights = {}  # optimizer step -> the trainer model's weights after it (0: before the first)

    class Record(TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, **kwargs):
            weights[0] = copy.deepcopy(ns["model"].state_dict())

        def on_step_end(self, args, state, control, model=None, **kwargs):
            weights[state.global_step] = copy.deepcopy(ns["model"].state_dict())

    ns = {"__name__": "__main__"}
    try:
        _run(build, line, ns)
        ns["trainer"].add_callback(Record())
        _run(train, line + build.count("\n"), ns)
        assert sorted(weights) == [0, 1, 2]
        before, step1, step2 = (hf_greedy(srv, weights[s]) for s in (0, 1, 2))
        assert before != step1 != step2, "each step must change greedy decoding, or the checks would be empty"
        assert srv.weight_version() == "2" and srv.greedy() == step1  # synced before the generations of steps 1, 2
        _run(sync, line + build.count("\n") + 1, ns)
        assert srv.weight_version() == "3" and srv.greedy() == step2
        assert all(torch.equal(weights[2][n], p) for n, p in ns["model"].state_dict().items())
        hf_greedy(srv, weights[2])  # srv.hf holds what the server serves, for the files after this one
    finally:
        if "trainer" in ns:
            ns["trainer"].vllm_generation.vllm_client.close_communicator()
