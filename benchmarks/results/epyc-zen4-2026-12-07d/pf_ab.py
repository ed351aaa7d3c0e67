"""In-process A/B of the default model's decode with stream_prefetch on / off (and attend_wide), rounds alternated."""
import json, statistics, sys, textwrap
from tiered import LLM, SamplingParams as SP, kernels
ext = kernels.load()
base = dict(ext.tuning()); print("tuning", base)
llm = LLM(sys.argv[2]) if len(sys.argv) > 2 else LLM()
ids = llm.encode(open(textwrap.__file__).read())[:32]
rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 5
sides = {"all on": dict(stream_prefetch=True, stream_prefetch_bytes=True),
         "byte formats off (tuned)": dict(stream_prefetch=True, stream_prefetch_bytes=False),
         "all off": dict(stream_prefetch=False, stream_prefetch_bytes=False)}
res = {k: [] for k in sides}
for r in range(rounds):
    for name, sw in (sides.items() if r % 2 == 0 else reversed(list(sides.items()))):
        ext.set_tuning(**sw)
        o = llm.generate([list(ids)], SP(temperature=0, max_tokens=96, ignore_eos=True))[0]
        res[name].append(round(o.stats.decode_tokens_per_s, 1))
ext.set_tuning(**base)
print(json.dumps({"model": sys.argv[2] if len(sys.argv) > 2 else "default", "runs": res, "median": {k: statistics.median(v) for k, v in res.items()},
                  "priced": llm.predicted_decode_at(o.stats.mean_decode_positions)}, indent=1))
