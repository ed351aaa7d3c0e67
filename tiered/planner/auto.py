"""The planner as the engine's default: which HardwareProfile to plan with, and the plan for an LLM.

`LLM` (engine/llm.py) calls `engine_profile` and `engine_plan` before it loads any weights, unless
EngineConfig.plan is "off" or names a saved plan to replay. The plan then decides what the runtime
would otherwise pick by itself:
  MoE       how many experts are resident on the fast tier and how many cache slots it keeps
            (Fiddler §3.4 placement with the HOBBIT-style cache carved out first);
  dense     with an accelerator whose budget cannot hold every FFN, the ScheInfer slicing rates
            (r_CC, r_CG, r_GG) of each layer's MLP, and the prompt-token assignment n_g re-solved
            per prompt length (Eq. 15).
The profile is, in order: EngineConfig.profile (a JSON path or a preset name), the one `tiered
profile` saved in the cache directory, or a quick measurement (~3 s on 2 cores) saved there for
next time.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path
from typing import Callable

from tiered.checkpoint.model_config import ModelConfig
from tiered.errors import ConfigError
from tiered.hardware import op_time
from tiered.hardware.profile import HardwareProfile, LinearModel, default_profile_path
from tiered.planner.plan import Plan, make_plan

def engine_profile(profile: str | None, accelerator=None, progress: Callable[[str], None] | None = None
                   ) -> HardwareProfile:
    """The HardwareProfile the engine plans with.

    Args:
        profile: a HardwareProfile JSON path or a preset name (`tiered profile --presets`); None =
            the cached profile of this machine, measured now (quick run) and cached if there is none
            or if it lacks the GPU while a CUDA accelerator is in use.
        accelerator: the engine's Accelerator (None = CPU only). For the host stand-in, this
            machine's CPU profile (or a given one without GPU keys) is turned into a GPU-shaped one
            (`standin_profile`); a given profile with GPU keys is used as is, to plan as if on
            that machine while the stand-in runs the plan.
        progress: told (one line) when a measurement starts.
    Raises:
        ConfigError: `profile` is neither a readable profile nor a preset.
    """
    from tiered.hardware.presets import PRESETS, get_preset

    measured = profile is None
    if profile is not None:
        if Path(profile).is_file():
            hw = HardwareProfile.load(profile)
        elif profile in PRESETS:
            hw = get_preset(profile)
        else:
            raise ConfigError(f"hardware profile {profile!r} is neither a file nor a preset",
                              "pass a JSON from `tiered profile` or one of: " + ", ".join(PRESETS))
    else:
        hw = _cached_or_measured(cuda=accelerator is not None and not accelerator.is_host, progress=progress)
    if accelerator is not None and accelerator.is_host and (measured or not op_time.has_device(hw, "gpu")):
        hw = standin_profile(hw, accelerator.link_bandwidth)
    return hw


def _cached_or_measured(cuda: bool, progress: Callable[[str], None] | None) -> HardwareProfile:
    path = default_profile_path()
    if path.is_file():
        try:
            hw = HardwareProfile.load(path)
            if not cuda or op_time.has_device(hw, "gpu"):
                return hw
        except ConfigError:
            pass  # unreadable: measure again
    from tiered.hardware.profiler import profile_machine

    if progress is not None:
        progress(f"no hardware profile of this machine yet: measuring a quick one for the planner, saved to {path} "
                 "(`tiered profile` makes a full one)")
    hw = profile_machine(quick=True, cuda=cuda)
    try:
        hw.save(path)
    except OSError:
        pass  # a read-only cache directory: plan with it anyway
    return hw


def standin_profile(cpu: HardwareProfile, link_bandwidth: float | None) -> HardwareProfile:
    """A GPU-shaped profile of the host stand-in accelerator (hardware/accelerator.HostAccelerator).

    Its "GPU" is the CPU: gemm/gemv/attn/memory keys of the CPU are copied to the GPU; a launch is
    one executor task hop (runtime/task); an H2D copy is a memcpy, or n / link_bandwidth when the
    link is throttled. Both "devices" share the same cores, so the plan's overlap is optimistic;
    the stand-in exists to run the GPU control paths, not to be fast.
    """
    models = dict(cpu.models)
    for key, m in cpu.models.items():
        if key.startswith(("gemm/cpu/", "gemv/cpu/", "attn/cpu/")) or key in ("memory/bandwidth/cpu", "memory/copy/cpu"):
            models[key.replace("/cpu", "/gpu", 1)] = m
    hop = cpu.models["runtime/task"].alpha if cpu.has("runtime/task") else 0.0
    models["launch/gpu"] = LinearModel(hop, 0.0, None)
    copy = cpu.models.get("memory/copy/cpu") or LinearModel(0.0, 0.0, None)
    models["copy/h2d_pinned"] = (LinearModel(hop, 1.0 / link_bandwidth, None) if link_bandwidth
                                 else LinearModel(hop, copy.beta, copy.r2))
    ram = cpu.cpu_memory or (os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    meta = dict(cpu.meta, notes=list(cpu.meta.get("notes", [])) + [
        "host stand-in accelerator: its GPU keys are the CPU's; both share the cores"])
    return replace(cpu, name=f"{cpu.name}+host-standin", models=models, gpu_memory=ram, meta=meta)


def engine_plan(cfg: ModelConfig, profile: HardwareProfile, *, model_name: str, gpu_memory: int | None,
                cpu_memory: int | None, has_accelerator: bool, precision: str, max_context: int,
                popularity=None, committed: dict | None = None, expert_cache_slots: int | None = None,
                max_resident: int | None = None) -> Plan:
    """The latency plan of an LLM about to load: budgets as the engine enforces them, KV-cache room
    for one `max_context`-token sequence (what the runtime reserves), prompt 512 (or half the
    context) and 128 generated tokens for the predicted times.

    Args:
        gpu_memory, cpu_memory: the engine's budgets [bytes] (None = unlimited / the profile's).
        has_accelerator: False plans CPU + disk (the engine has no GPU tier).
        precision: the compute dtype's name, "fp32" or "bf16".
        committed: tier -> bytes the engine already holds there (see make_plan), so the plan's
            byte counts are the engine's own.
        expert_cache_slots, max_resident: the user's own choices, which the plan keeps.
    Raises:
        BudgetError: the budgets cannot hold what must stay on the fast tier.
    """
    if not has_accelerator:  # no GPU tier: make_plan then plans CPU + disk
        profile = replace(profile, gpu_memory=None)
    prompt = max(1, min(512, max_context // 2))
    return make_plan(cfg, profile, model_name=model_name, gpu_memory=gpu_memory if has_accelerator else None,
                     cpu_memory=cpu_memory, goal="latency", prompt_tokens=prompt,
                     gen_tokens=max(1, min(128, max_context - prompt)), precision=precision,
                     context_tokens=max_context, popularity=popularity, committed=committed,
                     expert_cache_slots=expert_cache_slots, max_resident=max_resident)


def sliced_layers(plan: Plan) -> dict[int, tuple[float, float]]:
    """Dense layers the plan slices (r_GG < 1): layer -> (r_CC, r_CG). Empty without a GPU tier."""
    if plan.fast_tier != "gpu" or plan.flexgen is not None:
        return {}
    return {l.layer: (l.r_cc, l.r_cg) for l in plan.layers if l.kind == "dense" and l.r_gg < 1 - 1e-9}


def token_assignment(plan: Plan, cfg: ModelConfig, profile: HardwareProfile | None) -> Callable[[int, int], int]:
    """n_g(layer, T): prompt tokens of a T-token step whose CC part runs on the GPU (CG' path).

    With the profile, ScheInfer Eq. 15 is solved for each (layer, T) as it comes (memoized); a
    replayed plan without its profile scales the planned n_g by T / planned prompt length.
    """
    from functools import lru_cache

    from tiered.planner.cost_model import LayerShape, SliceRates, cost_params
    from tiered.planner.scheinfer import solve_n_g

    layers = {l.layer: l for l in plan.layers}
    bpe = op_time.bytes_per_element(plan.precision)

    @lru_cache(maxsize=4096)
    def n_g(layer: int, T: int) -> int:
        l = layers.get(layer)
        if l is None or l.r_cc <= 0:
            return 0
        if profile is None:
            return int(round(l.n_g * T / max(plan.prompt_tokens, 1)))
        shape = LayerShape(T, cfg.hidden_size, cfg.intermediate_size, 3, bpe)
        rates = SliceRates(l.r_cc, l.r_cg, max(0.0, 1.0 - l.r_cc - l.r_cg))
        return solve_n_g(shape, rates, cost_params(profile, plan.precision, shape)).n_g

    return n_g
