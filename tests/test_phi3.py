"""Phi-3 / Phi-4 (transformers' phi3) against transformers.

Phi-3's layers are Llama's with q/k/v fused into one qkv_proj and gate/up into one gate_up_proj (the gate first),
split on reading (checkpoint/hf_dir.HFDirCheckpoint._split_fused, gguf_file.GGUFCheckpoint._fused_rows), so the
model is models/llama.py's, native decode step included; the tiny checkpoint (tests/fixtures.py "phi3") has a
partial RoPE (3/4 of each head's features rotated) and every layer sliding over 8 positions. The parity tests in
test_hf_parity.py cover logits and greedy tokens; here the split handles, decode past the window in the native
step, GGUF files as llama.cpp's converter writes them, LongRoPE (Phi-3.5 / Phi-4-mini: the window decides the short or
long factors) and the refusals.
"""

from __future__ import annotations


import pytest
import torch
from gguf import GGMLQuantizationType as Q
from safetensors.torch import load_file

from fixtures import (check, decode_matches_transformers, gguf_matches_transformers, gguf_tokenizer_encodes_as_sentencepiece,
                      hf_logits, max_rel_err, prompt_ids, sentencepiece_model, stepwise_logits)
from gguf_writer import dequantized_model, write_phi3_gguf
from tiered import kernels
from tiered.checkpoint import open_checkpoint
from tiered.checkpoint.model_config import ModelConfig
from tiered.errors import UnsupportedModelError

REL_TOL = 1e-4
native_only = pytest.mark.skipif(not kernels.available(), reason="tiered/kernels is not built")


def test_fused_projections_split_into_llamas(zoo):
    """qkv_proj's rows become q / k / v_proj (H hd, Hkv hd, Hkv hd) and gate_up_proj's halves gate / up_proj, the
    same values, read raw from their bytes (offsets of the fused tensor's rows)."""
    path = zoo.dir("phi3")
    ckpt = open_checkpoint(path)
    c = ckpt.config
    assert (c.model_type, c.rotary_dim, c.head_dim, c.sliding_window) == ("phi3", 12, 16, 8)
    stored = load_file(str(path / "model.safetensors"))
    qkv, gu = stored["model.layers.1.self_attn.qkv_proj.weight"], stored["model.layers.1.mlp.gate_up_proj.weight"]
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    want = {"self_attn.q_proj": qkv[:q], "self_attn.k_proj": qkv[q:q + kv], "self_attn.v_proj": qkv[q + kv:],
            "mlp.gate_proj": gu[:c.intermediate_size], "mlp.up_proj": gu[c.intermediate_size:]}
    for name, w in want.items():
        h = ckpt.handle(f"model.layers.1.{name}.weight")
        assert torch.equal(h.load(None), w)
        out = torch.empty_like(w)
        h.read_into(out)  # raw from the file
        assert torch.equal(out, w)
    assert not any("qkv_proj" in n or "gate_up_proj" in n for n in ckpt.names())


@native_only
def test_native_step_decodes_past_the_window_as_transformers(zoo):
    """The native decode step runs every layer (partial RoPE, the window of 8) and decodes past the window with
    transformers' logits, as do its prompt rows, the modules and the torch-op step
    (fixtures.decode_matches_transformers)."""
    decode_matches_transformers(zoo, "phi3")


def test_bad_longrope_settings_are_refused():
    """Phi-3.5-mini's 4.x layout ("su" factors at the top level's rope_scaling) reads; factors of another count than
    the rotated pairs, or no original context, are CheckpointErrors; another activation is refused."""
    from tiered.errors import CheckpointError

    cfg = {"model_type": "phi3", "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
           "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 128,
           "original_max_position_embeddings": 16, "rope_scaling": {
               "type": "su", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}}
    assert ModelConfig.from_hf(cfg).rope_scaling["factor"] == 8.0
    with pytest.raises(CheckpointError) as e:
        ModelConfig.from_hf({**cfg, "rope_scaling": {**cfg["rope_scaling"], "long_factor": [2.0] * 7}})
    check(e, "long_factor", "8 positive numbers")
    with pytest.raises(CheckpointError) as e:
        ModelConfig.from_hf({k: v for k, v in cfg.items() if k != "original_max_position_embeddings"})
    check(e, "original_max_position_embeddings")
    with pytest.raises(UnsupportedModelError) as e:
        ModelConfig.from_hf({**cfg, "hidden_act": "gelu"})
    check(e, "activation")


def test_gguf_matches_transformers(zoo, tmp_path):
    """A phi3 GGUF (attn_qkv and ffn_up fused, rope.dimension_count the partial width) reads as config.json does and
    gives transformers' logits and greedy tokens (F32), the dequantized model's logits (Q8_0)."""
    hf = zoo.hf("phi3")
    gguf_matches_transformers(zoo, "phi3", write_phi3_gguf(hf, tmp_path / "p.gguf"))
    ids = prompt_ids(zoo.vocab_size, 20, seed=1)
    q8 = write_phi3_gguf(hf, tmp_path / "q8.gguf", Q.Q8_0)
    ref = hf_logits(dequantized_model(hf, Q.Q8_0), ids)
    assert max_rel_err(zoo.llm(q8, dtype="float32").logits(ids), ref) <= REL_TOL


@native_only
def test_q4_0_gguf_decodes_from_its_split_blocks(zoo, tmp_path):
    """The default engine over a Q4_0 phi3 file: each part of the fused tensors keeps its rows' Q4_0 blocks (int4
    decode copies), the native step decodes within int8 activations' rounding of the dequantized model."""
    hf = zoo.hf("phi3")
    path = write_phi3_gguf(hf, tmp_path / "q4.gguf", Q.Q4_0)
    llm = zoo.llm(path, decode_weights="auto")
    ids = prompt_ids(zoo.vocab_size, 30, seed=2)
    ref = hf_logits(dequantized_model(hf, Q.Q4_0), ids)[9:]
    assert llm.runtime.cpu_decode.schedule == [("native", 0, 2)]
    assert max_rel_err(stepwise_logits(llm, ids, 10, llm.runtime.cpu_decode), ref) <= 0.05


def test_longrope_factors_follow_the_window(zoo, tmp_path):
    """LongRoPE (Phi-3.5 / Phi-4-mini): a window within the original context (32 positions here) rotates by the
    short factors, as transformers does for every sequence that fits it (test_hf_parity's phi3_longrope); a window
    past it by the long factors, as transformers does for a sequence longer than the original context and
    llama.cpp for a context size past it; both with the attention factor sqrt(1 + ln 4 / ln 32)."""
    import json
    import math
    import shutil

    from fixtures import load_hf_model

    c = open_checkpoint(zoo.dir("phi3_longrope")).config
    s = c.rope_scaling
    assert (s["rope_type"], s["original_max_position_embeddings"], s["factor"]) == ("longrope", 32, 4.0)
    assert s["attention_factor"] == pytest.approx(math.sqrt(1 + math.log(4) / math.log(32)))
    wide = tmp_path / "wide"
    shutil.copytree(zoo.dir("phi3_longrope"), wide)
    cfg = json.loads((wide / "config.json").read_text())
    (wide / "config.json").write_text(json.dumps({**cfg, "max_position_embeddings": 64}))
    hf = load_hf_model(wide)
    long_ids, short_ids = prompt_ids(zoo.vocab_size, 40, seed=8), prompt_ids(zoo.vocab_size, 20, seed=9)
    assert max_rel_err(zoo.llm(wide, dtype="float32").logits(long_ids), hf_logits(hf, long_ids)) <= REL_TOL
    narrow = zoo.llm(wide, dtype="float32", max_context=32)
    assert max_rel_err(narrow.logits(short_ids), hf_logits(hf, short_ids)) <= REL_TOL
    # the window, not the prompt, decides: the wide window's short prompt rotates by the long factors
    assert max_rel_err(zoo.llm(wide, dtype="float32").logits(short_ids), hf_logits(hf, short_ids)) > 1e-3


def test_longrope_gguf_reads_its_factor_tensors(zoo, tmp_path):
    """A LongRoPE phi3 GGUF (rope_factors_long / _short tensors, the original context and attention factor as keys)
    reads the config.json's LongRoPE and gives transformers' logits."""
    hf = zoo.hf("phi3_longrope")
    path = write_phi3_gguf(hf, tmp_path / "lr.gguf")
    g, h = open_checkpoint(path).config, open_checkpoint(zoo.dir("phi3_longrope")).config
    for key in ("short_factor", "long_factor"):  # F32 in the file: the fp32 values the tables use either way
        assert torch.equal(torch.tensor(g.rope_scaling[key]).float(), torch.tensor(h.rope_scaling[key]).float())
    assert g.rope_scaling["attention_factor"] == pytest.approx(h.rope_scaling["attention_factor"], rel=1e-6)
    ids = prompt_ids(zoo.vocab_size, 20, seed=1)
    assert max_rel_err(zoo.llm(path, dtype="float32").logits(ids), hf_logits(hf, ids)) <= REL_TOL


PHI3_TEXTS = ["The quick brown fox", "  two leading spaces and  two  inside", "digits 2024 and 31337!",
              "a line\nand another\n\n", "<|user|>\nhello<|end|>\n<|assistant|>\n",
              "caf\u00e9 na\u00efve \u4f60\u597d \U0001f642", " a leading space"]


def test_gguf_tokenizer_encodes_as_sentencepiece(zoo, tmp_path):
    """A phi3 GGUF with its vocabulary written as llama.cpp's Phi3MiniModel converter writes it (a SentencePiece model
    with Llama's dummy prefix, the chat markers control tokens): tiered's tokenizer gives SentencePiece's own ids
    after <bos> and decodes them back; a prompt generates through it."""
    specials = ("<|user|>", "<|assistant|>", "<|end|>")
    spm = sentencepiece_model(tmp_path, "phi3", dummy_prefix=True, specials=specials)
    gguf_tokenizer_encodes_as_sentencepiece(zoo, "phi3", spm, write_phi3_gguf, tmp_path / "tok.gguf", PHI3_TEXTS,
                                            specials)


def test_streamed_text_survives_bytes_that_are_no_utf8(zoo, tmp_path):
    """Byte-fallback tokens that are no valid UTF-8 together (<0x9E> between ASCII bytes) make tokenizers'
    DecodeStream raise "Invalid prefix encountered" (tokenizers 0.23, a Phi-3-style vocabulary): the sequence's text
    goes on by the window rule (engine/detokenize.append_token_text), each token's text appended once, no error.""" 
    import copy

    from tokenizers.decoders import DecodeStream

    from tiered import SamplingParams
    from tiered.engine.detokenize import append_token_text
    from tiered.engine.sequence import Sequence

    specials = ("<|user|>", "<|assistant|>", "<|end|>")
    model = copy.deepcopy(zoo.hf("phi3"))
    torch.manual_seed(0)
    model.resize_token_embeddings(400, mean_resizing=False)
    path = write_phi3_gguf(model, tmp_path / "tok.gguf",
                           sentencepiece=sentencepiece_model(tmp_path, "phi3", dummy_prefix=True, specials=specials))
    tok = zoo.llm(path).tokenizer
    ids = [tok.convert_tokens_to_ids(t) for t in ("<0x4B>", "<0x9E>", "<0x32>", "M", "<0x25>", "n", "<0x41>")]
    stream = DecodeStream(skip_special_tokens=True)
    with pytest.raises(Exception, match="Invalid prefix"):
        for i in ids:
            stream.step(tok._tokenizer, i)
    seq = Sequence(index=0, prompt="", prompt_ids=[2], params=SamplingParams(), max_tokens=16, slot=-1,
                   generator=None)
    for i in ids:
        seq.output_ids.append(i)
        append_token_text(tok, seq)
    # the stream had emitted "K" (valid alone) before the byte that broke it; the rest once, as the whole decodes it
    assert seq.decode_stream is None and seq.text.replace("\ufffd", "") == "K" + tok.decode(ids).replace("\ufffd", "")
