"""LLM load time (LLM.load_s) of a GGUF MoE: experts' k-quant kinds against int8-g32 copies."""
import sys, time
import tiered.quant.gguf_experts as GE
from tiered import LLM, EngineConfig
path = sys.argv[1]
saved = dict(GE.KQUANT_OF_FORMAT)
for r in range(2):
    for name in ("kquant", "copies"):
        if name == "copies": GE.KQUANT_OF_FORMAT.clear()
        t = time.perf_counter(); l = LLM(path, EngineConfig()); dt = time.perf_counter() - t
        print(name, l.plan.dtypes["experts"], f"LLM() {dt:.2f} s, load_s {l.load_s:.2f}", flush=True)
        l.close(); del l
        GE.KQUANT_OF_FORMAT.update(saved)
