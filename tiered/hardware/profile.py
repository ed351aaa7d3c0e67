"""HardwareProfile: a machine's fitted cost models, saved as JSON (`tiered profile` writes it).

Every operation the planner prices is an affine model t = alpha + beta * n (ScheInfer Eq. 3;
ALGORITHMS.md 1.b, 5.2), with the fit quality R^2 kept beside it (ScheInfer Table I):

    key                      n is ...                 alpha [s]   beta [s per unit]
    gemm/<device>/<dtype>    multiply-accumulates     launch/start-up   s per MAC
                             (compute-bound regime: many tokens per call)
    gemm_pack/cpu/<dtype>    weight bytes a call      0                 s per byte
                             (beside gemm/cpu/<dtype>, fitted with it: torch packs or dequantizes the weight
                             every call; op_time.gemm_line adds it to calls of 8 rows or more)
    gemm_amx_pack/cpu/int4   weight bytes a call      0                 s per byte
                             (beside gemm_amx/cpu/int4, fitted with it: the AMX GEMM converts the int4
                             weight into its tiles every call; op_time.amx_gemm_time)
    gemv/<device>/<dtype>    weight bytes streamed    start-up          s per byte
                             (memory-bound regime, fitted at 1 token; ALGORITHMS.md 1.f S2)
    gemv_graph/gpu/<dtype>   weight bytes streamed    the kernel's own  s per byte
                             (the same GEMVs replayed in a captured CUDA graph: no host launch)
    attn/<device>/<dtype>    MACs of decode attention (q.K^T + p.V, one query per sequence)
    copy/h2d_pinned, copy/h2d_pageable, copy/d2h_pinned, copy/d2h_pageable     bytes
    disk/read_cold           bytes (page cache dropped before each read)
    disk/read_cold_parallel  bytes read by the runtime's disk readers at once (2 threads, disjoint ranges)
    disk/write               bytes (write + fsync)
    launch/<device>          (constant: alpha only; r2 None)
    memory/bandwidth/<device> bytes read (beta = 1 / read bandwidth)
    memory/copy/<device>     bytes copied (read once, written once)

devices: "cpu", "gpu"; dtypes: "fp32", "bf16", "fp16", "int8", "int4" (int4/int8 weights with
bf16/fp16 activations). A GEMM is priced as max(gemm(MACs), gemv(weight bytes)), see
hardware/op_time.py. Optional `meta` entries: "disk_memory" [bytes], "key_sources" (key -> where
that number comes from), "notes". Measured numbers live in these files, never in source; presets
for machines we do not have are built from published figures (hardware/presets.py) and say so in
`source`.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from tiered.errors import ConfigError


@dataclass(frozen=True)
class LinearModel:
    """t = alpha + beta * n [seconds]; r2 = coefficient of determination of the fit (None: not fitted)."""

    alpha: float
    beta: float
    r2: float | None = None

    def __call__(self, n: float) -> float:
        return self.alpha + self.beta * n if n > 0 else 0.0


@dataclass(frozen=True)
class HardwareProfile:
    """Cost models of one machine.

    Attributes:
        name: machine or preset name.
        source: "measured on <host> <date>" or the publication a preset comes from.
        models: key (see module docstring) -> LinearModel.
        gpu_memory, cpu_memory: capacities [bytes] (None when unknown / no GPU).
        meta: free-form details (CPU model, GPU name, torch version, threads).
    """

    name: str
    source: str
    models: dict[str, LinearModel] = field(default_factory=dict)
    gpu_memory: int | None = None
    cpu_memory: int | None = None
    meta: dict = field(default_factory=dict)

    def model(self, key: str) -> LinearModel:
        """The cost model `key`. Raises ConfigError naming the missing key."""
        try:
            return self.models[key]
        except KeyError:
            raise ConfigError(f"hardware profile {self.name!r} has no cost model {key!r}",
                              "re-run `tiered profile` or pick a preset that covers it") from None

    def has(self, key: str) -> bool:
        return key in self.models

    def time(self, key: str, n: float) -> float:
        """Seconds for workload n under model `key`."""
        return self.model(key)(n)

    def to_json(self) -> str:
        d = asdict(self)
        return json.dumps(d, indent=1)

    def save(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(self.to_json())

    @classmethod
    def from_dict(cls, d: dict) -> "HardwareProfile":
        return cls(d["name"], d["source"], {k: LinearModel(**v) for k, v in d["models"].items()},
                   d.get("gpu_memory"), d.get("cpu_memory"), d.get("meta", {}))

    @classmethod
    def load(cls, path: str | Path) -> "HardwareProfile":
        """Read a saved profile. Raises ConfigError when missing or malformed."""
        try:
            return cls.from_dict(json.loads(Path(path).read_text()))
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ConfigError(f"cannot read hardware profile {path} ({e})",
                              "run `tiered profile` to write one, or name a preset (`tiered profile --presets`)") from None


def default_profile_path() -> Path:
    """Where `tiered profile` saves by default: <cache dir>/hardware_profile.json."""
    from tiered.checkpoint.tokenizer import cache_dir
    return cache_dir() / "hardware_profile.json"


# CPU cost models whose per-byte term is the memory's rate: what a change of the machine's memory
# bandwidth since the profile moves (a VM's neighbours; the compute-bound GEMM fits and the host
# overhead keys stay as measured).
BANDWIDTH_BOUND_CPU = ("gemv/cpu/", "gemv_dram/cpu/", "expert_dram/cpu/", "attn/cpu/", "attn_decode/cpu/",
                       "memory/bandwidth/cpu", "memory/bandwidth_dram/cpu", "memory/copy/cpu")

# Of those, the ones timed over operands no cache holds (beyond meta["llc_bytes"]): the DRAM floors
# (op_time.dram_floor) under every CPU read of a step bigger than the cache. When the memory reads
# faster than the profile, only they move (the kernels keep their profiled rates); when it reads
# slower, every bandwidth-bound key moves. A faster memory does not speed up a kernel in proportion:
# on the 2-core EPYC (2026-11-26) the bf16 decode kernel's 32 MiB read swung between ~45 and ~80 GB/s
# from minute to minute while SmolLM2's int4 native decode step moved ~1.1x (311-386 tok/s against
# 369-437) and its fp32 step and a bf16 MoE's ~1.35x; scaling every key by the fast reading priced
# the int4 step at 760 tok/s where it ran 381-409.
DRAM_BOUND_CPU = ("gemv_dram/cpu/", "expert_dram/cpu/", "memory/bandwidth_dram/cpu", "attn_decode/cpu/")


def scale_cpu_bandwidth(profile: HardwareProfile, ratio: float, why: str = "") -> HardwareProfile:
    """`profile` with the per-byte terms of its bandwidth-bound CPU models multiplied by `ratio`
    (seconds now / seconds then: 1.25 = the memory is 1.25x slower than when profiled). The fixed
    terms (alpha) stay. A slower memory (ratio > 1) moves every BANDWIDTH_BOUND_CPU key. A faster one
    moves only the DRAM floors (DRAM_BOUND_CPU) where the profile has them: a read beyond the cache is
    priced max(kernel rate, DRAM floor), so the floor drops and each kernel keeps its own measured
    rate. meta["cpu_bandwidth_ratio"] records the ratio, meta["notes"] `why`.

    Raises:
        ValueError: ratio is not positive.
    """
    if not ratio > 0:
        raise ValueError(f"bandwidth ratio must be positive, got {ratio}")
    floors_only = ratio < 1.0 and any(k.startswith(DRAM_BOUND_CPU) for k in profile.models)
    moved = DRAM_BOUND_CPU if floors_only else BANDWIDTH_BOUND_CPU
    models = {k: (LinearModel(m.alpha, m.beta * ratio, m.r2) if k.startswith(moved) else m)
              for k, m in profile.models.items()}
    meta = dict(profile.meta, cpu_bandwidth_ratio=ratio)
    if why:
        meta["notes"] = list(profile.meta.get("notes", [])) + [why]
    return replace(profile, models=models, meta=meta)


def scale_compute_keys(profile: HardwareProfile, ratios: dict[str, float], why: str = "") -> HardwareProfile:
    """`profile` with the per-unit term (beta) of each compute-bound CPU key in `ratios` multiplied by its ratio
    (seconds now / seconds when that key was measured: hardware/profiler.ComputeProbe), faster or slower; the fixed
    terms stay. meta["cpu_compute_ratios"] records the ratios, meta["notes"] `why`.

    Raises:
        ValueError: a ratio is not positive.
    """
    _check_ratios(ratios, "compute")
    models = _betas_scaled(profile.models, profile.models, ratios, set(ratios))
    meta = _with_note(dict(profile.meta, cpu_compute_ratios={k: round(r, 4) for k, r in ratios.items()}), profile, why)
    return replace(profile, models=models, meta=meta)


def _check_ratios(ratios: dict[str, float], what: str) -> None:
    """Raises ValueError where a speed ratio is not positive."""
    if any(not r > 0 for r in ratios.values()):
        raise ValueError(f"{what} ratios must be positive, got {ratios}")


def _betas_scaled(base: dict, measured: dict, ratios: dict[str, float], keys: set) -> dict:
    """`base`'s models with each of `keys` that `measured` has replaced by its measured model with the per-unit
    term multiplied by its ratio (1 where `ratios` has none)."""
    models = dict(base)
    for k in keys & set(measured):
        m = measured[k]
        models[k] = LinearModel(m.alpha, m.beta * ratios.get(k, 1.0), m.r2)
    return models


def _with_note(meta: dict, profile: HardwareProfile, why: str) -> dict:
    """`meta` with meta["notes"] `profile`'s notes and `why`, where given."""
    if why:
        meta["notes"] = list(profile.meta.get("notes", [])) + [why]
    return meta


def scale_cpu_keys(profile: HardwareProfile, ratios: dict[str, float], why: str = "") -> HardwareProfile:
    """`profile` with the per-byte term of each CPU GEMV key in `ratios` multiplied by its ratio (seconds
    now / seconds when that key was measured, hardware/profiler.Probe), faster or slower; "*" (the
    probes' median ratio), where given, moves the other bandwidth-bound CPU keys as scale_cpu_bandwidth
    does (a faster memory only the DRAM floors). The fixed terms stay. meta["cpu_bandwidth_ratio"]
    records "*" (1.0 without it), meta["cpu_key_ratios"] the ratios, meta["notes"] `why`.

    Raises:
        ValueError: a ratio is not positive.
    """
    _check_ratios(ratios, "bandwidth")
    rest = ratios.get("*")
    base = scale_cpu_bandwidth(profile, rest) if rest is not None else profile
    probed = set((profile.meta.get("probe") or {}).get("seconds", {})) | (set(ratios) - {"*"})
    # each probed key by its own ratio alone (1: kept as measured)
    models = _betas_scaled(base.models, profile.models, ratios, probed)
    meta = _with_note(dict(base.meta, cpu_bandwidth_ratio=rest if rest is not None else 1.0,
                           cpu_key_ratios={k: round(r, 4) for k, r in ratios.items()}), profile, why)
    return replace(profile, models=models, meta=meta)
