import os, sys, inspect, textwrap, time, statistics as st, torch
from tiered import LLM, EngineConfig, SamplingParams
from tiered.models import layers
path = os.environ.get("MODEL", "/root/.cache/tiered/bench/qwen3moe-L8-D2048-H32x128kv4-E128k8F768-Q4_0-smollm2-tok-v3.gguf")
llm = LLM(path, EngineConfig())
toks = llm.encode(inspect.getsource(textwrap) * 4)
new_k, new_in = layers._norm_rope_kernels, layers.Attention.input_dtype
def old_in(self, x, cache):
    if self.q_norm is not None: return None
    return new_in(self, x, cache)
def setmode(m):
    layers._norm_rope_kernels = new_k if m == "new" else (lambda *a: None)
    layers.Attention.input_dtype = new_in if m == "new" else old_in
lens = [int(a) for a in sys.argv[1:]]
outs = {}
for m in ("old", "new"):
    setmode(m)
    outs[m] = llm.logits(list(toks[:lens[-1]]))
print("logits equal:", torch.equal(outs["old"], outs["new"]), (outs["old"]-outs["new"]).abs().max().item())
res = {}
for n in lens:
    llm.generate([list(toks[:n])], SamplingParams(max_tokens=1))
for r in range(int(os.environ.get("ROUNDS", 4))):
    for m in ("old", "new"):
        setmode(m)
        for n in lens:
            t = time.perf_counter(); llm.generate([list(toks[:n])], SamplingParams(max_tokens=1)); res.setdefault((n, m), []).append(time.perf_counter() - t)
for n in lens:
    print(n, " ".join(f"{m} {st.median(res[(n, m)])*1e3:.1f} ({min(res[(n, m)])*1e3:.0f}-{max(res[(n, m)])*1e3:.0f})" for m in ("old", "new")), flush=True)
