"""ExpertCache: fixed slots on the fast tier for experts, with a pluggable eviction policy.

Slots are allocated once (against the tier's budget) and refilled in place, so a miss costs one
copy and no allocation. The cache is driven from the engine thread: `lookup` before a layer runs,
`claim` a slot for each miss (never one pinned for the layer in flight), then the runtime fills the
slot's tensors on its streams. Policies are small objects with pure scoring (LRU, LFU); HOBBIT's
weighted policy plugs in the same way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Hashable

import torch

Key = Hashable  # (layer, expert)


class EvictionPolicy:
    """Chooses which cached key to evict. Subclasses override `score` (lower = evicted first)."""

    def __init__(self) -> None:
        self.clock = 0
        self.last_use: dict[Key, int] = {}
        self.uses: dict[Key, int] = {}

    def touch(self, key: Key) -> None:
        """Record one use of `key` (a hit, or its insertion after a miss)."""
        self.clock += 1
        self.last_use[key] = self.clock
        self.uses[key] = self.uses.get(key, 0) + 1

    def forget(self, key: Key) -> None:
        self.last_use.pop(key, None)

    def score(self, key: Key) -> float:
        raise NotImplementedError

    def victim(self, candidates: list[Key]) -> Key:
        """The candidate with the lowest score (ties: the first)."""
        return min(candidates, key=self.score)


class LRUPolicy(EvictionPolicy):
    """Least recently used first."""

    def score(self, key: Key) -> float:
        return self.last_use.get(key, 0)


class LFUPolicy(EvictionPolicy):
    """Least frequently used first (ties broken by recency)."""

    def score(self, key: Key) -> float:
        return self.uses.get(key, 0) + self.last_use.get(key, 0) / (self.clock + 1)


POLICIES = {"lru": LRUPolicy, "lfu": LFUPolicy}


@dataclass
class CacheStats:
    """Counters since creation: lookups that hit / missed, evictions, bytes written into slots."""

    hits: int = 0
    misses: int = 0
    evictions: int = 0
    bytes_in: int = 0

    @property
    def hit_rate(self) -> float:
        n = self.hits + self.misses
        return self.hits / n if n else 0.0


class ExpertCache:
    """`num_slots` slots, each a tuple of tensors of `shapes` in `dtype`, allocated with `alloc`.

    Args:
        num_slots: capacity in experts (0 = no cache: every lookup misses and claim returns None).
        shapes: shapes of one expert's tensors, e.g. ((F, D), (F, D), (D, F)).
        dtype: element type of the slots.
        alloc: (shape, dtype, what) -> tensor, reserving against the tier's budget.
        policy: eviction policy object (default LRU).
    """

    def __init__(self, num_slots: int, shapes, dtype: torch.dtype,
                 alloc: Callable[[tuple, torch.dtype, str], torch.Tensor], policy: EvictionPolicy | None = None) -> None:
        self.slots = [tuple(alloc(tuple(s), dtype, f"expert cache slot {i}") for s in shapes) for i in range(num_slots)]
        self.slot_bytes = sum(t.numel() * t.element_size() for t in self.slots[0]) if self.slots else 0
        self.policy = policy or LRUPolicy()
        self.where: dict[Key, int] = {}  # key -> slot index
        self.free = list(range(num_slots))[::-1]
        self.stats = CacheStats()

    @property
    def num_slots(self) -> int:
        return len(self.slots)

    def __contains__(self, key: Key) -> bool:
        return key in self.where

    def lookup(self, key: Key) -> tuple[torch.Tensor, ...] | None:
        """The slot holding `key` (a hit, recorded), or None (a miss, recorded)."""
        i = self.where.get(key)
        if i is None:
            self.stats.misses += 1
            return None
        self.stats.hits += 1
        self.policy.touch(key)
        return self.slots[i]

    def claim(self, key: Key, pinned: set) -> tuple[torch.Tensor, ...] | None:
        """A slot for `key`, evicting the policy's victim among unpinned keys.

        The caller must fill the slot before the key is used. Returns None when every slot is
        pinned (or there are none): the caller then uses a temporary buffer.
        """
        if not self.slots:
            return None
        if self.free:
            i = self.free.pop()
        else:
            candidates = [k for k in self.where if k not in pinned]
            if not candidates:
                return None
            victim = self.policy.victim(candidates)
            i = self.where.pop(victim)
            self.policy.forget(victim)
            self.stats.evictions += 1
        self.where[key] = i
        self.policy.touch(key)
        self.stats.bytes_in += self.slot_bytes
        return self.slots[i]
