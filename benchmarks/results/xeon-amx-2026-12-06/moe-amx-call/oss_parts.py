import os, sys, time, random, collections, statistics as st
from pathlib import Path
from tiered import LLM, EngineConfig, SamplingParams
from tiered.bench.gguf_moe import gpt_oss_20b, write_dummy_moe_gguf
from tiered.checkpoint import default_model_path
from tiered.quant import experts as qe
import tiered.quant.int4 as q4
shape = gpt_oss_20b(4)
path = Path(f"/tmp/tiered-moe-{shape.tag('Q8_0-MXFP4')}.gguf")
if not path.exists():
    write_dummy_moe_gguf(path.with_suffix(".part"), shape, qtype="Q8_0", tokenizer_from=default_model_path(), expert_qtype="MXFP4")
    path.with_suffix(".part").rename(path)
llm = LLM(str(path), EngineConfig())
print("mixed_rows", llm.plan.mixed_rows, flush=True)
stats = collections.defaultdict(float); cnt = collections.Counter()
def wrap(cls, name, key):
    orig = getattr(cls, name)
    def f(*a, **k):
        t = time.perf_counter(); y = orig(*a, **k); stats[key] += time.perf_counter() - t; cnt[key] += 1; return y
    setattr(cls, name, f)
wrap(qe.ExpertFormat, "_biased_glu", "biased_glu")
wrap(qe.ExpertFormat, "forward_group", "forward_group")
orig_amx = q4.amx_gemm
def amx(*a, **k):
    t = time.perf_counter(); y = orig_amx(*a, **k); stats["amx"] += time.perf_counter() - t; cnt["amx"] += 1; return y
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
rng = random.Random(0)
for n in [int(a) for a in sys.argv[1:]]:
    ids = [rng.randrange(100, 40000) for _ in range(n)]
    llm.generate([ids], SamplingParams(max_tokens=1))
    for r in range(2):
        stats.clear(); cnt.clear()
        t = time.perf_counter(); llm.generate([ids], SamplingParams(max_tokens=1)); tot = time.perf_counter() - t
        print(n, f"total {tot*1e3:.0f} ms priced {(llm.predicted_ttft_at(n) or 0)*1e3:.0f}", {k: f"{v*1e3:.1f}" for k, v in stats.items()}, dict(cnt), flush=True)
