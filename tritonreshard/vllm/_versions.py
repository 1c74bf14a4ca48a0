"""What differs between the vLLM versions the backend supports (``vllm >= 0.32, < 0.35``), in one place.

* **The reload calls.** vLLM 0.34 renamed the begin and end of a checkpoint-format reload to
  ``start_reload(model)`` / ``finish_reload(model, model_config, device)`` (``reload/lifecycle.py``:
  they pick the reload mode ``VLLM_RELOAD_MODE`` selects and set vLLM's process-wide
  ``weight_update_active()``); 0.32 and 0.33 have only ``initialize_layerwise_reload(model)`` /
  ``finalize_layerwise_reload(model, model_config)``, which 0.34 still exports. The new names are
  used where they exist (:func:`reload_names`). The apply step materializes layers through the
  layerwise reload's own records, so 0.34's ``VLLM_RELOAD_MODE=direct`` is refused at init
  (:func:`reload_mode_problem`).
* **The end of a failed update** on the TP ranks that do not raise (see :mod:`._agree`): 0.34's
  worker ends it with ``_end_weight_update(refresh=False)``, which also gives back the KV cache
  memory lent to the update; 0.32 and 0.33 clear ``_weight_update_active`` and reset the target
  inline (:func:`end_session`).
* **Incomplete weights.** 0.34's worker marks the weights incomplete when a session starts
  (``_incomplete_weight_updates``) and clears the mark only on a successful
  ``finish_weight_update``; while it is set, ``EngineCore.is_inference_ready()`` is false. The
  backend applies only once every TP rank holds the whole version, so a refit refused before the
  apply touched nothing: :func:`weights_complete` clears the mark then, :func:`weights_incomplete`
  sets it before the apply writes anything (0.32 and 0.33 have no mark: both do nothing).

Imported inside vLLM's workers only.
"""
from __future__ import annotations

from collections.abc import Callable

import vllm.envs as envs
from vllm.model_executor.model_loader import reload as _reload

__all__ = ["SUPPORTED", "end_session", "finish_reload", "reload_mode_problem", "reload_names", "start_reload",
           "weights_complete", "weights_incomplete"]

#: The vLLM versions the backend supports (pyproject.toml's ``vllm-cuda`` extra says the same).
SUPPORTED = ">=0.32,<0.35"

#: The key of the served model (not a speculative draft: the backend refuses draft updates) in
#: 0.34's ``Worker._incomplete_weight_updates``.
_TARGET = False


def reload_names(has: Callable[[str], bool]) -> tuple[str, str]:
    """The names of the reload's begin and end in a vLLM whose reload package exports the names
    ``has`` says it does: 0.34's ``start_reload`` / ``finish_reload`` where both exist, else
    ``initialize_layerwise_reload`` / ``finalize_layerwise_reload``."""
    if has("start_reload") and has("finish_reload"):
        return "start_reload", "finish_reload"
    return "initialize_layerwise_reload", "finalize_layerwise_reload"


_START, _FINISH = reload_names(lambda name: hasattr(_reload, name))


def start_reload(model) -> None:
    """Begin a layerwise reload of ``model`` (every layer's load-format tensors recorded)."""
    getattr(_reload, _START)(model)


def finish_reload(model, model_config, device) -> None:
    """End the reload :func:`start_reload` began (0.34's call also takes the device)."""
    # By name (getattr), as the begin: an attribute spelled here would not exist in 0.32 or 0.33.
    end = getattr(_reload, _FINISH)
    if _FINISH == "finish_reload":
        end(model, model_config, device)
    else:
        end(model, model_config)


def reload_mode_problem() -> str | None:
    """Why this process's reload mode cannot be served (None: it can). 0.34's direct mode views
    every tensor back to its checkpoint layout in place, with no layerwise records to materialize
    from; 0.32 and 0.33 have only the layerwise reload (they do not read the variable)."""
    mode = getattr(envs, "VLLM_RELOAD_MODE", "layerwise")
    if mode != "layerwise":
        return (f"VLLM_RELOAD_MODE={mode}: the tritonreshard backend applies through "
                f"vLLM's layerwise reload; unset it (or set it to layerwise)")
    return None


def end_session(worker, engine) -> None:
    """What vLLM's worker does when ``update_weights`` raises, on a TP rank where it does not."""
    end = getattr(worker, "_end_weight_update", None)
    if end is not None:  # 0.34: also closes the KV cache loan and resets the engine's target
        end(refresh=False)
        return
    worker._weight_update_active = False
    engine.reset_weight_update_target()


def weights_complete(worker) -> None:
    """The served weights are whole (nothing of this update was applied): 0.34 serves again."""
    marks = getattr(worker, "_incomplete_weight_updates", None)
    if marks is not None:
        marks.discard(_TARGET)


def weights_incomplete(worker) -> None:
    """The apply is about to write: until a successful ``finish_weight_update`` clears it (0.34's
    worker does), the weights may be incomplete."""
    marks = getattr(worker, "_incomplete_weight_updates", None)
    if marks is not None:
        marks.add(_TARGET)
