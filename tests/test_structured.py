"""Structured outputs (engine/structured.py): generation constrained to a JSON schema, any JSON object, a
regex, a choice or a grammar, on the tiny Llama (random weights: unconstrained, it writes no JSON at all, so
every valid output is the grammar's doing) and on SmolLM2 where installed."""

from __future__ import annotations

import json
import re

import llguidance.hf
import pytest
import torch
from llguidance import LLMatcher

from tiered import SamplingParams
from tiered.engine.structured import StructuredOutputsParams, TokenMatcher, grammar_tokenizer
from tiered.errors import ConfigError

# finite by construction: every value an enum, a boolean, a bounded integer or a short string
SCHEMA = {"type": "object",
          "properties": {"colour": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"},
                         "n": {"type": "integer", "minimum": 0, "maximum": 99},
                         "tag": {"type": "string", "minLength": 1, "maxLength": 6, "pattern": "^[a-z]+$"}},
          "required": ["colour", "ok", "n", "tag"], "additionalProperties": False}
COMPACT = dict(SCHEMA, **{"x-guidance": {"whitespace_flexible": False}})
PROMPT = "the quick brown fox"


def _valid(obj: dict) -> bool:
    """Whether `obj` follows SCHEMA (checked by hand, not by the grammar engine under test)."""
    return (set(obj) == {"colour", "ok", "n", "tag"} and obj["colour"] in ("red", "green", "blue")
            and isinstance(obj["ok"], bool) and isinstance(obj["n"], int) and not isinstance(obj["n"], bool)
            and 0 <= obj["n"] <= 99 and re.fullmatch("[a-z]{1,6}", obj["tag"]) is not None)


@pytest.fixture(scope="module")
def llm(zoo):
    return zoo.llm(zoo.dir("llama"))


# the three ways a row is drawn (engine/sampling.sample_tokens): greedy, the native temperature-only draw,
# the native filtered draw (top-p, repetition penalty)
DRAWS = {"greedy": dict(temperature=0), "temperature": dict(temperature=1.0, seed=3),
         "filtered": dict(temperature=0.9, top_p=0.9, repetition_penalty=1.2, seed=5)}


@pytest.mark.parametrize("draw", DRAWS)
def test_json_schema_output_follows_the_schema(llm, draw):
    """Each way of drawing gives JSON following the schema, its properties in the schema's order, and ends
    when the object closes; unconstrained, the same model writes no JSON."""
    free = llm.generate([PROMPT], SamplingParams(max_tokens=40, **DRAWS[draw]))[0]
    with pytest.raises(ValueError):
        json.loads(free.text)
    # the random model ranks whitespace high and would fill its 256-token context with JSON_WHITESPACE's 21
    # characters at every place: the schema's own x-guidance options (they win over the default) allow none
    params = SamplingParams(max_tokens=200, structured_outputs=StructuredOutputsParams(json=COMPACT), **DRAWS[draw])
    for out in llm.generate([PROMPT, "memory is a tier", "hello"], params):
        obj = json.loads(out.text)
        assert _valid(obj) and list(obj) == ["colour", "ok", "n", "tag"], out.text
        assert out.text == json.dumps(obj, separators=(",", ":")) and out.finish_reason == "stop"


def test_json_whitespace_is_bounded_by_default(llm):
    """Without x-guidance, whitespace between JSON tokens is one space or a newline and up to 20 spaces or
    tabs (llama.cpp's rule): compact, spaced and pretty-printed objects pass, longer runs are refused."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    alphabet = bytes_to_unicode()  # the tiny tokenizer is byte-level BPE: every byte has a token
    seq = llm.make_sequence(PROMPT, SamplingParams(structured_outputs={"json": SCHEMA}))
    for text, takes in (('{"colour": "red", "ok": true, "n"', None), ('{\n  "colour" : "red"', None),
                        ('{\n' + ' ' * 20 + '"colour"', None), ('{\n' + ' ' * 25, 22), ('{  "colour"', 2),
                        ('{\n\n"colour"', 2)):
        ids = [llm.tokenizer.convert_tokens_to_ids(alphabet[b]) for b in text.encode()]
        assert seq.matcher.matcher.validate_tokens(ids) == (len(ids) if takes is None else takes), text


def test_greedy_takes_the_best_token_the_grammar_allows(llm):
    """A constrained greedy token is the argmax of the model's own logits over the tokens the grammar
    allows there (an independent llguidance matcher replays the output), and often not the plain argmax."""
    so = StructuredOutputsParams(regex="[a-z ]{3,12}\\.")
    out = llm.generate([PROMPT], SamplingParams(max_tokens=40, temperature=0, structured_outputs=so))[0]
    assert re.fullmatch("[a-z ]{3,12}\\.", out.text) and out.finish_reason == "stop"
    tok = llguidance.hf.from_tokenizer(llm.tokenizer, n_vocab=llm.config.vocab_size,
                                       eos_token=list(llm.config.eos_token_ids))
    replay = LLMatcher(tok, LLMatcher.grammar_from_regex(so.regex))
    ids = list(out.prompt_token_ids)
    unconstrained_differs = False
    for token in out.token_ids:
        row = llm.logits(ids)[-1]
        bits = torch.tensor(list(replay.compute_bitmask()), dtype=torch.uint8)
        allowed = ((bits.unsqueeze(1) >> torch.arange(8)) & 1).flatten()[:row.numel()].bool()
        assert allowed[token]
        best = row.masked_fill(~allowed, float("-inf")).max()
        assert row[token] >= best - 1e-4, (token, float(row[token]), float(best))
        unconstrained_differs |= int(row.argmax()) != token
        assert replay.consume_token(token)
        ids.append(token)
    assert unconstrained_differs


@pytest.mark.parametrize("so,check", [
    (dict(regex="(ab|cd){2,4}!"), lambda t: re.fullmatch("(ab|cd){2,4}!", t)),
    (dict(choice=["alpha", "beta gamma", "delta"]), lambda t: t in ("alpha", "beta gamma", "delta")),
    (dict(grammar='start: "(" WORD ("," WORD)* ")"\nWORD: /[a-z]{1,4}/'),
     lambda t: re.fullmatch(r"\([a-z]{1,4}(,[a-z]{1,4})*\)", t)),
    (dict(grammar='root ::= "[" num ("," num)* "]"\nnum ::= [0-9] | [1-9] [0-9]'),  # llama.cpp's GBNF
     lambda t: re.fullmatch(r"\[(\d|[1-9]\d)(,(\d|[1-9]\d))*\]", t)),
    (dict(json_object=True), lambda t: isinstance(json.loads(t), dict))])
def test_regex_choice_grammar_and_json_object(llm, so, check):
    """A regex, a choice, a Lark grammar, a GBNF grammar and any JSON object, sampled with several seeds."""
    params = SamplingParams(max_tokens=300, temperature=0.8, seed=11, structured_outputs=so)
    for out in llm.generate([PROMPT, "tiered", "seven eight"], params):
        if out.finish_reason == "length":  # a JSON object the random model keeps extending
            assert so.get("json_object")
            continue
        assert check(out.text), (so, out.text)


def test_constrained_and_plain_requests_share_a_batch(llm):
    """Stepped in one batch (as the server steps its requests), the constrained row follows its grammar and
    gives what it gives alone, and the plain rows give what they give alone."""
    from tiered.engine.scheduler import Scheduler

    plain = SamplingParams(max_tokens=12, temperature=0)
    shaped = SamplingParams(max_tokens=100, temperature=0, structured_outputs=dict(json=COMPACT))
    alone = [llm.generate([PROMPT], plain)[0], llm.generate(["memory is a tier"], shaped)[0]]
    seqs = [llm.make_sequence(p, sp, index=i) for i, (p, sp) in
            enumerate(zip([PROMPT, "memory is a tier", PROMPT], [plain, shaped, plain]))]
    sched = Scheduler(max_batch=3, max_queue=3)
    for seq in seqs:
        sched.add(seq)
    cache = llm._cache_for(3, max(s.num_tokens + s.max_tokens for s in seqs))
    widths = set()
    while sched.has_work():
        llm.step(sched, cache)
        widths.add(len(sched.running))
    assert 3 in widths  # the three decoded together
    assert seqs[0].text == alone[0].text == seqs[2].text
    assert _valid(json.loads(seqs[1].text)) and seqs[1].text == alone[1].text


def test_rollback_steps_the_grammar_back(llm):
    """Sequence.truncate (the server's rollback) steps the parser back: its allowed tokens then equal a
    fresh matcher's after the kept tokens."""
    so = StructuredOutputsParams(json=COMPACT)
    out = llm.generate([PROMPT], SamplingParams(max_tokens=200, temperature=0, structured_outputs=so))[0]
    seq = llm.make_sequence(PROMPT, SamplingParams(max_tokens=200, structured_outputs=so))
    for t in out.token_ids:
        seq.output_ids.append(t)
        seq.token_times.append(0.0)
        seq.matcher.accept(t)
    assert seq.matcher.done
    seq.truncate(5)
    fresh = llm.make_sequence(PROMPT, SamplingParams(max_tokens=200, structured_outputs=so)).matcher
    for t in out.token_ids[:5]:
        fresh.accept(t)
    assert not seq.matcher.done and (seq.matcher.allowed() == fresh.allowed()).all()


def test_bad_structured_outputs_are_refused_with_clear_errors(llm):
    """None or several constraints, a schema that is not JSON, an empty choice, a regex or grammar that
    does not compile, a model without a tokenizer: ConfigError naming what is wrong, before any step."""
    for kwargs, words in (({}, "exactly one"), ({"regex": "a", "choice": ["b"]}, "got regex, choice"),
                          ({"json": "{not json"}, "not valid JSON"), ({"choice": []}, "non-empty"),
                          ({"json": [1, 2]}, "JSON object"), ({"regex": ""}, "empty")):
        with pytest.raises(ConfigError, match=words):
            StructuredOutputsParams(**kwargs)
    with pytest.raises(ConfigError, match="structured_outputs"):
        SamplingParams(structured_outputs={"schema": {}})
    for so in ({"regex": "(unclosed"}, {"grammar": "start: undefined_rule"}, {"grammar": "root ::= ("},
               {"json": {"type": "object", "properties": {"a": {"type": "wat"}}}}, {"json": {"$ref": "#/nope"}},
               {"regex": "a(?=b)"}):
        with pytest.raises(ConfigError, match="structured output"):
            llm.make_sequence(PROMPT, SamplingParams(structured_outputs=so))
    with pytest.raises(ConfigError, match="tokenizer"):
        grammar_tokenizer(None, llm.config.vocab_size, llm.config.eos_token_ids)
    # a boolean schema: true is any JSON value
    out = llm.generate([PROMPT], SamplingParams(max_tokens=200, temperature=0.7, seed=2, structured_outputs={"json": True}))[0]
    assert out.finish_reason == "length" or json.loads(out.text) is not None


def test_the_matcher_masks_tokens_past_the_tokenizer(llm):
    """Logit rows wider than the tokenizer (a model's padded vocabulary) never allow the rows past it."""
    tok = grammar_tokenizer(llm.tokenizer, llm.config.vocab_size + 64, llm.config.eos_token_ids)
    m = TokenMatcher(tok, StructuredOutputsParams(choice=["yes"]), llm.config.vocab_size + 64)
    row = torch.zeros(llm.config.vocab_size + 64)
    row[-10:] = 50.0
    masked = m.constrain(row)
    assert torch.isinf(masked[llm.config.vocab_size:]).all() and torch.isfinite(masked).any()


@pytest.mark.slow
def test_smollm2_writes_the_json_asked(smollm2_path):
    """SmolLM2 asked for a person as JSON under a schema: the object parses, follows it, and says what the
    prompt asked."""
    from tiered import LLM

    llm = LLM(smollm2_path)
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    msgs = [{"role": "user", "content": "Give me a JSON object describing a person named Bob aged 42."}]
    out = llm.generate([msgs], SamplingParams(max_tokens=60, temperature=0, structured_outputs={"json": schema}))[0]
    assert json.loads(out.text) == {"name": "Bob", "age": 42} and out.finish_reason == "stop"
    out = llm.generate([msgs], SamplingParams(max_tokens=5, temperature=0,
                                              structured_outputs={"choice": ["Bob", "Alice"]}))[0]
    assert out.text == "Bob"


LONG_KEYS = {"type": "object", "properties": {"temperature_in_celsius": {"type": "integer", "minimum": 0, "maximum": 9},
                                              "description_of_the_weather": {"enum": ["sunny", "rain"]}},
             "required": ["temperature_in_celsius", "description_of_the_weather"], "additionalProperties": False,
             "x-guidance": {"whitespace_flexible": False}}


def test_forced_tokens_go_in_as_rows_of_one_step(llm, monkeypatch):
    """The tokens a grammar forces (a schema's long key names) are appended without a draw and fed to the next
    step as rows beside the last drawn token: fewer steps, the same greedy text as a step a token
    (TIERED_FORCED_TOKENS=0), every forced run what an independent matcher says the grammar forces there."""
    from tiered.engine.scheduler import Scheduler

    params = SamplingParams(max_tokens=120, temperature=0, structured_outputs={"json": LONG_KEYS})

    def run():
        seq = llm.make_sequence(PROMPT, params)
        sched = Scheduler(max_batch=1, max_queue=1)
        sched.add(seq)
        cache, steps, rows = llm._cache_for(1, seq.num_tokens + seq.max_tokens), 0, []
        while sched.has_work():
            llm.step(sched, cache)
            steps += 1
            rows.append(seq.pending)
        return seq, steps, rows

    forced, forced_steps, pending = run()
    monkeypatch.setenv("TIERED_FORCED_TOKENS", "0")
    plain, plain_steps, _ = run()
    assert forced.text == plain.text and json.loads(forced.text)["description_of_the_weather"] in ("sunny", "rain")
    assert forced_steps < plain_steps - 5 and max(pending) > 3, (forced_steps, plain_steps, pending)
    assert forced.finish_reason == plain.finish_reason == "stop"


def test_a_slot_never_lends_kv_its_forced_tokens_lack(llm):
    """A request finished right after forced tokens (a choice completed by them) leaves its slot holding the KV
    of its prompt and drawn tokens only (Sequence.kv_tokens): a next request continuing that text reuses no
    more than that, and gives the tokens it gives on a fresh cache."""
    from tiered.engine.scheduler import Scheduler

    choice = SamplingParams(max_tokens=40, temperature=0, structured_outputs={"choice": ["abcdefghijklmnop rest"]})
    sched = Scheduler(max_batch=1, max_queue=2, prefix_reuse=True)
    first = llm.make_sequence(PROMPT, choice)
    sched.add(first)
    cache = llm._cache_for(1, 200)
    while sched.has_work():
        llm.step(sched, cache)
    assert first.text == "abcdefghijklmnop rest" and first.pending > 0
    follow = SamplingParams(max_tokens=8, temperature=0)
    second = llm.make_sequence(first.prompt_ids + first.output_ids, follow)
    sched.add(second)
    while sched.has_work():
        llm.step(sched, cache)
    assert second.cached_tokens == len(first.prompt_ids) + len(first.output_ids) - 1 - first.pending
    assert second.output_ids == llm.generate([first.prompt_ids + first.output_ids], follow)[0].token_ids
