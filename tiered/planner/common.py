"""What the goal modules share: the expert choices a user can fix, attention and lm_head times, and
the expert placement with the hit rates its resident set and cache get on a routing trace."""

from __future__ import annotations

from dataclasses import dataclass

from tiered.checkpoint.model_config import ModelConfig
from tiered.errors import BudgetError
from tiered.hardware import op_time
from tiered.hardware.budget import format_bytes
from tiered.hardware.profile import HardwareProfile
from tiered.memory import sizes
from tiered.planner.plan import Plan


@dataclass(frozen=True)
class ExpertChoices:
    """What shapes an expert placement besides bytes: popularity float [L, E] (None = uniform),
    and the user's fixed cache slots / resident cap (None = the planner chooses)."""

    popularity: object = None
    cache_slots: int | None = None
    max_resident: int | None = None


def attention_time(cfg: ModelConfig, profile: HardwareProfile, device: str, precision: str, tokens: int,
                   context: int, kv_format: str = "bf16", graphed: bool = False) -> float:
    """One layer's attention projections + attention over `context` cached positions [s]: decode's
    (tokens = 1) at the attn key's rate over the KV cache; a prompt's causal, each of its tokens
    over the context - tokens positions before it and the prompt up to itself, at attn_prefill's
    rate (op_time.prefill_attention_time). The decode key over every (query, key) pair had priced
    a 512-token prompt's attention at 1.7 ms a layer on the H100, 85% of its layer.
    `graphed`: a decode step's attention replayed in a CUDA graph: where the profile timed GEMVs in
    a graph (op_time.graph_gemv), its projections at that rate and no launches."""
    w = cfg.attention_weight_elements()
    graphed = graphed and tokens == 1 and op_time.graph_gemv(profile, device, precision) is not None
    proj = op_time.gemm_time(profile, device, precision, tokens * w, w * sizes.bytes_per_element(precision), calls=4,
                             graphed=graphed)
    if tokens > 1:  # a prompt: causal attention, its tokens after context - tokens cached ones
        macs = cfg.attention_macs_per_pair(False) * (tokens * (context - tokens) + tokens * (tokens + 1) / 2)
        return proj + op_time.prefill_attention_time(profile, device, precision, macs) + 6 * op_time.launch_time(profile, device)
    macs = tokens * context * cfg.attention_macs_per_pair(True)
    kv_layer = sizes.kv_cache_bytes(cfg, 1, context, kv_format) / cfg.num_hidden_layers
    if kv_format == "int8":  # the modules dequantize the layer's cache (KVCache.update): written and read again
        kv_layer += 2 * sizes.kv_cache_bytes(cfg, 1, context, "bf16") / cfg.num_hidden_layers
    attn = op_time.attention_time(profile, device, precision, macs, kv_layer)
    return proj + attn + (0 if graphed else 6) * op_time.launch_time(profile, device)


def head_time(cfg: ModelConfig, profile: HardwareProfile, device: str, precision: str, graphed: bool = False) -> float:
    """The lm_head projection of one token [s] (`graphed`: inside a whole-step CUDA graph, op_time.gemm_time)."""
    n = cfg.hidden_size * cfg.vocab_size
    return op_time.gemm_time(profile, device, precision, n, n * sizes.bytes_per_element(precision), graphed=graphed)


def place_experts(plan: Plan, cfg: ModelConfig, moe_layers: list[int], expert_bytes: int, fast_free: float,
                  cpu_free: float | None, experts: ExpertChoices, copied=None):
    """The expert placement (planner/placement.py: Fiddler §3.4 with the expert cache carved out
    first) on the plan's byte counts, and the hit shares its resident set and cache get on a routing
    trace drawn from the popularity (cpu_predict.simulate_hits; `copied` says which misses fill the
    cache, see there). Writes the placement into the plan (each MoE layer's expert_tiers is filled
    by the caller from the returned placement; the cache slots and expert bytes here).

    Returns:
        (ExpertPlacement, HitStats).
    Raises:
        BudgetError: the fast tier has no room left for experts at all.
    """
    from tiered.planner.cpu_predict import routing_trace, simulate_hits
    from tiered.planner.placement import plan_expert_placement

    if fast_free < 0:
        raise BudgetError(f"the {plan.fast_tier} budget is {format_bytes(-fast_free)} short of the non-expert "
                          "weights, KV cache and staging buffers", f"raise --{plan.fast_tier}-mem or lower --max-context")
    E, k = cfg.num_experts, cfg.num_experts_per_tok
    placement = plan_expert_placement(moe_layers, E, int(expert_bytes), fast_free, cpu_free, experts.popularity,
                                      cache_slots=experts.cache_slots, max_resident=experts.max_resident)
    resident = {key for key, tier in placement.tiers.items() if tier == "fast"}
    trace = routing_trace(moe_layers, E, k, max(plan.gen_tokens, 64), experts.popularity,
                          prompt_tokens=plan.prompt_tokens)
    plan.expert_cache_slots, plan.expected_hit_rate = placement.cache_slots, placement.expected_hit_rate
    plan.expert_bytes = int(expert_bytes)
    return placement, simulate_hits(trace, resident, placement.cache_slots, plan.cache_policy, copied=copied)


def fastest_expert_choice(experts: ExpertChoices, num_experts: int, top_k: int, predict, cache_fills: bool = True):
    """Resident experts or cache slots, whichever predicts faster: the user's fixed cache size, else
    no cache, one slot per active expert, or one layer's worth. `predict(ExpertChoices)` returns
    (step seconds, result); ties (to the microsecond) go to fewer cache slots, since residents cost
    no copies or reads to fill. Returns the winning result.

    Without an expert profile (popularity None) and with no user cap, and where misses fill the cache
    (`cache_fills`: not when every miss runs on the CPU), the cache takes the room (as
    many slots as fit, up to one layer's experts; residents only beyond that), whatever the
    predictions say: residents would be picked blind, in layer order, and the predictions draw
    routing i.i.d., under which a cache's hit rate is its worst case, no better than a blind
    resident set's. Real decode routing repeats experts from token to token, which a cache learns
    and a blind resident set does not: on the H200 (benchmarks/results/gpu/2026-11-26-session20,
    call 2's stall probe) 7 LRU slots made 56.0 tok/s where 7 blind residents made 27.7, with the
    same link and CPU (hit rates 78-81% against 21-25% in the benchmark's runs).

    Raises:
        BudgetError: no candidate fits (the last one's error).
    """
    if cache_fills and experts.cache_slots is None and experts.popularity is None and experts.max_resident is None:
        try:
            return predict(ExpertChoices(None, None, None))[1]
        except BudgetError:
            pass  # not one slot fits: the candidates below say why
    cands = [experts.cache_slots] if experts.cache_slots is not None else sorted({0, top_k, num_experts})
    scored, error = [], None
    for c in cands:
        try:
            t, result = predict(ExpertChoices(experts.popularity, c, experts.max_resident))
        except BudgetError as e:
            error = e
            continue
        scored.append((round(t, 6), c, result))
    if not scored:
        raise error
    return min(scored, key=lambda r: (r[0], r[1]))[2]


def expert_tiers(placement, layer: int, num_experts: int) -> list[str]:
    """Home tier of each expert of `layer` in `placement`."""
    return [placement.tiers[(layer, e)] for e in range(num_experts)]


def popularity_note(plan: Plan, popularity) -> None:
    if popularity is None:
        plan.notes.append("expert popularity assumed uniform; `tiered profile-experts` + --expert-profile places the "
                          "most popular experts on the fast tier (Fiddler §3.4)")
    else:
        plan.notes.append("resident experts chosen by popularity from the expert profile (Fiddler §3.4)")
