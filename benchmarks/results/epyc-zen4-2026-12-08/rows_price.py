"""One Qwen3-30B-A3B-width expert over r prompt rows (q8 activations), measured over cold slots, against
cpu_predict.prompt_expert_time from the cached profile, and from it with expert_rows/cpu/<kind>q8 (profiler 70's key)
fitted now."""
import sys, time, statistics, torch, dataclasses
from tiered.quant.experts import ExpertFormat
from tiered.hardware.profile import HardwareProfile, LinearModel
from tiered.hardware import profiler as P
from tiered.planner.cpu_predict import prompt_expert_time
hw = HardwareProfile.load("/root/.cache/tiered/hardware_profile.json")
big = 2 * P.last_level_cache_bytes()
models = dict(hw.models)
for k in P.EXPERT_ROWS_KINDS:
    pts = P._expert_rows_int4q8_points(5, big, kind=k); models[f"expert_rows/cpu/{k}q8"] = P.fit_affine([n for n, _ in pts], [t for _, t in pts])
hw2 = dataclasses.replace(hw, models=models)
D, F = 2048, 768
torch.manual_seed(0)
w = [torch.randn(F, D) * 0.02, torch.randn(F, D) * 0.02, torch.randn(D, F) * 0.02]
for name in sys.argv[1].split("|"):
    fmt = ExpertFormat(name, [(F, D), (F, D), (D, F)], "tiled", batch_act="q8", act="q8")
    s0 = fmt.empty(); fmt.quantize(w, s0)
    slots = [(s0[0].clone(),) for _ in range(int(3 * P.last_level_cache_bytes() // fmt.nbytes) + 1)]
    for r in (8, 16, 32, 64):
        x = torch.randn(r, D)
        ts = []
        for rep in range(5):
            t = time.perf_counter()
            for s in slots: fmt.forward(x, s)
            ts.append((time.perf_counter() - t) / len(slots))
        m = statistics.median(ts)
        p1 = prompt_expert_time(hw, name.split(",")[0], r, fmt.nbytes, 3 * D * F, "q8", working_set=1e9)
        p2 = prompt_expert_time(hw2, name.split(",")[0], r, fmt.nbytes, 3 * D * F, "q8", working_set=1e9)
        print(f"{name} rows {r}: measured {m*1e3:.3f} ms, priced {p1*1e3:.3f} ({(p1-m)/m:+.0%}), with the key {p2*1e3:.3f} ({(p2-m)/m:+.0%})", flush=True)
