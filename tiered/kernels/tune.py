"""Per-machine tuning of the native kernels, measured once after the build (`python -m tiered.kernels`).

Several choices depend on the CPU more than on the code, so they are measured here rather than fixed:

- ``stream_prefetch``: whether the weight-stream loops issue software prefetches ahead of their
  loads. On the 2-core Zen 3 VMs (AVX2) they lifted batch-1 int4 decode; on a Zen 4 VM (AVX-512)
  the same loops read 81-88% of the DRAM rate with them and 95-100% without. Until 2026-11-27 the
  int4 kernels' prefetches were missing from the built library (GCC deleted the calls to the
  prefetch helpers, now always_inline), so this choice only moved bf16 and int8; with them the Zen 4
  VM measures prefetch off 6% slower, and cold OLMoE-width int4 experts stream at 44-46 GB/s where
  they read 41-42 (bf16 activations; 2 threads, same run, `tiered/kernels/tune.py`'s experts).
- ``prefetch_l2``: whether those prefetches fill the L2 (prefetcht1) instead of the L1 (prefetcht0). One
  core's L1 has ~16 miss buffers, and a prefetch into it holds one until its line arrives from DRAM; the
  L2's queue holds ~48. On the 2-core Sapphire Rapids VM (2026-11-30) the L1 prefetches stalled on those
  buffers (samples pile up on them), and the L2 ones streamed Qwen3-30B-A3B-width Q4_0 experts 15-30%
  faster (8 experts of one token 13-14 -> 15.5 GB/s on 2 threads; a prompt's 100 experts of 2 rows
  14 -> 18) and that model decoded 11% faster, where a dense Q4_K_M model's long matrices moved 2% and
  SmolLM2's (in the cache) -2%, both within the noise. Timed on what gains or loses most: one token's 8
  routed experts of a layer a call (GROUP_WIDTH, `_group_sweep`); the one-expert sweeps below did not
  separate the two (ratio 0.98-1.1 in the noise).
- ``stream_prefetch_bytes``: the same switch for batch-1 calls of weights stored in a byte or more a weight (int8,
  int8-g32, fp8, bf16, fp32), ``stream_prefetch`` then governing the sub-byte formats' (int4, mxfp4, the k-quants).
  Those loops compute less per weight byte. On the Zen 4 VM (2026-12-07; weights cycled past the L3, one row, the
  same build) the prefetches made OLMoE-width bf16 experts 28% and int8-g32 decode copies 7% slower, where int4
  experts ran 6% slower and a 4096 x 4096 int4 decode copy 10% faster; one switch over the sum was a coin flip
  (median ratios 0.95-1.0 over that day's builds), and SmolLM2's decode (int4 layers, an int8-g32 head) ran 250
  tok/s with them on and 272 with them off. Timed on the bf16 experts and int8-g32 decode copies of BYTE_SHAPES
  (`_dense_calls`), and stream_prefetch's A/B on the sub-byte formats alone (int4 experts on both activations, a
  Llama-width int4 decode copy: WIDE_SHAPES).
- ``stream_prefetch_rows``: where ``stream_prefetch`` is off, whether calls of 2+ activation rows (a server's
  batched decode, a prompt's rows) issue them anyway. Such a call computes longer per weight byte, and on the
  Zen 4 VM (2026-12-02, stream_prefetch off) its stream overlapped its compute poorly without them: int4 on 8
  int8 rows of a 4096 x 4096 weight cycled past the L3 took 0.99-1.0 ms against 0.73-0.83 with them (0.61 in
  cache). Timed on such calls (ROWS_PREFETCH_SHAPE at ROWS_PREFETCH_ROWS rows, `_rows_prefetch_ab`).
- ``int4_int16_act``: on AVX-512 CPUs with VBMI, whether tiled int4 at batch 1 reads int16
  activations (the AVX2 path, more exact than bf16) instead of bf16 pairs (vdpbf16ps). On that
  Zen 4 VM the bf16 path was compute-bound near DRAM speed (74% of it, against 86%).
- ``attend_wide``: on AVX-512 CPUs, whether the native step's attention (decode over the KV cache, and a
  prompt's rows over their own keys) runs 16-float vectors instead of 8. Zen 5 and Intel's server cores
  execute a 512-bit FMA in one go, Zen 4 in two halves. On 2 Zen 5 cores a 1024-row prompt's attention
  (the attention-only model of hardware/profiler.attention_rows_call) took 0.56-0.72x the 8-wide time
  (2026-12-01). Timed on ATTEND_ROWS prompt rows (`_attend_ab`).
- ``bf16_native_rows``: rows up to which a bf16 expert (and a sliced FFN's CC rows) runs the native
  kernel (one call up to 8 rows, then groups of 8, reading the weights once a group) rather than
  torch's GEMMs (`choose_rows`): 32 on 2 AVX2 cores, 4 on the Zen 4 VM (oneDNN's bf16 GEMM there ran
  8 / 16 / 32 rows of a Mixtral-width expert in 12 / 15 / 20 ms against the native 19 / 34 / 66).

- ``q8_dequantize_rows``: rows beyond which a one-copy int4 weight's prompt call on int8 activations
  (Int4Linear.dense, a dense model's prefill) dequantizes the weight for one oneDNN GEMM instead of running
  the int4 kernel on the rows (quant/int4.dequantize_rows; 0: never). quant/int4's AVX-512 table (96 rows)
  was measured on a Zen 4 VM against the bf16-activation kernel; 2 Zen 5 cores (AVX-512 BF16 and VNNI, no
  AMX) ran the int8-row kernel ahead at every row count to 1024, and dequantizing past 96 rows made
  SmolLM2's 128-token prompt take 6.6x its 32-token one. Timed on one Llama-width weight (DEQUANTIZE_WIDTH) at
  DEQUANTIZE_ROW_CHOICES rows (`choose_dequantize_rows`).
- ``q8_expert_grouped_rows``: the same choice for a tiled int4 CPU expert's prompt rows on int8 activations
  (ExpertFormat.forward: its native kernel in groups of NATIVE_ROWS rows, `grouped`, or each projection
  dequantized for a matmul, `dequantized`; quant/experts.kind_grouped_rows; 0: groups at any rows), on
  Qwen3-30B-A3B-width Q4_0 experts (GROUP_WIDTH). quant/experts' table dequantized past 128 rows on AVX-512;
  the Zen 5 cores ran groups 0.85x the dequantized time at 256 rows and 0.93x at 512.
- ``mxfp4_kernel_rows``: the same for an mxfp4 projection (gpt-oss's experts: its native kernel in one call,
  quant/experts.tiled_int4_kernel, or dequantized for one GEMM, tiled_int4_dequantized; 0: the kernel at any
  rows), on a 2880 x 2880 projection (MXFP4_WIDTH). quant/experts' table dequantized past 96 rows on AVX-512
  (Sapphire Rapids' AMX GEMM); on the Zen 5 cores that made a 128-row projection 1.8x slower.

Each choice (but the last) is an interleaved A/B over cold weights: OLMoE-width SwiGLU experts (hidden 2048,
intermediate 1024, bf16 and tiled int4, the latter on bf16 / int16 and on int8 activations; the prefetch choices
also dense decode copies: WIDE_SHAPES, BYTE_SHAPES) cycled through so that they exceed the last-level cache,
one token each, `rounds` times in alternating order; the other option is taken only when the
median of its per-round time ratios is at least `margin` faster (VM neighbours move a single pass by
10-20%). The result lives beside the built library (``tuning.json``); `tiered.kernels.load()` applies
it, and ``TIERED_KERNEL_TUNING=0`` keeps the built-in defaults (prefetch on, bf16 activations, native
bf16 experts up to 32 rows).
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path
from typing import Callable

from tiered.hardware import contention

DEFAULTS = {"stream_prefetch": True, "prefetch_l2": False, "int4_int16_act": False, "attend_wide": True,
            "stream_prefetch_rows": True, "stream_prefetch_bytes": True,
            "bf16_native_rows": 32,
            "q8_dequantize_rows": None, "q8_expert_grouped_rows": None,  # None: quant's tables by ISA
            "mxfp4_kernel_rows": None}
# A tuning during which other processes took more than CONTENDED_SHARE of the cores is "contended": its
# A/Bs timed the neighbours. Two builds of the same sources tuned at once on the 2-core Zen 4 VM
# (2026-11-27) chose bf16_native_rows 32 and 4, int4_int16_act false and true. `python -m tiered.kernels`
# (setup) measures a contended tuning again, up to RETUNES times (hardware/contention.py).
RETUNES = contention.RETRIES
# the extension's own switches (ext.set_tuning; attend_wide stays off where the CPU has no AVX-512)
EXT_OPTIONS = ("stream_prefetch", "prefetch_l2", "int4_int16_act", "attend_wide", "stream_prefetch_rows",
               "stream_prefetch_bytes")
# stream_prefetch's A/B times, besides OLMoE's int4 experts, a Llama-width dense weight's int4 decode copies [N, K]
# at batch 1; stream_prefetch_bytes' the bf16 experts and int8-g32 decode copies (a GGUF's Q8_0 / Q6_K tensors,
# SmolLM2's head) of BYTE_SHAPES: a Llama-width weight and a SmolLM2 MLP projection
WIDE_SHAPES = ((4096, 4096),)
BYTE_SHAPES = ((4096, 4096), (1536, 576))
# stream_prefetch_rows' A/B: a batched decode step's call, int4 decode copies (tiled) of a Llama-width projection on
# this many int8 rows, copies cycled through the format's bytes
ROWS_PREFETCH_SHAPE, ROWS_PREFETCH_ROWS = (4096, 4096), 8
ATTEND_ROWS = 512  # attend_wide's A/B: a prompt of that many rows in the native step (profiler.attention_rows_call)
WIDTH = (2048, 1024)  # (hidden D, expert intermediate F): OLMoE's experts, a short stream per call
# prefetch_l2's A/B: one token's routed experts of a layer in one native call (ExpertFormat.forward_group,
# as a MoE decode step runs them), Qwen3-30B-A3B's width and top-8, int4 on int8 activations with exact
# zeros (a GGUF's Q4_0 experts), in one huge-page slab as the expert store holds them
GROUP_WIDTH, GROUP_TOP_K = (2048, 768), 8
ROW_CHOICES = (2, 4, 8, 32)
# q8_dequantize_rows' A/B: an int4 weight [N, K] (a Llama-3-8B-width attention projection's K, half its N: a
# prompt's GEMM is compute-bound, so the weight's size moves both sides alike) at these rows a call
DEQUANTIZE_WIDTH, DEQUANTIZE_ROW_CHOICES = (2048, 4096), (64, 128, 256, 512)
MXFP4_WIDTH = (2880, 2880)  # mxfp4_kernel_rows' A/B: a gpt-oss-20b expert projection (hidden 2880)
# Rows at which a bf16 expert's native kernel (one call up to 8 rows, then groups of 8, its weights read
# once a group) is timed against torch's three GEMMs (oneDNN: the weights read once): bf16_native_rows is
# the largest of these up to which the native kernel is not slower, 1 when it is slower at 2 rows.


def enabled() -> bool:
    """False when TIERED_KERNEL_TUNING=0 asks for the built-in defaults."""
    return os.environ.get("TIERED_KERNEL_TUNING", "1") not in ("0", "false", "no", "off")


def choose(ratios: list[float], margin: float = 0.03) -> bool:
    """Whether the alternative wins: the median of per-round time ratios (alternative / current) is
    at least `margin` below 1. Ties and noise keep the current option."""
    return bool(ratios) and statistics.median(ratios) <= 1.0 - margin


def _experts(fmt: str, total_bytes: int, act: str = "bf16", width: tuple[int, int] = WIDTH,
             exact_zeros: bool = False, slab: bool = False, at_least: int = 2, batch_act: str = "bf16"):
    """(ExpertFormat, [slots]) of `width` (hidden, intermediate; OLMoE's by default) experts in `fmt`
    filling about `total_bytes` (at least `at_least` of them) of the engine's host memory, distinct slots
    holding copies of one random expert (the stream's speed does not depend on the values): each slot from
    hardware/budget.host_empty, or with `slab` all carved from one HostSlab (profiler.slab_copies: the expert
    store's huge-page arena); act: int4's batch-1 activations (ExpertFormat.act); exact_zeros: the int4
    kernels skip the zero residual (ExpertFormat.exact_zeros, a GGUF's Q4_0 experts)."""
    import torch

    from tiered.hardware.budget import host_empty
    from tiered.hardware.profiler import slab_copies
    from tiered.quant.experts import ExpertFormat

    D, F = width
    g = torch.Generator().manual_seed(0)
    gu, dn = torch.randn(2 * F, D, generator=g) * 0.02, torch.randn(D, F, generator=g) * 0.02
    ef = ExpertFormat(fmt, ((F, D), (F, D), (D, F)), "tiled", act=act, exact_zeros=exact_zeros, batch_act=batch_act)
    if ef.is_dense:
        first = tuple(w.bfloat16() for w in (gu[:F], gu[F:], dn))
    else:
        first = tuple(torch.empty(s, dtype=ef.slot_dtype) for s in ef.slot_shapes)
        ef.quantize([gu[:F], gu[F:], dn], first)
    n = max(at_least, total_bytes // ef.nbytes)
    if slab:
        return ef, slab_copies(first, n)
    return ef, [tuple(host_empty(tuple(t.shape), t.dtype).copy_(t) for t in first) for _ in range(n)]


def prefetch_name(tuning: dict) -> str:
    """How a tuning's stream prefetches run, for a line of output: "off", "off at batch 1, on for 2+ rows", "on" or
    "on, into the L2", with "(formats of a byte or more: on|off at batch 1)" after where stream_prefetch_bytes
    differs from stream_prefetch."""
    if not tuning["stream_prefetch"]:
        said = "off at batch 1, on for 2+ rows" if tuning.get("stream_prefetch_rows") else "off"
    else:
        said = "on, into the L2" if tuning.get("prefetch_l2") else "on"
    byte = tuning.get("stream_prefetch_bytes", tuning["stream_prefetch"])  # a tuning saved before the switch: one
    if byte != tuning["stream_prefetch"]:
        said += f" (formats of a byte or more: {'on' if byte else 'off'} at batch 1)"
    return said


def choose_rows(ratios: dict[int, list[float]], margin: float = 0.03) -> int:
    """bf16_native_rows from {rows: per-round time ratios torch / native}: the largest row count, in
    ascending order, up to which torch's GEMMs never win by `margin` (`choose`); 1 when they win at the
    first. On the 2-core Zen 4 (AVX-512 BF16, 2026-11-26) torch won from 8 rows (0.65-0.74 at 8, 0.31-0.51
    at 32, Mixtral and OLMoE widths); on 2 AVX2 cores the native groups won at 16 (2.4 ms against 4.4)."""
    rows = 1
    for n in sorted(ratios):
        if choose(ratios[n], margin):
            break
        rows = n
    return rows


def dequantize_name(tuning: dict) -> str:
    """How a tuning runs int4 prompt rows on int8 activations (one-copy weights', experts'), for a line of output."""
    def said(key: str, what: str) -> str:
        rows = tuning.get(key)
        if rows is None:
            return f"{what} dequantized by the ISA's table"
        return f"{what} dequantized past {rows}" if rows else f"{what} never dequantized"
    return (f"{said('q8_dequantize_rows', 'int4 prompt rows')}, {said('q8_expert_grouped_rows', 'int4 expert rows')}, "
            f"{said('mxfp4_kernel_rows', 'mxfp4 rows')}")


def choose_dequantize_rows(ratios: dict[int, list[float]], margin: float = 0.03) -> int:
    """q8_dequantize_rows (and q8_expert_grouped_rows) from {rows: per-round time ratios dequantized / kernel
    (/ groups)}: the largest row count, in
    ascending order, below the first at which dequantizing wins by `margin` (`choose`), half that first
    where it wins at the smallest; 0 (never dequantize) where it wins at none."""
    rows = 0
    for n in sorted(ratios):
        if choose(ratios[n], margin):
            return rows or n // 2
        rows = n
    return 0


def _dequantize_ab(rows: int, rounds: int) -> list[float]:
    """Per-round ratios dequantized / kernel of an int4 DEQUANTIZE_WIDTH weight's call on `rows` int8-activation
    rows (Int4Linear.dense's two paths: `kernel("q8")` and `dequantized`), alternating which side goes first."""
    import torch

    from tiered.quant.int4 import Int4Linear, quantize_int4

    K, N = DEQUANTIZE_WIDTH
    g = torch.Generator().manual_seed(0)
    lin = Int4Linear.from_codes(*quantize_int4(torch.randn(N, K, generator=g) * 0.02), layout="tiled",
                                batch_act="q8")
    x = torch.randn(rows, K, generator=g).to(torch.bfloat16)
    return _alternated(_timed(lin.kernel("q8"), [x]), _timed(lin.dequantized, [x]), rounds)


def _expert_groups_ab(ef, slots, rows: int, rounds: int) -> list[float]:
    """Per-round ratios dequantized / grouped of `rows`-row sweeps of the int4 experts `slots` (ExpertFormat
    on int8 activations: `grouped`, its native kernel in groups of NATIVE_ROWS rows, and `dequantized`),
    alternating which side goes first."""
    import torch

    x = torch.randn(rows, ef.shapes[0][1]).to(torch.bfloat16)
    return _alternated(_timed(lambda s: ef.grouped(x, [s], [0, rows]), slots),
                       _timed(lambda s: ef.dequantized(x, s), slots), rounds)


def _mxfp4_ab(ef, slots, rows: int, rounds: int) -> list[float]:
    """Per-round ratios dequantized / kernel of `rows`-row calls of the mxfp4 gate projections of `slots`
    (quant/experts.tiled_int4_kernel in one call, tiled_int4_dequantized), alternating which side goes first."""
    import torch

    from tiered.quant.experts import tiled_int4_dequantized, tiled_int4_kernel

    x = torch.randn(rows, ef.shapes[0][1])
    xb = x.to(torch.bfloat16)
    views = [ef.views(s)[0] for s in slots]
    return _alternated(_timed(lambda v: tiled_int4_kernel(x, v, "q8", e2m1=True), views),
                       _timed(lambda v: tiled_int4_dequantized(x, xb, v, e2m1=True), views), rounds)


def _rows_ab(ext, ef, slots, rows: int, rounds: int) -> list[float]:
    """Per-round ratios torch / native of `rows`-row bf16 expert sweeps over `slots`, alternating which
    side goes first: the native kernel in one call up to 8 rows, then in groups of 8 rows."""
    import torch

    from tiered.models.moe import expert_forward

    x = torch.randn(rows, WIDTH[0]).to(torch.bfloat16)
    bounds = list(range(0, rows, 8)) + [rows]

    def native(s) -> None:
        if rows <= 8:
            ext.bf16_expert_forward(*s, x)
        else:
            ext.bf16_experts_forward_group([w for _ in bounds[1:] for w in s], x, bounds)
    return _alternated(_timed(native, slots), _timed(lambda s: expert_forward(x, *s), slots), rounds)


def _timed(fn: Callable, items: list) -> Callable[[], float]:
    """One side of an A/B: a call giving the seconds fn(item) takes for every item in turn."""
    def run() -> float:
        t = time.perf_counter()
        for item in items:
            fn(item)
        return time.perf_counter() - t
    return run


def _alternated(current: Callable[[], float], alternative: Callable[[], float], rounds: int) -> list[float]:
    """Per-round ratios alternative / current of two sides' seconds, in inference mode after a warm-up call of
    each (oneDNN's kernels for the shape, first-call buffers), alternating which side goes first."""
    import torch

    ratios = []
    with torch.inference_mode():
        current(), alternative()
        for r in range(rounds):
            if r % 2 == 0:
                a, b = current(), alternative()
            else:
                b, a = alternative(), current()
            ratios.append(b / a)
    return ratios


def _switch_ab(ext, option: str, run: Callable[[], float], rounds: int) -> list[float]:
    """Per-round ratios (the extension's switch `option` flipped / as set) of `run`'s seconds (_alternated: a
    warm-up of each side, then alternating which goes first); the switch is left as it was."""
    base = ext.tuning()[option]

    def side(flag: bool) -> Callable[[], float]:
        def timed() -> float:
            ext.set_tuning(**{option: flag})
            return run()
        return timed
    try:
        return _alternated(side(base), side(not base), rounds)
    finally:
        ext.set_tuning(**{option: base})


def _attend_ab(ext, rounds: int) -> list[float]:
    """Per-round ratios (attend_wide flipped / as set) of one native step over ATTEND_ROWS causal prompt rows of an
    attention-only model (hardware/profiler.attention_rows_call, a bf16 cache as the CPU plans keep)."""
    from tiered.hardware.profiler import attention_rows_call

    return _switch_ab(ext, "attend_wide", _timed(lambda call: call(), [attention_rows_call("bf16", ATTEND_ROWS)]),
                      rounds)


def _rows_prefetch_ab(ext, total_bytes: int, rounds: int) -> list[float]:
    """Per-round ratios (stream_prefetch_rows flipped / as set) of ROWS_PREFETCH_ROWS int8 rows through tiled int4
    decode copies of a ROWS_PREFETCH_SHAPE weight (the engine's Int4Linear kernel, as a batched step calls it),
    its copies cycled over about `total_bytes` so that each call streams its weight from memory."""
    import itertools

    import torch

    N, K = ROWS_PREFETCH_SHAPE
    g = torch.Generator().manual_seed(0)
    calls = itertools.cycle(_gemv_copies("int4q8", N, K, total_bytes // (N * K // 2), g))
    x = torch.randn(ROWS_PREFETCH_ROWS, K, generator=g)

    def run() -> float:
        t = time.perf_counter()
        for _ in range(4):
            next(calls)(x)
        return time.perf_counter() - t
    return _switch_ab(ext, "stream_prefetch_rows", run, rounds)


def _gemv_copies(dtype: str, N: int, K: int, count: int, g) -> list[Callable]:
    """The native calls of max(2, `count`) `dtype` decode copies (the profiler's names: tiled int4 Int4Linear,
    int8-g32 Int8G32Linear, int4q8 on int8 rows, ...) of one random weight [N, K] (`g`'s), each copy in memory of its
    own."""
    import torch

    from tiered.hardware.profiler import _module_copies, _native_gemv, _native_gemv_module

    template = _native_gemv_module(dtype, torch.randn(N, K, generator=g) * 0.02)[0]
    return [_native_gemv(dtype, m) for m in [template] + _module_copies(template, max(1, count - 1))]


def _dense_calls(shapes, total_bytes: int, dtype: str = "int4") -> Callable[[], float]:
    """A timed sweep (`_timed`) of one activation row through `dtype` decode copies (the profiler's names: tiled int4
    Int4Linear, int8-g32 Int8G32Linear, ...) of each [N, K] in `shapes` (the engine's kernels, as a dense model's
    batch-1 step calls them), each shape's copies cycled over about `total_bytes` / len(shapes) so that each call
    streams its weight from memory."""
    import torch

    from tiered.memory.sizes import bytes_per_element

    g = torch.Generator().manual_seed(0)
    calls = []
    for N, K in shapes:
        count = int(total_bytes // len(shapes) // (N * K * bytes_per_element(dtype)))
        x = torch.randn(1, K, generator=g)
        calls += [(call, x) for call in _gemv_copies(dtype, N, K, count, g)]
    return _timed(lambda call: call[0](call[1]), calls)


def _sweep(ef, slots, x) -> float:
    """Seconds to run one token through every expert of `slots`."""
    t = time.perf_counter()
    for s in slots:
        ef.forward(x, s)
    return time.perf_counter() - t


def _group_sweep(ef, slots, x) -> float:
    """Seconds to run one token through every expert of `slots`, GROUP_TOP_K experts a call."""
    bounds = list(range(GROUP_TOP_K + 1))
    xs = x.expand(GROUP_TOP_K, -1).contiguous()
    t = time.perf_counter()
    for i in range(0, len(slots) - GROUP_TOP_K + 1, GROUP_TOP_K):
        ef.forward_group(xs, slots[i:i + GROUP_TOP_K], bounds)
    return time.perf_counter() - t


def _ab_sweeps(sets, sweep=_sweep) -> Callable[[], float]:
    """Seconds of the summed sweeps over `sets` ((ExpertFormat, slots) pairs; `sweep`: one expert a call, or
    `_group_sweep`) of one token."""
    import torch

    x = torch.randn(1, sets[0][0].shapes[0][1])
    return lambda: sum(sweep(ef, slots, x) for ef, slots in sets)


def _ab(ext, sets, option: str, rounds: int, sweep=_sweep) -> list[float]:
    """Per-round ratios (option flipped / as set) of the summed sweeps over `sets` (`_ab_sweeps`), alternating which
    side goes first (_switch_ab)."""
    return _switch_ab(ext, option, _ab_sweeps(sets, sweep), rounds)


def measure(ext, total_bytes: int | None = None, rounds: int = 11, margin: float = 0.03,
            previous: dict | None = None) -> dict:
    """This machine's tuning, measured (see the module docstring): {"stream_prefetch": bool,
    "stream_prefetch_rows": bool, "stream_prefetch_bytes": bool, "int4_int16_act": bool, "bf16_native_rows": int,
    "q8_dequantize_rows", "q8_expert_grouped_rows" and "mxfp4_kernel_rows": int (0: never dequantized), "ratios":
    {option: per-round time ratios}, "others_share", "contended", "attempts" (hardware/contention.record; `previous`: the tuning it replaces), ...}. Leaves `ext` set to it.

    total_bytes: weight bytes per format cycled through (default: 4x the last-level cache, at least
    256 MiB). Takes ~2-5 s on 2 cores at the default size."""
    from tiered.hardware.profiler import cpu_model, last_level_cache_bytes

    start = contention.start()
    total = total_bytes or max(256 << 20, 4 * (last_level_cache_bytes() or 32 << 20))
    ext.set_tuning(**{k: DEFAULTS[k] for k in EXT_OPTIONS})
    # int4 twice: on int8 activations (routed experts, Plan.expert_act) and on bf16 / int16 ones (the
    # dense decode copies' batch-1 path, what int4_int16_act picks between)
    bf16, int4, int4q8 = _experts("bf16", total), _experts("int4", total), _experts("int4", total, "q8")
    out: dict = {"ratios": {}}
    # the int4 option only changes a kernel on AVX-512 with VBMI (elsewhere the path is fixed); first, so that the
    # prefetch A/Bs time the int4 kernel the machine runs
    if ext.gemv_isa() == "avx512" and ext.has_vbmi():
        ratios = _ab(ext, [int4], "int4_int16_act", rounds)
        out["ratios"]["int4_int16_act"] = ratios
        if choose(ratios, margin):
            ext.set_tuning(int4_int16_act=not DEFAULTS["int4_int16_act"])
    # batch-1 prefetches: the formats of a byte or more a weight, then the sub-byte ones
    experts, dense = _ab_sweeps([bf16]), _dense_calls(BYTE_SHAPES, total, "int8-g32")
    ratios = _switch_ab(ext, "stream_prefetch_bytes", lambda: experts() + dense(), rounds)
    out["ratios"]["stream_prefetch_bytes"] = ratios
    if choose(ratios, margin):
        ext.set_tuning(stream_prefetch_bytes=not DEFAULTS["stream_prefetch_bytes"])
    experts, dense = _ab_sweeps([int4, int4q8]), _dense_calls(WIDE_SHAPES, total)
    ratios = _switch_ab(ext, "stream_prefetch", lambda: experts() + dense(), rounds)
    out["ratios"]["stream_prefetch"] = ratios
    if choose(ratios, margin):
        ext.set_tuning(stream_prefetch=not DEFAULTS["stream_prefetch"])
    if ext.tuning()["stream_prefetch"]:  # where the prefetches stay: into the L1 or the L2
        group = _experts("int4", total, "q8", GROUP_WIDTH, exact_zeros=True, slab=True, at_least=2 * GROUP_TOP_K)
        ratios = _ab(ext, [group], "prefetch_l2", rounds, _group_sweep)
        out["ratios"]["prefetch_l2"] = ratios
        if choose(ratios, margin):
            ext.set_tuning(prefetch_l2=not DEFAULTS["prefetch_l2"])
    if not ext.tuning()["stream_prefetch"]:  # batch 1 without them: calls of 2+ rows with them, or not either
        ratios = _rows_prefetch_ab(ext, total, rounds)
        out["ratios"]["stream_prefetch_rows"] = ratios
        if choose(ratios, margin):
            ext.set_tuning(stream_prefetch_rows=not DEFAULTS["stream_prefetch_rows"])
    if ext.best_gemv_isa() == "avx512":  # the attention's vector width (16 floats on AVX-512 by default)
        ratios = _attend_ab(ext, rounds)
        out["ratios"]["attend_wide"] = ratios
        if choose(ratios, margin):
            ext.set_tuning(attend_wide=not DEFAULTS["attend_wide"])
    # bf16 experts past one row: the native kernel or torch's GEMMs (ExpertFormat.native_rows / grouped_rows)
    rows_ratios = {n: _rows_ab(ext, *bf16, n, max(3, rounds // 2)) for n in ROW_CHOICES}
    out["ratios"].update({f"bf16_rows_{n}": r for n, r in rows_ratios.items()})
    out.update(ext.tuning())
    out["bf16_native_rows"] = choose_rows(rows_ratios, margin)
    # where prompt rows dequantize for one GEMM: a one-copy int4 weight's (Int4Linear.dense), a tiled int4
    # expert's (groups of NATIVE_ROWS rows or dequantized matmuls), an mxfp4 projection's (one native call or
    # dequantized). One that cannot be timed here keeps None (quant's tables by ISA) and says why, rather than
    # failing the tuning (and with it, in a fresh build's load(), the kernels).
    rows = lambda ab, *args: {n: ab(*args, n, max(3, rounds // 2)) for n in DEQUANTIZE_ROW_CHOICES}  # noqa: E731
    for key, name, timed in (
            ("q8_dequantize_rows", "q8_dequantize", lambda: rows(_dequantize_ab)),
            ("q8_expert_grouped_rows", "q8_expert_groups", lambda: rows(_expert_groups_ab, *_experts(
                "int4", 0, "q8", GROUP_WIDTH, exact_zeros=True, slab=True, at_least=4, batch_act="q8"))),
            ("mxfp4_kernel_rows", "mxfp4_kernel", lambda: rows(_mxfp4_ab, *_experts(
                "mxfp4", 0, "q8", MXFP4_WIDTH, at_least=2)))):
        try:
            ratios = timed()
        except Exception as e:  # noqa: BLE001  (a format this machine's kernels cannot run: the table)
            out[key] = None
            out.setdefault("errors", {})[key] = f"{type(e).__name__}: {e}"[:200]
            continue
        out["ratios"].update({f"{name}_{n}": r for n, r in ratios.items()})
        out[key] = choose_dequantize_rows(ratios, margin)
    out.update(isa=ext.gemv_isa(), cpu=cpu_model(), bytes_per_format=total,
               rounds=rounds, margin=margin, when=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
               **contention.record(start, previous))
    return out


def path(directory: Path) -> Path:
    """Where a build directory keeps its tuning."""
    return Path(directory) / "tuning.json"


def saved(directory: Path) -> dict | None:
    """The tuning `directory` holds (tuning.json), or None."""
    try:
        out = json.loads(path(directory).read_text())
    except (ValueError, OSError):
        return None
    return out if isinstance(out, dict) else None


def complete(directory: Path) -> bool:
    """Whether `directory` holds a tuning of every choice in DEFAULTS (a tuning.json saved before a
    choice was added is measured again)."""
    return _complete(saved(directory))


def _complete(t: dict | None) -> bool:
    return t is not None and set(DEFAULTS) <= set(t)


def measured(directory: Path) -> bool:
    """Whether `directory` holds a tuning to keep (`complete`) that is not contended (other processes
    took more than CONTENDED_SHARE of the cores while it ran) or was contended RETUNES times already.
    `python -m tiered.kernels` (setup) measures until it is; the engine's load() only tunes a fresh
    build (`complete`), so that a running engine's kernels never change between its processes."""
    t = saved(directory)
    return _complete(t) and contention.keep(t)


def save(result: dict, directory: Path) -> Path:
    p = path(directory)
    p.write_text(json.dumps(result, indent=1))
    return p


def apply(ext, directory: Path) -> dict | None:
    """Set `ext` to the tuning saved in `directory` (None, defaults kept, when there is none, it is
    unreadable, or TIERED_KERNEL_TUNING=0)."""
    p = path(directory)
    if not enabled() or not p.exists():
        return None
    try:
        saved = json.loads(p.read_text())
        if not isinstance(saved.get("bf16_native_rows", DEFAULTS["bf16_native_rows"]), int):
            raise TypeError("bf16_native_rows")
        for key in ("q8_dequantize_rows", "q8_expert_grouped_rows", "mxfp4_kernel_rows"):
            if not isinstance(saved.get(key) or 0, int):  # None: the tables by ISA
                raise TypeError(key)
        ext.set_tuning(**{k: bool(saved[k]) for k in EXT_OPTIONS if k in saved})  # checked first: all or none
    except (ValueError, TypeError, KeyError, OSError, AttributeError):
        return None
    return saved
