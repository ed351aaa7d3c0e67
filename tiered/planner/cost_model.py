"""ScheInfer's cost model of one sliced MLP / expert layer (pure functions, no state).

Source: Lin, Pan, Shi, Wang, Chu, "Task scheduling for efficient inference of large language models
on single moderate GPU systems" (ScheInfer), §IV-A (Eq. 3-12) and §IV-B (Eq. 15); re-specified in
/work/shared/ALGORITHMS.md §1.b. All times are seconds, workloads multiply-accumulates (MACs),
copies bytes.

A layer's FFN weights are sliced along the intermediate dimension H into CC (CPU-stored,
CPU-computed), CG (CPU-stored, copied H2D at every use, GPU-computed) and GG (GPU-stored) parts with
rates r_CC + r_CG + r_GG = 1. The layer runs n_l GEMMs in sequence (gate, up, down for SwiGLU), each
split into the same three parts, on four streams: A = CPU compute, B = kernel launch, C = H2D copy,
D = GPU compute. Per GEMM (Eq. 4, `gemm_times`) the stages take t_L (launch), t_C2G (copy), t_G (GPU)
and t_C (CPU); the completion times follow the recurrence of Eq. 5 (`completion_times`), whose GPU
finish has the closed forms of Eq. 10-12 chosen by the predicates of Eq. 6-8 (`schedule_case`,
`gpu_finish_closed_form`) and, equivalently, the three-stage pipeline formula
t_L + t_C2G + t_G + (n_l - 1) * max(t_L, t_C2G, t_G) (`gpu_finish_pipeline`). The layer time is
t_fin = max(tau_G^{n_l}, n_l * t_C) (`layer_time`).

Typos and gaps of the paper, resolved as ALGORITHMS.md §1.b/§1.f says:
  * Eq. 4 writes t_C2G = alpha_C2G + ... without sgn; we use alpha_C2G * sgn(r_CG) (no copy, no cost),
    as Eq. 10-12 do.
  * Eq. 15's copy bytes are literally n_W * beta_C2G; we copy what is actually shipped,
    (r_CG + sgn(n_g) * r_CC) * n_W, and its sgn(r_CC) launch / start-up terms become sgn(n_g * r_CC)
    (no CG' work when n_g = 0).
  * S1: for MoE, n_l = 3 x (distinct experts activated in the layer), and the GPU-memory cost of
    r_GG = 1 is all experts' bytes (`LayerShape.n_matrices`); prefill uses the mean tokens per
    active expert (`moe_layer_shape`).
  * S4: the D2H of X1, the H2D of Y^CC and the final reduction are not in the paper's model; the
    simulator can add them as a constant join (simulator.py), they are 0 here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tiered.errors import ConfigError
from tiered.hardware import op_time
from tiered.hardware.profile import HardwareProfile

_RATE_TOL = 1e-9


def sgn(x: float) -> int:
    """ScheInfer's sgn on non-negative quantities: 1 if x > 0 else 0 (an indicator of non-empty work)."""
    return 1 if x > 0 else 0


@dataclass(frozen=True)
class LayerShape:
    """The shape of one MLP / MoE layer's FFN work, as ScheInfer's model sees it (§IV-A2).

    Attributes:
        tokens: T, tokens through each GEMM (decode batch; prompt length; or mean tokens per expert).
        d_model: M, model (embedding) dimension.
        d_ff: H, FFN intermediate dimension (the dimension the slicing rates split).
        n_gemms: n_l, GEMMs run one after another per step (3 per SwiGLU MLP: gate, up, down;
            3 x active experts for MoE, ALGORITHMS.md S1). Every GEMM is [T, M] x [M, H] in MACs.
        bytes_per_weight: bytes per weight element (fp16 2, int8 1, int4 0.5; add group-scale
            overhead here if the format has it).
        n_matrices: weight matrices stored in the layer (3 x experts for MoE); sets n_m, the GPU
            bytes of r_GG = 1. None: n_gemms (a dense MLP stores what it runs).
    """

    tokens: int
    d_model: int
    d_ff: int
    n_gemms: int = 3
    bytes_per_weight: float = 2.0
    n_matrices: int | None = None

    def __post_init__(self) -> None:
        for name in ("tokens", "d_model", "d_ff", "n_gemms"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ConfigError(f"LayerShape.{name} must be a positive integer, got {v!r}")
        if not self.bytes_per_weight > 0:
            raise ConfigError(f"LayerShape.bytes_per_weight must be > 0, got {self.bytes_per_weight!r}")
        if self.n_matrices is not None and (not isinstance(self.n_matrices, int) or self.n_matrices < 1):
            raise ConfigError(f"LayerShape.n_matrices must be a positive integer or None, got {self.n_matrices!r}")

    @property
    def macs_per_gemm(self) -> float:
        """n_GEMM = T * M * H [MACs] of one whole (unsliced) GEMM."""
        return float(self.tokens) * self.d_model * self.d_ff

    @property
    def weight_bytes(self) -> float:
        """n_W = M * H * bytes_per_weight [bytes] of one weight matrix."""
        return float(self.d_model) * self.d_ff * self.bytes_per_weight

    @property
    def layer_bytes(self) -> float:
        """n_m [bytes]: GPU memory the layer's FFN weights take at r_GG = 1 (Eq. 14)."""
        return (self.n_matrices or self.n_gemms) * self.weight_bytes

    def with_tokens(self, tokens: int) -> "LayerShape":
        """The same layer with T = tokens."""
        return LayerShape(tokens, self.d_model, self.d_ff, self.n_gemms, self.bytes_per_weight, self.n_matrices)


def moe_layer_shape(tokens: int, d_model: int, d_ff: int, n_experts: int, top_k: int,
                    bytes_per_weight: float, gemms_per_expert: int = 3) -> LayerShape:
    """An MoE layer as ScheInfer's single-chain model sees it (ALGORITHMS.md S1).

    With `tokens` tokens routed top_k of n_experts uniformly, the expected number of distinct active
    experts is E * (1 - (1 - k/E)^T) (rounded up, at least k, at most E); the chain runs
    gemms_per_expert GEMMs per active expert, each on the mean tokens per active expert
    ceil(T * k / active). All experts' weights count towards n_m.
    """
    if not 1 <= top_k <= n_experts:
        raise ConfigError(f"top_k={top_k} must be in [1, n_experts={n_experts}]")
    expected = n_experts * (1.0 - (1.0 - top_k / n_experts) ** tokens)
    active = min(n_experts, max(top_k, math.ceil(expected - 1e-9)))
    per_expert = max(1, math.ceil(tokens * top_k / active - 1e-9))
    return LayerShape(per_expert, d_model, d_ff, gemms_per_expert * active, bytes_per_weight,
                      gemms_per_expert * n_experts)


@dataclass(frozen=True)
class CostParams:
    """The constants of ScheInfer Eq. 3 for one machine and precision (ScheInfer Table I).

    alpha_* are start-up times [s]; beta_gpu / beta_cpu [s per MAC]; beta_c2g [s per byte];
    t_launch is the constant per-kernel (or per-copy) launch cost [s].

    beta_dram [s per byte], not in the paper: the host memory that the CPU's reads of the CC weights
    and the link's DMA of the CG weights share. A layer takes at least (CC + CG bytes) * beta_dram
    (`shared_dram_time`). 0 = each side has its own bandwidth, as in ScheInfer's model. On the H100's
    host (2026-11-26, 16 cores, DRAM ~105 GB/s, H2D 55 GB/s) the dense default plan, priced without it,
    predicted 50 tok/s and ran at 29: its CC and CG slices together streamed ~80 GB/s.
    """

    alpha_gpu: float
    beta_gpu: float
    alpha_cpu: float
    beta_cpu: float
    alpha_c2g: float
    beta_c2g: float
    t_launch: float
    beta_dram: float = 0.0

    def __post_init__(self) -> None:
        for name, v in self.__dict__.items():
            if not (v >= 0 and math.isfinite(v)):
                raise ConfigError(f"CostParams.{name} must be finite and >= 0, got {v!r}")


def roofline_params(p: CostParams, tokens: int, gpu_peak_macs: float, cpu_peak_macs: float) -> CostParams:
    """Eq. 3 constants for GEMMs over `tokens` tokens when `p` was fitted on GEMV-sized work (S2).

    ALGORITHMS.md S2: one affine line in MACs mixes two regimes. A line fitted at decode sizes
    (ScheInfer Table I: beta_G FP16 3.2e-12 s/MAC is 2 B / 625 GB/s, i.e. weight bytes over the
    A6000's memory bandwidth) charges a T-token GEMM T times a GEMV, although it reads the weights
    once. Here, per device, beta' = max(1 / peak, beta / tokens): the weight-read cost amortized over
    the tokens, floored by the compute peak [MAC/s]. The result is still affine in MACs at fixed T,
    so the edge-point solvers apply unchanged. Start-up (alpha), copy and launch terms are kept.
    In the prompt phase the CG' kernel runs on n_g < T tokens and is charged at the T-token rate,
    an approximation.
    """
    if tokens < 1 or gpu_peak_macs <= 0 or cpu_peak_macs <= 0:
        raise ConfigError("roofline_params needs tokens >= 1 and positive peaks")
    return CostParams(p.alpha_gpu, max(1.0 / gpu_peak_macs, p.beta_gpu / tokens), p.alpha_cpu,
                      max(1.0 / cpu_peak_macs, p.beta_cpu / tokens), p.alpha_c2g, p.beta_c2g, p.t_launch, p.beta_dram)


def cost_params(profile: HardwareProfile, precision: str = "fp16", shape: LayerShape | None = None, *,
                copy_key: str = "copy/h2d_pinned", launch_key: str = "launch/gpu",
                cpu_working_set: float = 0.0) -> CostParams:
    """Eq. 3 constants from a HardwareProfile: gemm/{gpu,cpu}/<precision> (with op_time's dtype
    fallbacks), the H2D copy model and the GPU launch constant (its alpha).

    With `shape`, a GEMM's memory floor is folded in the way hardware/op_time.gemm_time prices it
    (t = max(gemm(MACs), gemv(weight bytes)), S2): the memory model (gemv/<dev>/<precision>, else
    memory/bandwidth/<dev>) costs beta_mem * bytes_per_weight / T per MAC at T = shape.tokens, and
    the affine bound alpha = max(alphas), beta = max(betas per MAC) is used so the edge-point solvers
    still apply (exact when one regime dominates both terms). A single-line profile such as ScheInfer
    Table I, whose line lies above the bandwidth floor, comes back unchanged.

    `cpu_working_set`: bytes the CPU reads between two reads of one weight (a decode step's CPU-side
    slices). Beyond the last-level cache (meta["llc_bytes"]) the CPU's memory term is floored by
    op_time.dram_floor (as op_time.memory_time): the slower of memory/bandwidth_dram/cpu and, where
    profiled, gemv_dram/cpu/<precision>; the GEMV keys are timed on operands a large cache partly
    holds (the H200 host's quick profile: bf16 GEMV 221 GB/s, DRAM 98 GB/s).

    With `shape`, a GEMM over an FFN matrix of BIG_GEMM_BYTES or more is priced by
    gemm_big/<dev>/<precision>'s line where profiled (op_time.gemm_line: timed on real FFN matrices).

    Beyond the LLC, beta_dram is memory/bandwidth_dram/cpu's rate: the CPU's reads of the CC slices
    and the link's DMA of the CG slices draw on the one host memory (CostParams.beta_dram).

    Raises ConfigError naming a missing key.
    """
    def gemm(device: str) -> tuple[float, float]:
        m = op_time.find(profile, "gemm", device, precision)
        if m is None:
            raise ConfigError(f"hardware profile {profile.name!r} has no gemm/{device}/{precision} model",
                              "re-run `tiered profile` or pick a preset that covers it")
        if shape is not None:  # an FFN matrix's GEMM: gemm_big's line where it is that big
            m = op_time.gemm_line(profile, device, precision, shape.d_model * shape.d_ff * shape.bytes_per_weight, m,
                                  shape.tokens)
        beta = m.beta
        mem = (op_time.find(profile, "gemv", device, precision) or profile.models.get(f"memory/bandwidth/{device}")
               if shape is not None else None)
        if mem is None:
            return m.alpha, beta
        mem_beta = max(mem.beta, op_time.dram_floor(profile, "cpu", cpu_working_set, precision)) if device == "cpu" else mem.beta
        return max(m.alpha, mem.alpha), max(beta, mem_beta * shape.bytes_per_weight / shape.tokens)

    (ag, bg), (ac, bc) = gemm("gpu"), gemm("cpu")
    h, l = profile.model(copy_key), profile.model(launch_key)
    dram = profile.models.get("memory/bandwidth_dram/cpu")
    shared = dram.beta if dram is not None and op_time.beyond_cache(profile, cpu_working_set) else 0.0
    return CostParams(ag, bg, ac, bc, h.alpha, h.beta, l.alpha, shared)


@dataclass(frozen=True)
class SliceRates:
    """Fractions of the intermediate dimension H in each part: r_cc + r_cg + r_gg = 1 (Eq. 1-2)."""

    r_cc: float
    r_cg: float
    r_gg: float

    def __post_init__(self) -> None:
        rates = (self.r_cc, self.r_cg, self.r_gg)
        if any(not (-_RATE_TOL <= r <= 1 + _RATE_TOL) for r in rates) or abs(sum(rates) - 1) > 1e-6:
            raise ConfigError(f"slicing rates {rates} must lie in [0, 1] and sum to 1")

    @classmethod
    def from_gg_cg(cls, r_gg: float, r_cg: float) -> "SliceRates":
        """Rates with r_cc = 1 - r_gg - r_cg (clamped at 0 against rounding)."""
        return cls(max(0.0, 1.0 - r_gg - r_cg), r_cg, r_gg)


@dataclass(frozen=True)
class StageTimes:
    """Per-GEMM durations [s] of the four streams: launch t_L (B), copy t_C2G (C), GPU t_G (D), CPU t_C (A)."""

    launch: float
    copy: float
    gpu: float
    cpu: float


def gemm_times(shape: LayerShape, rates: SliceRates, p: CostParams) -> StageTimes:
    """ScheInfer Eq. 4: per-GEMM stage times under slicing (the whole input on every part).

        t_G   = alpha_G * [sgn(r_CG) + sgn(r_GG)] + (r_CG + r_GG) * n_GEMM * beta_G
        t_C   = alpha_C * sgn(r_CC) + r_CC * n_GEMM * beta_C
        t_C2G = alpha_C2G * sgn(r_CG) + r_CG * n_W * beta_C2G          (sgn form, ALGORITHMS.md 1.b)
        t_L   = [2 * sgn(r_CG) + sgn(r_GG)] * t_launch                 (a CG GEMM launches copy + kernel)
    """
    n, w = shape.macs_per_gemm, shape.weight_bytes
    s_cc, s_cg, s_gg = sgn(rates.r_cc), sgn(rates.r_cg), sgn(rates.r_gg)
    return StageTimes(
        launch=(2 * s_cg + s_gg) * p.t_launch,
        copy=p.alpha_c2g * s_cg + rates.r_cg * w * p.beta_c2g,
        gpu=p.alpha_gpu * (s_cg + s_gg) + (rates.r_cg + rates.r_gg) * n * p.beta_gpu,
        cpu=p.alpha_cpu * s_cc + rates.r_cc * n * p.beta_cpu,
    )


def prompt_gemm_times(shape: LayerShape, rates: SliceRates, n_g: int, p: CostParams) -> StageTimes:
    """ScheInfer Eq. 15: per-GEMM stage times in the prompt phase with n_g of the T tokens on CG'.

    The CC weights are also shipped to the GPU (CG') for n_g tokens; all T tokens take the CG and GG
    parts on the GPU (merged into one GEMM per part). With the resolutions of ALGORITHMS.md 1.b:

        t_L'   = [2 sgn(r_CG) + 2 sgn(n_g r_CC) + sgn(r_GG)] * t_launch
        t_C2G' = alpha_C2G [sgn(r_CG) + sgn(n_g r_CC)] + (r_CG + sgn(n_g) r_CC) * n_W * beta_C2G
        t_G'   = alpha_G [sgn(r_CG) + sgn(r_GG) + sgn(n_g r_CC)] + [T (r_CG + r_GG) + n_g r_CC] M H beta_G
        t_C'   = alpha_C sgn(r_CC (T - n_g)) + (T - n_g) r_CC M H beta_C

    n_g = 0 gives Eq. 4 exactly. Raises ConfigError unless 0 <= n_g <= T.
    """
    T = shape.tokens
    if not 0 <= n_g <= T:
        raise ConfigError(f"n_g={n_g} must be in [0, T={T}]")
    mh, w = float(shape.d_model) * shape.d_ff, shape.weight_bytes
    s_cg, s_gg, s_cgp = sgn(rates.r_cg), sgn(rates.r_gg), sgn(n_g * rates.r_cc)
    return StageTimes(
        launch=(2 * s_cg + 2 * s_cgp + s_gg) * p.t_launch,
        copy=p.alpha_c2g * (s_cg + s_cgp) + (rates.r_cg + sgn(n_g) * rates.r_cc) * w * p.beta_c2g,
        gpu=p.alpha_gpu * (s_cg + s_gg + s_cgp) + (T * (rates.r_cg + rates.r_gg) + n_g * rates.r_cc) * mh * p.beta_gpu,
        cpu=p.alpha_cpu * sgn(rates.r_cc * (T - n_g)) + (T - n_g) * rates.r_cc * mh * p.beta_cpu,
    )


@dataclass(frozen=True)
class Completion:
    """Completion timestamps [s] of GEMM i = 1..n_l on each stream (Eq. 5), index i-1."""

    launch: tuple[float, ...]
    copy: tuple[float, ...]
    gpu: tuple[float, ...]
    cpu: tuple[float, ...]


def completion_times(st: StageTimes, n_gemms: int) -> Completion:
    """ScheInfer Eq. 5, the recurrence over the n_l GEMMs of a layer (all tau^0 = 0):

        tau_L^i   = tau_L^{i-1} + t_L
        tau_C2G^i = max(tau_L^i, tau_C2G^{i-1}) + t_C2G
        tau_G^i   = max(tau_C2G^i, tau_G^{i-1}) + t_G
        tau_C^i   = tau_C^{i-1} + t_C
    """
    lau, cop, gpu, cpu = [], [], [], []
    tl = tc = tg = ta = 0.0
    for _ in range(n_gemms):
        tl = tl + st.launch
        tc = max(tl, tc) + st.copy
        tg = max(tc, tg) + st.gpu
        ta = ta + st.cpu
        lau.append(tl), cop.append(tc), gpu.append(tg), cpu.append(ta)
    return Completion(tuple(lau), tuple(cop), tuple(gpu), tuple(cpu))


def schedule_case(st: StageTimes) -> int:
    """Which of ScheInfer's three schedules holds (Eq. 6-8 predicates, §IV-A3):

        Q1: t_L < t_C2G     Q2: t_G < t_C2G     Q3: t_L < t_G
        1: Q1 and Q2 (the copy dominates)
        2: (Q1 and not Q2) or (not Q1 and Q3) (GPU compute dominates)
        3: not Q1 and not Q3 (kernel launch dominates)
    """
    q1, q2, q3 = st.launch < st.copy, st.gpu < st.copy, st.launch < st.gpu
    if q1 and q2:
        return 1
    if (q1 and not q2) or (not q1 and q3):
        return 2
    return 3


def gpu_finish_closed_form(st: StageTimes, n_gemms: int) -> float:
    """tau_G^{n_l} by ScheInfer Eq. 10 (case 1), Eq. 11 (case 2) or Eq. 12 (case 3) [s]."""
    case = schedule_case(st)
    if case == 1:
        return st.launch + n_gemms * st.copy + st.gpu
    if case == 2:
        return st.launch + st.copy + n_gemms * st.gpu
    return n_gemms * st.launch + st.copy + st.gpu


def gpu_finish_pipeline(st: StageTimes, n_gemms: int) -> float:
    """tau_G^{n_l} as a three-stage pipeline of identical jobs (equal to Eq. 10-12, case-free) [s]."""
    return st.launch + st.copy + st.gpu + (n_gemms - 1) * max(st.launch, st.copy, st.gpu)


def layer_time(st: StageTimes, n_gemms: int) -> float:
    """t_fin = max(tau_G^{n_l}, tau_C^{n_l}) with tau_C^{n_l} = n_l * t_C (Eq. 5) [s]."""
    return max(gpu_finish_pipeline(st, n_gemms), n_gemms * st.cpu)


def shared_dram_time(shape: LayerShape, host_share: float, p: CostParams) -> float:
    """Seconds the host memory needs for a layer's host-side weight traffic: `host_share` of each of
    its n_l weight matrices read from RAM (by the CPU, or by the link's DMA), at p.beta_dram."""
    return host_share * shape.n_gemms * shape.weight_bytes * p.beta_dram


def decode_layer_time(shape: LayerShape, rates: SliceRates, p: CostParams) -> float:
    """t_fin of one layer at slicing `rates` with the whole input on every part (Eq. 4-5) [s], no
    less than the host memory's time for the CC and CG weights (shared_dram_time)."""
    return max(layer_time(gemm_times(shape, rates, p), shape.n_gemms),
               shared_dram_time(shape, rates.r_cc + rates.r_cg, p))


def prompt_layer_time(shape: LayerShape, rates: SliceRates, n_g: int, p: CostParams) -> float:
    """t_fin of one layer in the prompt phase with n_g tokens on CG' (Eq. 15 in Eq. 5) [s], no less
    than the host memory's time for what the CPU reads (CC, when it has tokens) and the link ships
    (CG, and CC for CG')."""
    host = rates.r_cg + rates.r_cc * (sgn(shape.tokens - n_g) + sgn(n_g))
    return max(layer_time(prompt_gemm_times(shape, rates, n_g, p), shape.n_gemms), shared_dram_time(shape, host, p))
