"""Priced vs measured decode (ms/token) of SmolLM2 default and the Gemma-3-4B-width Q4_0 file (6 layers), this
machine: each model's plan price at the run's positions, and the median of 5 runs of 128 greedy tokens, the two
models' runs alternated."""
import sys, statistics, json
sys.path.insert(0, "benchmarks")
import cpu_gemma3
from tiered import LLM, EngineConfig, SamplingParams
from tiered.checkpoint import default_model_path

sp = SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True)
prompt = "Write a long story about a robot who learns to paint."
llms = {name: LLM(path, EngineConfig(max_context=1024))
        for name, path in (("smollm2", default_model_path()), ("gemma3-6L", cpu_gemma3.model_file(6)))}
meas = {n: [] for n in llms}
pos = {}
for n, llm in llms.items():
    llm.generate(prompt, sp)
for _ in range(int(sys.argv[1]) if len(sys.argv) > 1 else 5):
    for n, llm in llms.items():
        st = llm.generate(prompt, sp)[0].stats
        meas[n].append(1e3 / st.decode_tokens_per_s)
        pos[n] = st.mean_decode_positions
res = {}
for n, llm in llms.items():
    priced = 1e3 / llm.predicted_decode_at(pos[n])
    m = statistics.median(meas[n])
    res[n] = {"priced_ms": priced, "measured_ms": m, "runs": meas[n], "error": priced / m - 1}
    print(f"{n}: priced {priced:.2f} ms, measured {m:.2f} ms ({min(meas[n]):.2f}-{max(meas[n]):.2f}), "
          f"price/measured {priced / m:.3f}")
json.dump(res, open(sys.argv[2] if len(sys.argv) > 2 else "/tmp/s100/decode_price.json", "w"), indent=1)
