# F = expert intermediate, D = hidden, n = tokens routed to the expert, G = groups per row
"""Expert weight formats: one routed SwiGLU expert (gate, up [F, D]; down [D, F]) stored as a flat
byte buffer in bf16 / fp32, int8 (per-row or group-32 scales) or int4 (group 32), and computed
directly from that form.

An `ExpertFormat` is the contract every tier shares: a quantized expert is ONE contiguous uint8
tensor of `nbytes` (segments 64-byte aligned), so the disk store can pread it into a preallocated
slot, the cache can hold it in fixed slots and an H2D copy moves it as is. Dense formats keep the
three weight tensors as before (`slot_shapes` gives the tensors of either kind).

Projection kinds (what each of gate / up / down is stored as):

    kind      segments (per projection [N, K])                       bytes/weight  CPU kernel (torch; native below)
    bf16      w bf16 [N, K]                                          2             F.linear
    int8      q int8 [N, K], scale bf16 [N]       (w = q * s)        1 + 2/K       aten._weight_int8pack_mm
    int8-g32  q int8 [N, K], scale fp16 [N, K/32] (w = q * s_g)      1.0625        dequantize-then-matmul
    int4      codes 4 bit [N, K/2] u8, scale+zero bf16 [K/32, N, 2], 0.6875        aten._weight_int4pack_mm_for_cpu
              zero residual bf16 [K/32, N]                                         + a [n, K/32] x [K/32, N] GEMM
              (w = (q - 8) * s_g + z_g, FlexGen-style group-wise asymmetric, ALGORITHMS.md §4)
    fp8       q e4m3fn bits u8 [N, K], bs fp32 [N/128, K/128] (ceil)  ~1.0001       dequantize-then-matmul
              (w = e4m3(q) * s_block: DeepSeek-V3's / Qwen3-FP8's checkpoints as stored, quant/fp8.py)
    fp8-row   q e4m3fn bits u8 [N, K], s fp32 [N]                    1 + 4/K       dequantize-then-matmul
              (w = e4m3(q) * s_row: compressed-tensors' / fbgemm's per-channel FP8 as stored; a
              per-tensor scale repeated per row)
    mxfp4     tiled: e2m1 codes 4 bit + (scale, 0) bf16 per 32 inline  0.625        dequantize-then-matmul
              (w = (E2M1_U[q] - 12) * s_g: gpt-oss's MXFP4 experts as stored, bit for bit; no
              residual segment; other layouts plain codes and sz; quant/mxfp4.py)
    q6k       qt uint8 [N/16, K/32, 384], sc int8 [N/16, K/16, 16],   0.8203       tiered's native kernels only
              d fp16 [N/16, K/256, 16]  (w = d sc (u - 32): a GGUF file's Q6_K experts as stored, bit for bit)
    q5k       qt uint8 [N/16, K/32, 320], sm uint8 [N/16, K/32, 2, 16], 0.7031     (the host layout: no CUDA
              dd fp16 [N/16, K/256, 2, 16]  (w = d sc u - dmin m: Q5_K as stored)                kernel reads them)
    iq4xs     qt uint8 [N/16, K/32, 256], sc int8 [N/16, K/32, 16],   0.5391
              d fp16 [N/16, K/256, 16]  (w = d (ls - 32) kvalues_iq4nl[i]: IQ4_XS as stored; quant/kquant.py)

The int4 kernels take the zero in bf16; rounding it shifts all 32 weights of a group the same way
(|z| ~ 8 s, so up to s/64 each, a bias that adds up in a dot product). The residual z - bf16(z) is
kept too and added as group sums of x times the residual: the zero is then good to ~2^-16, and the
only rounding left is the scale's (multiplicative, up to |q - 8| * s * 2^-9). GGUF Q4_1/Q4_K zeros
(m + 8d, 8*d*sc - dmin*m) survive that way.

int4 has two code layouts: "cpu" is torch's packed layout for `_weight_int4pack_mm_for_cpu`
(computed from as stored: used whenever the experts are computed on the host), "plain" is two
codes per byte, even column in the low nibble (portable: a CUDA device converts it with
`aten._convert_weight_to_int4pack` after the copy; the CPU converts it per call). On CUDA, int8
per-row uses `_weight_int8pack_mm` when this torch build has it; every other case, and any kernel
that refuses its shapes, falls back to dequantize-then-matmul in the activation dtype.

The "tiled" layout (the host's when tiered/kernels is built) puts 16 output rows side by side, one
SIMD lane per row, for tiered's native kernels: int4 codes as `kernels.linear.tiled_codes`, and int8
projections with N % 16 == 0 and K % 32 == 0 as qt uint8 [N, K] = q + 128 in 16-row tiles of 4
columns (`kernels.linear.tiled_int8`; w = (qt - 128) * s), other int8 shapes per row; int8-g32 the
same qt with st fp16 [N/16, K/32, 16] (`tiled_group_scales`). With the extension built, every kind
but fp32 computes through tiered's native kernels on the CPU (`native`). Their int4 projections
multiply activations rounded per group of 32: to int8 (`act` / `batch_act` "q8", llama.cpp's
Q4_0 x Q8_0; the plan's default for routed experts, Plan.expert_act) or to bf16 / int16 ("bf16");
int8 projections read int16 activations. mxfp4 projections run the tiled int4 kernels with their codes
through a table, always on int8 activations (quant/mxfp4.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

import torch
import torch.nn.functional as F

from tiered import kernels
from tiered.errors import ConfigError
from tiered.hardware.cpu_gemm import linear
from tiered.kernels.linear import int8_tiles, tiled_group_scales, tiled_int8, untiled_group_scales, untiled_int8
from tiered.models.moe import expert_forward
from tiered.quant import fp8, mxfp4
from tiered.quant.int4 import GROUP
from tiered.quant.int8 import int8pack_mm
from tiered.quant.kquant import KQUANT_KINDS, LINEAR_OF_KIND

# KQUANT_KINDS: a GGUF file's Q6_K / Q5_K / IQ4_XS experts as stored (quant/kquant.py's layouts): tiered's native
# CPU kernels only
KINDS = ("fp32", "bf16", "int8", "int8-g32", "int4", "fp8", "fp8-row", "mxfp4", *KQUANT_KINDS)
FP8_KINDS = ("fp8", "fp8-row")
DENSE = {"fp32": torch.float32, "bf16": torch.bfloat16}
ALIGN = 64  # bytes: every segment starts on a cache line (and any dtype's alignment)
NATIVE_ROWS = 8  # tokens up to which a CPU expert runs the native fused GEMV kernel (a batch-1..8 kernel)
# Tokens up to which a CPU expert runs that kernel in groups of NATIVE_ROWS (its weights read once a
# group) rather than dequantized once for one matmul, by kind. Measured on 2 AVX2 cores, a
# Qwen3-30B-A3B expert (2048 x 768), ms at 16 / 64 / 256 rows, groups vs dequantize + matmul:
# int4 1.3 / 6.1 / 24.5 vs 5.0 / 8.3 / 22.3; int8 1.4 / 6.3 / 25.9 vs 2.6 / 10.5 / 40.4; bf16
# 2.4 / 9.4 / 39.5 vs 4.4 / 7.6 / 20.1 (torch's bf16 GEMM reads the weight once).
# mxfp4: its native kernel in one call (q8 activations, as llama.cpp computes MXFP4 at every size): a
# gpt-oss-20b expert projection (2880 x 2912) on 2 AVX2 cores, ms at 16 / 64 / 128 / 512 rows, one call 1.5 /
# 5.9 / 7.9 / 52 against dequantized once + an fp32 matmul 6.7 / 15 / 25 / 85 (a bf16 one 15 / 53 / 105 / -);
# the prompt's projections had taken the dequantizing path from 9 rows: a 128-token prompt 4.2 s, 2.3x llama.cpp's.
GROUPED_ROWS = {"int4": 128, "int8": 1 << 30, "int8-g32": 1 << 30, "bf16": 32, "fp32": 0, "fp8": 64, "fp8-row": 64,
                "mxfp4": 512, "q6k": 1 << 30, "q5k": 1 << 30, "iq4xs": 1 << 30}
# ... except on AVX-512 (kernels.isa(): with AVX512_BF16), where an mxfp4 projection of more rows than this is
# dequantized to bf16 for oneDNN's GEMM (quant/int4.dequantize_dtype, as a one-copy int4 weight's prompt):
# the same 2880 x 2912 projection on 2 Sapphire Rapids cores (AMX), 2026-11-29, ms at 32 / 64 / 128 / 512 rows
# (fastest of 5), the kernel 4.1 / 8.4 / 17.8 / 69 against bf16 dequantize + GEMM 5.3 / 8.2 / 8.0 / 16.2 (fp32:
# 10.4 / 13.7 / 21.3 / 64). Zen 4 (AVX512_BF16 without AMX) put one-copy int4's crossing at 96 rows. Since the
# kernel's AVX-512 form (2026-11-29, until then MXFP4 ran its AVX2 kernel there), ms at 32 / 64 / 128 / 256 rows
# (medians of 5 over 8 copies): the kernel 1.25 / 2.58 / 4.92 / 9.67 (AVX2 form 2.5 / 4.8 / 9.6 / 19.7), bf16
# dequantize + GEMM 2.9 / 3.2 / 3.7 / 4.9: crossing near 90 rows.
# On 2 Zen 5 cores (AVX-512 BF16, no AMX; 2026-12-01), a 2880 x 2880 projection, ms at 32 / 64 / 128 / 256 / 512
# rows: the kernel 0.59 / 1.19 / 2.31 / 4.65 / 9.03 against bf16 dequantize + GEMM 2.31 / 3.10 / 4.09 / 6.33 / 10.7:
# past 96 rows this table made a gpt-oss prompt's experts 1.2-1.8x slower there, so the kernel tuning measures
# the crossing (kernels/tune.py's mxfp4_kernel_rows); this table holds where the tuning has not.
MXFP4_KERNEL_ROWS = {"avx512": 96}
# ... and on int8 activations (batch_act "q8", the default) where the ISA is named here: on AVX2 a tiled int4
# expert's groups beat dequantizing it for one fp32 matmul at every row count: a Qwen3-30B-A3B expert (2048 x
# 768) on 2 Zen 3 cores, 2026-11-30, ms at 64 / 128 / 256 / 512 rows, groups 2.8 / 5.4 / 10.5 / 20.4 against
# 8.6 / 12.5 / 19.9 / 33.4 (the table above was measured on bf16 activations).
# On AVX-512 the crossing depends on the CPU (AMX's bf16 GEMM or not), so the kernel tuning measures it for int4
# (kernels/tune.py's q8_expert_grouped_rows): 2 Zen 5 cores (2026-12-01), the same expert (exact zeros, a Q4_0
# file's), ms at 64 / 128 / 256 / 512 rows, groups 0.70 / 1.34 / 2.66 / 5.53 against 1.27 / 1.99 / 3.13 / 5.97
# for bf16 dequantize + oneDNN's GEMM, where GROUPED_ROWS' 128 dequantized from 129 rows.
GROUPED_ROWS_Q8 = {"avx2": {"int4": 1 << 30}}


def kind_grouped_rows(kind: str, isa: str | None = None, batch_act: str = "bf16", tuning: dict | None = None) -> int:
    """Rows up to which a CPU expert's `kind` projections run the native kernel in groups of NATIVE_ROWS:
    on int8 activations (`batch_act` "q8") an int4 kind's from the kernel tuning's q8_expert_grouped_rows where it
    has one (kernels/tune.py; 0: at any rows), else GROUPED_ROWS_Q8's for the native kernels' ISA; else
    GROUPED_ROWS's. `isa` and `tuning` None: this machine's (kernels.isa, kernels.tuning); the planner passes
    a profiled machine's."""
    isa, tuned = kernels.tuned_choice("q8_expert_grouped_rows", isa, tuning)
    if batch_act == "q8":
        if kind == "int4" and tuned is not None:
            return int(tuned) or 1 << 30
        q8 = GROUPED_ROWS_Q8.get(isa, {})
        if kind in q8:
            return q8[kind]
    return GROUPED_ROWS[kind]


def mxfp4_kernel_rows(isa: str | None = None, tuning: dict | None = None) -> int:
    """Rows up to which an mxfp4 projection runs its native kernel in one call (q8 activations): the kernel
    tuning's mxfp4_kernel_rows where it has one (kernels/tune.py; 0: at any rows), else MXFP4_KERNEL_ROWS's for
    the native kernels' ISA, else GROUPED_ROWS's; more rows dequantize it for one GEMM. `isa` and `tuning` None:
    this machine's (kernels.isa, kernels.tuning); the planner passes a profiled machine's."""
    isa, tuned = kernels.tuned_choice("mxfp4_kernel_rows", isa, tuning)
    if tuned is not None:
        return int(tuned) or 1 << 30
    return MXFP4_KERNEL_ROWS.get(isa, GROUPED_ROWS["mxfp4"])


def prompt_rows(kind: str, isa: str | None, biased: bool = False, batch_act: str = "bf16",
                tuning: dict | None = None) -> tuple[int, int]:
    """(one_call, grouped): the rows up to which a CPU expert's `kind` projections run the native kernels in
    one call, and up to which in groups of NATIVE_ROWS (each group a call, its weights read once a group; 0:
    never); more rows dequantize each projection once for one GEMM. ExpertFormat.forward's choice (mxfp4:
    `_tiled_int4`'s), for the planner's prompt prices (planner/cpu_predict.prompt_expert_time); `isa`: the
    native kernels' on the priced machine. `biased`: gpt-oss's experts (swiglu_limit), never in row groups:
    up to one_call rows in one native call (ExpertFormat.biased_rows reads it from here), past them
    projection by projection (`project`'s own rows). `batch_act`: the rows' activations, `tuning`: the priced
    machine's kernel tuning (kind_grouped_rows)."""
    if kind == "mxfp4":
        return mxfp4_kernel_rows(isa, tuning), 0
    if biased:  # `project`: int8 kinds' kernels at any rows, fp8's up to GROUPED_ROWS, tiled int4's up to NATIVE_ROWS
        return (NATIVE_ROWS if kind == "int4" else GROUPED_ROWS[kind]), 0
    return NATIVE_ROWS, kind_grouped_rows(kind, isa, batch_act, tuning)


def bf16_native_rows() -> int:
    """Rows up to which bf16 weights (an expert, a sliced FFN's CC rows, a split's CPU rows) take the
    native fused kernel in one call: NATIVE_ROWS, or fewer where this machine's kernel tuning found
    torch's GEMMs faster (kernels.bf16_native_rows)."""
    from tiered import kernels

    return min(NATIVE_ROWS, kernels.bf16_native_rows())


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


LAYOUTS = ("cpu", "plain", "tiled")


def int8_tiled(layout: str, N: int, K: int) -> bool:
    """Whether an int8 / int8-g32 projection [N, K] of a format in `layout` is stored tiled (qt):
    the tiled layout, and a shape `kernels.linear.int8_tiles` accepts (else per row, q)."""
    return layout == "tiled" and int8_tiles(N, K)


def _segments(kind: str, N: int, K: int, int4_layout: str = "cpu") -> list[tuple[str, tuple, torch.dtype]]:
    """(field, shape, dtype) of one [N, K] projection stored as `kind` (int4: in `int4_layout`)."""
    if kind in DENSE:
        return [("w", (N, K), DENSE[kind])]
    if kind == "int8" and int8_tiled(int4_layout, N, K):  # 16-row tiles, +128 (kernels/linear.py)
        return [("qt", (N, K), torch.uint8), ("scale", (N,), torch.bfloat16)]
    if kind == "int8":
        return [("q", (N, K), torch.int8), ("scale", (N,), torch.bfloat16)]
    if kind == "int8-g32" and int8_tiled(int4_layout, N, K):
        return [("qt", (N, K), torch.uint8), ("st", (N // 16, K // GROUP, 16), torch.float16)]
    if kind == "int8-g32":
        return [("q", (N, K), torch.int8), ("scale", (N, K // GROUP), torch.float16)]
    if kind == "int4" and int4_layout == "tiled":  # each group-tile's codes then scales (tiled_inline), residuals
        return [("gw", (N // 16, K // GROUP, 320), torch.uint8), ("zr", (N // 16, K // GROUP, 16), torch.bfloat16)]
    if kind == "int4":
        return [("codes", (N, K // 2), torch.uint8), ("sz", (K // GROUP, N, 2), torch.bfloat16),
                ("zr", (K // GROUP, N), torch.bfloat16)]
    if kind == "fp8":  # any layout: the native kernel reads rows as stored
        return [("q", (N, K), torch.uint8), ("bs", fp8.scale_shape(N, K), torch.float32)]
    if kind == "fp8-row":  # the kernel's row_block 1, one scale across the columns
        return [("q", (N, K), torch.uint8), ("bs", (N, 1), torch.float32)]
    if kind == "mxfp4" and int4_layout == "tiled":  # tiled int4 with its scales inline, no residual (quant/mxfp4.py)
        return [("gw", (N // 16, K // GROUP, 320), torch.uint8)]
    if kind == "mxfp4":  # plain codes, (scale, 0) pairs: dequantized in torch
        return [("codes", (N, K // 2), torch.uint8), ("sz", (K // GROUP, N, 2), torch.bfloat16)]
    if kind in KQUANT_KINDS:  # quant/kquant's layout, 16-row tiles (validated by ExpertFormat: N % 16, K % 256)
        cls = LINEAR_OF_KIND[kind]
        return [(f, shape, dt) for f, (shape, dt) in zip(cls.PARTS, cls.layout(N // 16, K))]
    raise ConfigError(f"unknown expert format {kind!r}", "use " + ", ".join(KINDS))


def parse_kinds(name: str) -> tuple[str, str, str]:
    """Kinds of (gate, up, down) in a format name: "int4" (all three) or "int4,int4,int8".

    Raises:
        ConfigError: an unknown kind or not 1 / 3 entries.
    """
    kinds = tuple(name.split(","))
    if len(kinds) == 1:
        kinds = kinds * 3
    if len(kinds) != 3 or any(k not in KINDS for k in kinds):
        raise ConfigError(f"unknown expert format {name!r}", "use one of " + ", ".join(KINDS)
                          + " or three comma-separated kinds (gate,up,down)")
    return kinds  # type: ignore[return-value]


def fit_format(name: str, shapes) -> str:
    """`name` with each projection the format cannot hold replaced by the nearest kind that can:
    grouped kinds (int4, int8-g32, mxfp4) need in-features % 32 == 0 and fall back to per-row int8; the
    CPU and tiled int4 layouts also need out-features % 16 == 0 (so it is asked of every int4 and
    mxfp4: an mxfp4 projection with in-features % 32 == 0 falls back to int8-g32, which holds MXFP4
    exactly too); the k-quant kinds (q6k, q5k, iq4xs) need out-features % 16 and in-features % 256 and fall
    back to int8-g32 (then int8 as above). llama.cpp's converter does the same for block types (it writes such
    tensors in another type)."""
    kinds = []
    for kind, (N, K) in zip(parse_kinds(name), shapes):
        if kind in KQUANT_KINDS and (N % 16 or K % 256):
            kind = "int8-g32"
        if kind == "mxfp4" and N % 16 and not K % GROUP:
            kind = "int8-g32"
        if kind in ("int4", "int8-g32", "mxfp4") and (K % GROUP or (kind in ("int4", "mxfp4") and N % 16)):
            kind = "int8"
        kinds.append(kind)
    return format_name(kinds)


def pricing_precision(name: str) -> str:
    """The precision the planner's cost models price a format in (hardware profiles have rows for
    fp32, bf16, int8 and int4): the kind holding the most bytes, int8-g32 priced as int8, mxfp4 as int4
    (the tiled int4 kernels; on int8 activations: hardware/op_time.gemv_dtype)."""
    priced = {"int8-g32": "int8", "fp8": "int8", "fp8-row": "int8", "mxfp4": "int4", "q6k": "int8", "q5k": "int8",
              "iq4xs": "int8"}
    kinds = [priced.get(k, k) for k in parse_kinds(name)]
    order = ["int4", "int8", "bf16", "fp32"]
    return max(kinds, key=order.index)


def token_activations(name: str, act: str) -> str:
    """What format `name`'s experts multiply at one token where the plan asks for `act` (Plan.expert_act,
    "bf16" or "q8"): "q8" wherever a projection is mxfp4 (its kernel reads int8 activations at every
    size, as llama.cpp computes MXFP4: `project`), else `act`. The planner prices experts with it."""
    return "q8" if "mxfp4" in parse_kinds(name) else act


def rows_activations(name: str, act: str, batch_act: str) -> str:
    """What format `name`'s experts multiply in calls of 2+ rows (a batched decode step's share of an expert)
    where the plan asks for `act` at one token (Plan.expert_act) and `batch_act` for batches (Plan.batch_act):
    "q8" wherever a projection is mxfp4 (every size), where an int4 one reads q8 from one row (`act` "q8") or
    from two (`batch_act` "q8": the tiled kernels' q8_from, ExpertSpec's), and where a tiled int8 / int8-g32 one
    reads q8 from two (`batch_act` "q8": int8_q8_from), as the k-quant ones do; else `act`. The planner prices batched experts with it
    (cpu_predict.predict_decode)."""
    kinds = set(parse_kinds(name))
    if "mxfp4" in kinds or ("int4" in kinds and act == "q8"):
        return "q8"
    return "q8" if batch_act == "q8" and kinds & {"int4", "int8", "int8-g32", *KQUANT_KINDS} else act


def is_dense_format(name: str) -> bool:
    """An expert format whose three projections are plain dense tensors ("bf16", "fp32"): what
    ExpertFormat.is_dense says of it, from the name alone (the planner has no shapes)."""
    kinds = parse_kinds(name)
    return len(set(kinds)) == 1 and kinds[0] in DENSE


def format_name(kinds) -> str:
    """The format name of (gate, up, down) kinds: "int4" when all equal, else "a,b,c"."""
    return kinds[0] if len(set(kinds)) == 1 else ",".join(kinds)


@dataclass(frozen=True)
class ExpertFormat:
    """How one expert's three projections are stored and computed.

    Args:
        name: "bf16", "fp32", "int8", "int8-g32", "int4", "fp8", "fp8-row", "mxfp4", "q6k", "q5k", "iq4xs" or
            per projection "gate,up,down" kinds.
        shapes: ((F, D), (F, D), (D, F)) of gate, up, down.
        int4_layout: "cpu" (torch's CPU packed layout, computed from directly), "plain" (portable:
            what a CUDA device converts) or "tiled" (16-row tiles for tiered's native CPU kernel,
            `kernels.linear.tiled_codes`: the host layout when the extension is built).
        batch_act: what the native kernels of tiled int4 projections multiply in calls of two or
            more rows (a prompt's tokens, batched decode): "bf16" (the batch-1 numerics: int16
            activations on AVX2) or "q8" (int8 per group of 32, llama.cpp's Q8_0: vpmaddubsw does
            twice the multiply-adds per instruction; a Qwen3-30B-A3B expert at 8 / 16 / 64 rows on
            2 AVX2 cores 0.45 / 0.92 / 3.6 ms against 0.80 / 1.57 / 6.2). Plan.batch_act.
        act: what the native kernels of int4 projections multiply in one-row calls (a decode token):
            "bf16" (bf16 activations; int16 ones on AVX2 and where the kernel tuning picks them) or
            "q8" (int8 per group of 32, llama.cpp's Q4_0 x Q8_0: half the multiply-adds, which a
            batch-1 stream needs to reach the memory bound on AVX-512 VNNI). Plan.expert_act.
        exact_zeros: every int4 zero is exact in bf16, so each zero residual is 0 (a GGUF's Q4_0
            blocks: w = d (q - 8), zero 0; memory/apply.exact_int4_zeros decides): the native
            kernels then skip the residual segment, a third memory stream beside codes and scales
            (one thread, a 2048 x 2048 int4 weight: 160 -> 110-116 us a call). The segment is still
            stored (all zeros), so the slot size is the same either way.
        group_rows_limit: > 0: `grouped_rows` no more than this (Plan.expert_group_rows: where the planner prices
            the AMX GEMM below the kernel's groups from fewer rows than the kernel tuning measured on a small
            expert: cpu_predict.priced_group_rows); 0: the tuning's.
        swiglu_limit, swiglu_alpha: None for SiLU's SwiGLU; else gpt-oss's experts (models/gpt_oss.py):
            each projection's bias is its weight's input column D (F for down), zero columns after it
            up to a multiple of 32 (shapes (F, Db), (F, Db), (D, Fb): ModelConfig.expert_shapes),
            computed against the input with a 1 then zeros appended (models/gpt_oss.with_one), and
            the activation is the clamped GLU (models/gpt_oss.clamped_glu). On the CPU such experts run
            the native kernels with the bias columns and the clamped GLU inside (`forward_group`,
            `layer_call`: up to `biased_rows` rows an expert, in one call); past that, or without the
            kernels, torch ops per projection (`project`).
    mxfp4 projections (gpt-oss's MXFP4 as stored, quant/mxfp4.py) read int8 activations in every
    native call whatever `act` and `batch_act` say, and hold no zero residual (`exact_zeros` moot).
    Raises:
        ConfigError: unknown kind or layout, or a shape the kind cannot hold (K % 32 for grouped
            kinds; the CPU and tiled int4 layouts also need N % 16, the tiled layout of mxfp4 too; the
            k-quant kinds N % 16 and K % 256, and not the portable "plain" layout a CUDA device reads).
    """

    name: str
    shapes: tuple
    int4_layout: str = "cpu"
    batch_act: str = "bf16"
    act: str = "bf16"
    exact_zeros: bool = False
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.702
    group_rows_limit: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "shapes", tuple(tuple(int(d) for d in s) for s in self.shapes))
        if self.int4_layout not in LAYOUTS:
            raise ConfigError(f"unknown int4 layout {self.int4_layout!r}", "use " + ", ".join(LAYOUTS))
        for what, act in (("batch activations", self.batch_act), ("activations", self.act)):
            if act not in ("bf16", "q8"):
                raise ConfigError(f"unknown {what} {act!r}", "use bf16 or q8")
        for kind, (N, K) in zip(self.kinds, self.shapes):
            if kind in ("int4", "int8-g32", "mxfp4") and K % GROUP:
                raise ConfigError(f"expert format {kind} needs in-features divisible by {GROUP}, got {K}",
                                  "use --weights bf16 or int8 for this model")
            if kind == "mxfp4" and self.int4_layout == "tiled" and N % 16:
                raise ConfigError(f"the tiled mxfp4 layout needs out-features divisible by 16, got {N}",
                                  "use --weights bf16 or int8 for this model")
            if kind in KQUANT_KINDS and (N % 16 or K % 256 or self.int4_layout == "plain"):
                raise ConfigError(f"expert format {kind} holds a GGUF file's blocks for tiered's native CPU kernels: "
                                  f"[N, K] with N % 16 == 0 and K % 256 == 0 in the host layout, got [{N}, {K}] in the "
                                  f"{self.int4_layout} layout", "use int8-g32 for these experts")
            if kind == "int4" and self.int4_layout in ("cpu", "tiled") and N % 16:
                raise ConfigError(f"the {self.int4_layout} int4 layout needs out-features divisible by 16, got {N}",
                                  "use --weights int8 for this model")

    @cached_property
    def kinds(self) -> tuple[str, str, str]:
        return parse_kinds(self.name)

    @cached_property
    def is_dense(self) -> bool:
        """True when every projection is a dense tensor: the expert is kept as three tensors."""
        return is_dense_format(self.name)

    @property
    def dense_dtype(self) -> torch.dtype:
        return DENSE[self.kinds[0]]

    @cached_property
    def _layout(self) -> list[list[tuple[str, int, tuple, torch.dtype]]]:
        """Per projection: (field, byte offset, shape, dtype) of each segment in the flat buffer."""
        out, off = [], 0
        for kind, (N, K) in zip(self.kinds, self.shapes):
            segs = []
            for field, shape, dt in _segments(kind, N, K, self.int4_layout):
                segs.append((field, off, shape, dt))
                off = _align(off + torch.Size(shape).numel() * torch.empty((), dtype=dt).element_size())
            out.append(segs)
        object.__setattr__(self, "_nbytes", off)
        return out

    @property
    def nbytes(self) -> int:
        """Bytes of one expert in this format (the slot size on every tier)."""
        if self.is_dense:
            return sum(N * K for N, K in self.shapes) * torch.empty((), dtype=self.dense_dtype).element_size()
        self._layout
        return self._nbytes  # type: ignore[attr-defined]

    @property
    def slot_shapes(self) -> tuple[tuple[int, ...], ...]:
        """Shapes of the tensors one expert occupies: the 3 weights (dense) or one flat buffer."""
        return self.shapes if self.is_dense else ((self.nbytes,),)

    @property
    def slot_dtype(self) -> torch.dtype:
        """Element type of the slot tensors: the dense dtype, or uint8 for a flat buffer."""
        return self.dense_dtype if self.is_dense else torch.uint8

    # ------------------------------------------------------------------ views
    def views(self, slot: tuple[torch.Tensor, ...]) -> list[dict[str, torch.Tensor]]:
        """Typed views (no copy) of each projection's segments in `slot` (what `slot_shapes` gives)."""
        if self.is_dense:
            return [{"w": t} for t in slot]
        (buf,) = slot
        return [{f: buf[o:o + math.prod(s) * dt.itemsize].view(dt).view(s) for f, o, s, dt in segs}
                for segs in self._layout]

    def segment_views(self, slot: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
        """Every segment of `slot` in storage order (gate's, up's, down's), as typed views."""
        return [v for proj in self.views(slot) for v in proj.values()]

    # ----------------------------------------------------------------- encode
    def encode(self, parts: list[dict[str, torch.Tensor]], slot: tuple[torch.Tensor, ...],
               views: list[dict[str, torch.Tensor]] | None = None) -> None:
        """Write per-projection segments (as `quantize_projection` returns) into `slot` (host tensors);
        a segment already written in place (a view of the same bytes) is left as it is. `views`: the
        slot's `views` where the caller has them."""
        for dst, src in zip(views if views is not None else self.views(slot), parts):
            for f, t in dst.items():
                if src[f].data_ptr() != t.data_ptr():
                    t.copy_(src[f])

    def quantize(self, weights, slot: tuple[torch.Tensor, ...]) -> None:
        """Quantize dense (w_gate [F, D], w_up [F, D], w_down [D, F]) into `slot` (host tensors)."""
        self.encode([quantize_projection(w, k, self.int4_layout) for w, k in zip(weights, self.kinds)], slot)

    def empty(self) -> tuple[torch.Tensor, ...]:
        """A new host slot (for tests and conversion)."""
        return tuple(torch.empty(s, dtype=self.slot_dtype) for s in self.slot_shapes)

    # ---------------------------------------------------------------- compute
    @cached_property
    def native(self):
        """The native extension's fused expert for this format (tiered/kernels/linear.expert_spec),
        or None (no extension, or kinds / layout it has no kernel for)."""
        from tiered.kernels.linear import expert_spec

        return expert_spec(self)

    @cached_property
    def native_rows(self) -> int:
        """Rows up to which a CPU expert of this format runs the native fused kernel in one call:
        NATIVE_ROWS, for bf16 no more than this machine's kernel tuning gives it (kernels.
        bf16_native_rows: where oneDNN's bf16 GEMM is faster from fewer rows)."""
        return bf16_native_rows() if self.name == "bf16" else NATIVE_ROWS

    @cached_property
    def grouped_rows(self) -> int:
        """Rows up to which a CPU expert of this format runs the native kernel in groups of
        NATIVE_ROWS (GROUPED_ROWS, the least over its kinds, on its batch_act activations: kind_grouped_rows;
        bf16's from this machine's kernel tuning, 0 where it stops at NATIVE_ROWS or below); more: dequantized
        for one matmul."""
        if self.name == "bf16":
            from tiered import kernels

            rows = kernels.bf16_native_rows()
            return rows if rows > NATIVE_ROWS else 0
        rows = min(kind_grouped_rows(k, None, self.batch_act) for k in self.kinds)
        return min(rows, self.group_rows_limit) if self.group_rows_limit > 0 else rows

    @cached_property
    def biased_rows(self) -> int:
        """gpt-oss's experts (swiglu_limit set): rows up to which one expert's rows run the native kernels
        in one call, bias columns and clamped GLU inside (`forward_group`): the fewest over its kinds of
        the rows its projections keep their kernels for one by one (prompt_rows(kind, this machine's ISA,
        biased): mxfp4's mxfp4_kernel_rows, tiled int4's NATIVE_ROWS, ...), bf16's `native_rows`; past
        them each projection dequantizes for one GEMM (`project`). 0 for SiLU's experts."""
        if self.swiglu_limit is None:
            return 0
        if self.is_dense:
            return self.native_rows if self.dense_dtype == torch.bfloat16 else 0
        return min(prompt_rows(k, None, True)[0] for k in self.kinds)

    @property
    def group_rows(self) -> int:
        """Rows of one expert up to which `forward_group` computes it (more: None, call `forward`)."""
        return self.biased_rows if self.swiglu_limit is not None else max(self.native_rows, self.grouped_rows)

    @property
    def amx_rows(self) -> int:
        """Rows of one expert past which its native calls compute it on the AMX GEMM (`forward` past `group_rows`,
        ExpertSpec.forward_amx; `layer_call`'s experts past them, its forward_layer amx_rows): `group_rows` where the
        gate is tiled int4 or mxfp4 and the AMX GEMM runs here (quant/int4.amx_kernels: AMX granted, not TIERED_AMX=0
        or within `without_amx`); 0 where none does. gpt-oss's biased experts too (their `group_rows` is
        `biased_rows`), with their bias columns and clamped GLU in the call. Experts of more than quant/int4.AMX_ROWS
        rows still dequantize for oneDNN (`dequantized`, `_biased_glu`), whose rate the AMX GEMM falls behind there."""
        from tiered.quant.int4 import amx_kernels

        if (self.is_dense or self.int4_layout != "tiled" or self.kinds[0] not in ("int4", "mxfp4")
                or self.native is None or amx_kernels() is None):
            return 0
        return self.group_rows

    @property
    def layer_call_rows(self) -> int:
        """Rows of one expert up to which `layer_call` computes it itself (with `amx_rows` past the grouped kernels'
        rows, up to quant/int4.AMX_ROWS; else `group_rows`); an expert of more rows is computed by `forward` and
        `given` to the call."""
        from tiered.quant.int4 import AMX_ROWS

        return AMX_ROWS if self.amx_rows else self.group_rows

    @property
    def glu_args(self) -> dict:
        """The native calls' clamped-GLU arguments (forward_group, layer_call, DecodeStep.set_moe): gpt-oss's
        swiglu_limit / swiglu_alpha, or none."""
        return {} if self.swiglu_limit is None else dict(swiglu_limit=self.swiglu_limit, swiglu_alpha=self.swiglu_alpha)

    def forward(self, x: torch.Tensor, slot: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """SwiGLU expert from the stored form: x [n, D] -> [n, D] in x's dtype.

        (silu(x @ Wg^T) * (x @ Wu^T)) @ Wd^T, each projection with its kind's kernel. On the CPU, the
        native fused kernel when the extension is loaded (one call up to `native_rows` tokens, fp32
        between the projections; up to `grouped_rows` in groups of NATIVE_ROWS: `forward_group`);
        otherwise torch ops (tiled int4: the weight dequantized once per call, then bf16 matmuls).
        gpt-oss's experts (swiglu_limit): the native kernels up to `biased_rows` (`forward_group`),
        else torch ops per projection with the bias columns and the clamped GLU.
        """
        if self.swiglu_limit is not None:  # gpt-oss: biases as padded input columns, the clamped GLU
            y = None
            if x.device.type == "cpu":
                y = self.forward_group(x, [slot], [0, x.shape[0]])
                y = y if y is not None else self._amx_forward(x, slot)
            return y if y is not None else self._biased_glu(x, slot)
        if x.device.type == "cpu":
            n = x.shape[0]
            y = (self._native_forward(x, slot) if n <= self.native_rows else
                 self.forward_group(x, [slot], [0, n]) if n <= self.grouped_rows else self._amx_forward(x, slot))
            if y is not None:
                return y
        return self.dequantized(x, slot)

    def _amx_forward(self, x: torch.Tensor, slot: tuple[torch.Tensor, ...]) -> torch.Tensor | None:
        """`forward` of rows past the kernels' groups on the AMX GEMM in one native call (ExpertSpec.forward_amx:
        gate and up over x rounded to bf16 into bf16, their SwiGLU (gpt-oss's clamped GLU) in fp32 rounded to bf16,
        down over that; what `layer_call` computes such an expert with), in x's dtype; None where it does not run it
        (`amx_rows` 0, more than quant/int4.AMX_ROWS rows). In torch ops (`dequantized`: a gather, casts, three GEMM
        calls and the SwiGLU a call) a Qwen3-30B-A3B-width expert at 32-48 rows took ~0.9 ms beside its GEMMs' ~0.62
        (2 AMX cores, 2026-12-06)."""
        amx = self.amx_rows
        if not amx or not amx < x.shape[0] <= self.layer_call_rows:
            return None
        y = self.native.forward_amx(slot[0], x, **self.glu_args)
        return None if y is None else y.to(x.dtype)

    def dequantized(self, x: torch.Tensor, slot: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """`forward` by torch ops: x [n, D] -> [n, D], each projection dequantized (tiled int4: once a call) for a
        matmul, what the CPU runs past `group_rows` (kernels/tune.py times it against `grouped`); a dense
        expert's GEMMs."""
        if self.is_dense:
            return expert_forward(x, *slot)  # bf16 on AVX2: fp32 GEMMs (cpu_gemm)
        vg, vu, vd = self.views(slot)
        (kg, ku, kd), lay = self.kinds, self.int4_layout
        if self._bf16_glu(x):
            # gate and up in bf16 (the AMX GEMM's or oneDNN's own output), SwiGLU in one native pass (fp32 inside,
            # rounded once, as the down projection's bf16 rows round it), no fp32 copies of the [n, F] products: a
            # Mixtral-width expert at 512 rows spent ~25 ms in torch's fp32 silu, mul and casts (2 AMX cores,
            # 2026-12-06), its three AMX GEMMs ~30
            xb = x.to(torch.bfloat16).contiguous()
            h = kernels.load().swiglu(project(xb, vg, kg, lay, self.act), project(xb, vu, ku, lay, self.act))
            return project(h if kd in ("int4", "mxfp4") else h.to(x.dtype), vd, kd, lay, self.act).to(x.dtype)
        h = F.silu(project(x, vg, kg, lay, self.act)) * project(x, vu, ku, lay, self.act)
        return project(h, vd, kd, lay, self.act)

    def _bf16_glu(self, x: torch.Tensor) -> bool:
        """Whether `dequantized` runs this call's gate and up in bf16 with the native SwiGLU: CPU rows past the
        kernels' (each of gate and up tiled int4 / mxfp4, so dequantized into the AMX GEMM's tiles or for one bf16
        GEMM: quant/int4.dequantize_dtype() bf16) with the extension loaded."""
        from tiered.quant.int4 import dequantize_dtype

        kg, ku, _ = self.kinds
        if x.device.type != "cpu" or self.int4_layout != "tiled" or not {kg, ku} <= {"int4", "mxfp4"}:
            return False
        rows = x.shape[0]
        if any(rows <= (mxfp4_kernel_rows() if k == "mxfp4" else NATIVE_ROWS) for k in (kg, ku)):
            return False
        return dequantize_dtype() == torch.bfloat16 and kernels.load() is not None

    def _biased_glu(self, x: torch.Tensor, slot: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """A gpt-oss expert (swiglu_limit set) from the stored form: x [n, D] -> [n, D] in x's dtype."""
        from tiered.models.gpt_oss import clamped_glu, with_one

        x1 = with_one(x, self.shapes[0][1])  # (n, Db): the 1 each bias column multiplies, then zeros
        if self.is_dense:
            dt = x.dtype
            wg, wu, wd = (w if w.dtype == dt else w.to(dt) for w in slot)
            h = clamped_glu(linear(x1, wg), linear(x1, wu), self.swiglu_alpha, self.swiglu_limit)
            return linear(with_one(h, self.shapes[2][1]), wd)
        vg, vu, vd = self.views(slot)
        (kg, ku, kd), lay = self.kinds, self.int4_layout
        h = clamped_glu(project(x1, vg, kg, lay, self.act), project(x1, vu, ku, lay, self.act),
                        self.swiglu_alpha, self.swiglu_limit)
        return project(with_one(h, self.shapes[2][1]), vd, kd, lay, self.act)

    def _native_ext(self, slots: list[tuple[torch.Tensor, ...]]):
        """The native extension when its expert kernels can compute from these slots (a dense format:
        bf16 and contiguous; a quantized one: a kernel for its kinds and layout), else None. gpt-oss's
        biased experts pass their clamped GLU to the calls (`glu_args`)."""
        if self.is_dense:
            ok = self.dense_dtype == torch.bfloat16 and all(w.is_contiguous() for s in slots for w in s)
        else:
            ok = self.native is not None
        return kernels.load() if ok else None

    def _native_forward(self, x: torch.Tensor, slot: tuple[torch.Tensor, ...]) -> torch.Tensor | None:
        """The native fused expert's result in x's dtype, or None when it has no kernel for this."""
        ext = self._native_ext([slot])
        if ext is None:
            return None
        y = ext.bf16_expert_forward(*slot, x) if self.is_dense else self.native.forward(slot[0], x)
        return y if y.dtype == x.dtype else y.to(x.dtype)  # .to costs ~1.5 us even when a no-op

    def forward_group(self, xs: torch.Tensor, slots: list[tuple[torch.Tensor, ...]], bounds: list[int],
                      format_rows: int = 0) -> torch.Tensor | None:
        """Several experts of one layer in one native call (two parallel regions for all of them, not
        two per expert): expert i (slot `slots[i]`) on rows bounds[i]..bounds[i + 1] of xs [M, D]
        (CPU) -> ys [M, D] in xs's dtype, row m its expert's output: the same values as `forward` on
        each expert's rows. An expert with more than NATIVE_ROWS rows (a prompt's) runs as groups of
        NATIVE_ROWS rows, its weights read once a group (up to `grouped_rows` rows: see
        GROUPED_ROWS); gpt-oss's experts (swiglu_limit) up to `biased_rows` rows, all in one call
        with their bias columns and clamped GLU (the native one: the decode step's, not torch's
        sigmoid bit for bit). None when the native kernels cannot run it (no extension, no kernel for
        this format, a non-contiguous bf16 weight) or an expert has more than `group_rows` rows: call
        `forward` per expert instead. `format_rows` > 0: every expert's rows take the activation formats
        of a call of at least that many rows (a MoE step's tokens, as the native step's layer call takes
        them: a row's output then does not depend on how many rows its expert got; with batch_act "q8" the
        tiled kernels read int8 activations from 2 rows); 0: each expert's own rows."""
        if xs.device.type != "cpu":
            return None
        most = max(b - a for a, b in zip(bounds, bounds[1:]))
        if most > self.group_rows:
            return None
        return self.grouped(xs, slots, bounds, most, format_rows)

    def grouped(self, xs: torch.Tensor, slots: list[tuple[torch.Tensor, ...]], bounds: list[int],
                most: int | None = None, format_rows: int = 0) -> torch.Tensor | None:
        """`forward_group`'s native call (CPU xs) whatever the rows: an expert of more than NATIVE_ROWS rows in
        groups of NATIVE_ROWS (kernels/tune.py times it against `dequantized` past `group_rows`). `most`: the
        most rows of one expert where the caller has it. None when the native kernels cannot run it."""
        if most is None:
            most = max(b - a for a, b in zip(bounds, bounds[1:]))
        ext = self._native_ext(slots)
        if ext is None:
            return None
        if most > NATIVE_ROWS and self.swiglu_limit is None:  # groups of at most NATIVE_ROWS rows, each in the
            slots, bounds = _row_groups(slots, bounds)  # formats of the whole call (an expert's last group of one
            format_rows = max(format_rows, most)  # row had read int16 activations where the others read int8)
        if self.is_dense:
            ys = ext.bf16_experts_forward_group([w for s in slots for w in s], xs, bounds, **self.glu_args)
        else:
            ys = self.native.forward_group([s[0] for s in slots], xs, bounds, **self.glu_args, format_rows=format_rows)
        return ys.to(xs.dtype)

    def bind_layer(self, slots: list[tuple[torch.Tensor, ...]]):
        """Every expert of one MoE layer bound once as native kernels over its slot (slots[e]: expert
        e's, resident for as long as the result is used), for a native decode step's MoE layer
        (DecodeStep.set_moe: runtime/cpu_decode._native_moe); None when the native kernels cannot
        compute this format (see layer_call). gpt-oss's experts (swiglu_limit) are bound too: the
        kernels are their projections, the step computes their biases and clamped GLU."""
        ext = self._native_ext(slots)
        if ext is None:
            return None
        if self.is_dense:
            return ext.bf16_experts_bind([w for s in slots for w in s])
        return self.native.bind_layer([s[0] for s in slots])

    def layer_call(self, x: torch.Tensor, slots: list[tuple[torch.Tensor, ...]]):
        """The native call computing a CPU-only MoE layer's routed experts and their weighted sum at
        once, or None when the native kernels cannot (no extension or kernel for this format, x not
        float32 or bfloat16 on the CPU): call(topk_idx int64 [N, k], topk_weight [N, k] in x's dtype,
        experts, given=()) -> out [N, D] in x's dtype, for x [N, D], `experts` the routed ids ascending and
        `slots` their slots. Bit for bit the per-expert path: `forward` per expert on its rows, then
        index_add_ of ys * weight in expert order (gpt-oss's experts: `forward_group`'s native clamped
        GLU in place of torch's), where each expert's rows are within `native_rows` (a decode step's:
        the caller checks), or, more of them, the grouped call's (`forward_group`: groups of NATIVE_ROWS,
        up to `group_rows`). `given` (empty, or one per expert): None, or that expert's outputs [its rows,
        D] in x's dtype computed by the caller (a prompt's expert past `group_rows`: `forward`), in its
        rows' flat order; the call then adds them in its place and does not compute it. `amx_rows` > 0 (the
        format's `amx_rows`): an expert of more rows, not given, is computed on the AMX GEMM as `forward` computes
        it there (ExpertSpec.forward_amx), in the call.

        Raises (the call) RuntimeError: `given` of the wrong length, or an output of another shape or dtype."""
        if x.device.type != "cpu" or x.dtype not in (torch.float32, torch.bfloat16):
            return None
        ext = self._native_ext(slots)
        if ext is None or (self.swiglu_limit is not None and not self.biased_rows):
            return None
        glu = self.glu_args
        if self.is_dense:
            ws = [w for s in slots for w in s]
            return lambda idx, wt, experts, given=(), amx_rows=0: ext.bf16_experts_forward_layer(ws, x, idx, wt, experts,
                                                                                              **glu, given=list(given))
        codes = [s[0] for s in slots]
        return lambda idx, wt, experts, given=(), amx_rows=0: self.native.forward_layer(
            codes, x, idx, wt, experts, **glu, given=list(given), amx_rows=amx_rows)

    def dequantize(self, slot: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The three weights as fp32 (the reference the kernels are checked against)."""
        if self.is_dense:
            return tuple(t.float() for t in slot)  # type: ignore[return-value]
        return tuple(dequantize_projection(v, k, N, K, self.int4_layout)
                     for v, k, (N, K) in zip(self.views(slot), self.kinds, self.shapes))  # type: ignore[return-value]


# ---------------------------------------------------------------- projections
def fp8_block(kind: str, K: int) -> tuple[int, int]:
    """The block one scale of an fp8 kind covers in a projection of K in-features: 128 x 128 ("fp8"),
    a row ("fp8-row": (1, K))."""
    return (fp8.BLOCK, fp8.BLOCK) if kind == "fp8" else (1, max(K, 1))


def quantize_projection(w: torch.Tensor, kind: str, int4_layout: str = "cpu") -> dict[str, torch.Tensor]:
    """Segments of one dense projection w [N, K] in `kind` (host tensors, as `_segments` lays out)."""
    from tiered.quant.int4 import quantize_int4
    from tiered.quant.int8 import quantize_int8

    if kind in DENSE:
        return {"w": w.to(DENSE[kind])}
    if kind == "int8":
        q, s = quantize_int8(w)
        if int8_tiled(int4_layout, *q.shape):
            return {"qt": tiled_int8(q), "scale": s.to(torch.bfloat16)}
        return {"q": q, "scale": s.to(torch.bfloat16)}
    if kind == "int8-g32":
        from tiered.quant.int8 import quantize_int8_g32

        return int8_g32_segments(*quantize_int8_g32(w), int4_layout)
    if kind == "int4":
        return int4_segments(*quantize_int4(w), int4_layout)
    if kind in FP8_KINDS:
        q, bs = fp8.quantize_fp8(w, fp8_block(kind, w.shape[1]))
        return {"q": q, "bs": bs}
    if kind == "mxfp4":  # weights not stored as MXFP4: re-quantized (lossy)
        return mxfp4.segments(*mxfp4.quantize(w), int4_layout)
    if kind in KQUANT_KINDS:  # weights not stored in this k-quant: re-quantized (lossy; quant/gguf_encode.py's fit)
        return kquant_segments(kind, [quantize_blocks(w, kind)])
    raise ConfigError(f"unknown expert format {kind!r}", "use " + ", ".join(KINDS))


def quantize_blocks(w: torch.Tensor, kind: str) -> torch.Tensor:
    """w [N, K % 256 == 0] (any float dtype) -> the GGUF blocks of k-quant `kind`'s format (Q6_K, Q5_K, IQ4_XS),
    uint8 [N, K / 256 * block bytes], by quant/gguf_encode.py's fits."""
    from tiered.quant import gguf_encode

    if kind == "q6k":  # the common case: a Q4_K_M / Q5_K_M file's other ffn_down layers; the native fit (the same
        ext = kernels.load()  # bytes as gguf_encode's torch ops: ~6 ms a Qwen3-30B-A3B-width projection there)
        return ext.q6k_fit_rows(w) if ext is not None else gguf_encode.quantize_q6_k(w.float().contiguous())
    fit = {"q5k": gguf_encode.quantize_q5_k, "iq4xs": gguf_encode.quantize_iq4_xs}
    return torch.from_numpy(fit[kind](w.float().numpy()))


def kquant_segments(kind: str, raw: list[torch.Tensor], out: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """A k-quant projection's segments (quant/kquant's layout: qt, its scales, its super-block scales) from its GGUF
    blocks uint8 [N_i, K / 256 * block bytes] (one or more row ranges, N_i % 16 == 0), in one native repacking pass
    each; `out`: the projection's segment views in an expert's slot (ExpertFormat.views), written in place (then
    returned).

    Raises:
        RuntimeError: tiered's kernels are not built (the k-quant kinds are theirs alone)."""
    cls = LINEAR_OF_KIND[kind]
    return dict(zip(cls.PARTS, cls.pack_blocks(raw, None if out is None else [out[f] for f in cls.PARTS])))


def int8_g32_segments(q: torch.Tensor, scale: torch.Tensor, layout: str) -> dict[str, torch.Tensor]:
    """int8-g32 segments from q int8 [N, K] and scale fp16 [N, K/32] (w = q * s_g): in the tiled
    layout (N % 16 == 0) qt and st (`kernels.linear.tiled_int8`, `tiled_group_scales`), else as given."""
    if int8_tiled(layout, *q.shape):
        return {"qt": tiled_int8(q), "st": tiled_group_scales(scale)}
    return {"q": q, "scale": scale}


def _row_groups(slots: list, bounds: list[int]) -> tuple[list, list[int]]:
    """`forward_group`'s experts as groups of at most NATIVE_ROWS rows: (slots, bounds) with each
    expert's slot repeated once per group of its rows, in order; experts with no rows dropped."""
    out_slots, out_bounds = [], [0]
    for s, a, b in zip(slots, bounds, bounds[1:]):
        for c in range(a, b, NATIVE_ROWS):
            out_slots.append(s)
            out_bounds.append(min(c + NATIVE_ROWS, b))
    return out_slots, out_bounds


def int4_segments(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, layout: str) -> dict[str, torch.Tensor]:
    """int4 segments from codes int32 [N, K] (0..15), scale / zero fp32 [N, K/32] (w = (q-8)s + z)."""
    from tiered.kernels.linear import tiled_codes, tiled_inline, tiled_residual, tiled_scales

    if layout == "cpu":
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).contiguous(), 1)
    elif layout == "tiled":
        packed = tiled_codes(codes)
    else:
        c = codes.to(torch.uint8)
        packed = c[:, 0::2] | (c[:, 1::2] << 4)  # (N, K/2): even column in the low nibble
    sz = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)  # (G, N, 2)
    zr = (zero.T - sz[..., 1].float()).to(torch.bfloat16)  # (G, N): what rounding the zero lost
    if layout == "tiled":  # the scales inline: the kernels read one stream (two with residuals)
        return {"gw": tiled_inline(packed, tiled_scales(sz)), "zr": tiled_residual(zr)}
    return {"codes": packed, "sz": sz, "zr": zr}


def _plain_codes(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K/2] plain-layout bytes -> int32 codes [N, K]."""
    N = packed.shape[0]
    return torch.stack([packed & 0x0F, packed >> 4], dim=-1).reshape(N, -1).to(torch.int32)


def _group_tensors(v: dict[str, torch.Tensor], int4_layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """An int4 projection's (sz [G, N, 2], zr [G, N]) whatever its layout (views for cpu / plain)."""
    if int4_layout == "tiled":
        from tiered.kernels.linear import inline_scales, untiled_residual, untiled_scales

        return untiled_scales(inline_scales(v["gw"])), untiled_residual(v["zr"])
    return v["sz"], v["zr"]


def project(x: torch.Tensor, v: dict[str, torch.Tensor], kind: str, int4_layout: str, act: str = "bf16") -> torch.Tensor:
    """x [n, K] @ W^T for one stored projection -> [n, N] in x's dtype (kernel, else fallback); act:
    the native tiled int4 kernel's activations (ExpertFormat.act)."""
    if kind in DENSE:
        w = v["w"]
        return F.linear(x, w if w.dtype == x.dtype else w.to(x.dtype))
    cuda = x.device.type == "cuda"
    xb = x.to(torch.bfloat16).contiguous()
    if kind in ("int8", "int8-g32") and "qt" in v:  # the tiled layout: its native kernel, else dequantized below
        ext = kernels.load() if x.device.type == "cpu" else None
        if ext is not None:
            k = ext.int8_tiled_kernel(v["qt"], v["scale"]) if kind == "int8" else ext.int8g32_tiled_kernel(v["qt"], v["st"])
            return k(x).to(x.dtype)
    elif kind == "int8":
        try:
            return int8pack_mm(xb, v["q"], v["scale"]).to(x.dtype)
        except (RuntimeError, NotImplementedError):
            pass  # no kernel for this device / shape: dequantize below
    if kind == "int4" and int4_layout == "tiled":
        return _tiled_int4(x, xb, v, act)
    if kind == "mxfp4" and "gw" in v:  # the tiled int4 kernels with the e2m1 table, on int8 activations
        return _tiled_int4(x, xb, v, "q8", e2m1=True)
    if kind in KQUANT_KINDS:  # the native kernel (built a call: `forward`'s paths bind it in ExpertSpec instead)
        return kquant_linear(v, kind)(x).to(x.dtype)
    if kind in FP8_KINDS:
        ext = kernels.load() if x.device.type == "cpu" and x.shape[0] <= GROUPED_ROWS[kind] else None
        block = fp8_block(kind, x.shape[-1])
        if ext is not None:
            return ext.fp8_kernel(v["q"], v["bs"], row_block=block[0])(x).to(x.dtype)
        return F.linear(x, fp8.dequantize_fp8(v["q"], v["bs"], x.dtype, block))
    if kind == "int4":
        try:
            return _zero_residual(x, _int4_kernel(x, xb, v, cuda, int4_layout), v)
        except (RuntimeError, NotImplementedError):
            pass  # no kernel for this device / shape: dequantize below
    K = x.shape[-1]
    N = _int4_rows(v) if kind in ("int4", "mxfp4") else v["qt" if "qt" in v else "q"].shape[0]
    return F.linear(x, dequantize_projection(v, kind, N, K, int4_layout).to(x.dtype))


def kquant_linear(v: dict[str, torch.Tensor], kind: str):
    """A k-quant projection's segments as its quant/kquant.KQuantLinear (no copy).

    Raises:
        RuntimeError: tiered's kernels are not built."""
    if kernels.load() is None:
        raise RuntimeError(f"the {kind} expert kind needs tiered/kernels built")
    cls = LINEAR_OF_KIND[kind]
    return cls(*(v[f] for f in cls.PARTS))


def _int4_rows(v: dict[str, torch.Tensor]) -> int:
    """N of a stored int4 / mxfp4 projection: codes [N, K/2], or tiled codes with their scales inline
    [N/16, K/32, 320]."""
    return v["gw"].shape[0] * 16 if "gw" in v else v["codes"].shape[0]


def _tiled_int4(x: torch.Tensor, xb: torch.Tensor, v: dict[str, torch.Tensor], act: str,
                e2m1: bool = False) -> torch.Tensor:
    """x [n, K] @ W^T for a tiled int4 projection: the native kernel (on `act` activations) up to NATIVE_ROWS rows
    (an mxfp4 one up to mxfp4_kernel_rows(), in one call), else the weight dequantized once (native, or in
    torch without the extension) in quant/int4.dequantize_dtype() (bf16 on AVX-512, where oneDNN's bf16 GEMM
    is 3-4x its fp32 one; else fp32, exact for fp32 x) and one matmul (prefill-sized n: the conversion is
    paid once for all n rows) -> [n, N] in x's dtype; without the extension, fp32 for fp32 x.
    e2m1: an mxfp4 projection (its codes through the e2m1 table, no residual; int8 activations)."""
    from tiered.kernels import load

    ext = load() if x.device.type == "cpu" else None
    if ext is not None and x.shape[0] <= (mxfp4_kernel_rows() if e2m1 else NATIVE_ROWS):
        return tiled_int4_kernel(x, v, act, e2m1)
    return tiled_int4_dequantized(x, xb, v, e2m1)


def tiled_int4_kernel(x: torch.Tensor, v: dict[str, torch.Tensor], act: str, e2m1: bool = False) -> torch.Tensor:
    """`_tiled_int4`'s native kernel on `act` activations, whatever the rows (kernels/tune.py times it against
    `tiled_int4_dequantized`): x [n, K] -> [n, N] in x's dtype. Needs tiered/kernels."""
    from tiered.kernels import load

    return load().int4_tiled_kernel(v["gw"], None, v.get("zr"), None, act, e2m1=e2m1)(x).to(x.dtype)


def tiled_int4_dequantized(x: torch.Tensor, xb: torch.Tensor, v: dict[str, torch.Tensor],
                           e2m1: bool = False) -> torch.Tensor:
    """`_tiled_int4`'s dequantized path: the weight dequantized once and one matmul (xb: x in bf16); calls of up to
    quant/int4.AMX_ROWS rows in bf16 on a CPU with AMX take the native AMX GEMM instead (int4.amx_gemm)."""
    from tiered.kernels import load
    from tiered.kernels.linear import tiled_dequantize
    from tiered.quant.int4 import amx_gemm, dequantize_dtype

    ext = load() if x.device.type == "cpu" else None
    zr = v.get("zr")
    # fp32 x keeps an fp32 GEMM, but where the kernels' ISA GEMMs faster in bf16 (as a one-copy int4 weight's
    # prompt does: Int4Linear.dense). A Mixtral-width int4 expert projection (14336 x 4096) on 2 Sapphire
    # Rapids cores (AMX), fastest of 5, ms at 128 / 256 / 512 rows: fp32 dequantize + GEMM 82 / 129 / 212,
    # bf16 26 / 33 / 52, the q8 kernel in one call 27 / 54 / 105 (2026-11-29; mxfp4: MXFP4_KERNEL_ROWS' note)
    fp32 = x.dtype == torch.float32 and (ext is None or dequantize_dtype() == torch.float32)
    if ext is not None and not fp32:
        # AMX: the weight dequantized into the tiles' layout as the GEMM goes (quant/int4.amx_gemm); an expert's
        # row count changes from call to call, each new one a new oneDNN kernel (2-5 ms) on the path below
        y = amx_gemm(v["gw"], zr, xb, e2m1=e2m1)
        if y is not None:
            return y.to(x.dtype)
    if ext is not None:
        w = tiled_dequantize(v["gw"], None, zr, fp32, e2m1=e2m1)  # a reused buffer: no fresh pages per call
    else:
        N, K = _int4_rows(v), x.shape[-1]
        w = dequantize_projection(v, "mxfp4" if e2m1 else "int4", N, K, "tiled")
        w = w.to(torch.float32 if fp32 else torch.bfloat16)
    return F.linear(x if fp32 else xb, w).to(x.dtype)


def _zero_residual(x: torch.Tensor, y: torch.Tensor, v: dict[str, torch.Tensor]) -> torch.Tensor:
    """y + (group sums of x [n, K/32]) @ zero residual [K/32, N], in x's dtype (one addmm: the
    residual is ~2^-9 of the zero, so bf16 sums are precise enough for it)."""
    G = v["zr"].shape[0]
    gsum = x.reshape(x.shape[0], G, -1).sum(-1)  # (n, G)
    zr = v["zr"] if x.dtype == torch.bfloat16 else v["zr"].to(x.dtype)
    return torch.addmm(y, gsum, zr)


def _int4_kernel(x, xb, v, cuda: bool, int4_layout: str) -> torch.Tensor:
    """The int4 kernel of the device on bf16 activations `xb` -> [n, N] in x's dtype.

    Raises:
        RuntimeError: no kernel for this device and layout (the caller dequantizes).
    """
    if cuda and int4_layout == "plain":  # tinygemm wants the even column high: swap, tile on the device
        c, K = v["codes"], x.shape[-1]
        inner = 8 if K % 128 == 0 else 4 if K % 64 == 0 else 2  # K must be a multiple of inner * 16
        packed = torch.ops.aten._convert_weight_to_int4pack((((c & 0x0F) << 4) | (c >> 4)).contiguous(), inner)
        return torch.ops.aten._weight_int4pack_mm(xb, packed, GROUP, v["sz"]).to(x.dtype)
    if not cuda:
        packed = v["codes"] if int4_layout == "cpu" else \
            torch.ops.aten._convert_weight_to_int4pack_for_cpu(_plain_codes(v["codes"]), 1)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(xb, packed, GROUP, v["sz"]).to(x.dtype)
    raise RuntimeError("no int4 kernel for this device and layout")


def dequantize_projection(v: dict[str, torch.Tensor], kind: str, N: int, K: int, int4_layout: str) -> torch.Tensor:
    """The fp32 weight [N, K] of one stored projection (on the tensors' device).

    The CPU int4 layout is torch's private packing: it is decoded by the kernel itself (an identity
    activation gives W^T), exact up to bf16 products, like the kernel's own result.
    """
    if kind in DENSE:
        return v["w"].float()
    if kind == "int8":
        q = untiled_int8(v["qt"]) if "qt" in v else v["q"]
        return q.float() * v["scale"].float()[:, None]
    if kind == "int8-g32":
        q, s = (untiled_int8(v["qt"]), untiled_group_scales(v["st"])) if "qt" in v else (v["q"], v["scale"])
        return (q.float().reshape(N, K // GROUP, GROUP) * s.float()[..., None]).reshape(N, K)
    if kind in FP8_KINDS:
        return fp8.dequantize_fp8(v["q"], v["bs"], block=fp8_block(kind, K))
    if kind == "mxfp4":
        return mxfp4.dequantize(v, N, K)
    if kind in KQUANT_KINDS:
        return kquant_linear(v, kind).dequantize()
    sz, zr = _group_tensors(v, int4_layout)
    sz = sz.float()  # (G, N, 2)
    residual = zr.float().T.repeat_interleave(GROUP, dim=1)  # (N, K)
    if int4_layout == "cpu" and v["codes"].device.type != "cuda":
        eye = torch.eye(K, dtype=torch.bfloat16, device=v["codes"].device)
        w = torch.ops.aten._weight_int4pack_mm_for_cpu(eye, v["codes"], GROUP, v["sz"]).float().T
        return w + residual
    if int4_layout == "tiled":
        from tiered.kernels.linear import inline_codes, untiled_codes

        codes = untiled_codes(inline_codes(v["gw"])).float().reshape(N, K // GROUP, GROUP)
    else:
        codes = _plain_codes(v["codes"]).float().reshape(N, K // GROUP, GROUP)
    scale, zero = sz[..., 0].T[..., None], sz[..., 1].T[..., None]  # (N, G, 1)
    return ((codes - 8) * scale + zero).reshape(N, K) + residual
