"""Hugging Face model directories: config.json + one or many safetensors files.

Tensors are opened with `safetensors.safe_open` (memory-mapped; one tensor read at a time, as
nano-vllm's loader does). Sharded checkpoints are found through model.safetensors.index.json.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

from safetensors import safe_open

from tiered.checkpoint.handle import DENSE_BYTES, HandleTable, TensorHandle
from tiered.checkpoint.model_config import ModelConfig
from tiered.errors import CheckpointError

INDEX = "model.safetensors.index.json"


def _check_safetensors_file(path: Path) -> tuple[dict, int]:
    """Parse a safetensors header and check the file holds every byte it promises.

    Returns:
        The header dict (tensor name -> {dtype, shape, data_offsets}) and the header's length.
    Raises:
        CheckpointError: the file is truncated or its header is not valid JSON.
    """
    size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > size - 8:
                raise ValueError("header longer than file")
            header = json.loads(f.read(n))
    except (struct.error, ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path} is not a valid safetensors file ({e})",
                              "re-download or re-convert the checkpoint") from None
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    if 8 + n + end > size:
        raise CheckpointError(f"{path} is truncated: {size} bytes on disk, {8 + n + end} expected",
                              "re-download or re-copy the file")
    return header, n


class HFDirCheckpoint(HandleTable):
    """A model directory in the Hugging Face layout.

    Args:
        path: directory with config.json and *.safetensors (optionally sharded with an index).
    Raises:
        CheckpointError: no config.json, no safetensors, a shard missing or truncated.
        UnsupportedModelError: the architecture is not one tiered runs.
    """

    format_name = "safetensors"

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        cfg_path = self.path / "config.json"
        if not cfg_path.is_file():
            raise CheckpointError(f"{self.path} has no config.json",
                                  "pass a Hugging Face model directory or a .gguf file")
        try:
            self.hf_config = json.loads(cfg_path.read_text())
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{cfg_path} is not valid JSON ({e})", "restore the file") from None
        self.config = ModelConfig.from_hf(self.hf_config)
        index = self.path / INDEX
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(p.name for p in self.path.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{self.path} has no *.safetensors weights",
                                  "convert the checkpoint to safetensors (pytorch .bin is not read)")
        self._handles: dict[str, TensorHandle] = {}
        for name in files:
            f = self.path / name
            if not f.is_file():
                raise CheckpointError(f"shard {f} named in {INDEX} is missing", "download every shard")
            header, header_len = _check_safetensors_file(f)
            for key, meta in header.items():
                if key == "__metadata__":
                    continue
                begin, end = meta["data_offsets"]
                self._handles[key] = TensorHandle(
                    name=key, shape=tuple(meta["shape"]), format=meta["dtype"], nbytes=end - begin,
                    path=str(f), _load=self._loader(str(f), key), offset=8 + header_len + begin)
        self._open: dict[str, object] = {}

    def _loader(self, file: str, key: str):
        def load():
            if file not in self._open:
                self._open[file] = safe_open(file, framework="pt")
            # safe_open tensors alias the memory map; clone so callers own their memory.
            return self._open[file].get_tensor(key).clone()
        return load

    def release_pages(self) -> int:
        """Close the files' memory maps (safe_open handles): their pages leave this process, so the
        OS can drop them from its page cache (posix_fadvise DONTNEED skips mapped pages), and a later
        load maps the file again. Returns the bytes of the files that were mapped."""
        mapped = sum(os.path.getsize(f) for f in self._open)
        self._open.clear()
        return mapped

    def _load_tokenizer(self):
        """The HF tokenizer saved beside the weights, or None when the directory has none."""
        from tiered.checkpoint.tokenizer import load_hf_tokenizer
        return load_hf_tokenizer(self.path)


__all__ = ["HFDirCheckpoint", "DENSE_BYTES"]
