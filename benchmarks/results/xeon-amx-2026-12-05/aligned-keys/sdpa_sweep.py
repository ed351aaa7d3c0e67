import torch, time, statistics, torch.nn.functional as F
torch.set_num_threads(2)
dt = torch.bfloat16
H, Hkv, hd = 9, 3, 64
Ls = list(range(416, 481, 2))
cache = torch.randn(2, 1, Hkv, 1100, hd, dtype=dt)
qs = {n: torch.randn(1, n, H, hd).to(dt).transpose(1, 2) for n in Ls}
res = {n: [] for n in Ls}
for r in range(9):
    for n in Ls:
        q = qs[n]
        t = time.perf_counter(); F.scaled_dot_product_attention(q, cache[0][:, :, :n], cache[1][:, :, :n], is_causal=True, enable_gqa=True); res[n].append(time.perf_counter() - t)
for n in Ls:
    m = statistics.median(res[n]); print(n, round(m * 1e3, 3), "ns per causal pair-head", round(m / (n * (n + 1) / 2 * 9) * 1e9, 2))
