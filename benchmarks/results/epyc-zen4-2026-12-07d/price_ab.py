"""The k-quant GGUFs' decode priced with the profile's own runtime/decode_layer/<k-quant> keys (profiler 69) and without
them (op_time.step_stream's fallback: int8-g32's rate scaled by the gemv keys' ratio), against the decode measured,
in one process: each round measures once and prices both ways."""
import json, statistics, sys, textwrap, os
from dataclasses import replace
from tiered import LLM, SamplingParams as SP
import tiered.planner.auto as auto
B = os.path.expanduser("~/.cache/tiered/bench/")
models = {m: B + f"llama-L8-D4096-F14336-H32x128kv8-{m}-smollm2-tok-v1.gguf" for m in ("IQ4_XS", "Q5_K_M", "Q4_K_M")}
real = auto._cached_or_measured
def without(cuda, progress):
    hw = real(cuda, progress)
    return replace(hw, models={k: v for k, v in hw.models.items() if k not in ("runtime/decode_layer/q6k", "runtime/decode_layer/q5k", "runtime/decode_layer/iq4xs")})
out = {}
rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
for name, path in models.items():
    llm = LLM(path)
    auto._cached_or_measured = without
    old = LLM(path)
    auto._cached_or_measured = real
    ids = llm.encode(open(textwrap.__file__).read())[:32]
    res = {"measured": [], "priced (own keys)": [], "priced (fallback)": []}
    for r in range(rounds):
        o = llm.generate([list(ids)], SP(temperature=0, max_tokens=64, ignore_eos=True))[0]
        res["measured"].append(round(o.stats.decode_tokens_per_s, 1))
        res["priced (own keys)"].append(round(llm.predicted_decode_at(o.stats.mean_decode_positions), 1))
        res["priced (fallback)"].append(round(old.predicted_decode_at(o.stats.mean_decode_positions), 1))
    med = {k: statistics.median(v) for k, v in res.items()}
    out[name] = {"runs": res, "median": med, "error own": round(med["priced (own keys)"] / med["measured"] - 1, 3),
                 "error fallback": round(med["priced (fallback)"] / med["measured"] - 1, 3)}
    print(name, json.dumps(out[name]), flush=True)
    del llm, old
json.dump(out, open(sys.argv[2], "w"), indent=1)
