"""GGUF blocks from fp32 weights for the formats the `gguf` package dequantizes but cannot quantize: Q4_K, Q5_K, Q6_K,
IQ4_NL and IQ4_XS (ggml-quants.c's block layouts: block_q4_K {d; dmin; scales[12]; qs[128]}, block_q5_K {d; dmin;
scales[12]; qh[32]; qs[128]}, block_q6_K {ql[128]; qh[64]; scales[16]; d}, block_iq4_nl {d; qs[16]}, block_iq4_xs {d;
scales_h; scales_l[4]; qs[128]}).

tiered's own fits, one pass each (no search): min/max per 32 for Q4_K / Q5_K, absmax per 16 for Q6_K, the nearest
codebook value after an absmax scale for the IQ4 formats (llama.cpp searches each scale; its errors are smaller). They
write the test suite's GGUF files (tests/gguf_writer.py) and re-quantize an expert projection into a k-quant kind that a
layer of the file stores otherwise (quant/experts.quantize_projection: a Q4_K_M file's Q4_K ffn_down layers beside its
Q6_K ones).

All take w fp32 [rows, cols] (cols a multiple of the block's 256, or 32 for IQ4_NL) and return the blocks uint8
[rows, cols / block * block bytes], as a GGUF file stores them row by row.
"""

from __future__ import annotations

import numpy as np
import torch


def quantize_q4_k(w: np.ndarray) -> np.ndarray:
    """w fp32 [rows, cols % 256 == 0] -> Q4_K blocks uint8 [rows, cols / 256 * 144].

    Per 32-element sub-block: w ~ d * sc * q - dmin * m (q 4 bit, sc and m 6 bit); min/max fit.
    """
    rows, cols = w.shape
    x = w.astype(np.float32).reshape(-1, 8, 32)  # (blocks, sub, 32)
    lo = np.minimum(x.min(-1), 0.0)  # ggml keeps the min <= 0
    scale = (x.max(-1) - lo) / 15  # (blocks, 8)
    mins = -lo
    d = (scale.max(-1) / 63).astype(np.float16)  # (blocks,)
    dmin = (mins.max(-1) / 63).astype(np.float16)
    df, dmf = d.astype(np.float32)[:, None], dmin.astype(np.float32)[:, None]
    sc = np.clip(np.round(np.divide(scale, df, out=np.zeros_like(scale), where=df > 0)), 0, 63).astype(np.uint8)
    m = np.clip(np.round(np.divide(mins, dmf, out=np.zeros_like(mins), where=dmf > 0)), 0, 63).astype(np.uint8)
    step = (df * sc)[..., None]
    q = np.clip(np.round(np.divide(x + (dmf * m)[..., None], step, out=np.zeros_like(x), where=step > 0)), 0, 15)
    q = q.astype(np.uint8)  # (blocks, 8, 32)
    scales = np.empty((x.shape[0], 12), np.uint8)
    scales[:, 0:4] = (sc[:, :4] & 0x3F) | ((sc[:, 4:] >> 4) << 6)
    scales[:, 4:8] = (m[:, :4] & 0x3F) | ((m[:, 4:] >> 4) << 6)
    scales[:, 8:12] = (sc[:, 4:] & 0x0F) | ((m[:, 4:] & 0x0F) << 4)
    qs = (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(-1, 128)  # sub-blocks 2c (low) and 2c+1 (high)
    out = np.concatenate([d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2), scales, qs], axis=1)
    return out.reshape(rows, -1)


def quantize_q5_k(w: np.ndarray) -> np.ndarray:
    """w fp32 [rows, cols % 256 == 0] -> Q5_K blocks uint8 [rows, cols / 256 * 176].

    Per 32-element sub-block: w ~ d * sc * q - dmin * m (q 5 bit, sc and m 6 bit); min/max fit, as quantize_q4_k.
    """
    rows, cols = w.shape
    x = w.astype(np.float32).reshape(-1, 8, 32)  # (blocks, sub, 32)
    lo = np.minimum(x.min(-1), 0.0)
    scale = (x.max(-1) - lo) / 31
    mins = -lo
    d = (scale.max(-1) / 63).astype(np.float16)
    dmin = (mins.max(-1) / 63).astype(np.float16)
    df, dmf = d.astype(np.float32)[:, None], dmin.astype(np.float32)[:, None]
    sc = np.clip(np.round(np.divide(scale, df, out=np.zeros_like(scale), where=df > 0)), 0, 63).astype(np.uint8)
    m = np.clip(np.round(np.divide(mins, dmf, out=np.zeros_like(mins), where=dmf > 0)), 0, 63).astype(np.uint8)
    step = (df * sc)[..., None]
    q = np.clip(np.round(np.divide(x + (dmf * m)[..., None], step, out=np.zeros_like(x), where=step > 0)), 0, 31)
    q = q.astype(np.uint8)  # (blocks, 8, 32): sub-block s's element l
    scales = np.empty((x.shape[0], 12), np.uint8)
    scales[:, 0:4] = (sc[:, :4] & 0x3F) | ((sc[:, 4:] >> 4) << 6)
    scales[:, 4:8] = (m[:, :4] & 0x3F) | ((m[:, 4:] >> 4) << 6)
    scales[:, 8:12] = (sc[:, 4:] & 0x0F) | ((m[:, 4:] & 0x0F) << 4)
    lo4 = q & 0x0F
    qs = (lo4[:, 0::2] | (lo4[:, 1::2] << 4)).reshape(-1, 128)  # sub-blocks 2c (low) and 2c+1 (high)
    qh = np.zeros((x.shape[0], 32), np.uint8)
    for s in range(8):  # the fifth bit of sub-block s's element l: bit s of qh[l]
        qh |= (q[:, s] >> 4) << s
    out = np.concatenate([d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2), scales, qh, qs], axis=1)
    return out.reshape(rows, -1)


def quantize_q6_k(w):
    """w fp32 [rows, cols % 256 == 0] (numpy or torch) -> Q6_K blocks uint8 [rows, cols / 256 * 210] (the same
    kind of array).

    Per 16-element sub-block: w ~ d * sc * (q - 32) (q 6 bit, sc int8); absmax fit. In torch's threaded ops (a
    Q4_K_M file's Q4_K ffn_down experts are re-quantized to it at load: quant/experts.quantize_blocks; numpy's
    single thread took ~60 ms a Qwen3-30B-A3B expert projection on 2 Zen 4 cores).
    """
    as_numpy = isinstance(w, np.ndarray)
    t = torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32)) if as_numpy else w.float()
    rows = t.shape[0]
    x = t.reshape(-1, 16, 16)  # (blocks, sub, 16)
    scale = x.abs().amax(-1) / 31  # (blocks, 16)
    d = (scale.amax(-1) / 127).half()
    df = d.float()[:, None]
    sc = torch.where(df > 0, scale / torch.where(df > 0, df, 1), 0).round().clamp(-128, 127).to(torch.int8)
    step = (df * sc)[..., None]
    q = torch.where(step != 0, x / torch.where(step != 0, step, 1), 0).round().clamp(-32, 31) + 32
    q = q.to(torch.uint8).reshape(-1, 2, 128)  # (blocks, half, 128): element i = h * 128 + r
    lo, hi = q & 0x0F, q >> 4
    ql = (lo[:, :, :64] | (lo[:, :, 64:] << 4)).reshape(-1, 128)
    qh = (hi[:, :, 0:32] | (hi[:, :, 32:64] << 2) | (hi[:, :, 64:96] << 4) | (hi[:, :, 96:128] << 6)).reshape(-1, 64)
    out = torch.cat([ql, qh, sc.view(torch.uint8), d.view(torch.uint8).reshape(-1, 2)], dim=1).reshape(rows, -1)
    return out.numpy() if as_numpy else out


# ----------------------------------------------------------------------------------- IQ4
# gguf.quants dequantizes IQ4_NL / IQ4_XS but cannot quantize them: nearest codebook value (kvalues_iq4nl) after a
# scale that maps the group's largest magnitude onto the codebook's end (llama.cpp also searches the scale).
_IQ4 = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.float32)


def _iq4_indices(g: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """Groups g [n, 32] over their scales [n, 1] -> the nearest codebook indices, uint8 [n, 32]."""
    x = g / np.where(scale == 0, 1, scale)
    return np.abs(x[..., None] - _IQ4).argmin(-1).astype(np.uint8)


def _iq4_nibbles(idx: np.ndarray) -> np.ndarray:
    """Indices [n, 32] -> qs [n, 16]: weights 0..15 in the low nibbles, 16..31 in the high ones."""
    return idx[:, :16] | (idx[:, 16:] << 4)


def quantize_iq4_nl(w: np.ndarray) -> np.ndarray:
    """w fp32 [rows, cols % 32 == 0] -> IQ4_NL blocks uint8 [rows, cols / 32 * 18] (fp16 d, qs[16])."""
    g = w.astype(np.float32).reshape(-1, 32)
    amax = g[np.arange(len(g)), np.abs(g).argmax(1)][:, None]  # signed: its end of the codebook is -127
    d = (amax / -127.0).astype(np.float16)
    idx = _iq4_indices(g, d.astype(np.float32))
    return np.concatenate([d.view(np.uint8), _iq4_nibbles(idx)], 1).reshape(w.shape[0], -1)


def quantize_iq4_xs(w: np.ndarray) -> np.ndarray:
    """w fp32 [rows, cols % 256 == 0] -> IQ4_XS super-blocks uint8 [rows, cols / 256 * 136] (fp16 d, uint16
    scales_h, scales_l[4], qs[128]): each group's scale d (ls - 32), ls 6-bit."""
    sb = w.astype(np.float32).reshape(-1, 8, 32)
    amax = np.take_along_axis(sb, np.abs(sb).argmax(2)[..., None], 2)[..., 0]  # [n, 8], signed
    want = amax / -127.0  # the scale each group wants
    d = (np.abs(want).max(1, keepdims=True) / 31.0).astype(np.float16)  # ls - 32 in [-32, 31]
    df = np.where(d == 0, 1, d).astype(np.float32)
    ls = (np.clip(np.round(want / df), -32, 31) + 32).astype(np.int32)  # [n, 8]
    scale = d.astype(np.float32) * (ls - 32)
    idx = _iq4_indices(sb.reshape(-1, 32), scale.reshape(-1, 1))
    low, high = ls & 15, ls >> 4
    sl = (low[:, 0::2] | (low[:, 1::2] << 4)).astype(np.uint8)  # [n, 4]
    sh = (high << (2 * np.arange(8))).sum(1).astype(np.uint16)[:, None]
    qs = _iq4_nibbles(idx).reshape(-1, 128)
    return np.concatenate([d.view(np.uint8), sh.view(np.uint8), sl, qs], 1).reshape(w.shape[0], -1)
