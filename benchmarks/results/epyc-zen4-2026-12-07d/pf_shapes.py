"""stream_prefetch on/off per shape: int4 batch-1 gemv (int16 act as the tuning has it) cycled over 256 MB."""
import itertools, statistics, time, torch, sys
from tiered import kernels
from tiered.hardware.profiler import _module_copies, _native_gemv, _native_gemv_module
ext = kernels.load(); base = dict(ext.tuning())
shapes = [(576, 576), (1536, 576), (576, 1536), (49152, 576), (4096, 4096), (14336, 4096), (4096, 14336)]
for N, K in shapes:
    g = torch.Generator().manual_seed(0)
    t = _native_gemv_module("int4", torch.randn(N, K, generator=g) * 0.02)[0]
    n = max(2, (256 << 20) // (N * K // 2))
    copies = [t] + _module_copies(t, n - 1)
    calls = [_native_gemv("int4", m) for m in copies]
    x = torch.randn(1, K)
    def run():
        s = time.perf_counter()
        for c in calls: c(x)
        return time.perf_counter() - s
    r = {True: [], False: []}
    for i in range(9):
        for f in ((True, False) if i % 2 else (False, True)):
            ext.set_tuning(stream_prefetch=f); r[f].append(run())
    on, off = statistics.median(r[True]), statistics.median(r[False])
    gb = len(calls) * N * K * 0.5625 / 1e9
    print(f"{N}x{K}: on {gb/on:.1f} GB/s off {gb/off:.1f} GB/s  off/on time {off/on:.3f}", flush=True)
ext.set_tuning(stream_prefetch=base["stream_prefetch"])
