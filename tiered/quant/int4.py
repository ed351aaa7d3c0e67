"""Group-wise 4-bit weights on torch's packed-int4 CPU kernel.

Format: for each output row and each group of `group` (32) input columns, 4-bit codes q in 0..15
with a scale and a zero: w = (q - 8) * scale + zero. GGUF's Q4_0 (w = d * (q - 8)) and Q4_1
(w = d * q + m) blocks map onto it exactly: Q4_0 -> (scale=d, zero=0); Q4_1 -> (scale=d,
zero=m + 8d). The kernel (`aten._weight_int4pack_mm_for_cpu`) takes bf16 activations and bf16
scales/zeros, so the weights are read at ~4.5 bits each; rounding d and m to bf16 and the
activations to bf16 makes this path lossy (like llama.cpp's Q8 activations), never the default
for scoring or prefill.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

GROUP = 32  # elements per Q4_0 / Q4_1 block


def unpack_q4_blocks(raw: np.ndarray, fmt: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Decode GGUF Q4_0 / Q4_1 blocks.

    Args:
        raw: uint8 [N, K / 32 * block_bytes] (one row of blocks per output feature).
        fmt: "Q4_0" (18-byte blocks) or "Q4_1" (20-byte blocks).
    Returns:
        codes int32 [N, K] in 0..15, scale fp32 [N, K/32], zero fp32 [N, K/32] with
        w = (codes - 8) * scale + zero.
    """
    block = 18 if fmt == "Q4_0" else 20
    N = raw.shape[0]
    b = np.ascontiguousarray(raw).reshape(N, -1, block)  # (N, G, block)
    d = b[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)  # (N, G)
    qs = b[..., block - 16:]  # (N, G, 16): element j in low nibble, j + 16 in high nibble
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(np.int32).reshape(N, -1)  # (N, K)
    if fmt == "Q4_0":
        zero = np.zeros_like(d)
    else:
        m = b[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        zero = m + 8.0 * d
    return torch.from_numpy(codes), torch.from_numpy(d), torch.from_numpy(zero)


def quantize_int4(w: torch.Tensor, group: int = GROUP) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric min/max group-wise int4 quantization of a dense weight.

    Args:
        w: float [N, K], K divisible by `group`.
    Returns:
        codes int32 [N, K] in 0..15, scale fp32 [N, K/group], zero fp32 [N, K/group].
    """
    N, K = w.shape
    g = w.float().reshape(N, K // group, group)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / 15).clamp_min(1e-12)
    codes = ((g - lo.unsqueeze(-1)) / scale.unsqueeze(-1)).round().clamp(0, 15).to(torch.int32)
    zero = lo + 8 * scale
    return codes.reshape(N, K), scale, zero


class Int4Linear(nn.Module):
    """y = x @ W^T (+ b) with W in packed int4 groups. x [..., K] any float dtype -> [..., N] same dtype.

    Built by `from_codes`, `from_gguf` or `from_dense`; holds ~K*N/2 + 4*N*K/group bytes.
    """

    def __init__(self, packed: torch.Tensor, scales_zeros: torch.Tensor, in_features: int,
                 out_features: int, group: int, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.register_buffer("packed", packed)  # uint8 [N, K/2], kernel layout
        self.register_buffer("scales_zeros", scales_zeros)  # bf16 [K/group, N, 2]
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.in_features, self.out_features, self.group = in_features, out_features, group
        # Optional second layout: plain codes uint8 [N, K/2] for tiered's own int4 kernel
        # (kernels/linear.kernel_for); +K*N/2 bytes, so only when asked (`with_plain_codes`).
        self.codes: torch.Tensor | None = None

    def with_plain_codes(self, codes: torch.Tensor) -> "Int4Linear":
        """Also hold codes int [N, K] (0..15) in the plain layout, for tiered's own int4 kernel."""
        from tiered.kernels.linear import plain_codes

        self.codes = plain_codes(codes)
        return self

    @classmethod
    def from_codes(cls, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                   group: int = GROUP, bias: torch.Tensor | None = None) -> "Int4Linear":
        """codes int32 [N, K]; scale, zero fp32 [N, K/group]."""
        N, K = codes.shape
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.contiguous(), 1)
        sz = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)
        return cls(packed, sz, K, N, group, bias)

    @classmethod
    def from_gguf(cls, raw: np.ndarray, fmt: str, bias: torch.Tensor | None = None) -> "Int4Linear":
        """Pack GGUF Q4_0 / Q4_1 blocks (uint8 [N, bytes_per_row]) without dequantizing."""
        return cls.from_codes(*unpack_q4_blocks(raw, fmt), group=GROUP, bias=bias)

    @classmethod
    def from_dense(cls, w: torch.Tensor, bias: torch.Tensor | None = None, group: int = GROUP) -> "Int4Linear":
        """Quantize a dense float weight [N, K] (K % group == 0)."""
        return cls.from_codes(*quantize_int4(w, group), group=group, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features).to(torch.bfloat16).contiguous()
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, self.packed, self.group, self.scales_zeros)
        y = y.to(x.dtype).reshape(*shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias.to(y.dtype)
