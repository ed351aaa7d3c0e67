import os, sys, inspect, textwrap, time, torch
from tiered import LLM, EngineConfig, SamplingParams
path = "/root/.cache/tiered/bench/qwen3moe-L8-D2048-H32x128kv4-E128k8F768-Q4_0-smollm2-tok-v3.gguf"
llm = LLM(path, EngineConfig())
toks = llm.encode(inspect.getsource(textwrap) * 4)
n = 512
for _ in range(2): llm.generate([list(toks[:n])], SamplingParams(max_tokens=1))
from torch.profiler import profile, ProfilerActivity
with profile(activities=[ProfilerActivity.CPU], record_shapes=True, with_stack=True) as p:
    llm.generate([list(toks[:n])], SamplingParams(max_tokens=1))
from collections import defaultdict
agg = defaultdict(lambda: [0.0, 0])
for e in p.events():
    if e.name in ("aten::copy_", "aten::_scaled_dot_product_flash_attention_for_cpu") or "rms_norm" in e.name or "rope" in e.name:
        st = [s for s in e.stack if "tiered" in s][:3]
        key = (e.name[:40], str(e.input_shapes)[:80], " | ".join(s.split("tiered/")[-1] for s in st))
        agg[key][0] += e.cpu_time_total / 1e3; agg[key][1] += 1
for k, v in sorted(agg.items(), key=lambda kv: -kv[1][0])[:25]:
    print(f"{v[0]:7.1f} ms {v[1]:4d}  {k[0]}  {k[1]}\n        {k[2]}")
