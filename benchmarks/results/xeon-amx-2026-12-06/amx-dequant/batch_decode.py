# Usage: python batch_decode.py B [profile.json]; A/B: PYTHONPATH=<old worktree> against this tree, alternated.
# Decode of B sequences at once: (time of max_tokens 65) - (time of max_tokens 1), 64 steps; generated tok/s.
import sys, time, random, statistics as st
from tiered import LLM, SamplingParams, EngineConfig
from tiered.checkpoint import default_model_path
B = int(sys.argv[1])
llm = LLM(str(default_model_path()), EngineConfig(max_batch=B, profile=sys.argv[2] if len(sys.argv) > 2 else None))
rng = random.Random(0); V = llm.config.vocab_size
ps = [[rng.randrange(10, V) for _ in range(32)] for _ in range(B)]
def run(n):
    t = time.perf_counter(); llm.generate(ps, SamplingParams(max_tokens=n, ignore_eos=True)); return time.perf_counter() - t
run(2)
res = []
for _ in range(3):
    a = run(1); b = run(65); res.append(B * 64 / (b - a))
print(B, "decode tok/s", " ".join(f"{r:.0f}" for r in res), "median %.0f" % st.median(res))
p = llm.predicted_decode_at(32 + 33, batch=True)
print("priced at 65 positions:", p, "->", (B / p) if p and p < 1 else p)
