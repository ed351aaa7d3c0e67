"""`python -m tiered.kernels [--tune] [--require] [-v]`: build the native CPU kernels now, then measure
this machine's kernel tuning once (tune.py; `--tune` measures it again). scripts/setup.sh runs it."""

import statistics
import sys
import time

from tiered import kernels

t0 = time.perf_counter()
mod = kernels.load(verbose="-v" in sys.argv)
if mod is None:
    reason = kernels.failure() or "TIERED_NATIVE=0"
    print(f"tiered: native kernels not built ({reason}); the torch-op paths will be used", file=sys.stderr)
    sys.exit(1 if "--require" in sys.argv else 0)
print(f"tiered: native kernels ready in {time.perf_counter() - t0:.1f} s ({kernels.build_dir()})", file=sys.stderr)

from tiered.kernels import tune  # noqa: E402

if tune.enabled() and ("--tune" in sys.argv or not tune.path(kernels.build_dir()).exists()):
    t0 = time.perf_counter()
    result = tune.measure(mod)
    tune.save(result, kernels.build_dir())
    med = {k: statistics.median(v) for k, v in result["ratios"].items()}
    print(f"tiered: kernel tuning measured in {time.perf_counter() - t0:.1f} s: stream prefetch "
          f"{'on' if result['stream_prefetch'] else 'off'}, tiled int4 batch-1 activations "
          f"{'int16' if result['int4_int16_act'] else 'bf16'} on AVX-512 (median time ratios of the "
          f"alternatives: {', '.join(f'{k} {v:.2f}' for k, v in med.items())})", file=sys.stderr)
