"""Expert placement: which experts live on the fast tier, in CPU RAM, or stay on disk.

Fiddler §3.4 (ALGORITHMS.md 2.a.1, 2.b): non-expert weights go to the compute tier; the fast tier's
remaining bytes are filled with whole experts in order of global popularity (tokens routed, from a
calibration profile, over all (layer, expert) pairs); the rest go to CPU RAM, then disk. tiered adds
an expert cache (HOBBIT) carved out of the fast tier before the resident experts are chosen.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from tiered.errors import BudgetError, CheckpointError
from tiered.hardware.budget import format_bytes

FAST, CPU, DISK = "fast", "cpu", "disk"


@dataclass(frozen=True)
class ExpertPlacement:
    """Home tier of every (layer, expert), and the expert-cache size on the fast tier.

    Attributes:
        tiers: (layer, expert) -> "fast" | "cpu" | "disk".
        cache_slots: experts the fast-tier cache holds.
        expert_bytes: bytes of one expert in the compute dtype.
        expected_hit_rate: share of profiled routed tokens whose expert is fast-resident (Fiddler's
            "hit" formula), or None without a profile.
    """

    tiers: dict = field(default_factory=dict)
    cache_slots: int = 0
    expert_bytes: int = 0
    expected_hit_rate: float | None = None

    def count(self, tier: str, layer: int | None = None) -> int:
        """Experts whose home is `tier`, in all layers or in `layer`."""
        return sum(1 for (l, _), t in self.tiers.items() if t == tier and (layer is None or l == layer))

    def summary(self) -> str:
        return (f"experts: {self.count(FAST)} resident on the fast tier, {self.count(CPU)} in CPU RAM, "
                f"{self.count(DISK)} on disk; cache {self.cache_slots} slots of {format_bytes(self.expert_bytes)}")


def load_popularity(path: str | Path, num_layers: int, num_experts: int) -> np.ndarray:
    """Tokens routed per (layer, expert) from a `tiered profile-experts` JSON: float [L, E].

    Raises:
        CheckpointError: the file is unreadable or its shape does not match the model.
    """
    try:
        data = json.loads(Path(path).read_text())
        counts = np.asarray(data["tokens"], dtype=np.float64)
    except (OSError, ValueError, KeyError) as e:
        raise CheckpointError(f"cannot read expert profile {path} ({e})",
                              "write one with `tiered profile-experts`") from None
    if counts.shape != (num_layers, num_experts):
        raise CheckpointError(f"expert profile {path} is for {counts.shape}, model has "
                              f"({num_layers}, {num_experts}) layers x experts", "profile this model")
    return counts


def plan_expert_placement(moe_layers: list[int], num_experts: int, expert_bytes: int, fast_free: float,
                          cpu_free: float | None, popularity: np.ndarray | None = None,
                          cache_slots: int | None = None, min_cache_slots: int = 0,
                          max_resident: int | None = None) -> ExpertPlacement:
    """Choose each expert's home tier within the budgets.

    Args:
        moe_layers: indices of the layers with experts.
        num_experts: experts per MoE layer.
        expert_bytes: bytes of one expert on any tier [bytes].
        fast_free: bytes left on the fast tier after non-expert weights and KV cache.
        cpu_free: bytes of CPU RAM for expert home copies (None = the fast tier is CPU RAM itself:
            no separate CPU tier; all non-resident experts stay on disk).
        popularity: float [L, E] tokens routed per expert (None = uniform, layer order).
        cache_slots: slots for the expert cache; None = as many as fit up to one layer's experts,
            after `min_cache_slots`.
        min_cache_slots: fewest cache slots that the runtime needs.
        max_resident: cap on fast-resident experts (None = as many as fit).
    Raises:
        BudgetError: the fast tier cannot hold even `min_cache_slots` experts.
    """
    keys = [(l, e) for l in moe_layers for e in range(num_experts)]
    if cache_slots is None:
        cache_slots = int(min(num_experts, fast_free // max(expert_bytes, 1)))
    if cache_slots < min_cache_slots or cache_slots * expert_bytes > fast_free:
        raise BudgetError(
            f"the fast tier has {format_bytes(max(fast_free, 0))} left for experts; {max(cache_slots, min_cache_slots)} "
            f"cache slots need {format_bytes(max(cache_slots, min_cache_slots) * expert_bytes)}",
            "raise the fast-tier budget or lower --cache-slots")
    left = fast_free - cache_slots * expert_bytes
    if popularity is not None:
        order = sorted(keys, key=lambda k: -popularity[k[0], k[1]])
    else:
        order = keys
    tiers = {}
    n_fast = int(min(len(order), left // max(expert_bytes, 1)))
    if max_resident is not None:
        n_fast = min(n_fast, max_resident)
    for k in order[:n_fast]:
        tiers[k] = FAST
    rest = order[n_fast:]
    n_cpu = 0 if cpu_free is None else int(min(len(rest), cpu_free // max(expert_bytes, 1)))
    for k in rest[:n_cpu]:
        tiers[k] = CPU
    for k in rest[n_cpu:]:
        tiers[k] = DISK
    hit = None
    if popularity is not None and popularity.sum() > 0:
        hit = float(sum(popularity[k[0], k[1]] for k in order[:n_fast]) / popularity.sum())
    return ExpertPlacement(tiers, cache_slots, expert_bytes, hit)
