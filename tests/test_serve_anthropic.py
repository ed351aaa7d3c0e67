"""Anthropic's Messages API through `tiered serve` (serve/anthropic.py), driven by the real `anthropic` client: the
same answers as the chat completions of the same conversation, its stream's events, stop sequences, tool_use
blocks, a conversation of tool_use / tool_result blocks rendered as the chat's tool calls and answers, and
Anthropic's error shape and x-api-key header."""

from __future__ import annotations

import json

import httpx
import pytest

anthropic = pytest.importorskip("anthropic", reason="the Messages API tests drive the real anthropic client")

from test_serve_tools import ASK, KEY, MODEL, TIME, WEATHER, _server  # noqa: E402
from tiered.engine.prompt import encode_prompt  # noqa: E402

GREEDY = {"temperature": 0}  # Anthropic's own client no longer takes sampling arguments: the body still may
TOOL = {"name": WEATHER["function"]["name"], "description": WEATHER["function"]["description"],
        "input_schema": WEATHER["function"]["parameters"]}


@pytest.fixture(scope="module")
def server(zoo, chat_llama, tmp_path_factory):
    from test_serve_tools import TOOLS_TEMPLATE

    with _server(zoo, chat_llama, tmp_path_factory, TOOLS_TEMPLATE) as s:
        s.anthropic = anthropic.Anthropic(base_url=s.url, api_key=KEY, max_retries=0, timeout=60)
        yield s


def test_a_message_answers_as_the_chat_completion_of_the_conversation(server):
    """A system prompt and a user turn (any model name: Anthropic's clients name Claude models): the text block is
    the chat completion's content for the same messages, greedy; stop_reason max_tokens for a "length" finish;
    usage counts the prompt through the template and the generated tokens. Streamed: message_start, one text
    block's deltas, message_delta with the stop reason, message_stop; the same text."""
    messages = [{"role": "system", "content": "be brief"}] + ASK
    ref = server.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
    out = server.anthropic.messages.create(model="claude-sonnet-4-5", max_tokens=12, system="be brief",
                                           messages=ASK, extra_body=GREEDY)
    assert out.id.startswith("msg_") and out.role == "assistant" and out.model == MODEL and out.type == "message"
    assert [b.type for b in out.content] == ["text"] and out.content[0].text == ref.choices[0].message.content
    assert out.stop_reason == "max_tokens" == {"length": "max_tokens"}[ref.choices[0].finish_reason]
    assert out.stop_sequence is None
    assert out.usage.input_tokens + out.usage.cache_read_input_tokens == ref.usage.prompt_tokens
    assert out.usage.output_tokens == ref.usage.completion_tokens == 12
    kinds, deltas = [], []
    with server.anthropic.messages.stream(model=MODEL, max_tokens=12, system=[{"type": "text", "text": "be brief"}],
                                          messages=ASK, extra_body=GREEDY) as stream:
        for ev in stream:
            kinds.append(ev.type)
            if ev.type == "content_block_delta":
                deltas.append(ev.delta.text)
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "message_delta" in kinds
    assert kinds.count("content_block_start") == kinds.count("content_block_stop") == 1
    assert "".join(deltas) == final.content[0].text == out.content[0].text
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 12


def test_a_stop_sequence_ends_the_answer_and_is_named(server):
    """stop_sequences: the answer cut before the first one the text reaches, stop_reason stop_sequence naming it
    (streamed too); a sequence the answer never writes leaves it as it was."""
    whole = server.anthropic.messages.create(model=MODEL, max_tokens=16, messages=ASK,
                                             extra_body=GREEDY).content[0].text
    word = next(w for w in whole.split()[2:] if len(w) > 1)
    out = server.anthropic.messages.create(model=MODEL, max_tokens=16, messages=ASK, extra_body=GREEDY,
                                           stop_sequences=["\u2603never", word])
    assert out.stop_reason == "stop_sequence" and out.stop_sequence == word
    assert out.content[0].text == whole[:whole.index(word)]
    with server.anthropic.messages.stream(model=MODEL, max_tokens=16, messages=ASK, extra_body=GREEDY,
                                          stop_sequences=[word]) as stream:
        final = stream.get_final_message()
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", word)
    assert final.content[0].text == out.content[0].text


def test_a_named_tool_is_called_as_a_tool_use_block(server):
    """tool_choice {"type": "tool"}: one tool_use block of that tool, its input following the schema, stop_reason
    tool_use; streamed, the same input through input_json_delta; "any" (OpenAI's "required") calls a tool too, and
    disable_parallel_tool_use keeps it to one."""
    kw = dict(model=MODEL, max_tokens=40, messages=ASK, extra_body=GREEDY, tools=[TOOL])
    out = server.anthropic.messages.create(**kw, tool_choice={"type": "tool", "name": "get_weather"})
    (block,) = out.content
    assert block.type == "tool_use" and block.name == "get_weather" and block.id.startswith("toolu_")
    assert block.input["city"] in ("Paris", "Oslo", "Lima") and 1 <= block.input["days"] <= 7
    assert out.stop_reason == "tool_use"
    with server.anthropic.messages.stream(**kw, tool_choice={"type": "tool", "name": "get_weather"}) as stream:
        kinds = [ev.type for ev in stream]
        final = stream.get_final_message()
    assert [b.type for b in final.content] == ["tool_use"] and final.content[0].input == block.input
    assert "content_block_start" in kinds and final.stop_reason == "tool_use"
    tools = [TOOL, {"name": "get_time", "input_schema": TIME["function"]["parameters"]}]
    one = server.anthropic.messages.create(model=MODEL, max_tokens=150, messages=ASK, tools=tools, extra_body=GREEDY,
                                           tool_choice={"type": "any", "disable_parallel_tool_use": True})
    assert one.stop_reason == "tool_use" and [b.type for b in one.content] == ["tool_use"], one
    assert (one.content[0].name, set(one.content[0].input)) in (("get_weather", {"city", "days"}),
                                                                ("get_time", {"zone"}))


def test_tool_use_and_tool_result_blocks_are_the_chats_calls_and_answers(server):
    """An assistant's text and tool_use block, then the user's tool_result block and text: the prompt the chat
    template renders for the same conversation in OpenAI's form (count_tokens and a message's usage count it), the
    tool's answer a tool turn of its own."""
    convo = ASK + [
        {"role": "assistant", "content": [{"type": "text", "text": "Let me see."},
                                          {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                           "input": {"city": "Paris", "days": 2}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                      "content": [{"type": "text", "text": "sunny, 21 C"}]},
                                     {"type": "text", "text": "and tomorrow?"}]}]
    openai_form = ASK + [
        {"role": "assistant", "content": "Let me see.", "tool_calls": [
            {"id": "toolu_1", "type": "function", "function": {"name": "get_weather",
                                                               "arguments": {"city": "Paris", "days": 2}}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny, 21 C"},
        {"role": "user", "content": "and tomorrow?"}]
    ids = encode_prompt(server.llm.tokenizer, openai_form, True, tools=[WEATHER])
    text = server.llm.tokenizer.decode(ids)
    assert '"days": 2' in text and "sunny, 21 C" in text and "and tomorrow?" in text
    counted = server.anthropic.messages.count_tokens(model=MODEL, messages=convo, tools=[TOOL])
    assert counted.input_tokens == len(ids)
    out = server.anthropic.messages.create(model=MODEL, max_tokens=4, messages=convo, tools=[TOOL], extra_body=GREEDY,
                                           tool_choice={"type": "none"})
    assert out.usage.input_tokens + out.usage.cache_read_input_tokens == len(ids) and out.content[0].type == "text"


def test_anthropics_client_lists_the_served_model(server):
    """GET /v1/models answers Anthropic's client too (its paging and display fields beside OpenAI's)."""
    (model,) = server.anthropic.models.list().data
    assert model.id == MODEL and model.display_name == MODEL and model.type == "model"
    assert server.anthropic.models.retrieve(MODEL).id == MODEL
    assert [m.id for m in server.client.models.list()] == [MODEL]


def test_errors_take_anthropics_shape_and_the_key_its_header(server):
    """A wrong x-api-key is a 401 authentication_error; Authorization: Bearer works as on /v1/*; a body without
    max_tokens, an image block or a server tool is a 400 invalid_request_error naming what is wrong, in
    Anthropic's {"type": "error", "error": {...}} shape."""
    bad = anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as e:
        bad.messages.create(model=MODEL, max_tokens=2, messages=ASK)
    assert e.value.body["error"]["type"] == "authentication_error"
    url = server.url + "/v1/messages"
    ok = httpx.post(url, headers={"Authorization": f"Bearer {KEY}"},
                    json={"model": MODEL, "max_tokens": 2, "messages": ASK}, timeout=60)
    assert ok.status_code == 200 and ok.json()["type"] == "message"
    cases = [({"model": MODEL, "messages": ASK}, "max_tokens"),
             ({"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": [
                 {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}]},
              "'image'"),
             ({"model": MODEL, "max_tokens": 2, "messages": ASK,
               "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "server tools")]
    for body, words in cases:
        r = httpx.post(url, headers={"x-api-key": KEY}, json=body, timeout=60)
        assert r.status_code == 400, r.text
        err = r.json()
        assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error", err
        assert words in err["error"]["message"], err
    long = httpx.post(url, headers={"x-api-key": KEY}, timeout=60, json={
        "model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "word " * 400}]})
    assert long.status_code == 400 and long.json()["error"]["message"].startswith("prompt is too long: "), long.text
    huge = httpx.post(url, headers={"x-api-key": KEY}, timeout=60, json={
        "model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "word " * 800_000}]})
    assert huge.status_code == 413 and huge.json()["error"]["type"] == "request_too_large", huge.text  # the guard
    r = httpx.post(url + "/count_tokens", headers={"x-api-key": KEY}, json={"model": MODEL, "messages": ASK})
    assert r.status_code == 200 and r.json()["input_tokens"] == len(encode_prompt(server.llm.tokenizer, ASK, True))
    assert json.loads(json.dumps(r.json())) == r.json()


def test_a_prefilled_answer_is_continued(server):
    """A conversation ending with an assistant turn (Anthropic's prefill; vLLM's continue_final_message on
    /v1/chat/completions): the prompt ends with that turn's text, left open (no end of turn, no new turn), and the
    answer is what the model adds; the same on both APIs. OpenAI's asks for add_generation_prompt false with it."""
    convo = ASK + [{"role": "assistant", "content": "It is"}]
    ids = encode_prompt(server.llm.tokenizer, convo, True, add_generation_prompt=False, continue_final=True)
    assert server.llm.tokenizer.decode(ids).endswith("<|assistant|>It is")
    counted = server.anthropic.messages.count_tokens(model=MODEL, messages=convo)
    out = server.anthropic.messages.create(model=MODEL, max_tokens=6, messages=convo, extra_body=GREEDY)
    assert counted.input_tokens == len(ids) == out.usage.input_tokens + out.usage.cache_read_input_tokens
    chat = server.client.chat.completions.create(model=MODEL, messages=convo, max_tokens=6, temperature=0,
                                                 extra_body={"continue_final_message": True,
                                                             "add_generation_prompt": False})
    assert chat.usage.prompt_tokens == len(ids) and chat.choices[0].message.content == out.content[0].text
    closed = server.client.chat.completions.create(model=MODEL, messages=convo, max_tokens=2, temperature=0,
                                                   extra_body={"add_generation_prompt": False})
    assert closed.usage.prompt_tokens == len(encode_prompt(server.llm.tokenizer, convo, True, False))
    plain = server.client.chat.completions.create(model=MODEL, messages=convo, max_tokens=6, temperature=0)
    assert plain.usage.prompt_tokens != len(ids)  # a closed turn and a new one opened
    r = httpx.post(server.url + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=60,
                   json={"model": MODEL, "messages": convo, "max_tokens": 2, "continue_final_message": True})
    assert r.status_code == 400 and "add_generation_prompt" in r.json()["error"]["message"]
