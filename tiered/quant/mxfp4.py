# N = out-features, K = in-features (gpt-oss's padded widths: biased_width), G = K / 32 groups
"""The "mxfp4" expert kind: gpt-oss's MXFP4 experts held as stored, in 4-bit codes, and computed
exactly.

MXFP4 (OCP Microscaling Formats (MX) v1.0, §5.3 and §6.3; transformers' integrations/mxfp4.py): per
group of 32 inputs one E8M0 scale 2^(e - 127) and 32 FP4 e2m1 codes, valued FP4_E2M1[code] = 0, .5, 1,
1.5, 2, 3, 4, 6 (codes 0..7) and their negatives (bit 3 the sign). This kind keeps the codes as they are
and puts them through a fixed table where they are multiplied:

    E2M1_U[code] = 12 + 2 * FP4_E2M1[code]   in [0, 24]: the unsigned side of a u8 x s8 dot product
    w = (E2M1_U[code] - 12) * scale + zero,   scale = 2^(e - 128) as bf16, zero 0

so w = 2 * value * 2^(e - 128), the MXFP4 weight bit for bit, for every E8M0 byte e in 0..254 (bf16
has fp32's exponents, subnormals down to 2^-133; 255 is NaN in E8M0 and refused where a group's codes
are not all zero). gpt-oss's biases (models/gpt_oss.py: input column K, zero columns after it) are a
group of their own: code 1 (u = 13) at column K with the bias as its scale (exact for a bf16 bias,
refused otherwise: checkpoint/gpt_oss.mxfp4_codes), code 0 (w = 0) after it.

Layout (ExpertFormat's segments): in the "tiled" layout (the host's with tiered/kernels built) the
tiled int4 layout with its scales inline, gw uint8 [N/16, G, 320] (kernels/linear.tiled_codes and
tiled_inline: each 16-row tile's group is 256 code bytes, then its 16 (scale, zero) bf16 pairs), and no
zero-residual segment (tiled int4 keeps one, all zeros where exact: dropped here, as the kernels never
read it): 0.625 bytes a weight against int8-g32's 1.0625. Elsewhere (a CUDA device's "plain" layout,
torch's "cpu" one without the extension) plain codes [N, K/2] (even column in the low nibble) and
sz bf16 [G, N, 2], dequantized by `dequantize` in torch on whatever device holds them.

Kernels (csrc/gemv.cpp, Int4W::e2m1): the tiled int4 kernels on int8 activations (llama.cpp's Q8_0:
x ~ dx * xq per group of 32), the nibbles through E2M1_U by one vpshufb each right after the unpack and
each group's integer dot centred on 12: y = sum_g s dx sum_i (u_i - 12) xq_i + zero sum_i x_i, i.e. the
exact weights times the quantized activations, at every call size (this kind has no bf16 / int16
activation path), in one call up to quant/experts.mxfp4_kernel_rows() rows (a prompt's too);
int4_tiled_dequantize then one matmul past that (in bf16 on AVX-512).
"""

from __future__ import annotations

import functools

import torch

GROUP = 32
CENTRE = 12  # E2M1_U of code 0: the table's zero
# 12 + 2 * e2m1 value by code (transformers' FP4_VALUES doubled, shifted to be unsigned); csrc/gemv.cpp kE2m1U
E2M1_U = (12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0)
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # codes 0..7


def e2m1_doubled(codes: torch.Tensor) -> torch.Tensor:
    """e2m1 codes (any integer dtype, 0..15) -> E2M1_U[code] - 12 = 2 * their value, int32, on their
    device. Computed from the code's bits (sign, 2-bit exponent e, 1-bit mantissa m: 2 * value = m where
    e = 0, else (2 + m) << (e - 1)), not looked up: no table to copy to the device per call (nor inside
    a CUDA graph's capture)."""
    c = codes.to(torch.int32)
    e, m = (c >> 1) & 3, c & 1
    mag = torch.where(e == 0, m, (2 + m) << (e - 1).clamp(min=0))
    return torch.where((c & 8) != 0, -mag, mag)


def e8m0_scales(e: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes uint8 / int [...] -> the kind's scales 2^(e - 128) as bf16 [...], exact for every e in
    0..255 (built from the bits: normal numbers from e = 2, the subnormals 2^-127 and 2^-128 below)."""
    e = e.to(torch.int32)
    bits = torch.where(e >= 2, (e - 1) << 7, 64 >> (1 - e).clamp(0, 1))
    return bits.to(torch.int16).view(torch.bfloat16)


@functools.cache
def _e8m0_table() -> torch.Tensor:
    """e8m0_scales of every byte 0..255, bf16 [256] (built once: one gather per projection at load)."""
    return e8m0_scales(torch.arange(256))


def segments(codes: torch.Tensor, scale: torch.Tensor, layout: str) -> dict[str, torch.Tensor]:
    """The kind's segments of one projection from its e2m1 codes [N, K] (0..15, any integer dtype) and
    scales bf16 [N, K/32] (zeros 0): tiled {"gw"} (N % 16 == 0), else plain {"codes", "sz"} (module
    docstring)."""
    from tiered.kernels.linear import plain_codes, tiled_codes, tiled_inline, tiled_scales

    sz = torch.stack([scale.to(torch.bfloat16), torch.zeros_like(scale, dtype=torch.bfloat16)], -1)  # (N, G, 2)
    sz = sz.transpose(0, 1).contiguous()  # (G, N, 2)
    if layout == "tiled":
        return {"gw": tiled_inline(tiled_codes(codes), tiled_scales(sz))}
    return {"codes": plain_codes(codes), "sz": sz}


def tiled_from_blocks(blocks: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor, width: int, halves: bool,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """One MXFP4 projection and its bias straight to the tiled layout's gw (module docstring), the bytes
    `segments(*checkpoint/gpt_oss.mxfp4_codes(blocks, scales, bias, width, halves), "tiled")["gw"]` gives,
    in fewer passes: the tile bytes (q[r, 8c + j] | q[r, 8c + 4 + j] << 4) from each group's 32 codes,
    moved into place once, and the scales beside them. gpt-oss-20b-shaped experts loaded 3-4x faster
    (the repack was ~60% of a 4-layer model's load on the 2-core EPYC).

    Args:
        blocks: uint8 [N, G, 16], scales: uint8 [N, G] E8M0, halves: as checkpoint/gpt_oss.dequantize_mxfp4
            takes them (K = G * 32; N % 16 == 0).
        bias: [N], any float dtype whose values are bf16 numbers.
        width: biased_width(K).
        out: uint8 [N/16, width/32, 320] to write (an expert slot's view), or None for a new one.
    Returns:
        gw uint8 [N/16, width/32, 320].
    Raises:
        ValueError: as mxfp4_codes (a NaN scale over non-zero codes, a bias that is no bf16 number), or
            N not a multiple of 16.
    """
    from tiered.checkpoint.gpt_oss import _codes, checked_bias, checked_scales

    N, G, _ = blocks.shape
    if N % 16:
        raise ValueError(f"the tiled layout needs out-features a multiple of 16, got {N}")
    T, W = N // 16, width // GROUP
    if bool((scales == 255).any()):  # (rare: the codes are only needed to check a NaN scale's group)
        checked_scales(_codes(blocks, halves), scales)
    b16 = checked_bias(bias)
    gw = torch.empty(T, W, 320, dtype=torch.uint8) if out is None else out
    # four bytes at once: per row, group and 8 columns c8, the tile's 4 bytes q[8c + j] | q[8c + 4 + j] << 4
    # (j = 0..3) as one int32 x [N, G, 4]; a byte's nibble moved by 4 never carries into the next byte
    m = 0x0F0F0F0F
    if halves:  # ggml: byte i holds q[i] (low) and q[16 + i] (high); c8 = 0, 1 from the lows, 2, 3 the highs
        b = blocks.contiguous().view(torch.int32)  # (N, G, 4): bytes 4w .. 4w + 3
        even, odd = b[..., 0::2], b[..., 1::2]
        x = torch.cat(((even & m) | ((odd << 4) & ~m), ((even >> 4) & m) | (odd & ~m)), dim=-1)
    else:
        q = _codes(blocks, halves).contiguous().view(torch.int32)  # (N, G, 8): q[4w .. 4w + 3]
        x = q[..., 0::2] | (q[..., 1::2] << 4)
    gw[:, :G, :256].view(torch.int32).view(T, G, 4, 16).copy_(x.view(T, 16, G, 4).permute(0, 2, 3, 1))
    gw[:, G:, :256] = 0
    gw[:, G, :256].view(T, 4, 16, 4)[:, 0, :, 0] = 1  # the bias column K: code 1 (2 x 0.5) in every row
    sz = gw[..., 256:].view(torch.bfloat16).view(T, W, 16, 2)
    sz.zero_()
    sz[:, :G, :, 0] = _e8m0_table()[scales.long()].view(T, 16, G).transpose(1, 2)
    sz[:, G, :, 0] = b16.view(T, 16)
    return gw


def parts(v: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """A stored projection's (codes int32 [N, K] 0..15, sz bf16 [G, N, 2]) whatever its layout."""
    from tiered.kernels.linear import inline_codes, inline_scales, untiled_codes, untiled_scales

    if "gw" in v:
        return untiled_codes(inline_codes(v["gw"])), untiled_scales(inline_scales(v["gw"]))
    c = v["codes"]
    codes = torch.stack([c & 0x0F, c >> 4], dim=-1).reshape(c.shape[0], -1).to(torch.int32)
    return codes, v["sz"]


def dequantize(v: dict[str, torch.Tensor], N: int, K: int) -> torch.Tensor:
    """The fp32 weight [N, K] of one stored projection, on its tensors' device: (E2M1_U[code] - 12) *
    scale + zero, the MXFP4 values bit for bit (the table applied here as the kernels apply it)."""
    codes, sz = parts(v)
    q = e2m1_doubled(codes).float().reshape(N, K // GROUP, GROUP)
    s, z = sz.float().transpose(0, 1).unbind(-1)  # (N, G) each
    return (q * s[..., None] + z[..., None]).reshape(N, K)


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A dense weight [N, K] (K % 32 == 0) re-quantized to MXFP4 (lossy; what `--weights mxfp4` would do
    to weights not stored so): per group of 32 the scale 2^(floor(log2 max|w|) - 2) (OCP MX v1.0 §6.3:
    e2m1's largest exponent is 2), each weight the nearest e2m1 value of w / scale (6 at most) ->
    (codes uint8 [N, K], scale bf16 [N, K/32] in this kind's convention, 2^(e - 128) for the doubled
    values)."""
    N, K = w.shape
    g = w.float().reshape(N, K // GROUP, GROUP)
    amax = g.abs().amax(-1)  # (N, G)
    x = torch.floor(torch.log2(amax.clamp(min=2.0 ** -126))) - 2  # the E8M0 exponent e - 127
    e = (x + 127).clamp(0, 254)
    r = g / torch.exp2(e - 127)[..., None]
    mags = torch.tensor(E2M1_MAGNITUDES)
    mag = (r.abs()[..., None] - mags).abs().argmin(-1)  # (N, G, 32): nearest magnitude (ties to the smaller)
    codes = (mag | ((r < 0) & (mag > 0)).long() << 3).to(torch.uint8).reshape(N, K)
    return codes, e8m0_scales(e.to(torch.int32))
