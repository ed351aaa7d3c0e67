"""AMX GEMM (int4_tiled_gemm) against Int4Linear.dense's dequantize + oneDNN GEMM, 15 alternated rounds a shape."""
import torch, time, statistics, sys
from tiered import kernels
from tiered.quant.int4 import Int4Linear, quantize_int4, without_amx
ext = kernels.load()
torch.manual_seed(0)
shapes = [(3072, 576, 400), (576, 1536, 400), (960, 576, 400), (3072, 576, 941), (4096, 4096, 512), (14336, 4096, 256)]
for N, K, M in shapes:
    m = Int4Linear.from_codes(*quantize_int4(torch.randn(N, K) / 30), layout="tiled", batch_act="q8")
    x = torch.randn(M, K).to(torch.bfloat16)
    fa = lambda: ext.int4_tiled_gemm(m.packed, None, None, x, None, False, False)
    def fd():  # the dequantized weight's oneDNN GEMM
        with without_amx():
            return m.dense(x)
    it = max(2, int(2e8 // (M * N * K) ))
    def tm(f):
        t = time.perf_counter()
        for _ in range(it): f()
        return (time.perf_counter() - t) / it * 1e6
    fa(); fd()
    A, D = [], []
    for r in range(15):
        if r % 2: A.append(tm(fa)); D.append(tm(fd))
        else: D.append(tm(fd)); A.append(tm(fa))
    ratios = [a / d for a, d in zip(A, D)]
    print(f"{N}x{K} M={M}: amx {statistics.median(A):.0f} us, dense {statistics.median(D):.0f} us, ratio median {statistics.median(ratios):.2f} (min {min(ratios):.2f} max {max(ratios):.2f})", flush=True)
