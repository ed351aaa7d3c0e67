"""Fiddler's per-expert dispatch rule, priced from a HardwareProfile instead of a start-up calibration.

Source: Fiddler (ICLR 2025) §3.3 and Algorithm 1; ALGORITHMS.md 2.b, gap F4 (intercepts). For one
expert of `matrices` GEMMs of hidden x intermediate, with s routed tokens:

    cpu_lat(s)   = kernels * launch/cpu + activation(s) + gemm_time(cpu, s * macs_per_token, expert bytes)
    gpu_lat(s)   = kernels * launch/gpu + activation(s) + gemm_time(gpu, s * macs_per_token, expert bytes)
    transfer_lat = copy/h2d_pinned(expert bytes in the GPU's format)
    s*           = the largest s with cpu_lat(s) <= gpu_lat(s) + transfer_lat   (run on the CPU iff s <= s*)

`kernels` are the expert's three matmuls plus SwiGLU's two elementwise ops (silu, product), each
launched once (models/moe.expert_forward); `activation(s)` streams their s x intermediate values
(memory/bandwidth/<dev>). The matmuls' memory floor is op_time.memory_time's (the GEMV fit,
floored by the memory's read bandwidth). Each side is the max of a compute line (alpha + beta *
MACs) and that floor, so it is piecewise affine in s.

The dispatcher's `LatencyModel` is affine. `latency_model` takes each side's secant between s = 1
and s = s* (s_max when the CPU always wins): exact for a decode step's expert (s = 1, the case the
runtime meets most and the one the planner's decode times are made of) and at the crossing, so its
decisions (and its `cpu_threshold`) equal the piecewise model's for every s in 1..s_max whenever
the CPU wins on a prefix 1..s* (tests/test_profiler.py checks this by brute force). Anchoring at
s* with the compute slope instead (as before) priced a one-token CPU expert at its compute line,
0.17 ms on the H200's host against 4-5 ms streamed, and sent every decode miss to the CPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tiered.checkpoint.model_config import ModelConfig
from tiered.hardware import op_time
from tiered.hardware.profile import HardwareProfile
from tiered.runtime.dispatcher import LatencyModel


@dataclass(frozen=True)
class ExpertShape:
    """One expert: `matrices` weight matrices of hidden x intermediate elements (SwiGLU: 3)."""

    hidden: int
    intermediate: int
    matrices: int = 3

    @classmethod
    def from_config(cls, cfg: ModelConfig) -> "ExpertShape":
        return cls(cfg.hidden_size, cfg.moe_intermediate_size or cfg.intermediate_size, 3)

    @property
    def macs_per_token(self) -> int:
        return self.matrices * self.hidden * self.intermediate

    @property
    def kernels(self) -> int:
        """Kernels one expert call launches: its matmuls plus SwiGLU's silu and product."""
        return self.matrices + 2

    def weight_bytes(self, dtype: str, group: int = 32) -> float:
        """Stored bytes of the expert in `dtype` (int4 with its group scales and zeros)."""
        return self.matrices * self.hidden * self.intermediate * op_time.bytes_per_element(dtype, group)


@dataclass(frozen=True)
class _Piecewise:
    """t(s) = const + act * s + max(a(s) + beta * s, floor) [s], a(s) = alpha below `prompt_rows` tokens and
    `prompt_alpha` from there on (gemm_big's per-call intercept, which a prompt's GEMM on a big matrix
    pays: op_time.gemm_line)."""

    const: float
    alpha: float
    beta: float
    floor: float
    act: float = 0.0
    prompt_alpha: float = 0.0
    prompt_rows: float = math.inf

    def _alpha(self, s: float) -> float:
        return self.prompt_alpha if s >= self.prompt_rows else self.alpha

    def __call__(self, s: float) -> float:
        return self.const + self.act * s + max(self._alpha(s) + self.beta * s, self.floor)

    def piece(self, s: float) -> tuple[float, float]:
        """(alpha, beta) of the affine piece active at s."""
        if self._alpha(s) + self.beta * s >= self.floor:
            return self.const + self._alpha(s), self.beta + self.act
        return self.const + self.floor, self.act


@dataclass(frozen=True)
class ExpertLatency:
    """Latencies of one expert on one machine (seconds), from its HardwareProfile.

    Args:
        profile: the machine's cost models.
        shape: the expert's shape.
        cpu_dtype: format the CPU computes in (weights stored so in CPU memory).
        gpu_dtype: format copied to and computed on the GPU.
        cpu_act: the CPU's activations at one token (Plan.expert_act): int4 on "q8" streams at
            gemv/cpu/int4q8's rate (op_time.gemv_dtype).
        working_set: bytes the CPU reads between two reads of one expert (`step_expert_bytes`: a
            decode step's routed experts). Beyond the last-level cache the CPU side streams at
            memory/bandwidth_dram/cpu (op_time.memory_time): the GEMV keys are timed on operands a
            large cache partly holds (the H200 host's quick profile: bf16 GEMV 221 GB/s, DRAM 98;
            its CPU experts ran at ~93 GB/s, 2026-11-26).
    """

    profile: HardwareProfile
    shape: ExpertShape
    cpu_dtype: str = "bf16"
    gpu_dtype: str = "bf16"
    cpu_act: str = "bf16"
    working_set: float = 0.0

    @property
    def has_gpu(self) -> bool:
        return op_time.has_device(self.profile, "gpu") and self.profile.has("copy/h2d_pinned")

    def _side(self, device: str, dtype: str) -> _Piecewise:
        p, sh = self.profile, self.shape
        m = op_time.find(p, "gemm", device, dtype)
        if m is None:  # let gemm_time raise its ConfigError naming the missing key
            op_time.gemm_time(p, device, dtype, 1.0)
        key = op_time.gemv_dtype(dtype, self.cpu_act) if device == "cpu" else dtype
        floor = op_time.memory_time(p, device, key, sh.weight_bytes(dtype) / sh.matrices,
                                    working_set=self.working_set if device == "cpu" else 0.0,
                                    expert=device == "cpu") * sh.matrices
        const = sh.kernels * op_time.launch_time(p, device)
        bw = p.models.get(f"memory/bandwidth/{device}")
        # silu(gate) and gate * up read 3 and write 2 vectors of `intermediate` 16-bit values per token
        act_beta = 5 * sh.intermediate * 2 * bw.beta if bw is not None else 0.0
        # a GEMM on a big expert matrix: gemm_big's slope where profiled, and from PROMPT_GEMM_ROWS tokens its
        # per-call intercept too, as a dense prompt's GEMM on a matrix that size pays it (op_time.gemm_line;
        # on the H100's Xeon host 1.5 ms a call, oneDNN packing the weight for AMX: a forced-CPU prompt of
        # ~128 tokens an expert ran 0.357 s where the fit's intercept priced 0.217)
        per_call = sh.weight_bytes(dtype) / sh.matrices
        few, many = (op_time.gemm_line(p, device, dtype, per_call, m, rows)
                     for rows in (None, op_time.PROMPT_GEMM_ROWS))
        return _Piecewise(const, sh.matrices * few.alpha, sh.macs_per_token * few.beta, floor, act_beta,
                          prompt_alpha=sh.matrices * many.alpha, prompt_rows=op_time.PROMPT_GEMM_ROWS)

    @property
    def cpu(self) -> _Piecewise:
        return self._side("cpu", self.cpu_dtype)

    @property
    def gpu(self) -> _Piecewise:
        return self._side("gpu", self.gpu_dtype)

    def cpu_lat(self, s: int) -> float:
        return self.cpu(s)

    def gpu_lat(self, s: int) -> float:
        return self.gpu(s)

    @property
    def transfer_bytes(self) -> float:
        return self.shape.weight_bytes(self.gpu_dtype)

    def transfer_lat(self) -> float:
        return self.profile.time("copy/h2d_pinned", self.transfer_bytes)

    def cpu_wins(self, s: int) -> bool:
        """Algorithm 1's test for a non-resident expert: run on the CPU (no copy) at s tokens."""
        return not self.cpu_lat(s) > self.gpu_lat(s) + self.transfer_lat()

    def threshold(self, s_max: int = 4096) -> float:
        """Fiddler's s*: the crossing of cpu_lat and gpu_lat + transfer_lat [tokens, continuous].

        The CPU runs the expert iff s <= s*. Returns +inf when the CPU wins for every s in
        1..s_max (or always, as on a machine without a GPU), 0.0 when it loses at s = 1. Assumes
        what holds for real CPUs and GPUs: the CPU's per-token cost exceeds the GPU's and the CPU
        leaves its memory-bound regime at fewer tokens (a lower ridge point), so the CPU wins on a
        prefix of token counts; otherwise s* is the end of that prefix.
        """
        if not self.has_gpu:
            return math.inf
        cpu, gpu, tr = self.cpu, self.gpu, self.transfer_lat()
        if not self.cpu_wins(1):
            return 0.0
        if self.cpu_wins(s_max):
            return math.inf
        lo, hi = 1, s_max  # cpu wins at lo, loses at hi: bisect to the last winning integer
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if self.cpu_wins(mid) else (lo, mid)
        (ca, cb), (ga, gb) = cpu.piece(lo + 0.5), gpu.piece(lo + 0.5)
        if cb != gb:
            x = (ga + tr - ca) / (cb - gb)  # exact crossing on the pieces active between lo and hi
            if lo <= x <= hi:
                return x
        a, b = float(lo), float(hi)  # a piece changes between lo and hi: bisect the continuous margin
        for _ in range(64):
            mid = (a + b) / 2
            a, b = (mid, b) if cpu(mid) <= gpu(mid) + tr else (a, mid)
        return a

    def latency_model(self, s_max: int = 4096) -> LatencyModel:
        """The dispatcher's affine LatencyModel: each side's secant between s = 1 and s_a.

        s_a = s* (s_max when the CPU always wins). Both lines are exact at s = 1 (a decode step's
        expert) and at s_a, so they cross at s* and the decisions switch exactly there; between 1
        and s_a each line bounds its convex side from above. When the CPU loses at s = 1 already
        (s* = 0) or s* = 1, each line is exact at 1 with its side's per-token slope at large s (an
        upper bound for every s >= 1). Without a GPU the CPU line is built the same way.
        """
        disk = self.profile.models.get("disk/read_cold")
        disk_alpha, disk_bw = (disk.alpha, 1.0 / disk.beta) if disk is not None and disk.beta > 0 else (0.0, math.inf)
        cpu = self.cpu
        if not self.has_gpu:
            cb = cpu.beta + cpu.act
            return LatencyModel(cpu(1) - cb, cb, cpu(1) - cb, cb, 0.0, math.inf, disk_alpha, disk_bw)
        gpu = self.gpu
        s = self.threshold(s_max)
        at = float(s_max) if math.isinf(s) else s
        if at > 1.0 + 1e-9:
            cb, gb = ((side(at) - side(1)) / (at - 1.0) for side in (cpu, gpu))
        else:
            cb, gb = cpu.beta + cpu.act, gpu.beta + gpu.act
        h2d = self.profile.model("copy/h2d_pinned")
        # a prompt's expert GEMMs from PROMPT_GEMM_ROWS rows: the step to the exact side there, above the line
        rows = cpu.prompt_rows
        step = max(0.0, cpu(rows) - (cpu(1) - cb + cb * rows)) if rows < math.inf else 0.0
        # past the step the CPU's own piece there: a prompt's GEMMs at their compute slope (the secant's is
        # the memory-bound side's); exact at s* still, where s* lies past the step on that piece
        prompt_beta = cpu.piece(rows)[1] if rows < math.inf else None
        # CPU experts and H2D copies at once, each slowed by the other where the profile measured it
        share = (self.profile.meta or {}).get("host_share") or {}
        return LatencyModel(cpu(1) - cb, cb, gpu(1) - gb, gb, h2d.alpha, 1.0 / h2d.beta, disk_alpha, disk_bw,
                            cpu_prompt_alpha=step, cpu_prompt_rows=rows if step > 0 else math.inf,
                            cpu_prompt_beta=prompt_beta if step > 0 else None,
                            cpu_shared=max(1.0, float(share.get("cpu", 1.0))),
                            link_shared=max(1.0, float(share.get("h2d", 1.0))))


def step_expert_bytes(cfg: ModelConfig, dtype: str) -> float:
    """Bytes of the routed experts one decode step of one sequence reads [bytes]: top-k experts of
    `dtype` in every MoE layer (the reuse distance of an expert that every token routes to)."""
    layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    return layers * cfg.num_experts_per_tok * ExpertShape.from_config(cfg).weight_bytes(dtype)


def dispatch_latency(profile: HardwareProfile, cfg: ModelConfig, cpu_dtype: str = "bf16",
                     gpu_dtype: str = "bf16") -> LatencyModel:
    """LatencyModel for the experts of `cfg` on the machine `profile` (replaces runtime/calibrate.py)."""
    return ExpertLatency(profile, ExpertShape.from_config(cfg), cpu_dtype, gpu_dtype,
                         working_set=step_expert_bytes(cfg, cpu_dtype)).latency_model()
