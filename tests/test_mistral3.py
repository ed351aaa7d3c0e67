"""Mistral Small 3.1 / 3.2 and Magistral (transformers' Mistral3ForConditionalGeneration) run as their language model.

A tiny Mistral3ForConditionalGeneration (a Mistral text model beside a Pixtral vision tower and the projector) is
written by transformers itself; tiered reads its nested text_config and the language model's tensors
(model_config.MULTIMODAL_TEXT, checkpoint/hf_dir._language_model), leaves the vision tower's unread, and gives
transformers' text-only logits and greedy tokens.
"""

from __future__ import annotations

import pytest
import torch

from fixtures import TINY_DIMS, hf_greedy, max_rel_err, perturb_norm_or_bias, prompt_ids
from tiered import SamplingParams
from tiered.checkpoint import open_checkpoint


@pytest.fixture(scope="module")
def mistral3(zoo, tmp_path_factory):
    """(directory, transformers model) of a tiny Mistral3ForConditionalGeneration, fp32, seeded weights."""
    import transformers

    text = dict(TINY_DIMS, model_type="mistral", vocab_size=zoo.vocab_size, sliding_window=None, head_dim=16,
                bos_token_id=0, eos_token_id=1)
    vision = dict(model_type="pixtral", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=2, image_size=32, patch_size=8, head_dim=16)
    cfg = transformers.Mistral3Config(text_config=text, vision_config=vision, image_token_index=5, spatial_merge_size=2)
    torch.manual_seed(0)
    model = transformers.Mistral3ForConditionalGeneration(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            perturb_norm_or_bias(name, p)
    out = tmp_path_factory.mktemp("mistral3")
    model.save_pretrained(out)
    zoo.tokenizer.save_pretrained(out)
    return out, model


def test_mistral3_runs_its_language_model(zoo, mistral3):
    path, model = mistral3
    ckpt = open_checkpoint(path)
    assert ckpt.config.model_type == "mistral" and ckpt.config.hidden_size == TINY_DIMS["hidden_size"]
    assert not any("vision" in n or "projector" in n for n in ckpt.names())
    ids = prompt_ids(zoo.vocab_size, 16, seed=2)
    with torch.no_grad():
        ref = model(input_ids=torch.tensor([ids])).logits[0].float()
    llm = zoo.llm(path, dtype="float32")
    assert max_rel_err(llm.logits(ids), ref) <= 1e-4
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    assert llm.generate(ids, greedy)[0].token_ids == hf_greedy(model, ids, 12)
