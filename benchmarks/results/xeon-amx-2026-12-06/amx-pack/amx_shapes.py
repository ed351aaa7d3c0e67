# AMX GEMM times over shapes x rows, warm weights; then least squares fits.
import statistics as st, sys, time, json
import numpy as np, torch
from tiered import kernels
from tiered.kernels.linear import tiled_codes, tiled_inline, tiled_scales
from tiered.quant.int4 import quantize_int4
ext = kernels.load()
g = torch.Generator().manual_seed(0)
rows = [int(r) for r in sys.argv[1].split(",")] if len(sys.argv) > 1 else [16, 32, 64, 128, 256, 512]
shapes = [(1024, 1024), (2048, 1024), (1024, 2048), (3072, 576), (576, 1536), (4096, 4096), (14336, 4096), (4096, 14336)]
res = []
for N, K in shapes:
    codes, scale, zero = quantize_int4(torch.randn(N, K, generator=g) / 8)
    sz = tiled_scales(torch.stack([scale, zero], -1).transpose(0, 1).contiguous().to(torch.bfloat16))
    w = tiled_inline(tiled_codes(codes), sz)
    for M in rows:
        x = torch.randn(M, K).bfloat16()
        for _ in range(2):
            ext.int4_tiled_gemm(w, None, None, x, None)
        ts = []
        n = 9 if N * K * M < 4e9 else 5
        for _ in range(n):
            t = time.perf_counter(); ext.int4_tiled_gemm(w, None, None, x, None); ts.append(time.perf_counter() - t)
        res.append((N, K, M, st.median(ts)))
        print(N, K, M, f"{st.median(ts)*1e3:.3f} ms", flush=True)
json.dump(res, open(sys.argv[2] if len(sys.argv) > 2 else "amx_shapes.json", "w"))
