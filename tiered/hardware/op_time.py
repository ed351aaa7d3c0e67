"""Time of one operation from a HardwareProfile: key lookup with dtype fallbacks and a roofline.

A GEMM is priced as the slower of its two fitted regimes (ALGORITHMS.md 1.f S2, resolved with a
roofline of affine models):

    t = max( gemm/<dev>/<dtype>(MACs),  gemv/<dev>/<dtype>(weight bytes) )

`gemm` is the compute-bound fit (many tokens), `gemv` the memory-bound fit (few tokens: time tracks
the weight bytes streamed, not the MACs). When a profile has no `gemv` key, the memory part falls
back to memory/bandwidth/<dev>; when it has neither (e.g. ScheInfer's Table I, one line per
precision), the GEMM fit alone is used. Decode attention is priced the same way with `attn`
(MACs) against the KV-cache bytes it reads.
"""

from __future__ import annotations

from tiered.errors import ConfigError
from tiered.hardware.profile import HardwareProfile, LinearModel
from tiered.memory.sizes import bytes_per_element  # noqa: F401  (re-exported: op_time.bytes_per_element)

# Which fitted dtype stands in for a missing one (same width first, then wider).
DTYPE_FALLBACK = {
    "fp32": ("fp32",),
    "bf16": ("bf16", "fp16", "fp32"),
    "fp16": ("fp16", "bf16", "fp32"),
    "int8": ("int8",),
    "int4": ("int4",),
}


def find(profile: HardwareProfile, op: str, device: str, dtype: str) -> LinearModel | None:
    """The model `<op>/<device>/<dtype>` or its nearest fallback dtype; None when none is fitted."""
    for d in DTYPE_FALLBACK.get(dtype, (dtype,)):
        key = f"{op}/{device}/{d}"
        if profile.has(key):
            return profile.models[key]
    return None


def has_device(profile: HardwareProfile, device: str) -> bool:
    """The profile prices some GEMM on `device` ("cpu" or "gpu")."""
    return any(k.startswith(f"gemm/{device}/") for k in profile.models)


def memory_time(profile: HardwareProfile, device: str, dtype: str, nbytes: float, op: str = "gemv") -> float:
    """Seconds to stream `nbytes` of operands through `device`; 0 when the profile cannot say."""
    m = find(profile, op, device, dtype) or profile.models.get(f"memory/bandwidth/{device}")
    return m(nbytes) if m is not None else 0.0


def gemm_time(profile: HardwareProfile, device: str, dtype: str, macs: float, weight_bytes: float = 0.0,
              calls: int = 1) -> float:
    """Seconds for `calls` GEMMs totalling `macs` multiply-accumulates over `weight_bytes` of weights.

    Raises:
        ConfigError: the profile prices no GEMM on `device` in `dtype` (or a fallback dtype).
    """
    m = find(profile, "gemm", device, dtype)
    if m is None:
        raise ConfigError(f"hardware profile {profile.name!r} has no gemm/{device}/{dtype} model",
                          "re-run `tiered profile` on this machine or pick a preset that covers it")
    if macs <= 0:
        return 0.0
    compute = calls * m.alpha + m.beta * macs
    mem = memory_time(profile, device, dtype, weight_bytes / calls, "gemv") * calls if weight_bytes > 0 else 0.0
    return max(compute, mem)


def attention_time(profile: HardwareProfile, device: str, dtype: str, macs: float, kv_bytes: float,
                   calls: int = 1) -> float:
    """Seconds of decode attention: `macs` (q.K^T and p.V) over `kv_bytes` of cache, in `calls` calls.

    Uses attn/<dev>/<dtype> when fitted, else the GEMM fit; the KV bytes read are the memory floor.
    """
    if macs <= 0:
        return 0.0
    m = find(profile, "attn", device, dtype)
    compute = (calls * m.alpha + m.beta * macs) if m is not None else gemm_time(profile, device, dtype, macs, 0.0, calls)
    bw = profile.models.get(f"memory/bandwidth/{device}")
    return max(compute, bw(kv_bytes / calls) * calls if bw is not None and kv_bytes > 0 else 0.0)


def launch_time(profile: HardwareProfile, device: str) -> float:
    """Per-kernel launch cost on `device` [s]; 0 when not profiled."""
    m = profile.models.get(f"launch/{device}")
    return m.alpha if m is not None else 0.0
