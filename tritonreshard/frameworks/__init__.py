"""tritonreshard inside the RL frameworks that own the training loop.

* :mod:`tritonreshard.frameworks.trl`: a drop-in for TRL's ``VLLMClient`` weight sync (GRPO and
  the other trainers in server mode), refitting a ``vllm serve`` through tritonreshard.
* :mod:`tritonreshard.frameworks.verl`: verl 0.9.1's checkpoint-engine backend ``"tritonreshard"``
  (its ``custom_backend_module``): each actor rank publishes its own shards
  (:mod:`~tritonreshard.frameworks.verl.actor`) and verl's vLLM rollout workers pull theirs
  (:mod:`~tritonreshard.frameworks.verl.rollout`).

Each module imports its framework; importing this package imports none. See docs/frameworks.md.
"""
__all__: list[str] = []
