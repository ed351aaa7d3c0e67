# One process: int4_tiled_gemm (the AMX GEMM) on random tiled int4 weights at a few row counts, medians of 9 calls.
# A/B: `PYTHONPATH=<old worktree> python gemm_ab.py` against `python gemm_ab.py`, alternated processes.
import statistics as st, sys, time
import torch
from tiered import kernels
from tiered.kernels.linear import tiled_codes, tiled_inline, tiled_scales
from tiered.quant.int4 import quantize_int4

ext = kernels.load()
g = torch.Generator().manual_seed(0)
out = []
for N, K in [(14336, 4096), (4096, 14336), (3072, 576)]:
    codes, scale, zero = quantize_int4(torch.randn(N, K, generator=g) / 8)
    sz = tiled_scales(torch.stack([scale, zero], -1).transpose(0, 1).contiguous().to(torch.bfloat16))
    w = tiled_inline(tiled_codes(codes), sz)
    for M in (16, 64, 128, 256, 512):
        x = torch.randn(M, K).bfloat16()
        for _ in range(2):
            ext.int4_tiled_gemm(w, None, None, x, None)
        ts = []
        for _ in range(9):
            t = time.perf_counter(); ext.int4_tiled_gemm(w, None, None, x, None); ts.append(time.perf_counter() - t)
        out.append(f"{N}x{K}@{M}:{st.median(ts) * 1e3:.2f}")
print(" ".join(out), flush=True)
