"""Discrete-event simulation of task graphs on in-order streams (ScheInfer's four-stream schedule).

Source: ScheInfer §III-C (Stream-A CPU compute, Stream-B kernel launch, Stream-C H2D copy, Stream-D
GPU compute; a copy or GPU GEMM waits for its launch, a CG GEMM for its weight copy) and Fig. 5;
ALGORITHMS.md §1.c "Runtime layer execution". Times in seconds.

Semantics (`simulate`): every stream runs its tasks one at a time in the order they are listed; a
task starts as soon as its stream is free and all its dependencies have finished, and runs for its
duration without preemption. A dependency cycle (including one through stream order) raises
SimulationError.

`layer_tasks` builds one sliced MLP / expert layer the way ScheInfer's model (Eq. 5) sees it: per
GEMM i, one launch task (t_L, all of the GEMM's launches), one copy task (t_C2G, after its launch),
one GPU task (t_G, CG and GG kernels, after its copy) and one CPU task (t_C); a join waits for the
last GPU and CPU tasks. Its end times equal the recurrence of Eq. 5, hence Eq. 10-12, exactly (the
tests check this in each of the three cases). `stack_tasks` chains layers, each starting after the
previous layer's join, so a stack's time is the sum of its layers' t_fin (plus joins).
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from tiered.errors import TieredError
from tiered.planner.cost_model import StageTimes

CPU, LAUNCH, H2D, GPU = "A:cpu", "B:launch", "C:h2d", "D:gpu"
STREAMS = (CPU, LAUNCH, H2D, GPU)


class SimulationError(TieredError):
    """A task graph cannot run: unknown or duplicate names, negative durations, or a deadlock."""


@dataclass(frozen=True)
class Task:
    """One unit of work: `duration` seconds on `stream`, after every task named in `deps`."""

    name: str
    stream: str
    duration: float
    deps: tuple[str, ...] = ()


@dataclass(frozen=True)
class Span:
    """When a task ran [s]."""

    stream: str
    start: float
    end: float


@dataclass(frozen=True)
class Timeline:
    """A simulation's result: each task's span, by name, and the makespan [s]."""

    spans: dict[str, Span]
    makespan: float

    def end(self, name: str) -> float:
        return self.spans[name].end

    def busy(self, stream: str) -> float:
        """Seconds `stream` spent running tasks."""
        return sum(s.end - s.start for s in self.spans.values() if s.stream == stream)


def simulate(tasks: Sequence[Task]) -> Timeline:
    """Run `tasks` on their streams (event-driven: time jumps from one task completion to the next).

    Raises SimulationError on duplicate names, unknown dependencies, negative durations or deadlock.
    """
    names = set()
    queues: dict[str, deque[Task]] = {}
    for t in tasks:
        if t.name in names:
            raise SimulationError(f"duplicate task name {t.name!r}")
        if t.duration < 0:
            raise SimulationError(f"task {t.name!r} has negative duration {t.duration}")
        names.add(t.name)
        queues.setdefault(t.stream, deque()).append(t)
    for t in tasks:
        missing = [d for d in t.deps if d not in names]
        if missing:
            raise SimulationError(f"task {t.name!r} depends on unknown tasks {missing}")

    done: dict[str, float] = {}                 # name -> end time, for finished tasks
    spans: dict[str, Span] = {}
    busy = {s: False for s in queues}
    running: list[tuple[float, int, str, str]] = []   # heap of (end, seq, name, stream)
    seq, now = 0, 0.0
    while True:
        started = True
        while started:                          # start every ready head task; zero-length ones finish at once
            started = False
            for s, q in queues.items():
                if busy[s] or not q or any(d not in done for d in q[0].deps):
                    continue
                t = q.popleft()
                end = now + t.duration
                spans[t.name] = Span(s, now, end)
                if t.duration == 0:
                    done[t.name] = end
                    started = True
                else:
                    busy[s] = True
                    heapq.heappush(running, (end, seq, t.name, s))
                    seq += 1
        if not running:
            break
        now = running[0][0]
        while running and running[0][0] == now:   # everything finishing now
            _, _, name, s = heapq.heappop(running)
            done[name] = now
            busy[s] = False
    stuck = [q[0].name for q in queues.values() if q]
    if stuck:
        raise SimulationError(f"deadlock: tasks {stuck} wait on dependencies that never finish")
    return Timeline(spans, max((sp.end for sp in spans.values()), default=0.0))


def layer_tasks(times: StageTimes, n_gemms: int, *, prefix: str = "", after: tuple[str, ...] = (),
                join: float = 0.0) -> list[Task]:
    """ScheInfer's task graph of one layer (§III-C, Eq. 5): n_gemms x (launch, copy, GPU, CPU) + join.

    Args:
        times: per-GEMM stage durations (cost_model.gemm_times / prompt_gemm_times).
        n_gemms: n_l.
        prefix: name prefix, unique per layer in a stack.
        after: tasks the layer's first tasks wait for (the previous layer's join).
        join: seconds of the final reduction on the GPU stream (S4's unmodelled H2D of Y^CC and
            sum); 0 reproduces the paper.
    Names: f"{prefix}launch{i}", "copy{i}", "gpu{i}", "cpu{i}" for i = 1..n_gemms, and f"{prefix}join".
    """
    tasks: list[Task] = []
    for i in range(1, n_gemms + 1):
        first = after if i == 1 else ()
        tasks.append(Task(f"{prefix}launch{i}", LAUNCH, times.launch, first))
        tasks.append(Task(f"{prefix}copy{i}", H2D, times.copy, first + (f"{prefix}launch{i}",)))
        tasks.append(Task(f"{prefix}gpu{i}", GPU, times.gpu, first + (f"{prefix}launch{i}", f"{prefix}copy{i}")))
        tasks.append(Task(f"{prefix}cpu{i}", CPU, times.cpu, first))
    tasks.append(Task(f"{prefix}join", GPU, join, after + (f"{prefix}gpu{n_gemms}", f"{prefix}cpu{n_gemms}")))
    return tasks


def stack_tasks(layers: Sequence[tuple[StageTimes, int]], join: float = 0.0) -> list[Task]:
    """Layers run in order (layer j + 1 after layer j's join); names prefixed f"L{j}.". """
    tasks: list[Task] = []
    after: tuple[str, ...] = ()
    for j, (times, n) in enumerate(layers):
        tasks += layer_tasks(times, n, prefix=f"L{j}.", after=after, join=join)
        after = (f"L{j}.join",)
    return tasks


def simulate_layer(times: StageTimes, n_gemms: int, join: float = 0.0) -> float:
    """Simulated t_fin of one layer [s]."""
    return simulate(layer_tasks(times, n_gemms, join=join)).end("join")


def simulate_stack(layers: Sequence[tuple[StageTimes, int]], join: float = 0.0) -> float:
    """Simulated time of a stack of layers [s]."""
    return simulate(stack_tasks(layers, join)).makespan if layers else 0.0
