import sys, time, torch
from tiered.quant.int4 import amx_kernels
ext = amx_kernels()
torch.manual_seed(0)
reps = int(sys.argv[1]) if len(sys.argv) > 1 else 10
for (H, Hkv, hd) in [(9, 3, 64), (32, 4, 128)]:
    for T in (512, 1024, 2048):
        q = torch.randn(1, H, T, hd).bfloat16(); k = torch.randn(1, Hkv, T, hd).bfloat16(); v = torch.randn(1, Hkv, T, hd).bfloat16()
        s = hd ** -0.5
        ext.amx_prompt_attention(q, k, v, s, 0)
        ts = []
        for _ in range(reps):
            t = time.perf_counter(); ext.amx_prompt_attention(q, k, v, s, 0); ts.append(time.perf_counter() - t)
        ts.sort(); med = ts[len(ts)//2]
        flops = 4 * H * hd * T * T / 2
        ref = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float().repeat_interleave(H//Hkv, 1), v.float().repeat_interleave(H//Hkv, 1), is_causal=True, scale=s)
        err = (ext.amx_prompt_attention(q, k, v, s, 0).float() - ref).abs().max().item()
        print(f"H{H} kv{Hkv} hd{hd} T{T}: {med*1e3:.3f} ms  {flops/med/1e9:.0f} GFLOP/s  err {err:.4f}", flush=True)
