"""Stored expert tensors (GGUF blocks, block-scaled fp8) -> tiered's expert formats, without
dequantizing where the mapping is exact.

    GGUF block  -> expert kind   how                                                   exact?
    Q4_0        -> int4 (g32)    d, 4-bit q: scale = d, zero = 0, codes = q             yes (d rounded to bf16)
    Q4_1        -> int4 (g32)    d, m, 4-bit q: scale = d, zero = m + 8d, codes = q     yes (d rounded to bf16;
                                                                                       zero kept to ~2^-16)
    Q8_0        -> int8-g32      d (fp16), int8 q: scale = d, q as stored              yes, bit for bit
    Q4_K        -> int4 (g32)    super-blocks of 8 sub-blocks of 32, w = d*sc*q - dmin*m:  yes (d*sc rounded
                                 per sub-block scale = d*sc, zero = 8*scale - dmin*m     to bf16, zero ~2^-16)
    Q6_K        -> q6k           experts computed on the CPU alone (no accelerator) with  yes, bit for bit
    Q5_K        -> q5k           tiered's kernels built: the blocks as stored, repacked   (quant/kquant.py's
    IQ4_XS      -> iq4xs         into 16-row tiles (0.82 / 0.70 / 0.54 bytes a weight)   layouts)
    Q5_0/1, Q5_K-> int8 (row)    dequantized, then symmetric int8 per row              no: re-quantized
    Q6_K        -> int8-g32      16 sub-blocks of 16 with int8 sub-scales: dequantized,  no: re-quantized
                                 then symmetric int8 per 32 (two sub-scales per group)  (~2^-8 of a group's max)
    Q2_K, Q3_K  -> int4 (g32)    dequantized, then min/max int4 per 32                 no: re-quantized
    IQ4_NL      -> int8-g32      fp16 d, 4-bit index into kvalues_iq4nl (int8 values   yes, bit for bit
                                 -127..113): code = kvalues[i], scale = d
    IQ4_XS      -> int8-g32      as IQ4_NL, scale d (ls - 32) per 32 (ls 6-bit)        yes (the scale rounded
                                                                                       to fp16: ~2^-12)
    any other   -> q6k / q5k /   a layer whose projection the format (chosen from the   no: re-quantized
                   iq4xs         first MoE layer's) stores otherwise: dequantized, then  (quant/gguf_encode.py)
                                 fitted to the k-quant's blocks (a Q4_K_M file's Q4_K
                                 ffn_down layers beside its Q6_K ones)
    IQ1_x, IQ2_x, IQ3_x -> int4  lattice codebooks (1.6-3.4 bits a weight): dequantized  no: re-quantized
                                 (gguf), then min/max int4 per 32
    F32/F16/BF16-> bf16          cast                                                  F32 no, F16 no, BF16 yes
    F8_E4M3     -> fp8           safetensors fp8 + 128 x 128 block scales, as stored   yes, bit for bit
    F8_E4M3     -> fp8-row       fp8 + a scale per output channel or tensor            yes (fp32 scales)
    INT4        -> int4 (g32)    GPTQ / AWQ / compressed-tensors 4-bit codes, groups     yes (up to the bf16
                                 of a multiple of 32 split into 32s                      scale, zero ~2^-16)
    INT8        -> int8 (row)    GPTQ / compressed-tensors 8-bit codes, symmetric with   yes (up to the bf16
                                 one scale per output channel or tensor                  scale)
    INT4, INT8 of act-order or other groups, INT8 asymmetric -> the compute format,      fp32 yes
                                 dequantized
    BNB_NF4, BNB_FP4 (bitsandbytes 4-bit: a code table, no tiered kind) -> the compute    fp32 yes
                                 format, dequantized (LLM.int8 is INT8 per row)
    MXFP4       -> mxfp4         gpt-oss's experts where tiered/kernels is built: the   yes, bit for bit (any
                                 e2m1 codes as stored, scale 2^(e - 128) as bf16 per    E8M0 byte but 255;
                                 32, the bias a group of its own (checkpoint/gpt_oss.   bf16 biases)
                                 mxfp4_codes, quant/mxfp4.py): 0.625 bytes a weight
    MXFP4       -> int8-g32      without the kernels (or with fp16 biases): code =      yes, bit for bit (scales
                                 2 * e2m1 value, scale 2^(e - 128) per 32, the bias a   2^-24..2^15; biases
                                 group of its own (checkpoint/gpt_oss.mxfp4_int8_g32)   bf16/fp16, >= 2^-17)
    MXFP4 with fp32 biases -> bf16 (or the compute format), dequantized                  weights yes
    (checkpoint/hf_dir; fp8 of other block sizes takes the compute format, dequantized)
    GGUF gpt-oss experts, MXFP4 or Q8_0 with F32 biases -> int8-g32 as above (the bias checked on read:
    checkpoint/gpt_oss.int8_g32_with_bias; the converter's F32 biases hold the release's bf16 values);
    MXFP4 with F32 / BF16 biases -> mxfp4 where the kernels are built (each bias checked on read:
    gpt_oss.mxfp4_codes)

Sources: ggml-quants.c block layouts (block_q4_0 {d; qs[16]}, block_q4_1 {d; m; qs[16]},
block_q8_0 {d; qs[32]}); the `gguf` package dequantizes the K types.
"""

from __future__ import annotations

import itertools

import numpy as np
import torch

from tiered.checkpoint.handle import BLOCK_FORMATS
from tiered.kernels import load
from tiered.kernels.linear import tiled_int8
from tiered.quant.experts import (KQUANT_KINDS, ExpertFormat, dequantize_projection, fit_format, format_name,
                                  int4_segments, int8_g32_segments, int8_tiled, kquant_segments, quantize_blocks,
                                  quantize_projection)
from tiered.quant import fp8, mxfp4
from tiered.quant.gguf_dequant import blocks_tensor
from tiered.quant.int4 import unpack_q4_blocks
from tiered.quant.kquant import KIND_OF_FORMAT, kquant_fits

GGUF_EXPERT_KIND = {"Q4_0": "int4", "Q4_1": "int4", "Q8_0": "int8-g32", "Q4_K": "int4", "Q2_K": "int4",
                    "Q3_K": "int4", "Q5_0": "int8", "Q5_1": "int8", "Q5_K": "int8", "Q6_K": "int8-g32",
                    "IQ4_NL": "int8-g32", "IQ4_XS": "int8-g32", "IQ3_XXS": "int4", "IQ3_S": "int4", "IQ2_XXS": "int4",
                    "IQ2_XS": "int4", "IQ2_S": "int4", "IQ1_S": "int4", "IQ1_M": "int4"}
STORED_KIND = {**GGUF_EXPERT_KIND, "F8_E4M3": "fp8", "INT4": "int4", "INT8": "int8", "MXFP4": "int8-g32"}
# MXFP4 takes "mxfp4" instead where the handle offers its raw parts and tiered/kernels is built (stored_kind)
EXACT = ("Q4_0", "Q4_1", "Q8_0", "Q4_K", "F8_E4M3", "INT4", "INT8", "MXFP4", "IQ4_NL", "IQ4_XS")
# stored formats whose `load` is exact in fp32: integer codes x fp16 / bf16 scale, bitsandbytes' 4-bit table
# value x absmax (checkpoint/bnb.py), gpt-oss's MXFP4 e2m1 value x 2^k (checkpoint/gpt_oss.py: exact in bf16 too)
DEQUANTIZED = ("INT4", "INT8", "BNB_NF4", "BNB_FP4", "MXFP4")


def stored_kind(handle, kquant: bool = False) -> str:
    """The expert kind a tensor stored as `handle.format` maps to: fp8 in 128 x 128 blocks -> "fp8",
    fp8 scaled per output channel or per tensor -> "fp8-row" (quant/fp8.kernel_row_block 1); "bf16"
    for dense formats and fp8 of other blocks; gpt-oss's MXFP4 -> "mxfp4" where the handle offers its
    raw parts (bf16 biases, or a GGUF file's F32 ones: TensorHandle.mxfp4_exact) and tiered's kernels
    are built (they compute it; elsewhere it would dequantize per call), else "int8-g32" where the
    handle offers that form exactly (16-bit biases: TensorHandle.int8_g32_exact), else "bf16". `kquant`: the experts
    are computed on the CPU alone (no accelerator), so Q6_K / Q5_K / IQ4_XS keep their blocks as "q6k" / "q5k" /
    "iq4xs" where tiered's kernels are built and the shape tiles (quant/kquant.kquant_fits), not int8-g32 / int8 copies:
    0.82 / 0.70 / 0.54 bytes a weight against 1.06 / 1.0 (and Q5_K's re-quantization)."""
    if kquant and handle.format in KIND_OF_FORMAT and kquant_fits(tuple(handle.shape)):  # (quant/kquant's kinds)
        return KIND_OF_FORMAT[handle.format]
    if handle.format == "F8_E4M3" and not fp8.as_stored(handle):
        return "fp8-row" if _row_scaled(handle) else "bf16"
    if handle.format == "INT4" and (not handle.int4_group or handle.int4_group % 32):
        return "bf16"
    if handle.format == "INT8" and not handle.int8_per_row:  # grouped or asymmetric: held dequantized
        return "bf16"
    if handle.format == "MXFP4" and handle.mxfp4_exact and load() is not None:
        return "mxfp4"
    if handle.format == "MXFP4" and not handle.int8_g32_exact:  # fp32 biases: held dequantized
        return "bf16"
    return STORED_KIND.get(handle.format, "bf16")


def _row_scaled(handle) -> bool:
    """An fp8 handle whose scales are one per row (or tensor) across all columns: the fp8-row kind."""
    (N, K), (br, bc) = handle.shape, handle.fp8_block
    return bc >= K and (br == 1 or br >= N)


def stored_segments(fmt: ExpertFormat, handles) -> list | None:
    """The raw handles of an expert's segments in `fmt`'s slot order when the checkpoint holds them
    as that format stores them (fp8 experts: each projection's e4m3 bytes and block scales, read
    straight into the slot's segments: no converted copy on disk), else None."""
    if any(k != "fp8" for k in fmt.kinds) or not all(fp8.as_stored(h) and h.fp8_parts for h in handles):
        return None
    return [part for h in handles for part in h.fp8_parts]


def stored_format(handles, kquant: bool = False) -> str | None:
    """`auto_format` of (gate, up, down) handles stored in a format an expert kind keeps (GGUF
    blocks, fp8 per 128 x 128 block, row or tensor), or None for dense storage and fp8 scaled otherwise
    (the experts then take the compute format, each weight dequantized exactly in fp32). `kquant`: as
    stored_kind's."""
    kept = [h for h in handles if h.format in STORED_KIND and stored_kind(h) != "bf16"]
    return auto_format(handles, kquant) if kept else None


def auto_format(handles, kquant: bool = False) -> str:
    """The expert format that keeps a checkpoint's (gate, up, down) storage: e.g. Q4_K_M's
    (Q4_K, Q4_K, Q6_K) -> "int4,int4,int8-g32", or "int4,int4,q6k" with `kquant` (stored_kind's); fitted to the
    shapes (quant/experts.fit_format)."""
    return fit_format(format_name([stored_kind(h, kquant) for h in handles]), [h.shape for h in handles])


def requantized_note(handles, fmt: ExpertFormat) -> str | None:
    """A sentence naming the stored formats that `fmt` re-quantizes (None when every map is exact); `handles`: (gate,
    up, down) of one expert, or of one expert of each of several layers one after the other (the format is chosen
    from the first MoE layer's: a Q4_K_M file's Q4_K ffn_down layers beside its Q6_K ones are re-quantized)."""
    lossy = sorted({f"{h.format} -> {k}" for h, k in zip(handles, itertools.cycle(fmt.kinds))
                    if not (h.format in EXACT and stored_kind(h) == k) and KIND_OF_FORMAT.get(h.format) != k
                    and not (h.format == "BF16" and k == "bf16") and not (h.format == "F32" and k == "fp32")
                    and not (h.format in DEQUANTIZED and k == "fp32") and not (h.format == "MXFP4" and k == "bf16")
                    and not (h.format == "MXFP4" and k == "int8-g32" and h.int8_g32_exact)})
    return ("experts re-quantized on load: " + ", ".join(lossy)) if lossy else None


def unpack_q8_blocks(raw: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """GGUF Q8_0 blocks uint8 [N, K/32 * 34] -> (q int8 [N, K], scale fp16 [N, K/32]); w = q * scale."""
    N = raw.shape[0]
    b = np.ascontiguousarray(raw).reshape(N, -1, 34)  # (N, G, 34)
    d = b[..., 0:2].copy().view(np.float16)[..., 0]  # (N, G)
    q = b[..., 2:].copy().view(np.int8).reshape(N, -1)  # (N, K)
    return torch.from_numpy(q), torch.from_numpy(np.ascontiguousarray(d))


# llama.cpp's kvalues_iq4nl: the 16 int8 values an IQ4_NL / IQ4_XS 4-bit index picks
IQ4_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.int8)
IQ4_FORMATS = ("IQ4_NL", "IQ4_XS")


def unpack_iq4_blocks(raw: np.ndarray, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """GGUF IQ4_NL blocks uint8 [N, K/32 * 18] (fp16 d, qs[16]) or IQ4_XS super-blocks uint8 [N, K/256 * 136] (fp16
    d, uint16 scales_h, scales_l[4], qs[128]) -> (q int8 [N, K], scale fp16 [N, K/32]) with w = q * scale: q the
    codebook value IQ4_VALUES[i] of each 4-bit index (a group's 16 low nibbles are its weights 0..15, the high ones
    16..31), the scale IQ4_NL's d as stored, IQ4_XS's d (ls - 32) per group of 32 (ls: 4 bits of scales_l and 2 of
    scales_h) rounded to fp16 (gguf.quants.IQ4_XS computes it in fp32: within 2^-12 of it).

    Raises:
        ValueError: another format, or rows of the wrong width."""
    if fmt not in IQ4_FORMATS:
        raise ValueError(f"unpack_iq4_blocks: {fmt} is not an IQ4 format ({', '.join(IQ4_FORMATS)})")
    block = BLOCK_FORMATS[fmt][1]
    N = raw.shape[0]
    if raw.ndim != 2 or raw.shape[1] % block:
        raise ValueError(f"unpack_iq4_blocks: rows of whole {block}-byte blocks expected, got {raw.shape}")
    b = np.ascontiguousarray(raw).reshape(-1, block)
    d = b[:, 0:2].copy().view(np.float16).astype(np.float32)  # (blocks, 1)
    if fmt == "IQ4_NL":
        qs, scale = b[:, 2:], d  # (blocks, 16), one group a block
    else:
        sh = b[:, 2:4].copy().view(np.uint16).astype(np.int32)  # (blocks, 1)
        sl = b[:, 4:8].astype(np.int32)  # (blocks, 4): groups 2j (low nibble), 2j + 1 (high)
        low = np.stack([sl & 15, sl >> 4], -1).reshape(-1, 8)
        high = (sh >> (2 * np.arange(8, dtype=np.int32))) & 3
        scale = d * ((low | (high << 4)) - 32).astype(np.float32)  # (blocks, 8)
        qs = b[:, 8:].reshape(-1, 16)  # (blocks * 8, 16): a group's 16 bytes
    idx = np.concatenate([qs & 15, qs >> 4], -1)  # (groups, 32): low nibbles first
    q = IQ4_VALUES[idx].reshape(N, -1)
    return torch.from_numpy(q), torch.from_numpy(scale.astype(np.float16).reshape(N, -1))


def unpack_q4k_blocks(raw: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GGUF Q4_K blocks uint8 [N, K/256 * 144] -> (codes int32 [N, K] in 0..15, scale fp32 [N, K/32],
    zero fp32 [N, K/32]) with w = (codes - 8) * scale + zero, exactly ggml's d*sc*q - dmin*m."""
    from gguf.quants import Q4_K

    N = raw.shape[0]
    b = np.ascontiguousarray(raw).reshape(-1, 144)  # (blocks, 144)
    d = b[:, 0:2].copy().view(np.float16).astype(np.float32)  # (blocks, 1)
    dmin = b[:, 2:4].copy().view(np.float16).astype(np.float32)
    sc, m = Q4_K.get_scale_min(b[:, 4:16])  # (blocks, 8) each, 6-bit
    qs = b[:, 16:].reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    codes = (qs & 0x0F).reshape(N, -1).astype(np.int32)  # sub-block 2c: low nibbles, 2c+1: high
    scale = d * sc.astype(np.float32)  # (blocks, 8)
    zero = 8 * scale - dmin * m.astype(np.float32)
    return torch.from_numpy(codes), torch.from_numpy(scale.reshape(N, -1)), torch.from_numpy(zero.reshape(N, -1))


# the GGUF types that map onto int4 groups of 32 as stored (q4_blocks_tiled takes each, its block
# size from checkpoint/handle.BLOCK_FORMATS: Q4_K's super-blocks hold 256 weights)
INT4_BLOCK_FORMATS = ("Q4_0", "Q4_1", "Q4_K")


def unpack_int4_blocks(raw: np.ndarray, fmt: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Blocks of an INT4_BLOCK_FORMATS type -> (codes int32 [N, K], scale fp32 [N, K/32], zero fp32
    [N, K/32]): unpack_q4k_blocks for Q4_K, quant/int4.unpack_q4_blocks for Q4_0 / Q4_1."""
    return unpack_q4k_blocks(raw) if fmt == "Q4_K" else unpack_q4_blocks(raw, fmt)


def raw_blocks(handle) -> torch.Tensor:
    """A block-format handle's raw blocks uint8 [rows, bytes_per_row] as a tensor over the file's map
    (no copy when contiguous), for the native repacking passes."""
    return blocks_tensor(handle.blocks())


def projection_segments(handle, kind: str, int4_layout: str,
                        out: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Segments of one projection in `kind` from its checkpoint handle: GGUF Q4_0/Q4_1/Q4_K -> int4
    and Q8_0 -> int8-g32 straight from the blocks, gpt-oss's MXFP4 -> mxfp4 or int8-g32 from its codes
    and scales (TensorHandle.mxfp4_parts, int8_g32_parts), a GGUF gpt-oss Q8_0 expert from its blocks
    with the bias as a group (TensorHandle.int8_g32_parts, checkpoint/gguf_file.py), GGUF Q6_K / Q5_K /
    IQ4_XS -> q6k / q5k / iq4xs from the blocks (quant/experts.kquant_segments); anything else
    through the dense weight. `out`:
    the projection's segment views in an expert's slot (ExpertFormat.views), which the native
    repacking passes write in place (then the returned segments are those views)."""
    out = out or {}
    if KIND_OF_FORMAT.get(handle.format) == kind:  # a k-quant's blocks as stored
        return kquant_segments(kind, [raw_blocks(handle)], out or None)
    if kind in KQUANT_KINDS:  # stored otherwise (a Q4_K_M file's Q4_K ffn_down layer): fitted, into the slot
        return kquant_segments(kind, [quantize_blocks(dequantized(handle), kind)], out or None)
    if kind == "fp8" and fp8.as_stored(handle):
        q, bs = handle.scaled_fp8()
        return {"q": q.view(torch.uint8), "bs": bs}
    if kind == "fp8-row" and handle.format == "F8_E4M3" and _row_scaled(handle):  # a per-tensor scale per row
        q, bs = handle.scaled_fp8()
        return {"q": q.view(torch.uint8), "bs": fp8.kernel_scales(bs, *q.shape, handle.fp8_block)[0]}
    if handle.format == "INT4" and kind == "int4":  # GPTQ / AWQ / compressed-tensors codes as stored
        return int4_segments(*handle.int4_parts(), int4_layout)
    if handle.format == "INT8" and kind == "int8" and handle.int8_per_row:  # GPTQ / compressed-tensors codes
        q, scale = handle.int8_parts()
        if int8_tiled(int4_layout, *q.shape):
            return {"qt": tiled_int8(q), "scale": scale.to(torch.bfloat16)}
        return {"q": q, "scale": scale.to(torch.bfloat16)}
    if kind == "int8-g32" and handle.int8_g32_exact:  # gpt-oss's MXFP4 (codes x 2, scales / 2) or Q8_0 with its bias
        return int8_g32_segments(*handle.int8_g32_parts(), int4_layout)
    if kind == "mxfp4" and handle.mxfp4_exact:  # gpt-oss's MXFP4: the e2m1 codes as stored, bf16 scales
        from tiered.checkpoint.gpt_oss import checked_form, mxfp4_codes

        if int4_layout == "tiled" and handle.shape[0] % 16 == 0:  # the tile bytes from the blocks, in place
            return {"gw": checked_form(handle.name, mxfp4.tiled_from_blocks, *handle.mxfp4_parts(), handle.shape[1],
                                       handle.mxfp4_halves, out.get("gw"))}
        codes, scale = checked_form(handle.name, mxfp4_codes, *handle.mxfp4_parts(), handle.shape[1],
                                    handle.mxfp4_halves)
        return mxfp4.segments(codes, scale, int4_layout)
    if handle.format in INT4_BLOCK_FORMATS and kind == "int4":
        ext = load() if int4_layout == "tiled" else None
        if ext is not None:  # the same bytes in one native pass (~50x the numpy / torch path below)
            gw, zr = ext.q4_blocks_tiled(raw_blocks(handle), BLOCK_FORMATS[handle.format][1],
                                         zr_out=out.get("zr"), inline_sz=True, inline_out=out.get("gw"))
            return {"gw": gw, "zr": zr}
        return int4_segments(*unpack_int4_blocks(handle.blocks(), handle.format), int4_layout)
    if handle.format in IQ4_FORMATS and kind == "int8-g32":  # the codebook's int8 values and the scales per 32
        ext = load() if int8_tiled(int4_layout, *handle.shape) else None
        if ext is not None:  # the same bytes in one native pass
            qt, st = ext.iq4_blocks_tiled(raw_blocks(handle), handle.format == "IQ4_XS", out.get("qt"), out.get("st"))
            return {"qt": qt, "st": st}
        return int8_g32_segments(*unpack_iq4_blocks(handle.blocks(), handle.format), int4_layout)
    if handle.format == "Q6_K" and kind == "int8-g32":
        ext = load() if int8_tiled(int4_layout, *handle.shape) else None
        if ext is not None:  # dequantized and re-quantized per 32 in one native pass, the same bytes
            qt, st = ext.q6k_blocks_tiled(raw_blocks(handle), out.get("qt"), out.get("st"))
            return {"qt": qt, "st": st}
    if handle.format == "Q8_0" and kind == "int8-g32":
        ext = load() if int8_tiled(int4_layout, *handle.shape) else None
        if ext is not None:  # the same bytes in one native pass
            qt, st = ext.q8_blocks_tiled(raw_blocks(handle), out.get("qt"), out.get("st"))
            return {"qt": qt, "st": st}
        return int8_g32_segments(*unpack_q8_blocks(handle.blocks()), int4_layout)
    return quantize_projection(dequantized(handle), kind, int4_layout)


def dequantized(handle) -> torch.Tensor:
    """The fp32 weight of an expert's `handle` (what handle.load(torch.float32) gives: gguf's values), through native
    passes where it is Q6_K / Q5_K / IQ4_XS and tiles (its blocks repacked, then dequantized: quant/kquant's
    `dequantize`, gguf's arithmetic bit for bit) or Q4_K (q4k_dequantize_rows, the same): a layer stored otherwise
    than the expert format re-quantizes from it (a Q5_K_M file's Q5_K ffn_down experts into q6k, a Q4_K_M file's
    Q4_K ones), and torch's dequantization had taken ~7 ms (Q5_K) / ~4-5 ms (Q4_K) a Qwen3-30B-A3B-width projection
    on 2 Zen 4 cores, ~half of the Q5_K_M file's load."""
    kind = KIND_OF_FORMAT.get(handle.format)
    if handle.format == "Q4_K" and kquant_fits(tuple(handle.shape)):
        return load().q4k_dequantize_rows(raw_blocks(handle))
    if kind is None or not kquant_fits(tuple(handle.shape)):
        return handle.load(torch.float32)
    return dequantize_projection(kquant_segments(kind, [raw_blocks(handle)]), kind, *handle.shape, "tiled")


def encode_expert(fmt: ExpertFormat, handles, slot: tuple[torch.Tensor, ...] | None = None) -> tuple[torch.Tensor, ...]:
    """The expert whose (gate, up, down) handles are `handles`, in `fmt`, written into `slot` (host
    tensors of fmt.slot_shapes) or a new host slot; returns the slot."""
    slot = fmt.empty() if slot is None else slot
    if fmt.is_dense:
        for t, h in zip(slot, handles):
            h.read_into(t)
        return slot
    views = fmt.views(slot)  # the native repacks write here in place (encode then skips those segments)
    fmt.encode([projection_segments(h, k, fmt.int4_layout, v) for h, k, v in zip(handles, fmt.kinds, views)], slot, views)
    return slot
