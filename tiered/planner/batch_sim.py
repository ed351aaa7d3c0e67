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
running sequences' one row each counted); the others prefill first, as LLM._prefill_groups groups them (in admission
order, scheduler.rows_groups: as rows of native steps where Plan.chunks_as_rows, else packed into forwards of at most
a prefill chunk's tokens, models/layers.build_packed_metadata),
each writing its first token; then every running sequence decodes one token, beside the joining prompts' rows,
whose first tokens come from their last rows. A sequence finishing gives its slot back for the next step.
Prefix reuse (`prefixes`: which prompts share how many leading tokens, PromptPrefixes; tiered batch's server
reuses prefixes): an admitted request takes the free slot whose last request's prompt shares the most of its own,
or a running one's lends more (Scheduler._take_slot), and prefills only the rest; among those admitted at one step,
a prompt equal to an earlier one's is not prefilled at all (PromptTwins: a request's n choices), and where the plan
shares prefixes (Plan.shared_prefixes) one sharing at least SHARED_PREFIX_TOKENS more with an earlier admitted
prompt takes them from it (SharedPrefixes): that leader prefills first, alone, its followers in later forwards.
Both compare prompts only (a slot also holds its last request's generated tokens, which a later prompt may
continue: not counted); a prompt's uncached tokens are priced as a prompt of that many tokens attending to the
cached prefix too (StepPrices' `past`: a group's mean prefix weighted by its prompts' tokens).
Not replayed: stops before max_tokens (every request generates its max_tokens: the file's bound), speculative
decoding.
"""

from __future__ import annotations

import math
from array import array
from collections import deque
from dataclasses import dataclass
from typing import Callable, NamedTuple, Sequence

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
        rows: (prompt tokens T, prompts k, past) -> seconds of k prompts of T tokens in all as rows of one native
            step, after `past` cached positions on average a row (cpu_predict.predict_prompt_rows; the last row of
            each has its logits).
        alone: (prompt tokens, past) -> seconds of one prompt prefilled on its own after `past` cached positions,
            on the engine's path for it (latency_cpu.prompt_time: rows, chunks, or the modules' prefill).
        packed: (each prompt's tokens, past) -> seconds of those prompts packed into one forward, after `past`
            cached positions each (cpu_predict.predict_prefill with their lengths).
        most_rows: Plan.most_prompt_rows(): the most prompt rows one native step takes (0: prompts never join).
        chunks_as_rows: Plan.chunks_as_rows(): prompts prefill as rows of native steps (engine/llm._rows_groups).
        group_tokens: the most tokens of a packed prefill forward (Plan.prefill_chunk).
        shared_prefixes: Plan.shared_prefixes: prompts admitted together share a prefix's prefill (SharedPrefixes).
    """

    decode: Callable[[int, int], float]
    rows: Callable[[int, int], float]
    alone: Callable[[int], float]
    packed: Callable[[tuple[int, ...], int], float]
    most_rows: int
    chunks_as_rows: bool
    group_tokens: int
    shared_prefixes: bool = False


class PromptPrefixes(NamedTuple):
    """How many leading prompt tokens each two requests of a workload share, kept without the tokens: `rank` is each
    request's place among the prompts sorted (as token lists), `shared` the tokens each two neighbours of that order
    share at their start (n - 1 of them). Two requests share the fewest of `shared` between their ranks (the LCP array
    of string algorithms): `of` makes one from the prompts, `Table` answers for pairs.

    Raises (of, check):
        ValueError: no prompts, an empty prompt, or a rank and shared list that do not describe n prompts.
    """

    rank: tuple[int, ...]
    shared: tuple[int, ...]

    @classmethod
    def of(cls, prompts: Sequence[Sequence[int]]) -> "PromptPrefixes":
        """The prefixes of `prompts` (token ids of each request's prompt, in the workload's order: lists, or
        array("i")s, 4 bytes a token where a big file's lists would take ~36; O(n log n) comparisons of them)."""
        from tiered.engine.scheduler import _common_prefix

        if not prompts or any(len(p) < 1 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        # one type for all (an array never equals a list)
        lists = [p if isinstance(p, array) and p.typecode == "i" else array("i", p) for p in prompts]
        order = sorted(range(len(lists)), key=lists.__getitem__)
        rank = [0] * len(lists)
        for k, i in enumerate(order):
            rank[i] = k
        return cls(tuple(rank), tuple(_common_prefix(lists[a], lists[b]) for a, b in zip(order, order[1:])))

    def check(self, n: int) -> "PromptPrefixes":
        """Self, as ints, where it describes `n` prompts (rank a permutation of 0..n-1, n - 1 shared counts >= 0)."""
        rank, shared = tuple(int(r) for r in self.rank), tuple(int(c) for c in self.shared)
        if sorted(rank) != list(range(n)) or len(shared) != max(0, n - 1) or any(c < 0 for c in shared):
            raise ValueError(f"prefixes must rank {n} prompts and give {max(0, n - 1)} shared counts >= 0")
        return PromptPrefixes(rank, shared)

    def any_shared(self) -> bool:
        """Whether any two prompts share a token at their start."""
        return any(self.shared)

    class Table:
        """common(i, j): the leading tokens requests i and j (i != j) share, in O(1) (a sparse table of minima over
        `shared`, log2(n) rows of n ints)."""

        def __init__(self, prefixes: "PromptPrefixes") -> None:
            import numpy as np

            self.rank = prefixes.rank
            rows = [np.asarray(prefixes.shared, dtype=np.int64)]
            while 2 * (1 << (len(rows) - 1)) <= len(rows[0]):
                half = 1 << (len(rows) - 1)
                rows.append(np.minimum(rows[-1][:-half], rows[-1][half:]))
            self.rows = [array("q", r.tobytes()) for r in rows]  # 8 bytes an int, read back as Python ints

        def common(self, i: int, j: int) -> int:
            a, b = self.rank[i], self.rank[j]
            if a > b:
                a, b = b, a
            k = (b - a).bit_length() - 1
            row = self.rows[k]
            return min(row[a], row[b - (1 << k)])


@dataclass
class SimulatedRun:
    """A replayed workload: `seconds` in all (prefill_s of prefill forwards, decode_s of decode steps with their
    joining prompts' rows), `generated` tokens, decode `steps`, the mean sequences a step decoded (`occupancy`),
    how many prompts joined a step as rows (`joined`) or prefilled first (`prefilled`), and the prompt tokens not
    computed for a request (`reused`: its slot's, a running slot's or a leader's KV, or its twin's prefill)."""

    seconds: float
    generated: int
    steps: int
    prefill_s: float
    decode_s: float
    occupancy: float
    joined: int
    prefilled: int
    reused: int = 0

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
                      log: list | None = None, prefixes: PromptPrefixes | None = None) -> SimulatedRun:
    """Replay `requests` ((prompt tokens, generated tokens) each, >= 1, in the order they are queued, all at once)
    through `slots` KV-cache slots as the engine's continuous batching runs them (module docstring), each step
    priced by `prices`. `prefixes`: which of their prompts share how many leading tokens (PromptPrefixes, one rank
    a request), whose KV the server reuses (module docstring); None: every prompt prefilled whole. `log`: where
    given, each step's (the prompts prefilled first: each forward's uncached prompt tokens, the uncached prompt
    tokens of those joining the decode step as rows, sequences decoded), every tuple sorted, is appended to it
    (tests compare LLM.step's).

    Returns:
        SimulatedRun: the seconds from the first step to the last token, and what ran.
    Raises:
        ValueError: slots < 1, a request with fewer than 1 prompt or generated token, or prefixes not of as many
            prompts.
    """
    if slots < 1:
        raise ValueError(f"slots must be >= 1, got {slots}")
    if any(p < 1 or g < 1 for p, g in requests):
        raise ValueError("every request needs >= 1 prompt token and >= 1 generated token")
    if prefixes is not None and len(prefixes.rank) != len(requests):
        raise ValueError(f"prefixes rank {len(prefixes.rank)} prompts, not the {len(requests)} requests'")
    if not requests:
        return SimulatedRun(0.0, 0, 0, 0.0, 0.0, 0.0, 0, 0)
    from tiered.engine.scheduler import SHARED_PREFIX_TOKENS, rows_groups

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

    alone_at: dict[int, Callable[[float], float]] = {}

    def alone(T: int, past: int) -> float:
        if past not in alone_at:
            alone_at[past] = _grid(lambda t: prices.alone(t, past), p_step)
        return alone_at[past](T)

    memo: dict[tuple, float] = {}

    def priced(key: tuple, f: Callable[[], float]) -> float:
        if key not in memo:
            memo[key] = f()
        return memo[key]

    table = PromptPrefixes.Table(prefixes) if prefixes is not None and prefixes.any_shared() else None
    common = table.common if table is not None else None
    share = table is not None and prices.shared_prefixes
    most = prices.most_rows
    prompt = [p for p, _ in requests]
    waiting = deque(range(len(requests)))
    running: list[list[int]] = []  # [positions cached, tokens left to generate, request, slot] of each running one
    free = list(range(slots - 1, -1, -1))  # pop() hands out the lowest (Scheduler._free)
    last = [-1] * slots  # the request whose prompt each slot holds the KV of (prefix reuse)
    cached: dict[int, int] = {}  # each admitted request's prompt tokens not computed for it
    slot_of: dict[int, int] = {}
    prefill_s = decode_s = 0.0
    generated = steps = decoded = joined = prefilled = reused = 0

    def forwards_of(group: list[int], out: list) -> float:
        """The seconds of LLM._prefill_groups' forwards over `group` (admitted requests), each appended to `out`."""
        lengths = [prompt[i] - cached[i] for i in group]
        as_rows = prices.chunks_as_rows and most > 0
        t = 0.0
        for g in rows_groups(lengths, most if as_rows else prices.group_tokens):  # engine/llm._rows_groups
            out.append(tuple(sorted(lengths[j] for j in g)))
            if len(g) == 1:
                t += alone(lengths[g[0]], cached[group[g[0]]])
            elif as_rows:
                t += rows_price([group[j] for j in g])
            else:
                lens, past = tuple(sorted(lengths[j] for j in g)), mean_past([group[j] for j in g])
                t += priced(("packed", lens, past), lambda: prices.packed(lens, past))
        return t

    def mean_past(group: list[int]) -> int:
        """The cached positions before `group`'s prompts, their mean weighted by each one's uncached tokens."""
        return round(sum((prompt[i] - cached[i]) * cached[i] for i in group) / sum(prompt[i] - cached[i] for i in group))

    def rows_price(group: list[int]) -> float:
        """The seconds of `group`'s uncached prompt tokens as rows of one native step."""
        T, past = sum(prompt[i] - cached[i] for i in group), mean_past(group)
        return priced(("rows", T, len(group), past), lambda: prices.rows(T, len(group), past))

    def release(slot: int) -> None:
        free.append(slot)
        free.sort(reverse=True)

    while waiting or running:
        # Scheduler.schedule: the waiting take free slots in order; with prefixes, the free slot whose last prompt
        # shares the most of theirs, or a running sequence's slot lends more (Scheduler._take_slot)
        admitted: list[int] = []
        sources = [s[2] for s in running] if common is not None and waiting and free else []
        while waiting and free:
            i = waiting.popleft()
            best, n = free[-1], 0
            if common is not None:
                for slot in reversed(free):  # lowest first: ties keep the lowest
                    if last[slot] >= 0 and (m := common(i, last[slot])) > n:
                        best, n = slot, m
                n = max([n] + [common(i, j) for j in sources])
            free.remove(best)
            last[best], slot_of[i], cached[i] = i, best, min(n, prompt[i] - 1)
            admitted.append(i)
        # LLM.step: a prompt equal to an earlier admitted one's is not prefilled (PromptTwins), one sharing a prefix
        # with an earlier one's takes it after that leader's prefill (SharedPrefixes, where the plan shares them)
        twins: dict[int, list[int]] = {}
        firsts: dict[int, list[int]] = {}
        follows: dict[int, int] = {}
        prefilling = admitted
        if common is not None:
            prefilling = []
            for i in admitted:
                leader = next((j for j in firsts.get(prompt[i], ()) if common(i, j) == prompt[i]), None)
                if leader is None:
                    firsts.setdefault(prompt[i], []).append(i)
                    prefilling.append(i)
                else:
                    twins.setdefault(leader, []).append(i)
                    cached[i] = prompt[i]
        if share:
            leaders: list[int] = []
            for i in prefilling:
                n, best = 0, -1
                for j in leaders:
                    if (m := common(i, j)) > n:
                        n, best = m, j
                n = min(n, prompt[i] - 1)
                if best >= 0 and n - cached[i] >= SHARED_PREFIX_TOKENS:
                    follows[i], cached[i] = best, n
                else:
                    leaders.append(i)
        leading = set(follows.values())
        decoding = len(running)
        # LLM._mixed_prefills: the shortest uncached prompts (a leader's never), while the step's rows stay in `most`
        mixed: list[int] = []
        if admitted and most > 0:
            rows = decoding
            for i in sorted((i for i in prefilling if i not in leading), key=lambda i: prompt[i] - cached[i]):
                rows += prompt[i] - cached[i]
                if rows > most:
                    break
                mixed.append(i)
        first = set(mixed)
        rest = [i for i in prefilling if i not in first]
        forwards: list[tuple[int, ...]] = []
        # LLM._prefill_groups: the others' forwards, each writing its prompts' first tokens (and their twins'): the
        # leaders and the prompts sharing nothing first, then the followers
        prefill_s += forwards_of([i for i in rest if i not in follows], forwards)
        prefill_s += forwards_of([i for i in rest if i in follows], forwards)
        prefilled += len(rest)
        for i in rest + [t for i in rest for t in twins.get(i, ())]:
            generated += 1
            if requests[i][1] > 1:
                running.append([prompt[i], requests[i][1] - 1, i, slot_of[i]])
            else:
                release(slot_of[i])
        reused += sum(cached[i] for i in admitted)
        if log is not None and (rest or running or mixed):
            log.append((tuple(sorted(forwards)), tuple(sorted(prompt[i] - cached[i] for i in mixed)), len(running)))
        if not (running or mixed):
            continue
        # the decode step: every running sequence one token, beside the joining prompts' rows; where nothing can
        # change before the first running sequence finishes, its k steps at once at their mean positions (the decode
        # price is linear in positions between its grid points: a 10,000-request file through one slot had taken 1 s
        # a batch priced)
        k = min(s[1] for s in running) if log is None and not admitted and (not free or not waiting) else 1
        t = 0.0
        if running:
            n = len(running)
            t += k * decode(n, sum(s[0] for s in running) / n + (k + 1) / 2)
            decoded += n * k
        if mixed:
            # beside decode rows, the step's stream and per-step cost are paid once: the rows' share is theirs past
            # one row's (a lone row of one prompt: what a decode step of one sequence runs)
            t += rows_price(mixed) - (priced(("rows", 1, 1, 0), lambda: prices.rows(1, 1, 0)) if running else 0.0)
            joined += len(mixed)
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
                release(s[3])
        for i in mixed + [t for i in mixed for t in twins.get(i, ())]:
            generated += 1
            if requests[i][1] > 1:
                still.append([prompt[i], requests[i][1] - 1, i, slot_of[i]])
            else:
                release(slot_of[i])
        running = still
    return SimulatedRun(prefill_s + decode_s, generated, steps, prefill_s, decode_s,
                        decoded / steps if steps else 0.0, joined, prefilled, reused)
