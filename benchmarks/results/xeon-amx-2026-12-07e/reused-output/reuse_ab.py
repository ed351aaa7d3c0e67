"""A/B in one process: the Gemma-3-4B-width 6-layer file's prompt TTFT and minor page faults, the chunked gate / up
GEMM's y^T from the reused buffer (new) against a fresh tensor each call (before), alternated."""
import sys, random, statistics, json, resource
sys.path.insert(0, "benchmarks")
import cpu_gemma3, torch
from tiered import LLM, EngineConfig, SamplingParams
from tiered.quant import int4 as I
L, rounds = int(sys.argv[1]), int(sys.argv[2])
llm = LLM(cpu_gemma3.model_file(6), EngineConfig(max_context=L + 64))
sp = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
random.seed(0)
ids = [random.randrange(100, 40000) for _ in range(L)]
real = I._reused_output
modes = {"reused y^T": real, "fresh y^T": lambda N, T, dtype: torch.empty(N, T, dtype=dtype)}
out = {m: [] for m in modes}
llm.generate([ids], sp)
for r in range(rounds):
    for m, fn in (modes.items() if r % 2 == 0 else reversed(modes.items())):
        I._reused_output = fn
        r0 = resource.getrusage(resource.RUSAGE_SELF)
        t = llm.generate([ids], sp)[0].stats.ttft_s
        r1 = resource.getrusage(resource.RUSAGE_SELF)
        out[m].append((t, r1.ru_minflt - r0.ru_minflt, r1.ru_stime - r0.ru_stime))
I._reused_output = real
res = {m: {"ttft_median_s": statistics.median(x[0] for x in v), "minflt_median": statistics.median(x[1] for x in v),
           "sys_s_median": statistics.median(x[2] for x in v), "runs": v} for m, v in out.items()}
for m, v in res.items():
    print(f"{L} tokens, {m}: TTFT {v['ttft_median_s']:.3f} s, minor faults {v['minflt_median']:.0f}, system {v['sys_s_median']:.3f} s")
json.dump({"tokens": L, "modes": res}, open(f"/tmp/s100/reuse_ab_{L}.json", "w"), indent=1)
