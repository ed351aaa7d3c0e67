import sys, time, statistics
import torch
from tiered import LLM, EngineConfig, SamplingParams
from tiered.bench.checkpoint import ModelShape, write_dummy_checkpoint
shape = ModelShape(layers=2, hidden=2048, ffn=768, heads=32, kv_heads=4, vocab=8192, experts=128, top_k=8, routing="uniform")
path = write_dummy_checkpoint("/root/.cache/tiered/bench/finegrained-uniform-L2", shape)
for B in [int(b) for b in sys.argv[1:]]:
    llm = LLM(str(path), EngineConfig(max_batch=B, max_context=512, expert_weights=__import__("os").environ.get("EW", "auto")))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, 8000, (24,), generator=g).tolist() for _ in range(B)]
    llm.generate(prompts, SamplingParams(max_tokens=4))
    res = []
    for r in range(3):
        outs = llm.generate(prompts, SamplingParams(max_tokens=65, temperature=0, ignore_eos=True))
        res.append(B / statistics.median(o.stats.itl_s for o in outs))
    st = llm.runtime_stats() if hasattr(llm, "runtime_stats") else {}
    price = llm.predicted_decode_at(56, batch=B > 1)
    print(f"B={B} measured {statistics.median(res):.1f} tok/s {[round(x,1) for x in res]}; priced at 56 positions {price:.1f}; dtypes {llm.plan.dtypes.get('experts')}", flush=True)
    llm.close()
