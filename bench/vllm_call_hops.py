"""Probe: where the time of a weight-update call goes on an idle `vllm serve` (issue 41 item 1).

One server (``python -m vllm.entrypoints.openai.api_server`` under ``VLLM_SERVER_DEV_MODE=1``,
backend ``"tritonreshard"``, ``--tp`` workers, ``--model`` of examples/vllm_refit.py; default the tied
``tiny-qwen2``) and two FSDP trainer processes (examples/vllm_refit.py's); no completion requests.
A timing plugin (bench/_hops_probe.py, put on the server's PYTHONPATH through a temporary
dist-info: nothing of it is in the library) logs ``time.monotonic()`` at each hop of the three
calls ``/start_weight_update``, ``/update_weights``, ``/finish_weight_update``; this script adds the
client's send and reply times and prints, per call, hop -> ms:

* ``client -> handler``: the HTTP request until vLLM's ``AsyncLLM.<method>`` is entered;
* ``api -> engine core``: until the engine core's busy loop handles the utility request;
* ``core -> executor``: until ``MultiprocExecutor.collective_rpc`` is entered;
* ``executor -> worker r``: the broadcast until worker r's ``_execute_worker_rpc`` starts;
* ``worker r``: the worker's own call (our engine's for ``update_weights``);
* ``workers -> executor``: the last worker's end until the executor has every reply;
* ``executor -> api``: the utility reply back to the API server;
* ``handler -> client``: the HTTP reply.

``--before-init N`` first times N start/finish pairs before ``/init_weight_transfer_engine`` (no
refit group, no background pull), ``--refits N`` refits after it, each after ``--gap`` idle seconds.

    python bench/vllm_call_hops.py --model tiny-qwen2 --tp 2 --refits 3 --json
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import vllm_serve_bench as sb  # noqa: E402  (its Server; it puts examples/ on the path)

ex = sb.ex
METHODS = ("start_weight_update", "update_weights", "finish_weight_update")
# --load N: N busy processes (this one and N - 1 forks of it).
_HOG = ("import os, sys\nfor _ in range(int(sys.argv[1]) - 1):\n    if os.fork() == 0:\n        break\n"
        "while True:\n    pass\n")
ROUTES = {m: "/" + m for m in METHODS}


def install_probe(folder: str) -> None:
    """The probe as a vLLM general plugin in ``folder`` (a module and its dist-info's entry point)."""
    shutil.copy(HERE / "_hops_probe.py", os.path.join(folder, "trs_hops_probe.py"))
    info = os.path.join(folder, "trs_hops_probe-0.0.dist-info")
    os.makedirs(info)
    Path(info, "METADATA").write_text("Metadata-Version: 2.1\nName: trs-hops-probe\nVersion: 0.0\n")
    Path(info, "entry_points.txt").write_text("[vllm.general_plugins]\ntrs_hops = trs_hops_probe:register\n")


def timed_call(srv, method: str, body: dict, client: str = "urllib") -> dict:
    """One update call, by ``client``: Python's urllib, or curl at ``localhost`` as the README does."""
    t0 = time.monotonic()
    if client == "curl":
        url = srv.url.replace("127.0.0.1", "localhost") + ROUTES[method]
        out = subprocess.run(["curl", "-sf", url, "-H", "Content-Type: application/json", "-d", json.dumps(body)],
                             capture_output=True, text=True, timeout=300)
        if out.returncode != 0:
            raise RuntimeError(f"curl {url}: exit {out.returncode}: {out.stdout} {out.stderr}")
    else:
        srv.post(ROUTES[method], body)
    return {"method": method, "send": t0, "reply": time.monotonic()}


def hops(call: dict, events: list[dict]) -> dict:
    """Hop -> ms of one call, from the probe's events inside its client window."""
    ev = [e for e in events if e["method"] == call["method"] and call["send"] <= e["t"] <= call["reply"]]

    def at(where, event, pid=None):
        ts = [e["t"] for e in ev if e["where"] == where and e["event"] == event and (pid is None or e["pid"] == pid)]
        if len(ts) != 1:
            raise RuntimeError(f"{call['method']}: {len(ts)} {where}/{event} events in its window: {ev}")
        return ts[0]

    workers = sorted({e["pid"] for e in ev if e["where"] == "worker"})
    ms = lambda a, b: round((b - a) * 1e3, 1)  # noqa: E731
    out = {"client -> handler": ms(call["send"], at("api", "enter")),
           "api -> engine core": ms(at("api", "enter"), at("core-request", "enter")),
           "core -> executor": ms(at("core-request", "enter"), at("exec", "enter"))}
    for r, pid in enumerate(workers):
        out[f"executor -> worker {r}"] = ms(at("exec", "enter"), at("worker", "enter", pid))
        out[f"worker {r}"] = ms(at("worker", "enter", pid), at("worker", "exit", pid))
    out["workers -> executor"] = ms(max(at("worker", "exit", p) for p in workers), at("exec", "exit"))
    out["executor -> api"] = ms(at("exec", "exit"), at("api", "exit"))
    out["handler -> client"] = ms(at("api", "exit"), call["reply"])
    out["total"] = ms(call["send"], call["reply"])
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=sorted(ex.MODELS), default="tiny-qwen2")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--refits", type=int, default=3, help="refits timed after init (default 3)")
    ap.add_argument("--before-init", type=int, default=2, help="start/finish pairs before init (default 2)")
    ap.add_argument("--gap", type=float, default=2.0, help="idle seconds before each timed refit (default 2)")
    ap.add_argument("--pause", action="store_true", help="each refit inside /pause?mode=keep ... /resume "
                    "(the README's flow)")
    ap.add_argument("--client", choices=("urllib", "curl"), default="urllib", help="who makes the timed calls")
    ap.add_argument("--load", type=int, default=0, help="N busy processes in this session while timing "
                    "(the client's side computing; default 0)")
    ap.add_argument("--own-session", action="store_true", help="the server in a session of its own (the kernel "
                    "schedules each session as a group: under --load each call then waits out vLLM's reader spin)")
    ap.add_argument("--spin-s", type=float, default=None, help="set vLLM's reader busy loop "
                    "(SpinCondition.busy_loop_s, 1 s in 0.32) through the probe")
    ap.add_argument("--json", action="store_true", help="print a JSON summary as the last stdout line")
    args = ap.parse_args(argv)
    if args.load < 0 or (args.spin_s is not None and not args.spin_s >= 0):
        ap.error(f"--load must be >= 0 and --spin-s >= 0, got --load {args.load} --spin-s {args.spin_s}")
    import tritonreshard as trs
    import tritonreshard.vllm as trs_vllm

    tmp = tempfile.mkdtemp(prefix="trs-hops-")
    probe = os.path.join(tmp, "probe")
    os.makedirs(probe)
    install_probe(probe)
    log = os.path.join(tmp, "hops.jsonl")
    os.environ["TRS_HOPS_LOG"] = log
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), probe) if p)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if args.spin_s is not None:
        os.environ["TRS_HOPS_SPIN_S"] = str(args.spin_s)
    cfg = ex.model_config(args.model)
    model_dir = os.path.join(tmp, "model")
    hf = sb.tiny_model(cfg, seed=ex.SEED, path=model_dir)
    train_path = os.path.join(tmp, "train.safetensors")
    from safetensors.torch import save_file

    save_file({n: t.contiguous() for n, t in ex.training_tensors(hf).items()}, train_path)
    trs.secret_for_children()
    srv = sb.Server(model_dir, args.tp, sb.free_port(), os.path.join(tmp, "server.log"), eager=True,
                    own_session=args.own_session)
    summary = {"model": args.model, "tp": args.tp, "pause": args.pause, "client": args.client,
               "load": args.load, "own_session": args.own_session, "spin_s": args.spin_s, "calls": []}
    group, hogs = None, []
    try:
        srv.wait_up()
        # Busy processes for the timed part, in this script's session (as a test session's own
        # computing is beside the server it started), one process group to end.
        if args.load:
            hogs = [subprocess.Popen([sys.executable, "-c", _HOG, str(args.load)], process_group=0)]
        summary["load_avg"] = os.getloadavg()[0]
        calls = []
        for _ in range(args.before_init):
            time.sleep(args.gap)
            calls.append(dict(timed_call(srv, "start_weight_update", {}), phase="before init"))
            calls.append(dict(timed_call(srv, "finish_weight_update", {}), phase="before init"))
        ns = argparse.Namespace(model=args.model, tp=args.tp)
        group = ex.TrainerGroup(ex.mp.get_context("spawn"), train_path, ns, tag="hops")
        inference = list(range(len(ex.TRAINERS), len(ex.TRAINERS) + args.tp))
        srv.post("/init_weight_transfer_engine", {"init_info": trs_vllm.init_info(
            store=group.store, trainer_ranks=ex.TRAINERS, inference_ranks=inference, group="hops", timeout=300.0)})
        for _ in ex.TRAINERS:
            group.expect("ready")
        for v in range(1, args.refits + 1):
            group.step(v)
            group.fence()  # the workers pulled it in the background
            time.sleep(args.gap)
            if args.pause:
                srv.post("/pause?mode=keep")
            calls.append(dict(timed_call(srv, "start_weight_update", {}, args.client), phase=f"refit {v}"))
            calls.append(dict(timed_call(srv, "update_weights", {"update_info": {"version": v}}, args.client),
                              phase=f"refit {v}"))
            calls.append(dict(timed_call(srv, "finish_weight_update", {"weight_version": str(v)}, args.client),
                              phase=f"refit {v}"))
            srv.post("/reset_prefix_cache")
            if args.pause:
                srv.post("/resume")
        time.sleep(0.5)
        events = [json.loads(line) for line in Path(log).read_text().splitlines()]
        for call in calls:
            summary["calls"].append({"phase": call["phase"], "method": call["method"], "hops_ms": hops(call, events)})
        summary["worker"] = [dict(zip(("rank", "version", "kind", "total_ms", "wait_ms", "agree_ms", "copy_ms",
                                       "post_ms"), line, strict=True)) for line in sb.INSTALLED.findall(srv.log())]
    finally:
        for h in hogs:
            os.killpg(h.pid, signal.SIGKILL)
            h.wait()
        if group is not None:
            group.stop()
        srv.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    print_table(summary)
    if args.json:
        print(json.dumps(summary), flush=True)
    return summary


def print_table(summary: dict) -> None:
    calls = summary["calls"]
    names = [h for h in calls[0]["hops_ms"]] if calls else []
    print(f"{summary['model']}, TP={summary['tp']}, load {summary['load_avg']:.1f} ({summary['load']} busy "
          f"processes), server in {'its own' if summary['own_session'] else 'this'} session, reader spin "
          f"{'1 s (vLLM)' if summary['spin_s'] is None else str(summary['spin_s']) + ' s'}; ms per hop", flush=True)
    for call in calls:
        print(f"{call['phase']:>12} {call['method']:<22} " + "  ".join(f"{n}: {call['hops_ms'][n]}" for n in names))
    for w in summary.get("worker", []):
        print("worker rank {rank}: version {version} ({kind}) in {total_ms} ms: wait {wait_ms}, agree {agree_ms}, "
              "copy {copy_ms}, post-processing {post_ms} ms".format(**w))


if __name__ == "__main__":
    main()
