import time
from tiered.hardware import profiler as P
from tiered.hardware.profiler import decode_ws_cold, last_level_cache_bytes
cold = decode_ws_cold(last_level_cache_bytes(), True)
tot = time.perf_counter()
for fmt in ("q6k", "q5k", "iq4xs"):
    t = time.perf_counter(); pts = P._decode_layer_points(5, P.KQUANT_LAYER_SHAPES, cold_bytes=cold, fmt=fmt)
    print(fmt, round(time.perf_counter() - t, 2), "s", [(round(n/1e6, 2), round(n/s/1e9, 1)) for n, s in pts], flush=True)
print("total", round(time.perf_counter() - tot, 1))
