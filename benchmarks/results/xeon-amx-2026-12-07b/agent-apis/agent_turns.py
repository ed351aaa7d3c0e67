"""An agent-shaped conversation through tiered serve's Anthropic Messages API (as Claude Code drives it): a long
system prompt, turns that append the answer and a new user message, streamed; TTFT (first text delta) and the
prompt tokens a slot's KV held (cache_read_input_tokens) per turn. Usage: python agent_turns.py PORT [TURNS]"""
import sys, time, statistics
import anthropic

port, turns = int(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 6
c = anthropic.Anthropic(base_url=f"http://127.0.0.1:{port}", api_key="none", max_retries=0)
system = open("/usr/lib/python3.11/textwrap.py").read()[:6000]  # ~1500 tokens of "instructions"
messages, rows = [], []
for t in range(turns):
    messages.append({"role": "user", "content": f"Question {t}: summarise part {t} of the text in one line."})
    start, first = time.perf_counter(), None
    with c.messages.stream(model="claude-sonnet-4-5", max_tokens=48, system=system, messages=messages,
                           extra_body={"temperature": 0}) as s:
        for _ in s.text_stream:
            first = first or time.perf_counter()
        m = s.get_final_message()
    total = time.perf_counter() - start
    messages.append({"role": "assistant", "content": m.content[0].text if m.content else ""})
    u = m.usage
    rows.append((t, u.input_tokens + u.cache_read_input_tokens, u.cache_read_input_tokens,
                 (first - start) * 1e3 if first else float("nan"), total))
    print(f"turn {t}: prompt {rows[-1][1]} tokens, {u.cache_read_input_tokens} from a slot's KV, "
          f"TTFT {rows[-1][3]:.0f} ms, total {total:.2f} s", flush=True)
print("median TTFT of turns 1..:", round(statistics.median(r[3] for r in rows[1:])), "ms")
