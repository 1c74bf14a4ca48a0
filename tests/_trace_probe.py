"""Run under a Python that has vLLM: tests/test_trace.py's traced-equals-hand-written check for the
cases in ``CASES.json`` (``[[model_type, tp, ep], ...]``), in this process, writing ``OUT.json``:
``{"type-tp-ep": None, or the failed check's message}``. For the types whose vLLM module this
pytest process cannot import (Qwen3.5's needs torchvision: run with tests/_torchvision.probe_env()).

Usage: python _trace_probe.py CASES.json OUT.json
"""
import json
import sys

from test_trace import traced_equals_hand_written

if __name__ == "__main__":
    import gc

    gc.freeze()  # what the imports made lives as long as this process; see tests/conftest.py
    out = {}
    for model_type, tp, ep in json.loads(open(sys.argv[1]).read()):
        try:  # each case's own verdict, every case run
            traced_equals_hand_written(model_type, tp, ep)
            out[f"{model_type}-{tp}-{ep}"] = None
        except AssertionError as exc:
            out[f"{model_type}-{tp}-{ep}"] = f"{type(exc).__name__}: {exc}"
    with open(sys.argv[2], "w") as f:
        json.dump(out, f)
