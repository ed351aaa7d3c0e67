import torch, time, statistics as st
from tiered.quant.int4 import GROUP, Int4Linear, quantize_int4
torch.manual_seed(0)
for N, K, T in [(3072, 576, 400), (576, 1536, 400), (960, 576, 400), (3072, 576, 941)]:
    lin = Int4Linear.from_codes(*quantize_int4(torch.randn(N, K) / 8), GROUP, None, "tiled")
    x = torch.randn(T, K); xb = x.bfloat16()
    res = {}
    for name, xx in (("fp32", x), ("bf16", xb)):
        for _ in range(3): lin.dense(xx)
    a, b = [], []
    for _ in range(30):
        t = time.perf_counter(); lin.dense(x); a.append(time.perf_counter() - t)
        t = time.perf_counter(); lin.dense(xb); b.append(time.perf_counter() - t)
    print(N, K, T, f"fp32 x {st.median(a)*1e3:.3f} ms  bf16 x {st.median(b)*1e3:.3f} ms")
