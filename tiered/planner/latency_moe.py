"""Latency goal, MoE model, with a GPU: Fiddler's placement and dispatch (ALGORITHMS.md 2).

Non-expert weights, the KV cache of one `context_tokens` sequence and the expert staging ring go
to the GPU; the GPU bytes left hold whole experts, resident or as cache slots, whichever split the
routing-trace simulation predicts faster (residents win ties: they cost no fill copies); the rest
live in (pinned) CPU RAM, then on disk. Each step's missing experts are split between CPU compute
and H2D copies (runtime/dispatcher.split_misses) with the latency model priced from the profile
(planner/fiddler.py), which is also what the runtime dispatches with.

A layer's time is what runtime/moe_runner.py does, priced from profile keys (`LayerCosts`):
    front    the model code's host cost per layer (runtime/decode_step, op_time.step_overhead)
             against the GPU's attention (the host issues while the GPU runs)
    sync     the layer's one host sync: the per-expert token counts come back (a small D2H)
    experts  three workers at once: the compute stream (hits, then each copied expert once its
             weights land), the copy stream (per copy: a task hop + the expert's H2D), the calling
             thread (CPU-path experts: activations D2H once, each expert, its output H2D); CPU
             expert reads and H2D copies share the host's memory bandwidth (memory/bandwidth/cpu)
    combine  the runner's own kernels: grouping the routing slots per layer, gathering and
             index_add per expert (launch/gpu each)
    extra    in decode, a layer with CPU-path experts: the host time beyond those terms that a tiny
             MoE's such layers took (runtime/moe_cpu_layer_gpu/bf16, where profiled: LayerCosts.of)
A layer whose every expert is resident at full precision is priced as the runtime runs it instead:
grouped GEMMs over its stacked experts with no sync (runtime/grouped_experts.py), its launches free
inside the whole-step CUDA graph the engine then captures.
A decode step adds the per-step host cost, the lm_head and the logits' D2H. Cache hits are the
routing-trace simulation's with the runtime's fill rule: only copied misses claim a slot.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass


from tiered.checkpoint.model_config import ModelConfig
from tiered.errors import BudgetError
from tiered.hardware import op_time
from tiered.hardware.budget import format_bytes
from tiered.hardware.profile import HardwareProfile
from tiered.memory import sizes
from tiered.planner.common import (ExpertChoices, attention_time, expert_tiers, fastest_expert_choice, head_time,
                                   place_experts, popularity_note)
from tiered.planner.placement import FAST
from tiered.planner.plan import LayerPlan, Plan

# Kernels runtime/moe_runner.TieredExperts launches besides the experts' own (counted in its code):
RUNNER_LAYER_KERNELS = 5  # flatten, argsort, bincount, token = order // k, slot = order % k (+ zeros_like below)
RUNNER_EXPERT_KERNELS = 4  # x[tok] gather, topk_weight[tok, slot] gather, y * weight, out.index_add_
# runtime/grouped_experts.grouped_experts_forward's launches besides its 3 grouped GEMMs (top-2): argsort,
# zeros, scatter_add_, cumsum, gather, silu, mul, empty + index_put, sort, 2 gathers, 2 multiplies, add
GROUPED_KERNELS = 14


@dataclass(frozen=True)
class LayerCosts:
    """Fixed costs of one MoE layer's expert phase on this machine [s], from profile keys (a sliced dense
    layer's host round trip takes the same: latency_dense.sliced_layer_syncs)."""

    task: float  # a task's hop to a stream worker and back (runtime/task)
    launch: float  # one kernel launch (launch/gpu)
    sync: float  # the layer's host sync: a small D2H of the token counts (copy/d2h_pageable)
    copy_alpha: float  # per H2D call (copy/h2d_pinned alpha); an expert is `matrices` calls
    copy_beta: float  # per byte
    d2h: object  # copy/d2h_pageable model (activations to the host) or None
    h2d: object  # copy/h2d_pageable model (a CPU expert's output back) or None
    host_read_beta: float  # host memory per byte read (memory/bandwidth/cpu), shared by CPU experts and DMA
    cpu_layer_extra: float = 0.0  # a decode layer with CPU-path experts: host time the terms above leave out

    @classmethod
    def of(cls, profile: HardwareProfile) -> "LayerCosts":
        """The costs from `profile`'s keys. cpu_layer_extra: where the profile timed a tiny MoE's decode
        layers with every expert on the CPU path (runtime/moe_cpu_layer_gpu/bf16, CUDA), what that layer
        took beyond this model's price for it (the model code's per-layer cost, the sync, the runner's
        launches, the activations' D2H and each CPU expert's output H2D); 0 without the key."""
        m = profile.models
        task = op_time.task_overhead(profile)
        d2h, h2d, pinned = m.get("copy/d2h_pageable"), m.get("copy/h2d_pageable"), profile.model("copy/h2d_pinned")
        bw = m.get("memory/bandwidth/cpu")
        launch, sync = op_time.launch_time(profile, "gpu"), d2h.alpha if d2h is not None else 0.0
        extra, probe = 0.0, m.get("runtime/moe_cpu_layer_gpu/bf16")
        if probe is not None:  # measured with the engine's default (piecewise) graphs, its experts ~free
            k = op_time.MOE_PROBE_TOP_K
            _, per_layer = op_time.step_overhead(profile, "bf16", "gpu", graphed="piecewise")
            priced = (per_layer + 2 * sync  # the layer's host sync and its activations' D2H, both small D2H
                      + (RUNNER_LAYER_KERNELS + 1 + k * RUNNER_EXPERT_KERNELS) * launch
                      + k * (h2d.alpha if h2d is not None else 0.0))
            extra = max(0.0, probe.beta - priced)
        return cls(task, launch, sync, pinned.alpha, pinned.beta, d2h, h2d, bw.beta if bw is not None else 0.0, extra)


def prompt_experts(shares, resident: set[int], tokens: int, k: int) -> tuple[int, float]:
    """A prompt's active experts in one layer and the share of them resident on the GPU, when each of its
    `tokens` tokens picks expert e with probability min(1, k p_e), p_e = shares[e] / sum(shares) (a routing
    profile's tokens routed per expert, planner/placement.load_popularity). Expected active experts
    sum_e 1 - (1 - q_e)^tokens, rounded (at least k); resident share over them likewise.

    Without a profile the planner draws routing uniformly (q_e = k / E): a 512-token prompt then touches
    every expert. On the H100 (2026-11-26) the dummy weights' prompts touched ~2 experts a layer, the 7 the
    profile made resident: 0.051 s measured where the uniform draw priced 0.103."""
    from tiered.planner.cpu_predict import prompt_activity

    used = prompt_activity(shares, tokens, k)
    total = float(used.sum())
    on_fast = float(sum(used[e] for e in resident))
    return max(k, round(total)), (on_fast / total if total > 0 else 0.0)


def plan_moe_latency(plan: Plan, cfg: ModelConfig, profile: HardwareProfile, gpu: int, cpu: int | None,
                     experts: ExpertChoices = ExpertChoices(), graphs: bool = False) -> Plan:
    """Fill `plan` for an MoE model on a GPU of `gpu` bytes and `cpu` bytes of RAM (None = unlimited).
    `graphs`: the engine may graph decode steps (make.settle_gpu_decode): decode is priced with the
    graphed step's host cost, the whole step's when every expert is resident and groupable.

    Raises:
        BudgetError: the GPU cannot hold the non-expert weights, KV cache and staging buffers.
    """
    from tiered.planner.fiddler import ExpertLatency, ExpertShape, step_expert_bytes
    from tiered.runtime.dispatcher import BALANCED_MODES, COPY, CPU, PRICED, SPLIT, dispatch_misses, split_misses

    from tiered.quant.experts import pricing_precision, token_activations

    fmt, efmt = plan.dtypes["weights"], pricing_precision(plan.dtypes["experts"])
    E, k = cfg.num_experts, cfg.num_experts_per_tok
    moe_layers = [i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i)]
    ctx = plan.prompt_tokens + plan.gen_tokens
    non_expert = sizes.weight_bytes(cfg, fmt, sizes.is_expert_param) + sizes.rotary_bytes(cfg, plan.context_tokens)
    kv = sizes.kv_cache_bytes(cfg, plan.kv_slots, plan.context_tokens, plan.dtypes["kv_cache"])
    eb = sizes.expert_bytes(cfg, plan.dtypes["experts"])
    staging = plan.staging_buffers * eb
    fixed = non_expert + kv + staging + plan.workspace_bytes
    if fixed > gpu:
        raise BudgetError(f"GPU budget {format_bytes(gpu)} cannot hold the non-expert weights "
                          f"({format_bytes(non_expert)}), KV cache ({format_bytes(kv)}), workspace for activations "
                          f"and cuBLAS ({format_bytes(plan.workspace_bytes)}) and staging ({format_bytes(staging)})",
                          f"raise --gpu-mem by {format_bytes(fixed - gpu)}")
    cpu_room = (cpu - plan.staging_buffers * eb) if cpu is not None else None  # host staging ring
    if cpu_room is not None and cpu_room < 0:
        raise BudgetError(f"CPU budget {format_bytes(cpu)} cannot hold the {plan.staging_buffers} host staging buffers "
                          f"({format_bytes(staging)})", f"raise --cpu-mem by {format_bytes(-cpu_room)}")
    expert = ExpertLatency(profile, ExpertShape.from_config(cfg), efmt, efmt,
                           token_activations(plan.dtypes["experts"], plan.expert_act),
                           working_set=step_expert_bytes(cfg, efmt))
    plan.dispatch_latency = asdict(expert.latency_model())
    plan.dispatch_threshold_tokens = expert.threshold()
    lat = plan.latency_model()  # what the runtime splits misses with; times below are the exact sides
    disk = profile.models.get("disk/read_cold")
    t_disk = disk(eb) if disk is not None else 0.0
    costs = LayerCosts.of(profile)
    # a miss can be split by rows between the CPU and the link (runtime: dense experts in RAM, one
    # precision, and only in a layer none of whose misses is read from disk: expert_phase)
    splittable = plan.experts_splittable()
    # the model code's host cost per layer: decode's graphed when the engine graphs it (piecewise;
    # a whole-step graph's in grouped_layer_time), prefill's eager
    per_step_decode, per_layer_decode = op_time.step_overhead(profile, fmt, "gpu",
                                                              graphed="piecewise" if graphs else None)
    per_step_prefill, per_layer_prefill = op_time.step_overhead(profile, fmt, "gpu")
    per_step_whole, per_layer_whole = op_time.step_overhead(profile, fmt, "gpu", graphed="whole")
    act_bpe = sizes.bytes_per_element(sizes.kv_compute_format(plan.dtypes["kv_cache"]))  # activations: 16-bit, fp32 with fp32 weights
    matrices = expert.shape.matrices
    attn_dec = attention_time(cfg, profile, "gpu", fmt, 1, ctx, plan.dtypes["kv_cache"], graphed=graphs)
    attn_pre = attention_time(cfg, profile, "gpu", fmt, plan.prompt_tokens, plan.prompt_tokens, plan.dtypes["kv_cache"])
    head = head_time(cfg, profile, "gpu", fmt)
    logits = costs.d2h(4 * cfg.vocab_size) if costs.d2h is not None else 0.0
    step_fixed = head + logits  # plus the per-step cost of the step's kind (eager prefill, graphed decode)

    def expert_phase(tokens: int, s: int, hits: int, misses: int, d_share: float) -> float:
        """Seconds from the layer's sync to its last expert's output, `hits` + `misses` active experts
        with s tokens each, `d_share` of the misses read from disk first. The runner splits a miss
        only when none of the layer's misses is on disk: expected over that chance."""
        if not (splittable and misses and d_share > 0):
            return dispatched_phase(tokens, s, hits, misses, d_share, splittable)
        in_ram = (1 - d_share) ** misses
        return (in_ram * dispatched_phase(tokens, s, hits, misses, 0.0, True)
                + (1 - in_ram) * dispatched_phase(tokens, s, hits, misses, d_share / (1 - in_ram), False))

    def dispatched_phase(tokens: int, s: int, hits: int, misses: int, d_share: float, can_split: bool) -> float:
        dispatch = dispatch_misses([s] * misses, lat, eb, plan.dispatch_mode, splittable=can_split)
        paths = dispatch.paths
        gpu_task = costs.task + expert.gpu_lat(s)
        compute = hits * gpu_task
        to_host = costs.d2h(tokens * cfg.hidden_size * act_bpe) if costs.d2h is not None else 0.0
        if SPLIT in paths:  # a split keeps the CPU and the link busy together: the dispatcher's makespan
            misses_end = to_host + dispatch.seconds + misses * costs.task
            return max(compute, misses_end) + misses * d_share * t_disk
        n_cpu = sum(1 for p in paths if p == CPU)
        n_copy = misses - n_cpu
        link = n_copy * (costs.task + matrices * costs.copy_alpha + eb * costs.copy_beta)
        cpu_end = 0.0
        if n_cpu:
            out = costs.h2d(s * cfg.hidden_size * act_bpe) if costs.h2d is not None else 0.0
            experts_s = n_cpu * (expert.cpu_lat(s) + out)
            if n_copy:  # the CPU's experts and the copies both out of host memory at once (LatencyModel.together)
                experts_s, link = lat.together(experts_s, link)
            cpu_end = to_host + experts_s + (costs.cpu_layer_extra if tokens == 1 else 0.0)
        gpu_end = max(compute, link + gpu_task) if n_copy else compute
        shared = (n_cpu + n_copy) * eb * costs.host_read_beta if n_cpu and n_copy else 0.0
        return max(gpu_end, cpu_end, shared) + misses * d_share * t_disk

    def layer_time(tokens: int, h: float, d_share: float, attn: float, active: int | None = None) -> float:
        # Expected over how many of the step's active experts miss the GPU (binomial in the miss share 1 - h).
        # `active`: the step's active experts (prompt_experts, from a routing profile); None = i.i.d. routing
        if active is None:
            active = min(E, max(k, math.ceil(E * (1 - (1 - k / E) ** tokens))))
        s = max(1, math.ceil(tokens * k / active))
        per_layer = per_layer_decode if tokens == 1 else per_layer_prefill
        front = max(per_layer, attn) + costs.sync + RUNNER_LAYER_KERNELS * costs.launch
        combine = (1 + active * RUNNER_EXPERT_KERNELS) * costs.launch
        total = 0.0
        for m in range(active + 1):
            p = math.comb(active, m) * (1 - h) ** m * h ** (active - m)
            if p >= 1e-9:
                total += p * expert_phase(tokens, s, active - m, m, d_share)
        return front + total + combine

    def copied(tokens: list[int]) -> list[bool]:  # which misses take the copy path and fill a cache slot
        return [p == COPY for p in split_misses(tokens, lat, eb, plan.dispatch_mode, splittable=splittable)]

    # a layer whose every expert is resident at full precision runs grouped GEMMs over its stacked
    # experts with no host sync (moe_runner._grouped); with every layer so and graphs allowed, the
    # engine graphs the whole decode step (planner/auto: Plan.decode_graphs)
    groupable = plan.experts_groupable()
    popularity = experts.popularity if experts.popularity is not None and experts.popularity.sum() > 0 else None

    def grouped_layer_time(tokens: int, attn: float, graphed: bool) -> float:
        """A layer of stacked resident experts: the model code's per-layer cost (a graph replay's
        when graphed) or its attention, the grouped path's launches (none inside a graph), then the
        active experts' GEMMs (each expert's weights read once for its tokens)."""
        active = min(E, max(k, math.ceil(E * (1 - (1 - k / E) ** tokens))))
        s = max(1, math.ceil(tokens * k / active))
        launches = 0.0 if graphed else GROUPED_KERNELS * costs.launch
        per_layer = per_layer_whole if graphed else per_layer_decode if tokens == 1 else per_layer_prefill
        return max(per_layer, attn) + launches + active * expert.gpu_lat(s)

    def predict(choice: ExpertChoices):
        placement, hits = place_experts(plan, cfg, moe_layers, eb, gpu - fixed, cpu_room, choice, copied)
        graphed = groupable and graphs and placement.count("fast") == len(moe_layers) * E
        rows = []
        for i in moe_layers:
            g, c, d = (placement.count(t, i) for t in ("fast", "cpu", "disk"))
            res, cached = hits.rates(i)
            d_share = d / max(c + d, 1)
            if groupable and g == E:
                dec = grouped_layer_time(1, attn_dec, graphed)
                pre = grouped_layer_time(plan.prompt_tokens, attn_pre, False)
            else:
                dec = layer_time(1, res + cached, d_share, attn_dec)
                if popularity is not None:  # the prompt routes as the profile's tokens did
                    fast = {e for e in range(E) if placement.tiers.get((i, e)) == FAST}
                    active, h_pre = prompt_experts(popularity[i], fast, plan.prompt_tokens, k)
                    pre = layer_time(plan.prompt_tokens, h_pre, d_share, attn_pre, active)
                else:
                    pre = layer_time(plan.prompt_tokens, g / E, d_share, attn_pre)
            rows.append((i, g, c, d, dec, pre))
        step = sum(r[4] for r in rows) + step_fixed + (per_step_whole if graphed else per_step_decode)
        return step, (step, placement, hits, rows)

    step, placement, hits, rows = fastest_expert_choice(experts, E, k, predict, cache_fills=plan.dispatch_mode != "cpu")
    plan.expert_cache_slots, plan.expected_hit_rate = placement.cache_slots, placement.expected_hit_rate
    for i, g, c, d, dec, pre in rows:
        plan.layers.append(LayerPlan(i, "moe", efmt, experts_gpu=g, experts_cpu=c, experts_disk=d,
                                     r_cc=0.0, r_cg=0.0, r_gg=g / E, decode_s=dec, prefill_s=pre,
                                     expert_tiers=expert_tiers(placement, i, E)))
    plan.predicted_decode_tokens_per_s = 1.0 / step
    plan.predicted_ttft_s = sum(l.prefill_s for l in plan.layers) + step_fixed + per_step_prefill
    n_gpu, n_cpu, n_disk = (placement.count(t) for t in ("fast", "cpu", "disk"))
    plan.memory = {"gpu": fixed + (n_gpu + placement.cache_slots) * eb,
                   "cpu": (n_cpu + plan.staging_buffers) * eb, "disk": n_disk * eb}
    h = hits.fast_share()
    ways = {"balanced": "are split between CPU compute and H2D copies", "per-expert": "go where Fiddler's rule says",
            PRICED: "are split between CPU compute and H2D copies as the latency model prices them (no margins)",
            COPY: "are copied to the GPU", CPU: "run on the CPU", SPLIT: "are split by rows between the CPU and the link"}
    how = ways[plan.dispatch_mode]
    if plan.dispatch_mode in BALANCED_MODES:  # what the dispatch does with a decode step's 1..k one-token misses
        sides = {p for m in range(1, k + 1) for p in split_misses([1] * m, lat, eb, plan.dispatch_mode,
                                                                   splittable=splittable)}
        if len(sides) == 1:
            how = f"{ways[sides.pop()]}; a prompt's {ways[plan.dispatch_mode]}"
    total = len(moe_layers) * E
    plan.binding = (f"GPU memory: {n_gpu}/{total} experts resident and {placement.cache_slots} cache slots "
                    f"(hit rate {h:.0%}) beside the non-expert weights and KV cache; "
                    f"each decode step's missing experts {how} (s* = {plan.dispatch_threshold_tokens:.1f} tokens)"
                    + (f"; {n_disk} experts do not fit in CPU RAM and are read from disk" if n_disk else ""))
    popularity_note(plan, experts.popularity)
    return plan
