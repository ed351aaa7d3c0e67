# TTFT of a dummy-weight Q4_0 GGUF at Mixtral-8x7B's layer widths (2 layers: hidden 4096, 32 / 8 heads of 128, 8
# experts of 14336, top-2; SmolLM2's tokenizer) through the default engine: median of 3 a length after one warm-up,
# each beside the plan's price (LLM.predicted_ttft_at), "measured/priced" ms. Usage: [PROFILE=profile.json] python
# moe_ttft.py mixtral LENGTH... (the file is written once under /tmp; `gpt-oss` for gpt-oss-20b's widths).
import os, random, statistics as st, sys, time
from pathlib import Path
from tiered import LLM, EngineConfig, SamplingParams
from tiered.bench.gguf_moe import MoEShape, gpt_oss_20b, write_dummy_moe_gguf
from tiered.checkpoint import default_model_path

arch = sys.argv[1]
shape = (gpt_oss_20b(4) if arch == "gpt-oss" else
         MoEShape(layers=2, hidden=4096, heads=32, kv_heads=8, head_dim=128, experts=8, top_k=2, expert_ffn=14336))
oss = arch == "gpt-oss"  # ggml-org/gpt-oss-20b-GGUF's types: Q8_0 attention, MXFP4 experts
tag = shape.tag("Q8_0-MXFP4" if oss else "Q4_0")
path = Path(f"/tmp/tiered-moe-{tag}.gguf")
if not path.exists():
    write_dummy_moe_gguf(path.with_suffix(".part"), shape, qtype="Q8_0" if oss else "Q4_0",
                         tokenizer_from=default_model_path(), **({"expert_qtype": "MXFP4"} if oss else {}))
    path.with_suffix(".part").rename(path)
llm = LLM(str(path), EngineConfig(profile=os.environ.get("PROFILE")))  # PROFILE: one profile both sides
rng = random.Random(0)
out = []
for n in [int(a) for a in sys.argv[2:]]:
    ids = [rng.randrange(100, 40000) for _ in range(n)]
    llm.generate([ids], SamplingParams(max_tokens=1))
    ts = []
    for _ in range(3):
        t = time.perf_counter(); llm.generate([ids], SamplingParams(max_tokens=1)); ts.append((time.perf_counter() - t) * 1e3)
    out.append(f"{n}:{st.median(ts):.0f}/{(llm.predicted_ttft_at(n) or 0)*1e3:.0f}")
print(" ".join(out), flush=True)
