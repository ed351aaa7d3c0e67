"""Decode priced against measured, one process: SmolLM2 and the bench GGUFs (Q4_K_M, Q5_K_M, IQ4_XS), 3 rounds each."""
import json, statistics, sys, textwrap, os
from tiered import LLM, SamplingParams as SP
B = os.path.expanduser("~/.cache/tiered/bench/")
models = {"SmolLM2 (default)": None} | {m: B + f"llama-L8-D4096-F14336-H32x128kv8-{m}-smollm2-tok-v1.gguf" for m in ("Q4_K_M", "Q5_K_M", "IQ4_XS")}
out = {}
for name, path in models.items():
    llm = LLM(path) if path else LLM()
    ids = llm.encode(open(textwrap.__file__).read())[:32]
    runs, priced = [], []
    for r in range(int(sys.argv[1]) if len(sys.argv) > 1 else 3):
        o = llm.generate([list(ids)], SP(temperature=0, max_tokens=64, ignore_eos=True))[0]
        runs.append(round(o.stats.decode_tokens_per_s, 1)); priced.append(round(llm.predicted_decode_at(o.stats.mean_decode_positions), 1))
    m, p = statistics.median(runs), statistics.median(priced)
    out[name] = {"measured": runs, "priced": priced, "median_measured": m, "median_priced": p, "error": round(p / m - 1, 3),
                 "precision_mix": llm.plan.precision_mix}
    print(name, out[name], flush=True)
    del llm
json.dump(out, open(sys.argv[2] if len(sys.argv) > 2 else "/tmp/s104/price.json", "w"), indent=1)
