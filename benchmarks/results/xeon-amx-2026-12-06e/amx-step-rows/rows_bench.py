import sys, time, torch
from tiered.kernels.linear import tiled_codes, tiled_inline, tiled_scales, int4_tiled_kernel
from tiered.quant.int4 import quantize_int4, amx_kernels
ext = amx_kernels()
g = torch.Generator().manual_seed(0)
def weight(N, K):
    codes, scale, zero = quantize_int4(torch.randn(N, K, generator=g) / 8)
    sz = tiled_scales(torch.stack([scale, zero], -1).transpose(0, 1).contiguous().to(torch.bfloat16))
    return tiled_inline(tiled_codes(codes), sz)
WIDE = "--wide" in sys.argv  # Qwen3-30B-A3B's and Llama-3-8B's widths (15 calls each) instead of SmolLM2's


def med(f, reps=15 if WIDE else 40):
    f(); ts = []
    for _ in range(reps):
        t = time.perf_counter(); f(); ts.append(time.perf_counter() - t)
    return sorted(ts)[reps // 2]
SHAPES = ([("qwen_q", 4096, 2048), ("qwen_o", 2048, 4096), ("llama_qkv", 6144, 4096), ("llama_down", 4096, 14336)] if WIDE
          else [("gate_up", 3072, 576), ("down", 576, 1536), ("qkv", 960, 576)])
for name, N, K in SHAPES:
    w = weight(N, K)
    k = int4_tiled_kernel(w, None, batch_act="q8")
    for M in ((16, 24, 32, 40, 48) if WIDE else (8, 16, 24, 32, 40, 48, 64)):
        x = torch.randn(M, K)
        xb = x.bfloat16()
        t1 = med(lambda: k(x))
        t2 = med(lambda: ext.int4_tiled_gemm(w, None, None, xb, None, True, False))
        print(f"{name} M{M}: q8 rows {t1*1e6:.0f} us, amx {t2*1e6:.0f} us ({t2/t1:.2f}x)", flush=True)
