"""In-process A/B of a model's decode (default: SmolLM2) with the weight-stream prefetches on everywhere, as tuned (the
byte formats' off) and off everywhere, rounds alternated.

    python pf_ab.py ROUNDS [MODEL] [--two] [--tokens N]   (--two: without the "all off" arm; pf_ab2's run: 48 tokens)
"""
import argparse, json, statistics, textwrap
from tiered import LLM, SamplingParams as SP, kernels
ap = argparse.ArgumentParser()
ap.add_argument("rounds", type=int, nargs="?", default=5)
ap.add_argument("model", nargs="?")
ap.add_argument("--two", action="store_true")
ap.add_argument("--tokens", type=int, default=96)
opt = ap.parse_args()
ext = kernels.load()
base = dict(ext.tuning()); print("tuning", base)
llm = LLM(opt.model) if opt.model else LLM()
ids = llm.encode(open(textwrap.__file__).read())[:32]
rounds, tokens = opt.rounds, opt.tokens
sides = {"all on": dict(stream_prefetch=True, stream_prefetch_bytes=True),
         "byte formats off (tuned)": dict(stream_prefetch=True, stream_prefetch_bytes=False)}
if not opt.two:
    sides["all off"] = dict(stream_prefetch=False, stream_prefetch_bytes=False)
res = {k: [] for k in sides}
for r in range(rounds):
    for name, sw in (sides.items() if r % 2 == 0 else reversed(list(sides.items()))):
        ext.set_tuning(**sw)
        o = llm.generate([list(ids)], SP(temperature=0, max_tokens=tokens, ignore_eos=True))[0]
        res[name].append(round(o.stats.decode_tokens_per_s, 1))
ext.set_tuning(**base)
print(json.dumps({"model": opt.model or "default", "runs": res,
                  "median": {k: statistics.median(v) for k, v in res.items()},
                  "priced": llm.predicted_decode_at(o.stats.mean_decode_positions)}, indent=1))
