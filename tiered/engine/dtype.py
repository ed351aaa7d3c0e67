"""The compute dtype of an engine: EngineConfig.dtype, with "auto" resolved for its device."""

from __future__ import annotations

import torch

from tiered.checkpoint.handle import BLOCK_FORMATS

_FP32_FORMATS = ("F32", "F64")
_BF16_FORMATS = ("F16", "BF16", *BLOCK_FORMATS)


def checkpoint_dtype(checkpoint) -> torch.dtype:
    """The dtype a checkpoint's weights are stored in, as a compute dtype: torch.float32 when most
    of its floating-point elements are stored as F32 (or F64), else torch.bfloat16 (F16, BF16 and
    GGUF quantized blocks, whose dequantized values bf16 holds about as well as fp16 and with
    fp32's range). Integer tensors do not count."""
    fp32 = bf16 = 0
    for name in checkpoint.names():
        h = checkpoint.handle(name)
        if h.format in _FP32_FORMATS:
            fp32 += h.numel
        elif h.format in _BF16_FORMATS:
            bf16 += h.numel
    return torch.float32 if fp32 >= bf16 else torch.bfloat16


def resolve_dtype(config, accelerator, checkpoint) -> torch.dtype:
    """The engine's compute dtype (activations and dense weights).

    Args:
        config: EngineConfig; its `dtype` is "auto", "float32" or "bfloat16".
        accelerator: the engine's Accelerator, or None (CPU only).
        checkpoint: the opened checkpoint (read only for "auto" on CUDA: its storage formats).
    Returns:
        An explicit dtype as given. "auto": the checkpoint's dtype (`checkpoint_dtype`) on a CUDA
        accelerator; torch.float32 on the CPU and on the host stand-in, the lossless mode that
        matches transformers to 1e-4 (the CPU has no fast bf16 GEMM to gain from).
    """
    if config.dtype != "auto":
        return getattr(torch, config.dtype)
    if accelerator is None or accelerator.is_host:
        return torch.float32
    return checkpoint_dtype(checkpoint)
