"""Latency goal, MoE model, with a GPU: Fiddler's placement and dispatch (ALGORITHMS.md 2).

Non-expert weights, the KV cache of one `context_tokens` sequence and the expert staging ring go
to the GPU; the GPU bytes left hold whole experts, resident or as cache slots, whichever split the
routing-trace simulation predicts faster (residents win ties: they cost no fill copies); the rest
live in (pinned) CPU RAM, then on disk. Each step's missing experts are split between CPU compute
and H2D copies (runtime/dispatcher.split_misses) with the latency model priced from the profile
(planner/fiddler.py), which is also what the runtime dispatches with.
"""

from __future__ import annotations

import math
from dataclasses import asdict

from tiered.checkpoint.model_config import ModelConfig
from tiered.errors import BudgetError
from tiered.hardware.budget import format_bytes
from tiered.hardware.profile import HardwareProfile
from tiered.memory import sizes
from tiered.planner.common import (ExpertChoices, attention_time, expert_tiers, head_time, place_experts,
                                   popularity_note)
from tiered.planner.plan import LayerPlan, Plan


def plan_moe_latency(plan: Plan, cfg: ModelConfig, profile: HardwareProfile, gpu: int, cpu: int | None,
                     experts: ExpertChoices = ExpertChoices()) -> Plan:
    """Fill `plan` for an MoE model on a GPU of `gpu` bytes and `cpu` bytes of RAM (None = unlimited).

    Raises:
        BudgetError: the GPU cannot hold the non-expert weights, KV cache and staging buffers.
    """
    from tiered.planner.fiddler import ExpertLatency, ExpertShape
    from tiered.runtime.dispatcher import CPU, miss_makespan, split_misses

    fmt, efmt = plan.dtypes["weights"], plan.dtypes["experts"]
    E, k = cfg.num_experts, cfg.num_experts_per_tok
    moe_layers = [i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i)]
    ctx = plan.prompt_tokens + plan.gen_tokens
    non_expert = sizes.weight_bytes(cfg, fmt, sizes.is_expert_param) + sizes.rotary_bytes(cfg, plan.context_tokens)
    kv = sizes.kv_cache_bytes(cfg, 1, plan.context_tokens, plan.dtypes["kv_cache"])
    eb = sizes.expert_bytes(cfg, efmt)
    staging = plan.staging_buffers * eb
    fixed = non_expert + kv + staging + plan.workspace_bytes
    if fixed > gpu:
        raise BudgetError(f"GPU budget {format_bytes(gpu)} cannot hold the non-expert weights "
                          f"({format_bytes(non_expert)}), KV cache ({format_bytes(kv)}), activation workspace "
                          f"({format_bytes(plan.workspace_bytes)}) and staging ({format_bytes(staging)})",
                          f"raise --gpu-mem by {format_bytes(fixed - gpu)}")
    cpu_room = (cpu - plan.staging_buffers * eb) if cpu is not None else None  # host staging ring
    if cpu_room is not None and cpu_room < 0:
        raise BudgetError(f"CPU budget {format_bytes(cpu)} cannot hold the {plan.staging_buffers} host staging buffers "
                          f"({format_bytes(staging)})", f"raise --cpu-mem by {format_bytes(-cpu_room)}")
    lat_model = ExpertLatency(profile, ExpertShape.from_config(cfg), efmt, efmt)
    plan.dispatch_latency = asdict(lat_model.latency_model())
    plan.dispatch_threshold_tokens = lat_model.threshold()
    lat = plan.latency_model()
    disk = profile.models.get("disk/read_cold")
    t_disk = disk(eb) if disk is not None else 0.0
    attn_dec = attention_time(cfg, profile, "gpu", fmt, 1, ctx, plan.dtypes["kv_cache"])
    attn_pre = attention_time(cfg, profile, "gpu", fmt, plan.prompt_tokens, plan.prompt_tokens, plan.dtypes["kv_cache"])
    head = head_time(cfg, profile, "gpu", fmt)

    def layer_time(tokens: int, h: float, d_share: float) -> float:
        # Expected over how many of the step's active experts miss the GPU (binomial in the miss share
        # 1 - h); each miss set is split between CPU and link (split_misses), hits run on the GPU meanwhile.
        active = min(E, max(k, math.ceil(E * (1 - (1 - k / E) ** tokens))))
        s = max(1, math.ceil(tokens * k / active))
        total = 0.0
        for m in range(active + 1):
            p = math.comb(active, m) * (1 - h) ** m * h ** (active - m)
            if p < 1e-9:
                continue
            hits = (active - m) * lat.gpu_lat(s)
            paths = split_misses([s] * m, lat, eb, plan.dispatch_mode)
            copied = sum(1 for x in paths if x != CPU)
            gpu_side = hits + copied * lat.gpu_lat(s)
            total += p * (max(gpu_side, miss_makespan([s] * m, lat, eb, plan.dispatch_mode)) + m * d_share * t_disk)
        return total

    def predict(cache_slots: int | None, max_resident: int | None):
        choice = ExpertChoices(experts.popularity, cache_slots, max_resident)
        placement, hits = place_experts(plan, cfg, moe_layers, eb, gpu - fixed, cpu_room, choice)
        rows = []
        for i in moe_layers:
            g, c, d = (placement.count(t, i) for t in ("fast", "cpu", "disk"))
            res, cached = hits.rates(i)
            d_share = d / max(c + d, 1)
            rows.append((i, g, c, d, layer_time(1, res + cached, d_share) + attn_dec,
                         layer_time(plan.prompt_tokens, g / E, d_share) + attn_pre))
        return sum(r[4] for r in rows) + head, placement, hits, rows

    # candidates: the cache the user fixed, else none / one per active expert / one layer's worth
    cands = [experts.cache_slots] if experts.cache_slots is not None else sorted({0, k, E})
    scored, error = [], None
    for c in cands:
        try:
            scored.append((predict(c, experts.max_resident), c))
        except BudgetError as e:
            error = e
    if not scored:
        raise error
    (step, placement, hits, rows), _ = min(scored, key=lambda r: (round(r[0][0], 6), r[1]))
    plan.expert_cache_slots, plan.expected_hit_rate = placement.cache_slots, placement.expected_hit_rate
    for i, g, c, d, dec, pre in rows:
        plan.layers.append(LayerPlan(i, "moe", efmt, experts_gpu=g, experts_cpu=c, experts_disk=d,
                                     r_cc=0.0, r_cg=0.0, r_gg=g / E, decode_s=dec, prefill_s=pre,
                                     expert_tiers=expert_tiers(placement, i, E)))
    plan.predicted_decode_tokens_per_s = 1.0 / step
    plan.predicted_ttft_s = sum(l.prefill_s for l in plan.layers) + head
    n_gpu, n_cpu, n_disk = (placement.count(t) for t in ("fast", "cpu", "disk"))
    plan.memory = {"gpu": fixed + (n_gpu + placement.cache_slots) * eb,
                   "cpu": (n_cpu + plan.staging_buffers) * eb, "disk": n_disk * eb}
    h = hits.fast_share()
    how = {"balanced": "are split between CPU compute and H2D copies",
           "copy": "are copied to the GPU", "cpu": "run on the CPU"}[plan.dispatch_mode]
    total = len(moe_layers) * E
    plan.binding = (f"GPU memory: {n_gpu}/{total} experts resident and {placement.cache_slots} cache slots "
                    f"(hit rate {h:.0%}) beside the non-expert weights and KV cache; "
                    f"each decode step's missing experts {how} (s* = {plan.dispatch_threshold_tokens:.1f} tokens)"
                    + (f"; {n_disk} experts do not fit in CPU RAM and are read from disk" if n_disk else ""))
    popularity_note(plan, experts.popularity)
    return plan
