"""OpenAI's Responses API through `tiered serve` (serve/responses.py), driven by the real `openai` client: the same
answers as the chat completions of the same conversation, its stream's events, function_call items and their
outputs, previous_response_id over the responses it keeps, and what it refuses."""

from __future__ import annotations

import json

import httpx
import pytest

openai = pytest.importorskip("openai", reason="the Responses API tests drive the real openai client")

from test_serve_tools import ASK, KEY, MODEL, WEATHER, _server  # noqa: E402
from tiered.engine.prompt import encode_prompt  # noqa: E402

TOOL = {"type": "function", **WEATHER["function"]}


@pytest.fixture(scope="module")
def server(zoo, chat_llama, tmp_path_factory):
    from test_serve_tools import TOOLS_TEMPLATE

    with _server(zoo, chat_llama, tmp_path_factory, TOOLS_TEMPLATE) as s:
        yield s


def test_a_response_answers_as_the_chat_completion_of_the_conversation(server):
    """instructions and an input text: the message item's output_text is the chat completion's content for the same
    messages, greedy; status incomplete (max_output_tokens) with its reason; usage. Streamed: response.created,
    the message's events, response.incomplete; the same text."""
    messages = [{"role": "system", "content": "be brief"}] + ASK
    ref = server.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
    out = server.client.responses.create(model=MODEL, instructions="be brief", input=ASK[0]["content"],
                                         max_output_tokens=12, temperature=0)
    assert out.id.startswith("resp_") and out.object == "response" and out.model == MODEL
    assert out.status == "incomplete" and out.incomplete_details.reason == "max_output_tokens"
    (item,) = out.output
    assert item.type == "message" and item.role == "assistant" and item.id.startswith("msg_")
    assert out.output_text == item.content[0].text == ref.choices[0].message.content
    assert out.usage.input_tokens == ref.usage.prompt_tokens and out.usage.output_tokens == 12
    assert out.usage.total_tokens == out.usage.input_tokens + 12
    kinds, deltas, final = [], [], None
    for ev in server.client.responses.create(model=MODEL, instructions="be brief", input=ASK, max_output_tokens=12,
                                             temperature=0, stream=True):
        kinds.append(ev.type)
        if ev.type == "response.output_text.delta":
            deltas.append(ev.delta)
        if ev.type in ("response.completed", "response.incomplete"):
            final = ev.response
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.incomplete"
    assert "response.output_item.added" in kinds and "response.output_text.done" in kinds
    assert "".join(deltas) == final.output_text == out.output_text


def test_function_calls_and_their_outputs(server):
    """A named function (tool_choice): one function_call item whose arguments follow its schema, status
    completed; streamed the same call. A conversation holding that call and a function_call_output renders as the
    chat's tool call and tool turn."""
    kw = dict(model=MODEL, input=ASK, tools=[TOOL], max_output_tokens=40, temperature=0,
              tool_choice={"type": "function", "name": "get_weather"})
    out = server.client.responses.create(**kw)
    (call,) = out.output
    args = json.loads(call.arguments)
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    assert args["city"] in ("Paris", "Oslo", "Lima") and 1 <= args["days"] <= 7 and out.status == "completed"
    events = list(server.client.responses.create(**kw, stream=True))
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert [i.type for i in done] == ["function_call"] and json.loads(done[0].arguments) == args
    assert events[-1].type == "response.completed"
    convo = ASK + [{"type": "function_call", "call_id": "call_1", "name": "get_weather",
                    "arguments": '{"city": "Paris", "days": 2}'},
                   {"type": "function_call_output", "call_id": "call_1", "output": "sunny, 21 C"}]
    rendered = ASK + [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris",
                                                                                              "days": 2}}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    ids = encode_prompt(server.llm.tokenizer, rendered, True, tools=[WEATHER])
    later = server.client.responses.create(model=MODEL, input=convo, tools=[TOOL], max_output_tokens=3, temperature=0,
                                           tool_choice="none")
    assert later.usage.input_tokens == len(ids) and later.output[0].type == "message"


def test_previous_response_id_goes_on_from_a_kept_response(server):
    """previous_response_id: the kept response's conversation (its input and answer, not its instructions, as
    OpenAI's) comes before the new input, as if sent whole; GET returns a kept response, DELETE forgets it; store
    false keeps none; an unknown id is a 400."""
    first = server.client.responses.create(model=MODEL, input=ASK[0]["content"], max_output_tokens=5, temperature=0,
                                           instructions="be brief")
    second = server.client.responses.create(model=MODEL, input="and tomorrow?", previous_response_id=first.id,
                                            max_output_tokens=5, temperature=0)
    whole = ASK + [{"role": "assistant", "content": first.output_text}, {"role": "user", "content": "and tomorrow?"}]
    ref = server.client.chat.completions.create(model=MODEL, messages=whole, max_tokens=5, temperature=0)
    assert second.usage.input_tokens == ref.usage.prompt_tokens and second.output_text == ref.choices[0].message.content
    assert second.previous_response_id == first.id
    assert server.client.responses.retrieve(first.id).output_text == first.output_text
    server.client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        server.client.responses.retrieve(first.id)
    with pytest.raises(openai.BadRequestError, match="previous response"):
        server.client.responses.create(model=MODEL, input="hi", previous_response_id=first.id, max_output_tokens=2)
    unstored = server.client.responses.create(model=MODEL, input="hi", store=False, max_output_tokens=2)
    with pytest.raises(openai.NotFoundError):
        server.client.responses.retrieve(unstored.id)


def test_what_the_responses_api_refuses(server):
    """Items and tools this server cannot take are 400s naming them: an image part, a custom (freeform) tool; a
    built-in tool is left out of the prompt; text.format json_schema constrains the output to the schema."""
    url = server.url + "/v1/responses"
    head = {"Authorization": f"Bearer {KEY}"}
    cases = [({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]},
              "'input_image'"),
             ({"input": "hi", "tools": [{"type": "custom", "name": "apply_patch"}]}, "only function tools")]
    for body, words in cases:
        r = httpx.post(url, headers=head, json={"model": MODEL, "max_output_tokens": 2, **body}, timeout=60)
        assert r.status_code == 400 and words in r.json()["error"]["message"], r.text
    # a built-in tool (an agent lists web_search on every request) is left out of what the model sees, not refused
    plain = server.client.responses.create(model=MODEL, input="hi", max_output_tokens=3, temperature=0)
    built_in = server.client.responses.create(model=MODEL, input="hi", max_output_tokens=3, temperature=0,
                                              tools=[{"type": "web_search"}])
    assert built_in.output_text == plain.output_text and built_in.usage.input_tokens == plain.usage.input_tokens
    schema = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"],
              "additionalProperties": False, "x-guidance": {"whitespace_flexible": False}}
    out = server.client.responses.create(model=MODEL, input="a city?", max_output_tokens=30, temperature=0,
                                         text={"format": {"type": "json_schema", "name": "city", "schema": schema}})
    assert json.loads(out.output_text)["city"] in ("Paris", "Oslo")
