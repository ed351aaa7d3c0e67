"""Per-output-channel int8 weights on torch's `_weight_int8pack_mm` CPU kernel (tiered's own GEMV,
tiered/kernels/csrc/gemv.cpp, for batches up to NATIVE_ROWS rows when the extension is loaded).

w[n, k] = q[n, k] * scale[n] with q in -127..127. Used for the decode path of tensors stored as
GGUF Q8_0 (re-quantized from 32-element blocks to one scale per row: lossy, ~2x Q8_0's error) or
of dense tensors when asked. Activations and scales are bf16 for the kernel's fast path.
"""

from __future__ import annotations

import torch
from torch import nn

NATIVE_ROWS = 4  # rows up to which forward uses tiered's own int8 GEMV (faster than torch's there: cpu_gemv.md)


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8 quantization. w float [N, K] -> (q int8 [N, K], scale fp32 [N])."""
    scale = (w.float().abs().amax(dim=1) / 127).clamp_min(1e-12)
    q = (w.float() / scale[:, None]).round().clamp(-127, 127).to(torch.int8)
    return q, scale


class Int8Linear(nn.Module):
    """y = x @ (q * scale)^T (+ b). x [..., K] any float dtype -> [..., N] same dtype."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.register_buffer("q", q.contiguous())  # int8 [N, K]
        self.register_buffer("scale", scale.to(torch.bfloat16))  # bf16 [N]
        self.bias = None if bias is None else nn.Parameter(bias.float(), requires_grad=False)
        self.out_features, self.in_features = q.shape
        self._native = None  # tiered.kernels int8 kernel, built on the first small-batch call

    def _native_kernel(self):
        if self._native is None:
            from tiered.kernels.linear import kernel_for

            self._native = kernel_for(self) or False  # False: no extension, keep the torch op
        return self._native

    @classmethod
    def from_dense(cls, w: torch.Tensor, bias: torch.Tensor | None = None) -> "Int8Linear":
        return cls(*quantize_int8(w), bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        if x.device.type == "cpu" and x.numel() <= NATIVE_ROWS * self.in_features:
            k = self._native_kernel()
            if k:  # ours reads fp32 activations; bias added inside
                return k(x.reshape(-1, self.in_features)).to(x.dtype).reshape(*shape[:-1], self.out_features)
        x2 = x.reshape(-1, self.in_features).to(torch.bfloat16).contiguous()
        y = torch.ops.aten._weight_int8pack_mm(x2, self.q, self.scale)
        y = y.to(x.dtype).reshape(*shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias.to(y.dtype)
