"""Trace of every task the executor ran: Chrome trace-event JSON (opens in Perfetto) and a Gantt PNG."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class TraceEvent:
    """One task: which stream ran it, when (seconds from the trace's origin), what it moved."""

    name: str
    stream: str
    start: float
    end: float
    nbytes: int = 0
    layer: int | None = None
    expert: int | None = None


def to_chrome(events: list[TraceEvent], path: str | Path) -> None:
    """Write Chrome trace-event JSON: one 'X' (complete) event per task, one thread per stream."""
    streams = sorted({e.stream for e in events}, key=_stream_order)
    tid = {s: i for i, s in enumerate(streams)}
    out = [{"name": "thread_name", "ph": "M", "pid": 0, "tid": tid[s], "args": {"name": s}} for s in streams]
    for e in events:
        out.append({"name": e.name, "ph": "X", "pid": 0, "tid": tid[e.stream], "ts": e.start * 1e6,
                    "dur": max(e.end - e.start, 0.0) * 1e6,
                    "args": {"bytes": e.nbytes, "layer": e.layer, "expert": e.expert}})
    Path(path).write_text(json.dumps({"traceEvents": out, "displayTimeUnit": "ms"}))


def load_chrome(path: str | Path) -> list[TraceEvent]:
    """Read a trace written by `to_chrome` back into TraceEvents."""
    data = json.loads(Path(path).read_text())
    names = {e["tid"]: e["args"]["name"] for e in data["traceEvents"] if e.get("ph") == "M"}
    return [TraceEvent(e["name"], names[e["tid"]], e["ts"] / 1e6, (e["ts"] + e["dur"]) / 1e6,
                       e["args"].get("bytes", 0), e["args"].get("layer"), e["args"].get("expert"))
            for e in data["traceEvents"] if e.get("ph") == "X"]


def overlap_seconds(events: list[TraceEvent], a: str, b: str) -> float:
    """Total time during which a task on stream `a` and a task on stream `b` ran at once [s]."""
    ia = sorted((e.start, e.end) for e in events if e.stream == a)
    ib = sorted((e.start, e.end) for e in events if e.stream == b)
    total = 0.0
    for s, t in ia:
        for u, v in ib:
            if u >= t:
                break
            total += max(0.0, min(t, v) - max(s, u))
    return total


def _stream_order(s: str) -> tuple[int, str]:
    order = ["main", "compute", "copy", "cpu", "disk"]
    base = s.split(":")[0]
    return (order.index(base) if base in order else len(order), s)


def draw_gantt(events: list[TraceEvent], path: str | Path, title: str = "tiered trace") -> None:
    """Draw the timeline as a Gantt chart (one row per stream) into a PNG."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    streams = sorted({e.stream for e in events}, key=_stream_order)
    colors = {"compute": "tab:green", "copy": "tab:orange", "cpu": "tab:blue", "disk": "tab:red", "main": "tab:gray"}
    t0 = min((e.start for e in events), default=0.0)
    fig, ax = plt.subplots(figsize=(12, 1 + 0.6 * len(streams)))
    for row, s in enumerate(streams):
        bars = [((e.start - t0) * 1e3, max((e.end - e.start) * 1e3, 1e-3)) for e in events if e.stream == s]
        ax.broken_barh(bars, (row - 0.4, 0.8), color=colors.get(s.split(":")[0], "tab:purple"))
    ax.set_yticks(range(len(streams)), streams)
    ax.set_xlabel("time (ms)")
    ax.set_title(title)
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


__all__ = ["TraceEvent", "to_chrome", "load_chrome", "draw_gantt", "overlap_seconds"]
