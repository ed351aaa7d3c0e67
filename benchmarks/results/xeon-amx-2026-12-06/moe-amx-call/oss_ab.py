# A/B in one process on the 4-layer gpt-oss-20b-width MXFP4 dummy: old = ExpertFormat.amx_rows patched to 0 (experts past
# their kernel rows through torch ops: _biased_glu), new = one native call each on the AMX GEMM, in the layer call
import os, sys, time, random, statistics as st
from pathlib import Path
from tiered import LLM, EngineConfig, SamplingParams
from tiered.bench.gguf_moe import gpt_oss_20b
from tiered.quant import experts as qe
path = Path(f"/tmp/tiered-moe-{gpt_oss_20b(4).tag('Q8_0-MXFP4')}.gguf")
llm = LLM(str(path), EngineConfig())
print("mixed_rows", llm.plan.mixed_rows, flush=True)
rng = random.Random(0)
lens = [int(a) for a in sys.argv[1:]]
prompts = {n: [rng.randrange(100, 40000) for _ in range(n)] for n in lens}
new, old = qe.ExpertFormat.amx_rows, property(lambda self: 0)
for n in lens:
    llm.generate([prompts[n]], SamplingParams(max_tokens=1))
res = {}
for r in range(int(os.environ.get("ROUNDS", 3))):
    for name, prop in (("old", old), ("new", new)):
        qe.ExpertFormat.amx_rows = prop
        for n in lens:
            t = time.perf_counter(); llm.generate([prompts[n]], SamplingParams(max_tokens=1)); res.setdefault((n, name), []).append(time.perf_counter() - t)
for n in lens:
    print(n, " ".join(f"{name} {st.median(res[(n, name)])*1e3:.0f} ({min(res[(n, name)])*1e3:.0f}-{max(res[(n, name)])*1e3:.0f})" for name in ("old", "new")), f"priced {(llm.predicted_ttft_at(n) or 0)*1e3:.0f}", flush=True)
