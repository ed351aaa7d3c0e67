"""In-process A/B of the int4 decode copies' weight-stream prefetch on a GGUF's decode: the machine's kernel tuning as
built (kernels/tune.py) against stream prefetches into the L2 (set_tuning(stream_prefetch=True, prefetch_l2=True)),
rounds alternated, medians of decode tok/s; greedy tokens compared."""
import json, statistics, sys, textwrap
from tiered import LLM, SamplingParams as SP
from tiered.kernels import load

path, rounds, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
ext = load()
tuned = dict(ext.tuning())
arms = {"as tuned": dict(stream_prefetch=tuned["stream_prefetch"], prefetch_l2=tuned["prefetch_l2"]),
        "prefetch to L2": dict(stream_prefetch=True, prefetch_l2=True),
        "prefetch to L1": dict(stream_prefetch=True, prefetch_l2=False)}
llm = LLM(path)
ids = llm.encode(open(textwrap.__file__).read())[:32]
res, toks = {}, {}
try:
    for r in range(rounds):
        for name, kw in arms.items():
            ext.set_tuning(**kw)
            o = llm.generate([list(ids)], SP(temperature=0, max_tokens=64, ignore_eos=True))[0]
            res.setdefault(name, []).append(o.stats.decode_tokens_per_s)
            toks[name] = list(o.token_ids)
finally:
    ext.set_tuning(**arms["as tuned"])
rep = {"model": path, "rounds": rounds, "tuning": tuned, "decode_tok_s": res,
       "median": {k: statistics.median(v) for k, v in res.items()},
       "same_greedy_tokens": all(t == toks["as tuned"] for t in toks.values())}
json.dump(rep, open(out, "w"), indent=1)
print(json.dumps({k: rep[k] for k in ("median", "tuning", "same_greedy_tokens")}, indent=1))
