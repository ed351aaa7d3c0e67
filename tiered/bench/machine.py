"""The machine a benchmark ran on: CPU, memory, GPU, library versions and the code's git commit.

Every report carries this next to its numbers, so a result can be read (and doubted) without
knowing where it came from: a 2-core VM and a 16-core AMX host differ by 10x in CPU expert time.
"""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path

# CPU features that decide which kernels run fast: AVX2/FMA (all x86 BLAS), AVX-512 variants,
# VNNI / BF16 dot products and AMX tiles (bf16 and int8 GEMM on Sapphire Rapids and later).
_FLAG_PREFIXES = ("avx2", "fma", "avx512", "avx_vnni", "amx")
_PACKAGES = ("torch", "transformers", "accelerate", "safetensors", "numpy", "llama_cpp_python")


def cpu_model() -> str:
    """The CPU's model name (from /proc/cpuinfo, else platform)."""
    for line in _read("/proc/cpuinfo").splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def cpu_flags() -> list[str]:
    """The CPU's SIMD / matrix flags that matter for inference kernels (avx2, fma, avx512*, amx*)."""
    for line in _read("/proc/cpuinfo").splitlines():
        if line.startswith("flags"):
            return sorted(f for f in line.split(":", 1)[1].split() if f.startswith(_FLAG_PREFIXES))
    return []


def ram_bytes() -> int | None:
    """Total physical memory [bytes]."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def gpus() -> list[dict]:
    """Each CUDA device: name, memory [bytes], compute capability; [] without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return []
    out = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        out.append({"name": p.name, "memory_bytes": p.total_memory, "capability": f"{p.major}.{p.minor}"})
    return out


def versions() -> dict:
    """Versions of python and the libraries a benchmark depends on (None = not installed)."""
    import importlib.metadata as md

    out = {"python": platform.python_version()}
    for name in _PACKAGES:
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = None
    import torch

    out["torch"] = torch.__version__  # the imported build (e.g. 2.13.0+cpu), not only the dist version
    out["cuda"] = torch.version.cuda
    return out


def git_commit(repo: str | os.PathLike | None = None) -> dict:
    """The commit of the tiered checkout and whether its tiered/ or benchmarks/ has local changes."""
    repo = Path(repo) if repo else Path(__file__).resolve().parents[2]

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, timeout=30).stdout.strip()

    try:
        return {"commit": git("rev-parse", "HEAD") or None,
                "dirty": bool(git("status", "--porcelain", "--", "tiered", "benchmarks"))}
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}


def native_kernels() -> dict | None:
    """tiered's native kernels as this process runs them: {"isa", "tuning"} (the per-machine tuning
    that tiered/kernels/tune.py measured: stream_prefetch, prefetch_l2, int4_int16_act), or None without them."""
    from tiered import kernels

    if kernels.load(build=False) is None:
        return None
    return {"isa": kernels.isa(), "tuning": kernels.tuning()}


def machine_info() -> dict:
    """Everything above in one JSON-able dict: cpu, cores (logical, physical), cpu_flags,
    ram_bytes, gpus, platform, versions, git, native_kernels."""
    try:
        import psutil
        physical = psutil.cpu_count(logical=False)
    except ImportError:
        physical = None
    return {"cpu": cpu_model(), "cores": os.cpu_count(), "physical_cores": physical, "cpu_flags": cpu_flags(),
            "ram_bytes": ram_bytes(), "gpus": gpus(), "platform": platform.platform(), "versions": versions(),
            "git": git_commit(), "native_kernels": native_kernels()}


def describe(info: dict) -> str:
    """One Markdown line for a report's header, e.g. "Intel Xeon, 16 cores (avx512f, amx_bf16),
    128 GiB RAM; NVIDIA H200 141 GiB; torch 2.11, transformers 5.17; tiered 68fec1a"."""
    flags = [f for f in info["cpu_flags"] if f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16")]
    ram = f"{info['ram_bytes'] / 2**30:.0f} GiB RAM" if info.get("ram_bytes") else "RAM unknown"
    gpu = "; ".join(f"{g['name']} {g['memory_bytes'] / 2**30:.0f} GiB" for g in info["gpus"]) or "no GPU"
    v = info["versions"]
    git = info["git"]
    commit = (git["commit"] or "?")[:7] + (" + local changes" if git.get("dirty") else "")
    nk = info.get("native_kernels")
    kern = ""
    if nk:
        from tiered.kernels import tune

        t = nk["tuning"]
        kern = (f"; native kernels {nk['isa']} (stream prefetch {tune.prefetch_name(t)}"
                + (", int4 batch-1 on int16 x" if t["int4_int16_act"] else "") + ")")
    return (f"{info['cpu']}, {info['cores']} cores ({', '.join(flags) or 'no avx2'}), {ram}; {gpu}; "
            f"torch {v['torch']}, transformers {v['transformers']}; tiered {commit}{kern}")


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""
