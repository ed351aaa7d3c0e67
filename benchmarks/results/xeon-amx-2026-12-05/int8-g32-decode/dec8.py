import sys, time, statistics, random
from tiered import LLM, EngineConfig
from tiered.engine.sampling import SamplingParams
from tiered.checkpoint import default_model_path
from tiered.planner.cpu_predict import predict_decode
from tiered.engine.scheduler import Scheduler
tag = sys.argv[1]
llm = LLM(str(default_model_path()), EngineConfig(decode_weights="int8", max_batch=48, max_context=1024))
plan, cfg, prof = llm.plan, llm.config, llm._profile
print(tag, plan.precision, plan.batch_act, plan.dtypes.get("lm_head"), flush=True)
ids = llm.encode("Write a short story about a robot learning to paint.")
sp = SamplingParams(max_tokens=128, temperature=0, ignore_eos=True)
rates = []
for _ in range(3):
    t0 = time.perf_counter(); out = list(llm.stream(ids, sp)); t = time.perf_counter() - t0
    rates.append(len(out) / t)
pr1 = predict_decode(cfg, prof, plan.precision, context=len(ids) + 64, kv_format=plan.dtypes["kv_cache"], head_dtype=plan.dtypes.get("lm_head"), bursts=True)[1]
print(tag, "batch-1 tok/s", [round(r, 1) for r in rates], "median", round(statistics.median(rates), 1), f"priced {1/pr1:.1f}", flush=True)
rng = random.Random(0)
for B, c in ((48, 32), (8, 32)):
    seqs = [llm.make_sequence([rng.randrange(100, 40000) for _ in range(c)], SamplingParams(max_tokens=1000, temperature=0, ignore_eos=True), False, index=i) for i in range(B)]
    sched = Scheduler(B, B)
    for s in seqs: sched.add(s)
    cache = llm._cache_for(B, 1024)
    llm.step(sched, cache)
    ts = []
    for _ in range(12):
        t = time.perf_counter(); llm.step(sched, cache); ts.append(time.perf_counter() - t)
    pr = predict_decode(cfg, prof, plan.precision, context=c + 8, kv_format=plan.dtypes["kv_cache"], head_dtype=plan.dtypes.get("lm_head"), batch=B, batch_act=plan.batch_act, bursts=True)[1]
    print(tag, B, c, f"measured {statistics.median(ts)*1e3:.1f} ms priced {pr*1e3:.1f}", flush=True)
