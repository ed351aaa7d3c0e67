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

if tune.enabled() and ("--tune" in sys.argv or not tune.measured(kernels.build_dir())):
    t0 = time.perf_counter()
    while True:  # a tuning other processes disturbed is measured again, RETUNES times at most
        tune.save(tune.measure(mod, previous=tune.saved(kernels.build_dir())), kernels.build_dir())
        if tune.measured(kernels.build_dir()):
            break
        print(f"tiered: other processes took {tune.saved(kernels.build_dir())['others_share']:.0%} of the cores "
              "while tuning: measuring again", file=sys.stderr, flush=True)
        time.sleep(2.0)
    took = f" measured in {time.perf_counter() - t0:.1f} s"
else:
    took = ""  # load() measured it right after building, or an earlier run did
result = tune.apply(mod, kernels.build_dir()) if tune.enabled() else None
if result is not None:
    med = {k: statistics.median(v) for k, v in result.get("ratios", {}).items()}
    # the int4 activation choice exists only on AVX-512 with VBMI (tune.measure: elsewhere the path is fixed)
    int4 = (f"tiled int4 batch-1 activations {'int16' if result['int4_int16_act'] else 'bf16'} on AVX-512, "
            if "int4_int16_act" in result.get("ratios", {}) else "")
    # the attention's vector width: a choice on AVX-512 only (16 or 8 floats)
    attend = (f"attention {'16' if result['attend_wide'] else '8'}-wide, "
              if "attend_wide" in result.get("ratios", {}) else "")
    print(f"tiered: kernel tuning{took}: stream prefetch {tune.prefetch_name(result)}, {int4}{attend}bf16 experts on "
          f"the native kernel up to {result.get('bf16_native_rows', tune.DEFAULTS['bf16_native_rows'])} rows, "
          f"{tune.dequantize_name(result)} (median time "
          f"ratios of the alternatives: {', '.join(f'{k} {v:.2f}' for k, v in med.items())})", file=sys.stderr)
