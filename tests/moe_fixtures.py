"""Tiny deterministic Mixture-of-Experts checkpoints, written by transformers (never committed).

`make_moe_checkpoint(kind, path)` saves a real Hugging Face model directory (config.json from
transformers' own config class, model.safetensors with the Hub tensor names from
`save_pretrained`) for kind in MOE_KINDS. Weights are random (torch.manual_seed(0)) with
initializer_range 0.1 so routers spread tokens over many experts and greedy choices are well
separated; norm weights and biases are randomized too (transformers sets them to exactly 1 and 0),
so a loader that dropped them would be caught. No tokenizer: prompts are token ids.

Sizes: hidden 64, 4 query heads, 2 KV heads, 8 experts, top-2, vocab 256. Per kind:
    mixtral    2 layers, expert F 48 (Mixtral names: block_sparse_moe, w1/w2/w3).
    qwen2_moe  3 layers, expert F 32, shared expert F 64, layer 1 dense (mlp_only_layers, F 96),
               q/k/v bias, norm_topk_prob False.
    qwen3_moe  2 layers, expert F 32, decoder_sparse_step 2 (layer 0 dense, F 96), head_dim 32
               (!= hidden / heads), per-head q/k norm, norm_topk_prob True.
    olmoe      2 layers, expert F 32, q/k norm over the whole projection, clip_qkv 1.5,
               norm_topk_prob False.
    deepseek_v2  3 layers (layer 0 dense, F 96: first_k_dense_replace), latent attention (kv rank 32,
               q without low rank, per-head key 16 + 8 RoPE, value 16), expert F 32, 2 ungated shared
               experts, softmax routing limited to the best of 2 groups, routed scaling 1.5.
    deepseek_v3  3 layers (layer 0 dense), latent attention with a low-rank query (rank 24) and YaRN
               RoPE (factor 4, mscale_all_dim 0.8: the softmax scale and the tables' factor), sigmoid
               routing with a score-correction bias (randomized) in the best group of 2, scaling 2.5.
Not in MOE_KINDS (tests/test_glm4_moe.py runs them), GLM-4.5 MoE (transformers' glm4_moe):
    glm4_moe   3 layers (layer 0 dense, F 96), head_dim 32 with partial RoPE 0.5 (16 features rotated),
               q/k/v biases, per-head q/k norm, DeepSeek-V3's routing in the best group of 2 with a
               randomized score-correction bias, scaling 2.5, 2 ungated shared experts of F 32.
    glm4_moe_air  the same shapes at head_dim 16 (8 features rotated), no biases, no q/k norm, the best
               2 of 4 groups, one shared expert, scaling 1.0 (GLM-4.5-Air's attention options).
"""

from __future__ import annotations

from pathlib import Path

import torch

from fixtures import perturb_norm_or_bias

MOE_KINDS = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v2", "deepseek_v3")
VOCAB = 256

_COMMON = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
               rms_norm_eps=1e-6, initializer_range=0.1, vocab_size=VOCAB, bos_token_id=0,
               eos_token_id=1, pad_token_id=0, num_experts_per_tok=2, tie_word_embeddings=False)

_DEEPSEEK = dict(num_hidden_layers=3, n_routed_experts=8, moe_intermediate_size=32, intermediate_size=96,
                 n_shared_experts=2, first_k_dense_replace=1, kv_lora_rank=32, qk_nope_head_dim=16,
                 qk_rope_head_dim=8, v_head_dim=16)

_GLM4_MOE = dict(num_hidden_layers=3, n_routed_experts=8, moe_intermediate_size=32, intermediate_size=96,
                 first_k_dense_replace=1)

# kind -> (config class, model class, config overrides)
MOE_SPECS: dict[str, tuple[str, str, dict]] = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(num_hidden_layers=2, num_local_experts=8, intermediate_size=48)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  dict(num_hidden_layers=3, num_experts=8, moe_intermediate_size=32,
                       shared_expert_intermediate_size=64, intermediate_size=96, mlp_only_layers=[1],
                       decoder_sparse_step=1, norm_topk_prob=False, qkv_bias=True)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(num_hidden_layers=2, num_experts=8, moe_intermediate_size=32, intermediate_size=96,
                       decoder_sparse_step=2, head_dim=32, norm_topk_prob=True)),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM",
              dict(num_hidden_layers=2, num_experts=8, intermediate_size=32, clip_qkv=1.5,
                   norm_topk_prob=False)),
    "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM", dict(_DEEPSEEK, num_key_value_heads=4,
                    q_lora_rank=None, topk_method="group_limited_greedy", n_group=2, topk_group=1,
                    routed_scaling_factor=1.5)),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(_DEEPSEEK, num_key_value_heads=4,
                    q_lora_rank=24, n_group=2, topk_group=1, routed_scaling_factor=2.5, rope_parameters={
                        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                        "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0,
                        "mscale_all_dim": 0.8})),
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM", dict(_GLM4_MOE, head_dim=32, attention_bias=True,
                 use_qk_norm=True, n_group=2, topk_group=1, n_shared_experts=2, routed_scaling_factor=2.5,
                 rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})),
    "glm4_moe_air": ("Glm4MoeConfig", "Glm4MoeForCausalLM", dict(_GLM4_MOE, attention_bias=False, use_qk_norm=False,
                     n_group=4, topk_group=2, n_shared_experts=1, routed_scaling_factor=1.0,
                     rope_parameters={"rope_type": "default", "rope_theta": 500000.0, "partial_rotary_factor": 0.5})),
}


def build_hf_moe_model(kind: str, vocab_size: int = VOCAB, **changes):
    """The tiny transformers model of `kind` (a MOE_KINDS entry): fp32, eval, seeded weights.
    `changes` override config fields (e.g. hidden_size=256 for GGUF K-quant super-blocks)."""
    import transformers

    config_cls, model_cls, overrides = MOE_SPECS[kind]
    config = getattr(transformers, config_cls)(**{**_COMMON, "vocab_size": vocab_size, **overrides, **changes})
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if perturb_norm_or_bias(name, p):
                continue
            if name.endswith("gate.weight") and "shared" not in name:  # routers (some start at 0)
                p.copy_(config.initializer_range * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeek-V3's and GLM-4.5's (zeros at init)
                b.copy_(0.05 * torch.randn_like(b))
    return model


def make_moe_checkpoint(kind: str, path: str | Path, vocab_size: int = VOCAB) -> Path:
    """Write the tiny `kind` checkpoint (config.json + model.safetensors) into `path`; return it."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    build_hf_moe_model(kind, vocab_size).save_pretrained(path, safe_serialization=True)
    return path


def load_hf_moe_model(path: str | Path, **kwargs):
    """Reload a saved checkpoint with transformers (fp32, eager attention, eval); `kwargs` go to
    from_pretrained (a quantization_config, say)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager",
                                                **kwargs).eval()
