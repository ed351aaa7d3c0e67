# SmolLM2 TTFT of prompts of the given lengths (median of 5 after one warm-up), one process a side.
import sys, time, random, statistics as st
from tiered import LLM, SamplingParams
from tiered.checkpoint import default_model_path
llm = LLM(str(default_model_path()))
rng = random.Random(0); V = llm.config.vocab_size
out = []
for n in [int(a) for a in sys.argv[1:]]:
    ids = [rng.randrange(10, V) for _ in range(n)]
    llm.generate([ids], SamplingParams(max_tokens=1))
    ts = []
    for _ in range(5):
        t = time.perf_counter(); llm.generate([ids], SamplingParams(max_tokens=1)); ts.append((time.perf_counter() - t) * 1e3)
    out.append(f"{n}:{st.median(ts):.1f}")
print(" ".join(out))
