"""expert_dram/cpu/bf16's call (one expert a call, bf16_expert_forward) against the MoE decode's (a layer's top-2 experts
in one bf16_experts_forward_group call) over the same cold slots, alternated: GB/s of each."""
import itertools, statistics, time, torch
from tiered import kernels
from tiered.hardware import profiler as P
ext = kernels.load(); llc = P.last_level_cache_bytes()
D, F = 1024, 3584
nbytes = 3 * D * F * 2
slots = P.slab_copies(P.random_expert(D, F, torch.Generator().manual_seed(0)), P.cold_copies(3 * llc, nbytes))
x = torch.randn(1, D).to(torch.bfloat16); xs = torch.randn(2, D)
def one():
    t = time.perf_counter()
    for s in slots: ext.bf16_expert_forward(*s, x)
    return len(slots) * nbytes / (time.perf_counter() - t) / 1e9
def group():
    t = time.perf_counter()
    for a, b in zip(slots[::2], slots[1::2]): ext.bf16_experts_forward_group([*a, *b], xs, [0, 1, 2])
    return 2 * len(slots[1::2]) * nbytes / (time.perf_counter() - t) / 1e9
print("tuning", ext.tuning())
r = {"one": [], "group of 2": []}
for i in range(9):
    for name, f in ((("one", one), ("group of 2", group)) if i % 2 else (("group of 2", group), ("one", one))):
        r[name].append(round(f(), 1))
print(r, {k: statistics.median(v) for k, v in r.items()})
