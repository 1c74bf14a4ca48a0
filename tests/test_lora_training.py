"""Training through an optimizer publishes what it trains (issue 41, item 6; verl#7495's failure).

A trainer copies the tensors it is given into its shared buffer once; what it publishes is that
buffer. An optimizer that steps the caller's own tensors would then train memory nobody reads, with
no error. So given ``nn.Parameter`` s (a peft model's LoRA parameters, a dict of parameters) are
bound: re-pointed at the buffer, so that ``optimizer.step()`` writes where ``publish()`` reads. A
tensor that does not alias the buffer any more, or (LoRA) a copied tensor written after the copy,
is refused at ``publish()`` with one ``ValueError`` naming it, before any version moves.

The LoRA case runs the serving side's own receive path (``serving_rank(...).join``, what vLLM's
``init_lora_refit`` runs in each worker) in two TP-rank processes, without a vLLM engine: every
version a real peft model trained by Adam holds arrives exactly in both TP ranks' slot views.
"""
import pytest
import torch
from _mp import free_port, run_ranks

import tritonreshard as trs
from tritonreshard import Layout, Replicate

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

pytestmark = pytest.mark.timeout(300)

TINY = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=128,
            num_hidden_layers=1, intermediate_size=128, tie_word_embeddings=False, max_position_embeddings=64)
LORA = dict(r=4, lora_alpha=24, target_modules=["q_proj", "v_proj", "o_proj", "up_proj", "down_proj"])
TP, TRAINERS, READERS = 2, [0], [1, 2]
VERSIONS = 3


def _config():
    return transformers.LlamaConfig(**TINY, architectures=["LlamaForCausalLM"])


def _peft_model():
    torch.manual_seed(0)
    base = transformers.AutoModelForCausalLM.from_config(_config()).float()
    return peft.get_peft_model(base, peft.LoraConfig(**LORA))


def _step(pm, opt, step):
    """One real training step of the adapter (Adam on the peft model's LoRA parameters)."""
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, TINY["vocab_size"], (2, 12), generator=g)
    pm(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()


def _lora_rank(rank, ports):
    torch.set_num_threads(1)
    from tritonreshard.serving import ServingInit, serving_rank
    from tritonreshard.vllm.lora import LoraTrainer, lora_init_info

    cfg = _config()
    if rank in TRAINERS:
        pm = _peft_model()
        params = {n: p for n, p in pm.named_parameters() if p.requires_grad}
        opt = torch.optim.Adam(params.values(), lr=0.05)
        published = []
        info = lora_init_info(peft.LoraConfig(**LORA), lora_name="policy", lora_id=1, trainer_ranks=TRAINERS,
                              inference_ranks=READERS, store=f"127.0.0.1:{ports[0]}", timeout=120.0)
        with LoraTrainer(cfg, info, pm, rank=rank, tp=TP) as tr:
            # the peft model's own parameters are the trainer's buffer now
            bound = {n.replace(".default.", "."): p.data_ptr() for n, p in params.items()}
            assert bound == {n: t.data_ptr() for n, t in tr.tensors.items()}, "not bound"
            for v in range(1, VERSIONS + 1):
                tr.fence()
                _step(pm, opt, v)
                assert tr.publish() == v
                published.append({n: t.numpy().copy() for n, t in peft.get_peft_model_state_dict(pm).items()})
            tr.fence()
            # A bound parameter re-pointed elsewhere trains memory no reader sees: refused, nothing published.
            victim = next(n for n in params if "q_proj.lora_B" in n)
            params[victim].data = params[victim].data.clone()
            with pytest.raises(ValueError, match=r"q_proj\.lora_B\.weight'\] no longer are views"):
                tr.publish()
            assert tr.published == VERSIONS
        # The trap of verl#7495: the detached state-dict tensors are copied, the optimizer steps the
        # model's parameters: the first publish() after that step is refused, naming every written one.
        pm = _peft_model()
        opt = torch.optim.Adam([p for p in pm.parameters() if p.requires_grad], lr=0.05)
        detached = peft.get_peft_model_state_dict(pm)
        info = lora_init_info(peft.LoraConfig(**LORA), lora_name="policy", lora_id=1, trainer_ranks=TRAINERS,
                              inference_ranks=READERS, store=f"127.0.0.1:{ports[1]}", timeout=120.0)
        with LoraTrainer(cfg, info, detached, rank=rank, tp=TP) as tr:
            del detached  # the trainer holds them: a dropped state dict hides nothing
            _step(pm, opt, 1)
            with pytest.raises(ValueError) as err:
                tr.publish()
            assert tr.published == 0
            msg = str(err.value)
        return {"published": published, "trap": msg}
    spec = trs.recipes.lora_to_vllm(LORA, cfg, TP, TRAINERS, READERS, dtype=torch.float32)
    out = []
    init = ServingInit(store=f"127.0.0.1:{ports[0]}", trainer_ranks=TRAINERS, inference_ranks=READERS,
                       group="vllm-lora", timeout=120.0, prefetch=False)
    sub, _ = serving_rank(init, spec, tp=TP, tp_rank=rank - len(TRAINERS)).join(device=torch.device("cpu"),
                                                                                mode="shadow")
    with sub:
        for v in range(1, VERSIONS + 1):
            assert sub.pull(v) == v
            out.append({n: t.numpy().copy() for n, t in sub.tensors.items()})
    trap = ServingInit(store=f"127.0.0.1:{ports[1]}", trainer_ranks=TRAINERS, inference_ranks=READERS,
                       group="vllm-lora", timeout=120.0, prefetch=False)
    sub, _ = serving_rank(trap, spec, tp=TP, tp_rank=rank - len(TRAINERS)).join(device=torch.device("cpu"),
                                                                                mode="shadow")
    sub.close()
    return out


def _tensors(arrays):
    """Arrays (what crosses back from the ranks: numpy pickles by value, torch tensors by a shared
    file descriptor that dies with its process) as tensors."""
    return {n: torch.from_numpy(a) for n, a in arrays.items()}


def test_adam_on_a_peft_model_publishes_every_version_exactly():
    """A real peft model (a tiny Llama from its config, no download; r=4, alpha=24, five projections) trained by Adam,
    given to LoraTrainer as the model: every version its parameters hold arrives exactly in both TP
    ranks' slot views (the recipe's plan from that version), each version differs from the last;
    a re-pointed parameter and the detached state-dict trap are refused at publish(), naming them."""
    out = run_ranks(_lora_rank, 1 + len(READERS), args=((free_port(), free_port()),), timeout=240)
    published = [_tensors(s) for s in out[0]["published"]]
    spec = trs.recipes.lora_to_vllm(LORA, _config(), TP, TRAINERS, READERS, dtype=torch.float32)
    for v, state in enumerate(published, start=1):
        if v > 1:
            assert all(not torch.equal(state[n], published[v - 2][n]) for n in state if ".lora_A." in n), v
        want = trs.execute_local(spec.plan(), {0: state}, backend="torch")
        for r in READERS:
            got = _tensors(out[r][v - 1])
            assert sorted(got) == sorted(spec.dst)
            for n in spec.dst:
                assert torch.equal(got[n], want[r][n]), (v, r, n)
        # independently of the plan: column-parallel lora_a is A whole on each TP rank, zero-padded
        a = state["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"]
        for r in READERS:
            slot = torch.from_numpy(out[r][v - 1]["model.layers.0.self_attn.qkv_proj.lora_a_stacked.0"])
            assert torch.equal(slot[:4], a) and not slot[4:].any()
    trap = out[0]["trap"]
    for n in spec.src:  # every adapter tensor the optimizer stepped is named
        assert n in trap, n
    assert "pass the peft model" in trap


def test_refit_trainer_binds_a_dicts_parameters_and_refuses_a_replaced_one():
    """The general RefitTrainer (a colocated rank, one process): a dict of nn.Parameters (and a
    requires_grad leaf) trained by SGD is bound to the arena and every pull is exactly what the
    optimizer wrote; a plain tensor is copied (the caller's stays where it was); a parameter
    re-pointed after binding is refused at publish() naming it, and nothing is published."""
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(3, 4))
    leaf = torch.randn(5, requires_grad=True)
    plain = torch.randn(2)
    src = {"w": Layout((3, 4), [0], [Replicate()]), "leaf": Layout((5,), [0], [Replicate()]),
           "plain": Layout((2,), [0], [Replicate()])}
    dst = {k: Layout(v.shape, [0], [Replicate()]) for k, v in src.items()}
    opt = torch.optim.SGD([w, leaf], lr=0.1)
    plain_ptr = plain.data_ptr()
    with trs.RefitEndpoint(meeting=trs.Meeting(rank=0, world_size=1, store=f"127.0.0.1:{free_port()}"),
                           source=trs.SourceData({"w": w, "leaf": leaf, "plain": plain}, src),
                           destination=trs.DestinationData(dst)) as ep:
        arena = ep.source_tensors
        assert w.data_ptr() == arena["w"].data_ptr() and leaf.data_ptr() == arena["leaf"].data_ptr()
        assert plain.data_ptr() == plain_ptr != arena["plain"].data_ptr()
        for step in range(1, 4):
            ep.fence()
            before = w.detach().clone()
            ((w @ torch.ones(4)).sum() + leaf.sum() ** 2).backward()
            opt.step()
            opt.zero_grad()
            assert not torch.equal(before, w.detach())
            assert ep.publish() == step and ep.pull() == step
            assert torch.equal(ep.tensors["w"], w.detach()) and torch.equal(ep.tensors["leaf"], leaf.detach())
        ep.fence()
        w.data = w.data.clone()
        with pytest.raises(ValueError, match=r"\['w'\] no longer are views of the trainer's arena"):
            ep.publish()
        assert ep.published == 3
