"""`--plan off`: the runtime's plain rules written into a Plan, so they go through the same path.

The rules, without a cost model:
  weights      every non-expert weight on the fast tier (the GPU, or RAM without one); a dense model
               that does not fit is a BudgetError (no slicing without the planner);
  experts      Fiddler §3.4 placement: a cache of up to one layer's experts carved out of the fast
               tier first, then as many resident experts as fit (by popularity when profiled), the
               rest in CPU RAM, then on disk;
  dispatch     Fiddler's Algorithm 1 for each expert alone ("per-expert"), with a latency model
               calibrated on this machine now (runtime/calibrate.py).
A rules plan predicts nothing: its predicted times are 0.
"""

from __future__ import annotations

from dataclasses import asdict

from tiered.checkpoint.model_config import ModelConfig
from tiered.config import cpu_threads
from tiered.errors import BudgetError
from tiered.hardware.budget import format_bytes
from tiered.memory import sizes
from tiered.planner.common import expert_tiers
from tiered.planner.plan import LayerPlan, Plan


def rules_plan(cfg: ModelConfig, ec, accelerator, *, model_name: str, max_context: int, weights_format: str,
               popularity=None, experts_format: str | None = None, decode_precision: str | None = None) -> Plan:
    """The plain-rules Plan for `cfg` under EngineConfig `ec` on `accelerator` (None = CPU only).

    Raises:
        BudgetError: the fast tier cannot hold the non-expert weights, KV cache and staging, or a
            dense model's weights.
    """
    from tiered.planner.placement import plan_expert_placement

    fast_cap = accelerator.budget.capacity if accelerator is not None else ec.cpu_memory
    tier = "gpu" if accelerator is not None else "cpu"
    plan = Plan(model_name, "latency", "none", accelerator.budget.capacity if accelerator else None,
                ec.cpu_memory, 0, 0, weights_format, fast_tier=tier, kv_cache_tier=tier, attention_tier=tier,
                context_tokens=max_context, source="rules")
    plan.dtypes = {"weights": weights_format, "experts": experts_format or weights_format,
                   "kv_cache": sizes.kv_cache_format(weights_format, decode_precision, ec.kv_cache_dtype)}
    plan.cache_policy, plan.dispatch_mode = ec.cache_policy, ec.force_expert_path or "per-expert"
    plan.staging_buffers, plan.read_ahead = ec.staging_buffers, ec.read_ahead
    plan.cpu_threads = cpu_threads(ec)
    plan.kv_slots = ec.max_batch
    # a long prompt prefills in chunks of the workspace's tokens, on the device (the stand-in's too) or in RAM
    plan.prefill_chunk = sizes.WORKSPACE_TOKENS if accelerator is not None else sizes.CPU_PREFILL_TOKENS
    # a cache in RAM: its sliding layers forget behind their window (KVCache.forget)
    plan.kv_window = accelerator is None and ec.sliding_kv == "window" and cfg.windowed
    kv = sizes.kv_cache_bytes(cfg, plan.kv_slots, max_context, plan.dtypes["kv_cache"], plan.kv_advance())
    plan.workspace_bytes = (
        sizes.device_workspace_bytes(cfg, weights_format, accelerator.library_workspace_bytes()) if accelerator is not None
        else sizes.cpu_workspace_bytes(cfg, weights_format, max_context, plan.kv_slots))
    kv += plan.workspace_bytes + sizes.rotary_bytes(cfg, max_context)
    if not cfg.is_moe:
        need = sizes.weight_bytes(cfg, weights_format) + kv
        if fast_cap is not None and need > fast_cap:
            raise BudgetError(f"the {tier} budget {format_bytes(fast_cap)} cannot hold the model's weights and KV cache "
                              f"({format_bytes(need)}); the runtime's rules do not offload a dense model",
                              f"raise --{tier}-mem by {format_bytes(need - fast_cap)} or use --plan auto")
        plan.layers = [LayerPlan(i, "dense", weights_format) for i in range(cfg.num_hidden_layers)]
        plan.memory = {tier: need}
        plan.binding = "runtime rules: every weight on the fast tier"
        return plan
    eb = sizes.expert_bytes(cfg, plan.dtypes["experts"])
    staging = ec.staging_buffers * eb
    fixed = sizes.weight_bytes(cfg, weights_format, sizes.is_expert_param) + kv + staging
    free = float("inf") if fast_cap is None else fast_cap - fixed
    if free < 0:
        raise BudgetError(f"the {tier} budget {format_bytes(fast_cap)} cannot hold the non-expert weights, the KV cache "
                          f"of one {max_context}-token sequence and {ec.staging_buffers} staging buffers "
                          f"({format_bytes(fixed)})", f"raise --{tier}-mem by {format_bytes(-free)} or lower --max-context")
    cpu_free = None
    if accelerator is not None:
        cpu_free = float("inf") if ec.cpu_memory is None else ec.cpu_memory - staging
    moe = [i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i)]
    placement = plan_expert_placement(moe, cfg.num_experts, eb, free, cpu_free, popularity, ec.expert_cache_slots,
                                      max_resident=ec.resident_experts)
    plan.expert_cache_slots, plan.expert_bytes = placement.cache_slots, eb
    plan.expected_hit_rate = placement.expected_hit_rate
    for i in range(cfg.num_hidden_layers):
        if i in moe:
            g, c, d = (placement.count(t, i) for t in ("fast", "cpu", "disk"))
            lp = LayerPlan(i, "moe", weights_format, experts_gpu=g if accelerator else 0,
                           experts_cpu=c if accelerator else g, experts_disk=d,
                           expert_tiers=expert_tiers(placement, i, cfg.num_experts))
        else:
            lp = LayerPlan(i, "dense", weights_format)
        plan.layers.append(lp)
    if accelerator is not None:
        plan.dispatch_latency = asdict(_calibrated(cfg, accelerator, weights_format, plan.dtypes["experts"]))
    n_fast = placement.count("fast")
    plan.memory = {tier: fixed + (n_fast + placement.cache_slots) * eb}
    plan.binding = (f"runtime rules: {n_fast} experts resident, {placement.cache_slots} cache slots, "
                    f"misses by Fiddler's Algorithm 1 per expert")
    return plan


def _calibrated(cfg: ModelConfig, accelerator, fmt: str, experts_format: str | None = None):
    """The dispatcher's LatencyModel measured now on one expert-sized buffer pair (freed after). Where
    the experts are stored in the compute format `fmt` (dense), the CPU side is timed through the
    runtime's own CPU expert (quant/experts.ExpertFormat.forward: the native kernel at few rows);
    quantized experts are timed as dense `fmt` ones."""
    from tiered import kernels
    from tiered.quant.experts import ExpertFormat, is_dense_format
    from tiered.runtime.calibrate import calibrate

    dtype = sizes.torch_dtype(fmt)
    D, F = cfg.hidden_size, cfg.moe_intermediate_size
    shapes = ((F, D), (F, D), (D, F))
    cpu_forward = None
    if (experts_format or fmt) == fmt and is_dense_format(fmt):
        cpu_forward = ExpertFormat(fmt, shapes, "tiled" if kernels.available() else "cpu").forward
    dev = [accelerator.alloc(s, dtype, "calibration") for s in shapes]
    try:
        host = [accelerator.host_buffer(s, dtype) for s in shapes]
        return calibrate(shapes, dtype, accelerator, D, dev, host, cpu_forward=cpu_forward)
    finally:
        for t in dev:
            accelerator.free(t)
