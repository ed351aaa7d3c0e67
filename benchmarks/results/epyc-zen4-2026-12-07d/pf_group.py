import statistics
from tiered import kernels
from tiered.kernels import tune
ext = kernels.load(); base = ext.tuning()
total = 512 << 20
group = tune._experts("int4", total, "q8", tune.GROUP_WIDTH, exact_zeros=True, slab=True, at_least=2 * tune.GROUP_TOP_K)
ext.set_tuning(stream_prefetch=True)
for rep in range(2):
    r = tune._ab(ext, [group], "stream_prefetch", 11, tune._group_sweep)
    print(f"Qwen3-width Q4_0 experts, 8 a call: off/on median {statistics.median(r):.3f} {[round(x, 2) for x in r]}", flush=True)
ext.set_tuning(**base)
