"""Each file's default engine: 512- and 128-token TTFT measured (median of 3) against LLM.predicted_ttft_at, one process."""
import sys, time, statistics
from tiered import LLM, EngineConfig, SamplingParams
sp = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
for p in sys.argv[1:]:
    l = LLM(p, EngineConfig())
    out = []
    for T in (128, 512):
        prompt = [(i * 7919) % 40000 + 100 for i in range(T)]
        l.generate([prompt], sp)
        ts = []
        for _ in range(3):
            t = time.perf_counter(); l.generate([prompt], sp); ts.append(time.perf_counter() - t)
        m, pr = statistics.median(ts), l.predicted_ttft_at(T)
        out.append(f"{T}: {m:.3f} s measured, {pr:.3f} priced ({(pr - m) / m:+.0%})")
    print(p.split("-")[6], l.plan.dtypes["experts"], "; ".join(out), flush=True)
    l.close()
