"""GGUF Q6_K weights decoded from their own bits: Q6KLinear, tiered's "q6k" decode-copy format.

Q6_K (llama.cpp's k-quants) stores 256 weights in 210 bytes: 6-bit codes u (0..63), an int8 scale per 16 weights and
an fp16 scale d per 256, w = d sc (u - 32): 6.5625 bits a weight. A Q4_K_M file keeps its head, and attn_v and
ffn_down in about half its layers, in Q6_K; a Q6_K file all of its matrices. tiered had decoded them from int8 copies
per group of 32 (quant/int8.Int8G32Linear, the codes re-quantized: 8.5 bits a weight, 30% more bytes a token than the
file); Q6KLinear keeps the file's codes and scales bit for bit in the native kernels' tiled layout (gemv.cpp "q6k"):

    qt uint8 [N/16, K/32, 384]   per tile of 16 rows and group of 32 columns, the codes' low nibbles (256 bytes)
                                 and their high 2 bits (128 bytes), arranged so that each 4-column chunk is one
                                 64-byte vector of u bytes after a shift and a ternary logic op
    sc int8 [N/16, K/16, 16]     Q6_K's scale per 16 weights, a tile's 16 rows side by side
    d fp16 [N/16, K/256, 16]     its scale per super-block of 256

The kernel multiplies u against the activations quantized per group of 32 as the int8-g32 kernel's are (int16 at one
row: batch-1 numerics; int8 in calls of 2+ rows where batch_act is "q8"), and takes out 32 sum(x) per 16 weights.
"""

from __future__ import annotations

import numpy as np
import torch

from tiered.kernels.linear import NativeLinear

BLOCK_BYTES = 210  # bytes per Q6_K super-block of 256 weights
BYTES_PER_WEIGHT = BLOCK_BYTES / 256  # 0.8203125: what the decode copy holds, as the file does


def q6k_fits(shape) -> bool:
    """Whether a Q6_K weight of `shape` [N, K] can take a q6k decode copy: tiered's kernels are built, N % 16 == 0
    (the layout's tiles) and K % 256 == 0 (Q6_K's super-blocks: always, for a Q6_K tensor)."""
    from tiered.kernels import load

    return len(shape) == 2 and shape[0] % 16 == 0 and shape[1] % 256 == 0 and load() is not None


class Q6KLinear(NativeLinear):
    """y = x @ W^T (+ b) with W a GGUF Q6_K weight as stored: w = d sc (u - 32) (module docstring's layout).

    x [..., K] any float dtype -> [..., N] in x's dtype through the native kernel (`dense`: a prompt's rows through
    the weight dequantized to bf16 and oneDNN's GEMM). On the 2-core Zen 4 VM a 4096 x 14336 weight at batch 1
    took 1.70 ms a call against 2.06-2.27 for its int8-g32 copy (2026-12-07, weights past the L3).
    `batch_act`: what calls of two or more rows multiply (Plan.batch_act), as Int8G32Linear's: "bf16" the
    int16-quantized x of one row, "q8" x quantized to int8 per group of 32.

    Raises:
        ValueError: batch_act other than "bf16" or "q8".
    """

    def __init__(self, qt: torch.Tensor, sc: torch.Tensor, d: torch.Tensor, bias: torch.Tensor | None = None,
                 batch_act: str = "bf16") -> None:
        super().__init__()
        if batch_act not in ("bf16", "q8"):
            raise ValueError(f"batch_act must be 'bf16' or 'q8', got {batch_act!r}")
        self.register_buffer("qt", qt.contiguous())  # uint8 [N/16, K/32, 384]
        self.register_buffer("sc", sc.contiguous())  # int8 [N/16, K/16, 16]
        self.register_buffer("d", d.contiguous())  # fp16 [N/16, K/256, 16]
        self.bias = None if bias is None else torch.nn.Parameter(bias.float(), requires_grad=False)
        self.out_features, self.in_features = qt.shape[0] * 16, qt.shape[1] * 32
        self.batch_act = batch_act

    @classmethod
    def from_blocks(cls, blocks: list[np.ndarray | torch.Tensor], bias: torch.Tensor | None = None,
                    batch_act: str = "bf16") -> "Q6KLinear":
        """The Q6_K blocks of one or more weights (uint8 [N_i, K/256 * 210] each, N_i % 16 == 0; a fused group's
        parts, rows side by side) in the q6k layout, one native pass each.

        Raises:
            RuntimeError: the native extension is unavailable.
            ValueError: blocks of different widths, or rows not a multiple of 16."""
        from tiered.kernels import load
        from tiered.quant.gguf_dequant import blocks_tensor

        ext = load()
        if ext is None:
            raise RuntimeError("Q6KLinear needs tiered/kernels built")
        raws = [b if isinstance(b, torch.Tensor) else blocks_tensor(b) for b in blocks]
        if len({r.shape[1] for r in raws}) != 1 or any(r.shape[0] % 16 for r in raws):
            raise ValueError(f"Q6KLinear.from_blocks: parts of one width and N % 16 == 0 rows each, got "
                             f"{[tuple(r.shape) for r in raws]}")
        parts = [ext.q6k_blocks_q6t(r) for r in raws]
        return cls(*(p[0] if len(parts) == 1 else torch.cat(p) for p in zip(*parts)), bias, batch_act)

    def _build(self, ext, bias):
        return ext.q6k_kernel(self.qt, self.sc, self.d, bias, self.batch_act)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """W [N, K]: d sc (u - 32) in fp32 (gguf's order of operations: equal to gguf.quants.dequantize's), or
        that rounded to bf16 (dtype torch.bfloat16)."""
        from tiered.kernels import load

        return load().q6k_tiled_dequantize(self.qt, self.sc, self.d, dtype == torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = self.kernel()(x.reshape(-1, self.in_features))
        return y.to(x.dtype).reshape(*shape[:-1], self.out_features)

    def dense(self, x: torch.Tensor) -> torch.Tensor:
        """The prefill path: x [..., K] -> [..., N] in x's dtype; as Int8G32Linear.dense, beyond
        quant/int4.dequantize_rows() rows where quant/int4.dequantize_dtype() is bf16 the weight dequantized to bf16
        (in row chunks of whole tiles) for oneDNN's GEMM, else the native kernel."""
        import tiered.quant.int4 as int4
        from tiered.kernels.linear import q6k_dequantize

        x2 = x.reshape(-1, self.in_features)
        limit = int4.dequantize_rows()
        if limit is None or x2.shape[0] <= limit or int4.dequantize_dtype() != torch.bfloat16:
            return self.forward(x)
        bias = None if self.bias is None else self.bias.to(torch.bfloat16)
        y = int4.gemm_by_row_chunks(x2.to(torch.bfloat16), self.out_features, bias=bias, weight_rows=lambda n0, n1:
                                    q6k_dequantize(self.qt[n0 // 16:n1 // 16], self.sc[n0 // 16:n1 // 16],
                                                   self.d[n0 // 16:n1 // 16]))
        return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
