"""Throughput goal: FlexGen's LP policy search over (gbs, #gb) and placement percentages
(ALGORITHMS.md 4; planner/flexgen.py), and the engine's batch for it (plan_batch): the latency plans priced at
each batch, the KV cache of the batch in the budget."""

from __future__ import annotations

from typing import Callable

from tiered.checkpoint.model_config import ModelConfig
from tiered.errors import BudgetError
from tiered.hardware.profile import HardwareProfile
from tiered.planner.plan import Plan


def plan_throughput(plan: Plan, cfg: ModelConfig, profile: HardwareProfile, gpu, cpu) -> Plan:
    """Fill `plan` with FlexGen's best policy for `gpu` / `cpu` bytes (None = the profile's)."""
    from tiered.planner.flexgen import FlexGenModel, FlexGenOptions, search_policy

    compress = plan.precision == "int4"
    model = FlexGenModel.from_config(cfg, plan.model, bytes_per_element=2.0)
    opts = FlexGenOptions(compress_weight=compress, compress_cache=compress)
    pol = search_policy(model, profile, plan.prompt_tokens, plan.gen_tokens, opts, gpu_memory=gpu, cpu_memory=cpu)
    plan.flexgen = pol.to_dict()
    plan.predicted_throughput_tokens_per_s = pol.throughput
    plan.kv_cache_tier = _major(pol.cache)
    plan.attention_tier = "cpu" if pol.cpu_delegation and pol.cache[0] < 1 else "gpu"
    plan.memory = {k: v for k, v in pol.peak_memory.items()}
    plan.binding = f"{pol.binding}; bottlenecks: prefill {pol.bottleneck[0]}, decode {pol.bottleneck[1]}"
    plan.predicted_ttft_s = pol.prefill_layer_time * cfg.num_hidden_layers
    return plan


def _major(t) -> str:
    return ("gpu", "cpu", "disk")[max(range(3), key=lambda i: t[i])]


# batches the throughput goal tries (powers of two, as vLLM's max_num_seqs defaults and FlexGen's block sizes go)
BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# of the batches priced within this share of the best throughput, the smallest is taken: a larger batch holds
# more KV cache and makes each request wait longer for a few percent the prices cannot tell apart
NEAR_BEST = 0.97
# the largest batch an accelerator's plan takes where its time models do not price batches (GPU plans)
UNPRICED_MOST = 32


def block_throughput(plan: Plan) -> float | None:
    """Predicted generated tokens/s of a block of plan.kv_slots (B) requests of plan.prompt_tokens prompt and
    plan.gen_tokens (G) generated tokens each, all decoding together: B G / (prefill + G B / speed), the prompts
    prefilled together as the engine groups them (Plan.predicted_block_prefill_s; where not priced, one after
    another: B x Plan.predicted_ttft_s) and the decode steps priced at B sequences of the full context
    (Plan.predicted_batch_decode_tokens_per_s; at B = 1 the lone sequence's speed). FlexGen's objective
    (generated tokens over the block's time; ALGORITHMS.md 4). None where the plan prices no batch (its goal
    module has no batched time model: the GPU plans).

    Where the plan priced a known workload's own requests (Plan.predicted_requests_tokens_per_s: a batch file's
    lengths replayed through B slots, planner/batch_sim), that price instead: a file of varied lengths prefills its
    long prompts alone and decodes below the full batch as its requests finish (the block model had priced a
    48-request SmolLM2 file 25-30% fast)."""
    if plan.predicted_requests_tokens_per_s:
        return plan.predicted_requests_tokens_per_s
    B, G = plan.kv_slots, plan.gen_tokens
    speed = plan.predicted_batch_decode_tokens_per_s if B > 1 else plan.predicted_decode_tokens_per_s
    if not speed or plan.predicted_ttft_s is None:
        return None
    prefill = plan.predicted_block_prefill_s if B > 1 and plan.predicted_block_prefill_s is not None else \
        B * plan.predicted_ttft_s
    return B * G / (prefill + G * B / speed)


def plan_batch(make: Callable[[int], Plan], most: int = BATCHES[-1],
               compressed: Callable[[int], Plan] | None = None, lone_share: float | None = None) -> Plan:
    """The throughput goal's plan: of the plans `make(B)` for the batches B in BATCHES up to `most` (and `most`
    itself), the one whose block generates the most tokens a second (`block_throughput`; the smallest within
    NEAR_BEST of the best). Larger batches are tried until the budget cannot hold their KV cache (make raises
    BudgetError), as FlexGen's policy search bounds its block by peak memory (ALGORITHMS.md 4); where the plans
    price no batch (an accelerator's), the largest that fits, up to `most` and UNPRICED_MOST (and, with
    lone_share, below the first batch that slows one request down).

    Args:
        make: kv_slots -> the latency goal's plan with KV-cache room for that many sequences (make_plan).
        most: the largest batch to try; 1 or less: up to BATCHES[-1] (EngineConfig.max_batch's and make_plan's
            kv_slots' default, which caps nothing).
        compressed: kv_slots -> the same plan with an int8 KV cache (lossy: EngineConfig.kv_cache_dtype "int8"),
            where the plan's own cache is lossless ("auto"): when the budget refused a batch and int8 lets a larger
            one generate at least COMPRESSED_GAIN times as fast, a note says so (FlexGen leaves compression to the
            user too: its policy search takes it as a given).
        lone_share: only the batches below the first whose plan prices one request decoding alone (Plan.
            predicted_decode_tokens_per_s) under this share of batch 1's are chosen from (a server's,
            EngineConfig.lone_decode_share); None: every batch that fits.
    Returns:
        The chosen plan, its goal "throughput", predicted_throughput_tokens_per_s its block's, and a note of the
        batches priced.
    Raises:
        BudgetError: not even one sequence fits (make(1)'s error).
    """
    most = most if most > 1 else BATCHES[-1]
    tries = sorted({b for b in BATCHES if b <= most} | {most})
    plans: list[Plan] = []
    refused = None  # the first batch the budget cannot hold (its KV cache, or its experts: experts_in_reach)
    for B in tries:
        try:
            plans.append(make(B))
        except BudgetError as e:
            if not plans:
                raise
            refused = (B, e.message)
            break
    scores = [block_throughput(p) for p in plans]
    lone = [p.predicted_decode_tokens_per_s or 0.0 for p in plans]
    slow = next((i for i, v in enumerate(lone) if lone_share is not None and v < lone_share * lone[0]), None)
    if any(s is None for s in scores[1:]):  # unpriced batches: the most that fit, within the unpriced cap
        cap = min(most, UNPRICED_MOST)
        plan = ([p for p in plans[:slow] if p.kv_slots <= cap] or plans[:1])[-1]
        why = f"; batch {refused[0]}: {refused[1]}" if refused and refused[0] <= cap else ""
        if slow is not None and plans[slow].kv_slots <= cap:
            why += (f"; from batch {plans[slow].kv_slots} one request would decode at {lone[slow]:.1f} tok/s, under "
                    f"{lone_share:.0%} of batch 1's {lone[0]:.1f}")
        plan.notes.append(f"throughput goal: batch {plan.kv_slots}, the largest that fits up to {cap} "
                          f"(this plan's time models do not price batches){why}")
    else:
        top = max(scores[:slow])
        plan = next(p for p, s in zip(plans[:slow], scores) if s >= NEAR_BEST * top)
        priced = ", ".join(f"{p.kv_slots}: {s:.1f}" for p, s in zip(plans, scores))
        why = f"; batch {refused[0]}: {refused[1]}" if refused else ""
        if slow is not None:
            why += (f"; from batch {plans[slow].kv_slots} one request would decode at {lone[slow]:.1f} tok/s, under "
                    f"{lone_share:.0%} of batch 1's {lone[0]:.1f}")
        what = (f"the workload's requests (mean prompt {plan.prompt_tokens}, {plan.gen_tokens} generated tokens; "
                "their run replayed at each batch)" if plan.predicted_requests_tokens_per_s else
                f"prompts of {plan.prompt_tokens} and {plan.gen_tokens} generated tokens")
        plan.notes.append(f"throughput goal: batch {plan.kv_slots} for {what} (generated tok/s by batch: "
                          f"{priced}){why}")
        plan.predicted_throughput_tokens_per_s = block_throughput(plan)
        if refused and compressed is not None:
            _compression_note(plan, compressed, most)
    plan.goal = "throughput"
    return plan


# where an int8 KV cache lets the throughput goal generate at least this many times as fast, the plan says so
COMPRESSED_GAIN = 1.1


def _compression_note(plan: Plan, compressed: Callable[[int], Plan], most: int) -> None:
    """plan_batch's note on a batch the budget refused: the batch an int8 KV cache would fit and its price, where
    that is COMPRESSED_GAIN times the plan's."""
    try:
        alt = plan_batch(compressed, most)
    except BudgetError:
        return
    gain = (alt.predicted_throughput_tokens_per_s or 0.0) / plan.predicted_throughput_tokens_per_s
    if alt.kv_slots > plan.kv_slots and gain >= COMPRESSED_GAIN:
        plan.notes.append(f"an int8 KV cache (--kv-cache-dtype int8, lossy: docs/accuracy.md) would fit batch "
                          f"{alt.kv_slots} in the budget: {alt.predicted_throughput_tokens_per_s:.1f} generated tok/s "
                          f"priced, {gain:.2f}x")
