"""FP8 E4M3 weights with one fp32 scale per 128 x 128 block: the "fine-grained FP8" of DeepSeek-V3's
release (DeepSeek-V3 technical report, section 3.3) and of Qwen3's FP8 checkpoints, as transformers
names it (`quantization_config = {"quant_method": "fp8", "weight_block_size": [128, 128]}`; each
`X.weight` float8_e4m3fn [N, K] beside `X.weight_scale_inv` fp32 [ceil(N/128), ceil(K/128)]).

    w[n, k] = e4m3(q[n, k]) * s[n // 128, k // 128]

The same bytes are the "fp8" expert kind (quant/experts.py: segments q uint8 [N, K], the bit patterns,
and bs fp32 [ceil(N/128), ceil(K/128)]), which tiered's native kernel computes from as stored.
Dequantization follows transformers' (integrations/finegrained_fp8.Fp8Dequantize): the product in
fp32, then rounded to the compute dtype.

The other FP8 releases scale per output channel or per tensor (compressed-tensors' "channel" /
"tensor" strategies: RedHatAI's Llama-3.1-70B-Instruct-FP8; fbgemm_fp8: Meta's Llama-3.1-405B-FP8;
AutoFP8's per-tensor `weight_scale`): w[n, k] = e4m3(q[n, k]) * s[n] (or * s). They are blocks too,
(1, K) and (N, K) (checkpoint/hf_dir.py folds them so), and the native kernel takes them as stored
(`kernel_scales`: one scale per row across all columns); as experts they are dequantized.
"""

from __future__ import annotations

import torch

from tiered.errors import CheckpointError
from tiered.kernels.linear import NativeLinear

BLOCK = 128  # rows and columns per scale
E4M3_MAX = 448.0  # the largest finite float8_e4m3fn


def scale_shape(N: int, K: int, block: tuple[int, int] = (BLOCK, BLOCK)) -> tuple[int, int]:
    """Shape of the block scales of an [N, K] weight in blocks of `block` = (br, bc): (ceil(N/br), ceil(K/bc))."""
    br, bc = block
    return (N + br - 1) // br, (K + bc - 1) // bc


def as_stored(handle) -> bool:
    """Whether a checkpoint tensor is block-scaled fp8 in this format's 128 x 128 blocks, which the fp8
    expert kind and Fp8Linear keep as stored (other blocks are dequantized)."""
    return handle.format == "F8_E4M3" and handle.fp8_block == (BLOCK, BLOCK)


def kernel_row_block(N: int, K: int, block: tuple[int, int]) -> int | None:
    """The native fp8 kernel's row_block for an [N, K] weight scaled per `block` (br, bc): 128 for 128 x 128
    blocks, 1 per output channel (br 1) or per tensor (one row block, br >= N: its scale repeated per
    row by kernel_scales, so that parts of a fused projection keep theirs); columns in blocks of 128 or
    one block across K. None for other blocks (dequantized instead)."""
    br, bc = block
    if not (bc == BLOCK or bc >= K):
        return None
    if br >= N and (br, bc) != (BLOCK, BLOCK):
        return 1
    return br if br in (1, BLOCK) else None


def kernel_scales(bs: torch.Tensor, N: int, K: int, block: tuple[int, int]) -> tuple[torch.Tensor, int] | None:
    """(scales as tiered's fp8 kernel takes them, fp32 [ceil(N/rb), ceil(K/128) or 1], its row_block rb) for
    an [N, K] weight with scales bs [ceil(N/br), ceil(K/bc)] per `block`; None where kernel_row_block is."""
    rb = kernel_row_block(N, K, block)
    if rb is None:
        return None
    bs = bs.float().reshape(scale_shape(N, K, block))
    if rb == 1 and block[0] != 1:  # one scale for every row: repeated per row (4 bytes a row)
        bs = bs.expand(N, bs.shape[1])
    return bs.contiguous(), rb


def expand_scales(bs: torch.Tensor, N: int, K: int, block: tuple[int, int] = (BLOCK, BLOCK)) -> torch.Tensor:
    """Block scales [ceil(N/br), ceil(K/bc)] (any float dtype) -> one per weight, fp32 [N, K]."""
    br, bc = block
    return bs.float().repeat_interleave(br, 0)[:N].repeat_interleave(bc, 1)[:, :K]


def dequantize_fp8(q: torch.Tensor, bs: torch.Tensor, dtype: torch.dtype = torch.float32,
                   block: tuple[int, int] = (BLOCK, BLOCK)) -> torch.Tensor:
    """The weight [N, K] in `dtype` from q (float8_e4m3fn, or its bit patterns as uint8) [N, K] and
    block scales bs [ceil(N/br), ceil(K/bc)] (any float dtype) for blocks of `block` = (br, bc):
    e4m3(q) * s in fp32, then `dtype` (transformers' arithmetic). On q's device."""
    if q.dtype == torch.uint8:
        q = q.view(torch.float8_e4m3fn)
    (N, K), (br, bc) = q.shape, block
    s = bs.to(device=q.device, dtype=torch.float32)
    if N % br == 0 and K % bc == 0:  # whole blocks: the scales broadcast, one fp32 temporary
        return q.float().view(N // br, br, K // bc, bc).mul_(s[:, None, :, None]).view(N, K).to(dtype)
    return (q.float() * expand_scales(s, N, K, block)).to(dtype)


def quantize_fp8(w: torch.Tensor, block: tuple[int, int] = (BLOCK, BLOCK)) -> tuple[torch.Tensor, torch.Tensor]:
    """A dense weight w [N, K] -> (q uint8 [N, K] e4m3fn bit patterns, bs fp32 [ceil(N/br), ceil(K/bc)])
    for blocks of `block` = (br, bc) ((1, K): per output channel; (N, K): per tensor): each block's
    scale is its largest |w| / 448 (1 for an all-zero block), q = round-to-nearest e4m3 of w / scale
    (transformers' Fp8Quantize rule)."""
    N, K = w.shape
    br, bc = block
    w = w.float()
    gn, gk = scale_shape(N, K, block)
    padded = torch.zeros(gn * br, gk * bc, dtype=torch.float32, device=w.device)
    padded[:N, :K] = w
    amax = padded.reshape(gn, br, gk, bc).abs().amax(dim=(1, 3))
    bs = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    q = (w / expand_scales(bs, N, K, block)).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q.view(torch.uint8), bs


def check_scales(name: str, shape: tuple[int, ...], scale_shape_: tuple[int, ...], block: tuple[int, int]) -> None:
    """Check that a weight [N, K]'s `weight_scale_inv` has one scale per `block` (rows, columns).

    Raises:
        CheckpointError: the weight is not 2-D or the scales' shape is not (ceil(N/br), ceil(K/bc)).
    """
    if len(shape) != 2:
        raise CheckpointError(f"fp8 weight {name!r} has shape {tuple(shape)}; block-scaled weights are matrices",
                              "re-convert the checkpoint")
    (N, K), (br, bc) = shape, block
    want = scale_shape(N, K, block)
    if tuple(scale_shape_) != want:
        raise CheckpointError(f"fp8 weight {name!r} [{N}, {K}] has block scales of shape {tuple(scale_shape_)}, "
                              f"{want} expected for blocks of {br} x {bc}", "re-download or re-convert the checkpoint")


class Fp8Linear(NativeLinear):
    """y = x @ W^T (+ b) with W scaled fp8 as a checkpoint stores it: the decode copy (and, in the
    one-copy mode, the only copy) of a DeepSeek-V3 / Qwen3-FP8 projection (128 x 128 blocks) or of a
    Llama-3.1-70B-FP8 one (a scale per output channel), a byte a weight where a bf16 copy takes two.

    x [..., K] any float dtype -> [..., N] in x's dtype: up to `dequantize_rows()` rows through tiered's
    native fp8 kernel (fp32 activations, every 128-column block's dot scaled once); more rows (a
    prompt) dequantize W in row chunks to quant/int4.dequantize_dtype() for GEMMs, as Int4Linear.dense
    does. Needs the native extension (`kernel`).

    Args:
        q: uint8 [N, K] e4m3fn bit patterns; bs: fp32 [ceil(N/row_block), ceil(K/128)], or
            [ceil(N/row_block), 1] for one scale across the columns (kernel_scales); bias: [N] or None.
        row_block: rows per scale, 128 (blocks) or 1 (per output channel).
    """

    def __init__(self, q: torch.Tensor, bs: torch.Tensor, bias: torch.Tensor | None = None,
                 row_block: int = BLOCK) -> None:
        super().__init__()
        self.register_buffer("q", q.contiguous())
        self.register_buffer("bs", bs.float().contiguous())
        self.bias = None if bias is None else torch.nn.Parameter(bias.float(), requires_grad=False)
        self.out_features, self.in_features = q.shape
        self.row_block = row_block
        self.block = (row_block, BLOCK if self.bs.shape[1] > 1 else max(BLOCK, self.in_features))

    def _build(self, ext, bias):
        return ext.fp8_kernel(self.q, self.bs, bias, row_block=self.row_block)

    def dequantize(self) -> torch.Tensor:
        """W fp32 [N, K]."""
        return dequantize_fp8(self.q, self.bs, block=self.block)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        import tiered.quant.int4 as int4

        limit = int4.dequantize_rows()
        if limit is not None and x2.shape[0] > limit:
            return self.dense(x)
        return self.kernel()(x2).to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def dense(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] -> [..., N] in x's dtype through W dequantized (in row chunks) for GEMMs in
        quant/int4.dequantize_dtype() (bf16 where the CPU has AVX512_BF16, else fp32)."""
        import tiered.quant.int4 as int4

        dt = int4.dequantize_dtype()
        x2 = x.reshape(-1, self.in_features).to(dt)
        bias = None if self.bias is None else self.bias.to(dt)
        y = int4.gemm_by_row_chunks(x2, self.out_features, bias=bias, weight_rows=lambda n0, n1: self._rows(n0, n1, dt))
        return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def _rows(self, n0: int, n1: int, dtype: torch.dtype) -> torch.Tensor:
        """W's rows [n0, n1) in `dtype`."""
        K, rb = self.in_features, self.row_block
        s = self.bs[n0 // rb:(n1 + rb - 1) // rb]
        return (self.q[n0:n1].view(torch.float8_e4m3fn).float()
                * expand_scales(s, n1 - n0 + n0 % rb, K, self.block)[n0 % rb:]).to(dtype)
