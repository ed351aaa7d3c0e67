import sys, time, torch
sys.path.insert(0, "tests")  # run from the repository root
from gguf_writer import random_k_blocks
from gguf import GGMLQuantizationType as Q
from tiered.kernels import load
ext = load()
N, K = 4096, 14336
p5 = ext.q5k_blocks_q5t(torch.from_numpy(random_k_blocks(N, K, Q.Q5_K)))
r6 = torch.from_numpy(random_k_blocks(N, K, Q.Q6_K))
p6 = ext.q6k_blocks_q6t(r6); i8 = ext.q6k_blocks_tiled(r6)
out = torch.empty(N, K, dtype=torch.bfloat16)
for name, fn in (("q5k", lambda: ext.q5k_tiled_dequantize(*p5, True, out)), ("q6k", lambda: ext.q6k_tiled_dequantize(*p6, True, out)),
                 ("int8g32", lambda: ext.int8g32_tiled_dequantize(*i8, out))):
    fn(); ts = []
    for _ in range(5):
        t0 = time.perf_counter(); fn(); ts.append(time.perf_counter() - t0)
    print(name, f"{sorted(ts)[2]*1e3:.1f} ms")
