import os, sys, inspect, textwrap, time, collections, statistics, torch
from tiered import LLM, EngineConfig, SamplingParams
import tiered.quant.int4 as q4
path = "/root/.cache/tiered/bench/qwen3moe-L8-D2048-H32x128kv4-E128k8F768-Q4_0-smollm2-tok-v3.gguf"
llm = LLM(path, EngineConfig())
print(open("/proc/self/smaps_rollup").read())
ids = list(llm.encode(inspect.getsource(textwrap))[:512])
llm.generate([ids], SamplingParams(max_tokens=1))
orig = q4.amx_gemm
per = collections.defaultdict(list)
ptrs = []
def amx(codes, residual, xb, *a, **k):
    t = time.perf_counter(); y = orig(codes, residual, xb, *a, **k); per[(tuple(codes.shape), xb.shape[0] // 16)].append(time.perf_counter() - t)
    ptrs.append(codes.data_ptr())
    return y
for m in list(sys.modules.values()):
    if m and getattr(m, "amx_gemm", None) is orig: m.amx_gemm = amx
llm.generate([ids], SamplingParams(max_tokens=1))
for k in sorted(per):
    if len(per[k]) > 20: print(k, len(per[k]), f"{statistics.median(per[k])*1e3:.3f}")
# huge pages of an expert slot
import re
addr = ptrs[0]
for line in open("/proc/self/smaps"):
    pass
