import sys, random, statistics, json, os, resource, time
sys.path.insert(0, "benchmarks")
import cpu_gemma3
from tiered import LLM, EngineConfig, SamplingParams
from tiered.checkpoint import default_model_path
name, L, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
path = default_model_path() if name == "smollm2" else cpu_gemma3.model_file(6)
llm = LLM(path, EngineConfig(max_context=L + 64))
sp = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
random.seed(0)
ids = [random.randrange(100, 40000) for _ in range(L)]
llm.generate([ids], sp)
res = []
for _ in range(n):
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    t = llm.generate([ids], sp)[0].stats.ttft_s
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    res.append((t, r1.ru_minflt - r0.ru_minflt, r1.ru_stime - r0.ru_stime))
rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(name, L, "ttft", round(statistics.median(r[0] for r in res), 3), "minflt", statistics.median(r[1] for r in res), "sys s", round(statistics.median(r[2] for r in res), 3), "maxrss MiB", round(rss))
