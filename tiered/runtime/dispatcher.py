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

from dataclasses import dataclass

RESIDENT = "resident"  # weights already on the accelerator (resident or cached): run there
COPY = "copy"  # copy weights H2D into a cache slot, run on the accelerator
CPU = "cpu"  # run on the CPU, moving only activations
SPLIT = "split"  # the CPU computes some gate/up rows while the rest and down are copied (split_share)

# Share of a SwiGLU expert's bytes in its gate and up projections (the rows a SPLIT divides).
GATE_UP_SHARE = 2 / 3


@dataclass(frozen=True)
class LatencyModel:
    """Fitted latencies of one expert (seconds).

    cpu_lat(s) = cpu_alpha + cpu_beta * s; gpu_lat(s) = gpu_alpha + gpu_beta * s;
    transfer_lat(b) = h2d_alpha + b / h2d_bandwidth; disk_lat(b) = disk_alpha + b / disk_bandwidth.
    """

    cpu_alpha: float
    cpu_beta: float
    gpu_alpha: float
    gpu_beta: float
    h2d_alpha: float
    h2d_bandwidth: float  # bytes/s
    disk_alpha: float = 0.0
    disk_bandwidth: float = float("inf")  # bytes/s

    def cpu_lat(self, s: int) -> float:
        return self.cpu_alpha + self.cpu_beta * s

    def gpu_lat(self, s: int) -> float:
        return self.gpu_alpha + self.gpu_beta * s

    def transfer_lat(self, nbytes: int) -> float:
        return self.h2d_alpha + nbytes / self.h2d_bandwidth

    def split_share(self, s: int, nbytes: int) -> tuple[float, float]:
        """(a, seconds): SPLIT's share `a` in (0, 1] of the gate/up rows that the CPU computes (into
        the hidden activations, sent H2D), while the link copies the other rows and the whole down
        projection, and the makespan: max(CPU, link) then the accelerator's part (the rest of
        gate/up, then down). `a` makes the CPU and the link finish together:
            cpu_alpha + a g C' = h2d_alpha + (1 - a g) L,  C' = cpu_lat(s) - cpu_alpha, L = nbytes/bw,
        with g = GATE_UP_SHARE (ScheInfer's CC/CG row split, ALGORITHMS.md 1.a, applied to one
        missing expert: the misses of a decode step are often one per layer, which Fiddler sends
        wholly one way, leaving the other side idle)."""
        g, c, link = GATE_UP_SHARE, self.cpu_lat(s) - self.cpu_alpha, nbytes / self.h2d_bandwidth
        a = (self.h2d_alpha + link - self.cpu_alpha) / (g * (c + link)) if c + link > 0 else 1.0
        a = min(1.0, max(a, 1e-3))
        t = max(self.cpu_alpha + a * g * c, self.h2d_alpha + (1 - a * g) * link) + self.gpu_lat(s)
        return a, t

    def cpu_threshold(self, nbytes: int) -> float:
        """Largest token count for which the CPU path wins (Fiddler's s*), in tokens.

        When cpu_beta >= gpu_beta, choose_path picks the CPU iff s <= s*. Equal slopes make the
        choice independent of s: +inf (the CPU always wins) or -inf (it never does).
        """
        margin = self.gpu_alpha + self.transfer_lat(nbytes) - self.cpu_alpha
        if self.cpu_beta == self.gpu_beta:
            return float("inf") if margin >= 0 else float("-inf")
        if self.cpu_beta < self.gpu_beta:
            return float("inf")
        return margin / (self.cpu_beta - self.gpu_beta)


def choose_path(tokens: int, on_accelerator: bool, expert_bytes: int, lat: LatencyModel) -> str:
    """Algorithm 1 for one expert with `tokens` > 0 routed tokens. Returns RESIDENT, COPY or CPU."""
    if on_accelerator:
        return RESIDENT
    if lat.cpu_lat(tokens) > lat.gpu_lat(tokens) + lat.transfer_lat(expert_bytes):
        return COPY
    return CPU


# A SPLIT must beat the better whole path by this factor (it launches more, and fills no cache slot).
SPLIT_GAIN = 0.9


def split_misses(tokens: list[int], lat: LatencyModel, expert_bytes: int, mode: str = "balanced",
                 splittable: bool = False) -> list[str]:
    """Paths (COPY or CPU) for one layer's experts that are not on the accelerator, so that the CPU
    and the H2D link (with the accelerator computing what lands) finish together.

    Fiddler's Algorithm 1 picks one side per expert by its own latencies; when several experts of a
    step miss, sending all of them one way leaves the other idle. tiered sorts the misses by token
    count and gives the CPU the prefix (fewest tokens: where it loses least to the GPU) of the length
    that minimizes the makespan max(sum cpu_lat, sum transfer_lat + last gpu_lat); with one miss this
    is Algorithm 1 itself.

    Args:
        tokens: routed tokens of each missing expert (> 0), in any order.
        lat: the latency model (seconds).
        expert_bytes: bytes copied per expert.
        mode: "balanced" (above), "per-expert" (Algorithm 1 for each expert alone), "copy",
            "cpu" or "split" (every miss one way).
        splittable: a miss may be SPLIT (dense experts in CPU RAM, with an accelerator): in
            "balanced" mode a layer's single miss is split between the CPU and the link when that
            beats the better whole path by SPLIT_GAIN (LatencyModel.split_share).
    Returns:
        One path per entry of `tokens`, in its order.
    """
    if mode in (COPY, CPU, SPLIT):
        return [mode] * len(tokens)
    if mode == "balanced" and splittable and len(tokens) == 1:
        s = tokens[0]
        whole = min(lat.cpu_lat(s), lat.transfer_lat(expert_bytes) + lat.gpu_lat(s))
        if lat.split_share(s, expert_bytes)[1] < SPLIT_GAIN * whole:
            return [SPLIT]
    if mode == "per-expert":  # Algorithm 1 for each expert alone
        return [choose_path(s, False, expert_bytes, lat) for s in tokens]
    order = sorted(range(len(tokens)), key=lambda i: tokens[i])
    best_j, best_t = 0, float("inf")
    cpu_sum = 0.0
    for j in range(len(order) + 1):  # CPU takes order[:j]
        if j:
            cpu_sum += lat.cpu_lat(tokens[order[j - 1]])
        rest = order[j:]
        link = sum(lat.transfer_lat(expert_bytes) for _ in rest) + (lat.gpu_lat(tokens[rest[-1]]) if rest else 0.0)
        t = max(cpu_sum, link)
        if t < best_t - 1e-12:
            best_j, best_t = j, t
    paths = [COPY] * len(tokens)
    for i in order[:best_j]:
        paths[i] = CPU
    return paths
