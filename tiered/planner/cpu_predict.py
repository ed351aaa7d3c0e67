"""Predicted decode times on the CPU + disk tiers (no GPU): the planner's model of what `run` does
when CPU RAM is the fast tier and experts that do not fit stream from disk.

Per decode step and layer (ALGORITHMS.md 5.2, with the GPU terms absent):
    attention      projections priced by gemm_time (memory-bound at 1 token) + attention over the KV cache
    dense MLP      gemm_time of its three matrices
    MoE layer      router + the MoE block's fixed cost (runtime/moe_step) + for each of the step's experts: compute (gemv of the expert's bytes) and,
                   on a miss, a cold disk read of its bytes; without read-ahead reads and computes
                   alternate, with read-ahead the reads of a layer stream back to back while hits
                   compute; computes run inline on the calling thread, each read is a task on a
                   reader thread and pays the executor's per-task overhead (runtime/task)
    lm_head        gemm_time of the vocabulary projection
Cache hit rates come from replaying a routing trace through the runtime's own ExpertCache logic
(`simulate_hits`), as ALGORITHMS.md 5.2 prescribes ("a cache simulator driven by the routing traces").
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch

from tiered.checkpoint.model_config import ModelConfig
from tiered.hardware import op_time
from tiered.hardware.op_time import GEMM_ROWS, prefill_attention_pairs
from tiered.hardware.profile import HardwareProfile
from tiered.memory import sizes
from tiered.memory.expert_cache import ExpertCache, make_policy
from tiered.quant.experts import rows_activations



@dataclass
class HitStats:
    """Expert uses per layer in a routing trace: resident hits, cache hits, misses."""

    resident: dict = field(default_factory=dict)
    cache: dict = field(default_factory=dict)
    miss: dict = field(default_factory=dict)

    def rates(self, layer: int) -> tuple[float, float]:
        """(resident share, cache-hit share) of the layer's expert uses."""
        n = self.resident.get(layer, 0) + self.cache.get(layer, 0) + self.miss.get(layer, 0)
        return (self.resident.get(layer, 0) / n, self.cache.get(layer, 0) / n) if n else (0.0, 0.0)

    def fast_share(self) -> float:
        """Share of all expert uses served from the fast tier (resident or cached)."""
        r, c, m = (sum(d.values()) for d in (self.resident, self.cache, self.miss))
        return (r + c) / max(r + c + m, 1)


def prompt_routing(shares, tokens: int, top_k: int) -> tuple[np.ndarray, np.ndarray]:
    """How a `tokens`-token prompt spreads over a layer's experts when each token picks expert e with
    probability q_e = min(1, top_k p_e), p_e = shares[e] / sum(shares): (a, q), float [E] each: a_e =
    1 - (1 - q_e)^tokens, the probability that e computes some of the prompt, and q (its rows are drawn
    Binomial(tokens, q_e): RowCosts.expected)."""
    p = np.asarray(shares, dtype=np.float64)
    q = np.minimum(1.0, top_k * p / p.sum())
    return 1.0 - (1.0 - q) ** tokens, q


# RowCosts evaluates its cost at every row count up to this, past it at counts rounded to 32 steps a doubling
# (~3%; a prompt's costs are linear in the rows there)
EXACT_ROWS = 128


class RowCosts:
    """One routed expert's cost by the rows a prompt of `tokens` tokens gives it, and its expectation over
    the routing's draw (`expected`).

    `cost(r)`: seconds of one call over r rows (1 <= r <= tokens), evaluated once per row count (past
    EXACT_ROWS at counts rounded to ~3%) and kept: a prompt's layers and experts share them."""

    def __init__(self, cost, tokens: int) -> None:
        import math

        self.cost, self.tokens = cost, tokens
        self.table = np.full(tokens + 1, np.nan)
        self.lgamma = np.array([math.lgamma(k + 1) for k in range(tokens + 1)])  # log k!

    def rounded(self, r: np.ndarray) -> np.ndarray:
        """Row counts past EXACT_ROWS rounded to 32 steps a doubling (int64 array of r's shape)."""
        r = np.asarray(r, dtype=np.int64)
        step = np.left_shift(1, np.maximum(0, np.floor(np.log2(np.maximum(r, 1))).astype(np.int64) - 5))
        out = np.where(r > EXACT_ROWS, np.rint(r / step).astype(np.int64) * step, r)
        return np.clip(out, 1, self.tokens)

    def at(self, r: np.ndarray) -> np.ndarray:
        """cost at each of r (rounded), evaluating the row counts not seen before."""
        r = self.rounded(r)
        for n in np.unique(r[np.isnan(self.table[r])]):
            self.table[n] = self.cost(int(n))
        return self.table[r]

    def expected(self, q) -> np.ndarray:
        """Expected seconds of the expert over the prompt for each of `q` (float [E]: the probability that
        a token picks each expert): sum over r >= 1 of Binomial(tokens, q)(r) * cost(r) (r = 0: no call),
        the mass past 8 standard deviations dropped (float [E]). Priced at the mean rows instead, a cost
        that steps where the runtime changes path (a bf16 expert past its native rows runs torch's GEMM)
        missed the experts the draw puts past the step: uniformly routed over 8 experts top-2, a 128-token
        prompt gives each expert 32 +- 5 rows, and on 2 AVX2-only Zen 3 cores the half past the native
        kernel's 32 rows ran torch's bf16 GEMM ~6x slower (1.82 s measured, 0.70 priced at the mean,
        2026-11-30)."""
        T = self.tokens
        q = np.clip(np.atleast_1d(np.asarray(q, dtype=np.float64)), 0.0, 1.0)
        out = np.zeros(len(q))
        if T <= 0:
            return out
        whole = q >= 1.0
        out[whole] = self.at(np.array([T]))[0]
        mid = (q > 0) & ~whole
        if not mid.any():
            return out
        qm = q[mid]
        sd = np.sqrt(T * qm * (1 - qm))
        lo = int(max(1, np.floor((T * qm - 8 * sd).min())))
        hi = int(min(T, np.ceil((T * qm + 8 * sd).max())))
        if lo > hi:
            return out
        r = np.arange(lo, hi + 1)
        log_choose = self.lgamma[T] - self.lgamma[r] - self.lgamma[T - r]  # [R]
        pmf = np.exp(log_choose[None, :] + r[None, :] * np.log(qm)[:, None] + (T - r)[None, :] * np.log1p(-qm)[:, None])
        used = pmf.max(axis=0) > 1e-12
        out[mid] = pmf[:, used] @ self.at(r[used])
        return out


def prompt_activity(shares, tokens: int, top_k: int) -> np.ndarray:
    """prompt_routing's a: the probability that each expert of a layer computes some of a `tokens`-token
    prompt (float [E]; latency_moe.prompt_experts sums it, routing_trace draws from it)."""
    return prompt_routing(shares, tokens, top_k)[0]


def routing_trace(moe_layers: list[int], num_experts: int, top_k: int, steps: int,
                  popularity: np.ndarray | None = None, seed: int = 0,
                  prompt_tokens: int = 0) -> list[tuple[int, int, list[int]]]:
    """A synthetic routing trace [(layer, tokens, experts)] for `simulate_hits`: the prompt's prefill,
    then decode.

    With `prompt_tokens` > 1, the trace opens with the prompt through every MoE layer: each expert
    is active with its `prompt_activity` (at least top_k active; as latency_moe.prompt_experts counts
    them). Its misses fill the cache as the runtime's
    prefill does: on the H100 (session 28) the decode that followed a prompt's copies hit the slots
    20% of the time with every decode miss on the CPU, where a trace of decode alone priced 0%.
    Each of `steps` decode steps then routes one token through every MoE layer to `top_k` distinct
    experts drawn with probability p_e, proportional to `popularity[layer]` (float [L, E], tokens
    routed per expert from `tiered profile-experts`), or uniformly when None. Seeded: the same
    arguments give the same trace (the prompt draws from its own generator: the decode steps are
    the same with or without it).
    """
    rng = np.random.default_rng(seed)
    trace = []
    if prompt_tokens > 1:
        prompt_rng = np.random.default_rng(seed + 1)
        for layer in moe_layers:
            w = (np.asarray(popularity[layer], dtype=np.float64) + 1e-9 if popularity is not None
                 else np.ones(num_experts))
            active = prompt_activity(w, prompt_tokens, top_k)
            used = prompt_rng.random(num_experts) < active
            if used.sum() < top_k:  # every token picks top_k distinct experts
                used[np.argsort(-active, kind="stable")[:top_k]] = True
            trace.append((layer, prompt_tokens, [int(e) for e in np.flatnonzero(used)]))
    for _ in range(steps):
        for layer in moe_layers:
            p = None
            if popularity is not None:
                w = np.asarray(popularity[layer], dtype=np.float64) + 1e-9  # every expert stays drawable
                p = w / w.sum()
            trace.append((layer, 1, [int(e) for e in rng.choice(num_experts, top_k, replace=False, p=p)]))
    return trace


def simulate_hits(trace, resident: set, slots: int, policy: str = "lru", decode_only: bool = True,
                  copied=None) -> HitStats:
    """Replay routing decisions [(layer, tokens, experts)] through an ExpertCache of `slots` slots.

    The cache is the runtime's own class with empty slots, so eviction and pinning are the same, and
    each step is replayed in the runtime's order (runtime/moe_runner.py): every expert of the layer
    is looked up first, then the misses claim slots. Prefill steps (tokens > 1) still fill the cache
    but are not counted when decode_only.

    Args:
        copied: with an accelerator, which of a step's misses take the copy path and so claim a slot
            (a CPU-path miss computes from host memory and never enters the cache): a callable
            (tokens per missing expert, in expert order) -> list of bool, e.g. from
            runtime/dispatcher.split_misses; None = every miss claims one (CPU + disk tiers).
    """
    layers = 1 + max((layer for layer, _, _ in trace), default=0)
    cache = ExpertCache(slots, ((0,),), torch.float32, lambda s, d, w: torch.empty(s), make_policy(policy, layers))
    st = HitStats()
    for layer, tokens, experts in trace:
        cache.begin_layer(layer, tokens)
        count = tokens == 1 or not decode_only
        keys = [(layer, e) for e in experts]
        pinned = set(keys)
        misses = []
        for k in keys:
            if k in resident:
                kind = st.resident
            elif cache.lookup(k) is not None:
                kind = st.cache
            else:
                misses.append(k)
                kind = st.miss
            if count:
                kind[layer] = kind.get(layer, 0) + 1
        # tokens per missing expert: 1 in decode; in prefill tokens / experts used (top-1 bound)
        claims = [True] * len(misses) if copied is None else copied([max(1, tokens // len(keys))] * len(misses))
        for k, claim in zip(misses, claims):
            if claim:
                cache.claim(k, pinned)
    return st


def _row_time(hw: HardwareProfile, kind: str, weight_bytes: float, macs: float | None = None,
              expert: bool = False) -> float:
    """Seconds each row past the first adds to a decode-kernel call over `weight_bytes` of `kind`
    weights (gemv key names: "int4q8" is int4's kernel): its multiply-adds (`macs`, None = the weights'
    elements) at decode_rows/cpu/<kind>'s slope where profiled (tiered's kernels at 8-32 rows; int4q8's
    falls back to int4's in profiles before version 23), else at the GEMM fit's (0 without either).
    `expert`: a routed expert's call (its three projections and the SwiGLU between them), at
    expert_rows/cpu/<kind>'s slope where the profile timed that kind's expert kernel (int4q8, profiler 31):
    on 2 Zen 3 cores a Qwen3-30B-A3B-width Q4_0 expert's rows cost 9.1 ps a multiply-add where the
    4096 x 4096 projection's decode_rows gave 5.7, and a quick profile's poor fit of the latter (R^2 0.77)
    3.9: the 512-token prompt of the 8-layer model was priced 2.34 s where it took 3.0 (2026-11-30)."""
    base = weight_kind(kind)
    macs = macs if macs is not None else weight_bytes / op_time.bytes_per_element(base)
    m = (hw.models.get(f"expert_rows/cpu/{kind}") if expert else None) or \
        op_time.find(hw, "decode_rows", "cpu", kind) or op_time.find(hw, "gemm", "cpu", base)
    return m.beta * macs if m is not None else 0.0


def _gemv(hw: HardwareProfile, dtype: str, weight_bytes: float, calls: int = 1, working_set: float = 0.0,
          expert: bool = False, rows: float = 1, macs: float | None = None, in_step: bool = False,
          layer_bytes: float | None = None) -> float:
    """Seconds of `calls` one-token matmuls reading `weight_bytes` in all: the memory-bound regime
    (gemv/cpu/<dtype>), which is what a decode step runs; the many-token GEMM fit does not apply.
    `working_set`: the step's weight bytes (op_time.memory_time: beyond the cache, DRAM's rate);
    `expert`: routed experts' weights, beyond the cache at the native expert kernel's own rate.
    `rows` > 1 (a batched step): the weights stream once a call, and each row past the first adds
    its multiply-adds (`_row_time`; `macs` a row, None = the weights' elements), as
    native_expert_time prices a CPU expert's rows. On 2 Zen 4
    cores SmolLM2's default engine stepped 2.42 / 4.17 / 6.99 ms at 1 / 4 / 8 rows: 0.65-0.7 ms a
    row past the first, what its weights' multiply-adds cost at decode_rows' slopes (2026-11-27).
    `in_step`: the calls run inside the native decode step (native_step), which pays no per-call
    intercept beyond its per-layer fixed cost (op_time.memory_time's `intercept`); the calls' stream there (at
    any rows: the rows past the first add to it) runs no faster than the step ran its layers' calls where the
    profile timed it over `dtype` layers
    (op_time.step_stream: runtime/decode_layer, the calls' starts and ends in), at the rate of a layer of
    `layer_bytes` where given (op_time.layer_shape: a small layer's calls run slower a byte than a large one's),
    and the calls' stream (one row's or a batch's) at op_time.cache_factor of that where the step's `working_set`
    is small enough for the caches to hold part of it."""
    t = op_time.memory_time(hw, "cpu", dtype, weight_bytes / calls, "gemv", working_set, expert,
                            intercept=not in_step) * calls
    if in_step and not expert:  # (a routed expert's stream: its own keys, memory_time's)
        # no faster than the step streams them at one row (decode_layer's rate), at any rows: the rows past the first
        # add their multiply-adds to that stream, never take from it; and faster where the caches hold part of the
        # step's weights (a small model's), at any rows: one stream of the same bytes (SmolLM2's head at 2+ rows had
        # been priced from memory, its one row from the cache: a step of 2 rows priced 1.31x one on the AMX VM, now
        # 1.21x, where it took 1.14x)
        t = max(t, weight_bytes * op_time.step_stream(hw, dtype, layer_bytes)) * op_time.cache_factor(hw, working_set)
    return t + (rows - 1) * _row_time(hw, dtype, weight_bytes, macs, expert) if rows > 1 else t


def _projections(hw: HardwareProfile, dtype: str, mix: dict | None, elements: float, calls: int,
                 working_set: float, rows: float = 1, batch_act: str = "bf16", layer_bytes: float | None = None) -> float:
    """Seconds of `calls` one-token matmuls over `elements` weights in `dtype`, or split by `mix`
    (precision -> share of the elements, Plan.precision_mix), each share at its precision's rate;
    `rows` per call (`_gemv`), int4 ones on `batch_act` activations when more than one (`_batched`);
    inside the native step where the profile has it (native_step: `_gemv`'s in_step; `layer_bytes`: its layer's
    weight bytes there). int4 calls of quant/int4.STEP_AMX_ROWS rows or more in the native step run the AMX GEMM
    where the profile prices it (Int4TGemv::run_step; step_amx_time)."""
    total = 0.0
    for k, share in (mix or {dtype: 1.0}).items():
        if share <= 0:
            continue
        n = max(1, round(calls * share))
        nbytes = elements * share * op_time.bytes_per_element(k)
        amx = step_amx_time(hw, k, rows, elements * share, nbytes, n)
        total += amx if amx is not None else _gemv(hw, _batched(k, batch_act, rows), nbytes, calls=n,
                                                   working_set=working_set, rows=rows, in_step=native_step(hw),
                                                   layer_bytes=layer_bytes)
    return total


def step_amx_time(hw: HardwareProfile, kind: str, rows: float, elements: float, weight_bytes: float,
                  calls: int) -> float | None:
    """Seconds of the native step's `calls` int4 projections (`elements` weights, `weight_bytes`, in all) over `rows`
    rows where they run the AMX GEMM: quant/int4.STEP_AMX_ROWS rows or more on a profile of the native step whose
    runtime/step_rows/int4 was timed net of the AMX GEMM (meta["step_rows_amx"], profiler 57) and that prices it
    (op_time.amx_gemm_time; past quant/int4.AMX_ROWS rows as that many rows at a time); None elsewhere (the row
    kernels: `_gemv`). Before profiler 57 the step's layer code was timed net of the row kernels at every row count,
    which at 64-256 rows cost more than the AMX GEMM the step ran: the code came out ~0 and the rows' projections
    priced as the row kernels' (SmolLM2's 128 rows 47.6 ms of 51.6 where the step took 40-43, 2 AMX cores,
    2026-12-06); pricing the projections alone by the AMX GEMM then priced 512 rows 118 ms for 161."""
    import math

    from tiered.quant.int4 import AMX_ROWS, STEP_AMX_ROWS

    if kind != "int4" or rows < STEP_AMX_ROWS or not native_step(hw) or not (hw.meta or {}).get("step_rows_amx"):
        return None
    parts = math.ceil(rows / AMX_ROWS)
    return op_time.amx_gemm_time(hw, rows * elements, weight_bytes * parts, calls * parts)


def _batched(kind: str, batch_act: str, rows: float) -> str:
    """The gemv key of a `kind` decode copy's call over `rows` rows: int4 copies read int8 activations
    in calls of 2+ rows where Plan.batch_act is "q8" (the tiled kernel's q8_from 2: a server's batches),
    "int4q8" (on 2 AMX cores 3.4x cheaper a row than bf16 activations, 2026-11-29), int8-g32 ones (a GGUF
    Q8_0 / Q6_K head's, Q5_x / Q6_K tensors') too, "int8-g32q8" (Int8G32Linear.batch_act: one vpdpbusd per
    4 weights and row where int16 activations take two); else `kind`."""
    if rows <= 1 or kind == "int8":  # (Int8Linear, the per-row layout: no q8 path)
        return kind
    return op_time.gemv_dtype(kind, batch_act)


def weight_kind(key: str) -> str:
    """The weight format a gemv key prices ("int4q8" -> "int4", "int8-g32q8" -> "int8-g32", "int8q8" -> "int8": the
    same weights on int8 activations), for its bytes per element."""
    return key[:-2] if key in ("int4q8", "int8-g32q8", "int8q8", "q6kq8", "q5kq8", "iq4xsq8") else key


def mixed_bytes_per_element(dtype: str, mix: dict | None) -> float:
    """Bytes per weight of `dtype`, or the element-weighted mean over `mix` (Plan.precision_mix)."""
    return sum(share * op_time.bytes_per_element(k) for k, share in (mix or {dtype: 1.0}).items())


def step_weight_bytes(cfg: ModelConfig, dtype: str, moe_layers: list[int] | None = None, mix: dict | None = None) -> float:
    """Weight bytes one decode step reads: every layer's attention and dense MLP or router + top-k
    experts, and the lm_head (`mix`: the layers' precisions by share, Plan.precision_mix)."""
    bpe = mixed_bytes_per_element(dtype, mix)
    d = cfg.hidden_size
    attn = cfg.attention_weight_elements()
    total = d * cfg.vocab_size
    for i in range(cfg.num_hidden_layers):
        is_moe = has_experts(cfg, moe_layers, i)
        ffn = (d * cfg.num_experts + 3 * d * (cfg.num_experts_per_tok * cfg.moe_intermediate_size
                                              + cfg.shared_expert_intermediate_size) if is_moe
               else 3 * d * cfg.intermediate_size)
        total += attn + ffn
    return total * bpe


def has_experts(cfg: ModelConfig, moe_layers: list[int] | None, i: int) -> bool:
    """Whether layer i is priced as a MoE layer: `moe_layers` where given, else the model's own (cfg.is_moe_layer)."""
    return cfg.is_moe and (moe_layers is None and cfg.is_moe_layer(i) or moe_layers is not None and i in moe_layers)


def native_step(hw: HardwareProfile) -> bool:
    """Whether `hw` was measured with tiered/kernels built: the engine's CPU decode then runs the
    native step (runtime/cpu_decode, kernels/csrc/decode.cpp): q/k/v and gate/up as one kernel call
    each, attention as plain loops whose fixed cost runtime/decode_step already holds."""
    return bool(hw.meta and hw.meta.get("native_kernels"))


def native_fused_projections(hw: HardwareProfile, dtype: str) -> bool:
    """Whether a decode step runs q/k/v and gate/up as one kernel call each: the native step over the
    decode copies (quant/linear.install_decode_weights fuses them). The lossless fp32 mode keeps the
    dense weights, one kernel per projection (runtime/cpu_decode._group)."""
    return native_step(hw) and dtype != "fp32"


def _attention(cfg: ModelConfig, hw: HardwareProfile, dtype: str, context: int, working_set: float = 0.0,
               mix: dict | None = None, kv_format: str | None = None, rows: int = 1, batch_act: str = "bf16",
               proj_rows: int | None = None, layer_bytes: float | None = None, caches: int | None = None) -> float:
    """Seconds of one layer's attention in a decode step of `rows` sequences of `context` cached
    positions each: the projections (`proj_rows` per call, None = `rows`, on `batch_act` activations: `_batched`;
    `layer_bytes`: the layer's weight bytes, `_gemv`'s) and each row's pass over its own cache. `caches`: the
    sequences the rows belong to where fewer (speculative decoding's rows of one sequence, predict_decode's
    `sequences`): each cache is read once for its rows."""
    w = cfg.attention_weight_elements()
    native = native_step(hw)  # the native step runs plain and latent attention (DecodeStep.set_latent)
    proj = _projections(hw, dtype, mix, w, 2 if native_fused_projections(hw, dtype) else 4, working_set,
                        rows if proj_rows is None else proj_rows, batch_act, layer_bytes)
    act = _kv_format(dtype, kv_format)
    caches = rows if caches is None else max(1, min(rows, caches))
    kv_bytes = caches * context * sizes.kv_bytes_per_token(cfg, act)
    if native:  # the native step's attention streams the cached keys and values once (GQA heads share them),
        # at its own measured rate where profiled (attn_decode/cpu: below the memory's, ~15 GB/s on 2 Zen 4 cores)
        stream = op_time.memory_time(hw, "cpu", act, kv_bytes, "memory", working_set)
        m = hw.models.get(f"attn_decode/cpu/{act}")
        if m is None and act == "int8" and "attn_decode/cpu/bf16" in hw.models:
            # a profile from before int8 caches: their rows at the bf16 cache's rate a value (its bytes)
            m = hw.models["attn_decode/cpu/bf16"]
            kv_bytes = caches * context * sizes.kv_bytes_per_token(cfg, "bf16")
        read = max(stream, m.beta * kv_bytes) if m is not None else stream
        if rows > caches:  # rows sharing a cache (one sequence's drafts): their passes over keys the caches hold, at
            # the prompt rows' rate (attn_rows/cpu: predict_prompt_rows')
            again = hw.models.get(f"attn_rows/cpu/{act}") or hw.models.get(f"attn_rows/cpu/{sizes.kv_compute_format(act)}")
            if again is not None:
                read += again.beta * (rows - caches) * context * cfg.attention_macs_per_pair(True)
        if cfg.is_mla:  # each cached latent row serves every head: H (2 R + r) multiply-adds a position, in
            # fp32 loops, at the fp32 GEMM fit's slope (the 27-layer V2-Lite GGUF: ~0.3 ms a layer at 1024
            # positions on 2 Zen 4 cores, where torch's attention key had priced ~3 ms at 640)
            g = op_time.find(hw, "gemm", "cpu", "fp32")
            macs = rows * context * cfg.attention_macs_per_pair(True)
            read = max(read, g.beta * macs if g is not None else 0.0)
        return proj + read
    return proj + op_time.attention_time(hw, "cpu", sizes.kv_compute_format(act),
                                         rows * context * cfg.attention_macs_per_pair(True), kv_bytes)


def _kv_format(dtype: str, kv_format: str | None) -> str:
    """The KV cache's format in a decode step: the plan's (`kv_format`), else the engine's rule for weights read in
    `dtype` (CPU: fp32 activations; a 16-bit cache beside lossy copies)."""
    return kv_format or sizes.kv_cache_format(dtype if dtype in ("bf16", "fp16") else "fp32", dtype)


# decode-copy formats whose rows a batched native step runs on int8 activations like int4's (runtime/batch_rows)
INT_ROWS = {"int4", "int8", "int8-g32", "q6k", "q5k", "iq4xs"}


def predict_decode(cfg: ModelConfig, hw: HardwareProfile, dtype: str, context: int, hits: HitStats | None = None,
                   read_ahead: bool = True, readers: int = 2, task_overhead: float | None = None,
                   moe_layers: list[int] | None = None,
                   experts_format: str | None = None,
                   head_dtype: str | None = None, expert_act: str = "bf16",
                   mix: dict | None = None, kv_format: str | None = None,
                   batch: int = 1, batch_act: str = "bf16",
                   bursts: bool = False, sequences: int | None = None) -> tuple[list[tuple[float, float]], float]:
    """Per-layer (attention, FFN or MoE) seconds of one decode step, and the whole step
    (layers + lm_head) on CPU + disk.

    Args:
        cfg: the model; dtype: compute dtype name ("fp32", "bf16"); context: cached positions (a sliding layer
            attends to its window of them).
        hits: per-layer expert hit shares (MoE); None = every expert in RAM.
        read_ahead, readers: the runtime's disk-read mode.
        task_overhead: executor cost per expert task [s]; None = the profile's runtime/task model or 0.
        moe_layers: layers with experts (default: cfg.is_moe_layer).
        experts_format: the routed experts' stored format (quant/experts.py names: their bytes,
            memory/sizes.expert_bytes, and the GEMV key of their first projection's kind price
            them); None = `dtype`.
        expert_act: the routed experts' batch-1 activations (Plan.expert_act): int4 experts on "q8"
            are priced by gemv/cpu/int4q8 (op_time.gemv_dtype), int4's where the profile lacks it.
        head_dtype: the lm_head's format (quant/linear.head_precision: a GGUF file's Q8_0 embedding
            stays int8 beside int4 layers); None = `dtype`.
        mix: the layers' dense projections' precisions by share of their elements (Plan.precision_mix:
            a Q4_K_M file's Q6_K tensors decode from bf16 copies beside int4 ones); None = `dtype`.
        kv_format: the KV cache's format (Plan.dtypes["kv_cache"]); None = memory/sizes.kv_cache_format's
            for `dtype`.
        batch: sequences decoded together, each at `context` positions (a server's step over its
            slots): each projection streams its weights once for all rows and is no less than its
            rows' multiply-adds (decode_rows/cpu/<dtype>, `_gemv`); each row attends over its own
            cache; an MoE layer runs the experts its rows choose, E (1 - (1 - k/E)^batch) of them
            under uniform routing (the most a batch can activate), with batch k / that many rows each.
            In the native step with runtime/batch_rows/<kind> profiled (int4 copies on int8 rows, one
            precision), a dense layer is one row's stream plus each row past the first at that key
            (a row's fixed cost a layer and its cost a weight element at real widths, in the step).
        batch_act: what int4 decode copies multiply in steps of 2+ rows (Plan.batch_act): "q8" prices
            them by gemv/cpu/int4q8 and decode_rows/cpu/int4q8 (`_batched`).
        sequences: the sequences the `batch` rows belong to, where fewer than the rows (None: one a row): speculative
            decoding's step of one sequence's last token and its k drafts (Plan.speculative_costs) attends over that
            one cache, its keys and values read once for its rows (the later rows find them in the caches). Priced
            as 1 + k sequences, SmolLM2's steps of 2 / 3 / 4 / 5 rows had been 1.39 / 1.77 / 2.14 / 2.55x one row
            where they took 1.15 / 1.37 / 1.62 / 2.03x (2 AMX cores, 2026-12-05).
        bursts: the engine decodes a lone sequence in native bursts (LLM._burst: generate, stream, and a
            server with one request running and none waiting): at batch 1 with the native step running every layer (every expert resident in RAM: no
            cache slots, none on disk), the per-token fixed cost is a burst's (op_time.step_overhead's `burst`).
    """
    bpe = op_time.bytes_per_element(dtype)
    d = cfg.hidden_size
    over = task_overhead if task_overhead is not None else op_time.task_overhead(hw)
    # the model code's own fixed costs (module calls, small ops) per layer and per step, when profiled
    in_ram = hits is None or all(hits.rates(i)[0] >= 1 - 1e-9 for i in range(cfg.num_hidden_layers)
                                 if has_experts(cfg, moe_layers, i))
    per_step, per_layer = op_time.step_overhead(hw, dtype, burst=bursts and batch == 1 and native_step(hw) and in_ram)
    moe_fixed = op_time.moe_layer_overhead(hw)  # the MoE block's own code, beyond a dense layer's
    mla = op_time.mla_layer_overhead(hw) if cfg.is_mla else None
    if mla is not None:  # DeepSeek's layers (latent attention, their MoE block): their own measured fixed cost
        per_layer, moe_fixed = mla, 0.0
    # what passes between two reads of a weight: the step's weights and its rows' caches (beyond the last-level
    # cache: DRAM's rate; within it, op_time.cache_factor's). SmolLM2's default step after a 2048-token prompt
    # (47 MB of bf16 cache beside 89 MB of weights), its working set taken as the weights alone, was priced 4.7 ms
    # against 5.4 (2 AMX cores, 2026-12-04)
    B = max(1, int(batch))
    S = B if sequences is None else max(1, min(B, int(sequences)))  # the caches the rows read
    # a sliding layer's attention reads its window only (the native step's keys_span)
    attended = [min(context, cfg.window_of(i) or context) for i in range(cfg.num_hidden_layers)]
    ws = step_weight_bytes(cfg, dtype, moe_layers, mix) + S * sum(attended) * \
        sizes.kv_bytes_per_token(cfg, _kv_format(dtype, kv_format))
    layers = []
    # a batched native step's dense layers: one row's stream, and each row past the first as the step ran such rows at
    # the layers' widths (runtime/batch_rows/int4q8: the rows' kernels, code and waits; SmolLM2's 8-sequence step
    # priced by decode_rows' kernel alone was ~22% fast); decode copies mixing int4 with int8 (a Q4_K_M file's: its
    # Q6_K parts as int8) at the int4 key too: an 8-layer Llama-3-8B-width Q4_K_M step's rows past the first cost
    # 1-4 ms, 2.4 ps an element (2 Zen 4 cores, 2026-12-04), where decode_rows' slopes by share priced 9.5 ms
    rows_key = f"runtime/batch_rows/{_batched(dtype if mix is None else 'int4', batch_act, B)}"
    rows_key = rows_key if B > 1 and native_step(hw) and (mix is None or set(mix) <= INT_ROWS) and \
        rows_key in hw.models else None
    # a dense layer's weight bytes in the step (its calls' rate: op_time.layer_shape)
    dense_bytes = (cfg.attention_weight_elements() + 3 * d * cfg.intermediate_size) * mixed_bytes_per_element(dtype, mix)
    for i in range(cfg.num_hidden_layers):
        dense = not has_experts(cfg, moe_layers, i)
        by_key = rows_key is not None and dense
        lb = dense_bytes if dense else None
        attn = _attention(cfg, hw, dtype, attended[i], ws, mix, kv_format, B, batch_act, 1 if by_key else B,
                          layer_bytes=lb, caches=S) + per_layer
        t = 0.0
        if dense:
            F = cfg.intermediate_size
            t += _projections(hw, dtype, mix, 3 * d * F, 2 if native_fused_projections(hw, dtype) else 3, ws,
                              1 if by_key else B, batch_act, layer_bytes=lb)
            if by_key:  # split between the layer's two parts by their weights
                w_attn = cfg.attention_weight_elements()
                rows = op_time.batch_rows_time(hw, rows_key, B, w_attn + 3 * d * F)
                attn += rows * w_attn / (w_attn + 3 * d * F)
                t += rows * 3 * d * F / (w_attn + 3 * d * F)
        else:
            E, F, k = cfg.num_experts, cfg.moe_intermediate_size, cfg.num_experts_per_tok
            kind0 = (experts_format or dtype).split(",")[0]
            ekind = op_time.gemv_dtype(kind0, expert_act)
            eb = sizes.expert_bytes(cfg, experts_format) if experts_format else 3 * d * F * bpe
            t += _gemv(hw, dtype, d * E * bpe, working_set=ws, rows=B, in_step=native_step(hw)) + moe_fixed
            Fs = cfg.shared_expert_intermediate_size  # the always-on shared expert(s): a dense SwiGLU
            if Fs:
                t += _projections(hw, dtype, mix, 3 * d * Fs, 2 if native_fused_projections(hw, dtype) else 3, ws, B,
                                  batch_act)
            res, hit = hits.rates(i) if hits is not None else (1.0, 0.0)
            active = k if B == 1 else E * (1 - (1 - k / E) ** B)  # experts the step's rows choose (uniform)
            misses = active * (1 - res - hit)
            # what passes between two reads of one routed expert: E / active steps under uniform routing, not one.
            # The Qwen3-30B-A3B-width 8-layer file's step (370 MB) fits the 2-core VM's reported 480 MiB L3, and its
            # experts priced at the cache's rate made its decode 18% fast (81.2 tok/s priced, 68.6 measured); each
            # expert is read again only ~16 steps (5.9 GB) later, and cold it streamed at DRAM's rate (2 AMX cores,
            # 2026-12-06)
            ews = ws * max(1.0, E / max(active, 1e-9))
            calls = 2 if native_step(hw) else 3  # the native expert: gate and up in one call, then down
            if B > 1:  # each active expert once, over its share of the rows (on quant/experts.rows_activations)
                rkind = op_time.gemv_dtype(kind0, rows_activations(kind0, expert_act, batch_act))
                compute = _expert_rows(hw, rkind, experts_format or dtype, eb, 3 * d * F, k * B / active, calls, ews)
                t += experts_with_reads(hw, active, misses, eb, compute, read_ahead, readers, over)
            elif misses <= 1e-9 and native_step(hw):
                # every expert in RAM: the layer's k experts in one native call of two parallel
                # regions (runtime/moe_runner._all_on_fast, the plan's native_decode), no task per expert
                t += _gemv(hw, ekind, k * eb, calls=2, working_set=ews, expert=True, in_step=True)
            else:
                # computes run inline on the calling thread (the executor's "cpu" stream): no task hop;
                # each miss's read is a task on a reader thread and pays `over`
                compute = _gemv(hw, ekind, eb, calls=calls, working_set=ews, expert=True)
                t += experts_with_reads(hw, k, misses, eb, compute, read_ahead, readers, over)
        layers.append((attn, t))
    hd = head_dtype or dtype
    head = _gemv(hw, _batched(hd, batch_act, B), d * cfg.vocab_size * op_time.bytes_per_element(hd), working_set=ws,
                 rows=B, in_step=native_step(hw))
    return layers, sum(a + f for a, f in layers) + head + per_step


def _expert_rows(hw: HardwareProfile, kind: str, stored: str, expert_bytes: float, macs_per_row: float, rows: float,
                 calls: int, working_set: float) -> float:
    """Seconds of one routed expert over `rows` rows of a batched decode step (`kind`: its gemv key,
    `stored`: its format): bf16 experts on the native kernel within its rows (native_expert_time),
    torch's GEMMs past them; quantized ones on their decode kernels (`_gemv` with rows)."""
    import math

    if stored == "bf16" and native_step(hw):
        r = max(1, math.ceil(rows - 1e-9))
        if r <= expert_native_rows(hw, "bf16"):
            return native_expert_time(hw, "bf16", r, expert_bytes, macs_per_row)
        return torch_gemm_time(hw, "bf16", r * macs_per_row, expert_bytes, 3)
    return _gemv(hw, kind, expert_bytes, calls=calls, working_set=working_set, expert=True, rows=rows,
                 macs=macs_per_row)


def experts_with_reads(hw: HardwareProfile, active: float, misses: float, expert_bytes: float, compute: float,
                       read_ahead: bool, readers: int, over: float, overlap: bool = True) -> float:
    """Seconds of one MoE layer's `active` expert computes (`compute` s each, inline on the calling
    thread) when `misses` of them are first read from disk (expert_bytes each; each read a task on a
    reader thread that pays `over`).

    With read-ahead all of the layer's reads are issued at once (posix_fadvise WILLNEED, then the
    reader threads) and the CPU computes the others meanwhile and each miss once it lands:
    read-bound, the stream plus the last compute; compute-bound, the computes in a row. With several
    readers the stream is priced by disk/read_cold_parallel (timed as read-ahead reads, hardware/
    disk_reads), else the reads go back to back. Without read-ahead each miss is read, then computed.
    `overlap` False: the stream and the computes one after the other (a prompt's expert GEMMs keep
    every core busy, and the reader threads then wait for one).
    """
    disk = hw.models.get("disk/read_cold")
    if misses <= 0 or disk is None:
        return active * compute
    read = disk(expert_bytes)
    if not read_ahead:
        return active * compute + misses * (read + over)
    par = hw.models.get("disk/read_cold_parallel") if readers > 1 else None
    if par is not None:
        stream = par(misses * expert_bytes) + misses * over
    else:
        stream = misses * (read + over) - (max(misses, 1) - 1) * disk.alpha * (readers > 1)
    return max(stream + compute, active * compute) if overlap else stream + active * compute


def torch_gemm_time(hw: HardwareProfile, dtype: str, macs: float, weight_bytes: float, calls: int = 1) -> float:
    """Seconds of `calls` torch GEMMs (F.linear: a prompt's projections, an expert past its native rows)
    totalling `macs` over `weight_bytes`: op_time.gemm_time (compute, floored by one stream of the
    weights), and no less than gemm_rows/cpu/<dtype> where profiled: its time for each call's weights
    (torch's GEMM of GEMM_ROWS rows over cold weights: oneDNN reads and packs them every call) plus the
    multiply-adds of the rows beyond GEMM_ROWS at the GEMM line's slope. On 2 Zen 4 cores a 3584 x 1024
    bf16 weight took 321 / 378 / 713 / 1193 us at 8 / 16 / 64 / 128 rows, where max(compute, stream)
    priced 155 / 171 / 508 / 959 and this 321 / 381 / 741 / 1221; a uniformly routed CPU MoE's prefill of
    16-128 tokens had been priced 39-56% fast.

    bf16 on a CPU without a bf16 GEMM (meta["bf16_gemm_native"] False, with convert/cpu/bf16 profiled): each
    call's fp32 GEMM over its weight converted for it (hardware/cpu_gemm.linear), priced as the fp32 GEMM
    plus the conversion: timed as one, the two had fitted one line of R^2 0.34-0.95 on 2 Zen 3 cores. int4 (a
    one-copy weight past its kernel's rows): the GEMM plus the weight's dequantization (op_time.dequantize_time), on
    AMX within quant/int4.AMX_ROWS rows by gemm_amx/cpu/int4 (op_time.amx_gemm_time)."""
    conv = conversion_time(hw, weight_bytes / op_time.bytes_per_element(dtype) / calls) if dtype == "bf16" else None
    if conv is not None:
        return torch_gemm_time(hw, "fp32", macs, 2 * weight_bytes, calls) + calls * conv if macs > 0 else 0.0
    # one-copy int4 weights: within AMX_ROWS rows on AMX, the weight dequantized into the tiles as the GEMM goes
    amx = op_time.amx_gemm_time(hw, macs, weight_bytes, calls) if dtype == "int4" else None
    if amx is not None:
        return amx
    # past them (or without AMX) each dequantized for its GEMM (quant/int4.Int4Linear.dequantized), where profiled apart
    t = op_time.gemm_time(hw, "cpu", dtype, macs, weight_bytes, calls=calls) + op_time.dequantize_time(
        hw, "cpu", dtype, weight_bytes)
    rows_key = hw.models.get(f"gemm_rows/cpu/{dtype}")
    if rows_key is None or weight_bytes <= 0 or macs <= 0:
        return t
    per_call = weight_bytes / calls
    elements = weight_bytes / op_time.bytes_per_element(dtype)
    line = op_time.gemm_line(hw, "cpu", dtype, per_call, op_time.find(hw, "gemm", "cpu", dtype), macs / elements)
    return max(t, calls * rows_key(per_call) + max(0.0, macs - GEMM_ROWS * elements) * line.beta)


CONVERT_BIG_BYTES = 32 * 2**20  # glibc's largest mmap threshold: fresh fp32 copies past it fault in every call


def conversion_time(hw: HardwareProfile, elements: float) -> float | None:
    """Seconds to convert a bf16 weight of `elements` elements to fp32 on a CPU without a bf16 GEMM (meta
    ["bf16_gemm_native"] False), as hardware/cpu_gemm.linear does before each fp32 GEMM: convert/cpu/bf16 for
    fp32 copies under CONVERT_BIG_BYTES (the heap gives the last call's pages back), convert_big/cpu/bf16 past
    it (fresh pages faulted in: ~1.4 ns an element on 2 Zen 3 cores, against ~0.2 under it). None where the CPU
    has a bf16 GEMM or the profile did not time the conversion."""
    if (hw.meta or {}).get("bf16_gemm_native") is not False:
        return None
    small, big = hw.models.get("convert/cpu/bf16"), hw.models.get("convert_big/cpu/bf16")
    key = big if 4 * elements >= CONVERT_BIG_BYTES and big is not None else small
    return None if key is None else key(elements)


def native_expert_time(hw: HardwareProfile, dtype: str, rows: int, weight_bytes: float, macs_per_row: float) -> float:
    """Seconds of one CPU expert of `rows` rows in tiered's native kernel (within its native rows):
    op_time.gemm_time (compute, floored by one stream of the weights at the expert kernel's rate:
    memory_time's `expert`), and where the profile timed the
    native bf16 expert at 1-8 rows (expert_rows/cpu/bf16) no less than one stream of the weights plus
    each row past the first at that key's slope. On 2 Zen 4 cores a 1024 x 3584 bf16 expert took 414 /
    421 / 725 / 942 us at 1 / 2 / 4 / 8 rows, where one stream priced ~490 us whatever the rows.
    With that key the GEMM fit's compute line (torch's GEMM) no longer floors the time: the kernel
    computes at its own rate. On 2 AVX2-only Zen 3 cores torch's bf16 GEMM runs ~10 GMAC/s where the
    native kernel's rows cost 1.7e-11 s a MAC (~60 GMAC/s): floored by the former, uniformly routed
    8-16-token prompts of the Mixtral-width dummy were priced 2.5-2.9x slow (2026-11-30)."""
    key = hw.models.get(f"expert_rows/cpu/{dtype}")
    if key is None:
        return op_time.gemm_time(hw, "cpu", dtype, rows * macs_per_row, weight_bytes, calls=3, expert=True)
    stream = 3 * op_time.memory_time(hw, "cpu", dtype, weight_bytes / 3, "gemv", expert=True)
    return stream + key.beta * max(0, rows - 1) * macs_per_row


def kernel_isa(hw: HardwareProfile) -> str | None:
    """The native kernels' ISA ("avx512", "avx2", "scalar") where `hw` was measured: meta["kernel_isa"], else
    read off meta["int4_dequantize_rows"] (quant/int4.DEQUANTIZE_ROWS by ISA; profiles before 2026-11-29);
    None without the kernels or either."""
    meta = hw.meta or {}
    if not meta.get("native_kernels"):
        return None
    if meta.get("kernel_isa"):
        return meta["kernel_isa"]
    from tiered.quant.int4 import DEQUANTIZE_ROWS

    return next((isa for isa, rows in DEQUANTIZE_ROWS.items() if rows == meta.get("int4_dequantize_rows")), None)


def int4_kernel_rows(hw: HardwareProfile, batch_act: str) -> float | None:
    """The rows up to which a one-copy int4 weight's prompt GEMM runs the int4 kernel on `batch_act` activations on
    the machine `hw` profiled (quant/int4.dequantize_rows for its kernel_isa and kernel tuning; past them it
    dequantizes for one GEMM); inf: at every row count; meta["int4_dequantize_rows"] for profiles that name no ISA;
    None without the kernels."""
    import math

    from tiered.quant.int4 import dequantize_rows

    isa = kernel_isa(hw)
    if isa is None:
        return (hw.meta or {}).get("int4_dequantize_rows")

    rows = dequantize_rows(batch_act, isa, tuning=(hw.meta or {}).get("kernel_tuning") or {})
    return math.inf if rows is None else rows


def prompt_expert_time(hw: HardwareProfile, kind: str, rows: float, weight_bytes: float, macs_per_row: float,
                       batch_act: str = "bf16", biased: bool = False, working_set: float = 0.0,
                       glu: float = 0.0, group_rows: int | None = None) -> float | None:
    """Seconds of one CPU expert stored in quantized `kind` ("int4", "mxfp4", "int8-g32", ...: `weight_bytes`
    in all, `macs_per_row` its three projections' multiply-adds a row) over `rows` rows of a prompt, by the
    path the runtime takes there (quant/experts.prompt_rows, on the profiled machine's kernel_isa): the native
    kernel in one call (its weights streamed once, each row past the first at decode_rows' slope, `_gemv`),
    in groups of NATIVE_ROWS rows (the weights streamed once a group; an expert the cache holds twice over
    re-streamed from it, its rows past the first group at expert_groups/cpu/<key>'s slope where profiled), or,
    past those rows, int4 and mxfp4 projections on the AMX GEMM (op_time.amx_gemm_time; SiLU's experts in one
    native call, ExpertFormat.amx_rows, their SwiGLU fused) or dequantized for one GEMM each (gemm/cpu/int4:
    hardware/profiler.int4_gemm_shapes times that path), plus `glu` seconds where torch runs the GLU over the rows
    (ExpertFormat.dequantized's). int4 rows read `batch_act` activations (Plan.batch_act), mxfp4 ones int8 always;
    `biased`: gpt-oss's experts (ModelConfig.expert_bias), never in row groups. None where the profile has no native
    kernels or the path is none of these (a dense kind: native_expert_time / torch_gemm_time). Priced as fp32
    GEMMs before, a gpt-oss-20b-width prompt's mxfp4 experts cost 5.0 s of a 512-token TTFT that took 1.9
    (2 Sapphire Rapids cores, 2026-11-29). `group_rows`: priced_group_rows for this expert where the caller has it
    (predict_prefill: once a prediction, for every draw of rows it prices); None: computed here."""
    import math

    if not native_step(hw) or kind in ("bf16", "fp32", "fp16"):
        return None
    from tiered.quant.experts import GROUPED_ROWS, NATIVE_ROWS, prompt_rows

    if kind not in GROUPED_ROWS:
        return None
    one, grouped = prompt_rows(kind, kernel_isa(hw), biased, batch_act, (hw.meta or {}).get("kernel_tuning") or {})
    if kind == "int4" and not biased and grouped > NATIVE_ROWS:
        grouped = min(grouped, group_rows if group_rows is not None else
                      priced_group_rows(hw, weight_bytes, macs_per_row, batch_act))
    r = max(1, math.ceil(rows - 1e-9))
    key = op_time.gemv_dtype(kind, batch_act) if kind != "mxfp4" else kind
    if r <= one or r <= grouped:
        if op_time.find(hw, "gemv", "cpu", key) is None:  # a profile without the kernel's stream
            return None
        return _native_expert_rows_time(hw, key, r, one, weight_bytes, macs_per_row, working_set)
    amx = op_time.amx_gemm_time(hw, r * macs_per_row, weight_bytes, calls=3) if kind in ("int4", "mxfp4") else None
    if amx is not None:  # within AMX_ROWS on AMX: one native call, the SwiGLU (gpt-oss's clamped GLU and bias
        return amx  # columns) fused (ExpertFormat.amx_rows)
    if kind in ("int4", "mxfp4") and op_time.find(hw, "gemm", "cpu", "int4") is not None:
        return (op_time.gemm_time(hw, "cpu", "int4", r * macs_per_row, weight_bytes, calls=3) + glu
                + op_time.dequantize_time(hw, "cpu", "int4", weight_bytes))
    return None


def _native_expert_rows_time(hw: HardwareProfile, key: str, r: int, one: int, weight_bytes: float,
                             macs_per_row: float, working_set: float) -> float:
    """prompt_expert_time's native kernel path for `r` rows of one expert (gemv key `key`): one call up to `one`
    rows, else groups of NATIVE_ROWS rows, each streaming the three projections again. A group past the first
    re-reads an expert the cache may hold (expert_groups/cpu/<key>'s slope: its rows with their share of a re-read
    from the cache), paid whole whatever its rows (the kernel streams the expert once a group: a Mixtral-width
    expert took 11.6 / 10.2 / 12.2 ms at 9 / 12 / 16 rows on 2 AMX cores, 2026-12-06); how much the cache holds
    of it is the native step's own measure at twice the expert's bytes (cache_factor's runtime/decode_ws/int4,
    against its smallest set's: 1 for a 3 MB expert, 0.2 for Mixtral's 99 MB on that VM, whose sysfs reports a
    480 MB L3 that helps the step no further than ~128 MB), the rest as from memory: the groups of a Mixtral-width
    expert at 16 / 24 / 32 rows, measured 12.1-12.2 / 17.8-18.7 / 22.6 ms, were priced 9.9 / 14.1 / 18.3 as held by
    the cache, now 11.6 / 17.3 / 23.0 (profiler 56's quick profile); where the profile has no decode_ws points, the
    last-level cache's size decides."""
    import math

    from tiered.quant.experts import NATIVE_ROWS

    calls = 1 if r <= one else math.ceil(r / NATIVE_ROWS)  # each call streams the three projections
    stream = _gemv(hw, key, weight_bytes, calls=3, working_set=working_set, expert=True)
    row = _row_time(hw, key, weight_bytes, macs_per_row, expert=True)
    streamed = calls * stream + (r - calls) * row
    groups = hw.models.get(f"expert_groups/cpu/{key}")
    if calls == 1 or groups is None or op_time.beyond_cache(hw, 2 * weight_bytes):
        return streamed
    # the groups past the first re-read an expert the cache holds: their rows at the grouped slope (the re-reads'
    # share included), each group whole; the first group as one call
    first = min(r, NATIVE_ROWS)
    cached = stream + (first - 1) * row + (calls * NATIVE_ROWS - first) * groups.beta * macs_per_row
    held = op_time.cache_held(hw, 2 * weight_bytes)
    return held * cached + (1.0 - held) * streamed


def priced_group_rows(hw: HardwareProfile, weight_bytes: float, macs_per_row: float, batch_act: str = "bf16") -> int:
    """Rows of one tiled int4 CPU expert (`weight_bytes` in all, `macs_per_row` its three projections' multiply-adds
    a row) up to which its prompt rows run the native kernel in groups of NATIVE_ROWS rather than the AMX GEMM
    (quant/experts.ExpertFormat.grouped_rows; Plan.expert_group_rows), on the machine `hw` profiled: the fewest rows
    past NATIVE_ROWS at which the AMX GEMM (op_time.amx_gemm_time) is priced below the groups, less one, searched up
    to the kernel tuning's rows (kind_grouped_rows), which it returns where the profile prices no AMX GEMM or the
    groups' stream, or the groups win throughout. prompt_expert_time takes the least of this and
    the kernel tuning's q8_expert_grouped_rows, which is measured on one small expert (2048 x 768: groups and the AMX
    GEMM cross near 32 rows on 2 AMX cores): a Mixtral-width expert's groups re-stream 99 MB from memory each, and
    there the AMX GEMM won from ~20 rows (ratios dequantized / grouped 1.09 / 0.85 / 0.70 at 16 / 24 / 32 rows,
    2026-12-06), where the tuning's 32 kept every expert of a 128-token prompt on the groups."""
    from tiered.quant.experts import NATIVE_ROWS, kind_grouped_rows

    key = op_time.gemv_dtype("int4", batch_act)
    most = kind_grouped_rows("int4", kernel_isa(hw), batch_act, (hw.meta or {}).get("kernel_tuning") or {})
    if op_time.find(hw, "gemv", "cpu", key) is None:
        return most
    for r in range(NATIVE_ROWS + 1, min(most, AMX_GROUP_SEARCH_ROWS) + 1):
        amx = op_time.amx_gemm_time(hw, r * macs_per_row, weight_bytes, calls=3)
        if amx is None:
            return most
        if amx < _native_expert_rows_time(hw, key, r, NATIVE_ROWS, weight_bytes, macs_per_row, 0.0):
            return r - 1
    return most


AMX_GROUP_SEARCH_ROWS = 512  # priced_group_rows looks no further (quant/int4.AMX_ROWS: the AMX GEMM's rows)


def amx_experts(hw: HardwareProfile, stored: str, rows: float) -> bool:
    """Whether a prompt's CPU experts stored as `stored` compute `rows` rows each past their kernels' rows in one
    native call on the AMX GEMM (quant/experts.ExpertFormat.amx_rows: tiled int4 and mxfp4, gpt-oss's biased
    experts with their clamped GLU inside) on the profiled machine: its profile prices the AMX GEMM and the rows
    are within quant/int4.AMX_ROWS."""
    from tiered.quant.int4 import AMX_ROWS

    return (stored in ("int4", "mxfp4") and native_step(hw) and rows <= AMX_ROWS
            and hw.models.get("gemm_amx/cpu/int4") is not None)


def biased_native_rows(hw: HardwareProfile, stored: str) -> int:
    """Rows up to which one of gpt-oss's biased experts stored as `stored` runs the native kernels with its
    bias columns and clamped GLU inside on the profiled machine (quant/experts.ExpertFormat.biased_rows:
    prompt_rows' one-call rows of its kind, bf16's expert_native_rows); past them (or 0: no kernels) torch
    computes the GLU and the bias columns."""
    if not native_step(hw):
        return 0
    if stored == "bf16":
        return expert_native_rows(hw, "bf16")
    from tiered.quant.experts import GROUPED_ROWS, prompt_rows

    if stored not in GROUPED_ROWS or stored == "fp32":
        return 0
    return prompt_rows(stored, kernel_isa(hw), True, tuning=(hw.meta or {}).get("kernel_tuning") or {})[0]


def expert_native_rows(hw: HardwareProfile, dtype: str) -> int:
    """Rows up to which a CPU expert of `dtype` runs tiered's native kernel on the profiled machine, not
    torch's GEMMs (quant/experts.bf16_native_rows: the kernel tuning the profile recorded); 0 without
    the kernels. Only bf16 experts switch to torch (quantized formats keep their kernels)."""
    if not native_step(hw) or dtype != "bf16":
        return 0 if dtype == "bf16" else 1 << 30
    from tiered.quant.experts import NATIVE_ROWS

    return int(((hw.meta or {}).get("kernel_tuning") or {}).get("bf16_native_rows", NATIVE_ROWS))


def chunk_spans(tokens: int, chunk: int = 0) -> list[tuple[int, int]]:
    """(tokens, past) of each forward a `tokens`-token prompt prefills in: chunks of `chunk` tokens, each
    after the `past` tokens the earlier ones cached (engine/llm.LLM._prefill); one forward when `chunk` is
    0 or the prompt fits it."""
    if chunk <= 0 or tokens <= chunk:
        return [(tokens, 0)]
    return [(min(chunk, tokens - start), start) for start in range(0, tokens, chunk)]


def predict_prefill(cfg: ModelConfig, hw: HardwareProfile, dtype: str, tokens: int,
                    moe_layers: list[int] | None = None, disk_share: float = 0.0,
                    experts_dtype: str | None = None, act_dtype: str | None = None,
                    experts_format: str | None = None, read_ahead: bool = True, readers: int = 2,
                    task_overhead: float | None = None, batch_act: str = "bf16", popularity=None,
                    chunk: int = 0, ffn_only: bool = False, attn_dtype: str | None = None,
                    ffn_dtype: str | None = None, native_moe: bool = False, prompts: int = 1,
                    past: int = 0, lengths: Sequence[int] | None = None) -> float:
    """Seconds of a `tokens`-token prefill on the CPU (no GPU): the time to first token.

    `past`: positions the cache holds before the prompt's (a prefix reused from a slot or lent: engine/scheduler),
    which its attention also covers (each forward after them, op_time.prefill_attention_pairs' explicit mask).

    `prompts`: the tokens are that many prompts packed into one forward (prompts admitted together:
    LLM._prefill_groups, within the chunk; models/layers.build_packed_metadata), each attending to its own tokens
    in a call of its own and its last token's lm_head row; the weights and the experts (their reads too) go once
    for all. `lengths`: their tokens each (summing to `tokens`); None: `prompts` equal prompts.

    `ffn_only`: the seconds of its FFNs alone (each layer's dense FFN, or MoE block: router, shared expert,
    routed experts with their reads), what an MoE model's prompt costs beside its attention side when it runs
    as rows of the native decode step (predict_prompt_rows' `ffn`: the step's MoE block, or the block's
    module, computes the same expert groups as the prefill's; its router then priced inside the step).

    `chunk` (Plan.prefill_chunk; 0: one forward): a longer prompt prefills in forwards of `chunk` tokens
    (engine/llm.LLM._prefill), each priced below on its own tokens (the experts' draws, per-step costs and
    the last token's lm_head again each chunk, its experts read again where on disk) with its attention over
    the cache the earlier chunks wrote (op_time.prefill_attention_pairs).

    Per layer: the attention projections and each FFN / active expert as GEMMs of all their
    tokens (torch_gemm_time: compute, floored by streaming the weights once, and by the profile's
    small-row GEMM key where profiled and torch runs the GEMM), causal attention
    over the prompt (half the positions on average), the layer's own model code (norms, RoPE, SiLU,
    adds: runtime/prefill_code/<act dtype> over its tokens x width, op_time.prefill_code_time; an MoE
    layer's width counts each token's k routed copies at the hidden size; the decode step's per-layer
    cost in profiles without it), and for an
    MoE layer the router and, for the `disk_share` of its experts not in RAM, a cold read each, as
    the runtime reads them (`read_ahead` on `readers` threads, or one after the other) but not
    overlapped with the computes (experts_with_reads, overlap False): a prompt's expert GEMMs keep
    both cores busy. On the 2-core EPYC a 128-token prompt of the uniformly routed validation
    checkpoint (57 of 64 experts read from disk, read-ahead on) took 0.93-1.17 s; its reads
    overlapped as decode's are priced it at 0.70 s. Experts: with T tokens routed top-k of E uniformly,
    E * (1 - (1 - k/E)^T) are active (the reads), and each expert's rows are drawn Binomial(T, k/E);
    with `popularity` (float [L, E], tokens routed per expert: an expert profile,
    planner/placement.load_popularity), as latency_moe.prompt_experts counts a GPU plan's prompt: expert e
    takes each token with q_e = min(1, k p_e), is active with a_e = 1 - (1 - q_e)^T (prompt_routing) and
    computes Binomial(T, q_e) rows. The layer's experts cost the sum of each one's expected cost over
    its draw (RowCosts.expected: the runtime's path changes with the rows, so the mean rows misprice
    the draws past a path's end). Fewer experts
    of more rows cost less than the uniform draw's: the skew-routed 8-layer Mixtral-width dummy's 512-token
    prompt sent nearly every token to the same 2 experts a layer and took 0.220 s where the uniform draw (8
    experts of 128 rows, each a torch GEMM of 3 projections) priced 0.298 and its expert profile 0.225 (2
    Sapphire Rapids cores, 2026-11-29). Then the lm_head of the last token only (CausalLM's last_only) and the
    per-step cost. Prefill runs the dense weights in `dtype` (decode copies serve <= 8 rows).
    `experts_dtype`: the dtype expert GEMMs of more than 8 rows compute in (None = `dtype`): the
    activations' (quant/experts.ExpertFormat.forward converts or dequantizes the expert's weights to
    it once per call), whatever format the experts are stored in. `act_dtype`: the activations'
    dtype, which the attention runs in (None = `dtype`), priced by op_time.prefill_attention_time; `attn_dtype`
    the attention's where the plan has it attend in another (Plan.dtypes["prompt_attention"]); `ffn_dtype` the dtype
    the plan keeps one-copy int4 dense FFNs' intermediate in past the kernel's rows (Plan.dtypes["prompt_ffn"]).
    `native_moe`: each MoE layer's experts and their weighted sum run in one native call (a CPU plan's native
    step with every expert in RAM: runtime/moe_runner._all_on_fast, ExpertFormat.layer_call), whose gather of
    the k routed copies and weighted sum are priced at the native step's row-code rate (runtime/step_rows/int4,
    as predict_prompt_rows prices the same moe_experts) instead of torch's (runtime/prefill_code): at torch's
    2.6 ns an element they had been ~0.17 s of a Qwen3-30B-A3B-width 512-token prompt's 2.2 s priced, which
    then measured 1.2-1.8 s (2 Sapphire Rapids cores, 2026-12-03).
    `experts_format`: the experts' stored format (None = the experts' compute dtype): bf16 ones run
    torch's GEMMs past their native rows (expert_native_rows), priced by torch_gemm_time; quantized ones
    their native kernels or dequantized GEMMs, as the runtime runs them (prompt_expert_time, int4 rows on
    `batch_act` activations: Plan.batch_act), their reads from disk at their stored bytes.
    """
    import math

    bpe = op_time.bytes_per_element(dtype)
    d = cfg.hidden_size
    w_attn = cfg.attention_weight_elements()
    per_step, per_layer = op_time.step_overhead(hw, dtype)
    over = task_overhead if task_overhead is not None else op_time.task_overhead(hw)

    kernel_rows = int4_kernel_rows(hw, batch_act)
    no_bf16_gemm = (hw.meta or {}).get("bf16_gemm_native") is False
    # a dense FFN the plan keeps in bf16 between one-copy int4 projections that dequantize for bf16 GEMMs past the
    # kernel's rows (Plan.dtypes["prompt_ffn"], models/layers.MLP.prompt_dtype): its SiLU and product priced at
    # the bf16 code's rate
    bf16_intermediate = ffn_dtype == "bf16" and dtype == "int4" and (act_dtype or dtype) == "fp32"

    def gemm(T: int, dt: str, macs: float, nbytes: float, calls: int, torch_runs: bool) -> float:
        """torch's GEMMs past the decode copies' and the native experts' rows; within them the native
        kernels stream the weights (gemm_time). One-copy int4 weights run the int4 kernel up to
        quant/int4.dequantize_rows for the profiled ISA and `batch_act` (every row count on AVX2 with int8
        activations; its rows at decode_rows' slope for `batch_act` activations: Int4Linear.dense), past
        them a dequantized GEMM (gemm/cpu/int4, timed there:
        hardware/profiler.int4_gemm_shapes). bf16 weights' GEMMs are priced by the bf16 keys, which the
        profiler times through hardware/cpu_gemm.linear as the runtime calls it (an fp32 GEMM over the
        converted weight where the CPU has no bf16 GEMM). There (meta["bf16_gemm_native"] False) the
        projections are CastLinears (runtime/install), whose calls of up to the native rows run the native
        kernel: priced as its rows (`_gemv`; 8-16-token bf16 MoE prompts were priced 49-74% slow as GEMMs).
        T: the forward's tokens."""
        if dt == "int4" and kernel_rows and T <= kernel_rows:
            return _gemv(hw, _batched(dt, batch_act, T), nbytes, calls=calls, rows=T)
        if dt == "bf16" and no_bf16_gemm and T <= expert_native_rows(hw, "bf16"):
            return _gemv(hw, "bf16", nbytes, calls=calls, rows=T)
        if torch_runs:
            return torch_gemm_time(hw, dt, macs, nbytes, calls)
        return op_time.gemm_time(hw, "cpu", dt, macs, nbytes, calls=calls)
    moe_at = [has_experts(cfg, moe_layers, i) for i in range(cfg.num_hidden_layers)]
    n_moe = sum(moe_at)
    step_code = hw.models.get("runtime/step_rows/int4")  # the native step's row code: native_moe's gather and sum
    # a routed expert's bytes as stored (what a miss reads from disk, what its kernels stream)
    eb = (sizes.expert_bytes(cfg, experts_format) if experts_format else
          3 * d * cfg.moe_intermediate_size * bpe) if n_moe else 0
    edt = experts_dtype or dtype
    stored = experts_format or edt
    # a format of mixed kinds (a Q4_K_M file's int4,int4,q6k) is priced by its first, as predict_decode prices it: no
    # key prices "int4,int4,q6k" itself, and its prompts had fallen to fp32 GEMMs (the 8-layer Qwen3-30B-A3B-width
    # file's 512-token TTFT priced 3.5 s where it took 1.1; 2 Zen 4 cores, 2026-12-08)
    kind0 = stored.split(",")[0]
    E_, k_ = max(cfg.num_experts, 1), max(cfg.num_experts_per_tok, 1)
    # where an int4 expert's rows leave the kernel's groups (prompt_expert_time's, priced once here: it had been
    # searched again for every draw of rows priced, ~0.03 s of a Qwen3-30B-A3B-width load)
    group_rows = priced_group_rows(hw, eb, 3 * d * cfg.moe_intermediate_size, batch_act) \
        if n_moe and kind0 == "int4" and not cfg.expert_bias and native_step(hw) else None

    def forward(T: int) -> float:
        """Seconds of one forward of T tokens without its attention: the per-step cost, the last token's
        lm_head, and each layer's projections, FFN or experts (with their reads) and code."""
        # experts active in an MoE layer and rows each (T tokens routed top-k of E uniformly; a dense model: unused)
        active_experts = min(E_, max(k_, math.ceil(E_ * (1 - (1 - k_ / E_) ** T) - 1e-9)))
        rows_per_expert = max(1, math.ceil(T * k_ / active_experts - 1e-9))
        costs = None  # RowCosts: one routed expert's seconds by rows (the same in every MoE layer)
        total = 0.0 if ffn_only else per_step + _gemv(hw, dtype, d * cfg.vocab_size * bpe)
        for i in range(cfg.num_hidden_layers):
            is_moe = moe_at[i]
            # the layer's own code (norms, RoPE, SiLU, adds, module calls) over its tokens' widths; an MoE layer's
            # over its k routed copies of each token (the dispatch's gathers and weighted sums; its experts' GLU is
            # priced with each expert, `expert` below: fused in the kernels, in torch past their rows) and any shared
            # expert's intermediate rows
            # gpt-oss's biased experts (expert_bias) past their native rows (biased_native_rows) run their clamped GLU
            # and bias columns in torch over each routed row's intermediate width too: ~0.35 s of a 4-layer
            # gpt-oss-20b-width 512-token prompt's 1.85 (2 Sapphire Rapids cores, 2026-11-29); within them the native
            # call computes both inside the kernels, and so does the AMX GEMM's past them (amx_experts)
            torch_glu = is_moe and cfg.expert_bias and rows_per_expert > biased_native_rows(hw, stored) and \
                not amx_experts(hw, stored, rows_per_expert)
            # the routed copies gathered and summed by the native layer call (native_moe) or by torch's ops
            gathered = cfg.num_experts_per_tok * d if is_moe and native_moe and step_code is not None else 0
            routed = cfg.num_experts_per_tok * (d + cfg.moe_intermediate_size * torch_glu) - gathered
            t = 0.0
            if not ffn_only:
                width = d + (routed + cfg.shared_expert_intermediate_size if is_moe else cfg.intermediate_size)
                bf16_ffn = cfg.intermediate_size if not is_moe and bf16_intermediate and kernel_rows is not None and \
                    T > kernel_rows else 0
                code = op_time.prefill_code_time(hw, act_dtype or dtype, T * (width - bf16_ffn))
                if code is not None and bf16_ffn:
                    code += op_time.prefill_code_time(hw, "bf16", T * bf16_ffn, fixed=False) or 0.0
                if code is not None and gathered:
                    code += step_code(T * gathered)
                t = (per_layer if code is None else code) + gemm(T, dtype, T * w_attn, w_attn * bpe, 4, T > GEMM_ROWS)
            if not is_moe:
                F = cfg.intermediate_size
                t += gemm(T, dtype, 3 * T * d * F, 3 * d * F * bpe, 3, T > GEMM_ROWS)
            else:
                E, F = cfg.num_experts, cfg.moe_intermediate_size
                active = active_experts
                # the router: a GEMM over a weight of E rows that stays in cache, priced as the decode kernels' rows (the
                # GEMM fit's intercept, fitted over MiB-sized weights, had priced it 1.7 ms a layer whatever the tokens
                # on 2 Zen 3 cores, where torch's bf16 router took 18 / 82 / 593 us at 8 / 64 / 512 tokens and the native
                # step's fp32 one a few; an 8-token prompt of the uniformly routed Mixtral-width dummy priced 66% slow)
                t += _gemv(hw, dtype, d * E * bpe, rows=T, in_step=ffn_only and native_step(hw))
                Fs = cfg.shared_expert_intermediate_size
                if Fs:  # the shared expert(s), a dense FFN every token runs
                    t += gemm(T, dtype, 3 * T * d * Fs, 3 * d * Fs * bpe, 3, T > GEMM_ROWS)
                ebytes = 3 * d * F * op_time.bytes_per_element(edt)

                def expert(s: int) -> float:  # one expert of `s` rows, as the runtime computes it
                    # torch's SiLU and product over the rows' intermediate width where torch runs the expert (the
                    # kernels fuse them): 1.5 ms of each 512-row expert of the Mixtral-width dummy's prompt, which
                    # priced its 512-token TTFT 0.147 s where it took 0.193 (2 AMX cores, 2026-12-02); gpt-oss's
                    # clamped GLU is in the layer's width above, and `ffn_only`'s rows (predict_prompt_rows) count
                    # every routed row's SwiGLU in their own layer code
                    glu = 0.0 if cfg.expert_bias or ffn_only else (op_time.prefill_code_time(
                        hw, act_dtype or dtype, s * F, fixed=False) or 0.0)
                    quantized = None if stored == edt else prompt_expert_time(
                        hw, kind0, s, eb, 3 * d * F, batch_act, cfg.expert_bias, active_experts * eb * n_moe,
                        glu=glu, group_rows=group_rows)
                    if stored == edt and s <= expert_native_rows(hw, stored):  # tiered's native kernel
                        return native_expert_time(hw, edt, s, ebytes, 3 * d * F)
                    if quantized is not None:  # a quantized format's own kernels, or dequantized GEMMs past them
                        return quantized
                    # torch's GEMMs past the native rows (bf16), or a format without a priced path
                    return gemm(T, edt, 3 * s * d * F, ebytes, 3, stored == edt) + glu

                costs = costs or RowCosts(expert, T)
                if popularity is not None and np.sum(popularity[i]) > 0:  # the profile's skew
                    # every expert stays drawable
                    shares = np.asarray(popularity[i], dtype=np.float64) + 1e-9
                    a, q = prompt_routing(shares, T, k_)
                    active = max(float(k_), float(a.sum()))
                    work = float(costs.expected(q[a > 1e-6]).sum())
                else:  # each expert's rows drawn Binomial(T, k / E)
                    work = E_ * float(costs.expected(min(1.0, k_ / E_))[0])
                compute = work / active
                t += experts_with_reads(hw, active, active * disk_share, eb, compute, read_ahead, readers, over,
                                        overlap=False)
                if torch_glu:  # past their native rows gpt-oss's experts run one by one, torch op by op
                    t += active * over
            total += t
        return total

    attn_macs = cfg.attention_macs_per_pair(False)
    n = max(1, min(int(prompts), int(tokens))) if lengths is None else len(lengths)
    if lengths is None:
        lengths = [tokens // n] * n
    # packed prompts: one forward, each prompt's attention a call over its own tokens
    forwards = [(T, p + max(0, int(past))) for T, p in (chunk_spans(tokens, chunk) if n == 1 else [(tokens, 0)])]
    bodies = {T: forward(T) for T in {n for n, _ in forwards}}
    if ffn_only:
        return sum(bodies[T] for T, _ in forwards)
    heads = (n - 1) * _gemv(hw, dtype, d * cfg.vocab_size * bpe)  # each prompt's last row past the first

    def attention(T: int, past: int) -> float:  # every layer's, a sliding one's over its window (layer_pairs)
        return sum(count * op_time.prefill_attention_time(hw, "cpu", attn_dtype or act_dtype or dtype,
                                                          sum(layer_pairs(t, past, window) for t in
                                                              ([T] if n == 1 else lengths)) * attn_macs,
                                                          calls=n, past=past > 0 or (window or T) < T)
                   for window, count in layer_windows(cfg).items())
    return heads + sum(bodies[T] + attention(T, past) for T, past in forwards)


def _windowed_rows(rows: int, past: int, window: int) -> float:
    """(query, key) pairs of `rows` consecutive rows after `past` cached positions in a layer whose queries see
    their last `window` positions: row i over min(past + i + 1, window) keys."""
    growing = min(rows, max(0, window - past - 1))  # rows that see every position before them
    return growing * (past + 1) + growing * (growing - 1) / 2 + (rows - growing) * window


def layer_windows(cfg: ModelConfig) -> dict[int | None, int]:
    """{a layer's attention window (ModelConfig.window_of; None: the whole context): how many layers have it}."""
    counts: dict[int | None, int] = {}
    for i in range(cfg.num_hidden_layers):
        w = cfg.window_of(i)
        counts[w] = counts.get(w, 0) + 1
    return counts


def layer_pairs(tokens: int, past: int, window: int | None) -> float:
    """(query, key) pairs one layer's eager attention computes for a forward of `tokens` after `past` cached
    positions (op_time.prefill_attention_pairs), a sliding layer's over its window: its keys from
    sizes.window_key_start on (models/layers._window_keys), every pair under the explicit mask once a query's
    window cuts keys (layers.window_mask), the causal half while none does."""
    if window is None:
        return prefill_attention_pairs(tokens, past)
    if past == 0 and tokens <= window:
        return prefill_attention_pairs(tokens, 0)
    return tokens * (past - sizes.window_key_start(past, window) + tokens)


def predict_prompt_rows(cfg: ModelConfig, hw: HardwareProfile, dtype: str, tokens: int, mix: dict | None = None,
                        kv_format: str | None = None, head_dtype: str | None = None, batch_act: str = "bf16",
                        past: int = 0, ffn=None, logit_rows: int = 1, prompts: int = 1) -> float:
    """Seconds of a `tokens`-token prompt run as rows of the native CPU decode step (Plan.mixed_rows:
    LLM._forward_mixed), its time to first token: per layer the decode copies' projections at `tokens` rows
    (`dtype` or `mix` by share, on `batch_act` activations: `_projections`, as a batched decode step's), the
    step's per-layer cost, and the rows' attention over each row's causal prefix at the native step's rate over
    a prompt's own keys (attn_rows/cpu/<kv>: the cache holds them; torch's attention key where not profiled)
    and the rows' layer code (norms, RoPE, SiLU, their int8 rounding: runtime/step_rows/int4 over rows x (hidden
    + intermediate), 0 where not profiled: SmolLM2's TTFT at 512 tokens was priced 26% fast without it, 2 Zen 5
    cores, 2026-12-01); then the head on the last row and the per-step cost.
    `kv_format`: the KV cache's (None: memory/sizes.kv_cache_format's for `dtype`); `head_dtype`: the lm_head's.
    `past`: positions the cache holds before these rows (a chunk of a longer prompt, LLM._prefill): each row
    attends to them too, and only causally within the chunk (T past + T (T + 1) / 2 pairs, where torch's
    attention over a chunk computes every block under its mask: op_time.prefill_attention_pairs).
    `ffn` (an MoE model: required): ffn(T) seconds of every layer's FFN at T rows (predict_prefill's
    `ffn_only`), in place of the dense MLP's projections; the layer code then counts each row's k routed
    copies (gathered at the hidden size, their SwiGLU at the experts' width) and any shared expert's width.
    `logit_rows`: rows whose logits the step computes (the last; every row of a speculative step's sequence,
    LLM._forward_mixed), each past the first at the head's decode_rows slope (`_gemv`).
    `prompts`: the rows are that many prompts of tokens / prompts tokens each, prefilled in one step (prompts
    admitted together: LLM._prefill_groups, engine/llm._rows_groups): each attends to its own rows (and `past`),
    the weights and the experts stream once for all, and each prompt's last row has its logits.

    Raises:
        ValueError: an MoE `cfg` without `ffn`."""
    T = max(1, int(tokens))
    n = max(1, min(int(prompts), T))
    logit_rows = max(logit_rows, n)
    per_step, per_layer = op_time.step_overhead(hw, dtype)
    ws = step_weight_bytes(cfg, dtype, [], mix)
    d = cfg.hidden_size
    fused = native_fused_projections(hw, dtype)
    kv = _kv_format(dtype, kv_format)
    # the rows attend over each row's keys (a sliding layer's last `window` of them: the native step's keys_span)
    past = max(0, int(past))
    pairs = sum(count * (T * past + n * prefill_attention_pairs(T // n, 0) if window is None
                         else n * _windowed_rows(T // n, past, window))
                for window, count in layer_windows(cfg).items()) / cfg.num_hidden_layers
    macs = pairs * cfg.attention_macs_per_pair(False)
    dense = sizes.kv_compute_format(kv)  # an int8 cache's rows where a profile predates their own key: bf16's
    rows_key = hw.models.get(f"attn_rows/cpu/{kv}") or hw.models.get(f"attn_rows/cpu/{dense}")
    attention = rows_key(macs) if rows_key is not None else op_time.prefill_attention_time(hw, "cpu", dense, macs)
    code = hw.models.get("runtime/step_rows/int4")
    if cfg.is_moe and ffn is None:
        raise ValueError("predict_prompt_rows: an MoE model's rows need `ffn` (predict_prefill's ffn_only)")
    width = (d + cfg.num_experts_per_tok * (d + cfg.moe_intermediate_size) + cfg.shared_expert_intermediate_size
             if cfg.is_moe else d + cfg.intermediate_size)
    layer = (per_layer + attention + (code(T * width) if code is not None else 0.0)
             + _projections(hw, dtype, mix, cfg.attention_weight_elements(), 2 if fused else 4, ws, T, batch_act))
    if not cfg.is_moe:
        layer += _projections(hw, dtype, mix, 3 * d * cfg.intermediate_size, 2 if fused else 3, ws, T, batch_act)
    hd = head_dtype or dtype
    head = _gemv(hw, hd, d * cfg.vocab_size * op_time.bytes_per_element(hd), working_set=ws, in_step=native_step(hw),
                 rows=max(1, min(T, logit_rows)))
    return cfg.num_hidden_layers * layer + (ffn(T) if cfg.is_moe else 0.0) + head + per_step
