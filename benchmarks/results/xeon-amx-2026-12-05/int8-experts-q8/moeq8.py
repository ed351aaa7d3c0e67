import sys, time, statistics, random, os
from pathlib import Path
from tiered.bench.gguf_moe import qwen3_30b_a3b, write_dummy_moe_gguf
tag = sys.argv[1]
from tiered.bench.gguf_moe import MoEShape
few = os.environ.get("FEW") == "1"
path = Path("/tmp/s83/moe/q8moe-few.gguf" if few else "/tmp/s83/moe/q8moe.gguf")
if not path.exists():
    write_dummy_moe_gguf(path, MoEShape(layers=4, hidden=2048, heads=16, kv_heads=4, head_dim=128, experts=8, top_k=2, expert_ffn=5632) if few else qwen3_30b_a3b(4), qtype="Q8_0")
from tiered import LLM, EngineConfig
from tiered.engine.sampling import SamplingParams
from tiered.engine.scheduler import Scheduler
from tiered.planner.cpu_predict import predict_decode
llm = LLM(str(path), EngineConfig(max_batch=16, max_context=512))
plan, cfg, prof = llm.plan, llm.config, llm._profile
print(tag, plan.precision, plan.batch_act, plan.expert_act, plan.dtypes, flush=True)
V = cfg.vocab_size
rng = random.Random(0)
# batch 1
sp = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
ids = [rng.randrange(10, V) for _ in range(16)]
r1 = []
for _ in range(3):
    o = llm.generate([ids], sp)[0]; r1.append(o.stats.decode_tokens_per_s)
print(tag, "batch-1 tok/s", [round(r, 1) for r in r1], flush=True)
# prompt TTFT 128
ttft = []
for _ in range(3):
    p = [rng.randrange(10, V) for _ in range(128)]
    ttft.append(llm.generate([p], SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))[0].stats.ttft_s)
print(tag, "TTFT128", [round(t * 1e3) for t in ttft], "ms", flush=True)
for B in (16, 4):
    seqs = [llm.make_sequence([rng.randrange(10, V) for _ in range(32)], SamplingParams(max_tokens=1000, temperature=0, ignore_eos=True), False, index=i) for i in range(B)]
    sched = Scheduler(B, B)
    for s in seqs: sched.add(s)
    cache = llm._cache_for(B, 512)
    llm.step(sched, cache)
    ts = []
    for _ in range(8):
        t = time.perf_counter(); llm.step(sched, cache); ts.append(time.perf_counter() - t)
    pr = predict_decode(cfg, prof, plan.precision, context=40, kv_format=plan.dtypes["kv_cache"], head_dtype=plan.dtypes.get("lm_head"), batch=B, batch_act=plan.batch_act, experts_format=plan.dtypes.get("experts"), expert_act=plan.expert_act)[1]
    print(tag, B, f"step measured {statistics.median(ts)*1e3:.1f} ms priced {pr*1e3:.1f}", flush=True)
