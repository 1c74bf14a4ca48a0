"""Several runs of examples/vllm_refit.py in ONE driver process, one after the other: each run is
the example's own ``main(argv)`` (its engine, its trainer processes, its checks), started when the
previous run's engine and trainers are gone, with the environment the batch started with. A run's
own cost is its engine and trainers; the driver's start (importing torch, transformers and all of
vLLM: 10-15 s on 2 busy cores) is paid once for the batch instead of once per model.

Usage: python _refit_batch.py RUNS.json   (used by tests/test_families_live.py and tests/test_vllm.py)

``RUNS.json``: a list of argument lists for ``main`` (``--json`` is added). Prints one line per run,
``TRS-BATCH {"argv", "summary" | "error", "stdout"}``: the run's summary (what ``--json`` prints
last), or the traceback of what it raised; ``stdout``: what the run printed (its checks' lines).
A run that fails does not stop the next.
"""
import contextlib
import io
import json
import os
import sys
import traceback

PREFIX = "TRS-BATCH "


def run_batch(runs, *, env, timeout_per_run: float, workdir) -> tuple[dict, str]:
    """The tests' side: runs ``runs`` (argument lists, ``--model`` first) in one driver process.
    Returns ``({model: its record}, the batch's exit status and output tails, for failure messages)``."""
    import subprocess
    from pathlib import Path

    path = Path(workdir) / "runs.json"
    path.write_text(json.dumps(runs))
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), str(path)], capture_output=True, text=True,
                          timeout=timeout_per_run * len(runs), env=env, cwd=root)
    records = [json.loads(line[len(PREFIX):]) for line in proc.stdout.splitlines() if line.startswith(PREFIX)]
    # A string, not a tuple: pytest shortens a tuple's repr to a line, which cut the worker's error off.
    log = f"exit {proc.returncode}\n--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-6000:]}"
    return {r["argv"][1]: r for r in records}, log


def summary_of(batch, model: str) -> tuple[dict, str]:
    """``(summary, what the run printed)`` of ``model``'s run in ``batch`` (:func:`run_batch`'s
    return); fails with the run's traceback or the batch's output where there is none, or where the
    run's own verdict (``summary["ok"]``) is False."""
    records, log = batch
    assert model in records, f"no record of {model}'s run\n{log}"
    record = records[model]
    assert "error" not in record, f"{record['error']}\n{log}"
    assert record["summary"]["ok"], (record["summary"], log)
    return record["summary"], record["stdout"]


def main(path: str) -> int:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
    import vllm_refit  # the trainers' processes import its modules by name (spawn passes sys.path on)

    failed = 0
    with open(path) as f:
        runs = json.load(f)
    for argv in runs:
        out = io.StringIO()
        record = {"argv": argv}
        environ = dict(os.environ)  # a run sets what its processes inherit (--hosts 2: the workers' host)
        try:
            with contextlib.redirect_stdout(out):
                record["summary"] = vllm_refit.main([*argv, "--json"])
        except BaseException:  # this run's failure, reported; the next run still runs
            record["error"] = traceback.format_exc()
            failed += 1
        finally:  # each run starts from the batch's environment, as a process of its own would
            os.environ.clear()
            os.environ.update(environ)
        record["stdout"] = out.getvalue()
        print(PREFIX + json.dumps(record), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
