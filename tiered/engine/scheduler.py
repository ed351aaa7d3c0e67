"""Scheduler: continuous batching over a fixed number of KV-cache slots (nano-vllm's scheduler.py).

Requests wait in a bounded FIFO queue (at most `max_queue` beyond the free slots). At each step boundary the engine asks `schedule()`: waiting
sequences take free slots (they are prefilled this step), cancelled ones leave the queue or give
back their slot, and every running sequence decodes one token. A finished sequence gives its slot
back at once (`finish`), so a waiting request can join at the next step.

Prefix reuse (`prefix_reuse=True`, what `tiered serve` runs): a freed slot keeps the KV of the
tokens its last sequence wrote, and the scheduler remembers them. A new sequence takes the free
slot whose remembered tokens share the longest prefix with its prompt, and its prefill computes only
the rest (`Sequence.cached_tokens`). Requests that share a system prompt or a conversation's history
skip that part of their prefill, as vLLM's prefix caching and SGLang's radix cache do, here
without copying: the KV is already in the slot. A running sequence's slot lends its prefix too
(copied into the new slot at the step, `Sequence.kv_source`): a request arriving while another
with its system prompt still decodes skips it as well. Requests admitted at the same step share
in LLM.step: equal prompts prefill once (`PromptTwins`), and prompts sharing a prefix prefill it
once (`SharedPrefixes`, whatever `prefix_reuse` says: nothing of an earlier request is kept).

`add` and `cancel` may be called from any thread (an HTTP server's); `schedule` and `finish` from
the one thread that runs the step loop.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from tiered.engine.sequence import Sequence
from tiered.errors import TieredError


class QueueFullError(TieredError):
    """Every free slot is spoken for and `max_queue` more requests wait already; retry later."""


@dataclass(slots=True)
class StepPlan:
    """What one step runs: `prefill` (newly admitted, one forward each) and `running` (every
    sequence that holds a slot, including the newly admitted, decoded together after the
    prefills), plus the `cancelled` sequences removed at this boundary (their slots are free)."""

    prefill: list[Sequence] = field(default_factory=list)
    running: list[Sequence] = field(default_factory=list)
    cancelled: list[Sequence] = field(default_factory=list)


class Scheduler:
    """Continuous batching over KV-cache slots 0..max_batch-1.

    Args:
        max_batch: KV-cache slots, i.e. the most sequences decoded together (>= 1).
        max_queue: most sequences waiting beyond those the free slots will take at the next step
            (>= 0; 0 = never wait for a slot to free); `add` refuses more. At most
            max_batch + max_queue sequences are running or waiting.
        prefix_reuse: reuse the KV a freed slot still holds for a new prompt's shared prefix (the
            cache passed to LLM.step must be the same one every step).
    Raises:
        ValueError: a bound below its minimum.
    """

    def __init__(self, max_batch: int, max_queue: int, prefix_reuse: bool = False) -> None:
        if max_batch < 1 or max_queue < 0:
            raise ValueError(f"max_batch must be >= 1 and max_queue >= 0 (got {max_batch}, {max_queue})")
        self.max_batch, self.max_queue = max_batch, max_queue
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._free = list(range(max_batch - 1, -1, -1))  # pop() hands out the lowest slot first
        self.prefix_reuse = prefix_reuse
        self._slot_tokens: list[list[int]] = [[] for _ in range(max_batch)]  # tokens whose KV each slot holds
        self._cancel: set[Sequence] = set()  # sequences to drop at the next boundary
        self._lock = threading.Lock()
        # (slot, n) -> how many of the slot's first n positions a reuse takes (KVCache.reusable: a cache whose sliding
        # layers forget behind their window); LLM.step hands it over; None: any prefix, whole
        self.kv_reusable: Callable[[int, int], int] | None = None

    # ------------------------------------------------------- any thread
    def add(self, *seqs: Sequence) -> None:
        """Queue `seqs` for slots, all or none (a request's choices). Raises QueueFullError when
        they would not all fit: the waiting sequences fill every free slot and `max_queue` more
        wait already."""
        with self._lock:
            if len(self.waiting) + len(seqs) > self.max_queue + len(self._free):
                raise QueueFullError(f"the request queue is full ({self.max_queue} waiting for a slot)",
                                     "retry later or raise --max-queue")
            self.waiting.extend(seqs)

    def cancel(self, seq: Sequence) -> None:
        """Drop `seq` (waiting or running) at the next step boundary, freeing its slot."""
        with self._lock:
            self._cancel.add(seq)

    @property
    def num_waiting(self) -> int:
        """Sequences waiting for a slot."""
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        """Sequences holding a slot."""
        return len(self.running)

    def has_work(self) -> bool:
        """True while a sequence waits or runs."""
        return bool(self.waiting or self.running)

    # ----------------------------------------------------- the step loop's thread
    def schedule(self) -> StepPlan:
        """The next step: drop cancelled sequences, admit waiting ones into free slots (FIFO)."""
        plan = StepPlan()
        with self._lock:
            cancel, self._cancel = self._cancel, set()
            if cancel:
                for seq in [s for s in self.waiting if s in cancel]:
                    self.waiting.remove(seq)
                    plan.cancelled.append(seq)
                for seq in [s for s in self.running if s in cancel]:
                    self._release(seq)
                    plan.cancelled.append(seq)
            # what the running sequences' slots hold (Sequence.kv_tokens) for prefix reuse
            sources = [(s.slot, s.kv_tokens()) for s in self.running
                       if self.prefix_reuse and s.output_ids] if self.waiting and self._free else []
            while self.waiting and self._free:
                seq = self.waiting.popleft()
                self._take_slot(seq, sources)
                self.running.append(seq)
                plan.prefill.append(seq)
        plan.running = list(self.running)
        return plan

    def finish(self, seq: Sequence) -> None:
        """Give back the slot of a finished running sequence (its KV rows may be overwritten)."""
        with self._lock:
            self._release(seq)

    def _take_slot(self, seq: Sequence, sources: list[tuple[int, list[int]]] = ()) -> None:
        """Give `seq` a free slot: the lowest, or with prefix reuse the one sharing the longest
        prefix with its prompt (at most all but its last token: prefill must compute that one); a
        prompt whose logprobs are asked (Sequence.scores_prompt) the lowest, reusing nothing.
        With prefix reuse a running sequence's slot (`sources`: (slot, the tokens whose KV it holds))
        sharing a longer prefix lends it: LLM.step copies that KV into the new slot first
        (`Sequence.kv_source`), so a request arriving while another with its system prompt still
        decodes skips that prompt too."""
        seq.cached_tokens, seq.kv_source = 0, -1
        if not self.prefix_reuse or seq.scores_prompt:  # a prompt scored whole reuses no KV
            seq.slot = self._free.pop()
            if self.prefix_reuse:
                self._slot_tokens[seq.slot] = []
            return
        best, best_n = self._free[-1], 0
        for slot in reversed(self._free):  # lowest first: ties keep the lowest slot
            n = self._reusable(slot, self._slot_tokens[slot], seq.prompt_ids)
            if n > best_n:
                best, best_n = slot, n
        for slot, tokens in sources:
            n = self._reusable(slot, tokens, seq.prompt_ids)
            if n > best_n:
                seq.kv_source, best_n = slot, n
        self._free.remove(best)
        seq.slot = best
        seq.cached_tokens = best_n
        self._slot_tokens[best] = seq.prompt_ids[:seq.cached_tokens]  # still valid if it never runs

    def _reusable(self, slot: int, tokens: list[int], prompt: list[int]) -> int:
        """The positions of `slot`'s KV (`tokens`') a sequence of `prompt` reuses: their common prefix, at most
        all but the prompt's last token, and of it what the slot still holds the sliding layers' window before
        (kv_reusable)."""
        n = min(_common_prefix(tokens, prompt), len(prompt) - 1)
        return n if self.kv_reusable is None else self.kv_reusable(slot, n)

    def _release(self, seq: Sequence) -> None:
        self.running.remove(seq)
        if self.prefix_reuse:  # every token but the last sampled one (and forced ones before it) has its KV there
            self._slot_tokens[seq.slot] = (seq.kv_tokens() if seq.output_ids
                                           else [] if seq.kv_source >= 0  # its KV was never copied in
                                           else seq.prompt_ids[:seq.cached_tokens])
        self._free.append(seq.slot)
        self._free.sort(reverse=True)
        seq.slot = -1


def _common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of token lists a and b (slices compared by bisection: the
    comparisons run in C, ~log2(n) of them over n tokens in all)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def rows_groups(lengths: list[int], most: int) -> list[list[int]]:
    """Prompts of `lengths` uncached tokens packed into groups of at most `most` tokens each, in the order given: the
    native decode steps of prompt rows, or the packed forwards (models/layers.build_packed_metadata) LLM._prefill_groups
    runs (engine/llm._rows_groups, planner/batch_sim): groups of indices; a prompt longer than `most` is a group of
    its own (run chunk by chunk)."""
    groups: list[list[int]] = []
    rows = most + 1
    for i, n in enumerate(lengths):
        if groups and rows + n <= most:
            groups[-1].append(i)
            rows += n
        else:
            groups.append([i])
            rows = n
    return groups


class PromptTwins:
    """Admitted sequences whose prompts equal an earlier admitted one's (a request's `n` choices, the
    same prompt sent at once): only the first, the leader, is prefilled; each follower gets the
    leader's KV (KVCache.lend, every prompt position) and samples its first token from the
    leader's last-position logits with its own generator. Their tokens are those they would draw
    prefilled alone, up to the float rounding of a batched prefill's rows (the same rows as
    LLM.generate of the list). The follower's `cached_tokens` counts its whole prompt (none of it
    computed for it). One asking prompt logprobs follows only a leader recording as many
    alternatives, and takes its leader's; otherwise it is prefilled itself."""

    def __init__(self, seqs: list[Sequence]) -> None:
        leader_of: dict[tuple[int, ...], Sequence] = {}
        self._followers: dict[int, list[Sequence]] = {}  # id(leader) -> its followers
        self.followers: set[int] = set()  # ids of every follower
        for seq in seqs:
            leader = leader_of.setdefault(tuple(seq.prompt_ids), seq)
            # one asking prompt logprobs follows a leader recording as many (it takes them), else computes
            if leader is not seq and (not seq.scores_prompt or leader.params.prompt_logprobs == seq.params.prompt_logprobs):
                self._followers.setdefault(id(leader), []).append(seq)
                self.followers.add(id(seq))

    def of(self, leader: Sequence) -> list[Sequence]:
        """The followers of `leader` (none for any other sequence)."""
        return self._followers.get(id(leader), [])

    def join(self, leaders: list[Sequence], logits, cache) -> tuple[list[Sequence], "torch.Tensor"]:
        """After `leaders` were prefilled into `cache` (logits [len(leaders), V] of their last prompt
        positions): their followers take their KV; returns (leaders + followers, logits with a
        follower's row its leader's), what LLM._postprocess samples."""
        import torch

        rows = [(f, i) for i, s in enumerate(leaders) for f in self.of(s)]
        if not rows:
            return leaders, logits
        for f, i in rows:
            f.cached_tokens = len(f.prompt_ids)
            if f.scores_prompt:  # its leader recorded as many alternatives (__init__)
                f.prompt_logprobs = list(leaders[i].prompt_logprobs)
        cache.lend({f.slot: leaders[i].slot for f, i in rows}, max(len(f.prompt_ids) for f, _ in rows))
        index = torch.tensor([i for _, i in rows], device=logits.device)
        return leaders + [f for f, _ in rows], torch.cat([logits, logits.index_select(0, index)])


SHARED_PREFIX_TOKENS = 64  # fewest uncached tokens a follower takes from its leader (SharedPrefixes)


class SharedPrefixes:
    """Admitted sequences (no two prompts equal: PromptTwins takes those) whose prompts share a prefix
    with an earlier admitted one's, as requests with one system prompt arriving together do: the
    earlier one, the leader, prefills first; each follower then takes the leader's KV of the shared
    prefix (`lend`, KVCache.lend) and prefills only the rest of its prompt, in a later forward of the
    same step (LLM.step). A follower shares at most all but its last prompt token (its first token's
    logits are its own prefill's) and at least SHARED_PREFIX_TOKENS more than its slot holds already
    (`cached_tokens`, which then counts the shared prefix: not computed for it); a follower never
    leads. Admitted one step apart, the running slot's lending does the same (Scheduler._take_slot).
    TIERED_SHARED_PREFIX=0 turns it off (benchmarks/serve_load.py --compare-prefix).
    """

    def __init__(self, seqs: list[Sequence], min_tokens: int | None = None) -> None:
        min_tokens = SHARED_PREFIX_TOKENS if min_tokens is None else min_tokens
        self._leader: dict[int, tuple[Sequence, Sequence, int]] = {}  # id(follower) -> (it, leader, shared tokens)
        leaders: list[Sequence] = []
        for seq in seqs:
            head = seq.prompt_ids[:min_tokens]  # a cheap first test: the leader shares the first tokens
            best, shared = None, 0
            for leader in leaders:
                if leader.prompt_ids[:min_tokens] == head:
                    n = _common_prefix(leader.prompt_ids, seq.prompt_ids)
                    if n > shared:
                        best, shared = leader, n
            shared = min(shared, len(seq.prompt_ids) - 1)
            if best is not None and shared - seq.cached_tokens >= min_tokens and not seq.scores_prompt:
                self._leader[id(seq)] = (seq, best, shared)
                seq.cached_tokens = shared
            else:
                leaders.append(seq)
        self.leaders = {id(leader) for _, leader, _ in self._leader.values()}  # ids of leaders with followers

    def follows(self, seq: Sequence) -> bool:
        """Whether `seq` takes a leader's prefix (its `cached_tokens` count it already)."""
        return id(seq) in self._leader

    def holds(self) -> dict[int, int]:
        """{leader's slot: the fewest positions a follower takes from it}: what the leader's KV must still hold
        when `lend` runs (KVCache.hold: a forgetting cache keeps the window before it)."""
        held: dict[int, int] = {}
        for _, leader, shared in self._leader.values():
            held[leader.slot] = min(shared, held.get(leader.slot, shared))
        return held

    def lend(self, cache) -> None:
        """Copy every follower's shared prefix from its leader's slot into its own (KVCache.lend), after
        the leaders' prefill wrote it and before the followers' forward."""
        for seq, leader, shared in self._leader.values():
            cache.lend({seq.slot: leader.slot}, shared)
