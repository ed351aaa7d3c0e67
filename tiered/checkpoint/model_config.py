"""ModelConfig: a model's hyperparameters, from an HF config.json or GGUF metadata.

Only what the math needs lives here; it is read once and never mutated (llama2.c's `Config`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

from tiered.errors import CheckpointError, UnsupportedModelError

# HF `model_type` -> family. Dense families share one implementation (models/llama.py); MoE
# families share models/moe.py.
DENSE_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3")
MOE_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v2", "deepseek_v3", "glm4_moe", "gpt_oss")
QWEN_MOE_TYPES = ("qwen2_moe", "qwen3_moe")  # read decoder_sparse_step / mlp_only_layers
DEEPSEEK_TYPES = ("deepseek_v2", "deepseek_v3")  # multi-head latent attention, shared experts, grouped routing
# GLM-4.5 / 4.5-Air / 4.6: Llama-style attention with partial RoPE and DeepSeek-V3's MoE block
# multimodal config.json files whose text_config is the model tiered runs (Gemma 3 4B-27B's
# Gemma3ForConditionalGeneration, Mistral Small 3.1 / 3.2's and Magistral's Mistral3ForConditionalGeneration) ->
# the text model's type where the text_config does not name it
MULTIMODAL_TEXT = {"gemma3": "gemma3_text", "mistral3": "mistral"}
# the GLU activations of an MLP: SiLU (SwiGLU, every family but Gemma) and GELU's tanh approximation (GeGLU,
# Gemma 3's gelu_pytorch_tanh)
HIDDEN_ACTS = ("silu", "gelu_tanh")
ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")
# DeepSeek routers (models/moe.DeepSeekRouter): V2's softmax with plain or group-limited top-k, V3's
# sigmoid with a score-correction bias and group-limited top-k (topk_method "noaux_tc")
TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")



BIAS_ALIGN = 32  # a biased expert projection's in-features are padded to a multiple of this (int8-g32 / int4 groups)


def biased_width(k: int) -> int:
    """In-features of an expert projection over k inputs whose bias is an extra input column (gpt-oss):
    k + 1 rounded up to a multiple of BIAS_ALIGN (32): the weight's columns are [W | b | 0 ...], the
    input's [x | 1 | 0 ...]. E.g. 2880 -> 2912 (gpt-oss-20b / -120b), 64 -> 96."""
    return (k + 1 + BIAS_ALIGN - 1) // BIAS_ALIGN * BIAS_ALIGN


def expert_shapes(hidden: int, intermediate: int, bias: bool) -> tuple[tuple[int, int], tuple[int, int],
                                                                       tuple[int, int]]:
    """(gate, up, down) shapes [out, in] of one routed expert (ModelConfig.expert_shapes): (F, D),
    (F, D), (D, F), or with biases as padded input columns (F, biased_width(D)) twice and
    (D, biased_width(F))."""
    D, F = hidden, intermediate
    if not bias:
        return (F, D), (F, D), (D, F)
    return (F, biased_width(D)), (F, biased_width(D)), (D, biased_width(F))


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Hyperparameters of a decoder-only transformer (dense or MoE).

    Attributes (units in brackets):
        model_type: HF model_type, e.g. "llama", "qwen3", "mixtral".
        vocab_size, hidden_size, intermediate_size: [elements].
        num_hidden_layers, num_attention_heads, num_key_value_heads, head_dim: [count]/[elements].
        rms_norm_eps: epsilon of every RMSNorm.
        rope_theta: RoPE base; rope_scaling: None or a dict with "rope_type" in ROPE_TYPES.
        max_position_embeddings: trained context window [tokens].
        tie_word_embeddings: lm_head shares embed_tokens' weight.
        attention_bias: q/k/v projections carry a bias (Qwen2, Qwen2-MoE).
        o_proj_bias: the output projection carries a bias too (HF Llama, Qwen3, Qwen3-MoE and OLMoE
            tie it to `attention_bias`; Qwen2 and Mistral never have one).
        qk_norm: RMSNorm on q and k before RoPE (Qwen3, Qwen3-MoE, OLMoE).
        qk_norm_scope: "head" = over each head's hd elements (Qwen3), weights [hd]; "proj" = over
            the whole projection before splitting into heads (OLMoE), weights [H*hd] / [Hkv*hd].
        clip_qkv: q, k, v are clamped to [-clip_qkv, clip_qkv] after the q/k norm (OLMoE), or None.
        sliding_window: keys older than this many positions are masked (Mistral), or None.
        num_experts, num_experts_per_tok: routed experts E and top-k (0 when dense).
        moe_intermediate_size: F of each routed expert [elements]; dense layers of an MoE model
            (see `is_moe_layer`) use `intermediate_size`.
        shared_expert_intermediate_size: F of the always-on shared expert (Qwen2-MoE), 0 = none.
        norm_topk_prob: renormalize the top-k router probabilities to sum 1 (always for Mixtral).
        decoder_sparse_step, mlp_only_layers: which layers are MoE (Qwen-MoE): layer i is MoE when
            i is not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0.
        bos_token_id, eos_token_ids: special tokens from the checkpoint.

    Multi-head latent attention (DeepSeek-V2 §2.1; `is_mla` when kv_lora_rank > 0): each position
    caches one latent of kv_lora_rank elements plus one shared RoPE key of head_dim elements (=
    qk_rope_head_dim) instead of per-head keys and values; num_key_value_heads is then 1.
        q_lora_rank: rank of the low-rank query projection (q_a_proj, q_b_proj), 0 = one q_proj.
        kv_lora_rank: rank of the compressed key-value latent (kv_a_proj_with_mqa, kv_b_proj).
        qk_nope_head_dim, v_head_dim: per-head key part without RoPE and value width [elements].
        rope_interleave: RoPE rotates interleaved pairs (x0, x1), (x2, x3), ... (DeepSeek) instead
            of the two halves (Llama's rotate-half).
        partial_rotary_factor: RoPE rotates the first `rotary_dim` = head_dim * factor features of
            each query and key head (rotate-half over those) and passes the rest through (GLM-4.5:
            0.5); 1.0 = every feature.
    DeepSeek MoE (DeepSeek-V2 §2.2, DeepSeek-V3 §2.1.2):
        topk_method: a TOPK_METHODS name, "softmax" otherwise (every other MoE family's router).
        n_group, topk_group: experts split in n_group groups; tokens pick experts only from their
            topk_group best groups.
        routed_scaling_factor: multiplies the routed experts' weights.
        first_k_dense_replace, moe_layer_freq: layer i is MoE when i >= first_k_dense_replace and
            i % moe_layer_freq == 0 (DeepSeek); 0 and 1 for the other families.
        shared_expert_gated: the shared expert's output is scaled by sigmoid(shared_expert_gate(x))
            (Qwen2-MoE), else added as is (DeepSeek's shared experts).
    GLM-4.5 MoE (`glm4_moe`) is plain grouped-query attention (q/k/v biases per attention_bias,
    per-head q/k norms per use_qk_norm, partial RoPE) with DeepSeek-V3's MoE block: topk_method
    "noaux_tc", ungated shared experts, the first first_k_dense_replace layers dense.
    gpt-oss (`gpt_oss`, OpenAI's gpt-oss-20b / -120b; `_gpt_oss_fields`):
        local_window, local_layers: the layers in local_layers attend only to their last local_window
            positions (the query's own included), the others to the whole context (gpt-oss alternates
            the two per `layer_types`); None and () elsewhere (`sliding_window` is a window every layer
            shares). `window_of` gives a layer's window.
        attention_sinks: each attention head has a learned logit (`self_attn.sinks` [H]) that joins
            every query's softmax denominator and is then dropped.
        expert_bias: the router and every routed expert's gate, up and down projections carry biases.
        swiglu_limit, swiglu_alpha: the experts' clamped GLU, or None for SiLU's SwiGLU: gate clamped
            to <= limit, up to [-limit, limit], out = (up + 1) * gate * sigmoid(alpha * gate).
    Gemma 3 (`gemma3_text`, Google's Gemma 3 1B-27B; `_gemma_fields`) and Gemma 2 (`gemma2`): per-head q/k norms, local_window /
    local_layers for its sliding layers (5 of every 6), and
        hidden_act: the MLP's GLU activation, a HIDDEN_ACTS name: "silu" (SwiGLU) or "gelu_tanh" (GeGLU with
            GELU's tanh approximation, Gemma's gelu_pytorch_tanh).
        embed_scale: the embedding rows are multiplied by this (Gemma: sqrt(hidden_size), rounded to the
            embedding's dtype), 1.0 elsewhere; the tied lm_head reads the table unscaled.
        sandwich_norms: each block's output is normalized before its residual add (Gemma's
            post_attention_layernorm and post_feedforward_layernorm; the FFN's input norm is then
            pre_feedforward_layernorm): x + norm(attn(norm(x))), then h + norm(mlp(norm(h))).
        query_pre_attn_scalar: attention logits are scaled by query_pre_attn_scalar ** -0.5 instead of
            head_dim ** -0.5 (`attn_scale`), or None.
        local_rope_theta: the RoPE base of the local_layers (Gemma 3's sliding layers: 10000, unscaled), whose
            global layers take rope_theta and rope_scaling; None = every layer the same RoPE.
        attn_softcap, final_softcap: Gemma 2's tanh soft caps: each attention logit s becomes c tanh(s / c) before
            the mask and softmax (c = attn_softcap), each output logit likewise (final_softcap); None = none.
    Gemma's RMSNorm multiplies by (1 + weight): the checkpoint readers store 1 + weight (as llama.cpp's GGUF
    files hold it), so the norms here are plain RMSNorms.
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    o_proj_bias: bool = False
    qk_norm: bool = False
    qk_norm_scope: str = "head"  # "head" (Qwen3) | "proj" (OLMoE)
    clip_qkv: float | None = None
    sliding_window: int | None = None
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False
    topk_method: str = "softmax"
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    first_k_dense_replace: int = 0
    moe_layer_freq: int = 1
    shared_expert_gated: bool = True
    partial_rotary_factor: float = 1.0
    local_window: int | None = None
    local_layers: tuple[int, ...] = ()
    attention_sinks: bool = False
    expert_bias: bool = False
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.702
    hidden_act: str = "silu"
    embed_scale: float = 1.0
    sandwich_norms: bool = False
    query_pre_attn_scalar: float | None = None
    local_rope_theta: float | None = None
    attn_softcap: float | None = None
    final_softcap: float | None = None

    def __post_init__(self) -> None:
        if self.model_type not in DENSE_TYPES + MOE_TYPES:
            raise UnsupportedModelError(
                f"unsupported architecture {self.model_type!r}",
                "tiered runs " + ", ".join(DENSE_TYPES + MOE_TYPES))
        if self.num_attention_heads % self.num_key_value_heads:
            raise UnsupportedModelError(
                f"{self.num_attention_heads} attention heads are not a multiple of "
                f"{self.num_key_value_heads} KV heads", "check the checkpoint's config.json")
        rope_type = (self.rope_scaling or {}).get("rope_type", "default")
        if rope_type not in ROPE_TYPES:
            raise UnsupportedModelError(f"unsupported RoPE scaling {rope_type!r}",
                                        "tiered supports " + ", ".join(ROPE_TYPES))
        if rope_type == "longrope" and "attention_factor" not in self.rope_scaling:  # longrope_scaling's, phi3's
            raise UnsupportedModelError(f"unsupported RoPE scaling 'longrope' on {self.model_type}",
                                        "tiered reads LongRoPE in Phi-3 / Phi-3.5 / Phi-4 checkpoints")
        if self.qk_norm_scope not in ("head", "proj"):
            raise UnsupportedModelError(f"unknown q/k norm scope {self.qk_norm_scope!r}",
                                        "use 'head' (Qwen3) or 'proj' (OLMoE)")
        if self.is_moe and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise UnsupportedModelError(
                f"top-{self.num_experts_per_tok} routing over {self.num_experts} experts",
                "check num_experts_per_tok in the checkpoint's config.json")
        if self.decoder_sparse_step < 1 or self.moe_layer_freq < 1:
            raise UnsupportedModelError(f"decoder_sparse_step and moe_layer_freq must be >= 1, got "
                                        f"{self.decoder_sparse_step} and {self.moe_layer_freq}",
                                        "check the checkpoint's config.json")
        if self.topk_method not in ("softmax",) + TOPK_METHODS:
            raise UnsupportedModelError(f"unsupported expert routing topk_method {self.topk_method!r}",
                                        "tiered routes DeepSeek experts by " + ", ".join(TOPK_METHODS))
        if self.is_moe and (self.n_group < 1 or self.num_experts % self.n_group
                            or not 1 <= self.topk_group <= self.n_group):
            raise UnsupportedModelError(f"{self.num_experts} experts in {self.n_group} groups, top {self.topk_group} "
                                        "groups", "check n_group and topk_group in the checkpoint's config.json")
        if not (0 < self.partial_rotary_factor <= 1 and self.rotary_dim >= 2 and self.rotary_dim % 2 == 0):
            raise UnsupportedModelError(
                f"partial_rotary_factor {self.partial_rotary_factor} of head_dim {self.head_dim} gives no even "
                "rotary width", "check partial_rotary_factor in the checkpoint's config.json")
        if self.is_mla and self.rotary_dim != self.head_dim:
            raise UnsupportedModelError("latent attention rotates its whole RoPE key (partial_rotary_factor 1)",
                                        "ModelConfig.from_hf sets it")
        if self.is_mla and self.num_key_value_heads != 1:
            raise UnsupportedModelError("latent attention caches one latent per position (num_key_value_heads 1)",
                                        "ModelConfig.from_hf sets it")
        if self.local_layers and (self.local_window is None or self.local_window < 1 or self.sliding_window is not None
                                  or not all(0 <= i < self.num_hidden_layers for i in self.local_layers)):
            raise UnsupportedModelError(f"per-layer attention windows {self.local_window} over layers "
                                        f"{self.local_layers}",
                                        "check sliding_window and layer_types in the checkpoint's config.json")
        if self.hidden_act not in HIDDEN_ACTS:
            raise UnsupportedModelError(f"unsupported MLP activation {self.hidden_act!r}",
                                        "tiered's MLPs are GLUs of " + " or ".join(HIDDEN_ACTS))
        if self.hidden_act != "silu" and self.is_moe:
            raise UnsupportedModelError(f"{self.hidden_act} experts are not supported", "tiered's experts are SwiGLU")
        if self.local_rope_theta is not None and not self.local_layers:
            raise UnsupportedModelError("a local RoPE base without local layers", "ModelConfig.from_hf sets both")

    @property
    def attn_scale(self) -> float:
        """The attention logits' factor: query_pre_attn_scalar ** -0.5 (Gemma), else head_dim ** -0.5."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def local_rope(self) -> "ModelConfig | None":
        """The config whose RoPE (rope_inv_freq, Rotary) the local_layers rotate by: rope_theta
        local_rope_theta and no scaling; None where every layer rotates by this config's own."""
        if self.local_rope_theta is None:
            return None
        return replace(self, rope_theta=self.local_rope_theta, rope_scaling=None, local_rope_theta=None)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def rotary_dim(self) -> int:
        """Features of each query / key head RoPE rotates, the first ones [elements]: head_dim *
        partial_rotary_factor, truncated as transformers' int(); the width of the RoPE tables."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def is_mla(self) -> bool:
        """Multi-head latent attention (DeepSeek-V2/V3): the KV cache holds a latent per position."""
        return self.kv_lora_rank > 0

    def is_moe_layer(self, layer_idx: int) -> bool:
        """Layer `layer_idx` has a routed-expert block (else a dense MLP of intermediate_size)."""
        return (self.is_moe and layer_idx not in self.mlp_only_layers
                and (layer_idx + 1) % self.decoder_sparse_step == 0
                and layer_idx >= self.first_k_dense_replace and layer_idx % self.moe_layer_freq == 0)

    def window_of(self, layer_idx: int) -> int | None:
        """The attention window of layer `layer_idx` [positions, the query's own included], None = the
        whole context: `sliding_window` where every layer shares it, else `local_window` for the
        layers in `local_layers` (gpt-oss's sliding layers)."""
        if self.sliding_window is not None:
            return self.sliding_window
        return self.local_window if layer_idx in self.local_layers else None

    @property
    def windowed(self) -> bool:
        """Whether some layer attends to a sliding window (`window_of` not None): its KV cache may forget
        what lies behind it (models/layers.KVCache.forget)."""
        return self.sliding_window is not None or bool(self.local_layers and self.local_window)

    def expert_shapes(self) -> tuple[tuple[int, int], tuple[int, int], tuple[int, int]]:
        """Shapes of one routed expert's (gate, up, down) tensors as tiered holds them on every tier:
        (F, D), (F, D), (D, F); with expert_bias (gpt-oss) each projection's bias is its weight's
        input column K (K = D for gate / up, F for down) and zero columns follow it up to a multiple of
        32 inputs: (F, Db), (F, Db), (D, Fb) with Db = biased_width(D), Fb = biased_width(F), computed
        against an input with a 1 then zeros appended (models/gpt_oss.with_one,
        quant/experts.ExpertFormat.swiglu_limit). The padding keeps every projection's in-features a
        multiple of 32, so the grouped expert kinds (int8-g32, int4) hold gpt-oss experts."""
        return expert_shapes(self.hidden_size, self.moe_intermediate_size, self.expert_bias)

    def kv_widths(self) -> tuple[int, int, int]:
        """(heads, key width, value width) of one layer's KV cache per position [elements]: Hkv, hd, hd;
        for latent attention 1, kv_lora_rank + head_dim (the latent and the RoPE key side by side), 0."""
        if self.is_mla:
            return 1, self.kv_lora_rank + self.head_dim, 0
        return self.num_key_value_heads, self.head_dim, self.head_dim

    def kv_elements_per_token(self) -> int:
        """KV-cache elements one position takes in one layer (keys and values)."""
        heads, k, v = self.kv_widths()
        return heads * (k + v)

    def attention_weight_elements(self) -> int:
        """Elements of one layer's attention projection weights (no norms, no biases): q, k, v and o;
        for latent attention q (or q_a, q_b), kv_a_proj_with_mqa, kv_b_proj and o."""
        d, H = self.hidden_size, self.num_attention_heads
        if self.is_mla:
            qk = self.qk_nope_head_dim + self.head_dim
            q = d * self.q_lora_rank + self.q_lora_rank * H * qk if self.q_lora_rank else d * H * qk
            kv = d * (self.kv_lora_rank + self.head_dim) + self.kv_lora_rank * H * (self.qk_nope_head_dim + self.v_head_dim)
            return q + kv + H * self.v_head_dim * d
        return 2 * d * H * self.head_dim + 2 * d * self.num_key_value_heads * self.head_dim

    def attention_macs_per_pair(self, decode: bool) -> int:
        """Multiply-adds of one (query token, cached position) pair over all heads: 2 H hd (scores and
        values); latent attention's decode step H (2 kv_lora_rank + r) (models/deepseek: absorbed),
        a prompt's H (n + r + v) (expanded keys and values)."""
        H = self.num_attention_heads
        if not self.is_mla:
            return 2 * H * self.head_dim
        if decode:
            return H * (2 * self.kv_lora_rank + self.head_dim)
        return H * (self.qk_nope_head_dim + self.head_dim + self.v_head_dim)

    def attention_out_width(self) -> int:
        """Width of the attention's output before o_proj [elements]: H * hd (H * v_head_dim for MLA)."""
        return self.num_attention_heads * (self.v_head_dim if self.is_mla else self.head_dim)

    def num_parameters(self) -> int:
        """Exact parameter count [elements]: weights, biases and norms; MoE counts every expert."""
        d, L = self.hidden_size, self.num_hidden_layers
        q = self.num_attention_heads * self.head_dim
        kv = self.num_key_value_heads * self.head_dim
        attn = self.attention_weight_elements()
        if self.is_mla:  # q_a and kv_a norms, kv_a_proj_with_mqa's and o_proj's biases
            attn += self.q_lora_rank + self.kv_lora_rank
            attn += (self.q_lora_rank + self.kv_lora_rank + self.head_dim + d) * self.attention_bias
        else:
            attn += (q + 2 * kv) * self.attention_bias + d * self.o_proj_bias
        if self.qk_norm:
            attn += q + kv if self.qk_norm_scope == "proj" else 2 * self.head_dim
        attn += self.num_attention_heads * self.attention_sinks
        total = 0
        for i in range(L):
            if self.is_moe_layer(i):
                mlp = self.num_experts * 3 * d * self.moe_intermediate_size + d * self.num_experts
                # expert biases (gate, up [F], down [D]) and the router's [E]
                mlp += self.num_experts * (2 * self.moe_intermediate_size + d + 1) * self.expert_bias
                mlp += self.num_experts * (self.topk_method == "noaux_tc")  # e_score_correction_bias
                if self.shared_expert_intermediate_size:
                    mlp += 3 * d * self.shared_expert_intermediate_size + d * self.shared_expert_gated
            else:
                mlp = 3 * d * self.intermediate_size
            total += attn + mlp + (4 if self.sandwich_norms else 2) * d
        emb = self.vocab_size * d * (1 if self.tie_word_embeddings else 2)
        return total + emb + d

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], source: object = "config.json") -> "ModelConfig":
        """Build from a parsed HF config.json (transformers 4.x or 5.x layout).

        Args:
            cfg: the parsed JSON.
            source: the file it came from, named in errors.
        Raises:
            CheckpointError: the config is not a JSON object, lacks a required field, or gives a
                field a value of the wrong type or range (`_check_hf_fields`; glm4_moe's
                partial_rotary_factor outside (0, 1]; gpt_oss's layer_types, swiglu_limit or
                swiglu_alpha: `_gpt_oss_fields`).
            UnsupportedModelError: unknown model_type or RoPE scaling, MLP biases, a mix of
                sliding-window and full-attention layers (but gpt_oss's), a partial RoPE of no even width, or a
                glm4_moe activation other than SiLU.
        """
        if not isinstance(cfg, dict):
            raise CheckpointError(f"{source} is a JSON {type(cfg).__name__}, not an object of model settings",
                                  "restore the checkpoint's config.json")
        model_type = cfg.get("model_type", "")
        if model_type in MULTIMODAL_TEXT:
            cfg = _text_config(cfg, model_type, source)
            model_type = cfg["model_type"]
        if model_type in _GEMMA_DEFAULTS:
            cfg = {**_GEMMA_DEFAULTS[model_type], **cfg}
        if model_type not in DENSE_TYPES + MOE_TYPES:
            archs = ", ".join(cfg.get("architectures") or []) or model_type or "unknown"
            raise UnsupportedModelError(f"unsupported architecture {archs!r}",
                                        "tiered runs " + ", ".join(DENSE_TYPES + MOE_TYPES))
        _check_hf_fields(cfg, model_type, source)
        heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        # a family's own fields, over the common ones below
        family = _deepseek_fields(cfg, model_type) if model_type in DEEPSEEK_TYPES else {}
        if family:
            head_dim = family.pop("head_dim")
        if model_type == "glm4_moe":
            family = _glm4_moe_fields(cfg, source)
        if model_type == "gpt_oss":
            family = _gpt_oss_fields(cfg, source)
        if model_type in _GEMMA_DEFAULTS:
            family = _gemma_fields(cfg, source, model_type)
        if model_type == "phi3":
            family = _phi3_fields(cfg, source)
        # transformers 5 nests RoPE settings in rope_parameters; 4.x has rope_theta + rope_scaling.
        rope = dict(cfg.get("rope_parameters") or {})
        rope.pop("partial_rotary_factor", None)  # a field of its own (glm4_moe's), not a scaling
        theta = rope.pop("rope_theta", None) or cfg.get("rope_theta", 10000.0)
        scaling = cfg.get("rope_scaling") or (rope or None)
        if scaling is not None:
            scaling = {k: v for k, v in scaling.items() if k != "partial_rotary_factor"}
            scaling.setdefault("rope_type", scaling.pop("type", "default"))
            if scaling["rope_type"] == "default":
                scaling = None
        eos = cfg.get("eos_token_id")
        eos = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        window = _sliding_window(cfg, model_type)
        if cfg.get("mlp_bias"):  # HF Llama's mlp_bias: gate/up/down biases our MLP does not have
            raise UnsupportedModelError("MLP biases (mlp_bias=true in config.json) are not supported",
                                        "use a checkpoint without MLP biases")
        moe = model_type in MOE_TYPES
        n_exp = cfg.get("num_local_experts") or cfg.get("num_experts") or cfg.get("n_routed_experts") or 0
        if model_type == "qwen2_moe":  # Qwen2-MoE names its q/k/v bias flag qkv_bias
            bias = bool(cfg.get("qkv_bias", cfg.get("attention_bias", True)))
        else:
            bias = bool(cfg.get("attention_bias", model_type == "qwen2"))
        fields = dict(
            model_type=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg.get("intermediate_size", 0),
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bias,
            o_proj_bias=bias and model_type in ("llama", "qwen3", "qwen3_moe", "olmoe"),
            qk_norm=model_type in ("qwen3", "qwen3_moe", "olmoe"),
            qk_norm_scope="proj" if model_type == "olmoe" else "head",
            clip_qkv=cfg.get("clip_qkv") if model_type == "olmoe" else None,
            sliding_window=window,
            num_experts=n_exp if moe else 0,
            num_experts_per_tok=cfg.get("num_experts_per_tok", 0) if moe else 0,
            moe_intermediate_size=(cfg.get("moe_intermediate_size") or cfg.get("intermediate_size", 0)) if moe else 0,
            shared_expert_intermediate_size=(cfg.get("shared_expert_intermediate_size") or 0)
            if model_type == "qwen2_moe" else 0,
            # Mixtral always renormalizes; the others read the flag (HF default False).
            norm_topk_prob=model_type == "mixtral" or bool(cfg.get("norm_topk_prob", False)),
            decoder_sparse_step=(cfg.get("decoder_sparse_step") or 1) if model_type in QWEN_MOE_TYPES else 1,
            mlp_only_layers=tuple(cfg.get("mlp_only_layers") or ()) if model_type in QWEN_MOE_TYPES else (),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos,
        )
        return cls(**{**fields, **family})


# transformers' defaults for DeepSeek fields a config.json may leave out (DeepseekV2Config / V3Config)
_DEEPSEEK_DEFAULTS = {
    "deepseek_v2": dict(kv_lora_rank=512, q_lora_rank=1536, qk_nope_head_dim=128, qk_rope_head_dim=64,
                        v_head_dim=128, n_shared_experts=2, routed_scaling_factor=1.0, first_k_dense_replace=0,
                        topk_method="greedy"),
    "deepseek_v3": dict(kv_lora_rank=512, q_lora_rank=1536, qk_nope_head_dim=128, qk_rope_head_dim=64,
                        v_head_dim=128, n_shared_experts=1, routed_scaling_factor=2.5, first_k_dense_replace=3,
                        n_group=8, topk_group=4, norm_topk_prob=True),
}


def _deepseek_fields(cfg: dict[str, Any], model_type: str) -> dict[str, Any]:
    """ModelConfig fields of a DeepSeek-V2/V3 config.json (transformers' deepseek_v2 / deepseek_v3),
    plus "head_dim" (the RoPE part of a key, qk_rope_head_dim).

    As transformers computes them: V2 routes by softmax with `topk_method` "greedy" or
    "group_limited_greedy" and never renormalizes the top-k weights (its router ignores
    norm_topk_prob); V3 routes by sigmoid scores plus the score-correction bias within the best
    groups ("noaux_tc") and renormalizes per norm_topk_prob. Both rotate interleaved RoPE pairs (V3
    unless rope_interleave is false) and add n_shared_experts ungated shared experts of
    moe_intermediate_size each.

    Raises:
        UnsupportedModelError: an unknown topk_method or scoring function.
    """
    d = _DEEPSEEK_DEFAULTS[model_type]

    def get(key):  # an absent field takes transformers' default; a null one stays None (q_lora_rank: none)
        return cfg[key] if key in cfg else d.get(key)

    v3 = model_type == "deepseek_v3"
    method = "noaux_tc" if v3 else (get("topk_method") or "greedy")
    if method not in TOPK_METHODS or (v3 and cfg.get("topk_method") not in (None, "noaux_tc")):
        raise UnsupportedModelError(f"unsupported expert routing topk_method {cfg.get('topk_method')!r} for {model_type}",
                                    "tiered routes DeepSeek experts by " + ", ".join(TOPK_METHODS))
    scoring = cfg.get("scoring_func")
    if scoring is not None and scoring != ("sigmoid" if v3 else "softmax"):
        raise UnsupportedModelError(f"unsupported router scoring_func {scoring!r} for {model_type}",
                                    "transformers' DeepSeek-V2 routes by softmax, V3 by sigmoid")
    grouped = method != "greedy"
    shared = get("n_shared_experts") or 0
    return dict(
        head_dim=get("qk_rope_head_dim") or d["qk_rope_head_dim"], num_key_value_heads=1,
        q_lora_rank=get("q_lora_rank") or 0, kv_lora_rank=get("kv_lora_rank") or d["kv_lora_rank"],
        qk_nope_head_dim=get("qk_nope_head_dim") or 0, v_head_dim=get("v_head_dim") or d["v_head_dim"],
        rope_interleave=bool(cfg.get("rope_interleave", True)) if v3 else True,
        topk_method=method, n_group=(get("n_group") or 1) if grouped else 1,
        topk_group=(get("topk_group") or 1) if grouped else 1,
        routed_scaling_factor=float(get("routed_scaling_factor") or 1.0),
        first_k_dense_replace=get("first_k_dense_replace") or 0, moe_layer_freq=cfg.get("moe_layer_freq") or 1,
        shared_expert_intermediate_size=shared * (cfg.get("moe_intermediate_size") or 0),
        shared_expert_gated=False, o_proj_bias=bool(cfg.get("attention_bias", False)),
        norm_topk_prob=bool(get("norm_topk_prob")) if v3 else False,
    )


# transformers' defaults for glm4_moe fields a config.json may leave out (Glm4MoeConfig)
_GLM4_MOE_DEFAULTS = dict(intermediate_size=10944, moe_intermediate_size=1408, num_experts_per_tok=8,
                          n_shared_experts=1, n_routed_experts=128, routed_scaling_factor=1.0, n_group=1,
                          topk_group=1, first_k_dense_replace=1, norm_topk_prob=True, use_qk_norm=False,
                          partial_rotary_factor=0.5)


def _glm4_moe_fields(cfg: dict[str, Any], source: object) -> dict[str, Any]:
    """ModelConfig fields of a GLM-4.5 / GLM-4.5-Air / GLM-4.6 config.json (transformers' glm4_moe),
    transformers' defaults for those it leaves out (_GLM4_MOE_DEFAULTS).

    As transformers' modeling_glm4_moe computes them: grouped-query attention with q/k/v biases per
    attention_bias (o_proj never has one), RMSNorm per head on q and k when use_qk_norm, RoPE on the
    first head_dim * partial_rotary_factor features of each head (given at the top level, as the
    released config.json files have it, or in rope_parameters, as transformers 5 writes it; 0.5 when
    neither); layers >= first_k_dense_replace hold DeepSeek-V3's MoE block (sigmoid scores, the
    score-correction bias for the choice, the two best biased scores of each group ranking the groups,
    renormalized per norm_topk_prob, times routed_scaling_factor: "noaux_tc") with n_shared_experts
    ungated shared experts of moe_intermediate_size each, the others a dense MLP of intermediate_size.
    The multi-token-prediction layers (num_nextn_predict_layers, stored as model.layers.<L>.* past
    num_hidden_layers) are not part of the model: transformers ignores them too.

    Raises:
        CheckpointError: partial_rotary_factor is not a number in (0, 1].
        UnsupportedModelError: an activation other than SiLU.
    """
    d = _GLM4_MOE_DEFAULTS

    def get(key):
        return cfg[key] if cfg.get(key) is not None else d[key]

    factor = (cfg.get("rope_parameters") or {}).get("partial_rotary_factor")
    if factor is None:
        factor = get("partial_rotary_factor")
    if not (_is_number(factor) and 0 < factor <= 1):
        raise CheckpointError(f"{source}: partial_rotary_factor must be a number in (0, 1], got {factor!r}",
                              "fix or restore the checkpoint's config.json")
    if cfg.get("hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"unsupported activation {cfg['hidden_act']!r} for glm4_moe",
                                    "tiered's MLPs and experts are SwiGLU (silu)")
    return dict(
        intermediate_size=get("intermediate_size"), moe_intermediate_size=get("moe_intermediate_size"),
        num_experts=cfg.get("n_routed_experts") or cfg.get("num_local_experts") or d["n_routed_experts"],
        num_experts_per_tok=get("num_experts_per_tok"), topk_method="noaux_tc", n_group=get("n_group"),
        topk_group=get("topk_group"), routed_scaling_factor=float(get("routed_scaling_factor")),
        first_k_dense_replace=get("first_k_dense_replace"), moe_layer_freq=1,
        shared_expert_intermediate_size=get("n_shared_experts") * get("moe_intermediate_size"),
        shared_expert_gated=False, norm_topk_prob=bool(get("norm_topk_prob")), o_proj_bias=False,
        qk_norm=bool(get("use_qk_norm")), qk_norm_scope="head", partial_rotary_factor=float(factor),
    )


# transformers' defaults for gpt_oss fields a config.json may leave out (GptOssConfig)
_GPT_OSS_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                 "original_max_position_embeddings": 4096}


def _gpt_oss_fields(cfg: dict[str, Any], source: object) -> dict[str, Any]:
    """ModelConfig fields of a gpt-oss-20b / gpt-oss-120b config.json (transformers' gpt_oss), with
    transformers' defaults (GptOssConfig) for those it leaves out.

    As transformers' modeling_gpt_oss computes them: grouped-query attention with q/k/v/o biases per
    attention_bias (default true) and a learned sink logit per head; YaRN RoPE (rope_theta 150000,
    factor 32 over 4096 positions, truncate false, when the config gives no RoPE settings); layers
    alternating `sliding_attention` (window sliding_window, default 128) and `full_attention` per
    layer_types (default: even layers slide); every layer an MoE block of num_local_experts experts of
    intermediate_size, routed by a biased linear router whose top num_experts_per_tok logits are
    softmaxed (norm_topk_prob), experts with biases and the clamped GLU of swiglu_limit (7.0) and
    swiglu_alpha (1.702); RMSNorm eps 1e-5.

    Raises:
        CheckpointError: layer_types of another length than num_hidden_layers or with an unknown
            type; swiglu_limit / swiglu_alpha not positive numbers.
    """
    L = cfg["num_hidden_layers"]
    types = cfg.get("layer_types")
    if types is None:
        types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(L)]
    if len(types) != L or not set(types) <= {"sliding_attention", "full_attention"}:
        raise CheckpointError(f"{source}: layer_types must give sliding_attention or full_attention for each of the "
                              f"{L} layers, got {types!r}", "fix or restore the checkpoint's config.json")
    limit, alpha = cfg.get("swiglu_limit", 7.0), cfg.get("swiglu_alpha", 1.702)
    for name, v in (("swiglu_limit", limit), ("swiglu_alpha", alpha)):
        if not (_is_number(v) and v > 0):
            raise CheckpointError(f"{source}: {name} must be a positive number, got {v!r}",
                                  "fix or restore the checkpoint's config.json")
    window = cfg.get("sliding_window", 128)
    local = tuple(i for i, t in enumerate(types) if t == "sliding_attention") if window else ()
    rope = cfg.get("rope_parameters") or {}
    theta = rope.get("rope_theta") or cfg.get("rope_theta") or 150000.0
    out = dict(
        intermediate_size=cfg["intermediate_size"], moe_intermediate_size=cfg["intermediate_size"],
        num_experts=cfg.get("num_local_experts") or 128,
        num_experts_per_tok=cfg.get("num_experts_per_tok") or cfg.get("experts_per_token") or 4,
        norm_topk_prob=True, o_proj_bias=bool(cfg.get("attention_bias", True)),
        attention_bias=bool(cfg.get("attention_bias", True)), rms_norm_eps=cfg.get("rms_norm_eps", 1e-5),
        local_window=window if local else None, local_layers=local, sliding_window=None, attention_sinks=True,
        expert_bias=True, swiglu_limit=float(limit), swiglu_alpha=float(alpha), rope_theta=float(theta),
        # GptOssConfig's head_dim is 64 when absent, hidden / heads when null
        head_dim=64 if "head_dim" not in cfg else cfg["head_dim"] or cfg["hidden_size"] // cfg["num_attention_heads"])
    if not rope.get("rope_type", rope.get("type")) and not cfg.get("rope_scaling"):
        out["rope_scaling"] = dict(_GPT_OSS_ROPE)  # transformers' default (GptOssConfig.__post_init__)
    return out


def _field_error(source: object, field: str, why: str) -> CheckpointError:
    """The CheckpointError of a config.json field (`source` the file) that is missing or has a bad value."""
    return CheckpointError(f"{source}: {field} {why}", "fix or restore the checkpoint's config.json")


def fused_projections(config: "ModelConfig") -> dict[str, tuple[tuple[str, int], ...]]:
    """Phi-3's fused projections as Llama's (model_config._phi3_fields): each fused module path -> its parts'
    module paths and row counts, in row order: self_attn.qkv_proj [(H + 2 Hkv) hd, D] -> q / k / v_proj of H hd,
    Hkv hd and Hkv hd rows; mlp.gate_up_proj [2F, D] -> gate_proj (the first F rows) and up_proj (the readers'
    HFDirCheckpoint._split_fused and GGUFCheckpoint._fused_rows)."""
    q, kv, F = (config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim,
                config.intermediate_size)
    return {"self_attn.qkv_proj": (("self_attn.q_proj", q), ("self_attn.k_proj", kv), ("self_attn.v_proj", kv)),
            "mlp.gate_up_proj": (("mlp.gate_proj", F), ("mlp.up_proj", F))}


def _text_config(cfg: dict[str, Any], model_type: str, source: object) -> dict[str, Any]:
    """The language model's config of a multimodal config.json (MULTIMODAL_TEXT: Gemma 3's
    Gemma3ForConditionalGeneration, Mistral3ForConditionalGeneration): its `text_config` (of its own model_type,
    else MULTIMODAL_TEXT's), with the file's top-level token ids (Gemma 3 4B-27B give eos_token_id [1, 106] there)
    over the text config's. tiered runs the text model alone; the vision tower's weights are not read
    (checkpoint/hf_dir.py).

    Raises:
        CheckpointError: text_config is missing or not an object.
    """
    text = cfg.get("text_config")
    if not isinstance(text, dict):
        raise CheckpointError(f"{source}: a {model_type} config.json without a text_config object",
                              "restore the checkpoint's config.json")
    top = {k: cfg[k] for k in ("eos_token_id", "bos_token_id", "tie_word_embeddings") if cfg.get(k) is not None}
    return {**text, **top, "model_type": text.get("model_type") or MULTIMODAL_TEXT[model_type]}


# transformers' defaults for gemma3_text fields a config.json may leave out (Gemma3TextConfig; the multimodal
# files' text_config gives only what differs from them)
_GEMMA3_DEFAULTS = dict(vocab_size=262_208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                        num_attention_heads=8, num_key_value_heads=4, head_dim=256, max_position_embeddings=131_072,
                        rms_norm_eps=1e-6, bos_token_id=2, eos_token_id=1, tie_word_embeddings=True,
                        query_pre_attn_scalar=256, sliding_window=4096, hidden_activation="gelu_pytorch_tanh")
# and Gemma2Config's (Gemma 2 2B / 9B / 27B: soft caps, every other layer sliding, one RoPE)
_GEMMA_DEFAULTS = {"gemma3_text": _GEMMA3_DEFAULTS, "gemma2": dict(
    _GEMMA3_DEFAULTS, vocab_size=256_000, max_position_embeddings=8192, attn_logit_softcapping=50.0,
    final_logit_softcapping=30.0)}
# HF activation names -> HIDDEN_ACTS
_HF_ACTS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh"}


def _gemma_fields(cfg: dict[str, Any], source: object, model_type: str) -> dict[str, Any]:
    """ModelConfig fields of a Gemma 3 text config (transformers' gemma3_text: Gemma3ForCausalLM, or the
    text_config of Gemma3ForConditionalGeneration) or a Gemma 2 one (`gemma2`), with _GEMMA_DEFAULTS already filled
    in. Gemma 2 differs as transformers' modeling_gemma2 computes it: no q/k norms, the tanh soft caps of
    attn_logit_softcapping (on every attention logit, before the mask) and final_logit_softcapping (on the output
    logits), every other layer sliding (default layer_types: the even ones), one RoPE (rope_theta, default 10000)
    for every layer.

    As transformers' modeling_gemma3 computes them: the embedding scaled by sqrt(hidden_size); per-head q/k
    RMSNorms; logits scaled by query_pre_attn_scalar ** -0.5; layers per `layer_types` (default: every 6th
    layer global, sliding_window_pattern) either sliding (a window of sliding_window positions, RoPE base
    rope_local_base_freq, default 10000, unscaled) or global (rope_theta, default 1e6, with rope_scaling:
    linear 8 for 4B-27B); sandwich norms around each block; a GeGLU MLP (gelu_pytorch_tanh); lm_head tied
    to the embedding. transformers 5 writes the two RoPEs as rope_parameters {"full_attention": {...},
    "sliding_attention": {...}}; 4.x as rope_theta, rope_scaling and rope_local_base_freq.

    Raises:
        CheckpointError: layer_types of another length than num_hidden_layers or with an unknown type;
            query_pre_attn_scalar or a soft cap not a positive number.
        UnsupportedModelError: bidirectional attention (EmbeddingGemma), an activation other than
            gelu_pytorch_tanh / silu, a scaled local RoPE.
    """
    bad = partial(_field_error, source)
    caps = {}
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        v = cfg.get(key)
        if v is not None and not (_is_number(v) and v > 0):
            raise bad(key, f"must be a positive number or null, got {v!r}")
        caps[key] = None if v is None else float(v)
    if cfg.get("use_bidirectional_attention"):
        raise UnsupportedModelError("bidirectional attention (an embedding model) is not supported",
                                    "tiered runs causal language models")
    act = _HF_ACTS.get(cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh")
    if act is None:
        raise UnsupportedModelError(f"unsupported activation {cfg.get('hidden_activation')!r} for gemma3_text",
                                    "tiered's GLUs take " + ", ".join(_HF_ACTS))
    L = cfg["num_hidden_layers"]
    types = cfg.get("layer_types")
    if types is None:
        pattern = cfg.get("sliding_window_pattern") or (2 if model_type == "gemma2" else 6)
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(L)]
    if len(types) != L or not set(types) <= {"sliding_attention", "full_attention"}:
        raise bad("layer_types", f"must give sliding_attention or full_attention for each of the {L} layers, "
                                 f"got {types!r}")
    scalar = cfg.get("query_pre_attn_scalar")
    if not (_is_number(scalar) and scalar > 0):
        raise bad("query_pre_attn_scalar", f"must be a positive number, got {scalar!r}")
    rope = cfg.get("rope_parameters") or {}
    if model_type == "gemma2":  # one RoPE for every layer
        full = dict(cfg.get("rope_scaling") or rope)
        local = None
    elif "full_attention" in rope or "sliding_attention" in rope:  # transformers 5: one RoPE per layer type
        full, local = dict(rope.get("full_attention") or {}), dict(rope.get("sliding_attention") or {})
    else:
        full = dict(cfg.get("rope_scaling") or rope)
        local = {"rope_theta": cfg.get("rope_local_base_freq")}
    theta = full.pop("rope_theta", None) or cfg.get("rope_theta") or (10_000.0 if local is None else 1_000_000.0)
    full.setdefault("rope_type", full.pop("type", "default"))
    local = local if local is not None else {"rope_theta": theta}  # Gemma 2: the same RoPE
    local_theta = local.pop("rope_theta", None) or 10_000.0
    if local.get("rope_type", local.get("type", "default")) != "default":
        raise UnsupportedModelError(f"a scaled RoPE ({local}) on gemma3_text's sliding layers is not supported",
                                    "Gemma 3 rotates its sliding layers by plain RoPE")
    for v, field in ((theta, "rope_theta"), (local_theta, "rope_local_base_freq")):
        if not (_is_number(v) and v > 0):
            raise bad(field, f"must be a positive number, got {v!r}")
    for k in _ROPE_FACTORS.get(full["rope_type"], ()):
        if not (_is_number(full.get(k)) and full[k] > 0):
            raise bad(f"rope_scaling.{k}", "is missing" if k not in full else f"must be a positive number, got {full[k]!r}")
    window = cfg.get("sliding_window")
    local_layers = tuple(i for i, t in enumerate(types) if t == "sliding_attention") if window else ()
    bias = bool(cfg.get("attention_bias", False))
    scaling = None if full["rope_type"] == "default" else full
    # a local RoPE of its own where it differs from the global layers' (Gemma 3); Gemma 2's layers share one
    own_rope = bool(local_layers) and (float(local_theta) != float(theta) or scaling is not None)
    return dict(
        hidden_act=act, embed_scale=float(cfg["hidden_size"]) ** 0.5, sandwich_norms=True,
        query_pre_attn_scalar=float(scalar), qk_norm=model_type != "gemma2", qk_norm_scope="head",
        attention_bias=bias, o_proj_bias=bias, sliding_window=None, local_window=window if local_layers else None,
        local_layers=local_layers, rope_theta=float(theta), rope_scaling=scaling,
        local_rope_theta=float(local_theta) if own_rope else None,
        attn_softcap=caps["attn_logit_softcapping"], final_softcap=caps["final_logit_softcapping"],
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)))


def _phi3_fields(cfg: dict[str, Any], source: object) -> dict[str, Any]:
    """ModelConfig fields of a Phi-3 / Phi-3.5 / Phi-4 config.json (transformers' phi3: Microsoft's Phi-4 14B,
    Phi-4-mini, Phi-3 / 3.5-mini, Phi-3-medium), as transformers' modeling_phi3 computes them: Llama's layers with
    q/k/v fused into one qkv_proj and gate/up into one gate_up_proj (the gate first; checkpoint/hf_dir.py splits
    both, so the model is models/llama.py's), no biases, RoPE on each head's first head_dim * partial_rotary_factor
    features (given at the top level or in rope_parameters), and every layer sliding over `sliding_window`
    positions where it is set (Phi-3-mini-4k's 2047). LongRoPE (rope_type "longrope", 4.x's "su" / "yarn":
    Phi-3.5, Phi-4-mini, the 128k files) keeps its short_factor / long_factor, original_max_position_embeddings,
    factor (default max_position_embeddings / original) and attention_factor (`rope_inv_freq`).

    Raises:
        CheckpointError: partial_rotary_factor not a number in (0, 1]; LongRoPE factors that are not one positive
            number per rotated pair, or no original_max_position_embeddings.
        UnsupportedModelError: an activation other than SiLU.
    """
    bad = partial(_field_error, source)
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    if cfg.get("hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"unsupported activation {cfg['hidden_act']!r} for phi3",
                                    "tiered's Phi MLPs are SwiGLU (silu)")
    factor = cfg.get("partial_rotary_factor", rope.get("partial_rotary_factor", 1.0))
    if not (_is_number(factor) and 0 < factor <= 1):
        raise bad("partial_rotary_factor", f"must be a number in (0, 1], got {factor!r}")
    out = dict(partial_rotary_factor=float(factor), attention_bias=False, o_proj_bias=False,
               sliding_window=cfg.get("sliding_window") or None)
    if rope.get("rope_type", rope.get("type")) in ("longrope", "su", "yarn"):
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        pairs = int(head_dim * factor) // 2
        for key in ("short_factor", "long_factor"):
            v = rope.get(key)
            if not (isinstance(v, list) and len(v) == pairs and all(_is_number(x) and x > 0 for x in v)):
                raise bad(f"rope_scaling.{key}", f"must be {pairs} positive numbers (one per rotated pair)")
        orig = rope.get("original_max_position_embeddings") or cfg.get("original_max_position_embeddings")
        if not (is_int(orig) and orig > 0):
            raise bad("original_max_position_embeddings", f"must be a positive integer for LongRoPE, got {orig!r}")
        out["rope_scaling"] = longrope_scaling(rope["short_factor"], rope["long_factor"], orig,
                                               cfg.get("max_position_embeddings") or orig, rope.get("factor"),
                                               rope.get("attention_factor"))
    return out


def longrope_scaling(short: list, long: list, original: int, max_positions: int, factor=None,
                     attention_factor=None) -> dict:
    """A LongRoPE `rope_scaling` (Phi-3.5 / Phi-4-mini; transformers' _compute_longrope_parameters): the per-pair
    short and long factors [rotary_dim / 2], the original context `original` [positions], `factor` (default
    max_positions / original) and the attention factor (default sqrt(1 + ln(factor) / ln(original)), 1 for
    factor <= 1). Its tables use the long factors where the engine's window exceeds `original`, else the short ones
    (`rope_inv_freq`)."""
    factor = float(factor) if factor else max_positions / original
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return {"rope_type": "longrope", "short_factor": [float(x) for x in short],
            "long_factor": [float(x) for x in long], "original_max_position_embeddings": int(original),
            "factor": factor, "attention_factor": float(attention_factor)}


# HF config.json fields read as ints: (required, smallest value). A field given as null counts as
# absent (configs write e.g. "head_dim": null), so required ones must hold a number.
_INT_FIELDS = {
    "vocab_size": (True, 1), "hidden_size": (True, 1), "num_hidden_layers": (True, 1),
    "num_attention_heads": (True, 1), "num_key_value_heads": (False, 1), "head_dim": (False, 1),
    "intermediate_size": (False, 0), "max_position_embeddings": (False, 1), "sliding_window": (False, 0),
    "max_window_layers": (False, 0), "num_local_experts": (False, 0), "num_experts": (False, 0),
    "num_experts_per_tok": (False, 0), "moe_intermediate_size": (False, 0),
    "shared_expert_intermediate_size": (False, 0), "decoder_sparse_step": (False, 1),
    "bos_token_id": (False, 0), "n_routed_experts": (False, 0), "n_shared_experts": (False, 0),
    "kv_lora_rank": (False, 1), "q_lora_rank": (False, 1), "qk_nope_head_dim": (False, 0),
    "qk_rope_head_dim": (False, 2), "v_head_dim": (False, 1), "first_k_dense_replace": (False, 0),
    "moe_layer_freq": (False, 1), "n_group": (False, 1), "topk_group": (False, 1),
}
# fields read as numbers (int or float, finite): each must be above this value
_FLOAT_FIELDS = {"rms_norm_eps": 0.0, "rope_theta": 0.0, "clip_qkv": 0.0, "routed_scaling_factor": 0.0}
# RoPE scaling factors each rope_type reads (rope_inv_freq)
_ROPE_FACTORS = {"linear": ("factor",), "yarn": ("factor", "original_max_position_embeddings"),
                 "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}


def is_int(x) -> bool:
    """x is an int of JSON (a bool is not)."""
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _check_hf_fields(cfg: dict[str, Any], model_type: str, source: object) -> None:
    """Check that an HF config holds every field tiered reads, with values of the right type and
    range: the model's sizes are ints (a bool is not), positive where a zero makes no model.

    Raises:
        CheckpointError: a required field is missing, or a field has a value of the wrong type or
            range; the message names the field and `source`.
    """
    bad = partial(_field_error, source)

    for field, (required, least) in _INT_FIELDS.items():
        v = cfg.get(field)
        if v is None:
            if required:
                raise bad(field, "is missing")
            continue
        if not is_int(v):
            raise bad(field, f"must be an integer, got {v!r}")
        if v < least:
            raise bad(field, f"must be {'positive' if least == 1 else '>= 0'}, got {v}")
    if cfg.get("intermediate_size") is None and (model_type in DENSE_TYPES or not cfg.get("moe_intermediate_size")):
        raise bad("intermediate_size", "is missing")
    if model_type in DENSE_TYPES and cfg["intermediate_size"] < 1:
        raise bad("intermediate_size", f"must be positive, got {cfg['intermediate_size']}")
    if cfg.get("head_dim") is None and model_type not in DEEPSEEK_TYPES and cfg["hidden_size"] % cfg["num_attention_heads"]:
        raise bad("hidden_size", f"{cfg['hidden_size']} is not a multiple of num_attention_heads "
                                 f"{cfg['num_attention_heads']} (and no head_dim is given)")
    for field, above in _FLOAT_FIELDS.items():
        v = cfg.get(field)
        if v is not None and not (_is_number(v) and v > above):
            raise bad(field, f"must be a positive number, got {v!r}")
    eos = cfg.get("eos_token_id")
    if eos is not None and not all(is_int(i) and i >= 0 for i in (eos if isinstance(eos, list) else [eos])):
        raise bad("eos_token_id", f"must be a token id or a list of them, got {eos!r}")
    layers = cfg.get("mlp_only_layers")
    if layers is not None and not (isinstance(layers, list) and all(is_int(i) for i in layers)):
        raise bad("mlp_only_layers", f"must be a list of layer indices, got {layers!r}")
    types = cfg.get("layer_types")
    if types is not None and not (isinstance(types, list) and all(isinstance(t, str) for t in types)):
        raise bad("layer_types", f"must be a list of strings, got {types!r}")
    for field in ("rope_scaling", "rope_parameters"):
        rope = cfg.get(field)
        if rope is None:
            continue
        if not isinstance(rope, dict):
            raise bad(field, f"must be an object, got {rope!r}")
        theta = rope.get("rope_theta")
        if theta is not None and not (_is_number(theta) and theta > 0):
            raise bad(f"{field}.rope_theta", f"must be a positive number, got {theta!r}")
        for k in _ROPE_FACTORS.get(rope.get("rope_type", rope.get("type")), ()):
            if not (_is_number(rope.get(k)) and rope[k] > 0):
                raise bad(f"{field}.{k}",
                          "is missing" if k not in rope else f"must be a positive number, got {rope[k]!r}")


def _sliding_window(cfg: dict[str, Any], model_type: str) -> int | None:
    """The attention window shared by every layer of an HF config, or None when no layer slides.

    Mistral and Mixtral slide in every layer; Qwen2/Qwen3 (and their MoE variants) only in layers
    >= max_window_layers (HF default 28), which transformers 5 writes out as `layer_types`.

    Raises:
        UnsupportedModelError: some layers slide and others attend to the full context.
    """
    window = cfg.get("sliding_window")
    if window is None or not cfg.get("use_sliding_window", model_type in ("mistral", "mixtral")):
        return None
    types = cfg.get("layer_types")
    if types is None:
        first = cfg.get("max_window_layers", 28) if model_type.startswith("qwen") else 0
        types = ["full_attention" if i < first else "sliding_attention" for i in range(cfg["num_hidden_layers"])]
    sliding = {t == "sliding_attention" for t in types}
    if sliding == {False}:
        return None
    if sliding == {True}:
        return window
    raise UnsupportedModelError("models that mix sliding-window and full-attention layers are not supported",
                                "use a checkpoint whose layers all use the same attention")


def rope_inv_freq(config: ModelConfig, positions: int | None = None) -> "torch.Tensor":
    """RoPE inverse frequencies [rotary_dim // 2] fp32 (rotary_dim = head_dim unless a partial RoPE
    rotates fewer features, ModelConfig.rotary_dim), with linear, llama3, YaRN or LongRoPE scaling applied.
    LongRoPE (`longrope_scaling`; LongRoPE, Ding et al. 2024) divides pair i's frequency by long_factor[i] where
    the tables cover more than original_max_position_embeddings `positions` (the engine's window), else by
    short_factor[i]: the choice llama.cpp makes by its context size (transformers switches by the current
    sequence's length, the same for every sequence that fits the original context when the window does too).

    The llama3 rule (Llama 3.1 report): wavelengths longer than original_ctx / low_freq_factor are
    divided by `factor`, shorter than original_ctx / high_freq_factor are kept, and the band
    between is interpolated smoothly.
    """
    import torch

    dim = config.rotary_dim
    s = config.rope_scaling
    wave = config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    if s is not None and s["rope_type"] == "longrope":  # the long factors where the window (`positions`) exceeds
        long = positions is not None and positions > s["original_max_position_embeddings"]  # the original one,
        ext = torch.tensor(s["long_factor" if long else "short_factor"], dtype=torch.float32)  # as llama.cpp's n_ctx
        return 1.0 / (ext * wave)
    inv = 1.0 / wave
    if s is None:
        return inv
    if s["rope_type"] == "linear":
        return inv / s["factor"]
    if s["rope_type"] == "yarn":
        return _yarn_inv_freq(inv, dim, config.rope_theta, s)
    factor, lo, hi = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old / lo, inv / factor, inv)
    smooth = (old / wavelen - lo) / (hi - lo)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old / hi) & ~(wavelen > old / lo)
    return torch.where(medium, smoothed, scaled)


def _yarn_inv_freq(inv: "torch.Tensor", dim: int, base: float, s: dict) -> "torch.Tensor":
    """YaRN's inverse frequencies (Peng et al. 2023, "YaRN", §3.2 "NTK-by-parts"): dimensions that
    turn more than beta_fast times over the original context keep their frequency, those that turn
    fewer than beta_slow times are divided by `factor`, and a linear ramp blends the band between
    (its ends rounded outwards unless `truncate` is false), as transformers computes them."""
    import torch

    factor, old = s["factor"], s["original_max_position_embeddings"]
    beta_fast, beta_slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def dim_of(rotations: float) -> float:  # the dimension that turns `rotations` times over `old` positions
        return dim * math.log(old / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_of(beta_fast), dim_of(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (keep the frequency), 0: interpolate (divide by factor)
    return inv / factor * (1 - keep) + inv * keep


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature factor 0.1 mscale ln(scale) + 1 (1 for scale <= 1)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_attention_factor(config: ModelConfig) -> float:
    """The factor RoPE's cos and sin tables are multiplied by: 1, or for YaRN its `attention_factor`
    (given, else mscale(factor, mscale) / mscale(factor, mscale_all_dim) when both are given, else
    mscale(factor)), as transformers' _compute_yarn_parameters."""
    s = config.rope_scaling
    if s is not None and s["rope_type"] == "longrope":
        return s["attention_factor"]
    if s is None or s["rope_type"] != "yarn":
        return 1.0
    if s.get("attention_factor") is not None:
        return float(s["attention_factor"])
    if s.get("mscale") and s.get("mscale_all_dim"):
        return yarn_mscale(s["factor"], s["mscale"]) / yarn_mscale(s["factor"], s["mscale_all_dim"])
    return yarn_mscale(s["factor"])
