import time, torch, torch.nn.functional as F
from tiered.quant.int4 import amx_kernels
ext = amx_kernels()
def med(f, reps=20):
    f(); ts = []
    for _ in range(reps):
        t = time.perf_counter(); f(); ts.append(time.perf_counter() - t)
    return sorted(ts)[reps // 2] * 1e3
for (H, Hkv, hd) in [(9, 3, 64), (32, 4, 128)]:
    for T in (512, 1024, 2048):
        q = torch.randn(1, H, T, hd).bfloat16(); k = torch.randn(1, Hkv, T, hd).bfloat16(); v = torch.randn(1, Hkv, T, hd).bfloat16()
        a = med(lambda: ext.amx_prompt_attention(q, k, v, hd ** -0.5, 0))
        b = med(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))
        print(f"H{H} kv{Hkv} hd{hd} T{T}: amx {a:.3f} ms  torch {b:.3f} ms", flush=True)
