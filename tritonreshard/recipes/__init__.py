"""Recipes: the layouts and parts of a refit between a trainer's parameters and vLLM's.

Pure Python planning (no transformers or vLLM import). One module per source family:

* :mod:`~tritonreshard.recipes.hf`: Hugging Face parameters under FSDP (``hf_to_vllm``), and the
  vLLM destination side every recipe shares.
* :mod:`~tritonreshard.recipes.deepseek`: DeepSeek-V2 / V3 (MLA, dense-then-MoE layers, shared
  experts), dispatched from ``hf_to_vllm`` by ``config.model_type``.
* :mod:`~tritonreshard.recipes.megatron`: Megatron-Core TP x PP x DP x EP shards (``megatron_to_vllm``,
  ``megatron_tensors``, ``megatron_bind``).
"""
from .deepseek import DEEPSEEK_MODEL_TYPES, deepseek_to_vllm
from .hf import FAMILIES, Family, RecipeSpec, hf_to_vllm, pad_vocab_size
from .megatron import Megatron, megatron_bind, megatron_tensors, megatron_to_vllm, megatron_vocab_size

__all__ = ["hf_to_vllm", "RecipeSpec", "Family", "FAMILIES", "pad_vocab_size", "vllm_layout", "deepseek_to_vllm",
           "DEEPSEEK_MODEL_TYPES", "Megatron", "megatron_to_vllm", "megatron_tensors", "megatron_bind",
           "megatron_vocab_size"]
