"""Beam search: the `width` most likely continuations of one prompt, decoded together.

Each step decodes every running beam as one batch (one token each, `width` rows through the same
weights: a MoE layer's experts see up to `width` rows, which is why Fiddler benchmarks beam search,
ALGORITHMS.md section Fiddler, scenario (c)), then keeps the `width` best continuations of all beams
by their summed log-probabilities. A beam whose parent was another beam takes over that parent's KV
cache rows (KVCache.copy_slots). The selection follows Hugging Face transformers' beam search
(`GenerationMixin._beam_search`, v4.50+): the same candidates per step, the same finished-hypothesis
pool with its length penalty, the same stopping rule, so the lossless engine returns the sequences
transformers returns (tests/test_beam_search.py). Sampling (temperature, top-k/p) does not apply.

`BeamSearch` is the selection alone over logits rows; `LLM.beam_search` runs the model under it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tiered.engine.sequence import RequestStats
from tiered.errors import ConfigError

@dataclass(frozen=True, slots=True)
class BeamSearchParams:
    """How a beam search runs and stops.

    Attributes:
        width: beams kept per step (>= 1; 1 is greedy decoding). The engine decodes `width` rows a
            step and holds `width` KV-cache slots of prompt + max_tokens positions.
        max_tokens: most tokens generated per beam.
        length_penalty: a finished hypothesis scores sum(log p) / generated_tokens ** length_penalty
            (> 0 favours longer ones; transformers' default 1.0).
        early_stopping: transformers' meanings: False stops when no running beam can beat the worst
            of `width` finished hypotheses at its current length (the default); True stops as soon
            as `width` hypotheses finished; "never" prices a running beam at max_tokens when
            length_penalty > 0 (the canonical search).
        num_return: hypotheses returned, best first (default: width).
        stop_token_ids: token ids that end a beam besides the model's EOS tokens.
        ignore_eos: the model's EOS tokens do not end a beam (benchmarks: every beam runs max_tokens).
    Raises:
        ConfigError: a value out of range.
    """

    width: int = 4
    max_tokens: int = 128
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    num_return: int | None = None
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        checks = [
            (self.width >= 1, "the beam width must be >= 1"),
            (self.max_tokens >= 1, "max_tokens must be >= 1"),
            (self.early_stopping in (True, False, "never"), 'early_stopping must be True, False or "never"'),
            (self.num_return is None or 1 <= self.num_return <= self.width,
             "num_return must be between 1 and the beam width"),
        ]
        for ok, msg in checks:
            if not ok:
                raise ConfigError(msg, "fix the beam search parameters")


@dataclass(slots=True)
class Hypothesis:
    """One finished beam: its generated tokens (a final stop token included, as generate() keeps
    it), its decoded text, sum of log-probabilities [nats], score (that sum over generated
    tokens ** length_penalty) and why it ended ("stop": a stop token; "length": max_tokens)."""

    token_ids: list[int]
    logprob: float
    score: float
    finish_reason: str
    text: str = ""


@dataclass(slots=True)
class BeamSearchOutput:
    """What LLM.beam_search returns: the prompt, the best hypotheses (best score first) and the
    search's stats: generated_tokens = decode steps (tokens per beam), TTFT = the prompt's prefill
    and first selection, decode_tokens_per_s = steps after the first per second (each step decodes
    every running beam, `width` rows)."""

    prompt: str
    prompt_token_ids: list[int]
    hypotheses: list[Hypothesis]
    stats: RequestStats

    @property
    def best(self) -> Hypothesis:
        return self.hypotheses[0]

    def as_dict(self) -> dict:
        return {"prompt": self.prompt, "prompt_tokens": len(self.prompt_token_ids),
                "hypotheses": [{"text": h.text, "token_ids": h.token_ids, "logprob": h.logprob, "score": h.score,
                                "finish_reason": h.finish_reason} for h in self.hypotheses],
                "stats": self.stats.as_dict()}


class BeamSearch:
    """The selection of one beam search, step by step, over the model's logits (no model here).

    `advance(logits)` takes the logits of every running beam's next token and returns, for each new
    running beam, the index of the beam it continues (its KV parent); `running` holds their tokens.
    `done` turns True when the search stops; `result()` gives the hypotheses.

    Per step (transformers' `_beam_search`): the K = max(2, 1 + #stop ids) x width best
    continuations of all beams by summed log-probability; those among the best `width` that end
    (a stop token, or max_tokens reached) enter the pool of `width` finished hypotheses, scored
    sum / generated ** length_penalty; the best `width` that do not end keep running.

    Args:
        params: BeamSearchParams.
        stop_ids: token ids that end a beam (the model's EOS unless ignored, plus params.stop_token_ids).
    """

    def __init__(self, params: BeamSearchParams, stop_ids: frozenset[int] | set[int]) -> None:
        self.params = params
        self.stop_ids = frozenset(stop_ids)
        self.keep = max(2, 1 + len(self.stop_ids)) * params.width
        self.running: list[list[int]] = [[]]  # generated tokens of each running beam
        self.scores = torch.zeros(1)  # their summed log-probabilities, fp32 as transformers keeps them
        self.pool: list[Hypothesis] = []  # finished hypotheses, best first, at most width
        self.improvable = True
        self.done = False

    def advance(self, logits: torch.Tensor) -> list[int]:
        """One step. logits: [len(running), V] (any float dtype) of each running beam's next token.
        Returns the parent (an index into the previous `running`) of each new running beam, [] when
        the search stopped. Raises ValueError after it stopped or on a wrong row count."""
        if self.done or logits.shape[0] != len(self.running):
            raise ValueError(f"advance: {logits.shape[0]} rows for {len(self.running)} running beams"
                             + (" (the search has stopped)" if self.done else ""))
        p, w = self.params, self.params.width
        generated = len(self.running[0]) + 1  # tokens of each candidate
        logp = torch.log_softmax(logits.float(), dim=-1)
        V = logp.shape[1]
        total = (logp + self.scores[:, None]).reshape(-1)
        top, index = torch.topk(total, min(self.keep, total.numel()))
        parents, tokens, values = (index // V).tolist(), (index % V).tolist(), top.tolist()
        at_length = generated >= p.max_tokens
        ends = [at_length or t in self.stop_ids for t in tokens]
        if self.improvable and not (p.early_stopping is True and len(self.pool) == w):
            scores = (top / generated ** p.length_penalty).tolist()  # fp32, as transformers divides
            for rank in range(min(w, len(tokens))):  # only the best `width` may finish
                if ends[rank]:
                    reason = "stop" if tokens[rank] in self.stop_ids else "length"
                    self.pool.append(Hypothesis(self.running[parents[rank]] + [tokens[rank]], values[rank],
                                                scores[rank], reason))
            self.pool.sort(key=lambda h: -h.score)  # stable: earlier finishers first on ties
            del self.pool[w:]
        go = [r for r in range(len(tokens)) if not ends[r]][:w]
        if not go:  # every candidate ended (max_tokens reached)
            self.done = True
            return []
        self.running = [self.running[parents[r]] + [tokens[r]] for r in go]
        self.scores = top[go]
        self._check_stop(generated)
        return [parents[r] for r in go]

    def _check_stop(self, generated: int) -> None:
        """transformers' early-stop heuristic and stopping rule, after a step."""
        p, w = self.params, self.params.width
        if len(self.pool) == w:
            length = p.max_tokens if p.early_stopping == "never" and p.length_penalty > 0 else generated
            best_running = float(self.scores[0] / length ** p.length_penalty)
            self.improvable = self.improvable and best_running > self.pool[-1].score
        full = len(self.pool) == w and p.early_stopping is True
        self.done = not self.improvable or full

    def result(self) -> list[Hypothesis]:
        """The best `num_return` hypotheses, best first (the running beams stand in, scored as if
        they ended now, when fewer finished: only when a search is cut short)."""
        p = self.params
        out = list(self.pool)
        if len(out) < p.width:
            n = len(self.running[0])
            scores = (self.scores / max(n, 1) ** p.length_penalty).tolist()
            out += [Hypothesis(list(toks), float(s), score, "length")
                    for toks, s, score in zip(self.running, self.scores, scores) if toks]
            out.sort(key=lambda h: -h.score)
        return out[:p.num_return or p.width]


def stop_ids_of(params: BeamSearchParams, eos_ids) -> frozenset[int]:
    """The token ids that end a beam: the model's EOS ids (unless params.ignore_eos) and params.stop_token_ids."""
    return frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else frozenset(eos_ids))


def check_width(width: int, vocab_size: int) -> None:
    """Raises ConfigError when `width` beams cannot be drawn from a vocabulary of `vocab_size` tokens."""
    if width > vocab_size:
        raise ConfigError(f"a beam width of {width} exceeds the vocabulary ({vocab_size} tokens)",
                          "use a smaller --beams")
