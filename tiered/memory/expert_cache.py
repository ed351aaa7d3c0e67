"""ExpertCache: fixed slots on the fast tier for experts, with a pluggable eviction policy.

Slots are allocated once (against the tier's budget) and refilled in place, so a miss costs one
copy and no allocation. The cache is driven from the engine thread: `begin_layer` as each MoE layer
starts, `lookup` before it runs, `claim` a slot for each miss (never one pinned for the layer in
flight, nor one `protected` by the prefetcher), then the runtime fills the slot's tensors on its streams.

Policies (HOBBIT §3.3, ALGORITHMS.md 3.b Eq. 3; the victim is the candidate with the lowest score):
    random  a seeded uniform choice (the baseline every policy must beat)
    lru     last use, counted in expert uses
    lfu     F_t: tokens of this sequence that used the expert, any precision (sequence-level LFU)
    lhu     H_t: tokens of this sequence that used the expert at high precision
    fld     1 - ((l_t - l_i + l_n) mod l_n) / l_n: forward layer distance from the layer in flight
    hobbit  w_lru R_t/T + w_lfu F_t/T + w_lhu H_t/T + w_fld p^fld (Eq. 3), uniform weights until tuned (H7)
lfu, lhu and fld break ties by recency. Usage is per (layer, expert) whatever the precision: keys are
(layer, expert) or (layer, expert, precision), and a policy object may be shared by a high- and a
low-precision cache (each cache says whether its uses are high precision). Counters are per sequence
(`new_sequence`), as in HOBBIT; T counts the sequence's tokens, prompt included (gap H6).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable, Hashable

import torch

from tiered.errors import ConfigError

Key = Hashable  # (layer, expert) or (layer, expert, precision)


def _usage_key(key: Key) -> Key:
    """(layer, expert) of a key that may carry a precision tag."""
    return key[:2] if isinstance(key, tuple) and len(key) == 3 else key


def _layer(key: Key) -> int:
    return key[0] if isinstance(key, tuple) else 0


class EvictionPolicy:
    """Usage records of one sequence and a `score` per cached key (lower = evicted first).

    Args:
        num_layers: l_n, decoder layers of the model (the FLD ring; 1 when unknown).
    Attributes:
        clock: expert uses so far (LRU's time, kept across sequences); tokens: T, tokens of the sequence so far;
        layer: l_i, the layer in flight; last_use, uses, high_uses, last_token: per usage key.
    """

    name = "base"

    def __init__(self, num_layers: int = 1) -> None:
        self.num_layers = max(1, num_layers)
        self.clock = 0
        self.last_use: dict[Key, int] = {}
        self.new_sequence()

    def new_sequence(self) -> None:
        """Forget the sequence's usage records (HOBBIT resets them at the start of each sequence);
        LRU's recency (`clock`, `last_use`) is the cache's own and carries on."""
        self.tokens = 0
        self.layer = 0
        self._last_layer: int | None = None
        self.last_token: dict[Key, int] = {}
        self.uses: dict[Key, int] = {}
        self.high_uses: dict[Key, int] = {}

    def begin_layer(self, layer: int, tokens: int) -> None:
        """A MoE layer starts with `tokens` tokens; a layer not after the previous one starts a new
        forward step, which adds its tokens to T."""
        if self._last_layer is None or layer <= self._last_layer:
            self.tokens += tokens
        self._last_layer = self.layer = layer

    def touch(self, key: Key, tokens: int = 1, high: bool = True) -> None:
        """Record one use of `key` by `tokens` tokens (a hit, or its insertion after a miss)."""
        k = _usage_key(key)
        self.clock += 1
        self.last_use[k] = self.clock
        self.last_token[k] = self.tokens
        self.uses[k] = self.uses.get(k, 0) + tokens
        if high:
            self.high_uses[k] = self.high_uses.get(k, 0) + tokens

    def forget(self, key: Key) -> None:
        """`key` left the cache. Usage records stay: they are the sequence's, not the slot's."""

    def recency(self, key: Key) -> float:
        """Last use in (0, 1]: a tie-breaker below one use."""
        return self.last_use.get(_usage_key(key), 0) / (self.clock + 1)

    def fld(self, key: Key) -> float:
        """HOBBIT's p^fld: 1 for the layer in flight, 1 - 1/l_n for the next, 1/l_n for the last one."""
        n = self.num_layers
        return 1 - ((_layer(key) - self.layer + n) % n) / n

    def score(self, key: Key) -> float:
        raise NotImplementedError

    def victim(self, candidates: list[Key]) -> Key:
        """The candidate with the lowest score (ties: the first)."""
        return min(candidates, key=self.score)


class RandomPolicy(EvictionPolicy):
    """A uniformly random victim from a seeded generator (seed 0 unless given)."""

    name = "random"

    def __init__(self, num_layers: int = 1, seed: int = 0) -> None:
        self.rng = random.Random(seed)
        super().__init__(num_layers)

    def score(self, key: Key) -> float:
        return 0.0

    def victim(self, candidates: list[Key]) -> Key:
        return self.rng.choice(candidates)


class LRUPolicy(EvictionPolicy):
    """Least recently used first."""

    name = "lru"

    def score(self, key: Key) -> float:
        return self.last_use.get(_usage_key(key), 0)


class LFUPolicy(EvictionPolicy):
    """Least frequently used in this sequence first (F_t, tokens that used it); ties by recency."""

    name = "lfu"

    def score(self, key: Key) -> float:
        return self.uses.get(_usage_key(key), 0) + self.recency(key)


class LHUPolicy(EvictionPolicy):
    """Least high-precision used first (H_t: tokens that used it at high precision); ties by recency."""

    name = "lhu"

    def score(self, key: Key) -> float:
        return self.high_uses.get(_usage_key(key), 0) + self.recency(key)


class FLDPolicy(EvictionPolicy):
    """Farthest forward layer distance first: the layer just finished is needed last; ties by recency."""

    name = "fld"

    def score(self, key: Key) -> float:
        return self.fld(key) + self.recency(key) / self.num_layers


class HobbitPolicy(EvictionPolicy):
    """HOBBIT's multidimensional priority (Eq. 3): p_t = w_lru R_t/T + w_lfu F_t/T + w_lhu H_t/T + w_fld p^fld.

    R_t is the token index of t's last use, F_t / H_t the tokens that used t (at high precision),
    T the tokens of the sequence. Args: weights (w_lru, w_lfu, w_lhu, w_fld), >= 0 and summing to 1
    (default uniform, HOBBIT gap H7). Raises ConfigError on other weights.
    """

    name = "hobbit"

    def __init__(self, num_layers: int = 1, weights: tuple[float, float, float, float] = (0.25, 0.25, 0.25, 0.25)) -> None:
        if len(weights) != 4 or min(weights) < 0 or abs(sum(weights) - 1) > 1e-6:
            raise ConfigError(f"HOBBIT policy weights must be 4 non-negative numbers summing to 1, got {weights}",
                              "pass (w_lru, w_lfu, w_lhu, w_fld), e.g. (0.25, 0.25, 0.25, 0.25)")
        self.weights = tuple(weights)
        super().__init__(num_layers)

    def score(self, key: Key) -> float:
        k, T = _usage_key(key), max(self.tokens, 1)
        w_lru, w_lfu, w_lhu, w_fld = self.weights
        return (w_lru * self.last_token.get(k, 0) / T + w_lfu * self.uses.get(k, 0) / T
                + w_lhu * self.high_uses.get(k, 0) / T + w_fld * self.fld(key))


POLICIES: dict[str, type[EvictionPolicy]] = {p.name: p for p in (RandomPolicy, LRUPolicy, LFUPolicy, LHUPolicy,
                                                                  FLDPolicy, HobbitPolicy)}


def make_policy(name: str, num_layers: int = 1) -> EvictionPolicy:
    """The policy called `name` (a POLICIES key). Raises ConfigError for an unknown name."""
    try:
        return POLICIES[name](num_layers)
    except KeyError:
        raise ConfigError(f"unknown cache policy {name!r}", "use one of " + ", ".join(POLICIES)) from None


@dataclass
class CacheStats:
    """Counters since creation: lookups that hit / missed, evictions, bytes written into slots, and
    the miss penalty: bytes the misses had to bring in (`miss_bytes`, one expert each)."""

    hits: int = 0
    misses: int = 0
    evictions: int = 0
    bytes_in: int = 0
    miss_bytes: int = 0

    @property
    def hit_rate(self) -> float:
        n = self.hits + self.misses
        return self.hits / n if n else 0.0

    def miss_seconds(self, bandwidth: float, latency: float = 0.0) -> float:
        """The miss penalty in seconds over a link of `bandwidth` bytes/s with `latency` s per load."""
        return self.misses * latency + self.miss_bytes / bandwidth


class ExpertCache:
    """`num_slots` slots, each a tuple of tensors of `shapes` in `dtype`, allocated with `alloc`.

    Args:
        num_slots: capacity in experts (0 = no cache: every lookup misses and claim returns None).
        shapes: shapes of one expert's tensors, e.g. ((F, D), (F, D), (D, F)).
        dtype: element type of the slots.
        alloc: (shape, dtype, what) -> tensor, reserving against the tier's budget.
        policy: eviction policy object (default LRU); may be shared with a cache of the other precision.
        precision: the format this pool holds ("bf16", "int4", ...): a name for stats and errors.
        high: whether uses from this pool count as high precision (HOBBIT's LHU).
        item_bytes: bytes of one expert as a miss brings it in (default: one slot's bytes).
    Attributes:
        protected: keys that `claim` must not evict (experts predicted by the prefetcher).
    """

    def __init__(self, num_slots: int, shapes, dtype: torch.dtype,
                 alloc: Callable[[tuple, torch.dtype, str], torch.Tensor], policy: EvictionPolicy | None = None,
                 precision: str = "", high: bool = True, item_bytes: int | None = None) -> None:
        self.slots = [tuple(alloc(tuple(s), dtype, f"expert cache slot {i}") for s in shapes) for i in range(num_slots)]
        self.slot_bytes = sum(t.numel() * t.element_size() for t in self.slots[0]) if self.slots else 0
        self.item_bytes = self.slot_bytes if item_bytes is None else item_bytes
        self.policy = policy or LRUPolicy()
        self.precision, self.high = precision, high
        self.where: dict[Key, int] = {}  # key -> slot index
        self.free = list(range(num_slots))[::-1]
        self.protected: set = set()
        self.stats = CacheStats()

    @property
    def num_slots(self) -> int:
        return len(self.slots)

    def __contains__(self, key: Key) -> bool:
        return key in self.where

    def begin_layer(self, layer: int, tokens: int) -> None:
        """Tell the policy a MoE layer of `tokens` tokens starts (its FLD origin and token count T)."""
        self.policy.begin_layer(layer, tokens)

    def new_sequence(self) -> None:
        """A new sequence starts: usage records and protections reset; the cached experts stay."""
        self.policy.new_sequence()
        self.protected.clear()

    def lookup(self, key: Key, tokens: int = 1) -> tuple[torch.Tensor, ...] | None:
        """The slot holding `key` (a hit by `tokens` tokens, recorded), or None (a miss, recorded)."""
        i = self.where.get(key)
        if i is None:
            self.stats.misses += 1
            self.stats.miss_bytes += self.item_bytes
            return None
        self.stats.hits += 1
        self.policy.touch(key, tokens, self.high)
        return self.slots[i]

    def claim(self, key: Key, pinned: set, tokens: int = 1, use: bool = True) -> tuple[torch.Tensor, ...] | None:
        """A slot for `key`, evicting the policy's victim among keys neither pinned nor protected.

        The caller must fill the slot before the key is used. `use` records the insertion as a use
        by `tokens` tokens (a demand miss); a prefetch passes use=False. Returns None when every slot
        is pinned or protected (or there are none): the caller then uses a temporary buffer.
        """
        if not self.slots:
            return None
        if self.free:
            i = self.free.pop()
        else:
            candidates = [k for k in self.where if k not in pinned and k not in self.protected]
            if not candidates:
                return None
            victim = self.policy.victim(candidates)
            i = self.where.pop(victim)
            self.policy.forget(victim)
            self.stats.evictions += 1
        self.where[key] = i
        if use:
            self.policy.touch(key, tokens, self.high)
        self.stats.bytes_in += self.slot_bytes
        return self.slots[i]
