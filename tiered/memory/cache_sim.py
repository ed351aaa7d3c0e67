"""Expert-cache simulator: replays a routing trace through the runtime's ExpertCache and policies
(HOBBIT §3.3; ALGORITHMS.md gap H7: "replay routing traces ... through a cache simulator").

Per routing call (a MoE layer of one step), in the runtime's order (runtime/moe_runner.py):
  1. with prefetch, runtime/prefetch.Prefetcher's walk on the trace's recorded predictions: mask the
     predicted experts of the next layers, load the first layer's predicted misses (assumed to land
     in time: an upper bound on what prefetch saves);
  2. each used expert's needed precision: the maximum over the tokens that use it of HOBBIT's
     choice from its unimportance score (Eq. 2, thresholds T1 <= T2): s <= T1 high, s <= T2 low,
     else skip; the top-1 expert is always high (T1 = T2 = 1: every use is high precision);
  3. lookups (gap H5: a high copy serves a low request, a low copy never a high one; a skipped
     expert uses a low copy when one is cached), then the misses claim slots in the high or the low
     pool, with the layer's experts pinned. Both pools share one policy object (usage per expert).
Miss penalty: bytes of the precision each miss loads, and seconds over a link of `bandwidth`
bytes/s with `latency` seconds per load. Usage records reset at each sequence of the trace.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from tiered.errors import ConfigError
from tiered.memory.expert_cache import ExpertCache, HobbitPolicy, RandomPolicy, make_policy
from tiered.runtime.routing_trace import RoutingTrace, prediction_accuracy

HIGH, LOW, SKIP = 2, 1, 0


def unimportance(weights: np.ndarray) -> np.ndarray:
    """HOBBIT Eq. 2: for each token's top-k gate weights [n, k] (any order), the gate mass of the
    more important experts, after normalising over the top-k: s [n, k], 0 for each token's top-1."""
    w = weights / weights.sum(axis=-1, keepdims=True)
    order = np.argsort(-w, axis=-1, kind="stable")
    ws = np.take_along_axis(w, order, axis=-1)
    s_sorted = np.cumsum(ws, axis=-1) - ws
    s = np.empty_like(s_sorted)
    np.put_along_axis(s, order, s_sorted, axis=-1)
    return s


def precisions(weights: np.ndarray, t1: float, t2: float) -> np.ndarray:
    """HIGH / LOW / SKIP [n, k] from HOBBIT's thresholds on Eq. 2 (the top-1 is always HIGH)."""
    s = unimportance(weights)
    p = np.where(s <= t1, HIGH, np.where(s <= t2, LOW, SKIP))
    p[s == 0] = HIGH
    return p


@dataclass
class SimResult:
    """One replay's counts. Uses are (layer, expert) lookups per step; bytes and seconds are the
    demand misses' penalty; prefetch loads are counted apart (they overlap compute)."""

    policy: str
    capacity: int
    low_capacity: int
    prefetch: bool
    uses: int = 0
    hits: int = 0
    misses_high: int = 0
    misses_low: int = 0
    skipped: int = 0
    penalty_bytes: int = 0
    penalty_s: float | None = None
    prefetch_loads: int = 0
    prefetch_useful: int = 0
    prefetch_bytes: int = 0
    accuracy: dict = field(default_factory=dict)

    @property
    def misses(self) -> int:
        return self.misses_high + self.misses_low

    @property
    def hit_rate(self) -> float:
        return self.hits / self.uses if self.uses else 0.0

    def as_dict(self) -> dict:
        return {**asdict(self), "misses": self.misses, "hit_rate": self.hit_rate}


def replay(trace: RoutingTrace, capacity: int, policy: str, *, low_capacity: int = 0, t1: float = 1.0,
           t2: float = 1.0, high: str = "bf16", low: str = "int4", prefetch: bool = False,
           bandwidth: float | None = None, latency: float = 0.0, resident: frozenset = frozenset(),
           seed: int = 0, weights: tuple[float, float, float, float] | None = None) -> SimResult:
    """Replay `trace` through a high-precision cache of `capacity` experts (and a low-precision one
    of `low_capacity`) under eviction policy `policy` (memory/expert_cache.POLICIES).

    Args:
        t1, t2: HOBBIT's thresholds (0 <= t1 <= t2 <= 1); uses needing LOW need a low pool.
        high, low: formats of the two pools (bytes per expert from the trace's expert_bytes).
        prefetch: replay runtime/prefetch.Prefetcher on the trace's predictions.
        bandwidth, latency: the link misses cross [bytes/s, s per load]; None: no seconds.
        resident: (layer, expert) keys always on the fast tier (hits that never enter the cache).
        seed: the random policy's seed.
        weights: the hobbit policy's (w_lru, w_lfu, w_lhu, w_fld) (default uniform).
    Raises:
        ConfigError: bad thresholds, capacities or formats, or LOW uses without a low pool.
    """
    if not 0 <= t1 <= t2 <= 1:
        raise ConfigError(f"thresholds must satisfy 0 <= T1 <= T2 <= 1, got T1={t1}, T2={t2}", "HOBBIT uses 0.6, 0.9")
    if capacity < 0 or low_capacity < 0:
        raise ConfigError("cache capacities must be >= 0 experts", "pass --capacity N")
    eb = trace.meta["expert_bytes"]
    if high not in eb or low not in eb:
        raise ConfigError(f"unknown expert format {high if high not in eb else low!r}", "use " + ", ".join(eb))
    if t1 < 1 and low_capacity == 0:
        raise ConfigError("T1 < 1 sends some uses to low precision but there is no low-precision pool",
                          "pass --low-capacity M")
    L = trace.meta["num_layers"]
    pol = (RandomPolicy(L, seed) if policy == "random" else HobbitPolicy(L, weights) if policy == "hobbit" and weights
           else make_policy(policy, L))
    slot = ((0,),)
    alloc = lambda s, d, w: torch.empty(s)  # noqa: E731  (slots hold nothing: the simulator counts)
    hi = ExpertCache(capacity, slot, torch.float32, alloc, pol, precision=high, high=True, item_bytes=eb[high])
    lo = ExpertCache(low_capacity, slot, torch.float32, alloc, pol, precision=low, high=False, item_bytes=eb[low])
    res = SimResult(policy, capacity, low_capacity, prefetch)
    moe = trace.meta["moe_layers"]
    nxt = {l: moe[i + 1:] for i, l in enumerate(moe)}
    seq, masked, loaded = None, set(), set()
    for s, _step, layer, rows in trace.groups():
        if s != seq:
            seq, masked, loaded = s, set(), set()
            hi.new_sequence()
            lo.new_sequence()
        experts, weights = trace.experts[rows], trace.weights[rows]
        pol.begin_layer(layer, experts.shape[0])
        used = sorted(set(experts.ravel().tolist()))
        pinned = {(layer, e) for e in used}
        if prefetch:
            for e in used:
                if (layer, e) in loaded:
                    res.prefetch_useful += 1
            loaded = {k for k in loaded if k[0] != layer}
            masked = {k for k in masked if k[0] > layer}
            for r, target in enumerate(nxt[layer][:trace.predicted.shape[1]]):
                keys = {(target, int(e)) for e in trace.predicted[rows, r].ravel() if e >= 0}
                masked |= keys
                missing = sorted(k for k in keys if k not in resident and k not in hi)
                if missing:
                    hi.protected = set(masked)
                    for k in missing:
                        if hi.claim(k, pinned, use=False) is not None:
                            loaded.add(k)
                            res.prefetch_loads += 1
                            res.prefetch_bytes += eb[high]
                    break
            hi.protected = lo.protected = set(masked)
        need = precisions(weights, t1, t2)
        misses = []
        for e in used:  # every lookup first, then the misses claim slots (the runtime's order)
            key, sel = (layer, e), experts == e
            tokens, prec = int(sel.sum()), int(need[sel].max())
            res.uses += 1
            if key in resident:
                res.hits += 1
            elif key in hi:
                hi.lookup(key, tokens)
                res.hits += 1
            elif prec != HIGH and key in lo:
                lo.lookup(key, tokens)
                res.hits += 1
            elif prec == SKIP:
                res.skipped += 1
            else:
                misses.append((key, tokens, prec))
        for key, tokens, prec in misses:
            pool = hi if prec == HIGH else lo
            if prec == HIGH:
                res.misses_high += 1
            else:
                res.misses_low += 1
            res.penalty_bytes += pool.item_bytes
            pool.claim(key, pinned, tokens)
    if bandwidth:
        res.penalty_s = res.misses * latency + res.penalty_bytes / bandwidth
    if prefetch:
        res.accuracy = prediction_accuracy(trace)
    return res


def simplex(step: float = 0.1) -> list[tuple[float, float, float, float]]:
    """Every (w_lru, w_lfu, w_lhu, w_fld) on a grid of `step` with sum 1 (step 0.1: 286 points)."""
    n = round(1 / step)
    return [(a / n, b / n, c / n, (n - a - b - c) / n) for a in range(n + 1) for b in range(n + 1 - a)
            for c in range(n + 1 - a - b)]


def tune_weights(trace: RoutingTrace, capacity: int, step: float = 0.1, **kw) -> tuple[tuple, SimResult]:
    """HOBBIT gap H7: the Eq. 3 weights minimising the miss penalty (bytes) of `trace` by grid search over
    the simplex. Returns (weights, the replay with them); ties go to the first grid point. `kw` as for replay."""
    best = None
    for w in simplex(step):
        r = replay(trace, capacity, "hobbit", weights=w, **kw)
        if best is None or r.penalty_bytes < best[1].penalty_bytes:
            best = (w, r)
    return best
