"""tiered's own CPU kernels: a C++ extension built once per machine from `csrc/*.cpp`.

The build uses torch's C++ extension machinery (`torch.utils.cpp_extension.load`, ninja, the
system's g++), so it needs no build step at install time: `scripts/setup.sh` runs
`python -m tiered.kernels` once, and a later `load()` imports the cached library in ~0.1 s. The
library is compiled for the portable x86-64 baseline plus the flags below; code that wants AVX-512
or AVX2 picks it at run time from the CPU's flags (gcc's target attributes), so one build serves
the machine it was made on and any other.

OpenMP: the sources are compiled with -fopenmp so that `at::parallel_for` runs on torch's own
OpenMP team. torch ships `libgomp.so.1` and loads it first; the loader gives the extension that
same library (same soname), so there is one OpenMP runtime and one thread team in the process.

Tuning: two choices of the batch-1 weight stream (software prefetch; int16 or bf16 activations for
tiled int4 on AVX-512) are measured once per machine after the build (`tune.py`, ~1 s) and saved
beside the library; `load()` applies them (TIERED_KERNEL_TUNING=0 keeps the defaults).

Set TIERED_NATIVE=0 to run without the extension (the torch-op paths), e.g. to compare them.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import sys
from pathlib import Path

log = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
# -fno-trapping-math: lets GCC if-convert the clamps of decode.cpp's exp_fast, so that its loops
# (SiLU, softmax) vectorize in the AVX2 clone too (only AVX-512's masks did without it).
CFLAGS = ["-O3", "-fopenmp", "-fno-math-errno", "-fno-trapping-math", "-std=c++17"]
_loaded: object = None
_failed: str | None = None
_applied: dict = {}  # the tuning.json load() applied (tune.apply), for the Python-side choices


def cache_dir() -> Path:
    """Where built libraries live: $TIERED_KERNELS_DIR, else ~/.cache/tiered/kernels."""
    root = os.environ.get("TIERED_KERNELS_DIR")
    return Path(root) if root else Path.home() / ".cache" / "tiered" / "kernels"


def build_name() -> str:
    """The library's name: a hash of the sources, the flags, torch and Python, so that any change
    to them builds afresh instead of importing a stale library."""
    import torch

    h = hashlib.sha256()
    for p in sorted(CSRC.glob("*.cpp")) + sorted(CSRC.glob("*.h")):
        h.update(p.name.encode())
        h.update(p.read_bytes())
    h.update(" ".join(CFLAGS).encode())
    h.update(torch.__version__.encode())
    h.update(sys.version.encode())
    return f"tiered_kernels_{h.hexdigest()[:16]}"


def enabled() -> bool:
    """False when TIERED_NATIVE=0 turns the extension off."""
    return os.environ.get("TIERED_NATIVE", "1") not in ("0", "false", "no", "off")


def _import_built(name: str, directory: Path):
    so = directory / f"{name}.so"
    if not so.exists():
        return None
    spec = importlib.util.spec_from_file_location(name, so)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _env_on(name: str) -> bool:
    """False where the environment sets `name` to 0 (or false / no / off)."""
    return os.environ.get(name, "1") not in ("0", "false", "no", "off")


def amx_allowed() -> bool:
    """False where TIERED_AMX=0 (or false / no / off) turns tiered's AMX GEMM off: quant/int4.amx_kernels' prompt
    calls and the native step's rows (the extension's amx_rows, set at load)."""
    return _env_on("TIERED_AMX")


def load(build: bool = True, verbose: bool = False):
    """The extension module, building it first when `build` and no cached build exists (and then
    measuring this machine's kernel tuning for the new build, tune.py, unless TIERED_KERNEL_TUNING=0).

    Returns None (and logs why, once) when TIERED_NATIVE=0, or when the build fails (no C++
    compiler, no ninja): callers then use their torch-op paths. Building takes ~1 min on 2 cores.
    """
    global _loaded, _failed
    if not enabled():
        return None
    if _loaded is not None:
        return _loaded
    if _failed is not None:
        return None
    import torch  # noqa: F401  (loads libtorch and its libgomp before the extension)

    name = build_name()
    directory = cache_dir() / name
    built = False
    try:
        _loaded = _import_built(name, directory)
        if _loaded is None and build:
            from torch.utils.cpp_extension import load as cpp_load

            directory.mkdir(parents=True, exist_ok=True)
            print("tiered: building the native CPU kernels (once per machine, ~1 min) ...", file=sys.stderr, flush=True)
            sources = [str(p) for p in sorted(CSRC.glob("*.cpp"))]
            _loaded = cpp_load(name, sources, extra_cflags=CFLAGS, extra_ldflags=["-fopenmp"],
                               build_directory=str(directory), verbose=verbose)
            built = True
        if _loaded is not None:
            from tiered.kernels import tune

            if built and tune.enabled() and not tune.complete(directory):
                # a fresh build (new sources: an upgrade, an edit) is tuned now, as setup's
                # `python -m tiered.kernels` tunes its build: else it would run the defaults
                print("tiered: measuring this machine's kernel tuning (once per build, a few seconds) ...",
                      file=sys.stderr, flush=True)
                tune.save(tune.measure(_loaded), directory)
            _applied.clear()
            _applied.update(tune.apply(_loaded, directory) or {})  # this machine's measured tuning (tune.py)
            _loaded.amx_rows(amx_allowed())  # the native step's AMX rows, off with TIERED_AMX=0
            _loaded.bf16_attention_avx512(_env_on("TIERED_BF16_ATTENTION"))  # off with TIERED_BF16_ATTENTION=0
    except Exception as e:  # noqa: BLE001  (a failed build falls back; say why once)
        lines = str(e).strip().splitlines() or [""]
        _failed = f"{type(e).__name__}: " + next((ln for ln in lines if "error:" in ln), lines[-1]).strip()
        log.warning("tiered: native CPU kernels unavailable (%s); using the torch-op paths", _failed)
        return None
    return _loaded


def available() -> bool:
    """Whether the extension loads here (building it first if needed): what the planner
    (Plan.native_decode) and the profiler (meta["native_kernels"]) decide on."""
    return load() is not None


def isa() -> str | None:
    """The ISA path the native GEMV kernels take on this CPU ("avx512", "avx2" or "scalar"; None
    without the extension): what the planner's per-ISA choices (Plan.mixed_rows) key on."""
    ext = load()
    return None if ext is None else ext.gemv_isa()


def tuning() -> dict | None:
    """The kernel tuning this process runs with ({"stream_prefetch", "stream_prefetch_rows", "stream_prefetch_bytes",
    "prefetch_l2", "int4_int16_act", "bf16_native_rows", "q8_dequantize_rows", "q8_expert_grouped_rows", "mxfp4_kernel_rows"}: tune.py's
    measurement, applied by `load()`), or None without the extension: what a hardware profile's native keys
    were timed under."""
    ext = load()
    return None if ext is None else dict(ext.tuning(), bf16_native_rows=bf16_native_rows(),
                                         q8_dequantize_rows=q8_dequantize_rows(),
                                         q8_expert_grouped_rows=q8_expert_grouped_rows(),
                                         mxfp4_kernel_rows=mxfp4_kernel_rows())


def q8_dequantize_rows() -> int | None:
    """Rows beyond which a one-copy int4 weight's call on int8 activations dequantizes it for one GEMM
    (quant/int4.dequantize_rows), as this machine's tuning measured (tune.choose_dequantize_rows; 0: never);
    None without the extension or that measurement (quant/int4's tables by ISA then)."""
    return _tuned_rows("q8_dequantize_rows")


def q8_expert_grouped_rows() -> int | None:
    """Rows up to which a tiled int4 CPU expert on int8 activations runs its native kernel in groups rather than
    dequantized for one GEMM (quant/experts.kind_grouped_rows), as this machine's tuning measured
    (tune.choose_dequantize_rows; 0: at any rows); None without the extension or that measurement."""
    return _tuned_rows("q8_expert_grouped_rows")


def mxfp4_kernel_rows() -> int | None:
    """Rows up to which an mxfp4 projection runs its native kernel in one call rather than dequantized for one
    GEMM (quant/experts.mxfp4_kernel_rows), as this machine's tuning measured (tune.choose_dequantize_rows; 0: at
    any rows); None without the extension or that measurement."""
    return _tuned_rows("mxfp4_kernel_rows")


def tuned_choice(key: str, isa_name: str | None = None, tuning: dict | None = None) -> tuple[str | None, int | None]:
    """(ISA, the kernel tuning's `key`: rows, 0 for never / any, None where not measured) of the machine a
    per-ISA choice is made for (quant/int4.dequantize_rows, quant/experts.kind_grouped_rows and
    mxfp4_kernel_rows): `isa_name` and `tuning` as given, a profiled machine's (the planner passes its meta's
    kernel_isa and kernel_tuning); with `isa_name` None this machine's ISA (`isa`), and its measured `key`
    (the accessor of that name: q8_dequantize_rows, ...) unless `tuning` is given."""
    if isa_name is None:
        isa_name = isa()
        if tuning is None:
            tuning = {key: globals()[key]()}  # looked up when called (tests patch the accessors)
    return isa_name, (tuning or {}).get(key)


def _tuned_rows(key: str) -> int | None:
    if load() is None:
        return None
    rows = _applied.get(key)
    return None if rows is None else int(rows)


def bf16_native_rows() -> int:
    """Rows up to which a bf16 expert runs the native kernel (in groups of 8 beyond 8) rather than
    torch's GEMMs: this machine's tuning (tune.choose_rows), else the built-in 32."""
    from tiered.kernels import tune

    if load() is None:
        return tune.DEFAULTS["bf16_native_rows"]
    return int(_applied.get("bf16_native_rows", tune.DEFAULTS["bf16_native_rows"]))


def build_dir() -> Path:
    """This build's directory (its library and its tuning.json)."""
    return cache_dir() / build_name()


def failure() -> str | None:
    """Why the last `load()` returned None (None when it did not fail)."""
    return _failed
