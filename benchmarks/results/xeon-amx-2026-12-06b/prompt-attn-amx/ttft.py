import os, sys, inspect, textwrap, time, statistics as st
from tiered import LLM, EngineConfig, SamplingParams
import tiered
path = os.environ.get("MODEL", "/root/.cache/tiered/bench/qwen3moe-L8-D2048-H32x128kv4-E128k8F768-Q4_0-smollm2-tok-v3.gguf")
llm = LLM(path, EngineConfig())
toks = llm.encode(inspect.getsource(textwrap) * 4)
lens = [int(a) for a in sys.argv[1:]]
for n in lens: llm.generate([list(toks[:n])], SamplingParams(max_tokens=1))
res = {}
for r in range(int(os.environ.get("ROUNDS", 5))):
    for n in lens:
        t = time.perf_counter(); llm.generate([list(toks[:n])], SamplingParams(max_tokens=1)); res.setdefault(n, []).append(time.perf_counter() - t)
tag = os.environ.get("TAG", tiered.__file__)
print(tag, " ".join(f"{n}: {st.median(res[n])*1e3:.0f}" for n in lens), " priced " + " ".join(f"{(llm.predicted_ttft_at(n) or 0)*1e3:.0f}" for n in lens), flush=True)
