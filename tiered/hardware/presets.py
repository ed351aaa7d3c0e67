"""Hardware presets: HardwareProfiles of machines we do not have, from published figures.

Every number here is a published figure (paper table, vendor spec) or derived from one; each
preset's `meta["key_sources"]` says, per key, which. Nothing here was measured by tiered.

    name            machine                                  main sources
    scheinfer-a     RTX A6000 + Xeon Platinum 8358, PCIe 4   ScheInfer Table I (fitted alpha/beta/R^2)
    scheinfer-b     RTX 3090 + EPYC 7742, PCIe 4             ScheInfer Table I
    scheinfer-c     RTX 2080 Ti + Xeon Gold 6230, PCIe 3     ScheInfer Table I
    t4-pcie3        GCP T4 16 GB + Xeon 2.0 GHz 208 GB + NVMe  FlexGen Table 1/24 + FlexGen's fitted
                                                             T4 constants (experimental/cost_model.py)
    rtx4090-pcie4   RTX 4090 24 GB + 64 cores 256 GB + 980 PRO HOBBIT §5 testbed, NVIDIA spec sheets

Conventions (hardware/profile.py): n = MACs for gemm/attn (1 MAC = 2 FLOP, so beta = 2 / FLOPS),
n = bytes for gemv/copy/disk/memory (beta = 1 / bandwidth). "GB" in FlexGen's code is 2^30 bytes;
elsewhere GB = 10^9 as the vendors use it. An alpha of 0 means "not reported".
"""

from __future__ import annotations

from tiered.errors import ConfigError
from tiered.hardware.profile import HardwareProfile, LinearModel

GiB = 2**30

SCHEINFER = "ScheInfer (Lin et al.), Table I and §V-A"
FLEXGEN_T1 = "FlexGen (Sheng et al., ICML 2023) Table 1"
FLEXGEN_T24 = "FlexGen Table 24 (measured SSD speed of the main testbed)"
FLEXGEN_CM = "FlexGen repository experimental/cost_model.py, CostModelConfig (constants fitted on GCP T4)"
HOBBIT = "HOBBIT (Tang et al.) §5 Hardware (RTX 4090 testbed)"
NV_ADA = "NVIDIA Ada GPU architecture whitepaper / RTX 4090 spec sheet"
SCHEINFER_PCIE_NOTE = ("ScheInfer's PCIe beta implies 38-40 GB/s on PCIe 4.0 x16 (24 GB/s on PCIe 3.0), above "
                       "the link's theoretical rate: the unit may not be bytes (ALGORITHMS.md 1.f S3); kept as reported")

# ScheInfer Table I: (alpha [s], beta [s per MAC or per byte], r^2) per testbed; launch = (alpha, sigma).
_SCHEINFER_TABLE_I = {
    "a": {"gemm/gpu/fp16": (1.0e-7, 3.2e-12, 0.997), "gemm/gpu/int4": (4.7e-6, 8.1e-13, 0.999),
          "gemm/cpu/fp16": (7.4e-7, 1.6e-11, 0.988), "gemm/cpu/int4": (1.1e-5, 5.4e-12, 0.998),
          "copy/h2d_pinned": (3.0e-6, 2.6e-11, 0.985), "launch": (4.4e-5, 3.4e-6)},
    "b": {"gemm/gpu/fp16": (1.9e-7, 2.6e-12, 0.997), "gemm/gpu/int4": (4.6e-6, 6.5e-13, 0.996),
          "gemm/cpu/fp16": (3.4e-6, 1.5e-11, 0.995), "gemm/cpu/int4": (1.3e-5, 6.5e-12, 0.998),
          "copy/h2d_pinned": (5.8e-6, 2.5e-11, 0.994), "launch": (5.7e-5, 5.9e-6)},
    "c": {"gemm/gpu/fp16": (1.4e-7, 3.6e-12, 0.988), "gemm/gpu/int4": (6.4e-6, 9.2e-13, 0.989),
          "gemm/cpu/fp16": (1.8e-6, 2.5e-11, 0.993), "gemm/cpu/int4": (5.6e-7, 8.4e-12, 0.992),
          "copy/h2d_pinned": (3.7e-6, 4.1e-11, 0.999), "launch": (5.2e-5, 6.0e-6)},
}
# Testbed hardware (ScheInfer §V-A) and vendor spec figures used for capacities and bandwidths:
# (GPU, CPU, PCIe, GPU memory [bytes], GPU memory bandwidth [B/s], CPU memory bandwidth [B/s]).
_SCHEINFER_TESTBEDS = {
    "a": ("NVIDIA RTX A6000", "Intel Xeon Platinum 8358", "PCIe 4.0 x16", 48 * GiB, 768e9, 8 * 25.6e9),
    "b": ("NVIDIA RTX 3090", "AMD EPYC 7742", "PCIe 4.0 x16", 24 * GiB, 936e9, 8 * 25.6e9),
    "c": ("NVIDIA RTX 2080 Ti", "Intel Xeon Gold 6230", "PCIe 3.0 x16", 11 * GiB, 616e9, 6 * 23.47e9),
}
_SPEC_CPU_BW = "vendor spec: memory channels x DDR4 rate (8 x DDR4-3200 = 204.8 GB/s; 6 x DDR4-2933 = 140.8 GB/s)"


def _lm(alpha: float, beta: float, r2: float | None = None) -> LinearModel:
    return LinearModel(float(alpha), float(beta), r2)


def _scheinfer(testbed: str) -> HardwareProfile:
    table, (gpu, cpu, pcie, gmem, gbw, cbw) = _SCHEINFER_TABLE_I[testbed], _SCHEINFER_TESTBEDS[testbed]
    models = {k: _lm(*v) for k, v in table.items() if k != "launch"}
    launch_alpha, launch_sigma = table["launch"]
    models["launch/gpu"] = _lm(launch_alpha, 0.0)
    models["memory/bandwidth/gpu"] = _lm(0.0, 1.0 / gbw)
    models["memory/bandwidth/cpu"] = _lm(0.0, 1.0 / cbw)
    sources = {k: SCHEINFER + f", testbed {testbed.upper()} (fitted, as reported)" for k in models}
    sources["launch/gpu"] += f"; sigma = {launch_sigma:g} s replaces r^2"
    sources["memory/bandwidth/gpu"] = f"{gpu} spec sheet: {gbw / 1e9:.0f} GB/s peak (derived: beta = 1/bandwidth)"
    sources["memory/bandwidth/cpu"] = _SPEC_CPU_BW + " (peak, derived)"
    return HardwareProfile(
        name=f"scheinfer-{testbed}",
        source=f"preset from {SCHEINFER}, testbed {testbed.upper()}: {gpu}, {cpu}, {pcie}; "
               "fp16/int4 GEMM, PCIe H2D and launch fits as reported; memory bandwidths from spec sheets; "
               "CPU RAM size not reported",
        models=models, gpu_memory=gmem, cpu_memory=None,
        meta={"gpu": gpu, "cpu": cpu, "pcie": pcie, "launch_sigma": launch_sigma, "key_sources": sources,
              "notes": [SCHEINFER_PCIE_NOTE,
                        "gpu_memory is the card's full capacity; ScheInfer capped it at 12-32 GB in experiments",
                        "ScheInfer fits one line per precision over decode and prefill sizes (no gemv key)"]})


def _t4_pcie3() -> HardwareProfile:
    """FlexGen's main testbed: GCP T4 (16 GB), Intel Xeon @ 2.00 GHz with 208 GB, 1.5 TB NVMe."""
    tflop = 1e12
    t4_bw = 320e9  # T4 spec sheet: 320 GB/s GDDR6
    cpu_peak = 16 * 2.0e9 * 64  # 16 cores x 2.0 GHz x 64 fp32 FLOP/cycle (2 AVX-512 FMA units)
    models = {
        "gemm/gpu/fp16": _lm(0.0, 2.0 / (21.24 * tflop)),  # mm_flops_p: prefill GEMM
        "gemm/gpu/int4": _lm(0.0, 2.0 / (21.24 * tflop)),  # dequantize to fp16, then fp16 GEMM
        "gemv/gpu/fp16": _lm(0.0, 1.0 / t4_bw),
        "gemv/gpu/int4": _lm(0.0, 1.0 / t4_bw),
        "attn/gpu/fp16": _lm(0.0, 2.0 / (0.079 * tflop)),  # bmm_flops_g: decode attention
        "attn/cpu/fp32": _lm(0.0, 2.0 / (0.0123 * tflop)),  # cpu_flops: CPU-delegated attention
        "gemm/cpu/fp32": _lm(0.0, 2.0 / cpu_peak),
        "memory/bandwidth/gpu": _lm(0.0, 1.0 / t4_bw),
        "memory/bandwidth/cpu": _lm(0.0, 1.0 / (6 * 21.33e9)),
        "copy/h2d_pinned": _lm(0.0, 1.0 / (12.89 * GiB)),  # ctog_bdw
        "copy/d2h_pinned": _lm(0.0, 1.0 / (4.82 * GiB)),  # gtoc_bdw_hidden
        "disk/read_cold": _lm(0.0, 1.0 / 1.6e9),
        "disk/write": _lm(0.0, 1.0 / 1.3e9),
        "launch/gpu": _lm(_SCHEINFER_TABLE_I["c"]["launch"][0], 0.0),
    }
    sources = {
        "gemm/gpu/fp16": FLEXGEN_CM + ": mm_flops_p = 21.24 TFLOPS (prefill)",
        "gemm/gpu/int4": "derived: FlexGen dequantizes 4-bit groups to fp16 before compute (§5), so fp16 GEMM",
        "gemv/gpu/fp16": "NVIDIA T4 spec sheet: 320 GB/s (derived: beta = 1/bandwidth)",
        "gemv/gpu/int4": "NVIDIA T4 spec sheet: 320 GB/s (fewer bytes per weight, same bandwidth)",
        "attn/gpu/fp16": FLEXGEN_CM + ": bmm_flops_g = 0.079 TFLOPS (decode attention, memory-bound)",
        "attn/cpu/fp32": FLEXGEN_CM + ": cpu_flops = 0.0123 TFLOPS (CPU-delegated attention)",
        "gemm/cpu/fp32": "derived peak, assuming 208 GB = GCP n1-highmem-32 (16 cores): "
                         "16 x 2.0 GHz x 64 FLOP/cycle = 2.05 TFLOPS; an upper bound",
        "memory/bandwidth/gpu": "NVIDIA T4 spec sheet: 320 GB/s",
        "memory/bandwidth/cpu": "derived peak, assuming a Skylake-SP socket (GCP's 2.0 GHz Xeon): "
                                "6 channels x DDR4-2666 = 128 GB/s; an upper bound",
        "copy/h2d_pinned": FLEXGEN_CM + ": ctog_bdw = 12.89 GiB/s",
        "copy/d2h_pinned": FLEXGEN_CM + ": gtoc_bdw_hidden = 4.82 GiB/s (gtoc_bdw_cache = 0.97 GiB/s)",
        "disk/read_cold": FLEXGEN_T24 + ": 1.6 GB/s read (the text says about 2 GB/s; cost_model.py fits 0.473 GiB/s)",
        "disk/write": FLEXGEN_T24 + ": 1.3 GB/s write (the text says about 1 GB/s)",
        "launch/gpu": SCHEINFER + ", testbed C (RTX 2080 Ti: Turing, PCIe 3, like the T4); FlexGen reports none",
    }
    return HardwareProfile(
        name="t4-pcie3",
        source=f"preset from {FLEXGEN_T1} (16 GB T4, 208 GB DRAM, 1.5 TB NVMe), {FLEXGEN_T24}, and "
               f"{FLEXGEN_CM}; T4 bandwidth from NVIDIA's spec sheet; see meta.key_sources",
        models=models, gpu_memory=16 * GiB, cpu_memory=208 * GiB,
        meta={"gpu": "NVIDIA T4", "cpu": "Intel Xeon @ 2.00GHz", "pcie": "PCIe 3.0 x16",
              "disk_memory": int(1.5e12), "key_sources": sources,
              "notes": ["FlexGen fits separate prefill/decode GPU FLOPS (21.24 / 4.3 TFLOPS); tiered prices decode "
                        "GEMMs by the gemv (bandwidth) roofline instead of the 4.3 TFLOPS fit",
                        "FlexGen's cost_model.py relaxes every capacity by 0.8 (alpha_g/c/n); presets keep the "
                        "full capacities, pass smaller budgets to the planner for a margin"]})


def _rtx4090_pcie4() -> HardwareProfile:
    """HOBBIT's RTX 4090 testbed: 24 GB GPU, 64 CPU cores, 256 GB RAM, PCIe 4.0, Samsung 980 PRO."""
    flops = 82.6e12
    gbw = 1008e9  # 384-bit GDDR6X at 21 Gb/s
    mixtral_expert_macs = 3 * 4096 * 14336
    models = {
        "gemm/gpu/fp16": _lm(0.0, 2.0 / flops),
        "gemm/gpu/bf16": _lm(0.0, 2.0 / flops),
        "gemm/gpu/fp32": _lm(0.0, 2.0 / flops),
        "gemm/gpu/int4": _lm(0.0, 2.0 / flops),
        "gemv/gpu/fp16": _lm(0.0, 1.0 / gbw),
        "gemv/gpu/int4": _lm(0.0, 1.0 / gbw),
        "memory/bandwidth/gpu": _lm(0.0, 1.0 / gbw),
        "gemm/cpu/fp16": _lm(0.0, 3e-3 / mixtral_expert_macs),
        "copy/h2d_pinned": _lm(_SCHEINFER_TABLE_I["b"]["copy/h2d_pinned"][0], 1.0 / 25e9),
        "copy/d2h_pinned": _lm(_SCHEINFER_TABLE_I["b"]["copy/h2d_pinned"][0], 1.0 / 25e9),
        "disk/read_cold": _lm(0.0, 1.0 / 3.0e9),
        "disk/write": _lm(0.0, 1.0 / 5.0e9),
        "launch/gpu": _lm(_SCHEINFER_TABLE_I["b"]["launch"][0], 0.0),
    }
    sources = {
        "gemm/gpu/fp16": NV_ADA + ": 82.6 TFLOPS (the shader fp16/fp32 peak; the dense tensor-core fp16 peak "
                                  "with fp32 accumulate is 165.2): taken as the achievable dense GEMM rate",
        "gemm/gpu/bf16": "as gemm/gpu/fp16", "gemm/gpu/fp32": NV_ADA + ": 82.6 TFLOPS fp32 (non-tensor) peak",
        "gemm/gpu/int4": "derived: weight-only int4 dequantizes to fp16, so the fp16 rate",
        "gemv/gpu/fp16": NV_ADA + ": 1008 GB/s GDDR6X (derived: beta = 1/bandwidth)",
        "gemv/gpu/int4": NV_ADA + ": 1008 GB/s (fewer bytes per weight, same bandwidth)",
        "memory/bandwidth/gpu": NV_ADA + ": 1008 GB/s",
        "gemm/cpu/fp16": "derived from HOBBIT §5.3: Fiddler runs one fp16 Mixtral-8x7B expert (3 x 4096 x 14336 "
                         "MACs) on the testbed's CPU in about 3 ms; a one-point line through the origin",
        "copy/h2d_pinned": "PCIe 4.0 x16: 32 GB/s theoretical (HOBBIT), ~25 GB/s effective; alpha from "
                           + SCHEINFER + ", testbed B (RTX 3090 on PCIe 4.0 x16)",
        "copy/d2h_pinned": "as copy/h2d_pinned",
        "disk/read_cold": HOBBIT + ": Samsung 980 PRO, 7,000 MB/s theoretical, around 3,000 MB/s in practice",
        "disk/write": "Samsung 980 PRO spec sheet (1 TB): 5,000 MB/s sequential write (peak)",
        "launch/gpu": SCHEINFER + ", testbed B (RTX 3090; HOBBIT reports none)",
    }
    return HardwareProfile(
        name="rtx4090-pcie4",
        source=f"preset from {HOBBIT} (24 GB RTX 4090, 256 GB RAM, 64 cores, PCIe 4.0, 980 PRO NVMe) and "
               f"{NV_ADA}; see meta.key_sources",
        models=models, gpu_memory=24 * GiB, cpu_memory=256 * GiB,
        meta={"gpu": "NVIDIA GeForce RTX 4090", "cpu": "64 cores (model not reported)", "pcie": "PCIe 4.0 x16",
              "disk": "Samsung 980 PRO", "key_sources": sources,
              "notes": ["CPU GEMM is a single decode-time point: prefill-size CPU GEMMs are not covered"]})


_BUILDERS = {
    "scheinfer-a": lambda: _scheinfer("a"),
    "scheinfer-b": lambda: _scheinfer("b"),
    "scheinfer-c": lambda: _scheinfer("c"),
    "t4-pcie3": _t4_pcie3,
    "rtx4090-pcie4": _rtx4090_pcie4,
}

PRESETS: dict[str, str] = {
    "scheinfer-a": "RTX A6000 48 GB + Xeon Platinum 8358, PCIe 4.0 x16 (ScheInfer Table I)",
    "scheinfer-b": "RTX 3090 24 GB + AMD EPYC 7742, PCIe 4.0 x16 (ScheInfer Table I)",
    "scheinfer-c": "RTX 2080 Ti 11 GB + Xeon Gold 6230, PCIe 3.0 x16 (ScheInfer Table I)",
    "t4-pcie3": "T4 16 GB + Xeon 2.0 GHz 208 GB + 1.5 TB NVMe, PCIe 3.0 (FlexGen's testbed)",
    "rtx4090-pcie4": "RTX 4090 24 GB + 64 cores 256 GB + 980 PRO NVMe, PCIe 4.0 (HOBBIT's testbed, spec sheets)",
}


def get_preset(name: str) -> HardwareProfile:
    """The preset `name` (see PRESETS). Raises ConfigError naming the known presets."""
    try:
        return _BUILDERS[name]()
    except KeyError:
        raise ConfigError(f"unknown hardware preset {name!r}", "pick one of " + ", ".join(PRESETS)) from None
