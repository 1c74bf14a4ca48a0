"""The environment of a probe process that builds vLLM 0.32's Qwen3.5 models: with the torchvision
stand-in of tests/_standin on ``PYTHONPATH`` where no torchvision is installed (see its docstring)."""
import importlib.util
import os
from pathlib import Path

STANDIN = Path(__file__).with_name("_standin")


def probe_env() -> dict:
    """``os.environ`` for a probe subprocess, with the stand-in first on ``PYTHONPATH`` when this
    Python has no torchvision (a real one, where installed, is left alone)."""
    env = dict(os.environ)
    if importlib.util.find_spec("torchvision") is None:
        env["PYTHONPATH"] = os.pathsep.join([str(STANDIN), *filter(None, [env.get("PYTHONPATH")])])
    return env
