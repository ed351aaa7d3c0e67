"""Linear modules that choose their weight format by step size, and the swap that installs them.

Prefill (many tokens per step) is compute-bound and wants dense fp32 GEMM; decode (one token per
sequence) is memory-bound and wants the fewest bytes per weight. `PhaseLinear` keeps the dense
weight under its HF name (`weight`) and a decode module beside it, and picks one by the number of
rows in the input: a kernel choice by shape, as llama.cpp makes between its GEMV and GEMM paths.

Projections that read the same input (q/k/v; gate/up) share one fused decode kernel: fewer, larger
matmuls per token (nano-vllm's packed modules, done here only on the decode copy so the dense
weights keep their HF names).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from tiered.hardware.cpu_gemm import linear
from tiered.quant.int4 import GROUP, Int4Linear, quantize_int4
from tiered.quant.int8 import Int8Linear, quantize_int8
from tiered.quant.kquant import KQUANT_KINDS

FUSED_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class CastLinear(nn.Module):
    """Dense linear whose weight is stored in another dtype (e.g. bf16) than the activations.

    x [..., K] -> [..., N] in x's dtype; computes in the weight's dtype. A bf16 weight on the CPU takes
    tiered's native bf16 kernel (kernels/linear.kernel_for: x rounded to bf16, fp32 accumulation, as
    the native decode step runs it) up to quant/experts.bf16_native_rows() rows, where torch's bf16
    GEMV read ~27 GB/s against the kernel's ~47 (2-core Zen 4): the path of projections a decode step
    runs as modules (DeepSeek's latent-attention layers, a routing hook's fallback). Past them, on a CPU
    without a bf16 GEMM, torch's fp32 GEMM over the weight converted for the call (hardware/cpu_gemm.linear):
    on 2 AVX2 cores SmolLM2's one-copy bf16 engine (`--decode-weights bf16`) had taken 5.8 s for a
    512-token prompt in torch's bf16 GEMM, 0.92-0.98 so.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.to(weight.dtype), requires_grad=False)
        self.__dict__["_native"] = None  # (kernel, rows) once looked up; False: none for this weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        native = self.__dict__["_native"]
        if native is None:
            native = self.__dict__["_native"] = self._native_kernel()
        if native and x.numel() // x.shape[-1] <= native[1] and x.device.type == "cpu":
            y = native[0](x.reshape(-1, x.shape[-1]))
            return y.to(x.dtype).reshape(*x.shape[:-1], y.shape[-1])
        return linear(x, self.weight, self.bias)

    def _native_kernel(self):
        """(native kernel, rows it takes) for a contiguous bf16 CPU weight with the extension built, else False."""
        w = self.weight
        if w.dtype != torch.bfloat16 or w.device.type != "cpu" or not w.is_contiguous():
            return False
        from tiered.kernels.linear import kernel_for
        from tiered.quant.experts import bf16_native_rows

        k = kernel_for(self)
        return (k, bf16_native_rows()) if k is not None else False


def dense_dtype(module: nn.Module, rows: int) -> torch.dtype | None:
    """The dtype `module`'s prompt path computes a call of `rows` rows in without a cast of its own (its
    `dense_dtype`: PhaseLinear, Slice, Int4Linear), or None (any other module: it computes in the
    activations' dtype, or says nothing)."""
    fn = getattr(module, "dense_dtype", None)
    return fn(rows) if fn is not None else None


class SharedOutput(nn.Module):
    """Runs a fused module once per input tensor and hands each member its column slice.

    The `members` of a fused group are called one after another with the same tensor object; the
    fused result is kept (with a reference to its input, so identity is sound) until every member
    has taken it, then dropped: a 512-token prefill's q/k/v and gate/up outputs would otherwise stay
    alive in every layer until the next step (~11 MB a layer on SmolLM2).
    """

    def __init__(self, fused: nn.Module, members: int) -> None:
        super().__init__()
        self.fused, self.members = fused, members
        self._input: torch.Tensor | None = None
        self._dense = False
        self._output: torch.Tensor | None = None
        self._taken = 0

    def __call__(self, x: torch.Tensor, dense: bool = False) -> torch.Tensor:  # no hook machinery: hot path
        """The fused result for x (dense: through the fused module's `dense` path, when it has one)."""
        d = self.__dict__  # plain attributes: nn.Module.__setattr__ costs ~1 ms per token here
        if x is not d["_input"] or dense is not d["_dense"]:
            d["_input"], d["_dense"], d["_output"], d["_taken"] = x, dense, self.compute(x, dense), 0
        out = d["_output"]
        d["_taken"] += 1
        if d["_taken"] == d["members"]:
            d["_input"] = d["_output"] = None
        return out

    def compute(self, x: torch.Tensor, dense: bool = False) -> torch.Tensor:
        """The fused module's output for x [..., K] -> [..., N] (its `dense` path with `dense`, where it has one),
        computed afresh and kept nowhere: what __call__ caches for the members, and fused_pair hands over whole."""
        return (getattr(self.fused, "dense", self.fused) if dense else self.fused)(x)


class Slice(nn.Module):
    """Columns [start, stop) of a SharedOutput's result. x [..., K] -> [..., stop - start]."""

    def __init__(self, shared: SharedOutput, start: int, stop: int) -> None:
        super().__init__()
        self.shared, self.start, self.stop = shared, start, stop

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.shared(x)[..., self.start:self.stop]

    def dense(self, x: torch.Tensor) -> torch.Tensor:
        """The same columns through the fused module's dense (prefill) path."""
        return self.shared(x, dense=True)[..., self.start:self.stop]

    def dense_dtype(self, rows: int) -> torch.dtype | None:
        """The fused module's dense_dtype (None where it has none)."""
        return dense_dtype(self.shared.fused, rows)


class PhaseLinear(nn.Module):
    """Dense `weight` [N, K] for steps with more than `threshold` rows, `decode` module otherwise.

    `weight` None: the decode module is the projection's one copy and serves every step, the
    engine's one-copy mode (Plan.dense_copies False); steps of more than `threshold` rows then take
    its `dense` path when it has one (a tiled Int4Linear dequantizes for one fp32 GEMM)."""

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, decode: nn.Module, threshold: int) -> None:
        super().__init__()
        self.weight = weight
        self.bias = bias
        self.decode = decode
        self.threshold = threshold

    def dense_dtype(self, rows: int) -> torch.dtype | None:
        """The dtype a step of `rows` rows computes this projection in when it takes the one copy's dense path
        (`decode` dense_dtype: a tiled Int4Linear past its kernel's rows dequantizes to bf16 on AVX-512);
        None for steps the decode module serves, a dense weight's GEMM, or a module without one."""
        if rows <= self.threshold or self.weight is not None:
            return None
        return dense_dtype(self.decode, rows)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() // x.shape[-1] <= self.threshold:
            return self.decode(x)
        if self.weight is not None:
            return linear(x, self.weight, self.bias)
        dense = getattr(self.decode, "dense", None)
        return self.decode(x) if dense is None else dense(x)


def fused_pair(first: nn.Module, second: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
    """[first(x) | second(x)] [..., N1 + N2] in one call, where both are PhaseLinears that compute x's rows as
    column slices of one SharedOutput's fused module, first's columns directly before second's and the two of
    them its whole output (install_decode_weights' gate/up group in the one-copy mode, and every mode's decode
    rows): the fused module's output itself (its `dense` path past the threshold, as Slice.dense takes it), not
    two slices of it. None otherwise (a dense weight of their own for these rows, other modules, other slices).
    MLP.forward hands it to layers.swiglu: one pass over [T, 2F] instead of SiLU and a product over two strided
    halves."""
    if type(first) is not PhaseLinear or type(second) is not PhaseLinear or first.threshold != second.threshold:
        return None
    dense = x.numel() // x.shape[-1] > first.threshold
    if dense and (first.weight is not None or second.weight is not None):
        return None
    a, b = first.decode, second.decode
    if type(a) is not Slice or type(b) is not Slice or a.shared is not b.shared or a.start != 0 or a.stop != b.start:
        return None
    if b.stop != getattr(a.shared.fused, "out_features", None):
        return None
    return a.shared.compute(x, dense)


@dataclass
class DecodeWeight:
    """One projection's decode-format weight before packing: int4 codes or a dense tensor."""

    kind: str  # "int4" | "int8" | "int8-g32" | "q6k" | "q5k" | "iq4xs" | "fp8" | "dense"
    # int32 [N, K] (int4), int8 [N, K] (int8), tiled uint8 [N, K] (int8-g32) or e4m3fn bits uint8 [N, K] (fp8)
    codes: torch.Tensor | None = None
    # fp32 [N, K/32] (int4), [N] (int8), fp16 [N/16, K/32, 16] (int8-g32) or fp32 [N/128, K/128] (fp8)
    scale: torch.Tensor | None = None
    zero: torch.Tensor | None = None  # fp32 [N, K/32] (int4)
    dense: torch.Tensor | None = None  # [N, K] (dense, int8 source)
    # int4 from a GGUF file: its Q4_0/Q4_1/Q4_K blocks uint8 [N, bytes per row], unpacked only if the
    # tiled layout's native repacking cannot take them (`int4_parts`); q6k / q5k: its Q6_K / Q5_K blocks
    blocks: np.ndarray | None = None
    block_format: str | None = None
    row_block: int | None = None  # fp8: rows per scale (quant/fp8.kernel_scales: 128, or 1 per channel)

    @property
    def rows(self) -> int:
        """N, the output features."""
        return next(t for t in (self.codes, self.blocks, self.dense) if t is not None).shape[0]

    def int4_parts(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(codes int32 [N, K], scale fp32 [N, K/32], zero fp32 [N, K/32]) of an int4 weight."""
        if self.codes is None:
            from tiered.quant.gguf_experts import unpack_int4_blocks

            return unpack_int4_blocks(self.blocks, self.block_format)
        return self.codes, self.scale, self.zero


# GGUF blocks "auto" keeps packed. Q4_K (a Q4_K_M file's main type) maps exactly onto int4 groups of 32
# (scale d*sc, zero 8*scale - dmin*m, each rounded to bf16 as Q4_1's are). Q6_K (a Q4_K_M file's head, and its
# attn_v and ffn_down in half the layers) and Q5_K (a Q5_K_M file's other tensors) stay as stored (quant/kquant:
# 6.5625 / 5.5 bits a weight) where tiered's kernels are built and the rows make whole tiles (else bf16); Q5_0 / Q5_1
# become int8 per group of 32
# (Int8G32Linear: their codes re-quantized, ~2^-8 of a group's max) where tiered's kernels are built, and
# Q8_0 (SmolLM2's embedding and head) too: its codes and fp16 scales per 32 as stored, bit for bit. Without
# the kernels or their tiles, Q8_0 falls back to per-row int8 (Int8Linear: re-quantized per row), the rest
# to bf16. The tiled Q8_0 head of SmolLM2 (49152 x 576) took 0.72 / 0.88 / 4.67 ms at 1 / 8 / 48 rows
# against 0.80 / 2.54 / 14.5 per row (2 AMX cores, 2026-12-05; batches on int8 activations, Plan.batch_act).
# IQ4_XS (a 16-value codebook of int8 values times a scale per 32) stays as stored (quant/kquant.IQ4XSLinear: its
# indices through a table in the kernels, 4.3 bits a weight) where the kernels are built and the rows make whole tiles
# (else bf16, as the k-quants); IQ4_NL (a scale per block of 32, rare) becomes int8-g32 from its codes and
# scales (native iq4_blocks_tiled: the weights exactly). Q2_K / Q3_K and the
# lattice i-quants (IQ1-IQ3: 1.6-3.4 bits a weight) become int4 re-quantized per 32 from their dequantized weights
# (0.625 bytes a weight, where bf16 copies held 2: a 70B's Q3_K_M file would have needed ~140 GB), as their experts do.
GGUF_DECODE_KIND = {"Q4_0": "int4", "Q4_1": "int4", "Q4_K": "int4", "Q8_0": "int8-g32",
                    "Q5_0": "int8-g32", "Q5_1": "int8-g32", "Q5_K": "q5k", "Q6_K": "q6k",
                    "IQ4_NL": "int8-g32", "IQ4_XS": "iq4xs", "Q2_K": "int4", "Q3_K": "int4",
                    **{f: "int4" for f in ("IQ3_XXS", "IQ3_S", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ1_S", "IQ1_M")}}


INT4_ROWS = 16  # int4 decode copies need N % 16 == 0: the tiled layout's tiles, torch's int4pack's rows


def auto_kind(handle) -> str:
    """The decode-copy precision "auto" gives a checkpoint tensor: GGUF_DECODE_KIND by its storage
    format ("bf16" for the rest), int8-g32 only where tiered's kernels are built and the shape takes
    their tiled layout (N % 16, K % 32; else bf16, and Q8_0 per-row int8); a scaled fp8 weight as stored where tiered's kernels
    are built and take its scales (quant/fp8.kernel_scales: 128 x 128 blocks with N % 128 == 0, so that
    fused groups stay whole blocks; or a scale per output channel or tensor)."""
    if handle.format == "INT4":  # GPTQ / AWQ / compressed-tensors 4-bit: as stored where groups of 32 hold it
        return "int4" if handle.int4_group and handle.int4_group % GROUP == 0 else "bf16"
    if handle.format == "INT8":  # GPTQ / compressed-tensors 8-bit: as stored per row, else re-quantized per row
        return "int8"
    if handle.format == "F8_E4M3":
        from tiered.kernels import load
        from tiered.quant.fp8 import BLOCK

        block = _fp8_kernel_block(handle)
        return "fp8" if block is not None and (block == 1 or handle.shape[0] % BLOCK == 0) and load() is not None \
            else "bf16"
    kind = GGUF_DECODE_KIND.get(handle.format, "bf16")
    if kind in KQUANT_KINDS:  # (their rows and the int8-g32 copies' need the same whole tiles)
        from tiered.quant.kquant import kquant_fits

        return kind if kquant_fits(handle.shape) else "bf16"
    if kind == "int8-g32" and not int8_g32_fits(handle.shape):
        return "int8" if handle.format == "Q8_0" else "bf16"
    return kind


def int8_g32_fits(shape) -> bool:
    """Whether a weight of `shape` [N, K] can take an int8-g32 decode copy (Int8G32Linear): tiered's
    kernels are built and the shape takes their tiled int8 layout (kernels/linear.int8_tiles: N % 16,
    K % 32)."""
    from tiered.kernels import load
    from tiered.kernels.linear import int8_tiles

    return len(shape) == 2 and int8_tiles(*shape) and load() is not None


def copy_kind(handle, fmt: str) -> str:
    """The precision of the decode copy `decode_weight` makes of checkpoint tensor `handle` under format
    `fmt` ("int4", "int8", "int8-g32", "fp8", "bf16" or "fp32"): what the planner prices and
    sizes.decode_copy_bytes counts, tensor by tensor.

    "auto": `auto_kind` (an int4 storage format on rows the int4 kernels do not take, N % 16, -> bf16).
    "int8": int8 per group of 32 in the tiled layout (int8-g32, Int8G32Linear: a GGUF Q8_0 tensor's
    blocks as stored, anything else re-quantized per 32 weights) where `int8_g32_fits`; per-row int8
    (Int8Linear) for other shapes, without tiered's kernels, and for a GPTQ / compressed-tensors int8
    checkpoint's codes (format "INT8": kept per row as stored). "int4": int4 where K % 32 == 0 and
    N % 16 == 0, else bf16. "bf16" / "fp32": themselves."""
    if fmt == "auto":
        kind = auto_kind(handle)
        return "bf16" if kind == "int4" and handle.shape[0] % INT4_ROWS else kind
    if fmt == "int8":
        return _int8_kind(handle.format, handle.shape)
    if fmt == "int4":
        N, K = handle.shape
        return "int4" if K % GROUP == 0 and N % INT4_ROWS == 0 else "bf16"
    return fmt


def _int8_kind(stored: str | None, shape) -> str:
    """"int8-g32" or "int8": `copy_kind`'s rule for format "int8" on a tensor stored as `stored` of `shape`."""
    return "int8-g32" if stored != "INT8" and int8_g32_fits(shape) else "int8"


def _fp8_kernel_block(handle) -> int | None:
    """The native fp8 kernel's row_block for an F8_E4M3 handle's scales (quant/fp8.kernel_row_block), or None."""
    from tiered.quant.fp8 import kernel_row_block

    return kernel_row_block(*handle.shape, handle.fp8_block)


def decode_weight(linear: nn.Linear, handle, fmt: str) -> DecodeWeight | None:
    """The decode representation of `linear` under format `fmt`, or None to keep the dense module.

    "auto": GGUF Q4_0/Q4_1/Q4_K blocks -> int4 as stored; GGUF Q8_0 -> int8 per group of 32 as stored
    (with tiered's kernels and their tiles; else per-row int8); GGUF Q5_K / Q6_K as stored (quant/kquant, with
    tiered's kernels), Q5_0 / Q5_1 -> int8 per group of 32 (with tiered's kernels); IQ4_XS as stored (quant/kquant),
    IQ4_NL -> int8 per group of 32 from its codebook values (with tiered's kernels); Q2_K / Q3_K / IQ1-IQ3 -> int4 re-quantized per
    32 (GGUF_DECODE_KIND); block-scaled fp8 -> fp8 as stored (with tiered's
    kernels, whole 128-row blocks); GPTQ / AWQ / compressed-tensors int4 -> int4 as stored (groups of a
    multiple of 32); their int8 -> per-row int8, as stored where symmetric per channel or tensor, else
    re-quantized per row (int8_note); others -> bf16.
    "int4": everything with K % 32 == 0 and N % INT4_ROWS == 0 -> int4 (GGUF Q4 blocks as stored; other
    shapes bf16: neither int4 layout takes them); "int8": int8 per group of 32, tiled (GGUF Q8_0 blocks
    as stored; the rest re-quantized), where `int8_g32_fits`, else per-row int8 (GPTQ int8 codes: per row
    as stored; `copy_kind` says which); "bf16"; "fp32".
    A module left on the meta device (one-copy mode) has its weight read from `handle` when the
    format needs the dense values (Q4 blocks are unpacked without dequantizing).
    """
    from tiered.quant.gguf_experts import INT4_BLOCK_FORMATS

    stored = handle.format if handle is not None else None
    kind = auto_kind(handle) if handle is not None else None
    if kind == "int4" and handle.shape[0] % INT4_ROWS:  # no int4 kernel takes the rows: dense below
        kind = "bf16"
    if fmt in ("auto", "int4") and kind == "int4" and handle.format == "INT4":  # GPTQ / AWQ codes as stored
        return DecodeWeight("int4", *handle.int4_parts(GROUP))
    if fmt in ("auto", "int8") and stored == "INT8":  # GPTQ / compressed-tensors int8
        if handle.int8_per_row:  # symmetric per row: the codes as stored
            return DecodeWeight("int8", *handle.int8_parts())
        if fmt == "auto":  # grouped or asymmetric: re-quantized per row (int8_note)
            return DecodeWeight("int8", *quantize_int8(weight_of(linear, handle)))
    if fmt in ("auto", "int4") and kind == "int4" and stored in INT4_BLOCK_FORMATS:  # GGUF Q4 blocks: int4 as stored
        return DecodeWeight("int4", blocks=handle.blocks(), block_format=stored)
    if fmt == "auto" and kind == "int4":  # Q2_K / Q3_K / the lattice i-quants: re-quantized per 32 (GGUF_DECODE_KIND)
        return DecodeWeight("int4", *quantize_int4(weight_of(linear, handle)))
    if fmt == "auto" and kind == "fp8":  # as stored
        from tiered.quant.fp8 import kernel_scales

        q, bs = handle.scaled_fp8()
        bs, row_block = kernel_scales(bs, *q.shape, handle.fp8_block)
        return DecodeWeight("fp8", q.view(torch.uint8), bs, row_block=row_block)
    if fmt == "auto" and kind in KQUANT_KINDS:  # Q6_K / Q5_K / IQ4_XS blocks as stored (build_decode_module repacks them)
        return DecodeWeight(kind, blocks=handle.blocks(), block_format=stored)
    if fmt == "auto" and kind == "int8":  # row chunks: no whole dense copy
        return DecodeWeight("int8", *quantize_int8_blocks(handle))
    if fmt == "int8" and _int8_kind(stored, tuple((linear.weight if handle is None else handle).shape)) == "int8-g32":
        kind = "int8-g32"  # (copy_kind's rule)
    if fmt in ("auto", "int8") and kind == "int8-g32":  # Q8_0 as stored, the rest re-quantized per group of 32, tiled
        from tiered.kernels import load
        from tiered.quant.gguf_experts import IQ4_FORMATS, raw_blocks
        from tiered.quant.int8 import tiled_int8_g32

        if stored == "Q8_0":  # the blocks' codes and scales, bit for bit (one native pass)
            return DecodeWeight("int8-g32", *load().q8_blocks_tiled(raw_blocks(handle)))
        if stored in IQ4_FORMATS:  # the codebook's int8 values and the scales per 32 (one native pass)
            return DecodeWeight("int8-g32", *load().iq4_blocks_tiled(raw_blocks(handle), stored == "IQ4_XS"))
        if stored == "Q6_K":  # one native pass, the same bytes as below (auto_kind: the extension is there);
            # not written into host_empty's huge pages as the int4 copies are: faulting them inside this
            # pass loaded the 8-layer Q4_K_M model 0.3-0.6 s slower than move_to_huge_pages' copy
            return DecodeWeight("int8-g32", *load().q6k_blocks_tiled(raw_blocks(handle)))
        return DecodeWeight("int8-g32", *tiled_int8_g32(weight_of(linear, handle)))
    w = weight_of(linear, handle)
    if fmt == "fp32":
        return None if w.dtype == torch.float32 else DecodeWeight("dense", dense=w.float())
    if fmt == "int4" and w.shape[1] % GROUP == 0 and w.shape[0] % INT4_ROWS == 0:
        return DecodeWeight("int4", *quantize_int4(w))
    if fmt == "int8":
        return DecodeWeight("int8", dense=w)
    if w.dtype == torch.bfloat16:
        return None
    return DecodeWeight("dense", dense=w.to(torch.bfloat16))


def quantize_int8_blocks(handle, rows: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row int8 (quant/int8.quantize_int8) of a block-quantized tensor, dequantized `rows` rows
    at a time so the whole fp32 matrix never exists (a 49k x 576 embedding would be 113 MB).
    Returns (q int8 [N, K], scale fp32 [N])."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    from tiered.quant.gguf_dequant import blocks_tensor, dequantize_blocks

    raw, (N, K) = handle.blocks(), handle.shape
    if handle.format == "Q8_0":
        from tiered.kernels import load

        ext = load()
        if ext is not None:  # one native pass a row, the same bytes as _q8_0_per_row
            return tuple(ext.q8_rows_int8(blocks_tensor(np.asarray(raw))))
    qtype = GGMLQuantizationType[handle.format]
    q, scale = torch.empty(N, K, dtype=torch.int8), torch.empty(N)
    for i in range(0, N, rows):
        chunk = np.asarray(raw[i:i + rows])
        if handle.format == "Q8_0":
            q[i:i + rows], scale[i:i + rows] = _q8_0_per_row(chunk, K)
            continue
        w = dequantize_blocks(chunk, handle.format)
        if w is None:
            w = torch.from_numpy(dequantize(chunk, qtype).reshape(-1, K))
        q[i:i + rows], scale[i:i + rows] = quantize_int8(w)
    return q, scale


def _q8_0_per_row(chunk: np.ndarray, K: int) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_int8 of Q8_0 blocks uint8 [n, K/32 * 34] (w = d q per 32), bit for bit, in fewer passes:
    each row's amax from its blocks' |d| max|q| (the products are exact in fp32), then w = q d divided,
    rounded and clamped in place. ~2x the dequantize-then-quantize path (an lm_head of 49152 x 2880:
    ~1.7 s from ~3.6 on 2 AVX2 cores) -> (q int8 [n, K], scale fp32 [n])."""
    from tiered.quant.gguf_dequant import blocks_tensor

    n = chunk.shape[0]
    b = blocks_tensor(chunk).reshape(n, K // 32, 34)  # read only: every write below is to new tensors
    d = b[..., :2].contiguous().view(torch.float16).float()  # (n, G, 1)
    codes = b[..., 2:].contiguous().view(torch.int8)  # (n, G, 32)
    qmax = torch.maximum(codes.amax(-1).to(torch.int16), -codes.amin(-1).to(torch.int16))  # (n, G): max |q|
    scale = ((d[..., 0].abs() * qmax.float()).amax(1) / 127).clamp_min(1e-12)  # (n,)
    w = codes.float().mul_(d).view(n, K)
    return w.div_(scale[:, None]).round_().clamp_(-127, 127).to(torch.int8), scale


def _check_tensor(name: str, handle, shape) -> None:
    from tiered.errors import CheckpointError

    if handle is None:
        raise CheckpointError(f"checkpoint lacks tensor {name!r}", "the checkpoint is incomplete or does not match its config")
    if tuple(handle.shape) != tuple(shape):
        raise CheckpointError(f"tensor {name!r} has shape {tuple(handle.shape)}, config implies {tuple(shape)}",
                              "the checkpoint does not match its config")


def weight_of(linear: nn.Linear, handle) -> torch.Tensor:
    """linear's dense weight [N, K]: its own, or read from `handle` in the stored dtype (block
    formats dequantized to fp32) when the module holds none (left on the meta device)."""
    if not linear.weight.is_meta:
        return linear.weight.detach()
    if handle is None:
        raise ValueError("a meta-device linear needs its checkpoint tensor")
    return handle.load(None)


def _decode_counts(checkpoint, fmt: str) -> dict[str, int]:
    """Elements of the decoder layers' projections by the precision `fmt` gives their decode copies
    (`copy_kind`). Routed
    experts (".experts." in the name) take no decode copies (the plan prices them in their own format):
    counted, gpt-oss's MXFP4 experts ("bf16" here) made 97% of its Q8_0 file's layers bf16 and the plan
    priced its int8 attention at twice its bytes (decode 37.6 tok/s against 45.8-52.6 measured)."""
    count: dict[str, int] = {}
    for name in checkpoint.names():
        if ".layers." in name and name.endswith("_proj.weight") and ".experts." not in name:
            h = checkpoint.handle(name)
            kind = copy_kind(h, fmt)
            count[kind] = count.get(kind, 0) + h.numel
    return count


def int8_note(checkpoint, fmt: str) -> str | None:
    """The plan's line on 8-bit integer checkpoint weights (format "INT8") that `fmt`'s decode copies
    re-quantize ("auto" or "int8": grouped or asymmetric ones, per row), or None when there are none."""
    if fmt not in ("auto", "int8"):
        return None
    handles = [checkpoint.handle(n) for n in checkpoint.names() if ".experts." not in n]  # routed: no copies
    lossy = sum(1 for h in handles if h.format == "INT8" and not h.int8_per_row)
    if not lossy:
        return None
    return (f"decode copies of {lossy} grouped or asymmetric int8 checkpoint weights re-quantized per row "
            "(symmetric int8 per channel, as tiered's copies hold it, is kept as stored)")


def decode_precision(checkpoint, fmt: str) -> str:
    """The precision most decode-path weight bytes will have under format `fmt` (for the planner):
    "fp32", "bf16", "int8", "int8-g32", "fp8" or "int4": the decoder layers' matrices' `copy_kind`,
    weighted by elements ("auto" follows their storage format: GGUF Q4_0/Q4_1/Q4_K -> int4, Q8_0, Q5_x
    and Q6_K -> int8-g32, block-scaled fp8 -> fp8, anything else -> bf16; "int8" is int8-g32 where
    tiered's kernels take the shapes)."""
    if fmt in ("fp32", "bf16"):
        return fmt
    count = _decode_counts(checkpoint, fmt)
    return max(count, key=count.get) if count else ("bf16" if fmt == "auto" else fmt)


def decode_mix(checkpoint, fmt: str) -> dict[str, float] | None:
    """Shares of the decoder layers' projection elements by decode-copy precision (`copy_kind`) when
    `fmt` gives them more than one (Plan.precision_mix, which the CPU decode prediction prices): a
    Q4_K_M file's Q6_K attn_v and ffn_down (half its layers) keep bf16 copies beside its int4 ones, ~17%
    of the elements and ~40% of the bytes. None when one precision holds them all."""
    count = _decode_counts(checkpoint, fmt) if fmt not in ("fp32", "bf16") else {}
    if len(count) < 2:
        return None
    total = sum(count.values())
    return {k: n / total for k, n in sorted(count.items())}


def head_precision(checkpoint, fmt: str) -> str:
    """The lm_head's decode-copy precision under format `fmt` (for the planner), as
    install_decode_weights makes it: the head's (the token embedding's when tied) `copy_kind`; for
    "auto" by its storage format (GGUF_DECODE_KIND: GGUF Q4_0/Q4_1/Q4_K -> int4, Q8_0 / Q5_0 / Q5_1 / IQ4_NL ->
    int8-g32, Q5_K / Q6_K / IQ4_XS as stored, ...), anything else -> bf16. A
    GGUF Q4 file often stores its embedding as Q8_0, so its head reads twice the bytes per weight
    of its layers (SmolLM2's Q4_1 file: a 30 MB int8-g32 head beside ~70 MB of int4 layers)."""
    if fmt in ("fp32", "bf16"):
        return fmt
    key = "lm_head.weight" if checkpoint.has("lm_head.weight") else "model.embed_tokens.weight"
    if not checkpoint.has(key):
        return "bf16" if fmt == "auto" else fmt
    return copy_kind(checkpoint.handle(key), fmt)


def _tiled_from_blocks(parts: list[DecodeWeight], bias: torch.Tensor | None, batch_act: str) -> Int4Linear | None:
    """int4 `parts` that are all GGUF blocks of one format (Q4_0, Q4_1 or Q4_K), repacked natively into
    the tiled layout, each part into its own whole tiles of one weight (rows side by side): the same
    bytes as unpacking (unpack_q4_blocks, unpack_q4k_blocks) then Int4Linear.from_codes (tested), and
    SmolLM2's 210 projections take ~0.1 s instead of ~0.5 s of its load. None when the blocks, the
    shape (`tiled_fits`, whole tiles per part) or the native extension do not allow it."""
    from tiered.checkpoint.handle import BLOCK_FORMATS
    from tiered.hardware.budget import host_empty
    from tiered.kernels import load
    from tiered.kernels.linear import inline_scales
    from tiered.quant.gguf_dequant import blocks_tensor
    from tiered.quant.int4 import tiled_fits

    fmts = {p.block_format for p in parts}
    if any(p.blocks is None for p in parts) or len(fmts) != 1:
        return None
    per, block = BLOCK_FORMATS[fmts.pop()]  # weights and bytes per block
    rows = [p.blocks.shape[0] for p in parts]
    N, K = sum(rows), parts[0].blocks.shape[1] // block * per
    ext = load() if tiled_fits(N, K) and all(n % 16 == 0 for n in rows) else None
    if ext is None:
        return None
    # written straight into huge pages when large (budget.host_empty): move_to_huge_pages then leaves
    # it where it is instead of copying it into its arena. A fused group's parts go to their own whole
    # tiles of it, one call each, with no concatenated copy of their blocks (0.6 s of the 8-layer
    # Q4_K_M model's load)
    gw = host_empty((N // 16, K // GROUP, 320), torch.uint8)
    t = 0
    for p, n in zip(parts, rows):  # the zero residual is dropped
        ext.q4_blocks_tiled(blocks_tensor(p.blocks), block, inline_sz=True, inline_out=gw[t:t + n // 16])
        t += n // 16
    return Int4Linear(gw, inline_scales(gw), K, N, GROUP, bias, "tiled", batch_act)


def build_decode_module(parts: list[DecodeWeight], biases: list[torch.Tensor | None], int4_layout: str = "cpu",
                        batch_act: str = "bf16") -> nn.Module:
    """One decode module computing all `parts` side by side (outputs concatenated on the last dim);
    int4 parts in `int4_layout` with `batch_act` activations for calls of several rows (Int4Linear), int8-g32
    ones with it too (Int8G32Linear)."""
    bias = None if all(b is None for b in biases) else torch.cat(
        [b.detach().float() if b is not None else torch.zeros(p.rows) for p, b in zip(parts, biases)])
    kind = parts[0].kind
    if kind == "int4":
        tiled = _tiled_from_blocks(parts, bias, batch_act) if int4_layout == "tiled" else None
        if tiled is not None:
            return tiled
        codes, scale, zero = zip(*(p.int4_parts() for p in parts))
        return Int4Linear.from_codes(torch.cat(codes), torch.cat(scale), torch.cat(zero), GROUP, bias, int4_layout,
                                     batch_act)
    if kind == "fp8":  # rows side by side: each part whole 128-row blocks (auto_kind) or a scale per row
        from tiered.quant.fp8 import Fp8Linear

        return Fp8Linear(torch.cat([p.codes for p in parts]), torch.cat([p.scale for p in parts]), bias,
                         parts[0].row_block)
    if kind in KQUANT_KINDS:  # k-quant blocks, each part's rows whole 16-row tiles (auto_kind)
        from tiered.quant.kquant import LINEAR_OF_KIND

        return LINEAR_OF_KIND[kind].from_blocks([p.blocks for p in parts], bias, batch_act)
    if kind == "int8-g32":  # tiled rows side by side: each part's tiles are whole 16-row tiles
        from tiered.quant.int8 import Int8G32Linear

        return Int8G32Linear(torch.cat([p.codes for p in parts]), torch.cat([p.scale for p in parts]), bias, batch_act)
    if kind == "int8" and all(p.codes is not None for p in parts):
        return Int8Linear(torch.cat([p.codes for p in parts]), torch.cat([p.scale for p in parts]), bias)
    if kind == "int8":  # mixed or dense sources: quantize the dense values
        return Int8Linear.from_dense(torch.cat([p.dense if p.dense is not None else p.codes.float() * p.scale[:, None]
                                                for p in parts]), bias)
    w = torch.cat([p.dense for p in parts])
    return CastLinear(w, bias)


def _module_bytes(m: nn.Module) -> int:
    """Bytes `m`'s parameters and buffers hold, each byte once: the union of their memory spans (the
    tiled int4 layout's scales_zeros is a view into its packed tiles; counted per tensor, its decode
    copies were 0.75 B a weight where they hold 0.625)."""
    spans = sorted((t.data_ptr(), t.data_ptr() + _span(t)) for t in list(m.parameters()) + list(m.buffers())
                   if t.numel())
    total, end = 0, 0
    for a, b in spans:
        total += max(0, b - max(a, end))
        end = max(end, b)
    return total


def _span(t: torch.Tensor) -> int:
    """Bytes from t's first element to just past its last (its strides' reach)."""
    return (1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))) * t.element_size()


def install_decode_weights(model: nn.Module, checkpoint, fmt: str, threshold: int, *, dense: bool = True,
                           skip=None, int4_layout: str = "cpu", batch_act: str = "bf16") -> int:
    """Swap the nn.Linear layers of `model` for PhaseLinears carrying decode-format copies.

    Args:
        model: a loaded model with HF parameter names.
        checkpoint: where the weights came from (its storage formats drive "auto").
        fmt: decode weight format (EngineConfig.decode_weights).
        threshold: largest number of rows that takes the decode path.
        dense: the dense weights were loaded and stay (prefill runs on them). False (one-copy
            mode): the projections were left on the meta device, each gets its decode copy from
            the checkpoint (one projection's dense values at a time, at most) and that copy serves
            every step.
        skip: parameter names that stay off the model (routed experts): never given a copy.
        int4_layout, batch_act: the int4 copies' layout and batched activations (Int4Linear).
    Returns:
        Bytes held by the decode copies.
    """
    extra = 0
    for mod_name, module in list(model.named_modules()):
        linears = {}
        for n, c in module.named_children():
            name = f"{mod_name}.{n}.weight" if mod_name else f"{n}.weight"
            # experts served by the runtime stay on the meta device: nothing to copy
            if type(c) is nn.Linear and not (c.weight.is_meta and (dense or (skip is not None and skip(name)))):
                linears[n] = c
        if not linears:
            continue
        prepared = {}
        for name, lin in linears.items():
            key = f"{mod_name}.{name}.weight" if mod_name else f"{name}.weight"
            if key == "lm_head.weight" and not checkpoint.has(key):
                key = "model.embed_tokens.weight"  # tied embeddings
            handle = checkpoint.handle(key) if checkpoint.has(key) else None
            if lin.weight.is_meta:  # one-copy mode: materialize's checks, made here
                _check_tensor(key, handle, lin.weight.shape)
            prepared[name] = decode_weight(lin, handle, fmt)
            if prepared[name] is None and not dense:  # no lossy copy asked for: its own weight is the copy
                prepared[name] = DecodeWeight("dense", dense=weight_of(lin, handle))
        done = set()
        for group in FUSED_GROUPS:
            parts = [prepared.get(n) for n in group]
            if any(p is None for p in parts) or len({p.kind for p in parts}) != 1 or \
                    len({linears[n].in_features for n in group}) != 1 or \
                    len({(p.row_block, None if p.scale is None else p.scale.shape[1:]) for p in parts}) != 1:
                continue  # (fp8 parts fuse when scaled alike: all 128-row blocks, or all per channel)
            shared = SharedOutput(build_decode_module(parts, [linears[n].bias for n in group], int4_layout, batch_act),
                                  len(group))
            extra += _module_bytes(shared.fused)
            start = 0
            for n in group:
                stop = start + linears[n].out_features
                setattr(module, n, PhaseLinear(linears[n].weight if dense else None, linears[n].bias,
                                               Slice(shared, start, stop), threshold))
                start = stop
                done.add(n)
        for name, part in prepared.items():
            if name in done or part is None:
                continue
            dec = build_decode_module([part], [linears[name].bias], int4_layout, batch_act)
            extra += _module_bytes(dec)
            setattr(module, name, PhaseLinear(linears[name].weight if dense else None, linears[name].bias, dec,
                                              threshold))
        if not dense:  # one copy: the file pages and temporaries of this module's weights go back now,
            from tiered.memory.host import release_load_memory  # so the load's peak is the copies, not copies + file

            release_load_memory(checkpoint)
    return extra

