"""Prompt attention alone, 2 threads: tiered's bf16 kernel (AVX512-BF16 here) against torch's SDPA in fp32 and bf16,
causal from position 0 and a chunk after cached positions; medians of 7, alternated."""
import torch, time, statistics, json, sys
import torch.nn.functional as F
from tiered import kernels
ext = kernels.load()
torch.manual_seed(0)
res = []
for (name, H, Hkv, hd, T, past) in [("smollm2", 9, 3, 64, 512, 0), ("smollm2", 9, 3, 64, 1024, 0), ("smollm2", 9, 3, 64, 1024, 3072),
                                  ("gemma3-4b", 8, 4, 256, 1024, 0), ("gemma3-4b", 8, 4, 256, 1024, 7168), ("qwen3", 32, 8, 128, 512, 0)]:
    S = past + T
    q = torch.randn(1, T, H, hd).bfloat16().transpose(1, 2)
    k, v = (torch.randn(1, Hkv, S, hd).bfloat16() for _ in range(2))
    qf, kf, vf = q.float(), k.float(), v.float()
    mask = None if past == 0 else (torch.arange(S) <= torch.arange(past, S)[:, None])
    sc = hd ** -0.5
    fns = {
        "tiered bf16": lambda: ext.bf16_prompt_attention(q, k, v, sc, past, 0),
        "torch fp32": lambda: F.scaled_dot_product_attention(qf, kf, vf, attn_mask=mask, is_causal=mask is None, scale=sc, enable_gqa=True),
        "torch bf16": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=sc, enable_gqa=True),
    }
    t = {n: [] for n in fns}
    for f in fns.values(): f()
    for r in range(7):
        for n, f in (fns.items() if r % 2 == 0 else reversed(fns.items())):
            t0 = time.perf_counter(); f(); t[n].append(time.perf_counter() - t0)
    row = {"model": name, "H": H, "Hkv": Hkv, "hd": hd, "T": T, "past": past, **{n: statistics.median(x) * 1e3 for n, x in t.items()}}
    res.append(row)
    print(row, flush=True)
json.dump(res, open(sys.argv[1] if len(sys.argv) > 1 else "/tmp/s101/attn_bench.json", "w"), indent=1)
