"""Recipes: the layouts and parts of a refit between a trainer's parameters and vLLM's.

Pure Python planning (no transformers or vLLM import). One module per source family:

* :mod:`~tritonreshard.recipes.hf`: Hugging Face parameters under FSDP (``hf_to_vllm``), and the
  vLLM destination side every recipe shares.
* :mod:`~tritonreshard.recipes.deepseek`: DeepSeek-V2 / V3 (MLA, dense-then-MoE layers, shared
  experts), dispatched from ``hf_to_vllm`` by ``config.model_type``.
"""
from .deepseek import DEEPSEEK_MODEL_TYPES, deepseek_to_vllm
from .hf import FAMILIES, Family, RecipeSpec, hf_to_vllm, pad_vocab_size

__all__ = ["hf_to_vllm", "RecipeSpec", "Family", "FAMILIES", "pad_vocab_size", "deepseek_to_vllm",
           "DEEPSEEK_MODEL_TYPES"]
