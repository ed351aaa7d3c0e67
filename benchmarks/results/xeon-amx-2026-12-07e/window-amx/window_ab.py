"""A/B in one process: a Gemma-3-4B-width 6-layer Q4_0 file's long prompt, its sliding layers' chunks on the AMX
kernel with their window (new) against torch's SDPA under the window's mask (before), alternated, TTFT medians."""
import sys, random, statistics, json, time
sys.path.insert(0, "benchmarks")
import cpu_gemma3
from tiered import LLM, EngineConfig, SamplingParams
from tiered.models import layers
L, rounds = int(sys.argv[1]), int(sys.argv[2])
llm = LLM(cpu_gemma3.model_file(6), EngineConfig(max_context=L + 64))
sp = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
random.seed(0)
ids = [random.randrange(100, 40000) for _ in range(L)]
real = layers.attend
def before(q, k, v, mask, causal, scale, gqa, past=None, window=0):
    return real(q, k, v, mask, causal, scale, gqa, None if window else past, 0)
modes = {"window on AMX": real, "window by SDPA": before}
out = {m: [] for m in modes}
llm.generate([ids], sp)
for r in range(rounds):
    for m, fn in (modes.items() if r % 2 == 0 else reversed(modes.items())):
        layers.attend = fn
        out[m].append(llm.generate([ids], sp)[0].stats.ttft_s)
layers.attend = real
res = {m: {"median_s": statistics.median(v), "runs": v} for m, v in out.items()}
for m, v in res.items():
    print(f"{L} tokens, {m}: TTFT {v['median_s']:.3f} s (runs {', '.join(f'{x:.3f}' for x in v['runs'])})")
json.dump({"tokens": L, "modes": res}, open(f"/tmp/s100/window_ab_{L}.json", "w"), indent=1)
