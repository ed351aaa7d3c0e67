import torch, time, statistics
import torch.nn.functional as F
torch.set_num_threads(2)
T, K, N = 1024, 10240, 2560
W = (torch.randn(N, K) * 0.02).bfloat16()
xc = torch.randn(T, K).bfloat16()             # contiguous rows
xt_store = torch.randn(K, T).bfloat16()       # y^T storage of the GLU
xv = xt_store.t()                             # [T, K] view, transposed
def tm(f, n=7):
    for _ in range(2): f()
    ts = []
    for _ in range(n):
        t0 = time.perf_counter(); f(); ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3
for r in range(2):
    print("linear(contiguous x)", round(tm(lambda: F.linear(xc, W)), 1),
          "linear(transposed view)", round(tm(lambda: F.linear(xv, W)), 1),
          "mm(W, x^T storage) -> y^T", round(tm(lambda: torch.mm(W, xt_store)), 1),
          "mm(x^T view^T ...)", round(tm(lambda: torch.mm(xv, W.t())), 1))
# gate/up chunk: mm(Wchunk [13104, 2560], x.t()) with x contiguous [1024, 2560] -> x.t() non-contiguous view
Wg = (torch.randn(13104, 2560) * 0.02).bfloat16()
x2 = torch.randn(1024, 2560).bfloat16()
out = torch.empty(13104, 1024, dtype=torch.bfloat16)
x2t = x2.t().contiguous()
print("gate/up chunk mm(W, x.t() view)", round(tm(lambda: torch.mm(Wg, x2.t(), out=out)), 1),
      "mm(W, x^T contiguous)", round(tm(lambda: torch.mm(Wg, x2t, out=out)), 1),
      "linear(x, W) -> y", round(tm(lambda: F.linear(x2, Wg)), 1), "GMAC", 13104*2560*1024/1e9)
