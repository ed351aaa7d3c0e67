"""4-bit safetensors checkpoints: GPTQ (v1 and v2 zeros), AWQ (GEMM packing) and compressed-tensors'
pack-quantized W4A16, packed here from known codes by writers that share no code with tiered's reader
(checkpoint/int4_packed.py), against transformers on the weights those codes encode (dequantized here
in fp32). compressed-tensors' own packer (pack_to_int32) was checked to give the same words as the
writer below (2026-11-27, compressed-tensors 0.20.0); transformers' loads of these formats need
optimum / gptqmodel / autoawq / compressed-tensors, which the CPU image lacks.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from fixtures import hf_logits, load_hf_model, prompt_ids, stepwise_logits  # noqa: E402
from fixtures import max_rel_err as rel  # noqa: E402
from moe_fixtures import VOCAB  # noqa: E402
from quant_fixtures import QuantZoo, edited, write_quantized  # noqa: E402

from tiered import LLM, EngineConfig  # noqa: E402
from tiered.checkpoint import open_checkpoint  # noqa: E402
from tiered.errors import CheckpointError, UnsupportedModelError  # noqa: E402

REL_TOL = 1e-4
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def pack_words(fields: torch.Tensor) -> torch.Tensor:
    """[R, 8 W] values 0..15 -> int32 [R, W], field j of each 8 at bits 4j."""
    f = fields.to(torch.int64).reshape(fields.shape[0], -1, 8)
    words = sum(f[..., j] << (4 * j) for j in range(8))
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def quantize(w: torch.Tensor, group: int, symmetric: bool):
    """w [N, K] -> (codes [N, K] 0..15, zero [N, G] 0..15, scale fp16 [N, G]) with w ~ (codes - zero) * scale."""
    N, K = w.shape
    g = w.reshape(N, K // group, group)
    if symmetric:
        scale = (g.abs().amax(-1) / 7.5).clamp_min(1e-8).half()
        zero = torch.full(scale.shape, 8)
    else:
        lo, hi = g.amin(-1), g.amax(-1)
        scale = ((hi - lo) / 15).clamp_min(1e-8).half()
        zero = (-lo / scale.float()).round().clamp(0, 15).long()
    codes = (g / scale.float()[..., None] + zero[..., None]).round().clamp(0, 15).long()
    return codes.reshape(N, K), zero, scale


def packed_tensors(w: torch.Tensor, method: str, group: int) -> tuple[dict, torch.Tensor]:
    """One projection's tensors in `method`'s layout (suffix -> tensor) and the weight they encode, fp32."""
    N, K = w.shape
    codes, zero, scale = quantize(w, group, symmetric=method == "compressed-tensors")
    ref = ((codes.reshape(N, K // group, group) - zero[..., None]).float() * scale.float()[..., None]).reshape(N, K)
    if method.startswith("gptq"):
        stored_zero = zero if method == "gptq_v2" else (zero - 1) & 0xF
        out = {"qweight": _gptq_qweight(codes),
               "qzeros": pack_words(stored_zero.T.contiguous()), "scales": scale.T.contiguous(),
               "g_idx": (torch.arange(K) // group).to(torch.int32)}
    elif method == "awq":
        def awq(x):  # [R, N] -> [R, N/8] words, nibble i holding column 8c + AWQ_ORDER[i]
            return pack_words(x.reshape(x.shape[0], -1, 8)[..., AWQ_ORDER].reshape(x.shape[0], -1))
        out = {"qweight": awq(codes.T.contiguous()), "qzeros": awq(zero.T.contiguous()), "scales": scale.T.contiguous()}
    else:
        out = {"weight_packed": pack_words(codes), "weight_scale": scale, "weight_shape": torch.tensor([N, K])}
    return out, ref


def _gptq_qweight(codes: torch.Tensor) -> torch.Tensor:
    """codes [N, K] -> GPTQ's qweight int32 [K/8, N]: word [k // 8, n] holds input k at bits 4 (k % 8)."""
    N, K = codes.shape
    f = codes.T.reshape(K // 8, 8, N).permute(0, 2, 1).reshape(K // 8, N * 8)  # [K/8, N, 8] flattened
    return pack_words(f)


CONFIGS = {
    "gptq": {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": False,
             "checkpoint_format": "gptq"},
    "gptq_v2": {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": False,
                "checkpoint_format": "gptq_v2"},
    "awq": {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"},
    "compressed-tensors": {"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"],
                           "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                               "num_bits": 4, "type": "int", "strategy": "group", "group_size": 128,
                               "symmetric": True}}}},
}


def write_int4(src: Path, dst: Path, method: str, group: int = 128) -> tuple[Path, Path]:
    """`src` with every decoder projection packed as `method` (dst), and the weights those codes encode as
    a plain fp32 checkpoint (dst-dequantized): the oracle's."""
    def quantize(name, w):
        parts = name.split(".")
        if ".layers." in name and parts[-1] == "weight" and parts[-2] in LINEARS and w.dim() == 2:
            return packed_tensors(w.float(), method, group)
        return None
    return write_quantized(src, dst, CONFIGS[method], quantize)


@pytest.fixture(scope="module")
def zoo(tmp_path_factory) -> QuantZoo:
    # expert widths of a multiple of 128 (groups of 128 over their inputs)
    return QuantZoo(tmp_path_factory.mktemp("int4ckpt"), write_int4, "llama_wide",
                    hidden_size=256, moe_intermediate_size=256, intermediate_size=256)


def prompt(n: int = 12, seed: int = 0) -> list[int]:
    return prompt_ids(VOCAB, n, seed)


METHODS = tuple(CONFIGS)


@pytest.mark.parametrize("method", METHODS)
def test_weights_unpack_to_the_encoded_values(zoo, method):
    from safetensors.torch import load_file

    path, ref_dir = zoo.get("llama_wide", method)
    ref = load_file(str(ref_dir / "model.safetensors"))
    ckpt = open_checkpoint(path)
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.down_proj.weight"):
        h = ckpt.handle(name)
        assert h.format == "INT4" and h.int4_group == 128 and h.shape == tuple(ref[name].shape)
        assert torch.equal(h.load(torch.float32), ref[name])
        codes, scale, zero = h.int4_parts(32)  # tiered's groups of 32: the same weight
        N, K = h.shape
        w = ((codes.float() - 8).view(N, K // 32, 32) * scale[..., None] + zero[..., None]).view(N, K)
        assert (w - ref[name]).abs().max() <= 1e-6 * ref[name].abs().max()
    assert not any(n.endswith((".qweight", ".qzeros", ".scales", ".g_idx", "weight_packed", "weight_scale"))
                   for n in ckpt.names())


@pytest.mark.parametrize("method", METHODS)
def test_dense_model_equals_transformers(zoo, method):
    path, _ = zoo.get("llama_wide", method)
    llm = LLM(path, EngineConfig(max_context=32, decode_weights="fp32", dtype="float32", accelerator="none"))
    ids = prompt()
    assert rel(llm.logits(ids), hf_logits(zoo.hf("llama_wide", method), ids)) <= REL_TOL


@pytest.mark.parametrize("method", ["gptq", "compressed-tensors"])
def test_cpu_decode_keeps_the_codes(zoo, method):
    """The CPU's default engine keeps each projection's codes as its one copy (Int4Linear, groups of 32
    from the stored 128s), and decodes like transformers on the encoded weights: within 2e-3 nats a step
    with bf16 activations everywhere (batch_activations="bf16"), within 5e-3 by default (its prompt rows on
    int8 activations, as llama.cpp computes them: Plan.batch_act "q8"; 2.1e-3 at most here)."""
    from tiered.eval.kl import kl_divergence
    from tiered.quant.int4 import Int4Linear

    path, _ = zoo.get("llama_wide", method)
    ids = prompt(16)
    ref = hf_logits(zoo.hf("llama_wide", method), ids)
    for act, bound in (("auto", 5e-3), ("bf16", 2e-3)):
        auto = LLM(path, EngineConfig(max_context=32, accelerator="none", batch_activations=act))
        assert not auto.plan.dense_copies and auto.plan.precision == "int4"
        assert auto.plan.batch_act == ("q8" if act == "auto" else "bf16")
        assert len([m for m in auto.model.modules() if isinstance(m, Int4Linear)]) == 2 * 4
        kl = kl_divergence(ref[7:], stepwise_logits(auto, ids, 8))
        assert float(kl.max()) < bound, (act, kl)  # bf16 scales / zeros (residual kept)
        auto.close()


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_moe_experts_stay_int4(zoo, method):
    from tiered.memory.expert_store import expert_tensor_names, moe_layers
    from tiered.quant.experts import ExpertFormat
    from tiered.quant.gguf_experts import encode_expert, requantized_note, stored_format

    path, _ = zoo.get("qwen3_moe", method)
    ckpt = open_checkpoint(path)
    hs = [ckpt.handle(n) for n in expert_tensor_names(ckpt.config.model_type, moe_layers(ckpt, ckpt.config)[0], 1)]
    assert stored_format(hs) == "int4"
    fmt = ExpertFormat("int4", [h.shape for h in hs], int4_layout="plain")
    assert requantized_note(hs, fmt) is None
    for w, h in zip(fmt.dequantize(encode_expert(fmt, hs)), hs):
        ref = h.load(torch.float32)
        assert (w - ref).abs().max() <= 2**-8 * ref.abs().max()  # bf16 scales, zeros to ~2^-16
    llm = LLM(path, EngineConfig(max_context=32, decode_weights="fp32", accelerator="none"))
    assert llm.plan.dtypes["experts"] == "int4"
    ids = prompt()
    ref = hf_logits(zoo.hf("qwen3_moe", method), ids)
    assert rel(llm.logits(ids), ref) < 0.02
    host = LLM(path, EngineConfig(max_context=32, decode_weights="fp32", accelerator="host"))  # the strict stand-in
    assert host.plan.dtypes["experts"] == "int4"
    assert rel(host.logits(ids), ref) < 0.02


def _edit(zoo, tmp_path, method, config=None, drop=None) -> Path:
    return edited(zoo.get("llama_wide", method)[0], tmp_path / "edited", config, drop)


def test_gptq_act_order_loads_through_g_idx(zoo, tmp_path):
    """desc_act: inputs are assigned to groups by g_idx (a permutation's order), so the groups are not
    runs of 32: the weights load dequantized through g_idx, exactly, and decode on bf16 copies."""
    from safetensors.torch import load_file, save_file

    path = _edit(zoo, tmp_path, "gptq", config=lambda q: q.update(desc_act=True))
    ref_dir = tmp_path / "reference"
    shutil.copytree(zoo.get("llama_wide", "gptq")[1], ref_dir)
    t, ref = load_file(str(path / "model.safetensors")), load_file(str(ref_dir / "model.safetensors"))
    g = torch.Generator().manual_seed(3)
    for base in [k[:-len(".qweight")] for k in t if k.endswith(".qweight")]:
        K, N = t[base + ".qweight"].shape[0] * 8, t[base + ".qweight"].shape[1]
        w = ref[base + ".weight"]
        g_idx = torch.argsort(torch.randperm(K, generator=g)) // 128  # input k in group g_idx[k]
        codes = torch.empty(N, K, dtype=torch.long)
        zeros, scales = [], []
        for grp in range(K // 128):
            cols = (g_idx == grp).nonzero().flatten()
            c, z, s = quantize(w[:, cols], len(cols), symmetric=False)
            codes[:, cols] = c
            zeros.append(z[:, 0])
            scales.append(s[:, 0])
        zero, scale = torch.stack(zeros), torch.stack(scales)  # [G, N]
        ref[base + ".weight"] = (codes - zero[g_idx].T).float() * scale[g_idx].T.float()
        t[base + ".qweight"] = _gptq_qweight(codes)
        t[base + ".qzeros"] = pack_words(((zero - 1) & 0xF).contiguous())
        t[base + ".scales"], t[base + ".g_idx"] = scale.contiguous(), g_idx.to(torch.int32)
    save_file(t, str(path / "model.safetensors"), metadata={"format": "pt"})
    save_file(ref, str(ref_dir / "model.safetensors"), metadata={"format": "pt"})
    h = open_checkpoint(path).handle("model.layers.1.mlp.down_proj.weight")
    assert h.format == "INT4" and h.int4_group == 0
    assert torch.equal(h.load(torch.float32), ref["model.layers.1.mlp.down_proj.weight"])
    llm = LLM(path, EngineConfig(max_context=32, decode_weights="fp32", dtype="float32", accelerator="none"))
    ids = prompt()
    assert rel(llm.logits(ids), hf_logits(load_hf_model(ref_dir), ids)) <= REL_TOL
    auto = LLM(path, EngineConfig(max_context=32, accelerator="none"))
    assert auto.plan.precision == "bf16"


@pytest.mark.parametrize("method, change, error, words", [
    ("gptq", lambda q: q.update(bits=3), UnsupportedModelError, ("3-bit", "4- and 8-bit")),  # 8: test_int8_checkpoints
    ("awq", lambda q: q.update(version="gemv"), UnsupportedModelError, ("GEMM",)),
])
def test_unsupported_schemes_are_refused(zoo, tmp_path, method, change, error, words):
    with pytest.raises(error) as e:
        open_checkpoint(_edit(zoo, tmp_path, method, config=change))
    assert all(w in str(e.value) for w in words), str(e.value)


def test_damaged_tensors_are_refused(zoo, tmp_path):
    base = "model.layers.0.self_attn.o_proj"
    with pytest.raises(CheckpointError, match=r"lacks tensor .*o_proj.qzeros"):
        open_checkpoint(_edit(zoo, tmp_path, "gptq", drop=lambda t: t.pop(base + ".qzeros")))
    with pytest.raises(CheckpointError, match=r"o_proj's gptq tensors disagree"):
        open_checkpoint(_edit(zoo, tmp_path / "b", "gptq", drop=lambda t: t.__setitem__(base + ".scales",
                                                                                         t[base + ".scales"][:, :8].contiguous())))
    # asymmetric pack-quantized reads zero points packed along the outputs (test_int8_checkpoints): not floats
    with pytest.raises(CheckpointError, match=r"o_proj.weight_zero_point is F32 \(256, 2\), not zero points"):
        open_checkpoint(_edit(zoo, tmp_path / "c", "compressed-tensors",
                              drop=lambda t: t.__setitem__(base + ".weight_zero_point", torch.zeros(256, 2))))


def test_info_names_the_groups(zoo):
    from typer.testing import CliRunner

    from tiered.cli import app

    res = CliRunner().invoke(app, ["info", str(zoo.get("llama_wide", "awq")[0])])
    assert res.exit_code == 0, res.output
    assert "INT4 x14" in res.output and "int4:        groups of 128 x14" in res.output
