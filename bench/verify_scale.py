"""Fail-closed at any size: what ``verify=`` and the tracer cost one vLLM worker, at real model sizes.

A benchmark script, not a test (``python bench/verify_scale.py --all``). Each row runs in a fresh
process (caches cold, one worker's view): vLLM's model of one TP rank is built on the meta device
from a config's published sizes (``bench/configs/*.json``; nothing allocated), then

* ``verify``: ``verify_model`` of the hand-written recipe on that rank (every layer);
* ``trace``: ``trace_recipe`` of the whole model (every TP rank's loader, one after another, as each
  worker does with ``init_info(trace=True)``), checked equal to the hand-written recipe.

Per row, measured in the process (``tritonreshard.vllm._cost.Cost``): wall and CPU seconds
(``time.process_time``; this machine's 2 cores are shared), the peak resident set above the one
before the step (``VmHWM``, reset through ``/proc/self/clear_refs``), and what is still resident
after it. The last TP rank is the one checked (it holds the vocab padding, where there is any).

``--before TREE`` runs the same rows on another checkout (``git worktree add TREE <commit>``) whose
``verify_model(..., sample=)`` fed whole tensors as float64 codes: those only fit this 24 GiB
machine with the model cut to ``--layers`` layers, ``--experts`` experts and ``--vocab`` rows, so
``--all`` runs both sides at such cut sizes, two sizes each, and prints the growth between them.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
MODELS = ("llama-3-8b", "qwen3-30b-a3b", "qwen3-235b-a22b", "deepseek-v3")
EXPERTS = {"qwen3_moe": "num_experts", "deepseek_v3": "n_routed_experts"}


def _config(name: str, layers: int | None, experts: int | None, vocab: int | None):
    import transformers

    raw = json.loads((HERE / "configs" / f"{name}.json").read_text())
    raw.pop("_source")
    if layers is not None:
        raw["num_hidden_layers"] = layers
        raw["first_k_dense_replace"] = min(raw.get("first_k_dense_replace", 0), layers - 1)
    if experts is not None:
        raw[EXPERTS[raw["model_type"]]] = experts
        raw["num_experts_per_tok"] = min(raw["num_experts_per_tok"], experts)
        if raw["model_type"] == "deepseek_v3":
            raw["n_group"] = raw["topk_group"] = 1
    if vocab is not None:
        raw["vocab_size"] = vocab
    return transformers.AutoConfig.for_model(raw.pop("model_type"), **raw)


def measure(row: dict) -> dict:
    """One row in this process (call it in a fresh one)."""
    import torch

    import tritonreshard as trs
    from tritonreshard.vllm import trace as vtrace
    from tritonreshard.vllm._verify import verify_model

    config = _config(row["model"], row.get("layers"), row.get("experts"), row.get("vocab"))
    tp, ep, before = row["tp"], row["ep"], row.get("before", False)
    trainers, inference = list(range(8)), list(range(8, 8 + tp))
    kw = dict(tp=tp, trainer_ranks=trainers, inference_ranks=inference, dtype=torch.bfloat16, expert_parallel=ep)
    spec = trs.recipes.hf_to_vllm(config, **kw, src_dtype=torch.bfloat16)
    out = {**row, "params_B": round(sum(lay.numel for lay in spec.src.values()) / 1e9, 2),
           "layers": config.num_hidden_layers}
    rank = tp - 1
    if row["what"] == "verify":
        build = {} if before else {"ranks": [rank]}
        models = vtrace.rank_models(config, tp, dtype=torch.bfloat16, expert_parallel=ep, **build)
        model = models[-1]
        t0, c0 = time.perf_counter(), time.process_time()
        peak0 = _rss()
        with vtrace._as_tp_rank(tp, rank):
            stats = verify_model(model, spec, rank=inference[rank], tp_rank=rank,
                                 **({"sample": True} if before else {}))
        out |= {"s": round(time.perf_counter() - t0, 2), "cpu_s": round(time.process_time() - c0, 2),
                "peak_MiB": _mib(stats.get("verify_peak_bytes")), "held_MiB": _mib(stats.get("verify_held_bytes")),
                "rss_growth_MiB": round((_rss() - peak0) / 2**20), "params_checked": stats["verify_params"],
                "elements_checked": stats.get("verify_elements"),
                "layers_checked": len(stats["verify_layers"]) if isinstance(stats["verify_layers"], list)
                else stats["verify_layers"]}
    else:
        stats: dict = {}
        t0, c0 = time.perf_counter(), time.process_time()
        peak0 = _rss()
        traced = vtrace.trace_recipe(config, **kw, src_dtype=torch.bfloat16, stats=stats)
        out |= {"s": round(time.perf_counter() - t0, 2), "cpu_s": round(time.process_time() - c0, 2),
                "peak_MiB": _mib(stats.get("trace_peak_bytes")), "held_MiB": _mib(stats.get("trace_held_bytes")),
                "rss_growth_MiB": round((_rss() - peak0) / 2**20),
                "equal_to_hand_written": vtrace.recipe_differences(traced, spec) == []}
    out["maxrss_MiB"] = round(_rss() / 2**20)
    out["code"] = str(Path(trs.__file__).resolve().parent.parent)
    if before:  # its peak figures were computed, not measured: only the resident set's growth counts
        out["peak_MiB"] = out["held_MiB"] = None
    return out


def _rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # the process's peak, bytes


def _mib(b) -> int | None:
    return None if b is None else round(b / 2**20)


def _run(row: dict, tree: Path | None, timeout: float) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree or ROOT))
    proc = subprocess.run([sys.executable, __file__, "--row", json.dumps(row)], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=str(tree or ROOT))
    if proc.returncode:
        return {**row, "error": (proc.stderr or proc.stdout).strip().splitlines()[-1][:300]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def rows(full: bool, cut: bool) -> list[dict]:
    out = []
    if full:
        for m in MODELS:
            for ep in ((False, True) if m != "llama-3-8b" else (False,)):
                out += [{"model": m, "tp": 8, "ep": ep, "what": "verify"},
                        {"model": m, "tp": 8, "ep": ep, "what": "trace"}]
    if cut:  # the sizes the element check fits in here, both sides: the growth between two sizes
        for what in ("verify", "trace"):
            # (the element-wise trace of two 8B layers would need about 22 GB: one only)
            out += [{"model": "llama-3-8b", "tp": 8, "ep": False, "what": what, "layers": n, "vocab": 1024}
                    for n in ((1, 2) if what == "verify" else (1,))]
            out += [{"model": "qwen3-30b-a3b", "tp": 2, "ep": False, "what": what, "layers": 1, "experts": e,
                     "vocab": 4096} for e in (2, 14)]
    return out


def table(lines: list[dict]) -> str:
    """The rows as the markdown table of docs/vllm.md."""
    out = ["| model | layers | TP | EP | step | code | wall s | CPU s | peak MiB | held MiB | checked |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in lines:
        size = f"{r.get('params_B')}B"
        cut = ", ".join(f"{k} {r[k]}" for k in ("experts", "vocab") if k in r)
        model = f"{r['model']} ({size}{', ' + cut if cut else ''})"
        peak = r.get("peak_MiB") if r.get("peak_MiB") is not None else f"{r.get('rss_growth_MiB')} (RSS growth)"
        checked = (f"{r['layers_checked']} layers, {r['params_checked']} params, "
                   f"{r['elements_checked'] / 1e9:.2f}G elements" if r.get("elements_checked") else
                   f"{r['layers_checked']} layers, {r['params_checked']} params" if "layers_checked" in r else
                   f"equal to hand-written: {r.get('equal_to_hand_written')}")
        out.append(f"| {model} | {r.get('layers')} | {r['tp']} | {'yes' if r['ep'] else 'no'} | {r['what']} | "
                   f"{'before' if r.get('before') else 'after'} | {r.get('s', r.get('error'))} | {r.get('cpu_s')} | "
                   f"{peak} | {r.get('held_MiB')} | {checked} |")
    return "\n".join(out)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--row", help=argparse.SUPPRESS)
    ap.add_argument("--all", action="store_true", help="every full-size row, then the cut sizes before and after")
    ap.add_argument("--full", action="store_true", help="the full-size rows (after only)")
    ap.add_argument("--cut", action="store_true", help="the cut-size rows, before (with --before) and after")
    ap.add_argument("--before", type=Path, help="a checkout of the element-wise check (git worktree add ...)")
    ap.add_argument("--timeout", type=float, default=1200)
    ap.add_argument("--out", type=Path, help="also write the rows as JSON lines here")
    ap.add_argument("--table", type=Path, help="print the JSON lines of this file as docs/vllm.md's table")
    args = ap.parse_args(argv)
    if args.table:
        print(table([json.loads(x) for x in args.table.read_text().splitlines() if x.strip()]))
        return
    if args.row:
        print(json.dumps(measure(json.loads(args.row))))
        return
    todo = rows(args.all or args.full, args.all or args.cut)
    for row in todo:
        results = [_run(row, None, args.timeout)]
        if args.before and ("layers" in row):
            results.append(_run({**row, "before": True}, args.before, args.timeout))
        for r in results:
            line = json.dumps(r)
            print(line, flush=True)
            if args.out:
                with args.out.open("a") as f:
                    f.write(line + "\n")


if __name__ == "__main__":
    main()
