"""make_plan: (model config, hardware profile, budgets, goal) -> Plan, by goal and machine kind.

  latency, dense, GPU    -> latency_dense.py (ScheInfer slicing)
  latency, MoE, GPU      -> latency_moe.py (Fiddler placement and dispatch)
  latency, no GPU        -> latency_cpu.py (CPU RAM fast tier, disk slow tier)
  throughput             -> throughput.py (FlexGen LP)
Every figure comes from the HardwareProfile and every byte count from memory/sizes.py; `binding`
names the resource that limits the plan.
"""

from __future__ import annotations

from typing import Sequence

from tiered.checkpoint.model_config import ModelConfig
from tiered.errors import ConfigError
from tiered.config import SLIDING_KV
from tiered.hardware import op_time
from tiered.hardware.profile import HardwareProfile
from tiered.memory import sizes
from tiered.planner.common import ExpertChoices
from tiered.planner.plan import DISPATCH_MODES, Plan

PRECISIONS = ("fp32", "bf16", "fp16", "int8", "int8-g32", "q6k", "q5k", "iq4xs", "int4", "fp8")


def make_plan(cfg: ModelConfig, profile: HardwareProfile, *, model_name: str = "", gpu_memory: int | None = None,
              cpu_memory: int | None = None, goal: str = "latency", prompt_tokens: int = 512, gen_tokens: int = 128,
              precision: str = "bf16", weights_format: str | None = None, context_tokens: int | None = None,
              popularity=None, expert_cache_slots: int | None = None, max_resident: int | None = None,
              cache_policy: str = "lru", dispatch_mode: str = "balanced", staging_buffers: int = 2,
              read_ahead: bool = True, workspace: int | None = None,
              dense_copies: bool = True, experts_format: str | None = None, kv_slots: int = 1,
              head_precision: str | None = None, embedding_bytes: int | None = None,
              expert_act: str = "bf16", batch_act: str = "bf16", graphs: bool = False,
              prefetch: bool = False, prefetch_lookahead: int = 2, precision_mix: dict | None = None,
              library_workspace: int | None = None, mixed_rows: int = 0, speculative: str = "off",
              speculative_tokens: int = 0, prompt_lookup: tuple[int, int] = (2, 4), kv_cache: str = "auto",
              requests: Sequence[tuple[int, int]] | None = None, prefixes=None, sliding_kv: str = "window") -> Plan:
    """Plan `cfg` on `profile` within the budgets (None = the profile's capacities).

    Args:
        precision: the weight format the time models price ("fp32", "bf16", "int8", "int4"); on a
            CPU-only plan of a dense model, the decode copies' format.
        precision_mix: on a CPU-only plan, the decode copies' precisions by share of the layers'
            projection elements where they mix (quant/linear.decode_mix; Plan.precision_mix).
        weights_format: format the weights are stored in on their tiers (default: `precision`);
            the KV cache's format follows from it and `precision` (memory/sizes.kv_cache_format).
        context_tokens: KV-cache positions to keep room for [tokens] (default prompt + generated);
            the engine passes its max_context, the room its runtime reserves.
        popularity: float [L, E] tokens routed per expert (`tiered profile-experts`): the most
            popular experts are made resident, and cache hit rates are simulated on routing drawn
            from it (uniform when None).
        expert_cache_slots, max_resident: fixed by the user (None = the planner chooses).
        cache_policy, dispatch_mode, staging_buffers, read_ahead: runtime settings the plan
            records and prices (dispatch_mode "copy" / "cpu" forces every miss one way).
        experts_format: storage format of routed experts ("bf16", "int8", "int4", ... see
            quant/experts.py); None = the weights format. Expert bytes on every tier follow it.
        workspace: GPU bytes kept beyond the plan's tensors (None = memory/sizes.workspace_bytes, one
            step's activations, plus `library_workspace`); the engine passes its accelerator's.
        library_workspace: GPU bytes libraries hold for the engine, with workspace None (None = the
            profile's GPU's: memory/sizes.library_workspace_bytes of meta["gpu_capability"], 0 without).
        dense_copies: Plan.dense_copies; False (the CPU's one-copy mode) counts and prices the
            non-expert weights in `precision`, the format of their one copy.
        kv_slots: sequences of context_tokens whose KV cache the fast tier keeps room for.
        head_precision: the lm_head's format where it differs from `precision` (CPU decode copies
            of a GGUF file: quant/linear.head_precision), recorded as dtypes["lm_head"] and priced.
        embedding_bytes: bytes of the token embedding where the CPU's one-copy mode keeps it in its
            file's blocks (quant/embedding.BlockEmbedding: a GGUF file's Q8_0 / Q4_K table), None =
            counted dense in the weights' format.
        expert_act, batch_act: what routed int4 experts read at batch 1 and int4 decode copies in steps of
            2+ rows (Plan.expert_act / batch_act), recorded before pricing: a server's batched step is
            priced on the activations its int4 rows read (cpu_predict.predict_decode's batch_act).
        graphs: the engine may graph GPU decode steps (EngineConfig.graphs on a CUDA device): the
            GPU plans price the host cost of the graphed step they will get (op_time.step_overhead),
            and settle_gpu_decode records which (Plan.decode_graphs / piecewise_graphs).
        prefetch, prefetch_lookahead: HOBBIT's expert prefetch (MoE), recorded before pricing: the
            runner then takes neither the grouped expert path nor a whole-step graph.
        mixed_rows: Plan.mixed_rows of a CPU-only plan (planner/auto.planned_mixed_rows: prompts
            of up to that many tokens run as rows of the native decode step), recorded before pricing: a prompt
            within it is priced as those rows (cpu_predict.predict_prompt_rows); 0 for any other plan.
        speculative, speculative_tokens, prompt_lookup: speculative decoding (EngineConfig's; Plan's fields):
            a CPU-only plan prices its steps of 1 + k rows (Plan.speculative_costs).
        kv_cache: the KV cache's format (EngineConfig.kv_cache_dtype: memory/sizes.KV_FORMATS), "auto" =
            memory/sizes.kv_cache_format's for the weights and `precision`; its bytes and its reads are priced.
        requests: (prompt tokens, generated tokens) of each request of a known workload (EngineConfig.requests: a
            batch file's), in the order they are queued: a CPU-only plan replays their run at kv_slots slots
            (planner/batch_sim) into Plan.predicted_requests_tokens_per_s, which the throughput goal's batch is
            chosen on (throughput.block_throughput); other plans ignore them.
        prefixes: which of the requests' prompts share how many leading tokens (EngineConfig.request_prefixes,
            batch_sim.PromptPrefixes): the replay reuses them as the server does.
        sliding_kv: EngineConfig.sliding_kv: "window" lets a KV cache in RAM keep only its sliding layers' windows
            (Plan.kv_window, counted so in its bytes: a CPU plan's); "full" keeps every position.
    Raises:
        ConfigError: unknown goal, precision or dispatch mode, or a cost model the profile lacks.
        BudgetError: the budgets cannot hold what the goal needs on the fast tier.
    """
    if goal not in ("latency", "throughput"):
        raise ConfigError(f"goal must be latency or throughput, got {goal!r}", "pass --goal latency|throughput")
    if goal == "throughput" and not (op_time.has_device(profile, "gpu") and (gpu_memory or profile.gpu_memory)):
        # no GPU: the engine's throughput plan, the CPU latency plan at the batch that generates the most
        # tokens a second (planner/throughput.plan_batch; FlexGen's LP places tensors across GPU, CPU and disk)
        given = {k: v for k, v in locals().items() if k not in ("cfg", "profile", "goal", "kv_slots")}
        from tiered.planner.throughput import plan_batch
        int8 = (lambda B: make_plan(cfg, profile, goal="latency", kv_slots=B, **dict(given, kv_cache="int8"))) \
            if kv_cache == "auto" and not cfg.is_mla else None
        return plan_batch(lambda B: make_plan(cfg, profile, goal="latency", kv_slots=B, **given), kv_slots, int8)
    if sliding_kv not in SLIDING_KV:
        raise ConfigError(f"sliding_kv must be one of {SLIDING_KV}, got {sliding_kv!r}", "pass window or full")
    if precision not in PRECISIONS:
        raise ConfigError(f"precision must be one of {PRECISIONS}", "pass e.g. --precision bf16")
    if dispatch_mode not in DISPATCH_MODES:
        raise ConfigError(f"dispatch mode must be one of {DISPATCH_MODES}", "pass balanced, copy or cpu")
    gpu = gpu_memory if gpu_memory is not None else profile.gpu_memory
    cpu = cpu_memory if cpu_memory is not None else profile.cpu_memory
    plan = Plan(model_name or cfg.model_type, goal, profile.name, gpu, cpu, prompt_tokens, gen_tokens, precision)
    plan.context_tokens = context_tokens or prompt_tokens + gen_tokens
    plan.precision_mix = precision_mix
    fmt = weights_format or precision
    plan.dtypes = {"weights": fmt, "experts": experts_format or fmt,
                   "kv_cache": sizes.kv_cache_format(fmt, precision, kv_cache),
                   "decode": precision}
    sizes.kv_bytes_per_token(cfg, plan.dtypes["kv_cache"])  # a ConfigError for a format the model cannot cache
    if head_precision and head_precision != precision:
        plan.dtypes["lm_head"] = head_precision
    plan.cache_policy, plan.dispatch_mode = cache_policy, dispatch_mode
    plan.staging_buffers, plan.read_ahead = staging_buffers, read_ahead
    plan.dense_copies, plan.kv_slots = dense_copies, kv_slots
    plan.expert_act, plan.batch_act = expert_act, batch_act
    plan.expert_group_rows = expert_group_rows(cfg, profile, plan.dtypes["experts"], batch_act)
    plan.speculative = speculative
    plan.speculative_tokens = speculative_tokens if speculative != "off" else 0
    plan.prompt_lookup = list(prompt_lookup)
    plan.prefetch, plan.prefetch_lookahead = prefetch and cfg.is_moe, prefetch_lookahead
    sizes.bytes_per_element(fmt)  # a ConfigError for an unknown format, before any work
    experts = ExpertChoices(popularity, expert_cache_slots, max_resident)
    if goal == "latency" and op_time.has_device(profile, "gpu") and gpu:
        if workspace is None:
            library = library_workspace if library_workspace is not None else sizes.library_workspace_bytes(
                profile.meta.get("gpu_capability") if profile.meta else None)
            workspace = sizes.device_workspace_bytes(cfg, fmt, library)
        plan.workspace_bytes = workspace
        plan.prefill_chunk = sizes.WORKSPACE_TOKENS  # the prompt tokens that workspace holds
    if goal == "throughput":
        from tiered.planner.throughput import plan_throughput
        plan = plan_throughput(plan, cfg, profile, gpu, cpu)
    elif not op_time.has_device(profile, "gpu") or not gpu:
        from tiered.planner.latency_cpu import plan_cpu_latency
        plan.fast_tier = "cpu"
        plan.mixed_rows = mixed_rows
        # the cache in RAM, lazily committed: its sliding layers forget behind their window (KVCache.forget)
        plan.kv_window = sliding_kv == "window" and cfg.windowed
        plan = plan_cpu_latency(plan, cfg, profile, cpu, experts, embedding_bytes, requests, prefixes)
    elif cfg.is_moe:
        from tiered.planner.latency_moe import plan_moe_latency
        plan = plan_moe_latency(plan, cfg, profile, gpu, cpu, experts, graphs=graphs)
    else:
        from tiered.planner.latency_dense import plan_dense_latency
        plan = plan_dense_latency(plan, cfg, profile, gpu, cpu, graphs=graphs)
    return settle_gpu_decode(plan, cfg, graphs)


def expert_group_rows(cfg: ModelConfig, profile: HardwareProfile, experts_format: str, batch_act: str) -> int:
    """Plan.expert_group_rows: for an MoE model whose routed experts' gate and up are int4 (SiLU's SwiGLU), the
    rows up to which a CPU expert's prompt rows run the native kernel's groups where the profile prices the AMX
    GEMM below them sooner than the kernel tuning's q8_expert_grouped_rows says (cpu_predict.priced_group_rows,
    which prompt_expert_time prices by too); 0 otherwise (the tuning's)."""
    from tiered.checkpoint.model_config import expert_shapes
    from tiered.planner.cpu_predict import kernel_isa, priced_group_rows
    from tiered.quant.experts import fit_format, kind_grouped_rows, parse_kinds

    if not cfg.is_moe or getattr(cfg, "expert_bias", False) or experts_format in ("fp32", "bf16", "fp16"):
        return 0
    try:
        shapes = expert_shapes(cfg.hidden_size, cfg.moe_intermediate_size, False)
        kinds = parse_kinds(fit_format(experts_format, shapes))
    except ConfigError:  # a format the experts cannot take: sizes / placement say so
        return 0
    if kinds[0] != "int4" or kinds[1] != "int4":
        return 0
    tuned = kind_grouped_rows("int4", kernel_isa(profile), batch_act, (profile.meta or {}).get("kernel_tuning") or {})
    rows = priced_group_rows(profile, sizes.expert_bytes(cfg, experts_format),
                             3 * cfg.hidden_size * cfg.moe_intermediate_size, batch_act)
    return rows if rows < tuned else 0


def settle_gpu_decode(plan: Plan, cfg: ModelConfig, graphs: bool) -> Plan:
    """Record how `plan`'s GPU decode steps run (in place; returns it):
      fused_projections  attention on the GPU: q/k/v and gate/up as one GEMM each;
      decode_graphs      `graphs` allowed and nothing in the step syncs with the host: every weight on
                         the GPU, MoE experts all resident and groupable (Plan.experts_groupable), no
                         prefetch (runtime/graphs.DecodeGraphs);
      piecewise_graphs   `graphs` allowed otherwise, attention on the GPU (PiecewiseGraphs).
    `graphs`: EngineConfig.graphs allows graphs on this accelerator (planner/auto.graphs_allowed)."""
    on_gpu = plan.fast_tier == "gpu" and plan.attention_tier == "gpu"
    plan.fused_projections = on_gpu
    graphs = graphs and on_gpu and plan.flexgen is None
    # an MoE step syncs unless every expert is resident and stacked (moe_runner._grouped)
    moe_sync_free = plan.all_experts_resident() and plan.experts_groupable()
    plan.decode_graphs = graphs and not plan.sliced_layers() and (not cfg.is_moe or moe_sync_free)
    plan.piecewise_graphs = graphs and not plan.decode_graphs
    return plan
