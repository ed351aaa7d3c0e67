# One Mixtral-width (or WIDTH) int4 expert at a few prompt rows: seconds of its kernel groups (ExpertFormat.grouped)
# and of its AMX path (ExpertFormat.dequantized), 4 slab copies cycled, medians of 3 rounds, beside the prices of
# both (cpu_predict._native_expert_rows_time, op_time.amx_gemm_time). Usage: python
# expert_price.py 4096x14336 8,16,24,32 profile.json
# absolute seconds per expert (grouped native vs AMX dequantized path) and the planner's prices, per rows
import sys, statistics as st, time, torch
from tiered.kernels.tune import _experts
from tiered.hardware.profile import HardwareProfile
from tiered.hardware import op_time
from tiered.planner.cpu_predict import _native_expert_rows_time
from tiered.quant.experts import NATIVE_ROWS
hw = HardwareProfile.load(sys.argv[3]) if hasattr(HardwareProfile, "load") else None
W = tuple(int(a) for a in sys.argv[1].split("x"))
ef, slots = _experts("int4", 0, "q8", W, exact_zeros=True, slab=True, at_least=4, batch_act="q8")
D, F = W
wb = ef.nbytes; macs = 3 * D * F
for rows in [int(a) for a in sys.argv[2].split(",")]:
    x = torch.randn(rows, D).to(torch.bfloat16)
    res = {"g": [], "d": []}
    with torch.inference_mode():
        for r in range(4):
            for k, fn in (("g", lambda s: ef.grouped(x, [s], [0, rows])), ("d", lambda s: ef.dequantized(x, s))):
                t = time.perf_counter()
                for s in slots: fn(s)
                res[k].append((time.perf_counter() - t) / len(slots))
    g, d = st.median(res["g"][1:]), st.median(res["d"][1:])
    pg = _native_expert_rows_time(hw, op_time.gemv_dtype("int4", "q8"), rows, NATIVE_ROWS, wb, macs, 0.0)
    pa = op_time.amx_gemm_time(hw, rows * macs, wb, calls=3)
    print(f"{rows:3d} grouped {g*1e3:6.2f} ms (priced {pg*1e3:6.2f}) | amx {d*1e3:6.2f} ms (priced {pa*1e3:6.2f})", flush=True)
