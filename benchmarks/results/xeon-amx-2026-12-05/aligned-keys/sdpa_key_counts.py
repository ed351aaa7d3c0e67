import torch, time, statistics, torch.nn.functional as F
torch.set_num_threads(2)
dt = torch.bfloat16
H, Hkv, hd = 9, 3, 64
Ls = [195, 270, 300, 422, 446, 454, 478, 500, 777, 941, 1000]
cache = torch.randn(2, 1, Hkv, 1100, hd, dtype=dt)
qs = {n: torch.randn(1, n, H, hd).to(dt).transpose(1, 2) for n in Ls}
def P(n, m=16): return -(-n // m) * m
def plain(n): return F.scaled_dot_product_attention(qs[n], cache[0][:, :, :n], cache[1][:, :, :n], is_causal=True, enable_gqa=True)
def kvpad(n): return F.scaled_dot_product_attention(qs[n], cache[0][:, :, :P(n)], cache[1][:, :, :P(n)], is_causal=True, enable_gqa=True)
def bothpad(n):
    q = F.pad(qs[n], (0, 0, 0, P(n) - n))
    return F.scaled_dot_product_attention(q, cache[0][:, :, :P(n)], cache[1][:, :, :P(n)], is_causal=True, enable_gqa=True)[:, :, :n]
for n in Ls:
    a, b, c = plain(n), kvpad(n), bothpad(n)
    assert (a.float() - b.float()).abs().max() < 2e-2 and (a.float() - c.float()).abs().max() < 2e-2, n
fs = {"plain": plain, "kv to 16": kvpad, "q and kv to 16": bothpad}
res = {(n, k): [] for n in Ls for k in fs}
for r in range(15):
    for n in Ls:
        for k, f in fs.items():
            t = time.perf_counter(); f(n); res[(n, k)].append(time.perf_counter() - t)
for n in Ls:
    base = statistics.median(res[(n, "plain")])
    print(n, "plain", round(base * 1e3, 3), " ".join(f"{k} {statistics.median(res[(n, k)]) / base:.2f}" for k in fs if k != "plain"))
