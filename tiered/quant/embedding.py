"""An embedding table kept in its checkpoint's quantized blocks (GGUF Q8_0, Q4_K, ...).

A decode step reads one row per token, so the table need not be dense: rows are dequantized as
they are looked up (by the `gguf` package, exactly as `TensorHandle.load` would), straight from
the file's memory map: the table costs its stored bytes (Q8_0: 34 bytes per 32 values, 28% of
fp32), in the page cache, and no copy. The engine's one-copy mode
(Plan.dense_copies False) uses it for block-quantized embeddings.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn


class BlockEmbedding(nn.Module):
    """input_ids int64 [...] -> embeddings [..., D] in `dtype`, from raw blocks uint8 [V, row_bytes].

    Args:
        handle: the embedding's TensorHandle (a block format; `handle.blocks()` gives its rows).
        dtype: the dtype of the returned rows (the model's compute dtype).
    Raises:
        ValueError: the tensor is not stored in blocks.
    """

    def __init__(self, handle, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        self.qtype, self._dequantize = GGMLQuantizationType[handle.format], dequantize
        # the file's own bytes (a read-only memory map): no copy; a lookup reads only its rows
        self.blocks: np.ndarray = handle.blocks()
        self.num_embeddings, self.embedding_dim = handle.shape
        self.dtype = dtype
        # tiered/kernels when built, with the table as a uint8 tensor over the same read-only memory
        # map (no copy; the kernel only reads it): a Q8_0 lookup is then one native call
        from tiered import kernels

        self._ext, self._table = kernels.load(build=False), None
        if self._ext is not None and self.qtype.name == "Q8_0":
            import warnings

            with warnings.catch_warnings():  # not writable: the file's map; nothing writes through it
                warnings.simplefilter("ignore", UserWarning)
                self._table = torch.from_numpy(np.ascontiguousarray(self.blocks))

    @property
    def nbytes(self) -> int:
        return int(self.blocks.nbytes)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self._table is not None and input_ids.device.type == "cpu":  # the same fp32 products, natively
            out = self._ext.q8_0_rows(self._table, input_ids.reshape(-1), self.embedding_dim)
            return out.to(self.dtype).reshape(*input_ids.shape, self.embedding_dim)
        rows = self.blocks[input_ids.reshape(-1).cpu().numpy()]
        if self.qtype.name == "Q8_0":
            out = q8_0_rows(rows, self.embedding_dim)
        else:
            out = torch.from_numpy(self._dequantize(rows, self.qtype).reshape(-1, self.embedding_dim))
        return out.to(self.dtype).reshape(*input_ids.shape, self.embedding_dim)


def q8_0_rows(rows: np.ndarray, dim: int) -> torch.Tensor:
    """GGUF Q8_0 rows uint8 [n, dim / 32 * 34] (per block of 32: an fp16 scale d, then 32 int8 q)
    -> fp32 [n, dim] = q * d: the same fp32 products as gguf.quants.dequantize, in a few torch ops
    (a decode step's one-row lookup: ~8 us, where the gguf package's path took 29-65 us in a loop)."""
    b = rows.reshape(len(rows), dim // 32, 34)
    d = np.ascontiguousarray(b[..., :2]).view(np.float16).astype(np.float32)  # [n, G, 1]
    q = np.ascontiguousarray(b[..., 2:]).view(np.int8).astype(np.float32)  # [n, G, 32]
    return torch.from_numpy((q * d).reshape(len(rows), dim))
