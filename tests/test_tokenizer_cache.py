"""checkpoint/tokenizer.py's rule for a model directory's tokenizer: read through the generic
TokenizersBackend where it gives what AutoTokenizer gives (checked once, recorded in the cache), else
through AutoTokenizer's model-specific class (whose import costs ~1.1 s of every start)."""

from __future__ import annotations

import json
import threading

from fixtures import build_tokenizer
from tiered.checkpoint.tokenizer import _PROBES, GENERIC_MARK, _hf_mark, load_hf_tokenizer


def _directory(tmp_path, cls: str):
    d = tmp_path / cls
    build_tokenizer().save_pretrained(d)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    (d / "tokenizer_config.json").write_text(json.dumps({**cfg, "tokenizer_class": cls}))
    return d


def test_a_directory_tokenizer_reads_through_the_generic_class_only_where_it_is_the_same(tmp_path, monkeypatch):
    monkeypatch.setenv("TIERED_CACHE", str(tmp_path / "cache"))
    # transformers reads a ByteLevel tokenizer.json saved as "LlamaTokenizer" through the generic class anyway
    same = _directory(tmp_path, "LlamaTokenizer")
    first = load_hf_tokenizer(same)
    mark = _hf_mark(same)
    assert mark is not None and mark.name == GENERIC_MARK and json.loads(mark.read_text()) == {"load": "generic"}
    again = load_hf_tokenizer(same)
    assert type(again).__name__ == "TokenizersBackend"
    assert all(again(t).input_ids == first(t).input_ids for t in _PROBES)
    # GPT2Tokenizer rebuilds its own pipeline from the vocabulary and merges: not the same, kept as its class
    other = _directory(tmp_path, "GPT2Tokenizer")
    first = load_hf_tokenizer(other)
    assert type(first).__name__ == "GPT2Tokenizer"
    assert json.loads(_hf_mark(other).read_text()) == {"load": "class"}
    assert type(load_hf_tokenizer(other)).__name__ == "GPT2Tokenizer"
    # the rule is keyed by the tokenizer files: an edited config is checked again
    cfg = json.loads((other / "tokenizer_config.json").read_text())
    (other / "tokenizer_config.json").write_text(json.dumps({**cfg, "model_max_length": 77}))
    assert not _hf_mark(other).is_file()
    assert load_hf_tokenizer(other).model_max_length == 77 and _hf_mark(other).is_file()
    # a directory already saved by the generic class needs no rule
    plain = tmp_path / "plain"
    build_tokenizer().save_pretrained(plain)
    assert _hf_mark(plain) is None


def test_the_same_tokenizer_check_compares_what_tiered_reads():
    """_same_tokenizer: a copy is the same (a chat template that refuses a system turn is compared
    without one); another chat template, another special token or another vocabulary is not."""
    import copy

    from tiered.checkpoint.tokenizer import _same_tokenizer

    a = build_tokenizer()
    a.chat_template = ("{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system') }}"
                       "{% endif %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}")
    assert _same_tokenizer(a, copy.deepcopy(a))
    b = copy.deepcopy(a)
    b.chat_template = a.chat_template.replace("<{{", "[{{")
    assert not _same_tokenizer(a, b)
    c = copy.deepcopy(a)
    c.add_special_tokens({"additional_special_tokens": ["<extra>"]})
    assert not _same_tokenizer(a, c)
    d = build_tokenizer()
    d.chat_template = a.chat_template
    d.add_tokens(["memory"])  # splits text differently
    assert not _same_tokenizer(a, d)


def test_llm_loads_the_tokenizer_on_its_own_thread_while_the_weights_are_placed(zoo, monkeypatch):
    """LLM() starts the tokenizer's load after the plan (whose speed check wants idle cores) and
    waits for it before returning; the weights are placed meanwhile on the calling thread."""
    from tiered import LLM, EngineConfig
    from tiered.checkpoint.hf_dir import HFDirCheckpoint

    seen = {}
    load_tokenizer, place, plan = HFDirCheckpoint._load_tokenizer, LLM._place, LLM._plan

    def tokenizer_load(self):
        seen["tokenizer"] = (threading.current_thread(), "planned" in seen)
        return load_tokenizer(self)

    def placing(self, progress):
        seen["place"] = threading.current_thread()
        return place(self, progress)

    def planning(self, progress):
        seen["planned"] = True
        return plan(self, progress)

    monkeypatch.setattr(HFDirCheckpoint, "_load_tokenizer", tokenizer_load)
    monkeypatch.setattr(LLM, "_place", placing)
    monkeypatch.setattr(LLM, "_plan", planning)
    llm = LLM(zoo.dir("llama"), EngineConfig(decode_weights="fp32"))
    thread, after_the_plan = seen["tokenizer"]
    assert seen["place"] is threading.main_thread() and thread is not threading.main_thread() and after_the_plan
    assert llm.encode("hello there") == zoo.tokenizer("hello there")["input_ids"]
    # LLM.planned reads no tokenizer
    seen.clear()
    LLM.planned(zoo.dir("llama"))
    assert "tokenizer" not in seen
