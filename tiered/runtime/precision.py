# N = tokens, k = top-k, E = experts
"""HOBBIT's token-level precision choice for expert misses (Tang et al., "HOBBIT: A Mixed Precision
Expert Offloading System for Fast MoE Inference", 2024, §4.1; ALGORITHMS.md §3.b).

The router's top-k weights of a token, normalised over the k to sum to 1 and ranked (rank 0 the
largest), give each selected expert an unimportance score (Eq. 2):

    s_0 = 0,   s_i = sum_{j < i} w_j      (gate mass already covered by more important experts)

and with thresholds 0 <= T1 <= T2 <= 1:  s <= T1 -> HIGH,  T1 < s <= T2 -> LOW,  s > T2 -> SKIP;
the top-1 expert (s = 0) is always HIGH. An expert used by several tokens of a step takes the
highest precision any of them asks for. Defaults are the paper's Mixtral values T1 = 0.6, T2 = 0.9
(§3.d: 67% high / 30% low / 3% skipped there).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tiered.errors import ConfigError

SKIP, LOW, HIGH = 0, 1, 2
NAMES = {HIGH: "high", LOW: "low", SKIP: "skip"}
DEFAULT_T1, DEFAULT_T2 = 0.6, 0.9


@dataclass(frozen=True)
class MixedPrecision:
    """HOBBIT's Expert Scorer: thresholds and the two storage formats.

    Args:
        high, low: expert formats of the high and low copies (e.g. "bf16" and "int4").
        t1, t2: thresholds on the unimportance score, 0 <= t1 <= t2 <= 1.
    Raises:
        ConfigError: thresholds out of order or range.
    """

    high: str
    low: str
    t1: float = DEFAULT_T1
    t2: float = DEFAULT_T2

    def __post_init__(self) -> None:
        if not 0.0 <= self.t1 <= self.t2 <= 1.0:
            raise ConfigError(f"HOBBIT thresholds need 0 <= T1 <= T2 <= 1, got T1={self.t1}, T2={self.t2}",
                              "pass e.g. T1=0.6, T2=0.9 (the paper's defaults)")

    def slot_precisions(self, topk_weight: torch.Tensor) -> torch.Tensor:
        """Precision of each routing slot: topk_weight [N, k] (any order) -> int64 [N, k] of
        HIGH / LOW / SKIP, on topk_weight's device."""
        w = topk_weight.float()
        w = w / w.sum(dim=-1, keepdim=True).clamp_min(1e-30)  # normalised over the top-k
        sorted_w, order = torch.sort(w, dim=-1, descending=True)  # rank 0 = most important
        s = torch.cumsum(sorted_w, dim=-1) - sorted_w  # (N, k): mass of the higher-ranked experts
        prec = torch.where(s <= self.t1, HIGH, torch.where(s <= self.t2, LOW, SKIP))
        prec[:, 0] = HIGH  # top-1 always high (s = 0 already; explicit against rounding)
        return torch.empty_like(prec).scatter_(-1, order, prec)  # back to the slots' order

    def expert_needs(self, topk_idx: torch.Tensor, topk_weight: torch.Tensor, num_experts: int) -> torch.Tensor:
        """Highest precision any token asks of each expert: int64 [E] (SKIP also for unused ones)."""
        prec = self.slot_precisions(topk_weight).flatten()
        need = torch.zeros(num_experts, dtype=prec.dtype, device=prec.device)
        return need.scatter_reduce_(0, topk_idx.flatten(), prec, reduce="amax")
