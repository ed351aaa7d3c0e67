"""SamplingParams and the sampler: small pure functions over a logits row (gpt-fast's habit).

Order of operations (as in HF's logits processors and vLLM): OpenAI's logit bias, presence and
frequency penalties (`adjust_logits`), repetition penalty, temperature, top-k, top-p, min-p, then a
draw from the remaining distribution with the request's generator. Temperature 0 means greedy (argmax
after the bias and penalties), and so does any temperature below GREEDY_TEMPERATURE.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from tiered.engine.structured import StructuredOutputsParams
from tiered.errors import ConfigError
from tiered.kernels import load

MAX_LOGPROBS = 20  # most alternatives recorded per token (OpenAI's top_logprobs bound)
# Temperatures below this sample greedily (vLLM's _SAMPLING_EPS). At T = 1e-5 two logits 1e-3 apart
# already have odds of e^-100, so the draw is the argmax anyway; far below it logits / T overflows
# fp32 (1/T does below ~3e-39, and T itself rounds to 0 below ~1e-45), which would draw garbage or
# make the native samplers refuse the whole batch.
GREEDY_TEMPERATURE = 1e-5
# The least top_p the filters use: they compare top_p in fp32, where a smaller positive value (1e-320)
# rounds to 0 and would keep no token. Any top_p at or below the top token's probability (>= 1/V)
# keeps that token alone, so raising it to fp32's smallest normal number changes nothing else.
MIN_TOP_P = float(torch.finfo(torch.float32).tiny)
SEED_RANGE = (-2**63, 2**63 - 1)  # a generator's seed: a signed 64-bit integer
PENALTY_RANGE = (-2.0, 2.0)  # OpenAI's presence_penalty and frequency_penalty
LOGIT_BIAS_RANGE = (-100.0, 100.0)  # OpenAI's logit_bias values


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick each next token, and when to stop.

    Attributes:
        max_tokens: most tokens to generate per prompt.
        temperature: softmax temperature; 0 (or anything below GREEDY_TEMPERATURE) = greedy.
        top_k: keep the k most likely tokens (0 = off).
        top_p: keep the smallest set with cumulative probability >= top_p (1 = off).
        min_p: drop tokens with probability < min_p * max probability (0 = off).
        repetition_penalty: CTRL-style penalty (>1 discourages tokens already in prompt or output).
        seed: seed of this request's generator, a signed 64-bit integer (None = nondeterministic).
        stop: strings that end generation; the stop string is not included in the text.
        stop_token_ids: extra token ids that end generation (the model's EOS always does,
            unless ignore_eos).
        ignore_eos: keep generating past EOS (benchmarks).
        logprobs: record each generated token's log-probability under the model (the raw logits'
            log-softmax, before bias, penalties, temperature and filters) with this many most likely
            alternatives (0 = the chosen token only; None = record nothing). At most MAX_LOGPROBS.
        prompt_logprobs: record each prompt token's log-probability given the tokens before it
            (vLLM's prompt_logprobs; OpenAI completions' `echo` with `logprobs`, which lm-eval-harness
            scores with) with this many most likely alternatives (0 = the prompt token only; None =
            record nothing); the first prompt token has none. Such a prompt is computed whole: no KV
            of it is taken from a slot or another request. At most MAX_LOGPROBS.
        presence_penalty: OpenAI's: subtracted from the logit of every token generated so far
            (-2..2; positive discourages repeating a token at all).
        frequency_penalty: OpenAI's: subtracted once per time a token was generated so far (-2..2).
        logit_bias: OpenAI's: {token id: bias} added to those logits before anything else (-100..100:
            -100 bans a token, 100 all but forces it); given as a dict or (id, bias) pairs, kept as
            sorted pairs. Token ids past the vocabulary are refused by LLM.make_sequence.
        structured_outputs: constrain the output to a JSON schema, any JSON object, a regex, one of
            some strings or a grammar (engine/structured.py; a dict of its fields is taken too). None:
            unconstrained. The model needs a tokenizer; a grammar that does not compile is refused by
            LLM.make_sequence.
    """

    max_tokens: int = 128
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = field(default_factory=tuple)
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.structured_outputs, dict):
            try:
                object.__setattr__(self, "structured_outputs", StructuredOutputsParams(**self.structured_outputs))
            except TypeError as e:
                raise ConfigError(f"structured_outputs: {e}", "give json, json_object, regex, choice or grammar") from None
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        try:
            bias = tuple(sorted((int(t), float(b)) for t, b in bias))
        except (TypeError, ValueError):
            raise ConfigError("logit_bias must map token ids to numbers", "fix the sampling parameters") from None
        object.__setattr__(self, "logit_bias", bias)
        checks = [
            (self.max_tokens >= 1, "max_tokens must be >= 1"),
            (self.temperature >= 0 and math.isfinite(self.temperature), "temperature must be a finite number >= 0"),
            (self.top_k >= 0, "top_k must be >= 0 (0 disables it)"),
            (0 < self.top_p <= 1, "top_p must be in (0, 1]"),
            (0 <= self.min_p <= 1, "min_p must be in [0, 1]"),
            (self.repetition_penalty > 0 and math.isfinite(self.repetition_penalty),
             "repetition_penalty must be a finite number > 0"),
            (self.seed is None or SEED_RANGE[0] <= self.seed <= SEED_RANGE[1],
             f"seed must be a signed 64-bit integer ({SEED_RANGE[0]}..{SEED_RANGE[1]})"),
            (all(self.stop), "stop strings must be non-empty"),
            (self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS, f"logprobs must be in 0..{MAX_LOGPROBS}"),
            (self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= MAX_LOGPROBS,
             f"prompt_logprobs must be in 0..{MAX_LOGPROBS}"),
            (PENALTY_RANGE[0] <= self.presence_penalty <= PENALTY_RANGE[1],
             f"presence_penalty must be in {PENALTY_RANGE[0]:g}..{PENALTY_RANGE[1]:g}"),
            (PENALTY_RANGE[0] <= self.frequency_penalty <= PENALTY_RANGE[1],
             f"frequency_penalty must be in {PENALTY_RANGE[0]:g}..{PENALTY_RANGE[1]:g}"),
            (all(t >= 0 and LOGIT_BIAS_RANGE[0] <= b <= LOGIT_BIAS_RANGE[1] for t, b in self.logit_bias),
             f"logit_bias must map token ids >= 0 to biases in {LOGIT_BIAS_RANGE[0]:g}..{LOGIT_BIAS_RANGE[1]:g}"),
        ]
        for ok, msg in checks:
            if not ok:
                raise ConfigError(msg, "fix the sampling parameters")

    @property
    def adjusts_logits(self) -> bool:
        """Whether `adjust_logits` changes a row: a logit bias, or a presence or frequency penalty."""
        return bool(self.logit_bias) or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def greedy(self) -> bool:
        """True when tokens are the argmax (after the repetition penalty): temperature below
        GREEDY_TEMPERATURE, 0 included."""
        return self.temperature < GREEDY_TEMPERATURE


def adjust_logits(logits: torch.Tensor, params: SamplingParams, generated: list[int]) -> torch.Tensor:
    """OpenAI's logit bias and presence / frequency penalties on one row of logits fp32 [V]:
    logits[t] + bias[t] - presence_penalty * (count[t] > 0) - frequency_penalty * count[t], count[t] the
    times token t is in `generated` (the request's tokens so far, not its prompt: as OpenAI and vLLM
    count). Returns a new tensor (the row itself when params.adjusts_logits is False).

    Raises:
        IndexError: a logit_bias token id >= V (LLM.make_sequence refuses those first)."""
    if not params.adjusts_logits:
        return logits
    logits = logits.clone()
    if params.logit_bias:
        ids = torch.tensor([t for t, _ in params.logit_bias])
        logits.index_add_(0, ids, torch.tensor([b for _, b in params.logit_bias], dtype=logits.dtype))
    if generated and (params.presence_penalty or params.frequency_penalty):
        counts = torch.bincount(torch.tensor(generated), minlength=logits.shape[-1])[:logits.shape[-1]].to(logits.dtype)
        logits -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """logits fp32 [V]; seen int64 [n] token ids -> new logits, positive ones / penalty, negative * penalty."""
    if penalty == 1.0 or seen.numel() == 0:
        return logits
    logits = logits.clone()
    picked = logits[seen]
    logits[seen] = torch.where(picked > 0, picked / penalty, picked * penalty)
    return logits


def filter_top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Set all but the k largest logits [V] to -inf (k = 0 or k >= V: unchanged)."""
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k).values[-1]
    return logits.masked_fill(logits < kth, float("-inf"))


def filter_top_p(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Nucleus filter on logits [V]: keep the most likely tokens whose cumulative probability reaches p
    (at least the most likely one, however small p is)."""
    if p >= 1.0:
        return logits
    p = max(p, MIN_TOP_P)
    # Fast path: the nucleus almost always lies in the few most likely tokens. If the tokens of
    # probability >= 1e-4 x the top one already hold mass p, the nucleus is a prefix of them in
    # descending order and every other token is dropped: the same result as sorting all V (49k on
    # SmolLM2: the sort was ~1 ms a token; a top-k of 256 ~0.27 ms), from sorting those few.
    if logits.shape[-1] > 1024:
        probs = logits.softmax(-1)
        cand = torch.nonzero(probs >= probs.max() * 1e-4).squeeze(-1)
        top, order = probs[cand].sort(descending=True)
        cum = top.cumsum(-1)
        if float(cum[-1]) >= p:
            keep = cand[order[(cum - top) < p]]
            return torch.full_like(logits, float("-inf")).index_copy_(0, keep, logits[keep])
    sorted_logits, order = torch.sort(logits, descending=True)
    cum = sorted_logits.softmax(-1).cumsum(-1)
    drop_sorted = cum - sorted_logits.softmax(-1) >= p  # mass before this token already reaches p
    drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def filter_min_p(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    """Drop tokens whose probability is below min_p times the top token's probability."""
    if min_p <= 0.0:
        return logits
    probs = logits.softmax(-1)
    return logits.masked_fill(probs < min_p * probs.max(), float("-inf"))


def greedy_tokens(logits: torch.Tensor) -> list[int]:
    """The argmax of each row of logits [B, V] (the first of equal maxima; a NaN counts as the
    maximum, as in torch.argmax). On the CPU through numpy: on SmolLM2's 49k fp32 logits 5 us
    against torch.argmax's 45 (a single-row reduction), ~1.3% of a decode step on 2 cores."""
    logits = logits.float()
    if logits.device.type == "cpu":
        return logits.numpy().argmax(axis=1).tolist()
    return logits.argmax(-1).tolist()


def greedy_token(logits: torch.Tensor) -> int:
    """The argmax of logits [V] (greedy_tokens of one row)."""
    return greedy_tokens(logits.unsqueeze(0))[0]


def sample_token(logits: torch.Tensor, params: SamplingParams, seen: torch.Tensor,
                 generator: torch.Generator | None) -> int:
    """Pick the next token from one row of logits [V] (fp32). Returns a token id."""
    logits = apply_repetition_penalty(logits.float(), seen, params.repetition_penalty)
    if params.greedy:
        return greedy_token(logits)
    logits = logits / params.temperature
    logits = filter_min_p(filter_top_p(filter_top_k(logits, params.top_k), params.top_p), params.min_p)
    return sample_categorical(logits.softmax(-1), generator)


def plain_draw(params: SamplingParams) -> bool:
    """True when a draw needs only the temperature: no filter, no penalty, not greedy."""
    return (not params.greedy and params.top_k == 0 and params.top_p >= 1.0 and params.min_p <= 0.0
            and params.repetition_penalty == 1.0)


def sample_tokens(logits: torch.Tensor, params: list[SamplingParams], seen: list[torch.Tensor],
                  generators: list[torch.Generator | None]) -> list[int]:
    """`sample_token` for each row of logits [B, V] (fp32), the rows' params, seen ids and generators.

    Rows that only need the temperature (no top-k, top-p, min-p or repetition penalty) are drawn
    together by the native `sample_rows` (one pass of vectorized exp per row, rows in parallel: ~25x
    cheaper than softmax + float64 cumsum per row on a 49k vocabulary), each at one uniform number
    from its own generator, so that a seeded request stays reproducible. Rows with filters (the CLI's
    defaults: top-p 0.9, repetition penalty 1.1) take the native `sample_filtered`, the same filters
    as `sample_token` in C++ with one pass of exp over the vocabulary (~45 us a token with the CLI defaults on
    49k logits on 2 Zen 3 cores, 2026-11-30; 0.13 ms before, filtering to -inf and drawing over all of it
    again; 0.58 through torch ops), at one uniform
    number the same way. Greedy rows, and every row without the native kernels, take `sample_token`.
    Returns B token ids."""
    if all(p.greedy and p.repetition_penalty == 1.0 for p in params):
        # every row greedy: one argmax over the rows (~70 us a token through the per-row path inside
        # a CPU decode loop, whose weights leave the interpreter's caches cold)
        return greedy_tokens(logits)
    ext = load(build=False)
    native = ext is not None and logits.dim() == 2
    plain = [i for i, p in enumerate(params) if plain_draw(p)] if native else []
    tokens = [-1] * len(params)
    if plain:
        rows = logits if len(plain) == len(params) else logits[plain]
        u = torch.stack([torch.rand((), generator=generators[i], dtype=torch.float64) for i in plain])
        temps = torch.tensor([params[i].temperature for i in plain], dtype=torch.float32)
        for i, t in zip(plain, ext.sample_rows(rows.float().contiguous(), temps, u).tolist()):
            tokens[i] = t
    for i, p in enumerate(params):
        if native and tokens[i] < 0 and not p.greedy:
            u = float(torch.rand((), generator=generators[i], dtype=torch.float64))
            tokens[i] = ext.sample_filtered(logits[i].float().contiguous(), seen[i], p.repetition_penalty, p.temperature,
                                            p.top_k, max(p.top_p, MIN_TOP_P), p.min_p, u)
    for i, p in enumerate(params):
        if tokens[i] < 0:
            tokens[i] = sample_token(logits[i], p, seen[i], generators[i])
    return tokens


def sample_categorical(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One draw from probs [V] (non-negative, summing to ~1) by inverting its CDF (float64) at one
    uniform number: exact, and ~20x cheaper than torch.multinomial on a CPU vocabulary of 49k
    (0.07 vs 1.4 ms: multinomial was 15% of a SmolLM2 decode step). Never returns a
    zero-probability token."""
    nz = torch.nonzero(probs).squeeze(-1)  # the CDF only rises at these: the same draw from their sums
    cdf = probs[nz].double().cumsum(-1)
    u = torch.rand((), generator=generator, dtype=torch.float64) * cdf[-1]
    j = int(torch.searchsorted(cdf, u, right=True))
    return int(nz[min(j, len(nz) - 1)])  # j = len: u rounded to the total, the last token with mass


def token_logprobs(logits: torch.Tensor, token: int, top: int) -> tuple[float, list[tuple[int, float]]]:
    """Log-probability [nats] of `token` under logits [V] (log-softmax in fp32), and the `top` most
    likely (token id, log-probability) pairs, most likely first: `prompt_token_logprobs` of one row."""
    return prompt_token_logprobs(logits.unsqueeze(0), torch.tensor([token], device=logits.device), top)[0]


def prompt_token_logprobs(logits: torch.Tensor, targets: torch.Tensor, top: int) -> list[tuple[float, list[tuple[int, float]]]]:
    """`token_logprobs` of many rows at once (a prompt's positions, SamplingParams.prompt_logprobs):
    logits [R, V] (any float dtype, any device: log-softmax in fp32 there), targets int64 [R] on
    its device, row r's token. Returns per row (log-probability of targets[r] [nats], the `top`
    most likely (token id, log-probability) pairs, most likely first), on the host."""
    lp = logits.float().log_softmax(-1)
    chosen = lp.gather(-1, targets.unsqueeze(-1)).squeeze(-1).tolist()
    if top <= 0:
        return [(c, []) for c in chosen]
    values, ids = torch.topk(lp, min(top, lp.shape[-1]), dim=-1)
    return [(c, list(zip(i, v))) for c, i, v in zip(chosen, ids.tolist(), values.tolist())]
