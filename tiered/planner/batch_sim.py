"""The time of a known workload's requests (a batch file's lengths) under the engine's continuous batching: the
scheduler (engine/scheduler.Scheduler) and LLM.step replayed step by step over the requests' prompt and generated
tokens, each step priced by the plan's time models (StepPrices: planner/latency_cpu.request_prices).

Why: the throughput goal's block model (planner/throughput.block_throughput, FlexGen's objective, ALGORITHMS.md 4)
prices kv_slots requests of one (prompt, generated) pair prefilled in groups and decoding together at the full
batch. A file of varied lengths runs otherwise: its long prompts prefill alone (past Plan.most_prompt_rows), its
short ones join decode steps as rows, its requests finish at different steps so the steps run below the full
batch, and each step's attention reads only the positions its sequences hold. A SmolLM2 file of 48 completions
(15-500-token prompts, 16-128 generated; 8 slots, 2-core AMX VM, 2026-12-04) took 7.0 s where the block model
priced 5.6: 19 prompts past 256 tokens prefilled alone in 2.9 s, 341 decode steps at ~7 of 8 sequences 3.3 s.

What the replay follows (LLM.step): at each step the waiting requests take the free slots in file order; of the
admitted, the shortest prompts join the step's decode rows while the rows stay within Plan.most_prompt_rows (the
running sequences' one row each counted); the others prefill first, as LLM._prefill_groups groups them (as rows of
native steps, engine/llm._rows_groups, where Plan.chunks_as_rows; else scheduler.prefill_groups' padded forwards),
each writing its first token; then every running sequence decodes one token, beside the joining prompts' rows,
whose first tokens come from their last rows. A sequence finishing gives its slot back for the next step.
Not replayed: prefix reuse between requests (a batch file's shared system prompts prefill once: priced in full),
a request's n choices (one request, one sequence), stops before max_tokens (every request generates its
max_tokens: the file's bound), speculative decoding.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Callable, Sequence

# the grids the step prices are interpolated on: a decode step's positions in GRID_POINTS steps of the workload's
# longest context, its sequences exactly up to EXACT_BATCH and at 1.5x spaced batches past it (the batched rows'
# prices are piecewise linear in rows: op_time.batch_rows_time), prompt tokens in GRID_POINTS steps of the longest
GRID_POINTS = 16
EXACT_BATCH = 16


@dataclass(frozen=True)
class StepPrices:
    """The seconds of each kind of step the engine runs for a workload (planner/latency_cpu.request_prices makes
    them from a CPU plan's time models).

    Attributes:
        decode: (sequences n >= 1, cached positions c >= 1 of each) -> seconds of one decode step of n sequences
            (cpu_predict.predict_decode at batch n and context c).
        rows: (prompt tokens T, prompts k) -> seconds of k prompts of T tokens in all as rows of one native step
            (cpu_predict.predict_prompt_rows; the last row of each has its logits).
        alone: prompt tokens -> seconds of one prompt prefilled on its own, on the engine's path for it
            (latency_cpu.prompt_time: rows, chunks, or the modules' prefill).
        padded: (padded tokens T, prompts k) -> seconds of k prompts in one padded forward of T tokens
            (cpu_predict.predict_prefill with prompts=k).
        most_rows: Plan.most_prompt_rows(): the most prompt rows one native step takes (0: prompts never join).
        chunks_as_rows: Plan.chunks_as_rows(): prompts prefill as rows of native steps (engine/llm._rows_groups).
        group_tokens: the most padded tokens of a prefill group (scheduler.prefill_groups' max_tokens).
        padding: groups pad to their longest prompt (dense models); False: equal lengths only (MoE).
    """

    decode: Callable[[int, int], float]
    rows: Callable[[int, int], float]
    alone: Callable[[int], float]
    padded: Callable[[int, int], float]
    most_rows: int
    chunks_as_rows: bool
    group_tokens: int
    padding: bool = True


@dataclass
class SimulatedRun:
    """A replayed workload: `seconds` in all (prefill_s of prefill forwards, decode_s of decode steps with their
    joining prompts' rows), `generated` tokens, decode `steps`, the mean sequences a step decoded (`occupancy`),
    and how many prompts joined a step as rows (`joined`) or prefilled first (`prefilled`)."""

    seconds: float
    generated: int
    steps: int
    prefill_s: float
    decode_s: float
    occupancy: float
    joined: int
    prefilled: int

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens a second."""
        return self.generated / self.seconds if self.seconds > 0 else 0.0


def _grid(f: Callable[[int], float], step: int) -> Callable[[float], float]:
    """f interpolated linearly between multiples of `step` (each evaluated once); exact at them."""
    memo: dict[int, float] = {}

    def at(i: int) -> float:
        if i not in memo:
            memo[i] = f(max(1, i * step))
        return memo[i]

    def g(x: float) -> float:
        lo = int(x // step)
        x0 = max(1, lo * step)  # the first grid point is 1 (f(0) is no price)
        w = (x - x0) / ((lo + 1) * step - x0)
        return at(lo) if w <= 0 else (1 - w) * at(lo) + w * at(lo + 1)

    return g


def _batch_grid(n: int) -> tuple[int, int]:
    """The priced batches around n: (n, n) up to EXACT_BATCH, then the 1.5x-spaced ones bracketing it."""
    if n <= EXACT_BATCH:
        return n, n
    lo = EXACT_BATCH
    while True:
        hi = max(lo + 1, int(lo * 1.5))
        if n <= hi:
            return lo, hi
        lo = hi


def simulate_requests(requests: Sequence[tuple[int, int]], slots: int, prices: StepPrices,
                      log: list | None = None) -> SimulatedRun:
    """Replay `requests` ((prompt tokens, generated tokens) each, >= 1, in the order they are queued, all at once)
    through `slots` KV-cache slots as the engine's continuous batching runs them (module docstring), each step
    priced by `prices`. `log`: where given, each step's (the prompts prefilled first: each forward's prompt lengths,
    prompt lengths joining the decode step as rows, sequences decoded), every tuple sorted, is appended to it
    (tests compare LLM.step's).

    Returns:
        SimulatedRun: the seconds from the first step to the last token, and what ran.
    Raises:
        ValueError: slots < 1, or a request with fewer than 1 prompt or generated token.
    """
    if slots < 1:
        raise ValueError(f"slots must be >= 1, got {slots}")
    if any(p < 1 or g < 1 for p, g in requests):
        raise ValueError("every request needs >= 1 prompt token and >= 1 generated token")
    if not requests:
        return SimulatedRun(0.0, 0, 0, 0.0, 0.0, 0.0, 0, 0)
    from tiered.engine.scheduler import prefill_groups, rows_groups

    longest = max(p + g for p, g in requests)
    c_step = max(1, math.ceil(longest / GRID_POINTS))
    p_step = max(1, math.ceil(max(p for p, _ in requests) / GRID_POINTS))
    decode_at: dict[int, Callable[[float], float]] = {}

    def decode(n: int, positions: float) -> float:
        lo, hi = _batch_grid(n)
        for b in (lo, hi):
            if b not in decode_at:
                decode_at[b] = _grid(lambda c, b=b: prices.decode(b, c), c_step)
        if lo == hi:
            return decode_at[lo](positions)
        w = (n - lo) / (hi - lo)
        return (1 - w) * decode_at[lo](positions) + w * decode_at[hi](positions)

    alone = _grid(prices.alone, p_step)
    memo: dict[tuple, float] = {}

    def priced(key: tuple, f: Callable[[], float]) -> float:
        if key not in memo:
            memo[key] = f()
        return memo[key]

    most = prices.most_rows
    waiting = deque(requests)
    running: list[list[int]] = []  # [positions cached, tokens left to generate] of each sequence holding a slot
    free = slots
    prefill_s = decode_s = 0.0
    generated = steps = decoded = joined = prefilled = 0
    while waiting or running:
        admitted = []
        while waiting and free:
            admitted.append(waiting.popleft())
            free -= 1
        decoding = len(running)
        # LLM._mixed_prefills: the shortest admitted prompts, while the step's rows stay within `most`
        mixed: list[int] = []
        if admitted and most > 0:
            rows = decoding
            for i in sorted(range(len(admitted)), key=lambda i: admitted[i][0]):
                rows += admitted[i][0]
                if rows > most:
                    break
                mixed.append(i)
        first = set(mixed)
        rest = [admitted[i] for i in range(len(admitted)) if i not in first]
        forwards = []
        # LLM._prefill_groups: the others' forwards, each writing its prompts' first tokens
        if rest:
            lengths = [p for p, _ in rest]
            if prices.chunks_as_rows and most > 0:
                for g in rows_groups(lengths, most):  # engine/llm._rows_groups: in admission order
                    forwards.append(tuple(sorted(lengths[j] for j in g)))
                    T = sum(lengths[j] for j in g)
                    prefill_s += (priced(("rows", T, len(g)), lambda: prices.rows(T, len(g))) if len(g) > 1
                                  else alone(T))
            else:
                for g in prefill_groups(lengths, prices.group_tokens, padding=prices.padding):
                    forwards.append(tuple(sorted(lengths[j] for j in g)))
                    T = len(g) * max(lengths[j] for j in g)
                    prefill_s += (alone(lengths[g[0]]) if len(g) == 1 else
                                  priced(("padded", T, len(g)), lambda: prices.padded(T, len(g))))
            prefilled += len(rest)
            for p, g in rest:
                generated += 1
                if g > 1:
                    running.append([p, g - 1])
                else:
                    free += 1
        if log is not None and (rest or running or mixed):
            log.append((tuple(sorted(forwards)), tuple(sorted(admitted[i][0] for i in mixed)), len(running)))
        if not (running or mixed):
            continue
        # the decode step: every running sequence one token, beside the joining prompts' rows; where nothing can
        # change before the first running sequence finishes, its k steps at once at their mean positions (the decode
        # price is linear in positions between its grid points: a 10,000-request file through one slot had taken 1 s
        # a batch priced)
        k = min(s[1] for s in running) if log is None and not mixed and not rest and (free == 0 or not waiting) else 1
        t = 0.0
        if running:
            n = len(running)
            t += k * decode(n, sum(s[0] for s in running) / n + (k + 1) / 2)
            decoded += n * k
        if mixed:
            T, m = sum(admitted[i][0] for i in mixed), len(mixed)
            share = priced(("rows", T, m), lambda: prices.rows(T, m))
            # beside decode rows, the step's stream and per-step cost are paid once: the rows' share is theirs past
            # one row's (a lone row of one prompt: what a decode step of one sequence runs)
            t += share - (priced(("rows", 1, 1), lambda: prices.rows(1, 1)) if running else 0.0)
            joined += m
        decode_s += t
        steps += k
        still = []
        for s in running:
            generated += k
            s[0] += k
            s[1] -= k
            if s[1] > 0:
                still.append(s)
            else:
                free += 1
        for i in mixed:
            p, g = admitted[i]
            generated += 1
            if g > 1:
                still.append([p, g - 1])
            else:
                free += 1
        running = still
    return SimulatedRun(prefill_s + decode_s, generated, steps, prefill_s, decode_s,
                        decoded / steps if steps else 0.0, joined, prefilled)
