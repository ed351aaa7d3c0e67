# N = tokens, E = experts, D = hidden, F = expert intermediate, k = top-k,
# B = batch, H = query heads, Hkv = KV heads, T = new tokens, S = cached positions, hd = head dim
"""gpt-oss (OpenAI's gpt-oss-20b and gpt-oss-120b; transformers' `gpt_oss`).

A Mixture-of-Experts decoder whose every layer is:
  - grouped-query attention with q/k/v/o biases, YaRN RoPE (rotate-half), and attention sinks: a
    learned logit per head (`self_attn.sinks` [H]) joins each query's softmax denominator and is
    dropped, so a query may give less than all of its weight to the keys (`attend_with_sinks`);
    layers alternate a sliding window (ModelConfig.local_window, the layers in local_layers) and
    full attention (models/layers.window_mask);
  - an MoE block: a biased linear router (`mlp.router`: weight [E, D], bias [E]) whose top-k logits
    are softmaxed (GptOssTopKRouter), and experts with biased projections and a clamped GLU:
        gate = clamp(x Wg^T + bg, max=limit), up = clamp(x Wu^T + bu, -limit, limit),
        out = ((up + 1) * gate * sigmoid(alpha * gate)) Wd^T + bd      (limit 7.0, alpha 1.702).

Expert layout: the checkpoint stores a layer's experts fused (`mlp.experts.gate_up_proj` [E, D, 2F]
with gate and up interleaved by column, `down_proj` [E, F, D], their biases [E, 2F] and [E, D]; the
released files MXFP4-quantized): checkpoint/gpt_oss.py gives each expert its own tensors, named
`model.layers.N.mlp.experts.J.{gate_proj,up_proj,down_proj}.weight`, each projection's bias stored
as its weight's input column K (K = D for gate / up, F for down), zero columns after it up to a
multiple of 32: gate/up [F, Db], down [D, Fb] with Db = biased_width(D), Fb = biased_width(F)
(ModelConfig.expert_shapes; 2880 -> 2912 for gpt-oss-20b / -120b), computed against the input with a
1 then zeros appended (`with_one`, `biased_glu_expert`). So an expert is three tensors like every
other architecture's, whose in-features are multiples of 32 (the grouped kinds mxfp4, int8-g32 and int4
hold them: MXFP4's codes and scales map onto mxfp4 and int8-g32 exactly, checkpoint/gpt_oss.py), and the expert
runtime moves and caches it unchanged (quant/experts.ExpertFormat computes it with `swiglu_limit` set).

Source: transformers' modeling_gpt_oss.py (GptOssAttention, eager_attention_forward, GptOssTopKRouter,
GptOssExperts) and the gpt-oss model card (OpenAI, 2025).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tiered.checkpoint.model_config import ModelConfig, biased_width
from tiered.models.layers import Attention
from tiered.models.llama import CausalLM, DecoderLayer
from tiered.models.moe import ExpertsElsewhere, LocalExperts, MoEBlock, SWIGLU_EXPERT_NAMES


# torch's CPU flash attention returning each query's logsumexp (a private op: None where this torch lacks it)
_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def attend_with_sinks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, causal: bool,
                      scale: float, sinks: torch.Tensor) -> torch.Tensor:
    """Attention whose softmax has one more logit per head, the sink, dropped after the softmax.

    Args:
        q: [B, H, T, hd]; k, v: [B, Hkv, S, hd] (Hkv divides H; same dtype as q).
        mask: bool [B, 1, T, S] (True = attend) or None; causal: the T queries are the last T of the
            S positions and each sees positions up to its own (mask is then None).
        scale: the logits' factor (hd ** -0.5); sinks: [H], any float dtype.
    Returns:
        [B, H, T, hd] in q's dtype: softmax([q k^T * scale, sink])[:S] @ v, the softmax in fp32.
    On the CPU, torch's flash attention (no [B, H, T, S] scores: 3.5x faster at 512 tokens, 7x at
    1024, gpt-oss-20b's heads on 2 cores) gives softmax(q k^T * scale) v and each query's logsumexp
    of its scores, lse; the sink then rescales it exactly: o = o_keys * sigmoid(lse - sink), the share
    of the weight the keys keep. Elsewhere computed eagerly (scores [B, H, T, S] in fp32), as
    transformers' eager_attention_forward.
    """
    B, H, T, _ = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    if Hkv != H:  # (B, Hkv, S, hd) -> (B, H, S, hd)
        k, v = k.repeat_interleave(H // Hkv, 1), v.repeat_interleave(H // Hkv, 1)
    if q.device.type == "cpu" and T > 1 and _FLASH_CPU is not None:
        if causal and T != S:  # the kernel's causal mask is top-left aligned: the last T queries' explicitly
            mask, causal = torch.ones(T, S, dtype=torch.bool).tril(S - T), False
        bias = None if mask is None else torch.zeros(mask.shape, dtype=q.dtype).masked_fill_(~mask, float("-inf"))
        out, lse = _FLASH_CPU(q, k, v, 0.0, causal, attn_mask=bias, scale=scale)[:2]  # (B, H, T, hd), (B, H, T) fp32
        keep = torch.sigmoid(lse - sinks.float().view(1, H, 1))  # e^lse / (e^lse + e^sink)
        return (out.float() * keep.unsqueeze(-1)).to(q.dtype)
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale  # (B, H, T, S)
    if causal:
        mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(S - T)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    sink = sinks.float().view(1, H, 1, 1).expand(B, H, T, 1)
    probs = torch.cat([scores, sink], -1).softmax(-1)[..., :S]  # (B, H, T, S): the sink dropped
    return torch.matmul(probs.to(v.dtype), v).to(q.dtype)


class SinkAttention(Attention):
    """Grouped-query attention (models/layers.Attention: q/k/v/o biases, RoPE, the layer's window)
    whose softmax takes each head's learned sink logit (`sinks` [H], HF `self_attn.sinks`)."""

    aligns_keys = False  # attend_with_sinks reads a causal step as its keys' last T queries: no widened keys

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        self.sinks = nn.Parameter(torch.empty(config.num_attention_heads))

    def attend(self, q, k, v, mask: torch.Tensor | None, causal: bool, past: int | None = None,
               window: int = 0) -> torch.Tensor:
        return attend_with_sinks(q, k, v, mask, causal, self.scale, self.sinks)


class GptOssRouter(nn.Linear):
    """gpt-oss's router (HF `mlp.router`): logits = x W^T + b (W [E, D], b [E]); the top-k logits,
    softmaxed among themselves, weight the chosen experts (transformers' GptOssTopKRouter).

    An nn.Linear subclass, as models/moe.Router: it keeps the HF names and stays out of the decode-
    weight swap (quant/linear.py), so routing always uses the dense weight.
    """

    def __init__(self, hidden: int, num_experts: int, top_k: int) -> None:
        super().__init__(hidden, num_experts, bias=True)
        self.top_k = top_k
        self.norm_topk_prob = True  # a softmax over the top-k is the renormalized full softmax

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, D] -> (topk_idx int64 [N, k], topk_weight [N, k] in x's dtype)."""
        logits = F.linear(x, self.weight.to(x.dtype), self.bias.to(x.dtype))  # (N, E), activation dtype like HF
        topk_idx, topk_weight = self.select(logits.float())
        return topk_idx, topk_weight.to(x.dtype)

    def select(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Router logits fp32 [N, E] (bias included) -> (topk_idx int64 [N, k], topk_weight fp32 [N, k]):
        top-k of the logits, then their softmax."""
        top, idx = torch.topk(logits, self.top_k, dim=-1)  # (N, k)
        return idx, top.softmax(dim=-1)


def with_one(x: torch.Tensor, width: int) -> torch.Tensor:
    """x [n, K] -> [n, width] (width > K, biased_width(K) for tiered's experts): x, then a column of
    ones (column K), then zeros: what a projection whose bias is its weight's input column K multiplies
    (the zero columns meet the weight's zero padding). In x's dtype and on its device."""
    out = F.pad(x, (0, width - x.shape[-1]))  # (n, width): zeros after x
    out[..., x.shape[-1]] = 1.0
    return out


def clamped_glu(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's gated activation: gate [n, F] clamped to <= limit, up [n, F] to [-limit, limit];
    (up + 1) * gate * sigmoid(alpha * gate) -> [n, F] (transformers' GptOssExperts._apply_gate)."""
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def biased_glu_expert(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor,
                      alpha: float, limit: float) -> torch.Tensor:
    """One gpt-oss expert: x [n, D]; w_gate, w_up [F, Db] and w_down [D, Fb], each projection's bias
    its input column D (resp. F), zeros after it (Db = biased_width(D), Fb = biased_width(F):
    ModelConfig.expert_shapes) -> [n, D] in x's dtype (weights cast to it)."""
    dt = x.dtype
    w_gate, w_up, w_down = (w if w.dtype == dt else w.to(dt) for w in (w_gate, w_up, w_down))
    x1 = with_one(x, w_gate.shape[1])  # (n, Db)
    h = clamped_glu(F.linear(x1, w_gate), F.linear(x1, w_up), alpha, limit)  # (n, F)
    return F.linear(with_one(h, w_down.shape[1]), w_down)


class GptOssExpert(nn.Module):
    """One routed gpt-oss expert: gate_proj, up_proj [F, Db], down_proj [D, Fb] (bias at input column
    D / F, then zeros: Db = biased_width(D), Fb = biased_width(F))."""

    names = SWIGLU_EXPERT_NAMES

    def __init__(self, hidden: int, intermediate: int, alpha: float, limit: float) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(biased_width(hidden), intermediate, bias=False)
        self.up_proj = nn.Linear(biased_width(hidden), intermediate, bias=False)
        self.down_proj = nn.Linear(biased_width(intermediate), hidden, bias=False)
        self.alpha, self.limit = alpha, limit

    def weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(w_gate [F, Db], w_up [F, Db], w_down [D, Fb]) as stored."""
        return self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [n, D] -> [n, D]."""
        return biased_glu_expert(x, *self.weights(), self.alpha, self.limit)


class GptOssMoEBlock(MoEBlock):
    """gpt-oss's MoE block (HF `mlp`): `router` (GptOssRouter, also reached as `gate`, the name the
    runtime reads) and `experts` (GptOssExpert); no shared expert. Runs like every MoEBlock: its
    `runner` (models/moe.ExpertRunner) computes the routed experts."""

    def __init__(self, config: ModelConfig, layer_idx: int, experts: bool = True) -> None:
        nn.Module.__init__(self)
        D, E, F_ = config.hidden_size, config.num_experts, config.moe_intermediate_size
        self.layer_idx = layer_idx
        self.router = GptOssRouter(D, E, config.num_experts_per_tok)
        self.experts = nn.ModuleList(GptOssExpert(D, F_, config.swiglu_alpha, config.swiglu_limit) for _ in range(E)
                                     if experts)
        self.shared_expert_gate = None
        self.shared_expert = None
        self.runner = LocalExperts() if experts else ExpertsElsewhere()
        self.on_route = None

    def __getattr__(self, name: str):
        if name == "gate":
            return self._modules["router"]
        return super().__getattr__(name)


def build_gpt_oss_model(config: ModelConfig, max_positions: int, experts: bool = True) -> CausalLM:
    """The CausalLM of a gpt_oss config: every layer SinkAttention + GptOssMoEBlock (HF names)."""
    layers: list[nn.Module] = []
    for i in range(config.num_hidden_layers):
        layer = DecoderLayer(config, i, mlp=GptOssMoEBlock(config, i, experts))
        layer.self_attn = SinkAttention(config, i)
        layers.append(layer)
    return CausalLM(config, max_positions, layers)
