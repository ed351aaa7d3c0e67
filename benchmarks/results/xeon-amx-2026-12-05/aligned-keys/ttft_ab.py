import time, random, statistics, sys
from tiered import LLM, EngineConfig
from tiered.engine.sampling import SamplingParams
from tiered.checkpoint import default_model_path
llm = LLM(str(default_model_path()))
rng = random.Random(0)
sp = SamplingParams(max_tokens=1, temperature=0)
Ts = (100, 270, 446, 500, 777, 941)
ids = {T: [rng.randrange(100, 40000) for _ in range(T)] for T in Ts}
res = {T: [] for T in Ts}
for T in Ts: llm.generate([ids[T]], sp)
for r in range(5):
    for T in Ts:
        t = time.perf_counter(); llm.generate([ids[T]], sp); res[T].append(time.perf_counter() - t)
print(sys.argv[1], " ".join(f"{T}:{statistics.median(res[T]) * 1e3:.1f}" for T in Ts))
