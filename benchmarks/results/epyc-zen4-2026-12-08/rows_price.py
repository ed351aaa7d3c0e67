"""One Qwen3-30B-A3B-width expert over r prompt rows (q8 activations), measured over cold slots, against
cpu_predict.prompt_expert_time."""
import sys, time, statistics, torch
from tiered.quant.experts import ExpertFormat
from tiered.hardware.profile import HardwareProfile
from tiered.planner.cpu_predict import prompt_expert_time
from tiered.hardware.profiler import last_level_cache_bytes
hw = HardwareProfile.load("/root/.cache/tiered/hardware_profile.json")
D, F = 2048, 768
torch.manual_seed(0)
w = [torch.randn(F, D) * 0.02, torch.randn(F, D) * 0.02, torch.randn(D, F) * 0.02]
for name in sys.argv[1].split("|"):
    fmt = ExpertFormat(name, [(F, D), (F, D), (D, F)], "tiled", batch_act="q8", act="q8")
    s0 = fmt.empty(); fmt.quantize(w, s0)
    slots = [(s0[0].clone(),) for _ in range(int(3 * last_level_cache_bytes() // fmt.nbytes) + 1)]
    for r in (8, 16, 32, 64):
        x = torch.randn(r, D)
        ts = []
        for rep in range(5):
            t = time.perf_counter()
            for s in slots: fmt.forward(x, s)
            ts.append((time.perf_counter() - t) / len(slots))
        p = prompt_expert_time(hw, name.split(",")[0], r, fmt.nbytes, 3 * D * F, "q8", working_set=1e9)
        m = statistics.median(ts)
        print(f"{name} rows {r}: measured {m*1e3:.3f} ms, priced {p*1e3:.3f} ({(p-m)/m:+.0%})", flush=True)
