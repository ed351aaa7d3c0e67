"""ScheInfer's solvers: slicing rates (stage 1, stage 2) and prompt-phase token assignment.

Source: ScheInfer §IV-A3 (Eq. 13, edge points), §IV-A4 (Eq. 14, greedy GPU-memory assignment) and
§IV-B (Eq. 15, token assignment); ALGORITHMS.md §1.b-1.c, gaps §1.f. Times in seconds, memory in bytes.

Stage 1 (`solve_r_cg`): for a fixed r_GG, the optimal r_CG in [0, 1 - r_GG] in O(1). On (0, 1 - r_GG)
the GPU term of t_fin is convex, piecewise linear and increasing in r_CG and the CPU term linear and
decreasing, so t_fin is convex there and its minimum lies at a breakpoint of the GPU term
(t_L = t_C2G, t_G = t_C2G, t_L = t_G), at a crossing of one of the three GPU pieces (Eq. 10-12) with
the CPU term, or at an end; r_CG = 0 and 1 - r_GG (the sgn jumps) are candidates of their own and
dominate the open ends. Each candidate is clipped and evaluated exactly.

Stage 2 (`assign_gpu_memory`): r_GG per layer from the grid v_i = i / N_v (N_v: the paper's "n_G",
renamed; not reported, S6 suggests 16 or 32), raising at each step the layer and value with the
largest time saved per byte (Eq. 14) that still fits the budget; stop when no positive saving fits
(S7; ties to the lower layer index, then the lower value). The total time is non-increasing in the
budget (a larger budget's first divergent move beats, per byte, everything the smaller one can do).

Token assignment (`solve_n_g`): the prompt's n_g tokens moved from CC to CG' (Eq. 15), slicing rates
fixed to the decode optimum (S9). The same convexity argument holds in n_g on [1, T - 1]; the
candidates are 0, 1, T - 1, T and floor/ceil of the breakpoints and crossings.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from tiered.errors import BudgetError, ConfigError
from tiered.planner.cost_model import (CostParams, LayerShape, SliceRates, decode_layer_time, gemm_times,
                                       prompt_gemm_times, prompt_layer_time, schedule_case, sgn)

__all__ = ["SliceRates", "RateSolution", "MemoryAssignment", "TokenAssignment", "edge_points", "solve_r_cg",
           "assign_gpu_memory", "rgg_grid", "solve_n_g", "ffn_gpu_budget"]


@dataclass(frozen=True)
class RateSolution:
    """Stage-1 answer for one layer: the rates, t_fin* [s] and the schedule case (1-3) at the optimum."""

    rates: SliceRates
    time: float
    case: int


@dataclass(frozen=True)
class MemoryAssignment:
    """Stage-2 answer: per-layer rates and decode times [s], GPU bytes used of the budget."""

    rates: tuple[SliceRates, ...]
    times: tuple[float, ...]
    used_bytes: float
    budget_bytes: float

    @property
    def total_time(self) -> float:
        """Sum of the layers' t_fin* [s] (one decode step's FFN time)."""
        return float(sum(self.times))


@dataclass(frozen=True)
class TokenAssignment:
    """Prompt-phase answer for one layer: n_g tokens on CG', the layer time [s] and its case."""

    n_g: int
    time: float
    case: int


def _finite(xs) -> list[float]:
    return [x for x in xs if x is not None and math.isfinite(x)]


def _div(a: float, b: float) -> float | None:
    return a / b if b != 0 else None


def edge_points(shape: LayerShape, r_gg: float, p: CostParams) -> list[float]:
    """The candidate set X of Eq. 13 for a given r_GG, clipped to [0, 1 - r_GG], sorted, unique.

    With g = sgn(r_GG), A_G = n_GEMM beta_G, B = n_W beta_C2G, C = n_GEMM beta_C, n = n_l,
    K = n (alpha_C + (1 - r_GG) C), t_L = (2 + g) t_launch and a_G = alpha_G (1 + g) + r_GG A_G:
        r1 = (t_L - alpha_C2G) / B                      t_L = t_C2G
        r2 = (a_G - alpha_C2G) / (B - A_G)              t_G = t_C2G
        r3 = (t_L - a_G) / A_G                          t_L = t_G
        x1 = (K - t_L - n alpha_C2G - a_G) / (n B + A_G + n C)      case-1 piece = CPU
        x2 = (K - t_L - alpha_C2G - n a_G) / (B + n A_G + n C)      case-2 piece = CPU
        x3 = (K - n t_L - alpha_C2G - a_G) / (B + A_G + n C)        case-3 piece = CPU
    plus 0 and 1 - r_GG. Undefined points (zero denominators) are dropped.
    """
    hi = max(0.0, 1.0 - r_gg)
    n = shape.n_gemms
    g = sgn(r_gg)
    A, B, C = shape.macs_per_gemm * p.beta_gpu, shape.weight_bytes * p.beta_c2g, shape.macs_per_gemm * p.beta_cpu
    K = n * (p.alpha_cpu + hi * C)
    tl = (2 + g) * p.t_launch
    ag = p.alpha_gpu * (1 + g) + r_gg * A
    cands = [0.0, hi,
             _div(tl - p.alpha_c2g, B), _div(ag - p.alpha_c2g, B - A), _div(tl - ag, A),
             _div(K - tl - n * p.alpha_c2g - ag, n * B + A + n * C),
             _div(K - tl - p.alpha_c2g - n * ag, B + n * A + n * C),
             _div(K - n * tl - p.alpha_c2g - ag, B + A + n * C)]
    return sorted({min(max(c, 0.0), hi) for c in _finite(cands)})


def solve_r_cg(shape: LayerShape, r_gg: float, p: CostParams) -> RateSolution:
    """Stage 1 (Eq. 13): the r_CG in [0, 1 - r_GG] minimizing the layer's decode t_fin, O(1).

    Ties go to the smaller r_CG (less PCIe traffic). Raises ConfigError unless 0 <= r_gg <= 1.
    """
    if not 0.0 <= r_gg <= 1.0:
        raise ConfigError(f"r_gg={r_gg} must be in [0, 1]")
    best = None
    for r in edge_points(shape, r_gg, p):
        rates = SliceRates.from_gg_cg(float(r_gg), float(r))
        t = float(decode_layer_time(shape, rates, p))
        if best is None or t < best[0]:
            best = (t, rates)
    t, rates = best
    return RateSolution(rates, t, schedule_case(gemm_times(shape, rates, p)))


def rgg_grid(grid: int | Sequence[float]) -> tuple[float, ...]:
    """The allowed r_GG values besides 0: v_i = i / N_v, i = 1..N_v (an int N_v), or explicit values
    in (0, 1] (e.g. (1.0,) for all-or-nothing layers)."""
    if isinstance(grid, int):
        if grid < 1:
            raise ConfigError(f"r_GG grid size N_v={grid} must be >= 1")
        return tuple(i / grid for i in range(1, grid + 1))
    vals = tuple(sorted(set(float(v) for v in grid)))
    if not vals or vals[0] <= 0 or vals[-1] > 1:
        raise ConfigError(f"r_GG grid {grid} must be non-empty values in (0, 1]")
    return vals


def assign_gpu_memory(layers: Sequence[LayerShape], params: CostParams | Sequence[CostParams], budget_bytes: float,
                      grid: int | Sequence[float] = 16) -> MemoryAssignment:
    """Stage 2 (Eq. 14): greedy r_GG per layer under a GPU byte budget, r_CG by stage 1 at each r_GG.

    Args:
        layers: the FFN layer shapes in model order (decode shapes: the rates are solved for decode).
        params: one CostParams for all layers, or one per layer.
        budget_bytes: GPU bytes available to FFN weights (see `ffn_gpu_budget`, S5).
        grid: N_v, or explicit r_GG values (see `rgg_grid`).
    Returns the rates, the per-layer t_fin* and sum(r_GG_j * n_m_j) <= budget_bytes.
    """
    if budget_bytes < 0:
        raise BudgetError(f"GPU budget for FFN weights is negative ({budget_bytes:.0f} B)")
    ps = [params] * len(layers) if isinstance(params, CostParams) else list(params)
    if len(ps) != len(layers):
        raise ConfigError(f"{len(ps)} CostParams for {len(layers)} layers")
    values = np.array((0.0,) + rgg_grid(grid))                            # (V,) r_GG choices, 0 first
    memo: dict = {}

    def solve(j: int, v: float) -> RateSolution:
        v = float(v)
        key = (layers[j], ps[j], v)
        if key not in memo:
            memo[key] = solve_r_cg(layers[j], v, ps[j])
        return memo[key]

    F = np.array([[solve(j, v).time for v in values] for j in range(len(layers))])   # (L, V) t_fin*
    n_m = np.array([s.layer_bytes for s in layers])                                   # (L,) bytes at r_GG=1
    pre = np.zeros(len(layers), dtype=int)                                            # index into values
    left = float(budget_bytes)
    while len(layers):
        rows = np.arange(len(layers))
        extra = (values[None, :] - values[pre][:, None]) * n_m[:, None]               # (L, V) bytes
        saved = F[rows, pre][:, None] - F                                             # (L, V) seconds
        ok = (values[None, :] > values[pre][:, None]) & (extra <= left)
        score = np.where(ok, saved / np.where(ok, extra, 1.0), -np.inf)               # Eq. 14, s per byte
        j, i = np.unravel_index(np.argmax(score), score.shape)                        # first max: low j, low v
        if not score[j, i] > 0:
            break
        left -= extra[j, i]
        pre[j] = i
    sols = [solve(j, values[pre[j]]) for j in range(len(layers))]
    used = float(sum(values[pre[j]] * n_m[j] for j in range(len(layers))))
    return MemoryAssignment(tuple(s.rates for s in sols), tuple(s.time for s in sols), used, float(budget_bytes))


def solve_n_g(shape: LayerShape, rates: SliceRates, p: CostParams) -> TokenAssignment:
    """Token assignment (Eq. 15): the integer n_g in [0, T] minimizing the prompt-phase layer time.

    `shape.tokens` is the prompt length T (per expert for MoE); the rates stay fixed (S9). With
    n = n_l, for n_g > 0 the launch t_L' and copy t_C2G' are constants, t_G' = a + n_g b and the CPU
    term n t_C' = K' - n_g n c, so the candidates are 0, 1, T - 1, T and floor/ceil of
        (t_C2G' - a) / b, (t_L' - a) / b                                  GPU breakpoints
        (K' - t_L' - n t_C2G' - a) / (b + n c)                            case-1 piece = CPU
        (K' - t_L' - t_C2G' - n a) / (n b + n c)                          case-2 piece = CPU
        (K' - n t_L' - t_C2G' - a) / (b + n c)                            case-3 piece = CPU
    Ties go to the smaller n_g. n_g = 0 when r_CC = 0 (nothing to move).
    """
    T, n = shape.tokens, shape.n_gemms
    cands = {0, T}
    if rates.r_cc > 0 and T > 1:
        s1 = prompt_gemm_times(shape, rates, 1, p)          # constants of n_g > 0, from the model itself
        mh = float(shape.d_model) * shape.d_ff
        b = rates.r_cc * mh * p.beta_gpu
        a = s1.gpu - b                                      # t_G' at n_g -> 0+
        c = rates.r_cc * mh * p.beta_cpu
        K = n * (p.alpha_cpu + T * c)
        L, Cp = s1.launch, s1.copy
        xs = _finite([_div(Cp - a, b), _div(L - a, b),
                      _div(K - L - n * Cp - a, b + n * c), _div(K - L - Cp - n * a, n * b + n * c),
                      _div(K - n * L - Cp - a, b + n * c)])
        cands |= {1, T - 1}
        for x in xs:
            x = min(max(x, 1.0), T - 1.0)
            cands |= {math.floor(x), math.ceil(x)}
    best = min((prompt_layer_time(shape, rates, k, p), k) for k in sorted(cands))
    t, k = best
    return TokenAssignment(int(k), float(t), schedule_case(prompt_gemm_times(shape, rates, k, p)))


def ffn_gpu_budget(capacity_bytes: float, *, non_ffn_bytes: float, kv_cache_bytes: float = 0.0,
                   activation_bytes: float = 0.0, staging_bytes: float = 0.0, margin: float = 0.05) -> float:
    """GPU bytes left for FFN weights (ALGORITHMS.md S5, the paper does not say):

        capacity - non-FFN weights (attention, embeddings, norms, routers) - KV cache
                 - activation workspace - CG staging (2 x the largest CG slice) - margin * capacity

    Raises BudgetError when the fixed parts alone do not fit.
    """
    left = capacity_bytes * (1.0 - margin) - non_ffn_bytes - kv_cache_bytes - activation_bytes - staging_bytes
    if left < 0:
        raise BudgetError(f"GPU capacity {capacity_bytes / 1e9:.2f} GB cannot hold the non-FFN weights, KV cache, "
                          f"workspace and staging ({(capacity_bytes - left) / 1e9:.2f} GB with the margin)",
                          "raise the GPU budget or shorten the context")
    return left
