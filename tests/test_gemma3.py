"""Gemma 3 (transformers' gemma3_text; models/gemma.py) against transformers.

Gemma 3's layers differ from Llama's in six ways the tiny checkpoints exercise (tests/fixtures.py "gemma3"):
sandwich norms, Gemma's RMSNorm by (1 + weight) (stored as 1 + weight by the readers), a GeGLU MLP, an
embedding scaled by sqrt(hidden), per-head q/k norms with logits scaled by query_pre_attn_scalar ** -0.5, and
two kinds of layer: sliding (a window of 8 here, RoPE base 10000) and global (linear RoPE scaling, base 1e6).
Checked: the parity tests in test_hf_parity.py cover both tiny variants (logits and greedy tokens); here the
decode past the window, each feature changing the logits (so the parity covers it), the multimodal checkpoint
layout (Gemma3ForConditionalGeneration's config.json and tensor names), the Hub's sparse configs,
llama.cpp's gemma3 GGUF files (F32 equal to transformers, Q4_0 equal to the dequantized model) and the
refusals. The sliced GeGLU MLPs on the stand-in accelerator are test_planned_run.py's.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace

import pytest
import torch
from gguf import GGMLQuantizationType as Q
from safetensors.torch import load_file, save_file

from fixtures import (check, decode_matches_transformers, gguf_matches_transformers, gguf_tokenizer_encodes_as_sentencepiece,
                      hf_logits, local_model, max_rel_err, prompt_ids, sentencepiece_model)
from gguf_writer import dequantized_model, write_gemma3_gguf
from tiered import SamplingParams, kernels
from tiered.checkpoint import open_checkpoint
from tiered.checkpoint.model_config import ModelConfig
from tiered.errors import UnsupportedModelError
from tiered.models.layers import KVCache, build_attention_metadata
from tiered.runtime.cpu_decode import CPUDecodeStep

native_only = pytest.mark.skipif(not kernels.available(), reason="tiered/kernels is not built")
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
REL_TOL = 1e-4

# google/gemma-3-4b-it's config.json (Gemma3ForConditionalGeneration), the text part as the Hub has it
HUB_4B = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "eos_token_id": [1, 106],
          "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                          "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                          "sliding_window": 1024},
          "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 1152}}


def test_hub_config_takes_transformers_defaults():
    """The Hub's sparse text_config reads as Gemma3TextConfig fills it in: 5 of every 6 layers sliding (1024
    positions, RoPE base 10000 unscaled), the global ones at 1e6 with linear scaling 8, logits by 256 ** -0.5,
    the embedding by sqrt(2560), the top-level eos ids."""
    c = ModelConfig.from_hf(HUB_4B)
    assert (c.model_type, c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.vocab_size) == \
        ("gemma3_text", 8, 4, 256, 262_208)
    assert c.local_layers == tuple(i for i in range(34) if (i + 1) % 6) and c.local_window == 1024
    assert (c.rope_theta, c.rope_scaling, c.local_rope_theta) == (1e6, {"factor": 8.0, "rope_type": "linear"}, 1e4)
    assert c.attn_scale == 256 ** -0.5 and c.embed_scale == 2560 ** 0.5 and c.eos_token_ids == (1, 106)
    assert c.hidden_act == "gelu_tanh" and c.sandwich_norms and c.tie_word_embeddings
    local = c.local_rope()
    assert (local.rope_theta, local.rope_scaling) == (1e4, None)
    # transformers 5 writes the two RoPEs per layer type: the same model
    v5 = dict(HUB_4B["text_config"], rope_parameters={
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
    del v5["rope_scaling"]
    assert replace(ModelConfig.from_hf(v5), eos_token_ids=(1, 106)) == c


@pytest.mark.parametrize("field, value, words", [
    ("use_bidirectional_attention", True, ("bidirectional",)),
    ("hidden_activation", "relu", ("activation", "relu")),
])
def test_what_gemma3_does_not_compute_is_refused(field, value, words):
    cfg = dict(HUB_4B["text_config"], **{field: value})
    with pytest.raises(UnsupportedModelError) as e:
        ModelConfig.from_hf(cfg)
    check(e, *words)


@native_only
def test_native_step_decodes_past_the_window_as_transformers(zoo):
    """The native C++ decode step runs every Gemma layer itself (sandwich norms, GeGLU, the sliding layer's own
    RoPE tables and window, the query_pre_attn_scalar scale: DecodeStep.set_sandwich / set_local_rope /
    set_activation) and decodes past the window (8) with transformers' logits, as do its prompt rows, the modules
    and the torch-op step (which runs the layers as their modules) (fixtures.decode_matches_transformers)."""
    decode_matches_transformers(zoo, "gemma3")
    llm = zoo.llm(zoo.dir("gemma3"))
    assert all(L.module_attn for L, _ in CPUDecodeStep(llm.model, native=False).layers)


@pytest.mark.parametrize("change", [
    dict(embed_scale=1.0), dict(query_pre_attn_scalar=None), dict(hidden_act="silu"),
    dict(local_rope_theta=1e6, rope_scaling=None), dict(local_layers=(), local_window=None, local_rope_theta=None),
])
def test_each_gemma_feature_changes_the_logits(zoo, change):
    """The model code without one of Gemma's features gives other logits than with it: the parity with
    transformers covers each. (Sandwich norms: a model without them has no weights for two norms.)"""
    path = zoo.dir("gemma3")
    ids = torch.tensor([prompt_ids(zoo.vocab_size, 20, seed=2)])
    model = local_model(path)
    cfg = model.config

    def logits(m) -> torch.Tensor:
        cache = KVCache(m.config, 1, 64, torch.float32)
        pos = torch.arange(ids.shape[1])[None]
        meta = build_attention_metadata(m.rotary, pos, torch.tensor([0]), None)
        with torch.no_grad():
            return m(ids, pos, torch.tensor([0]), cache, last_only=False, meta=meta)[0]

    ref = logits(model)
    assert max_rel_err(ref, hf_logits(zoo.hf("gemma3"), ids[0].tolist())) <= REL_TOL
    ckpt = open_checkpoint(path)
    ckpt.config = replace(cfg, **change)
    assert max_rel_err(logits(_local_model_of(ckpt)), ref) > 1e-3


def _local_model_of(ckpt, max_positions: int = 64):
    """fixtures.local_model over an opened checkpoint (whose config a test replaced)."""
    from tiered.memory.materialize import materialize
    from tiered.models import build_model
    from tiered.models.layers import Rotary

    with torch.device("meta"):
        model = build_model(ckpt.config, max_positions)
    model.rotary = Rotary(ckpt.config, max_positions)
    materialize(model, ckpt, torch.float32)
    return model.eval()


def _multimodal_dir(zoo, tmp_path, prefix: str):
    """The tiny gemma3 checkpoint laid out as a Gemma3ForConditionalGeneration file: config.json with the text
    config nested, the language model's tensors under `prefix`, a vision tower's and a projector's tensors
    beside them."""
    src = zoo.dir("gemma3")
    dst = tmp_path / f"mm-{prefix.strip('.')}"
    shutil.copytree(src, dst)
    text = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({
        "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "text_config": text,
        "vision_config": {"model_type": "siglip_vision_model"}, "eos_token_id": [1]}))
    tensors = load_file(str(src / "model.safetensors"))
    out = {prefix + k[len("model."):] if k.startswith("model.") else k: v for k, v in tensors.items()}
    out["vision_tower.vision_model.embeddings.patch_embedding.weight"] = torch.zeros(4, 3, 2, 2)
    out["multi_modal_projector.mm_input_projection_weight"] = torch.zeros(4, 64)
    (dst / "model.safetensors").unlink()
    save_file(out, str(dst / "model.safetensors"))
    return dst


@pytest.mark.parametrize("prefix", ["language_model.model.", "model.language_model."])
def test_multimodal_checkpoint_runs_its_language_model(zoo, tmp_path, prefix):
    """A Gemma3ForConditionalGeneration directory (transformers 4.x's tensor names, then 5.x's) runs as its text
    model: the same config and logits, the vision tensors not read."""
    path = _multimodal_dir(zoo, tmp_path, prefix)
    ckpt = open_checkpoint(path)
    assert ckpt.config == open_checkpoint(zoo.dir("gemma3")).config
    assert not any("vision" in n or "projector" in n for n in ckpt.names())
    ids = prompt_ids(zoo.vocab_size, 16, seed=3)
    llm = zoo.llm(path, dtype="float32")
    assert max_rel_err(llm.logits(ids), hf_logits(zoo.hf("gemma3"), ids)) <= REL_TOL


def test_f32_gguf_matches_transformers(zoo, tmp_path):
    """A gemma3 GGUF file as llama.cpp's converter writes it (norms as 1 + weight) gives transformers' logits and
    greedy tokens, and the config.json's config (llama.cpp reads query_pre_attn_scalar as head_dim here)."""
    gguf_matches_transformers(zoo, "gemma3_gguf", write_gemma3_gguf(zoo.hf("gemma3_gguf"), tmp_path / "g.gguf"))


def test_gguf_without_a_pattern_slides_five_layers_of_six(zoo, tmp_path):
    """Without attention.sliding_window_pattern, layers slide as llama.cpp's gemma3 loader has them: all but
    every 6th."""
    path = write_gemma3_gguf(zoo.hf("gemma3_gguf"), tmp_path / "p.gguf", pattern=False)
    assert open_checkpoint(path).config.local_layers == (0, 1)


def test_q4_0_gguf_equals_the_dequantized_model(zoo, tmp_path):
    """A Q4_0 gemma3 file (Google's QAT files are Q4_0) gives the logits of transformers' model with its 2-D
    weights dequantized, in the lossless mode."""
    path = write_gemma3_gguf(zoo.hf("gemma3_gguf"), tmp_path / "q.gguf", Q.Q4_0)
    llm = zoo.llm(path, dtype="float32")
    ids = prompt_ids(zoo.vocab_size, 20, seed=5)
    ref = hf_logits(dequantized_model(zoo.hf("gemma3_gguf"), Q.Q4_0), ids)
    assert max_rel_err(llm.logits(ids), ref) <= REL_TOL


GEMMA_TEXTS = ["The quick brown fox", "  two leading spaces and  two  inside", "digits 2024 and 31337!",
               "a line\nand another\n\n", "<start_of_turn>user\nhello<end_of_turn>\n<start_of_turn>model\n",
               "caf\u00e9 na\u00efve \u4f60\u597d \U0001f642", " a leading space", ""]


def test_gguf_tokenizer_encodes_as_sentencepiece(zoo, tmp_path):
    """A gemma3 GGUF with its vocabulary written as llama.cpp's converter writes Gemma's (a SentencePiece model built
    as Gemma's: no dummy prefix): tiered's tokenizer for it (transformers' GGUF conversion, cached) gives
    SentencePiece's own ids after <bos> (spaces, digits, newlines, the turn markers, byte fallback) and decodes them
    back to the text; a prompt generates through it."""
    specials = ("<start_of_turn>", "<end_of_turn>")
    spm = sentencepiece_model(tmp_path, "gemma", dummy_prefix=False, specials=specials)
    gguf_tokenizer_encodes_as_sentencepiece(zoo, "gemma3_gguf", spm, write_gemma3_gguf, tmp_path / "tok.gguf",
                                            GEMMA_TEXTS, specials)
