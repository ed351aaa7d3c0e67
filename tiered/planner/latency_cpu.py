"""Latency goal without a GPU: CPU RAM is the fast tier, disk the slow one (`run --accelerator none`).

Non-expert weights and the KV cache go to RAM; the RAM left holds whole experts (by popularity, else
in layer order), resident or as cache slots; the rest are read from disk per use. Decode time comes
from planner/cpu_predict.py with hit shares from the routing-trace simulation.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from tiered.checkpoint.model_config import ModelConfig
from tiered.errors import BudgetError
from tiered.hardware.budget import format_bytes
from tiered.hardware.profile import HardwareProfile
from tiered.memory import sizes
from tiered.planner.common import ExpertChoices, expert_tiers, fastest_expert_choice, place_experts, popularity_note
from tiered.planner.cpu_predict import chunk_spans
from tiered.planner.plan import LayerPlan, Plan


def plan_cpu_latency(plan: Plan, cfg: ModelConfig, profile: HardwareProfile, cpu: int | None,
                     experts: ExpertChoices = ExpertChoices(), embedding_bytes: int | None = None,
                     requests: Sequence[tuple[int, int]] | None = None, prefixes=None) -> Plan:
    """Fill `plan` for CPU + disk within `cpu` bytes of RAM (None = unlimited).

    Args:
        embedding_bytes: the token embedding's bytes where the one-copy mode keeps it in its file's
            blocks (make_plan), None = dense.
        requests: (prompt tokens, generated tokens) of each request of a known workload (make_plan's): their run
            at plan.kv_slots slots is replayed (planner/batch_sim.simulate_requests) into
            Plan.predicted_requests_tokens_per_s.
        prefixes: which of their prompts share how many leading tokens (batch_sim.PromptPrefixes): the replay
            reuses them as the server does; None: every prompt prefilled whole.

    Raises:
        BudgetError: RAM cannot hold the non-expert weights, KV cache and staging.
    """
    from tiered.planner.cpu_predict import native_step, predict_decode

    dtype = plan.precision  # what decode reads: the decode copies' format (int4/int8) or the weights'
    fmt = plan.dtypes["weights"]
    ctx = plan.prompt_tokens + plan.gen_tokens
    L = cfg.num_hidden_layers
    moe = [i for i in range(L) if cfg.is_moe and cfg.is_moe_layer(i)]
    held = fmt if plan.dense_copies else dtype  # one-copy mode: the decode copies are the weights
    mix = plan.precision_mix if not plan.dense_copies else None  # ... in their precisions, where they mix
    skip = sizes.is_expert_param if moe else None
    head = plan.dtypes.get("lm_head")
    if plan.dense_copies:  # the dense weights, and beside them the decode copies where there are any
        copies = plan.dtypes.get("decode") not in ("none", None)
        held_bytes = (sizes.weight_bytes(cfg, held, skip)
                      + (sizes.decode_copy_bytes(cfg, plan.precision_mix or {dtype: 1.0}, head, skip, dense=fmt)
                         if copies else 0)
                      # a bf16 engine's latent attention also holds its absorbed bf16 kernels
                      + (sizes.absorbed_bytes(cfg) if fmt == "bf16" else 0))
    else:
        held_bytes = sizes.one_copy_weight_bytes(cfg, fmt, mix or {dtype: 1.0}, skip, head, embedding_bytes)
    # a prompt longer than the workspace's tokens prefills chunk by chunk: its activations stay within it
    plan.prefill_chunk = sizes.CPU_PREFILL_TOKENS
    plan.workspace_bytes = sizes.cpu_workspace_bytes(cfg, fmt, plan.context_tokens, plan.kv_slots)
    fixed = (held_bytes
             + sizes.rotary_bytes(cfg, plan.context_tokens)
             + sizes.kv_cache_bytes(cfg, plan.kv_slots, plan.context_tokens, plan.dtypes["kv_cache"], plan.kv_advance())
             + plan.workspace_bytes)
    plan.kv_cache_tier = plan.attention_tier = "cpu"
    # a MoE model also needs its staging buffers for experts read from disk, whatever else fits
    eb = sizes.expert_bytes(cfg, plan.dtypes["experts"]) if moe else 0
    staging = plan.staging_buffers * eb
    if cpu is not None and fixed + staging > cpu:
        parts = [("the non-expert weights" if moe else "the weights")
                 + (" with their decode copies" if plan.dtypes.get("decode") not in ("none", None) else ""),
                 "the KV cache", "a prefill chunk's activations"] + (["expert staging buffers"] if moe else [])
        what = ", ".join(parts[:-1]) + " and " + parts[-1]
        raise BudgetError(f"CPU budget {format_bytes(cpu)} cannot hold {what} ({format_bytes(fixed + staging)})",
                          f"raise --cpu-mem by {format_bytes(fixed + staging - cpu)} or lower --max-context")
    hits = None
    memory = {"cpu": fixed}

    def predict(hits, batch: int = 1, context: int = ctx, bursts: bool = True, sequences: int | None = None):
        # bursts: LLM._burst, a lone sequence's (a server's too; batch 1 only)
        return predict_decode(cfg, profile, dtype, context=context, hits=hits, read_ahead=plan.read_ahead,
                              readers=max(2, plan.staging_buffers), experts_format=plan.dtypes["experts"] if moe else None,
                              head_dtype=plan.dtypes.get("lm_head"), expert_act=plan.expert_act,
                              mix=plan.precision_mix, kv_format=plan.dtypes["kv_cache"], batch=batch,
                              batch_act=plan.batch_act, bursts=bursts, sequences=sequences)
    if moe:
        E, k = cfg.num_experts, cfg.num_experts_per_tok
        room = float("inf") if cpu is None else cpu - fixed - staging
        def score(choice: ExpertChoices):  # on the routing-trace simulation's hit rates
            placement, hits = place_experts(plan, cfg, moe, eb, room, None, choice)
            return predict(hits)[1], (placement, hits)
        placement, hits = fastest_expert_choice(experts, E, k, score)
        plan.expert_cache_slots, plan.expected_hit_rate = placement.cache_slots, placement.expected_hit_rate
        total = placement.count("fast")
        memory = {"cpu": fixed + staging + (total + placement.cache_slots) * eb, "disk": (E * len(moe) - total) * eb}
    layers, step = predict(hits)
    for i, (attn, ffn) in enumerate(layers):
        lp = LayerPlan(i, "moe" if i in moe else "dense", dtype, r_cc=1.0, r_cg=0.0, r_gg=0.0, decode_s=attn + ffn)
        if i in moe:
            lp.experts_gpu, lp.experts_cpu, lp.experts_disk = 0, placement.count("fast", i), placement.count("disk", i)
            lp.expert_tiers = expert_tiers(placement, i, cfg.num_experts)
        plan.layers.append(lp)
    plan.predicted_decode_tokens_per_s = 1.0 / step
    if plan.kv_slots > 1:  # a server's full step: kv_slots sequences at the priced context each
        plan.predicted_batch_decode_tokens_per_s = plan.kv_slots / predict(hits, plan.kv_slots)[1]
    disk_share = 1.0 - hits.fast_share() if hits else 0.0

    plan.dtypes["prompt_attention"] = prompt_attention(plan, cfg, profile)
    plan.dtypes["prompt_ffn"] = prompt_ffn(plan, cfg, profile)
    rows, modules = prompt_paths(plan, cfg, profile, disk_share, experts.popularity if moe else None)
    if plan.mixed_rows and native_step(profile) and f"attn_rows/cpu/{plan.dtypes['kv_cache']}" in profile.models:
        # (a profile without the rows' attention key would price them at torch's attention: no comparison)
        plan.mixed_rows = priced_mixed_rows(plan.mixed_rows, plan.prefill_chunk, rows, modules)
    plan.predicted_ttft_s = prompt_time(plan, plan.prompt_tokens, rows, modules)
    if plan.kv_slots > 1:
        plan.predicted_block_prefill_s = block_prefill_time(plan, rows, modules)
    plan.memory = memory
    if requests:  # a known workload's lengths: its run replayed at kv_slots slots (planner/batch_sim)
        from tiered.planner.batch_sim import simulate_requests

        # whether admitted prompts share a prefix's prefill (auto.py settles it so for every plan; the replay's now)
        plan.shared_prefixes = plan.weights_stay_put()
        run = simulate_requests(requests, plan.kv_slots,
                                request_prices(plan, lambda n, c: predict(hits, n, c)[1], rows, modules),
                                prefixes=prefixes)
        plan.predicted_requests_tokens_per_s = run.tokens_per_s
    if plan.speculative_tokens and native_step(profile):
        # a step of one sequence's 1 + k rows: its cache read once for them
        plan.speculative_costs = speculative_costs(lambda B: predict(hits, B, bursts=False, sequences=1)[1],
                                                   plan.speculative_tokens)
    plan.binding = ("CPU memory bandwidth: every weight is read from RAM once per token" if not disk_share else
                    f"disk reads: {disk_share:.0%} of expert uses miss RAM (resident experts and "
                    f"{plan.expert_cache_slots} cache slots) and are read from disk")
    plan.notes.append("no GPU in this profile: CPU RAM is the fast tier, disk the slow one")
    if moe:
        popularity_note(plan, experts.popularity)
    return plan


def prompt_paths(plan: Plan, cfg: ModelConfig, profile: HardwareProfile, disk_share: float = 0.0, popularity=None):
    """(rows, modules): the seconds of a prompt of T tokens on each path a CPU `plan`'s engine may run it, priced by
    `profile` (prompt_time picks one). `rows(T, past=0, logit_rows=1, prompts=1)`: as rows of the native decode step
    (cpu_predict.predict_prompt_rows; an MoE model's FFNs as its prefill computes them, predict_prefill's ffn_only:
    the step's MoE block, or the block's module); `modules(T, chunk=Plan.prefill_chunk, ffn_only=False, prompts=1,
    past=0, lengths=None)`:
    through the modules' prefill (predict_prefill), with `disk_share` of the expert uses read from disk and `popularity` the
    expert profile's routing (float [L, E]; None: uniform)."""
    from tiered.planner.cpu_predict import predict_prefill, predict_prompt_rows

    dtype, fmt = plan.precision, plan.dtypes["weights"]
    held = fmt if plan.dense_copies else dtype  # one-copy mode: the decode copies are the weights
    moe = [i for i in range(cfg.num_hidden_layers) if cfg.is_moe and cfg.is_moe_layer(i)]
    # every expert in RAM at one precision: a layer's experts and weighted sum in one native call (moe_runner's
    # _all_on_fast under the native step's group_layers)
    native_moe = bool(moe) and plan.native_decode and not disk_share and plan.mixed_precision is None

    def modules(T: int, chunk: int = plan.prefill_chunk, ffn_only: bool = False, prompts: int = 1,
                past: int = 0, lengths=None) -> float:
        return predict_prefill(cfg, profile, held, T, moe or None, disk_share, experts_dtype=fmt, act_dtype=fmt,
                               experts_format=plan.dtypes["experts"], read_ahead=plan.read_ahead,
                               readers=max(2, plan.staging_buffers), batch_act=plan.batch_act,
                               popularity=popularity if moe else None, chunk=chunk, ffn_only=ffn_only,
                               attn_dtype=plan.dtypes.get("prompt_attention"), ffn_dtype=plan.dtypes.get("prompt_ffn"),
                               native_moe=native_moe, prompts=prompts, past=past, lengths=lengths)

    ffn = (lambda T: modules(T, 0, ffn_only=True)) if cfg.is_moe else None  # noqa: E731

    def rows(T: int, past: int = 0, logit_rows: int = 1, prompts: int = 1) -> float:
        return predict_prompt_rows(cfg, profile, dtype, T, plan.precision_mix, plan.dtypes["kv_cache"],
                                   plan.dtypes.get("lm_head"), plan.batch_act, past, ffn, logit_rows, prompts)

    return rows, modules


def speculative_costs(step, most: int) -> list[float]:
    """Plan.speculative_costs: the seconds of a decode step of one sequence's 1 + k rows (its last token and k
    draft tokens, each row's logits computed: LLM._forward_mixed) relative to one row, k = 0..`most`, priced as
    a batched decode step of 1 + k rows of one sequence (`step(B)` seconds: cpu_predict.predict_decode at batch B,
    sequences 1, no bursts), which runs the same rows through the same kernels (each row attending to its own
    positions of the one cache, read once for them; every row's logits): the weights stream once and each row past
    the first adds its multiply-adds and code at runtime/batch_rows' rate. On 2 Zen 4 cores (2026-12-04) SmolLM2's int4 step took 4.6 / 6.3 / 7.6 / 9.3 /
    10.5 ms at 1-5 rows (1.35 / 1.65 / 2.00 / 2.27x), an 8-layer Llama-3-8B-width Q4_K_M step 45 / 46 / 50 / 53 /
    62 ms (1.02-1.38x), where pricing the rows as a prompt's (predict_prompt_rows: decode_rows' slope for each row's
    multiply-adds, beside the stream) had given the latter 1.26-2.15x."""
    one = step(1)
    return [round(step(1 + k) / one, 4) for k in range(most + 1)]


def prompt_attention(plan: Plan, cfg: ModelConfig, profile: HardwareProfile) -> str:
    """The format a CPU plan's prompts attend in through the modules' prefill (Plan.dtypes["prompt_attention"],
    applied by models/layers.set_prompt_attention): the KV cache's bf16 where the activations are fp32 and the
    profile prices torch's bf16 attention (attn_prefill/cpu/bf16) below its fp32 one (attn_prefill/cpu/fp32) at
    the plan's prompt (up to one prefill chunk), else the activations' dtype. The keys and values are then read
    as cached, in bf16, instead of upcast, and only the queries and the softmax's probabilities are rounded
    further: on SmolLM2's default engine over 1024 tokens of prose the mean next-token KL to the lossless
    weights went 0.00179 -> 0.00183 nats (the int4 decode copies and the bf16 cache make the rest), and its
    512 / 1024-token prompts took 161 / 325 ms against 206 / 441 on 2 Sapphire Rapids cores (AMX), where
    torch's fp32 flash attention ran ~0.14 TFLOP/s (2026-12-02). On AVX2 (no bf16 compute) the bf16 key is the
    slower and fp32 stays. Latent attention (models/deepseek) attends in its own code: the activations'."""
    act, kv = plan.dtypes["weights"], plan.dtypes["kv_cache"]
    keys = [f"attn_prefill/cpu/{d}" for d in (act, kv)]
    if act != "fp32" or kv != "bf16" or cfg.is_mla or not all(k in profile.models for k in keys):
        return act
    from tiered.hardware import op_time

    T = min(plan.prompt_tokens, plan.prefill_chunk or plan.prompt_tokens)
    macs = op_time.prefill_attention_pairs(T) * cfg.attention_macs_per_pair(False)
    fp32, bf16 = (op_time.prefill_attention_time(profile, "cpu", d, macs) for d in (act, kv))
    return kv if bf16 < fp32 else act


def prompt_ffn(plan: Plan, cfg: ModelConfig, profile: HardwareProfile) -> str:
    """The format a CPU plan's prompts run their dense FFNs in between the projections (Plan.dtypes["prompt_ffn"],
    applied by models/layers.set_prompt_ffn): bf16 where the projections are one-copy int4 weights (the plan's
    precision int4 without dense copies) whose prompt calls past the kernel's rows dequantize for bf16 GEMMs on
    the profiled machine's kernels (quant/int4.DEQUANTIZE_DTYPE by its ISA: AVX-512; dequantize_rows not
    "never") under fp32 activations, else the activations' dtype. The prompt's x is then cast to bf16 once and
    gate, up, their SiLU product and down stay in bf16 instead of round-tripping fp32 between the GEMMs: SmolLM2's
    256 / 512 / 1024-token prompts 121.5 -> 118.3 / 200.8 -> 188.0 / 460.7 -> 413.4 ms on 2 Sapphire Rapids
    cores, the mean next-token KL to an fp32-GEMM reference over 512 tokens of prose 0.00135 -> 0.00139 nats
    (2026-12-02). predict_prefill prices that intermediate at runtime/prefill_code/bf16's slope. MoE layers'
    experts run their own code (an MoE model's dense layers, where it has any, follow this)."""
    act = plan.dtypes["weights"]
    layers = range(cfg.num_hidden_layers)
    if act != "fp32" or plan.precision != "int4" or plan.dense_copies or \
            (cfg.is_moe and all(cfg.is_moe_layer(i) for i in layers)):
        return act
    from tiered.planner.cpu_predict import int4_kernel_rows, kernel_isa
    from tiered.quant.int4 import DEQUANTIZE_DTYPE

    if DEQUANTIZE_DTYPE.get(kernel_isa(profile)) != torch.bfloat16 or \
            int4_kernel_rows(profile, plan.batch_act) == math.inf:  # (no dequantizing ISA, or never past the kernel)
        return act
    return "bf16"


def prompt_time(plan: Plan, tokens: int, rows, modules, past: int = 0) -> float:
    """Seconds of a `tokens`-token prompt on the path `plan`'s engine runs it (LLM.step, LLM._prefill): within
    Plan.most_prompt_rows as rows of the native decode step (`rows(T, past)`: cpu_predict.predict_prompt_rows);
    past the chunk, chunk by chunk, each as rows where Plan.chunks_as_rows; else through the modules' prefill
    (`modules(T)`: predict_prefill, chunks and all). `past`: positions the cache holds before them (a reused
    prefix), which they attend to too."""
    if tokens <= plan.most_prompt_rows():
        return rows(tokens, past)
    if plan.chunks_as_rows():
        return sum(rows(n, past + p) for n, p in chunk_spans(tokens, plan.prefill_chunk))
    return modules(tokens, past=past)


def block_prefill_groups(plan: Plan) -> tuple[list[int], bool]:
    """How the engine prefills plan.kv_slots (B) prompts of plan.prompt_tokens (P) admitted together
    (LLM._prefill_groups): ([prompts in each group], as rows). Where whole chunks run as rows (Plan.chunks_as_rows),
    native steps of at most Plan.most_prompt_rows rows each; else forwards of prompts packed within the prefill
    chunk's tokens (models/layers.build_packed_metadata). Both in admission order (scheduler.rows_groups); a prompt
    past a group's tokens is a group of its own."""
    B, P = plan.kv_slots, max(1, plan.prompt_tokens)
    # (the engine bounds a packed forward by the prefill chunk, the tokens its workspace holds: sizes.cpu_prefill_tokens)
    most = plan.most_prompt_rows() if plan.chunks_as_rows() else plan.prefill_chunk or plan.context_tokens
    g = max(1, most // P)
    return [g] * (B // g) + ([B % g] if B % g else []), plan.chunks_as_rows()


def block_prefill_time(plan: Plan, rows, modules) -> float:
    """Seconds to prefill plan.kv_slots prompts of plan.prompt_tokens (P) admitted together (the throughput goal's
    block, planner/throughput.block_throughput) in the engine's groups (block_prefill_groups): a group of g prompts
    as one step of g P rows (`rows(T, prompts=g)`) or one packed forward (`modules(T, 0, prompts=g)`), a lone prompt
    as prompt_time prices it. A group streams the weights, and reads and runs each active expert, once for all its
    prompts: 16 prompts of 64 tokens of the 8-layer Qwen3-30B-A3B-width Q4_0 file with 766 of its 1024 experts on
    disk prefilled in 5.1 s together, where 16 times one prompt's TTFT priced 40.6 s (2 Zen 4 cores, 2026-12-04)."""
    groups, as_rows = block_prefill_groups(plan)
    P = max(1, plan.prompt_tokens)
    prices: dict[int, float] = {}
    for g in set(groups):
        prices[g] = (prompt_time(plan, P, rows, modules) if g == 1 else
                     rows(g * P, prompts=g) if as_rows else modules(g * P, 0, prompts=g))
    return sum(prices[g] for g in groups)


def request_prices(plan: Plan, decode, rows, modules):
    """batch_sim.StepPrices of a CPU `plan`: `decode(n, c)` seconds of a step of n sequences at c cached positions
    (cpu_predict.predict_decode), `rows` and `modules` prompt_paths'. A prompt prefilled on its own runs as
    prompt_time prices it where whole chunks run as rows (Plan.chunks_as_rows); else through the modules' prefill
    (LLM._prefill: a prompt that did not join a decode step's rows), chunk by chunk past the prefill chunk."""
    from tiered.planner.batch_sim import StepPrices

    as_rows = plan.chunks_as_rows()
    return StepPrices(
        decode=decode, rows=lambda T, k, past=0: rows(T, past, prompts=k),
        alone=(lambda T, past=0: prompt_time(plan, T, rows, modules, past)) if as_rows else
        (lambda T, past=0: modules(T, past=past)),
        packed=lambda lengths, past=0: modules(sum(lengths), 0, prompts=len(lengths), past=past, lengths=lengths),
        most_rows=plan.most_prompt_rows(), chunks_as_rows=as_rows,
        group_tokens=plan.prefill_chunk or plan.context_tokens, shared_prefixes=plan.shared_prefixes)


# Prompt lengths past the measured mixed rows (planner/auto.MIXED_ROWS) where a plan prices both of a prompt's paths.
# 128 and 160: past AVX-512's floor of 96 the first length had been 192, where SmolLM2's two paths run within 5% of
# each other; a quick profile of the 2-core AMX VM priced its rows 4% slower there (104 against 100 ms) and left
# every prompt of 97-191 tokens to the modules. Measured there (2026-12-02, medians of 5, alternated), rows against
# modules: 69 / 79 / 104 / 144 / 231 against 95 / 100 / 109 / 130 / 168 ms at 128 / 160 / 192 / 256 / 384 tokens
# (the rows priced within 2%, the modules 8-11% fast by that quick profile, 14-18% slow by a full one)
PRICED_MIXED_ROWS = (128, 160, 192, 256, 384, 512, 768, 1024)


def priced_mixed_rows(floor: int, chunk: int, rows, modules) -> int:
    """Plan.mixed_rows extended past `floor` (planner/auto.mixed_rows: where the ISA's measurements found rows of the
    native step winning) to the longest of PRICED_MIXED_ROWS within `chunk` (Plan.prefill_chunk; 0 none) up to
    which each length's prompt is priced no slower as rows (`rows(T)` seconds: cpu_predict.predict_prompt_rows)
    than through the modules' prefill (`modules(T)`: predict_prefill). Both paths run the same int4 kernels where
    prompt rows never dequantize; the rows' attention (the native step's, attn_rows) and layer code (C++) against
    torch's attention (attn_prefill) and the modules' code (runtime/prefill_code) decide. On 2 Zen 5 cores
    SmolLM2's prompts as rows took 0.67-0.74x the prefill's time at 256-1024 tokens (87 / 194 / 482 ms against
    125 / 291 / 661 at 256 / 512 / 1024, 2026-12-01), where the table stopped at 256 for AVX2's sake (its rows
    had lost from 256, 1243 against 1082 ms at 512, when its modules' prefill dequantized). On 2 Zen 3 cores
    (AVX2, prompt rows never dequantized by the kernel tuning; 2026-12-01, alternated) the rows took 0.75-0.93x
    the modules' time at 192-1024 tokens (244 against 321 ms at 256, 702 against 752 at 512, 1371 against 1520
    at 1024), priced 0.85-0.88x: the plan extends its rows to 1024 there too."""
    most = floor
    for T in PRICED_MIXED_ROWS:
        if T <= floor:
            continue
        if (chunk and T > chunk) or rows(T) > modules(T):
            break
        most = T
    return most
