"""DeepSeek-V2 / V3: multi-head latent attention (MLA) and DeepSeek's MoE router and shared experts.

Source: DeepSeek-V2 (DeepSeek-AI 2024, arXiv 2405.04434) §2.1 (MLA) and §2.2 (DeepSeekMoE:
shared experts, device-limited = group-limited routing); DeepSeek-V3 (arXiv 2412.19437) §2.1.2
(sigmoid affinities, auxiliary-loss-free balancing bias used for the choice only, weights
renormalized over the chosen experts). As Hugging Face transformers implements them
(`deepseek_v2`, `deepseek_v3`), whose parameter names these modules keep.

Dimension legend: B = batch, T = new tokens, S = cached positions, D = hidden, H = heads,
R = kv_lora_rank (the latent), r = qk_rope_head_dim (= config.head_dim), n = qk_nope_head_dim,
v = v_head_dim.

The KV cache holds, per position and layer, the normalized latent c_kv [R] and the rotated shared
key k_pe [r] side by side ([R + r], one "head": ModelConfig.kv_widths), not per-head keys and
values: 576 elements for DeepSeek-V2-Lite's 16 heads of 192 + 128 (5,120 as plain attention).
Steps of several tokens (prefill) expand the latent into per-head keys and values with kv_b_proj,
as transformers does. A decode step (T = 1) attends in the latent space instead (MLA's "absorbed"
form, DeepSeek-V2 §2.1.2 / Appendix C): q_nope is mapped through kv_b_proj's key part into the
latent (q_lat = W_UK^T q_nope per head), scores are q_lat . c_kv + q_pe . k_pe, and the weighted sum
of latents goes through kv_b_proj's value part, so a step reads S x (R + r) cached elements, never
S x H x (n + v).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tiered.checkpoint.model_config import ModelConfig, yarn_mscale
from tiered.models.layers import AttentionMetadata, KVCache, RMSNorm, apply_rotary, attend
from tiered.models.moe import Router


class LatentProjection(nn.Linear):
    """kv_b_proj [H (n + v), R]: a subclass of nn.Linear so that it keeps a dense weight (the
    decode-weight swap, quant/linear.install_decode_weights, takes plain nn.Linear only): the
    absorbed decode step reads it per head as a matrix."""


def _latent_attend(q: torch.Tensor, cached: torch.Tensor, R: int, mask: torch.Tensor | None,
                   scale: float) -> torch.Tensor:
    """One decode token per sequence over its cached latents: q [B, H, 1, R + r], cached [B, 1, S, R + r],
    mask bool [B, 1, 1, S] or None -> weighted latents [B, H, 1, R], softmax in fp32.

    Two batched matmuls that read the cache once for all heads. torch's scaled_dot_product_attention
    with enable_gqa on these shapes (16 heads on one head of 576) broadcast the cache per head on
    the CPU: DeepSeek-V2-Lite's widths, 192 positions, bf16, 2.5 ms against 0.28 (2 Zen 4 cores)."""
    B, H = q.shape[0], q.shape[1]
    c = cached[:, 0]  # [B, S, R + r]
    scores = torch.matmul(q.view(B, H, -1), c.transpose(1, 2)).float() * scale  # [B, H, S]
    if mask is not None:
        scores = scores.masked_fill(~mask.view(B, 1, -1), float("-inf"))
    return torch.matmul(scores.softmax(-1).to(c.dtype), c[..., :R]).view(B, H, 1, R)


class LatentAttention(nn.Module):
    """Multi-head latent attention: x [B, T, D] -> [B, T, D], writing [c_kv, k_pe] into the cache.

    Children (HF names): q_proj [H (n + r), D], or q_a_proj [q_lora_rank, D] + q_a_layernorm +
    q_b_proj [H (n + r), q_lora_rank]; kv_a_proj_with_mqa [R + r, D]; kv_a_layernorm [R];
    kv_b_proj [H (n + v), R]; o_proj [D, H v].

    RoPE: rope_interleave rotates pairs (x0, x1), (x2, x3), ...; the pairs are gathered first
    (evens, then odds) and rotated with the rotate-half tables, which gives the same dot products
    (transformers' V3 layout). The softmax scale is (n + r)^-0.5, times mscale(factor,
    mscale_all_dim)^2 under YaRN (transformers' yarn_apply_mscale).
    """

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        D, H = config.hidden_size, config.num_attention_heads
        self.layer_idx, self.H = layer_idx, H
        self.R, self.r, self.n, self.v = config.kv_lora_rank, config.head_dim, config.qk_nope_head_dim, config.v_head_dim
        bias = config.attention_bias
        qk = self.n + self.r
        if config.q_lora_rank:
            self.q_proj = None
            self.q_a_proj = nn.Linear(D, config.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(config.q_lora_rank, 1e-6)
            self.q_b_proj = nn.Linear(config.q_lora_rank, H * qk, bias=False)
        else:
            self.q_proj = nn.Linear(D, H * qk, bias=False)
            self.q_a_proj = self.q_a_layernorm = self.q_b_proj = None
        self.kv_a_proj_with_mqa = nn.Linear(D, self.R + self.r, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.R, 1e-6)
        self.kv_b_proj = LatentProjection(self.R, H * (self.n + self.v), bias=False)
        self.o_proj = nn.Linear(H * self.v, D, bias=bias)
        self.interleave = config.rope_interleave
        self._pairs: dict = {}  # device -> int64 [r]: the even RoPE dimensions, then the odd ones
        self.absorbed: tuple | None = None  # install_absorbed's native per-head kernels (CPU decode)
        self.scale = qk ** -0.5
        s = config.rope_scaling
        if s is not None and s.get("rope_type") == "yarn" and s.get("mscale_all_dim"):
            self.scale *= yarn_mscale(s["factor"], s["mscale_all_dim"]) ** 2

    def install_absorbed(self, ext) -> int:
        """Give the CPU decode step bf16 copies of kv_b_proj's halves in GEMV layout, per head W_UK^T
        [R, n] and W_UV [v, R] (llama.cpp's attn_k_b / attn_v_b), each a native bf16 kernel of
        tiered/kernels (`ext`), run as one `run_grouped` call per half: the absorbed products read
        half the bytes of the fp32 weight (V2-Lite: 4 of 8 MB a layer a token) without torch's
        batched matmuls (in fp32 ~270 us a layer on 2 Zen 4 cores; these ~110). Returns the copies'
        bytes. The dense weight stays for prompts (expanded attention)."""
        H, n, v, R = self.H, self.n, self.v, self.R
        w = self.kv_b_proj.weight.detach().view(H, n + v, R)
        uk = w[:, :n].transpose(1, 2).to(torch.bfloat16).contiguous()  # [H, R, n]
        uv = w[:, n:].to(torch.bfloat16).contiguous()  # [H, v, R]
        self.absorbed = ([ext.bf16_kernel(uk[h]) for h in range(H)], [ext.bf16_kernel(uv[h]) for h in range(H)],
                         ext.run_grouped, (uk, uv))
        return 2 * (uk.numel() + uv.numel())

    def _absorbed_native(self, q_nope: torch.Tensor, meta: AttentionMetadata, q_pe: torch.Tensor,
                         cached: torch.Tensor) -> torch.Tensor:
        """The absorbed decode step through install_absorbed's kernels: q_nope [B, H, 1, n] -> [B, H, 1, v]."""
        ks_uk, ks_uv, run, _ = self.absorbed
        B, H = q_nope.shape[0], self.H
        q_lat = run(ks_uk, q_nope.view(B, H, -1).transpose(0, 1).float().contiguous())  # [H, B, R] fp32
        q_lat = q_lat.transpose(0, 1).unsqueeze(2).to(q_pe.dtype)  # [B, H, 1, R]
        o_lat = _latent_attend(torch.cat((q_lat, q_pe), -1), cached, self.R, meta.mask, self.scale)
        out = run(ks_uv, o_lat.view(B, H, -1).transpose(0, 1).float().contiguous())  # [H, B, v]
        return out.transpose(0, 1).unsqueeze(2).to(q_pe.dtype)

    def _rotate(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """x [B, h, T, r] -> rotated (pairs gathered first when interleaved)."""
        if self.interleave:
            pairs = self._pairs.get(x.device)
            if pairs is None:  # made once per device, outside any CUDA-graph capture's replays
                d = x.device
                pairs = self._pairs[d] = torch.cat((torch.arange(0, self.r, 2, device=d), torch.arange(1, self.r, 2, device=d)))
            x = x.index_select(-1, pairs)
        return apply_rotary(x, meta.cos, meta.sin, meta.sin_signed)

    def forward(self, x: torch.Tensor, meta: AttentionMetadata, cache: KVCache) -> torch.Tensor:
        B, T, _ = x.shape
        H, R, r, n, v = self.H, self.R, self.r, self.n, self.v
        q = self.q_proj(x) if self.q_proj is not None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_pe = q.view(B, T, H, n + r).transpose(1, 2).split((n, r), -1)  # [B, H, T, n], [B, H, T, r]
        latent, k_pe = self.kv_a_proj_with_mqa(x).split((R, r), -1)  # [B, T, R], [B, T, r]
        latent = self.kv_a_layernorm(latent)
        q_pe = self._rotate(q_pe, meta)
        k_pe = self._rotate(k_pe.unsqueeze(1), meta)  # [B, 1, T, r]
        entry = torch.cat((latent.unsqueeze(1), k_pe.to(latent.dtype)), -1)  # [B, 1, T, R + r]
        if meta.segments is not None:  # prompts packed into one row: each writes and attends on its own
            out = torch.cat([self._expanded(q_nope[:, :, o:o + n_], q_pe[:, :, o:o + n_], cache.update(
                self.layer_idx, entry[:, :, o:o + n_], entry[:, :, o:o + n_, :0], one)[0], one)
                for o, n_, one in meta.segments], 2)
            return self.o_proj(out.transpose(1, 2).reshape(B, T, H * v))
        cached, _ = cache.update(self.layer_idx, entry, entry[..., :0], meta)  # [B, 1, S, R + r]
        if cached.dtype != q.dtype:  # a 16-bit KV cache beside fp32 activations
            cached = cached.to(q.dtype)
        if T == 1 and self.absorbed is not None:  # absorbed, tiered's kernels (the plan's native CPU decode)
            out = self._absorbed_native(q_nope, meta, q_pe.to(q.dtype), cached)
        elif T == 1:  # absorbed: attend over the latents, one shared "KV head" of R + r
            # in the model's dtype: torch's bf16 batched matmuls of these shapes run 2-5x slower than fp32
            # ones on the CPU (V2-Lite's widths, 27 layers, 2 Zen 4 cores: ~560 against ~295 us a layer)
            w = self.kv_b_proj.weight.view(H, n + v, R)
            q_lat = torch.matmul(q_nope, w[:, :n].to(q.dtype))  # [B, H, 1, R]
            o_lat = _latent_attend(torch.cat((q_lat, q_pe.to(q_lat.dtype)), -1), cached, R, meta.mask, self.scale)
            out = torch.matmul(o_lat, w[:, n:].transpose(1, 2).to(o_lat.dtype))  # [B, H, 1, v]
        else:
            out = self._expanded(q_nope, q_pe, cached, meta)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, H * v))

    def _expanded(self, q_nope: torch.Tensor, q_pe: torch.Tensor, cached: torch.Tensor,
                  meta: AttentionMetadata) -> torch.Tensor:
        """Attention expanded per head, as transformers computes it (a prompt's): q_nope [B, H, T, n], rotated
        q_pe [B, H, T, r], the cache's [c_kv, k_pe] rows [B, 1, S, R + r] -> [B, H, T, v]."""
        B, H, n, v, R, r = q_nope.shape[0], self.H, self.n, self.v, self.R, self.r
        if cached.dtype != q_nope.dtype:  # a 16-bit KV cache beside fp32 activations
            cached = cached.to(q_nope.dtype)
        S = cached.shape[2]
        kv = F.linear(cached[:, 0, :, :R], self.kv_b_proj.weight).view(B, S, H, n + v).transpose(1, 2)
        k_nope, values = kv.split((n, v), -1)  # [B, H, S, n], [B, H, S, v]
        keys = torch.cat((k_nope, cached[:, :, :, R:].expand(B, H, S, r)), -1)
        return attend(torch.cat((q_nope, q_pe.to(q_nope.dtype)), -1), keys, values, meta.mask, meta.causal,
                      self.scale, False)  # [B, H, T, v]


class DeepSeekRouter(Router):
    """DeepSeek's router (HF `mlp.gate`): weight [E, D], logits in fp32 as transformers computes them.

    topk_method:
        "greedy": softmax scores, top-k (DeepSeek-V2), renormalized when norm_topk_prob (a GGUF
            file's expert_weights_norm; transformers' V2 config never sets it).
        "group_limited_greedy": softmax scores; each group of E / n_group experts is scored by its
            best expert, tokens choose among the topk_group best groups (DeepSeek-V2 §2.2.2).
        "noaux_tc": sigmoid scores; the choice adds `e_score_correction_bias` [E] (fp32), each group
            is scored by the sum of its two best biased scores, and the top-k among the topk_group
            best groups keep their unbiased scores, renormalized when norm_topk_prob (DeepSeek-V3).
    The weights are then multiplied by routed_scaling_factor.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config.hidden_size, config.num_experts, config.num_experts_per_tok, config.norm_topk_prob)
        self.method, self.n_group, self.topk_group = config.topk_method, config.n_group, config.topk_group
        self.scaling = config.routed_scaling_factor
        self.e_score_correction_bias = (nn.Parameter(torch.zeros(config.num_experts), requires_grad=False)
                                        if self.method == "noaux_tc" else None)

    def _group_mask(self, choice: torch.Tensor, best: int) -> torch.Tensor:
        """bool [N, E]: experts in each token's topk_group best groups (a group's score: the sum of
        its `best` highest choice scores)."""
        N, E = choice.shape
        groups = choice.view(N, self.n_group, E // self.n_group)
        score = groups.topk(best, dim=-1).values.sum(-1) if best > 1 else groups.max(-1).values  # [N, G]
        keep = torch.zeros_like(score, dtype=torch.bool).scatter_(1, score.topk(self.topk_group, dim=-1).indices, True)
        return keep.unsqueeze(-1).expand(N, self.n_group, E // self.n_group).reshape(N, E)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, D] -> (topk_idx int64 [N, k], topk_weight [N, k] in x's dtype)."""
        idx, weight = self.select(F.linear(x.float(), self.weight.float()))  # logits [N, E] in fp32
        return idx, weight.to(x.dtype)

    def select(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The routing rule on logits fp32 [N, E] -> (topk_idx int64 [N, k], topk_weight fp32 [N, k])."""
        if self.method == "noaux_tc":
            scores = logits.sigmoid()
            choice = scores + self.e_score_correction_bias.float()
            if self.n_group > 1:
                choice = choice.masked_fill(~self._group_mask(choice, 2), float("-inf"))
            idx = choice.topk(self.top_k, dim=-1).indices
            weight = scores.gather(1, idx)
            if self.norm_topk_prob:
                weight = weight / (weight.sum(-1, keepdim=True) + 1e-20)
        else:
            scores = logits.softmax(dim=-1)
            if self.method == "group_limited_greedy" and self.n_group > 1:
                scores = scores.masked_fill(~self._group_mask(scores, 1), 0.0)
            weight, idx = scores.topk(self.top_k, dim=-1)
            if self.norm_topk_prob:  # a llama.cpp file's expert_weights_norm (transformers' V2 never sets it)
                weight = weight / weight.sum(-1, keepdim=True)
        return idx, weight * self.scaling
