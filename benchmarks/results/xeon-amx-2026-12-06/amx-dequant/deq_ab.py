# One process: the int4_tiled_dequantize and int4_tiled_gemm (AMX) times of three tiled int4 weights (random).
# A/B: `PYTHONPATH=<old worktree> python deq_ab.py` against `python deq_ab.py`, alternated.
import torch, time, statistics as st
from tiered import kernels
from tiered.kernels.linear import tiled_codes, tiled_inline, tiled_scales
from tiered.quant.int4 import quantize_int4
ext = kernels.load()
g = torch.Generator().manual_seed(0)
res = []
for N, K in [(3072, 576), (576, 1536), (14336, 4096)]:
    codes, scale, zero = quantize_int4(torch.randn(N, K, generator=g) / 8)
    sz = tiled_scales(torch.stack([scale, zero], -1).transpose(0, 1).contiguous().to(torch.bfloat16))
    w = tiled_inline(tiled_codes(codes), sz)
    x8 = torch.randn(8, K).bfloat16(); x256 = torch.randn(256, K).bfloat16()
    def med(f, n=25):
        for _ in range(3): f()
        ts = []
        for _ in range(n):
            t = time.perf_counter(); f(); ts.append(time.perf_counter() - t)
        return st.median(ts) * 1e6
    d = med(lambda: ext.int4_tiled_dequantize(w, None, None, fp32=False))
    a8 = med(lambda: ext.int4_tiled_gemm(w, None, None, x8, None))
    a256 = med(lambda: ext.int4_tiled_gemm(w, None, None, x256, None))
    res.append(f"{N}x{K}: dequantize {d:.0f} us, amx 8 rows {a8:.0f}, 256 rows {a256:.0f}")
print(" | ".join(res))
