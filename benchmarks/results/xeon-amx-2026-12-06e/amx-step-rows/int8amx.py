import time, torch
from tiered.kernels import load
from tiered.kernels.linear import tiled_int8, tiled_group_scales, int8_tiled_kernel
ext = load()
g = torch.Generator().manual_seed(0)
def med(f, reps=30):
    f(); ts = []
    for _ in range(reps):
        t = time.perf_counter(); f(); ts.append(time.perf_counter() - t)
    return sorted(ts)[reps // 2]
for N, K in ((49152, 576), (160, 96)):
    q = torch.randint(-127, 128, (N, K), generator=g, dtype=torch.int8)
    sc = (torch.rand(N, K // 32, generator=g) * 0.01 + 0.001).half()
    bias = torch.randn(N, generator=g) if N < 1000 else None
    k = ext.int8g32_tiled_kernel(tiled_int8(q), tiled_group_scales(sc), bias, "q8")
    W = (q.float().reshape(N, K // 32, 32) * sc.float().unsqueeze(-1)).reshape(N, K)
    kr = int8_tiled_kernel(tiled_int8(q), torch.rand(N, generator=g) * 0.01, None, "q8")
    for M in (8, 23, 24, 32, 48):
        x = torch.randn(M, K, generator=g)
        ref = x.bfloat16().float() @ W.bfloat16().float().T + (bias if bias is not None else 0)
        exact = x @ W.T + (bias if bias is not None else 0)
        ys, yr = k.step(x), k(x)
        e = lambda y: float((y - exact).abs().max() / exact.abs().max())
        line = f"N{N} M{M}: step err {e(ys):.2e} (vs bf16 ref {float((ys - ref).abs().max() / ref.abs().max()):.1e}), run err {e(yr):.2e}, same {torch.equal(ys, yr)}"
        if N > 1000:
            line += f"; step {med(lambda: k.step(x))*1e3:.2f} ms, run {med(lambda: k(x))*1e3:.2f} ms"
        print(line, flush=True)
    # per-row scales (not g32)
    s2 = torch.rand(N, generator=g) * 0.01
    kr = ext.int8_tiled_kernel(tiled_int8(q), s2, None, "q8") if hasattr(ext, "int8_tiled_kernel") else int8_tiled_kernel(tiled_int8(q), s2, None, "q8")
    x = torch.randn(32, K, generator=g)
    Wr = q.float() * s2.unsqueeze(1)
    ex = x @ Wr.T
    print(f"N{N} per-row scales M32: step err {float((kr.step(x) - ex).abs().max() / ex.abs().max()):.2e}, run err {float((kr(x) - ex).abs().max() / ex.abs().max()):.2e}")
