import time, torch
from tiered.hardware.cuda import CudaAccelerator, page_locked
print("torch", torch.__version__)
acc = CudaAccelerator(pinned="huge")
n = 256 << 20
h = acc.host_buffer((n,), torch.uint8)
h.fill_(1)
c = torch.empty(n, dtype=torch.uint8, pin_memory=True)
print("registered huge: is_pinned", h.is_pinned(), "page_locked", page_locked(h), "| cudaHostAlloc is_pinned", c.is_pinned())
d = torch.empty(n, dtype=torch.uint8, device="cuda")
for name, src in (("huge", h), ("cudaHostAlloc", c)):
    for nb in (False, True):
        r = []
        for _ in range(5):
            torch.cuda.synchronize(); t0 = time.perf_counter(); d.copy_(src, non_blocking=nb)
            t1 = time.perf_counter(); torch.cuda.synchronize(); t2 = time.perf_counter()
            r.append((round((t1 - t0) * 1e3, 3), round((t2 - t0) * 1e3, 3)))
        print(f"{name} non_blocking={nb}: (returned ms, done ms) {r[1:]}  GB/s {n / min(x[1] for x in r[1:]) / 1e6:.1f}")
