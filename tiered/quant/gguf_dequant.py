"""GGUF blocks dequantized in torch: the `gguf` package's arithmetic (the same fp32 values, bit for
bit: tested), in torch's threaded element-wise ops instead of numpy's single thread.

The package's numpy dequantizers run at ~40 M weights/s on the 2-core EPYC: a Q4_K_M file's Q6_K
output matrix at Llama-3-8B width with SmolLM2's 49k vocabulary (201 M weights) took 5.2 s of the
load; here ~1 s. Formats without a torch version return None (the caller uses the package's).

Block layouts (ggml-quants.c): Q8_0 {fp16 d; int8 qs[32]}: w = d q. Q4_K {fp16 d, dmin; 12 bytes of
6-bit sub-block scales and mins; 4-bit qs[128]}: w = (d sc) q - (dmin m) per 32. Q5_K {Q4_K's d, dmin and
scales; qh[32] fifth bits (sub-block s's in bit s); qs[128]}: the same with 5-bit q. Q6_K {ql[128] low
nibbles; qh[64] high 2 bits; int8 scales[16]; fp16 d}: w = (d sc) (q - 32) per 16.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch

from tiered.checkpoint.handle import BLOCK_FORMATS

TORCH_FORMATS = ("Q8_0", "Q4_K", "Q5_K", "Q6_K")  # the formats dequantize_blocks computes here


def blocks_tensor(raw: np.ndarray) -> torch.Tensor:
    """GGUF blocks (uint8, often a read-only view of the file's map) as a torch uint8 tensor of the
    same shape, no copy when contiguous: for reading only."""
    with warnings.catch_warnings():  # torch warns that the array is not writable: it is only read
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(np.ascontiguousarray(raw))


def _f16(b: torch.Tensor) -> torch.Tensor:
    """Byte pairs uint8 [n, 2] -> their fp16 values as fp32 [n, 1]."""
    return b.contiguous().view(torch.float16).float()


def _shifted(b: torch.Tensor, shifts: list[int], mask: int) -> torch.Tensor:
    """(b >> shift) & mask for each shift, stacked on a new dim before the last: [..., S, n]."""
    s = torch.tensor(shifts, dtype=torch.uint8).reshape(len(shifts), 1)
    return (b.unsqueeze(-2) >> s) & mask


def dequantize_blocks(raw: np.ndarray, fmt: str) -> torch.Tensor | None:
    """GGUF blocks of format `fmt`, uint8 [..., bytes per row], -> fp32 [rows, weights per row]
    (rows = the product of the leading dims), or None for a format without a torch version here."""
    if fmt not in TORCH_FORMATS:
        return None
    rows = int(np.prod(raw.shape[:-1])) if raw.ndim > 1 else 1
    b = blocks_tensor(raw).reshape(-1, BLOCK_FORMATS[fmt][1])
    n = b.shape[0]
    if fmt == "Q8_0":
        out = b[:, 2:].contiguous().view(torch.int8).float() * _f16(b[:, :2])
    elif fmt in ("Q4_K", "Q5_K"):
        d, dmin, sc = _f16(b[:, 0:2]), _f16(b[:, 2:4]), b[:, 4:16].reshape(n, 3, 4)
        lo, mid, top = sc[:, 0], sc[:, 1], sc[:, 2]  # gguf's get_scale_min: d, m, m_d
        scale = torch.cat([lo & 0x3F, (top & 0x0F) | ((lo >> 2) & 0x30)], -1).float()  # [n, 8]
        mins = torch.cat([mid & 0x3F, (top >> 4) | ((mid >> 2) & 0x30)], -1).float()
        qs = b[:, 16:] if fmt == "Q4_K" else b[:, 48:]
        q = _shifted(qs.reshape(n, 4, 32), [0, 4], 0x0F).reshape(n, 8, 32)
        if fmt == "Q5_K":  # sub-block s's fifth bits: bit s of qh[0..31]
            q = q | (_shifted(b[:, 16:48], list(range(8)), 0x01) << 4)
        out = (d * scale).reshape(n, 8, 1) * q.float() - (dmin * mins).reshape(n, 8, 1)
    else:  # Q6_K
        ql, qh = b[:, :128], b[:, 128:192]
        dd = (_f16(b[:, 208:210]) * b[:, 192:208].contiguous().view(torch.int8).float()).reshape(n, 16, 1)
        low = _shifted(ql.reshape(n, 2, 64), [0, 4], 0x0F).reshape(n, 8, 32)
        high = _shifted(qh.reshape(n, 2, 32), [0, 2, 4, 6], 0x03).reshape(n, 8, 32)
        q = ((low | (high << 4)).to(torch.int8) - 32).reshape(n, 16, 16).float()
        out = dd * q
    return out.reshape(rows, -1)


def dequantize_rows_threaded(raw: np.ndarray, qtype, threads: int | None = None) -> np.ndarray:
    """GGUF blocks uint8 [rows, bytes per row] of a format without a torch version here (the i-quants, Q2_K / Q3_K,
    Q5_x, ...) -> fp32 [rows, weights per row] by the `gguf` package's dequantization (the same values), its rows in
    `threads` chunks (default torch.get_num_threads()) on a thread pool: its numpy ops release the GIL, and one
    thread ran ~40-60 M weights a second for the i-quants on the 2-core EPYC (a 70B's weights: ~25 minutes).

    Raises:
        ValueError: raw is not 2-D."""
    from concurrent.futures import ThreadPoolExecutor

    from gguf.quants import dequantize

    if raw.ndim != 2:
        raise ValueError(f"dequantize_rows_threaded: blocks [rows, bytes per row] expected, got {raw.shape}")
    rows = raw.shape[0]
    n = max(1, min(threads or torch.get_num_threads(), rows // 16 or 1))
    if n == 1:
        return np.asarray(dequantize(raw, qtype), dtype=np.float32).reshape(rows, -1)
    bounds = [rows * i // n for i in range(n + 1)]
    with ThreadPoolExecutor(n) as pool:
        parts = list(pool.map(lambda i: dequantize(raw[bounds[i]:bounds[i + 1]], qtype), range(n)))
    return np.concatenate([np.asarray(p, dtype=np.float32).reshape(bounds[i + 1] - bounds[i], -1)
                           for i, p in enumerate(parts)])
