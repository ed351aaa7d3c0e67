import sys, statistics
from tiered import LLM, EngineConfig, SamplingParams
from tiered.checkpoint import default_model_path
from tiered.chat import Chat
llm = LLM(sys.argv[1] if len(sys.argv) > 1 else default_model_path(), EngineConfig(max_context=4096))
params = SamplingParams(temperature=0, max_tokens=96, ignore_eos=True)
qs = [f"Tell me fact number {i} about the history of computing, in detail." for i in range(8)]
res = {}
for rnd in range(2):
    for mode in (("slot", "generate") if rnd == 0 else ("generate", "slot")):
        chat = Chat(llm, params, system="You are a helpful assistant.")
        if mode == "generate":
            chat._slot = False
        t = []
        for q in qs:
            chat.ask(q, lambda _: None)
            s = chat.last.stats
            t.append((s.prompt_tokens, round(s.ttft_s * 1e3), s.cached_tokens))
        res.setdefault(mode, []).append(t)
for mode, runs in res.items():
    print(mode, "turn: (prompt tokens, TTFT ms, reused)", runs[0], "| TTFT second run", [x[1] for x in runs[1]], flush=True)
