import time, statistics as st, torch, itertools
from pathlib import Path
from tiered import LLM, EngineConfig
from tiered.bench.gguf_moe import gpt_oss_20b
from tiered.planner import cpu_predict
from tiered.hardware import op_time
path = Path(f"/tmp/tiered-moe-{gpt_oss_20b(4).tag('Q8_0-MXFP4')}.gguf")
llm = LLM(str(path), EngineConfig())
hw = llm._profile
from tiered.runtime.moe_runner import TieredExperts
runners = [m for m in llm.model.modules() if isinstance(getattr(m, "runner", None), TieredExperts)]
r = runners[0].runner
fmt = r.fmt
print(fmt.name, fmt.shapes, fmt.nbytes, "biased_rows", fmt.biased_rows, "amx_rows", fmt.amx_rows)
slots = [r.store.resident[(k, e)] for (k, e) in r.store.resident if True][:96]
eb = fmt.nbytes
(F, Db), _, (D, Fb) = fmt.shapes
macs = 2 * F * Db + D * Fb
cyc = itertools.cycle(slots)
for rows in (40, 64, 128, 256):
    x = torch.randn(rows, D)
    for _ in range(5): fmt.native.forward_amx(next(cyc)[0], x, **fmt.glu_args)
    ts = []
    for _ in range(30):
        s = next(cyc)[0]; t = time.perf_counter(); fmt.native.forward_amx(s, x, **fmt.glu_args); ts.append(time.perf_counter() - t)
    pe = cpu_predict.prompt_expert_time(hw, "mxfp4", rows, eb, macs, "q8", True)
    amxp = op_time.amx_gemm_time(hw, rows * macs, eb, calls=3)
    print(f"rows {rows}: measured {st.median(ts)*1e3:.2f} ms, prompt_expert_time {pe*1e3:.2f}, amx {amxp*1e3:.2f}")
