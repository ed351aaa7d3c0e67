"""One token's 8 Qwen3-30B-A3B-width experts in one native layer call (forward_group), slots cycled beyond the cache:
formats A/B, alternated rounds. ms per call."""
import sys, time, statistics, torch
from tiered.quant.experts import ExpertFormat
D, F = 2048, 768
names = sys.argv[1].split("|")
torch.manual_seed(0)
w = [torch.randn(F, D) * 0.02, torch.randn(F, D) * 0.02, torch.randn(D, F) * 0.02]
fmts, slots = {}, {}
for n in names:
    fmt = ExpertFormat(n, [(F, D), (F, D), (D, F)], "tiled", batch_act="q8", act="q8")
    s0 = fmt.empty(); fmt.quantize(w, s0)
    cnt = int(1.5e9 // fmt.nbytes) // 8 * 8
    ss = [(s0[0].clone(),) for _ in range(cnt)]
    fmts[n], slots[n] = fmt, ss
x = torch.randn(8, D)
bounds = list(range(9))
def run(n):
    fmt, ss = fmts[n], slots[n]
    t = time.perf_counter()
    for i in range(0, len(ss), 8):
        fmt.forward_group(x, ss[i:i + 8], bounds)
    return (time.perf_counter() - t) / (len(ss) // 8) * 1e3
res = {n: [] for n in names}
for r in range(int(sys.argv[2]) if len(sys.argv) > 2 else 7):
    for n in (names if r % 2 else names[::-1]):
        res[n].append(run(n))
for n in names:
    print(f"{n}: {statistics.median(res[n]):.3f} ms a layer call, {fmts[n].nbytes * 8 / statistics.median(res[n]) / 1e6:.1f} GB/s  {[round(v,3) for v in res[n]]}")
