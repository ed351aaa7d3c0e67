"""Repacking speed of one 4096 x 14336 GGUF k-quant weight into tiered's copies as stored (q6k_blocks_q6t /
q5k_blocks_q5t), into new tensors and into given ones (hardware/budget.host_empty: huge pages, first touch
included), medians of 7; and an 8-layer Llama-3-8B-width file's load (LLM(path), its page cache warm)."""
import statistics, sys, time
import torch
from tiered.bench.gguf_dense import random_k_blocks
from tiered.hardware.budget import host_empty
from tiered.kernels import load
from tiered.quant.kquant import Q5KLinear, Q6KLinear
import numpy as np
ext = load()
N, K = 4096, 14336
rng = np.random.default_rng(0)
for cls, q in ((Q6KLinear, "Q6_K"), (Q5KLinear, "Q5_K")):
    raw = torch.from_numpy(random_k_blocks(rng, N, K, q, 0.02))
    pack = getattr(ext, f"{cls.KIND}_blocks_{cls.KIND[:2]}t")
    new, given = [], []
    for _ in range(7):
        t = time.perf_counter(); pack(raw); new.append(time.perf_counter() - t)
        outs = [host_empty(s, d) for s, d in cls.layout(N // 16, K)]
        t = time.perf_counter(); pack(raw, *outs); given.append(time.perf_counter() - t)
    print(f"{cls.KIND}: new tensors {statistics.median(new)*1e3:.1f} ms, host_empty outputs {statistics.median(given)*1e3:.1f} ms")
if len(sys.argv) > 1:
    from tiered import LLM
    for path in sys.argv[1:]:
        ts = []
        for _ in range(3):
            t = time.perf_counter(); llm = LLM(path); ts.append(time.perf_counter() - t); del llm
        print(path.split("/")[-1], "load s", [round(x, 2) for x in ts], "median", round(statistics.median(ts), 2))
