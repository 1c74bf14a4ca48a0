"""Recipes: the layouts and parts of a refit between a trainer's parameters and vLLM's.

Pure Python planning (no transformers or vLLM import). Modules, bottom up (each imports only those
above it in this list):

* :mod:`~tritonreshard.recipes.builder`: the vLLM side every recipe shares (:class:`RecipeSpec`,
  :class:`RecipeBuilder`, :func:`tp_layout`, vLLM's vocab padding) and the argument and size checks;
* :mod:`~tritonreshard.recipes.fp8`: vLLM's block-FP8 destinations (``quantization=``);
* :mod:`~tritonreshard.recipes.dense`: Llama, Mistral, Qwen2, Qwen3, Qwen3-MoE (:data:`FAMILIES`);
* :mod:`~tritonreshard.recipes.deepseek`: DeepSeek-V2 / V3 (MLA, dense-then-MoE layers, shared experts);
* :mod:`~tritonreshard.recipes.families`: Mixtral, Phi-3 (fused checkpoint), GLM-4.5 MoE, Gemma 3
  (:data:`FAMILY_MODEL_TYPES`);
* :mod:`~tritonreshard.recipes.hybrid`: Qwen3-Next and Qwen3.5 (gated DeltaNet + gated attention, MoE);
* :mod:`~tritonreshard.recipes.hf`: Hugging Face parameters under FSDP (``hf_to_vllm``), dispatched by
  ``config.model_type`` through the registry :data:`RECIPES`;
* :mod:`~tritonreshard.recipes.lora`: PEFT LoRA adapters -> vLLM's per-TP-rank LoRA slots (``lora_to_vllm``);
* :mod:`~tritonreshard.recipes.megatron`: Megatron-Core TP x PP x DP x EP shards (``megatron_to_vllm``,
  ``megatron_tensors``, ``megatron_bind``).
"""
from .builder import RecipeBuilder, RecipeSpec, pad_vocab_size, tp_layout, vllm_layout
from .deepseek import DEEPSEEK_MODEL_TYPES, build_deepseek, deepseek_to_vllm
from .dense import FAMILIES, Family, build_dense
from .families import FAMILY_MODEL_TYPES, build_family
from .hf import RECIPES, hf_to_vllm
from .hybrid import HYBRID_MODEL_TYPES, build_hybrid
from .lora import LORA_MODEL_TYPES, LORA_MODULES, PEFT_PREFIX, LoraSpec, lora_to_vllm
from .megatron import Megatron, megatron_bind, megatron_tensors, megatron_to_vllm, megatron_vocab_size

__all__ = ["hf_to_vllm", "RECIPES", "RecipeSpec", "RecipeBuilder", "tp_layout", "vllm_layout", "Family", "FAMILIES",
           "pad_vocab_size", "build_dense", "build_deepseek", "deepseek_to_vllm", "DEEPSEEK_MODEL_TYPES", "Megatron",
           "megatron_to_vllm", "megatron_tensors", "megatron_bind", "megatron_vocab_size", "lora_to_vllm", "LoraSpec",
           "LORA_MODEL_TYPES", "LORA_MODULES", "PEFT_PREFIX", "build_family", "FAMILY_MODEL_TYPES",
           "build_hybrid", "HYBRID_MODEL_TYPES"]
