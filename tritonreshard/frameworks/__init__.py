"""tritonreshard inside the RL frameworks that own the training loop.

* :mod:`tritonreshard.frameworks.trl`: a drop-in for TRL's ``VLLMClient`` weight sync (GRPO and
  the other trainers in server mode), refitting a ``vllm serve`` through tritonreshard.

Each module imports its framework; importing this package imports none. See docs/frameworks.md.
"""
__all__: list[str] = []
