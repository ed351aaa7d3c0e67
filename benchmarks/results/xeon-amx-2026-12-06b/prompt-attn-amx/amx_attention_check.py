import torch, time, statistics as st
import torch.nn.functional as F
from tiered import kernels
ext = kernels.load()
torch.manual_seed(0)
def tm(f, k=10):
    f(); ts=[]
    for _ in range(k):
        t=time.perf_counter(); f(); ts.append(time.perf_counter()-t)
    return st.median(ts)*1e3
for (B, H, Hkv, hd, T, S) in [(1, 9, 3, 64, 512, 512), (1, 4, 2, 64, 37, 48), (2, 6, 6, 128, 70, 80), (1, 32, 4, 128, 512, 512), (1, 9, 3, 64, 2048, 2048), (1, 2, 1, 32, 1, 16)]:
    if T < 2: continue
    q = torch.randn(B, T, H, hd).bfloat16().transpose(1, 2)
    k = torch.randn(B, Hkv, S, hd).bfloat16(); v = torch.randn(B, Hkv, S, hd).bfloat16()
    scale = hd ** -0.5
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True, scale=scale, enable_gqa=True)
    tor = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    got = ext.amx_prompt_attention(q, k, v, scale)
    e_got = (got.float() - ref).abs().max().item(); e_tor = (tor.float() - ref).abs().max().item()
    a = tm(lambda: ext.amx_prompt_attention(q, k, v, scale)); b = tm(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True))
    print(f"B{B} H{H}/{Hkv} hd{hd} T{T} S{S}: max err amx {e_got:.4f} torch-bf16 {e_tor:.4f}; amx {a:.2f} ms torch {b:.2f} ms")
