"""Wire a loaded MoE model to the tiered runtime: placement, expert store, cache, runner.

Called by LLM after the non-expert weights are materialized on the compute tier. Budgets are
checked before anything is allocated: the plan is made from byte counts first.
"""

from __future__ import annotations

import torch

from tiered.errors import BudgetError
from tiered.hardware.budget import MemoryBudget, format_bytes
from tiered.memory.expert_cache import POLICIES, ExpertCache
from tiered.memory.expert_store import ExpertStore, expert_tensor_names, moe_layers
from tiered.memory.placement import load_popularity, plan_expert_placement
from tiered.models.moe import moe_blocks
from tiered.runtime.calibrate import calibrate
from tiered.runtime.executor import Executor
from tiered.runtime.moe_runner import StagingPool, TieredExperts


def install_tiered_experts(model, checkpoint, engine_config, dtype: torch.dtype, accelerator,
                           fast_budget: MemoryBudget, cpu_budget: MemoryBudget, kv_reserve: int = 0) -> TieredExperts:
    """Place the experts, build store / cache / staging / executor, and set every MoEBlock's runner.

    Args:
        kv_reserve: fast-tier bytes kept free for the KV cache (allocated per generate call, after
            the experts are placed), so experts never take the KV cache's room (Fiddler 2.b: N_gpu
            counts the fast tier minus non-expert weights, KV cache and workspace).
    Raises:
        BudgetError: the budgets cannot hold the staging buffers, the KV cache and the cache the
            runtime needs.
    """
    cfg = checkpoint.config
    layers = moe_layers(checkpoint, cfg)
    names = expert_tensor_names(cfg.model_type, layers[0], 0)
    elem = torch.empty((), dtype=dtype).element_size()
    shapes = [tuple(checkpoint.handle(n).shape) for n in names]
    expert_bytes = sum(a * b for a, b in shapes) * elem
    n_stage = engine_config.staging_buffers
    # staging buffers come first: the runtime cannot work without them
    fast_stage_bytes = n_stage * expert_bytes
    host_stage_bytes = n_stage * expert_bytes if accelerator is not None else 0
    if not fast_budget.fits(fast_stage_bytes):
        raise BudgetError(f"the {fast_budget.name} budget has {format_bytes(max(fast_budget.free, 0))} left after the "
                          f"non-expert weights; {n_stage} staging buffers need {format_bytes(fast_stage_bytes)}",
                          f"raise --{fast_budget.name}-mem by {format_bytes(fast_stage_bytes - max(fast_budget.free, 0))}")
    if not fast_budget.fits(fast_stage_bytes + kv_reserve):
        left = max(fast_budget.free - fast_stage_bytes, 0)
        raise BudgetError(f"the {fast_budget.name} budget has {format_bytes(left)} left after the non-expert weights "
                          f"and staging buffers; the KV cache of one max_context-token sequence needs "
                          f"{format_bytes(kv_reserve)}",
                          f"raise --{fast_budget.name}-mem by {format_bytes(kv_reserve - left)} or lower --max-context")
    popularity = None
    if engine_config.expert_profile:
        popularity = load_popularity(engine_config.expert_profile, cfg.num_hidden_layers, cfg.num_experts)
    cpu_free = None
    if accelerator is not None:
        cpu_free = cpu_budget.free - host_stage_bytes
    placement = plan_expert_placement(layers, cfg.num_experts, expert_bytes,
                                      fast_budget.free - fast_stage_bytes - kv_reserve,
                                      cpu_free, popularity, engine_config.expert_cache_slots,
                                      max_resident=engine_config.resident_experts)

    def fast_alloc(shape, dt, what):
        if accelerator is not None:
            return accelerator.alloc(shape, dt, what)
        return fast_budget.empty(shape, dt, what)

    def host_alloc(shape, dt, what):
        return cpu_budget.empty(shape, dt, what, pin=not accelerator.is_host)

    fast_staging = StagingPool([tuple(fast_alloc(s, dtype, "staging") for s in shapes) for _ in range(n_stage)])
    host_staging = None
    if accelerator is not None:
        host_staging = StagingPool([tuple(host_alloc(s, dtype, "host staging") for s in shapes) for _ in range(n_stage)])
    store = ExpertStore(checkpoint, placement, dtype, accelerator, fast_budget, cpu_budget, engine_config.offload_dir)
    cache = ExpertCache(placement.cache_slots, shapes, dtype, fast_alloc, POLICIES[engine_config.cache_policy]())
    latency = None
    if accelerator is not None:
        latency = calibrate(shapes, dtype, accelerator, cfg.hidden_size, fast_staging.buffers[0], host_staging.buffers[0])
    # without an accelerator the CPU computes experts on the engine's own thread (see DeferredTask)
    executor = Executor(accelerator, disk_readers=max(2, n_stage), trace=engine_config.trace,
                        inline=("cpu",) if accelerator is None else ())
    runner = TieredExperts(store, cache, executor, latency, accelerator, fast_staging, host_staging,
                           read_ahead=engine_config.read_ahead, force_path=engine_config.force_expert_path)
    runner.placement = placement
    for block in moe_blocks(model):
        block.runner = runner
    return runner
