"""Dense decoder-only transformers of the Llama family: Llama 2/3, Mistral, Qwen2/2.5, Qwen3, SmolLM2.

One implementation covers them all; the differences are ModelConfig fields (q/k/v bias for Qwen2,
per-head q/k RMSNorm for Qwen3, sliding window for Mistral, llama3 RoPE scaling, tied embeddings).
Parameter names equal Hugging Face's (`model.layers.N.self_attn.q_proj.weight`, ...).

Dimension legend: B = batch, T = new tokens per sequence, D = hidden, V = vocab.
"""

from __future__ import annotations

import torch
from torch import nn

from tiered.checkpoint.model_config import ModelConfig
from tiered.models.layers import (MLP, Attention, AttentionMetadata, KVCache, RMSNorm, Rotary, build_attention_metadata,
                                  input_dtype)


class DecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then h + mlp(norm(h)). `mlp` is any [.., D] -> [.., D] module, `attn`
    an attention module of the family's (None: models/layers.Attention, or latent attention for MLA)."""

    def __init__(self, config: ModelConfig, layer_idx: int, mlp: nn.Module | None = None,
                 attn: nn.Module | None = None) -> None:
        super().__init__()
        if attn is not None:
            self.self_attn = attn
        elif config.is_mla:  # DeepSeek's multi-head latent attention
            from tiered.models.deepseek import LatentAttention

            self.self_attn = LatentAttention(config, layer_idx)
        else:
            self.self_attn = Attention(config, layer_idx)
        self.mlp = mlp if mlp is not None else MLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, meta: AttentionMetadata, cache: KVCache) -> torch.Tensor:
        """x [B, T, D] -> [B, T, D] (`step` with its two parts added)."""
        h, m = self.step(x, None, meta, cache)
        return h + m

    def step(self, x: torch.Tensor, delta: torch.Tensor | None, meta: AttentionMetadata,
             cache: KVCache) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer on the residual stream x + delta (x [B, T, D]; delta [B, T, D], the previous layer's FFN output
        not yet added, or None) -> (h, m), the layer's output being h + m: m is this layer's FFN output, left for the
        next layer's first norm (or the final norm) to add in the same pass (RMSNorm.residual; CausalLM.hidden_states).
        Each norm's output is made in the dtype its block computes the call in without a cast of its own
        (`layers.input_dtype`: bf16 into a CPU prompt's attention and FFN whose one-copy int4 projections dequantize
        for bf16 GEMMs), and the blocks' bf16 outputs are added to the fp32 residual stream in those passes. A
        400-token SmolLM2 prompt's adds, norms and casts had taken ~0.7 ms a layer in torch's ops (torch.profiler);
        its TTFT went from 157 to 136 ms, 941 tokens' from 351 to 298 (2 AMX cores, 2026-12-05)."""
        x, n = self.input_layernorm.residual(x, delta, input_dtype(self.self_attn, x, cache))
        h, y = self.post_attention_layernorm.residual(x, self.self_attn(n, meta, cache), input_dtype(self.mlp, x, cache))
        return h, self.mlp(y)

    @property
    def ffn_norm(self) -> RMSNorm:
        """The norm whose output the FFN takes: post_attention_layernorm (the FFN's pre-norm here; Gemma's
        layers have one more, models/gemma.py)."""
        return self.post_attention_layernorm

    def ffn_output(self, m: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The FFN's output m [..., D] as the residual stream adds it: m itself here (in `dtype` where given);
        Gemma's layers normalize it first."""
        return m if dtype is None or m.dtype == dtype else m.to(dtype)

    def attention_residual(self, x: torch.Tensor, meta: AttentionMetadata, cache: KVCache) -> torch.Tensor:
        """x + attn(norm(x)): the layer up to its MLP (x [B, T, D] -> [B, T, D]), as `forward` computes it. A
        piecewise-graphed decode step (runtime/graphs.PiecewiseGraphs) captures this part and runs the MLP eagerly."""
        return x + self.self_attn(self.input_layernorm(x, input_dtype(self.self_attn, x, cache)), meta, cache)


class Backbone(nn.Module):
    """`model.*` of an HF causal LM: embed_tokens, layers, norm."""

    def __init__(self, config: ModelConfig, layers: list[nn.Module]) -> None:
        super().__init__()
        # an explicit weight skips nn.Embedding's normal_ init: on the meta device that op runs a
        # Python decomposition whose first call imports torch._dynamo (~1.4 s of every load)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size,
                                         _weight=torch.empty(config.vocab_size, config.hidden_size))
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class CausalLM(nn.Module):
    """A decoder-only causal LM with HF parameter names.

    Args:
        config: the model's hyperparameters.
        max_positions: size of the RoPE table [tokens] (the engine's context window).
        layers: decoder layers; None builds dense `DecoderLayer`s (MoE models pass their own).
    """

    def __init__(self, config: ModelConfig, max_positions: int, layers: list[nn.Module] | None = None) -> None:
        super().__init__()
        self.config = config
        if layers is None:
            layers = [DecoderLayer(config, i) for i in range(config.num_hidden_layers)]
        self.model = Backbone(config, layers)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rotary = Rotary(config, max_positions)
        self._scales: dict[torch.dtype, float] = {}  # embed's scale rounded per dtype

    @property
    def max_positions(self) -> int:
        return self.rotary.cos.shape[0]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids int64 [...] -> their embedding rows [..., D] in the table's dtype, times config.embed_scale
        rounded to that dtype where it is not 1 (Gemma's sqrt(D), as transformers rounds it)."""
        x = self.model.embed_tokens(input_ids)
        scale = self.config.embed_scale
        if scale == 1.0:
            return x
        rounded = self._scales.get(x.dtype)
        if rounded is None:
            rounded = self._scales[x.dtype] = float(torch.tensor(scale, dtype=x.dtype))
        return x * rounded

    def hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                      cache: KVCache, meta: AttentionMetadata | None = None) -> torch.Tensor:
        """input_ids, positions int64 [B, T]; slots int64 [B] -> final-norm hidden states [B, T, D].
        `meta` replaces the step's own metadata (e.g. layers.build_static_decode_metadata)."""
        if meta is None:
            meta = build_attention_metadata(self.rotary, positions, slots, self.config.sliding_window)
        x, m = self.embed(input_ids), None
        for layer in self.model.layers:  # the residual stream as x + m: DecoderLayer.step
            x, m = layer.step(x, m, meta, cache)
        return self.model.norm.residual(x, m)[1]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                cache: KVCache, last_only: bool = True, meta: AttentionMetadata | None = None,
                last: torch.Tensor | None = None) -> torch.Tensor:
        """Run one step and return logits: [B, V] for the last token (last_only) or [B, T, V].
        last: with prompts packed into one row (`meta` of layers.build_packed_metadata, B = 1), int64 [k] on
        h's device, each prompt's last column: the logits are then [k, V], one row a prompt; None = column
        T - 1 of each row."""
        h = self.hidden_states(input_ids, positions, slots, cache, meta)
        if last_only:
            B, D = h.shape[0], h.shape[-1]
            # reshape, not the slice alone: the slice keeps the prompt's batch stride, and torch's
            # matmul then runs the lm_head as a bmm over a copied weight (a SmolLM2 prefill's head:
            # 51 ms of its 0.7 s on 2 cores, the [V, D] weight copied, against ~4 ms)
            h = h[:, -1:].reshape(B, 1, D) if last is None else h[0, last].unsqueeze(1)
        logits = self.head(h)
        return logits[:, -1] if last_only else logits

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """Final-norm hidden states h [..., D] -> logits [..., V]: the lm_head, soft-capped where the model caps
        its output (Gemma 2's final_softcap: c tanh(logits / c))."""
        return self.softcap(self.lm_head(h))

    def softcap(self, logits: torch.Tensor) -> torch.Tensor:
        """logits as the model outputs them: c tanh(logits / c) for config.final_softcap c, else unchanged."""
        c = self.config.final_softcap
        return logits if c is None else torch.tanh(logits / c) * c
