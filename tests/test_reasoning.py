"""Reasoning models' output (engine/reasoning.py): `<think>` blocks and gpt-oss's harmony channels told apart from
the answer in RequestOutput, the CLI's view and the server's `reasoning_content`; harmony's markers kept in the text
and its stop tokens; generation_config.json's end-of-sequence ids; structured outputs that constrain the answer
after the reasoning."""

from __future__ import annotations

import contextlib
import json
import shutil
import time
from pathlib import Path

import httpx
import pytest

from fixtures import build_tokenizer, write_tiny_checkpoint
from tiered import LLM, EngineConfig, SamplingParams
from tiered.engine.reasoning import (ReasoningStream, held_tail, output_stops, prompt_opens_thinking, reasoning_format,
                                     split)
from tiered.engine.structured import StructuredOutputsParams, TokenMatcher, grammar_tokenizer

HARMONY_MARKERS = ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>", "<|constrain|>"]
# gpt-oss's format, shortened: each message `<|start|>role<|message|>...<|end|>`, the answer's turn opened
HARMONY_TEMPLATE = ("{% for m in messages %}<|start|>{{ m.role }}{% if m.role == 'assistant' %}<|channel|>final"
                    "{% endif %}<|message|>{{ m.content }}<|end|>{% endfor %}"
                    "{% if add_generation_prompt %}<|start|>assistant{% endif %}")
# a Qwen3-style hybrid template: thinking is the model's choice, `enable_thinking: false` closes it in the prompt;
# `open_thinking` opens it (as DeepSeek-R1's template does)
THINK_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                  "{% if add_generation_prompt %}<|assistant|>{% if enable_thinking is defined and not enable_thinking %}"
                  "<think>\n\n</think>\n\n{% elif open_thinking %}<think>\n{% endif %}{% endif %}")

TEXTS = [
    ("think", False, "<think>\nLet me see: 2 + 2.\n</think>\n\nIt is 4.", "Let me see: 2 + 2.", "It is 4.", []),
    ("think", True, "Hmm.\n</think>\n\n4", "Hmm.", "4", []),
    ("think", False, "No thinking; a </think> later is text", None, "No thinking; a </think> later is text", []),
    ("think", False, "<think>cut off mid-thought", "cut off mid-thought", "", []),
    ("harmony", False, "<|channel|>analysis<|message|>User greets.<|end|><|start|>assistant<|channel|>final"
     "<|message|>Hello there!", "User greets.", "Hello there!", []),
    ("harmony", False, '<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary '
     'to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris"}', "Need the weather.", "",
     [("get_weather", '{"city":"Paris"}')]),
    ("harmony", False, "<|channel|>analysis<|message|>x<|end|><|start|>assistant to=functions.f<|channel|>commentary "
     "json<|message|>{}", "x", "", [("f", "{}")]),
    ("harmony", False, "<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant<|channel|>final<|message|>"
     "Done", None, "Checking.Done", []),
    ("harmony", False, "plain text, no channel", None, "plain text, no channel", []),
    (None, False, "<think>x</think>y", None, "<think>x</think>y", []),
]


@pytest.mark.parametrize("fmt,opened,text,reasoning,content,calls", TEXTS)
def test_split_and_the_stream_agree_at_every_cut(fmt, opened, text, reasoning, content, calls):
    """`split` sorts a whole text into reasoning, answer and calls; a ReasoningStream fed the same text in pieces of
    any size sends deltas that add up to the same parts (a marker cut in two is held back until it is whole), and
    never sends reasoning as answer or the reverse."""
    parts = split(text, fmt, opened)
    assert (parts.reasoning, parts.content, parts.calls) == (reasoning, content, calls)
    for size in (1, 2, 3, 5, 8, len(text)):
        stream, r, c = ReasoningStream(fmt, opened), "", ""
        for i in range(0, len(text), size):
            dr, dc = stream.feed(text[i:i + size])
            r, c = r + dr, c + dc
            assert "<|" not in r + c and "<think>" not in r  # no marker leaks, whole or cut
        dr, dc, got = stream.finish()
        r, c = r + dr, c + dc
        assert ((r.strip() or None), c.strip(), got) == (reasoning, content, calls)


def test_held_tail_holds_only_what_may_begin_a_marker():
    assert held_tail("abc <|chan", ["<|channel|>"]) == 6 and held_tail("abc </th", ["</think>"]) == 4
    assert held_tail("abc <", ["</think>"]) == 1 and held_tail("abc", ["</think>"]) == 0 and held_tail("x", [""]) == 0


def _tokenizer(template: str, specials: list[str] = ()):
    tok = build_tokenizer()
    if specials:
        tok.add_special_tokens({"additional_special_tokens": list(specials)})
    tok.chat_template = template
    return tok


def test_formats_and_open_thinking_come_from_the_template():
    """The format is read off the chat template (harmony's channel markers; a `</think>` it writes); a prompt whose
    template opened `<think>` leaves the model inside it, one that closed it (enable_thinking false) does not."""
    harmony, think = _tokenizer(HARMONY_TEMPLATE, HARMONY_MARKERS), _tokenizer(THINK_TEMPLATE)
    assert reasoning_format(harmony) == "harmony" and reasoning_format(think) == "think"
    assert reasoning_format(build_tokenizer()) is None and reasoning_format(None) is None
    ask = [{"role": "user", "content": "hi"}]

    def ids(**kw):
        return think(think.apply_chat_template(ask, tokenize=False, add_generation_prompt=True, **kw),
                     add_special_tokens=False)["input_ids"]

    assert prompt_opens_thinking(think, ids(open_thinking=True))
    assert not prompt_opens_thinking(think, ids()) and not prompt_opens_thinking(think, ids(enable_thinking=False))
    # harmony's stops: <|return|> and <|call|> join the checkpoint's, <|end|> (one message's end) leaves them
    vocab = harmony.get_vocab()
    assert output_stops(harmony, (1, vocab["<|end|>"])) == (1, vocab["<|return|>"], vocab["<|call|>"])
    assert output_stops(think, (1, 5)) == (1, 5)


@pytest.fixture(scope="module")
def harmony_dir(tmp_path_factory) -> Path:
    """The tiny Llama with harmony's markers as special tokens, a harmony template, and <|end|> among config.json's
    end-of-sequence ids (as a GGUF whose end-of-turn id is <|end|> gives them)."""
    d = tmp_path_factory.mktemp("harmony") / "llama-harmony"
    tok = _tokenizer(HARMONY_TEMPLATE, HARMONY_MARKERS)
    write_tiny_checkpoint("llama", d, tok)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "eos_token_id": [1, tok.convert_tokens_to_ids("<|end|>")]}))
    return d


@pytest.fixture(scope="module")
def harmony(harmony_dir):
    with LLM(str(harmony_dir), EngineConfig()) as llm:
        yield llm


def _write(llm, seq, text: str) -> None:
    """The model 'writes' `text`: its tokens accepted one by one as drawn ones are (detokenized, stops applied)."""
    for t in llm.tokenizer(text, add_special_tokens=False)["input_ids"]:
        llm._accept(seq, t, time.perf_counter())
        if seq.finished:
            return


def test_harmony_output_keeps_its_markers_and_is_split(harmony):
    """A harmony model's chat: the text keeps the channel markers (special tokens, which decoding would drop,
    running the messages together), the output is split into reasoning and answer, <|end|> does not end it and
    <|return|> does (not part of the text); a call ends at <|call|> with its function and arguments."""
    llm, vocab = harmony, harmony.tokenizer.get_vocab()
    assert llm.keeps_special_tokens and llm.reasoning_format == "harmony"
    assert vocab["<|end|>"] not in llm.config.eos_token_ids
    assert {vocab["<|return|>"], vocab["<|call|>"], 1} <= set(llm.config.eos_token_ids)
    ask = [{"role": "user", "content": "weather in Paris?"}]
    seq = llm.make_sequence(ask, SamplingParams(max_tokens=200))
    assert seq.reasoning_format == "harmony" and seq.keep_special
    _write(llm, seq, "<|channel|>analysis<|message|>The user asks.<|end|><|start|>assistant<|channel|>final"
                     "<|message|>It is sunny.<|return|>")
    out = seq.output()
    assert out.finish_reason == "stop" and out.text.endswith("It is sunny.") and "<|end|><|start|>assistant" in out.text
    assert (out.reasoning, out.content, out.tool_calls) == ("The user asks.", "It is sunny.", [])
    assert out.as_dict()["reasoning"] == "The user asks." and out.as_dict()["content"] == "It is sunny."
    seq = llm.make_sequence(ask, SamplingParams(max_tokens=200))
    _write(llm, seq, "<|channel|>analysis<|message|>Call it.<|end|><|start|>assistant<|channel|>commentary "
                     'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>trailing')
    out = seq.output()
    assert out.finish_reason == "stop" and out.tool_calls == [("get_weather", '{"city": "Paris"}')]
    assert "trailing" not in out.text and out.content == ""
    # a plain completion (no chat template) is not split, but keeps the markers the model writes
    seq = llm.make_sequence("weather?", SamplingParams(max_tokens=50), chat=False)
    _write(llm, seq, "<|channel|>final<|message|>x")
    assert seq.reasoning_format is None and seq.output().content == seq.output().text == "<|channel|>final<|message|>x"


def test_harmony_json_schema_constrains_the_answer_after_the_reasoning(harmony):
    """A structured output on a harmony model: the analysis message is free (the model reasons as it was trained
    to), the final channel's message follows the schema, and the answer is that JSON."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
              "additionalProperties": False}
    params = [SamplingParams(max_tokens=120, temperature=1.0, seed=s, structured_outputs={"json": schema})
              for s in range(4)]
    outs = [harmony.generate([[{"role": "user", "content": "hi"}]], p)[0] for p in params]
    done = [o for o in outs if o.finish_reason == "stop"]
    assert done, [o.text for o in outs]
    for out in done:
        assert out.text.startswith("<|channel|>") and "<|channel|>final<|message|>" in out.text
        assert set(json.loads(out.content)) == {"a"} and out.text.endswith(out.content.strip())
    assert any(o.reasoning for o in done)  # the free analysis message (random bytes from this model)


def test_think_grammar_admits_the_reasoning_then_the_answer(chat_llama):
    """The `<think>` wrapper (structured.after_reasoning) as the grammar engine runs it: with the block opened by the
    prompt, the thought ends at `</think>` and the answer follows the constraint; left to the model, it may think or
    answer at once; a constrained answer inside the thought is not the end."""
    tok = _tokenizer(THINK_TEMPLATE)
    gt = grammar_tokenizer(tok, len(tok), (1,))
    schema = StructuredOutputsParams(json=json.dumps({"type": "object", "properties": {"a": {"type": "integer"}},
                                                      "required": ["a"]}))

    def run(text: str, opened: bool) -> TokenMatcher:
        m = TokenMatcher(gt, schema, len(tok), "think", opened)
        for t in tok(text, add_special_tokens=False)["input_ids"]:
            assert m.accept(t), text
        return m

    assert run('I need {"a": 1} here.\n</think>\n\n{"a": 2}', True).done
    assert not run('{"a": 1}', True).done  # still thinking
    assert run('<think>hm</think>\n{"a": 3}', False).done and run('{"a": 3}', False).done
    plain = TokenMatcher(gt, schema, len(tok))
    assert not plain.accept(tok("<", add_special_tokens=False)["input_ids"][0])


@contextlib.contextmanager
def _think_server(zoo, chat_llama, tmp_path_factory, monkeypatch):
    from test_serve import KEY, running_server
    from tiered.serve.engine import ServingEngine

    d = tmp_path_factory.mktemp("think") / "llama-think"
    shutil.copytree(chat_llama, d)
    cfg = d / "tokenizer_config.json"
    cfg.write_text(json.dumps({**json.loads(cfg.read_text()), "chat_template": THINK_TEMPLATE}))
    llm = zoo.llm(d)
    # the random model writes no <think> block by itself: a regex scripts its whole output, reasoning included (its
    # grammar not wrapped in the reasoning one, which would leave the thought to the model)
    import tiered.engine.llm as engine_llm

    monkeypatch.setattr(engine_llm, "TokenMatcher", lambda tok, p, v, *_: TokenMatcher(tok, p, v))
    with running_server(ServingEngine(llm, max_batch=4, max_queue=8), KEY) as url:
        yield url, llm


def test_server_answers_reasoning_apart_streamed_or_not(zoo, chat_llama, tmp_path_factory, monkeypatch):
    """/v1/chat/completions on a `<think>` model: `reasoning_content` holds the thought and `content` the answer, in
    one response and in a stream's deltas (which add up to them); chat_template_kwargs reach the template
    (enable_thinking false closes the block in the prompt); a completion is not split."""
    openai = pytest.importorskip("openai")
    from test_serve import KEY, MODEL

    script = {"structured_outputs": {"regex": r"<think>\n[a-z]{3,6} [a-z]{3,6}\n</think>\n\n[A-Z][a-z]{2,6}\."}}
    with _think_server(zoo, chat_llama, tmp_path_factory, monkeypatch) as (url, llm):
        client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=60)
        ask = dict(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=40, temperature=0,
                   extra_body=script)
        msg = client.chat.completions.create(**ask).choices[0].message
        thought, answer = msg.model_extra["reasoning_content"], msg.content
        assert msg.model_extra["reasoning"] == thought  # vLLM's name beside DeepSeek's
        assert thought.count(" ") == 1 and "<think>" not in thought and answer[0].isupper() and answer.endswith(".")
        r, c, finish = "", "", None
        for chunk in client.chat.completions.create(**ask, stream=True):
            delta = chunk.choices[0].delta
            r += (delta.model_extra or {}).get("reasoning_content") or ""
            assert (delta.model_extra or {}).get("reasoning") == (delta.model_extra or {}).get("reasoning_content")
            c += delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
        assert (r.strip(), c.strip(), finish) == (thought, answer, "stop")
        # vLLM's include_reasoning false: the answer alone, streamed or not
        hidden = {**ask, "extra_body": {**script, "include_reasoning": False}}
        msg = client.chat.completions.create(**hidden).choices[0].message
        assert msg.content == answer and "reasoning_content" not in (msg.model_extra or {})
        deltas = [c.choices[0].delta for c in client.chat.completions.create(**hidden, stream=True) if c.choices]
        assert not any((d.model_extra or {}).get("reasoning_content") for d in deltas)
        assert "".join(d.content or "" for d in deltas).strip() == answer
        # chat_template_kwargs: the prompt closes thinking; refused for the template's own arguments
        closed = client.chat.completions.create(**{**ask, "extra_body": {
            **script, "chat_template_kwargs": {"enable_thinking": False}}})
        opened = client.chat.completions.create(**{**ask, "extra_body": {
            **script, "chat_template_kwargs": {"open_thinking": True}}})
        plain = client.chat.completions.create(**ask)
        assert closed.usage.prompt_tokens > opened.usage.prompt_tokens > plain.usage.prompt_tokens
        with pytest.raises(openai.BadRequestError, match="add_generation_prompt"):
            client.chat.completions.create(**{**ask, "extra_body": {"chat_template_kwargs": {
                "add_generation_prompt": False}}})
        text = client.completions.create(model=MODEL, prompt="hi", max_tokens=30, temperature=0, extra_body=script)
        assert text.choices[0].text.startswith("<think>")  # as the model wrote it


def test_anthropic_messages_answer_the_reasoning_as_a_thinking_block(zoo, chat_llama, tmp_path_factory, monkeypatch):
    """/v1/messages on a `<think>` model: a thinking block then the text block, in one response and as a stream's
    thinking_delta and text_delta events (which add up to them); `thinking` disabled closes the block in the prompt
    (the template's enable_thinking), as chat_template_kwargs do on /v1/chat/completions."""
    from test_serve import KEY, MODEL

    script = {"structured_outputs": {"regex": r"<think>\n[a-z]{3,6} [a-z]{3,6}\n</think>\n\n[A-Z][a-z]{2,6}\."}}
    with _think_server(zoo, chat_llama, tmp_path_factory, monkeypatch) as (url, llm):
        ask = {"model": MODEL, "max_tokens": 40, "temperature": 0, "messages": [{"role": "user", "content": "hi"}],
               **script}
        headers = {"x-api-key": KEY}
        msg = httpx.post(url + "/v1/messages", headers=headers, json=ask, timeout=60).json()
        (think, text) = msg["content"]
        assert think["type"] == "thinking" and think["thinking"].strip().count(" ") == 1 and text["type"] == "text"
        assert text["text"][0].isupper() and text["text"].endswith(".") and msg["stop_reason"] == "end_turn"
        events = []
        with httpx.stream("POST", url + "/v1/messages", headers=headers, json={**ask, "stream": True}, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(json.loads(line[6:]))
        starts = [e["content_block"]["type"] for e in events if e["type"] == "content_block_start"]
        deltas = [e["delta"] for e in events if e["type"] == "content_block_delta"]
        assert starts == ["thinking", "text"] and events[-1]["type"] == "message_stop"
        assert "".join(d.get("thinking", "") for d in deltas).strip() == think["thinking"].strip()
        assert "".join(d.get("text", "") for d in deltas).strip() == text["text"].strip()
        closed = httpx.post(url + "/v1/messages", headers=headers, json={**ask, "thinking": {"type": "disabled"}},
                            timeout=60).json()
        assert closed["usage"]["input_tokens"] + closed["usage"]["cache_read_input_tokens"] > \
            msg["usage"]["input_tokens"] + msg["usage"]["cache_read_input_tokens"]


def test_llm_chat_continues_a_prefilled_answer(zoo, chat_llama):
    """LLM.chat(continue_final_message=True, add_generation_prompt=False) (vLLM's): the prompt ends with the last
    message's text, left open, and the answer continues it (the prompt's tokens those encode_prompt gives); asked
    with a generation prompt too, a ConfigError."""
    from tiered.engine.prompt import encode_prompt
    from tiered.errors import ConfigError

    llm = zoo.llm(chat_llama)
    convo = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello there"}]
    greedy = SamplingParams(max_tokens=4, temperature=0)
    out = llm.chat(convo, greedy, add_generation_prompt=False, continue_final_message=True)[0]
    ids = encode_prompt(llm.tokenizer, convo, True, False, continue_final=True)
    assert out.prompt_token_ids == ids and llm.tokenizer.decode(ids).rstrip().endswith("Hello there")
    assert len(ids) < len(encode_prompt(llm.tokenizer, convo, True))  # no end of turn, no new one
    assert out.token_ids == llm.generate([ids], greedy, chat=True)[0].token_ids
    with pytest.raises(ConfigError, match="add_generation_prompt"):
        llm.chat(convo, greedy, continue_final_message=True)


def test_generation_config_adds_end_of_sequence_ids(zoo, tmp_path):
    """generation_config.json's eos_token_id (transformers' generate stops at them: Llama 3.1's <|eot_id|>, gpt-oss's
    <|call|>) joins config.json's; an unreadable file adds none."""
    d = tmp_path / "llama"
    shutil.copytree(zoo.dir("llama"), d)
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 7, 9], "temperature": 0.6}))
    from tiered.checkpoint import open_checkpoint

    assert open_checkpoint(d).config.eos_token_ids == (1, 7, 9)
    (d / "generation_config.json").write_text("{not json")
    assert open_checkpoint(d).config.eos_token_ids == (1,)


def test_cli_shows_reasoning_then_the_answer(harmony):
    """`tiered run`'s view (chat.AnswerView): reasoning first (dim on a terminal), a blank line, then the answer;
    --hide-reasoning leaves it out; harmony's calls shown as [call NAME ARGS]; without a format, the text as it is."""
    from tiered.chat import DIM, RESET, AnswerView

    text = ("<|channel|>analysis<|message|>Think.<|end|><|start|>assistant<|channel|>commentary to=functions.f "
            '<|message|>{"x": 1}')
    for ansi, show in ((False, True), (True, True), (False, False)):
        shown = []
        view = AnswerView(shown.append, "harmony", show_reasoning=show, ansi=ansi)
        for ch in text:
            view(ch)
        assert view.finish() == [("f", '{"x": 1}')]
        want = ((DIM if ansi else "") + "Think." + (RESET if ansi else "") + "\n\n" if show else "") + '[call f {"x": 1}]'
        assert "".join(shown) == want
    shown = []
    view = AnswerView(shown.append, None)
    view("<think>x</think>")
    assert view.finish() == [] and "".join(shown) == view.answer == "<think>x</think>"


def test_llm_chat_takes_tools_and_template_variables(zoo, chat_llama, tmp_path, monkeypatch):
    """LLM.chat (vLLM's): conversations through the template with `tools` and `chat_template_kwargs`; the calls
    the model wrote in its template's format become tool_calls (a regex scripts the random model's Hermes call);
    a template that refuses a conversation is a ConfigError; `tiered run --template-var` reaches the template."""
    from typer.testing import CliRunner

    import tiered.engine.llm as engine_llm
    from tiered.cli import app
    from tiered.errors import ConfigError

    d = tmp_path / "llama-tools"
    shutil.copytree(chat_llama, d)
    template = ("{% if tools %}<|system|>tools: {% for t in tools %}{{ t.function.name }} {% endfor %}<tool_call>\n"
                "{% endif %}{% for m in messages %}{% if m.role == 'bad' %}{{ raise_exception('no bad turns') }}"
                "{% endif %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>"
                "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}"
                "{% endif %}")
    cfg = d / "tokenizer_config.json"
    cfg.write_text(json.dumps({**json.loads(cfg.read_text()), "chat_template": template}))
    llm = zoo.llm(d)
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    ask = [{"role": "user", "content": "weather?"}]
    monkeypatch.setattr(engine_llm, "TokenMatcher", lambda tok, p, v, *_: TokenMatcher(tok, p, v))
    script = StructuredOutputsParams(regex=r'Ok\. <tool_call>\{"name": "get_weather", "arguments": \{"city": "Oslo"\}\}'
                                           r'</tool_call>')
    out = llm.chat(ask, SamplingParams(max_tokens=150, temperature=0, structured_outputs=script), tools=[weather])[0]
    assert out.tool_calls == [("get_weather", '{"city": "Oslo"}')] and out.content == "Ok."
    assert out.prompt_token_ids == encode(llm, ask, tools=[weather]) and "tools: get_weather" in llm.tokenizer.decode(
        out.prompt_token_ids)
    plain = llm.chat([ask, ask], SamplingParams(max_tokens=3, temperature=0))
    assert len(plain) == 2 and plain[0].tool_calls == [] and plain[0].prompt_token_ids == encode(llm, ask)
    closed = llm.chat(ask, SamplingParams(max_tokens=3, temperature=0), chat_template_kwargs={"enable_thinking": False})
    assert closed[0].prompt_token_ids == encode(llm, ask, template_kwargs={"enable_thinking": False})
    assert len(closed[0].prompt_token_ids) > len(plain[0].prompt_token_ids)
    with pytest.raises(ConfigError, match="no bad turns"):
        llm.chat([{"role": "bad", "content": "x"}], SamplingParams(max_tokens=2))
    result = CliRunner().invoke(app, ["run", "hi", "--model", str(d), "--max-tokens", "2", "--json",
                                      "--template-var", "enable_thinking=false"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["prompt_tokens"] == len(encode(llm, [{"role": "user", "content": "hi"}],
                                                                    template_kwargs={"enable_thinking": False}))
    bad = CliRunner().invoke(app, ["run", "hi", "--model", str(d), "--template-var", "no-equals"])
    assert bad.exit_code != 0 and "KEY=VALUE" in bad.output


def encode(llm, messages, **kw) -> list[int]:
    from tiered.engine.prompt import encode_prompt

    return encode_prompt(llm.tokenizer, messages, True, **kw)


def test_info_names_the_chat_formats(chat_llama, tmp_path):
    """`tiered info`: the template's reasoning and tool-call formats and the sampling the directory ships."""
    from typer.testing import CliRunner

    from tiered.cli import app

    d = tmp_path / "llama-info"
    shutil.copytree(chat_llama, d)
    cfg = d / "tokenizer_config.json"
    cfg.write_text(json.dumps({**json.loads(cfg.read_text()), "chat_template": THINK_TEMPLATE + "<tool_call>"}))
    (d / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "top_p": 0.95}))
    out = CliRunner().invoke(app, ["info", str(d)])
    assert out.exit_code == 0, out.output
    assert ("chat:        template; reasoning in <think> blocks; tool calls as <tool_call> JSON; served sampling "
            "temperature 0.6, top_p 0.95") in out.stdout


def test_a_special_think_token_stays_in_the_text(zoo, tmp_path):
    """A tokenizer that makes `</think>` a special token (decoding would drop it) keeps its special tokens in the
    output, so an answer after a prompt-opened think block is still told from the reasoning; as plain added tokens
    (Qwen3's, DeepSeek's) nothing changes."""
    from tiered.engine.reasoning import marks_special

    template = THINK_TEMPLATE.replace("{% elif open_thinking %}", "{% else %}")  # always opens the block
    for special in (True, False):
        tok = _tokenizer(template)
        if special:
            tok.add_special_tokens({"additional_special_tokens": ["<think>", "</think>"]})
        else:
            tok.add_tokens(["<think>", "</think>"])
        d = tmp_path / f"think-{special}"
        write_tiny_checkpoint("llama", d, tok)
        assert marks_special(tok, "think") is special and not marks_special(tok, None)
        with LLM(str(d), EngineConfig()) as llm:
            assert llm.keeps_special_tokens is special
            seq = llm.make_sequence([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=100))
            assert seq.thinking_opened
            _write(llm, seq, "the user greets\n</think>\n\nHello.")
            out = seq.output()
            assert (out.reasoning, out.content) == ("the user greets", "Hello."), out.text


def test_harmony_named_and_required_calls_are_its_own_messages(harmony):
    """tool_choice naming a function (or "required") on a harmony model: the output is its analysis message, then
    one `commentary to=functions.NAME <|constrain|>json` message whose body follows the tool's parameters (gpt-oss's
    call format, not JSON in the final channel); it reads back as that call, through LLM.chat and the server."""
    from test_serve import KEY, MODEL, running_server
    from tiered.engine.tools import ToolPlan
    from tiered.serve.engine import ServingEngine

    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"],
        "additionalProperties": False}}}
    clock = {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"enum": ["UTC"]}}, "required": ["zone"], "additionalProperties": False}}}
    ask = [{"role": "user", "content": "weather?"}]
    for choice, names in (({"type": "function", "function": {"name": "get_time"}}, {"get_time"}),
                          ("required", {"get_weather", "get_time"})):
        plan = ToolPlan.of([weather, clock], choice, True, harmony.tokenizer)
        assert plan.harmony and plan.structured().whole
        outs = [harmony.chat(ask, SamplingParams(max_tokens=300, temperature=1.0, seed=s,
                                                 structured_outputs=plan.structured()), tools=[weather, clock])[0]
                for s in range(3)]
        done = [o for o in outs if o.finish_reason == "stop"]
        assert done, [o.text for o in outs]
        for out in done:
            ((name, args),) = out.tool_calls
            assert name in names and "<|channel|>commentary to=functions." + name in out.text
            assert set(json.loads(args)) == ({"zone"} if name == "get_time" else {"city"}) and out.content == ""
        for out in outs:
            if out.finish_reason == "length":
                assert out.tool_calls == []  # a call cut short is none
    with running_server(ServingEngine(harmony, max_batch=2, max_queue=4), KEY) as url:
        import httpx

        for seed in range(4):
            r = httpx.post(f"{url}/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=60, json={
                "model": MODEL, "messages": ask, "max_tokens": 300, "temperature": 1.0, "seed": seed,
                "tools": [weather, clock], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})
            choice = r.json()["choices"][0]
            if choice["finish_reason"] == "tool_calls":
                (call,) = choice["message"]["tool_calls"]
                assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"])["city"]
                break
        else:
            pytest.fail(f"no call finished in 4 seeds: {choice}")


def test_an_earlier_answers_reasoning_reaches_the_template_by_either_name():
    """Interleaved thinking: an assistant message's reasoning, sent as vLLM's `reasoning` or DeepSeek's
    `reasoning_content`, is the template's `reasoning_content` (Qwen3's, GLM-4.5's) and `thinking` (gpt-oss's);
    other roles' are not passed on."""
    from jinja2 import Template

    from tiered.serve.protocol import ChatMessage

    qwen_like = Template("{% for m in messages %}{% if m.reasoning_content %}<think>{{ m.reasoning_content }}"
                         "</think>{% endif %}{{ m.content }}|{% endfor %}")
    for key in ("reasoning", "reasoning_content"):
        msgs = [ChatMessage(role="user", content="q", **{key: "not mine"}),
                ChatMessage(role="assistant", content="a", **{key: "why"})]
        dicts = [m.as_dict() for m in msgs]
        assert qwen_like.render(messages=dicts) == "q|<think>why</think>a|"
        assert dicts[1]["thinking"] == "why" and "thinking" not in dicts[0]
    assert "reasoning_content" not in ChatMessage(role="assistant", content="a").as_dict()
