"""In-process A/B of a GGUF's prompt: its q6k / q5k / int8-g32 decode copies' prefill GEMMs past
quant/int4.dequantize_rows() rows dequantized to bf16 for oneDNN (before) or on the engine's batch_act rows through
the native kernel as the machine's tuning says (after: dequantize_rows(batch_act)), rounds alternated, medians of
TTFT; the first greedy tokens compared, and the plan's predicted TTFT."""
import json, statistics, sys, textwrap, time
import tiered.quant.int4 as int4
from tiered import LLM, SamplingParams as SP

path, rounds, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
tokens = [int(t) for t in (sys.argv[4] if len(sys.argv) > 4 else "512").split(",")]
from tiered.quant.int8 import Int8G32Linear
from tiered.quant.kquant import KQuantLinear

real = int4.dequantize_rows
after = {cls: cls.dense for cls in (KQuantLinear, Int8G32Linear)}


def before(cls):
    """cls.dense as it was: its dequantize_rows asked with no batch_act (96 rows on AVX-512)."""
    def dense(self, x):
        int4.dequantize_rows = lambda *a, **k: real("bf16")
        try:
            return after[cls](self, x)
        finally:
            int4.dequantize_rows = real
    return dense


llm = LLM(path)
text = open(textwrap.__file__).read() * 4
ids = llm.encode(text)
res, first = {}, {}
for r in range(rounds):
    for T in tokens:
        for name in ("dequantized bf16", "kernel rows"):
            for cls in after:
                cls.dense = before(cls) if name == "dequantized bf16" else after[cls]
            o = llm.generate([ids[:T]], SP(temperature=0, max_tokens=4, ignore_eos=True))[0]
            res.setdefault(f"{T}/{name}", []).append(o.stats.ttft_s)
            first[f"{T}/{name}"] = list(o.token_ids)
for cls in after:
    cls.dense = after[cls]
rep = {"model": path, "rounds": rounds, "ttft_s": res, "median": {k: statistics.median(v) for k, v in res.items()},
       "predicted_ttft_s": {T: llm.predicted_ttft_at(T) for T in tokens},
       "same_first_tokens": {T: first[f"{T}/dequantized bf16"] == first[f"{T}/kernel rows"] for T in tokens},
       "mixed_rows": llm.plan.mixed_rows, "batch_act": llm.plan.batch_act, "precision_mix": llm.plan.precision_mix}
json.dump(rep, open(out, "w"), indent=1)
print(json.dumps({k: rep[k] for k in ("median", "predicted_ttft_s", "same_first_tokens", "mixed_rows", "batch_act")}, indent=1))
