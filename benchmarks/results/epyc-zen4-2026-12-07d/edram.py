from tiered import kernels
from tiered.hardware import profiler as P
ext = kernels.load(); base = ext.tuning(); llc = P.last_level_cache_bytes()
for r in range(2):
    for flag in (False, True):
        ext.set_tuning(stream_prefetch_bytes=flag)
        pts = P._expert_dram_points(3, 3 * llc)
        print("bytes prefetch", flag, [round(n / t / 1e9, 1) for n, t in pts], flush=True)
ext.set_tuning(**base)
