"""The checks and the report of ``examples/vllm_refit.py``: the run's summary (what ``--json`` prints
last), vLLM's greedy tokens after each refit against transformers' float32 greedy (or, for a
bfloat16 engine, against vLLM engines started from the same weights: :class:`EngineReference`), the
lines each refit prints, an engine's shutdown with its shared memory, and the run's verdict
(``summary["ok"]``).
"""
from __future__ import annotations

import json
import os
import socket
import time

from vllm_refit_hosts import hosts_ok

from tritonreshard.apps.kit import hf_greedy, mismatches, vllm_greedy

# vLLM gives its engine process and its workers 5 s each to exit, then SIGKILLs them; on a busy
# machine they often need longer, and a killed one never unlinks its message queues (vLLM's
# multiprocessing.shared_memory segments, /psm_*), so Python's resource tracker unlinks them at exit
# with "There appear to be N leaked shared_memory objects". tritonreshard creates none of those (its
# segments are memfds or trs-* names), so such a warning is vLLM's; a longer grace lets it clean up
# (examples/vllm_refit.py gives vLLM's workers the same: VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS).
SHUTDOWN_GRACE_S = 30


def new_summary(args, hf, prompts) -> dict:
    """The run's summary before anything ran: what ``--json`` prints last, filled in as the run goes."""
    return {"model": args.model, "parameters": sum(p.numel() for p in hf.parameters()), "refits": 0, "tp": args.tp,
            "prompts": len(prompts), "tokens_compared": 0, "mismatches": 0,
            "refit_ms": [], "update_ms": [], "fence_ms": [], "worker": [], "greedy": [],
            "prefetch": not args.no_prefetch, "hosts": args.hosts, "changed": args.changed, "cross_host": [],
            "encode_ms": [], "dtype": args.dtype, "reference": "transformers" if args.dtype == "float32" else "vllm",
            "reference_engine_s": [], "vllm_shm_removed": [], "net": args.net,
            "engine_hostname": socket.gethostname(), "trainer_hosts": [], "trainer_hostnames": []}


def compare(llm, hf, prompts, max_tokens, what, summary, reference=None):
    """vLLM's greedy tokens against transformers' float32 greedy with the weights ``hf`` holds; with
    ``reference`` (an :class:`EngineReference`: a bfloat16 engine) only recorded now, and checked
    against a vLLM engine started from those weights once this one has shut down."""
    got = vllm_greedy(llm, prompts, max_tokens)
    if reference is not None:
        summary["greedy"].append(got)
        reference.record(what, hf, got)
        print(f"{what}: vLLM greedy recorded, for a vLLM engine started from these weights", flush=True)
        return 0
    want = hf_greedy(hf, prompts, max_tokens)
    summary["greedy"].append(got)  # so a reader (and the test) can see each refit changed the output
    bad = _tally(got, want, summary)
    print(f"{what}: vLLM greedy {'==' if not bad else '!='} transformers greedy "
          f"({sum(len(w) for w in want)} tokens, {bad} mismatches)", flush=True)
    return bad


def _tally(got, want, summary) -> int:
    """Counts the greedy tokens compared and those that differ into ``summary``; returns the latter."""
    bad = mismatches(got, want)
    summary["tokens_compared"] += sum(len(w) for w in want)
    summary["mismatches"] += bad
    return bad


class EngineReference:
    """The check of a bfloat16 engine, where transformers' float32 greedy is no exact reference:
    after each refit the weights the trainers published are saved as a checkpoint
    (``save_pretrained``, as the engine's starting checkpoint was written) with the refitted
    engine's greedy tokens; :meth:`check`, once that engine has shut down (two would share the same
    cores), starts one vLLM engine per version from its checkpoint, with the refitted engine's
    settings, and counts the tokens that differ. vLLM's own loader and kernels are then the
    reference: a wrong element anywhere in the refit shows as a different token.

    ``root``: a folder for the checkpoints (the caller removes it); ``engine_kwargs``: the
    ``vllm.LLM`` arguments, less the weight-transfer ones."""

    def __init__(self, root: str, engine_kwargs: dict):
        self.root, self.engine_kwargs, self.versions = root, engine_kwargs, []

    def record(self, what: str, hf, got: list[list[int]]) -> None:
        path = os.path.join(self.root, f"version-{len(self.versions)}")
        hf.save_pretrained(path)
        self.versions.append((what, path, got))

    def check(self, prompts, max_tokens: int, summary: dict) -> None:
        from vllm import LLM  # only a bfloat16 run's reference engines need it here

        for what, path, got in self.versions:
            t0 = time.perf_counter()
            llm = LLM(path, **self.engine_kwargs)
            idents = engine_idents(llm)
            try:
                want = vllm_greedy(llm, prompts, max_tokens)
            finally:
                shutdown_engine(llm, idents, summary)
            summary["reference_engine_s"].append(round(time.perf_counter() - t0, 1))
            bad = _tally(got, want, summary)
            print(f"{what}: vLLM greedy after the refit {'==' if not bad else '!='} vLLM greedy of an engine "
                  f"started from these weights ({sum(len(w) for w in want)} tokens, {bad} mismatches)", flush=True)


def dist_ident(worker):
    """(Run in each vLLM worker.) The name vLLM's CPU workers give their shared-memory TP
    communicator (``VLLM_DIST_IDENT``)."""
    return os.environ.get("VLLM_DIST_IDENT")


def engine_idents(llm) -> list[str]:
    """The names of ``llm``'s workers' shared-memory TP communicators (none where there are none)."""
    return sorted(set(llm.collective_rpc(dist_ident)) - {None})


def remove_vllm_shm(idents) -> list[str]:
    """vLLM SIGKILLs workers that outlive its shutdown grace (SHUTDOWN_GRACE_S here; still possible on a
    very busy machine); they then leave their TP shared-memory segments in /dev/shm. Remove exactly
    this engine's, by its names (none where there is no /dev/shm)."""
    if not os.path.isdir("/dev/shm"):
        return []
    left = sorted(f for f in os.listdir("/dev/shm") if any(i and f.startswith(f"{i}-") for i in idents))
    for f in left:
        os.unlink(os.path.join("/dev/shm", f))
    return left


def shutdown_engine(llm, idents, summary) -> None:
    """``llm`` shut down now, not at interpreter exit (the checks after it need it), with time to exit
    cleanly (:data:`SHUTDOWN_GRACE_S`); what its workers left in /dev/shm (``idents``) is removed and
    named in ``summary["vllm_shm_removed"]``."""
    llm.llm_engine.engine_core.shutdown(timeout=SHUTDOWN_GRACE_S)
    summary["vllm_shm_removed"] += remove_vllm_shm(idents)


def report_refit(what: str, summary: dict, cross: dict, hosts: int) -> None:
    """The lines of one refit: its time and each worker's phases; with ``hosts`` 2, what crossed hosts."""
    w = summary["worker"][-1]
    print(f"{what}: {summary['refit_ms'][-1]} ms (in each worker: wait {w['wait_ms']:.2f} ms, agree "
          f"{w['agree_ms']:.2f} ms, copy {w['copy_ms']:.2f} ms, post-processing {w['post_ms']:.2f} ms; "
          f"{'prefetched' if w['prefetched'] else 'pulled in update_weights'})", flush=True)
    if hosts > 1:
        changed = [f"{c:.2%}" for c in cross["changed"] if c is not None]
        print(f"{what}: {sum(cross['bytes'])} bytes crossed hosts ({sum(cross['delta_bytes'])} as deltas, "
              f"{sum(cross['dense_bytes'])} whole; changed {', '.join(changed) or 'not compared'})", flush=True)


def finish(args, summary: dict, hosts) -> dict:
    """The run's verdict into ``summary["ok"]``: it had the hosts it says (``hosts``: the harness of
    --net namespaces, else None), no greedy token differed, every refit ran, with ``--fault`` the
    bad init and the killed trainer failed clearly while vLLM kept serving, and with ``--tear`` the
    torn direct pull failed saying the weights may be torn. Prints the summary as
    one JSON line with ``--json``; returns it."""
    summary["refit_ms_median"] = sorted(summary["refit_ms"])[len(summary["refit_ms"]) // 2]
    if hosts is not None:  # the trainers are gone: their host keeps nothing of theirs
        summary["trainer_host_shm"] = hosts.shm_files(0)
    refits = args.refits + bool(args.fault and args.recover) + bool(getattr(args, "tear", False))
    fault, tear = summary.get("fault"), summary.get("tear")
    ok = hosts_ok(args, summary, hosts) and summary["mismatches"] == 0 and summary["refits"] == refits and (
        not args.fault or (fault["error"] and fault["names_rank"] and summary["bad_init_error"]
                           and fault["serves_previous"])) and (
        tear is None or (tear["error"] is not None and "may hold part of" in tear["error"]))
    summary["ok"] = bool(ok)
    if args.json:
        print(json.dumps(summary), flush=True)
    return summary
