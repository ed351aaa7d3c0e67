"""A/B in one process: a long prompt's TTFT with a bf16 prompt's attention on AVX512-BF16 (csrc/gemv.cpp
attn_block_avx512: the native step's prompt rows and the modules' chunks) against without it (bf16_attention_avx512
off: the rows' fp32 FMAs over keys widened to fp32, torch's SDPA), alternated, medians; the first tokens of each."""
import sys, os, random, statistics, json
sys.path.insert(0, "benchmarks")
import cpu_gemma3
from tiered import LLM, EngineConfig, SamplingParams, kernels
model, L, rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
ext = kernels.load()
prof = os.environ.get("PROFILE")
llm = LLM(None if model == "smollm2" else cpu_gemma3.model_file(6),
          EngineConfig(max_context=L + 64, **({"profile": prof} if prof else {})))
print("plan dtypes", llm.plan.dtypes, "mixed_rows", llm.plan.mixed_rows, "priced TTFT", llm.predicted_ttft_at(L))
sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
random.seed(0)
ids = [random.randrange(100, 40000) for _ in range(L)]
llm.generate([ids[:512]], sp)
modes = {"avx512-bf16 attention": True, "without": False}
out = {m: [] for m in modes}
toks = {}
for r in range(rounds):
    for m, on in (modes.items() if r % 2 == 0 else reversed(modes.items())):
        ext.bf16_attention_avx512(on)
        o = llm.generate([ids], sp)[0]
        out[m].append(o.stats.ttft_s)
        toks[m] = o.token_ids if hasattr(o, "token_ids") else o.outputs
ext.bf16_attention_avx512(True)
res = {"model": model, "tokens": L, "plan_dtypes": llm.plan.dtypes, "priced_ttft_s": llm.predicted_ttft_at(L),
       "modes": {m: {"median_s": statistics.median(v), "runs": v} for m, v in out.items()},
       "same_tokens": str(toks["avx512-bf16 attention"]) == str(toks["without"])}
for m, v in res["modes"].items():
    print(f"{model} {L} tokens, {m}: TTFT {v['median_s']:.3f} s (runs {', '.join(f'{x:.3f}' for x in v['runs'])})")
print("same tokens", res["same_tokens"], toks)
json.dump(res, open(f"/tmp/s101/long_ab_{model}_{L}.json", "w"), indent=1)
