"""Linear modules that choose their weight format by step size, and the swap that installs them.

Prefill (many tokens per step) is compute-bound and wants dense fp32 GEMM; decode (one token per
sequence) is memory-bound and wants the fewest bytes per weight. `PhaseLinear` keeps the dense
weight under its HF name (`weight`) and a decode module beside it, and picks one by the number of
rows in the input: a kernel choice by shape, as llama.cpp makes between its GEMV and GEMM paths.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tiered.quant.int4 import GROUP, Int4Linear


class CastLinear(nn.Module):
    """Dense linear whose weight is stored in another dtype (e.g. bf16) than the activations.

    x [..., K] -> [..., N] in x's dtype; computes in the weight's dtype.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.to(weight.dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.to(self.weight.dtype), self.weight, self.bias).to(x.dtype)


class PhaseLinear(nn.Module):
    """Dense `weight` [N, K] for steps with more than `threshold` rows, `decode` module otherwise."""

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, decode: nn.Module, threshold: int) -> None:
        super().__init__()
        self.weight = weight
        self.bias = bias
        self.decode = decode
        self.threshold = threshold

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() // x.shape[-1] <= self.threshold:
            return self.decode(x)
        return F.linear(x, self.weight, self.bias)


def decode_module(linear: nn.Linear, handle, fmt: str) -> nn.Module | None:
    """The decode-path module for `linear` under weight format `fmt`, or None to keep it as is.

    Args:
        linear: the loaded dense module (weight [N, K]).
        handle: the checkpoint's TensorHandle of the weight (its storage format decides "auto").
        fmt: "auto" | "bf16" | "int4" | "fp32".
    """
    w, b = linear.weight, linear.bias
    gguf_q4 = handle is not None and handle.format in ("Q4_0", "Q4_1")
    if fmt == "fp32":
        return None if w.dtype == torch.float32 else CastLinear(w.detach().float(), b)
    if fmt in ("auto", "int4") and gguf_q4:
        return Int4Linear.from_gguf(handle.blocks(), handle.format, bias=None if b is None else b.detach().float())
    if fmt == "int4" and w.shape[1] % GROUP == 0:
        return Int4Linear.from_dense(w.detach(), bias=None if b is None else b.detach().float())
    if w.dtype == torch.bfloat16:
        return None
    return CastLinear(w.detach().to(torch.bfloat16), b)


def install_decode_weights(model: nn.Module, checkpoint, fmt: str, threshold: int) -> int:
    """Swap every nn.Linear of `model` for a PhaseLinear carrying a decode-format copy.

    Args:
        model: a loaded model with HF parameter names.
        checkpoint: where the weights came from (lm_head falls back to the tied embedding).
        fmt: decode weight format (EngineConfig.decode_weights).
        threshold: largest number of rows that takes the decode path.
    Returns:
        Bytes held by the decode copies.
    """
    extra = 0
    for mod_name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if type(child) is not nn.Linear:
                continue
            full = f"{mod_name}.{child_name}" if mod_name else child_name
            key = f"{full}.weight"
            if not checkpoint.has(key) and key == "lm_head.weight":
                key = "model.embed_tokens.weight"
            handle = checkpoint.handle(key) if checkpoint.has(key) else None
            dec = decode_module(child, handle, fmt)
            if dec is None:
                continue
            extra += sum(t.numel() * t.element_size() for t in list(dec.parameters()) + list(dec.buffers()))
            setattr(module, child_name, PhaseLinear(child.weight, child.bias, dec, threshold))
    return extra
