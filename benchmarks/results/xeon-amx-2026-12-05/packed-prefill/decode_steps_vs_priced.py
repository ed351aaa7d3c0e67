import time, statistics, random, torch
from tiered import LLM, EngineConfig
from tiered.engine.sampling import SamplingParams
from tiered.engine.scheduler import Scheduler
from tiered.checkpoint import default_model_path
from tiered.planner.cpu_predict import predict_decode
llm = LLM(str(default_model_path()), EngineConfig(max_batch=48, max_context=547))
plan, cfg, prof = llm.plan, llm.config, llm._profile
V = cfg.vocab_size; rng = random.Random(0)
cache = llm._cache_for(48, 547)
for B in (4, 8, 16, 32, 48):
    seqs = [llm.make_sequence([rng.randrange(10, V) for _ in range(128)], SamplingParams(max_tokens=1000, temperature=0, ignore_eos=True), False, index=i) for i in range(B)]
    sched = Scheduler(B, B)
    for s in seqs: sched.add(s)
    llm.step(sched, cache)
    fw, st = [], []
    orig = llm._forward
    def f(*a, **k):
        t = time.perf_counter(); r = orig(*a, **k); fw.append(time.perf_counter() - t); return r
    llm._forward = f
    for _ in range(10):
        t = time.perf_counter(); llm.step(sched, cache); st.append(time.perf_counter() - t)
    llm._forward = orig
    c = seqs[0].num_tokens
    pr = predict_decode(cfg, prof, plan.precision, context=c, batch=B, mix=plan.precision_mix, kv_format=plan.dtypes["kv_cache"], head_dtype=plan.dtypes.get("lm_head"), batch_act=plan.batch_act, expert_act=plan.expert_act, bursts=False)[1] * 1e3
    print(B, "step", round(statistics.median(st)*1e3, 2), "forward", round(statistics.median(fw[1:])*1e3, 2), "priced", pr)
    for s in seqs: sched.finish(s) if hasattr(sched, "finish") else None
