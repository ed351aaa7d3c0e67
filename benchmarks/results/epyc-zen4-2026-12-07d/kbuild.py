import time
from tiered.hardware import profiler as P
from tiered import kernels; kernels.load()
for fmt in ("q6k", "iq4xs"):
    for shape in P.KQUANT_LAYER_SHAPES:
        t = time.perf_counter(); L = P._ColdDecodeLayers(shape, fmt=fmt, runs=2); b = time.perf_counter() - t
        c = L.call(1); t = time.perf_counter()
        for _ in range(10): c()
        print(fmt, shape, "build", round(b, 2), "s; 10 calls", round(time.perf_counter() - t, 3), "s", flush=True)
        del L, c
