# one expert's three GEMMs at Qwen3-30B-A3B width: cold (a fresh weight each call, as a prompt's experts) and warm
import torch, time, statistics, itertools, os, sys
from tiered.quant.int4 import GROUP, Int4Linear, quantize_int4, amx_gemm
from tiered.hardware.profiler import random_normal
g = torch.Generator().manual_seed(0)
shapes = [(2048, 768), (768, 2048)] if len(sys.argv) < 2 else [tuple(map(int, a.split("x"))) for a in sys.argv[1:]]
for (K, N) in shapes:
    ws = [Int4Linear.from_codes(*quantize_int4(random_normal(N, K, generator=g)), GROUP, None, "tiled").packed for _ in range(24)]
    for T in [int(v) for v in os.environ.get("ROWS", "16,24,40,48,64").split(",")]:
        x = torch.randn(T, K, generator=g).to(torch.bfloat16)
        for w in ws[:4]: amx_gemm(w, None, x)
        ts = []
        for i in range(96):
            w = ws[i % len(ws)]; s = time.perf_counter(); amx_gemm(w, None, x); ts.append(time.perf_counter() - s)
        print(f"{os.environ.get('TIERED_AMX_SMALL','base'):>10} {K}x{N} rows {T}: {statistics.median(ts)*1e3:.3f} ms", flush=True)
