import sys, time, random, collections
sys.path.insert(0, "benchmarks")
import cpu_gemma3, torch
from tiered import LLM, EngineConfig, SamplingParams
from tiered.quant import int4 as I
llm = LLM(cpu_gemma3.model_file(6), EngineConfig(max_context=2048 + 64))
sp = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
random.seed(0)
ids = [random.randrange(100, 40000) for _ in range(1024)]
llm.generate([ids], sp)
rec = collections.defaultdict(list)
real_mm, real_lin = torch.mm, torch.nn.functional.linear
def mm(a, b, *args, **kw):
    t0 = time.perf_counter(); r = real_mm(a, b, *args, **kw); rec[("mm", tuple(a.shape), tuple(b.shape), b.is_contiguous())].append(time.perf_counter() - t0); return r
def lin(x, w, b=None):
    t0 = time.perf_counter(); r = real_lin(x, w, b); rec[("linear", tuple(x.shape), tuple(w.shape))].append(time.perf_counter() - t0); return r
I.torch.mm = mm
I.F.linear = lin
t0 = time.perf_counter()
st = llm.generate([ids], sp)[0].stats
print("ttft", st.ttft_s)
I.torch.mm, I.F.linear = real_mm, real_lin
tot = 0
for k, v in sorted(rec.items(), key=lambda kv: -sum(kv[1])):
    tot += sum(v)
    print(k, len(v), f"{sum(v)*1e3:.1f} ms")
print("total", tot)
