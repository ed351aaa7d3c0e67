"""Server metrics in the Prometheus text exposition format (version 0.0.4), without a client library.

Counters only grow; summaries keep their sum and count over the server's life and quantiles over
the last `window` observations.
"""

from __future__ import annotations

import threading
from collections import deque


class Summary:
    """A Prometheus summary [seconds]: quantiles over the last `window` observations, sum and count."""

    QUANTILES = (0.5, 0.9, 0.99)

    def __init__(self, window: int = 2048) -> None:
        self.recent: deque[float] = deque(maxlen=window)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        """Record one observation (in the summary's unit)."""
        self.recent.append(value)
        self.sum += value
        self.count += 1

    def quantile(self, q: float) -> float:
        """The q-quantile (0..1) of the recent observations (nearest rank); NaN when there are none."""
        if not self.recent:
            return float("nan")
        xs = sorted(self.recent)
        return xs[min(len(xs) - 1, int(q * len(xs)))]


class ServerMetrics:
    """What /metrics reports. Updated by the engine thread and the HTTP handlers (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: dict[str, int] = {}  # outcome -> count: finished, cancelled, rejected, error
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.steps = 0
        self.ttft = Summary()
        self.itl = Summary()
        self.batch = Summary()  # running sequences per decode step
        self.peak_batch = 0

    def count_request(self, outcome: str) -> None:
        """Count a request that ended without finishing: cancelled, rejected or error."""
        with self._lock:
            self.requests[outcome] = self.requests.get(outcome, 0) + 1

    def observe_first_token(self, ttft_s: float) -> None:
        """A request's first token came `ttft_s` seconds after it arrived (queueing included)."""
        with self._lock:
            self.ttft.observe(ttft_s)

    def observe_finished(self, prompt_tokens: int, token_times: list[float]) -> None:
        """A finished request: its prompt tokens and its tokens' times [perf_counter s]."""
        with self._lock:
            self.requests["finished"] = self.requests.get("finished", 0) + 1
            self.prompt_tokens += prompt_tokens
            self.generation_tokens += len(token_times)
            for a, b in zip(token_times, token_times[1:]):
                self.itl.observe(b - a)

    def observe_step(self, running: int) -> None:
        """One engine step in which `running` sequences each got a token (decoded together)."""
        with self._lock:
            self.steps += 1
            self.batch.observe(running)
            self.peak_batch = max(self.peak_batch, running)

    def render(self, queue_depth: int, running: int, runtime: dict) -> str:
        """The exposition text: these metrics, the scheduler's gauges, and the expert hit rates of
        `runtime` (LLM.runtime_stats(); empty for dense models)."""
        out: list[str] = []

        def metric(name: str, kind: str, help_: str, samples: list[tuple[str, float]]) -> None:
            out.append(f"# HELP {name} {help_}")
            out.append(f"# TYPE {name} {kind}")
            out.extend(f"{name}{labels} {value:.9g}" for labels, value in samples)

        def summary(name: str, help_: str, s: Summary) -> None:
            samples = [(f'{{quantile="{q}"}}', s.quantile(q)) for q in Summary.QUANTILES]
            metric(name, "summary", help_, samples)
            out.append(f"{name}_sum {s.sum:.9g}")
            out.append(f"{name}_count {s.count}")

        with self._lock:
            outcomes = sorted(set(self.requests) | {"finished"})
            metric("tiered_requests_total", "counter", "Requests by outcome (finished, cancelled, rejected, error).",
                   [(f'{{outcome="{o}"}}', self.requests.get(o, 0)) for o in outcomes])
            metric("tiered_prompt_tokens_total", "counter", "Prompt tokens of finished requests.",
                   [("", self.prompt_tokens)])
            metric("tiered_generation_tokens_total", "counter", "Tokens generated for finished requests.",
                   [("", self.generation_tokens)])
            metric("tiered_engine_steps_total", "counter", "Engine steps that produced at least one token.",
                   [("", self.steps)])
            summary("tiered_time_to_first_token_seconds", "Arrival to first token, queueing included.", self.ttft)
            summary("tiered_inter_token_latency_seconds", "Gap between consecutive tokens of a request.", self.itl)
            summary("tiered_decode_batch_size", "Sequences decoded together per step.", self.batch)
            metric("tiered_decode_batch_size_peak", "gauge", "Most sequences decoded together in one step.",
                   [("", self.peak_batch)])
        metric("tiered_queue_depth", "gauge", "Requests waiting for a KV-cache slot.", [("", queue_depth)])
        metric("tiered_running_batch", "gauge", "Sequences holding a KV-cache slot.", [("", running)])
        if runtime:
            metric("tiered_expert_hit_rate", "gauge", "Expert uses served from the fast tier (resident or cached).",
                   [("", runtime["hit_rate"])])
            metric("tiered_expert_cache_hit_rate", "gauge", "Expert-cache hits over lookups.",
                   [("", runtime["cache_hit_rate"])])
        return "\n".join(out) + "\n"
