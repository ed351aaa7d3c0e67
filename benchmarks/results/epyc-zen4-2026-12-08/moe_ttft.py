"""TTFT of a 128- and a 512-token prompt: the default engine (k-quant expert kinds) against int8-g32 copies, alternated."""
import sys, time, statistics
import tiered.quant.gguf_experts as GE
from tiered import LLM, EngineConfig, SamplingParams
path = sys.argv[1]; rounds = int(sys.argv[2])
llms = {"auto": LLM(path, EngineConfig())}
saved = dict(GE.KQUANT_OF_FORMAT); GE.KQUANT_OF_FORMAT.clear()
llms["copies"] = LLM(path, EngineConfig())
GE.KQUANT_OF_FORMAT.update(saved)
sp = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
for T in (128, 512):
    prompt = [(i * 7919) % 40000 + 100 for i in range(T)]
    res = {n: [] for n in llms}
    for r in range(rounds):
        for n, l in (list(llms.items()) if r % 2 == 0 else list(llms.items())[::-1]):
            t = time.perf_counter(); l.generate([prompt], sp); res[n].append(time.perf_counter() - t)
    print(T, {n: (llms[n].plan.dtypes["experts"], round(statistics.median(v), 3), round(llms[n].predicted_ttft_at(T) or -1, 3)) for n, v in res.items()}, flush=True)
