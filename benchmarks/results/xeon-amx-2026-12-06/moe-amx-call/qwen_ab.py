# A/B in one process: the modules' prefill with the experts past group_rows in the native call (new) against torch ops (old: amx_rows 0)
import os, sys, inspect, textwrap, time, statistics as st
from tiered import LLM, EngineConfig, SamplingParams
from tiered.quant import experts as qe
path = os.environ.get("MODEL", "/root/.cache/tiered/bench/qwen3moe-L8-D2048-H32x128kv4-E128k8F768-Q4_0-smollm2-tok-v3.gguf")
llm = LLM(path, EngineConfig())
print("mixed_rows", llm.plan.mixed_rows, flush=True)
toks = llm.encode(inspect.getsource(textwrap) * 4)
new = qe.ExpertFormat.amx_rows
old = property(lambda self: 0)
res = {}
lens = [int(a) for a in sys.argv[1:]]
for n in lens:
    llm.generate([list(toks[:n])], SamplingParams(max_tokens=1))
for r in range(int(os.environ.get("ROUNDS", 5))):
    for name, prop in (("old", old), ("new", new)):
        qe.ExpertFormat.amx_rows = prop
        for n in lens:
            t = time.perf_counter(); llm.generate([list(toks[:n])], SamplingParams(max_tokens=1)); res.setdefault((n, name), []).append(time.perf_counter() - t)
for n in lens:
    print(n, " ".join(f"{name} {st.median(res[(n, name)])*1e3:.0f} ({min(res[(n, name)])*1e3:.0f}-{max(res[(n, name)])*1e3:.0f})" for name in ("old", "new")), f"priced {(llm.predicted_ttft_at(n) or 0)*1e3:.0f}", flush=True)
