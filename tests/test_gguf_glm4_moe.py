"""llama.cpp's glm4moe GGUF files (GLM-4.5 / 4.5-Air / 4.6): tiered reads them as transformers' glm4_moe.

The files come from tests/gguf_writer.write_glm4_moe_gguf (llama.cpp's Glm4MoeModel converter
restated) from the tiny transformers models of tests/moe_fixtures.py: "glm4_moe" (head_dim 32, 16
features rotated, q/k/v biases, q/k norms, the best 1 of 2 expert groups, 2 shared experts, scaling
2.5) and "glm4_moe_air" (head_dim 16 without key_length in the file, 8 rotated, no biases or norms,
2 of 4 groups), each with the multi-token-prediction layer GLM-4.5's files carry after its layers.
Checked: llama.cpp itself (llama-cpp-python, where installed) scores those files as transformers
does; the config equals the Hugging Face directory's; lossless fp32 prompt logits, greedy tokens and
every step of the CPU decode step (torch ops and native C++) within 1e-4 of transformers; F16, Q8_0
and Q4_0 files against transformers on the weights the file holds (a quantized file's native decode
steps against its torch-op steps: a near-tied expert choice may flip between a prompt's and a step's
bf16 expert activations); a file lacking a key llama.cpp requires, a softmax router or M-RoPE
sections refused with a clear error; the tokenizer.
"""

from __future__ import annotations

import sys
from pathlib import Path

import gguf
import pytest
import torch
from gguf import GGMLQuantizationType as Q

sys.path.insert(0, str(Path(__file__).parent))

from fixtures import hf_greedy  # noqa: E402
from runtime_fixtures import decode_logits, rel_err  # noqa: E402
from gguf_writer import dequantized_glm4_moe_model, write_glm4_moe_gguf  # noqa: E402
from moe_fixtures import build_hf_moe_model  # noqa: E402

from tiered import LLM, EngineConfig, SamplingParams, kernels  # noqa: E402
from tiered.checkpoint import open_checkpoint  # noqa: E402
from tiered.checkpoint.model_config import ModelConfig  # noqa: E402
from tiered.errors import CheckpointError, UnsupportedModelError  # noqa: E402
from tiered.runtime.cpu_decode import CPUDecodeStep  # noqa: E402

KINDS = ("glm4_moe", "glm4_moe_air")
PROMPT = torch.randint(2, 256, (16,), generator=torch.Generator().manual_seed(0)).tolist()
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
LOSSLESS = dict(max_context=32, decode_weights="fp32", accelerator="none")
REL_TOL = 1e-4
native_only = pytest.mark.skipif(not kernels.available(), reason="tiered/kernels is not built")
_models: dict = {}


def model(kind: str):
    """The tiny transformers model of `kind` (fp32, eval), built once."""
    if kind not in _models:
        _models[kind] = build_hf_moe_model(kind)
    return _models[kind]


def hf_logits(m, ids: list[int]) -> torch.Tensor:
    """transformers' fp32 logits [T, V] of one prompt."""
    with torch.no_grad():
        return m(torch.tensor([ids])).logits[0].float()


# ---------------------------------------------------------------------------------------- config
@pytest.mark.parametrize("kind", KINDS)
def test_config_equals_the_hf_directorys(kind, tmp_path):
    """Every ModelConfig field as read from config.json, the MTP layer not counted; the file holds no
    tensor of it under an HF name."""
    m = model(kind)
    m.save_pretrained(tmp_path / "hf")
    ckpt = open_checkpoint(write_glm4_moe_gguf(m, tmp_path / "m.gguf", mtp=True))
    hf = open_checkpoint(tmp_path / "hf")
    cfg = ckpt.config
    differ = {f for f in ModelConfig.__dataclass_fields__ if getattr(cfg, f) != getattr(hf.config, f)}
    # the files carry no tokenizer (so no special tokens); floats are f32 in GGUF
    assert differ <= {"bos_token_id", "eos_token_ids", "rms_norm_eps"}, differ
    assert cfg.rms_norm_eps == pytest.approx(hf.config.rms_norm_eps)
    assert cfg.num_hidden_layers == 3 and cfg.rotary_dim == cfg.head_dim // 2
    assert set(ckpt.names()) == set(hf.names())


@pytest.mark.parametrize("kind", KINDS)
def test_llama_cpp_reads_the_files_as_transformers(kind, tmp_path):
    """The writer is llama.cpp's layout: llama.cpp itself (llama-cpp-python, fp32 KV cache) loads an
    F32 file with its MTP layer and scores the prompt as transformers does."""
    llama_cpp = pytest.importorskip("llama_cpp")
    m = model(kind)
    path = write_glm4_moe_gguf(m, tmp_path / "m.gguf", mtp=True)
    llm = llama_cpp.Llama(str(path), n_ctx=32, logits_all=True, verbose=False, type_k=0, type_v=0)
    llm.eval(PROMPT)
    got = torch.tensor(llm.scores[:len(PROMPT)])
    del llm
    assert rel_err(got, hf_logits(m, PROMPT)) < 1e-5


# ------------------------------------------------------------------------------- lossless parity
@pytest.mark.parametrize("kind", KINDS)
def test_f32_logits_and_greedy_equal_transformers(kind, tmp_path):
    m = model(kind)
    llm = LLM(write_glm4_moe_gguf(m, tmp_path / "m.gguf", mtp=True), EngineConfig(**LOSSLESS))
    try:
        assert rel_err(llm.logits(PROMPT), hf_logits(m, PROMPT)) <= REL_TOL
        out = llm.generate(PROMPT, GREEDY)[0].token_ids
        assert out == hf_greedy(m, PROMPT, 12) and len(set(out)) > 1
    finally:
        llm.close()


@pytest.mark.parametrize("native", [False, pytest.param(True, marks=native_only)], ids=["torch_ops", "native"])
@pytest.mark.parametrize("kind", KINDS)
def test_decode_steps_equal_transformers(kind, native, tmp_path):
    """A 6-token prompt, then 14 tokens fed one a step through the CPU decode step (its torch-op form
    or the native C++ step): each step's logits equal transformers' at that position."""
    m = model(kind)
    llm = LLM(write_glm4_moe_gguf(m, tmp_path / "m.gguf"), EngineConfig(**LOSSLESS))
    try:
        ids = torch.randint(2, 256, (20,), generator=torch.Generator().manual_seed(4)).tolist()
        got = decode_logits(llm, CPUDecodeStep(llm.model, native=native), ids, 6, torch.float32)
        assert rel_err(got, hf_logits(m, ids)[6:]) <= REL_TOL
    finally:
        llm.close()


def test_f16_file_in_fp32_equals_transformers_on_its_weights(tmp_path):
    """An F16 file (experts too) in the lossless mode: transformers' logits on the F16 weights."""
    m = model("glm4_moe")
    llm = LLM(write_glm4_moe_gguf(m, tmp_path / "f16.gguf", Q.F16), EngineConfig(**LOSSLESS, dtype="float32"))
    try:
        assert llm.plan.dtypes["experts"] == "fp32"
        ref = dequantized_glm4_moe_model(m, Q.F16)
        assert rel_err(llm.logits(PROMPT), hf_logits(ref, PROMPT)) <= REL_TOL
        assert llm.generate(PROMPT, GREEDY)[0].token_ids == hf_greedy(ref, PROMPT, 12)
    finally:
        llm.close()


# ---------------------------------------------------------------------------------- block types
@pytest.mark.parametrize("qtype, kept", [(Q.Q8_0, "int8-g32"), (Q.Q4_0, "int4")])
@pytest.mark.parametrize("kind", KINDS)
def test_quantized_file_equals_transformers_on_its_weights(kind, qtype, kept, tmp_path):
    """Q8_0 / Q4_0 files (every 2-D weight but the routers): the routed experts stay in the file's
    blocks (int8-g32 / int4 expert formats), the rest loads dequantized; logits near transformers'
    on the weights the blocks hold (bf16 activations into the experts), and each native decode step's
    near the torch-op step's."""
    m = model(kind)
    llm = LLM(write_glm4_moe_gguf(m, tmp_path / "q.gguf", qtype, mtp=True),
              EngineConfig(**LOSSLESS, expert_activations="bf16"))
    try:
        assert llm.plan.dtypes["experts"].split(",")[0] == kept
        ref = hf_logits(dequantized_glm4_moe_model(m, qtype), PROMPT)
        assert rel_err(llm.logits(PROMPT), ref) < 2e-2
        if kernels.available():
            ids = PROMPT[:10]
            torch_ops = decode_logits(llm, CPUDecodeStep(llm.model, native=False), ids, 4, torch.float32)
            assert rel_err(decode_logits(llm, CPUDecodeStep(llm.model, native=True), ids, 4, torch.float32), torch_ops) < 2e-2
    finally:
        llm.close()


# ------------------------------------------------------------------------------- refused files
@pytest.mark.parametrize("key", ["expert_shared_count", "expert_count", "expert_used_count",
                                 "expert_feed_forward_length", "attention.layer_norm_rms_epsilon",
                                 "block_count", "attention.head_count", "feed_forward_length"])
def test_missing_required_key_is_a_checkpoint_error(key, tmp_path):
    """A key llama.cpp's glm4moe loader requires (feed_forward_length: of the leading dense layer),
    left out: CheckpointError naming it."""
    path = write_glm4_moe_gguf(model("glm4_moe_air"), tmp_path / "m.gguf", drop=(f"glm4moe.{key}",))
    with pytest.raises(CheckpointError, match=f"lacks glm4moe.{key}") as e:
        open_checkpoint(path)
    assert "re-convert" in str(e.value)


def test_expert_groups_without_their_used_count_are_a_checkpoint_error(tmp_path):
    path = write_glm4_moe_gguf(model("glm4_moe_air"), tmp_path / "m.gguf", drop=("glm4moe.expert_group_used_count",))
    with pytest.raises(CheckpointError, match="4 expert groups but lacks glm4moe.expert_group_used_count"):
        open_checkpoint(path)


def test_nextn_tensors_in_a_main_layer_are_a_checkpoint_error(tmp_path):
    """The MTP layer's tensors with no nextn_predict_layers (so counted as a main layer): refused,
    never run as a fourth decoder layer."""
    path = write_glm4_moe_gguf(model("glm4_moe_air"), tmp_path / "m.gguf", mtp=True,
                               drop=("glm4moe.nextn_predict_layers",))
    with pytest.raises(CheckpointError, match="nextn"):
        open_checkpoint(path)


@pytest.mark.parametrize("extra, match", [
    (lambda w: w.add_expert_gating_func(gguf.ExpertGatingFuncType.SOFTMAX), "expert_gating_func 1"),
    (lambda w: w.add_rope_dimension_sections([4, 2, 2, 0]), "M-RoPE"),
], ids=["softmax_router", "mrope"])
def test_other_routers_and_mrope_are_refused(extra, match, tmp_path):
    path = write_glm4_moe_gguf(model("glm4_moe_air"), tmp_path / "m.gguf", drop=("glm4moe.expert_gating_func",),
                               extra=extra)
    with pytest.raises(UnsupportedModelError, match=match):
        open_checkpoint(path)


def test_gating_func_absent_is_sigmoid(tmp_path):
    """llama.cpp's glm4moe loader takes a missing expert_gating_func as sigmoid; so does tiered."""
    path = write_glm4_moe_gguf(model("glm4_moe_air"), tmp_path / "m.gguf", drop=("glm4moe.expert_gating_func",))
    assert open_checkpoint(path).config.topk_method == "noaux_tc"


# ------------------------------------------------------------------------------------- tokenizer
def test_tokenizer_loads(smollm2_path, tmp_path):
    """transformers does not load a glm4moe GGUF's tokenizer itself; tiered builds it with
    transformers' GGUF tokenizer converters: SmolLM2's gpt2-style tokenizer copied into a glm4moe
    file encodes as SmolLM2's own."""
    path = write_glm4_moe_gguf(model("glm4_moe_air"), tmp_path / "tok.gguf", tokenizer_from=smollm2_path)
    text = "Memory is a hierarchy: café, 日本語, 😀."
    assert open_checkpoint(path).tokenizer().encode(text) == open_checkpoint(smollm2_path).tokenizer().encode(text)
