import sys, time, random
from tiered import LLM, SamplingParams
from tiered.checkpoint import default_model_path
llm = LLM(str(default_model_path()))
rng = random.Random(int(sys.argv[1])); V = llm.config.vocab_size
def ttft(n):
    ids = [rng.randrange(10, V) for _ in range(n)]
    t = time.perf_counter(); llm.generate([ids], SamplingParams(max_tokens=1)); return (time.perf_counter() - t) * 1e3
ttft(300); ttft(300)
fresh = [ttft(n) for n in range(int(sys.argv[2]), int(sys.argv[2]) + 7 * 13, 13)]
warm = [ttft(int(sys.argv[2])) for _ in range(5)]
import statistics as st
print(f"fresh median {st.median(fresh):.1f}  warm median {st.median(warm):.1f}")
