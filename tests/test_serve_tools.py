"""Tool calling through `tiered serve` (engine/tools.py): the real server over the tiny Llama with a chat template
that renders tools and teaches the Hermes call format, driven by the real `openai` client. The random model
never calls a tool by itself, so "auto" is steered into one with a regex (structured outputs); "required" and
a named function constrain the output to the calls' JSON."""

from __future__ import annotations

import contextlib
import json
import shutil
from types import SimpleNamespace

import httpx
import pytest

openai = pytest.importorskip("openai", reason="the serving tests drive the real openai client (pip install openai)")

from test_serve import KEY, MODEL, running_server  # noqa: E402
from tiered.engine.prompt import encode_prompt  # noqa: E402
from tiered.serve.engine import ServingEngine  # noqa: E402
from tiered.engine.tools import ToolPlan  # noqa: E402

# a Hermes-style template (as Qwen2.5 / Qwen3 write theirs, shortened to the tiny model's 256-token context: tools
# by name only): tools in a system turn, calls as
# <tool_call>{"name", "arguments"}</tool_call>, tool answers in turns of their own
TOOLS_TEMPLATE = (
    "{% if tools %}<|system|>You may call: {% for t in tools %}{{ t.function.name }} {% endfor %}as <tool_call>"
    "\n{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] or '' }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}"
    "</tool_call>{% endfor %}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "days"], "additionalProperties": False,
                   "x-guidance": {"whitespace_flexible": False}}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                                       "required": ["zone"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "what is the weather in Paris"}]


# GLM-4.5's call format (its template, shortened): the function's name, then <arg_key> / <arg_value> pairs, strings
# as they are and other values as JSON
GLM_TEMPLATE = (
    "{% if tools %}<|system|>You may call: {% for t in tools %}{{ t.function.name }} {% endfor %}\n{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] or '' }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function.name }}{% for k, v in c.function.arguments.items() %}"
    "<arg_key>{{ k }}</arg_key><arg_value>{{ v if v is string else v | tojson }}</arg_value>{% endfor %}</tool_call>"
    "{% endfor %}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")


# Qwen3-Coder's call format (its template, shortened): <function=NAME> and a <parameter=KEY> block per argument inside
# <tool_call>, strings as they are and other values as JSON
XML_TEMPLATE = (
    "{% if tools %}<|system|>You may call: {% for t in tools %}{{ t.function.name }} {% endfor %}\n{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] or '' }}"
    "{% for c in m.tool_calls or [] %}<tool_call>\n<function={{ c.function.name }}>\n"
    "{% for k, v in c.function.arguments.items() %}<parameter={{ k }}>\n{{ v if v is string else v | tojson }}\n"
    "</parameter>\n{% endfor %}</function>\n</tool_call>{% endfor %}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@contextlib.contextmanager
def _server(zoo, chat_llama, tmp_path_factory, template: str):
    d = tmp_path_factory.mktemp("tools") / "llama-tools"
    shutil.copytree(chat_llama, d)
    cfg = d / "tokenizer_config.json"
    cfg.write_text(json.dumps({**json.loads(cfg.read_text()), "chat_template": template}))
    llm = zoo.llm(d)
    with running_server(ServingEngine(llm, max_batch=4, max_queue=8), KEY) as url:
        yield SimpleNamespace(url=url, llm=llm, client=openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0,
                                                                      timeout=60))


@pytest.fixture(scope="module")
def server(zoo, chat_llama, tmp_path_factory):
    with _server(zoo, chat_llama, tmp_path_factory, TOOLS_TEMPLATE) as s:
        yield s


def _post(server, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"},
                      json={"model": MODEL, "messages": ASK, "max_tokens": 40, **body}, timeout=60)


def test_a_named_function_is_called_with_arguments_following_its_schema(server):
    """tool_choice naming a function: one call of it, arguments JSON following its parameters, content null,
    finish "tool_calls"; the prompt is the template rendered with the tools (usage counts those tokens)."""
    out = server.client.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=40, temperature=0.8, seed=3, tools=[WEATHER, TIME],
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    args = json.loads(call.function.arguments)
    assert call.function.name == "get_weather" and call.type == "function" and call.id.startswith("call_")
    assert args["city"] in ("Paris", "Oslo", "Lima") and 1 <= args["days"] <= 7 and set(args) == {"city", "days"}
    # streamed: the arguments in deltas, the first with the call's id and name; joined, the same call (greedy)
    named = dict(model=MODEL, messages=ASK, max_tokens=40, temperature=0, tools=[WEATHER, TIME],
                 tool_choice={"type": "function", "function": {"name": "get_weather"}})
    whole = server.client.chat.completions.create(**named).choices[0].message.tool_calls[0]
    deltas, finish = [], None
    for c in server.client.chat.completions.create(**named, stream=True):
        deltas += c.choices[0].delta.tool_calls or []
        finish = c.choices[0].finish_reason or finish
    assert len(deltas) > 2 and finish == "tool_calls" and deltas[0].id.startswith("call_")
    assert deltas[0].function.name == "get_weather" and all(d.function.name is None and d.id is None for d in deltas[1:])
    assert "".join(d.function.arguments for d in deltas) == whole.function.arguments and {d.index for d in deltas} == {0}
    tok = server.llm.tokenizer
    with_tools = encode_prompt(tok, ASK, True, tools=[WEATHER, TIME])
    assert out.usage.prompt_tokens == len(with_tools) > len(encode_prompt(tok, ASK, True))
    r = httpx.post(f"{server.url}/tokenize", headers={"Authorization": f"Bearer {KEY}"},
                   json={"messages": ASK, "tools": [WEATHER, TIME]})
    assert r.json()["tokens"] == with_tools  # vLLM's /tokenize renders the tools as the chat does


def test_required_calls_one_of_the_tools(server):
    """tool_choice "required": each choice is one or more calls of the given tools (one with
    parallel_tool_calls false), each call's arguments following its own tool's schema, written as
    json.dumps writes them. (With parallel calls the random model may go on calling until max_tokens: that
    choice's text is left as text, finish "length".)"""
    for parallel in (True, False):
        out = server.client.chat.completions.create(
            model=MODEL, messages=ASK, max_tokens=150, temperature=0.9, seed=5, n=3, tools=[WEATHER, TIME],
            tool_choice="required", parallel_tool_calls=parallel)
        assert any(c.finish_reason == "tool_calls" for c in out.choices)
        for choice in out.choices:
            calls = choice.message.tool_calls
            if parallel and choice.finish_reason == "length":
                assert calls is None and choice.message.content.startswith('[{"name": "get_')
                continue
            assert choice.finish_reason == "tool_calls" and calls and (parallel or len(calls) == 1)
            for call in calls:
                assert call.function.arguments == json.dumps(json.loads(call.function.arguments))
                args = json.loads(call.function.arguments)
                assert (call.function.name, set(args)) in (("get_weather", {"city", "days"}), ("get_time", {"zone"}))


def test_auto_parses_hermes_calls_out_of_the_text_streamed_or_not(server):
    """tool_choice "auto" on a template that teaches <tool_call>: a text holding calls answers them as
    tool_calls with the text before them as content (steered here by a regex, the random model calls
    nothing by itself); a stream sends that text, then the calls in one chunk, and holds back what may begin
    a call; plain text stays text."""
    steer = {"structured_outputs": {"regex": r'Sure\. <tool_call>\{"name": "get_weather", "arguments": '
                                             r'\{"city": "(Paris|Oslo)", "days": [1-7]\}\}</tool_call>'}}
    body = {"tools": [WEATHER, TIME], "temperature": 0, "max_tokens": 180, **steer}
    state = lambda: httpx.get(f"{server.url}/state", headers={"Authorization": f"Bearer {KEY}"}).json()["serving"]  # noqa: E731
    before = state()
    r = _post(server, body)
    after = state()  # the regex forces most of the text: steps carried several tokens, each counted
    assert after["generated_tokens"] - before["generated_tokens"] == r.json()["usage"]["completion_tokens"]
    assert after["steps"] - before["steps"] < r.json()["usage"]["completion_tokens"] / 2
    message = r.json()["choices"][0]["message"]
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "tool_calls", r.json()
    assert message["content"] == "Sure." and message["tool_calls"][0]["function"]["name"] == "get_weather"
    args = json.loads(message["tool_calls"][0]["function"]["arguments"])
    stream = server.client.chat.completions.create(model=MODEL, messages=ASK, stream=True, tools=[WEATHER, TIME],
                                                   temperature=0, max_tokens=180, extra_body=steer)
    content, calls, finish = "", [], None
    for c in stream:
        delta = c.choices[0].delta
        content += delta.content or ""
        assert "<" not in content  # what may begin a call was held back
        calls += delta.tool_calls or []
        finish = c.choices[0].finish_reason or finish
    assert content.strip() == "Sure." and finish == "tool_calls" and len(calls) == 1
    assert calls[0].function.name == "get_weather" and json.loads(calls[0].function.arguments) == args
    plain = server.client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], temperature=0,
                                                  max_tokens=12).choices[0]
    assert plain.message.tool_calls is None and plain.finish_reason == "length" and plain.message.content


def _steered_call(served, steer: dict, content: str, max_tokens: int) -> dict:
    """The one get_weather call "auto" parses out of a `steer`ed answer (`content` before it), whole and streamed
    the same: its arguments, a city of the regex's and an integer of days."""
    ask = dict(model=MODEL, messages=ASK, tools=[WEATHER], temperature=0, max_tokens=max_tokens, extra_body=steer)
    out = served.client.chat.completions.create(**ask).choices[0]
    assert out.finish_reason == "tool_calls" and out.message.content == content, out
    args = json.loads(out.message.tool_calls[0].function.arguments)
    assert out.message.tool_calls[0].function.name == "get_weather"
    assert args["city"] in ("Paris", "Oslo") and isinstance(args["days"], int)
    calls = [c for chunk in served.client.chat.completions.create(**ask, stream=True)
             for c in chunk.choices[0].delta.tool_calls or []]
    assert [json.loads(c.function.arguments) for c in calls] == [args]
    return args


def test_auto_parses_glm_calls(zoo, chat_llama, tmp_path_factory):
    """On a GLM-4.5-style template, "auto" parses its <arg_key> / <arg_value> calls: a string parameter's value as
    written, an integer's as JSON; streamed the same."""
    steer = {"structured_outputs": {"regex": r"On it\.<tool_call>get_weather<arg_key>city</arg_key><arg_value>"
                                             r"(Paris|Oslo)</arg_value><arg_key>days</arg_key><arg_value>[1-7]</arg_value>"
                                             r"</tool_call>"}}
    with _server(zoo, chat_llama, tmp_path_factory, GLM_TEMPLATE) as glm:
        _steered_call(glm, steer, "On it.", 180)


def test_auto_parses_qwen3_coder_calls(zoo, chat_llama, tmp_path_factory):
    """On a Qwen3-Coder-style template (<function=NAME> / <parameter=KEY> inside <tool_call>), "auto" parses its calls:
    a string parameter's value as written (its newlines inside kept, the ones around it not), an integer's as JSON;
    streamed the same; an earlier call in the conversation renders back in that format."""
    steer = {"structured_outputs": {"regex": r"Ok\.\n<tool_call>\n<function=get_weather>\n<parameter=city>\n"
                                             r"(Paris|Oslo)\n</parameter>\n<parameter=days>\n[1-7]\n</parameter>\n"
                                             r"</function>\n</tool_call>"}}
    with _server(zoo, chat_llama, tmp_path_factory, XML_TEMPLATE) as coder:
        args = _steered_call(coder, steer, "Ok.", 200)
        history = ASK + [{"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": args}}]}]
        ids = encode_prompt(coder.llm.tokenizer, history, True, tools=[WEATHER])
        assert f"<parameter=city>\n{args['city']}\n</parameter>" in coder.llm.tokenizer.decode(ids)


def test_a_conversation_with_calls_and_their_answers(server):
    """An assistant turn carrying tool_calls (arguments as JSON text) and the tool's answer are rendered by the
    template with the arguments as an object, as transformers' templates read them."""
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": '{"city": "Paris", "days": 2}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    out = server.client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER], max_tokens=4,
                                                temperature=0, tool_choice="none")
    rendered = [dict(m) for m in history]
    rendered[1]["tool_calls"] = [{"id": "call_1", "type": "function",
                                  "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}}]
    ids = encode_prompt(server.llm.tokenizer, rendered, True, tools=[WEATHER])
    assert '"days": 2' in server.llm.tokenizer.decode(ids) and out.usage.prompt_tokens == len(ids)
    assert out.choices[0].message.tool_calls is None


def test_bad_tool_requests_are_400s(server):
    for body, param in (({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
                         "tool_choice"),
                        ({"tool_choice": "required"}, "tool_choice"),
                        ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
                         None),
                        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
                        ({"tools": [{"type": "retrieval"}]}, "tools")):
        r = _post(server, body)
        assert r.status_code == 400, (body, r.text)
        assert param is None or (r.json()["error"]["param"] or "").startswith(param), r.json()


def test_tool_plan_parsing():
    """ToolPlan.parse: Hermes calls (several; "parameters" as some models write it), text around them, a
    broken call left as text, a cut output left as text; held: the tail that may open a call."""
    plan = ToolPlan.of([WEATHER, TIME], None, True, SimpleNamespace(chat_template="... <tool_call> ..."))
    assert plan.mode == "auto" and plan.format == "hermes"
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 1}}\n'
            '</tool_call>\n<tool_call>{"name": "get_time", "parameters": {"zone": "UTC"}}</tool_call>')
    content, calls = plan.parse(text, "stop")
    assert content == "Let me check." and [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[1]["function"]["arguments"]) == {"zone": "UTC"}
    assert plan.parse('<tool_call>{"name": oops}</tool_call>', "stop") == ('<tool_call>{"name": oops}</tool_call>', [])
    assert plan.parse(text, "length") == (text, [])
    assert plan.held("hello <tool") == len("<tool") and plan.held("hello") == 0 and plan.held("a <tool_call>{") == len("<tool_call>{")
    assert not ToolPlan.of([WEATHER], None, True, SimpleNamespace(chat_template="no tags")).calls
    # Llama 3.1-3.3: a bare JSON call ("parameters"), several joined by ";", the python tag where it is kept
    llama = ToolPlan.of([WEATHER, TIME], "auto", True, SimpleNamespace(
        chat_template='Respond in the format {"name": function name, "parameters": dictionary of argument name and '
                      'its value}. Do not use variables.'))
    content, calls = llama.parse('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Lima", "days": 2}}; '
                                 '{"name": "get_time", "parameters": {"zone": "CET"}}', "stop")
    assert llama.format == "json" and content is None and [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Lima", "days": 2}
    assert llama.parse("It is sunny.", "stop") == ("It is sunny.", []) and llama.parse("{not json", "stop")[1] == []
    assert llama.held(' {"name"') == 8 and llama.held("<|python") == 8 and llama.held("Sunny {") == 0
    assert llama.content_end('{"name": "x"}') == 0 and plan.content_end('hi <tool_call>{}') == 3
    # GLM-4.5: name, then <arg_key> / <arg_value> pairs; a string parameter keeps its text ("42" stays "42")
    glm = ToolPlan.of([WEATHER, TIME, {"type": "function", "function": {"name": "note", "parameters": {
        "type": "object", "properties": {"text": {"type": "string"}}}}}], None, True,
        SimpleNamespace(chat_template="<tool_call>{{ name }}<arg_key>{{ k }}</arg_key>"))
    content, calls = glm.parse('<think>hm</think>Checking.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n'
                               '<arg_value>Lima</arg_value>\n<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n'
                               '</tool_call><tool_call>note<arg_key>text</arg_key><arg_value>42</arg_value></tool_call>',
                               "stop")
    assert glm.format == "glm" and content == "<think>hm</think>Checking."
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"city": "Lima", "days": 3}, {"text": "42"}]
    assert glm.parse("<tool_call>get_weather stray text</tool_call>", "stop")[1] == []
    # Qwen3-Coder: <function=NAME>, then <parameter=KEY> blocks; a string keeps its text and inner newlines
    coder = ToolPlan.of([WEATHER, {"type": "function", "function": {"name": "note", "parameters": {
        "type": "object", "properties": {"text": {"type": "string"}}}}}], None, True,
        SimpleNamespace(chat_template="<tool_call>\n<function={{ name }}>\n<parameter={{ k }}>"))
    content, calls = coder.parse("Checking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nLima\n"
                                 "</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>\n"
                                 "<tool_call>\n<function=note>\n<parameter=text>\n42\nmore\n</parameter>\n</function>"
                                 "\n</tool_call>", "stop")
    assert coder.format == "xml" and content == "Checking."
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"city": "Lima", "days": 3},
                                                                       {"text": "42\nmore"}]
    assert coder.parse("<tool_call>\n<function=get_weather>\nstray\n</function>\n</tool_call>", "stop")[1] == []
    assert coder.held("Sure <tool_c") == len("<tool_c") and coder.content_end("Hi <tool_call>") == 3
    # Mistral: [TOOL_CALLS] then a list of calls with "arguments" (the marker dropped where the text skips it)
    mistral = ToolPlan.of([TIME], None, True, SimpleNamespace(chat_template="... [TOOL_CALLS] ..."))
    for text in ('[TOOL_CALLS] [{"name": "get_time", "arguments": {"zone": "UTC"}}]',
                 '[{"name": "get_time", "arguments": {"zone": "UTC"}}]'):
        assert mistral.parse(text, "stop")[1][0]["function"]["arguments"] == '{"zone": "UTC"}'


def test_deepseek_calls_are_parsed_in_both_forms():
    """DeepSeek's format (a template that writes <｜tool▁calls▁begin｜>): V3 / R1's `function<｜tool▁sep｜>NAME` with
    fenced JSON and V3.1's `NAME<｜tool▁sep｜>JSON`, several calls in one block, the text before them the content; a
    stream holds back from the block's opening (or a tail that may begin it); a call that is not JSON leaves text."""
    ds = ToolPlan.of([WEATHER, TIME], None, True, SimpleNamespace(chat_template="{{ '<｜tool▁calls▁begin｜>' }}"))
    v3 = ('Let me check.\n<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n'
          '{"city": "Oslo", "days": 2}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>')
    content, calls = ds.parse(v3, "stop")
    assert ds.format == "deepseek" and content == "Let me check." and ds.content_end(v3) == len("Let me check.\n")
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Oslo", "days": 2})]
    v31 = ('<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{"zone": "UTC"}<｜tool▁call▁end｜>'
           '<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Lima", "days": 1}<｜tool▁call▁end｜><｜tool▁calls▁end｜>')
    content, calls = ds.parse(v31, "stop")
    assert content is None and [c["function"]["name"] for c in calls] == ["get_time", "get_weather"]
    assert calls[0]["function"]["arguments"] == '{"zone": "UTC"}'
    assert ds.held("Sure <｜tool▁ca") == len("<｜tool▁ca") and ds.held(v3) == len(v3) - len("Let me check.\n")
    assert ds.held("Sunny.") == 0 and ds.parse("Sunny.", "stop") == ("Sunny.", [])
    bad = "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{zone<｜tool▁call▁end｜>"
    assert ds.parse(bad, "stop") == (bad, [])
