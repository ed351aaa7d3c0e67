"""A conversation through tiered serve's Responses API chained by previous_response_id (each turn sends only its
new input): prompt tokens, those a slot's KV held (cached_tokens) and TTFT per turn. Usage: python
responses_chain.py PORT [TURNS]"""
import sys, time, statistics
import openai

port, turns = int(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 6
c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
instructions = open("/usr/lib/python3.11/textwrap.py").read()[:6000]
prev, ttfts = None, []
for t in range(turns):
    start, first, final = time.perf_counter(), None, None
    for ev in c.responses.create(model="smollm2", instructions=instructions, previous_response_id=prev, stream=True,
                                 input=f"Question {t}: summarise part {t} of the text in one line.",
                                 max_output_tokens=48, temperature=0):
        if ev.type == "response.output_text.delta":
            first = first or time.perf_counter()
        if ev.type in ("response.completed", "response.incomplete"):
            final = ev.response
    prev = final.id
    ttfts.append((first - start) * 1e3 if first else float("nan"))
    u = final.usage
    print(f"turn {t}: prompt {u.input_tokens} tokens, {u.input_tokens_details.cached_tokens} from a slot's KV, "
          f"TTFT {ttfts[-1]:.0f} ms, status {final.status}", flush=True)
print("median TTFT of turns 1..:", round(statistics.median(ttfts[1:])), "ms")
