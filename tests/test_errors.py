"""Bad input raises the right tiered.errors class, with a message naming the problem and a hint."""

from __future__ import annotations

import json

import pytest

from fixtures import check, copy_dir, prompt_ids
from tiered import LLM, SamplingParams
from tiered.checkpoint import open_checkpoint
from tiered.errors import CheckpointError, ConfigError, ContextLengthError, UnsupportedModelError


# ------------------------------------------------------------------------------- checkpoints
def test_missing_path(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(CheckpointError) as e:
        open_checkpoint(missing)
    check(e, str(missing), "does not exist")
    with pytest.raises(CheckpointError):
        LLM(missing)


def test_directory_without_config_json(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(CheckpointError) as e:
        LLM(tmp_path)
    check(e, "config.json")


def test_invalid_config_json(zoo, tmp_path):
    d = copy_dir(zoo, "llama", tmp_path)
    (d / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError) as e:
        open_checkpoint(d)
    check(e, "config.json", "not valid JSON")


def test_directory_without_safetensors(zoo, tmp_path):
    d = copy_dir(zoo, "llama", tmp_path)
    (d / "model.safetensors").unlink()
    with pytest.raises(CheckpointError) as e:
        open_checkpoint(d)
    check(e, "safetensors")


@pytest.mark.parametrize("keep", [0.5, 0.999])
def test_truncated_safetensors(zoo, tmp_path, keep):
    d = copy_dir(zoo, "llama", tmp_path)
    f = d / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[:int(len(data) * keep)])
    with pytest.raises(CheckpointError) as e:
        LLM(d)
    check(e, "model.safetensors", "truncated")


@pytest.mark.parametrize("size", [0, 5, 100])
def test_safetensors_with_broken_header(zoo, tmp_path, size):
    d = copy_dir(zoo, "llama", tmp_path)
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[:size])
    with pytest.raises(CheckpointError) as e:
        open_checkpoint(d)
    check(e, "model.safetensors")


def test_sharded_checkpoint_with_missing_shard(zoo, tmp_path):
    d = copy_dir(zoo, "llama", tmp_path)
    names = open_checkpoint(d).names()
    index = {"metadata": {}, "weight_map": {n: "model.safetensors" for n in names}}
    index["weight_map"][names[0]] = "model-00002-of-00002.safetensors"
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError) as e:
        open_checkpoint(d)
    check(e, "model-00002-of-00002.safetensors", "missing")


def test_missing_tensor(zoo, tmp_path):
    from safetensors.torch import load_file, save_file

    d = copy_dir(zoo, "llama", tmp_path)
    tensors = load_file(str(d / "model.safetensors"))
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError) as e:
        LLM(d)
    check(e, "model.layers.1.mlp.down_proj.weight")


def test_tensor_shape_disagrees_with_config(zoo, tmp_path):
    d = copy_dir(zoo, "llama", tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["intermediate_size"] = 256
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError) as e:
        LLM(d)
    check(e, "shape")


@pytest.mark.parametrize("archs,named", [(["GPT2LMHeadModel"], "GPT2LMHeadModel"), (None, "gpt2")])
def test_unsupported_architecture(tmp_path, archs, named):
    from transformers import GPT2Config

    cfg = GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=256).to_dict()
    if archs:
        cfg["architectures"] = archs
    assert cfg["model_type"] == "gpt2"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError) as e:
        LLM(tmp_path)
    check(e, "unsupported architecture", named)


@pytest.mark.parametrize("rope_type, error, words", [
    ("longrope", UnsupportedModelError, ("longrope",)),
    # YaRN (DeepSeek's, Qwen2.5's long context) needs the context it was trained at
    ("yarn", CheckpointError, ("original_max_position_embeddings", "missing"))])
def test_unsupported_or_incomplete_rope_scaling(zoo, tmp_path, rope_type, error, words):
    d = copy_dir(zoo, "llama", tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": rope_type, "factor": 4.0, "rope_theta": 10000.0}
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(error) as e:
        open_checkpoint(d)
    check(e, *words)


def test_mlp_bias_is_refused(zoo, tmp_path):
    """HF Llama's mlp_bias adds gate/up/down biases tiered's MLP lacks: refuse, never ignore them."""
    d = copy_dir(zoo, "llama", tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["mlp_bias"] = True
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError) as e:
        LLM(d)
    check(e, "mlp_bias")


def test_mixed_sliding_and_full_layers_are_refused(zoo, tmp_path):
    """A Qwen2 whose later layers slide (max_window_layers=1 of 2): refuse, never window them all."""
    d = copy_dir(zoo, "qwen2", tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(use_sliding_window=True, sliding_window=8, layer_types=["full_attention", "sliding_attention"])
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError) as e:
        LLM(d)
    check(e, "sliding")


@pytest.mark.parametrize("keep", [0.5, 0.99])
def test_truncated_gguf(zoo, tmp_path, keep):
    src = zoo.gguf("llama", "F32")
    f = tmp_path / "truncated.gguf"
    data = src.read_bytes()
    f.write_bytes(data[:int(len(data) * keep)])
    with pytest.raises(CheckpointError) as e:
        LLM(f)
    check(e, "truncated.gguf", "truncated")


@pytest.mark.parametrize("size", [4, 8, 64, 300, 2000])
def test_gguf_with_broken_header(zoo, tmp_path, size):
    f = tmp_path / "broken.gguf"
    f.write_bytes(zoo.gguf("llama", "F32").read_bytes()[:size])
    with pytest.raises(CheckpointError) as e:
        open_checkpoint(f)
    check(e, "broken.gguf", *(("truncated or corrupt",) if size >= 8 else ()))  # past the magic: named as such


def test_file_that_is_not_a_checkpoint(tmp_path):
    for name in ("model.gguf", "model.bin"):
        f = tmp_path / name
        f.write_bytes(b"\x00" * 64)
        with pytest.raises(CheckpointError) as e:
            open_checkpoint(f)
        check(e, name)


def test_unsupported_gguf_architecture(tmp_path):
    import numpy as np
    from gguf import GGUFWriter

    f = tmp_path / "gpt2.gguf"
    w = GGUFWriter(str(f), "gpt2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((16, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UnsupportedModelError) as e:
        open_checkpoint(f)
    check(e, "gpt2")


# ---------------------------------------------------------------------------------- prompts
def test_prompt_longer_than_context(zoo):
    llm = zoo.llm(zoo.dir("llama"), max_context=16)
    assert llm.max_context == 16
    with pytest.raises(ContextLengthError) as e:
        llm.generate(prompt_ids(zoo.vocab_size, 20), SamplingParams(max_tokens=4))
    check(e, "20 tokens", "16")
    assert "max_context" in e.value.hint
    # A prompt that fills the window leaves no room for a token either.
    with pytest.raises(ContextLengthError):
        llm.generate(prompt_ids(zoo.vocab_size, 16), SamplingParams(max_tokens=1))
    # One token short of the window: generation stops at the window ("length").
    out = llm.generate(prompt_ids(zoo.vocab_size, 15), SamplingParams(temperature=0, max_tokens=50,
                                                                     ignore_eos=True))[0]
    assert len(out.token_ids) == 1 and out.finish_reason == "length"
    with pytest.raises(ContextLengthError):
        llm.logits(prompt_ids(zoo.vocab_size, 17))
    assert llm.logits(prompt_ids(zoo.vocab_size, 16)).shape == (16, zoo.vocab_size)


def test_one_bad_prompt_in_a_batch_fails_the_call(zoo):
    llm = zoo.llm(zoo.dir("llama"), max_context=16)
    with pytest.raises(ContextLengthError) as e:
        llm.generate([prompt_ids(zoo.vocab_size, 4), prompt_ids(zoo.vocab_size, 30)])
    check(e, "prompt 1")


def test_max_context_above_the_model_is_capped(zoo):
    llm = zoo.llm(zoo.dir("llama"), max_context=100_000)
    assert llm.max_context == 256  # max_position_embeddings of the tiny models


def test_empty_prompt(zoo):
    llm = zoo.llm(zoo.dir("llama"))
    with pytest.raises(ConfigError) as e:
        llm.generate([[]])
    check(e, "empty")
    with pytest.raises(ContextLengthError):
        llm.logits([])


def test_no_prompts_no_outputs(zoo):
    assert zoo.llm(zoo.dir("llama")).generate([]) == []


def test_text_prompt_without_tokenizer(zoo):
    llm = zoo.llm(zoo.gguf("llama", "F32"))
    assert llm.tokenizer is None
    with pytest.raises(ConfigError) as e:
        llm.generate("hello")
    check(e, "tokenizer")
    out = llm.generate(prompt_ids(zoo.vocab_size, 4), SamplingParams(max_tokens=3, ignore_eos=True, seed=0))[0]
    assert len(out.token_ids) == 3 and out.text == ""


def test_token_ids_outside_the_vocabulary(zoo):
    llm = zoo.llm(zoo.dir("llama"))
    for bad in (zoo.vocab_size, -1):
        with pytest.raises(ConfigError) as e:
            llm.generate([[5, 6], [7, bad]])
        check(e, "outside the vocabulary")


def test_chat_prompt_without_chat_template(zoo):
    llm = zoo.llm(zoo.dir("llama"))
    assert not getattr(llm.tokenizer, "chat_template", None)
    with pytest.raises(ConfigError) as e:
        llm.generate([{"role": "user", "content": "hi"}])
    check(e, "chat template")
    with pytest.raises(ConfigError):
        llm.generate("hi", chat=True)
    # Text without a template is encoded as plain text.
    assert llm.encode("hi") == zoo.tokenizer("hi")["input_ids"]

