# forward_amx (one native call: 3 AMX GEMMs + the GLU between) against the expert's three amx_gemm calls alone, cold slots
import torch, time, statistics as st, itertools
from tiered.quant.experts import ExpertFormat
from tiered.quant.int4 import amx_gemm
from tiered.checkpoint.model_config import biased_width
def run(fmt, D, rows_list, n_slots=24):
    g = torch.Generator().manual_seed(0)
    slots = []
    for _ in range(n_slots):
        s = fmt.empty(); fmt.quantize([0.05 * torch.randn(sh, generator=g) for sh in fmt.shapes], s); slots.append(s)
    cyc = itertools.cycle(slots)
    for rows in rows_list:
        x = torch.randn(rows, D, generator=g)
        F_ = fmt.shapes[0][0]
        xb = torch.randn(rows, fmt.shapes[0][1], generator=g).bfloat16(); hb = torch.randn(rows, fmt.shapes[2][1], generator=g).bfloat16()
        e2 = fmt.kinds[0] == "mxfp4"
        a, b = [], []
        for i in range(40):
            s = next(cyc); t = time.perf_counter(); fmt.native.forward_amx(s[0], x, **fmt.glu_args); a.append(time.perf_counter() - t)
            s = next(cyc); vg, vu, vd = fmt.views(s)
            t = time.perf_counter(); amx_gemm(vg["gw"], vg.get("zr"), xb, e2m1=e2); amx_gemm(vu["gw"], vu.get("zr"), xb, e2m1=e2); amx_gemm(vd["gw"], vd.get("zr"), hb, e2m1=e2); b.append(time.perf_counter() - t)
        print(f"{fmt.name} {fmt.shapes} rows {rows}: forward_amx {st.median(a)*1e3:.3f} ms, three GEMMs {st.median(b)*1e3:.3f}", flush=True)
D = 2880; Db = biased_width(D)
run(ExpertFormat("mxfp4", ((D, Db), (D, Db), (D, Db)), "tiled", swiglu_limit=7.0), D, (40, 64, 256), 8)
run(ExpertFormat("int4", ((768, 2048), (768, 2048), (2048, 768)), "tiled", batch_act="q8"), 2048, (40, 64, 256))
