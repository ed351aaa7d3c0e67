"""Gemma 2 (transformers' gemma2; models/gemma.py) against transformers.

Gemma 2's block is Gemma 3's (sandwich norms, GeGLU, the scaled embedding, query_pre_attn_scalar) without q/k norms,
with one RoPE for every layer, every other layer sliding, and tanh soft caps on the attention logits (before the
mask) and on the output logits. The tiny checkpoint (tests/fixtures.py "gemma2") caps at 2 and 3 so that the caps
bend its logits; test_hf_parity.py covers logits and greedy tokens. Here: the Hub's config defaults, each cap
changing the logits, decode past the window through the native step (which caps too), the torch-op step and the
modules, llama.cpp's gemma2 GGUF files.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from fixtures import decode_matches_transformers, gguf_matches_transformers, hf_logits, local_model, max_rel_err, prompt_ids
from gguf_writer import write_gemma_gguf
from test_gemma3 import _local_model_of
from tiered import kernels
from tiered.checkpoint import open_checkpoint
from tiered.checkpoint.model_config import ModelConfig
from tiered.models.layers import KVCache, build_attention_metadata

REL_TOL = 1e-4
# google/gemma-2-9b-it's config.json (the fields it gives)
HUB_9B = {"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "attn_logit_softcapping": 50.0,
          "final_logit_softcapping": 30.0, "head_dim": 256, "hidden_size": 3584, "intermediate_size": 14336,
          "max_position_embeddings": 8192, "num_attention_heads": 16, "num_hidden_layers": 42,
          "num_key_value_heads": 8, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_theta": 10000.0,
          "sliding_window": 4096, "vocab_size": 256000, "hidden_activation": "gelu_pytorch_tanh",
          "eos_token_id": [1, 107], "bos_token_id": 2}


def test_hub_config():
    c = ModelConfig.from_hf(HUB_9B)
    assert (c.model_type, c.attn_softcap, c.final_softcap, c.qk_norm, c.local_rope_theta) == \
        ("gemma2", 50.0, 30.0, False, None)
    assert c.local_layers == tuple(range(0, 42, 2)) and c.local_window == 4096 and c.rope_theta == 10000.0
    assert c.sandwich_norms and c.hidden_act == "gelu_tanh" and c.embed_scale == 3584 ** 0.5
    assert c.eos_token_ids == (1, 107)


@pytest.mark.parametrize("change", [dict(attn_softcap=None), dict(final_softcap=None)])
def test_each_cap_changes_the_logits(zoo, change):
    path = zoo.dir("gemma2")
    ids = torch.tensor([prompt_ids(zoo.vocab_size, 20, seed=2)])

    def logits(m) -> torch.Tensor:
        pos = torch.arange(ids.shape[1])[None]
        meta = build_attention_metadata(m.rotary, pos, torch.tensor([0]), None)
        with torch.no_grad():
            return m(ids, pos, torch.tensor([0]), KVCache(m.config, 1, 64, torch.float32), last_only=False, meta=meta)[0]

    ref = logits(local_model(path))
    assert max_rel_err(ref, hf_logits(zoo.hf("gemma2"), ids[0].tolist())) <= REL_TOL
    ckpt = open_checkpoint(path)
    ckpt.config = replace(ckpt.config, **change)
    assert max_rel_err(logits(_local_model_of(ckpt)), ref) > 1e-3


@pytest.mark.skipif(not kernels.available(), reason="tiered/kernels is not built")
def test_decode_past_the_window_matches_transformers(zoo):
    """The native decode step runs Gemma 2's layers itself (DecodeStep.set_softcap: the capped attention logits; the
    capped head in CausalLM.softcap) and decodes past the window (8) with transformers' logits, as do its prompt
    rows, the torch-op step and the modules (attend_softcapped) (fixtures.decode_matches_transformers)."""
    decode_matches_transformers(zoo, "gemma2")


def test_gguf_matches_transformers(zoo, tmp_path):
    """A gemma2 GGUF as llama.cpp's converter writes it (the caps as keys, norms as 1 + weight) reads as config.json
    does and gives transformers' logits and greedy tokens; without the pattern key every other layer slides."""
    gguf_matches_transformers(zoo, "gemma2", write_gemma_gguf(zoo.hf("gemma2"), tmp_path / "g2.gguf", pattern=False))
