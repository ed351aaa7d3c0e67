"""torch's CPU GEMM for bf16 weights, by what this CPU computes bf16 with.

oneDNN gives torch a bf16 GEMM on AVX-512 (BF16, AMX, or emulated). AVX2-only CPUs have none: torch's
bf16 GEMM there is a reference loop, ~10 GMAC/s on 2 Zen 3 cores where fp32 runs 50-85. A Mixtral-width
expert's projection at 512 rows took 183 ms in bf16 and 24 ms upcast to fp32, its weight's conversion
included (2026-11-30). `linear` is F.linear with that upcast where it pays; the profiler times
gemm/cpu/bf16 through it, so the plans price what the runtime runs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_BF16_NATIVE: bool | None = None


def bf16_gemm_native() -> bool:
    """Whether torch's CPU GEMM has a bf16 path of its own on this machine (oneDNN's)."""
    global _BF16_NATIVE
    if _BF16_NATIVE is None:
        try:
            _BF16_NATIVE = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
        except (AttributeError, RuntimeError):  # a torch build without oneDNN: its own loops either way
            _BF16_NATIVE = True
    return _BF16_NATIVE


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, w, b): x [..., K], w [N, K], b [N] or None -> [..., N] in x's dtype (x and w in one
    dtype, or fp32 x over a bf16 w). A bf16 w on a CPU without a bf16 GEMM (`bf16_gemm_native`) is
    converted to fp32 for the call and the GEMM runs in fp32 (x's rows exact in it), the result rounded
    to x's dtype; elsewhere torch's GEMM in w's dtype."""
    if w.dtype == torch.bfloat16 and x.device.type == "cpu" and not bf16_gemm_native():
        return F.linear(x.float(), w.float(), None if b is None else b.float()).to(x.dtype)
    if x.dtype != w.dtype:
        return F.linear(x.to(w.dtype), w, b).to(x.dtype)
    return F.linear(x, w, b)
