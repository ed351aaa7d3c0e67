import re, sys, time, resource
from pathlib import Path
sys.path.insert(0, "benchmarks")
import cpu_gemma3
from tiered import LLM, EngineConfig, SamplingParams
path = cpu_gemma3.model_file(6)
def rss():
    return int(re.search(r"VmRSS:\s+(\d+)", Path("/proc/self/status").read_text()).group(1)) * 1024
def hwm():
    return int(re.search(r"VmHWM:\s+(\d+)", Path("/proc/self/status").read_text()).group(1)) * 1024
t0 = time.perf_counter()
llm = LLM(path, EngineConfig())
t1 = time.perf_counter()
r0, h0 = rss(), hwm()
out = llm.generate("hello there, tell me a story", SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
print(f"context {llm.max_context} load {t1-t0:.2f}s rss_after_load {r0/2**20:.0f} MiB peak_load {h0/2**20:.0f} MiB rss_after_gen {rss()/2**20:.0f} MiB filled {getattr(llm.model.rotary, 'filled', None)}")
