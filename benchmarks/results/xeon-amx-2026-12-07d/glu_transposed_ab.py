"""A/B of the native GLU over a transposed prompt GEMM output (layers._transposed_rows) on the Gemma-3-4B-width
dummy, alternated in one process: python glu_transposed_ab.py [PROMPT_TOKENS [ROUNDS]] (run from the repository
root; 1024 tokens 14 rounds, and 8192 tokens 6 rounds, gave this README's figures)."""
import statistics
import sys
import time

import torch

sys.path.insert(0, "benchmarks")
import cpu_gemma3  # noqa: E402

import tiered.models.layers as L  # noqa: E402
from tiered import LLM, EngineConfig, SamplingParams  # noqa: E402

tokens = int(sys.argv[1]) if len(sys.argv) > 1 else 1024
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 14
llm = LLM(cpu_gemma3.model_file(6), EngineConfig(max_context=tokens + 256))
ids = torch.randint(100, 40000, (tokens,)).tolist()
sp = SamplingParams(temperature=0, max_tokens=1)
native = L._transposed_rows
res = {"new": [], "old": []}
for i in range(rounds):
    mode = "new" if i % 2 else "old"
    L._transposed_rows = native if mode == "new" else (lambda x: None)
    t0 = time.perf_counter()
    llm.generate(ids, sp)
    res[mode].append(time.perf_counter() - t0)
print({k: (round(statistics.median(v[1:]), 3), [round(x, 3) for x in v]) for k, v in res.items()})
