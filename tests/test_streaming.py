"""Stop strings, stop tokens, EOS, streaming (llm.stream, on_text) and incremental detokenization.

The tiny checkpoints carry a byte-level BPE tokenizer, so random models emit partial UTF-8
sequences too: the detokenizer must never stream a half character it later has to take back.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings

from fixtures import prompt_ids
from tiered import SamplingParams
from tiered.engine.detokenize import append_token_text, apply_stop_strings, take_stream_delta
from tiered.engine.sequence import Sequence

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
SAMPLED = SamplingParams(temperature=1.0, seed=7, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(zoo):
    return zoo.llm(zoo.dir("llama"))


@pytest.fixture(scope="module")
def prompts(zoo):
    return [prompt_ids(zoo.vocab_size, n, seed=20 + n) for n in (6, 9, 4)]


def test_text_is_the_decoded_tokens(llm, prompts):
    for out in llm.generate(prompts, GREEDY):
        full = llm.tokenizer.decode(out.token_ids, skip_special_tokens=True)
        assert out.text and full.startswith(out.text)
        assert out.text == full.rstrip("\ufffd")  # only an unfinished character is held back


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_stream_concatenates_to_the_final_text(llm, prompts, params):
    for p in prompts:
        final = llm.generate(p, params)[0].text
        pieces = list(llm.stream(p, params))
        assert "".join(pieces) == final
        assert len(pieces) > 1 and all(pieces)


def test_on_text_streams_every_prompt_of_a_batch(llm, prompts):
    got: dict[int, str] = {}
    outs = llm.generate(prompts, SAMPLED, on_text=lambda i, s: got.__setitem__(i, got.get(i, "") + s))
    assert [got[i] for i in range(len(prompts))] == [o.text for o in outs]


def pick_stop(text: str) -> str:
    """A 2-3 character substring from the middle of `text`, not at its very start."""
    for n in (3, 2):
        for start in range(len(text) // 3, len(text) - n):
            s = text[start:start + n]
            if "\ufffd" not in s and text.find(s) > 0:
                return s
    raise AssertionError(f"no usable stop string in {text!r}")


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_stop_string_cuts_text_and_stream(llm, prompts, params):
    for p in prompts:
        full = llm.generate(p, params)[0].text
        stop = pick_stop(full)
        sp = replace(params, stop=(stop,))
        out = llm.generate(p, sp)[0]
        assert out.text == full[:full.find(stop)]
        assert out.finish_reason == "stop" and out.stop_string == stop
        assert len(out.token_ids) < params.max_tokens
        assert "".join(llm.stream(p, sp)) == out.text  # the stream never showed the stop string


def test_earliest_of_several_stop_strings_wins(llm, prompts):
    full = llm.generate(prompts[0], GREEDY)[0].text
    early, late = pick_stop(full[: len(full) // 2 + 3]), pick_stop(full)
    cut = min(full.find(early), full.find(late))
    out = llm.generate(prompts[0], replace(GREEDY, stop=(late, early, "never-in-the-text-\u2603")))[0]
    assert out.text == full[:cut]
    assert out.stop_string == (early if full.find(early) < full.find(late) else late)  # the one that cut it
    assert llm.generate(prompts[0], GREEDY)[0].stop_string is None  # ended by its length


def test_stop_token_ids_end_generation(llm, prompts):
    full = llm.generate(prompts[1], GREEDY)[0].token_ids
    stop_tok = full[5]
    out = llm.generate(prompts[1], replace(GREEDY, stop_token_ids=[stop_tok]))[0]
    k = full.index(stop_tok)
    assert out.token_ids == full[:k + 1]  # the stop token is returned, like vLLM
    assert out.finish_reason == "stop"
    assert out.text == llm.tokenizer.decode(full[:k], skip_special_tokens=True).rstrip("\ufffd")


def test_eos_ends_generation_unless_ignored(zoo, tmp_path, prompts):
    """A copy of the tiny Llama whose EOS is a token it is known to emit greedily."""
    from tiered import LLM, EngineConfig

    base = zoo.llm(zoo.dir("llama"))
    full = base.generate(prompts[2], GREEDY)[0].token_ids
    eos = full[4]
    d = tmp_path / "eos"
    shutil.copytree(zoo.dir("llama"), d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["eos_token_id"] = [eos, 1]
    (d / "config.json").write_text(json.dumps(cfg))
    llm = LLM(d, EngineConfig(decode_weights="fp32"))
    assert llm.config.eos_token_ids == (eos, 1)
    out = llm.generate(prompts[2], replace(GREEDY, ignore_eos=False))[0]
    assert out.token_ids == full[:full.index(eos) + 1] and out.finish_reason == "stop"
    assert llm.generate(prompts[2], GREEDY)[0].token_ids == full


def test_max_tokens_and_stats(llm, prompts):
    outs = llm.generate(prompts, replace(GREEDY, max_tokens=5))
    for p, o in zip(prompts, outs):
        assert len(o.token_ids) == 5 and o.finish_reason == "length"
        s = o.stats
        assert s.prompt_tokens == len(p) and s.generated_tokens == 5
        assert s.ttft_s > 0 and s.prefill_s > 0 and s.decode_s >= 0 and s.itl_s >= 0
        assert set(o.as_dict()) >= {"text", "token_ids", "finish_reason", "stats", "prompt_tokens"}


def test_text_prompts_are_tokenized(llm, zoo):
    out = llm.generate("The quick brown fox", replace(GREEDY, max_tokens=4))[0]
    assert out.prompt == "The quick brown fox"
    assert out.prompt_token_ids == zoo.tokenizer("The quick brown fox")["input_ids"]
    two = llm.generate(["The quick brown fox", "Memory is"], replace(GREEDY, max_tokens=4))
    assert two[0].token_ids == out.token_ids and len(two) == 2


# ----------------------------------------------------------------- detokenizer, alone
def feed(tokenizer, ids: list[int], stop: tuple[str, ...] = ()) -> tuple[Sequence, str]:
    """Run the engine's per-token postprocessing over `ids`; return the sequence and the stream."""
    seq = Sequence(index=0, prompt="", prompt_ids=[0], params=SamplingParams(stop=stop), max_tokens=len(ids),
                   slot=0, generator=None)
    streamed = ""
    for i, t in enumerate(ids):
        seq.output_ids.append(t)
        append_token_text(tokenizer, seq)
        apply_stop_strings(seq)
        if not seq.finished and i == len(ids) - 1:
            seq.finish_reason = "length"
        streamed += take_stream_delta(seq)
        if seq.finished:
            break
    return seq, streamed


@settings(max_examples=80, deadline=None)
@given(st.data())
def test_the_window_fallback_gives_the_streams_text(zoo, data):
    """append_token_text runs tokenizers' DecodeStream where the tokenizer has a `tokenizers` backend,
    else decodes a window per token (vLLM's rule): both give the same text, special tokens,
    incomplete UTF-8 and all."""
    class Plain:  # no `_tokenizer`: the window fallback
        def decode(self, ids, skip_special_tokens=False):
            return zoo.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    ids = data.draw(st.lists(st.integers(0, zoo.vocab_size - 1), min_size=1, max_size=30))
    (stream, _), (window, _) = feed(zoo.tokenizer, ids), feed(Plain(), ids)
    assert stream.decode_stream is not None and window.decode_stream is None
    assert stream.text == window.text


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_incremental_detokenization_equals_full_decode(zoo, data):
    ids = data.draw(st.lists(st.integers(0, zoo.vocab_size - 1), min_size=1, max_size=30))
    seq, streamed = feed(zoo.tokenizer, ids)
    full = zoo.tokenizer.decode(ids, skip_special_tokens=True)
    assert streamed == seq.text
    assert seq.text == full.rstrip("\ufffd") or (full.endswith("\ufffd") and full.startswith(seq.text))


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_stop_strings_on_arbitrary_text(zoo, data):
    """Whatever the tokens: text == full text cut at the earliest stop string; stream == text."""
    words = ["ab", "the", " fox", "é", "日本", "\U0001f600", "x", " ", "."]
    text = "".join(data.draw(st.lists(st.sampled_from(words), min_size=1, max_size=12)))
    ids = zoo.tokenizer(text)["input_ids"]
    stops = tuple(data.draw(st.lists(st.sampled_from(["fox", "é", "日", "\U0001f600", "e f", "..", "b"]),
                                     min_size=1, max_size=3)))
    seq, streamed = feed(zoo.tokenizer, ids, stops)
    hits = [text.find(s) for s in stops if s in text]
    assert seq.text == (text[:min(hits)] if hits else text)
    assert seq.finish_reason == ("stop" if hits else "length")
    assert streamed == seq.text
