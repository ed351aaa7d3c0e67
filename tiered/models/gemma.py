"""Gemma 3 (Google's Gemma 3 1B / 4B / 12B / 27B language models; transformers' `gemma3_text`) and Gemma 2
(`gemma2`: 2B / 9B / 27B).

A dense decoder whose every layer is:
  - grouped-query attention with per-head q/k RMSNorms, logits scaled by query_pre_attn_scalar ** -0.5
    (ModelConfig.attn_scale), in one of two kinds per `layer_types`: sliding layers (5 of every 6) attend
    to their last `sliding_window` positions and rotate by a RoPE of base 10000, global layers attend
    to the whole context and rotate by rope_theta (1e6) with linear scaling (factor 8 for 4B-27B):
    ModelConfig.local_window / local_layers / local_rope_theta, the local tables in Rotary.local_cos /
    local_sin, each step's in AttentionMetadata.local_rope (models/layers.local_rope_metadata);
  - sandwich norms: each block's output is normalized before its residual add,
        h = x + norm_pa(attn(norm_in(x))),   out = h + norm_pf(mlp(norm_ff(h)));
  - a GeGLU MLP: down(gelu_tanh(gate(x)) * up(x)) (models/layers.MLP with act "gelu_tanh").
The embedding rows are multiplied by sqrt(hidden_size) rounded to the table's dtype (CausalLM.embed); the
lm_head is the embedding table, unscaled. Gemma's RMSNorm multiplies by (1 + weight): the checkpoint
readers store 1 + weight (checkpoint/hf_dir.py; llama.cpp's GGUF files hold that already), so every norm
here is models/layers.RMSNorm. transformers computes Gemma's norm product in fp32 before rounding to a
16-bit model's dtype (Llama's rounds first): a bf16 model's norms here round as Llama's do, ~1 ulp apart.

Parameter names equal transformers' Gemma3ForCausalLM's (`model.layers.N.pre_feedforward_layernorm.weight`,
...). The native C++ decode step runs these layers itself (runtime/cpu_decode: DecodeStep.set_sandwich,
set_local_rope, set_activation; the scale its constructor's); the torch-op step runs them as these modules.

Gemma 2 is the same block without q/k norms, with one RoPE for every layer (every other layer sliding), and tanh
soft caps on the attention logits (`attend_softcapped`, before the mask) and on the output logits
(CausalLM.head); the native decode step caps them too (DecodeStep.set_softcap; a prompt's rows there score one row
at a time).

Source: transformers' modeling_gemma3.py / modeling_gemma2.py (Gemma3TextScaledWordEmbedding, Gemma3RMSNorm, Gemma3Attention,
Gemma3DecoderLayer) and the Gemma 3 technical report (Gemma Team, 2025, §2).

Dimension legend: B = batch, T = new tokens per sequence, D = hidden.
"""

from __future__ import annotations

import torch

from tiered.checkpoint.model_config import ModelConfig
from tiered.models.layers import MLP, Attention, AttentionMetadata, KVCache, RMSNorm, input_dtype, local_rope_metadata
from tiered.models.llama import DecoderLayer


def _widened(y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """y in fp32 where it is 16-bit beside a residual stream of `dtype` fp32: an output norm then takes RMSNorm's
    one native pass (fp32 rows) instead of torch's five ops and casts on the 16-bit rows (a bf16 prompt's blocks:
    ~1 ms a Gemma-3-4B-width layer of a 512-token prompt, 2 AMX cores)."""
    return y.float() if dtype == torch.float32 and y.dtype != torch.float32 else y


def attend_softcapped(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, causal: bool,
                      scale: float, cap: float) -> torch.Tensor:
    """Attention whose logits are soft-capped (Gemma 2): s = q k^T * scale, then cap * tanh(s / cap), the mask, a
    softmax in fp32 rounded to q's dtype, times v, as transformers' eager attention computes it (no fused kernel
    caps its logits).

    Args:
        q: [B, H, T, hd]; k, v: [B, Hkv, S, hd] (Hkv divides H; q's dtype).
        mask: bool [B, 1, T, S] (True = attend) or None; causal (with mask None): query i sees keys 0..i (the
            top-left alignment of torch's is_causal).
        scale: the logits' factor; cap: the soft cap (> 0).
    Returns:
        [B, H, T, hd] in q's dtype.
    """
    H, Hkv = q.shape[1], k.shape[1]
    if H != Hkv:
        k, v = k.repeat_interleave(H // Hkv, dim=1), v.repeat_interleave(H // Hkv, dim=1)
    s = torch.tanh(torch.matmul(q, k.transpose(-1, -2)) * scale / cap) * cap
    if mask is None and causal:
        T, S = s.shape[-2:]
        mask = torch.ones(T, S, dtype=torch.bool, device=s.device).tril()
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(s.float(), dim=-1).to(q.dtype), v)


class GemmaAttention(Attention):
    """models/layers.Attention whose local layers rotate by the local RoPE (local_rope_metadata) where the model
    has one; the logits' scale is ModelConfig.attn_scale (Attention's), soft-capped where the model caps them
    (Gemma 2's attn_softcap: `attend_softcapped`)."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        self.local_rope = config.local_rope_theta is not None and layer_idx in config.local_layers
        self.softcap = config.attn_softcap
        if self.softcap is not None:
            self.aligns_keys = False  # its own masks: no widened keys

    def attend(self, q, k, v, mask: torch.Tensor | None, causal: bool, past: int | None = None,
               window: int = 0) -> torch.Tensor:
        """Attention.attend, soft-capped where the model caps its logits."""
        if self.softcap is None:
            return super().attend(q, k, v, mask, causal, past, window)
        return attend_softcapped(q, k, v, mask, causal, self.scale, self.softcap)

    def forward(self, x: torch.Tensor, meta: AttentionMetadata, cache: KVCache) -> torch.Tensor:
        """x [B, T, D] -> [B, T, D] (Attention.forward, with the local RoPE's tables in a local layer)."""
        return super().forward(x, local_rope_metadata(meta) if self.local_rope else meta, cache)


class GemmaDecoderLayer(DecoderLayer):
    """Gemma 3's block: x + post_attention_layernorm(attn(input_layernorm(x))) = h, then
    h + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(h))) (see the module doc)."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        D, eps = config.hidden_size, config.rms_norm_eps
        super().__init__(config, layer_idx, MLP(D, config.intermediate_size, config.hidden_act),
                         GemmaAttention(config, layer_idx))
        self.pre_feedforward_layernorm = RMSNorm(D, eps)
        self.post_feedforward_layernorm = RMSNorm(D, eps)

    def step(self, x: torch.Tensor, delta: torch.Tensor | None, meta: AttentionMetadata,
             cache: KVCache) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer on the residual stream x + delta -> (h, m) as DecoderLayer.step: m is this layer's normalized
        FFN output, in x's dtype, for the next norm to add."""
        x, n = self.input_layernorm.residual(x, delta, input_dtype(self.self_attn, x, cache))
        a = self.post_attention_layernorm(_widened(self.self_attn(n, meta, cache), x.dtype), x.dtype)
        h, y = self.pre_feedforward_layernorm.residual(x, a, input_dtype(self.mlp, x, cache))
        return h, self.ffn_output(self.mlp(y), h.dtype)

    @property
    def ffn_norm(self) -> RMSNorm:
        """The norm whose output the FFN takes (DecoderLayer.ffn_norm)."""
        return self.pre_feedforward_layernorm

    def ffn_output(self, m: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The FFN's output m [..., D] as the residual stream adds it: post_feedforward_layernorm(m), in `dtype`
        (None: m's)."""
        return self.post_feedforward_layernorm(_widened(m, m.dtype if dtype is None else dtype), dtype)

    def attention_residual(self, x: torch.Tensor, meta: AttentionMetadata, cache: KVCache) -> torch.Tensor:
        """x + post_attention_layernorm(attn(input_layernorm(x))) (DecoderLayer.attention_residual)."""
        n = self.input_layernorm(x, input_dtype(self.self_attn, x, cache))
        return x + self.post_attention_layernorm(self.self_attn(n, meta, cache), x.dtype)
