"""Plan: the planner's decision as data — printable, saved, loaded and replayed by `run`.

`make_plan` turns (model config, hardware profile, budgets, goal) into a Plan:
  latency goal, dense model  -> ScheInfer: greedy GPU-memory assignment of r_GG per layer (Eq. 14),
                                optimal r_CG per layer (edge points, Eq. 5-13), token assignment n_g
                                for the prompt (Eq. 15);
  latency goal, MoE model    -> Fiddler: non-expert weights and KV cache on the GPU, the remaining
                                GPU bytes filled with whole experts (§3.4), per-expert dispatch by the
                                latency models (Algorithm 1) with its threshold s*;
  throughput goal            -> FlexGen's LP policy search over (gbs, #gb) and placement percentages.
Every figure comes from the HardwareProfile; `binding` names the resource that limits the plan.
"""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tiered.checkpoint.model_config import ModelConfig
from tiered.errors import ConfigError
from tiered.hardware import op_time
from tiered.hardware.budget import format_bytes
from tiered.hardware.profile import HardwareProfile

PRECISION_BYTES = {"fp32": 4.0, "bf16": 2.0, "fp16": 2.0, "int8": 1.0, "int4": 0.5 + 4 / 64}


@dataclass
class LayerPlan:
    """One decoder layer: where its FFN / experts live and its predicted times [s]."""

    layer: int
    kind: str  # "dense" | "moe"
    precision: str
    r_cc: float = 0.0
    r_cg: float = 0.0
    r_gg: float = 1.0
    n_g: int = 0  # prompt tokens on the CG' path
    experts_gpu: int = 0
    experts_cpu: int = 0
    experts_disk: int = 0
    decode_s: float = 0.0
    prefill_s: float = 0.0


@dataclass
class Plan:
    """A whole-model plan. Times in seconds, memory in bytes, throughput in tokens/s."""

    model: str
    goal: str
    profile: str
    gpu_memory: int | None
    cpu_memory: int | None
    prompt_tokens: int
    gen_tokens: int
    precision: str
    layers: list[LayerPlan] = field(default_factory=list)
    kv_cache_tier: str = "gpu"
    attention_tier: str = "gpu"
    fast_tier: str = "gpu"  # where resident experts / GG slices live: "gpu", or "cpu" when there is no GPU
    context_tokens: int = 0  # KV-cache positions the memory figures keep room for
    committed: dict = field(default_factory=dict)  # tier -> bytes the engine already holds there (exact)
    dispatch_threshold_tokens: float | None = None
    expert_cache_slots: int = 0
    predicted_ttft_s: float = 0.0
    predicted_decode_tokens_per_s: float = 0.0
    predicted_throughput_tokens_per_s: float | None = None
    memory: dict = field(default_factory=dict)  # tier -> bytes
    binding: str = ""
    notes: list[str] = field(default_factory=list)
    flexgen: dict | None = None

    def summary(self, measured_tokens_per_s: float | None = None) -> str:
        """One line: what the plan decided, its prediction (beside a measured speed, when given)
        and the binding resource."""
        moe = [l for l in self.layers if l.kind == "moe"]
        sliced = [l for l in self.layers if l.kind == "dense" and l.r_gg < 1 - 1e-9 and self.fast_tier == "gpu"]
        if self.flexgen:
            what = f"FlexGen policy {self.flexgen['policy']}"
        elif moe:
            what = (f"{self.resident_experts()} of {sum(l.experts_gpu + l.experts_cpu + l.experts_disk for l in moe)} "
                    f"experts resident on the {self.fast_tier}, {self.expert_cache_slots} cache slots")
        elif sliced:
            n = len(sliced)
            what = (f"{n} of {len(self.layers)} FFNs sliced (mean r_CC {sum(l.r_cc for l in sliced) / n:.2f}, "
                    f"r_CG {sum(l.r_cg for l in sliced) / n:.2f}, r_GG {sum(l.r_gg for l in sliced) / n:.2f})")
        else:
            what = f"every weight on the {self.fast_tier}"
        speed = (f"throughput {self.predicted_throughput_tokens_per_s:.1f} tok/s" if self.flexgen else
                 f"decode {self.predicted_decode_tokens_per_s:.1f} tok/s")
        if measured_tokens_per_s is not None:
            speed += f" (measured {measured_tokens_per_s:.1f})"
        return f"plan ({self.profile}): {what}; predicted {speed}; binding: {self.binding}"

    def resident_experts(self) -> int:
        """Experts the plan makes resident on its fast tier (the GPU, or CPU RAM without one)."""
        return sum(l.experts_gpu if self.fast_tier == "gpu" else l.experts_cpu for l in self.layers if l.kind == "moe")

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json())

    @classmethod
    def load(cls, path: str | Path) -> "Plan":
        """Read a saved plan. Raises ConfigError when unreadable."""
        try:
            d = json.loads(Path(path).read_text())
            d["layers"] = [LayerPlan(**l) for l in d["layers"]]
            return cls(**d)
        except (OSError, ValueError, TypeError, KeyError) as e:
            raise ConfigError(f"cannot read plan {path} ({e})", "write one with `tiered plan --json > FILE`") from None

    def render(self) -> str:
        """A one-screen text summary: header, per-layer table (runs of equal layers folded), totals."""
        gm = format_bytes(self.gpu_memory) if self.gpu_memory else "none"
        cm = format_bytes(self.cpu_memory) if self.cpu_memory else "unlimited"
        out = [f"plan for {self.model} — goal: {self.goal}, profile: {self.profile}",
               f"budgets: GPU {gm}, CPU {cm}; prompt {self.prompt_tokens} tokens, {self.gen_tokens} generated; "
               f"weights {self.precision}; KV cache on {self.kv_cache_tier}, attention on {self.attention_tier}"]
        if self.flexgen:
            f = self.flexgen
            out.append(f"FlexGen policy {f['policy']}: GPU batch {f['gpu_batch_size']} x {f['num_gpu_batches']} batches; "
                       f"weights/KV/activations on (GPU, CPU, disk) = {_pct(f['weights'])} / {_pct(f['cache'])} / "
                       f"{_pct(f['activations'])}")
        else:
            out.append("layers     FFN      r_CC  r_CG  r_GG   n_g  experts GPU/CPU/disk  decode ms  prefill ms")
            for group in _runs(self.layers):
                l = group[0]
                span = f"{l.layer}" if len(group) == 1 else f"{l.layer}-{group[-1].layer}"
                experts = f"{l.experts_gpu}/{l.experts_cpu}/{l.experts_disk}" if l.kind == "moe" else "-"
                out.append(f"{span:<10} {l.kind:<8} {l.r_cc:5.2f} {l.r_cg:5.2f} {l.r_gg:5.2f} {l.n_g:5d}  "
                           f"{experts:>19}  {l.decode_s * 1e3:9.2f}  {l.prefill_s * 1e3:10.2f}")
        if self.dispatch_threshold_tokens is not None:
            s = self.dispatch_threshold_tokens
            out.append(f"dispatch: a non-resident expert runs on the CPU when it has <= {s:.1f} tokens, "
                       f"else its weights are copied to the GPU (Fiddler Alg. 1)")
        if self.expert_cache_slots:
            out.append(f"expert cache: {self.expert_cache_slots} slots on the {self.fast_tier} for experts that are not resident")
        mem = ", ".join(f"{k} {format_bytes(v)}" for k, v in self.memory.items())
        out.append(f"memory: {mem}")
        if self.predicted_throughput_tokens_per_s is not None:
            out.append(f"predicted: throughput {self.predicted_throughput_tokens_per_s:.2f} tokens/s")
        else:
            out.append(f"predicted: TTFT {self.predicted_ttft_s:.3f} s, decode {self.predicted_decode_tokens_per_s:.2f} tokens/s")
        out.append(f"binding: {self.binding}")
        out.extend(f"note: {n}" for n in self.notes)
        return "\n".join(out)


def _pct(t) -> str:
    return "(" + ", ".join(f"{100 * x:.0f}%" for x in t) + ")"


def _runs(layers: list[LayerPlan]) -> list[list[LayerPlan]]:
    """Fold consecutive layers whose plan rows print the same."""
    def row(l: LayerPlan) -> tuple:
        return (l.kind, round(l.r_cc, 2), round(l.r_cg, 2), round(l.r_gg, 2), l.n_g, l.experts_gpu, l.experts_cpu,
                l.experts_disk, round(l.decode_s * 1e3, 2), round(l.prefill_s * 1e3, 2))
    return [list(g) for _, g in itertools.groupby(layers, key=row)]


# --------------------------------------------------------------------------------------------
def _non_ffn_bytes(cfg: ModelConfig, bpe: float) -> float:
    d, L = cfg.hidden_size, cfg.num_hidden_layers
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    attn = L * (2 * d * q + 2 * d * kv)
    emb = cfg.vocab_size * d * (1 if cfg.tie_word_embeddings else 2)
    router = L * d * cfg.num_experts if cfg.is_moe else 0
    shared = L * 3 * d * cfg.shared_expert_intermediate_size
    return (attn + emb + router + shared) * bpe + L * 2 * d * 4


def _kv_bytes(cfg: ModelConfig, tokens: int, bpe: float = 2.0) -> float:
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * tokens * bpe


def _kv_bpe(precision: str) -> float:
    """KV-cache bytes per element: the compute dtype (fp32, else 16-bit activations)."""
    return 4.0 if precision == "fp32" else 2.0


def _attention_time(cfg: ModelConfig, profile: HardwareProfile, device: str, precision: str, tokens: int,
                    context: int) -> float:
    """One layer's attention projections + attention over `context` cached positions [s]."""
    d = cfg.hidden_size
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    w = 2 * d * q + 2 * d * kv
    proj = op_time.gemm_time(profile, device, precision, tokens * w, w * PRECISION_BYTES[precision], calls=4)
    macs = 2 * tokens * context * q
    attn = op_time.attention_time(profile, device, precision, macs, _kv_bytes(cfg, context) / cfg.num_hidden_layers)
    return proj + attn + 6 * op_time.launch_time(profile, device)


def make_plan(cfg: ModelConfig, profile: HardwareProfile, *, model_name: str = "", gpu_memory: int | None = None,
              cpu_memory: int | None = None, goal: str = "latency", prompt_tokens: int = 512, gen_tokens: int = 128,
              precision: str = "bf16", context_tokens: int | None = None, popularity=None,
              committed: dict | None = None, expert_cache_slots: int | None = None,
              max_resident: int | None = None) -> Plan:
    """Plan `cfg` on `profile` within the budgets (None = the profile's capacities).

    Args:
        context_tokens: KV-cache positions to keep room for [tokens] (default prompt + generated);
            the engine passes its max_context, the room its runtime reserves.
        popularity: float [L, E] tokens routed per expert (`tiered profile-experts`): the most
            popular experts are made resident, and cache hit rates are simulated on routing drawn
            from it (uniform when None).
        committed: tier ("gpu" / "cpu") -> bytes the engine has already committed there outside the
            FFN / experts (weights it has loaded, decode copies, the KV-cache room), measured: it
            replaces the planner's own estimate of those bytes and its 5% safety margin.
        expert_cache_slots, max_resident: fixed by the user (None = the planner chooses: a cache of
            up to one layer's experts, then as many resident experts as fit).

    Raises:
        ConfigError: unknown goal or precision, or a cost model the profile lacks.
        BudgetError: the budgets cannot hold what the goal needs on the GPU.
    """
    if goal not in ("latency", "throughput"):
        raise ConfigError(f"goal must be latency or throughput, got {goal!r}", "pass --goal latency|throughput")
    if precision not in PRECISION_BYTES:
        raise ConfigError(f"precision must be one of {sorted(PRECISION_BYTES)}", "pass e.g. --precision bf16")
    gpu = gpu_memory if gpu_memory is not None else profile.gpu_memory
    cpu = cpu_memory if cpu_memory is not None else profile.cpu_memory
    plan = Plan(model_name or cfg.model_type, goal, profile.name, gpu, cpu, prompt_tokens, gen_tokens, precision)
    plan.context_tokens = context_tokens or prompt_tokens + gen_tokens
    plan.committed = dict(committed or {})
    experts = _ExpertChoices(popularity, expert_cache_slots, max_resident)
    if goal == "throughput":
        return _throughput(plan, cfg, profile, gpu, cpu)
    if not op_time.has_device(profile, "gpu") or not gpu:
        plan.fast_tier = "cpu"
        return _cpu_latency(plan, cfg, profile, cpu, experts)
    if cfg.is_moe:
        return _moe_latency(plan, cfg, profile, gpu, cpu, experts)
    return _dense_latency(plan, cfg, profile, gpu, cpu)


@dataclass(frozen=True)
class _ExpertChoices:
    """What shapes an expert placement besides bytes: popularity float [L, E] (None = uniform),
    and the user's fixed cache slots / resident cap (None = the planner chooses)."""

    popularity: object = None
    cache_slots: int | None = None
    max_resident: int | None = None


def _dense_latency(plan: Plan, cfg: ModelConfig, profile: HardwareProfile, gpu: int, cpu: int | None) -> Plan:
    from tiered.planner.cost_model import LayerShape, cost_params, decode_layer_time, prompt_layer_time
    from tiered.planner.scheinfer import assign_gpu_memory, ffn_gpu_budget, solve_n_g

    bpe = PRECISION_BYTES[plan.precision]
    M, H, L = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    ctx = plan.prompt_tokens + plan.gen_tokens
    non_ffn, kv = _non_ffn_bytes(cfg, bpe), _kv_bytes(cfg, plan.context_tokens, _kv_bpe(plan.precision))
    staging = 2 * 3 * M * H * bpe  # double-buffered CG slices of the largest FFN
    if "gpu" in plan.committed:  # measured by the engine: exact, no margin
        non_ffn, kv = plan.committed["gpu"], 0.0
    budget = ffn_gpu_budget(gpu, non_ffn_bytes=non_ffn, kv_cache_bytes=kv, staging_bytes=staging,
                            margin=0.0 if "gpu" in plan.committed else 0.05)
    decode_shape = LayerShape(1, M, H, 3, bpe)
    params = cost_params(profile, plan.precision, decode_shape)
    assign = assign_gpu_memory([decode_shape] * L, params, budget)
    prompt_shape = LayerShape(plan.prompt_tokens, M, H, 3, bpe)
    pparams = cost_params(profile, plan.precision, prompt_shape)
    attn_dec = _attention_time(cfg, profile, "gpu", plan.precision, 1, ctx)
    attn_pre = _attention_time(cfg, profile, "gpu", plan.precision, plan.prompt_tokens, plan.prompt_tokens)
    ffn_gpu_bytes = 0.0
    for i, rates in enumerate(assign.rates):
        tok = solve_n_g(prompt_shape, rates, pparams)
        plan.layers.append(LayerPlan(i, "dense", plan.precision, rates.r_cc, rates.r_cg, rates.r_gg, tok.n_g,
                                     decode_s=decode_layer_time(decode_shape, rates, params) + attn_dec,
                                     prefill_s=prompt_layer_time(prompt_shape, rates, tok.n_g, pparams) + attn_pre))
        ffn_gpu_bytes += rates.r_gg * 3 * M * H * bpe
    head = op_time.gemm_time(profile, "gpu", plan.precision, M * cfg.vocab_size, M * cfg.vocab_size * bpe)
    decode = sum(l.decode_s for l in plan.layers) + head
    plan.predicted_decode_tokens_per_s = 1.0 / decode
    plan.predicted_ttft_s = sum(l.prefill_s for l in plan.layers) + head
    ffn_total = L * 3 * M * H * bpe
    plan.memory = {"gpu": non_ffn + kv + staging + ffn_gpu_bytes, "cpu": ffn_total - ffn_gpu_bytes}
    mean_cc = sum(l.r_cc for l in plan.layers) / L
    if ffn_gpu_bytes >= ffn_total - 1:
        plan.binding = "GPU compute: every FFN fits on the GPU"
    elif mean_cc > 0.5:
        plan.binding = (f"GPU memory: {format_bytes(budget)} for FFN weights holds {ffn_gpu_bytes / ffn_total:.0%} of them; "
                        f"the CPU computes {mean_cc:.0%} of the rest's rows (CPU GEMM bound)")
    else:
        plan.binding = (f"GPU memory and PCIe: {ffn_gpu_bytes / ffn_total:.0%} of FFN weights resident, "
                        f"the rest split between CPU compute and H2D copies")
    return plan


def _moe_latency(plan: Plan, cfg: ModelConfig, profile: HardwareProfile, gpu: int, cpu: int | None,
                 experts: _ExpertChoices = _ExpertChoices()) -> Plan:
    from tiered.planner.fiddler import ExpertLatency, ExpertShape

    bpe = PRECISION_BYTES[plan.precision]
    L, E, k = cfg.num_hidden_layers, cfg.num_experts, cfg.num_experts_per_tok
    moe_layers = [i for i in range(L) if cfg.is_moe_layer(i)]
    ctx = plan.prompt_tokens + plan.gen_tokens
    non_expert = _non_ffn_bytes(cfg, bpe) + (L - len(moe_layers)) * 3 * cfg.hidden_size * cfg.intermediate_size * bpe
    kv = _kv_bytes(cfg, plan.context_tokens, _kv_bpe(plan.precision))
    shape = ExpertShape.from_config(cfg)
    lat = ExpertLatency(profile, shape, plan.precision, plan.precision)
    expert_bytes = shape.weight_bytes(plan.precision)
    workspace = 2 * expert_bytes  # staging for copied experts
    if "gpu" in plan.committed:  # measured by the engine: exact, no margin
        non_expert, kv = plan.committed["gpu"], 0.0
        free = gpu - non_expert - workspace
    else:
        free = gpu * 0.95 - non_expert - kv - workspace
    if free < 0:
        from tiered.errors import BudgetError
        raise BudgetError(f"GPU budget {format_bytes(gpu)} cannot hold the non-expert weights "
                          f"({format_bytes(non_expert)}), KV cache ({format_bytes(kv)}) and staging",
                          f"raise --gpu-mem by {format_bytes(-free)}")
    total = len(moe_layers) * E
    cpu_room = (cpu - plan.committed.get("cpu", 0) - 2 * expert_bytes) if cpu else float("inf")
    placement, hits = _place_experts(plan, cfg, moe_layers, expert_bytes, free, max(cpu_room, 0.0), experts)
    n_gpu, n_cpu, n_disk = (placement.count(t) for t in ("fast", "cpu", "disk"))
    thr = lat.threshold()
    plan.dispatch_threshold_tokens = thr
    disk = profile.models.get("disk/read_cold")
    t_disk = disk(expert_bytes) if disk is not None else 0.0

    def layer_time(tokens: int, h: float, d_share: float) -> float:
        # tokens routed per active expert (uniform), the experts a step touches, Fiddler makespan (gap F1);
        # h: share of the active experts found on the GPU (resident or cached), d_share: misses read from disk
        active = min(E, max(k, math.ceil(E * (1 - (1 - k / E) ** tokens))))
        s = max(1, math.ceil(tokens * k / active))
        res, miss = active * h, active * (1 - h)
        gpu_side = res * lat.gpu_lat(s)
        cpu_side = 0.0
        if lat.cpu_wins(s):
            cpu_side = miss * lat.cpu_lat(s)
        else:
            gpu_side += miss * (lat.gpu_lat(s) + lat.transfer_lat())
        return max(gpu_side, cpu_side) + miss * d_share * t_disk

    attn_dec = _attention_time(cfg, profile, "gpu", plan.precision, 1, ctx)
    attn_pre = _attention_time(cfg, profile, "gpu", plan.precision, plan.prompt_tokens, plan.prompt_tokens)
    for i in moe_layers:
        g, c, d = (placement.count(t, i) for t in ("fast", "cpu", "disk"))
        res, cached = hits.rates(i)
        d_share = d / max(c + d, 1)
        plan.layers.append(LayerPlan(i, "moe", plan.precision, experts_gpu=g, experts_cpu=c, experts_disk=d,
                                     r_cc=0.0, r_cg=0.0, r_gg=g / E,
                                     decode_s=layer_time(1, res + cached, d_share) + attn_dec,
                                     prefill_s=layer_time(plan.prompt_tokens, g / E, d_share) + attn_pre))
    head = op_time.gemm_time(profile, "gpu", plan.precision, cfg.hidden_size * cfg.vocab_size,
                             cfg.hidden_size * cfg.vocab_size * bpe)
    plan.predicted_decode_tokens_per_s = 1.0 / (sum(l.decode_s for l in plan.layers) + head)
    plan.predicted_ttft_s = sum(l.prefill_s for l in plan.layers) + head
    plan.memory = {"gpu": non_expert + kv + workspace + (n_gpu + placement.cache_slots) * expert_bytes,
                   "cpu": n_cpu * expert_bytes, "disk": n_disk * expert_bytes}
    h = hits.fast_share()
    path = "CPU compute" if lat.cpu_wins(1) else "H2D copies"
    plan.binding = (f"GPU memory: {n_gpu}/{total} experts resident and {placement.cache_slots} cache slots "
                    f"(hit rate {h:.0%}) beside the non-expert weights and KV cache; "
                    f"each decode step's missing experts go to {path} (s* = {thr:.1f} tokens)"
                    + (f"; {n_disk} experts do not fit in CPU RAM and are read from disk" if n_disk else ""))
    _popularity_note(plan, experts.popularity)
    return plan


def _throughput(plan: Plan, cfg: ModelConfig, profile: HardwareProfile, gpu, cpu) -> Plan:
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


def _place_experts(plan: Plan, cfg: ModelConfig, moe_layers: list[int], expert_bytes: float, fast_free: float,
                   cpu_free: float | None, experts: _ExpertChoices):
    """The runtime's own placement (memory/placement.py: Fiddler §3.4 with the expert cache carved
    out first) on the planner's byte counts, and the hit shares its resident set and cache get on a
    routing trace drawn from the popularity (cpu_predict.simulate_hits). Sets plan.expert_cache_slots.

    Raises BudgetError when the fast tier has no room left for experts at all.
    """
    from tiered.errors import BudgetError
    from tiered.memory.placement import plan_expert_placement
    from tiered.planner.cpu_predict import routing_trace, simulate_hits

    if fast_free < 0:
        raise BudgetError(f"the {plan.fast_tier} budget is {format_bytes(-fast_free)} short of the non-expert "
                          "weights, KV cache and staging buffers", f"raise --{plan.fast_tier}-mem or lower --max-context")
    E, k = cfg.num_experts, cfg.num_experts_per_tok
    placement = plan_expert_placement(moe_layers, E, int(expert_bytes), fast_free, cpu_free, experts.popularity,
                                      cache_slots=experts.cache_slots, max_resident=experts.max_resident)
    resident = {key for key, tier in placement.tiers.items() if tier == "fast"}
    trace = routing_trace(moe_layers, E, k, max(plan.gen_tokens, 64), experts.popularity)
    plan.expert_cache_slots = placement.cache_slots
    return placement, simulate_hits(trace, resident, placement.cache_slots)


def _popularity_note(plan: Plan, popularity) -> None:
    if popularity is None:
        plan.notes.append("expert popularity assumed uniform; `tiered profile-experts` + --expert-profile places the "
                          "most popular experts on the fast tier (Fiddler §3.4)")
    else:
        plan.notes.append("resident experts chosen by popularity from the expert profile (Fiddler §3.4)")


def _major(t) -> str:
    return ("gpu", "cpu", "disk")[max(range(3), key=lambda i: t[i])]


def _cpu_latency(plan: Plan, cfg: ModelConfig, profile: HardwareProfile, cpu: int | None,
                 experts: _ExpertChoices = _ExpertChoices()) -> Plan:
    """No GPU: CPU RAM is the fast tier, disk the slow one (what `run --accelerator none` does).

    Non-expert weights and the KV cache go to RAM; the RAM left holds whole experts (uniform
    popularity: each layer gets an equal share), the rest are read from disk per use. Decode time
    comes from planner/cpu_predict.py with resident shares for hit rates (no cache credit).
    """
    from tiered.planner.cpu_predict import HitStats, predict_decode

    # decode weights may be int4/int8 (GGUF blocks kept packed); otherwise fp32 or 16-bit
    dtype = plan.precision if plan.precision in ("fp32", "bf16", "int4", "int8") else "bf16"
    plan.precision = dtype
    bpe = PRECISION_BYTES[dtype]
    ctx = plan.prompt_tokens + plan.gen_tokens
    L = cfg.num_hidden_layers
    moe = [i for i in range(L) if cfg.is_moe and cfg.is_moe_layer(i)]
    dense_ffn = (L - len(moe)) * 3 * cfg.hidden_size * cfg.intermediate_size * bpe
    fixed = plan.committed.get("cpu", _non_ffn_bytes(cfg, bpe) + dense_ffn + _kv_bytes(cfg, plan.context_tokens, bpe))
    plan.kv_cache_tier = plan.attention_tier = "cpu"
    if cpu is not None and fixed > cpu:
        from tiered.errors import BudgetError
        raise BudgetError(f"CPU budget {format_bytes(cpu)} cannot hold the non-expert weights and KV cache "
                          f"({format_bytes(fixed)})", f"raise --cpu-mem by {format_bytes(fixed - cpu)}")
    hits = None
    memory = {"cpu": fixed}
    if moe:
        E = cfg.num_experts
        eb = 3 * cfg.hidden_size * cfg.moe_intermediate_size * bpe
        staging = 2 * eb
        room = float("inf") if cpu is None else cpu - fixed - staging
        placement, hits = _place_experts(plan, cfg, moe, eb, room, None, experts)
        total = placement.count("fast")
        memory = {"cpu": fixed + staging + (total + placement.cache_slots) * eb, "disk": (E * len(moe) - total) * eb}
    layers, step = predict_decode(cfg, profile, dtype, context=ctx, hits=hits)
    for i, (attn, ffn) in enumerate(layers):
        lp = LayerPlan(i, "moe" if i in moe else "dense", dtype, r_cc=1.0, r_cg=0.0, r_gg=0.0, decode_s=attn + ffn)
        if i in moe:
            lp.experts_gpu, lp.experts_cpu, lp.experts_disk = 0, placement.count("fast", i), placement.count("disk", i)
        plan.layers.append(lp)
    plan.predicted_decode_tokens_per_s = 1.0 / step
    prefill_macs = plan.prompt_tokens * (cfg.num_parameters() if not moe else
                                         cfg.num_parameters() * cfg.num_experts_per_tok / max(cfg.num_experts, 1))
    plan.predicted_ttft_s = op_time.gemm_time(profile, "cpu", dtype, prefill_macs, 0.0, calls=7 * L)
    plan.memory = memory
    disk_share = 1.0 - hits.fast_share() if hits else 0.0
    plan.binding = ("CPU memory bandwidth: every weight is read from RAM once per token" if not disk_share else
                    f"disk reads: {disk_share:.0%} of expert uses miss RAM (resident experts and "
                    f"{plan.expert_cache_slots} cache slots) and are read from disk")
    plan.notes.append("no GPU in this profile: CPU RAM is the fast tier, disk the slow one")
    if moe:
        _popularity_note(plan, experts.popularity)
    return plan
