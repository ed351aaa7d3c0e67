"""Group-wise 4-bit weights on torch's packed-int4 CPU kernel.

Format: for each output row and each group of `group` (32) input columns, 4-bit codes q in 0..15
with a scale and a zero: w = (q - 8) * scale + zero. GGUF's Q4_0 (w = d * (q - 8)) and Q4_1
(w = d * q + m) blocks map onto it exactly: Q4_0 -> (scale=d, zero=0); Q4_1 -> (scale=d,
zero=m + 8d). The kernel (`aten._weight_int4pack_mm_for_cpu`) takes bf16 activations and bf16
scales/zeros, so the weights are read at ~4.5 bits each; rounding d and m to bf16 and the
activations to bf16 makes this path lossy (like llama.cpp's Q8 activations), never the default
for scoring or prefill.
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

GROUP = 32  # elements per Q4_0 / Q4_1 block
# Int4Linear.dense: calls of more rows dequantize the weight for one fp32 GEMM, by the native kernels'
# ISA (kernels.isa). Measured on the 2-core Zen 4 EPYC (2026-11-26), the bf16-activation kernel against
# dequantize + GEMM at 64 / 128 / 512 rows: 1536 x 576 0.7 / 1.6 / 5.9 ms vs 1.9 / 2.6 / 7.1; 4096 x 4096
# 7.4 / 15.3 / 59.7 vs 22.3 / 35.1 / 106.1; 14336 x 4096 33.5 / 65.3 / 289 vs 106 / 151 / 413 (the
# dequantized weight leaves the cache, and writing it costs more than the GEMM saves). Its AVX2 path
# on the same cores: ahead to 128 rows, even at 512 (5.9 vs 5.2, 113 vs 107, 383 vs 388 ms).
# On AVX-512 (which the kernels' ISA means only with AVX512_BF16) the weight is dequantized to bf16
# instead, for oneDNN's bf16 GEMM (DEQUANTIZE_DTYPE): on the same cores, 2026-11-26, kernel against
# bf16 dequantize + GEMM at 32 / 64 / 128 / 512 rows: 1536 x 576 0.3 / 0.5 / 1.1 / 4.2 ms vs 0.3 / 0.4 /
# 0.7 / 2.3; 14336 x 4096 14.8 / 28.0 / 55.8 / 231 vs 25.7 / 34.1 / 49.8 / 152: from 96 rows.
DEQUANTIZE_ROWS = {"avx512": 96, "avx2": 256}
DEQUANTIZE_ROWS_OTHER = 48  # the scalar path
# Calls on int8 activations (batch_act "q8", Plan.batch_act's default), where the ISA is named here: on AVX2 the
# int4 kernel on int8 rows ran 117-169 GMAC/s at 256-1024 rows on 2 Zen 3 cores against 61-88 for dequantize +
# fp32 GEMM (2026-11-30: 4096 x 4096 at 512 rows 55 vs 105 ms, 14336 x 4096 207 vs 356, 4096 x 14336 258 vs
# 342, 1536 x 576 2.9 vs 6.1; at 1024 rows 110 vs 200, 428 vs 695): never dequantized there (None). A
# Llama-3-8B-width Q4_K_M prompt of 512 tokens had taken 11.8 s where llama.cpp took 9.7.
# On AVX-512 it depends on the CPU more than on the ISA: 2 Zen 5 cores (2026-12-01, AVX-512 BF16 and VNNI, no
# AMX) ran the int8-row kernel ahead of bf16 dequantize + oneDNN GEMM at every row count to 1024 (0.20-0.52x
# the time at 32-128 rows, 0.65-0.93x at 256-512 on 4096 x 4096 and 14336 x 4096, 0.91-1.07x at 1024), and
# SmolLM2's 128-token prompt, dequantized past 96 rows, took 6.6x its 32-token one. So the kernel tuning
# measures it (kernels/tune.py's q8_dequantize_rows); this table holds where the tuning has not.
DEQUANTIZE_ROWS_Q8 = {"avx2": None}
DEQUANTIZE_DTYPE = {"avx512": torch.bfloat16}  # the GEMM's dtype beyond DEQUANTIZE_ROWS (else fp32)
# Weights of more elements are dequantized and multiplied this many elements' rows at a time: the
# reused buffer stays 64 MiB in bf16 (a 70B model's fused gate/up would take 0.9 GB whole)
DEQUANTIZE_CHUNK = 32 * 2**20
# Calls of up to this many rows past dequantize_rows take tiered's AMX GEMM where the CPU has AMX (kernels'
# int4_tiled_gemm: each thread dequantizes its 32-row blocks of W into AMX's tile layout in its own cache, no
# dequantized W in memory for oneDNN to pack again, no oneDNN kernels built per new row count). Against bf16
# dequantize + oneDNN GEMM on 2 Sapphire Rapids cores (2026-12-05, 15 alternated rounds, median time ratios):
# 3072 x 576 at 400 rows 1.00, 576 x 1536 0.94, 960 x 576 0.92, 14336 x 4096 at 256 rows 0.69, 4096 x 4096 at 512
# 1.00; but 3072 x 576 at 941 rows 1.37 (oneDNN's GEMM loop reaches more of AMX's rate than this one's 2 x 2 tiles,
# which pays where the dequantizing passes weigh most: fewer rows). oneDNN's first call at a row count it has not
# seen takes 2-5 ms more a shape (~15 ms of a SmolLM2 prompt of a new length), which this path never does. At 512
# (the first choice) SmolLM2's 512-token prompt ran about as before and its price, the AMX key's line from 192 and
# 384 rows, came out 22% fast in planner validation: 384. Since a prompt's blocks hand these GEMMs bf16 rows (no casts
# around oneDNN's call either: models/layers.input_dtype), SmolLM2's TTFT with this path up to 1024 rows against 384
# (medians of 7 prompts of new lengths, then 5 of the first length again; two alternated processes a side, 2 AMX
# cores, 2026-12-06): 450-528 tokens 194 / 199 -> 171 / 174 ms (repeated 167 -> 148 / 157), 560-638 231 / 230 ->
# 195 / 192 (196 / 198 -> 182 / 181), 700-778 269 / 263 -> 235 / 264 (234 / 232 -> 233 / 252), 900-978 342 / 333 ->
# 352 / 333 (305 / 296 -> 340 / 300): 512, with gemm_amx/cpu/int4 timed at up to these rows (profiler.amx_gemm_shapes).
AMX_ROWS = 512
# Rows from which the native decode step's int4 projections (and tiled int8 ones: a Q8_0 / Q6_K head) run the AMX GEMM
# on a CPU with AMX (csrc/gemv.cpp's kAmxStepRows: Int4TGemv::run_step, Int8Gemv::run_step); the planner prices the
# int4 ones so (planner/cpu_predict.step_amx_time).
STEP_AMX_ROWS = 24


def unpack_q4_blocks(raw: np.ndarray, fmt: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Decode GGUF Q4_0 / Q4_1 blocks.

    Args:
        raw: uint8 [N, K / 32 * block_bytes] (one row of blocks per output feature).
        fmt: "Q4_0" (18-byte blocks) or "Q4_1" (20-byte blocks).
    Returns:
        codes int32 [N, K] in 0..15, scale fp32 [N, K/32], zero fp32 [N, K/32] with
        w = (codes - 8) * scale + zero.
    """
    block = 18 if fmt == "Q4_0" else 20
    N = raw.shape[0]
    b = np.ascontiguousarray(raw).reshape(N, -1, block)  # (N, G, block)
    d = b[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)  # (N, G)
    qs = b[..., block - 16:]  # (N, G, 16): element j in low nibble, j + 16 in high nibble
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(np.int32).reshape(N, -1)  # (N, K)
    if fmt == "Q4_0":
        zero = np.zeros_like(d)
    else:
        m = b[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        zero = m + 8.0 * d
    return torch.from_numpy(codes), torch.from_numpy(d), torch.from_numpy(zero)


def quantize_int4(w: torch.Tensor, group: int = GROUP) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric min/max group-wise int4 quantization of a dense weight.

    Args:
        w: float [N, K], K divisible by `group`.
    Returns:
        codes int32 [N, K] in 0..15, scale fp32 [N, K/group], zero fp32 [N, K/group].
    """
    N, K = w.shape
    g = w.float().reshape(N, K // group, group)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / 15).clamp_min(1e-12)
    codes = ((g - lo.unsqueeze(-1)) / scale.unsqueeze(-1)).round().clamp(0, 15).to(torch.int32)
    zero = lo + 8 * scale
    return codes.reshape(N, K), scale, zero


LAYOUTS = ("cpu", "tiled")


def tiled_fits(out_features: int, in_features: int, group: int = GROUP) -> bool:
    """Whether a weight [N, K] can take the "tiled" layout (tiered's kernels: N % 16, K % 32, group 32)."""
    return group == GROUP and out_features % 16 == 0 and in_features % GROUP == 0


def dequantize_rows(batch_act: str = "bf16", isa: str | None = None, tuning: dict | None = None) -> int | None:
    """Rows beyond which Int4Linear.dense dequantizes for one GEMM. Calls on int8 activations (`batch_act` "q8"):
    the kernel tuning's measured q8_dequantize_rows where it has one (kernels/tune.py: 0 for never), else
    DEQUANTIZE_ROWS_Q8 where it names the ISA; other calls, and q8 ones on other ISAs: DEQUANTIZE_ROWS by the
    native kernels' ISA. `isa` and `tuning` None: this machine's (kernels.isa, kernels.tuning); the planner
    passes a profiled machine's (its meta's kernel_isa and kernel_tuning). None: never, the kernel at every
    row count."""
    from tiered import kernels

    isa, tuned = kernels.tuned_choice("q8_dequantize_rows", isa, tuning)
    if batch_act == "q8" and tuned is not None:
        return int(tuned) or None
    if batch_act == "q8" and isa in DEQUANTIZE_ROWS_Q8:
        return DEQUANTIZE_ROWS_Q8[isa]
    return DEQUANTIZE_ROWS.get(isa, DEQUANTIZE_ROWS_OTHER)


def _transposed(x: torch.Tensor) -> bool:
    """Whether x [T, K] (T > 1) is a view of x^T's contiguous storage [K, T]."""
    return x.dim() == 2 and x.shape[0] > 1 and x.shape[1] > 1 and x.stride() == (1, x.shape[0])


def _reused_output(N: int, T: int, dtype: torch.dtype) -> torch.Tensor:
    """An [N, T] `dtype` tensor for a GEMM's y^T: this thread's buffer where nothing else holds its memory any more
    (kernels/linear._scratch_view's `unheld`). A fresh tensor of more than glibc's 32 MiB mmap threshold is new
    pages each call: a Gemma-3-4B-width gate / up output (42 MB at 1024 rows) faulted ~10k pages a layer, 68k and
    0.18 s of system time in a 1024-token prompt of 1.0 s (2 AMX cores, 2026-12-07). The buffer is within the
    prompt's planned workspace (memory/sizes.workspace_bytes: gate, up and product)."""
    from tiered.kernels.linear import _scratch_view

    return _scratch_view(N, T, dtype, slot="y^T", unheld=True)


def gemm_by_row_chunks(x: torch.Tensor, out_features: int, weight_rows, bias: torch.Tensor | None) -> torch.Tensor:
    """x [T, K] @ W^T (+ bias) -> [T, N] in x's dtype, where `weight_rows(n0, n1)` gives W's rows [n0, n1)
    dequantized in x's dtype (into a reused buffer: used at once): the whole W in one GEMM up to
    DEQUANTIZE_CHUNK elements, else in chunks of whole 16-row tiles, each GEMM writing its rows of y^T. An x that
    is a view of x^T's storage (the GLU's output over a transposed gate / up GEMM: a down projection's input) is
    multiplied as it lies, y^T = W x^T, and y returned as a view of y^T too: oneDNN's GEMM over the transposed view
    had taken 1.3x the time (a Gemma-3-4B-width down projection, 1024 rows of 10240, bf16: 43.5-47.9 ms against
    32.5-33.8, 2 AMX cores, 2026-12-07)."""
    N, K = out_features, x.shape[1]
    step = max(16, DEQUANTIZE_CHUNK // K // 16 * 16)
    if step >= N and not _transposed(x):
        return F.linear(x, weight_rows(0, N), bias)
    # (x^T's storage, a GLU's over a transposed GEMM output: layers._glu, is multiplied as it lies: one chunk)
    yt = _reused_output(N, x.shape[0], x.dtype)
    for n0 in range(0, N, step):
        n1 = min(N, n0 + step)
        torch.mm(weight_rows(n0, n1), x.t(), out=yt[n0:n1])
    return yt.t() if bias is None else yt.t() + bias


_AMX_OFF = 0  # without_amx's depth


def amx_kernels():
    """The native kernels where their AMX GEMM (int4_tiled_gemm) runs here: the CPU has AMX-TILE and AMX-BF16 and
    Linux grants this process the tile data; else None (and with TIERED_AMX=0, or within `without_amx`)."""
    from tiered import kernels

    ext = kernels.load()
    if ext is None or _AMX_OFF or not kernels.amx_allowed():
        return None
    return ext if ext.amx_available() else None


def bf16_attention_kernels():
    """The native kernels where their bf16 prompt attention (bf16_prompt_attention; the native step's prompt rows
    over a bf16 cache alike) runs here: on AMX tiles where the native step's AMX calls run, else on AVX512-BF16
    (csrc/gemv.cpp attn_block_avx512); else None (an AVX2 or scalar build, and within `without_amx`)."""
    from tiered import kernels

    ext = kernels.load()
    if ext is None or _AMX_OFF:
        return None
    return ext if ext.bf16_attention_available() else None


def amx_gemm(codes: torch.Tensor, residual: torch.Tensor | None, xb: torch.Tensor, bias: torch.Tensor | None = None,
             e2m1: bool = False) -> torch.Tensor | None:
    """xb [n, K] bf16 @ W^T (+ bias) -> [n, N] bf16 on the AMX GEMM (kernels' int4_tiled_gemm) for a tiled int4 weight
    (`codes` with its scales inline [N/16, K/32, 320], its zero residual or None; e2m1: MXFP4 codes) where the call
    takes it: n within AMX_ROWS on a CPU with AMX (`amx_kernels`); else None (the caller dequantizes for oneDNN).
    The one place Int4Linear.dequantized and quant/experts.tiled_int4_dequantized decide it."""
    if xb.shape[0] > AMX_ROWS or xb.device.type != "cpu":
        return None
    ext = amx_kernels()
    if ext is None:
        return None
    return ext.int4_tiled_gemm(codes, None, residual, xb if xb.stride(-1) == 1 else xb.contiguous(), bias, False, e2m1)


@contextlib.contextmanager
def without_amx():
    """Int4Linear.dequantized's calls take the dequantized oneDNN GEMM at every row count meanwhile, and prompts'
    bf16 attention torch's SDPA (`bf16_attention_kernels` None; the profiler times gemm/cpu/int4 so: its points at 2 and 4 x dequantize_rows would otherwise time the AMX GEMM, whose rate
    falls behind oneDNN's past AMX_ROWS, and price a 1024-token prompt chunk's GEMMs by it)."""
    global _AMX_OFF
    _AMX_OFF += 1
    try:
        yield
    finally:
        _AMX_OFF -= 1


def dequantize_dtype() -> torch.dtype:
    """The dtype Int4Linear.dense dequantizes to and computes its GEMM in beyond dequantize_rows()
    (DEQUANTIZE_DTYPE by the native kernels' ISA, else float32)."""
    from tiered import kernels

    return DEQUANTIZE_DTYPE.get(kernels.isa(), torch.float32)


class Int4Linear(nn.Module):
    """y = x @ W^T (+ b) with W in int4 groups of 32 (w = (q - 8) * scale + zero), one copy in one of
    two layouts:

        "cpu"    torch's packed int4 (`_weight_int4pack_mm_for_cpu`, bf16 activations): packed uint8
                 [N, K/2] in torch's order, scales_zeros bf16 [K/32, N, 2].
        "tiled"  tiered's own kernels (kernels/linear.tiled_inline; needs the native extension):
                 packed uint8 [N/16, K/32, 320], each 16-row tile's group of 32 columns as its 256
                 code bytes then its 16 (scale, zero) pairs, so the kernels read one stream;
                 scales_zeros is a bf16 [N/16, K/32, 16, 2] view of those pairs.
                 One activation row reads bf16 x (as torch's kernel does); calls of two or more rows
                 read `batch_act` ("q8": x rounded to int8 per group of 32, llama.cpp's Q8_0 -
                 about 2x faster at batch 8 - or "bf16"). `dense(x)` is the prefill path of a weight
                 held only in this form (bf16 kernel, or the weight dequantized for one GEMM).

    x [..., K] any float dtype -> [..., N] in x's dtype. Built by `from_codes`, `from_gguf` or
    `from_dense`; holds ~K*N/2 + 4*N*K/group bytes.
    """

    def __init__(self, packed: torch.Tensor, scales_zeros: torch.Tensor, in_features: int,
                 out_features: int, group: int, bias: torch.Tensor | None, layout: str = "cpu",
                 batch_act: str = "bf16") -> None:
        super().__init__()
        if layout not in LAYOUTS:
            raise ValueError(f"int4 layout must be one of {LAYOUTS}, got {layout!r}")
        self.register_buffer("packed", packed)  # uint8 [N, K/2] in torch's order, or tiled [N/16, K/32, 320]
        self.register_buffer("scales_zeros", scales_zeros)  # bf16 [K/group, N, 2], or a view of the tiled pairs
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.in_features, self.out_features, self.group = in_features, out_features, group
        self.layout, self.batch_act = layout, batch_act
        self._kernels: dict = {}  # the tiled layout's native Kernels by batch_act, built at first use
        # Optional second layout: plain codes uint8 [N, K/2] for tiered's own int4 kernel
        # (kernels/linear.kernel_for); +K*N/2 bytes, so only when asked (`with_plain_codes`).
        self.codes: torch.Tensor | None = None

    def with_plain_codes(self, codes: torch.Tensor) -> "Int4Linear":
        """Also hold codes int [N, K] (0..15) in the plain layout, for tiered's own int4 kernel."""
        from tiered.kernels.linear import plain_codes

        self.codes = plain_codes(codes)
        return self

    @classmethod
    def from_codes(cls, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                   group: int = GROUP, bias: torch.Tensor | None = None, layout: str = "cpu",
                   batch_act: str = "bf16") -> "Int4Linear":
        """codes int32 [N, K]; scale, zero fp32 [N, K/group]. layout "tiled" falls back to "cpu" for
        a shape the tiled kernels do not take (`tiled_fits`)."""
        N, K = codes.shape
        sz = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)
        if layout == "tiled" and tiled_fits(N, K, group):
            from tiered.kernels.linear import inline_scales, tiled_codes, tiled_inline, tiled_scales

            buf = tiled_inline(tiled_codes(codes), tiled_scales(sz))
            return cls(buf, inline_scales(buf), K, N, group, bias, "tiled", batch_act)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.contiguous(), 1)
        return cls(packed, sz, K, N, group, bias)

    @classmethod
    def from_gguf(cls, raw: np.ndarray, fmt: str, bias: torch.Tensor | None = None) -> "Int4Linear":
        """Pack GGUF Q4_0 / Q4_1 blocks (uint8 [N, bytes_per_row]) without dequantizing."""
        return cls.from_codes(*unpack_q4_blocks(raw, fmt), group=GROUP, bias=bias)

    @classmethod
    def from_dense(cls, w: torch.Tensor, bias: torch.Tensor | None = None, group: int = GROUP) -> "Int4Linear":
        """Quantize a dense float weight [N, K] (K % group == 0)."""
        return cls.from_codes(*quantize_int4(w, group), group=group, bias=bias)

    def kernel(self, batch_act: str | None = None):
        """The tiled layout's native Kernel (x [B, K] any float dtype -> y [B, N] fp32, bias added):
        bf16 activations at one row, `batch_act` (default self.batch_act) from two. Kernels share
        this module's tensors (no copy).

        Raises:
            RuntimeError: not the tiled layout, or the native extension is unavailable."""
        act = batch_act or self.batch_act
        k = self._kernels.get(act)
        if k is None:
            from tiered.kernels.linear import int4_tiled_kernel

            bias = None if self.bias is None else self.bias.detach().float()
            k = int4_tiled_kernel(self.packed, None, None, bias, "bf16", act) \
                if self.layout == "tiled" else None
            if k is None:
                raise RuntimeError(f"Int4Linear({self.layout}) has no native kernel: the tiled layout needs "
                                   "tiered/kernels built")
            self._kernels[act] = k
        return k

    def dense(self, x: torch.Tensor) -> torch.Tensor:
        """The prefill path: x [..., K] -> [..., N] in x's dtype: the kernel on `batch_act` activations
        (Plan.batch_act: int8 by default, as a prompt's rows in the native step read them), or beyond
        `dequantize_rows(batch_act)` rows the weight dequantized once (into a reused buffer) for one GEMM in
        `dequantize_dtype()`: bf16 on AVX-512 (activations, weights and the product rounded to bf16,
        accumulated in fp32 by oneDNN), else fp32. torch's packed layout: `forward`. A Llama-3-8B-width
        Q4_K_M prompt of 96 tokens (8 layers, 2 Sapphire Rapids cores, 2026-11-29) took 2.45 s on the
        bf16-activation kernel, 0.85 s as int8 rows."""
        if self.layout != "tiled":
            return self.forward(x)
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        limit = dequantize_rows(self.batch_act)
        y = self.kernel(self.batch_act)(x2) if limit is None or x2.shape[0] <= limit else self.dequantized(x2)
        return y.to(x.dtype).reshape(*shape[:-1], self.out_features)

    def dense_dtype(self, rows: int) -> torch.dtype | None:
        """The dtype `dense` computes a call of `rows` rows in where it dequantizes this weight for one GEMM
        (dequantize_dtype(): bf16 on AVX-512): activations of that dtype then go through without a cast either
        way. None where such a call runs the kernel (within dequantize_rows(batch_act)) or the layout has no
        `dense` path of its own."""
        if self.layout != "tiled":
            return None
        limit = dequantize_rows(self.batch_act)
        return None if limit is None or rows <= limit else dequantize_dtype()

    def dequantized(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, K] -> [T, N] in `dequantize_dtype()`: the weight ("tiled" layout) dequantized (into a reused
        buffer) for one GEMM in that dtype, as `dense` runs calls past dequantize_rows; calls of up to AMX_ROWS rows in
        bf16 on a CPU with AMX take the native AMX GEMM instead (`amx_gemm`: no dequantized weight in memory)."""
        from tiered.kernels.linear import tiled_dequantize

        dt = dequantize_dtype()
        if dt == torch.bfloat16 and self.packed.dim() == 3:  # AMX: W dequantized into the tiles as the GEMM goes
            y = amx_gemm(self.packed, None, x.to(dt), self.bias)
            if y is not None:
                return y
        bias = None if self.bias is None else self.bias.to(dt)
        fp32 = dt == torch.float32
        return gemm_by_row_chunks(x.to(dt), self.out_features, bias=bias, weight_rows=lambda n0, n1:
                                  tiled_dequantize(self.packed, None, fp32=fp32, rows=(n0, n1)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        if self.layout == "tiled":
            y = self.kernel()(x.reshape(-1, self.in_features))
            return y.to(x.dtype).reshape(*shape[:-1], self.out_features)
        x2 = x.reshape(-1, self.in_features).to(torch.bfloat16).contiguous()
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, self.packed, self.group, self.scales_zeros)
        y = y.to(x.dtype).reshape(*shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias.to(y.dtype)
