"""Profiler: micro-benchmarks of this machine, fitted to affine cost models -> HardwareProfile.

Each operation is timed at several sizes (a warm-up call first, then the median of repeats; calls
shorter than a few milliseconds are looped so a sample is long enough to time) and fitted to
t = alpha + beta * n by least squares, with R^2 beside it (ScheInfer Eq. 3 and Table I;
ALGORITHMS.md 1.b). The keys and the units of n are listed in hardware/profile.py:

    gemm/<dev>/<dtype>   compute-bound GEMMs (64..512 tokens)   n = MACs
    gemv/<dev>/<dtype>   memory-bound GEMVs (1 token)           n = weight bytes
    attn/<dev>/<dtype>   decode attention (bmm q.K^T, p.V)      n = MACs
    gemm_big/cpu/<dtype> a prompt's GEMMs (256 tokens) on 32-112 MiB bf16 weights (4096 x 14336:
                         a Mixtral / Llama-3-8B FFN matrix), copies cycled over 2 x the
                         last-level cache (cold, as a prompt meets a model's FFNs)  n = MACs
    gemm_rows/cpu/<dtype> torch's GEMM of GEMM_ROWS (8) rows on cold 1.7-32 MiB weights in a huge-page
                         slab (a short prompt's, an expert's past its native rows)  n = weight bytes
    expert_rows/cpu/bf16 the native bf16 expert at 1-8 rows, cold in a slab (its slope: each row's
                         cost)                                                   n = MACs
    expert_rows/cpu/int4q8 the tiled int4 expert on int8 activations at 2-8 rows (a prompt's Q4_0
                         experts), 16 of 2048 x 1024 in a layer call, cold in a slab  n = MACs
    expert_rows/cpu/<kind>q8 the same for int8-g32, q6k, q5k and iq4xs experts (a GGUF file's Q8_0 / k-quant ones)
    expert_groups/cpu/int4q8 the same at 8-32 rows (1-4 groups of 8: each row past the first group, its
                         share of the group's weight stream from the cache included)  n = MACs
    decode_rows/cpu/<dtype> tiered's decode kernels at 8-32 rows (a batched decode step: a server's
                         or a beam search's rows), cold 4096 x 4096 weights; int4q8: int4 on int8
                         activations (Plan.batch_act "q8"); int8-g32q8: the tiled int8-g32 copies
                         (a GGUF head's) on int8 activations there                n = MACs
    attn_prefill/cpu/<dtype>  a prompt's causal attention (models/layers.attend, as the model runs it: torch's
                         SDPA, or a bf16 prompt's AMX kernel where it runs)
                         n = MACs (2 * heads * T (T + 1) / 2 * head_dim)
    convert/cpu/bf16     a bf16 weight's conversion to fp32 (CPUs without a bf16 GEMM only: hardware/cpu_gemm),
                         cold weights whose fp32 copy is under 32 MiB             n = elements
    convert_big/cpu/bf16 the same past 32 MiB (each call faults fresh pages in)  n = elements
    dequantize/cpu/int4  a one-copy int4 weight's dequantization before a prompt's GEMM past the kernel's
                         rows (tiered's kernels only; gemm/cpu/int4 is then fitted net of it)   n = elements
    gemm_amx/cpu/int4    a one-copy int4 weight's prompt GEMM on AMX (kernels' int4_tiled_gemm, calls of
                         AMX_FIT_ROWS rows, up to quant/int4.AMX_ROWS; CPUs with AMX only)       n = MACs
    gemm_amx_pack/cpu/int4  fitted with it (fit_gemm): the weight's conversion into the GEMM's tiles
                         (it dequantizes nothing into memory)                         n = weight bytes
    gemm_amx_floor/cpu/int4  its big weight's call at the fewest rows, a byte (amx_floor): the stream
                         that floors a call of few rows                               n = weight bytes
    attn_prefill_past/cpu/<dtype>  a prefill chunk's attention over the cache before it (1024 queries over
                         2048-4096 keys, an explicit mask: every pair computed)  n = MACs (2 * heads * T * S * head_dim)
    memory/bandwidth/<dev>, memory/copy/<dev>                  n = bytes
    memory/bandwidth_dram/cpu  reads of 2-4 x the last-level cache (meta["llc_bytes"])   n = bytes
    gemv_dram/cpu/<dtype>      the native decode GEMVs over 3 x the last-level cache      n = weight bytes
    gemv_graph/gpu/<dtype>     GEMVs replayed in a captured CUDA graph (CUDA only)       n = weight bytes
    launch/<dev>         a tiny op (alpha only)
    runtime/task         one task through tiered's executor and back (alpha only)
    runtime/engine_token the engine's loop around each decode step (schedule, inputs, sampling, output)
                         beyond the model step, a tiny model's ITL less its step (alpha only, bursts off)
    runtime/burst_token  a token of a decode burst (LLM._burst) beyond its layers' code: the same tiny
                         engine's ITL with bursts on less its layers (alpha only; tiered/kernels built)
    attn_decode/cpu/<kv>         the native decode step's attention per KV-cache byte (cache in <kv>,
                                 from DRAM; with tiered/kernels built and the LLC's size known)
    attn_rows/cpu/<kv>           the native step's attention over a prompt run as its rows (Plan.mixed_rows;
                                 over a bf16 cache attending in bf16, as plans there have prompts attend: AMX),
                                 seconds a layer             n = the layer's attention multiply-adds
    runtime/decode_step/<dtype>  a decode step of a tiny tiered model, decode weights in <dtype>
                         n = layers (the fixed per-step and per-layer cost of the model code)
    runtime/decode_layer/<fmt>  the native decode step's dense layers at real widths (SmolLM2's and up), int4
                         or int8-g32 decode copies, or a GGUF file's q6k / q5k / iq4xs ones as stored (widths a
                         multiple of 256), read from memory, less the layer code (runtime/decode_step's
                         per layer): its calls, fitted through the origin   n = a layer's weight bytes
    runtime/decode_ws/int4  the same layers (768 wide) cycled over working sets of 16-512 MiB and over 3 x the
                         last-level cache: seconds a weight byte (points only: op_time.cache_factor; the model is
                         the cold set's rate, alpha 0)            n = the working set's bytes
    runtime/step_rows/int4  the native step's layer code at prompt rows (SmolLM2's widths), beyond the rows'
                         four int4 kernel calls, seconds a layer   n = rows x (hidden + intermediate)
    runtime/batch_rows/int4q8  a row past the first of a batched native decode step (a server's sequences) over
                         dense int4 layers at real widths on int8 rows, seconds a layer   n = the layer's elements
    runtime/prefill_code/<dtype> a prompt's prefill through the engine with every F.linear and attention
                         call an empty result: the layers' own code (norms, RoPE, SiLU, adds), seconds a
                         layer                                       n = tokens x (hidden + intermediate)
    runtime/decode_step_gpu/<dtype>  the same on CUDA, model in <dtype> (CUDA only)
    runtime/decode_step_graphed_gpu/<dtype>  the same stepped through piecewise CUDA graphs
                                 (runtime/graphs.PiecewiseGraphs; CUDA only)
    runtime/decode_step_graph_gpu/<dtype>    the same as one CUDA graph a step (DecodeGraphs)
    runtime/mla_step/bf16  the same for a tiny DeepSeek-V2 model (latent attention, DeepSeek's router
                                 and shared expert; every layer its modules)
    runtime/moe_step/bf16  the same for a tiny MoE model opened by the engine (router, top-k and
                         the expert runner per MoE layer; every expert in RAM)   n = layers
    copy/{h2d,d2h}_{pinned,pageable}   (CUDA only)             n = bytes
    disk/read_cold (page cache dropped with posix_fadvise before each read), disk/write (+ fsync)
    disk/read_cold_parallel  cold reads split over DISK_READERS threads at once   n = all bytes

CPU kernels: fp32 and bf16 `F.linear`, int8 `aten._weight_int8pack_mm` and int4
`aten._weight_int4pack_mm_for_cpu` (bf16 activations; quant/int8.py, quant/int4.py). CUDA kernels:
fp32, bf16, fp16, int8 (`torch._int_mm`, int8 activations, gemm only) and int4
(`aten._weight_int4pack_mm`, sm80+), each skipped with a note in meta["skipped"] if it fails.
`quick=True` takes about 5 s on a 2-core machine; the full run about 2 minutes.
"""

from __future__ import annotations

import datetime as _dt
import itertools
import math
import os
import platform
import shutil
import socket
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from tiered import kernels
from tiered.errors import ConfigError
from tiered.hardware import contention
from tiered.hardware.budget import move_to_huge_pages
from tiered.hardware.cpu_gemm import bf16_gemm_native, linear
from tiered.hardware.op_time import GEMM_ROWS, MOE_PROBE_TOP_K, prefill_attention_pairs
from tiered.hardware.profile import HardwareProfile, LinearModel
from tiered.memory.sizes import DENSE_FORMATS, bytes_per_element, kv_torch_dtype, torch_dtype
from tiered.quant.int4 import AMX_ROWS, STEP_AMX_ROWS, amx_gemm, amx_kernels, dequantize_dtype, dequantize_rows, without_amx
from tiered.quant.kquant import GGUF_FORMAT, KQUANT_KINDS

MiB = 2**20
DISK_READERS = 2  # the runtime's disk reader threads (runtime/install.py: max(2, staging buffers))
Progress = Callable[[str], None]


def fit_affine(xs, ys) -> LinearModel:
    """Least-squares t = alpha + beta * n with alpha, beta >= 0 (non-negative least squares), and R^2.

    Raises:
        ValueError: no points, or xs and ys of different lengths.
    """
    x, y = np.asarray(xs, float), np.asarray(ys, float)
    if len(x) != len(y) or len(x) == 0:
        raise ValueError(f"need matching, non-empty samples (got {len(x)} and {len(y)})")
    if len(x) == 1 or np.ptp(x) == 0:
        return LinearModel(0.0, float(y.mean() / x.mean()) if x.mean() else 0.0, None)
    from scipy.optimize import nnls  # here: scipy.optimize costs ~0.6 s to import, and a load only reads a profile

    scale = x.max()  # condition the design matrix: n spans 1e6..1e10
    (alpha, b), _ = nnls(np.stack([np.ones_like(x), x / scale], axis=1), y)
    beta = b / scale
    ss = ((y - y.mean()) ** 2).sum()
    r2 = 1.0 - ((y - alpha - beta * x) ** 2).sum() / ss if ss > 0 else 1.0
    return LinearModel(float(alpha), float(beta), float(r2))


def fit_gemm(xs, ws, ys, relative: bool = False) -> tuple[LinearModel, LinearModel | None]:
    """Least-squares t = alpha + beta * n + gamma * w with alpha, beta, gamma >= 0 (non-negative least squares):
    a CPU GEMM call's seconds over its multiply-adds n and its weight's bytes w, which torch's CPU GEMMs read and
    pack (oneDNN, MKL) or dequantize (int8) at every call. Returns (LinearModel(alpha, beta, R^2),
    LinearModel(0, gamma, R^2)), R^2 of the three-term fit; fit_affine's line and None where the points cannot
    separate the terms (fewer than 4, or w constant or proportional to n).

    Over multiply-adds alone the line bends with the weight a call: on 2 Sapphire Rapids cores (AMX,
    2026-12-02) torch's bf16 GEMM took 2.4 ps a multiply-add at 64 rows of a 1024 x 1024 weight and 1.0 at 512,
    the affine fit's R^2 was 0.63-0.81, its slope 1.04-1.47 ps from one profile to the next, and it priced
    SmolLM2's 512-row projections 26-150% slow; three terms fitted R^2 0.989 (fp32: 0.93 -> 0.9993) and priced
    them within -5..+34%, Mixtral-width experts' 512-row projections within 9% (affine: +10-13%).
    `relative`: each point weighted by 1 / its time (least squares of the relative errors), for points over weights
    of 1 to 33 MB (gemm_amx/cpu/int4's): unweighted, the 33 MB weight's 5-30 ms calls set the line and the 1 MB ones'
    0.1-0.2 ms came out 18-26% slow (2 AMX cores, 2026-12-06). R^2 is the unweighted one either way.

    Raises:
        ValueError: no points, or xs, ws and ys of different lengths."""
    x, w, y = np.asarray(xs, float), np.asarray(ws, float), np.asarray(ys, float)
    if not len(x) == len(w) == len(y):
        raise ValueError(f"need matching samples (got {len(x)}, {len(w)} and {len(y)})")
    if len(x) < 4 or x.max() <= 0 or w.max() <= 0:
        return fit_affine(x, y), None
    design = np.stack([np.ones_like(x), x / x.max(), w / w.max()], axis=1)
    if np.linalg.matrix_rank(design, tol=1e-9) < 3:
        return fit_affine(x, y), None
    from scipy.optimize import nnls

    scale = 1.0 / np.maximum(y, 1e-12) if relative else np.ones_like(y)
    (alpha, b, g), _ = nnls(design * scale[:, None], y * scale)
    beta, gamma = b / x.max(), g / w.max()
    if beta <= 0.0:  # no cost per multiply-add is no GEMM's: a stalled point; the line over n alone
        return fit_affine(x, y), None
    ss = ((y - y.mean()) ** 2).sum()
    r2 = float(1.0 - ((y - alpha - beta * x - gamma * w) ** 2).sum() / ss) if ss > 0 else 1.0
    return LinearModel(float(alpha), float(beta), r2), LinearModel(0.0, float(gamma), r2)


def pack_key(key: str) -> str:
    """The weight-bytes term beside a GEMM key (fit_gemm): gemm/cpu/bf16 -> gemm_pack/cpu/bf16 (torch's packing),
    gemm_amx/cpu/int4 -> gemm_amx_pack/cpu/int4 (the AMX GEMM's conversion of the weight into its tiles).

    Raises:
        ValueError: `key` is neither a gemm/<device>/<dtype> nor a gemm_amx/<device>/<dtype> key."""
    for head in ("gemm/", "gemm_amx/"):
        if key.startswith(head):
            return head[:-1] + "_pack/" + key[len(head):]
    raise ValueError(f"{key!r} is no GEMM key (gemm/<device>/<dtype> or gemm_amx/<device>/<dtype>)")


def fit_proportional(xs, ys) -> LinearModel:
    """Least-squares t = beta * n through the origin (alpha = 0), and R^2: for reads and copies of
    8 MiB and more, whose fixed cost is microseconds; an affine fit's intercept there is the noise
    of a machine whose bandwidth moved between sizes.

    Raises:
        ValueError: no points, or xs and ys of different lengths.
    """
    x, y = np.asarray(xs, float), np.asarray(ys, float)
    if len(x) != len(y) or len(x) == 0:
        raise ValueError(f"need matching, non-empty samples (got {len(x)} and {len(y)})")
    beta = float((x * y).sum() / (x * x).sum()) if (x * x).sum() > 0 else 0.0
    ss = ((y - y.mean()) ** 2).sum()
    r2 = 1.0 - ((y - beta * x) ** 2).sum() / ss if ss > 0 and len(x) > 1 else None
    return LinearModel(0.0, max(beta, 0.0), None if r2 is None else float(r2))


def median_times(fns: list[Callable[[], object]], repeats: int, sync: Callable[[], None] = lambda: None,
                 min_sample: float = 10e-3) -> list[float]:
    """median_time of each of `fns`, their samples interleaved (fn 0, 1, ..., then again): on a machine whose
    memory bandwidth drifts (a VM's neighbours), every point then samples the same moments, and a fit
    across them sees their sizes, not when each was timed. The 2-core EPYC's DRAM reads (2, 3 and 4 x
    its 32 MiB LLC, 2026-11-26), eight fits each way: one size after the other, 31-52 GB/s, R^2
    0.86-0.96, the first size always the fastest (38-81 GB/s against 30-49); interleaved, 48-51 GB/s,
    R^2 0.93-0.995."""
    return [float(np.median(x)) for x in interleaved_samples(fns, repeats, sync, min_sample)]


def interleaved_samples(fns: list[Callable[[], object]], repeats: int, sync: Callable[[], None] = lambda: None,
                        min_sample: float = 10e-3) -> list[list[float]]:
    """median_times' samples: for each of `fns`, its `repeats` seconds per call, sample i of every fn taken in
    round i (fn 0, 1, ..., then again), after one warm-up call each that sizes its samples (as many calls as take
    `min_sample` seconds, at most 1000)."""
    inner = []
    for fn in fns:  # one warm-up call each, which sizes its samples
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        inner.append(max(1, min(1000, int(min_sample / max(time.perf_counter() - t0, 1e-7)))))
    samples = [[] for _ in fns]
    for _ in range(repeats):
        for fn, n, out in zip(fns, inner, samples):
            sync()
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            sync()
            out.append((time.perf_counter() - t0) / n)
    return samples


def median_time(fn: Callable[[], object], repeats: int, sync: Callable[[], None] = lambda: None,
                min_sample: float = 10e-3) -> float:
    """Median seconds per call of `fn` over `repeats` samples, after a warm-up call (each sample as many
    calls as take `min_sample` seconds, at most 1000)."""
    return median_times([fn], repeats, sync, min_sample)[0]


PROBE_SHAPE = (1, 4096, 4096)  # the memory-speed probe: tiered's bf16 decode kernel on a 32 MiB weight
# ... its copies cycled over 3 x the last-level cache, at most this many bytes. Every engine builds the probe
# at planning: on the 2-core AMX VM, whose sysfs reports a 480 MiB L3, 3 x that (1.4 GiB of copies) made
# SmolLM2's engine start take 3.6 s where it had taken 1.5 and its peak RSS 1.9 GB where its steady RSS is
# ~0.45 (cpu_dense, 2026-11-29). That VM's reads slow to the DRAM's rate between 64 and 256 MiB (torch
# sum() over 64 / 128 / 256 / 768 / 1536 MiB: 48.6 / 31.2 / 21.3 / 22.9 / 24.1 GB/s): its cache is ~100 MiB.
PROBE_MAX_COLD_BYTES = 256 * MiB


class Probe:
    """The memory's speed at a moment, as the bf16 decode kernel sees it: one call of tiered's native bf16
    GEMV on a 4096 x 4096 weight, its copies cycled over 3 x the last-level cache, at most
    PROBE_MAX_COLD_BYTES (no cache holds it).

    The profiler times it among the samples of every CPU GEMV key (`_gemm_points`: interleaved with
    the key's shapes), so each key carries the speed of the minutes it was measured in
    (meta["probe"]); at planning it is timed again (cpu_probe_seconds) and each key is scaled by its
    own ratio (planner/auto.bandwidth_now). A VM's memory speed moves between minutes: one quick
    profile of the 2-core EPYC (2026-11-27) timed gemv/cpu/bf16 at 42 GB/s and, a minute later,
    gemv_dram/cpu/bf16 at 81; scaled by gemv_dram's ratio alone, every key was priced 1.4x slow and
    `make run` 27% slow.

    Attributes:
        fn: one call (cycles to the next copy); nbytes: its weight's bytes; last: its median seconds
        in the last key's samples (set by _gemm_points), or None; samples: those samples in the order taken
        (seconds per call, one a round of the key's shapes), or None.
    """

    def __init__(self, llc: int) -> None:
        (T, K, N), cold = PROBE_SHAPE, min(3 * llc, PROBE_MAX_COLD_BYTES)
        copies = max(2, -(-cold // (K * N * 2)))
        # fill_random_'s values: every engine builds this probe at planning (randn over the whole 4096 x 4096
        # took 0.15 s of it on 2 Zen 3 cores)
        # the fp32 draw freed before any copy is made, the template the first of the copies: every engine's
        # planning peaks here (SmolLM2's engine on the 2-core AMX VM: 647 MB where its load peaks at ~400, the
        # draw's 64 MiB and a spare template's 32 among it)
        template = _native_gemv_module("bf16", random_normal(N, K))[0]
        modules = [template] + _module_copies(template, copies - 1)
        move_to_huge_pages(torch.nn.ModuleList(modules))
        turn = itertools.cycle([_native_gemv("bf16", m) for m in modules])
        x = torch.randn(T, K)
        self.fn = lambda: next(turn)(x)
        self.nbytes = K * N * 2
        self.last: float | None = None
        self.samples: list[float] | None = None
        self._keep = modules


def probed_times(fns: list[Callable[[], object]], repeats: int, probe: Probe | None,
                 sync: Callable[[], None] = lambda: None) -> list[float]:
    """median_times of `fns` with `probe`'s call (Probe, None: none) interleaved among their samples, its median
    left in probe.last and its samples in probe.samples: a key's timings carrying the memory's speed of their
    minutes, and how far it moved across them (probe_swing). Returns `fns`' times alone."""
    samples = interleaved_samples(list(fns) + ([probe.fn] if probe is not None else []), repeats, sync)
    if probe is not None:
        probe.samples = samples.pop()
        probe.last = float(np.median(probe.samples))
    return [float(np.median(x)) for x in samples]


# The compute-speed probe: tiered's int4 kernel on int8 rows and its bf16 row kernel, each on a weight the caches
# hold: (rows, K in, N out, kernel). ~0.8 ms a reading's call on 2 Zen 3 cores.
COMPUTE_PROBE_SHAPES = ((64, 576, 1536, "int4q8"), (16, 512, 1024, "bf16"))
COMPUTE_PROBE_REPEATS = 9
# The compute-bound CPU keys: each carries the compute probe's seconds of its minutes (meta["compute_probe"]), and
# planning scales each by the probe's speed now against them (planner/auto.compute_now).
# (Not attn/cpu, torch's decode attention: bandwidth-bound, hardware/profile.BANDWIDTH_BOUND_CPU.)
COMPUTE_KEYS = ("decode_rows/cpu/", "expert_rows/cpu/", "expert_groups/cpu/", "attn_rows/cpu/", "attn_prefill/cpu/", "attn_prefill_past/cpu/",
                "gemm/cpu/", "gemm_amx/cpu/", "gemm_amx_pack/cpu/", "gemm_pack/cpu/", "gemm_big/cpu/", "runtime/step_rows/", "runtime/prefill_code/",
                "dequantize/cpu/", "runtime/batch_rows/")


class ComputeProbe:
    """The cores' speed at a moment, as the compute-bound keys see it: one call each of tiered's int4 kernel on
    64 int8 rows and its bf16 row kernel on 16 rows (COMPUTE_PROBE_SHAPES), over weights the caches hold, so that
    no memory read is timed. The compute-bound keys' twin of Probe (the memory's speed).

    The profiler times it before and after every COMPUTE_KEYS key's timing (each of the row keys' three:
    _Bench.again), and meta["compute_probe"] records each key's median reading; at planning it is timed again
    (cpu_compute_ratios) and each key scaled by its own ratio (planner/auto.compute_now). A VM's cores change
    speed for minutes at a time with its neighbours: on 2 Zen 3 cores (2026-12-01) the int4 kernel at SmolLM2's
    widths took 6.5-7.5 ps a multiply-add in one minute and 9.8-11.3 some minutes later, where the profile's
    decode_rows/cpu/int4q8 had been fitted at 6.2; SmolLM2's default 512-token TTFT (its prompt as rows of that
    kernel) measured 0.67-0.82 s against 0.55 priced.

    Raises RuntimeError without tiered's kernels."""

    def __init__(self) -> None:
        if not kernels.available():
            raise RuntimeError("tiered/kernels is not built")
        g = torch.Generator().manual_seed(0)
        self._calls = []
        for T, K, N, kind in COMPUTE_PROBE_SHAPES:
            fn = _native_gemv(kind, _native_gemv_module(kind, torch.randn(N, K, generator=g) * 0.02)[0])
            x = torch.randn(T, K, generator=g)
            self._calls.append(lambda fn=fn, x=x: fn(x))

    def seconds(self, repeats: int = COMPUTE_PROBE_REPEATS) -> float:
        """Median seconds of one call of each kernel over `repeats` samples, after a warm-up call (which brings
        the weights into the caches)."""
        with torch.inference_mode():
            for call in self._calls:
                call()
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                for call in self._calls:
                    call()
                times.append(time.perf_counter() - t0)
        return float(np.median(times))


STREAM_KEYS = ("gemv/cpu/", "gemv_dram/cpu/", "memory/bandwidth")  # time = bytes / rate
# Keys timed again like STREAM_KEYS when their fit is poor: those and gemm_rows (a call's cost grows with its
# weight's bytes, read and packed by oneDNN: 0.07 / 0.16 / 0.53 / 0.88 / 1.67 ms for 0.7 / 1.8 / 7 / 17 / 34 MB
# of bf16 on 2 Sapphire Rapids cores with AMX, 2026-11-29). There one full profile timed its 7 MB weight at
# 2.2 ms (R^2 0.02; a fit's intercept of 1.75 ms) and three later timings gave 1.8, 0.66 and 8.5 ms: the plan
# then priced a uniformly routed CPU MoE's 64-token prefill at 412 ms where it ran 137.
# The GEMM keys too: one full profile on the 2-core AVX2-only EPYC timed gemm/cpu/fp32's shapes 1.7-12x
# slower than they ran before and after (67 M MACs in 15.7 ms against 1.1-1.3; R^2 0.53, an intercept of 9 ms
# a call) and priced SmolLM2's fp32 512-token TTFT at 3.2 s where it took 0.92 (2026-11-30).
RELATIVE_GEMM_KEYS = ("gemm_amx/cpu/",)  # fitted on their relative errors (fit_gemm's `relative`)
GEMM_KEYS = ("gemm/cpu/", "gemm_big/cpu/", "gemm_amx/cpu/")  # the GEMM lines (GEMM_STALL_R2): torch's, tiered's AMX one
# The conversion keys (convert, convert_big: a stream of a weight's bytes, page faults past glibc's mmap threshold)
# too: one quick profile on 2 Zen 3 cores fitted them as one line at R^2 0.89, 5.8 ns an element, where the full
# one a minute before fitted 1.3 (R^2 0.98), and the plan priced a 128-token bf16 MoE prompt 2x slow
# The row keys (decode_rows, expert_rows) too: a quick profile on 2 Zen 3 cores fitted decode_rows/cpu/int4q8 at
# R^2 0.77 (1.5 ms an intercept, 3.9 ps a multiply-add against the full profiles' 0.44-0.51 ms and 5.6-5.8 ps)
RETIMED_KEYS = STREAM_KEYS + ("gemm_rows/cpu/", "convert/cpu/", "convert_big/cpu/", "decode_rows/cpu/",
                              "expert_rows/cpu/", "expert_groups/cpu/", "runtime/decode_layer/",
                              "dequantize/cpu/") + GEMM_KEYS


def _upcast_gemm(key: str) -> bool:
    """`key` is torch's bf16 GEMM line (gemm, gemm_big) on a CPU without a bf16 GEMM, where hardware/cpu_gemm.linear
    converts each call's weight and GEMMs in fp32 (the planner prices that by gemm/cpu/fp32 and convert/cpu/bf16)."""
    return key.startswith(GEMM_KEYS) and key.endswith("/bf16") and not bf16_gemm_native()


STALL_R2 = 0.95  # below it such a key's samples stalled (sound runs fit at 0.98-0.9999): timed again
# torch's GEMM keys (gemm, gemm_big; not gemm_rows, whose per-call packing bends its line), stricter: a
# compute-bound line (sound runs fit at 0.997-0.9999 on 2 AVX2 cores); one full profile there fit gemm/cpu/bf16
# at R^2 0.966 with every point 10-60% slower than the runs before and after (a neighbour's burst), and priced
# the 8-layer Mixtral-width dummy's 512-token bf16 TTFT 12.8 s for 9.8.
GEMM_STALL_R2 = 0.99
STALL_RETRIES = 2
# Compute-bound row keys: timed twice more, later in the profile (_Bench.again: before and after the disk's timing),
# and fitted on each point's median of the three timings (_Bench.settle). A VM's cores change speed for seconds at a
# time with its neighbours, every point of a key alike, too evenly for a fit's R^2 to show it: on 2 Zen 3 cores the
# native bf16 expert at 1 / 2 / 4 / 8 rows took 0.8-0.9 / 0.9-1.0 / 1.3-1.5 / 2.7-3.1 ms in most seconds, 1.2 / 1.4-1.5
# / 2.1 / 5.2-5.4 in about one in ten, and 0.67 / 0.72 / 1.05 / 1.80 in another (2026-12-01). Three of five full
# profiles fitted it in a slow second, and their plans priced the uniformly routed Mixtral-width dummy's 16-128-token
# prompts 47-52% slow; the faster of two timings then caught a fast second and priced them 29% fast.
SECOND_PASS_KEYS = ("expert_rows/cpu/", "expert_groups/cpu/", "decode_rows/cpu/")


class _Bench:
    """One profiling run: settings, the fitted models so far, and notes."""

    def __init__(self, quick: bool, disk_dir: Path | None, progress: Progress | None) -> None:
        self.quick = quick
        self.repeats = 5 if quick else 9
        self.disk_dir = Path(disk_dir) if disk_dir else Path(tempfile.gettempdir())
        self.say = progress or (lambda msg: None)
        self.models: dict[str, LinearModel] = {}
        self.skipped: dict[str, str] = {}
        self.notes: list[str] = []  # fits replaced (Bench.fit), into meta["notes"]
        self.points: dict[str, list[tuple[float, float]]] = {}
        self.llc: int | None = None  # last-level cache [bytes], when the OS says
        self.host_share: dict | None = None  # CUDA: CPU experts and H2D copies at once (_host_share)
        self.probe: Probe | None = None  # the memory-speed probe timed beside each CPU GEMV key (Probe)
        self.probes: dict[str, float] = {}  # key -> the probe's seconds among that key's samples
        self.probe_pairs: list[tuple[float, float]] = []  # the probe's (first half, second half) in each key's timing
        self.compute: ComputeProbe | None = None  # the compute-speed probe timed around each COMPUTE_KEYS key
        self.compute_seconds: dict[str, list[float]] = {}  # key -> its readings around that key's timings
        self.compute_pairs: list[tuple[float, float]] = []  # (before, after) one timing of a compute-bound key
        # SECOND_PASS_KEYS measured so far: key -> (its timing, the points of each of its timings)
        self.deferred: dict[str, tuple[Callable[[], list[tuple[float, float]]], list[list[tuple[float, float]]]]] = {}

    def fit(self, key: str, points: list[tuple[float, float]], weights: list[float] | None = None) -> None:
        """Fit `key` on its (n, seconds) `points`; `weights` (a CPU GEMM key's: each point's weight bytes) fits
        the call's weight term beside it (fit_gemm, pack_key), where the points separate it."""
        self.points[key] = points
        if weights is not None:
            line, pack = fit_gemm([n for n, _ in points], weights, [t for _, t in points],
                                  relative=key.startswith(RELATIVE_GEMM_KEYS))
            self.models.pop(pack_key(key), None)
            if pack is not None:
                self.models[key], self.models[pack_key(key)] = line, pack
                self.say(f"{key}: alpha={line.alpha:.3g} s beta={line.beta:.3g} s/unit, {pack.beta:.3g} s a weight "
                         f"byte R^2={round(line.r2, 3)}")
                return
        if key.startswith("runtime/decode_ws/"):  # seconds a byte by working set: the cold set's rate (its points
            m = LinearModel(0.0, max(points)[1], None)  # give the rest, op_time.cache_factor)
            self.models[key] = m
            self.say(f"{key}: " + ", ".join(f"{n / MiB:.0f} MiB {1 / t / 1e9:.1f} GB/s" for n, t in points))
            return
        # reads and copies of MiBs; the native step's layers per byte, fixed costs in (_decode_layer_points)
        # and its attention over prompt rows per multiply-add (_attn_rows_points: the affine fit's intercept, ~0.45 ms
        # a layer on 2 Zen 5 cores, is the longer prompts' rate improving, and would price a 64-token SmolLM2
        # prompt 13 ms of attention where it computes ~1)
        fit = fit_proportional if key.startswith(("memory/", "runtime/decode_layer/", "attn_rows/",
                                                  "runtime/step_rows/", "dequantize/")) else fit_affine
        m = fit([n for n, _ in points], [t for _, t in points])
        if m.beta == 0.0 and len(points) >= 3 and all(n > 0 for n, _ in points):
            # no cost per unit is no real operation's: a stalled point made the least-squares slope
            # negative, clamped to 0 (gemv_dram/cpu/bf16 under a fresh machine's build load: 8 and 32 MiB at
            # ~65 GB/s, 16 MiB at 4 GB/s, fitted a constant 1.6 ms, and the plan priced SmolLM2 at 826 tok/s
            # where it ran 315). The median of the points' rates instead, through the origin.
            rate = float(np.median([t / n for n, t in points]))
            ts = np.array([t for _, t in points])
            ss = float(((ts - ts.mean()) ** 2).sum())
            resid = float(((ts - rate * np.array([n for n, _ in points])) ** 2).sum())
            m = LinearModel(0.0, rate, min(1.0, 1.0 - resid / ss) if ss > 0 else 1.0)  # (R^2 of that line)
            self.notes.append(f"{key}: no slope in a least-squares fit of its points (one stalled); their "
                              "median rate instead")
        self.models[key] = m
        self.say(f"{key}: alpha={m.alpha:.3g} s beta={m.beta:.3g} s/unit R^2={m.r2 if m.r2 is None else round(m.r2, 3)}")

    def attempt(self, key: str, fn: Callable[[], list[tuple[float, float]]], weights: list[float] | None = None
                ) -> None:
        """Time `key` by `fn` (its (n, seconds) points) and fit it (`weights`: Bench.fit's); a key skipped where
        `fn` raises.

        A bandwidth-bound key (STREAM_KEYS: its time is bytes over a rate, a straight line by
        construction) or a GEMM key (RETIMED_KEYS) whose fit has R^2 below STALL_R2 (GEMM_STALL_R2)
        had stalled samples: it is timed again, up to STALL_RETRIES times, and the best-fitting run
        kept, with a note. A quick profile taken while another process ran (load 1.9 on the 2-core
        EPYC, 2026-11-27) timed gemv/cpu/int4's 2.6 MB weight at 2.5 ms for ~70 us: its fit (R^2
        0.02) gave each GEMV a 0.6 ms intercept, and the plan priced SmolLM2's decode at 76 ms a token
        where it ran 2.8. Not torch's bf16 GEMM keys on a CPU without a bf16 GEMM (`_upcast_gemm`): each call
        converts its weight there, so their points lie on no line of MACs, and convert/cpu/bf16 prices them."""
        try:
            before = self.read_compute(key)
            best = None
            runs = 1 + (STALL_RETRIES if key.startswith(RETIMED_KEYS) and not _upcast_gemm(key) else 0)
            stall_r2 = GEMM_STALL_R2 if key.startswith(GEMM_KEYS) else STALL_R2
            for tries in range(runs):
                if self.probe is not None:
                    self.probe.last, self.probe.samples = None, None
                notes = len(self.notes)
                self.fit(key, fn(), weights)
                r2 = self.models[key].r2
                run = (r2 if r2 is not None else 1.0, self.models[key], self.points[key], self.notes[notes:],
                       self.probe.samples if self.probe is not None else None,
                       self.models.get(pack_key(key)) if weights is not None else None)
                del self.notes[notes:]
                if best is None or run[0] > best[0]:
                    best = run
                if best[0] >= stall_r2 or tries == runs - 1:
                    break
                self.say(f"{key}: R^2 {run[0]:.2f}: stalled samples, timing it again")
            r2, self.models[key], self.points[key], notes, probe_samples, pack = best
            if pack is not None:  # the weight term of the run kept (fit_gemm)
                self.models[pack_key(key)] = pack
            elif weights is not None:
                self.models.pop(pack_key(key), None)
            self.notes += notes
            if tries:
                self.notes.append(f"{key}: timed {tries + 1} times (R^2 below {stall_r2}: stalled samples); the "
                                  f"best fit kept (R^2 {r2:.3f})")
            if probe_samples:  # the memory probe's samples among this key's (probed_times)
                self.probes[key] = float(np.median(probe_samples))
                pair = halves(probe_samples)
                if pair is not None:
                    self.probe_pairs.append(pair)
            readings = before + self.read_compute(key)
            self.keep_compute(key, readings, pair=True)
            if pack is not None:  # timed with it: the cores' speed of the same minutes
                self.keep_compute(pack_key(key), readings)
            if key.startswith(SECOND_PASS_KEYS):
                self.deferred[key] = (fn, [self.points[key]])
        except Exception as e:  # a kernel this torch build or device lacks: note it, keep going
            self.skip(key, e)

    def again(self) -> None:
        """Time the SECOND_PASS_KEYS measured so far once more (a timing that fails, or times other points, is
        left out)."""
        for key, (fn, runs) in self.deferred.items():
            before = self.read_compute(key)
            try:
                points = fn()
            except Exception:  # noqa: BLE001  (the other timings stand)
                continue
            if [n for n, _ in points] == [n for n, _ in runs[0]]:
                runs.append(points)
                self.keep_compute(key, before + self.read_compute(key), pair=True)

    def read_compute(self, key: str) -> list[float]:
        """A reading of the compute-speed probe (ComputeProbe) beside `key`'s timing, where `key` is compute-bound
        (COMPUTE_KEYS) and the probe was built: [seconds], or [] (none, or it failed)."""
        if self.compute is None or not key.startswith(COMPUTE_KEYS):
            return []
        try:
            return [self.compute.seconds()]
        except Exception:  # noqa: BLE001  (the key stands; planning then leaves it as measured)
            return []

    def keep_compute(self, key: str, readings: list[float], pair: bool = False) -> None:
        """`readings` (read_compute's, around one timing of `key` that stands) into compute_seconds; with `pair`
        (the key's own timing, not a twin key's copy of it) the reading before and the one after into
        compute_pairs."""
        if readings:
            self.compute_seconds.setdefault(key, []).extend(readings)
        if pair and len(readings) == 2:
            self.compute_pairs.append((readings[0], readings[1]))

    def settle(self) -> None:
        """Fit each of the SECOND_PASS_KEYS timed more than once on its points' medians over its timings (`again`),
        with a note where that moved the key by more than 10% at its largest point against its first fit."""
        for key, (_, runs) in self.deferred.items():
            if len(runs) < 2:
                continue
            before = self.models[key]
            self.fit(key, [(n, float(np.median([run[i][1] for run in runs]))) for i, (n, _) in enumerate(runs[0])])
            n_max = max(n for n, _ in runs[0])
            ratio = self.models[key](n_max) / before(n_max)
            if abs(ratio - 1.0) > 0.1:
                self.notes.append(f"{key}: timed {len(runs)} times through the profile, {ratio:.2f}x its first fit at "
                                  "its largest point (each point's median kept)")
        self.deferred = {}

    def skip(self, key: str, e: Exception) -> None:
        """Note that `key` could not be measured (meta["skipped"]) and why."""
        self.skipped[key] = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
        self.say(f"{key}: skipped ({self.skipped[key]})")


# ---- GEMM kernels: (device, dtype, weight [N, K] fp32 on CPU) -> (callable on x [T, K], x dtype, bytes/elem)

def _native(module):
    from tiered.kernels.linear import kernel_for

    return kernel_for(module)


def _native_gemv_format(device: str, dtype: str, gemv: bool) -> bool:
    """Whether a `dtype` GEMV on `device` runs tiered's native kernel (tiered/kernels built)."""
    return gemv and device == "cpu" and dtype in ("fp32", "bf16", "int8", "int8-g32", "int8-g32q8", "int4", "int4q8", "fp8",
                                                 *KQUANT_KINDS, *(k + "q8" for k in KQUANT_KINDS)) and kernels.available()


def _native_gemv_module(dtype: str, w: torch.Tensor):
    """The module holding a `dtype` decode copy of w [N, K] as the engine's CPU decode step keeps it
    (fp32 nn.Linear, bf16 CastLinear, tiled int4 Int4Linear, Int8Linear, Int8G32Linear: a GGUF
    Q5_x/Q6_K tensor's copy and Q8_0 / Q6_K experts' kernel; Fp8Linear: an fp8 checkpoint's weights
    and fp8 experts' kernel), and its weight bytes per element."""
    if dtype == "fp32":  # the lossless mode's decode weights: f32_kernel
        lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
        lin.weight.data = w.clone()  # its own memory: copies that shared w's were timed in the cache
        return lin, 4
    if dtype == "bf16":
        from tiered.quant.linear import CastLinear

        return CastLinear(w.to(torch.bfloat16), None), 2
    if dtype in ("int4", "int4q8"):  # the tiled layout the engine's int4 decode copies take
        from tiered.quant.int4 import Int4Linear, quantize_int4
        lin = Int4Linear.from_codes(*quantize_int4(w), layout="tiled")
        return lin, 0.5 + 4 / lin.group
    if dtype in ("int8-g32", "int8-g32q8"):  # q8: batched calls on int8 activations (Plan.batch_act "q8")
        from tiered.quant.int8 import Int8G32Linear
        return Int8G32Linear.from_dense(w, batch_act="q8" if dtype == "int8-g32q8" else "bf16"), 1 + 2 / 32
    if dtype == "fp8":
        from tiered.memory.sizes import bytes_per_element
        from tiered.quant.fp8 import Fp8Linear, quantize_fp8
        return Fp8Linear(*quantize_fp8(w)), bytes_per_element("fp8")
    if dtype.removesuffix("q8") in KQUANT_KINDS:  # a GGUF Q6_K / Q5_K / IQ4_XS weight as stored (q8: its batched
        # calls on int8 activations, Plan.batch_act "q8"): random blocks (the speed does not depend on the values)
        import numpy as np

        from tiered.bench.gguf_dense import random_k_blocks
        from tiered.quant.kquant import LINEAR_OF_KIND, bytes_per_weight

        kind = dtype.removesuffix("q8")
        N, K = w.shape
        blocks = random_k_blocks(np.random.default_rng(0), N, K, GGUF_FORMAT[kind], 0.02)
        return (LINEAR_OF_KIND[kind].from_blocks([blocks], batch_act="q8" if dtype != kind else "bf16"),
                bytes_per_weight(kind))
    from tiered.quant.int8 import Int8Linear
    return Int8Linear.from_dense(w), 1 + 2 / w.shape[1]


def _module_copies(template, count: int) -> list:
    """`count` copies of the module `template` (copy.deepcopy: every tensor cloned into memory of its own), what the
    profiler cycles over so that each call reads its weight from memory no cache holds. `template` must hold no
    native Kernel yet (those do not copy): the caller keeps it apart from its kernels. Cloning costs a memcpy
    where building each copy again (_native_gemv_module) quantized its weight anew: the quick profile's int4
    decode_rows timing spent 5 of its 6 s quantizing 21 copies of a 4096 x 4096 weight (2 Zen 3 cores,
    2026-12-01). The kernels' speed does not depend on the weights' values."""
    import copy

    return [copy.deepcopy(template) for _ in range(count)]


def _native_gemv(dtype: str, module):
    """The native Kernel the CPU decode step calls for `module` (_native_gemv_module's)."""
    if dtype == "int4q8":  # on int8 activations at every row count: routed int4 experts at batch 1
        # (Plan.expert_act), int4 decode copies in a batched step (Plan.batch_act)
        from tiered.kernels.linear import int4_tiled_kernel
        return int4_tiled_kernel(module.packed, None, None, None, "q8")
    return _native(module)


def _linear_kernel(device: str, dtype: str, w: torch.Tensor, gemv: bool = False):
    """(fn(x) -> y, x's dtype, weight bytes per element) of the kernel the engine runs for a `dtype`
    weight w [N, K] on `device`. gemv: a decode-step GEMV: on a CPU with tiered/kernels built, the
    native Kernel the native decode step calls for that format (kernels/linear.kernel_for), with
    its per-call cost, not a module's Python-side reshapes and casts."""
    dev = torch.device("cuda" if device == "gpu" else "cpu")
    if _native_gemv_format(device, dtype, gemv):
        module, bpe = _native_gemv_module(dtype, w)
        return _native_gemv(dtype, module), torch.float32, bpe
    if dtype in DENSE_FORMATS:
        td = torch_dtype(dtype)
        wd = w.to(dev, td, copy=True)  # its own memory, as every copy of a cycled GEMV needs
        return (lambda x: linear(x, wd)), td, wd.element_size()  # as the runtime calls it (cpu_gemm)
    if dtype == "int8" and device == "cpu":
        from tiered.quant.int8 import Int8Linear
        lin = Int8Linear.from_dense(w)
        return lin, torch.bfloat16, 1 + 2 / w.shape[1]
    if dtype == "int4" and device == "cpu":
        from tiered.quant.int4 import GROUP, Int4Linear, quantize_int4
        if kernels.available():  # a prompt through a one-copy int4 weight: the tiled layout's dense path, its rows
            # in the dtype it dequantizes for, as a prompt's attention and FFN hand them (models/layers.input_dtype):
            # no cast of x or y inside the call (fp32 rows cast both: SmolLM2's 3072 x 576 / 576 x 1536 weights at 400
            # rows took 1.27 / 0.84 ms with fp32 rows, 1.00 / 0.56 with bf16, medians of 30 on 2 AMX cores, 2026-12-05)
            lin = Int4Linear.from_codes(*quantize_int4(w), GROUP, None, "tiled")
            return lin.dense, dequantize_dtype(), 0.5 + 4 / GROUP
        lin = Int4Linear.from_dense(w)
        return lin, torch.bfloat16, 0.5 + 4 / lin.group
    if dtype == "int8":  # CUDA: int8 x int8 -> int32 (activations quantized too)
        return _cuda_int8_kernel(w)
    if dtype == "int4":  # CUDA tinygemm: uint8 [N, K/2] -> packed, bf16 [K/g, N, 2] scales and zeros
        from tiered.quant.int4 import quantize_int4
        group = 128
        codes, scale, zero = quantize_int4(w, group)
        packed_u8 = (codes[:, ::2] << 4 | codes[:, 1::2]).to(torch.uint8).to(dev)
        packed = torch.ops.aten._convert_weight_to_int4pack(packed_u8, 8)
        sz = torch.stack([scale, zero], -1).transpose(0, 1).contiguous().to(dev, torch.bfloat16)
        return (lambda x: torch.ops.aten._weight_int4pack_mm(x, packed, group, sz)), torch.bfloat16, 0.5 + 4 / group
    raise ValueError(f"no {dtype} kernel on {device}")


def _cuda_int8_kernel(w: torch.Tensor):
    wq = w.cuda().clamp(-127, 127).to(torch.int8).t()  # [K, N] view of [N, K]: column-major, as _int_mm wants
    return (lambda x: torch._int_mm(x, wq)), torch.int8, 1.0


def random_expert(hidden: int, ffn: int, generator: torch.Generator | None = None) -> tuple[torch.Tensor, ...]:
    """One bf16 SwiGLU expert of small random weights (N(0, 0.02^2)): gate [ffn, hidden], up [ffn, hidden],
    down [hidden, ffn], what the profiler's and benchmarks' expert timings run on."""
    return tuple(random_normal(*sh, generator=generator).to(torch.bfloat16)
                 for sh in ((ffn, hidden), (ffn, hidden), (hidden, ffn)))


RANDOM_BLOCK = 1 << 16  # distinct draws of fill_random_ / random_normal


def fill_random_(t: torch.Tensor, std: float = 0.02, generator: torch.Generator | None = None) -> torch.Tensor:
    """Fill the contiguous tensor `t` in place with N(0, std^2) values: RANDOM_BLOCK draws (fewer for a smaller
    tensor) repeated through it, by doubling copies. What the profiler's operands hold: a kernel's time depends on
    its operands' memory, not their values, and drawing every element took most of some keys' setup on 2 Zen 3
    cores (2026-12-01: runtime/decode_layer/int4's model init 3.2 s, attn_decode's caches 1.9 s, expert_dram's
    experts 1.7 s). Returns `t`."""
    flat = t.view(-1)
    n = flat.numel()
    if n:
        flat[:min(n, RANDOM_BLOCK)].copy_(torch.randn(min(n, RANDOM_BLOCK), generator=generator).mul_(std))
    done = min(n, RANDOM_BLOCK)
    while done < n:
        k = min(done, n - done)
        flat[done:done + k].copy_(flat[:k])
        done += k
    return t


def random_normal(*shape: int, std: float = 0.02, generator: torch.Generator | None = None) -> torch.Tensor:
    """fp32 [shape] of N(0, std^2) values (fill_random_)."""
    return fill_random_(torch.empty(shape), std, generator)


def _random_model(cfg, positions: int, linears: bool = True):
    """models.build_model(cfg, positions) in eval mode on the CPU with values fit to time it: built on the meta
    device (no init), then every parameter given memory and fill_random_'s values (norm weights 1), the
    rotary tables computed. nn.Linear's own init took 3.2 s of runtime/decode_layer/int4's setup. `linears`
    False: the nn.Linear layers' weights stay on the meta device (a one-copy install gives them their copies from a
    stand-in checkpoint: install_decode_weights(dense=False))."""
    from torch import nn

    from tiered.models import build_model
    from tiered.models.layers import Rotary

    with torch.device("meta"):
        model = build_model(cfg, positions)
    kept = {} if linears else {name: m.weight for name, m in model.named_modules() if type(m) is nn.Linear}
    model = model.to_empty(device="cpu").eval()
    for name, w in kept.items():  # (to_empty gave them memory: back to the meta device)
        model.get_submodule(name).weight = nn.Parameter(w, requires_grad=False)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.is_meta:
                continue
            if p.dim() == 1 and "norm" in name:
                p.fill_(1.0)
            else:
                fill_random_(p, 1.0 if "embed" in name else 0.02)
    model.rotary = Rotary(cfg, positions)
    return model


def cold_copies(cold_bytes: int, nbytes: int) -> int:
    """Copies of an `nbytes` operand that fill `cold_bytes` (at least 2): cycled, each call reads memory
    no cache holds."""
    return max(2, -(-cold_bytes // nbytes))


def slab_copies(first: tuple[torch.Tensor, ...], copies: int) -> list[tuple[torch.Tensor, ...]]:
    """`copies` copies of the CPU tensors `first` (`first` itself among them only as values), carved from
    one HostSlab (each tensor page-aligned, on huge pages where the OS gives them), as the runtime holds
    its CPU experts (memory/expert_store) and a CPU-only engine its decode copies. Why not clones: on the
    2-core AMX VM (2026-11-29), torch's 8-row bf16 GEMM over clones on 4 KiB pages gave fits of R^2
    0.10-0.77 with intercepts 0.56-4.9 ms from one run to the next; over the same bytes in a slab, R^2
    0.85-0.99 and 0.26-0.88 ms."""
    from tiered.hardware.budget import HostSlab

    shapes = [tuple(t.shape) for t in first]
    dtypes = {t.dtype for t in first}
    if len(dtypes) != 1:
        raise ValueError("slab_copies takes tensors of one dtype")
    dtype = dtypes.pop()
    slab = HostSlab(HostSlab.bytes_for(copies, shapes, dtype))
    out = []
    for _ in range(copies):
        slot = tuple(slab.take(sh, dtype) for sh in shapes)
        for dst, src in zip(slot, first):
            dst.copy_(src)
        out.append(slot)
    return out


COLD_WEIGHT_BYTES = 64 * MiB  # CPU GEMVs rotate over this many weight bytes: beyond the last-level cache


def _gemm_points(device: str, dtype: str, shapes, sync, repeats: int, by_bytes: bool, cold_bytes: int | None = None,
                 probe: "Probe | None" = None):
    """(n, seconds) per shape (T tokens, K in, N out): n = MACs, or weight bytes when by_bytes.

    CPU GEMVs (by_bytes) cycle over enough copies of the weight to exceed COLD_WEIGHT_BYTES (however
    many that takes: 32 copies of a 512 x 512 int4 weight sat in a 32 MiB cache), so each call
    streams its weight from memory as a decode step does (a model's weights do not fit in the
    cache); timing one small weight again and again would measure the cache instead. `cold_bytes`: cycle over that many bytes instead, however many copies it takes
    (gemv_dram: beyond a last-level cache of hundreds of MiB), GEMMs too (gemm_big: a prompt's FFN
    matrices, which it meets once each).

    CPU shapes are timed interleaved (median_times: every shape's samples in turn), so a VM whose memory
    bandwidth drifts moves all of a fit's points together rather than its slope and intercept. The
    quick int4 fit's intercept, which prices SmolLM2's 200-1100 KiB matrices, came out 0.38 us in one
    fresh clone's profile (one shape after the other) where this 2-core EPYC's is 2.5-6 us, and that
    plan priced `make run` 20-28% fast. Four fits each way, side by side: interleaved, the quick shapes
    priced SmolLM2's four fused int4 shapes (cold) within 1-4% of their measured sum; one after the
    other, 3-10% fast. GPU shapes are timed one at a time, each freed before the next is made.

    `probe` (CPU): a Probe timed among the shapes' samples; its median goes to probe.last.
    """
    cpu_calls: list[tuple[float, Callable[[], object]]] = []  # (n, one call) per shape, timed together
    points: list[tuple[float, float]] = []  # GPU: (n, seconds) per shape
    native = _native_gemv_format(device, dtype, by_bytes)
    # (N, K) -> the native module of one random weight of that shape, never given a kernel: each shape's copies
    templates: dict[tuple[int, int], tuple] = {}
    for T, K, N in shapes:
        if native:  # the module first: its copies join it in one huge-page arena before any kernel is made
            if (N, K) not in templates:
                templates[N, K] = _native_gemv_module(dtype, random_normal(N, K))
            template, bpe = templates[N, K]
            xdtype = torch.float32
        else:
            w = random_normal(N, K)
            fn, xdtype, bpe = _linear_kernel(device, dtype, w, gemv=by_bytes)
        dev = "cuda" if device == "gpu" else "cpu"
        x = (torch.randint(-8, 8, (T, K), dtype=torch.int8) if xdtype == torch.int8 else torch.randn(T, K)).to(dev, xdtype)
        need = -(-(cold_bytes or COLD_WEIGHT_BYTES) // int(K * N * bpe))
        copies = need if device == "cpu" and (by_bytes or cold_bytes) else 1
        if native:
            # every shape its own copies (each cycled on its own: a shape never reads the copy another just read)
            modules = _module_copies(template, copies)
            if copies > 1:  # the copies in one huge-page arena, as a CPU-only engine holds its decode copies
                move_to_huge_pages(torch.nn.ModuleList(modules))
            fns = [_native_gemv(dtype, m) for m in modules]
        else:
            fns = [fn] + [_linear_kernel(device, dtype, w, gemv=by_bytes)[0] for _ in range(copies - 1)]
        turn = itertools.cycle(fns)
        n = K * N * bpe if by_bytes else T * K * N
        call = lambda turn=turn, x=x: next(turn)(x)  # noqa: E731
        if device == "cpu":
            cpu_calls.append((n, call))
        else:
            points.append((n, median_time(call, repeats, sync)))
    if cpu_calls:
        times = probed_times([fn for _, fn in cpu_calls], repeats, probe, sync)
        points = list(zip((n for n, _ in cpu_calls), times))
    return points


DECODE_ROWS = (8, 16, 32)  # rows of the decode_rows keys: past the few rows one weight stream covers


def _decode_rows_points(dtype: str, repeats: int, cold_bytes: int | None, probe: "Probe | None" = None
                        ) -> list[tuple[float, float]]:
    """(multiply-adds, seconds a call) of tiered's `dtype` decode kernel (the module the engine's CPU
    decode step holds: _native_gemv_module) at DECODE_ROWS rows of a 4096 x 4096 weight, copies cycled
    over `cold_bytes` (COLD_WEIGHT_BYTES without it), the rows timed interleaved. What a batched decode
    step's projection costs once its rows' multiply-adds outweigh one stream of the weight: on 2 Zen 4
    cores the int4 kernel took 0.30 ms at 1-4 rows (the stream), then 66 us a row (0.53 / 1.05 / 2.10 ms
    at 8 / 16 / 32 rows); bf16 1.04 ms at 1 row, 0.32 ms a row from 8 (2026-11-27). The fit's slope is
    a row's cost per multiply-add (cpu_predict.predict_decode's `batch`). Raises RuntimeError without
    the kernels."""
    if not _native_gemv_format("cpu", dtype, True):
        raise RuntimeError("tiered/kernels is not built")
    K = N = 4096
    points = _gemm_points("cpu", dtype, [(rows, K, N) for rows in DECODE_ROWS], lambda: None, repeats, True,
                          cold_bytes=cold_bytes, probe=probe)
    return [(float(rows * K * N), t) for rows, (_, t) in zip(DECODE_ROWS, points)]


# gemm_rows' weights (N, K): a small model's FFN matrix (SmolLM2's, 1.8 MB of bf16: without it the fit's
# intercept was an extrapolation from 7 MB, which prices each of a small model's prompt GEMMs), a small
# MoE's expert projection, Llama-3-8B's attention projections.
GEMM_ROWS_SHAPES = ((1536, 576), (3584, 1024), (4096, 2048), (4096, 4096))


def int4_gemm_shapes(shapes, amx: bool = False) -> list[tuple[int, int, int]]:
    """gemm/cpu/int4's (T, K, N) shapes with tiered's kernels: the weights of `shapes` (the GEMM fit's), each at
    2 and 4 x quant/int4.dequantize_rows() rows, where a one-copy int4 weight's prompt GEMM dequantizes it
    (bf16 for oneDNN on AVX-512, else fp32) for one GEMM: the path a prompt of that many tokens takes. Fewer
    rows run the int4 kernel, priced by decode_rows/cpu/int4 (cpu_predict.predict_prefill). The two paths in
    one fit (64-512 rows on 2 AMX cores, 2026-11-29: 75 GMAC/s in the kernel, ~500 dequantized) gave R^2 0.13
    and priced SmolLM2's default 512-token TTFT 0.75 s where it took 0.32. `amx`: a CPU whose calls up to
    quant/int4.AMX_ROWS run the AMX GEMM (gemm_amx/cpu/int4), so only calls past them dequantize: at 2 and 4 x
    AMX_ROWS rows (a CPU plan's prefill chunk of 1024 is one such call a projection). Timed at 64 and 128 rows
    and extrapolated, oneDNN's GEMM had priced a Gemma-3-4B-width file's 1024-token chunks' projections at 1.05
    TMAC/s where they ran 0.93 (2 AMX cores, 2026-12-07)."""
    d = dequantize_rows()
    d = max(d, AMX_ROWS) if amx else d
    weights = list(dict.fromkeys((K, N) for _, K, N in shapes))[:2]
    return [(m * d, K, N) for K, N in weights for m in (2, 4)]


# gemm_amx/cpu/int4's rows: from the fewest an expert's prompt rows take the AMX GEMM at (quant/experts' group rows,
# 32 for Mixtral's int4) to quant/int4.AMX_ROWS; three counts, so that the weight's conversion into the tiles (each
# call's per weight, gemm_amx_pack) separates from the multiply-adds
AMX_FIT_ROWS = (AMX_ROWS // 16, AMX_ROWS // 4, AMX_ROWS)


def amx_gemm_shapes(shapes) -> list[tuple[int, int, int]]:
    """gemm_amx/cpu/int4's (T, K, N) shapes: the weights of int4_gemm_shapes' (`shapes`) and AMX_NARROW_WEIGHT, each
    at AMX_FIT_ROWS rows: the range of the AMX GEMM's calls (past AMX_ROWS the dequantized oneDNN GEMM runs,
    gemm/cpu/int4's), measured rather than extrapolated (a line from 192 and 384 rows priced SmolLM2's 512-token TTFT
    22% fast with AMX_ROWS 512, 2026-12-05)."""
    weights = list(dict.fromkeys([(K, N) for _, K, N in shapes] + [AMX_NARROW_WEIGHT, AMX_WIDE_WEIGHT]))
    return [(rows, K, N) for K, N in weights for rows in AMX_FIT_ROWS]


def amx_floor(points, shapes) -> tuple[LinearModel, list[tuple[float, float]]] | None:
    """gemm_amx_floor/cpu/int4 (and its one point) from gemm_amx/cpu/int4's (multiply-adds, seconds) `points` of
    `shapes` (amx_gemm_shapes'): seconds a weight byte of AMX_WIDE_WEIGHT's call at the fewest AMX_FIT_ROWS, through
    the origin. A call of few rows over a weight read from memory streams it no faster (op_time.amx_gemm_time floors
    by it): the fit's line priced a Mixtral-width expert's AMX path at 9 / 12 / 16 rows 9.3 / 9.9 / 10.6 ms where it
    took 13.0-13.3 (2 AMX cores, 2026-12-06; the weight streamed at ~8.5 GB/s where the GEMVs read ~30). None where
    the points are not those shapes'."""
    if not points or len(points) != len(shapes):
        return None
    K, N = AMX_WIDE_WEIGHT
    at = [i for i, (T, k, n) in enumerate(shapes) if (k, n) == (K, N) and T == AMX_FIT_ROWS[0]]
    if not at:
        return None
    nbytes = K * N * bytes_per_element("int4")
    t = points[at[0]][1]
    return LinearModel(0.0, t / nbytes, None), [(float(nbytes), t)]


def _amx_points(shapes, repeats: int, cold_bytes: int | None = None) -> list[tuple[float, float]]:
    """(multiply-adds, seconds a call) of the AMX GEMM (quant/int4.amx_gemm: kernels' int4_tiled_gemm, its one-copy
    int4 weight converted to bf16 into the tiles as it goes, as Int4Linear.dequantized and a tiled int4 expert's
    projections past their kernel's rows call it) over bf16 rows for weights of `shapes` (T, K, N), each weight's
    calls cycled over copies filling `cold_bytes` (COLD_WEIGHT_BYTES without it) in one huge-page slab
    (_cold_turn), as a prompt meets its weights, the shapes timed interleaved (median_times). gemm_amx/cpu/int4
    and gemm_amx_pack/cpu/int4 are fitted on them together (fit_gemm). Over one weight the caches hold, a
    Mixtral-width projection (14336 x 4096) took 2.97 / 4.02 ms at 16 / 32 rows where cold copies took 4.26 / 5.10
    (2 AMX cores, 2026-12-06): the stream overlaps the conversion only in part. Raises RuntimeError without the
    AMX GEMM (quant/int4.amx_kernels)."""
    from tiered.quant.int4 import GROUP, Int4Linear, quantize_int4

    if amx_kernels() is None:
        raise RuntimeError("no AMX GEMM here (tiered/kernels without AMX, or TIERED_AMX=0)")
    g = torch.Generator().manual_seed(0)
    turns = {}  # (K, N) -> the cycle over that weight's cold copies, shared by its row counts
    calls = []
    for T, K, N in shapes:
        if (K, N) not in turns:
            packed = Int4Linear.from_codes(*quantize_int4(random_normal(N, K, generator=g)), GROUP, None, "tiled").packed
            turns[K, N] = _cold_turn(packed, cold_bytes)
        x = torch.randn(T, K, generator=g).to(torch.bfloat16)
        calls.append(lambda turn=turns[K, N], x=x: amx_gemm(next(turn), None, x))
    return [(float(T * K * N), t) for (T, K, N), t in zip(shapes, median_times(calls, repeats))]


# (K, N) of a small model's fused gate/up (SmolLM2's 576 -> 2 x 1536), timed beside the GEMM fit's weights for
# gemm_amx/cpu/int4: the AMX GEMM drains its accumulators after every K loop, which a narrow K repeats most (at 512
# rows SmolLM2's 3072 x 576 and 576 x 1536 took 1.30 / 0.68 ms where the line of the fit's 1024- and 2048-wide weights
# priced 1.15 / 0.57, and its prompts of 120-960 tokens, packed or alone, were priced 7-22% fast; 2 AMX cores,
# 2026-12-06)
AMX_NARROW_WEIGHT = (576, 3072)
# ... and a big model's FFN projection (Llama-3-8B's and Mixtral's experts' 4096 -> 14336, 33 MB in int4): read from
# memory at few rows, the AMX GEMM streams ~9 GB/s where the 1-2 MB weights' fit (their calls' fixed cost beside a
# conversion of 0.04 ns a byte) priced it 2.5 ms for 3.9-4.1 at 16 rows (2 AMX cores, 2026-12-06)
AMX_WIDE_WEIGHT = (4096, 14336)


def _dequantize_points(shapes, repeats: int) -> list[tuple[float, float]]:
    """(weight elements, seconds a call) of a one-copy int4 weight's dequantization (tiered's tiled layout, into
    the reused buffer in quant/int4.dequantize_dtype(), as Int4Linear.dequantized does before its GEMM) for the
    weights of `shapes` (T, K, N: int4_gemm_shapes') and a 4096 x 2048 one, timed interleaved:
    dequantize/cpu/int4, through the origin. gemm/cpu/int4 is fitted net of it (_net_of_dequantize), so that a
    prompt's dequantized GEMM costs its multiply-adds plus its weight's elements: fitted over multiply-adds alone
    at 2 and 4 x its dequantize rows, where the dequantization is a larger share of each, the key priced SmolLM2's
    projections at 512 rows 18-29% slow (0.64 / 0.50 / 1.49 / 0.86 ms measured, 2 AMX cores, 2026-12-02) and its
    512-token TTFT 15% slow. Raises RuntimeError without the kernels."""
    if not kernels.available():
        raise RuntimeError("tiered/kernels is not built")
    from tiered.kernels.linear import tiled_dequantize
    from tiered.quant.int4 import GROUP, Int4Linear, quantize_int4

    fp32 = dequantize_dtype() == torch.float32
    weights = list(dict.fromkeys([(K, N) for _, K, N in shapes] + [(2048, 4096)]))
    calls, sizes = [], []
    for K, N in weights:
        lin = Int4Linear.from_codes(*quantize_int4(random_normal(N, K)), GROUP, None, "tiled")
        calls.append(lambda lin=lin, N=N: tiled_dequantize(lin.packed, None, fp32=fp32, rows=(0, N)))
        sizes.append(float(K * N))
    return list(zip(sizes, median_times(calls, repeats)))


def _net_of_dequantize(points: list[tuple[float, float]], shapes, dequantize: LinearModel | None
                       ) -> list[tuple[float, float]]:
    """gemm/cpu/int4's (multiply-adds, seconds) points of `shapes` (T, K, N) less each weight's dequantization
    (dequantize/cpu/int4; the points as they are without it), at least a tenth of each: what is left is the GEMM."""
    if dequantize is None:
        return points
    return [(n, max(t - dequantize.beta * K * N, 0.1 * t)) for (n, t), (_, K, N) in zip(points, shapes)]


def _cold_turn(w: torch.Tensor, cold_bytes: int | None):
    """An endless cycle over copies of the CPU weight `w` that fill `cold_bytes` (COLD_WEIGHT_BYTES without it)
    in one huge-page slab (slab_copies): each call then reads a copy no cache holds, as a prompt meets its
    weights."""
    nbytes = w.numel() * w.element_size()
    return itertools.cycle([c for c, in slab_copies((w,), cold_copies(cold_bytes or COLD_WEIGHT_BYTES, nbytes))])


def _gemm_rows_points(dtype: str, shapes, repeats: int, cold_bytes: int | None) -> list[tuple[float, float]]:
    """(weight bytes, seconds a call) of torch's `dtype` GEMM (F.linear, as a prompt's projections and a CPU
    expert past its native rows run) of GEMM_ROWS rows by an N x K weight, cycled over `cold_bytes` of
    copies (beyond the last-level cache; 64 MiB without it) in one huge-page slab (slab_copies), the
    shapes timed interleaved (median_times). What a small-row GEMM costs beyond its multiply-adds: oneDNN
    reads (and packs) the weight at every call. On 2 Zen 4 cores a 3584 x 1024 bf16 weight took 321 us
    at 8 rows, 1.97x its bytes at the DRAM rate, and each row more ~7.5 us (64 rows: 713 us, where
    max(compute, stream) priced 508). Raises ValueError for a dtype torch does not GEMM (fp32, bf16,
    fp16)."""
    try:
        td = torch_dtype(dtype)
    except ConfigError:
        raise ValueError(f"gemm_rows times torch's GEMM in fp32, bf16 or fp16, not {dtype!r}") from None
    g = torch.Generator().manual_seed(0)
    calls, sizes = [], []
    for N, K in shapes:
        w = random_normal(N, K, generator=g).to(td)
        nbytes = N * K * w.element_size()
        turn = _cold_turn(w, cold_bytes)
        x = torch.randn(GEMM_ROWS, K, generator=g).to(td)
        calls.append(lambda turn=turn, x=x: linear(x, next(turn)))
        sizes.append(float(nbytes))
    return list(zip(sizes, median_times(calls, repeats)))


# convert/cpu/bf16's weights (N, K): fp32 copies under glibc's largest mmap threshold (32 MiB: freed, they come back
# from the heap), and convert_big/cpu/bf16's: past it (every call maps fresh pages and faults them in)
CONVERT_SHAPES = ((1536, 576), (1536, 1536), (3584, 1024), (3072, 2048))
CONVERT_BIG_SHAPES = ((4096, 2048), (4096, 4096), (14336, 4096))


def _convert_points(shapes, repeats: int, cold_bytes: int | None) -> list[tuple[float, float]]:
    """(elements, seconds a call) of a bf16 weight's conversion to fp32 (`w.float()`: a fresh fp32 tensor each
    call), as hardware/cpu_gemm.linear runs before each of its fp32 GEMMs on a CPU without a bf16 GEMM, over
    weights of `shapes` (N, K), copies cycled over `cold_bytes` (64 MiB without it) in one huge-page slab, timed
    interleaved (median_times). The planner prices a bf16 GEMM there as the fp32 GEMM plus this
    (planner/cpu_predict.torch_gemm_time): timed as one, through that helper, the conversion (per weight
    element) and the GEMM (per multiply-add) fitted one line of R^2 0.34-0.95 on 2 Zen 3 cores, and 512-token
    bf16 prompts priced 4-67% slow, profile to profile (2026-11-30). Two keys, as the fp32 copy's size decides
    where it comes from: under 32 MiB (CONVERT_SHAPES) the heap gives back the last call's pages, ~0.15-0.3 ns
    an element there; past it (CONVERT_BIG_SHAPES) every call maps and faults in fresh ones, ~1.4 ns. One line
    over both had priced a Mixtral-width expert's conversion 8x slow."""
    g = torch.Generator().manual_seed(0)
    calls, sizes = [], []
    for N, K in shapes:
        w = random_normal(N, K, generator=g).to(torch.bfloat16)
        turn = _cold_turn(w, cold_bytes)
        calls.append(lambda turn=turn: next(turn).float())
        sizes.append(float(N * K))
    return list(zip(sizes, median_times(calls, repeats)))


def _expert_rows_points(repeats: int, cold_bytes: int | None) -> list[tuple[float, float]]:
    """(multiply-adds, seconds a call) of tiered's native bf16 SwiGLU expert (ext.bf16_expert_forward,
    what a CPU expert of a few rows runs: quant/experts.ExpertFormat.forward) at 1, 2, 4 and 8 rows of a
    1024 x 3584 expert (22 MiB), copies cycled over `cold_bytes` (64 MiB without it). The slope is what each
    row beyond the first costs: the weights stream once a call whatever the rows, but each row's
    multiply-adds come on top (on 2 Zen 4 cores a Mixtral-width expert took 8.5 ms at 1 row and 17.6 at 8).
    Raises RuntimeError without the kernels."""
    ext = kernels.load()
    if ext is None:
        raise RuntimeError("tiered/kernels is not built")
    D, F = 1024, 3584
    slots = slab_copies(random_expert(D, F, torch.Generator().manual_seed(0)),
                        cold_copies(cold_bytes or COLD_WEIGHT_BYTES, 3 * D * F * 2))
    return _expert_row_points(slots, D, F, (1, 2, 4, 8), lambda x, slot: ext.bf16_expert_forward(*slot, x), repeats)


def _expert_row_points(slots, D: int, F: int, row_counts, run, repeats: int) -> list[tuple[float, float]]:
    """(multiply-adds, seconds a call) of `run(x, slot)` on a D x F expert at each of `row_counts` rows (x bf16
    [rows, D]), each call on the next of `slots` (cold copies), the row counts timed interleaved (median_times,
    as _gemm_points' CPU shapes): the expert_rows keys' points."""
    calls = []
    for rows in row_counts:
        x = torch.randn(rows, D).to(torch.bfloat16)
        turn = itertools.cycle(slots)
        calls.append(lambda turn=turn, x=x: run(x, next(turn)))
    return [(float(rows * 3 * D * F), t) for rows, t in zip(row_counts, median_times(calls, repeats))]


EXPERT_Q8_ROWS = (2, 4, 8)  # expert_rows/cpu/int4q8's rows: one group each (NATIVE_ROWS), q8 from 2 rows
# ... of experts this wide (hidden, intermediate: OLMoE's, between Qwen3-30B-A3B's 2048 x 768 and DeepSeek-V2-Lite's
# 2048 x 1408), this many in one layer call (ExpertFormat.forward_group, as a prompt's MoE layer runs them)
EXPERT_Q8_SHAPE, EXPERT_Q8_GROUP = (2048, 1024), 16


def _expert_rows_q8_points(repeats: int, cold_bytes: int | None, row_counts: tuple[int, ...] = EXPERT_Q8_ROWS,
                           kind: str = "int4") -> list[tuple[float, float]]:
    """(multiply-adds, seconds an expert) of tiled `kind` experts on int8 activations (quant/experts.ExpertFormat,
    layout "tiled", batch_act "q8"; int4's zeros exact: a GGUF's Q4_0 experts as the engine keeps them) at
    EXPERT_Q8_ROWS rows each, EXPERT_Q8_GROUP experts of EXPERT_Q8_SHAPE in one layer call (forward_group: the
    native MoE call a prompt's rows and a batched step run), copies cycled over `cold_bytes` (64 MiB without it)
    in a slab; a call's time over its experts. A prompt's int4 expert runs its rows in such groups
    (cpu_predict.prompt_expert_time): the slope is each row's cost on top of the weights' stream, its three
    projections and the SwiGLU between them. Timed before (profiler 31-44) as one 1024 x 3584 expert a call: on
    2 Zen 4 cores that slope was 4.1 ps a multiply-add where a Qwen3-30B-A3B-width layer call's rows cost 2.7, and
    the 8-layer model's 512-token prompt was priced 1.74 s against 1.24 measured (its MoE blocks 143 ms a layer
    priced, 95 measured; 2026-12-03). Before that the 4096 x 4096 projection's decode_rows/cpu/int4q8 had stood
    for it: on 2 Zen 3 cores a Qwen3-30B-A3B-width expert's rows cost 9.1 ps a multiply-add (0.117 ms at 1 row,
    0.417 at 8, 1.53 at 32 in groups of 8) where that key's slope was 5.7 (2026-11-30). `kind`: the experts' kind
    (ExpertFormat name), "int4" as a Q4_0 file's (zeros exact), or a GGUF file's other kinds as stored, int8-g32
    (Q8_0) and the k-quants (q6k, q5k, iq4xs: expert_rows/cpu/<kind>q8, profiler 70), whose rows of 2+ read int8
    too. Raises RuntimeError without the kernels."""
    if not kernels.available():
        raise RuntimeError("tiered/kernels is not built")
    from tiered.quant.experts import ExpertFormat

    D, F = EXPERT_Q8_SHAPE
    fmt = ExpertFormat(kind, ((F, D), (F, D), (D, F)), "tiled", batch_act="q8", exact_zeros=kind == "int4")
    first = fmt.empty()
    if kind in GGUF_FORMAT:  # random blocks of the file format (no fit: the kernels' speed ignores the values)
        import numpy as np

        from tiered.bench.gguf_dense import random_k_blocks
        from tiered.quant.experts import kquant_segments

        rng = np.random.default_rng(0)
        fmt.encode([kquant_segments(kind, [torch.from_numpy(random_k_blocks(rng, N, K, GGUF_FORMAT[kind], 0.02))])
                    for N, K in fmt.shapes], first)
    else:
        fmt.quantize(random_expert(D, F, torch.Generator().manual_seed(0)), first)
    slots = slab_copies(first, max(EXPERT_Q8_GROUP, cold_copies(cold_bytes or COLD_WEIGHT_BYTES, fmt.nbytes)))
    G, calls = EXPERT_Q8_GROUP, []
    for rows in row_counts:
        x = torch.randn(rows * G, D).to(torch.bfloat16)
        bounds = [i * rows for i in range(G + 1)]
        turn = itertools.cycle(slots)
        calls.append(lambda x=x, bounds=bounds, turn=turn: fmt.forward_group(x, [next(turn) for _ in range(G)], bounds))
    return [(float(rows * 3 * D * F), t / G) for rows, t in zip(row_counts, median_times(calls, repeats))]


EXPERT_GROUP_ROWS = (8, 16, 24, 32)  # expert_groups/cpu/int4q8's rows: 1-4 groups of NATIVE_ROWS an expert
# The expert kinds besides int4 whose rows expert_rows/cpu/<kind>q8 times (profiler 70): a Qwen3-30B-A3B-width q6k /
# iq4xs expert at 8-64 rows had been priced 25-38% / 14-39% slow by the dense copies' decode_rows keys, and the
# 8-layer Q6_K file's 512-token TTFT 2.34 s for 1.36 (2 Zen 4 cores, 2026-12-08)
EXPERT_ROWS_KINDS = ("int8-g32", "q6k", "q5k", "iq4xs")


def _expert_groups_int4q8_points(repeats: int, cold_bytes: int | None) -> list[tuple[float, float]]:
    """(multiply-adds, seconds an expert) as _expert_rows_q8_points times them, at EXPERT_GROUP_ROWS rows an
    expert: one to four groups of NATIVE_ROWS rows, each group streaming the expert's weights again
    (ExpertFormat.grouped). The slope is what each row past the first group costs, its group's share of a weight
    stream included: the second and later streams of an expert the cache holds come at the cache's rate, not the
    memory's. On 2 Zen 4 cores a Qwen3-30B-A3B-width expert's groups past the first streamed in ~0.073 ms where its
    first took 0.118 from memory, and pricing every group at the first's rate priced its 32-row prompt calls
    0.92 ms against 0.73 measured (2026-12-03). Raises RuntimeError without the kernels."""
    return _expert_rows_q8_points(repeats, cold_bytes, EXPERT_GROUP_ROWS)


# Experts the native bf16 expert kernel is timed on beyond the cache (expert_dram/cpu/bf16): (hidden,
# intermediate) of a small MoE's, Mixtral's at half width, and Mixtral's (22, 88 and 336 MiB).
EXPERT_DRAM_SHAPES = ((1024, 3584), (2048, 7168), (4096, 14336))


def _expert_dram_points(repeats: int, cold_bytes: int, shapes=EXPERT_DRAM_SHAPES,
                        probe: Probe | None = None) -> list[tuple[float, float]]:
    """(weight bytes, seconds a call) of tiered's native bf16 SwiGLU expert at one row (a decode step's CPU
    expert: quant/experts.ExpertFormat.forward), for experts of `shapes` (hidden, intermediate), each
    cycled over copies filling `cold_bytes` (beyond the last-level cache) carved from one HostSlab (page-
    aligned, on huge pages where the OS gives them) as the runtime's CPU experts are
    (memory/expert_store). The shapes are timed interleaved (median_times). Why a key of its own: on the
    H100's 16-core host the decode GEMV's DRAM rate (gemv_dram/cpu/bf16, 8-32 MiB matrices) read 69 GB/s
    where a Mixtral expert streamed ~90 (its weights pinned: 98.7; pageable 82.8), so the plans priced a
    CPU expert 5.1 ms against 3.9 measured and copied misses a CPU would have finished first.

    `probe` (Probe), where given, is timed among the shapes (its median into probe.last), as _gemm_points
    does for the GEMV keys: the key carries the memory's speed of its minutes (meta["probe"]), and
    planning scales it by the speed now (planner/auto.bandwidth_now). On 2 Zen 3 cores (2026-12-01) a
    profile timed it at 20.4 GB/s in a slow minute, and the all-in-RAM MoE's decode, 2 x 22 MiB experts
    a layer, was priced 19.9 ms a token against 14.9-17.5 measured minutes later: only a slower memory
    moved it (the probes' median ratio).

    Raises RuntimeError without the kernels."""
    ext = kernels.load()
    if ext is None:
        raise RuntimeError("tiered/kernels is not built")
    g = torch.Generator().manual_seed(0)
    calls, sizes = [], []
    for D, ffn in shapes:
        nbytes = 3 * D * ffn * 2
        slots = slab_copies(random_expert(D, ffn, g), cold_copies(cold_bytes, nbytes))
        turn, x = itertools.cycle(slots), torch.randn(1, D).to(torch.bfloat16)
        calls.append(lambda turn=turn, x=x: ext.bf16_expert_forward(*next(turn), x))
        sizes.append(float(nbytes))
    return list(zip(sizes, probed_times(calls, repeats, probe)))


def _host_share(cold_bytes: int, seconds: float, hidden: int = 4096, ffn: int = 14336,
                device: str = "cuda") -> dict:
    """hardware/host_share.host_share on this machine: Mixtral-width bf16 experts (`hidden` x `ffn`) in
    page-locked memory, as an offloading engine holds its CPU experts, enough of them to exceed
    `cold_bytes` (at least 2), computed at one token by the calling thread while another copies one
    expert-sized page-locked buffer to `device` again and again. On a machine without CUDA (tests) pass
    device="cpu": host copies stand in, from ordinary memory."""
    from tiered.hardware.host_share import CpuLoop, host_share

    cuda = device == "cuda"
    nbytes = 3 * hidden * ffn * 2
    first = random_expert(hidden, ffn, torch.Generator().manual_seed(0))
    experts = [tuple(t.pin_memory() if cuda else t.clone() for t in first) for _ in range(cold_copies(cold_bytes, nbytes))]
    cpu = CpuLoop(experts, hidden)
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, pin_memory=cuda).fill_(1)
    dst = torch.empty_like(src, device=device)
    cpu.rate(min(seconds, 0.1))  # warm-up: pages, kernels, clocks
    return host_share(cpu, src, dst, seconds)


def _gemv_graph_points(dtype: str, shapes, repeats: int) -> list[tuple[float, float]]:
    """(weight bytes, seconds a call) of `dtype` GEMVs (1 x K by N x K, F.linear) replayed in a captured
    CUDA graph, as a graphed decode step runs its projections: no host issues them, so what is left
    beyond the bytes is the kernel's own start and tail. Each graph holds GEMV_GRAPH_CALLS calls over
    enough weight copies to exceed twice the GPU's L2 (a decode step reads each weight once), and a
    point is one replay's median time over its calls. The eager gemv/gpu key times back-to-back calls
    the host issues; on the H100 its 18 us intercept was the host's, and priced a whole-step graph of
    8 Llama-3-8B layers at 3.4 ms a step where it ran in 2.4 (the bytes alone priced 1.9)."""
    from tiered.memory import sizes

    td = sizes.torch_dtype(dtype)
    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 * MiB)
    points = []
    for _, K, N in shapes:
        nbytes = int(K * N * sizes.bytes_per_element(dtype))
        copies = max(1, min(GEMV_GRAPH_CALLS, -(-2 * l2 // nbytes)))
        ws = [torch.randn(N, K, device="cuda", dtype=td) * 0.02 for _ in range(copies)]
        x = torch.randn(1, K, device="cuda", dtype=td)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up off the default stream, as capture requires
            for w in ws:
                F.linear(x, w)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = [F.linear(x, ws[i % copies]) for i in range(GEMV_GRAPH_CALLS)]
        t = median_time(graph.replay, repeats, torch.cuda.synchronize)
        points.append((float(nbytes), t / GEMV_GRAPH_CALLS))
        del graph, outs, ws
    return points


GEMV_GRAPH_CALLS = 16  # GEMVs in one captured graph (gemv_graph/gpu/<dtype>)


def _attn_points(device: str, dtype: str, shapes, sync, repeats: int):
    dev = "cuda" if device == "gpu" else "cpu"
    td = torch_dtype(dtype)
    points = []
    for bh, S, hd in shapes:  # bh = sequences x heads, S cached tokens, hd head dim
        q = torch.randn(bh, 1, hd, device=dev, dtype=td)
        k = torch.randn(bh, S, hd, device=dev, dtype=td)
        v = torch.randn(bh, S, hd, device=dev, dtype=td)
        t = median_time(lambda: torch.bmm(torch.softmax(torch.bmm(q, k.transpose(1, 2)), -1), v), repeats, sync)
        points.append((2 * bh * S * hd, t))
    return points


ATTN_DECODE_LAYERS = 16  # layers of attn_decode's model: its KV bytes, not the step's fixed costs, set the slope
ATTN_DECODE_CONTEXTS = (2048, 4096, 8192)  # cached positions a timed step reads
ATTN_DECODE_SLOTS = 2  # sequences whose caches the timed steps alternate between


def _attn_decode_points(kv: str, repeats: int) -> list[tuple[float, float]]:
    """(KV-cache bytes a decode step reads, seconds) of the native CPU decode step (runtime/
    cpu_decode, tiered/kernels) over a cache in `kv` ("fp32" or "bf16", beside fp32 activations):
    a model of ATTN_DECODE_LAYERS layers of attention only in effect (12 query heads on 4 KV heads of
    64, SmolLM2's group of 3 and head size; hidden 128, a tiny MLP and vocabulary: ~5 MiB of weights)
    decoding one token after each of ATTN_DECODE_CONTEXTS cached positions (32-128 MiB of bf16 KV a
    step), its calls alternating between ATTN_DECODE_SLOTS sequences' caches (models/layers.KVCache,
    as the engine holds them), so that a step's keys and values were last read 1-2 other caches ago.
    The slope is what the step's attention costs a KV byte: split over the threads and prefetched,
    but below the memory's rate. On 2 AMX cores (2026-11-29) SmolLM2's default engine took 2.8 us a
    position over its 30 layers (8.1 GB/s against ~20 for its weights) and this key read 11-12 (R^2 0.99).
    The key's earlier model (2 layers of 8 heads on 2, 0.25-4 MiB a step, cycled over 1 GiB of
    caches) timed the step's fixed costs and page walks more than its attention (R^2 -133 in one
    quick profile): it priced SmolLM2's default decode at 640 positions 2.5x slow."""
    from tiered.checkpoint.model_config import ModelConfig
    from tiered.memory import sizes
    from tiered.models.layers import KVCache, quantize_kv_rows
    from tiered.runtime.cpu_decode import CPUDecodeStep

    calls = []
    cfg = ModelConfig(model_type="llama", vocab_size=64, hidden_size=128, intermediate_size=64,
                      num_hidden_layers=ATTN_DECODE_LAYERS, num_attention_heads=12, num_key_value_heads=4,
                      head_dim=64)
    for ctx in ATTN_DECODE_CONTEXTS:
        model = _random_model(cfg, ctx + 1)
        step = CPUDecodeStep(model, native=True)
        cache = KVCache(cfg, ATTN_DECODE_SLOTS, ctx + 1, sizes.kv_torch_dtype(kv))
        for t in (cache.k, cache.v):
            if cache.quantized:  # int8 rows with their scales (models/layers.quantize_kv_rows)
                t.copy_(quantize_kv_rows(fill_random_(torch.empty(*t.shape[:-1], cfg.head_dim), 1.0)))
            else:
                fill_random_(t, 1.0)
        ids, pos = torch.tensor([[1]]), torch.tensor([[ctx]])
        turn = itertools.cycle([torch.tensor([s]) for s in range(ATTN_DECODE_SLOTS)])
        calls.append(lambda step=step, ids=ids, pos=pos, turn=turn, cache=cache: step(ids, pos, next(turn), cache))
    with torch.inference_mode():  # the contexts timed interleaved, as _gemm_points' CPU shapes
        times = median_times(calls, max(5, repeats))
    # n: the KV bytes of the cached positions each step reads
    return [(float(sizes.kv_cache_bytes(cfg, 1, ctx, kv)), t) for ctx, t in zip(ATTN_DECODE_CONTEXTS, times)]


ATTN_ROWS_LAYERS = 4  # layers of attn_rows' model
ATTN_ROWS_TOKENS = (256, 512, 1024)  # prompt rows a timed step runs (Plan.mixed_rows reaches the prefill chunk)


def _attn_rows_model(kv: str, slots: int, positions: int):
    """(CPUDecodeStep, KVCache of `slots` x `positions` in `kv`) of _attn_rows_points' attention-only model (12
    query heads on 4 KV heads of 64, hidden 64, ATTN_ROWS_LAYERS layers) in the native step."""
    from tiered.checkpoint.model_config import ModelConfig
    from tiered.models.layers import KVCache, set_prompt_attention
    from tiered.runtime.cpu_decode import CPUDecodeStep

    cfg = ModelConfig(model_type="llama", vocab_size=64, hidden_size=64, intermediate_size=64,
                      num_hidden_layers=ATTN_ROWS_LAYERS, num_attention_heads=12, num_key_value_heads=4, head_dim=64)
    model = _random_model(cfg, positions)
    if kv == "bf16":  # prompts over a bf16 cache attend in bf16 (Plan.dtypes["prompt_attention"]): AMX where it runs
        set_prompt_attention(model, torch.bfloat16)
    return CPUDecodeStep(model, native=True), KVCache(cfg, slots, positions, kv_torch_dtype(kv))


def attention_rows_call(kv: str, tokens: int, causal: bool = True) -> Callable[[], object]:
    """One native step over `tokens` prompt rows of _attn_rows_points' model (a cache in `kv`, the head on the last
    row): one sequence's causal rows, or with `causal` False each row its own sequence at position 0 (one key to
    attend to). Call it under torch.inference_mode. Raises RuntimeError without the kernels."""
    if not kernels.available():
        raise RuntimeError("tiered/kernels is not built")
    step, cache = _attn_rows_model(kv, 1, tokens) if causal else _attn_rows_model(kv, tokens, 1)
    ids, last = torch.full((tokens, 1), 1), torch.tensor([tokens - 1])
    pos = torch.arange(tokens).unsqueeze(1) if causal else torch.zeros(tokens, 1, dtype=torch.long)
    slots = torch.zeros(tokens, dtype=torch.long) if causal else torch.arange(tokens)
    return lambda: step(ids, pos, slots, cache, rows=last)


def _attn_rows_points(kv: str, repeats: int) -> list[tuple[float, float]]:
    """(attention multiply-adds a layer, seconds a layer) of a prompt of ATTN_ROWS_TOKENS tokens run as rows of
    the native CPU decode step (LLM._forward_mixed: Plan.mixed_rows) over a cache in `kv` ("fp32" or "bf16"): an
    attention-only model in effect (attention_rows_call: 12 query heads on 4 KV heads of 64, hidden 64,
    ATTN_ROWS_LAYERS layers, the head on the last row), less the same rows each attending to one key (every row its
    own sequence at position 0): what the rows' causal attention adds. Multiply-adds: 2 x heads x head_dim a (row,
    position) pair of each row's causal prefix (op_time.prefill_attention_pairs). The slope is the native
    attention's rate over a prompt's own keys, which the cache holds: on 2 Zen 5 cores SmolLM2's 1024-token prompt
    spent ~185 of its 482 ms as rows there, where torch's attention (attn_prefill) ran the same pairs in ~300
    (2026-12-01); priced at attn_decode's rate per cached byte (a decode step's keys from DRAM) the rows had cost
    1.7x their time. Raises RuntimeError without the kernels."""
    calls = [attention_rows_call(kv, T, causal) for T in ATTN_ROWS_TOKENS for causal in (True, False)]
    with torch.inference_mode():  # the lengths and their references timed interleaved, as _gemm_points' shapes
        times = median_times(calls, max(3, repeats))
    return [(float(2 * 12 * 64 * prefill_attention_pairs(T, 0)),
             max(0.0, times[2 * i] - times[2 * i + 1]) / ATTN_ROWS_LAYERS) for i, T in enumerate(ATTN_ROWS_TOKENS)]


def _attn_prefill_points(dtype: str, shapes, repeats: int):
    """(MACs, seconds) of a prefill forward's attention on the CPU, as models/layers.attend runs it (torch's
    scaled_dot_product_attention, or a whole bf16 prompt's on tiered's AMX kernel where it runs), per shape (heads, T queries, S keys, head_dim): S == T a whole prompt
    (is_causal: attn_prefill), S > T a chunk after S - T cached tokens (engine/llm.LLM._prefill), whose rows
    see the past and their own prefix through an explicit mask (attn_prefill_past). MACs = 2 * heads *
    head_dim * op_time.prefill_attention_pairs: the causal half of a whole prompt, every pair of a chunk (the
    kernel computes every block under a mask). On 2 Zen 4 cores torch's flash kernel ran a SmolLM2 prompt's
    attention at several times the GEMM fit's time per MAC, which the prefill prediction had used; on 2 Zen 3
    cores the chunks ran ~47 GMAC/s where 512-token prompts ran ~17 (2026-11-30): priced by the causal key, a
    4096-token SmolLM2 prompt in chunks of 1024 was 37% slow."""
    from tiered.models.layers import attend

    td = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    points = []
    for heads, T, S, hd in shapes:
        q = torch.randn(1, heads, T, hd, dtype=td)
        k, v = (torch.randn(1, heads, S, hd, dtype=td) for _ in range(2))
        mask = None if S == T else torch.ones(T, S, dtype=torch.bool).tril(S - T)
        t = median_time(lambda: attend(q, k, v, mask, mask is None, hd ** -0.5, False, S - T), repeats, lambda: None)
        points.append((2 * heads * hd * prefill_attention_pairs(T, S - T), t))
    return points


def _memory_points(device: str, sizes_mib, sync, repeats: int, copy: bool):
    """(bytes, seconds) of a read (sum) or a copy of each size, timed interleaved (median_times). CPU buffers
    come from hardware/budget.host_empty (huge pages where the OS gives them), as the engine's CPU weights,
    experts and staging sit (move_to_huge_pages, HostSlab): these keys floor every CPU GEMV's price
    (op_time.memory_time), and on 4 KiB pages the 2-core AMX VM's reads ran 16-18 GB/s against 26 on huge
    pages (2026-11-29), below the bf16 decode kernel's own 19-27."""
    from tiered.hardware.budget import host_empty

    dev = "cuda" if device == "gpu" else "cpu"
    fns = []
    for mib in sizes_mib:
        n = mib * MiB // 4
        src = torch.ones(n, device=dev) if dev == "cuda" else host_empty((n,), torch.float32).fill_(1.0)
        if copy:
            dst = torch.empty_like(src) if dev == "cuda" else host_empty((n,), torch.float32)
            fns.append(lambda s=src, d=dst: d.copy_(s))
        else:
            fns.append(lambda s=src: s.sum())
    return [(mib * MiB, t) for mib, t in zip(sizes_mib, median_times(fns, repeats, sync))]


def _launch_time(device: str, sync) -> float:
    dev = "cuda" if device == "gpu" else "cpu"
    a, b = torch.ones(1, device=dev), torch.ones(1, device=dev)
    n = 2000
    samples = []
    for _ in range(5):
        sync()
        t0 = time.perf_counter()
        for _ in range(n):
            torch.add(a, b, out=a)
        samples.append((time.perf_counter() - t0) / n)  # enqueue cost per kernel (no sync per call)
        sync()
    return float(np.median(samples))


def _task_overhead() -> float:
    """Seconds to hand a no-op task to an executor stream and get its result back (runtime/task)."""
    from tiered.runtime.executor import Executor

    ex = Executor(None)
    try:
        samples = []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(200):
                ex.submit("cpu", lambda: None).result()
            samples.append((time.perf_counter() - t0) / 200)
    finally:
        ex.close()
    return float(np.median(samples))


class _NoCheckpoint:
    """Stands in for a checkpoint when installing decode weights on a randomly initialized model."""

    def has(self, name: str) -> bool:
        return False


class _RandomBlocks:
    """Stands in for a GGUF file whose every weight of `model` ([N, K] each, K % 256 == 0) is stored in `block_format`
    ("Q6_K", "Q5_K", "IQ4_XS"): random blocks (tiered/bench/gguf_dense.random_k_blocks; the kernels' speed does not
    depend on the values), so that install_decode_weights' "auto" gives the model the decode copies as stored it
    gives such a file's tensors (quant/kquant.py). Weights of one shape share one array of blocks (each copy is
    repacked into memory of its own)."""

    def __init__(self, model, block_format: str) -> None:
        import numpy as np

        self.shapes = {n: tuple(t.shape) for n, t in model.named_parameters() if t.dim() == 2}
        self.format, self.rng, self.made = block_format, np.random.default_rng(0), {}

    def has(self, name: str) -> bool:
        return name in self.shapes

    def handle(self, name: str):
        from types import SimpleNamespace

        from tiered.bench.gguf_dense import random_k_blocks

        N, K = self.shapes[name]

        def blocks():
            if (N, K) not in self.made:
                self.made[N, K] = random_k_blocks(self.rng, N, K, self.format, 0.02)
            return self.made[N, K]
        return SimpleNamespace(format=self.format, shape=(N, K), blocks=blocks)


def _decode_step_points(repeats: int, dtype: str = "fp32", device: str = "cpu",
                        graphed: str | None = None) -> list[tuple[float, float]]:
    """(layers, seconds) of one decode step of tiny dense tiered models (hidden 64) with 2..8 layers.

    The weights are so small that what is timed is the fixed cost of a decode step and of each
    layer in tiered's model code (module calls, small ops, KV-cache writes): runtime/decode_step.
    On the CPU that is the engine's lean decode step (runtime/cpu_decode.CPUDecodeStep, native when
    tiered/kernels is built, as the planner will then choose): fp32 activations, weights read in
    `dtype`; on CUDA
    (runtime/decode_step_gpu) the model is cast to `dtype` as the engine does there, and each step
    ends with the device synchronized: the host's cost of issuing the ops, or the GPU's if slower.
    With `graphed` (CUDA) the step runs through runtime/graphs: "piecewise"
    (runtime/decode_step_graphed_gpu, PiecewiseGraphs, as an offloading plan's does: each layer's
    attention one graph replay, its MLP eager between) or "whole" (runtime/decode_step_graph_gpu,
    DecodeGraphs: the step one replay, as a model wholly on the GPU decodes).

    Raises:
        RuntimeError: `graphed` and the graphs could not be captured (the reason is in the message).
    """
    from tiered.checkpoint.model_config import ModelConfig
    from tiered.models.layers import KVCache, Rotary
    from tiered.quant.linear import install_decode_weights
    from tiered.runtime.cpu_decode import CPUDecodeStep

    cuda = device == "cuda"
    td = torch_dtype(dtype) if dtype in DENSE_FORMATS else torch.float32
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    points = []
    for layers in (2, 4, 8):
        cfg = ModelConfig(model_type="llama", vocab_size=64, hidden_size=64, intermediate_size=128,
                          num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
        model = _random_model(cfg, 64)
        if cuda:  # as the engine: weights in `dtype`, RoPE tables fp32, q/k/v and gate/up fused
            from tiered.runtime.install import fuse_projections

            model = model.to("cuda", td)
            model.rotary = Rotary(cfg, 64).to("cuda")
            fuse_projections(model)
        elif dtype != "fp32":  # the engine's CPU decode path: fp32 activations, weights read in `dtype`
            install_decode_weights(model, _NoCheckpoint(), dtype, 8)
        dev = "cuda" if cuda else "cpu"
        cache = KVCache(cfg, 1, 64, td if cuda else torch.float32, dev)
        slots, ids, pos = (torch.tensor([0], device=dev), torch.tensor([[1]], device=dev),
                           torch.tensor([[32]], device=dev))
        with torch.inference_mode():
            model(torch.ones(1, 32, dtype=torch.long, device=dev), torch.arange(32, device=dev).unsqueeze(0), slots, cache)
            # the engine's CPU decode path is the lean step (runtime/cpu_decode), CUDA's the modules
            step = model if cuda else CPUDecodeStep(model, native=kernels.available())
            if graphed:
                from tiered.hardware.cuda import CudaAccelerator
                from tiered.runtime.graphs import DecodeGraphs, PiecewiseGraphs

                kind = {"whole": DecodeGraphs, "piecewise": PiecewiseGraphs}[graphed]
                graphs = kind(model, CudaAccelerator(), None)
                step = lambda i, p, s, c: graphs(i, p, s, c, 33, True)  # noqa: E731
                step(ids, pos, slots, cache)
                if graphs.disabled is not None:
                    raise RuntimeError(f"{graphed} graphs: {graphs.disabled}")
            t = median_time(lambda: step(ids, pos, slots, cache), repeats, sync)
        points.append((float(layers), t))
    return points


# runtime/decode_layer/int4's dense layers (hidden, intermediate, heads, KV heads; head_dim 64): SmolLM2-135M's
# widths up to twice them (2.2, 3.9 and 8.8 MB of int4 a layer), where a call's start and end weigh most
DECODE_LAYER_SHAPES = ((576, 1536, 9, 3), (768, 2048, 12, 4), (1152, 3072, 18, 6))
DECODE_LAYER_RUN = 4  # layers a timed call of the native step runs: its own cost (the binding, buffers) is a 4th's
# runtime/decode_layer/<k-quant>'s (q6k, q5k, iq4xs): Qwen2.5-1.5B's, Llama-3.2-1B's and 3B's widths (21, 50 and 72
# MB of Q6_K a layer; every width a multiple of 256, a k-quant block, where 576 and 1152 are not): the k-quant files
# people run are 1B and up, and on 2 Zen 4 cores (2026-12-07) the step streamed IQ4_XS layers 768 to 1536 wide at
# 17-24 GB/s, 2048 to 4096 wide at 26-32 (the kernels' per-row costs), which op_time.layer_shape follows by a layer's
# bytes between these points
KQUANT_LAYER_SHAPES = ((1536, 4096, 24, 8), (2048, 8192, 32, 8), (3072, 8192, 48, 16))


def _dense_config(shape, layers: int):
    """The ModelConfig of `layers` dense Llama layers of `shape` (hidden, intermediate, heads, KV heads; heads of
    64; a vocabulary of 64): DECODE_LAYER_SHAPES' models."""
    from tiered.checkpoint.model_config import ModelConfig

    D, F_, H, Hkv = shape
    return ModelConfig(model_type="llama", vocab_size=64, hidden_size=D, intermediate_size=F_, num_hidden_layers=layers,
                       num_attention_heads=H, num_key_value_heads=Hkv, head_dim=64)


def _dense_decode_step(cfg, positions: int, distinct: int | None = None, fmt: str = "int4"):
    """(model, CPUDecodeStep) of the dense model `cfg` with the engine's int4 decode copies (tiled, on int8 rows,
    q/k/v and gate/up fused) as its projections' one copy (a GGUF's), in one huge-page arena, in the native step;
    rotary tables for `positions`. `distinct`: quantize that many layers only and make the others copies of them
    (copy.deepcopy: memory of their own), for timings that only need the layers' bytes apart (_decode_layer_points:
    quantizing its 40 layers in fp32 took ~3 s of the quick profile). `fmt`: "int8-g32" for the int8 copies per
    group of 32 instead (Int8G32Linear: a GGUF Q8_0 file's, --decode-weights int8's), a KQUANT_KINDS one for the
    GGUF k-quant copies as stored (random blocks, `_RandomBlocks`; every width a multiple of 256)."""
    import copy
    from dataclasses import replace

    from tiered.quant.linear import PhaseLinear, install_decode_weights
    from tiered.runtime.cpu_decode import CPUDecodeStep

    layers = cfg.num_hidden_layers
    distinct = min(distinct or layers, layers)
    kquant = fmt in KQUANT_KINDS  # a GGUF file's k-quant tensors, "auto" keeps them as stored: no dense values
    model = _random_model(replace(cfg, num_hidden_layers=distinct), positions, linears=not kquant)
    if kquant:
        install_decode_weights(model, _RandomBlocks(model, GGUF_FORMAT[fmt]), "auto", 8, dense=False,
                               int4_layout="tiled", batch_act="q8")
    else:
        install_decode_weights(model, _NoCheckpoint(), {"int8-g32": "int8"}.get(fmt, fmt), 8, int4_layout="tiled",
                               batch_act="q8")
    for m in model.modules():  # one copy, as the engine keeps a GGUF's projections: the int4 copies alone
        if isinstance(m, PhaseLinear):
            m.weight = None
    for i in range(distinct, layers):  # before any kernel holds them (kernels do not copy)
        layer = copy.deepcopy(model.model.layers[i % distinct])
        layer.self_attn.layer_idx = i
        model.model.layers.append(layer)
    model.config = cfg
    move_to_huge_pages(model)
    return model, CPUDecodeStep(model, native=True)


STEP_ROWS_TOKENS = (64, 128, 256)  # rows of runtime/step_rows/int4's timed steps


def _step_rows_points(repeats: int, shape=DECODE_LAYER_SHAPES[0]) -> list[tuple[float, float]]:
    """(rows x (hidden + intermediate), seconds a layer) of the native CPU decode step's layer code at STEP_ROWS_TOKENS
    rows (a prompt run as rows of the step: Plan.mixed_rows) over DECODE_LAYER_RUN dense layers of `shape` (SmolLM2's
    widths) with the engine's int4 decode copies on int8 rows (tiled, q/k/v and gate/up fused), each row its own
    sequence at position 0 (one key to attend to), less the same rows' four projections timed alone through their
    kernels (from STEP_AMX_ROWS rows on a CPU with AMX: the AMX GEMM, as the step runs them; meta["step_rows_amx"]),
    interleaved with the steps: runtime/step_rows/int4, fitted through the origin. What the rows cost
    beyond their matmuls and attention: norms, RoPE, SiLU, the rows' int8 rounding, the parallel regions' waits.
    On 2 Zen 5 cores SmolLM2's 1024-token prompt as rows spent ~34 ms there (1.1 us a row and layer) of 441,
    which the rows' price had left out: its TTFT at 512 tokens priced 26% fast (2026-12-01). Raises RuntimeError
    without the kernels."""
    if not kernels.available():
        raise RuntimeError("tiered/kernels is not built")
    from tiered.models.layers import KVCache

    D, F_, H, Hkv = shape
    cfg = _dense_config(shape, DECODE_LAYER_RUN)
    _, step = _dense_decode_step(cfg, 8)
    g = torch.Generator().manual_seed(0)
    # a layer's four kernel calls alone, as the step holds them: q/k/v, o, gate/up, down (N, K)
    modules = [_native_gemv_module("int4q8", torch.randn(N, K, generator=g) * 0.02)[0]
               for N, K in (((H + 2 * Hkv) * 64, D), (D, H * 64), (2 * F_, D), (D, F_))]
    projections = [_native_gemv("int4q8", m) for m in modules]
    # from STEP_AMX_ROWS rows on a CPU with AMX the step runs its int4 projections on the AMX GEMM (run_step): alone
    # they are timed there too, on bf16 rows (the step's own conversion of its rows is its code's)
    amx = amx_kernels() is not None
    inputs = {K: {T: torch.randn(T, K, generator=g) for T in STEP_ROWS_TOKENS} for K in (D, H * 64, F_)}
    calls = []
    for T in STEP_ROWS_TOKENS:
        cache = KVCache(cfg, T, 1, torch.bfloat16, "cpu")
        ids, pos, slots, last = torch.full((T, 1), 1), torch.zeros(T, 1, dtype=torch.long), torch.arange(T), \
            torch.tensor([T - 1])
        calls.append(lambda ids=ids, pos=pos, slots=slots, cache=cache, last=last:
                     step(ids, pos, slots, cache, rows=last))
        xs = [inputs[K][T] for K in (D, H * 64, D, F_)]
        if amx and T >= STEP_AMX_ROWS:
            xbs = [x.to(torch.bfloat16) for x in xs]
            calls.append(lambda xbs=xbs: [amx_gemm(m.packed, None, x) for m, x in zip(modules, xbs)])
        else:
            calls.append(lambda xs=xs: [k(x) for k, x in zip(projections, xs)])
    with torch.inference_mode():
        samples = interleaved_samples(calls, max(5, repeats))
    # the median of each round's difference (the step and its projections timed back to back), not the difference
    # of their medians: on 2 Zen 4 cores whose speed changed from one second to the next the medians' differences
    # read 0.21 / 0.24 / 0.22 ms at 64 / 128 / 256 rows in one profile and 0.28 / 0.20 / 0.72 in the next; over 8
    # timings of 5 rounds the fitted slope's spread (std / mean) was 0.37 from the medians, 0.29 from the rounds'
    # differences, one timing's 64-row point 0 against 0.30 ms (2026-12-02)
    return [(float(T * (D + F_)), max(0.0, float(np.median([step / DECODE_LAYER_RUN - alone for step, alone in
                                                            zip(samples[2 * i], samples[2 * i + 1])]))))
            for i, T in enumerate(STEP_ROWS_TOKENS)]


def _layer_elements(shape) -> int:
    """Weight elements of one dense layer of `shape` (DECODE_LAYER_SHAPES'): its attention and its SwiGLU."""
    D, F_ = shape[:2]
    return _dense_config(shape, 1).attention_weight_elements() + 3 * D * F_


class _ColdDecodeLayers:
    """Dense layers of `shape` (DECODE_LAYER_SHAPES') with the engine's int4 decode copies (`fmt` "int8-g32": its int8
    ones per group of 32) in tiered's native decode
    step (_dense_decode_step), `runs` runs of DECODE_LAYER_RUN of them, or where not given enough to hold `cold_bytes`
    (COLD_WEIGHT_BYTES without it), every
    DECODE_LAYER_RUN of them copies of the first run's: `call(B)` runs the next DECODE_LAYER_RUN layers each call
    (cycling), so every weight comes from memory as a decode step's do, on B rows, each its own sequence at 32
    cached positions (a bf16 cache, the default plan's beside fp32 activations). `elements`: a layer's weight
    elements. What _decode_layer_points (one row) and _batch_rows_points (a batched step's rows) time."""

    def __init__(self, shape, cold_bytes: int | None = None, fmt: str = "int4", runs: int | None = None) -> None:
        from dataclasses import replace

        from tiered.memory.sizes import bytes_per_element

        cfg = _dense_config(shape, DECODE_LAYER_RUN)
        self.elements = _layer_elements(shape)
        nbytes = self.elements * bytes_per_element(fmt)
        runs = runs or max(1, -(-(cold_bytes or COLD_WEIGHT_BYTES) // int(DECODE_LAYER_RUN * nbytes)))
        self.cfg = replace(cfg, num_hidden_layers=runs * DECODE_LAYER_RUN)
        self.model, self.step = _dense_decode_step(self.cfg, 64, distinct=DECODE_LAYER_RUN, fmt=fmt)
        self._starts = itertools.cycle(range(0, runs * DECODE_LAYER_RUN, DECODE_LAYER_RUN))

    def call(self, B: int, runs: int | None = None) -> Callable[[], None]:
        """One timed call: the next DECODE_LAYER_RUN layers on B rows (their own cache, built here). `runs`: cycle
        over the first that many runs of DECODE_LAYER_RUN layers only (a smaller working set), each call its own
        cycle; None: over all of them, shared by every call."""
        from tiered.models.layers import KVCache

        cache = KVCache(self.cfg, B, 64, torch.bfloat16, "cpu")
        for t in (cache.k, cache.v):  # resident pages, as a running cache's: the step reads 32 positions it never
            t.zero_()  # wrote, which a fresh KVCache maps to the kernel's one zero page (memory/host.lazy_zeros)
        x, p, slots = torch.randn(B, self.cfg.hidden_size), torch.full((B,), 32), torch.arange(B)
        cos, sin = self.model.rotary.cos[p], self.model.rotary.sin[p]
        starts = self._starts if runs is None else itertools.cycle(range(0, runs * DECODE_LAYER_RUN, DECODE_LAYER_RUN))

        def call() -> None:
            i = next(starts)
            self.step.native.forward(x, cos, sin, slots, p, cache.k, cache.v, i, i + DECODE_LAYER_RUN)
        return call

    @property
    def runs(self) -> int:
        """Runs of DECODE_LAYER_RUN layers held."""
        return self.cfg.num_hidden_layers // DECODE_LAYER_RUN


# runtime/decode_ws/int4's working sets [MiB]: the native step's layers cycled over this many weight bytes, each
# below the set it takes as out of every cache (decode_ws_cold)
DECODE_WS_MIB = (16, 32, 64, 128, 256, 512)
DECODE_WS_SAMPLE = 10e-3  # seconds a timed sample of one working set takes at least (whole passes over it)


def decode_ws_cold(llc: int | None, quick: bool = False) -> int:
    """The working set [bytes] runtime/decode_ws/int4 takes as read from memory: 3 x the last-level cache, within
    512 MiB - 1.5 GiB; 512 MiB in a quick profile (building 1.4 GiB of layers took ~3 s of the key's 4-5 on 2
    AMX cores, where 512 MiB read within 4% of its rate)."""
    return int(512 * MiB if quick else min(max(3 * (llc or 0), 512 * MiB), 1536 * MiB))


def _decode_ws_points(repeats: int, llc: int | None, shape=DECODE_LAYER_SHAPES[1], layer_code: float = 0.0,
                      sets_mib=DECODE_WS_MIB, cold: int | None = None, quick: bool = False) -> list[tuple[float, float]]:
    """(working set bytes, seconds a weight byte) of tiered's native decode step over dense int4 layers of `shape`
    (DECODE_LAYER_SHAPES', as runtime/decode_layer/int4 times them), one token, its layers cycled over each of
    DECODE_WS_MIB below decode_ws_cold(llc) and over that cold set: runtime/decode_ws/int4, how much faster the
    step streams weights that the caches partly hold between two reads (a model whose step reads fewer bytes than
    the cache holds). Each round takes every working set in turn: one untimed pass over it (its cache state), then
    whole passes timed for DECODE_WS_SAMPLE; the median of `repeats` rounds, less `layer_code` a layer
    (runtime/decode_step's). On 2 cores of a Xeon with AMX whose sysfs reports a 480 MiB L3 (2026-12-04), a
    768-wide layer's calls ran 1.7x faster cycled over 16-64 MiB than over 1 GiB, 1.2x over 96 and as from memory
    from 128 MiB, and SmolLM2's 89 MB int4 step ran 2.5 ms a token where runtime/decode_layer/int4 (timed cold)
    priced 3.9. `quick`: decode_ws_cold's. `sets_mib`, `cold` [bytes]: other working sets (tests). Raises
    RuntimeError without the kernels."""
    if not kernels.available():
        raise RuntimeError("tiered/kernels is not built")
    from tiered.memory.sizes import bytes_per_element

    cold = cold or decode_ws_cold(llc, quick)
    layers = _ColdDecodeLayers(shape, cold)
    run_bytes = DECODE_LAYER_RUN * layers.elements * bytes_per_element("int4")
    sets = sorted({min(layers.runs, max(1, round(mib * MiB / run_bytes))) for mib in sets_mib
                   if mib * MiB < cold / 2} | {layers.runs})
    passes = {runs: layers.call(1, runs) for runs in sets}
    samples: dict[int, list[float]] = {runs: [] for runs in sets}
    with torch.inference_mode():
        for _ in range(max(3, repeats)):
            for runs, call in passes.items():
                for _ in range(runs):  # the set's cache state: one pass
                    call()
                n, t0 = 0, time.perf_counter()
                while True:
                    for _ in range(runs):
                        call()
                    n += 1
                    t = time.perf_counter() - t0
                    if t >= DECODE_WS_SAMPLE:
                        break
                layer = t / (n * runs * DECODE_LAYER_RUN) - layer_code
                samples[runs].append(max(layer, 1e-9) * DECODE_LAYER_RUN / run_bytes)
    return [(float(runs * run_bytes), float(np.median(samples[runs]))) for runs in sets]


def _decode_layer_points(repeats: int, shapes=DECODE_LAYER_SHAPES, cold_bytes: int | None = None,
                         probe: "Probe | None" = None, layer_code: float = 0.0, fmt: str = "int4"
                         ) -> list[tuple[float, float]]:
    """(`fmt` weight bytes a layer, seconds a layer's kernel calls take) in tiered's native decode step over
    dense layers of `shapes` with the engine's `fmt` decode copies (int4, or int8-g32: tiled, one copy each: q/k/v
    and gate/up fused), one token at 32 cached positions, less `layer_code` (runtime/decode_step's per-layer cost:
    the layer's code, whose weights at hidden 64 the cache holds): runtime/decode_layer/<fmt>, fitted through the
    origin (a layer's calls per weight byte: their stream, and their starts and ends, the wait for the slower
    thread, which no weight is too small to pay). Each timed call runs DECODE_LAYER_RUN layers of a model of
    as many runs of them for every shape, the next run each call, the shapes timed interleaved (median_times)
    with `probe` among them (its median to probe.last, as _gemm_points: the key scales with the memory's speed
    at planning): enough runs that `cold_bytes` or more (COLD_WEIGHT_BYTES without it; the profile passes
    decode_ws_cold's, beyond the caches) pass between two reads of one weight, so every weight comes from memory
    as a big model's decode step's do. (With 64 MiB of layers each, the 8.8 MB layers were read again every
    ~180 MB, the 2.2 MB ones every ~730: on 2 AMX cores whose VM's share of a 480 MiB L3 speeds sets of up to
    ~256 MiB, the widest timed faster a byte than it reads from memory, and a Gemma-3-4B-width step of 59 MB
    layers, priced at that rate, 14-26% fast, 2026-12-07; op_time.cache_factor prices what the caches hold of a
    small model's step.)

    The GEMV keys time each kernel alone, from Python, over its own weight: on 2 Zen 3 cores (2026-11-30) the
    step ran SmolLM2-width layers (2.2 MB) in 75-81 us, 27-29 GB/s, and 8.8 MB ones at 31-35, where the gemv fit
    without its intercept and runtime/decode_step's 7.3 us a layer priced 69 us (38.6 GB/s). An affine fit's
    intercept (a call's fixed cost) came out 3-49 us from run to run of this VM. Raises RuntimeError without
    the kernels."""
    if not kernels.available():
        raise RuntimeError("tiered/kernels is not built")
    from tiered.memory.sizes import bytes_per_element

    calls, sizes = [], []
    # as many runs of layers for every shape: what passes between two reads of one weight (the other shapes' runs
    # and the probe's call in each round, that many rounds) is then cold_bytes or more for each alike
    per_round = sum(DECODE_LAYER_RUN * _layer_elements(shape) * bytes_per_element(fmt) for shape in shapes) + \
        (probe.nbytes if probe is not None else 0)
    runs = max(1, -(-int(cold_bytes or COLD_WEIGHT_BYTES) // int(per_round)))
    for shape in shapes:  # (each call holds its layers)
        layers = _ColdDecodeLayers(shape, fmt=fmt, runs=runs)
        calls.append(layers.call(1))
        sizes.append(layers.elements * bytes_per_element(fmt))
    with torch.inference_mode():
        times = probed_times(calls, repeats, probe)
    return [(float(n), max(t / DECODE_LAYER_RUN - layer_code, 1e-9)) for n, t in zip(sizes, times)]


# rows of runtime/batch_rows/int4q8's timed steps (a server's batched decode), beside 1; 32 and 64 since the step's
# int4 projections take the AMX GEMM from quant/int4.STEP_AMX_ROWS (24) rows where it runs (profile meta["batch_rows"]
# records them)
BATCH_ROWS = (4, 8, 16, 32, 64)


def _batch_rows_points(repeats: int, shapes=DECODE_LAYER_SHAPES, cold_bytes: int | None = None
                       ) -> list[tuple[float, float]]:
    """(a layer's weight elements, seconds a layer each row past the first adds) of tiered's native decode step over
    dense layers of `shapes` with the engine's int4 decode copies on int8 rows (tiled, q/k/v and gate/up fused), its
    weights from memory as in _decode_layer_points, at each of BATCH_ROWS rows (a server's batched decode: each row
    its own sequence at 32 cached positions) against one row, the median of each round's difference
    (interleaved_samples) over rows - 1: what a row past the first costs inside the step, its multiply-adds through
    the kernels at the layers' own widths, the row's code (norms, RoPE, SiLU, its int8 rounding, its attention over
    a short cache) and the parallel regions' waits. runtime/batch_rows/int4q8 (affine: a row's fixed cost a layer,
    and its cost a weight element) prices a batched step's dense layers (cpu_predict.predict_decode). On 2 Zen 4
    cores (2026-12-02) a row cost 33.7 / 54 / 97 us a layer at SmolLM2's widths and the two larger ones (3.5 / 6.3
    / 14.2 M elements: 12.6 us + 6.0 ps an element), where the kernels' own decode_rows/cpu/int4q8 (a 4096 x 4096
    weight timed alone, 3.9 ps a multiply-add) had priced SmolLM2's 8-sequence step at 9.5 ms against 12.2 measured
    (8.5 of them its layers), and that row of the planner validation 15-49% fast in 11 of 20 runs on four
    machines. Raises RuntimeError without the kernels."""
    if not kernels.available():
        raise RuntimeError("tiered/kernels is not built")
    points = []
    for shape in shapes:
        # one shape's batches interleaved among themselves: interleaved with the other shapes', its first call of a
        # round (one row) found its layers evicted by theirs and the batches after it found them cached, so that on
        # the AMX VM (whose caches hold a shape's 64 MiB) one row took 110 us a SmolLM2-width layer there against 65
        # alone and 4 rows came out free (0 us a row, 6.7 measured alone: SmolLM2's 4-sequence step priced 22% fast)
        layers = _ColdDecodeLayers(shape, cold_bytes)
        with torch.inference_mode():
            one, *batches = interleaved_samples([layers.call(B) for B in (1,) + BATCH_ROWS], max(5, repeats))
        for B, rows in zip(BATCH_ROWS, batches):
            points.append((float(layers.elements), max(0.0, float(np.median(
                [(t - t1) / DECODE_LAYER_RUN / (B - 1) for t, t1 in zip(rows, one)])))))
        del layers
    return points


def _moe_step_points(repeats: int) -> list[tuple[float, float]]:
    """(layers, seconds) of one decode step of tiny Mixtral-shaped models (hidden 64, 8 experts,
    top-2, bf16, every expert in RAM) with 2..8 layers, each opened by the engine itself (`LLM`
    over a dummy checkpoint, plan "off": the runtime's rules, the native step when built) so the
    step runs what a CPU-only MoE decode runs: with every expert resident, each MoE block inside the
    native step (router, softmax, top-k, the experts in one call, combine: DecodeStep.set_moe);
    otherwise the lean step's attention, then each MoE block as a module and the expert runner
    (runtime/moe_runner). The weights are too small to matter: what is timed is the
    fixed cost per step and per MoE layer (runtime/moe_step/bf16, n = layers), which
    runtime/decode_step's dense layers do not have."""
    from tiered.bench.checkpoint import ModelShape, write_dummy_checkpoint

    points = []
    with tempfile.TemporaryDirectory(prefix="tiered-profile-moe-") as tmp:
        for layers in (2, 4, 8):
            shape = ModelShape(layers=layers, hidden=64, ffn=128, heads=4, kv_heads=2, vocab=64, experts=8, top_k=2,
                               max_position_embeddings=128)
            path = write_dummy_checkpoint(Path(tmp) / f"moe-{layers}", shape)
            points.append((float(layers), _engine_decode_step(path, repeats)))
    return points


class _EmptyMatmuls(TorchFunctionMode):
    """Inside it, F.linear and F.scaled_dot_product_attention return an empty tensor of their result's
    shape and dtype, so that a forward pass times the model code around them: norms, RoPE, SiLU,
    residual adds, casts and module calls (_prefill_code_points). A weight's conversion to fp32 (an
    nn.Parameter's .float(): hardware/cpu_gemm.linear's, on a CPU without a bf16 GEMM) is its GEMM's, whose
    key times it: empty too. A bf16 prompt's attention on tiered's kernel (AMX, AVX512-BF16: layers._bf16_attention,
    a call into C++ that no TorchFunctionMode sees) takes torch's SDPA here (quant/int4.without_amx), empty
    too: until profiler 62 it ran on the empty projections' garbage inside runtime/prefill_code/bf16, which
    attn_prefill/cpu/bf16 prices already (2 AMX cores, 2026-12-06: SmolLM2's bf16 512-token TTFT priced 22% slow
    at profiler 60; 96% at 61, whose lazy max took garbage scores slower still)."""

    def __enter__(self):
        self._no_amx = without_amx()
        self._no_amx.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._no_amx.__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.float and isinstance(args[0], torch.nn.Parameter):
            return torch.empty(args[0].shape, dtype=torch.float32, device=args[0].device)
        if func is F.linear:
            x, w = args[0], args[1]
            return torch.empty(*x.shape[:-1], w.shape[0], dtype=x.dtype, device=x.device)
        if func is F.scaled_dot_product_attention:
            q, v = args[0], args[2]
            return torch.empty(*q.shape[:-1], v.shape[-1], dtype=q.dtype, device=q.device)
        return func(*args, **(kwargs or {}))


# runtime/prefill_code's models: (hidden, intermediate) at 8 layers, prompts of PREFILL_CODE_TOKENS (past the
# rows a prompt runs in the native decode step: planner/auto.MIXED_ROWS)
PREFILL_CODE_SHAPES = ((256, 768), (512, 2048))
PREFILL_CODE_TOKENS = (256, 1024)


def _prefill_code_points(dtype: str, repeats: int) -> list[tuple[float, float]]:
    """(T x (hidden + intermediate), seconds a layer) of a T-token prompt's prefill through the engine
    (`LLM` over a dummy dense checkpoint of PREFILL_CODE_SHAPES, plan "off", weights and activations in
    `dtype`, one token generated) with every F.linear and attention call an empty result (_EmptyMatmuls):
    the layers' own code beyond the GEMMs and attention the planner prices (norms, RoPE, SiLU, residual
    adds, casts, module calls): runtime/prefill_code/<dtype>, alpha a layer's fixed cost, beta a token's
    cost per element of its width. On 2 AMX cores SmolLM2's 512-token bf16 prefill (0.17 s) spent 59 ms
    there, which the decode step's fixed cost (runtime/decode_step, ~4 us a layer) had stood for: its
    TTFT priced 29-36% fast (2026-11-29). Every prompt runs the modules' prefill (Plan.mixed_rows 0): with
    mixed rows to 256, 256-token prompts ran as rows of the native step with their matmuls, 2-10 ms a layer
    where 1024 tokens took 0.8-3.5, and the fit (R^2 -2.1) priced SmolLM2's default 512-token TTFT 0.39 s
    where it took 0.24-0.32 (2 Zen 5 cores, 2026-12-01). Raises RuntimeError where a shape's longer prompt
    took less time than its shorter one (a path other than the one timed)."""
    from tiered.bench.checkpoint import ModelShape, write_dummy_checkpoint
    from tiered.config import EngineConfig
    from tiered.engine.llm import LLM
    from tiered.engine.sampling import SamplingParams

    layers, points = 8, []
    with tempfile.TemporaryDirectory(prefix="tiered-profile-prefill-") as tmp:
        for d, F_ in PREFILL_CODE_SHAPES:
            shape = ModelShape(layers=layers, hidden=d, ffn=F_, heads=d // 64, kv_heads=max(1, d // 256), vocab=64,
                               max_position_embeddings=2 * max(PREFILL_CODE_TOKENS))
            path = write_dummy_checkpoint(Path(tmp) / f"dense-{d}", shape)
            llm = LLM(path, EngineConfig(accelerator="none", dtype={"bf16": "bfloat16"}.get(dtype, "float32"),
                                         decode_weights=dtype, plan="off", max_context=2 * max(PREFILL_CODE_TOKENS)))
            # the modules' prefill at every length: a prompt within Plan.mixed_rows would run as rows of the native
            # decode step instead, its matmuls in C++ where _EmptyMatmuls cannot empty them
            llm.plan.mixed_rows = 0
            try:
                sp = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
                for T in PREFILL_CODE_TOKENS:
                    ids = [i % 64 for i in range(T)]
                    with _EmptyMatmuls():
                        t = median_time(lambda: llm.generate([ids], sp), repeats, lambda: None)
                    points.append((float(T * (d + F_)), t / layers))
            finally:
                llm.close()
    for (n0, t0), (n1, t1) in zip(points[::len(PREFILL_CODE_TOKENS)], points[len(PREFILL_CODE_TOKENS) - 1::len(PREFILL_CODE_TOKENS)]):
        if t1 < t0:  # 4x the tokens in less time: not the path timed (the key would price prompts by noise)
            raise RuntimeError(f"a prompt of {n1:.0f} token-widths took {t1 * 1e3:.3f} ms a layer, less than "
                               f"{n0:.0f} did ({t0 * 1e3:.3f} ms): not the modules' prefill")
    return points


TINY_ENGINE_LAYERS = 2  # _tiny_engine_itl's model: runtime/engine_token's and runtime/burst_token's


def _engine_token_seconds(repeats: int) -> float:
    """Seconds the engine's loop adds to each generated token beyond its model step (runtime/engine_token,
    alpha only): LLM.step's scheduling, the step's input tensors, sampling, the token's bookkeeping and
    output. The median ITL of 64 greedy tokens from a tiny dense model opened by the engine (hidden 64,
    vocabulary 64, plan "off", bf16 decode copies, the native step when built) less the median of its model
    step called alone (_engine_decode_step's way), at least 0. On 2 Zen 3 cores ~90 us a token
    (2026-11-30), which no step key held: SmolLM2's default decode (3.4-4.0 ms a token) was priced 0.04 ms
    of its ~0.2-0.4 outside the native step's forward and logits."""
    itl, step = _tiny_engine_itl(repeats, bursts=False, step=True)
    return max(0.0, itl - step)


def _burst_token_seconds(repeats: int, layer_code: float) -> float:
    """Seconds a token of a decode burst (LLM._burst) costs beyond its layers' code (runtime/burst_token, alpha
    only): the embedding row, the head's glue, the draw in C++, the token's bookkeeping, detokenizing and output
    in Python, and the burst's call spread over its tokens. The median ITL of 64 greedy tokens from the tiny dense
    engine of _engine_token_seconds with its bursts on, less its 2 layers at `layer_code` seconds each
    (runtime/decode_step/bf16's slope), at least 0. In place of runtime/decode_step's per-step cost and
    runtime/engine_token (op_time.step_overhead's `burst`): on 2 Zen 3 cores a burst token of that engine took
    29-56 us where one step a token took ~275 (2026-11-30). Raises RuntimeError without the kernels (no bursts)."""
    if not kernels.available():
        raise RuntimeError("tiered/kernels is not built: no decode bursts")
    itl, _ = _tiny_engine_itl(repeats, bursts=True)
    return max(0.0, itl - TINY_ENGINE_LAYERS * layer_code)


def _tiny_engine_itl(repeats: int, bursts: bool, step: bool = False) -> tuple[float, float | None]:
    """(the median ITL of 64 greedy tokens after a 16-token prompt, over `repeats` runs after one, and with
    `step` the median of its model step called alone, else None) of a tiny dense engine (_open_engine over a
    dummy checkpoint: TINY_ENGINE_LAYERS layers, hidden 64, vocabulary 64) with decode bursts on or off
    (LLM.bursts). Raises RuntimeError when bursts are asked and its step cannot burst."""
    from tiered.bench.checkpoint import ModelShape, write_dummy_checkpoint
    from tiered.engine.sampling import SamplingParams

    with tempfile.TemporaryDirectory(prefix="tiered-profile-loop-") as tmp:
        shape = ModelShape(layers=TINY_ENGINE_LAYERS, hidden=64, ffn=128, heads=4, kv_heads=2, vocab=64,
                           max_position_embeddings=128)
        llm = _open_engine(write_dummy_checkpoint(Path(tmp) / "dense", shape), max_context=128)
        llm.bursts = bursts
        try:
            if bursts and not llm.runtime.cpu_decode.can_burst(llm._kv_cache(1, 16)):
                raise RuntimeError("the tiny engine's step cannot burst")
            sp = SamplingParams(temperature=0, max_tokens=65, ignore_eos=True)
            llm.generate([[1] * 16], sp)
            itl = float(np.median([llm.generate([[1] * 16], sp)[0].stats.itl_s for _ in range(repeats)]))
            return itl, _model_step_seconds(llm, repeats) if step else None
        finally:
            llm.close()


def _open_engine(path: Path, max_context: int = 64):
    """The checkpoint at `path` opened by the engine on the CPU: bf16, bf16 decode copies, plan "off" (the
    runtime's rules), room for `max_context` tokens."""
    from tiered.config import EngineConfig
    from tiered.engine.llm import LLM

    return LLM(path, EngineConfig(accelerator="none", dtype="bfloat16", decode_weights="bf16", plan="off",
                                  max_context=max_context))


def _model_step_seconds(llm, repeats: int) -> float:
    """Median seconds of one CPU decode step of `llm`'s model (after a 32-token prompt), called alone."""
    step, cache = llm.runtime.cpu_decode, llm._kv_cache(1, 64)
    slots, ids, pos = torch.tensor([0]), torch.tensor([[1]]), torch.tensor([[32]])
    with torch.inference_mode():
        llm.model(torch.ones(1, 32, dtype=torch.long), torch.arange(32).unsqueeze(0), slots, cache)
        return median_time(lambda: step(ids, pos, slots, cache), repeats)


def _engine_decode_step(path: Path, repeats: int) -> float:
    """Median seconds of one CPU decode step (after a 32-token prompt) of the checkpoint at `path`
    opened by the engine (_open_engine)."""
    llm = _open_engine(path)
    try:
        return _model_step_seconds(llm, repeats)
    finally:
        llm.close()


def _mla_step_points(repeats: int) -> list[tuple[float, float]]:
    """(layers, seconds) of one decode step of tiny DeepSeek-V2-shaped models (hidden 64, multi-head
    latent attention with 4 heads, a latent of 32 and a RoPE key of 8; 8 experts, top-2, one shared
    expert, every layer MoE; bf16, every expert in RAM) with 2..8 layers, opened by the engine (plan
    "off"). The native step runs each such layer in C++ (DecodeStep.set_latent: the attention in the
    latent space; set_moe: DeepSeek's router, the bf16 experts as stored, the shared expert), or as its
    modules where it cannot (TIERED_NATIVE_MLA=0 / TIERED_NATIVE_MOE=0, fp32 experts); the fixed cost
    per layer is the slope (runtime/mla_step/bf16), beside runtime/moe_step's for plain MoE layers."""
    from tiered.bench.checkpoint import DEEPSEEK_V2_LITE, write_dummy_deepseek_checkpoint

    tiny = dict(vocab_size=64, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_attention_heads=4,
                num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
                first_k_dense_replace=0, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                max_position_embeddings=128, bos_token_id=0, eos_token_id=1,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    points = []
    with tempfile.TemporaryDirectory(prefix="tiered-profile-mla-") as tmp:
        for layers in (2, 4, 8):
            path = write_dummy_deepseek_checkpoint(Path(tmp) / f"mla-{layers}",
                                                   {**DEEPSEEK_V2_LITE, **tiny, "num_hidden_layers": layers})
            points.append((float(layers), _engine_decode_step(path, repeats)))
    return points


def _moe_cpu_layer_points(repeats: int, device: str = "cuda") -> list[tuple[float, float]]:
    """(layers, seconds) of one decode step of tiny Mixtral-shaped models (hidden 64, 8 experts, top-2, bf16)
    with 2, 4 and 8 layers, opened by the engine on `device` ("cuda"; "host", the stand-in, in tests) with
    no expert on it and every miss computed on the CPU (plan "off", resident_experts 0, no cache slots,
    force_expert_path "cpu"), decode graphed as the engine does by default. The weights are too small to
    matter: the slope is the host's fixed cost of a decode layer whose experts run on the CPU path of
    runtime/moe_runner (the model code, the router, the layer's sync, the activations' D2H, the CPU
    expert calls, their outputs' H2D, the combine). On the H100's host session 28's traces had ~1.5 ms
    of such time in each forced-CPU layer beside its experts, where the plan priced ~0.9."""
    from tiered.bench.checkpoint import ModelShape, write_dummy_checkpoint
    from tiered.config import EngineConfig
    from tiered.engine.llm import LLM
    from tiered.engine.sampling import SamplingParams

    points = []
    with tempfile.TemporaryDirectory(prefix="tiered-profile-moe-gpu-") as tmp:
        for layers in (2, 4, 8):
            shape = ModelShape(layers=layers, hidden=64, ffn=128, heads=4, kv_heads=2, vocab=64, experts=8,
                               top_k=MOE_PROBE_TOP_K, max_position_embeddings=128)
            path = write_dummy_checkpoint(Path(tmp) / f"moe-{layers}", shape)
            llm = LLM(path, EngineConfig(accelerator=device, dtype="bfloat16", plan="off", max_context=64,
                                         resident_experts=0, expert_cache_slots=0, force_expert_path="cpu"))
            try:
                ids, params = list(range(1, 9)), SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
                llm.generate([ids], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))  # warm-up, graphs
                itl = float(np.median([llm.generate([ids], params)[0].stats.itl_s for _ in range(max(3, repeats))]))
                points.append((float(layers), itl))
            finally:
                llm.close()
    return points


COPY_ROUNDS = 2  # rounds over the copy sizes; each size keeps its fastest round's median


def _copy_points(kind: str, sizes_mib, repeats: int, rounds: int = COPY_ROUNDS):
    """[(bytes, seconds)] of one copy `kind` ("h2d_pinned", "d2h_pageable", ...) per size in `sizes_mib`:
    the median of `repeats` copies, over `rounds` rounds of every size in turn, each size keeping its
    fastest round. A link is never faster than it is, and a slow minute is not its speed: the 2026-11-28
    H100 host read its 64 MiB pinned H2D copy at 40.2 GB/s in one round (16 MiB: 50.4; every earlier H100
    profile 54-55 at 64 MiB), the fit priced the link at 40.7 GB/s, and every miss copied then moved ~53."""
    sync = torch.cuda.synchronize
    pinned = kind.endswith("pinned")
    # each size's buffers allocated once, its copies timed in every round
    pairs = {mib * MiB: (torch.empty(mib * MiB, dtype=torch.uint8, pin_memory=pinned),
                         torch.empty(mib * MiB, dtype=torch.uint8, device="cuda")) for mib in sizes_mib}
    best: dict[int, float] = {}
    for _ in range(max(1, rounds)):
        for n, (host, dev) in pairs.items():
            if kind.startswith("h2d"):
                t = median_time(lambda: dev.copy_(host, non_blocking=pinned), repeats, sync)
            else:
                t = median_time(lambda: host.copy_(dev, non_blocking=pinned), repeats, sync)
            best[n] = min(t, best.get(n, float("inf")))
    return sorted(best.items())


def _disk_points(directory: Path, sizes_mib, repeats: int, readers: int = DISK_READERS) -> tuple[list, list, list, str]:
    """(cold-read points, parallel cold-read points, write points, note). Reads after
    POSIX_FADV_DONTNEED, with os.preadv; parallel reads split each size over `readers` threads
    reading disjoint ranges at once (the runtime's disk readers with read-ahead), n = all bytes."""
    directory.mkdir(parents=True, exist_ok=True)
    fd, path = tempfile.mkstemp(prefix="tiered-profile-", dir=directory)
    note = "cold reads: posix_fadvise(DONTNEED) before each read"
    try:
        block = os.urandom(MiB)
        write_pts = []
        for mib in sizes_mib:
            ts = []
            for _ in range(max(2, repeats - 1)):
                os.lseek(fd, 0, os.SEEK_SET)
                t0 = time.perf_counter()
                for _ in range(mib):
                    os.write(fd, block)
                os.fsync(fd)
                ts.append(time.perf_counter() - t0)
            write_pts.append((mib * MiB, float(np.median(ts))))
        can_drop = hasattr(os, "posix_fadvise")
        if not can_drop:
            note = "no posix_fadvise on this OS: reads may come from the page cache"
        read_pts = []
        for mib in sizes_mib:
            buf = bytearray(mib * MiB)
            ts = []
            for _ in range(repeats):
                if can_drop:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                t0 = time.perf_counter()
                got = os.preadv(fd, [buf], 0)
                ts.append(time.perf_counter() - t0)
                assert got == len(buf), f"short read: {got} of {len(buf)} bytes"
            read_pts.append((mib * MiB, float(np.median(ts))))
        par_pts = []
        with ThreadPoolExecutor(readers) as pool:
            for mib in sizes_mib:
                part = mib * MiB // readers
                bufs = [bytearray(part) for _ in range(readers)]
                ts = []
                for _ in range(repeats):
                    if can_drop:
                        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                    t0 = time.perf_counter()
                    got = list(pool.map(lambda i: os.preadv(fd, [bufs[i]], i * part), range(readers)))
                    ts.append(time.perf_counter() - t0)
                    assert got == [part] * readers, f"short read: {got}"
                par_pts.append((part * readers, float(np.median(ts))))
        if _fs_type(directory) in ("tmpfs", "ramfs"):
            note += f"; {directory} is {_fs_type(directory)}: these are RAM speeds"
        return read_pts, par_pts, write_pts, note
    finally:
        os.close(fd)
        os.unlink(path)


def _fs_type(path: Path) -> str:
    """Filesystem type of the mount holding `path` (Linux /proc/mounts), or "unknown"."""
    try:
        best, kind = "", "unknown"
        p = str(path.resolve())
        for line in Path("/proc/mounts").read_text().splitlines():
            parts = line.split()
            if len(parts) > 2 and p.startswith(parts[1]) and len(parts[1]) > len(best):
                best, kind = parts[1], parts[2]
        return kind
    except OSError:
        return "unknown"


def cpu_model() -> str:
    """The CPU's model name (from /proc/cpuinfo, else platform)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


PROBE_REFERENCE = "gemv_dram/cpu/bf16"  # the key whose probe time cpu_bandwidth_ratio compares against


def cpu_probe_ratios(profile: HardwareProfile, probe: Probe | None = None, repeats: int = 5) -> dict[str, float] | None:
    """{key: the probe's seconds now / its seconds among that key's samples} for every CPU GEMV key of a
    profile with meta["probe"] (Probe; > 1: the memory is slower now than when the key was measured),
    and "*": now / the median over the keys. None without probe times or tiered's kernels. `probe`:
    one built before (its copies reused)."""
    info = profile.meta.get("probe") if profile.meta else None
    llc = profile.meta.get("llc_bytes") if profile.meta else None
    if not info or not info.get("seconds") or not llc or not kernels.available():
        return None
    probe = probe or Probe(llc)
    now = median_times([probe.fn], repeats)[0]
    ratios = {k: now / t for k, t in info["seconds"].items()}
    ratios["*"] = now / float(np.median(list(info["seconds"].values())))
    return ratios


def probe_swing(pairs: list[tuple[float, float]]) -> float | None:
    """How far a speed probe moves within one timing of a key: the mean over `pairs` of |log(after / before)|;
    None for fewer than 3 pairs. The mean, not the median: a VM that switches between two speeds shows it in the
    pairs that straddle a switch.

    meta["compute_probe"]["swing"]: the compute probe's seconds (before, after) each compute-bound key's timing,
    about a second apart (_Bench.compute_pairs); meta["probe"]["swing"]: the memory probe's median seconds over the
    first and the second half of its samples among each GEMV key's (halves, _Bench.probe_pairs). Planning scales
    the keys by a probe's speed now (planner/auto.compute_now, bandwidth_now) only where its swing is small, i.e.
    where a speed lasts longer than a timing.

    On 2 Zen 4 cores (2026-12-02) the compute probe moved between ~0.26 and ~0.5 ms from one second to the next: a
    reading predicted the mean of the next 1-10 s with a correlation of 0.06-0.15 (a ratio to it erred 14% where
    the long-run median erred 6%), a quick profile's 37 pairs moved 15% on average (6 of them by more than 30%;
    full profiles 12% and 14%), and the check scaled the keys by 0.55-1.8x from one planning to the next. The
    memory probe there (readings of ~50 ms, 0.19 s apart, 150 s): consecutive readings moved 12% on average, the
    p5-p95 range was 1.8x, a reading predicted the next 1-10 s with a correlation of 0.04-0.19 and erred 8-9% where
    the long-run median erred 2-5%, and 10-s medians stayed within 0.93-1.05 ms. (The compute readings'
    correlation across a timing read 0.33, 0.42 and 0.68 in three profiles there: it says how the profile's
    minutes drifted more than whether a reading lasts, and gates nothing.)"""
    logs = [abs(math.log(after / before)) for before, after in pairs if before > 0 and after > 0]
    return float(np.mean(logs)) if len(logs) >= 3 else None


def halves(samples: list[float] | None) -> tuple[float, float] | None:
    """(median of the first half, median of the second half) of `samples` in the order taken (the middle one of an
    odd count left out): a probe's reading before and after across one timing. None for fewer than 2."""
    if not samples or len(samples) < 2:
        return None
    h = len(samples) // 2
    return float(np.median(samples[:h])), float(np.median(samples[-h:]))


def cpu_compute_ratios(profile: HardwareProfile, probe: ComputeProbe | None = None) -> dict[str, float] | None:
    """{key: the compute probe's seconds now / its median reading around that key's timings} for every
    compute-bound key of a profile with meta["compute_probe"] (ComputeProbe; > 1: the cores are slower now than
    when the key was measured). None without those readings or tiered's kernels. `probe`: one built before."""
    info = profile.meta.get("compute_probe") if profile.meta else None
    if not info or not info.get("seconds") or not kernels.available():
        return None
    now = (probe or ComputeProbe()).seconds()
    return {k: now / t for k, t in info["seconds"].items() if t > 0 and k.startswith(COMPUTE_KEYS)}


def cpu_bandwidth_ratio(profile: HardwareProfile, seconds: float = 0.06) -> tuple[float, float] | None:
    """(seconds now / seconds the profile predicts, bytes/s now) for streaming weights beyond the
    last-level cache: how much slower (> 1) or faster the memory is now than when `profile` was
    measured. None when the profile has no CPU bandwidth model.

    Where the profile timed the decode kernel itself from DRAM (gemv_dram/cpu/bf16: tiered/kernels
    built), the check times that kernel again, the same way (a 4096 x 4096 bf16 weight, copies
    cycled over 3 x meta["llc_bytes"], the median of 5 calls; ~0.3 s with its set-up). Else it reads a
    buffer of 4 x the cache (at least 128 MiB, at most 512 MiB) for `seconds` (at least 5 reads) against
    memory/bandwidth_dram/cpu (memory/bandwidth/cpu without it).

    A VM's memory bandwidth swings with its neighbours: the 2-core EPYC read 25-34 GB/s in one
    minute of 2026-11-26 where its profile of 40 minutes before said 49. The two ways do not swing
    alike: an hour later torch's sum() read 1.7-1.9x slower than the quick profile had, the bf16 decode
    kernel 1.3-1.6x, and SmolLM2's native decode step ran 3.7 ms where the profile priced 2.7; scaled
    by sum()'s ratio the plan had priced it at 4.9 ms (planner_validation's default row: 28% off).
    """
    llc = profile.meta.get("llc_bytes") or 0
    kernel = profile.models.get("gemv_dram/cpu/bf16")
    if kernel is not None and llc and kernels.available():
        n, t = _gemm_points("cpu", "bf16", [(1, 4096, 4096)], lambda: None, 5, True, cold_bytes=3 * llc)[0]
        return t / kernel(n), n / t
    nbytes = int(min(512 * MiB, max(128 * MiB, 4 * llc)))
    model = profile.models.get("memory/bandwidth_dram/cpu") if llc and nbytes > llc else None
    model = model or profile.models.get("memory/bandwidth/cpu")
    if model is None:
        return None
    src = torch.ones(nbytes // 4)
    src.sum()  # first touch
    samples, end = [], time.perf_counter() + seconds
    while len(samples) < 5 or time.perf_counter() < end:
        t0 = time.perf_counter()
        src.sum()
        samples.append(time.perf_counter() - t0)
    now = float(np.median(samples))
    return now / model(nbytes), nbytes / now


def last_level_cache_bytes() -> int | None:
    """Size of the CPU's largest data cache (Linux sysfs, cpu0), or None when unknown."""
    best = None
    for d in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            if (d / "type").read_text().strip() == "Instruction":
                continue
            text = (d / "size").read_text().strip().upper()
            n = int(text.rstrip("KMG")) * {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1], 1)
        except (OSError, ValueError, IndexError):
            continue
        best = max(best or 0, n)
    return best


def _meta(b: _Bench, cuda: bool) -> dict:
    meta = {"cpu": cpu_model(), "threads": torch.get_num_threads(), "cores": os.cpu_count(),
            "torch": torch.__version__, "python": platform.python_version(), "platform": platform.platform(),
            "quick": b.quick, "repeats": b.repeats, "disk_dir": str(b.disk_dir), "disk_fs": _fs_type(b.disk_dir),
            "disk_memory": shutil.disk_usage(b.disk_dir).free, "skipped": b.skipped, "llc_bytes": b.llc,
            "points": {k: [[float(n), float(t)] for n, t in v] for k, v in b.points.items()},
            "batch_rows": list(BATCH_ROWS)}
    if cuda:
        props = torch.cuda.get_device_properties(0)
        meta.update(gpu=props.name, gpu_capability=f"{props.major}.{props.minor}", cuda=torch.version.cuda)
    return meta


# Bumped when a key's measurement changes meaning, so cached profiles of older method are re-measured
# (2: runtime/decode_step times the lean CPU decode step, runtime/cpu_decode; 3: the native step and
# kernels when tiered/kernels is built, meta["native_kernels"]; 4: the CPU gemv keys time the native
# Kernels the native step calls, without a module's per-call Python cost; 5: gemv/cpu/fp32 times the
# native fp32 kernel, kernels/linear.f32_kernel, which the lossless mode's decode step now calls;
# and runtime/moe_step/bf16 is measured; 6: runtime/moe_step/bf16 times the native step running its
# resident MoE layers itself, DecodeStep.set_moe; 7: gemv/cpu/int4q8, tiled int4 on int8 activations,
# what routed int4 experts run at batch 1; 8: attn_prefill/cpu/<dtype>, a prompt's causal attention,
# gemm_big/cpu/<dtype>, a prompt's GEMM on a real FFN matrix, and on CUDA
# runtime/decode_step_graphed_gpu/<dtype> and runtime/decode_step_graph_gpu/<dtype>; 9: the native CPU gemv
# keys stream their weight copies from one huge-page arena, as a CPU-only engine's decode copies sit,
# hardware/budget.move_to_huge_pages); 10: gemm/cpu/int4 times the tiled layout's prompt path
# (Int4Linear.dense: the bf16-activation kernel, by quant/int4.dequantize_rows) when tiered/kernels is
# built, as a one-copy engine's prompts run, instead of torch's int4pack; and gemv/cpu/int8-g32 is
# measured (quant/int8.Int8G32Linear's kernel), which int8-g32 weights fell back to gemv/cpu/int8 for;
# 11: gemm/cpu/int4's Int4Linear.dense takes oneDNN's bf16 GEMM beyond quant/int4.dequantize_rows() rows
# on AVX-512 (its 128- and 256-row shapes); 12: attn_decode/cpu/<kv>, the native decode step's
# attention a KV byte from DRAM, which had been priced at the memory's rate; 13: gemm_big/cpu/<dtype> cycles
# its weights over 2 x the last-level cache: one matrix timed again and again sat in the H100 host's 300 MiB
# cache, and a prompt's CPU experts ran 14-33 ms at ~128 tokens where that key priced 12.5; 14: the CPU
# gemv keys cycle over COLD_WEIGHT_BYTES however many copies it takes (they stopped at 32: a 512 x 512 int4
# weight's 32 copies, 5 MiB, sat in the 2-core EPYC's 32 MiB cache, and its fit priced SmolLM2's int4
# matrices, 576 x 1536 cold, 1.35-2.0x fast; without the stop 1.22-1.5x), and the fp32 copies have memory of
# their own (every fp32 copy had viewed the one weight, so gemv/cpu/fp32 read a cache: 147-163 GB/s up to 16
# MiB on the 2-core EPYC, whose DRAM reads 40-80); 15: gemm_rows/cpu/bf16, torch's GEMM at 8 rows over cold
# weights (a short prompt's, an expert's past its native rows): 1.4-2x the weights' bytes at the DRAM rate, where
# max(compute, stream) priced the stream alone (a uniformly routed CPU MoE's 16-128-token prefill 39-56% fast),
# and expert_rows/cpu/bf16, the native bf16 expert at 1-8 rows (each row's multiply-adds beyond the stream);
# 16: every CPU GEMM / GEMV key's shapes, expert_rows' rows and attn_decode's contexts are timed interleaved
# (median_times), not one after the other: a fresh clone's quick int4 fit, shape by shape, had a 0.38 us
# intercept where the 2-core EPYC's is 2.5-6 us, and its plan priced `make run` 20-28% fast; 17:
# expert_dram/cpu/bf16, the native bf16 expert at one row over experts of 22-336 MiB beyond the cache in a
# HostSlab, which prices CPU experts where gemv_dram had (69 GB/s on the H100's host against ~90 streamed).
# On CUDA machines also meta["host_share"] (a CPU expert's and an H2D copy's slowdown when they run at once)
# and runtime/moe_cpu_layer_gpu/bf16 (a tiny MoE's decode layers with every expert on the CPU path).
# 18: runtime/mla_step/bf16 (a tiny DeepSeek-V2's decode layers: latent attention and DeepSeek's MoE block
# inside the CPU decode step, as modules then; in C++ since).
# 19: gemv/cpu/fp8 (tiered's fp8 kernel: an fp8 checkpoint's decode weights and fp8 experts, priced
# at int8's rate before; the kernel converts each byte through fp16 and is slower than int8's from cache).
# 20: meta["probe"]: a memory-speed probe (Probe: the bf16 decode kernel from DRAM) timed among each CPU
# GEMV key's samples, so that planning scales each key by the memory's speed now against its own minute's.
# 21: decode_rows/cpu/<dtype>, the decode kernels at 8-32 rows: a batched decode step (a server's rows)
# is priced at its multiply-adds where they outweigh the weights' stream (cpu_predict.predict_decode).
# 22: gemm_rows/cpu/bf16 also times a 1536 x 576 weight (GEMM_ROWS_SHAPES) and is timed again when its fit
# is poor (RETIMED_KEYS): on 2 AMX cores its intercept, extrapolated from 7-34 MB through noise, had priced
# each of SmolLM2's prompt GEMMs 1.75 ms where they take 0.07-0.5 (a 512-token bf16 TTFT 0.47 s for 0.21);
# gemm/cpu/int4 with the kernels is timed where a prompt dequantizes (int4_gemm_shapes; meta["int4_dequantize_rows"]).
# 23: decode_rows/cpu/int4q8, int4 rows on int8 activations (a server's batched steps, Plan.batch_act "q8"), which
# had been priced at the bf16 rows' slope: 3.4x too slow a row on 2 AMX cores (an 8-sequence SmolLM2 step 43%);
# runtime/prefill_code/<dtype>, a prompt's layer code beyond its GEMMs and attention (SmolLM2's bf16 TTFT 36% fast).
# 24: gemm/cpu/int8 times Int8Linear's prompt rows as they now run where the ISA GEMMs bf16 (one bf16 GEMM over
# the codes, quant/int8.DEQUANTIZE_ROWS: 4.5x _weight_int8pack_mm's speed at 128 rows on 2 AMX cores), and
# meta["kernel_isa"] names the paths a CPU expert's prompt rows take (cpu_predict.prompt_expert_time).
# 25: gemm_rows/cpu/bf16 and expert_rows/cpu/bf16 cycle over copies in one huge-page slab (slab_copies), as the
# runtime's CPU experts sit: over clones on 4 KiB pages the 2-core AMX VM's gemm_rows fit had R^2 0.22 and a
# 1.19 ms intercept (SmolLM2's 512-token bf16 TTFT priced 85% slow); in a slab, R^2 0.94-0.97, 0.39-0.54 ms.
# 26: memory/bandwidth/cpu, memory/bandwidth_dram/cpu and memory/copy/cpu read buffers from host_empty (huge
# pages), as the engine's CPU weights and experts sit: on 4 KiB pages the AMX VM's reads (16-18 GB/s) floored
# every bf16 GEMV and expert below the kernels' own 19-27.
# 27: attn_decode/cpu/<kv> times 16 layers over 32-128 MiB of KV a step, alternating between 2 sequences' caches
# (_attn_decode_points): 2 layers over 0.25-4 MiB, cycled over 1 GiB of caches on 4 KiB pages, had timed the
# step's fixed costs and page walks, and a quick profile's fit (1 GB/s, R^2 -133) priced SmolLM2's default
# decode at 640 positions 61 tok/s against 156 measured.
# 28: the memory-speed probe (Probe, timed among every GEMV key's samples and again at planning) cycles over at
# most PROBE_MAX_COLD_BYTES (256 MiB), not 3 x a sysfs L3 of 480 MiB; the native decode attention scores 4
# heads x 4 keys in registers and widens a bf16 cache without shuffles (~1.6x its speed: attn_decode).
# 29: gemm/cpu/<dtype> and gemm_big/cpu/<dtype> are timed again when their fit is poor (RETIMED_KEYS), torch's
# GEMM keys below R^2 0.99 (GEMM_STALL_R2); the bf16 GEMM keys timed through hardware/cpu_gemm.linear (fp32 over
# the converted weight where the CPU has no bf16 GEMM, as the runtime now runs them).
# 30: attn_prefill_past/cpu/<dtype>, a prefill chunk's attention over the cache before it (CPU plans prefill long
# prompts in chunks: Plan.prefill_chunk); convert(_big)/cpu/bf16 where the CPU has no bf16 GEMM, whose bf16 GEMMs are
# then priced as fp32 ones plus the conversion (and their bf16 GEMM keys no longer timed again on a poor fit).
# 31: expert_rows/cpu/int4q8, the tiled int4 expert's rows on int8 activations (a prompt's Q4_0 experts were priced
# by the 4096 x 4096 projection's decode_rows slope, 1.6x cheaper a row); decode_rows and expert_rows timed again
# on a poor fit (RETIMED_KEYS).
# 32: runtime/decode_layer/int4, the native step's dense int4 layers at real widths with their weights from
# memory (a layer's kernel calls per weight byte, their starts and ends in: 27-29 GB/s at SmolLM2's widths where
# the GEMV fit read 38.6), and runtime/engine_token, the engine's loop around each decode step (~90 us a token
# there, which no key held): SmolLM2's default decode was priced 10-25% fast on 2 Zen 3 cores.
# 33: runtime/burst_token, a decode burst's token beyond its layers' code (LLM._burst: a lone sequence's CPU decode,
# several tokens a native call), in place of the per-step fixed cost and runtime/engine_token where the engine
# bursts (op_time.step_overhead's `burst`); runtime/engine_token now times the loop with bursts off.
# 34: runtime/prefill_code/<dtype> times every prompt through the modules' prefill (Plan.mixed_rows 0): with mixed
# rows to 256 its 256-token prompts had run as native-step rows, matmuls and all (R^2 -2.1; SmolLM2's default
# 512-token TTFT priced 0.39 s where it took 0.24-0.32 on 2 Zen 5 cores).
# 35: attn_rows/cpu/<kv>, the native step's attention over a prompt run as its rows (Plan.mixed_rows), which
# cpu_predict.predict_prompt_rows prices such prompts by (their TTFT had been priced as the modules' prefill).
# 36: runtime/step_rows/int4, the native step's layer code per prompt row beyond its matmuls (predict_prompt_rows).
# 37: the compute-bound row keys (SECOND_PASS_KEYS: expert_rows, decode_rows) are timed three times through the
# profile and fitted on each point's median (_Bench.again, settle): a neighbour's second had slowed every point alike.
# 38: meta["compute_probe"]: a compute-speed probe (ComputeProbe: the int4 and bf16 row kernels on weights the caches
# hold) timed around each compute-bound key (COMPUTE_KEYS), so that planning scales each by the cores' speed now
# against its own minutes' (planner/auto.compute_now), as meta["probe"] does the GEMV keys by the memory's.
# 39: the memory-speed probe is also timed among expert_dram/cpu/bf16's samples (_expert_dram_points), which
# then follows the memory's speed now as the GEMV keys do: timed in a slow minute (20.4 GB/s where the kernel
# streamed 25-30 in others) it priced the all-in-RAM MoE's decode 13-34% slow on 2 Zen 3 cores (8 rounds, each
# priced, then measured).
# 40: dequantize/cpu/int4, a one-copy int4 weight's dequantization per element, and gemm/cpu/int4 fitted net of it
# (_net_of_dequantize): cpu_predict.torch_gemm_time prices a prompt's dequantized int4 GEMM as its multiply-adds plus
# its weight's elements (over multiply-adds alone at 192-384 rows the key priced SmolLM2's 512-row projections 18-29%
# slow, its 512-token TTFT 15%).
# 41: the CPU GEMM keys (gemm/cpu/<dtype>) fitted over multiply-adds and their weight's bytes a call (fit_gemm), the
# latter as gemm_pack/cpu/<dtype> (op_time.gemm_line adds it to calls of GEMM_ROWS rows or more): over multiply-adds
# alone the bf16 line's R^2 was 0.63-0.81 on 2 AMX cores, and the best-fitting of its three timings (GEMM_STALL_R2)
# was the one with the steepest slope; the quick profile times a fourth GEMM shape for it.
# 42: meta["compute_probe"]["swing"] (probe_swing): how far the compute probe moves across one timing of a key;
# planning's compute-speed check does not apply where it swings beyond planner/auto.COMPUTE_SWING (on 2 Zen 4 cores
# whose speed changed from one second to the next, a reading at planning told nothing of the run's, and the check
# scaled the keys by 0.55-1.8x from one planning to the next, seconds apart).
# 43: meta["probe"]["swing"]: the memory probe's twin (probe_swing over the halves of its samples among each GEMV
# key's); planning's memory-speed check does not apply where it swings beyond planner/auto.MEMORY_SWING (the same
# Zen 4 cores' memory: consecutive readings 0.19 s apart moved 12%, and the check once scaled the all-in-RAM MoE's
# GEMV keys 1.75x slow before a run that measured its fastest decode of the session).
# 44: runtime/batch_rows/int4q8 (_batch_rows_points): a batched native decode step's rows past the first at the
# layers' own widths, which predict_decode prices a server's step by (decode_rows' 4096 x 4096 kernel alone priced
# SmolLM2's 8-sequence step ~22% fast).
# 45: expert_rows/cpu/int4q8 timed in layer calls of 16 experts of 2048 x 1024 (_expert_rows_q8_points), as a
# prompt's MoE layer and a batched step run them, not one 1024 x 3584 expert a call; expert_groups/cpu/int4q8
# (_expert_groups_int4q8_points): an expert's rows past its first group of 8, whose weight streams come from the
# cache. Together they had priced a Qwen3-30B-A3B-width 512-token prompt's MoE blocks 1.5x slow on 2 Zen 4 cores
# (TTFT 1.74 s priced, 1.24 measured).
# 46: attn_decode/cpu/int8 and attn_rows/cpu/int8, the native step's attention over an int8 KV cache
# (EngineConfig.kv_cache_dtype "int8": rows dequantized into fp32 scratch a part at a time).
# 48: runtime/batch_rows/int4q8 times each layer shape's batches interleaved among themselves (_batch_rows_points):
# interleaved across the shapes, the one-row call a round began with found its layers evicted, and the rows past
# the first came out cheaper than they run (4 rows free on the AMX VM).
# 49: decode_rows/cpu/int8-g32q8, the tiled int8-g32 decode copies' batched rows on int8 activations
# (Int8G32Linear.batch_act "q8", Plan.batch_act): a GGUF Q8_0 / Q6_K head's rows had been priced at the per-row
# int8 kernel's int16 slope, which the head no longer runs in a server's steps.
# 50: runtime/decode_layer/int8-g32, the native step's dense layers with int8 copies per group of 32 (a Q8_0 file's,
# --decode-weights int8's since it makes them): priced at gemv/cpu/int8-g32's rate alone (the kernel timed by itself),
# SmolLM2's --decode-weights int8 decode was priced 286 tok/s where it ran 223-252 on 2 AMX cores.
# 51: gemm_amx/cpu/int4, a one-copy int4 weight's prompt GEMM on AMX (kernels' int4_tiled_gemm, within
# quant/int4.AMX_ROWS rows), fitted net of dequantize/cpu/int4 as gemm/cpu/int4 is; gemm/cpu/int4 itself timed on
# the dequantized oneDNN path (quant/int4.without_amx), which calls past AMX_ROWS take.
# 52: a CPU prompt's norms run natively with the residual adds before them (models/layers.RMSNorm.residual), one-copy
# int4 attention and FFN take bf16 rows without casts: runtime/prefill_code/<dtype> measured again (SmolLM2's
# 400-token TTFT 157 -> 136 ms on 2 AMX cores); gemm/cpu/int4 and gemm_amx/cpu/int4 time rows in the dtype the
# weight dequantizes for (no casts inside the call), as the prompt's blocks now hand them; gemm_amx/cpu/int4 at a quarter
# of quant/int4.AMX_ROWS (now 512) and at AMX_ROWS rows.
# 53: the AMX GEMM's and int4_tiled_dequantize's bf16 weights converted by VCVTNE(2)PS2BF16 and its scales read
# a vector a group (csrc/gemv.cpp int4t_vnni_tile): a Mixtral-width int4 expert's AMX call at 8 / 256 rows
# 6.1-7.3 / 21.7-28.8 -> 4.0 / 17.8-19.0 ms on 2 AMX cores; gemm_amx/cpu/int4 and gemm/cpu/int4 measured again.
# 54: runtime/batch_rows/int4q8 timed at 32 and 64 rows too (BATCH_ROWS, kept in meta["batch_rows"]): the native step's
# int4 projections over 48+ rows take the AMX GEMM where it runs (Int4TGemv::run_step), SmolLM2's 64-sequence step
# 1.09-1.15x as fast, which the 16-row points' slope had priced as the int8-row kernels' rows.
# 55: gemm_amx/cpu/int4 fitted with its weight term gemm_amx_pack/cpu/int4 (fit_gemm) on the AMX GEMM's calls at 32,
# 128 and 512 rows (AMX_FIT_ROWS), instead of net of dequantize/cpu/int4: the GEMM converts the weight into its tiles
# (~0.03 ns a weight on 2 AMX cores) where dequantize/cpu/int4 writes it to memory (0.1-0.4 ns), and
# op_time.amx_gemm_time added the latter to every call: a Mixtral-width int4 expert's 4096 x 14336 projection at 128
# rows was priced 23 ms for 7.3-9.3.
# 56: gemm_amx_floor/cpu/int4 (amx_floor): the 4096 x 14336 weight's AMX call at 32 rows a byte, which floors calls of
# fewer rows (op_time.amx_gemm_time): a Mixtral-width expert's AMX path at 9-16 rows was priced 9.3-10.6 ms for
# 13.0-13.3, and below the kernel's groups (10.2-12.2), which the planner then gave up from 9 rows
# (cpu_predict.priced_group_rows).
# 57: runtime/step_rows/int4 net of the AMX GEMM where the step runs its int4 projections on it (STEP_AMX_ROWS rows
# or more, meta["step_rows_amx"]), which the planner then prices the step's rows by (cpu_predict.step_amx_time): net
# of the row kernels, which cost more than the step's AMX calls at 64-256 rows, the code came out ~0.
# 58: the AMX GEMM's calls of up to 64 rows take one block of W at a time and K in chunks of 3 groups (csrc/gemv.cpp
# kAmxSmallTiles): an expert's projection at 16-64 rows 10-25% faster on 2 AMX cores, which gemm_amx/cpu/int4's
# 32-row point and gemm_amx_floor/cpu/int4 price; both measured again.
# 59: attn_prefill/cpu/<dtype> timed through models/layers.attend, whose whole bf16 prompts take tiered's AMX
# attention where it runs (csrc/gemv.cpp bf16_prompt_attention: SmolLM2's heads at 512 tokens 0.72 ms against torch's
# 0.98 on 2 AMX cores).
# 60: attn_rows/cpu/bf16 timed with the model's prompts attending in bf16 (layers.set_prompt_attention, as plans over a
# bf16 cache on AVX-512 BF16 choose), whose runs of rows take the AMX attention where it runs
# (gemv::bf16_runs_attention: SmolLM2's 512-token prompt as rows 155 -> 132 ms on 2 AMX cores); attn_prefill_past/cpu/bf16
# timed through layers.attend with the chunk's `past`, whose bf16 chunks take the AMX attention too.
# 61: the AMX attention's softmax in base 2 with its max moved lazily (csrc/gemv.cpp kAttnLazyMax): SmolLM2's heads at
# 512 / 1024 tokens 0.60 / 2.23 -> 0.31 / 1.11 ms on 2 AMX cores; attn_prefill, attn_prefill_past and attn_rows
# (cpu, bf16) measured again.
# 62: runtime/prefill_code/bf16 without the AMX attention (_EmptyMatmuls empties it as it does torch's SDPA): it had
# timed it on garbage beside attn_prefill's pricing of it.
# 63: the native step's int4 projections take the AMX GEMM from 24 rows (was 48; quant/int4.STEP_AMX_ROWS): the
# runtime/batch_rows/int4q8 point at 32 rows now times it.
# 64: gemm/cpu/int4 on a CPU with AMX timed at 1024 and 2048 rows (int4_gemm_shapes' `amx`), where its calls past
# quant/int4.AMX_ROWS dequantize (64 and 128 rows take the AMX GEMM there).
# 65: runtime/decode_layer/<fmt> with as many runs of layers for every shape, decode_ws_cold's bytes between two reads
# of a weight (its widest shape had been read again every ~180 MB, within the caches' reach).
# 66: a bf16 prompt's attention on AVX512-BF16 without AMX (csrc/gemv.cpp attn_block_avx512: Zen 4 / 5), where torch's
# SDPA and the native step's fp32 rows had computed it: attn_prefill, attn_prefill_past and attn_rows (cpu, bf16)
# measured again (SmolLM2's heads at 1024 tokens 3.9 ms against torch's 11.7 on 2 Zen 4 cores).
# 67: gemv/cpu/q6k, q5k and iq4xs, the GGUF k-quant / IQ4_XS decode copies as stored (quant/kquant.py), whose stream
# the native step's pricing takes at runtime/decode_layer/int8-g32's rate scaled by their kernels' own
# (op_time.step_stream): the k-quant loop prefetches into the L2 on every machine, and on the 2-core Zen 4 VM an
# IQ4_XS file's decode was priced 22.8 tok/s where it ran 30.9, a Q5_K_M file's 20.4 for 26.2 (2026-12-07).
# 68: decode_rows/cpu/q6kq8, q5kq8 and iq4xsq8, those copies' rows on int8 activations (a prompt run as rows of the
# native step, a batched step), which had been priced at int8-g32q8's slope: the IQ4_XS / Q5_K_M files' 512-token
# TTFTs 4855 / 4868 ms where they ran 3854 / 3875.
# 69: runtime/decode_layer/q6k, q5k and iq4xs, the native step over dense layers with those copies (KQUANT_LAYER_SHAPES),
# where op_time.step_stream had scaled int8-g32's by the gemv keys' ratio (the IQ4_XS file's decode priced 23.6-28.5
# tok/s where it ran 33-34); and the kernel tuning's byte-format prefetch switch (stream_prefetch_bytes), under which
# the int8-g32 and bf16 keys run.
# 70: expert_rows/cpu/int8-g32q8, q6kq8, q5kq8 and iq4xsq8 (EXPERT_ROWS_KINDS): a GGUF file's Q8_0 / Q6_K / Q5_K / IQ4_XS
# experts as stored, their rows in a prompt's layer calls, which the dense copies' decode_rows keys had priced
# 25-39% slow a Qwen3-30B-A3B-width expert.
PROFILER_VERSION = 70


# CPU keys the planner prices every model family by. One skipped because its timing raised (Bench.attempt) is
# an error of that run, not a kernel the machine lacks: an error inside the tuning's A/Bs once left a cached
# profile without gemm/cpu/int8, and every later plan of an int8 model raised ConfigError. The engine measures
# such a cached profile again (planner/auto._cached_or_measured), up to SKIP_RETRIES profiles in a row.
REQUIRED_CPU_KEYS = ("gemm/cpu/fp32", "gemm/cpu/bf16", "gemm/cpu/int8", "gemm/cpu/int4", "gemv/cpu/fp32",
                     "gemv/cpu/bf16", "gemv/cpu/int8", "gemv/cpu/int4")
SKIP_RETRIES = 2


def failed_cpu_keys(meta: dict | None) -> list[str]:
    """The REQUIRED_CPU_KEYS a profile's meta["skipped"] names: timings that raised."""
    return sorted(k for k in ((meta or {}).get("skipped") or {}) if k in REQUIRED_CPU_KEYS)


def failure_record(meta: dict, previous: dict | None) -> dict:
    """{"failed_attempts": n} for a new profile's meta: 0 where no REQUIRED_CPU_KEYS timing raised, else one
    more than the profile it replaces (`previous`, its meta) counted."""
    if not failed_cpu_keys(meta):
        return {"failed_attempts": 0}
    return {"failed_attempts": int((previous or {}).get("failed_attempts", 0)) + 1}


def profile_machine(quick: bool = True, disk_dir: str | Path | None = None, cuda: bool | None = None,
                    threads: int | None = None, progress: Progress | None = None,
                    previous: HardwareProfile | None = None) -> HardwareProfile:
    """Measure this machine and fit its HardwareProfile.

    Args:
        quick: a short run (58 s on 2 Zen 3 cores, 2026-12-01; fewer sizes, 5 repeats) instead of the
            full one (98 s there).
        disk_dir: where to write the temporary file for disk timings (default: the temp dir).
        cuda: profile the GPU too; None = when torch.cuda.is_available().
        threads: CPU threads for torch during the run (restored after); None = torch's current
            setting. Profile with the thread count the engine will use.
        progress: called with one line per fitted model.
        previous: the profile this one replaces, whose meta["attempts"] it counts on from when that
            one was contended (hardware/contention.record).
    Returns:
        A HardwareProfile named after the host, with meta (CPU model, threads, torch version, GPU
        name, raw points, skipped kernels, and "others_share" / "contended" / "attempts": how much of
        the cores other processes took meanwhile, hardware/contention.py; "failed_attempts": profiles in a
        row whose REQUIRED_CPU_KEYS timings raised) and the CPU/GPU/disk capacities in bytes.
    """
    cuda = torch.cuda.is_available() if cuda is None else cuda
    saved_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        return _run(quick, Path(disk_dir) if disk_dir else None, cuda, progress,
                    previous.meta if previous is not None else None)
    finally:
        torch.set_num_threads(saved_threads)


def _run(quick: bool, disk_dir: Path | None, cuda: bool, progress: Progress | None,
         previous: dict | None = None) -> HardwareProfile:
    load_before = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    neighbours = contention.start()
    b = _Bench(quick, disk_dir, progress)
    nosync = lambda: None  # noqa: E731
    r = b.repeats
    # CPU
    # (4 shapes at least: the weight term beside the multiply-adds' line, fit_gemm)
    gemm_shapes = [(64, 1024, 1024), (256, 1024, 1024), (128, 2048, 1024), (512, 1024, 1024)] if quick else \
        [(64, 1024, 1024), (128, 1024, 1024), (256, 1024, 1024), (512, 1024, 1024),
         (128, 2048, 2048), (256, 2048, 2048), (64, 4096, 2048)]
    gemv_shapes = [(1, 512, 512), (1, 1024, 1024), (1, 2048, 2048), (1, 4096, 2048)] if quick else \
        [(1, 512, 512), (1, 1024, 512), (1, 1024, 1024), (1, 2048, 1024), (1, 2048, 2048), (1, 4096, 2048),
         (1, 4096, 4096), (1, 8192, 4096)]
    llc = last_level_cache_bytes()
    if kernels.available() and llc and 3 * llc <= 3 * 2**30:
        try:  # the memory-speed probe timed beside every CPU GEMV key (Probe)
            b.probe = Probe(llc)
        except Exception as e:  # noqa: BLE001  (as Bench.attempt: note it, keep going)
            b.skip("probe", e)
    pr = b.probe
    if kernels.available():
        try:  # the compute-speed probe timed around every compute-bound key (ComputeProbe)
            b.compute = ComputeProbe()
        except Exception as e:  # noqa: BLE001  (as Bench.attempt: note it, keep going)
            b.skip("compute_probe", e)
    for dtype in ("fp32", "bf16", "int8", "int4"):
        # a prompt's one-copy int4 GEMM past the kernel's rows (tiered's kernels): dequantization, then the GEMM
        dequantized = dtype == "int4" and kernels.available()
        shapes = int4_gemm_shapes(gemm_shapes, amx_kernels() is not None) if dequantized else gemm_shapes
        if dequantized:
            b.attempt("dequantize/cpu/int4", lambda sh=shapes: _dequantize_points(sh, r))
        with without_amx():  # oneDNN's GEMM, what calls past AMX_ROWS take (quant/int4.without_amx)
            b.attempt(f"gemm/cpu/{dtype}", lambda d=dtype, sh=shapes, dq=dequantized: _net_of_dequantize(
                _gemm_points("cpu", d, sh, nosync, r, False), sh, b.models.get("dequantize/cpu/int4") if dq else None),
                weights=[K * N * bytes_per_element(dtype) for _, K, N in shapes])
        if dequantized and amx_kernels() is not None:  # ... and calls within AMX_ROWS on a CPU with AMX
            amx = amx_gemm_shapes(shapes)
            # over multiply-adds and each call's weight (its conversion into the tiles: gemm_amx_pack/cpu/int4)
            b.attempt("gemm_amx/cpu/int4", lambda sh=amx: _amx_points(sh, r, 2 * llc if llc and llc <= 2**30 else None),
                      weights=[K * N * bytes_per_element("int4") for _, K, N in amx])
            floor = amx_floor(b.points.get("gemm_amx/cpu/int4"), amx)
            if floor is not None:
                b.models["gemm_amx_floor/cpu/int4"], b.points["gemm_amx_floor/cpu/int4"] = floor
        b.attempt(f"gemv/cpu/{dtype}", lambda d=dtype: _gemm_points("cpu", d, gemv_shapes, nosync, r, True, probe=pr))
    if kernels.available():  # routed int4 experts' batch-1 kernel (op_time.gemv_dtype)
        b.attempt("gemv/cpu/int4q8", lambda: _gemm_points("cpu", "int4q8", gemv_shapes, nosync, r, True, probe=pr))
        # int8 per group of 32: Q5_x/Q6_K decode copies and Q8_0/Q6_K experts (tiled, N % 16 == 0)
        b.attempt("gemv/cpu/int8-g32", lambda: _gemm_points("cpu", "int8-g32", gemv_shapes, nosync, r, True, probe=pr))
        # e4m3 with 128 x 128 block scales: an fp8 checkpoint's weights and fp8 experts (quant/fp8.py)
        b.attempt("gemv/cpu/fp8", lambda: _gemm_points("cpu", "fp8", gemv_shapes, nosync, r, True, probe=pr))
        # GGUF Q6_K / Q5_K / IQ4_XS decode copies as stored (quant/kquant.py; every shape's K a multiple of 256)
        for kind in KQUANT_KINDS:
            b.attempt(f"gemv/cpu/{kind}", lambda k=kind: _gemm_points("cpu", k, gemv_shapes, nosync, r, True, probe=pr))
    attn_shapes = [(32, 256, 128), (32, 1024, 128), (32, 2048, 128)] if quick else \
        [(32, 256, 128), (32, 512, 128), (32, 1024, 128), (32, 2048, 128), (64, 2048, 128)]
    for dtype in ("fp32",) if quick else ("fp32", "bf16"):
        b.attempt(f"attn/cpu/{dtype}", lambda d=dtype: _attn_points("cpu", d, attn_shapes, nosync, r))
    # the GEMM fit's shapes are 1-4 MiB weights; real FFN matrices are not: 32 to 112 MiB of bf16 weights, met
    # once a prompt, beyond the last-level cache (copies cycled over twice its size)
    big_gemms = [(256, 4096, 4096), (256, 4096, 8192), (256, 4096, 14336)]
    big_cold = 2 * llc if llc and 2 * llc <= 2 * 2**30 else None
    # torch's bf16 GEMMs at a few rows (a short prompt's, an expert's past its native rows) over cold weights
    b.attempt("gemm_rows/cpu/bf16", lambda: _gemm_rows_points("bf16", GEMM_ROWS_SHAPES, max(3, r // 2), big_cold))
    if not bf16_gemm_native():  # its bf16 GEMMs run in fp32 over the converted weight (hardware/cpu_gemm.linear)
        b.attempt("convert/cpu/bf16", lambda: _convert_points(CONVERT_SHAPES, max(3, r // 2), big_cold))
        b.attempt("convert_big/cpu/bf16", lambda: _convert_points(CONVERT_BIG_SHAPES, max(3, r // 2), big_cold))
    if kernels.available():  # the native bf16 expert at 1-8 rows (a short prompt's experts)
        b.attempt("expert_rows/cpu/bf16", lambda: _expert_rows_points(max(3, r // 2), big_cold))
        # the tiled int4 expert on int8 activations at 2-8 rows (a prompt's Q4_0 experts, in calls of 8 rows)
        b.attempt("expert_rows/cpu/int4q8", lambda: _expert_rows_q8_points(max(3, r // 2), big_cold))
        # ... and its rows past the first group (a prompt's 9+ rows an expert: groups streaming the weights again)
        b.attempt("expert_groups/cpu/int4q8", lambda: _expert_groups_int4q8_points(max(3, r // 2), big_cold))
        # a GGUF file's other expert kinds as stored (a Q8_0 file's int8-g32, the k-quants), in the same layer calls
        for kind in EXPERT_ROWS_KINDS:
            b.attempt(f"expert_rows/cpu/{kind}q8",
                      lambda k=kind: _expert_rows_q8_points(max(3, r // 2), big_cold, kind=k))
        # the decode kernels at a batched step's rows; int4q8: int4 on int8 activations (Plan.batch_act "q8",
        # a server's batches: 3.4 ps a row's multiply-add against 11.5 on bf16 ones, 2 AMX cores, 2026-11-29);
        # int8-g32q8: the tiled int8-g32 copies (a GGUF file's Q8_0 / Q6_K head) on int8 activations there
        # q6kq8 / q5kq8 / iq4xsq8: the k-quant copies' batched rows (a prompt's, as rows of the native step) on int8 ones
        for dtype in ("int4", "int4q8", "int8", "int8-g32q8", "bf16", "fp32", *(k + "q8" for k in KQUANT_KINDS)):
            b.attempt(f"decode_rows/cpu/{dtype}", lambda d=dtype: _decode_rows_points(d, max(3, r // 2), None))
    for dtype in ("bf16", "fp32"):
        b.attempt(f"gemm_big/cpu/{dtype}",
                  lambda d=dtype: _gemm_points("cpu", d, big_gemms, nosync, max(3, r // 2), False, cold_bytes=big_cold))
    prefill_shapes = [(8, 128, 128, 64), (8, 256, 256, 64), (8, 512, 512, 64)]
    past_shapes = [(8, 1024, 2048, 64), (8, 1024, 3072, 64), (8, 1024, 4096, 64)]
    for dtype in ("fp32", "bf16"):  # prefill attention runs in the activations' dtype
        b.attempt(f"attn_prefill/cpu/{dtype}", lambda d=dtype: _attn_prefill_points(d, prefill_shapes, r))
        # a chunk after cached tokens (a prompt longer than a CPU plan's prefill_chunk: sizes.CPU_PREFILL_TOKENS)
        b.attempt(f"attn_prefill_past/cpu/{dtype}", lambda d=dtype: _attn_prefill_points(d, past_shapes, max(3, r // 2)))
    mem_sizes = [8, 32, 96] if quick else [16, 64, 256, 512]
    b.attempt("memory/bandwidth/cpu", lambda: _memory_points("cpu", mem_sizes, nosync, r, copy=False))
    if llc and 4 * llc <= 4 * 2**30:  # reads no cache holds: a decode step whose weights exceed the cache
        b.llc = llc
        dram = [2 * llc // MiB, 3 * llc // MiB, 4 * llc // MiB]
        b.attempt("memory/bandwidth_dram/cpu", lambda: _memory_points("cpu", dram, nosync, max(5, r // 2), copy=False))
        if kernels.available():  # the decode kernels' own rate from DRAM, weights no cache holds
            dram_gemvs = [(1, 2048, 2048), (1, 4096, 2048), (1, 4096, 4096)]
            for dtype in ("bf16",) if quick else ("fp32", "bf16", "int8", "int4"):
                b.attempt(f"gemv_dram/cpu/{dtype}", lambda d=dtype: _gemm_points(
                    "cpu", d, dram_gemvs, nosync, max(3, r // 2), True, cold_bytes=3 * llc, probe=pr))
            # the native bf16 expert at one row over experts of real width, as a CPU expert streams them
            b.attempt("expert_dram/cpu/bf16", lambda: _expert_dram_points(max(3, r // 2), 3 * llc, probe=pr))
            for kv in ("bf16", "fp32", "int8"):  # the native step's attention over a cache in DRAM
                b.attempt(f"attn_decode/cpu/{kv}", lambda k=kv: _attn_decode_points(k, r))
    if kernels.available():  # ... and over a prompt's own keys, as rows of the step
        for kv in ("bf16", "fp32", "int8"):
            b.attempt(f"attn_rows/cpu/{kv}", lambda k=kv: _attn_rows_points(k, r))
    b.attempt("memory/copy/cpu", lambda: _memory_points("cpu", mem_sizes, nosync, r, copy=True))
    b.models["launch/cpu"] = LinearModel(_launch_time("cpu", nosync), 0.0, None)
    b.say(f"launch/cpu: {b.models['launch/cpu'].alpha:.3g} s")
    b.models["runtime/task"] = LinearModel(_task_overhead(), 0.0, None)
    try:
        b.models["runtime/engine_token"] = LinearModel(_engine_token_seconds(r), 0.0, None)
        b.say(f"runtime/engine_token: {b.models['runtime/engine_token'].alpha:.3g} s")
    except Exception as e:  # noqa: BLE001  (as Bench.attempt: note it, keep going)
        b.skip("runtime/engine_token", e)
    for dtype in ("fp32", "bf16"):
        b.attempt(f"runtime/decode_step/{dtype}", lambda d=dtype: _decode_step_points(r, d))
    if kernels.available():  # the native step's dense int4 layers at real widths, weights from memory
        code = b.models.get("runtime/decode_step/bf16")  # the layer code beside int4 copies (step_overhead's)
        cold = decode_ws_cold(b.llc, quick)  # (what passes between two reads of a weight: beyond the caches)
        b.attempt("runtime/decode_layer/int4", lambda: _decode_layer_points(
            r, cold_bytes=cold, probe=pr, layer_code=code.beta if code is not None else 0.0))
        # ... and with int8 copies per group of 32 (a GGUF Q8_0 file's, --decode-weights int8's, a Q8_0 head's)
        b.attempt("runtime/decode_layer/int8-g32", lambda: _decode_layer_points(
            r, cold_bytes=cold, probe=pr, layer_code=code.beta if code is not None else 0.0, fmt="int8-g32"))
        # ... and with a GGUF file's Q6_K / Q5_K / IQ4_XS copies as stored (widths a multiple of 256)
        for kind in KQUANT_KINDS:
            b.attempt(f"runtime/decode_layer/{kind}", lambda k=kind: _decode_layer_points(
                r, KQUANT_LAYER_SHAPES, cold, pr, code.beta if code is not None else 0.0, fmt=k))
        # ... and cycled over working sets the caches may hold (a small model's step)
        b.attempt("runtime/decode_ws/int4", lambda: _decode_ws_points(
            r, b.llc, layer_code=code.beta if code is not None else 0.0, quick=quick))
        b.attempt("runtime/step_rows/int4", lambda: _step_rows_points(r))  # ... and its code at prompt rows
        b.attempt("runtime/batch_rows/int4q8", lambda: _batch_rows_points(r))  # ... and a batched step's rows
        try:  # a decode burst's token beyond its layers' code
            b.models["runtime/burst_token"] = LinearModel(
                _burst_token_seconds(r, code.beta if code is not None else 0.0), 0.0, None)
            b.say(f"runtime/burst_token: {b.models['runtime/burst_token'].alpha:.3g} s")
        except Exception as e:  # noqa: BLE001  (as Bench.attempt: note it, keep going)
            b.skip("runtime/burst_token", e)
    for dtype in ("fp32", "bf16"):  # a prompt's model code beyond its GEMMs and attention
        b.attempt(f"runtime/prefill_code/{dtype}", lambda d=dtype: _prefill_code_points(d, max(5, r)))
    b.attempt("runtime/moe_step/bf16", lambda: _moe_step_points(r))
    b.attempt("runtime/mla_step/bf16", lambda: _mla_step_points(r))
    b.say(f"runtime/task: {b.models['runtime/task'].alpha:.3g} s")
    b.again()  # the compute-bound row keys a second time, the runtime keys' timing after their first
    # disk
    disk_sizes = [1, 4, 16] if quick else [1, 4, 16, 64, 128]
    try:
        reads, parallel, writes, note = _disk_points(b.disk_dir, disk_sizes, r)
        b.fit("disk/read_cold", reads)
        b.fit("disk/read_cold_parallel", parallel)
        b.fit("disk/write", writes)
    except OSError as e:
        note = f"disk timing failed: {e}"
        b.skipped["disk/read_cold"] = note
    b.again()  # the compute-bound row keys a third time, the disk's timing after their second
    b.settle()
    # GPU
    if cuda:
        sync = torch.cuda.synchronize
        g_gemm = [(256, 4096, 4096), (1024, 4096, 4096), (2048, 4096, 8192)] if quick else \
            [(256, 4096, 4096), (512, 4096, 4096), (1024, 4096, 4096), (2048, 4096, 8192), (4096, 8192, 8192)]
        g_gemv = [(1, 4096, 4096), (1, 8192, 8192), (1, 8192, 28672)] if quick else \
            [(1, 4096, 4096), (1, 8192, 4096), (1, 8192, 8192), (1, 4096, 14336), (1, 8192, 28672)]
        for dtype in ("fp32", "bf16", "fp16", "int8", "int4"):
            b.attempt(f"gemm/gpu/{dtype}", lambda d=dtype: _gemm_points("gpu", d, g_gemm, sync, r, False))
            if dtype != "int8":  # _int_mm needs more than 16 rows
                b.attempt(f"gemv/gpu/{dtype}", lambda d=dtype: _gemm_points("gpu", d, g_gemv, sync, r, True))
        b.attempt("attn/gpu/fp16", lambda: _attn_points("gpu", "fp16", [(512, 1024, 128), (512, 4096, 128),
                                                                          (2048, 4096, 128)], sync, r))
        b.attempt("memory/bandwidth/gpu", lambda: _memory_points("gpu", [64, 256, 1024], sync, r, copy=False))
        b.attempt("memory/copy/gpu", lambda: _memory_points("gpu", [64, 256, 1024], sync, r, copy=True))
        b.models["launch/gpu"] = LinearModel(_launch_time("gpu", sync), 0.0, None)
        b.attempt("gemv_graph/gpu/bf16", lambda: _gemv_graph_points("bf16", g_gemv, r))
        b.attempt("runtime/decode_step_gpu/bf16", lambda: _decode_step_points(r, "bf16", "cuda"))
        b.attempt("runtime/decode_step_graphed_gpu/bf16", lambda: _decode_step_points(r, "bf16", "cuda", "piecewise"))
        b.attempt("runtime/decode_step_graph_gpu/bf16", lambda: _decode_step_points(r, "bf16", "cuda", "whole"))
        b.attempt("runtime/moe_cpu_layer_gpu/bf16", lambda: _moe_cpu_layer_points(r, "cuda"))
        copy_sizes = [1, 4, 16, 64] if quick else [1, 4, 16, 64, 256]
        for kind in ("h2d_pinned", "h2d_pageable", "d2h_pinned", "d2h_pageable"):
            b.attempt(f"copy/{kind}", lambda k=kind: _copy_points(k, copy_sizes, r))
        try:  # CPU experts beside H2D copies: how much each slows the other (dispatcher: LatencyModel.together)
            b.host_share = _host_share(2 * (llc or 0), 0.2 if quick else 0.5)
            b.say(f"host_share: CPU expert x{b.host_share['cpu']:.2f}, H2D x{b.host_share['h2d']:.2f} together")
        except Exception as e:  # noqa: BLE001  (as Bench.attempt: note it, keep going)
            b.skip("host_share", e)
    host = socket.gethostname()
    meta = _meta(b, cuda)
    meta["profiler_version"] = PROFILER_VERSION
    meta["native_kernels"] = kernels.available()
    meta["kernels_build"] = kernels.build_name() if meta["native_kernels"] else None  # what timed the native keys
    meta["kernel_tuning"] = kernels.tuning()  # ... tuned so (None without them)
    if meta["native_kernels"]:  # rows from which a one-copy int4 weight's prompt GEMM dequantizes (gemm/cpu/int4)
        meta["int4_dequantize_rows"] = dequantize_rows()
        meta["kernel_isa"] = kernels.isa()  # the paths a CPU expert's prompt rows take (cpu_predict.prompt_expert_time)
        # runtime/step_rows/int4 timed net of the AMX GEMM from STEP_AMX_ROWS rows (cpu_predict.step_amx_time)
        meta["step_rows_amx"] = amx_kernels() is not None and "runtime/step_rows/int4" in b.models
    # False (AVX2 only): a bf16 engine's projections are CastLinears, on the native kernel up to its rows
    meta["bf16_gemm_native"] = bf16_gemm_native()
    meta["disk_note"] = note
    meta["load_average"] = load_before
    meta.update(contention.record(neighbours, previous))
    meta.update(failure_record(meta, previous))  # ... measured again by the engine, SKIP_RETRIES in a row at most
    if b.host_share is not None:
        meta["host_share"] = b.host_share
    if b.probes:  # the memory-speed probe's seconds beside each CPU GEMV key (Probe)
        meta["probe"] = {"shape": list(PROBE_SHAPE), "bytes": b.probe.nbytes, "seconds": dict(b.probes)}
        swing = probe_swing(b.probe_pairs)
        if swing is not None:  # how far the memory's speed moved within one key's timing
            meta["probe"]["swing"] = round(swing, 4)
    b.probe = None  # its copies' memory back before the profile is returned
    seconds = {k: float(np.median(v)) for k, v in b.compute_seconds.items()}
    if seconds:  # the compute-speed probe's median reading around each compute-bound key (ComputeProbe)
        meta["compute_probe"] = {"shapes": [list(s) for s in COMPUTE_PROBE_SHAPES], "seconds": seconds}
        swing = probe_swing(b.compute_pairs)
        if swing is not None:
            meta["compute_probe"]["swing"] = round(swing, 4)
    b.compute = None
    notes = list(b.notes)
    if meta["contended"]:
        notes.append(f"other processes took {meta['others_share']:.0%} of the cores while profiling: CPU timings "
                     "are theirs as much as this machine's (the engine measures such a profile again once "
                     "the machine is quiet)")
    elif load_before is not None and load_before > (os.cpu_count() or 1) - 0.5:
        notes.append(f"load average {load_before:.1f} on {os.cpu_count()} cores before profiling: other "
                     "processes competed for the CPU, so CPU timings may be noisy (see R^2)")
    if notes:
        meta["notes"] = notes
    return HardwareProfile(
        name=host,
        source=f"measured on {host} {_dt.datetime.now().isoformat(timespec='seconds')} by `tiered profile`"
               f" ({'quick' if quick else 'full'})",
        models=dict(b.models),
        gpu_memory=torch.cuda.get_device_properties(0).total_memory if cuda else None,
        cpu_memory=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else None,
        meta=meta)
