import os, sys, inspect, textwrap, time, collections, torch
from tiered import LLM, EngineConfig, SamplingParams
from tiered.quant import experts as qe
import tiered.quant.int4 as q4
path = "/root/.cache/tiered/bench/qwen3moe-L8-D2048-H32x128kv4-E128k8F768-Q4_0-smollm2-tok-v3.gguf"
llm = LLM(path, EngineConfig())
n = int(sys.argv[1])
ids = list(llm.encode(inspect.getsource(textwrap))[:n])
llm.generate([ids], SamplingParams(max_tokens=1))
stats = collections.defaultdict(float); cnt = collections.Counter()
orig_fwd = qe.ExpertFormat.forward
def fwd(self, x, slot):
    t = time.perf_counter(); y = orig_fwd(self, x, slot); stats["forward"] += time.perf_counter() - t; cnt["forward"] += 1; cnt[("rows", x.shape[0] // 8 * 8)] += 1
    return y
orig_amx = q4.amx_gemm
def amx(*a, **k):
    t = time.perf_counter(); y = orig_amx(*a, **k); stats["amx"] += time.perf_counter() - t; cnt["amx"] += 1
    return y
qe.ExpertFormat.forward = fwd
import tiered.quant.experts
for m in list(sys.modules.values()):
    if m and getattr(m, "amx_gemm", None) is orig_amx: m.amx_gemm = amx
orig_lc = qe.ExpertFormat.layer_call
def lc(self, x, slots):
    call = orig_lc(self, x, slots)
    if call is None: return None
    def timed(*a, **k):
        t = time.perf_counter(); y = call(*a, **k); stats["layer_call"] += time.perf_counter() - t; return y
    return timed
qe.ExpertFormat.layer_call = lc
for r in range(2):
    stats.clear(); cnt.clear()
    t = time.perf_counter(); llm.generate([ids], SamplingParams(max_tokens=1)); tot = time.perf_counter() - t
    print(f"total {tot*1e3:.0f} ms", {k: f"{v*1e3:.1f}" for k, v in stats.items()}, dict(cnt), flush=True)
from tiered.planner import cpu_predict
from tiered.hardware import op_time
hw = llm._profile
per = collections.defaultdict(list)
def fwd2(self, x, slot):
    t = time.perf_counter(); y = orig_fwd(self, x, slot); per[x.shape[0]].append(time.perf_counter() - t)
    return y
qe.ExpertFormat.forward = fwd2
llm.generate([ids], SamplingParams(max_tokens=1))
D, F = 2048, 768
wb = 3 * D * F * 0.5625
macs = 3 * D * F
for r in sorted(per):
    if len(per[r]) < 5: continue
    import statistics
    m = statistics.median(per[r]) * 1e3
    amxp = op_time.amx_gemm_time(hw, r * macs, wb, calls=3) * 1e3
    pe = cpu_predict.prompt_expert_time(hw, "int4", r, wb, macs, batch_act="q8")
    print(f"rows {r}: n={len(per[r])} measured {m:.3f} ms, amx priced {amxp:.3f}, prompt_expert_time {pe*1e3 if pe else 0:.3f}")
