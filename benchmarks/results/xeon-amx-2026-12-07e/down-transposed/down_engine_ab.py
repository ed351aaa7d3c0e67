"""A/B in one process: the Gemma-3-4B-width 6-layer Q4_0 file's prompt TTFT, the down projection's GEMM over the
GLU's transposed output as y^T = W x^T (new) against F.linear over the transposed view (before), alternated."""
import sys, random, statistics, json
sys.path.insert(0, "benchmarks")
import cpu_gemma3
from tiered import LLM, EngineConfig, SamplingParams
from tiered.quant import int4 as I
L, rounds = int(sys.argv[1]), int(sys.argv[2])
llm = LLM(cpu_gemma3.model_file(6), EngineConfig(max_context=L + 64))
sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
random.seed(0)
ids = [random.randrange(100, 40000) for _ in range(L)]
real = I._transposed
modes = {"y^T = W x^T": real, "F.linear over the view": lambda x: False}
out = {m: [] for m in modes}
tokens = {}
llm.generate([ids], sp)
for r in range(rounds):
    for m, fn in (modes.items() if r % 2 == 0 else reversed(modes.items())):
        I._transposed = fn
        o = llm.generate([ids], sp)[0]
        out[m].append(o.stats.ttft_s)
        tokens[m] = o.token_ids
I._transposed = real
res = {m: {"median_s": statistics.median(v), "runs": v} for m, v in out.items()}
for m, v in res.items():
    print(f"{L} tokens, {m}: TTFT {v['median_s']:.3f} s (runs {', '.join(f'{x:.3f}' for x in v['runs'])})")
print("same tokens:", len(set(map(tuple, tokens.values()))) == 1)
json.dump({"tokens": L, "modes": res, "same_tokens": len(set(map(tuple, tokens.values()))) == 1},
          open(f"/tmp/s100/down_ab_{L}.json", "w"), indent=1)
