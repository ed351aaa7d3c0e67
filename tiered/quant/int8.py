"""Per-output-channel int8 weights on torch's `_weight_int8pack_mm` CPU kernel (tiered's own GEMV,
tiered/kernels/csrc/gemv.cpp, for batches up to NATIVE_ROWS rows when the extension is loaded).

w[n, k] = q[n, k] * scale[n] with q in -127..127. Used for the decode path of tensors stored as
GGUF Q8_0 (re-quantized from 32-element blocks to one scale per row: lossy, ~2x Q8_0's error) or
of dense tensors when asked. Activations and scales are bf16 for the kernel's fast path.
"""

from __future__ import annotations

import torch
from torch import nn

from tiered.kernels.linear import NativeLinear

NATIVE_ROWS = 4  # rows up to which forward uses tiered's own int8 GEMV (faster than torch's there: cpu_gemv.md)
# Rows from which forward multiplies the codes converted to bf16 (exact) in one oneDNN GEMM, then the row scales,
# where the native kernels' ISA GEMMs in bf16 (quant/int4.dequantize_dtype: AVX-512 BF16), instead of
# _weight_int8pack_mm, whose cost grows ~linearly with the rows. A gpt-oss-20b q/k/v weight (5120 x 2880) on 2
# Sapphire Rapids cores (AMX), ms at 8 / 16 / 32 / 64 / 128 / 512 rows: int8pack 2.9 / 4.7 / 8.1 / 14.3 / 26.6
# / 107, bf16 codes + GEMM 4.2 / 4.1 / 4.4 / 4.4 / 5.9 / 14.4 (2026-11-29), the same relative error to the
# exact product (1.7e-3: both round x to bf16). 32, not the measured 16: a CPU with AVX512_BF16 but no AMX
# (Zen 4) GEMMs bf16 several times slower.
DEQUANTIZE_ROWS = 32
INT8PACK_K = 16  # torch's CPU `_weight_int8pack_mm` needs K % 16 == 0: other widths crash or are wrong


def int8pack_mm(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x bf16 [M, K] @ (q int8 [N, K] * scale bf16 [N])^T -> bf16 [M, N].

    torch's `_weight_int8pack_mm` where its CPU kernel is right: on torch 2.13 a K that is not a
    multiple of 16 segfaults (K = 24: DeepSeek-V3-style q_b_proj on a small query rank) or returns
    wrong rows (K = 8, 40), so such weights (small in practice) run dequantized through F.linear.
    """
    if q.shape[1] % INT8PACK_K == 0 or x.device.type != "cpu":
        return torch.ops.aten._weight_int8pack_mm(x, q, scale)
    return torch.nn.functional.linear(x, q.to(x.dtype) * scale.to(x.dtype)[:, None])


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
        if self._bf16_gemm(x2):
            from tiered.kernels.linear import bf16_rows
            from tiered.quant.int4 import gemm_by_row_chunks

            y = gemm_by_row_chunks(x2, self.out_features, lambda n0, n1: bf16_rows(self.q, n0, n1), None)
            y = y.float() * self.scale.float()
        else:
            y = int8pack_mm(x2, self.q, self.scale)
        y = y.to(x.dtype).reshape(*shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def _bf16_gemm(self, x2: torch.Tensor) -> bool:
        """Whether a call of x2 [M, K] (bf16) takes the bf16 GEMM over the codes (DEQUANTIZE_ROWS): a CPU
        prompt's rows where the native kernels' ISA GEMMs in bf16."""
        if x2.device.type != "cpu" or x2.shape[0] < DEQUANTIZE_ROWS:
            return False
        from tiered.quant.int4 import dequantize_dtype

        return dequantize_dtype() == torch.bfloat16


def quantize_int8_g32(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per group of 32 columns. w float [N, K] (K % 32 == 0) -> (q int8 [N, K],
    scale fp16 [N, K/32]) with w ~ q * scale[g]: each group's error at most half its scale
    (max |w| of the group / 254)."""
    N, K = w.shape
    g = w.float().reshape(N, K // 32, 32)
    s = (g.abs().amax(-1) / 127).clamp_min(1e-12).to(torch.float16)
    q = (g / s.float()[..., None]).round().clamp(-127, 127).to(torch.int8).reshape(N, K)
    return q, s


def tiled_int8_g32(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w float [N, K] quantized by `quantize_int8_g32` into the tiled int8 layout of tiered's kernels:
    (qt uint8 [N, K], st fp16 [N/16, K/32, 16]) (kernels/linear.tiled_int8, tiled_group_scales).

    Raises:
        ValueError: a shape the tiled layout does not take (N % 16, K % 32)."""
    from tiered.kernels.linear import tiled_group_scales, tiled_int8

    q, s = quantize_int8_g32(w)
    return tiled_int8(q), tiled_group_scales(s)


class Int8G32Linear(NativeLinear):
    """y = x @ W^T (+ b) with W int8 in groups of 32 along K, each group with its own fp16 scale
    (w = q * s_g): the decode copy of GGUF Q5_x / Q6_K tensors (their 6-bit codes and 16-weight
    sub-scales re-quantized per 32 weights: ~2^-8 of a group's max, where one scale per row, as
    Int8Linear keeps, would lose ~4x more on rows with outliers), at 1.06 bytes a weight against
    Q6_K's 0.82 and bf16's 2. The tiled int8 layout of tiered's kernels (kernels/linear.tiled_int8,
    tiled_group_scales; the experts' "int8-g32" format): qt uint8 [N, K], st fp16 [N/16, K/32, 16].

    x [..., K] any float dtype -> [..., N] in x's dtype through the native kernel at every row count:
    on the 2-core EPYC, a 4096 x 14336 weight took 2.1 / 47 / 111 / 396 ms for 1 / 64 / 128 / 512
    rows there, and 321 / 373 / 477 / 709 ms dequantized (in torch, ~280 ms) for one fp32 GEMM.
    Needs the native extension and N % 16 == 0, K % 32 == 0 (kernels/linear.int8_tiles).
    `batch_act`: what calls of two or more rows multiply (Plan.batch_act): "bf16" the int16-quantized x of
    one row (exact int32 dots per group of 32), "q8" x quantized to int8 per group of 32 (llama.cpp's Q8_0
    activations; one vpdpbusd per 4 weights and row where int16 takes two: a SmolLM2-width head of
    49152 x 576 at 16 / 48 rows took 1.28 / 3.72 ms against 2.24 / 6.80 on 2 AMX cores, its error to the
    fp32 product 7.6e-3 against 5.3e-3, 2026-12-05). AVX2 reads int16 either way.

    Raises:
        ValueError: batch_act other than "bf16" or "q8".
    """

    def __init__(self, qt: torch.Tensor, st: torch.Tensor, bias: torch.Tensor | None = None,
                 batch_act: str = "bf16") -> None:
        super().__init__()
        if batch_act not in ("bf16", "q8"):
            raise ValueError(f"batch_act must be 'bf16' or 'q8', got {batch_act!r}")
        self.register_buffer("qt", qt.contiguous())  # uint8 [N, K], tiled
        self.register_buffer("st", st.contiguous())  # fp16 [N/16, K/32, 16]
        self.bias = None if bias is None else nn.Parameter(bias.float(), requires_grad=False)
        self.out_features, self.in_features = qt.shape
        self.batch_act = batch_act

    @classmethod
    def from_dense(cls, w: torch.Tensor, bias: torch.Tensor | None = None, batch_act: str = "bf16") -> "Int8G32Linear":
        """Quantize a dense float weight [N, K] (`tiled_int8_g32`); batch_act as the constructor's.

        Raises:
            ValueError: a shape the tiled layout does not take."""
        return cls(*tiled_int8_g32(w), bias, batch_act)

    def _build(self, ext, bias):
        return ext.int8g32_tiled_kernel(self.qt, self.st, bias, self.batch_act)

    def dequantize(self) -> torch.Tensor:
        """W fp32 [N, K] (quant/experts.dequantize_projection, the experts' int8-g32 arithmetic)."""
        from tiered.quant.experts import dequantize_projection

        return dequantize_projection({"qt": self.qt, "st": self.st}, "int8-g32", self.out_features,
                                     self.in_features, "tiled")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = self.kernel()(x.reshape(-1, self.in_features))
        return y.to(x.dtype).reshape(*shape[:-1], self.out_features)

    def dense(self, x: torch.Tensor) -> torch.Tensor:
        """The prefill path: x [..., K] -> [..., N] in x's dtype. Beyond quant/int4.dequantize_rows(batch_act)
        rows (None: never) where quant/int4.dequantize_dtype() is bf16 (AVX-512), the weight dequantized to bf16
        natively (kernels/linear.tiled_int8_g32_dequantize; in row chunks beyond
        quant/int4.DEQUANTIZE_CHUNK elements) for oneDNN's bf16 GEMM, as Int4Linear.dense does; else the
        native kernel. On the 2-core EPYC (2026-11-26), 4096 x 14336 at 512 rows on int16 ("bf16") rows: 396 ms
        through the kernel, ~160 ms so; on the 2-core Zen 4 VM (2026-12-07), whose tuning runs int8 rows at every
        count, 14336 x 4096 on 256 / 1024 q8 rows 79 / 321 ms in the kernel against 108 / 343 dequantized."""
        import tiered.quant.int4 as int4

        x2 = x.reshape(-1, self.in_features)
        limit = int4.dequantize_rows(self.batch_act)
        if limit is None or x2.shape[0] <= limit or int4.dequantize_dtype() != torch.bfloat16:
            return self.forward(x)
        from tiered.kernels.linear import tiled_int8_g32_dequantize

        bias = None if self.bias is None else self.bias.to(torch.bfloat16)
        y = int4.gemm_by_row_chunks(x2.to(torch.bfloat16), self.out_features, bias=bias, weight_rows=lambda n0, n1:
                                    tiled_int8_g32_dequantize(self.qt[n0:n1], self.st[n0 // 16:n1 // 16]))
        return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
