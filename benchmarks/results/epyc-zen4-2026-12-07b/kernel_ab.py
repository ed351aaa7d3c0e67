import numpy as np, torch, time, sys
sys.path.insert(0, "tests")  # run from the repository root
from gguf_writer import random_k_blocks
from gguf import GGMLQuantizationType as Q
from tiered.kernels import load
ext = load()
N, K = 4096, 14336
res = {}
raws5 = [torch.from_numpy(random_k_blocks(N, K, Q.Q5_K, seed=i)) for i in range(8)]
raws6 = [torch.from_numpy(random_k_blocks(N, K, Q.Q6_K, seed=i)) for i in range(8)]
ks = {"q5k": [ext.q5k_kernel(*ext.q5k_blocks_q5t(r)) for r in raws5],
      "q6k": [ext.q6k_kernel(*ext.q6k_blocks_q6t(r)) for r in raws6],
      "int8g32": [ext.int8g32_tiled_kernel(*ext.q6k_blocks_tiled(r)) for r in raws6]}
t0 = time.perf_counter(); ext.q5k_blocks_q5t(raws5[0]); t5 = time.perf_counter() - t0
t0 = time.perf_counter(); ext.q6k_blocks_q6t(raws6[0]); t6 = time.perf_counter() - t0
t0 = time.perf_counter(); ext.q6k_blocks_tiled(raws6[0]); ti = time.perf_counter() - t0
print(f"pack: q5k {t5*1e3:.0f} ms, q6k {t6*1e3:.0f} ms, int8g32 from Q6_K {ti*1e3:.0f} ms")
x = torch.randn(1, K)
for rnd in range(9):
    for name, kk in ks.items():
        t0 = time.perf_counter()
        for _ in range(3):
            for k in kk: k(x)
        res.setdefault(name, []).append((time.perf_counter() - t0) / 3 / len(kk))
bpw = {"q5k": 180 / 256, "q6k": 210 / 256, "int8g32": 34 / 32}
for name in res:
    dt = sorted(res[name])[4]
    print(name, f"{dt*1e3:.3f} ms {N*K*bpw[name]/dt/1e9:.1f} GB/s")
