import sys, time, statistics
from tiered import LLM, EngineConfig, SamplingParams
path = "/root/.cache/tiered/bench/qwen3moe-L8-D2048-H32x128kv4-E128k8F768-Q4_0-smollm2-tok-v3.gguf"
llm = LLM(path, EngineConfig(profile=sys.argv[1]))
base = llm.encode(open("/usr/lib/python3.11/textwrap.py").read(), chat=False)
llm.generate([base[:16]], SamplingParams(max_tokens=1))
out = []
for n in (24, 32, 40):
    ts = []
    for r in range(5):
        ids = base[r * 11: r * 11 + n]
        t0 = time.perf_counter(); llm.generate([ids], SamplingParams(max_tokens=1)); ts.append(time.perf_counter() - t0)
    out.append(f"{n}: {statistics.median(ts)*1e3:.1f} ms")
print("  ".join(out), flush=True)
