"""Plan: every decision the runtime takes, as data — printable, saved, loaded and replayed.

The planner's goal modules fill it (latency_dense.py: ScheInfer slicing; latency_moe.py: Fiddler
placement and dispatch; latency_cpu.py: CPU + disk; throughput.py: FlexGen's LP), `rules.py` fills
it from the runtime's plain rules (`--plan off`), and `Plan.load` replays a saved one bit for bit.
memory/ applies it (weights, experts, cache, slices) and runtime/ consumes it (dispatch, threads,
staging); neither re-derives a decision. Times in seconds, memory in bytes, speeds in tokens/s.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tiered.errors import ConfigError
from tiered.hardware.budget import format_bytes

# the most positions one engine step writes for a sequence besides its prompt rows: a decode burst's or a
# structured output's forced tokens (engine/llm.BURST_MAX, FORCED_TOKENS), a speculative draft's
STEP_TOKENS = 64
DISPATCH_MODES = ("balanced", "priced", "per-expert", "copy", "cpu", "split")


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
    expert_tiers: list[str] = field(default_factory=list)  # MoE: home tier of each expert ("fast"|"cpu"|"disk")


@dataclass
class Plan:
    """A whole-model plan. Times in seconds, memory in bytes, throughput in tokens/s.

    Decisions the runtime applies (nothing else decides them):
        layers[i].r_cc / r_cg / r_gg / n_g   ScheInfer slicing of dense FFNs (fast_tier "gpu")
        layers[i].expert_tiers               home tier of each expert: "fast", "cpu" or "disk"
        expert_cache_slots, cache_policy     the fast-tier expert cache (memory/expert_cache.POLICIES)
        prefetch, prefetch_lookahead         HOBBIT's expert prefetch from stacked next-layer gates,
                                             p MoE layers ahead (runtime/prefetch.py)
        expert_bytes                         bytes of one expert in dtypes["experts"]
        dispatch_mode, dispatch_latency      where a non-resident expert runs (Fiddler Alg. 1):
                                             "balanced" splits a layer's misses between the CPU and
                                             the H2D link so both finish together (latency model
                                             fields of runtime/dispatcher.LatencyModel), a layer's
                                             single dense miss split by rows between them when that
                                             is faster (SPLIT); "priced" is balanced without its
                                             margins (dispatcher.MIX_GAIN, SPLIT_GAIN: the latency
                                             model's fastest assignment, to measure the margins);
                                             "copy" / "cpu" / "split" send every miss one way
        dtypes                               formats: "weights" (compute dtype of loaded weights),
                                             "experts", "kv_cache", "decode" (decode-copy format,
                                             "none" = no copies), "lm_head" (its decode copy's
                                             format where it differs from `precision`: a GGUF
                                             file's Q8_0 embedding), "prompt_attention" (a CPU
                                             plan's: what steps of 2+ tokens attend in through
                                             the modules, the KV cache's bf16 where faster than
                                             the fp32 activations': latency_cpu.prompt_attention),
                                             "prompt_ffn" (a CPU plan's: what a prompt's dense
                                             FFN runs its intermediate in between one-copy int4
                                             projections that dequantize for bf16 GEMMs:
                                             latency_cpu.prompt_ffn);
                                             decode_threshold: steps of at
                                             most this many rows use the decode copies; int4_layout:
                                             their int4 layout ("tiled": tiered's kernels, "cpu":
                                             torch's int4pack); batch_act:
                                             activations of int4 decode copies in steps of 2+ rows
                                             ("q8" or "bf16"; batch 1 reads bf16); expert_act:
                                             routed int4 experts' activations at batch 1
        mixed_precision, expert_cache_slots_low
                                             HOBBIT mixed precision (ALGORITHMS.md §3): None, or
                                             {"high", "low", "t1", "t2"}: each offloaded expert
                                             also has a dtypes["experts_low"] copy on its slow
                                             tier; a miss loads high / low / nothing by the
                                             token's unimportance score; low copies are cached in
                                             their own pool of expert_cache_slots_low slots
        context_tokens, kv_slots             KV-cache positions reserved for each of kv_slots sequences
        kv_window                            the sliding layers' KV keeps each sequence's window only (a
                                             cache in RAM: KVCache.forget, EngineConfig.sliding_kv); the
                                             figures count them so (kv_advance)
        cpu_threads                          torch intra-op threads for CPU compute (0 = leave as is)
        staging_buffers, read_ahead          expert staging ring size; issue a layer's reads at once
        decode_graphs                        capture decode steps as CUDA graphs (every weight on
                                             the GPU, no slices; MoE: every expert resident at full
                                             precision, computed by grouped GEMMs: runtime/graphs.py)
        piecewise_graphs                     capture each layer's attention as a graph and run the
                                             MLPs (expert runner, sliced FFNs) eagerly between
                                             replays (attention on the GPU, some weights off it)
        fused_projections                    q/k/v and each dense MLP's gate/up as one GEMM on the
                                             GPU (runtime/install.fuse_projections)
        dense_copies                         keep the dense weights beside the decode copies (prefill
                                             runs on them; lossless in fp32). False: each weight's
                                             one copy is its decode copy, which serves every step
        cpu_decode_step                      run CPU decode steps of at most native_step_rows() rows
                                             through runtime/cpu_decode.CPUDecodeStep (fused kernels,
                                             ~30 torch ops per layer) instead of the modules
        native_decode                        run that step in C++ (tiered/kernels, built by setup):
                                             only the weight kernels remain of the torch ops
        decode_bursts                        LLM._burst: a lone sequence of generate / stream decodes
                                             several tokens per native call (the native step's)
        shared_prefixes                      LLM.step: prompts admitted together that share a prefix
                                             prefill it once, the followers in one more forward
                                             (engine/scheduler.SharedPrefixes): where that forward
                                             moves no weights (weights_stay_put)
        mixed_rows                           LLM.step: an admitted sequence runs its uncached
                                             prompt tokens as rows of the native decode step,
                                             beside the running sequences, while the step has at
                                             most this many rows (Sarathi-style mixed prefill and
                                             decode); longer prompts, and 0, prefill on their own,
                                             chunk by chunk as such rows where this reaches
                                             prefill_chunk (LLM._prefill). A CPU plan prices both
                                             paths past the ISA's floor (latency_cpu.priced_mixed_rows)
        expert_group_rows                    rows of one tiled int4 CPU expert up to which a prompt
                                             runs it as the native kernel's groups of 8 rows, past
                                             them on the AMX GEMM (ExpertFormat.grouped_rows; the
                                             native step's experts decide by the average: set_moe's
                                             amx_rows): cpu_predict.priced_group_rows where below
                                             the kernel tuning's; 0: the tuning's
        speculative                          speculative decoding (engine/speculative.py): "off",
                                             "ngram" (prompt lookup: drafts copied from the context) or
                                             "draft" (a draft model's), verified as rows of the
                                             sequence's decode step
        speculative_tokens                   most draft tokens a sequence proposes a step (0: off)
        prompt_lookup                        (min, max) n-gram sizes the lookup tries
        speculative_costs                    priced time of a decode step of 1 + k rows of one
                                             sequence relative to one row, k = 0..speculative_tokens
                                             (latency_cpu.speculative_costs); LLM.step drafts the k
                                             with the most expected tokens a unit of time at the
                                             sequence's acceptance (speculative.draft_length); None:
                                             unpriced, every draft as long as it comes
        prefill_chunk                        prompt tokens one prefill forward takes at most: a longer
                                             prompt prefills alone, chunk by chunk, each chunk
                                             attending to the KV cache the earlier ones wrote (the
                                             tokens workspace_bytes was sized for); 0 = whole prompts
        pinned                               how a CUDA accelerator pins the weights kept in RAM:
                                             "cuda" (cudaHostAlloc) where dense FFNs are sliced,
                                             "huge" (registered huge pages) otherwise
                                             (planner/auto.pinned_memory)
        device_issue                         who issues device work on CUDA (H2D copies from
                                             page-locked RAM, a sliced FFN's GPU GEMMs): "thread"
                                             (the layer's own, before its CPU work, where nothing
                                             it waits for is pending) or "worker" (the streams'
                                             worker threads)
        source                               who decided: "planner", "rules" (plan off) or a file

    Pricing inputs recorded beside the decisions:
        precision, precision_mix             the format the time models price the weights in; on
                                             the CPU's decode copies, the shares of the layers'
                                             projection elements by copy precision where they mix
                                             (quant/linear.decode_mix: a Q4_K_M file's Q6_K
                                             tensors keep bf16 copies beside int4), None = all
                                             `precision`
    """

    model: str
    goal: str
    profile: str
    gpu_memory: int | None
    cpu_memory: int | None
    prompt_tokens: int
    gen_tokens: int
    precision: str
    layers: list[LayerPlan] = field(default_factory=list)
    precision_mix: dict | None = None  # decode-copy precision -> share of the layers' projection elements
    kv_cache_tier: str = "gpu"
    attention_tier: str = "gpu"
    fast_tier: str = "gpu"  # where resident experts / GG slices live: "gpu", or "cpu" when there is no GPU
    context_tokens: int = 0  # KV-cache positions the memory figures keep room for, per sequence
    kv_slots: int = 1  # sequences whose KV cache the memory figures keep room for (serve's --max-batch)
    committed: dict = field(default_factory=dict)  # tier -> bytes the engine already holds there (exact)
    dispatch_threshold_tokens: float | None = None
    expert_cache_slots: int = 0
    predicted_ttft_s: float = 0.0
    predicted_decode_tokens_per_s: float = 0.0
    # decode tokens/s of all kv_slots sequences together (each at the priced context): a server's full
    # step, priced where the plan is the CPU's (planner/cpu_predict.predict_decode's `batch`); else None
    predicted_batch_decode_tokens_per_s: float | None = None
    predicted_throughput_tokens_per_s: float | None = None
    # seconds to prefill kv_slots prompts of prompt_tokens admitted together, grouped as the engine groups them
    # (planner/latency_cpu.block_prefill_time: the throughput goal's block); None: kv_slots x predicted_ttft_s
    predicted_block_prefill_s: float | None = None
    # generated tokens/s of a known workload's requests (EngineConfig.requests: a batch file's lengths) replayed
    # through kv_slots slots as the engine's continuous batching runs them (planner/batch_sim); None: not given
    predicted_requests_tokens_per_s: float | None = None
    memory: dict = field(default_factory=dict)  # tier -> bytes
    binding: str = ""
    notes: list[str] = field(default_factory=list)
    flexgen: dict | None = None
    expert_bytes: int = 0
    workspace_bytes: int = 0  # fast-tier room kept for a prefill chunk's activations (memory/sizes.workspace_bytes)
    expected_hit_rate: float | None = None  # popularity share of the resident experts (Fiddler's "hit")
    cache_policy: str = "lru"
    prefetch: bool = False
    prefetch_lookahead: int = 2
    dispatch_mode: str = "balanced"
    dispatch_latency: dict | None = None
    dtypes: dict = field(default_factory=dict)
    cpu_threads: int = 0
    staging_buffers: int = 2
    read_ahead: bool = True
    decode_threshold: int = 8
    batch_act: str = "bf16"
    expert_act: str = "bf16"
    int4_layout: str = "cpu"
    decode_graphs: bool = False
    piecewise_graphs: bool = False
    fused_projections: bool = False
    cpu_decode_step: bool = False
    native_decode: bool = False
    decode_bursts: bool = False
    shared_prefixes: bool = False
    mixed_rows: int = 0
    expert_group_rows: int = 0
    speculative: str = "off"
    speculative_tokens: int = 0
    prompt_lookup: list[int] = field(default_factory=lambda: [2, 4])
    speculative_costs: list[float] | None = None
    prefill_chunk: int = 0
    kv_window: bool = False
    dense_copies: bool = True
    mixed_precision: dict | None = None
    expert_cache_slots_low: int = 0
    pinned: str = "huge"
    device_issue: str = "thread"
    source: str = "planner"

    def kv_advance(self) -> int | None:
        """KVCache's `advance` (and memory/sizes.kv_cache_bytes') for this plan's KV cache: the most positions a
        sequence writes between two forgets (LLM.step forgets after each step and each prefill chunk: a chunk, a
        step's prompt rows, or the whole context without chunks; at least a burst's or a draft's tokens) where the
        sliding layers forget behind their window (kv_window); None where every position is kept."""
        if not self.kv_window:
            return None
        return max(self.prefill_chunk or self.context_tokens, self.mixed_rows, STEP_TOKENS)

    def summary(self, measured_tokens_per_s: float | None = None, measured_positions: int | None = None,
                predicted_at_positions: float | None = None) -> str:
        """One line: what the plan decided, its prediction (beside a measured speed, when given)
        and the binding resource.

        Args:
            measured_tokens_per_s: a run's decode speed to show beside the prediction.
            measured_positions: the mean cached positions of that run's decode steps (prompt plus
                half the generated tokens): shown beside the positions the prediction priced
                (prompt_tokens + gen_tokens), since a decode step's attention grows with them.
            predicted_at_positions: the plan's decode speed [tokens/s] priced at measured_positions
                (LLM.predicted_decode_at), shown beside the planned figure.
        """
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
        if self.source == "rules":
            speed = "nothing (no cost model)"
        priced = self.prompt_tokens + self.gen_tokens
        positions = measured_positions is not None and self.source != "rules" and not self.flexgen and priced > 0
        if positions:
            speed += f" at {priced} positions"
            if predicted_at_positions is not None and measured_positions != priced:
                speed += f", {predicted_at_positions:.1f} at {measured_positions}"
        if measured_tokens_per_s is not None:
            speed += f" (measured {measured_tokens_per_s:.1f}" + (f" at {measured_positions})" if positions else ")")
        if self.predicted_batch_decode_tokens_per_s is not None and self.source != "rules":
            speed += f"; {self.predicted_batch_decode_tokens_per_s:.1f} tok/s over {self.kv_slots} sequences at once"
        if self.goal == "throughput" and not self.flexgen and self.predicted_throughput_tokens_per_s:
            speed += f"; throughput {self.predicted_throughput_tokens_per_s:.1f} generated tok/s, prefills included"
        src = {"planner": self.profile, "rules": "runtime rules"}.get(self.source, f"{self.source}, {self.profile}")
        return f"plan ({src}): {what}; predicted {speed}; binding: {self.binding}"

    def resident_experts(self) -> int:
        """Experts the plan makes resident on its fast tier (the GPU, or CPU RAM without one)."""
        return sum(l.experts_gpu if self.fast_tier == "gpu" else l.experts_cpu for l in self.layers if l.kind == "moe")

    def most_prompt_rows(self) -> int:
        """Most prompt rows one native decode step takes (LLM._mixed_prefills, eval/kl): mixed_rows within the
        prefill chunk (the rows its workspace holds); 0: prompts never run as rows."""
        return min(self.mixed_rows, self.prefill_chunk or self.mixed_rows)

    def native_step_rows(self) -> int:
        """Most sequences a decode step runs through the CPU decode step (LLM._forward), the modules beyond:
        decode_threshold, or the prompt rows the plan runs through that step where more (Plan.most_prompt_rows: the
        rows it priced cheaper there than through the modules; a decode row is one such row over its own cache).
        `generate` of a list under the latency goal steps more sequences than the plan's kv_slots (which
        decode_threshold covers): SmolLM2's 32 and 128 sequences had stepped through the modules at 406 and 689-731
        generated tok/s, through the step at 551-584 and 829-849 (2 AMX cores, 2026-12-05)."""
        return max(self.decode_threshold, self.most_prompt_rows())

    def chunks_as_rows(self) -> bool:
        """Whether a prompt past the prefill chunk runs chunk by chunk as rows of the native decode step
        (LLM._prefill): the mixed rows reach a whole chunk."""
        return bool(self.prefill_chunk) and self.mixed_rows >= self.prefill_chunk

    def all_experts_resident(self) -> bool:
        """Every routed expert is resident on the fast tier (False for a dense model)."""
        moe = [l for l in self.layers if l.kind == "moe"]
        total = sum(l.experts_gpu + l.experts_cpu + l.experts_disk for l in moe)
        return bool(moe) and self.resident_experts() == total

    def weights_stay_put(self) -> bool:
        """Whether a forward reads every weight on the tier that computes it: no FlexGen streaming,
        nothing on disk and, on a GPU plan, every dense FFN whole on the GPU and every routed expert
        resident. One more forward then moves no weights (shared_prefixes, which take one, are on)."""
        if self.flexgen or self.memory.get("disk") or any(l.experts_disk for l in self.layers):
            return False
        if self.fast_tier == "cpu":
            return True
        moe = any(l.kind == "moe" for l in self.layers)
        return all(l.r_gg >= 1 - 1e-9 for l in self.layers if l.kind == "dense") and (not moe or self.all_experts_resident())

    def experts_splittable(self) -> bool:
        """A missing routed expert can be split by rows between the CPU and the link (dispatcher
        SPLIT): stored dense, one precision (no HOBBIT low copies)."""
        from tiered.quant.experts import is_dense_format

        name = self.dtypes.get("experts")
        return name is not None and is_dense_format(name) and self.mixed_precision is None

    def experts_groupable(self) -> bool:
        """Resident routed experts can be stacked per layer and run as grouped GEMMs with no host sync
        (memory/expert_store.ExpertStore.stacks, moe_runner._grouped): splittable, stored in the
        activations' dtype, and no prefetch (whose hooks the grouped path skips)."""
        return (self.experts_splittable() and self.dtypes.get("experts") == self.dtypes.get("weights")
                and not self.prefetch)

    def expert_placement(self):
        """The experts' home tiers and cache size as the runtime's ExpertPlacement (planner/placement.py)."""
        from tiered.planner.placement import ExpertPlacement

        tiers = {(l.layer, e): t for l in self.layers for e, t in enumerate(l.expert_tiers)}
        return ExpertPlacement(tiers, self.expert_cache_slots, self.expert_bytes, self.expected_hit_rate)

    def sliced_layers(self) -> dict[int, tuple[float, float]]:
        """Dense layers the plan slices (r_GG < 1): layer -> (r_CC, r_CG). Empty without a GPU tier."""
        if self.fast_tier != "gpu" or self.flexgen is not None:
            return {}
        return {l.layer: (l.r_cc, l.r_cg) for l in self.layers if l.kind == "dense" and l.r_gg < 1 - 1e-9}

    def latency_model(self):
        """The dispatcher's LatencyModel (runtime/dispatcher.py), or None when nothing is dispatched."""
        from tiered.runtime.dispatcher import LatencyModel

        return None if self.dispatch_latency is None else LatencyModel(**self.dispatch_latency)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json())

    @classmethod
    def load(cls, path: str | Path) -> "Plan":
        """Read a saved plan. Raises ConfigError when unreadable."""
        try:
            return cls.from_json(Path(path).read_text())
        except OSError as e:
            raise ConfigError(f"cannot read plan {path} ({e})", "write one with `tiered plan --json > FILE`") from None
        except ConfigError as e:
            raise ConfigError(f"cannot read plan {path} ({e.args[0]})", "write one with `tiered plan --json > FILE`") from None

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        """The Plan of `to_json` output, equal field for field. Raises ConfigError when malformed."""
        try:
            d = json.loads(text)
            d["layers"] = [LayerPlan(**l) for l in d["layers"]]
            plan = cls(**d)
        except (ValueError, TypeError, KeyError) as e:
            raise ConfigError(f"not a plan: {e}", "write one with `tiered plan --json > FILE`") from None
        if plan.dispatch_mode not in DISPATCH_MODES:
            raise ConfigError(f"not a plan: dispatch_mode {plan.dispatch_mode!r}", f"use one of {DISPATCH_MODES}")
        return plan

    def check_model(self, cfg) -> None:
        """Raise ConfigError unless this (replayed) plan was made for a model of `cfg`'s structure: as many
        layers, the same layers with experts and as many experts each, and the decisions every plan
        carries (the weights' format, non-negative slot and thread counts). A plan for another model would
        otherwise fail deep in placement, or run with its predictions meaning nothing."""
        where = f"the plan for {self.model}"
        hint = "replay a plan made for this model (`tiered plan --model M --json > FILE`), or leave --plan out"
        if len(self.layers) != cfg.num_hidden_layers:
            raise ConfigError(f"{where} has {len(self.layers)} layers; this model has {cfg.num_hidden_layers}", hint)
        for i, lp in enumerate(self.layers):
            moe = cfg.is_moe and cfg.is_moe_layer(i)
            if (lp.kind == "moe") != moe:
                raise ConfigError(f"{where} has a {lp.kind} layer {i}; this model's layer {i} is "
                                  f"{'MoE' if moe else 'dense'}", hint)
            if moe and lp.expert_tiers and len(lp.expert_tiers) != cfg.num_experts:
                raise ConfigError(f"{where} places {len(lp.expert_tiers)} experts in layer {i}; this model has "
                                  f"{cfg.num_experts}", hint)
        if "weights" not in self.dtypes:
            raise ConfigError(f"{where} has no weights format (dtypes['weights'])", hint)
        for name in ("expert_cache_slots", "expert_cache_slots_low", "staging_buffers", "cpu_threads"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{where} has {name} {getattr(self, name)}", "a count must be >= 0: fix the file")

    def render(self) -> str:
        """A one-screen text summary: header, per-layer table (runs of equal layers folded), totals."""
        gm = format_bytes(self.gpu_memory) if self.gpu_memory else "none"
        cm = format_bytes(self.cpu_memory) if self.cpu_memory else "unlimited"
        by = "" if self.source == "planner" else f", decided by {self.source}"
        out = [f"plan for {self.model} — goal: {self.goal}, profile: {self.profile}{by}",
               f"budgets: GPU {gm}, CPU {cm}; prompt {self.prompt_tokens} tokens, {self.gen_tokens} generated; "
               f"priced in {self.precision}; KV cache on {self.kv_cache_tier}"
               f"{' (its sliding layers their windows)' if self.kv_window else ''}, attention on {self.attention_tier}"]
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
        from tiered.runtime.dispatcher import BALANCED_MODES

        if self.dispatch_mode not in BALANCED_MODES and self.dispatch_latency is not None:
            how = {"copy": "is copied to the GPU", "cpu": "runs on the CPU",
                   "split": "is split by rows between the CPU and the link"}.get(self.dispatch_mode, "runs as Fiddler's rule says")
            out.append(f"dispatch: every non-resident expert {how}")
        elif self.dispatch_threshold_tokens is not None:
            s = self.dispatch_threshold_tokens
            out.append(f"dispatch: a non-resident expert runs on the CPU when it has <= {s:.1f} tokens, "
                       f"else its weights are copied to the GPU (Fiddler Alg. 1); a layer's misses are split "
                       f"between the CPU and the link so both finish together (one dense miss of the layer by rows)")
        if self.expert_cache_slots:
            out.append(f"expert cache: {self.expert_cache_slots} slots ({self.cache_policy}) on the {self.fast_tier} "
                       "for experts that are not resident"
                       + (f"; prefetch {self.prefetch_lookahead} MoE layers ahead" if self.prefetch else ""))
        if self.mixed_precision:
            m = self.mixed_precision
            out.append(f"mixed precision (HOBBIT): misses load {m['high']} when the unimportance score <= T1={m['t1']}, "
                       f"{m['low']} up to T2={m['t2']}, else skip; top-1 always {m['high']}; "
                       f"{self.expert_cache_slots_low} low-precision cache slots")
        if self.dtypes:
            out.append("formats: " + ", ".join(f"{k} {v}" for k, v in self.dtypes.items())
                       + (f"; {self.cpu_threads} CPU threads" if self.cpu_threads else ""))
        if self.mixed_rows:
            out.append(f"prompts: up to {self.mixed_rows} tokens as rows of the native decode step"
                       + (", longer ones chunk by chunk as such rows" if self.chunks_as_rows()
                          else ", longer ones through the modules' prefill"))
        if self.expert_group_rows:
            out.append(f"prompt experts: in the kernel's groups of 8 rows up to {self.expert_group_rows} rows an expert, "
                       "past them on the AMX GEMM")
        if self.speculative_tokens:
            costs = self.speculative_costs
            how = (f"prompt lookup, n-grams {self.prompt_lookup[1]} down to {self.prompt_lookup[0]}"
                   if self.speculative == "ngram" else "a draft model")
            out.append(f"speculative decoding ({how}): up to {self.speculative_tokens} draft tokens a step"
                       + (", a step of 1 + k rows priced " + " / ".join(f"{c:.2f}" for c in costs) + "x one row"
                          if costs else ", every proposal drafted (unpriced)"))
        if self.decode_graphs or self.piecewise_graphs:
            out.append("decode: " + ("one CUDA graph per step" if self.decode_graphs else
                                     "piecewise CUDA graphs (each layer's attention; MLPs / experts eager)"))
        mem = ", ".join(f"{k} {format_bytes(v)}" for k, v in self.memory.items())
        if self.prefill_chunk and self.workspace_bytes:
            mem += (f" ({format_bytes(self.workspace_bytes)} of it the activation workspace: longer prompts prefill "
                    f"in chunks of {self.prefill_chunk} tokens)")
        out.append(f"memory: {mem}")
        if self.predicted_throughput_tokens_per_s is not None:
            out.append(f"predicted: throughput {self.predicted_throughput_tokens_per_s:.2f} tokens/s"
                       + ("" if self.flexgen else  # the engine's throughput plan: its batch, and one request's times
                          f" over {self.kv_slots} sequences at once (each: TTFT {self.predicted_ttft_s:.3f} s, decode "
                          f"alone {self.predicted_decode_tokens_per_s:.2f} tokens/s)"))
        else:
            out.append(f"predicted: TTFT {self.predicted_ttft_s:.3f} s, decode {self.predicted_decode_tokens_per_s:.2f} tokens/s"
                       + (f", {self.predicted_batch_decode_tokens_per_s:.2f} tokens/s over {self.kv_slots} sequences "
                          "at once" if self.predicted_batch_decode_tokens_per_s is not None else ""))
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


