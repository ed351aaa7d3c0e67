"""Weights -> the fastest `Kernel` of the native extension for them (csrc/gemv.cpp, csrc/kernels.cpp).

Every function returns None when the extension is unavailable (`tiered.kernels.load()` is None:
TIERED_NATIVE=0, or no compiler); callers then keep their torch-op paths.

    weight                                   kernel
    Int8Linear (q int8 [N, K], scale [N])    int8_kernel (ours)
    Int4Linear with plain codes              int4_kernel (ours, bf16 activations: act="q8" is faster but
                                             doubles SmolLM2's int4 KL, see EXPERT_INT4_ACT)
    Int4Linear (torch's packed layout only)  int4pack_kernel (torch's _weight_int4pack_mm_for_cpu)
    CastLinear / nn.Linear, bf16 weight      bf16_kernel (ours)
    nn.Linear, other dtypes                  dense_kernel (at::linear)

A Kernel is called as kernel(x [B, K] any float dtype) -> y [B, N] fp32 (bias added).
"""

from __future__ import annotations

import torch
from torch import nn

from tiered.kernels import load


def plain_codes(codes: torch.Tensor) -> torch.Tensor:
    """int4 codes int [N, K] in 0..15 -> uint8 [N, K/2], column 2i in the low nibble (ExpertFormat's
    "plain" layout, what `int4_kernel` reads)."""
    c = codes.to(torch.uint8)
    return (c[:, 0::2] | (c[:, 1::2] << 4)).contiguous()


def int4_kernel(codes: torch.Tensor, scales_zeros: torch.Tensor, residual: torch.Tensor | None = None,
                bias: torch.Tensor | None = None, act: str = "bf16"):
    """Our int4 kernel over plain codes uint8 [N, K/2] and Int4Linear's scales_zeros bf16 [K/32, N, 2]
    (w = (q - 8) * scale + zero), plus an optional zero residual bf16 [K/32, N]. No copy of the
    weights: the kernel reads the tensors given (and keeps them alive). None without the extension.

    act: the activations the kernel reads: "bf16" (x rounded to bf16, vdpbf16ps per group of 32) or
    "q8" (x quantized to int8 per group of 32 as llama.cpp's Q8_0, vpdpbusd per 4 groups: ~2x the
    bandwidth of "bf16" at batch 1, adds the activations' 8-bit rounding to the error)."""
    ext = load()
    if ext is None:
        return None
    zr = None if residual is None else residual.T
    return ext.int4_kernel(codes, scales_zeros[..., 0].T, scales_zeros[..., 1].T, zr, bias, act)


def kernel_for(m: nn.Module):
    """The best native Kernel computing module `m` (x [B, K] -> y [B, N] fp32 with m's bias).

    Args:
        m: Int4Linear, Int8Linear, CastLinear or nn.Linear (any weight dtype).
    Returns:
        A Kernel, or None when the extension is unavailable.
    Raises:
        TypeError: a module of another type.
    """
    from tiered.quant.int4 import Int4Linear
    from tiered.quant.int8 import Int8Linear
    from tiered.quant.linear import CastLinear

    ext = load()
    if ext is None:
        return None
    bias = getattr(m, "bias", None)
    bias = None if bias is None else bias.detach().float()
    if isinstance(m, Int4Linear):
        if m.codes is not None:
            return int4_kernel(m.codes, m.scales_zeros, bias=bias)
        return ext.int4pack_kernel(m.packed, m.group, m.scales_zeros, m.in_features, m.out_features, bias)
    if isinstance(m, Int8Linear):
        return ext.int8_kernel(m.q, m.scale, bias)
    if isinstance(m, (CastLinear, nn.Linear)):
        w = m.weight.detach()
        if w.dtype == torch.bfloat16 and w.is_contiguous():
            return ext.bf16_kernel(w, bias)
        return ext.dense_kernel(w, bias)
    raise TypeError(f"no native kernel for {type(m).__name__}")


NATIVE_EXPERT_KINDS = ("bf16", "int8", "int4")
# Routed int4 experts read int8-quantized activations (int4_kernel's act="q8": vpdpbusd, ~1.5-2x
# the batch-1 bandwidth of act="bf16"). Its 8-bit rounding of x doubles SmolLM2's int4 decode KL
# (max 0.0033 -> 0.0099 nats through the native step), so dense int4 weights keep bf16 activations;
# for experts it is part of the int4 format's cost (issue 9: int4 experts are for offloaded MoE).
EXPERT_INT4_ACT = "q8"


def expert_spec(fmt):
    """A native ExpertSpec for a quantized `quant.experts.ExpertFormat` (spec.forward(slot uint8
    [nbytes], x [n, D]) -> [n, D] fp32), or None: no extension, a dense format (use
    `ext.bf16_expert_forward`), a kind without a native kernel (fp32, int8-g32), or int4 in torch's
    "cpu" layout (our kernel reads the "plain" one)."""
    ext = load()
    if ext is None or fmt.is_dense or any(k not in NATIVE_EXPERT_KINDS for k in fmt.kinds):
        return None
    if "int4" in fmt.kinds and fmt.int4_layout != "plain":
        return None
    offsets = [[off for _, off, _, _ in segs] for segs in fmt._layout]
    return ext.expert_spec(list(fmt.kinds), [list(s) for s in fmt.shapes], offsets, fmt.nbytes, EXPERT_INT4_ACT)
