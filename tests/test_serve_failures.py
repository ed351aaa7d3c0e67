"""`tiered serve` when one request fails, and the completion logprobs of characters split over tokens.

A request whose prefill, sampling or detokenizing raises ends alone (500, or an error event and
[DONE] for a stream) while the requests stepped with it finish with the text they would have had;
a failure of every step fails every request in flight and leaves the slots free. A completion's
logprobs give each token the text it adds to the completion, so the texts join to the completion
and text_offset counts characters of it, also where one character spans several tokens.
"""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from test_serve import KEY, MODEL, PROMPTS, _greedy, _idle, _metrics, server  # noqa: F401
from tiered import SamplingParams
from tiered.engine import llm as llm_module
from tiered.engine.sequence import TokenLogprob
from tiered.errors import ContextLengthError
from tiered.serve.protocol import CompletionLogprobs

AUTH = {"Authorization": f"Bearer {KEY}"}
ERRORS = 'tiered_requests_total{outcome="error"}'  # requests the engine failed (/metrics)
POISON = 4242  # the seed of the request a test makes fail
SPLIT = "\u65e5\u672c\u8a9e, \U0001f600 and"  # CJK and an emoji: characters of 3 and 4 bytes


@pytest.fixture
def held_steps(monkeypatch):
    """held_steps(engine, n): the engine's steps wait until n requests run or wait, then each takes
    >= 20 ms, so that the n requests are stepped together."""
    def enable(engine, n: int) -> None:
        step, released = engine.llm.step, threading.Event()

        def held(*a, **kw):
            deadline = time.monotonic() + 10
            while not released.is_set() and time.monotonic() < deadline:
                if engine.scheduler.num_waiting + engine.scheduler.num_running >= n:
                    released.set()
                time.sleep(0.005)
            time.sleep(0.02)
            return step(*a, **kw)
        monkeypatch.setattr(engine.llm, "step", held)
    return enable


def _poison(monkeypatch, llm, where: str) -> None:
    """Make the request seeded POISON fail: its prefill (a context overflow found late), or its
    sampling or detokenizing once it has 2 tokens (sampling raises for its whole batch, as a
    batched sampler would, after drawing the other rows' numbers)."""
    def poisoned(seqs) -> bool:
        return any(s.params.seed == POISON for s in seqs)
    if where == "prefill":
        prefill, mixed = llm._prefill, llm._forward_mixed

        def bad_prefill(seqs, cache):
            if poisoned(seqs):
                raise ContextLengthError("the prompt overflows the context (simulated)")
            return prefill(seqs, cache)

        def bad_mixed(prefills, decode, cache):
            if poisoned(prefills):
                raise ContextLengthError("the prompt overflows the context (simulated)")
            return mixed(prefills, decode, cache)
        monkeypatch.setattr(llm, "_prefill", bad_prefill)
        monkeypatch.setattr(llm, "_forward_mixed", bad_mixed)
    elif where == "sampling":
        sample, calls = llm_module.sample_tokens, []

        def bad_sample(logits, params, seen, generators):
            tokens = sample(logits, params, seen, generators)
            if any(p.seed == POISON for p in params):
                calls.append(len(params))
                if len(calls) > 2:
                    raise ValueError("invalid probabilities (simulated)")
            return tokens
        monkeypatch.setattr(llm_module, "sample_tokens", bad_sample)
    else:
        append = llm_module.append_token_text

        def bad_append(tokenizer, seq):
            if seq.params.seed == POISON and len(seq.output_ids) > 2:
                raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte (simulated)")
            append(tokenizer, seq)
        monkeypatch.setattr(llm_module, "append_token_text", bad_append)


def _complete(url: str, prompt: str, stream: bool, **kw) -> tuple[int, str, dict | None]:
    """(status, text, error object or None) of one completion of 12 tokens (greedy unless `kw`
    says otherwise), streamed or whole."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 12, "temperature": 0, "stream": stream, **kw}
    if not stream:
        r = httpx.post(url + "/v1/completions", headers=AUTH, json=body, timeout=60)
        return r.status_code, r.json()["choices"][0]["text"] if r.status_code == 200 else "", r.json().get("error")
    with httpx.stream("POST", url + "/v1/completions", headers=AUTH, json=body, timeout=60) as r:
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]", lines
    events = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    text = "".join(e["choices"][0]["text"] for e in events if "choices" in e)
    return r.status_code, text, events[-1].get("error")


@pytest.mark.parametrize("where", ["prefill", "sampling", "detokenizing"])
@pytest.mark.parametrize("stream", [False, True])
def test_one_failing_request_spares_the_requests_stepped_with_it(server, monkeypatch, held_steps, where, stream):
    """The other requests of the failed step finish with their own text (streamed and whole; greedy,
    and sampled with a seed), the failing one gets OpenAI's error shape, the slots come back and the
    server goes on. A failure in one request's step used to fail every request in flight with it."""
    good = [PROMPTS[0], PROMPTS[4], SPLIT]
    kws = [{}, {}, dict(temperature=1.0, seed=7)]
    refs = [_greedy(server, p, 12, chat=False).text for p in good[:2]]
    refs.append(server.llm.generate(SPLIT, SamplingParams(temperature=1.0, top_p=1.0, seed=7, max_tokens=12),
                                    chat=False)[0].text)
    before = _metrics(server).get(ERRORS, 0)
    _poison(monkeypatch, server.llm, where)
    held_steps(server.engine, len(good) + 1)
    with ThreadPoolExecutor(len(good) + 1) as pool:
        done = [pool.submit(_complete, server.url, p, i % 2 == 1, **kw) for i, (p, kw) in enumerate(zip(good, kws))]
        bad = pool.submit(_complete, server.url, PROMPTS[1], stream, seed=POISON, max_tokens=40)
        got = [f.result() for f in done]
        status, _, error = bad.result()
    assert [(s, t) for s, t, _ in got] == [(200, ref) for ref in refs]
    assert status == (200 if stream else 500) and error["type"] == "server_error", error
    assert "simulated" in error["message"] and set(error) == {"message", "type", "param", "code"}
    monkeypatch.undo()
    _idle(server)
    assert _metrics(server)[ERRORS] == before + 1
    assert server.engine.scheduler.num_running == 0
    out = server.client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=8, temperature=0)
    assert out.choices[0].text == _greedy(server, PROMPTS[2], 8, chat=False).text
    assert sorted(server.engine.scheduler._free) == [0, 1, 2, 3]  # every slot free again


def test_a_step_that_always_fails_fails_every_request_and_frees_the_slots(server, monkeypatch, held_steps):
    """A forward that raises whatever the batch (no one request to blame) fails every request in
    flight with it; the slots come back and later requests are served."""
    def broken(*a, **kw):
        raise RuntimeError("device lost (simulated)")
    held_steps(server.engine, 3)
    monkeypatch.setattr(server.llm, "_forward", broken)
    monkeypatch.setattr(server.llm, "_forward_mixed", broken)
    with ThreadPoolExecutor(3) as pool:
        got = list(pool.map(lambda i: _complete(server.url, PROMPTS[i], i == 1), range(3)))
    assert [s for s, _, _ in got] == [500, 200, 500]
    assert all("device lost (simulated)" in e["message"] for _, _, e in got)
    monkeypatch.undo()
    _idle(server)
    assert sorted(server.engine.scheduler._free) == [0, 1, 2, 3] and server.engine.scheduler.num_waiting == 0
    with ThreadPoolExecutor(4) as pool:
        texts = list(pool.map(lambda p: _complete(server.url, p, False)[:2], PROMPTS[:4]))
    assert texts == [(200, _greedy(server, p, 12, chat=False).text) for p in PROMPTS[:4]]


def test_a_failure_delivering_one_request_spares_the_engine(server, monkeypatch, held_steps):
    """An exception while the engine thread hands one request its event (its metrics, its logprobs:
    outside the step) ends that request with the error, its last event too; the thread goes on
    serving the requests stepped with it and later ones. It used to stop the thread: every request
    in flight then waited forever."""
    engine = server.engine
    observe = engine.metrics.observe_finished

    def bad_observe(prompt_tokens, times, cached):
        if prompt_tokens == poisoned_len:
            raise ZeroDivisionError("metrics bug (simulated)")
        return observe(prompt_tokens, times, cached)

    poisoned_len = len(server.llm.encode(PROMPTS[1], chat=False))
    assert poisoned_len not in {len(server.llm.encode(p, chat=False)) for p in (PROMPTS[0], PROMPTS[4])}
    monkeypatch.setattr(engine.metrics, "observe_finished", bad_observe)
    held_steps(engine, 3)
    with ThreadPoolExecutor(3) as pool:
        got = list(pool.map(lambda i: _complete(server.url, PROMPTS[i], i == 4), (0, 1, 4)))
    assert [(s, t) for s, t, _ in got[::2]] == [(200, _greedy(server, PROMPTS[i], 12, chat=False).text) for i in (0, 4)]
    assert got[1][0] == 500 and "metrics bug (simulated)" in got[1][2]["message"]
    monkeypatch.undo()
    _idle(server)
    assert engine.scheduler.num_running == 0 and engine._thread.is_alive()
    assert _complete(server.url, PROMPTS[2], True)[:2] == (200, _greedy(server, PROMPTS[2], 12, chat=False).text)


# ------------------------------------------------------------------ logprobs of split characters
def test_completion_token_texts_join_to_the_text_where_characters_span_tokens(zoo):
    """Each token carries the text it adds: "" for a token ending inside a character, the whole
    character for the one completing it; text_offset counts characters before each token, and
    a stream's chunks (several calls) give what one call gives."""
    tok = zoo.tokenizer
    text = "Caf\u00e9 \U0001f600 and \u65e5\u672c\u8a9e."
    ids = tok.encode(text)
    assert any("\ufffd" in tok.decode([t]) for t in ids)  # some token is part of a character
    entries = [TokenLogprob(t, -1.0, [(t, -1.0), (ids[0], -2.0)]) for t in ids]
    whole = CompletionLogprobs(tok).add(entries)
    assert "".join(whole["tokens"]) == text and "" in whole["tokens"]
    assert whole["text_offset"] == [len("".join(whole["tokens"][:i])) for i in range(len(ids))]
    assert whole["text_offset"][whole["tokens"].index("\U0001f600")] == text.index("\U0001f600")
    assert all(top[t] == -1.0 for t, top in zip(whole["tokens"], whole["top_logprobs"]))
    chunked, parts = CompletionLogprobs(tok), []
    for i in range(0, len(entries), 3):
        parts.append(chunked.add(entries[i:i + 3]))
    for key in whole:
        assert sum((p[key] for p in parts), []) == whole[key]


def test_chat_logprob_bytes_of_characters_split_over_tokens(zoo):
    """A chat logprob's `bytes` are the token's own raw bytes where its text alone is part of a
    character (U+FFFD): the bytes of a text's tokens join to its UTF-8, in byte-level BPE (the test
    tokenizer, SmolLM2's kind) and in SentencePiece's byte fallback (Llama 2, Mistral). They used to
    be U+FFFD's three bytes."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    from tiered.serve.protocol import chat_logprobs, token_bytes

    tok = zoo.tokenizer
    text = "Caf\u00e9 \U0001f600 and \u65e5\u672c\u8a9e."
    ids = tok.encode(text)
    assert any("\ufffd" in tok.decode([t]) for t in ids)
    content = chat_logprobs(tok, [TokenLogprob(t, -1.0, [(t, -1.0)]) for t in ids])["content"]
    assert b"".join(bytes(c["bytes"]) for c in content) == text.encode("utf-8")
    assert all(c["top_logprobs"][0]["bytes"] == c["bytes"] for c in content)
    assert [c["token"] for c in content] == [tok.decode([t]) for t in ids]  # the text field as before
    # SentencePiece with byte fallback: no merges, each character of 3 bytes as three <0xNN> pieces
    vocab = {"<unk>": 0, **{f"<0x{b:02X}>": 1 + b for b in range(256)}, "\u2581": 257, "a": 258}
    sp = Tokenizer(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True))
    sp.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    sp = PreTrainedTokenizerFast(tokenizer_object=sp, unk_token="<unk>")
    ids = sp.encode("a\u65e5", add_special_tokens=False)
    assert ids == [258, 1 + 0xE6, 1 + 0x97, 1 + 0xA5]
    assert b"".join(token_bytes(sp, t) for t in ids) == "a\u65e5".encode("utf-8")
    assert token_bytes(None, 7) == b"7"


def test_completion_logprobs_of_characters_split_over_tokens(server):
    """Through the server, whole and streamed: the tokens' texts join to the completion and each
    text_offset is the completion's length before the token (a piece of a character used to count
    as one U+FFFD, so offsets drifted past the text)."""
    kw = dict(model=MODEL, prompt=SPLIT, max_tokens=16, temperature=0, logprobs=2)
    out = server.client.completions.create(**kw)
    text, lp = out.choices[0].text, out.choices[0].logprobs
    ref = _greedy(server, SPLIT, 16, chat=False)
    assert text == ref.text and any("\ufffd" in server.llm.tokenizer.decode([t]) for t in ref.token_ids)
    assert "".join(lp.tokens) == text and "" in lp.tokens
    assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(len(lp.tokens))]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert top[token] == logprob  # greedy: the sampled token is the most likely
    chunks = [c.choices[0] for c in server.client.completions.create(stream=True, **kw)]
    assert "".join(c.text for c in chunks) == text
    streamed = [c.logprobs for c in chunks if c.logprobs is not None]
    assert sum((s.tokens for s in streamed), []) == lp.tokens
    assert sum((s.text_offset for s in streamed), []) == lp.text_offset
