import time, sys
from tiered.hardware import profiler as P
for fmt in sys.argv[1:]:
    for shape in ((1536, 4096, 24, 8), (2048, 8192, 32, 8), (3072, 8192, 24, 8), (4096, 14336, 32, 8)):
        t = time.perf_counter(); pts = P._decode_layer_points(5, (shape,), cold_bytes=600 << 20, fmt=fmt)
        print(fmt, shape, round(time.perf_counter() - t, 2), "s", [(round(n/1e6, 2), round(n/s/1e9, 1)) for n, s in pts], flush=True)
