# SmolLM2's default engine: TTFT as rows of the native step (mixed_rows 1024) vs the modules' prefill (0), medians
# of 5 alternated in one process, each path's price beside it. Usage: [PROFILE=...] python smol_rvm.py LENGTH...
import os, random, statistics as st, sys, time
from tiered import LLM, EngineConfig, SamplingParams
from tiered.planner.latency_cpu import prompt_paths
llm = LLM(None, EngineConfig(profile=os.environ.get("PROFILE")))
plan = llm.plan; mixed = plan.mixed_rows
rows_f, mods_f = prompt_paths(plan, llm.config, llm._profile)
print("mixed_rows", mixed, flush=True)
rng = random.Random(0)
for n in [int(a) for a in sys.argv[1:]]:
    ids = [rng.randrange(100, 40000) for _ in range(n)]
    res = {"rows": [], "modules": []}
    for r in range(5):
        for name, m in (("rows", 1024), ("modules", 0)):
            plan.mixed_rows = m
            if r == 0: llm.generate([ids], SamplingParams(max_tokens=1))
            t = time.perf_counter(); llm.generate([ids], SamplingParams(max_tokens=1)); res[name].append(time.perf_counter() - t)
    plan.mixed_rows = mixed
    print(f"{n}: rows {st.median(res['rows'])*1e3:.1f} ms (priced {rows_f(n)*1e3:.1f}) | modules {st.median(res['modules'])*1e3:.1f} ms (priced {mods_f(n)*1e3:.1f})", flush=True)
