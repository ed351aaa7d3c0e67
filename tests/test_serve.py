"""`tiered serve`: the real server (uvicorn in a thread, on a free loopback port) over a tiny model,
driven by the real `openai` client and raw HTTP.

Greedy output through the server must equal LLM.generate of the same prompt; bad requests get
OpenAI-style errors and leave the server serving; a client that goes away frees its slot.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import shutil
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import httpx
import pytest
import uvicorn

openai = pytest.importorskip("openai", reason="the serving tests drive the real openai client (pip install openai)")

from runtime_fixtures import engine_config, rt  # noqa: F401
from runtime_fixtures import prompt as moe_prompt
from tiered import LLM, EngineConfig, SamplingParams
from tiered.serve.app import build_app
from tiered.serve.engine import ServingEngine
from tiered.serve.protocol import token_bytes

KEY = "sk-test-key"
MODEL = "tiny-llama"
PROMPTS = ["the quick brown fox", "memory is a tier", "one two three four five six", "hello",
           "a longer prompt about disks and caches and experts", "tiered", "seven eight", "fox and dog"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running_server(engine: ServingEngine, api_key: str | None):
    """The real server over `engine` on a free loopback port, in a thread; yields its base URL."""
    port = _free_port()
    srv = uvicorn.Server(uvicorn.Config(build_app(engine, MODEL, api_key=api_key), host="127.0.0.1", port=port,
                                       log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not srv.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        srv.should_exit = True
        thread.join(timeout=30)


@pytest.fixture(scope="module")
def server(zoo, chat_llama):
    """A server with 4 slots and a queue of 16 over the tiny Llama (with a chat template added)."""
    llm = zoo.llm(chat_llama)
    engine = ServingEngine(llm, max_batch=4, max_queue=16)
    with running_server(engine, KEY) as url:
        yield SimpleNamespace(url=url, llm=llm, engine=engine,
                              client=openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=60))


@pytest.fixture
def slow_steps(monkeypatch):
    """slow_steps(llm): from now on each of llm's engine steps takes >= 20 ms more, each a token (no
    decode bursts: LLM.bursts), so requests overlap and a disconnect lands mid-stream."""
    def enable(llm) -> None:
        step = llm.step
        monkeypatch.setattr(llm, "bursts", False)

        def slow(*a, **kw):
            time.sleep(0.02)
            return step(*a, **kw)
        monkeypatch.setattr(llm, "step", slow)
    return enable


def _metrics(server) -> dict[str, float]:
    text = httpx.get(server.url + "/metrics").text
    return {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines() if not line.startswith("#")}


def _idle(server, timeout: float = 10.0) -> None:
    """Wait until no request runs or waits (the test thread may then use the LLM directly)."""
    deadline = time.monotonic() + timeout
    while server.engine.scheduler.has_work():
        assert time.monotonic() < deadline, "the engine did not go idle"
        time.sleep(0.01)


def _greedy(server, prompt, max_tokens: int, chat: bool, **kw):
    _idle(server)
    return server.llm.generate(prompt, SamplingParams(temperature=0, max_tokens=max_tokens, **kw), chat=chat)[0]


def test_health_models_and_api_key(server):
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    assert [m.id for m in server.client.models.list()] == [MODEL]
    r = httpx.get(server.url + "/v1/models")
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model=MODEL, prompt="hi", max_tokens=2)


def test_browser_pages_on_this_machine_may_call_the_api_and_others_only_when_allowed(server):
    """CORS: a page served from localhost (any port) gets its preflight answered and Access-Control-Allow-Origin on
    the answers, the API key still required (the preflight itself carries none); a page elsewhere gets neither,
    unless the server allows its origin (`--allowed-origin`) or every one ('*')."""
    import asyncio

    def preflight(base: str, origin: str) -> httpx.Response:
        return httpx.options(base + "/v1/chat/completions", headers={
            "Origin": origin, "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization,content-type"})

    local = "http://localhost:3000"
    r = preflight(server.url, local)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == local
    assert "authorization" in r.headers["access-control-allow-headers"].lower()
    assert "POST" in r.headers["access-control-allow-methods"]
    ok = httpx.get(server.url + "/v1/models", headers={"Origin": "http://127.0.0.1:5173",
                                                       "Authorization": f"Bearer {KEY}"})
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "http://127.0.0.1:5173"
    no_key = httpx.get(server.url + "/v1/models", headers={"Origin": local})
    assert no_key.status_code == 401 and no_key.headers["access-control-allow-origin"] == local
    elsewhere = "https://example.com"
    assert preflight(server.url, elsewhere).status_code == 400
    answer = httpx.get(server.url + "/v1/models", headers={"Origin": elsewhere, "Authorization": f"Bearer {KEY}"})
    assert answer.status_code == 200 and "access-control-allow-origin" not in answer.headers
    for allowed, origin in ((("https://example.com",), elsewhere), (("*",), "https://any.example.org")):
        app = build_app(server.engine, MODEL, api_key=KEY, allowed_origins=allowed)

        async def ask():
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
                pre = await c.options("/v1/completions", headers={"Origin": origin,
                                                                   "Access-Control-Request-Method": "POST"})
                got = await c.get("/v1/models", headers={"Origin": origin, "Authorization": f"Bearer {KEY}"})
                other = await c.get("/v1/models", headers={"Origin": "https://other.example.net",
                                                           "Authorization": f"Bearer {KEY}"})
                return pre, got, other
        pre, got, other = asyncio.run(ask())
        assert pre.status_code == 200 and got.status_code == 200
        assert got.headers["access-control-allow-origin"] in (origin, "*")
        assert ("access-control-allow-origin" in other.headers) == (allowed == ("*",))


def test_completion_equals_generate(server):
    out = server.client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=12, temperature=0)
    ref = _greedy(server, PROMPTS[0], 12, chat=False)
    assert out.choices[0].text == ref.text and out.choices[0].finish_reason == ref.finish_reason
    assert out.object == "text_completion" and out.model == MODEL
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(ref.prompt_token_ids), len(ref.token_ids))
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens


def test_chat_uses_the_template_and_equals_generate(server):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": PROMPTS[1]}]
    out = server.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0)
    ref = _greedy(server, messages, 10, chat=True)
    assert out.choices[0].message.role == "assistant" and out.choices[0].message.content == ref.text
    assert out.usage.prompt_tokens == len(server.llm.encode(messages)) == len(ref.prompt_token_ids)
    # The same conversation again: its slot still holds the prompt's KV (prefix reuse), the answer
    # is the same, and the usage says how many prompt tokens were not computed again.
    again = server.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0)
    assert again.choices[0].message.content == ref.text
    assert again.usage.prompt_tokens_details.cached_tokens == out.usage.prompt_tokens - 1
    metrics = httpx.get(server.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    assert "tiered_prompt_tokens_cached_total" in metrics


def test_streaming_matches_the_whole_answer(server):
    kw = dict(model=MODEL, max_tokens=16, temperature=0)
    whole = server.client.chat.completions.create(messages=[{"role": "user", "content": PROMPTS[2]}], **kw)
    chunks = list(server.client.chat.completions.create(messages=[{"role": "user", "content": PROMPTS[2]}],
                                                        stream=True, stream_options={"include_usage": True}, **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens and not chunks[-1].choices
    pieces = [c.choices[0].text for c in server.client.completions.create(prompt=PROMPTS[3], stream=True, **kw)]
    assert "".join(pieces) == _greedy(server, PROMPTS[3], 16, chat=False).text
    with httpx.stream("POST", server.url + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                      json={**kw, "prompt": PROMPTS[3], "stream": True}) as r:
        lines = [line for line in r.iter_lines() if line]
    assert r.headers["content-type"].startswith("text/event-stream") and lines[-1] == "data: [DONE]"


def test_stop_strings(server):
    full = _greedy(server, PROMPTS[4], 24, chat=False).text
    stop = full[len(full) // 2:len(full) // 2 + 2]
    assert stop.strip() and len(full) >= 8  # the tiny model says enough to cut
    out = server.client.completions.create(model=MODEL, prompt=PROMPTS[4], max_tokens=24, temperature=0, stop=[stop])
    assert out.choices[0].text == full[:full.index(stop)] and out.choices[0].finish_reason == "stop"


def test_seed_reproduces_sampling(server):
    kw = dict(model=MODEL, prompt=PROMPTS[5], max_tokens=16, temperature=1.0, top_p=0.9)
    a = server.client.completions.create(seed=1234, **kw).choices[0].text
    b = server.client.completions.create(seed=1234, **kw).choices[0].text
    _idle(server)
    ref = server.llm.generate(PROMPTS[5], SamplingParams(temperature=1.0, top_p=0.9, max_tokens=16, seed=1234),
                              chat=False)[0].text
    assert a == b == ref


def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(server):
    auth = {"Authorization": f"Bearer {KEY}"}
    r = httpx.post(server.url + "/v1/completions", content=b'{"model": "tiny-llama", "prompt": ',
                   headers={**auth, "content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(server.url + "/v1/completions", headers=auth, json={"model": "gpt-x", "prompt": "hi"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        server.client.completions.create(model=MODEL, prompt=list(range(2, 300)), max_tokens=4)
    assert e.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as e:
        server.client.completions.create(model=MODEL, prompt="hi", max_tokens=-3)
    assert e.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError, match="outside the vocabulary"):
        server.client.completions.create(model=MODEL, prompt=[5, 10**6], max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="outside the vocabulary"):  # one bad prompt of a batch
        server.client.completions.create(model=MODEL, prompt=[[5, 6], [5, 10**6]], max_tokens=4)
    out = server.client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=4, temperature=0)
    assert out.choices[0].text == _greedy(server, PROMPTS[0], 4, chat=False).text


def test_tokenizer_endpoints_as_vllm_answers_them(server):
    """vLLM's /tokenize, /detokenize and /tokenizer_info (lm-eval-harness's remote tokenizer checks
    both of the first and uses them instead of a local copy): a text encodes as a completion's prompt
    (or without special tokens), messages as a chat's; ids decode back; the API key guards them;
    a token past the vocabulary or both inputs at once are 400s."""
    auth = {"Authorization": f"Bearer {KEY}"}
    llm, text = server.llm, PROMPTS[4]
    r = httpx.post(server.url + "/tokenize", headers=auth, json={"prompt": text}).json()
    assert r["tokens"] == llm.encode(text, chat=False) and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == llm.max_context
    bare = httpx.post(server.url + "/tokenize", headers=auth, json={"prompt": text, "add_special_tokens": False}).json()
    assert bare["tokens"] == llm.tokenizer(text, add_special_tokens=False)["input_ids"]
    messages = [{"role": "user", "content": text}]
    chat = httpx.post(server.url + "/tokenize", headers=auth, json={"model": MODEL, "messages": messages}).json()
    assert chat["tokens"] == llm.encode(messages)
    back = httpx.post(server.url + "/detokenize", headers=auth, json={"tokens": bare["tokens"]}).json()
    assert back == {"prompt": text}
    info = httpx.get(server.url + "/tokenizer_info", headers=auth).json()
    assert info["eos_token"] == llm.tokenizer.eos_token and info["chat_template"] == llm.tokenizer.chat_template
    assert httpx.post(server.url + "/tokenize", json={"prompt": text}).status_code == 401
    for path, body in (("/detokenize", {"tokens": [llm.config.vocab_size]}), ("/tokenize", {"prompt": "a", "messages": messages}),
                       ("/tokenize", {"prompt": "a", "model": "gpt-x"})):
        r = httpx.post(server.url + path, headers=auth, json=body)
        assert r.status_code == 400 and r.json()["error"]["message"], r.json()


def test_a_batch_of_prompts_gives_each_its_choices(server):
    """A completion's prompt as a list of texts or of token-id lists (OpenAI's batch): prompt p's choice j
    is choice p * n + j, sampled as LLM.generate samples it (its seed seed + p * n + j); the usage counts
    each prompt once; a stream carries the same; more choices than the server holds are refused."""
    kw = dict(model=MODEL, max_tokens=6, temperature=1.0, seed=11)
    out = server.client.completions.create(prompt=PROMPTS[:3], n=2, **kw)
    _idle(server)
    prompts = [p for p in PROMPTS[:3] for _ in range(2)]
    refs = [server.llm.generate(p, SamplingParams(temperature=1.0, max_tokens=6, seed=11 + i), chat=False)[0]
            for i, p in enumerate(prompts)]
    assert [c.index for c in out.choices] == list(range(6)) and [c.text for c in out.choices] == [r.text for r in refs]
    assert out.usage.prompt_tokens == sum(len(r.prompt_token_ids) for r in refs[::2])
    assert out.usage.completion_tokens == sum(len(r.token_ids) for r in refs)
    ids = [server.llm.encode(p, chat=False) for p in PROMPTS[:3]]
    assert [c.text for c in server.client.completions.create(prompt=ids, n=2, **kw).choices] == [r.text for r in refs]
    texts = [""] * 6
    for chunk in server.client.completions.create(prompt=PROMPTS[:3], n=2, stream=True, **kw):
        texts[chunk.choices[0].index] += chunk.choices[0].text
    assert texts == [r.text for r in refs]
    r = httpx.post(server.url + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                   json={**kw, "prompt": ["a"] * (server.engine.capacity + 1)})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"


def test_a_failed_step_fails_its_requests_and_the_server_goes_on(server, monkeypatch):
    """A step that raises every time fails its request with a 500; a step that raised once is taken
    again request by request (ServingEngine._isolate), and the request gets its answer."""
    step = server.llm.step

    def broken(*a, **kw):
        raise RuntimeError("out of memory (simulated)")
    monkeypatch.setattr(server.llm, "step", broken)
    with pytest.raises(openai.InternalServerError, match="simulated"):
        server.client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=4)
    monkeypatch.undo()
    _idle(server)
    assert server.engine.scheduler.num_running == 0
    ref = _greedy(server, PROMPTS[0], 4, chat=False).text

    def once(*a, **kw):
        monkeypatch.setattr(server.llm, "step", step)  # only this one step fails
        raise RuntimeError("out of memory (simulated)")
    monkeypatch.setattr(server.llm, "step", once)
    out = server.client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=4, temperature=0)
    assert out.choices[0].text == ref


def test_queue_full_answers_503_with_retry_after(server, monkeypatch, slow_steps):
    """With no queue (--max-queue 0) a request still takes a free slot (an idle server used to
    refuse every one); with every slot taken it gets 503 with Retry-After."""
    prompt = PROMPTS[6]
    assert _greedy(server, prompt, 100, chat=False).finish_reason == "length"  # it would run 100 steps (2+ s)
    monkeypatch.setattr(server.engine.scheduler, "max_queue", 0)
    assert server.client.completions.create(model=MODEL, prompt="hi", max_tokens=2).choices[0].text is not None
    slow_steps(server.llm)
    auth = {"Authorization": f"Bearer {KEY}"}
    with contextlib.ExitStack() as stack:
        lines = []  # kept: a line iterator that is dropped closes its connection
        for _ in range(4):  # the 4 slots taken
            r = stack.enter_context(httpx.stream("POST", server.url + "/v1/completions", headers=auth, json={
                "model": MODEL, "prompt": prompt, "max_tokens": 100, "temperature": 0, "stream": True}))
            lines.append(r.iter_lines())
            assert next(lines[-1]).startswith("data: {")
        assert server.engine.scheduler.num_running == 4
        r = httpx.post(server.url + "/v1/completions", headers=auth, json={"model": MODEL, "prompt": "hi"})
        assert r.status_code == 503 and r.headers["retry-after"] == "1" and r.json()["error"]["code"] == "queue_full"
    monkeypatch.undo()
    _idle(server, timeout=1.5)  # the streams' clients went away: their slots are free again
    assert server.client.completions.create(model=MODEL, prompt="hi", max_tokens=2).choices[0].text is not None


def test_a_client_that_disconnects_mid_stream_frees_its_slot(server, slow_steps):
    prompt = PROMPTS[6]
    assert _greedy(server, prompt, 100, chat=False).finish_reason == "length"  # it would run 100 steps (2+ s)
    slow_steps(server.llm)
    before = _metrics(server).get('tiered_requests_total{outcome="cancelled"}', 0)
    with httpx.stream("POST", server.url + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                      json={"model": MODEL, "prompt": prompt, "max_tokens": 100, "temperature": 0,
                            "stream": True}) as r:
        next(line for line in r.iter_lines() if line.startswith("data: {"))
        assert server.engine.scheduler.num_running == 1
    _idle(server, timeout=1.5)  # well before the 100 steps would end
    assert _metrics(server)['tiered_requests_total{outcome="cancelled"}'] == before + 1
    assert server.client.completions.create(model=MODEL, prompt="hi", max_tokens=2).choices  # still serving


def test_a_client_that_gives_up_on_a_whole_answer_frees_its_slot(server, slow_steps):
    prompt = PROMPTS[6]
    assert _greedy(server, prompt, 100, chat=False).finish_reason == "length"
    slow_steps(server.llm)
    before = _metrics(server).get('tiered_requests_total{outcome="cancelled"}', 0)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=0.3,
                   json={"model": MODEL, "prompt": prompt, "max_tokens": 100, "temperature": 0})
    _idle(server, timeout=1.5)  # the handler polls for the disconnect every 0.5 s
    assert _metrics(server)['tiered_requests_total{outcome="cancelled"}'] == before + 1


def test_concurrent_streaming_clients_batch_together(server, slow_steps):
    expected = [_greedy(server, p, 12, chat=False).text for p in PROMPTS]
    slow_steps(server.llm)

    def one(prompt: str) -> str:
        stream = server.client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                                  stream=True)
        return "".join(c.choices[0].text for c in stream)
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        got = list(pool.map(one, PROMPTS))
    assert got == expected
    m = _metrics(server)
    assert 1 < m["tiered_decode_batch_size_peak"] <= 4  # batched across requests, within the 4 slots
    assert m["tiered_running_batch"] == 0 and m["tiered_queue_depth"] == 0
    assert m['tiered_requests_total{outcome="finished"}'] >= len(PROMPTS)
    assert m["tiered_time_to_first_token_seconds_count"] >= len(PROMPTS)
    # the KV cache's bytes: reserved, and (on the CPU) those in RAM, which the requests' positions wrote
    reserved, resident = m['tiered_kv_cache_bytes{state="reserved"}'], m['tiered_kv_cache_bytes{state="resident"}']
    assert reserved == server.engine.cache.held_bytes and 0 < resident <= reserved
    assert httpx.get(server.url + "/state", headers={"Authorization": f"Bearer {KEY}"}).json()["kv_cache"][
        "reserved_bytes"] == reserved


def test_a_lone_request_bursts_and_a_new_one_ends_the_burst(server, monkeypatch):
    """A lone request with none waiting decodes in native bursts (LLM._burst from the engine's step), with the
    same text as one step a token, each burst token counted as an engine step. A request submitted while a
    burst runs makes the engine's interrupt flag nonzero: the burst ends after its token in flight and the
    next step admits the newcomer, whose tokens are those it gets alone. A burst's tokens stream as one chunk."""
    llm, engine = server.llm, server.engine
    first, second = PROMPTS[6], PROMPTS[1]
    _idle(server)
    monkeypatch.setattr(llm, "bursts", False)
    ref = [llm.generate(p, SamplingParams(temperature=0, max_tokens=40), chat=False)[0]
           for p in (first, second)]
    per_step = [c.choices[0].text for c in server.client.completions.create(
        model=MODEL, prompt=first, max_tokens=40, temperature=0, stream=True)]
    monkeypatch.setattr(llm, "bursts", True)
    step = llm.runtime.cpu_decode
    real, drawn, arrivals, arrive = step.burst, [], [], []
    loop = asyncio.new_event_loop()  # the newcomer's events go nowhere: its sequence is read instead

    def spy(*a, **k):
        assert a[9] is engine._interrupt  # LLM._burst's `interrupt`
        if arrive and not arrivals:  # the second request arrives while the first one's burst runs
            arrivals.extend(engine.submit([second], SamplingParams(temperature=0, max_tokens=40),
                                          chat=False, loop=loop))
            assert a[9].item() == 1
        tokens, seconds = real(*a, **k)
        drawn.append((a[3], len(tokens)))
        return tokens, seconds
    monkeypatch.setattr(step, "burst", spy)
    try:
        steps = _metrics(server)["tiered_engine_steps_total"]
        chunks = [c.choices[0].text for c in server.client.completions.create(
            model=MODEL, prompt=first, max_tokens=40, temperature=0, stream=True)]
        assert "".join(chunks) == ref[0].text and drawn  # alone: bursts, the same text
        assert sum(n for _, n in drawn) > len(drawn)  # several tokens a burst
        assert "".join(per_step) == ref[0].text and len(chunks) < len(per_step) - 4  # a burst: one chunk (_merged)
        assert _metrics(server)["tiered_engine_steps_total"] - steps >= len(ref[0].token_ids) - 1  # one a token
        drawn.clear()
        arrive.append(True)
        out = server.client.completions.create(model=MODEL, prompt=first, max_tokens=40, temperature=0)
        _idle(server)
    finally:
        loop.close()
    assert drawn[0][0] >= 2 and drawn[0][1] == 1  # the arrival ended the first burst after one token
    assert out.choices[0].text == ref[0].text
    assert arrivals[0].seq.output_ids == ref[1].token_ids


def test_a_request_that_does_not_stream_is_handed_its_output_alone(server, slow_steps):
    """A handle that does not stream (a request without `stream`: the app passes body.stream to submit) gets one
    event, its output, where a streaming one gets a text delta a step: the handler's loop is not woken a token
    (`tiered batch` on 2 cores: 368 against 342 generated tok/s). The output is the same."""
    _idle(server)
    slow_steps(server.llm)  # a step a token

    async def events(stream: bool) -> list:
        (handle,) = server.engine.submit([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                                         chat=False, stream=stream)
        got = []
        while not got or got[-1][1] is None:
            got.append(await asyncio.wait_for(handle.events.get(), timeout=30))
        return got

    quiet, loud = asyncio.run(events(False)), asyncio.run(events(True))
    assert len(quiet) == 1 and len(loud) > 5
    assert quiet[0][1].token_ids == loud[-1][1].token_ids and len(quiet[0][1].token_ids) == 12
    assert "".join(e[0] for e in loud) == loud[-1][1].text == quiet[0][1].text  # (the output carries the text)


@pytest.mark.parametrize("kind", ["mixtral", "deepseek_v3"])
def test_moe_under_a_budget_batches_requests(rt, zoo, tmp_path, slow_steps, kind):
    """A tiny Mixtral (or DeepSeek-V3: latent attention's masked decode over slots of different
    lengths) behind the host stand-in, experts in CPU RAM with a 2-slot cache, 2 KV slots:
    concurrent requests equal LLM.generate, within the budget; /metrics shows the expert hit rate."""
    d = tmp_path / kind
    shutil.copytree(rt.dir(kind), d)
    zoo.tokenizer.save_pretrained(d)  # to stream text; prompts stay token ids below the MoE vocab
    s = rt.sizes(kind)
    llm = LLM(d, engine_config(accelerator="host", gpu_memory=s.fast(cache_slots=2) + s.kv, cpu_memory="64MiB",
                               expert_cache_slots=2))
    try:
        prompts = [moe_prompt(n, seed=n) for n in (5, 9, 12)]
        sp = SamplingParams(temperature=0, max_tokens=10)
        refs = [llm.generate(p, sp)[0] for p in prompts]
        expected = [r.text for r in refs]
        engine = ServingEngine(llm, max_batch=2, max_queue=4)
        slow_steps(llm)
        with running_server(engine, None) as url:
            client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
            with ThreadPoolExecutor(3) as pool:
                got = list(pool.map(lambda p: client.completions.create(model=MODEL, prompt=p, max_tokens=10,
                                                                        temperature=0).choices[0].text, prompts))
            metrics = httpx.get(url + "/metrics").text
            state = httpx.get(url + "/state").json()
        assert got == expected and any(expected)
        e, links = state["experts"], {l["link"]: l for l in state["links"]}
        assert e["fast"] + e["cpu"] + e["disk"] == s.moe_layers * s.num_experts and e["cache_slots"] == 2
        assert e["hit_rate"] == llm.runtime_stats()["hit_rate"] and state["moe"]
        tokens = state["serving"]["generated_tokens"]
        assert tokens == sum(len(r.token_ids) for r in refs)
        assert links["host -> device (H2D)"]["bytes_per_token"] == llm.runtime_stats()["bytes_h2d"] / tokens
        assert "tiered_expert_hit_rate " in metrics and "tiered_decode_batch_size_peak 2\n" in metrics
        # the stand-in device's KV cache: reserved bytes only (no host pages to count)
        assert f'tiered_kv_cache_bytes{{state="reserved"}} {engine.cache.held_bytes}' in metrics
        assert 'state="resident"' not in metrics and state["kv_cache"]["resident_bytes"] is None
        assert llm.fast_budget.peak <= llm.fast_budget.capacity
    finally:
        llm.close()


def test_the_serve_command(zoo):
    """`tiered serve` end to end in a subprocess: flags, the default model id, the key, a completion."""
    import subprocess
    import sys

    port, path = _free_port(), zoo.dir("llama")
    cmd = [sys.executable, "-c", "from tiered.cli import app; app()", "serve", "--model", str(path),
           "--port", str(port), "--api-key", KEY, "--max-batch", "2", "--max-queue", "2", "--decode-weights", "fp32",
           "--plan", "off", "--allowed-origin", "https://app.example.com"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "tiered serve did not come up"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0, timeout=60)
        assert [m.id for m in client.models.list()] == [path.name]
        out = client.completions.create(model=path.name, prompt=PROMPTS[0], max_tokens=5, temperature=0)
        assert out.usage.completion_tokens >= 1
        assert httpx.get(f"http://127.0.0.1:{port}/v1/models").status_code == 401
        cors = httpx.get(f"http://127.0.0.1:{port}/v1/models", headers={"Origin": "https://app.example.com"})
        assert cors.headers["access-control-allow-origin"] == "https://app.example.com"  # --allowed-origin
        # a second server on the taken port: uvicorn says why and the command exits, not hangs
        busy = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        assert busy.returncode == 1, busy.stdout + busy.stderr
    finally:
        proc.terminate()  # SIGTERM: the HTTP thread and the engine (on the main thread) stop cleanly
        assert proc.wait(timeout=30) == 0, proc.stdout.read()
    bad = subprocess.run(cmd[:4] + ["--max-batch", "-1"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "max-batch" in bad.stderr
    bad = subprocess.run(cmd[:4] + ["--allowed-origin", "https://app.example.com/"], capture_output=True, text=True,
                         timeout=60)
    assert bad.returncode == 2 and "allowed-origin" in bad.stderr


def test_serve_plans_its_batch_where_no_gpu_is_used(zoo):
    """`serve --max-batch 0` (the default) without an accelerator: the throughput goal picks the batch for chat-sized
    requests up to AUTO_MOST, and the server's KV cache has that many slots; with one (the stand-in), or a batch
    given, that batch under the latency goal; with one (the stand-in), up to ACCELERATOR_BATCH
    (test_serve_on_a_gpu_takes_the_slots_its_budget_holds)."""
    from tiered.errors import ConfigError
    from tiered.serve.engine import ACCELERATOR_BATCH, AUTO_MOST, AUTO_WORKLOAD, LONE_DECODE_SHARE, serve_batch

    assert serve_batch("none", 3) == serve_batch("host", 3) == {"max_batch": 3}
    batch = serve_batch("none", 0)
    assert batch == {"max_batch": AUTO_MOST, "goal": "throughput", "workload": AUTO_WORKLOAD,
                     "lone_decode_share": LONE_DECODE_SHARE}
    assert serve_batch("host", 0) == dict(batch, max_batch=ACCELERATOR_BATCH)
    with pytest.raises(ConfigError, match="lone_decode_share"):
        EngineConfig(lone_decode_share=1.5)
    llm = LLM(zoo.dir("llama"), EngineConfig(accelerator="none", max_context=256, decode_weights="fp32", **batch))
    try:
        assert llm.plan.goal == "throughput" and (llm.plan.prompt_tokens, llm.plan.gen_tokens) == (128, 128)
        assert 1 < llm.plan.kv_slots <= AUTO_MOST
        assert any(n.startswith(f"throughput goal: batch {llm.plan.kv_slots} ") for n in llm.plan.notes)
        engine = ServingEngine(llm, max_batch=llm.plan.kv_slots)  # the room the plan kept
        assert engine.cache.k.shape[1] == llm.plan.kv_slots
    finally:
        llm.close()


def _reference_logprobs(llm, prompt_ids: list[int], output_ids: list[int]) -> list[float]:
    """Each generated token's log-probability from one full-sequence scoring pass (LLM.logits)."""
    rows = llm.logits(prompt_ids + output_ids[:-1])[len(prompt_ids) - 1:].log_softmax(-1)
    return [float(rows[i, t]) for i, t in enumerate(output_ids)]


def test_n_choices_sample_as_the_api_samples_a_list_of_the_prompt(server):
    """OpenAI's `n`: n choices of one prompt, choice i sampled with seed + i, as LLM.generate samples
    the prompt given n times; the usage counts the prompt once and every choice's tokens."""
    kw = dict(model=MODEL, prompt=PROMPTS[6], max_tokens=12, temperature=1.0, seed=77)
    out = server.client.completions.create(n=3, **kw)
    _idle(server)
    refs = server.llm.generate([PROMPTS[6]] * 3, SamplingParams(temperature=1.0, max_tokens=12, seed=77), chat=False)
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert [c.text for c in out.choices] == [r.text for r in refs]
    assert len({c.text for c in out.choices}) > 1  # the seeds differ: so do the samples
    assert out.choices[0].text == server.client.completions.create(n=1, **kw).choices[0].text
    assert out.usage.prompt_tokens == len(refs[0].prompt_token_ids)
    assert out.usage.completion_tokens == sum(len(r.token_ids) for r in refs)
    # streamed: every chunk names its choice; each choice's deltas make its text and end with its finish
    messages = [{"role": "user", "content": PROMPTS[6]}]
    ckw = dict(model=MODEL, messages=messages, max_tokens=10, temperature=1.0, seed=5, n=2)
    whole = server.client.chat.completions.create(**ckw)
    chunks = list(server.client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **ckw))
    texts, finishes, roles = ["", ""], [None, None], [0, 0]
    for c in chunks[:-1]:
        (choice,) = c.choices
        roles[choice.index] += choice.delta.role == "assistant"
        texts[choice.index] += choice.delta.content or ""
        finishes[choice.index] = choice.finish_reason or finishes[choice.index]
    assert roles == [1, 1] and texts == [c.message.content for c in whole.choices]
    assert finishes == [c.finish_reason for c in whole.choices]
    assert not chunks[-1].choices and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    # more choices than the server runs and queues at once (4 slots + 16): refused, not queued for ever
    r = httpx.post(server.url + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                   json={**kw, "n": server.engine.capacity + 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n" and "--max-queue" in r.json()["error"]["message"]
    r = httpx.post(server.url + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"}, json={**kw, "n": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"


def test_completion_logprobs(server):
    kw = dict(model=MODEL, prompt=PROMPTS[4], max_tokens=10, temperature=0, logprobs=3)
    out = server.client.completions.create(**kw)
    lp = out.choices[0].logprobs
    ref = _greedy(server, PROMPTS[4], 10, chat=False, logprobs=3)
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == out.usage.completion_tokens
    assert lp.token_logprobs == pytest.approx(_reference_logprobs(server.llm, ref.prompt_token_ids, ref.token_ids),
                                              abs=1e-3)
    # equal up to float rounding: with prefix reuse the server prefills only what its slot lacks
    assert lp.token_logprobs == pytest.approx([e.logprob for e in ref.logprobs], abs=1e-5)
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert 1 <= len(top) <= 3 and max(top.values()) == logprob and top[token] == logprob  # greedy: the argmax
        assert all(v <= 0 for v in top.values())
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    chunks = [c.choices[0] for c in server.client.completions.create(stream=True, **kw)]
    streamed = [c.logprobs for c in chunks if c.logprobs is not None]
    assert sum((s.tokens for s in streamed), []) == lp.tokens
    assert sum((s.token_logprobs for s in streamed), []) == pytest.approx(lp.token_logprobs, abs=1e-5)
    assert sum((s.text_offset for s in streamed), []) == lp.text_offset
    assert server.client.completions.create(model=MODEL, prompt="hi", max_tokens=2).choices[0].logprobs is None


def _lm_eval_parse(choice: dict, ctxlen: int) -> tuple[float, bool]:
    """lm-eval-harness local-completions' reading of an echoed choice (parse_logprobs): the sum of the
    continuation's token log-probabilities (the prompt past ctxlen tokens, the generated one left out)
    and whether each was its position's most likely token."""
    lp = choice["logprobs"]
    tokens, tops = lp["token_logprobs"][ctxlen:-1], lp["top_logprobs"][ctxlen:-1]
    return sum(tokens), all(t == max(top.values()) for t, top in zip(tokens, tops))


def test_echo_scores_the_prompt_as_lm_eval_asks(server):
    """`echo` with `logprobs` (lm-eval-harness's loglikelihood request: token-id prompts in a batch,
    max_tokens 1, logprobs 1, echo): each choice's text and logprobs begin with its prompt's, the first
    token's null, the others the model's (LLM.logits); lm-eval's reading gives the reference sum and
    greediness. max_tokens 0 scores the prompt alone; a stream's first chunk is the prompt; a batch of
    texts gives a choice each; echo without logprobs echoes the text."""
    tok = server.llm.tokenizer
    ids = [tok.encode(p) for p in PROMPTS[4:6]]
    body = {"model": MODEL, "prompt": ids, "max_tokens": 1, "logprobs": 1, "echo": True, "temperature": 0, "seed": 1234}
    r = httpx.post(server.url + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"}, json=body).json()
    assert [c["index"] for c in r["choices"]] == [0, 1]
    assert r["usage"]["prompt_tokens"] == sum(len(x) for x in ids) and r["usage"]["completion_tokens"] == 2
    for x, choice in zip(ids, r["choices"]):
        lp = choice["logprobs"]
        assert len(lp["token_logprobs"]) == len(x) + 1 and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        scores = server.llm.logits(x).log_softmax(-1)
        want = [float(scores[i, t]) for i, t in enumerate(x[1:])]
        assert lp["token_logprobs"][1:len(x)] == pytest.approx(want, abs=1e-4)
        assert choice["text"].startswith(tok.decode(x)) and lp["text_offset"][0] == 0
        ctxlen = 3
        total, greedy = _lm_eval_parse(choice, ctxlen)
        assert total == pytest.approx(sum(want[ctxlen - 1:]), abs=1e-3)
        assert greedy == all(int(scores[i].argmax()) == x[i + 1] for i in range(ctxlen - 1, len(x) - 1))
    only = httpx.post(server.url + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                      json={**body, "prompt": ids[0], "max_tokens": 0}).json()
    choice = only["choices"][0]
    assert choice["text"] == tok.decode(ids[0]) and choice["finish_reason"] == "length"
    assert choice["logprobs"]["token_logprobs"] == r["choices"][0]["logprobs"]["token_logprobs"][:-1]
    assert only["usage"]["completion_tokens"] == 0
    chunks = [c.choices[0] for c in server.client.completions.create(
        model=MODEL, prompt=PROMPTS[4], max_tokens=3, logprobs=2, echo=True, temperature=0, stream=True)]
    whole = server.client.completions.create(model=MODEL, prompt=PROMPTS[4], max_tokens=3, logprobs=2, echo=True,
                                             temperature=0).choices[0]
    assert chunks[0].text == PROMPTS[4] and "".join(c.text for c in chunks) == whole.text
    streamed = [c.logprobs for c in chunks if c.logprobs is not None]
    assert sum((x.token_logprobs for x in streamed), []) == whole.logprobs.token_logprobs
    assert sum((x.text_offset for x in streamed), []) == whole.logprobs.text_offset
    assert whole.logprobs.text_offset[len(ids[0])] == len(PROMPTS[4])  # the completion's after the prompt
    texts = server.client.completions.create(model=MODEL, prompt=PROMPTS[:2], max_tokens=2, echo=True, temperature=0)
    assert [c.text[:len(p)] for c, p in zip(texts.choices, PROMPTS)] == PROMPTS[:2]
    assert all(c.logprobs is None for c in texts.choices)
    for bad in ({"max_tokens": 0, "echo": False}, {"prompt": []}):
        r = httpx.post(server.url + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"}, json={**body, **bad})
        assert r.status_code == 400, r.json()


def test_chat_logprobs(server):
    messages = [{"role": "user", "content": PROMPTS[2]}]
    kw = dict(model=MODEL, messages=messages, max_tokens=8, temperature=0, logprobs=True, top_logprobs=2)
    out = server.client.chat.completions.create(**kw)
    content = out.choices[0].logprobs.content
    ref = _greedy(server, messages, 8, chat=True, logprobs=2)
    # equal up to float rounding: with prefix reuse the server prefills only what its slot lacks
    assert [c.logprob for c in content] == pytest.approx([e.logprob for e in ref.logprobs], abs=1e-5)
    assert [c.logprob for c in content] == pytest.approx(
        _reference_logprobs(server.llm, ref.prompt_token_ids, ref.token_ids), abs=1e-3)
    for c, e in zip(content, ref.logprobs):
        assert c.token == server.llm.tokenizer.decode([e.token])
        assert bytes(c.bytes) == token_bytes(server.llm.tokenizer, e.token)
        assert [t.logprob for t in c.top_logprobs] == pytest.approx([lp for _, lp in e.top], abs=1e-5)
        assert len(c.top_logprobs) == 2
        assert c.top_logprobs[0].token == c.token and c.top_logprobs[0].logprob == c.logprob  # greedy
    chunks = list(server.client.chat.completions.create(stream=True, **kw))
    streamed = sum((c.choices[0].logprobs.content for c in chunks if c.choices and c.choices[0].logprobs), [])
    assert [c.token for c in streamed] == [c.token for c in content]
    assert [c.logprob for c in streamed] == pytest.approx([c.logprob for c in content], abs=1e-5)
    plain = server.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
    assert plain.choices[0].logprobs is None
    with pytest.raises(openai.BadRequestError, match="top_logprobs needs logprobs"):
        server.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, top_logprobs=2)
    with pytest.raises(openai.BadRequestError):
        server.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, logprobs=True,
                                              top_logprobs=21)


def test_serve_on_a_gpu_takes_the_slots_its_budget_holds(rt):
    """`serve` with an accelerator (the stand-in) and --max-batch 0: the largest batch up to ACCELERATOR_BATCH whose
    KV cache the GPU budget holds (its plans price no batch), where 8 slots had been refused with a BudgetError
    though `run`'s one slot fitted; the server's cache has the planned slots, inside the budget."""
    from tiered.errors import BudgetError
    from tiered.hardware.standin import device_memory
    from tiered.serve.engine import ACCELERATOR_BATCH, serve_batch

    s = rt.sizes("mixtral")
    budget = s.fast(cache_slots=2) + s.kv  # the weights, 2 expert cache slots and 2 sequences' KV cache
    config = dict(accelerator="host", gpu_memory=budget, cpu_memory="64MiB", expert_cache_slots=2)
    with pytest.raises(BudgetError, match="KV cache"):
        LLM(rt.dir("mixtral"), engine_config(**config, max_batch=ACCELERATOR_BATCH))  # what serve asked for
    with device_memory() as m:  # the stand-in's real allocations
        llm = LLM(rt.dir("mixtral"), engine_config(**config, **serve_batch("host", 0)))
        try:
            assert llm.plan.goal == "throughput" and llm.plan.kv_slots == 2
            assert any(n.startswith(f"throughput goal: batch 2, the largest that fits up to {ACCELERATOR_BATCH}")
                       for n in llm.plan.notes), llm.plan.notes
            prompts = [moe_prompt(5), moe_prompt(7, seed=1)]
            refs = [llm.generate(p, SamplingParams(temperature=0, max_tokens=6))[0].token_ids for p in prompts]
            engine = ServingEngine(llm, max_batch=llm.plan.kv_slots, max_queue=4)
            assert engine.cache.k.shape[1] == 2
            with running_server(engine, None) as url:
                def ask(p):
                    body = dict(model=MODEL, prompt=p, max_tokens=6, temperature=0, return_tokens_as_token_ids=True)
                    return httpx.post(url + "/v1/completions", json=body, timeout=60).json()
                with ThreadPoolExecutor(2) as pool:
                    got = list(pool.map(ask, prompts))
            assert [g["usage"]["completion_tokens"] for g in got] == [len(r) for r in refs] == [6, 6], got
            assert 0 < m.peak <= budget
        finally:
            llm.close()


def test_max_batch_is_planned_for(rt):
    """`serve --max-batch N` plans room for N sequences' KV caches on the fast tier, so the
    server's N-slot cache fits a budget that the planner would otherwise fill with experts."""
    from tiered.errors import BudgetError

    s = rt.sizes("mixtral")
    budget = s.fast(cache_slots=2) + 3 * s.kv + s.expert // 2  # room for 3 more KV caches, not another expert
    llm = LLM(rt.dir("mixtral"), engine_config(accelerator="host", gpu_memory=budget, cpu_memory="64MiB",
                                               expert_cache_slots=2, max_batch=4))
    assert llm.plan.kv_slots == 4
    engine = ServingEngine(llm, max_batch=4, max_queue=4)  # its 4-slot KV cache fits what the plan kept
    assert engine.cache.k.shape[1] == 4
    one = LLM(rt.dir("mixtral"), engine_config(accelerator="host", gpu_memory=budget - 3 * s.kv, cpu_memory="64MiB",
                                               expert_cache_slots=2))
    with pytest.raises(BudgetError):  # planned for one sequence: no room for four
        ServingEngine(one, max_batch=4, max_queue=4)


# ------------------------------------------------------------------------------ QA regressions
def test_a_tiny_temperature_or_top_p_is_greedy_and_spares_the_batch(server, slow_steps):
    """temperature 1e-320 (0 in fp32) or 1e-40 (1/T overflows fp32) is greedy and top_p 1e-320 keeps the
    most likely token; such a request used to fail every request in its step with a 500."""
    ref = _greedy(server, PROMPTS[0], 8, chat=False)
    slow_steps(server.llm)

    def one(kw: dict) -> str:
        return server.client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=8, **kw).choices[0].text
    cases = [dict(temperature=0), dict(temperature=1e-320), dict(temperature=1e-40), dict(temperature=1, top_p=1e-320),
             dict(temperature=1e-40, top_p=0.5)]
    with ThreadPoolExecutor(len(cases)) as pool:  # in one batch with each other
        got = list(pool.map(one, cases))
    assert got == [ref.text] * len(cases)


@pytest.fixture
def own_server(server):
    """A second server (1 slot, queue of 2) over the same LLM, with an engine of its own that a test
    may stop; yields (url, engine)."""
    engine = ServingEngine(server.llm, max_batch=1, max_queue=2)
    with running_server(engine, None) as url:
        yield url, engine


def test_stopping_ends_every_request_in_flight_at_once(own_server, server, slow_steps):
    """engine.stop() (what `tiered serve` does on SIGTERM or Ctrl-C) ends the running and the
    waiting requests at once: 503 server_shutting_down for a whole answer, an error event then
    [DONE] for a stream; later requests get 503 too, and the HTTP server then exits promptly. They
    used to wait forever (the command: until its 30 s join gave up, dropping them without a word)."""
    url, engine = own_server
    prompt = PROMPTS[6]
    assert _greedy(server, prompt, 100, chat=False).finish_reason == "length"  # 100 slow steps: 2+ s
    slow_steps(server.llm)
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 100, "temperature": 0}
    with ThreadPoolExecutor(2) as pool, httpx.stream("POST", url + "/v1/completions", timeout=10,
                                                     json={**body, "stream": True}) as stream:
        lines = stream.iter_lines()
        assert next(lines).startswith("data: {")  # running
        waiting = [pool.submit(httpx.post, url + "/v1/completions", json=body, timeout=10) for _ in range(2)]
        deadline = time.monotonic() + 5
        while engine.scheduler.num_waiting < 2:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        t0 = time.monotonic()
        engine.stop()
        rest = [line for line in lines if line]
        for r in (f.result() for f in waiting):
            assert r.status_code == 503 and r.json()["error"]["code"] == "server_shutting_down"
        assert time.monotonic() - t0 < 1.0  # not the 2 s the requests had left
    assert rest[-1] == "data: [DONE]"
    error = json.loads(rest[-2].removeprefix("data: "))["error"]
    assert error["code"] == "server_shutting_down" and error["type"] == "server_error"
    r = httpx.post(url + "/v1/completions", json=body)
    assert r.status_code == 503 and r.json()["error"]["code"] == "server_shutting_down"
    assert _metrics(SimpleNamespace(url=url))['tiered_requests_total{outcome="shutdown"}'] == 4


def test_encoding_runs_off_the_event_loop_and_huge_prompts_are_refused_early(server, monkeypatch):
    """A prompt's encoding runs on a worker thread (the server answers meanwhile: an 8 MB prompt
    used to stall every client for ~12 s); a prompt too long to fit by its characters is refused
    before it is encoded, and a body too large to hold any prompt that fits before it is read."""
    make = server.llm.make_sequence

    def slow_make(*a, **kw):
        time.sleep(1.0)
        return make(*a, **kw)
    monkeypatch.setattr(server.llm, "make_sequence", slow_make)
    with ThreadPoolExecutor(1) as pool:
        done = pool.submit(server.client.completions.create, model=MODEL, prompt="hi", max_tokens=2)
        time.sleep(0.2)
        t0 = time.monotonic()
        assert httpx.get(server.url + "/health").status_code == 200
        assert time.monotonic() - t0 < 0.5
        assert done.result().choices
    monkeypatch.undo()
    auth = {"Authorization": f"Bearer {KEY}"}
    chars = 32 * server.llm.max_context + 1
    r = httpx.post(server.url + "/v1/chat/completions", headers=auth,
                   json={"model": MODEL, "messages": [{"role": "user", "content": "a" * chars}]})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert r.json()["error"]["param"] == "messages" and f"{chars} characters" in r.json()["error"]["message"]
    r = httpx.post(server.url + "/v1/completions", headers=auth, json={"model": MODEL, "prompt": "a" * (8 << 20)})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

    def chunks():  # a chunked body (no Content-Length): refused once it passes the limit
        yield b'{"model": "tiny-llama", "prompt": "'
        for _ in range(64):
            yield b"a" * (1 << 17)
        yield b'"}'
    r = httpx.post(server.url + "/v1/completions", headers={**auth, "content-type": "application/json"},
                   content=chunks())
    assert r.status_code == 413 and r.json()["error"]["type"] == "invalid_request_error"
    assert server.client.completions.create(model=MODEL, prompt="hi", max_tokens=2).choices


def test_seed_outside_64_bits_and_handler_failures_get_json_errors(server, monkeypatch):
    """A seed outside the signed 64-bit range is a 400 on param "seed" (it was a plain-text 500 that
    reset the connection), and any exception a handler raises is answered as OpenAI's JSON 500 on a
    connection that stays usable."""
    auth = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=server.url, headers=auth) as http:
        for seed in (2**64, 2**63, -2**63 - 1):
            r = http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2, "seed": seed})
            assert r.status_code == 400 and r.json()["error"]["param"] == "seed", r.text
        for seed in (2**63 - 1, -2**63):
            r = http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2, "seed": seed})
            assert r.status_code == 200, r.text

        def broken(*a, **kw):
            raise RuntimeError("a bug (simulated)")
        monkeypatch.setattr(server.engine, "submit", broken)
        before = _metrics(server).get('tiered_requests_total{outcome="error",status="500"}', 0)
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
        assert "simulated" in r.json()["error"]["message"]
        assert _metrics(server)['tiered_requests_total{outcome="error",status="500"}'] == before + 1
        monkeypatch.undo()
        assert http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2}).status_code == 200


def test_error_shapes_models_endpoint_and_the_authorization_scheme(server):
    auth = {"Authorization": f"Bearer {KEY}"}
    for method, path, status, code in (("GET", "/v1/nope", 404, "unknown_url"), ("GET", "/nope", 404, "unknown_url"),
                                       ("GET", "/v1/completions", 405, "method_not_allowed"),
                                       ("GET", "/v1/models/gpt-x", 404, "model_not_found")):
        r = httpx.request(method, server.url + path, headers=auth)
        assert r.status_code == status and set(r.json()) == {"error"}, r.text
        assert r.json()["error"]["code"] == code and r.json()["error"]["type"] == "invalid_request_error"
    assert server.client.models.retrieve(MODEL).id == MODEL
    r = httpx.get(server.url + f"/v1/models/{MODEL}", headers=auth)
    assert r.json() == httpx.get(server.url + "/v1/models", headers=auth).json()["data"][0]
    assert httpx.get(server.url + f"/v1/models/{MODEL}").status_code == 401
    r = httpx.post(server.url + "/v1/chat/completions", content=b'{"model": "x", "messages": [}',
                   headers={**auth, "content-type": "application/json"})
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] is None
    assert error["message"] == "the body is not valid JSON: Expecting value at character 28", error
    for header in (f"bearer {KEY}", f"BEARER {KEY}", f"Bearer  {KEY}"):
        assert httpx.get(server.url + "/v1/models", headers={"Authorization": header}).status_code == 200
    assert httpx.get(server.url + "/v1/models", headers={"Authorization": f"Basic {KEY}"}).status_code == 401


@pytest.mark.parametrize("endpoint,field,value", [
    ("completions", "best_of", 2), ("completions", "suffix", "x"),
    ("chat", "functions", [{"name": "f"}])])
def test_unsupported_parameters_are_refused(server, endpoint, field, value):
    """Parameters that would change what the answer means are refused by name (they were ignored
    with a 200); their neutral values, which common clients send, are accepted."""
    body = ({"messages": [{"role": "user", "content": "hi"}]} if endpoint == "chat" else {"prompt": "hi"})
    r = httpx.post(f"{server.url}/v1/{endpoint.replace('chat', 'chat/completions')}",
                   headers={"Authorization": f"Bearer {KEY}"}, json={"model": MODEL, "max_tokens": 2, **body, field: value})
    assert r.status_code == 400 and r.json()["error"]["param"] == field
    assert "not supported" in r.json()["error"]["message"]


def test_logit_bias_and_penalties_sample_as_the_engine_does(server):
    """OpenAI's logit_bias, frequency_penalty and presence_penalty reach the sampler (they were refused):
    a +100 bias makes a token every greedy pick, and penalties give LLM.generate's tokens with them;
    out-of-range values, keys that are not token ids and ids past the vocabulary are 400s naming them."""
    prompt = PROMPTS[2]
    out = server.client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0,
                                           logit_bias={"5": 100})
    assert out.choices[0].text == server.llm.tokenizer.decode([5] * 5)
    penal = dict(frequency_penalty=1.5, presence_penalty=0.5)
    got = server.client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, **penal)
    want = _greedy(server, prompt, 12, chat=False, **penal)
    assert got.choices[0].text == want.text and want.token_ids != _greedy(server, prompt, 12, chat=False).token_ids
    for field, value in (("presence_penalty", 2.5), ("frequency_penalty", -3), ("logit_bias", {"x": 1}),
                         ("logit_bias", {"5": 101}), ("logit_bias", {str(server.llm.config.vocab_size): 1})):
        r = httpx.post(f"{server.url}/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                       json={"model": MODEL, "max_tokens": 2, "prompt": "hi", field: value})
        assert r.status_code == 400 and field in (r.json()["error"]["param"] or r.json()["error"]["message"]), r.json()


def test_structured_outputs_in_openai_and_vllm_forms(server):
    """response_format json_schema / json_object (OpenAI), structured_outputs and guided_* (vLLM) constrain
    the answer as SamplingParams.structured_outputs does in LLM.generate (they were refused with 400), a
    lone request included (it would otherwise decode in a native burst, unconstrained); several at once, a
    regex that does not compile, a json_schema without its schema are 400s."""
    schema = {"type": "object", "properties": {"word": {"enum": ["fox", "dog", "cat"]}, "n": {"type": "integer",
              "minimum": 0, "maximum": 9}}, "required": ["word", "n"], "additionalProperties": False,
              "x-guidance": {"whitespace_flexible": False}}
    messages = [{"role": "user", "content": "describe a fox"}]
    got = server.client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=60, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "animal", "schema": schema, "strict": True}})
    want = server.llm.generate([messages], SamplingParams(max_tokens=60, temperature=0,
                                                          structured_outputs={"json": schema}), chat=True)[0]
    assert got.choices[0].message.content == want.text and got.choices[0].finish_reason == "stop"
    assert set(json.loads(want.text)) == {"word", "n"}
    obj = server.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=200, temperature=0.7,
                                                seed=1, response_format={"type": "json_object"}).choices[0]
    assert obj.finish_reason == "length" or isinstance(json.loads(obj.message.content), dict)
    for extra, check in (({"structured_outputs": {"regex": "[a-c]{2,4}!"}}, lambda t: re.fullmatch("[a-c]{2,4}!", t)),
                         ({"guided_choice": ["yes", "no"]}, lambda t: t in ("yes", "no")),
                         ({"guided_regex": "(ab)+c"}, lambda t: re.fullmatch("(ab)+c", t)),
                         ({"guided_json": schema}, lambda t: set(json.loads(t)) == {"word", "n"}),
                         ({"structured_outputs": {"grammar": 'root ::= "x" [0-9]'}}, lambda t: re.fullmatch("x[0-9]", t))):
        out = server.client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=60, temperature=0.9,
                                               seed=2, n=2, extra_body=extra)
        assert all(check(c.text) and c.finish_reason == "stop" for c in out.choices), (extra, out.choices)
    for body, param in (({"guided_regex": "(", "max_tokens": 3}, None),
                        ({"guided_choice": ["a"], "guided_regex": "b"}, None),
                        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
                        ({"response_format": {"type": "xml"}}, "response_format")):
        r = httpx.post(f"{server.url}/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"},
                       json={"model": MODEL, "messages": messages, **body})
        assert r.status_code == 400, (body, r.text)
        assert param is None or (r.json()["error"]["param"] or "").startswith(param), r.json()


def test_neutral_values_of_unsupported_parameters_are_accepted(server):
    neutral = dict(logit_bias={}, frequency_penalty=0, presence_penalty=0.0)
    out = server.client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=4, temperature=0, echo=False,
                                           best_of=1, suffix=None, **neutral)
    assert out.choices[0].text == _greedy(server, PROMPTS[0], 4, chat=False).text
    assert server.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=2, response_format={"type": "text"},
                                                 extra_body={"logit_bias": None, "tools": []}, **neutral).choices


def test_refused_requests_are_counted_by_status(server):
    before = _metrics(server)
    auth = {"Authorization": f"Bearer {KEY}"}
    httpx.post(server.url + "/v1/completions", headers=auth, json={"model": MODEL, "prompt": "hi", "max_tokens": 0})
    httpx.post(server.url + "/v1/completions", headers=auth, json={"model": "gpt-x", "prompt": "hi"})
    httpx.get(server.url + "/v1/models")
    after = _metrics(server)
    key = 'tiered_requests_total{outcome="invalid",status="%d"}'
    assert after[key % 400] == before.get(key % 400, 0) + 2 and after[key % 401] == before.get(key % 401, 0) + 1


def test_requests_that_leave_sampling_out_take_the_models_generation_config(zoo, chat_llama, tmp_path):
    """generation_config.json's sampling (vLLM's --generation-config auto): a request without temperature / top_p /
    top_k / min_p / repetition_penalty takes the model's (here temperature 0: greedy, the text of an explicit
    temperature 0), one that gives them keeps its own; vLLM's top_k -1 is off; do_sample false ships none."""
    import json
    import shutil

    from tiered.checkpoint.hf_dir import generation_defaults
    from tiered.serve.protocol import ChatCompletionRequest

    d = tmp_path / "llama-gen"
    shutil.copytree(chat_llama, d)
    (d / "generation_config.json").write_text(json.dumps({"do_sample": True, "temperature": 0.0, "top_k": 20,
                                                          "repetition_penalty": 1.05, "eos_token_id": 1}))
    assert generation_defaults(d) == {"temperature": 0.0, "top_k": 20, "repetition_penalty": 1.05}
    body = ChatCompletionRequest(model=MODEL, messages=[{"role": "user", "content": "hi"}], top_k=-1, top_p=0.5)
    p = body.sampling(8, generation_defaults(d))
    assert (p.temperature, p.top_p, p.top_k, p.repetition_penalty) == (0.0, 0.5, 0, 1.05)
    q = ChatCompletionRequest(model=MODEL, messages=[{"role": "user", "content": "hi"}]).sampling(8)
    assert (q.temperature, q.top_p, q.top_k, q.repetition_penalty) == (1.0, 1.0, 0, 1.0)  # OpenAI's
    # vLLM's ignore_eos extra (benchmarks' batch files): every request generates its max_tokens
    assert not q.ignore_eos and ChatCompletionRequest(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                      ignore_eos=True).sampling(8).ignore_eos
    llm = zoo.llm(d)
    with running_server(ServingEngine(llm, max_batch=2, max_queue=4), KEY) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=60)
        ask = dict(model=MODEL, messages=[{"role": "user", "content": "memory is"}], max_tokens=12)
        left_out = {client.chat.completions.create(**ask, seed=s).choices[0].message.content for s in range(3)}
        greedy = client.chat.completions.create(**ask, temperature=0, extra_body={"repetition_penalty": 1.05,
                                                                                  "top_k": 20})
        assert left_out == {greedy.choices[0].message.content}
        sampled = {client.chat.completions.create(**ask, temperature=1.5, seed=s).choices[0].message.content
                   for s in range(3)}
        assert len(sampled) > 1  # its own temperature
    (d / "generation_config.json").write_text(json.dumps({"do_sample": False, "temperature": 0.6}))
    assert generation_defaults(d) == {}
