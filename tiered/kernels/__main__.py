"""`python -m tiered.kernels`: build the native CPU kernels now (scripts/setup.sh runs it)."""

import sys
import time

from tiered import kernels

t0 = time.perf_counter()
mod = kernels.load(verbose="-v" in sys.argv)
if mod is None:
    reason = kernels.failure() or "TIERED_NATIVE=0"
    print(f"tiered: native kernels not built ({reason}); the torch-op paths will be used", file=sys.stderr)
    sys.exit(1 if "--require" in sys.argv else 0)
print(f"tiered: native kernels ready in {time.perf_counter() - t0:.1f} s ({kernels.cache_dir() / kernels.build_name()})",
      file=sys.stderr)
