# The AMX GEMM (quant/int4.amx_gemm) over copies of one weight filling 64 MB / 960 MB / 3 GB, cycled: does the
# cold set's size change its time? (it does not much: ~5% at 3 GB against 960 MB). Usage: python cold_copies.py
import sys, torch, itertools
from tiered.hardware import profiler as P
from tiered.quant.int4 import GROUP, Int4Linear, amx_gemm, quantize_int4
for K, N in [(1024, 1024), (4096, 14336)]:
    packed = Int4Linear.from_codes(*quantize_int4(P.random_normal(N, K)), GROUP, None, "tiled").packed
    nb = packed.numel()
    for cold in (64 << 20, 960 << 20, 3 << 30):
        cs = [w for w, in P.slab_copies((packed,), P.cold_copies(cold, nb))]
        out = []
        for T in (16, 32, 128):
            x = torch.randn(T, K).bfloat16()
            turn = itertools.cycle(cs)
            t = P.median_times([lambda: amx_gemm(next(turn), None, x)], 5)[0]
            out.append(f"{T}:{t*1e3:.3f}ms({nb/t/1e9:.1f}GB/s)")
        print(K, N, f"cold {cold>>20} MB", " ".join(out), flush=True)
        del cs
