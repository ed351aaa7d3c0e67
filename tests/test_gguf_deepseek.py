"""llama.cpp's deepseek2 GGUF files (DeepSeek-V2/V3): tiered reads them as transformers' DeepSeek models.

The files come from tests/gguf_writer.write_deepseek_gguf, llama.cpp's converter restated (and
checked against llama.cpp's own loader), from the tiny transformers models of tests/moe_fixtures.py:
logits against transformers on the same weights, in both of llama.cpp's attention layouts (the
split attn_k_b / attn_v_b of current files, the one attn_kv_b of older ones), and routed experts kept
in the file's blocks.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

sys.path.insert(0, str(Path(__file__).parent))

from fixtures import hf_greedy  # noqa: E402
from gguf_writer import roundtrip, write_deepseek_gguf  # noqa: E402
from moe_fixtures import build_hf_moe_model  # noqa: E402

from tiered import LLM, EngineConfig, SamplingParams  # noqa: E402
from tiered.checkpoint import open_checkpoint  # noqa: E402
from tiered.checkpoint.model_config import ModelConfig  # noqa: E402
from tiered.errors import UnsupportedModelError  # noqa: E402

PROMPT = torch.randint(2, 256, (16,), generator=torch.Generator().manual_seed(0)).tolist()
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
LOSSLESS = dict(max_context=64, decode_weights="fp32", accelerator="none")

# what a deepseek2 file can say: V2 with plain top-k (llama.cpp scores expert groups by their two best
# experts, which no transformers V2 router does), V3 with YaRN's mscale equal to mscale_all_dim
VARIANTS = {
    "deepseek_v2": dict(topk_method="greedy", n_group=None, topk_group=None),
    "deepseek_v3": dict(rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                         "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1,
                                         "mscale": 0.8, "mscale_all_dim": 0.8}),
}


def _model(kind: str):
    return build_hf_moe_model(kind, **VARIANTS[kind])


def _hf_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


@pytest.mark.parametrize("kind", list(VARIANTS))
@pytest.mark.parametrize("legacy", [False, True], ids=["split_kv_b", "legacy_kv_b"])
def test_deepseek2_gguf_logits_and_greedy_equal_transformers(kind, legacy, tmp_path):
    model = _model(kind)
    path = write_deepseek_gguf(model, tmp_path / f"{kind}.gguf", legacy=legacy)
    llm = LLM(path, EngineConfig(**LOSSLESS))
    ours, ref = llm.logits(PROMPT), _hf_logits(model, PROMPT)
    assert float((ours - ref).abs().max() / ref.abs().max()) < 2e-5
    assert llm.generate(PROMPT, GREEDY)[0].token_ids == hf_greedy(model, PROMPT, 12)
    llm.close()


@pytest.mark.parametrize("kind", list(VARIANTS))
def test_deepseek2_gguf_config_equals_the_hf_directorys(kind, tmp_path):
    model = _model(kind)
    model.save_pretrained(tmp_path / "hf")
    gguf_cfg = open_checkpoint(write_deepseek_gguf(model, tmp_path / "m.gguf")).config
    hf_cfg = open_checkpoint(tmp_path / "hf").config
    differ = {f for f in ModelConfig.__dataclass_fields__ if getattr(gguf_cfg, f) != getattr(hf_cfg, f)}
    # the fixtures' files carry no tokenizer (so no special tokens); floats are f32 in GGUF
    assert differ <= {"bos_token_id", "eos_token_ids", "rope_scaling", "rms_norm_eps"}, differ
    assert gguf_cfg.rms_norm_eps == pytest.approx(hf_cfg.rms_norm_eps)
    if hf_cfg.rope_scaling:
        assert {k: gguf_cfg.rope_scaling[k] for k in hf_cfg.rope_scaling} == pytest.approx(hf_cfg.rope_scaling)
    assert gguf_cfg.kv_elements_per_token() == 32 + 8  # the latent and the RoPE key


@pytest.mark.parametrize("qtype, kept", [(Q.Q8_0, "int8-g32"), (Q.Q4_0, "int4")])
def test_deepseek2_gguf_experts_stay_in_their_blocks(qtype, kept, tmp_path):
    """Q8_0 / Q4_0 routed experts are kept as the file's blocks (int8-g32 / int4 expert formats) and
    decode like transformers on the weights the blocks hold."""
    model = _model("deepseek_v3")
    path = write_deepseek_gguf(model, tmp_path / "q.gguf", experts_qtype=qtype)
    ref = copy.deepcopy(model)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                a = p.detach().numpy()
                if name.endswith("gate_up_proj"):  # written as two tensors, gate then up
                    f = a.shape[1] // 2
                    a = np.concatenate([roundtrip(a[:, :f], qtype), roundtrip(a[:, f:], qtype)], axis=1)
                else:
                    a = roundtrip(a, qtype)
                p.copy_(torch.from_numpy(a))
    llm = LLM(path, EngineConfig(**LOSSLESS, expert_activations="bf16"))
    assert llm.plan.dtypes["experts"].split(",")[0] == kept
    ours, want = llm.logits(PROMPT), _hf_logits(ref, PROMPT)
    assert float((ours - want).abs().max() / want.abs().max()) < 2e-2  # bf16 activations into the experts
    llm.close()


def test_deepseek2_gguf_softmax_within_groups_is_refused(tmp_path):
    """A softmax router with expert groups: llama.cpp ranks groups by their two best experts, where
    transformers' DeepSeek-V2 takes the best one; such a file is refused, never run another way."""
    import gguf

    model = _model("deepseek_v2")
    path = write_deepseek_gguf(model, tmp_path / "g.gguf")
    reader = gguf.GGUFReader(path)
    w = gguf.GGUFWriter(str(tmp_path / "grouped.gguf"), "deepseek2")
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        w.add_key_value(field.name, field.contents(), field.types[0], field.types[-1] if len(field.types) > 1 else None)
    w.add_expert_group_count(2)
    w.add_expert_group_used_count(1)
    for t in reader.tensors:
        w.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UnsupportedModelError, match="groups"):
        open_checkpoint(tmp_path / "grouped.gguf")


def test_deepseek2_gguf_tokenizer_loads(smollm2_path, tmp_path):
    """transformers refuses a deepseek2 GGUF's tokenizer (it does not load the architecture); tiered
    builds it with transformers' GGUF tokenizer converters: SmolLM2's gpt2-style tokenizer copied into
    a deepseek2 file encodes as SmolLM2's own."""
    path = write_deepseek_gguf(_model("deepseek_v2"), tmp_path / "tok.gguf", tokenizer_from=smollm2_path)
    text = "Memory is a hierarchy: café, 日本語, 😀."
    assert open_checkpoint(path).tokenizer().encode(text) == open_checkpoint(smollm2_path).tokenizer().encode(text)
