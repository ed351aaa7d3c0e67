"""Several GGUF files' default engines in one process, decode rounds alternated: measured tok/s against priced."""
import sys, statistics
from tiered import LLM, EngineConfig, SamplingParams
paths = sys.argv[1].split(",")
rounds = int(sys.argv[2])
llms = {p.split("/")[-1].split("-")[5]: LLM(p, EngineConfig()) for p in paths}
prompt = list(range(100, 132))
sp = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
res = {n: [] for n in llms}
pos = {}
for r in range(rounds):
    for n, l in (list(llms.items()) if r % 2 == 0 else list(llms.items())[::-1]):
        o = l.generate([prompt], sp)[0]
        res[n].append(o.stats.decode_tokens_per_s); pos[n] = o.stats.mean_decode_positions
for n, l in llms.items():
    m = statistics.median(res[n]); p = l.predicted_decode_at(pos[n])
    print(f"{n}: experts {l.plan.dtypes['experts']}, measured {m:.1f} tok/s {[round(v,1) for v in res[n]]}, priced {p:.1f} ({(p-m)/m:+.0%})")
