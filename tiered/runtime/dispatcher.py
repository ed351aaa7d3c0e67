"""Dispatcher: per MoE layer and step, where each routed expert runs (Fiddler Algorithm 1).

Source: Fiddler (ICLR 2025) §3.3, Algorithm 1; ALGORITHMS.md §2.b. For an expert with s > 0 routed
tokens whose weights are not on the accelerator, compare running it on the CPU (move activations)
with copying its weights to the accelerator and running there (move weights):

    copy  iff  cpu_lat(s) > gpu_lat(s) + transfer_lat(expert_bytes)

Both sides include the disk read when the expert's home is disk. The latency model has intercepts
(ALGORITHMS.md gap F4: cpu_lat(s) = a + c*s) and comes from a start-up calibration
(runtime/calibrate.py) until the planner's hardware profile supplies it; no constants in source.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tiered.hardware.op_time import PROMPT_GEMM_ROWS

RESIDENT = "resident"  # weights already on the accelerator (resident or cached): run there
COPY = "copy"  # copy weights H2D into a cache slot, run on the accelerator
CPU = "cpu"  # run on the CPU, moving only activations
SPLIT = "split"  # the CPU computes some gate/up rows while the rest and down are copied (split_share)
PRICED = "priced"  # a mode: "balanced" without MIX_GAIN and SPLIT_GAIN, each layer as the latency model prices it
BALANCED_MODES = ("balanced", PRICED)  # modes that split a layer's misses between the CPU and the link

# Share of a SwiGLU expert's bytes in its gate and up projections (the rows a SPLIT divides).
GATE_UP_SHARE = 2 / 3


@dataclass(frozen=True)
class LatencyModel:
    """Fitted latencies of one expert (seconds).

    cpu_lat(s) = cpu_alpha + cpu_beta * s below rows = cpu_prompt_rows tokens, and from there on
               cpu_alpha + cpu_beta * rows + cpu_prompt_alpha + cpu_prompt_beta * (s - rows);
    gpu_lat(s) = gpu_alpha + gpu_beta * s;
    transfer_lat(b) = h2d_alpha + b / h2d_bandwidth; disk_lat(b) = disk_alpha + b / disk_bandwidth.
    cpu_prompt_alpha: what a prompt's GEMMs of an expert pay once a call on the CPU from cpu_prompt_rows
    rows (op_time.gemm_line: gemm_big's intercept, 1.5 ms a matrix on the H100's Xeon host, oneDNN
    packing the weight for AMX); 0 where not profiled. cpu_prompt_beta [s per token]: the CPU's slope
    from there on, a prompt's GEMMs' compute (the CPU side's own piece there: ExpertLatency.cpu); None
    = cpu_beta (plans saved before it). The line below the step is the secant between 1 token and s*,
    whose slope is the memory-bound side's: continued past the step it priced a 128-token expert on
    the H100's host at 9.2 ms where the piece gives 12.5 (and the traces 14-33).
    """

    cpu_alpha: float
    cpu_beta: float
    gpu_alpha: float
    gpu_beta: float
    h2d_alpha: float
    h2d_bandwidth: float  # bytes/s
    disk_alpha: float = 0.0
    disk_bandwidth: float = float("inf")  # bytes/s
    cpu_prompt_alpha: float = 0.0
    cpu_prompt_rows: float = float("inf")
    cpu_prompt_beta: float | None = None
    cpu_shared: float = 1.0  # CPU expert seconds while H2D copies run beside it, per second alone (>= 1)
    link_shared: float = 1.0  # H2D copy seconds while a CPU expert runs beside it, per second alone (>= 1)

    def cpu_lat(self, s: int) -> float:
        rows = self.cpu_prompt_rows
        if s < rows:
            return self.cpu_alpha + self.cpu_beta * s
        return self.cpu_alpha + self.cpu_beta * rows + self.cpu_prompt_alpha + self._prompt_beta * (s - rows)

    @property
    def _prompt_beta(self) -> float:
        return self.cpu_beta if self.cpu_prompt_beta is None else self.cpu_prompt_beta

    def gpu_lat(self, s: int) -> float:
        return self.gpu_alpha + self.gpu_beta * s

    def together(self, cpu_s: float, link_s: float) -> tuple[float, float]:
        """(CPU end, link end) [s] of `cpu_s` seconds of CPU expert work and `link_s` seconds of H2D copies
        (each timed alone) started together: both draw on the host's memory, so while both run each
        goes slower by its factor (cpu_shared, link_shared: the profile's meta["host_share"], measured
        by hardware/host_share), and the one left alone finishes at its own speed. On the H100's host
        ~1.13 and ~1.11: a Mixtral expert on the CPU (3.9 ms) beside one copied (6.4 ms) ends at 4.4 ms,
        the copy at 6.8."""
        if cpu_s <= 0 or link_s <= 0:
            return cpu_s, link_s
        c, l = cpu_s * self.cpu_shared, link_s * self.link_shared  # each one's time were the other always there
        if c <= l:  # the CPU ends first; the copy's remaining work then runs alone
            return c, c + (link_s - c / self.link_shared)
        return l + (cpu_s - l / self.cpu_shared), l

    def transfer_lat(self, nbytes: int) -> float:
        return self.h2d_alpha + nbytes / self.h2d_bandwidth

    def split_share(self, s: int, nbytes: int, cpu_busy: float = 0.0, link_busy: float = 0.0) -> tuple[float, float]:
        """(a, seconds): SPLIT's share `a` in (0, 1] of the gate/up rows that the CPU computes (into
        the hidden activations, sent H2D), while the link copies the other rows and the whole down
        projection, and the makespan: max(CPU, link) then the accelerator's part (the rest of
        gate/up, then down). `a` makes the CPU and the link finish together:
            cpu_busy + a g C = link_busy + h2d_alpha + (1 - a g) L,
        C = cpu_lat(s), L = nbytes / bw, g = GATE_UP_SHARE, where cpu_busy and link_busy (seconds)
        are the work already given to each side in the same layer (whole experts on the CPU, whole
        copies). The CPU's part is its share of the whole expert's time, cpu_alpha included: the
        line's intercept is a decode expert's weight stream (cpu_lat(1) - cpu_beta, ~5 ms of ~5.2 for a
        Mixtral expert on the H100's host), which a share of the rows reads a share of. Pricing the
        intercept in full, as a fixed cost, had put a lone miss's split at the CPU's own time (no
        gain, so no plan chose it) and the forced split's CPU share at ~0.69 of gate/up (46% of the
        expert's bytes, the link 54%) where the trace's rates balance at ~0.9 (59%): on that host every
        miss split decoded 23.9 tok/s against 31.1 on the CPU, its copies the layer's end (session 28). ScheInfer's CC/CG row split (ALGORITHMS.md 1.a) applied
        to one missing expert: the misses of a decode step are few per layer, and Fiddler sends
        each wholly one way, leaving the other side idle. When the CPU side is already the busier
        (a <= 0), the smallest share is returned and the makespan shows the loss. The two sides run
        together from start to end, so each goes at its shared rate throughout (cpu_shared,
        link_shared: `together`), the busy times (given as each side alone) included."""
        g = GATE_UP_SHARE
        c = self.cpu_lat(s) * self.cpu_shared
        link = nbytes / self.h2d_bandwidth * self.link_shared
        cpu_busy, link_busy = cpu_busy * self.cpu_shared, link_busy * self.link_shared  # beside the other side too
        gap = link_busy + self.h2d_alpha + link - cpu_busy
        a = gap / (g * (c + link)) if c + link > 0 else 1.0
        a = min(1.0, max(a, 1e-3))
        t = max(cpu_busy + a * g * c, link_busy + self.h2d_alpha + (1 - a * g) * link)
        return a, t + self.gpu_lat(s)

    def cpu_threshold(self, nbytes: int) -> float:
        """Largest token count for which the CPU path wins (Fiddler's s*), in tokens.

        When cpu_beta >= gpu_beta, choose_path picks the CPU iff s <= s*. Equal slopes make the
        choice independent of s: +inf (the CPU always wins) or -inf (it never does). A prompt's
        intercept (cpu_prompt_alpha from cpu_prompt_rows tokens) puts s* just below that step where
        the CPU wins up to it and loses at it, or moves the crossing past it by its cost.
        """
        def crossing(margin: float) -> float:
            if self.cpu_beta == self.gpu_beta:
                return float("inf") if margin >= 0 else float("-inf")
            if self.cpu_beta < self.gpu_beta:
                return float("inf")
            return margin / (self.cpu_beta - self.gpu_beta)

        margin = self.gpu_alpha + self.transfer_lat(nbytes) - self.cpu_alpha
        s = crossing(margin)
        if s < self.cpu_prompt_rows or math.isinf(self.cpu_prompt_rows):
            return s
        rows = self.cpu_prompt_rows  # the CPU wins below its prompt intercept's step: past it?
        at_rows = self.gpu_lat(rows) + self.transfer_lat(nbytes) - self.cpu_lat(rows)
        if at_rows < 0:
            return math.nextafter(rows, 0.0)
        slope = self._prompt_beta - self.gpu_beta  # past the step, the prompt line against the GPU's
        return rows + at_rows / slope if slope > 0 else float("inf")


def choose_path(tokens: int, on_accelerator: bool, expert_bytes: int, lat: LatencyModel) -> str:
    """Algorithm 1 for one expert with `tokens` > 0 routed tokens. Returns RESIDENT, COPY or CPU."""
    if on_accelerator:
        return RESIDENT
    if lat.cpu_lat(tokens) > lat.gpu_lat(tokens) + lat.transfer_lat(expert_bytes):
        return COPY
    return CPU


# A SPLIT must beat the better whole path by this factor (it launches more, and fills no cache slot).
SPLIT_GAIN = 0.9
# A layer whose whole misses go both ways (some on the CPU, some copied) must beat the better one-sided
# assignment by this factor. What the latency model leaves out costs the mix: the copy is a task (or, issued
# by the calling thread, a launch) and its expert's launch and join; the CPU's reads and the copy's DMA
# sharing the host's DRAM (each ~10% slower together: benchmarks/results/gpu/2026-11-26-h100,
# gpu_dram_share) is priced where the profile measured it (LatencyModel.together). Before copies were
# issued by the calling thread, a copy was a task on a worker thread that waited for a core while the CPU
# team held them all. On the H100 host (session 28, uniform routing) a decode
# layer of one CPU expert and one copy took 10.1 ms (median; copies starting up to 3.6 ms late) against
# 8.7 ms for both on the CPU, where the model priced 6.6 against 6.9.
MIX_GAIN = 0.9
# SPLIT_ROWS_NOTE: an expert with cpu_prompt_rows tokens or more (the CPU's compute-bound prompt piece; at
# most op_time.PROMPT_GEMM_ROWS, where the latency model has no such piece) is never split. Every GPU run
# that measured prompt splits found them slower than priced and slower than copying every miss: on the
# H100 host, uniform routing, a 512-token prompt took 0.279 s with every miss split (priced 0.168) against
# 0.228 copied (2026-11-26), and the default plan's CPU + split + copies 0.257 s (priced 0.223) against
# 0.212 copied (2026-11-28); on the first H100 run 0.177 against 0.092.


@dataclass(frozen=True)
class LayerDispatch:
    """One layer's misses, dispatched (dispatch_misses).

    Attributes:
        paths: COPY, CPU or SPLIT per missing expert, in the order of the tokens given.
        shares: for each SPLIT entry, the CPU's share of its gate/up rows in (0, 1]; None elsewhere.
        seconds: predicted makespan from the layer's dispatch to its last expert's output (the
            latency model's sides only: no task or launch overheads).
    """

    paths: list[str]
    shares: list[float | None]
    seconds: float


def dispatch_misses(tokens: list[int], lat: LatencyModel, expert_bytes: int, mode: str = "balanced",
                    splittable: bool = False) -> LayerDispatch:
    """Paths for one layer's experts that are not on the accelerator, so that the CPU and the H2D
    link (with the accelerator computing what lands) finish together.

    Fiddler's Algorithm 1 picks one side per expert by its own latencies; when several experts of a
    step miss, sending all of them one way leaves the other idle. tiered sorts the misses by token
    count and gives the CPU the prefix (fewest tokens: where it loses least to the GPU) of the length
    that minimizes the makespan max(sum cpu_lat, sum transfer_lat + last gpu_lat); with one miss this
    is Algorithm 1 itself. A mix of sides is taken only when it beats the better one-sided
    assignment by MIX_GAIN. With `splittable`, the expert at the boundary may instead be SPLIT by
    rows, its share balancing what each side already has (LatencyModel.split_share with busy
    times): on the H200 host's rates (CPU 4.7 ms, link 7 ms per Mixtral expert) one miss takes
    ~2.8 ms instead of 4.7, and two ~5.6 ms instead of 7. A split is taken only when it beats the
    best whole assignment by SPLIT_GAIN, and never at a prompt's token counts (SPLIT_ROWS_NOTE).

    Args:
        tokens: routed tokens of each missing expert (> 0), in any order.
        lat: the latency model (seconds).
        expert_bytes: bytes copied per expert.
        mode: "balanced" (above), "priced" (balanced without the margins MIX_GAIN and SPLIT_GAIN: the
            assignment the latency model prices fastest, to measure what the margins cost or save),
            "per-expert" (Algorithm 1 for each expert alone), "copy", "cpu" or "split" (every miss
            one way; "split" balances each expert alone).
        splittable: a miss may be SPLIT (dense experts in CPU RAM, with an accelerator).
    Returns:
        LayerDispatch, its lists in the order of `tokens`.
    """
    n = len(tokens)
    if mode == SPLIT:
        splits = [lat.split_share(s, expert_bytes) for s in tokens]
        return LayerDispatch([SPLIT] * n, [a for a, _ in splits], sum(t for _, t in splits))
    if mode in (COPY, CPU, "per-expert"):
        paths = [mode] * n if mode != "per-expert" else [choose_path(s, False, expert_bytes, lat) for s in tokens]
        return LayerDispatch(paths, [None] * n, _whole_makespan(tokens, paths, lat, expert_bytes))
    order = sorted(range(n), key=lambda i: tokens[i])
    copy_lat = lat.transfer_lat(expert_bytes)
    cpu_before = [0.0]  # CPU seconds of order[:j]
    for i in order:
        cpu_before.append(cpu_before[-1] + lat.cpu_lat(tokens[i]))

    def whole(j: int) -> float:  # CPU takes order[:j] whole, the rest is copied (the two sharing host memory)
        rest = order[j:]
        cpu_end, link_end = lat.together(cpu_before[j], len(rest) * copy_lat)
        return max(cpu_end, link_end + (lat.gpu_lat(tokens[rest[-1]]) if rest else 0.0))

    mix_gain, split_gain = (1.0, 1.0) if mode == PRICED else (MIX_GAIN, SPLIT_GAIN)
    best_j, best_t = min(((j, whole(j)) for j in (0, n)), key=lambda jt: jt[1])  # one side takes every miss
    if n > 1:
        mix_j, mix_t = min(((j, whole(j)) for j in range(1, n)), key=lambda jt: jt[1])
        if mix_t < mix_gain * best_t - 1e-12:
            best_j, best_t = mix_j, mix_t
    if mode in BALANCED_MODES and splittable and n:
        split_j, split_a, split_t = None, 0.0, float("inf")
        prompt_rows = min(lat.cpu_prompt_rows, PROMPT_GEMM_ROWS)  # a prompt's expert is never split (SPLIT_ROWS_NOTE)
        for j in range(n):  # CPU takes order[:j] whole, order[j] is split, order[j+1:] is copied
            if tokens[order[j]] >= prompt_rows:  # (ascending: every later one is too)
                break
            a, t = lat.split_share(tokens[order[j]], expert_bytes, cpu_before[j], (n - j - 1) * copy_lat)
            if n - j - 1:
                t = max(t, (n - j - 1) * copy_lat + lat.gpu_lat(tokens[order[-1]]))
            if t < split_t - 1e-12:
                split_j, split_a, split_t = j, a, t
        if split_t < split_gain * best_t - 1e-12:
            return _prefix_dispatch(order, split_j, split_t, split_a)
    return _prefix_dispatch(order, best_j, best_t)


def _prefix_dispatch(order: list[int], j: int, seconds: float, share: float | None = None) -> LayerDispatch:
    """CPU for order[:j], SPLIT at `share` for order[j] when a share is given, COPY for the rest."""
    n = len(order)
    paths, shares = [COPY] * n, [None] * n
    for i in order[:j]:
        paths[i] = CPU
    if share is not None:
        paths[order[j]], shares[order[j]] = SPLIT, share
    return LayerDispatch(paths, shares, seconds)


def _whole_makespan(tokens: list[int], paths: list[str], lat: LatencyModel, expert_bytes: int) -> float:
    """max(CPU experts in turn, copies in turn then the last one's compute): seconds."""
    cpu = sum(lat.cpu_lat(s) for s, p in zip(tokens, paths) if p == CPU)
    copied = [s for s, p in zip(tokens, paths) if p == COPY]
    link = len(copied) * lat.transfer_lat(expert_bytes) + (lat.gpu_lat(copied[-1]) if copied else 0.0)
    return max(cpu, link)


def split_misses(tokens: list[int], lat: LatencyModel, expert_bytes: int, mode: str = "balanced",
                 splittable: bool = False) -> list[str]:
    """The paths of dispatch_misses (same arguments): COPY, CPU or SPLIT per entry of `tokens`."""
    return dispatch_misses(tokens, lat, expert_bytes, mode, splittable).paths
