# TTFT of the Mixtral-width 2-layer Q4_0 dummy (written by moe_ttft.py under /tmp) as rows of the
# native step (up to 1024 tokens, whatever the plan's mixed_rows) against the modules' prefill (mixed_rows set to 0), medians of 3 alternated in
# one process, each path's price beside it. Usage: [PROFILE=profile.json] python rows_vs_modules.py LENGTH...
import os, glob, random, statistics as st, time, sys
from tiered import LLM, EngineConfig, SamplingParams
from tiered.planner.latency_cpu import prompt_paths
path = glob.glob("/tmp/tiered-moe-*Q4_0*.gguf")[0]
llm = LLM(path, EngineConfig(profile=os.environ.get("PROFILE")))
plan = llm.plan
mixed = plan.mixed_rows
prof = llm._profile
print("mixed_rows", mixed)
rows_f, mods_f = prompt_paths(plan, llm.config, prof)
rng = random.Random(0)
for n in [int(a) for a in sys.argv[1:]]:
    ids = [rng.randrange(100, 40000) for _ in range(n)]
    res = {"rows": [], "modules": []}
    for r in range(3):
        for name, m in (("rows", 1024), ("modules", 0)):
            plan.mixed_rows = m
            if r == 0: llm.generate([ids], SamplingParams(max_tokens=1))
            t = time.perf_counter(); llm.generate([ids], SamplingParams(max_tokens=1)); res[name].append(time.perf_counter() - t)
    plan.mixed_rows = mixed
    print(f"{n}: rows {st.median(res['rows'])*1e3:.0f} ms (priced {rows_f(n)*1e3:.0f}) | modules {st.median(res['modules'])*1e3:.0f} ms (priced {mods_f(n)*1e3:.0f})", flush=True)
for L in llm.model.model.layers:
    blk = L.mlp
    r = getattr(blk, "runner", None)
    if r is not None:
        print("group_rows", r.fmt.group_rows, r.fmt.batch_act, r.fmt.grouped_rows, r.fmt.native_rows); break
