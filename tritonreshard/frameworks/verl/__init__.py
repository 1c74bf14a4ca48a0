"""tritonreshard as verl's checkpoint-engine backend (verl 0.9.1): the actors publish their own
shards, the vLLM rollout workers read theirs, and no full tensor is built.

Name this package verl's custom backend module, with the backend, in the verl config::

    actor_rollout_ref.rollout.checkpoint_engine.backend=tritonreshard
    actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module=tritonreshard.frameworks.verl
    actor_rollout_ref.hybrid_engine=False              # trainer.v1.trainer_mode=separate_async,
    actor_rollout_ref.rollout.name=vllm                # or the fully-async trainer

verl imports it in every worker before the first sync. Importing it registers
:class:`TritonreshardCheckpointEngine` as ``"tritonreshard"`` in verl's ``CheckpointEngineRegistry``
and wraps ``ActorRolloutRefWorker.update_weights`` so that this backend (and no other) gets the
training engine instead of gathered tensors (:func:`~.actor.wrap_update_weights`: it refuses a
verl version or signature it does not know, and installs nothing once verl honours the backend's
``consumes_engine``), and ``ActorRolloutRefWorker.execute_checkpoint_engine`` so that the backend
holds the engine before verl's ``prepare`` (:func:`~.actor.wrap_execute_checkpoint_engine`: the
actors announce their parameters' dtype there). The actor side is :mod:`.actor`, the rollout side
:mod:`.rollout`.

Importing ``tritonreshard`` never imports this package (nor verl).
"""
from .actor import (
    BACKEND,
    GROUP,
    KNOWN_EXECUTE_SIGNATURE,
    KNOWN_SIGNATURE,
    KNOWN_VERL,
    ShardSource,
    Topology,
    TritonreshardCheckpointEngine,
    VerlRefitConfig,
    export_source,
    install,
    settings_problems,
    source_dtype,
    wrap_execute_checkpoint_engine,
    wrap_update_weights,
)

__all__ = ["TritonreshardCheckpointEngine", "VerlRefitConfig", "Topology", "ShardSource", "export_source",
           "source_dtype", "settings_problems", "wrap_update_weights", "wrap_execute_checkpoint_engine", "install",
           "BACKEND", "GROUP", "KNOWN_VERL", "KNOWN_SIGNATURE", "KNOWN_EXECUTE_SIGNATURE"]

# verl imports this module as its custom_backend_module in every worker: the wrap goes in here.
install()
