"""Weights -> the fastest `Kernel` of the native extension for them (csrc/gemv.cpp, csrc/kernels.cpp).

Every function returns None when the extension is unavailable (`tiered.kernels.load()` is None:
TIERED_NATIVE=0, or no compiler); callers then keep their torch-op paths.

    weight                                   kernel
    Int8Linear (q int8 [N, K], scale [N])    int8_kernel (ours)
    int8 expert projection, tiled layout     int8_tiled_kernel (ours: 16 rows per SIMD vector, vpdpbusd)
    int8-g32 (GGUF Q8_0) expert, tiled       int8g32_tiled_kernel (the same, fp16 scales per group of 32)
    Q6KLinear, Q5KLinear (GGUF Q6_K / Q5_K   q6k_kernel, q5k_kernel (their codes and scales as stored; batch_act
    copies as stored, quant/kquant)          as the int8 ones')
    Int8G32Linear (a GGUF Q8_0 / Q6_K copy)  int8g32_tiled_kernel (its batch_act from 2 rows: int8 x, one
                                             vpdpbusd per 4 weights and row, on AVX-512)
    Int4Linear, tiled layout                 int4_tiled_kernel (ours: bf16 activations at batch 1,
                                             Int4Linear.batch_act from 2 rows)
    Int4Linear with plain codes              int4_kernel (ours, bf16 activations: act="q8" is faster but
                                             doubles SmolLM2's int4 KL)
    quantized expert (ExpertFormat)          expert_spec (ours: the three projections fused; int4 on
                                             ExpertFormat.act at one row, .batch_act from two; mxfp4:
                                             the tiled int4 kernels through the e2m1 table, int8 x)
    Int4Linear (torch's packed layout only)  int4pack_kernel (torch's _weight_int4pack_mm_for_cpu)
    CastLinear / nn.Linear, bf16 weight      bf16_kernel (ours)
    nn.Linear, fp32 weight                   f32_kernel (ours; at::linear above 16 rows)
    fp8 E4M3, 128 x 128 block scales         fp8_kernel (ours: DeepSeek-V3 / Qwen3-FP8 weights as stored)
    nn.Linear, other dtypes                  dense_kernel (at::linear)

A Kernel is called as kernel(x [B, K] any float dtype) -> y [B, N] fp32 (bias added).
"""

from __future__ import annotations

import threading

import torch
from torch import nn

from tiered.kernels import load


def plain_codes(codes: torch.Tensor) -> torch.Tensor:
    """int4 codes int [N, K] in 0..15 -> uint8 [N, K/2], column 2i in the low nibble (ExpertFormat's
    "plain" layout, what `int4_kernel` reads)."""
    c = codes.to(torch.uint8)
    return (c[:, 0::2] | (c[:, 1::2] << 4)).contiguous()


TILE = 16  # rows per tile of the tiled int4 layout


def tiled_codes(codes: torch.Tensor) -> torch.Tensor:
    """int4 codes int [N, K] in 0..15 (N % 16 == 0, K % 8 == 0) -> uint8 [N, K/2] in the "tiled"
    layout that `int4_kernel(layout="tiled")` reads: per tile of 16 rows and per 8 columns, 64 bytes
    where byte 4r + j holds q[16t + r, 8c + j] (low nibble) and q[16t + r, 8c + 4 + j] (high).
    One SIMD lane is then one output row (csrc/gemv.cpp, "int4, tiled").

    Raises:
        ValueError: N not a multiple of 16 or K not a multiple of 8.
    """
    N, K = codes.shape
    if N % TILE or K % 8:
        raise ValueError(f"tiled int4 codes need N % {TILE} == 0 and K % 8 == 0, got {N} x {K}")
    c = codes.to(torch.uint8).reshape(N // TILE, TILE, K // 8, 2, 4)  # (t, r, c8, half, j)
    b = c[:, :, :, 0] | (c[:, :, :, 1] << 4)  # (t, r, c8, j)
    return b.permute(0, 2, 1, 3).contiguous().reshape(N, K // 2)


def tiled_scales(scales_zeros: torch.Tensor) -> torch.Tensor:
    """Int4Linear's scales_zeros bf16 [G, N, 2] -> the tiled layout's [N/16, G, 16, 2] (each tile's
    scales and zeros one contiguous run, read once per tile)."""
    G, N, _ = scales_zeros.shape
    return scales_zeros.reshape(G, N // TILE, TILE, 2).transpose(0, 1).contiguous()


def tiled_residual(residual: torch.Tensor) -> torch.Tensor:
    """A zero residual bf16 [G, N] -> the tiled layout's [N/16, G, 16]."""
    G, N = residual.shape
    return residual.reshape(G, N // TILE, TILE).transpose(0, 1).contiguous()


def tiled_inline(codes: torch.Tensor, sz: torch.Tensor) -> torch.Tensor:
    """The tiled layout with its scales inline: tiled codes uint8 [N, K/2] (`tiled_codes`) and sz bf16
    [N/16, K/32, 16, 2] (`tiled_scales`) -> uint8 [N/16, K/32, 320]: each group-tile's 256 code bytes,
    then its 16 (scale, zero) pairs, five whole cache lines. A kernel then reads one stream where the
    separate scales cost one thread up to ~25% of its int4 rate (csrc/gemv.cpp Int4W::inline_sz). A
    zero residual (`tiled_residual`) stays a tensor of its own."""
    T, G = sz.shape[:2]
    return torch.cat([codes.reshape(T, G, 256), sz.contiguous().view(torch.uint8).reshape(T, G, 64)], dim=-1)


def inline_scales(buf: torch.Tensor) -> torch.Tensor:
    """The (scale, zero) pairs of a `tiled_inline` buffer uint8 [N/16, K/32, 320], as a bf16
    [N/16, K/32, 16, 2] view of it (not contiguous: `tiled_scales`' layout, strided)."""
    return buf.view(torch.bfloat16)[..., 128:160].unflatten(-1, (TILE, 2))


def inline_codes(buf: torch.Tensor) -> torch.Tensor:
    """The tiled codes of a `tiled_inline` buffer, uint8 [N, K/2] as `tiled_codes` lays them out (a copy)."""
    T, G = buf.shape[:2]
    return buf[..., :256].reshape(T * TILE, G * 256 // TILE)


def untiled_scales(sz: torch.Tensor) -> torch.Tensor:
    """The inverse of `tiled_scales`: [N/16, G, 16, 2] -> [G, N, 2]."""
    T, G = sz.shape[:2]
    return sz.transpose(0, 1).reshape(G, T * TILE, 2)


def untiled_residual(zr: torch.Tensor) -> torch.Tensor:
    """The inverse of `tiled_residual`: [N/16, G, 16] -> [G, N]."""
    T, G = zr.shape[:2]
    return zr.transpose(0, 1).reshape(G, T * TILE)


def int8_tiles(N: int, K: int) -> bool:
    """Whether an int8 weight [N, K] can take the tiled int8 layout (`tiled_int8`): N % 16 == 0 and
    K % 32 == 0 (csrc/gemv.cpp int8_tiles; other shapes stay per row)."""
    return N % TILE == 0 and K % 32 == 0


def tiled_int8(q: torch.Tensor) -> torch.Tensor:
    """int8 weights [N, K] (per-row layout) -> uint8 [N, K] in the tiled int8 layout that
    `int8_tiled_kernel` reads: per tile of 16 rows and per 4 columns, 64 bytes where byte 4r + j
    holds q[16t + r, 4c + j] + 128. One 32-bit SIMD lane is then one output row and the bytes are
    vpdpbusd's unsigned operand (csrc/gemv.cpp, "int8, tiled").

    Raises:
        ValueError: not int8, or a shape `int8_tiles` rejects.
    """
    N, K = q.shape
    if q.dtype != torch.int8 or not int8_tiles(N, K):
        raise ValueError(f"tiled int8 needs int8 [N, K] with N % {TILE} == 0 and K % 32 == 0, got {q.dtype} {N} x {K}")
    u = (q.to(torch.int16) + 128).to(torch.uint8).reshape(N // TILE, TILE, K // 4, 4)  # (t, r, c, j)
    return u.permute(0, 2, 1, 3).contiguous().reshape(N, K)


def tiled_group_scales(scale: torch.Tensor) -> torch.Tensor:
    """int8-g32 scales [N, K/32] -> the tiled layout's [N/16, K/32, 16] (a tile's 16 rows side by
    side per group, as `int8g32_tiled_kernel` reads them)."""
    N, G = scale.shape
    return scale.reshape(N // TILE, TILE, G).transpose(1, 2).contiguous()


def untiled_group_scales(st: torch.Tensor) -> torch.Tensor:
    """`tiled_group_scales`' inverse: [N/16, K/32, 16] -> [N, K/32]."""
    T, G, _ = st.shape
    return st.transpose(1, 2).reshape(T * TILE, G)


def untiled_int8(qt: torch.Tensor) -> torch.Tensor:
    """`tiled_int8`'s inverse: uint8 [N, K] tiled -> int8 [N, K] per row."""
    N, K = qt.shape
    u = qt.reshape(N // TILE, K // 4, TILE, 4).permute(0, 2, 1, 3).reshape(N, K)
    return (u.to(torch.int16) - 128).to(torch.int8)


def int8_tiled_kernel(qt: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
                      batch_act: str = "bf16"):
    """Our int8 kernel over the tiled layout: qt uint8 [N, K] (`tiled_int8`), scale [N]; w = (qt -
    128) * scale. Exact int32 dots of the weights with int16-quantized activations (per group of 32,
    as the per-row int8 kernel); batch_act "q8": calls of two or more rows on int8-quantized ones
    (AVX-512 and scalar paths; AVX2 keeps int16). None without the extension.

    Raises:
        RuntimeError: shapes or dtypes other than the above, or batch_act not "bf16" / "q8"."""
    ext = load()
    return None if ext is None else ext.int8_tiled_kernel(qt, scale, bias, batch_act)


def int4_tiled_kernel(codes: torch.Tensor, sz: torch.Tensor | None, residual: torch.Tensor | None = None,
                      bias: torch.Tensor | None = None, act: str = "bf16", batch_act: str | None = None,
                      e2m1: bool = False):
    """Our int4 kernel over the tiled layout: codes uint8 [N, K/2] (`tiled_codes`), sz bf16
    [N/16, K/32, 16, 2] (`tiled_scales`), optional residual bf16 [N/16, K/32, 16] (`tiled_residual`);
    or the scales inline: codes uint8 [N/16, K/32, 320] (`tiled_inline`), sz None (the residual as before).
    w = (q - 8) * scale + zero + residual. One SIMD lane per output row: at batch 1 it reads near the
    memory bandwidth and at batch 8 it converts each weight once for all 8 rows. act as `int4_kernel`,
    for calls of one activation row; batch_act (default act) for calls of two or more. e2m1: the codes
    are FP4 e2m1 (quant/mxfp4.py: w = (E2M1_U[q] - 12) * scale + zero + residual), on int8 activations
    at every call size (act and batch_act ignored). None without the extension.

    Raises:
        RuntimeError: shapes or dtypes other than the above, or act / batch_act not "bf16" / "q8"."""
    ext = load()
    return None if ext is None else ext.int4_tiled_kernel(codes, sz, residual, bias, act, batch_act, e2m1=e2m1)


_scratch = threading.local()  # tiled_dequantize's per-thread buffers (and gemm_by_row_chunks' y^T), by slot and dtype


def tiled_dequantize(codes: torch.Tensor, sz: torch.Tensor | None, residual: torch.Tensor | None = None,
                     fp32: bool = True, rows: tuple[int, int] | None = None, e2m1: bool = False) -> torch.Tensor:
    """A tiled int4 weight (`int4_tiled_kernel`'s tensors, either form; e2m1: MXFP4 codes, as there)
    dequantized, [N, K] fp32 (bf16 with fp32=False), or its rows [n0, n1) (whole tiles of 16), written
    into this thread's reused buffer: the result is valid until the next call on the same thread (use
    it at once, e.g. in one F.linear). A fresh tensor per call would fault in new pages every time: a
    SmolLM2 prefill dequantizes ~0.5 GB.

    Raises:
        RuntimeError: the extension is unavailable, or bad shapes (as `int4_tiled_kernel`)."""
    ext = load()
    if ext is None:
        raise RuntimeError("tiled_dequantize needs tiered/kernels built")
    N, K = (codes.shape[0] * TILE, codes.shape[1] * 32) if codes.dim() == 3 else (codes.shape[0], codes.shape[1] * 2)
    dtype = torch.float32 if fp32 else torch.bfloat16
    n0, n1 = rows if rows is not None else (0, N)
    return ext.int4_tiled_dequantize(codes, sz, residual, n0, n1, fp32, _scratch_view(n1 - n0, K, dtype), e2m1=e2m1)


def bf16_rows(w: torch.Tensor, n0: int, n1: int) -> torch.Tensor:
    """Rows [n0, n1) of w [N, K] (int8 codes: exact in bf16, whose 8 significant bits hold any |q| <= 256)
    converted to bf16 [n1 - n0, K] in this thread's reused buffer, valid until the next call on the
    thread (as `tiled_dequantize`'s)."""
    return _scratch_view(n1 - n0, w.shape[1], torch.bfloat16).copy_(w[n0:n1])


def _scratch_view(N: int, K: int, dtype: torch.dtype, slot: str = "", unheld: bool = False) -> torch.Tensor:
    """[N, K] of this thread's reused `dtype` buffer `slot` (grown as needed; made again outside inference mode where
    it was made inside, as the engine's forwards and the kernel tuning run: an inference tensor takes no
    in-place write outside it). `unheld`: for a result its caller keeps (quant/int4.gemm_by_row_chunks' y^T): the
    buffer is used again only where nothing else holds its memory any more (its storage's use count: the buffer's
    own and the query's), else a new one takes the slot."""
    key = f"{slot}{dtype}"
    buf = getattr(_scratch, key, None)
    if buf is None or buf.numel() < N * K or (buf.is_inference() and not torch.is_inference_mode_enabled()) or \
            (unheld and torch._C._storage_Use_Count(buf.untyped_storage()._cdata) > 2):
        buf = torch.empty(N * K, dtype=dtype)
        setattr(_scratch, key, buf)
    return buf[:N * K].view(N, K)


def tiled_int8_g32_dequantize(qt: torch.Tensor, st: torch.Tensor) -> torch.Tensor:
    """A tiled int8-g32 weight (qt uint8 [N, K], st fp16 [N/16, K/32, 16]) dequantized to bf16 [N, K],
    (qt - 128) * s rounded to nearest even, into this thread's reused buffer as `tiled_dequantize`'s:
    valid until the next call on the same thread.

    Raises:
        RuntimeError: the extension is unavailable, or bad shapes."""
    ext = load()
    if ext is None:
        raise RuntimeError("tiled_int8_g32_dequantize needs tiered/kernels built")
    N, K = qt.shape
    return ext.int8g32_tiled_dequantize(qt, st, _scratch_view(N, K, torch.bfloat16))


def kquant_dequantize(kind: str, qt: torch.Tensor, scales: torch.Tensor, supers: torch.Tensor) -> torch.Tensor:
    """A "q6k" / "q5k" / "iq4xs" weight (quant/kquant's layouts: qt uint8 [N/16, K/32, 384 / 320 / 256] and its scales) dequantized
    to bf16 [N, K] (rounded to nearest even), into this thread's reused buffer as `tiled_dequantize`'s: valid until the
    next call on the same thread.

    Raises:
        RuntimeError: the extension is unavailable, or bad shapes."""
    ext = load()
    if ext is None:
        raise RuntimeError("kquant_dequantize needs tiered/kernels built")
    N, K = qt.shape[0] * 16, qt.shape[1] * 32
    return getattr(ext, f"{kind}_tiled_dequantize")(qt, scales, supers, True, _scratch_view(N, K, torch.bfloat16))


def untiled_codes(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of `tiled_codes`: uint8 [N, K/2] tiled -> int32 codes [N, K]."""
    N, K = packed.shape[0], packed.shape[1] * 2
    b = packed.reshape(N // TILE, K // 8, TILE, 4).permute(0, 2, 1, 3)  # (t, r, c8, j)
    c = torch.stack([b & 0x0F, b >> 4], dim=3)  # (t, r, c8, half, j)
    return c.reshape(N, K).to(torch.int32)


def int4_kernel(codes: torch.Tensor, scales_zeros: torch.Tensor, residual: torch.Tensor | None = None,
                bias: torch.Tensor | None = None, act: str = "bf16"):
    """Our int4 kernel over plain codes uint8 [N, K/2] and Int4Linear's scales_zeros bf16 [K/32, N, 2]
    (w = (q - 8) * scale + zero), plus an optional zero residual bf16 [K/32, N]. No copy of the
    weights: the kernel reads the tensors given (and keeps them alive). None without the extension.

    act: the activations the kernel reads: "bf16" (x rounded to bf16, vdpbf16ps per group of 32) or
    "q8" (x quantized to int8 per group of 32 as llama.cpp's Q8_0, vpdpbusd per 4 groups: ~2x the
    bandwidth of "bf16" at batch 1, adds the activations' 8-bit rounding to the error)."""
    ext = load()
    if ext is None:
        return None
    zr = None if residual is None else residual.T
    return ext.int4_kernel(codes, scales_zeros[..., 0].T, scales_zeros[..., 1].T, zr, bias, act)


class NativeLinear(nn.Module):
    """A linear layer held only in a format tiered's native kernels compute (quant/int8.Int8G32Linear,
    quant/fp8.Fp8Linear): `kernel()` builds that kernel on first use from the subclass's
    `_build(ext, bias fp32 [N] or None)`; `self.bias` is the layer's bias or None."""

    _native = None

    def kernel(self):
        """The native kernel (x [B, K] -> y [B, N] fp32, bias added).

        Raises:
            RuntimeError: the native extension is unavailable."""
        if self._native is None:
            ext = load()
            if ext is None:
                raise RuntimeError(f"{type(self).__name__} needs tiered/kernels built")
            self._native = self._build(ext, None if self.bias is None else self.bias.detach().float())
        return self._native

    def _build(self, ext, bias):
        raise NotImplementedError


def kernel_for(m: nn.Module):
    """The best native Kernel computing module `m` (x [B, K] -> y [B, N] fp32 with m's bias).

    Args:
        m: Int4Linear, Int8Linear, Int8G32Linear, Fp8Linear, CastLinear or nn.Linear (any weight dtype).
    Returns:
        A Kernel, or None when the extension is unavailable.
    Raises:
        TypeError: a module of another type.
    """
    from tiered.quant.int4 import Int4Linear
    from tiered.quant.int8 import Int8Linear
    from tiered.quant.linear import CastLinear

    ext = load()
    if ext is None:
        return None
    if isinstance(m, NativeLinear):
        return m.kernel()
    bias = getattr(m, "bias", None)
    bias = None if bias is None else bias.detach().float()
    if isinstance(m, Int4Linear):
        if m.layout == "tiled":
            return m.kernel()
        if m.codes is not None:
            return int4_kernel(m.codes, m.scales_zeros, bias=bias)
        return ext.int4pack_kernel(m.packed, m.group, m.scales_zeros, m.in_features, m.out_features, bias)
    if isinstance(m, Int8Linear):
        return ext.int8_kernel(m.q, m.scale, bias)
    if isinstance(m, (CastLinear, nn.Linear)):
        w = m.weight.detach()
        if w.dtype == torch.bfloat16 and w.is_contiguous():
            return ext.bf16_kernel(w, bias)
        if w.dtype == torch.float32 and w.is_contiguous():
            return ext.f32_kernel(w, bias)
        return ext.dense_kernel(w, bias)
    raise TypeError(f"no native kernel for {type(m).__name__}")


# int8-g32, mxfp4 and the k-quants (a GGUF file's Q6_K / Q5_K / IQ4_XS experts as stored): the tiled layout only
NATIVE_EXPERT_KINDS = ("bf16", "int8", "int4", "int8-g32", "fp8", "fp8-row", "mxfp4", "q6k", "q5k", "iq4xs")


def expert_spec(fmt):
    """A native ExpertSpec for a quantized `quant.experts.ExpertFormat` (spec.forward(slot uint8
    [nbytes], x [n, D]) -> [n, D] fp32), or None: no extension, a dense format (use
    `ext.bf16_expert_forward`), a kind without a native kernel (fp32; int8-g32 outside the tiled
    layout or with N % 16; mxfp4 and the k-quants outside the tiled layout), or int4 in torch's "cpu" layout
    (our kernels read the "plain" and "tiled" ones)."""
    from tiered.quant.kquant import KQUANT_KINDS

    ext = load()
    if ext is None or fmt.is_dense or any(k not in NATIVE_EXPERT_KINDS for k in fmt.kinds):
        return None
    if "int4" in fmt.kinds and fmt.int4_layout not in ("plain", "tiled"):
        return None
    if ({"mxfp4", *KQUANT_KINDS} & set(fmt.kinds)) and fmt.int4_layout != "tiled":
        return None
    if any(k == "int8-g32" and (fmt.int4_layout != "tiled" or not int8_tiles(*s)) for k, s in zip(fmt.kinds, fmt.shapes)):
        return None
    offsets = []
    for segs, kind in zip(fmt._layout, fmt.kinds):
        o = [off for _, off, _, _ in segs]
        if kind == "int4" and fmt.int4_layout == "tiled":
            # codes with their scales inline, then residuals: the kernel's three offsets are the codes,
            # the first (s, z) line (+256: how ExpertSpec tells the inline form) and the residuals
            o = [o[0], o[0] + 256, o[1]]
        if kind == "int4" and fmt.exact_zeros:  # the residuals are all zero: not read (offset -1)
            o = o[:2] + [-1]
        if kind == "mxfp4":  # tiled int4's codes with their scales inline, and no residual
            o = [o[0], o[0] + 256, -1]
        offsets.append(o)
    if fmt.int4_layout == "tiled":
        return ext.expert_spec(list(fmt.kinds), [list(s) for s in fmt.shapes], offsets, fmt.nbytes,
                               fmt.act, "tiled", fmt.batch_act)
    return ext.expert_spec(list(fmt.kinds), [list(s) for s in fmt.shapes], offsets, fmt.nbytes, fmt.act, "plain")
