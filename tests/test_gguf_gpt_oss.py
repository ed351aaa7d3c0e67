"""llama.cpp's gpt-oss GGUF files (OpenAI's gpt-oss-20b / -120b as llama.cpp converts them, e.g.
ggml-org/gpt-oss-20b-GGUF): tiered reads them as transformers' gpt_oss.

The files come from tests/gguf_writer.write_gpt_oss_gguf (llama.cpp's GptOssModel converter restated)
from test_gpt_oss's tiny GptOssForCausalLM (hidden 64, 4 heads of 16, 4 layers sliding (window 4) /
full alternating, 8 experts of F 32 top-4, YaRN with truncate false) at llama.cpp's fixed swiglu_limit
7.0, its gate/up weights scaled so that the clamps act and its expert biases bf16 values (as released;
llama.cpp's converter writes them F32). Experts F32, F16, BF16, Q8_0, or MXFP4 in ggml's block layout
from the writer's own encoder (quantize_mxfp4_ggml: e byte, input j in byte j's low nibble, 16 + j in
its high one; checked against the gguf package's MXFP4 dequantizer, llama.cpp's Python restatement).
Checked: llama.cpp itself (llama-cpp-python, where installed) scores the files as transformers does;
the config and tensor names equal the Hugging Face directory's; lossless fp32 prompt logits, greedy
tokens and decode steps within 1e-4 of transformers on the weights each file holds; MXFP4 and Q8_0
experts offer int8-g32 bit for bit (codes, 2^(e - 128) / fp16 scales, the bias group), MXFP4 ones the
mxfp4 kind's raw parts too (bit for bit through quant/mxfp4), and the default CPU engine keeps them as
mxfp4 / int8-g32, its decode steps in the native step; malformed files and what tiered does not
compute refused with clear errors; `tiered info`; the tokenizer.
"""

from __future__ import annotations

import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

sys.path.insert(0, str(Path(__file__).parent))

from gguf_writer import (dequantized_gpt_oss_model, mxfp4_experts, quantize_mxfp4_ggml,  # noqa: E402
                         write_gpt_oss_gguf)
from runtime_fixtures import decode_logits, rel_err  # noqa: E402
from test_gpt_oss import build_hf, hf_greedy, router_gap  # noqa: E402

from tiered import LLM, EngineConfig, SamplingParams, kernels  # noqa: E402
from tiered.checkpoint import open_checkpoint  # noqa: E402
from tiered.checkpoint.model_config import ModelConfig  # noqa: E402
from tiered.errors import CheckpointError, UnsupportedModelError  # noqa: E402
from tiered.runtime.cpu_decode import CPUDecodeStep  # noqa: E402

PROMPT = torch.randint(2, 256, (16,), generator=torch.Generator().manual_seed(0)).tolist()
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
LOSSLESS = dict(max_context=32, decode_weights="fp32", accelerator="none")
REL_TOL = 1e-4
GLU_SCALE = 3.0  # gate/up weights x3: pre-activations past llama.cpp's fixed clamp of 7 (test_clamp_acts)
KVALUES = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)  # ggml's kvalues_mxfp4: 2 x e2m1
native_only = pytest.mark.skipif(not kernels.available(), reason="tiered/kernels is not built")


def build_model(changes: dict | None = None):
    """test_gpt_oss's tiny model at swiglu_limit 7.0, gate/up scaled, expert biases bf16 values."""
    m = build_hf({"swiglu_limit": 7.0, **(changes or {})})
    with torch.no_grad():
        for layer in m.model.layers:
            ex = layer.mlp.experts
            ex.gate_up_proj.mul_(GLU_SCALE)
            for b in (ex.gate_up_proj_bias, ex.down_proj_bias):
                b.copy_(b.to(torch.bfloat16).float())
    return m.eval()


class Zoo:
    """The model, its GGUF files per expert type and their transformers references, built once."""

    def __init__(self, root: Path) -> None:
        self.root, self.model, self._paths, self._refs = root, build_model(), {}, {}

    def path(self, experts: str = "F32") -> Path:
        if experts not in self._paths:
            self._paths[experts] = write_gpt_oss_gguf(self.model, self.root / f"{experts}.gguf", experts)
        return self._paths[experts]

    def ref(self, experts: str = "F32"):
        if experts not in self._refs:
            self._refs[experts] = dequantized_gpt_oss_model(self.model, experts)
        return self._refs[experts]

    def logits(self, experts: str, ids: list[int]) -> torch.Tensor:
        return hf_logits(self.ref(experts), ids)


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    return Zoo(tmp_path_factory.mktemp("gpt_oss_gguf"))


def hf_logits(m, ids: list[int]) -> torch.Tensor:
    """transformers' fp32 logits [T, V] of one prompt."""
    with torch.no_grad():
        return m(torch.tensor([ids])).logits[0].float()


# ---------------------------------------------------------------------------------------- config
def test_config_and_names_equal_the_hf_directorys(zoo, tmp_path):
    """Every ModelConfig field as read from config.json (YaRN with truncate false, even layers sliding,
    limit 7.0), every tensor name, and every tensor's values (F32 file: the experts' biased layout too)."""
    zoo.model.save_pretrained(tmp_path / "hf")
    hf, ckpt = open_checkpoint(tmp_path / "hf"), open_checkpoint(zoo.path())
    cfg = ckpt.config
    differ = {f for f in ModelConfig.__dataclass_fields__ if getattr(cfg, f) != getattr(hf.config, f)}
    # the file carries no tokenizer (so no special tokens); floats are f32 in GGUF
    assert differ <= {"bos_token_id", "eos_token_ids", "rms_norm_eps"}, differ
    assert cfg.rms_norm_eps == pytest.approx(hf.config.rms_norm_eps)
    assert cfg.local_layers == (0, 2) and cfg.rope_scaling["truncate"] is False and cfg.swiglu_limit == 7.0
    assert set(ckpt.names()) == set(hf.names())
    for name in hf.names():
        assert torch.equal(ckpt.handle(name).load(), hf.handle(name).load()), name


def test_clamp_acts(zoo):
    """llama.cpp's clamp of 7 (not in the file) changes this model's logits, so the parity tests cover it."""
    import copy

    m = copy.deepcopy(zoo.model)
    for layer in m.model.layers:
        layer.mlp.experts.limit = 1e4
    assert rel_err(hf_logits(m, PROMPT), hf_logits(zoo.model, PROMPT)) > 1e-3


@pytest.mark.parametrize("pattern, local", [(3, (0, 1, 3)), (0, (0, 1, 2, 3)), (1, ()),
                                            ([False, True, True, False], (1, 2))])
def test_sliding_window_pattern(zoo, tmp_path, pattern, local):
    """attention.sliding_window_pattern as llama.cpp reads it (llama_hparams::set_swa_pattern): a period
    n slides layer i when n == 0 or i % n < n - 1; an array gives each layer's flag."""
    path = write_gpt_oss_gguf(zoo.model, tmp_path / "p.gguf", extra=lambda w: w.add_sliding_window_pattern(pattern))
    cfg = open_checkpoint(path).config
    assert cfg.local_layers == local and cfg.local_window == (4 if local else None)


@pytest.mark.skipif(not hasattr(gguf, "quants"), reason="gguf without quants")
def test_mxfp4_encoder_is_ggmls():
    """The writer's MXFP4 blocks decode, by the gguf package's dequantizer (llama.cpp's Python restatement
    of dequantize_row_mxfp4), to the values the encoder meant, and by tiered's (ggml's nibble order)."""
    from gguf.quants import dequantize

    from tiered.checkpoint.gpt_oss import dequantize_mxfp4

    w = torch.randn(6, 96, generator=torch.Generator().manual_seed(3)).numpy() * 0.3
    blocks, values = quantize_mxfp4_ggml(w)
    assert np.array_equal(dequantize(blocks, Q.MXFP4).reshape(w.shape), values)
    raw = torch.from_numpy(blocks).reshape(6, 3, 17)
    assert torch.equal(dequantize_mxfp4(raw[..., 1:], raw[..., 0], halves=True), torch.from_numpy(values))
    assert np.abs(values - w).max() <= 0.25 * np.abs(w).max()


# ------------------------------------------------------------------------------------- llama.cpp
@pytest.mark.parametrize("experts, tol", [("F32", 1e-5), ("MXFP4", 5e-2)])
def test_llama_cpp_reads_the_files_as_transformers(zoo, experts, tol):
    """The writer is llama.cpp's layout: llama.cpp itself (llama-cpp-python, fp32 KV cache) scores a
    prompt as transformers does on the weights the file holds, with YaRN's correction range rounded
    outwards as llama.cpp rounds it (ggml_rope_yarn_corr_dims; tiered keeps transformers' truncate false).
    F32: to fp32 rounding. MXFP4: llama.cpp's CPU matmul quantizes the experts' activations to Q8_0
    (~2.5e-2 here; the same blocks with OpenAI's nibble order instead of ggml's score ~1.0 off); the
    prompt is one whose expert choices are no near-ties (router_gap)."""
    llama_cpp = pytest.importorskip("llama_cpp")
    ids = torch.randint(2, 256, (16,), generator=torch.Generator().manual_seed(4)).tolist()
    assert router_gap(zoo.path(experts), ids) > 5e-3
    ref = build_model({"rope_parameters": {**zoo.model.config.rope_parameters, "truncate": True}})
    ref.load_state_dict(zoo.ref(experts).state_dict())
    llm = llama_cpp.Llama(str(zoo.path(experts)), n_ctx=32, logits_all=True, verbose=False, type_k=0, type_v=0)
    llm.eval(ids)
    got = torch.tensor(np.array(llm.scores[:len(ids)]))
    del llm
    assert rel_err(got, hf_logits(ref, ids)) < tol


# ------------------------------------------------------------------------------- lossless parity
@pytest.mark.parametrize("experts", ["F32", "MXFP4", "Q8_0", "F16", "BF16"])
def test_logits_and_greedy_equal_transformers(zoo, experts):
    """The lossless engine (fp32 experts, dequantized exactly): prompt logits and 12 greedy tokens of
    transformers on the weights the file holds."""
    llm = LLM(zoo.path(experts), EngineConfig(**LOSSLESS, dtype="float32", expert_weights="fp32"))
    try:
        assert rel_err(llm.logits(PROMPT), zoo.logits(experts, PROMPT)) <= REL_TOL
        out = llm.generate(PROMPT, GREEDY)[0].token_ids
        assert out == hf_greedy(zoo.ref(experts), PROMPT, 12) and len(set(out)) > 1
    finally:
        llm.close()


def test_experts_on_disk_small_cache(zoo, tmp_path):
    """No accelerator, RAM for the non-expert weights, a prefill chunk's activations (the 32-token context's)
    and a 3-slot expert cache: every MXFP4 expert is read from disk (a converted copy in the offload directory:
    the biased layout is not readable in place), the logits and greedy tokens stay transformers'."""
    from tiered.memory import sizes
    from tiered.planner.placement import DISK

    path = zoo.path("MXFP4")
    cfg = open_checkpoint(path).config
    nonexpert = 4 * sum(int(t.n_elements) for t in gguf.GGUFReader(path).tensors if "_exps." not in t.name)
    kv = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * 32 * cfg.head_dim * 4
    budget = (nonexpert + kv + 2 * 32 * cfg.head_dim * 4 + sizes.workspace_bytes(cfg, "fp32", 32)
              + (2 + 3) * sizes.expert_bytes(cfg, "fp32"))
    llm = LLM(path, EngineConfig(**LOSSLESS, cpu_memory=budget, expert_cache_slots=3,
                                 offload_dir=str(tmp_path / "offload")))
    try:
        assert llm.experts.placement.count(DISK) == 32
        assert rel_err(llm.logits(PROMPT), zoo.logits("MXFP4", PROMPT)) <= REL_TOL
        assert llm.generate(PROMPT, GREEDY)[0].token_ids == hf_greedy(zoo.ref("MXFP4"), PROMPT, 12)
        assert llm.experts.bytes_read > 0 and llm.experts.cache.stats.evictions > 0
    finally:
        llm.close()


@pytest.mark.parametrize("native", [False, pytest.param(True, marks=native_only)], ids=["torch_ops", "native"])
@pytest.mark.parametrize("experts", ["F32", "MXFP4"])
def test_decode_steps_equal_transformers(zoo, experts, native):
    """A 3-token prompt, then 17 tokens fed one a step (past the window) through the CPU decode step:
    each step's logits equal transformers' at that position."""
    llm = LLM(zoo.path(experts), EngineConfig(**LOSSLESS))
    try:
        ids = torch.randint(2, 256, (20,), generator=torch.Generator().manual_seed(4)).tolist()
        got = decode_logits(llm, CPUDecodeStep(llm.model, native=native), ids, 3, torch.float32)
        assert rel_err(got, zoo.logits(experts, ids)[3:]) <= REL_TOL
    finally:
        llm.close()


# ------------------------------------------------------------------------------------ int8-g32
def test_mxfp4_experts_are_int8_g32_bit_for_bit(zoo):
    """Every MXFP4 expert projection: int8_g32_parts' codes are ggml's kvalues of the encoded codes and
    its scales 2^(e - 128) of the blocks' e bytes, q * scale the encoded values with the bias as column K
    (then zeros); `load` the same values."""
    ckpt, mx = open_checkpoint(zoo.path("MXFP4")), mxfp4_experts(zoo.model)
    for layer in range(4):
        p = f"model.layers.{layer}.mlp.experts."
        gate_blocks, up_blocks, gu_values = mx[p + "gate_up_proj"]
        down_blocks, down_values = mx[p + "down_proj"]
        gub = zoo.model.get_parameter(p + "gate_up_proj_bias").detach()
        dnb = zoo.model.get_parameter(p + "down_proj_bias").detach()
        for e in range(8):
            wants = ((gate_blocks[e], gu_values[e].T[0::2], gub[e, 0::2], 96),
                     (up_blocks[e], gu_values[e].T[1::2], gub[e, 1::2], 96),
                     (down_blocks[e], down_values[e].T, dnb[e], 64))
            for proj, (blocks, values, bias, width) in zip(("gate_proj", "up_proj", "down_proj"), wants):
                h = ckpt.handle(f"{p}{e}.{proj}.weight")
                assert h.format == "MXFP4" and h.int8_g32_exact and h.shape == (values.shape[0], width)
                q, s = h.int8_g32_parts()
                R, K = values.shape
                b = torch.from_numpy(blocks).reshape(R, K // 32, 17)
                codes = torch.cat((b[..., 1:] & 15, b[..., 1:] >> 4), -1).reshape(R, K).long()
                assert torch.equal(q[:, :K], torch.tensor(KVALUES, dtype=torch.int8)[codes])
                assert torch.equal(s[:, :K // 32].float(), torch.exp2(b[..., 0].float() - 128))
                want = torch.zeros(R, width)
                want[:, :K], want[:, K] = torch.from_numpy(values), bias
                got = (q.float().reshape(R, -1, 32) * s.float()[..., None]).reshape(R, width)
                assert torch.equal(got, want) and torch.equal(h.load(), want), (layer, e, proj)


def test_mxfp4_experts_are_the_mxfp4_kind_bit_for_bit(zoo):
    """Every MXFP4 expert projection offers its raw parts in ggml's nibble order (mxfp4_halves): the
    blocks' qs and e bytes as stored and the bias; as the mxfp4 kind's segments (tiled and plain) they
    dequantize to `load`'s values (the encoded weights, the bias as column K, zeros after) bit for bit."""
    from tiered.checkpoint.gpt_oss import mxfp4_codes
    from tiered.quant import mxfp4

    ckpt, mx = open_checkpoint(zoo.path("MXFP4")), mxfp4_experts(zoo.model)
    blocks = torch.from_numpy(mx["model.layers.1.mlp.experts.down_proj"][0][3].copy()).reshape(64, 1, 17)
    h = ckpt.handle("model.layers.1.mlp.experts.3.down_proj.weight")
    b, e, bias = h.mxfp4_parts()
    assert h.mxfp4_exact and h.mxfp4_halves and torch.equal(b, blocks[..., 1:]) and torch.equal(e, blocks[..., 0])
    assert torch.equal(bias, zoo.model.model.layers[1].mlp.experts.down_proj_bias[3].detach())
    for name in ckpt.names():
        if ".experts." in name:
            h = ckpt.handle(name)
            codes, scale = mxfp4_codes(*h.mxfp4_parts(), h.shape[1], h.mxfp4_halves)
            for layout in ("tiled", "plain"):
                assert torch.equal(mxfp4.dequantize(mxfp4.segments(codes, scale, layout), *h.shape), h.load()), name


def test_q8_0_experts_are_int8_g32_bit_for_bit(zoo):
    """Q8_0 experts: int8_g32_parts holds the blocks' int8 codes and fp16 scales as stored, the bias a
    group of its own; q * scale equals `load` (the gguf package's dequantization, bias column added)."""
    from gguf.quants import quantize

    ckpt = open_checkpoint(zoo.path("Q8_0"))
    gu = zoo.model.model.layers[2].mlp.experts.gate_up_proj.detach()[5].T.numpy()  # (2F, D)
    blocks = quantize(np.ascontiguousarray(gu[1::2]), Q.Q8_0).reshape(32, 2, 34)  # up rows of expert 5
    h = ckpt.handle("model.layers.2.mlp.experts.5.up_proj.weight")
    q, s = h.int8_g32_parts()
    codes = torch.from_numpy(blocks[..., 2:].copy().view(np.int8)).reshape(32, 64)
    assert h.format == "Q8_0" and torch.equal(q[:, :64], codes)
    assert torch.equal(s[:, :2], torch.from_numpy(blocks[..., :2].copy().view(np.float16)[..., 0]))
    assert (q[:, 64] == 1).all() and not q[:, 65:].any()
    for name in ckpt.names():
        if ".experts." in name:
            h = ckpt.handle(name)
            q, s = h.int8_g32_parts()
            got = (q.float().reshape(q.shape[0], -1, 32) * s.float()[..., None]).reshape(q.shape)
            assert torch.equal(got, h.load()), name


@pytest.mark.parametrize("experts, kind", [pytest.param("MXFP4", "mxfp4", marks=native_only), ("Q8_0", "int8-g32")])
def test_default_engine_keeps_the_experts_exactly(zoo, experts, kind):
    """EngineConfig() on the CPU: experts held straight from the file (MXFP4 as mxfp4, the e2m1 codes as
    stored; Q8_0 as int8-g32; the plan says mapped exactly) at sizes.expert_bytes', prompt logits within
    the quantized expert tests' 2e-2 of transformers' (bf16 KV cache and decode copies, int8 / int16
    activations) with the same next tokens where transformers' are not near-tied. With the kernels
    built every layer's decode step runs whole in the native step ([("native", 0, 4)]: the experts'
    projections bound by DecodeStep.set_moe), its logits within 2e-3 of the same step with the MoE
    blocks run as modules, and of transformers' within 2e-2 (int8-g32) or 0.1 (mxfp4: its native
    calls read int8 activations, which this model's GLU outliers coarsen; the exact weights on exact
    activations give 0.02; the prompt's logits within 5e-2 so)."""
    from tiered.memory import sizes

    ids = torch.randint(2, 256, (16,), generator=torch.Generator().manual_seed(4)).tolist()
    assert router_gap(zoo.path(experts), ids) > 1e-2  # no near-tied expert choice the activations could flip
    llm = LLM(zoo.path(experts), EngineConfig(max_context=32, accelerator="none"))
    try:
        assert llm.plan.dtypes["experts"] == kind and llm.experts.store.fmt.name == kind
        assert llm.experts.store.expert_bytes == sizes.expert_bytes(llm.config, kind)
        assert any("mapped exactly" in n for n in llm.plan.notes), llm.plan.notes
        got, ref = llm.logits(ids), zoo.logits(experts, ids)
        top = ref.topk(2, -1).values
        clear = top[:, 0] - top[:, 1] > 0.05  # not near-tied: the bf16 logits alone are ~0.008 apart at 2
        # a prompt's mxfp4 calls read int8 activations too with the kernels (quant/experts.GROUPED_ROWS: one
        # native call up to 512 rows, as llama.cpp computes MXFP4): 0.027 here, 0.02 on exact activations; and so
        # do its int8-g32 calls of 2+ rows (Plan.batch_act "q8", since 2026-12-05: 0.027 here)
        prompt_tol = 5e-2 if kernels.available() else 2e-2
        assert rel_err(got, ref) <= prompt_tol and torch.equal(got.argmax(-1)[clear], ref.argmax(-1)[clear])
        if kernels.available():
            step = llm.runtime.cpu_decode
            assert step.schedule == [("native", 0, 4)]
            native = decode_logits(llm, step, ids, 3)
            step.schedule = step.fallback
            try:
                modules = decode_logits(llm, step, ids, 3)
            finally:
                step.schedule = [("native", 0, 4)]
            # 3e-4 on 2 AVX2 cores, 1.4e-3 on AVX-512 (Sapphire Rapids, int8-g32): the two paths' sums differ in
            # order and rounding there, and are equally near transformers' (mean |error| 0.00583 each, 2026-11-29)
            assert rel_err(native, modules) <= 2e-3
            # one-row expert calls: mxfp4 on int8 activations (llama.cpp's Q8_0; this model's GLU outputs,
            # past a clamp of 7 with gate/up x3, put outliers in their groups of 32), int8-g32 on int16 ones
            assert rel_err(native, ref[3:]) <= (0.1 if kind == "mxfp4" else 2e-2)
    finally:
        llm.close()


def test_bias_fp16_cannot_hold_is_refused_on_read(zoo, tmp_path):
    """An fp32 expert bias with more significant bits than fp16 keeps: int8_g32_parts refuses it
    (CheckpointError naming the tensor), `load` reads it exactly."""
    m = build_model()
    with torch.no_grad():
        m.model.layers[1].mlp.experts.down_proj_bias[2, 5] = 0.1234567
    ckpt = open_checkpoint(write_gpt_oss_gguf(m, tmp_path / "b.gguf", "MXFP4"))
    h = ckpt.handle("model.layers.1.mlp.experts.2.down_proj.weight")
    with pytest.raises(CheckpointError, match="layers.1.mlp.experts.2.down_proj.*bias") as e:
        h.int8_g32_parts()
    assert "--weights" in str(e.value)
    from tiered.quant.gguf_experts import projection_segments

    with pytest.raises(CheckpointError, match="layers.1.mlp.experts.2.down_proj.*bias.*bf16"):
        projection_segments(h, "mxfp4", "tiled")  # nor a bf16 one: the mxfp4 kind refuses it too
    assert float(h.load()[5, 32]) == pytest.approx(0.1234567, rel=1e-7)


def test_mxfp4_scale_int8_g32_cannot_hold_is_refused_on_read(zoo, tmp_path):
    """An MXFP4 group whose scale fp16 cannot hold (2^(e - 128) below 2^-24): refused on read."""
    blocks = mxfp4_experts(zoo.model)["model.layers.0.mlp.experts.down_proj"][0].copy()
    blocks.reshape(8, 64, 1, 17)[3, 7, 0, 0] = 60  # expert 3, row 7: e = 60
    path = write_gpt_oss_gguf(zoo.model, tmp_path / "s.gguf", "MXFP4",
                              swap_tensors={"blk.0.ffn_down_exps.weight": (blocks, Q.MXFP4)})
    h = open_checkpoint(path).handle("model.layers.0.mlp.experts.3.down_proj.weight")
    with pytest.raises(CheckpointError, match="experts.3.down_proj.*scale"):
        h.int8_g32_parts()
    assert float(h.load()[7, :32].abs().max()) < 2.0 ** -60


# ------------------------------------------------------------------------------- refused files
@pytest.mark.parametrize("key", ["block_count", "context_length", "embedding_length", "attention.head_count",
                                 "attention.layer_norm_rms_epsilon", "attention.sliding_window", "expert_count",
                                 "expert_used_count", "expert_feed_forward_length"])
def test_missing_required_key_is_a_checkpoint_error(zoo, key, tmp_path):
    """A key llama.cpp's gpt-oss loader requires, left out: CheckpointError naming it."""
    path = write_gpt_oss_gguf(zoo.model, tmp_path / "m.gguf", drop=(f"gpt-oss.{key}",))
    with pytest.raises(CheckpointError, match=f"lacks gpt-oss.{key}") as e:
        open_checkpoint(path)
    assert "re-convert" in str(e.value)


@pytest.mark.parametrize("damage, match", [
    (dict(skip_tensors=("blk.2.ffn_up_exps.bias",)), "lacks tensor blk.2.ffn_up_exps.bias"),
    (dict(skip_tensors=("blk.1.ffn_down_exps.weight",)), "lacks tensor blk.1.ffn_down_exps.weight"),
    (dict(swap_tensors={"blk.0.ffn_gate_exps.weight": (np.zeros((8, 16, 64), np.float32), Q.F32)}),
     r"blk.0.ffn_gate_exps.weight has shape \(8, 16, 64\), the config implies \(8, 32, 64\)"),
    (dict(swap_tensors={"blk.3.ffn_down_exps.bias": (np.zeros((8, 32), np.float32), Q.F32)}),
     r"blk.3.ffn_down_exps.bias has shape \(8, 32\), the config implies \(8, 64\)"),
    (dict(extra=lambda w: w.add_sliding_window_pattern([True, False])), "2 flags for 4 layers"),
], ids=["no_bias", "no_weight", "weight_shape", "bias_shape", "pattern_length"])
def test_damaged_file_is_a_checkpoint_error(zoo, tmp_path, damage, match):
    with pytest.raises(CheckpointError, match=match):
        open_checkpoint(write_gpt_oss_gguf(zoo.model, tmp_path / "d.gguf", **damage))


@pytest.mark.parametrize("kw, match", [
    (dict(experts="Q4_0"), "experts stored as Q4_0"),
    (dict(extra=lambda w: w.add_rope_freq_base_swa(10000.0)), "rope.freq_base_swa"),
    (dict(extra=lambda w: w.add_uint32("gpt-oss.rope.dimension_count", 8)), "rope.dimension_count 8"),
    (dict(drop=("gpt-oss.attention.value_length",), extra=lambda w: w.add_value_length(32)), "value_length 32"),
    (dict(drop=("gpt-oss.rope.scaling.type",), extra=lambda w: w.add_rope_scaling_type(gguf.RopeScalingType.LONGROPE)),
     "RoPE scaling 'longrope'"),
    (dict(extra=lambda w: w.add_rope_scaling_yarn_ext_factor(0.5)), "yarn_ext_factor"),
    (dict(drop=("gpt-oss.expert_feed_forward_length",), extra=lambda w: w.add_array(
        "gpt-oss.expert_feed_forward_length", [32, 32, 64, 32])), "per layer"),
    (dict(extra=lambda w: w.add_tensor("blk.0.ffn_gate_up_exps.weight", np.zeros((8, 64, 64), np.float32))),
     "fused gate/up"),  # convert_hf_to_gguf.py --fuse-gate-up-exps
], ids=["q4_0_experts", "freq_base_swa", "partial_rope", "value_length", "longrope", "yarn_ext", "ff_per_layer",
        "fused_gate_up"])
def test_what_tiered_does_not_compute_is_refused(zoo, tmp_path, kw, match):
    with pytest.raises(UnsupportedModelError, match=match):
        open_checkpoint(write_gpt_oss_gguf(zoo.model, tmp_path / "u.gguf", **kw))


# ------------------------------------------------------------------------------ info, tokenizer
def test_tiered_info(zoo):
    """`tiered info` on an MXFP4 file: gpt-oss's attention and experts, kept as mxfp4 exactly (int8-g32
    without the kernels)."""
    from typer.testing import CliRunner

    from tiered.cli import app

    res = CliRunner().invoke(app, ["info", str(zoo.path("MXFP4"))])
    assert res.exit_code == 0, res.output
    for line in ("model_type:  gpt_oss", "experts:     8, top-4, expert FFN 32, biased clamped GLU (limit 7)",
                 "window 4 on layers [0, 2]",
                 "stored MXFP4/MXFP4/MXFP4 (gate/up/down) -> kept as "
                 + ("mxfp4" if kernels.available() else "int8-g32") + "; exact"):
        assert line in res.output, res.output


def test_tokenizer_loads(zoo, smollm2_path, tmp_path):
    """transformers does not load a gpt-oss GGUF's model; tiered builds its tokenizer with transformers'
    GGUF tokenizer converters: SmolLM2's gpt2-style tokenizer copied into a gpt-oss file encodes as
    SmolLM2's own."""
    path = write_gpt_oss_gguf(zoo.model, tmp_path / "tok.gguf", tokenizer_from=smollm2_path)
    text = "Memory is a hierarchy: café, 日本語, 😀."
    assert open_checkpoint(path).tokenizer().encode(text) == open_checkpoint(smollm2_path).tokenizer().encode(text)


def test_plan_prices_the_attentions_decode_copies_not_the_experts(zoo, tmp_path):
    """The planner's decode-copy precision (quant/linear.decode_precision, decode_mix) counts the layers'
    dense projections only: a file of Q8_0 attention and MXFP4 experts decodes its attention from int8
    copies, and the routed experts (no copies; the plan prices them as mxfp4) no longer make it 97% bf16."""
    from tiered.quant.linear import decode_mix, decode_precision

    path = write_gpt_oss_gguf(zoo.model, tmp_path / "q8.gguf", "MXFP4", qtype=Q.Q8_0)
    ckpt = open_checkpoint(path)
    assert any(".experts." in n and n.endswith("_proj.weight") for n in ckpt.names())
    # Q8_0: its blocks as int8-g32 where tiered's kernels are built (and its tiles fit), else per-row int8
    from tiered import kernels
    assert decode_precision(ckpt, "auto") == ("int8-g32" if kernels.available() else "int8")
    assert decode_mix(ckpt, "auto") is None
