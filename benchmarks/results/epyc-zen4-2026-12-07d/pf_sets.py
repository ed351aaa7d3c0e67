"""stream_prefetch (the sub-byte formats' batch-1 switch) flipped on each set of tune.py's kinds alone, 11 alternated rounds."""
import statistics
from tiered import kernels
from tiered.kernels import tune
ext = kernels.load(); base = ext.tuning()
total = 256 << 20
ext.set_tuning(stream_prefetch=True)
sets = {"int4 exp": tune._ab_sweeps([tune._experts("int4", total)]),
        "int4q8 exp": tune._ab_sweeps([tune._experts("int4", total, "q8")]), "int4 dense 4096x4096": tune._dense_calls(((4096, 4096),), total),
        "int4 dense 14336x4096": tune._dense_calls(((14336, 4096),), total),
        "int4 dense SmolLM2 widths": tune._dense_calls(((1536, 576), (576, 1536), (576, 576)), total)}
for name, run in sets.items():
    r = tune._switch_ab(ext, "stream_prefetch", run, 11)
    print(f"{name}: off/on median {statistics.median(r):.3f}  {[round(x,2) for x in r]}", flush=True)
ext.set_tuning(**base)
