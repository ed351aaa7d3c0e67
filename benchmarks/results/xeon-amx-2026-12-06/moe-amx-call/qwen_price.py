import os, sys, inspect, textwrap, time, statistics as st
from tiered import LLM, EngineConfig, SamplingParams
path = os.environ.get("MODEL", "/root/.cache/tiered/bench/qwen3moe-L8-D2048-H32x128kv4-E128k8F768-Q4_0-smollm2-tok-v3.gguf")
llm = LLM(path, EngineConfig(profile=os.environ.get("PROFILE")))
print("mixed_rows", llm.plan.mixed_rows, "group rows", llm.plan.expert_group_rows, flush=True)
toks = llm.encode(inspect.getsource(textwrap) * 4)
lens = [int(a) for a in sys.argv[1:]]
out = []
for n in lens:
    llm.generate([list(toks[:n])], SamplingParams(max_tokens=1))
    ts = []
    for _ in range(3):
        t = time.perf_counter(); llm.generate([list(toks[:n])], SamplingParams(max_tokens=1)); ts.append(time.perf_counter() - t)
    out.append(f"{n}:{st.median(ts)*1e3:.0f}/{(llm.predicted_ttft_at(n) or 0)*1e3:.0f}")
print(" ".join(out), flush=True)
