"""The lossless oracle on tiny HF checkpoints: tiered == transformers, logits and greedy tokens.

DESIGN.md "Correctness oracle": max relative logit error <= 1e-4 in float32 and identical greedy
tokens, for every supported dense architecture, loaded from a real config.json + safetensors.
"""

from __future__ import annotations

import pytest
import torch

from fixtures import TINY_SPECS, hf_greedy, prompt_ids
from tiered import SamplingParams
from tiered.checkpoint import HFDirCheckpoint, open_checkpoint

ARCHS = list(TINY_SPECS)
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
REL_TOL = 1e-4


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got - ref).abs().max() / ref.abs().max())


@pytest.mark.parametrize("name", ARCHS)
def test_logits_match_transformers(zoo, name):
    ids = prompt_ids(zoo.vocab_size, 16)
    with torch.no_grad():
        ref = zoo.hf(name)(torch.tensor([ids])).logits[0].float()
    got = zoo.llm(zoo.dir(name)).logits(ids)
    assert got.dtype == torch.float32 and got.shape == ref.shape == (16, zoo.vocab_size)
    assert ref.abs().max() > 1.0, "random weights too small for a meaningful comparison"
    assert rel_err(got, ref) <= REL_TOL


@pytest.mark.parametrize("name", ARCHS)
def test_greedy_matches_transformers(zoo, name):
    ids = prompt_ids(zoo.vocab_size, 16, seed=1)
    ref = hf_greedy(zoo.hf(name), ids, 16)
    out = zoo.llm(zoo.dir(name)).generate(ids, GREEDY)
    assert len(out) == 1
    assert out[0].token_ids == ref
    assert out[0].finish_reason == "length"
    assert out[0].prompt_token_ids == ids
    assert out[0].stats.generated_tokens == 16 and out[0].stats.prompt_tokens == 16


@pytest.mark.parametrize("name", ["llama", "mistral", "qwen3"])
def test_batched_generation_equals_one_at_a_time(zoo, name):
    llm = zoo.llm(zoo.dir(name))
    prompts = [prompt_ids(zoo.vocab_size, n, seed=10 + n) for n in (3, 16, 7, 11)]
    batched = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    single = [llm.generate(p, GREEDY)[0].token_ids for p in prompts]
    assert batched == single
    # And each equals transformers, so batching did not merely repeat one mistake.
    assert batched[1] == hf_greedy(zoo.hf(name), prompts[1], 16)


def test_prefill_then_decode_logits_equal_full_scoring(zoo):
    """Decoding token by token through the KV cache gives the logits of one full forward."""
    from tiered.models.layers import KVCache

    llm = zoo.llm(zoo.dir("qwen2"))
    ids = prompt_ids(zoo.vocab_size, 12, seed=3)
    full = llm.logits(ids)
    cache = KVCache(llm.config, 1, len(ids), torch.float32)
    rows = []
    with torch.inference_mode():
        rows.append(llm.model(torch.tensor([ids[:4]]), torch.arange(4).unsqueeze(0), torch.tensor([0]), cache))
        for t in range(4, len(ids)):
            rows.append(llm.model(torch.tensor([[ids[t]]]), torch.tensor([[t]]), torch.tensor([0]), cache))
    stepped = torch.cat(rows).float()  # [T - 3, V]
    assert rel_err(stepped, full[3:]) <= REL_TOL


def test_sliding_window_is_exercised(zoo):
    """Sanity of the Mistral fixture: its window (8) changes the logits of a 16-token prompt."""
    from fixtures import load_hf_model

    ids = prompt_ids(zoo.vocab_size, 16)
    windowed = zoo.hf("mistral")
    full = load_hf_model(zoo.dir("mistral"))
    full.config.sliding_window = None
    with torch.no_grad():
        a = windowed(torch.tensor([ids])).logits[0]
        b = full(torch.tensor([ids])).logits[0]
    assert torch.allclose(a[:8], b[:8], atol=1e-5)
    assert (a[8:] - b[8:]).abs().max() > 1e-2
    assert zoo.llm(zoo.dir("mistral")).config.sliding_window == 8


def test_rope_scaling_is_exercised(zoo):
    """Sanity of the llama3 fixture: its scaled inverse frequencies differ from plain RoPE."""
    from dataclasses import replace

    from tiered.checkpoint.model_config import rope_inv_freq

    cfg = open_checkpoint(zoo.dir("llama3_rope")).config
    assert cfg.rope_scaling["rope_type"] == "llama3" and cfg.rope_theta == 500000.0
    assert not torch.allclose(rope_inv_freq(cfg), rope_inv_freq(replace(cfg, rope_scaling=None)))


@pytest.mark.parametrize("name,expect", [
    ("llama", dict(tie_word_embeddings=False, attention_bias=False, qk_norm=False, head_dim=16)),
    ("llama_tied", dict(tie_word_embeddings=True)),
    ("mistral", dict(sliding_window=8)),
    ("qwen2", dict(attention_bias=True, qk_norm=False, sliding_window=None)),
    ("qwen3", dict(qk_norm=True, attention_bias=False, head_dim=32)),
])
def test_model_config_from_config_json(zoo, name, expect):
    ckpt = open_checkpoint(zoo.dir(name))
    assert isinstance(ckpt, HFDirCheckpoint) and ckpt.format_name == "safetensors"
    cfg = ckpt.config
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads,
            cfg.intermediate_size, cfg.vocab_size) == (64, 2, 4, 2, 128, zoo.vocab_size)
    assert cfg.eos_token_ids == (1,) and cfg.bos_token_id == 0
    for k, v in expect.items():
        assert getattr(cfg, k) == v, k


def test_handles_are_lazy_and_match_safetensors(zoo):
    from safetensors.torch import load_file

    ckpt = open_checkpoint(zoo.dir("qwen2"))
    ref = load_file(str(zoo.dir("qwen2") / "model.safetensors"))
    assert sorted(ckpt.names()) == sorted(ref)
    assert ckpt.nbytes() == sum(t.numel() * t.element_size() for t in ref.values())
    h = ckpt.handle("model.layers.0.self_attn.q_proj.bias")
    assert h.shape == (64,) and h.format == "F32" and not h.is_quantized and h.numel == 64
    assert torch.equal(h.load(), ref["model.layers.0.self_attn.q_proj.bias"])
    assert h.load(torch.bfloat16).dtype == torch.bfloat16
    with pytest.raises(ValueError):
        h.blocks()
    # Tied checkpoints store no lm_head; the model still has one (the embedding).
    tied = zoo.llm(zoo.dir("llama_tied"))
    assert not open_checkpoint(zoo.dir("llama_tied")).has("lm_head.weight")
    assert tied.model.lm_head.weight is tied.model.model.embed_tokens.weight


def test_parameter_count(zoo):
    for name in ("llama", "llama_tied", "mistral"):
        n_hf = sum(p.numel() for p in zoo.hf(name).parameters() if p.ndim == 2)
        # ModelConfig.num_parameters counts weights and norms, not biases.
        n_norm = sum(p.numel() for n, p in zoo.hf(name).named_parameters() if "norm" in n)
        assert open_checkpoint(zoo.dir(name)).config.num_parameters() == n_hf + n_norm
