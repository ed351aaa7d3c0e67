"""PLACE (single tier): build a model on the meta device and materialize each tensor where it lives.

Nothing is allocated for a parameter until its own tensor is read from the checkpoint, so peak
memory is the model plus one tensor, never two copies of the model (gpt-fast's meta-device habit).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from tiered.errors import CheckpointError
from tiered.memory.sizes import kept_fp32


def _set_param(model: nn.Module, name: str, tensor: torch.Tensor) -> None:
    module_path, _, leaf = name.rpartition(".")
    module = model.get_submodule(module_path) if module_path else model
    setattr(module, leaf, nn.Parameter(tensor, requires_grad=False))


def materialize(model: nn.Module, checkpoint, dtype: torch.dtype, device: torch.device | str = "cpu",
                on_tensor: Callable[[str, int], None] | None = None,
                skip: Callable[[str], bool] | None = None, accelerator=None) -> int:
    """Fill every meta parameter of `model` from `checkpoint`, converted to `dtype` on `device`.

    Norm weights and biases stay fp32-precise only if `dtype` is fp32, as in HF; DeepSeek's routers
    are loaded in fp32 whatever `dtype` (memory/sizes.kept_fp32), as transformers keeps them.

    Args:
        model: module tree built under torch.device("meta"), HF parameter names.
        checkpoint: HFDirCheckpoint or GGUFCheckpoint.
        dtype: parameter dtype (torch.float32 or torch.bfloat16).
        on_tensor: called with (name, bytes) after each tensor, for progress bars.
        skip: names for which it returns True stay on the meta device (e.g. routed experts, which
            the runtime serves from its own tiers).
        accelerator: when given, each tensor goes to its device through `accelerator.to_device`
            (`device` is then its device); None = `.to(device)` (the CPU).
    Returns:
        Bytes of parameters materialized.
    Raises:
        CheckpointError: a tensor is missing or its shape differs from the config's.
    """
    cfg = model.config
    total = 0
    for name, param in list(model.named_parameters(remove_duplicate=False)):
        if (name == "lm_head.weight" and cfg.tie_word_embeddings) or (skip is not None and skip(name)):
            continue
        if not checkpoint.has(name):
            raise CheckpointError(f"checkpoint lacks tensor {name!r}",
                                  "the checkpoint is incomplete or does not match its config")
        handle = checkpoint.handle(name)
        if tuple(handle.shape) != tuple(param.shape):
            raise CheckpointError(f"tensor {name!r} has shape {tuple(handle.shape)}, config implies "
                                  f"{tuple(param.shape)}", "the checkpoint does not match its config")
        t = handle.load(torch.float32 if kept_fp32(cfg, name) else dtype)
        t = accelerator.to_device(t) if accelerator is not None else t.to(device)
        _set_param(model, name, t)
        total += t.numel() * t.element_size()
        if on_tensor is not None:
            on_tensor(name, handle.nbytes)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return total
