"""Engine configuration: frozen dataclasses validated on creation."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from tiered.errors import ConfigError

if TYPE_CHECKING:
    from tiered.planner.batch_sim import PromptPrefixes

WEIGHT_FORMATS = ("auto", "fp32", "bf16", "int8", "int4")
BATCH_ACTIVATIONS = ("auto", "q8", "bf16")
KV_CACHE_DTYPES = ("auto", "fp32", "bf16", "fp16", "int8")
SLIDING_KV = ("window", "full")
DTYPES = ("auto", "float32", "bfloat16")
ACCELERATORS = ("auto", "cuda", "host", "none")
CACHE_POLICIES = ("random", "lru", "lfu", "lhu", "fld", "hobbit")  # memory/expert_cache.POLICIES
EXPERT_FORMATS = ("auto", "fp32", "bf16", "int8", "int4", "fp8")
MAX_SPECULATIVE_TOKENS = 16  # most draft tokens a step verifies (EngineConfig.num_speculative_tokens)


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """How the engine loads and runs a model.

    Attributes:
        dtype: activation / dense-weight dtype for prefill and scoring: "auto", "float32" or
            "bfloat16". "auto" computes in the checkpoint's dtype on a CUDA accelerator (bfloat16
            for bf16 / fp16 / GGUF-quantized checkpoints, float32 for fp32 ones) and in float32 on
            the CPU and the host stand-in (engine/dtype.py resolve_dtype). float32 is the lossless
            mode that matches transformers to 1e-4.
        decode_weights: weight format of the decode path (one or a few tokens per step):
            "auto" keeps GGUF 4-bit blocks (Q4_0/Q4_1) as packed int4 with bf16 activations and
            other tensors in bf16; "fp32" / "bf16" use dense weights; "int8" quantizes every weight
            to int8 per group of 32 (fp16 scales, tiered's tiled layout; per row where the kernels
            or the shape do not take it: quant/linear.copy_kind); "int4" also re-quantizes dense
            weights to group-wise int4 (group 32).
            Only "fp32" is lossless.
        expert_weights: storage format of routed experts on every tier (disk, RAM, accelerator
            cache): "auto" keeps a GGUF file's quantized experts as stored (Q4_0/Q4_1 -> int4,
            Q8_0 -> int8 group 32 exactly; K-quants re-quantized, quant/gguf_experts.py), a
            block-scaled fp8 safetensors checkpoint's (DeepSeek-V3, Qwen3-FP8) as stored ("fp8"),
            bf16 ones as stored on the CPU's default (lossy, compact-copy) engine, and other HF
            checkpoints' in the compute dtype; "bf16", "fp32", "int8" (per-row
            scales), "int4" (group 32) or "fp8" (e4m3, a scale per 128 x 128 block) re-quantize
            every expert at load. Quantized experts are lossy.
        expert_low_weights: None (off), or the low-precision format ("int4" / "int8") of HOBBIT's
            mixed-precision experts (ALGORITHMS.md §3): every offloaded expert also gets a low copy,
            and a miss loads the high copy, the low copy or nothing by the token's unimportance score.
        mixed_thresholds: HOBBIT's (T1, T2) for expert_low_weights; the paper's (0.6, 0.9).
        decode_weights_threshold: steps with at most this many tokens use the decode weights;
            larger steps (prefill) use the dense `dtype` weights (raised to max_batch, so that every
            decode step of a served batch takes the decode path; a CPU plan's native decode step also
            takes decode steps of up to the prompt rows it runs there: Plan.native_step_rows).
        batch_activations: what int4 decode weights (tiled layout, tiered/kernels built) multiply in
            native steps of two or more rows (a batch of sequences, or a prompt's tokens run as rows:
            Plan.mixed_rows): "q8" (activations rounded to int8 per group of 32, llama.cpp's Q8_0:
            about 2x the speed of "bf16" at batch 8, more rounding), "bf16" (the batch-1 numerics),
            or "auto": q8 (planner/auto.batch_activations: prompts as rows 2-3x faster than on bf16,
            for ~0.001 nats of SmolLM2 next-token KL to lossless: mean 0.0014-0.0018 nats with bf16
            prompt rows, 0.0025-0.0028 with q8). A MoE prompt is mostly its routed experts, run in groups
            of 8 rows (quant/experts.ExpertFormat.batch_act): q8 makes them 1.7x faster on AVX2, as
            llama.cpp computes them. Batch 1 always reads bf16. On AVX2, "bf16" reads int16 activations (more exact than bf16) and
            "q8" int8 ones through vpmaddubsw (1.3x int16's speed at 4 and 16 rows, 2 cores). The int8-g32
            decode copies (a GGUF's Q8_0 tensors and head: quant/int8.Int8G32Linear) and the k-quant ones (its
            Q6_K / Q5_K as stored: quant/kquant.py) follow it too, on
            AVX-512: "q8" one vpdpbusd per 4 weights and row, "bf16" their int16 activations (AVX2: int16 always),
            and so do routed int8 / int8-g32 experts (a Q8_0 MoE file's, --weights int8's) in calls of 2+ rows.
        expert_activations: what routed int4 experts multiply at batch 1 (one decode token, native
            kernels): "q8" (int8 per group of 32, as llama.cpp computes Q4_0 experts: half the
            multiply-adds, which AVX-512 VNNI needs to stream an int4 expert at the memory bound:
            an OLMoE-width expert from cache at 2x the speed of "bf16", 1.4-2x on AVX2), "bf16" (bf16
            activations, int16 ones on AVX2: more exact), or "auto": q8.
        max_context: context window in tokens; None uses the model's max_position_embeddings.
        max_batch: sequences decoded together (`tiered serve --max-batch`): the plan keeps KV-cache
            room for this many sequences of max_context tokens on the fast tier. Under goal "throughput"
            the plan chooses the batch, and a max_batch above 1 caps it.
        goal: "latency" (default: one conversation's TTFT and tokens/s, a server's batch of max_batch) or
            "throughput" (many prompts at once, FlexGen's setting: the plan picks the batch, the KV-cache room
            of that many sequences of max_context tokens, that generates the most tokens a second over a
            block of prompts of `workload` lengths: planner/throughput.plan_batch; `tiered batch`).
        workload: (prompt tokens, generated tokens) of a typical request, which the throughput goal prices
            (default (512, 32): FlexGen's benchmark setting; within max_context, the generated tokens up to half of
            it and the prompt the rest); the latency goal ignores it.
        requests: (prompt tokens, generated tokens) of each request of a known workload, in the order they are
            queued (`tiered batch`: the file's lines): the throughput goal then prices each batch by replaying
            their run through its slots as the engine's continuous batching runs them (planner/batch_sim: long
            prompts prefilled alone, short ones joining decode steps as rows, steps below the full batch as requests
            finish), and `workload` defaults to their means; the latency goal ignores them.
        request_prefixes: which of `requests`' prompts share how many leading tokens (planner/batch_sim.
            PromptPrefixes: each prompt's rank in sorted order and each two neighbours' shared tokens; `tiered batch`
            makes it from the file's prompts): the replay then reuses prefixes as the server does (a system prompt
            shared by a file's chats prefilled once a slot); None: every prompt priced whole.
        lone_decode_share: under goal "throughput", only batches whose plan prices one request decoding alone at
            least this share of batch 1's plan's speed (a server's: its KV-cache slots take budget from the
            weights' and experts' room, and one client may be all it has; serve/engine.serve_batch passes
            LONE_DECODE_SHARE); None: any batch (`tiered batch`, whose file is the whole load).
        kv_cache_dtype: the KV cache's format (Plan.dtypes["kv_cache"]): "auto" (the weights' 16-bit format,
            fp32 in the lossless mode: memory/sizes.kv_cache_format), "fp32", "bf16", "fp16", or "int8": each
            position's keys and values of a KV head as int8 with an fp32 scale per 32 (models/layers.
            quantize_kv_rows; llama.cpp's --cache-type-k/v q8_0, FlexGen's KV compression, §5): 56% of a bf16
            cache's bytes, so nearly twice the sequences or context in a budget and fewer bytes for a long
            context's decode step to read; lossy. Not for latent attention (DeepSeek's MLA).
        sliding_kv: what a KV cache in RAM keeps of its sliding-window layers (Plan.kv_window; Gemma 2 / 3,
            gpt-oss, Mistral / Phi-3 windowed models): "window" (each sequence's last window positions and some
            slack: models/layers.KVCache.forget hands the older ones' pages back, and the budget counts only them,
            so a context window several times longer fits; a prefix is reused only where the slot still holds the
            window before it, as llama.cpp's SWA cache) or "full" (every position: any shared prefix is reused,
            llama.cpp's --swa-full). A cache on a GPU keeps every position.
        num_threads: CPU threads for torch; None keeps torch's default (one per core); more than the
            cores this process may run on are capped at them (`cpu_threads`).
        gpu_memory: accelerator budget [bytes, or a string like "12GiB"]; None = all free memory.
        cpu_memory: CPU RAM budget for weights, experts and (without accelerator) the expert
            cache [bytes or string]; None = unlimited.
        offload_dir: directory for disk-tier expert copies when the checkpoint's experts cannot be
            read directly in the compute dtype (quantized ones, for instance); None = a directory for the
            checkpoint in tiered's cache (memory/expert_store.default_offload_dir). A later load with the same
            disk experts reads the copies an earlier one wrote there.
        accelerator: "auto" (CUDA if present, else none), "cuda", "host" (the CPU stand-in with
            its own budget, for tests and emulation) or "none" (CPU RAM is the fast tier).
        link_bandwidth: emulated H2D bandwidth of the host stand-in [bytes/s]; None = memcpy.
        expert_cache_slots: experts the fast-tier cache holds; None = as many as fit, up to one
            layer's experts; 0 = no cache (on-demand loading).
        cache_policy: eviction policy of the expert cache: "random", "lru", "lfu", "lhu", "fld" or
            "hobbit" (HOBBIT's weighted priority, Eq. 3; memory/expert_cache.py).
        prefetch: predict the next layers' experts from each MoE layer's gate input and load the
            predicted misses early (HOBBIT §3.2; runtime/prefetch.py).
        prefetch_lookahead: p, how many MoE layers ahead the prefetcher predicts (HOBBIT: 1-3).
        resident_experts: most experts placed for good on the fast tier (by popularity); None =
            as many as the budget holds after the cache; 0 = none (pure on-demand loading).
        expert_profile: JSON from `tiered profile-experts`: places the most popular experts on the
            fast tier (Fiddler §3.4); None = layer order.
        read_ahead: issue all of a layer's expert reads at once when the router has chosen.
        staging_buffers: expert-sized staging buffers per tier for misses that get no cache slot.
        trace: record a timeline of every executor task.
        plan: "auto" (default) lets the planner decide expert residency, cache slots and dense
            slicing from a hardware profile (planner/auto.py); "off" leaves them to the runtime's
            own rules; any other value is the path of a saved plan (`tiered plan --json`) to replay.
            Explicit resident_experts / expert_cache_slots always win over the plan.
        graphs: CUDA-graph decode steps (runtime/graphs.py): "auto" captures them on a CUDA
            accelerator (the whole step when every weight is on the GPU, else piecewise: each
            layer's attention as a graph, its MLP or experts eager in between); "on" also on the
            host stand-in, where the captured parts rerun at each replay with host syncs refused
            (what a capture forbids); "off" decodes eagerly.
        pinned: how a CUDA accelerator pins host memory (weights kept in RAM for the CPU and the
            link, staging buffers): "auto" (default) lets the plan choose (Plan.pinned); "huge"
            registers tiered's transparent-huge-page memory in place (cudaHostRegister); "cuda"
            takes torch's pinned allocator (cudaHostAlloc, 4 KiB pages).
        device_issue: who issues device work on CUDA (Plan.device_issue): H2D copies from page-locked
            RAM and a sliced FFN's GPU GEMMs. "auto" (default) and "thread": the thread that needs
            them, before its CPU work, where nothing they wait for is pending; "worker": the copy and
            compute streams' worker threads (the way before: on the H100's 16-core host such copies
            started up to 3.6 ms late beside CPU experts, their worker waiting for a core).
        profile: HardwareProfile JSON path or preset name the planner uses; None = this machine's
            cached profile (measured once, quickly, if there is none).
        speculative: speculative decoding (engine/speculative.py): "off" (default), or "ngram": prompt lookup
            (Saxena 2023; vLLM's ngram method), draft tokens copied from where the context's last tokens
            occurred before, verified as rows of one step (the model's distribution is kept: greedy outputs are
            the model's argmax at every token, sampled ones its distribution).
            Or "draft": a draft model of the same tokenizer (`draft_model`) writes each draft greedily (Leviathan
            et al. 2023; llama.cpp's --model-draft), run on the CPU's native step.
        draft_model: the draft model's checkpoint (a path, as `model` takes); giving one means speculative "draft".
        num_speculative_tokens: most draft tokens a sequence proposes a step (1..16); the plan prices each
            length against the sequence's recent acceptance (Plan.speculative_costs).
        prompt_lookup_min, prompt_lookup_max: n-gram sizes the lookup tries, longest first (vLLM's names).
        force_expert_path: tests and benchmarks only: "copy", "cpu" or "split" for every non-resident
            expert, or "priced": each layer's misses as the latency model prices them fastest, without
            the balanced dispatch's margins (runtime/dispatcher.MIX_GAIN, SPLIT_GAIN).
    """

    dtype: str = "auto"
    decode_weights: str = "auto"
    decode_weights_threshold: int = 8
    batch_activations: str = "auto"
    expert_activations: str = "auto"
    expert_weights: str = "auto"
    expert_low_weights: str | None = None
    mixed_thresholds: tuple[float, float] = (0.6, 0.9)
    max_context: int | None = None
    max_batch: int = 1
    goal: str = "latency"
    workload: tuple[int, int] | None = None
    requests: tuple[tuple[int, int], ...] | None = None
    request_prefixes: PromptPrefixes | None = None
    lone_decode_share: float | None = None
    kv_cache_dtype: str = "auto"
    sliding_kv: str = "window"
    num_threads: int | None = None
    gpu_memory: int | str | None = None
    cpu_memory: int | str | None = None
    offload_dir: str | None = None
    accelerator: str = "auto"
    link_bandwidth: float | None = None
    expert_cache_slots: int | None = None
    cache_policy: str = "lru"
    prefetch: bool = False
    prefetch_lookahead: int = 2
    resident_experts: int | None = None
    expert_profile: str | None = None
    read_ahead: bool = True
    staging_buffers: int = 2
    trace: bool = False
    plan: str = "auto"
    graphs: str = "auto"
    pinned: str = "auto"
    device_issue: str = "auto"
    profile: str | None = None
    speculative: str = "off"
    draft_model: str | None = None
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    force_expert_path: str | None = None

    def __post_init__(self) -> None:
        from tiered.hardware.budget import parse_bytes

        for name in ("gpu_memory", "cpu_memory"):
            value = parse_bytes(getattr(self, name))
            if value is not None and value <= 0:
                raise ConfigError(f"{name} must be positive", "pass a size such as 12GiB")
            object.__setattr__(self, name, value)
        if self.accelerator not in ACCELERATORS:
            raise ConfigError(f"accelerator must be one of {ACCELERATORS}, got {self.accelerator!r}",
                              "pass auto, cuda, host or none")
        if self.cache_policy not in CACHE_POLICIES:
            raise ConfigError(f"cache_policy must be one of {CACHE_POLICIES}", "pass e.g. lru or hobbit")
        if self.max_batch < 1:
            raise ConfigError("max_batch must be >= 1 sequence", "pass a positive count")
        if self.goal not in ("latency", "throughput"):
            raise ConfigError(f"goal must be 'latency' or 'throughput', got {self.goal!r}",
                              "pass latency (one conversation) or throughput (a batch of prompts)")
        if self.lone_decode_share is not None and not 0 < self.lone_decode_share <= 1:
            raise ConfigError(f"lone_decode_share must be in (0, 1], got {self.lone_decode_share!r}", "pass e.g. 0.9")
        if self.workload is not None and (len(self.workload) != 2 or min(self.workload) < 1):
            raise ConfigError(f"workload must be (prompt tokens, generated tokens), both >= 1, got {self.workload!r}",
                              "pass e.g. (512, 32)")
        if self.requests is not None:
            try:
                requests = tuple((int(p), int(g)) for p, g in self.requests)
            except (TypeError, ValueError):
                requests = None
            if not requests or min(min(r) for r in requests) < 1:
                raise ConfigError("requests must be (prompt tokens, generated tokens) pairs, each >= 1, at least one",
                                  "pass e.g. ((512, 32), (40, 128))")
            object.__setattr__(self, "requests", requests)
        if self.request_prefixes is not None:
            from tiered.planner.batch_sim import PromptPrefixes
            try:
                if not self.requests:
                    raise ValueError("no requests given")
                prefixes = PromptPrefixes(*self.request_prefixes).check(len(self.requests))
            except (TypeError, ValueError) as e:
                raise ConfigError(f"request_prefixes must describe the requests' prompts: {e}",
                                  "pass batch_sim.PromptPrefixes.of(the prompts' token ids), with requests") from None
            object.__setattr__(self, "request_prefixes", prefixes)
        if self.prefetch_lookahead < 1:
            raise ConfigError("prefetch_lookahead must be >= 1 layer", "pass 1 to 3 (HOBBIT's range)")
        if self.expert_cache_slots is not None and self.expert_cache_slots < 0:
            raise ConfigError("expert_cache_slots must be >= 0", "pass 0 (no cache) or more")
        if self.resident_experts is not None and self.resident_experts < 0:
            raise ConfigError("resident_experts must be >= 0", "pass 0 (none) or more")
        if self.staging_buffers < 1:
            raise ConfigError("staging_buffers must be >= 1", "pass a positive count")
        if self.link_bandwidth is not None and self.link_bandwidth <= 0:
            raise ConfigError("link_bandwidth must be > 0 bytes/s", "pass e.g. 16e9")
        if self.force_expert_path not in (None, "copy", "cpu", "split", "priced"):
            raise ConfigError("force_expert_path must be None, 'copy', 'cpu', 'split' or 'priced'", "leave it unset")
        if self.pinned not in ("auto", "huge", "cuda"):
            raise ConfigError(f"pinned must be 'auto', 'huge' or 'cuda', got {self.pinned!r}", "pass auto")
        if self.device_issue not in ("auto", "thread", "worker"):
            raise ConfigError(f"device_issue must be 'auto', 'thread' or 'worker', got {self.device_issue!r}", "pass auto")
        if self.draft_model is not None and self.speculative == "off":
            object.__setattr__(self, "speculative", "draft")
        if self.speculative not in ("off", "ngram", "draft"):
            raise ConfigError(f"speculative must be 'off', 'ngram' or 'draft', got {self.speculative!r}",
                              "pass ngram (prompt lookup), draft (with draft_model) or off")
        if (self.speculative == "draft") != (self.draft_model is not None):
            raise ConfigError("speculative 'draft' takes a draft model, and only it does",
                              "give draft_model (--draft-model PATH) with speculative 'draft', or leave both out")
        if not 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ConfigError(f"num_speculative_tokens must be in 1..{MAX_SPECULATIVE_TOKENS}, "
                              f"got {self.num_speculative_tokens}", "pass e.g. 4")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ConfigError(f"prompt lookup n-gram sizes must satisfy 1 <= min <= max, got "
                              f"{self.prompt_lookup_min}, {self.prompt_lookup_max}", "pass e.g. 2 and 4")
        if self.graphs not in ("auto", "on", "off"):
            raise ConfigError(f"graphs must be 'auto', 'on' or 'off', got {self.graphs!r}", "pass auto")
        if not self.plan:
            raise ConfigError("plan must be 'auto', 'off' or the path of a saved plan", "pass plan='auto'")
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype must be one of {DTYPES}, got {self.dtype!r}",
                              "pass dtype='auto', 'float32' (lossless) or 'bfloat16'")
        if self.decode_weights not in WEIGHT_FORMATS:
            raise ConfigError(f"decode_weights must be one of {WEIGHT_FORMATS}, got {self.decode_weights!r}",
                              "pass one of " + ", ".join(WEIGHT_FORMATS))
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}",
                              "pass 'auto' (the weights' 16-bit format) or 'int8' (half the bytes, lossy)")
        if self.sliding_kv not in SLIDING_KV:
            raise ConfigError(f"sliding_kv must be one of {SLIDING_KV}, got {self.sliding_kv!r}",
                              "pass 'window' (the sliding layers keep their window) or 'full' (every position)")
        if self.batch_activations not in BATCH_ACTIVATIONS:
            raise ConfigError(f"batch_activations must be one of {BATCH_ACTIVATIONS}, got {self.batch_activations!r}",
                              "pass 'auto', 'q8' (faster batched decode) or 'bf16' (batch-1 numerics)")
        if self.expert_activations not in BATCH_ACTIVATIONS:
            raise ConfigError(f"expert_activations must be one of {BATCH_ACTIVATIONS}, got {self.expert_activations!r}",
                              "pass 'auto', 'q8' (llama.cpp's numerics, faster) or 'bf16' (more exact)")
        if self.expert_weights not in EXPERT_FORMATS:
            raise ConfigError(f"expert_weights must be one of {EXPERT_FORMATS}, got {self.expert_weights!r}",
                              "pass one of " + ", ".join(EXPERT_FORMATS))
        if self.expert_low_weights not in (None, "int8", "int4"):
            raise ConfigError(f"expert_low_weights must be None, 'int8' or 'int4', got {self.expert_low_weights!r}",
                              "pass int4 (HOBBIT's FP16+INT4 pair) or leave it unset")
        t1, t2 = self.mixed_thresholds
        if not 0.0 <= t1 <= t2 <= 1.0:
            raise ConfigError(f"mixed_thresholds need 0 <= T1 <= T2 <= 1, got {self.mixed_thresholds}",
                              "pass e.g. (0.6, 0.9), the HOBBIT paper's values")
        if self.decode_weights_threshold < 1:
            raise ConfigError("decode_weights_threshold must be >= 1", "pass a positive token count")
        if self.max_context is not None and self.max_context < 1:
            raise ConfigError("max_context must be >= 1 token", "pass a positive token count or None")
        if self.num_threads is not None and self.num_threads < 1:
            raise ConfigError("num_threads must be >= 1", "pass a positive thread count or None")

    def request_means(self) -> tuple[int, int] | None:
        """(mean prompt tokens, mean generated tokens) of `requests`, rounded (None without them)."""
        if not self.requests:
            return None
        n = len(self.requests)
        return (max(1, round(sum(p for p, _ in self.requests) / n)), max(1, round(sum(g for _, g in self.requests) / n)))


def usable_cores() -> int:
    """The CPU cores this process may run on (its affinity mask where the OS has one)."""
    import os

    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def cpu_threads(ec: EngineConfig) -> int:
    """The CPU threads a plan gives compute: EngineConfig.num_threads capped at the usable cores (an
    OpenMP team of thousands of threads runs far slower, and at 4096 crashed torch), else torch's
    default."""
    import torch

    return min(ec.num_threads, usable_cores()) if ec.num_threads else torch.get_num_threads()
