# SmolLM2 one-copy int4 projections: the q8 row kernel against the AMX GEMM at 8-128 rows (medians of 30 calls).
import torch, time
from tiered import LLM, EngineConfig
from tiered.checkpoint import default_model_path
from tiered.quant.int4 import Int4Linear, amx_gemm
llm = LLM(str(default_model_path()), EngineConfig(max_batch=32))
lins = {}
for name, m in llm.model.named_modules():
    if isinstance(m, Int4Linear) and m.layout == "tiled":
        lins.setdefault((m.out_features, m.in_features), m)
print(list(lins))
def med(f, n=30):
    for _ in range(3): f()
    ts = []
    for _ in range(n):
        t = time.perf_counter(); f(); ts.append(time.perf_counter() - t)
    ts.sort(); return ts[n // 2] * 1e6
with torch.inference_mode():
    for shape, m in lins.items():
        for M in (8, 16, 32, 48, 64, 96, 128):
            x = torch.randn(M, shape[1])
            xb = x.bfloat16()
            q8 = med(lambda: m.kernel("q8")(x))
            amx = med(lambda: amx_gemm(m.packed, None, xb, m.bias))
            print(shape, M, "q8 %.0f us, amx %.0f us, ratio %.2f" % (q8, amx, amx / q8))
