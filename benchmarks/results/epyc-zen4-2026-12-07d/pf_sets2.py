import statistics
from tiered import kernels
from tiered.kernels import tune
ext = kernels.load(); base = ext.tuning()
total = 256 << 20
ext.set_tuning(stream_prefetch=True, stream_prefetch_bytes=True)
sets = {"bf16 exp": tune._ab_sweeps([tune._experts("bf16", total)]), "int8-g32 dense": tune._dense_calls(tune.BYTE_SHAPES, total, "int8-g32"),
        "int4 exp": tune._ab_sweeps([tune._experts("int4", total)])}
for name, run in sets.items():
    r = tune._switch_ab(ext, "stream_prefetch_bytes", run, 7)
    print(f"{name}: bytes-off/on median {statistics.median(r):.3f}  {[round(x,2) for x in r]}", flush=True)
ext.set_tuning(**base)
