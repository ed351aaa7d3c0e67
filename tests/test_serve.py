"""`tiered serve`: the real server (uvicorn in a thread, on a free loopback port) over a tiny model,
driven by the real `openai` client and raw HTTP.

Greedy output through the server must equal LLM.generate of the same prompt; bad requests get
OpenAI-style errors and leave the server serving; a client that goes away frees its slot.
"""

from __future__ import annotations

import contextlib
import json
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
from tiered import LLM, SamplingParams
from tiered.serve.app import build_app
from tiered.serve.engine import ServingEngine

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
    """slow_steps(llm): from now on each of llm's engine steps takes >= 20 ms more, so requests
    overlap and a disconnect lands mid-stream."""
    def enable(llm) -> None:
        step = llm.step

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
    with pytest.raises(openai.BadRequestError):
        server.client.completions.create(model=MODEL, prompt=["one", "two"], max_tokens=4)
    out = server.client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=4, temperature=0)
    assert out.choices[0].text == _greedy(server, PROMPTS[0], 4, chat=False).text


def test_a_failed_step_fails_its_requests_and_the_server_goes_on(server, monkeypatch):
    step = server.llm.step

    def broken(*a, **kw):
        monkeypatch.setattr(server.llm, "step", step)  # only this one step fails
        raise RuntimeError("out of memory (simulated)")
    monkeypatch.setattr(server.llm, "step", broken)
    with pytest.raises(openai.InternalServerError, match="simulated"):
        server.client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=4)
    _idle(server)
    assert server.engine.scheduler.num_running == 0
    out = server.client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=4, temperature=0)
    assert out.choices[0].text == _greedy(server, PROMPTS[0], 4, chat=False).text


def test_queue_full_answers_503_with_retry_after(server, monkeypatch):
    monkeypatch.setattr(server.engine.scheduler, "max_queue", 0)  # every place in the queue taken
    r = httpx.post(server.url + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                   json={"model": MODEL, "prompt": "hi"})
    assert r.status_code == 503 and r.headers["retry-after"] == "1" and r.json()["error"]["code"] == "queue_full"
    monkeypatch.undo()
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


def test_moe_under_a_budget_batches_requests(rt, zoo, tmp_path, slow_steps):
    """A tiny Mixtral behind the host stand-in, experts in CPU RAM with a 2-slot cache, 2 KV slots:
    concurrent requests equal LLM.generate, within the budget; /metrics shows the expert hit rate."""
    d = tmp_path / "mixtral"
    shutil.copytree(rt.dir("mixtral"), d)
    zoo.tokenizer.save_pretrained(d)  # to stream text; prompts stay token ids below the MoE vocab
    s = rt.sizes("mixtral")
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
           "--plan", "off"]
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
        # a second server on the taken port: uvicorn says why and the command exits, not hangs
        busy = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        assert busy.returncode == 1, busy.stdout + busy.stderr
    finally:
        proc.terminate()  # SIGTERM: the HTTP thread and the engine (on the main thread) stop cleanly
        assert proc.wait(timeout=30) == 0, proc.stdout.read()
    bad = subprocess.run(cmd[:4] + ["--max-batch", "0"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "max-batch" in bad.stderr


def _reference_logprobs(llm, prompt_ids: list[int], output_ids: list[int]) -> list[float]:
    """Each generated token's log-probability from one full-sequence scoring pass (LLM.logits)."""
    rows = llm.logits(prompt_ids + output_ids[:-1])[len(prompt_ids) - 1:].log_softmax(-1)
    return [float(rows[i, t]) for i, t in enumerate(output_ids)]


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
        assert c.token == server.llm.tokenizer.decode([e.token]) and bytes(c.bytes) == c.token.encode()
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
