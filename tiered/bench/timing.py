"""Timing helpers: medians of repeats and decode speed with prefill excluded.

Definitions every benchmark shares (seconds, tokens):
    TTFT          wall time from handing a prompt to the engine to holding its first generated token.
    decode tok/s  (N - 1) / (t(N) - t(1)) for N generated tokens, t(i) the time token i was ready:
                  the first token closes the prefill, so prefill is not in the figure.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable, Sequence


def median(values: Sequence[float]) -> float | None:
    """The median of `values`; None when there are none."""
    return statistics.median(values) if values else None


def repeat(fn: Callable[[], float], repeats: int) -> list[float]:
    """Call `fn` `repeats` times; return its results in order (e.g. seconds or tokens/s)."""
    return [fn() for _ in range(repeats)]


def timed(fn: Callable[[], object]) -> tuple[object, float]:
    """(fn(), wall seconds it took)."""
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def decode_tokens_per_s(token_times: Sequence[float]) -> float:
    """Decode speed [tokens/s] from the times [s] each generated token was ready:
    (N - 1) / (t(N) - t(1)). Raises ValueError for fewer than two tokens."""
    if len(token_times) < 2:
        raise ValueError("decode speed needs at least two generated tokens")
    span = token_times[-1] - token_times[0]
    return (len(token_times) - 1) / span if span > 0 else float("inf")
