import sys, time, random, statistics as st
from tiered import LLM, SamplingParams, EngineConfig
from tiered.checkpoint import default_model_path
from tiered.engine import llm as llm_mod
llm = LLM(str(default_model_path()), EngineConfig(max_batch=32, profile=sys.argv[1]))
print(llm.plan.summary()[:200], llm.plan.most_prompt_rows(), llm.plan.prefill_chunk)
rng = random.Random(0); V = llm.config.vocab_size
tm = {}
orig = llm_mod.LLM._prefill
def pf(self, seqs, cache):
    t = time.perf_counter(); r = orig(self, seqs, cache); tm.setdefault(len(seqs), []).append(time.perf_counter() - t); return r
llm_mod.LLM._prefill = pf
sp = SamplingParams(max_tokens=1)
for k, n in [(1, 480), (4, 120), (2, 240), (8, 60), (1, 960), (4, 240)]:
    tm.clear()
    for r in range(4):
        ps = [[rng.randrange(10, V) for _ in range(n + r)] for _ in range(k)]
        llm.generate(ps, sp)
    print(k, n, {kk: f"{st.median(v)*1e3:.1f}ms x{len(v)}" for kk, v in tm.items()})
