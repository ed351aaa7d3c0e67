"""SmolLM2 default engine, max_batch B: B prompts of P tokens admitted together (prefilled as rows of native steps),
their prefill time (the last first token) with the bf16 attention on AVX512-BF16 against without it, alternated;
and the plan's price of that block (latency_cpu.block_prefill_time's rows(g P, prompts=g))."""
import os, sys, random, statistics, json
from tiered import LLM, EngineConfig, SamplingParams, kernels
from tiered.planner.latency_cpu import prompt_paths
ext = kernels.load()
B, P, rounds = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
llm = LLM(None, EngineConfig(max_batch=B, max_context=2048, profile=os.environ["PROFILE"]))
rows, modules = prompt_paths(llm.plan, llm.config, llm._profile)
random.seed(1)
prompts = [[random.randrange(100, 40000) for _ in range(P)] for _ in range(B)]
sp = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
llm.generate(prompts, sp)
out = {True: [], False: []}
for r in range(rounds):
    for on in ((True, False) if r % 2 == 0 else (False, True)):
        ext.bf16_attention_avx512(on)
        outs = llm.generate(prompts, sp)
        out[on].append(max(o.stats.ttft_s for o in outs))
ext.bf16_attention_avx512(True)
print(f"B={B} P={P}: bf16 {statistics.median(out[True]):.3f} s, without {statistics.median(out[False]):.3f} s; "
      f"priced rows(B P, prompts=B) {rows(B * P, prompts=B):.3f} s, one by one {B * rows(P):.3f}; mixed_rows {llm.plan.mixed_rows}")
