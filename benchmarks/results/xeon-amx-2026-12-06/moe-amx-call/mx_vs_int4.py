# The AMX GEMM over one MXFP4 weight against one int4 weight of the same shape (tiled layouts), cold copies, ms
import torch, time, statistics, itertools
from tiered.quant import mxfp4
from tiered.quant.int4 import GROUP, Int4Linear, quantize_int4, amx_gemm
from tiered.hardware.profiler import _cold_turn, random_normal
from tiered.hardware.profile import HardwareProfile
from tiered.hardware import op_time
hw = HardwareProfile.load("/root/.cache/tiered/hardware_profile.json")
g = torch.Generator().manual_seed(0)
for (N, K) in [(2880, 2912), (768, 2048), (14336, 4096)]:
    w = random_normal(N, K, generator=g)
    i4 = Int4Linear.from_codes(*quantize_int4(w), GROUP, None, "tiled").packed
    mx = mxfp4.segments(*mxfp4.quantize(w), "tiled")["gw"]
    ti, tm = _cold_turn(i4, None), _cold_turn(mx, None)
    for T in (32, 64, 128, 256):
        x = torch.randn(T, K, generator=g).to(torch.bfloat16)
        res = {"int4": [], "mxfp4": []}
        for _ in range(3): amx_gemm(next(ti), None, x); amx_gemm(next(tm), None, x, e2m1=True)
        for _ in range(25):
            a = next(ti); s = time.perf_counter(); amx_gemm(a, None, x); res["int4"].append(time.perf_counter() - s)
            b = next(tm); s = time.perf_counter(); amx_gemm(b, None, x, e2m1=True); res["mxfp4"].append(time.perf_counter() - s)
        pr = op_time.amx_gemm_time(hw, T * K * N, K * N * 0.5625) * 1e3
        prm = op_time.amx_gemm_time(hw, T * K * N, mx.numel()) * 1e3
        print(f"{N}x{K} rows {T}: int4 {statistics.median(res['int4'])*1e3:.3f} (priced {pr:.3f}) mxfp4 {statistics.median(res['mxfp4'])*1e3:.3f} (priced {prm:.3f}; {mx.numel()/(N*K):.4f} B/weight)", flush=True)
