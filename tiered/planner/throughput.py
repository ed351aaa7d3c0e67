"""Throughput goal: FlexGen's LP policy search over (gbs, #gb) and placement percentages
(ALGORITHMS.md 4; planner/flexgen.py)."""

from __future__ import annotations

from tiered.checkpoint.model_config import ModelConfig
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
