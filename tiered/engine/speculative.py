"""Speculative decoding by prompt lookup: draft tokens copied from the context, verified in one step.

A decode step of an offloaded or CPU-run model is bound by reading its weights, once a step whatever the
rows: on 2 Zen 4 cores an 8-layer Llama-3-8B-width Q4_K_M step took 55 ms for one row and 70 for four
(2026-12-04). Where a sequence's next tokens are likely a copy of earlier ones (a summary quoting its source,
code edited in place, an extraction, a JSON answer repeating the prompt's keys), those tokens are proposed
without any model and the step feeds them as rows after the sequence's last token: its logits at every row
tell at once how many of them the model would have written. Every accepted draft is a token without a step
of its own, and the step's last row gives one more token (the correction where a draft was rejected, else the
next one).

- Proposal: prompt lookup decoding (Saxena 2023, "Prompt Lookup Decoding"; vLLM's `ngram` method, llama.cpp's
  lookup decoding): the last n tokens (n from `max_ngram` down to `min_ngram`) are looked up among the earlier
  tokens of the prompt and output, and the tokens that followed their latest occurrence are the draft
  (`NgramDrafter`, an index of every n-gram's latest continuation, updated as tokens come).
- Verification keeps the model's distribution exactly (Leviathan et al. 2023, "Fast Inference from Transformers
  via Speculative Decoding", §2.3; Chen et al. 2023, "Accelerating LLM Decoding with Speculative Sampling"):
  greedy requests accept a draft token while it is the argmax; a sampled request's draft, a point mass q, is
  accepted with probability min(1, p(d) / q(d)) = p(d), and a rejection draws from the residual
  norm(max(0, p - q)): p without d (`verify_draw`). p is the request's own draw distribution (penalties,
  temperature, top-k / top-p / min-p, a grammar's mask), computed after the tokens accepted before it.
- Draft length: the plan prices a step of 1 + k rows of one sequence (Plan.speculative_costs, relative to one
  row); each sequence's recent acceptance a gives 1 + a + ... + a^k expected tokens for it, and the length with
  the most tokens a unit of time is drafted, none where no draft pays (`draft_length`).
"""

from __future__ import annotations

import torch

from tiered.engine.sampling import (SamplingParams, apply_repetition_penalty, filter_min_p, filter_top_k,
                                    filter_top_p, greedy_token, sample_categorical)

# prior of a sequence's acceptance before any verification (one accepted of two drafted), and how much of its
# history each later step keeps (drafts of the recent steps tell what the text does now)
PRIOR_ACCEPTED, PRIOR_DRAFTED, ACCEPTANCE_DECAY = 1.0, 2.0, 0.7


class Drafter:
    """A sequence's speculation state: its acceptance (`accepted`, `drafted`: counts decayed by ACCEPTANCE_DECAY
    a record, with a prior of PRIOR_ACCEPTED of PRIOR_DRAFTED), the verified drafts' totals (stats), and the
    proposals since the last that drafted (`idle`)."""

    def __init__(self) -> None:
        self.accepted, self.drafted = PRIOR_ACCEPTED, PRIOR_DRAFTED
        self.total_drafted = self.total_accepted = 0  # undecayed counts of verified drafts, for stats
        self.idle = 0  # proposals since the last one drafted (LLM._propose; a lone sequence's bursts lengthen)

    @property
    def acceptance(self) -> float:
        """The share of recent draft tokens accepted (decayed counts with a prior of PRIOR_ACCEPTED of
        PRIOR_DRAFTED)."""
        return self.accepted / self.drafted

    def record(self, drafted: int, accepted: int) -> None:
        """One verification, or a proposal's tokens scored against those that came (`guess`): `drafted` tokens
        proposed, the first `accepted` of them accepted. (The verifier counts total_drafted and total_accepted
        itself, as the tokens come: a sequence's stats are taken when its last token is.)"""
        self.accepted = ACCEPTANCE_DECAY * self.accepted + accepted
        self.drafted = ACCEPTANCE_DECAY * self.drafted + drafted

    def guess(self, at: int, proposal: list[int]) -> None:
        """`proposal` was made after a context of `at` tokens and not drafted (none here)."""

    def reset(self) -> None:
        """Forget what was built from the context: it was cut (Sequence.truncate)."""


class NgramDrafter(Drafter):
    """Prompt lookup (Saxena 2023; vLLM's ngram proposer): the draft after a context is what followed the
    latest earlier occurrence of its last n tokens, n from `max_ngram` down to `min_ngram`.

    The index maps each n-gram of the context to the position after its latest occurrence that has a
    continuation; it grows with the tokens (`propose` indexes those appended since the last call), so a step
    costs O(new tokens x n-gram sizes), the first O(prompt). A context that was cut (Sequence.truncate) is
    indexed anew (`reset`).

    Also keeps the sequence's acceptance (`accepted`, `drafted`: decayed counts, `record`): of the drafts a step
    verified, and of the proposals left undrafted (`guess`: scored against the tokens that came instead, at the
    next `propose`), so that a sequence whose acceptance fell drafts again once its text repeats.

    Args:
        min_ngram, max_ngram: n-gram sizes looked up (1 <= min_ngram <= max_ngram).
    Raises:
        ValueError: sizes out of order or below 1.
    """

    def __init__(self, min_ngram: int = 2, max_ngram: int = 4) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"n-gram sizes must satisfy 1 <= min <= max (got {min_ngram}, {max_ngram})")
        super().__init__()
        self.min_ngram, self.max_ngram = min_ngram, max_ngram
        self._index: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(min_ngram, max_ngram + 1)}
        self._indexed = 0  # context tokens whose n-grams ending before them are indexed
        self._guess: tuple[int, list[int]] | None = None  # (context length, proposal) left undrafted

    def reset(self) -> None:
        """Forget the indexed context (it was cut: Sequence.truncate); the next `propose` indexes it anew. The
        acceptance and the counts stay."""
        for index in self._index.values():
            index.clear()
        self._indexed = 0
        self._guess = None

    def propose(self, prompt: list[int], output: list[int], k: int) -> list[int]:
        """Up to `k` draft tokens to follow context prompt + output (token id lists; not copied), [] where
        none of its last n-grams occurred before with a continuation."""
        P, N = len(prompt), len(prompt) + len(output)

        def window(a: int, b: int) -> list[int]:  # context[a:b]
            if b <= P:
                return prompt[a:b]
            if a >= P:
                return output[a - P:b - P]
            return prompt[a:] + output[:b - P]

        if self._guess is not None:  # a proposal not drafted: as many of its tokens as came, scored
            at, guess = self._guess
            came = window(at, min(N, at + len(guess))) if at <= N else []
            if came:
                m = next((i for i, (a, b) in enumerate(zip(came, guess)) if a != b), len(came))
                self.record(min(m + 1, len(came)), m)
            self._guess = None
        start = max(self._indexed, 1)
        if start < N:  # the n-grams ending at i - 1 gain continuation position i
            new = window(max(0, start - self.max_ngram), N)
            off = max(0, start - self.max_ngram)
            for i in range(start, N):
                for n, index in self._index.items():
                    if i >= n:
                        index[tuple(new[i - n - off:i - off])] = i
            self._indexed = N
        if k <= 0:
            return []
        tail = window(max(0, N - self.max_ngram), N)
        for n in range(self.max_ngram, self.min_ngram - 1, -1):
            if len(tail) < n:
                continue
            j = self._index[n].get(tuple(tail[len(tail) - n:]))
            if j is not None:
                return window(j, min(j + k, N))
        return []

    def guess(self, at: int, proposal: list[int]) -> None:
        """`proposal` was not drafted after a context of `at` tokens: the next `propose` scores it against the
        tokens that came after them (a mismatch ends it: as a verification would have)."""
        self._guess = (at, list(proposal)) if proposal else None


def expected_tokens(acceptance: float, k: int) -> float:
    """Tokens a step with `k` draft tokens gives on average when each is accepted with probability
    `acceptance` given the ones before it: 1 + a + a^2 + ... + a^k (the step's last row gives one always)."""
    return sum(acceptance ** i for i in range(k + 1))


def draft_length(acceptance: float, costs: list[float] | None, most: int, per_token: float = 0.0) -> int:
    """Draft tokens to propose: the k in 0..`most` with the most expected tokens (`expected_tokens`) per unit
    of step time, `costs[k]` the priced time of a step of 1 + k rows of one sequence relative to one row
    (Plan.speculative_costs; None: unpriced, every row free) and `per_token` what making each draft token costs
    in that unit (a draft model's step: DraftModel.cost; 0 for a lookup). With neither priced, `most`. 0 where
    no draft pays for its rows."""
    if costs is None and not per_token:
        return most
    best, best_rate = 0, 1.0
    for k in range(1, (most if costs is None else min(most, len(costs) - 1)) + 1):
        rate = expected_tokens(acceptance, k) / ((1.0 if costs is None else costs[k]) + k * per_token)
        if rate > best_rate * 1.0001:
            best, best_rate = k, rate
    return best


def draw_probs(logits: torch.Tensor, params: SamplingParams, seen: torch.Tensor) -> torch.Tensor:
    """The distribution a sampled (not greedy) request draws its next token from: probs fp32 [V] of logits
    fp32 [V] (after its bias, penalties and grammar mask) with the repetition penalty over `seen` (int64 ids),
    the temperature and the top-k, top-p and min-p filters: engine/sampling.sample_token's."""
    logits = apply_repetition_penalty(logits.float(), seen, params.repetition_penalty) / params.temperature
    logits = filter_min_p(filter_top_p(filter_top_k(logits, params.top_k), params.top_p), params.min_p)
    return logits.softmax(-1)


def verify_draw(logits: torch.Tensor, params: SamplingParams, seen: torch.Tensor,
                generator: torch.Generator | None, draft: int | None) -> int:
    """The token a sequence writes at one verified row: logits fp32 [V] (its adjusted row), `seen` int64 ids
    (its repetition penalty's operand), `draft` the token proposed there (None: the row after the last draft,
    or after none). Greedy: the argmax (after the repetition penalty), whatever the draft. Sampled: the draft
    with probability p(draft), else a draw from p without it (speculative sampling with a point-mass draft,
    Leviathan et al. 2023 §2.3): the token is distributed as p either way."""
    if params.greedy:
        return greedy_token(apply_repetition_penalty(logits.float(), seen, params.repetition_penalty))
    probs = draw_probs(logits, params, seen)
    if draft is None:
        return sample_categorical(probs, generator)
    if float(torch.rand((), generator=generator, dtype=torch.float64)) < float(probs[draft]):
        return draft
    probs = probs.clone()
    probs[draft] = 0.0
    return sample_categorical(probs, generator)


# rows of one native call catching a draft model's KV cache up with a sequence's context (the rest in later calls)
CATCH_UP_ROWS = 256


class ModelDrafter(Drafter):
    """A sequence's state under a draft model (DraftModel): `pos`, the context positions whose KV the draft
    model's cache holds for its slot (written by catch-ups and by its drafting steps, as far as the tokens it fed
    were the context's), and while a step is under way `base`, the context's length when it drafted.

    A sequence whose drafts stopped paying (draft_length 0) makes no proposal to score: its acceptance drifts
    back toward the prior a step (`idle_step`), so that it drafts again later."""

    def __init__(self) -> None:
        super().__init__()
        self.pos = 0
        self.base = 0

    def reset(self) -> None:
        """The context was cut: the draft model's cache is written anew from the start."""
        self.pos = self.base = 0

    def record(self, drafted: int, accepted: int) -> None:
        """After a verification of `drafted` tokens of which the first `accepted` were the model's: the draft cache
        holds the context up to base + the accepted ones it fed (it fed all but the last draft token)."""
        super().record(drafted, accepted)
        if drafted:
            self.pos = self.base + min(accepted, drafted - 1)

    def idle_step(self) -> None:
        """A step that drafted nothing: the acceptance moves a step toward the prior."""
        self.accepted = ACCEPTANCE_DECAY * self.accepted + (1 - ACCEPTANCE_DECAY) * PRIOR_ACCEPTED
        self.drafted = ACCEPTANCE_DECAY * self.drafted + (1 - ACCEPTANCE_DECAY) * PRIOR_DRAFTED


class DraftModel:
    """Speculative decoding with a draft model (Leviathan et al. 2023; Chen et al. 2023; llama.cpp's
    --model-draft, vLLM's draft-model method): a small model of the same vocabulary writes each sequence's draft
    greedily, token by token, and the target verifies them in one step (verify_draw). The draft model runs as an
    LLM of its own on the CPU's native decode step (its rows path: every sequence's catch-up and draft tokens as
    rows of one call a draft token), over a KV cache of its own with the target cache's slots; each sequence's
    ModelDrafter says how far that cache holds its context.

    A greedy draft is a point mass, so verify_draw's rule keeps the target's distribution for sampled requests
    too (their acceptance is the target's probability of the draft model's argmax).

    Args:
        llm: the draft model's LLM (CPU, native kernels).
        vocab_size: the target's vocabulary: drafts are argmaxes over the ids both models have.
        target_tokenizer: the target's tokenizer, whose vocabulary the draft's must equal (id for id, over the
            ids both have); None where either has none (generated checkpoints): equal vocabulary sizes then.
        cost: seconds of a draft step over the target's decode step (draft_length's per_token), or None where
            unpriced.
    Raises:
        ConfigError: the draft cannot run on the native step, or its vocabulary differs.
    """

    def __init__(self, llm, vocab_size: int, target_tokenizer, cost: float | None) -> None:
        from tiered.errors import ConfigError

        self.llm = llm
        self.cost = cost
        self.vocab = min(vocab_size, llm.config.vocab_size)
        step = llm.runtime.cpu_decode
        if step is None or not step.takes_prefill_rows(llm._kv_cache(1, 8)):
            raise ConfigError("the draft model must run on the CPU's native decode step",
                              "build tiered/kernels (scripts/setup.sh) and give a draft the native step runs "
                              "(a dense or all-in-RAM checkpoint in the engine's default formats)")
        mine, theirs = llm.tokenizer, target_tokenizer
        if (mine is None) != (theirs is None) or (mine is None and llm.config.vocab_size != vocab_size):
            raise ConfigError("the draft model's vocabulary differs from the model's",
                              "give a draft of the same tokenizer (the same family's smallest model)")
        if mine is not None:
            a, b = mine.get_vocab(), theirs.get_vocab()
            shared = {t: i for t, i in a.items() if i < self.vocab}
            if any(b.get(t) != i for t, i in shared.items()):
                bad = next(t for t, i in shared.items() if b.get(t) != i)
                raise ConfigError(f"the draft model's vocabulary differs from the model's (token {bad!r} is "
                                  f"{shared[bad]} in the draft, {b.get(bad)} in the model)",
                                  "give a draft of the same tokenizer (the same family's smallest model)")
        self._cache = None
        self._for: tuple[int, int] | None = None  # (slots, positions) of the target cache the draft cache mirrors

    def cache_for(self, slots: int, positions: int):
        """The draft model's KV cache for a target cache of `slots` slots of `positions` positions (made anew,
        and every sequence's draft state dropped with it, when the target's changes: LLM._propose)."""
        if self._for != (slots, positions):
            self._cache = None  # its budget released before the new one is reserved
            self._cache = self.llm._kv_cache(slots, positions)
            self._for = (slots, positions)
        return self._cache

    def propose(self, work: list[tuple[object, int]], slots: int, positions: int) -> None:
        """Set each (sequence, k)'s draft (Sequence.draft): the draft model's k greedy tokens after its context,
        the sequences' catch-ups and then each draft token as rows of one native call, batched across `work`.
        `slots`, `positions`: the target cache's (the draft cache mirrors them)."""
        cache = self.cache_for(slots, positions)
        step = self.llm.runtime.cpu_decode
        seqs = [s for s, _ in work]
        context = {id(s): s.prompt_ids + s.output_ids for s in seqs}
        with torch.inference_mode():
            for s in seqs:  # long catch-ups a chunk at a time first (a prompt's, at the sequence's first draft)
                ctx, d = context[id(s)], s.drafter
                d.pos = min(d.pos, len(ctx) - 1)
                while len(ctx) - d.pos > CATCH_UP_ROWS:
                    self._rows(step, cache, [(ctx[d.pos:d.pos + CATCH_UP_ROWS], d.pos, s.slot)])
                    d.pos += CATCH_UP_ROWS
            feed = [(context[id(s)][s.drafter.pos:], s.drafter.pos, s.slot) for s in seqs]
            tokens = self._rows(step, cache, feed)
            for s, t in zip(seqs, tokens):
                s.drafter.base = s.drafter.pos = len(context[id(s)])
                s.draft = [t]
            for j in range(1, max(k for _, k in work)):
                more = [s for s, k in work if k > j]
                tokens = self._rows(step, cache, [(s.draft[-1:], s.drafter.base + j - 1, s.slot) for s in more])
                for s, t in zip(more, tokens):
                    s.draft.append(t)

    def _rows(self, step, cache, feed: list[tuple[list[int], int, int]]) -> list[int]:
        """One native call of the draft model over each (tokens, first position, slot) of `feed`: the argmax over
        the shared vocabulary of each one's last row."""
        logits = step.rows_call([(toks, start, slot, 1) for toks, start, slot in feed], cache)
        return logits[:, :self.vocab].float().argmax(-1).tolist()
