import sys, time, torch, statistics
sys.path.insert(0, "benchmarks")
import cpu_gemma3
from tiered import LLM, EngineConfig, SamplingParams
import tiered.models.layers as L
llm = LLM(cpu_gemma3.model_file(6), EngineConfig(max_context=8448))
ids = torch.randint(100, 40000, (8192,)).tolist()
sp = SamplingParams(temperature=0, max_tokens=1)
orig = L._transposed_rows
res = {"new": [], "old": []}
for i in range(6):
    mode = "new" if i % 2 else "old"
    L._transposed_rows = orig if mode == "new" else (lambda x: None)
    t0 = time.perf_counter(); out = llm.generate(ids, sp)[0]; res[mode].append(time.perf_counter() - t0)
print({k: (round(statistics.median(v[1:]), 3), [round(x, 3) for x in v]) for k, v in res.items()})
