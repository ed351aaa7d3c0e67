import torch, time, statistics, json, itertools
from tiered.quant.int4 import GROUP, Int4Linear, quantize_int4, amx_gemm
from tiered.hardware.profiler import _cold_turn, random_normal
from tiered.hardware.profile import HardwareProfile
from tiered.hardware import op_time
hw = HardwareProfile.load("/root/.cache/tiered/hardware_profile.json") if hasattr(HardwareProfile, "load") else None
g = torch.Generator().manual_seed(0)
def turn(K, N, cold):
    packed = Int4Linear.from_codes(*quantize_int4(random_normal(N, K, generator=g)), GROUP, None, "tiled").packed
    return _cold_turn(packed, None) if cold else itertools.repeat(packed)
for (K, N) in [(2048, 768), (768, 2048), (4096, 4096)]:
    for cold in (True, False):
        t = turn(K, N, cold)
        for T in (16, 32, 48, 64, 128):
            x = torch.randn(T, K, generator=g).to(torch.bfloat16)
            for _ in range(5): amx_gemm(next(t), None, x)
            ts = []
            for _ in range(40):
                w = next(t); s = time.perf_counter(); amx_gemm(w, None, x); ts.append(time.perf_counter() - s)
            m = statistics.median(ts)
            wb = K * N * 0.5625
            pr = op_time.amx_gemm_time(hw, T * K * N, wb, calls=1) if hw else 0
            print(f"{K}x{N} {'cold' if cold else 'warm'} rows {T}: {m*1e3:.3f} ms priced {pr*1e3:.3f}", flush=True)
