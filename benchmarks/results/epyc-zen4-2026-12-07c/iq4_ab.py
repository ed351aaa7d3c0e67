"""In-process A/B: the same GGUF with its IQ4_XS tensors decoded from int8-g32 copies of their codebook values
(before: quant/linear.GGUF_DECODE_KIND's IQ4_XS "int8-g32") and as stored (after: "iq4xs", quant/kquant.IQ4XSLinear),
rounds alternated, medians; greedy tokens compared."""
import json, statistics, sys, textwrap
import tiered.quant.linear as ql
from tiered import LLM, SamplingParams as SP
path, rounds, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
saved = dict(ql.GGUF_DECODE_KIND)
ql.GGUF_DECODE_KIND.update({"IQ4_XS": "int8-g32"})
before = LLM(path)
ql.GGUF_DECODE_KIND.update(saved)
after = LLM(path)
ids = before.encode(open(textwrap.__file__).read())[:32]
res = {"int8-g32 copies": [], "as stored": []}; toks = {}; pri = {}; mix = {}
for r in range(rounds):
    for name, llm in (("int8-g32 copies", before), ("as stored", after)):
        o = llm.generate([list(ids)], SP(temperature=0, max_tokens=64, ignore_eos=True))[0]
        res[name].append(o.stats.decode_tokens_per_s); toks[name] = list(o.token_ids)
        pri[name] = llm.predicted_decode_at(o.stats.mean_decode_positions); mix[name] = llm.plan.precision_mix
rep = {"model": path, "rounds": rounds, "decode_tok_s": res, "median": {k: statistics.median(v) for k, v in res.items()},
       "priced": pri, "precision_mix": mix,
       "same_greedy_tokens": sum(a == b for a, b in zip(*toks.values())), "tokens": len(toks["as stored"])}
json.dump(rep, open(out, "w"), indent=1)
print(json.dumps({k: rep[k] for k in ("median", "priced", "same_greedy_tokens", "precision_mix")}, indent=1))
