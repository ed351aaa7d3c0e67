# SmolLM2-135M's default engine: TTFT at each length (median of 5 after a warm-up) beside its price,
# "measured/priced" ms, and the plan's mixed_rows. Usage: [PROFILE=profile.json] python smolm2_ttft.py 64 128 270 512 941
import os, random, statistics as st, sys, time
from tiered import LLM, EngineConfig, SamplingParams
llm = LLM(None, EngineConfig(profile=os.environ.get("PROFILE")))
rng = random.Random(0)
out = []
for n in [int(a) for a in sys.argv[1:]]:
    ids = [rng.randrange(100, 40000) for _ in range(n)]
    llm.generate([ids], SamplingParams(max_tokens=1))
    ts = []
    for _ in range(5):
        t = time.perf_counter(); llm.generate([ids], SamplingParams(max_tokens=1)); ts.append((time.perf_counter() - t) * 1e3)
    out.append(f"{n}:{st.median(ts):.0f}/{(llm.predicted_ttft_at(n) or 0)*1e3:.0f}")
print("mixed_rows", llm.plan.mixed_rows, " ".join(out), flush=True)
