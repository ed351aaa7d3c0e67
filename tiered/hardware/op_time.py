"""Time of one operation from a HardwareProfile: key lookup with dtype fallbacks and a roofline.

A GEMM is priced as the slower of its two fitted regimes (ALGORITHMS.md 1.f S2, resolved with a
roofline of affine models):

    t = max( gemm/<dev>/<dtype>(MACs),  gemv/<dev>/<dtype>(weight bytes) )

`gemm` is the compute-bound fit (many tokens), `gemv` the memory-bound fit (few tokens: time tracks
the weight bytes streamed, not the MACs). When a profile has no `gemv` key, the memory part falls
back to memory/bandwidth/<dev>; when it has neither (e.g. ScheInfer's Table I, one line per
precision), the GEMM fit alone is used. Decode attention is priced the same way with `attn`
(MACs) against the KV-cache bytes it reads.
"""

from __future__ import annotations

import math

from tiered.errors import ConfigError
from tiered.hardware.profile import HardwareProfile, LinearModel
from tiered.memory.sizes import bytes_per_element  # noqa: F401  (re-exported: op_time.bytes_per_element)

# Which fitted dtype stands in for a missing one (same width first, then wider).
DTYPE_FALLBACK = {
    "fp32": ("fp32",),
    "bf16": ("bf16", "fp16", "fp32"),
    "fp16": ("fp16", "bf16", "fp32"),
    "int8": ("int8",),
    "int8-g32": ("int8-g32", "int8"),  # the same tiled int8 stream with a scale per 32 weights
    "fp8": ("fp8", "int8"),  # a byte per weight too (quant/fp8.py), until a profile measures fp8
    "int4": ("int4",),
    "int4q8": ("int4q8", "int4"),  # int4 on int8 activations (routed experts); older profiles: int4's
    "int8-g32q8": ("int8-g32q8", "int8-g32", "int8"),  # int8-g32 decode copies' batched calls on int8 activations
    # GGUF Q6_K / Q5_K decode copies as stored (quant/kquant.py): until a profile times their kernels, a byte of them
    # at the int8-g32 copies' rate (2 Zen 4 cores, 4096 x 14336 at one row from memory, q6k: 28.2 GB/s against
    # 27.5-29.6, 2026-12-07); their batched calls on int8 activations at int8-g32q8's. A routed k-quant expert at
    # one token on "q8" (Plan.expert_act) reads int16 activations (ExpertSpec: int8 from two rows), so its gemv key
    # is the one-row kernel's (gemv/cpu/q6k: no gemv/cpu/q6kq8 is timed; decode_rows/cpu/q6kq8 is)
    "q6k": ("q6k", "int8-g32", "int8"),
    "q6kq8": ("q6kq8", "q6k", "int8-g32q8", "int8-g32", "int8"),
    "q5k": ("q5k", "int8-g32", "int8"),
    "q5kq8": ("q5kq8", "q5k", "int8-g32q8", "int8-g32", "int8"),
    # GGUF IQ4_XS as stored: the same loop over nibbles through a table, priced as the k-quants until profiled
    "iq4xs": ("iq4xs", "int8-g32", "int8"),
    "iq4xsq8": ("iq4xsq8", "iq4xs", "int8-g32q8", "int8-g32", "int8"),
    # tiled per-row int8 experts' calls of 2+ rows on int8 activations: the same kernel's rows as int8-g32q8's, the
    # per-row int8 stream at one row
    "int8q8": ("int8q8", "int8-g32q8", "int8"),
    "mxfp4": ("int4q8", "int4"),  # gpt-oss's MXFP4 experts: the tiled int4 kernels on int8 activations
}


def gemv_dtype(kind: str, act: str = "bf16") -> str:
    """The gemv/cpu/<dtype> key a matmul of a routed expert's (or a decode copy's) `kind` weight ("bf16", "int8",
    "int4", ...) on `act` activations is priced by: "int4q8" for int4 on int8 ones (Plan.expert_act "q8": half
    the multiply-adds, so a faster stream where the int16 / bf16 path is compute-bound), "int8-g32q8" / "int8q8"
    for the tiled int8 kinds on int8 ones (calls of 2+ rows where Plan.batch_act is "q8": ExpertSpec's
    int8_q8_from; their one-row stream falls back to int8-g32's / int8's keys), else kind (mxfp4's key falls back
    to int4q8's: DTYPE_FALLBACK; which activations a format's experts read at one token is
    quant/experts.token_activations')."""
    if act != "q8":
        return kind
    return {"int4": "int4q8", "int8-g32": "int8-g32q8", "int8": "int8q8", "q6k": "q6kq8", "q5k": "q5kq8",
            "iq4xs": "iq4xsq8"}.get(kind, kind)


def find(profile: HardwareProfile, op: str, device: str, dtype: str) -> LinearModel | None:
    """The model `<op>/<device>/<dtype>` or its nearest fallback dtype; None when none is fitted."""
    d = found_dtype(profile, op, device, dtype)
    return None if d is None else profile.models[f"{op}/{device}/{d}"]


def found_dtype(profile: HardwareProfile, op: str, device: str, dtype: str) -> str | None:
    """The dtype whose `<op>/<device>/<dtype>` model `find` returns: `dtype` or its nearest fallback
    (DTYPE_FALLBACK) that the profile fitted; None when none is."""
    return next((d for d in DTYPE_FALLBACK.get(dtype, (dtype,)) if profile.has(f"{op}/{device}/{d}")), None)


def has_device(profile: HardwareProfile, device: str) -> bool:
    """The profile prices some GEMM on `device` ("cpu" or "gpu")."""
    return any(k.startswith(f"gemm/{device}/") for k in profile.models)


def memory_time(profile: HardwareProfile, device: str, dtype: str, nbytes: float, op: str = "gemv",
                working_set: float = 0.0, expert: bool = False, intercept: bool = True) -> float:
    """Seconds to stream `nbytes` of operands through `device`; 0 when the profile cannot say.

    The op's own fit (gemv/<dev>/<dtype>), floored by the device's read bandwidth
    (memory/bandwidth/<dev>, its per-byte term): no kernel reads its weights faster than the memory
    delivers them. The floor binds where the GEMV fit was timed on weights a large last-level cache
    partly holds (the profiler rotates CPU GEMVs over 64 MiB): on the H200's 16-core Xeon host the
    bf16 GEMV fit runs at 93 GB/s against 84 GB/s for a plain read; on 2 cores the GEMV is the
    slower of the two and the floor never binds. A routed expert's weights beyond the cache, where
    expert_dram is profiled, are floored by that rate instead (dram_floor).

    Bandwidth models price bytes by their per-byte term alone: their points are reads of 8-512 MiB,
    and an intercept fitted to them is noise that, charged to every small read, once priced
    SmolLM2's bf16 decode step at 23 ms against 10.5 measured (a 0.46 ms intercept on a VM whose
    bandwidth swung during the full profile's reads).

    `working_set`: bytes read between two reads of the same weight (a decode step's weights). When
    it exceeds the last-level cache (meta["llc_bytes"]), no read hits the cache and the floor is the
    memory's own rate beyond it, memory/bandwidth_dram/<dev>, when profiled.

    `expert`: the bytes are a routed expert's, read by the native expert kernel. Where the profile timed
    that kernel (expert_dram/<dev>/<dtype>: beyond the cache, in huge pages, as the runtime holds its
    experts), its rate is the expert's price beyond the cache (dram_floor) and the most it costs within
    it: the GEMV fit is another kernel's (the decode GEMV's, over matrices of 0.5-64 MiB). On 2 AMX cores
    (2026-11-29) that fit read 19 GB/s and the expert kernel 27 from DRAM; the all-in-RAM MoE's decode
    (2 x 22 MiB experts a layer) was priced at the fit, 23.7 ms a step against 17.1 measured.

    `intercept` False: the op's per-byte term alone, for calls issued back to back inside tiered's native
    decode step, whose fixed costs a layer runtime/decode_step prices once (op_time.step_overhead). The
    gemv fits' intercepts are what a call issued alone from Python pays beyond its bytes (the binding, the
    threads' wake-up, a cold matrix's first reads): on 2 AMX cores the int4 kernel's 21-30 us against
    1.2 us for a hot 64 x 64 one, where SmolLM2's default engine stepped in 4.7 ms and its 120 int4 calls
    and int8 head, each priced with that intercept, came to 7.9 (2026-11-29).
    """
    m = find(profile, op, device, dtype)
    bw = profile.models.get(f"memory/bandwidth/{device}")
    kernel = find(profile, "expert_dram", device, dtype) if expert and op == "gemv" else None
    floor = dram_floor(profile, device, working_set, dtype if op == "gemv" else None, expert)
    if kernel is None or not beyond_cache(profile, working_set):  # (beyond it, the expert kernel's own stream)
        floor = max(bw.beta if bw is not None else 0.0, floor)
    if m is None:  # a read's time is its bytes at the memory's rate (bandwidth fits' intercepts are noise)
        return nbytes * floor
    t = max(m(nbytes) - (0.0 if intercept or nbytes <= 0 else m.alpha), nbytes * floor)
    if kernel is None:
        return t
    own = nbytes * max(floor, kernel.beta)  # the expert kernel's own stream, no faster than the memory
    return own if beyond_cache(profile, working_set) else min(t, own)


def beyond_cache(profile: HardwareProfile, working_set: float) -> bool:
    """Whether `working_set` bytes exceed the profile's last-level cache (meta["llc_bytes"]; False where
    the profile does not know it): no read of such a set hits the cache."""
    llc = profile.meta.get("llc_bytes") if profile.meta else None
    return bool(llc and working_set > llc)


def dram_floor(profile: HardwareProfile, device: str, working_set: float, dtype: str | None = None,
               expert: bool = False) -> float:
    """Seconds per byte below which `device` cannot stream operands when `working_set` bytes pass
    between two reads of the same one [s/byte]: once the working set exceeds the last-level cache
    (meta["llc_bytes"]), the slower of memory/bandwidth_dram/<dev> (plain reads) and, for a `dtype`
    GEMV, the kernel's own rate over weights no cache holds: gemv_dram/<dev>/<dtype> (the decode
    GEMV: on the H200's host one bf16 expert streamed 81 GB/s where plain reads did 98); for an
    `expert`'s weights, expert_dram/<dev>/<dtype> where profiled (the native expert kernel on
    experts of real width in huge pages, as the runtime holds them: on the H100's 16-core host the
    decode GEMV over 8-32 MiB matrices read 69 GB/s where a Mixtral expert streamed ~90, and the
    plans priced each CPU expert 5.1 ms against 3.9 measured). Else 0 (the cache may serve it).

    An expert's weights, where expert_dram is profiled, are floored by that rate alone: the plain reads (torch's
    sum over huge pages) are another kernel's stream, and the expert key times the runtime's own. On 2 Zen 3 cores
    (2026-12-01) they read 21.5 GB/s where the native expert streamed 26.9, and as the floor they priced the
    all-in-RAM MoE's decode 13% slow (median of 8 rounds alternated with its measurement; 7% fast without it).
    A dense step keeps both floors: there SmolLM2's bf16 and fp32 decode streamed at about the plain reads' rate
    (gemv_dram's 8-32 MiB matrices read 28.6), and priced by gemv_dram alone its rows went 7-8% -> 10-12% off."""
    if not beyond_cache(profile, working_set):
        return 0.0
    kernel = find(profile, "expert_dram", device, dtype) if dtype and expert else None
    if kernel is not None:
        return kernel.beta
    dram = profile.models.get(f"memory/bandwidth_dram/{device}")
    kernel = find(profile, "gemv_dram", device, dtype) if dtype else None
    return max(m.beta for m in (dram, kernel, LinearModel(0.0, 0.0, None)) if m is not None)


# A GEMM over at least this many weight bytes a call is priced by gemm_big/<dev>/<dtype>'s line, timed on
# 32-112 MiB matrices, where profiled: the GEMM fit's shapes are 2-4 MiB weights, whose rate says little
# about a real projection's either way. On the H200's host (16 cores, AMX) prompt GEMMs on 112 MiB
# matrices ran at ~1.0e12 MAC/s where the quick fit said 2.9e12; on the H100's (2026-11-26) at 2.8e12
# where the quick fit (R^2 0.25) said 1.0e11, and the no-GPU 512-token TTFTs were priced 14x too slow
# (9.0 s predicted, 0.58 s measured). On 2 Zen 4 cores the two agree (bf16). From 16 MiB on (a
# 4096 x 2048 bf16 matrix; Llama-3-8B's attention projections are 8 and 32 MiB) the big line is nearer.
BIG_GEMM_BYTES = 16 * 2**20


# A GEMM of at least this many rows is a prompt's: it pays gemm_big's intercept per call.
PROMPT_GEMM_ROWS = 64

# Top-k of the tiny MoE whose CPU-path decode layers the profiler times on CUDA (runtime/moe_cpu_layer_gpu/bf16);
# planner/latency_moe.LayerCosts prices that layer with it.
MOE_PROBE_TOP_K = 2

# Rows at which the profiler times torch's GEMM over cold weights (gemm_rows/cpu/<dtype>): a short prompt's,
# an expert's past its native rows (planner/cpu_predict.torch_gemm_time prices the rows beyond).
GEMM_ROWS = 8


def gemm_line(profile: HardwareProfile, device: str, dtype: str, bytes_per_call: float, fit: LinearModel,
              tokens: float | None = None) -> LinearModel:
    """The affine model [s per call, s per MAC] of a GEMM over `bytes_per_call` weight bytes a call:
    from BIG_GEMM_BYTES on where profiled, gemm_big/<dev>/<dtype>'s (with the dtype fallbacks), else
    `fit` (the gemm key's), its call term plus the weight's bytes at gemm_pack's rate (gemm_pack) for
    calls of GEMM_ROWS `tokens` or more (the rows its fit was timed at are 64-512). gemm_big's intercept
    (1.5 ms a call on the H100's host, where oneDNN packs the weight for AMX at every call) is charged
    only to calls of PROMPT_GEMM_ROWS `tokens` or more; fewer rows, or `tokens` None, keep `fit`'s:
    charged per call, it priced CPU experts' and CC slices' decode GEMVs 4x too slow."""
    m = find(profile, "gemm_big", device, dtype) if bytes_per_call >= BIG_GEMM_BYTES else None
    if m is not None:
        return m if tokens is not None and tokens >= PROMPT_GEMM_ROWS else LinearModel(fit.alpha, m.beta, m.r2)
    pack = gemm_pack(profile, device, dtype)
    if pack is None or tokens is None or tokens < GEMM_ROWS:
        return fit
    return LinearModel(fit.alpha + pack * bytes_per_call, fit.beta, fit.r2)


def gemm_pack(profile: HardwareProfile, device: str, dtype: str) -> float | None:
    """Seconds a byte of `dtype` weight that each call of the GEMM fit's dtype (find's fallback) pays beside its
    multiply-adds: gemm_pack/<dev>/<that dtype> (hardware/profiler.fit_gemm: torch's CPU GEMMs read and pack,
    or dequantize, the weight at every call), per byte of `dtype`; None where the profile fitted none (before
    profiler 41, GPU keys, presets: the GEMM line is then over multiply-adds alone)."""
    d = found_dtype(profile, "gemm", device, dtype)
    m = None if d is None else profile.models.get(f"gemm_pack/{device}/{d}")
    return None if m is None else m.beta * bytes_per_element(d) / bytes_per_element(dtype)


def graph_gemv(profile: HardwareProfile, device: str, dtype: str) -> LinearModel | None:
    """gemv_graph/<dev>/<dtype> (with the dtype fallbacks): a GEMV's cost replayed in a captured CUDA
    graph, [s a call, s a weight byte]; None where the profile did not time it (then the eager
    gemv fit prices graphed GEMVs too, its intercept being mostly the host's)."""
    return find(profile, "gemv_graph", device, dtype)


def gemm_time(profile: HardwareProfile, device: str, dtype: str, macs: float, weight_bytes: float = 0.0,
              calls: int = 1, graphed: bool = False, expert: bool = False) -> float:
    """Seconds for `calls` GEMMs totalling `macs` multiply-accumulates over `weight_bytes` of weights.
    Calls over big weights take gemm_big's line, calls of GEMM_ROWS rows or more over smaller ones pay their
    weight's bytes at gemm_pack's rate where profiled (gemm_line). `graphed`: GEMVs (a token a call)
    replayed in a CUDA graph, priced by gemv_graph/<dev>/<dtype> where profiled (graph_gemv).
    `expert`: the weights are a routed expert's in the native expert kernel, whose stream floors the
    time at that kernel's rate (memory_time's `expert`).

    Raises:
        ConfigError: the profile prices no GEMM on `device` in `dtype` (or a fallback dtype).
    """
    m = find(profile, "gemm", device, dtype)
    if m is None:
        raise ConfigError(f"hardware profile {profile.name!r} has no gemm/{device}/{dtype} model",
                          "re-run `tiered profile` on this machine or pick a preset that covers it")
    if macs <= 0:
        return 0.0
    tokens = macs / (weight_bytes / bytes_per_element(dtype)) if weight_bytes > 0 else None
    g = graph_gemv(profile, device, dtype) if graphed and tokens is not None and tokens <= 1.5 else None
    if g is not None:  # GEMVs (a token a call) replayed in a graph
        return calls * g.alpha + g.beta * weight_bytes
    line = gemm_line(profile, device, dtype, weight_bytes / calls, m, tokens)
    compute = calls * line.alpha + line.beta * macs
    mem = memory_time(profile, device, dtype, weight_bytes / calls, "gemv", expert=expert) * calls \
        if weight_bytes > 0 else 0.0
    return max(compute, mem)


def dequantize_time(profile: HardwareProfile, device: str, dtype: str, weight_bytes: float) -> float:
    """Seconds to dequantize `weight_bytes` of `dtype` weights before a GEMM over them: dequantize/<dev>/<dtype>
    per element where profiled (one-copy int4 weights on the CPU, whose prompt GEMMs past the kernel's rows
    dequantize each weight first: gemm/cpu/int4 is then the GEMM alone, profiler 40), else 0 (older profiles'
    gemm/cpu/int4 holds it). The callers that price such a GEMM add it (cpu_predict.torch_gemm_time,
    prompt_expert_time); gemm_time does not (a decode GEMV of an int4 head runs the kernel)."""
    m = profile.models.get(f"dequantize/{device}/{dtype}")
    return m.beta * weight_bytes / bytes_per_element(dtype) if m is not None and weight_bytes > 0 else 0.0


def amx_gemm_time(profile: HardwareProfile, macs: float, weight_bytes: float, calls: int = 1) -> float | None:
    """Seconds of `calls` one-copy int4 prompt GEMMs (a projection's rows past its kernel's, an int4 / mxfp4
    expert's) totalling `macs` over `weight_bytes` of int4 weights on the AMX path (quant/int4.AMX_ROWS:
    kernels' int4_tiled_gemm): gemm_amx/cpu/int4's line plus each call's weight converted into the tiles at
    gemm_amx_pack/cpu/int4's rate (fitted together, profiler 55), floored by one stream of the weights (at
    gemm_amx_floor/cpu/int4's rate where profiled: the AMX GEMM's own stream at few rows). Profiles
    51-54 fitted the line net of dequantize/cpu/int4 and have no pack key: their weights pay that instead. None
    where the profile has no gemm_amx key (a CPU without AMX, profiles before profiler 51) or the calls' rows pass
    AMX_ROWS (the dequantized oneDNN GEMM then: gemm/cpu/int4)."""
    from tiered.quant.int4 import AMX_ROWS

    m = profile.models.get("gemm_amx/cpu/int4")
    if m is None or macs <= 0 or weight_bytes <= 0 or macs / (weight_bytes / bytes_per_element("int4")) > AMX_ROWS:
        return None
    pack = profile.models.get("gemm_amx_pack/cpu/int4")
    compute = calls * m.alpha + m.beta * macs + (pack.beta * weight_bytes if pack is not None else 0.0)
    mem = memory_time(profile, "cpu", "int4", weight_bytes / calls, "gemv") * calls
    floor = profile.models.get("gemm_amx_floor/cpu/int4")  # its own stream at few rows (profiler.amx_floor)
    if floor is not None:
        mem = max(mem, floor.beta * weight_bytes)
    return max(compute, mem) + (dequantize_time(profile, "cpu", "int4", weight_bytes) if pack is None else 0.0)


def attention_time(profile: HardwareProfile, device: str, dtype: str, macs: float, kv_bytes: float,
                   calls: int = 1) -> float:
    """Seconds of decode attention: `macs` (q.K^T and p.V) over `kv_bytes` of cache, in `calls` calls.

    Uses attn/<dev>/<dtype> when fitted, else the GEMM fit; the KV bytes read are the memory floor.
    """
    if macs <= 0:
        return 0.0
    m = find(profile, "attn", device, dtype)
    compute = (calls * m.alpha + m.beta * macs) if m is not None else gemm_time(profile, device, dtype, macs, 0.0, calls)
    bw = profile.models.get(f"memory/bandwidth/{device}")
    return max(compute, bw.beta * kv_bytes if bw is not None else 0.0)


def prefill_attention_pairs(tokens: int, past: int = 0) -> float:
    """(query, key) pairs a prefill forward's attention computes: T (T + 1) / 2 for a prompt from position 0
    (SDPA's causal mask skips the blocks above the diagonal), T (past + T) for a chunk after `past` cached
    tokens: its mask is explicit (models/layers.attention_mask), and torch's CPU SDPA computes every block
    under one, masked or not."""
    return tokens * (tokens + 1) / 2 if past == 0 else tokens * (past + tokens)


def prefill_attention_time(profile: HardwareProfile, device: str, dtype: str, macs: float, calls: int = 1,
                           past: bool = False) -> float:
    """Seconds of a prompt's causal attention: `macs` (q.K^T and p.V over the causal half) in `calls`
    calls. attn_prefill/<dev>/<dtype> (torch's SDPA on whole prompts) where profiled, else the GEMM fit.
    `past`: a prefill chunk's attention over the cache before it (`macs` over every pair: its mask is
    explicit), attn_prefill_past/<dev>/<dtype> where profiled (~47 GMAC/s on 2 Zen 3 cores, where the causal
    key's 512-token prompts ran ~17).

    Raises:
        ConfigError: neither is profiled for `device` in `dtype` (or a fallback dtype).
    """
    m = (profile.models.get(f"attn_prefill_past/{device}/{dtype}") if past else None) or \
        profile.models.get(f"attn_prefill/{device}/{dtype}")
    if m is None:  # q.K^T and p.V as two GEMMs a call
        return gemm_time(profile, device, dtype, macs, 0.0, 2 * calls)
    return calls * m.alpha + m.beta * macs if macs > 0 else 0.0


def launch_time(profile: HardwareProfile, device: str) -> float:
    """Per-kernel launch cost on `device` [s]; 0 when not profiled."""
    m = profile.models.get(f"launch/{device}")
    return m.alpha if m is not None else 0.0


def task_overhead(profile: HardwareProfile) -> float:
    """One task's hop through tiered's executor and back [s] (runtime/task); 0 when not profiled."""
    m = profile.models.get("runtime/task")
    return m.alpha if m is not None else 0.0


def moe_layer_overhead(profile: HardwareProfile) -> float:
    """Seconds an MoE layer's fixed cost exceeds a dense layer's in a CPU decode step: the MoE block's
    own code (router, top-k, the experts' call and combine), the slope of runtime/moe_step/bf16 (a
    tiny MoE model's step, n = layers) less runtime/decode_step/bf16's (the attention and norms
    both layers have, which step_overhead already prices). 0 when either is not profiled. That tiny
    model keeps every expert in RAM, so since PROFILER_VERSION 6 this is the native step's MoE
    layer (~10 us on 2 cores); a layer run as a module with the expert runner (experts on disk or
    in a cache) costs ~0.2 ms more, unpriced, beside its expert reads."""
    moe, dense = profile.models.get("runtime/moe_step/bf16"), profile.models.get("runtime/decode_step/bf16")
    return max(0.0, moe.beta - dense.beta) if moe is not None and dense is not None else 0.0


def mla_layer_overhead(profile: HardwareProfile) -> float | None:
    """Seconds of one DeepSeek layer's fixed cost in a CPU decode step (latent attention and the MoE
    block, in C++ where the native step runs them: the slope of runtime/mla_step/bf16, a tiny
    DeepSeek-V2's step, n = layers), in place of step_overhead's per-layer cost and moe_layer_overhead;
    None when not profiled."""
    m = profile.models.get("runtime/mla_step/bf16")
    return m.beta if m is not None else None


def prefill_code_time(profile: HardwareProfile, dtype: str, elements: float, fixed: bool = True) -> float | None:
    """Seconds one layer's own model code takes in a CPU prefill beyond its GEMMs and attention (norms,
    RoPE, SiLU, residual adds, casts, module calls), `elements` = the prompt's tokens x the layer's width
    (hidden + intermediate): runtime/prefill_code/<dtype> (profiler._prefill_code_points; activations in
    `dtype`, bf16 falling back to fp32 and back). `fixed` False: the elements' share alone, without the
    layer's fixed cost (code a layer runs beside the one priced whole: an expert's GLU in torch). None when
    not profiled (profiles before version 23)."""
    for d in (dtype, "bf16" if dtype == "fp32" else "fp32"):
        m = profile.models.get(f"runtime/prefill_code/{d}")
        if m is not None:
            return m(elements) if fixed else m.beta * elements
    return None


def step_stream(profile: HardwareProfile, dtype: str, layer_bytes: float | None = None) -> float:
    """Seconds a weight byte of `dtype` decode copies takes in tiered's native CPU decode step at one token,
    its kernel calls' starts and ends in: runtime/decode_layer/<dtype>'s rate (the step over dense layers at
    real widths, weights from memory, the layer code taken out; profiler 32), 0 where not profiled (int4
    alone is). The GEMV keys time a kernel alone over its own weight: on 2 Zen 3 cores (2026-11-30) the step
    ran SmolLM2's 2.2 MB layers at 27-29 GB/s where the int4 GEMV fit read 38.6, and its 30 layers, priced at
    that fit, came to 2.1 ms a token where they ran 2.3-2.8.

    `layer_bytes` (a layer's weight bytes in the step): the rate at that layer size (`layer_shape`), where the
    profile kept the key's points.

    A kind STEP_STREAM_FALLBACK names (the k-quant copies) without a key of its own takes the named kind's, scaled by
    how their kernels stream alone (gemv/cpu/<kind> against gemv/cpu/<named>, profiler 67; 1 where either is
    missing): the k-quant loop prefetches into the L2 on every machine where the int8-g32 one follows the machine's
    tuning, and an IQ4_XS file's decode priced at int8-g32's step rate a byte came to 22.8 tok/s where it ran 30.9 (2
    Zen 4 cores, 2026-12-07)."""
    key = f"runtime/decode_layer/{dtype}"
    scale = 1.0
    if key not in profile.models and dtype in STEP_STREAM_FALLBACK:  # (its own key first, once a profile has it)
        named = STEP_STREAM_FALLBACK[dtype]
        key = f"runtime/decode_layer/{named}"
        own, other = profile.models.get(f"gemv/cpu/{dtype}"), profile.models.get(f"gemv/cpu/{named}")
        if own is not None and other is not None and own.beta > 0 and other.beta > 0:
            scale = own.beta / other.beta
    m = profile.models.get(key)
    return scale * m.beta * layer_shape(profile, key, layer_bytes) if m is not None else 0.0


# decode-copy kinds the native step's stream prices at another's runtime/decode_layer rate (a byte each) until a
# profile times their own: the Q6_K / Q5_K copies at the int8-g32 ones' (DTYPE_FALLBACK's note)
STEP_STREAM_FALLBACK = {"q6k": "int8-g32", "q5k": "int8-g32", "iq4xs": "int8-g32"}


def _points(profile: HardwareProfile, key: str) -> list:
    """The (n, seconds) points the profiler kept for `key` (meta["points"]), [] where it kept none."""
    return list(((profile.meta or {}).get("points") or {}).get(key) or ())


def _decode_ws_points(profile: HardwareProfile) -> list[tuple[float, float]]:
    """runtime/decode_ws/int4's (working-set bytes, seconds a byte) points, ascending, the positive ones."""
    return sorted((p[0], p[1]) for p in _points(profile, "runtime/decode_ws/int4") if p[0] > 0 and p[1] > 0)


def cache_factor(profile: HardwareProfile, working_set: float) -> float:
    """How much of its time from memory tiered's native decode step takes to stream weights when `working_set`
    bytes pass between two reads of the same one (a decode step's weight bytes): runtime/decode_ws/int4's seconds a
    byte at that working set over its cold set's (the largest it timed), interpolated in log bytes between the
    timed sets and held at the smallest below them; at most 1 (no faster than from memory is 1: the keys that
    price the step were timed beyond the caches). 1 where not profiled or `working_set` is not given.

    A last-level cache's size alone does not say this: on 2 cores of a Xeon whose sysfs reports a 480 MiB L3
    (2026-12-04), the step streamed 1.7x faster over 16-64 MiB than from memory and no faster from 128 MiB
    (the share of the cache a VM's cores get), and SmolLM2's default plan, its 89 MB int4 step priced as from
    memory, was priced 3.9 ms a token where it ran 2.5."""
    pts = _decode_ws_points(profile)
    if working_set is None or working_set <= 0 or len(pts) < 2:
        return 1.0
    cold = pts[-1][1]
    if working_set <= pts[0][0]:
        return min(1.0, pts[0][1] / cold)
    for (x0, t0), (x1, t1) in zip(pts, pts[1:]):
        if working_set <= x1:
            f = math.log(working_set / x0) / math.log(x1 / x0)
            return min(1.0, (t0 + (t1 - t0) * f) / cold)
    return 1.0


def cache_held(profile: HardwareProfile, working_set: float) -> float:
    """How much of `working_set` bytes read again right away the caches hold, 0 to 1, by the native step's own
    measure (cache_factor: runtime/decode_ws/int4): 1 at or below its smallest timed set's speed-up, 0 where it
    streams as from memory, linear in cache_factor between. Where the profile has no decode_ws points: 1 within the
    last-level cache's size (beyond_cache), else 0."""
    pts = _decode_ws_points(profile)
    if len(pts) < 2:
        return 0.0 if beyond_cache(profile, working_set) else 1.0
    least = cache_factor(profile, pts[0][0])  # the smallest timed set's
    if least >= 1.0:
        return 0.0
    return min(1.0, max(0.0, (1.0 - cache_factor(profile, working_set)) / (1.0 - least)))


def batch_rows_time(profile: HardwareProfile, key: str, rows: float, elements: float) -> float:
    """Seconds the rows past the first add to a dense layer of `elements` weight elements in tiered's native decode
    step at `rows` rows (a batched step: a server's sequences, or one sequence's draft tokens), by `key`
    (runtime/batch_rows/<kind>): its points (meta["points"]: a row's cost at each timed width, for each of the
    profiler's BATCH_ROWS in turn, meta["batch_rows"]) fitted affine over the widths at each timed batch, the rows' total there
    interpolated linearly in rows between the timed batches (none at one row) and beyond the largest at the last
    segment's slope; where the profile kept no such points, rows - 1 times the key's own fit. 0 where `key` is not
    profiled.

    A row does not cost the same at every batch: the first rows ride the weights' stream, later ones pay their
    multiply-adds. On 2 Zen 4 cores a SmolLM2-width row cost 8.5 / 11.6 / 15.8 us a layer at 4 / 8 / 16 rows, on
    2 AMX cores 0 / 3.5 / 8.6 (2026-12-04), where one affine fit over all of them (R^2 0.16 on the AMX VM) priced
    SmolLM2's 32-sequence step at 28.8 ms against 34.1 measured."""
    m = profile.models.get(key)
    if m is None or rows <= 1:
        return 0.0
    # the batches its points were timed at (profiler.BATCH_ROWS when made; before profiler 54, 4 / 8 / 16)
    BATCH_ROWS = tuple(int(b) for b in (profile.meta or {}).get("batch_rows") or (4, 8, 16))
    pts = _points(profile, key)
    k = len(BATCH_ROWS)
    if len(pts) < 2 * k or len(pts) % k:
        return (rows - 1) * m(elements)
    anchors = [(1.0, 0.0)]
    for j, b in enumerate(BATCH_ROWS):
        xs, ts = [p[0] for p in pts[j::k]], [p[1] for p in pts[j::k]]
        mean_x, mean_t = sum(xs) / len(xs), sum(ts) / len(ts)
        var = sum((x - mean_x) ** 2 for x in xs)
        slope = sum((x - mean_x) * (t - mean_t) for x, t in zip(xs, ts)) / var if var > 0 else 0.0
        row = max(0.0, mean_t + slope * (elements - mean_x))
        anchors.append((float(b), max(anchors[-1][1], (b - 1) * row)))  # more rows never cost less
    for (b0, e0), (b1, e1) in zip(anchors, anchors[1:]):
        if rows <= b1:
            return e0 + (e1 - e0) * (rows - b0) / (b1 - b0)
    (b0, e0), (b1, e1) = anchors[-2:]
    return e1 + (e1 - e0) / (b1 - b0) * (rows - b1)


def layer_shape(profile: HardwareProfile, key: str, layer_bytes: float | None) -> float:
    """How a layer of `layer_bytes` runs against `key`'s fit through the origin (one rate a byte whatever the layer):
    the ratio of its points' times to that fit, interpolated linearly in bytes between the timed layer sizes and
    held at the nearest one beyond them (meta["points"][key]; 1 without them or without `layer_bytes`). Relative,
    so it holds when planning scales the key to the memory's speed of the minute. A layer's calls pay a fixed cost
    (their starts and ends, the wait for the slower thread) that a small layer's bytes do not hide: on 2 Zen 4 cores
    (2026-12-04) the step ran SmolLM2's 2.2 MB layers in 96 us (23 GB/s), 3.9 MB ones at 29 and 8.8 MB ones at 34
    GB/s, where the fit through the origin (30.6 GB/s) priced SmolLM2's decode at 3.3 ms a token against 3.5-4.3
    measured; an affine fit's intercept is unstable (3-49 us from run to run on 2 Zen 3 cores), and its slope
    (41 GB/s) beyond the memory's."""
    pts = sorted((p[0], p[1]) for p in _points(profile, key) if p[0] > 0)
    if layer_bytes is None or layer_bytes <= 0 or len(pts) < 2:
        return 1.0
    slope = sum(x * t for x, t in pts) / sum(x * x for x, _ in pts)
    if slope <= 0:
        return 1.0
    ratio = [(x, t / (slope * x)) for x, t in pts]
    if layer_bytes <= ratio[0][0]:
        return ratio[0][1]
    for (x0, r0), (x1, r1) in zip(ratio, ratio[1:]):
        if layer_bytes <= x1:
            return r0 + (r1 - r0) * (layer_bytes - x0) / (x1 - x0)
    return ratio[-1][1]


def step_overhead(profile: HardwareProfile, dtype: str, device: str = "cpu",
                  graphed: str | None = None, burst: bool = False) -> tuple[float, float]:
    """(per step, per layer) seconds of the model code's own fixed costs in a decode step: module
    calls, small ops and their launches, KV-cache writes (runtime/decode_step: a tiny model's decode
    step, n = layers). (0, 0) when not profiled.

    With device "gpu", runtime/decode_step_gpu/<dtype> (the same tiny model on the accelerator)
    when profiled; else the CPU measurement stands in: the same Python issues the same ops, each a
    kernel launch instead of a small CPU kernel. `graphed` (how the engine graphs its GPU decode
    steps) looks first for that model stepped the same way: "piecewise",
    runtime/decode_step_graphed_gpu/<dtype> (runtime/graphs.PiecewiseGraphs: each layer's attention
    one replay, its MLP eager); "whole", runtime/decode_step_graph_gpu/<dtype> (DecodeGraphs: the
    step one replay), then the piecewise key. int4/int8 decode weights run with 16-bit activations,
    so their nearest profiled step is bf16. The per-step cost includes the engine's loop around the step
    (runtime/engine_token: scheduling, the step's inputs, sampling, output), where profiled.

    `burst` (a lone sequence's CPU decode in native bursts, LLM._burst): the per-token cost is
    runtime/burst_token's where profiled (a tiny engine's burst ITL less its layers' code: the embedding
    row, the head's glue, the draw and each token's bookkeeping), in place of the step's fixed cost and
    the loop's (~40 us against ~135 on 2 Zen 3 cores).
    """
    loop = profile.models.get("runtime/engine_token")  # the engine's own loop around every step
    fallback = (dtype, "fp32") if dtype == "fp32" else (dtype, "bf16", "fp32")
    gpu = {"whole": ["decode_step_graph_gpu", "decode_step_graphed_gpu"],
           "piecewise": ["decode_step_graphed_gpu"]}.get(graphed or "", []) + ["decode_step_gpu"]
    keys = ([f"runtime/{k}/{d}" for k in gpu for d in fallback] if device == "gpu" else []) + \
        [f"runtime/decode_step/{d}" for d in fallback]
    m = next((profile.models[k] for k in keys if k in profile.models), None)
    per_layer = m.beta if m is not None else 0.0
    if burst and device == "cpu" and "runtime/burst_token" in profile.models:
        return profile.models["runtime/burst_token"].alpha, per_layer
    per_step = (m.alpha if m is not None else 0.0) + (loop.alpha if loop is not None else 0.0)
    return per_step, per_layer
