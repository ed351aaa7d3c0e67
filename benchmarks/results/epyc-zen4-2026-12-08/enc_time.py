import time, torch, sys
from tiered.checkpoint import open_checkpoint
from tiered.memory.expert_store import expert_tensor_names
from tiered.quant.experts import ExpertFormat, quantize_blocks, kquant_segments
path = sys.argv[1]
ck = open_checkpoint(path)
hs = [ck.handle(n) for n in expert_tensor_names(ck.config.model_type, 1, 0)]
print([h.format for h in hs])
h = hs[2]
t = time.perf_counter(); w = h.load(torch.float32); t1 = time.perf_counter()
b = quantize_blocks(w, "q6k"); t2 = time.perf_counter()
seg = kquant_segments("q6k", [b]); t3 = time.perf_counter()
from tiered.quant.experts import quantize_projection
q = quantize_projection(w, "int8-g32", "tiled"); t4 = time.perf_counter()
print(f"load {1e3*(t1-t):.1f} ms, fit q6k {1e3*(t2-t1):.1f}, pack {1e3*(t3-t2):.1f}; int8-g32 quantize {1e3*(t4-t3):.1f}")
