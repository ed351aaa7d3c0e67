"""A k-quant MoE GGUF: decode tok/s of the default engine (experts' k-quant kinds) against the same file with the
experts forced to the int8-g32 copies (--expert-weights), rounds alternated in one process."""
import sys, time, statistics, torch
from tiered import LLM, EngineConfig, SamplingParams
import tiered.quant.gguf_experts as GE
path, alt = sys.argv[1], "int8-g32 copies"
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 3
llms = {"auto": LLM(path, EngineConfig())}
saved = dict(GE.KQUANT_OF_FORMAT); GE.KQUANT_OF_FORMAT.clear()
llms[alt] = LLM(path, EngineConfig())
GE.KQUANT_OF_FORMAT.update(saved)
for n, l in llms.items():
    print(n, l.plan.dtypes["experts"], [x for x in l.plan.notes if "expert" in x][:2], flush=True)
prompt = list(range(100, 132))
sp = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
res = {n: [] for n in llms}
outs = {}
for r in range(rounds):
    for n, l in (llms.items() if r % 2 == 0 else reversed(llms.items())):
        o = l.generate([prompt], sp)[0]
        res[n].append(o.stats.decode_tokens_per_s); outs[n] = o.token_ids
print({n: [round(v, 1) for v in vs] for n, vs in res.items()})
print({n: round(statistics.median(vs), 2) for n, vs in res.items()}, "same tokens:", outs["auto"] == outs[alt])
for n, l in llms.items():
    print(n, "priced", round(l.predicted_decode_at(80) if hasattr(l, "predicted_decode_at") else -1, 1))
