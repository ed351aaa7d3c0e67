import sys, time, random, statistics as st
from tiered.quant import int4
if len(sys.argv) > 3: int4.AMX_ROWS = int(sys.argv[3])
from tiered import LLM, SamplingParams
from tiered.checkpoint import default_model_path
llm = LLM(str(default_model_path()))
rng = random.Random(1); V = llm.config.vocab_size
def ttft(n):
    ids = [rng.randrange(10, V) for _ in range(n)]
    t = time.perf_counter(); llm.generate([ids], SamplingParams(max_tokens=1)); return (time.perf_counter() - t) * 1e3
ttft(300); ttft(300)
base = int(sys.argv[1]); step = int(sys.argv[2])
fresh = [ttft(n) for n in range(base, base + 7 * step, step)]
warm = [ttft(base) for _ in range(5)]
print(f"AMX_ROWS {int4.AMX_ROWS} base {base}: fresh median {st.median(fresh):.1f}  warm median {st.median(warm):.1f}")
