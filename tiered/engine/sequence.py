"""Sequence: one request's mutable state during generation, and its results."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from tiered.engine.reasoning import split
from tiered.engine.sampling import SamplingParams


@dataclass(frozen=True, slots=True)
class RequestStats:
    """Per-request measurements (seconds, tokens, tokens/s).

    ttft_s is from the call's start to the first generated token; itl_s is the mean gap between
    consecutive generated tokens; decode_tokens_per_s counts tokens after the first.
    """

    prompt_tokens: int
    generated_tokens: int
    ttft_s: float
    prefill_s: float
    prefill_tokens_per_s: float
    decode_s: float
    decode_tokens_per_s: float
    itl_s: float

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__slots__}

    cached_tokens: int = 0  # prompt tokens whose KV was not computed for this request (prefill skipped them)
    # the fewest threads torch's CPU team had at a step of this request (0: not recorded): below the plan's
    # (Plan.cpu_threads) where hardware/contention.ThreadGovernor gave cores back to other processes
    cpu_threads: int = 0
    # speculative decoding (engine/speculative.py): draft tokens proposed, and of them accepted (each a token
    # without a step of its own)
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0

    def drafts_note(self) -> str:
        """" | drafts N, M accepted (P%)" where speculative decoding drafted for this request, else ""."""
        if not self.draft_tokens:
            return ""
        return (f" | drafts {self.draft_tokens}, {self.accepted_draft_tokens} accepted "
                f"({self.accepted_draft_tokens / self.draft_tokens:.0%})")

    @property
    def mean_decode_positions(self) -> int:
        """Cached positions a decode step of this request attended to on average [tokens]: the
        prompt and half the generated tokens."""
        return self.prompt_tokens + self.generated_tokens // 2


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """A generated token's log-probability [nats] and the most likely alternatives at its position."""

    token: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, log-probability), most likely first


@dataclass(slots=True)
class RequestOutput:
    """What generate() returns for one prompt: the generated text and token ids, and stats.

    A reasoning model's chat output (engine/reasoning.py: `<think>` blocks, gpt-oss's harmony channels) is also
    given in parts: `reasoning` (None where it wrote none), `content` the answer, `tool_calls` harmony's calls
    ((function name, arguments JSON text) each). For other outputs `content` is `text`.
    """

    prompt: str
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" (EOS, stop token or stop string) or "length"
    stats: RequestStats
    logprobs: list[TokenLogprob] | None = None  # one per token_ids entry when SamplingParams.logprobs is set
    # one per prompt token when SamplingParams.prompt_logprobs is set; None at the first (nothing before it)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    reasoning: str | None = None
    content: str | None = None  # None: set to `text` (__post_init__)
    tool_calls: list[tuple[str, str]] = field(default_factory=list)
    stop_string: str | None = None  # the stop string that ended it (vLLM's stop_reason); None: EOS or length

    def __post_init__(self) -> None:
        if self.content is None:
            self.content = self.text

    def as_dict(self) -> dict:
        out = {"prompt": self.prompt, "text": self.text, "token_ids": self.token_ids,
               "prompt_tokens": len(self.prompt_token_ids), "finish_reason": self.finish_reason,
               "stats": self.stats.as_dict()}
        if self.reasoning is not None or self.content != self.text or self.tool_calls:
            out |= {"reasoning": self.reasoning, "content": self.content,
                    "tool_calls": [{"name": n, "arguments": a} for n, a in self.tool_calls]}
        return out


@dataclass(slots=True, eq=False)
class Sequence:
    """Run state of one request: tokens so far, detokenizer offsets, timings. Compared and hashed by
    identity (the scheduler's and the server's keys): two requests with equal fields stay two, and a
    key holds its sequence alive (an id() key could name a new request at a finished one's address)."""

    index: int
    prompt: str
    prompt_ids: list[int]
    params: SamplingParams
    max_tokens: int
    slot: int
    generator: torch.Generator | None
    output_ids: list[int] = field(default_factory=list)
    text: str = ""
    emitted: int = 0  # characters of `text` already streamed
    prefix_offset: int = 0
    read_offset: int = 0
    decode_stream: object = None  # tokenizers.decoders.DecodeStream of output_ids (engine/detokenize.py)
    finish_reason: str | None = None
    stop_string: str | None = None  # the stop string that ended it (apply_stop_strings)
    t_start: float = field(default_factory=time.perf_counter)
    t_prefill_start: float = 0.0
    token_times: list[float] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None  # filled when params.logprobs is set
    prompt_logprobs: list[TokenLogprob | None] | None = None  # filled by its prefill when params.prompt_logprobs is set
    cached_tokens: int = 0  # prompt tokens whose KV its slot held or took from another slot (prefill skipped them)
    kv_source: int = -1  # a running sequence's slot whose KV of those tokens LLM.step copies in first (-1: none)
    cpu_threads: int = 0  # the fewest CPU threads at a step of it (LLM.step; RequestStats.cpu_threads)
    # its grammar's parser where params.structured_outputs is set (engine/structured.TokenMatcher)
    matcher: object = None
    # generated tokens before the last whose KV is not written yet: its grammar's forced tokens (LLM._force),
    # which the next step feeds as rows with the last one
    pending: int = 0
    # a reasoning model's chat (engine/reasoning.py): its format ("think", "harmony"; None: the output is all
    # answer), whether its prompt opened a think block, and whether its text keeps special tokens (harmony's markers)
    reasoning_format: str | None = None
    thinking_opened: bool = False
    keep_special: bool = False
    # speculative decoding (engine/speculative.py): its prompt lookup (None until its first proposal), and the
    # draft tokens the next step verifies as rows after its last token
    drafter: object = None
    draft: list[int] = field(default_factory=list)
    _seen: torch.Tensor | None = field(default=None, repr=False)  # seen_ids' buffer, int64, grown by doubling
    _seen_n: int = 0  # its entries filled

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def scores_prompt(self) -> bool:
        """Whether its prefill records prompt logprobs (SamplingParams.prompt_logprobs): it then
        computes every prompt token (no cached prefix) in a forward of its own (LLM._prefill_scored)."""
        return self.params.prompt_logprobs is not None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def seen_ids(self) -> torch.Tensor:
        """The prompt's and the generated token ids so far, int64 [num_tokens] (a repetition penalty's
        operand): a view of a buffer the tokens are appended to, so a step copies its new tokens only
        (rebuilding the whole list took ~11 us a token at 100 tokens, ~0.2 ms at 2,000)."""
        n, done = self.num_tokens, self._seen_n
        with torch.inference_mode():  # an inference tensor, written in inference mode whoever calls
            if self._seen is None or self._seen.numel() < n:
                grown = torch.empty(max(64, 2 * n), dtype=torch.long)
                if done:
                    grown[:done] = self._seen[:done]
                self._seen = grown
            if done < n:
                P = len(self.prompt_ids)
                new = (self.prompt_ids[done:] if done < P else []) + self.output_ids[max(0, done - P):]
                if len(new) == 1:
                    self._seen[done] = new[0]
                else:
                    self._seen[done:n] = torch.tensor(new, dtype=torch.long)
                self._seen_n = n
            return self._seen[:n]

    def kv_tokens(self) -> list[int]:
        """The tokens whose KV its slot holds once it has run a step: the prompt and every generated token but
        the last and the forced ones before it (`pending`); the prompt alone before its first token."""
        return self.prompt_ids + self.output_ids[:len(self.output_ids) - 1 - self.pending]

    def truncate(self, n: int) -> None:
        """Drop the generated tokens past the first `n` (their times and logprobs too, and its grammar's
        parser steps back over them), as a rollback does (serve/engine's _Saved.restore); seen_ids refills
        from there."""
        if self.matcher is not None:
            self.matcher.rollback(len(self.output_ids) - n)
        if self.drafter is not None:  # its index holds the dropped tokens' n-grams
            self.drafter.reset()
        self.draft = []
        del self.output_ids[n:], self.token_times[n:]
        if self.logprobs is not None:
            del self.logprobs[n:]
        self._seen_n = min(self._seen_n, len(self.prompt_ids) + n)

    def stats(self) -> RequestStats:
        n = len(self.output_ids)
        first = self.token_times[0] if self.token_times else time.perf_counter()
        prefill_s = first - self.t_prefill_start
        decode_s = self.token_times[-1] - first if n > 1 else 0.0
        return RequestStats(
            prompt_tokens=len(self.prompt_ids), generated_tokens=n, ttft_s=first - self.t_start,
            prefill_s=prefill_s, prefill_tokens_per_s=len(self.prompt_ids) / prefill_s if prefill_s > 0 else 0.0,
            decode_s=decode_s, decode_tokens_per_s=(n - 1) / decode_s if decode_s > 0 else 0.0,
            itl_s=decode_s / (n - 1) if n > 1 else 0.0, cached_tokens=self.cached_tokens,
            cpu_threads=self.cpu_threads,
            draft_tokens=self.drafter.total_drafted if self.drafter is not None else 0,
            accepted_draft_tokens=self.drafter.total_accepted if self.drafter is not None else 0)

    def output(self) -> RequestOutput:
        parts = split(self.text, self.reasoning_format, self.thinking_opened) if self.reasoning_format else None
        if parts is not None and self.finish_reason == "length":
            parts.calls = []  # a call cut by max_tokens is no call (its arguments end mid-way)
        return RequestOutput(self.prompt, self.prompt_ids, self.text, list(self.output_ids),
                             self.finish_reason or "length", self.stats(),
                             None if self.logprobs is None else list(self.logprobs),
                             None if self.prompt_logprobs is None else list(self.prompt_logprobs),
                             *((parts.reasoning, parts.content, parts.calls) if parts is not None else ()),
                             stop_string=self.stop_string)
