import time, random, statistics, torch
from tiered import LLM, EngineConfig
from tiered.engine.sampling import SamplingParams
from tiered.checkpoint import default_model_path
llm = LLM(str(default_model_path()), EngineConfig(max_context=1100, max_batch=8))
rng = random.Random(0)
sp = SamplingParams(max_tokens=1, temperature=0)
prompts = [[rng.randrange(100, 40000) for _ in range(T)] for T in (446, 300, 195)]
for _ in range(3): llm.generate(prompts, sp)
from torch.profiler import profile, ProfilerActivity
with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
    for _ in range(3): llm.generate(prompts, sp)
print(prof.key_averages(group_by_input_shape=True).table(sort_by="self_cpu_time_total", row_limit=30))
