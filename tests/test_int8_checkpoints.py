"""8-bit integer and asymmetric 4-bit safetensors checkpoints: GPTQ Int8 (v1 and v2 zeros, per group and per
channel), compressed-tensors' int-quantized W8A8 (per channel with static input scales; per group,
asymmetric), pack-quantized W8A16 (8-bit codes four to a word; symmetric per channel and asymmetric per
group with packed zero points) and asymmetric pack-quantized W4A16, packed here from known codes by writers
that share no code with tiered's readers (checkpoint/int8_packed.py, int4_packed.py), against transformers
on the weights those codes encode (dequantized here in fp32).

The writers follow GPTQModel's `pack_block` (8-bit: 32 inputs as 8 words of 4 bytes, input k at bits
8 (k % 4) of word k // 4; qzeros 4 outputs a word) and compressed-tensors' compressors (naive / int-quantized
int8 codes; pack_to_int32 with q + 2^(bits-1) per field, zero points packed along the outputs). compressed-
tensors' own pack_to_int32 (0.20.0, installed apart from the test environment, 2026-11-27) gave the same
words as `pack_fields` below for 8- and 4-bit codes along either dim, and its unpack_from_int32 +
dequantize the same weights as tiered's readers for the compressed-tensors schemes here, bit for bit (fp32
scales); GPTQModel's dequantize_weight (its 2/4/8-bit branch, transcribed, v1 zeros converted as its
convert_gptq_v1_to_v2_format does) gave the same as tiered's for the GPTQ ones. transformers' loads of these
formats need optimum / gptqmodel / compressed-tensors, which the CPU image lacks.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
import torch

from tiered import kernels

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


def pack_fields(values: torch.Tensor, bits: int) -> torch.Tensor:
    """[R, C] unsigned values < 2^bits -> int32 words [R, ceil(C * bits / 32)], value j of each word at
    bits * j (C padded with zeros)."""
    per = 32 // bits
    R, C = values.shape
    v = torch.nn.functional.pad(values.to(torch.int64), (0, -C % per)).reshape(R, -1, per)
    words = sum(v[..., j] << (bits * j) for j in range(per))
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def quantize(w: torch.Tensor, group: int, bits: int, symmetric: bool, scale_dtype=torch.float16):
    """w [N, K] -> (codes [N, K] in 0..2^bits - 1, zero [N, G] in 0..2^bits - 1, scale [N, G] in
    `scale_dtype`) with w ~ (codes - zero) * scale (unsigned codes: GPTQ's; a signed scheme's are codes -
    2^(bits-1))."""
    N, K = w.shape
    top, mid = 2**bits - 1, 2 ** (bits - 1)
    g = w.reshape(N, K // group, group)
    if symmetric:
        scale = (g.abs().amax(-1) / (mid - 0.5)).clamp_min(1e-8).to(scale_dtype)
        zero = torch.full(scale.shape, mid)
    else:
        lo, hi = g.amin(-1), g.amax(-1)
        scale = ((hi - lo) / top).clamp_min(1e-8).to(scale_dtype)
        zero = (-lo / scale.float()).round().clamp(0, top).long()
    codes = (g / scale.float()[..., None] + zero[..., None]).round().clamp(0, top).long()
    return codes.reshape(N, K), zero, scale


def encoded(codes, zero, scale) -> torch.Tensor:
    """The weight fp32 [N, K] that (codes - zero) * scale gives, per group of K / G inputs."""
    N, K = codes.shape
    G = zero.shape[1]
    return ((codes.reshape(N, G, -1) - zero[..., None]).float() * scale.float()[..., None]).reshape(N, K)


# scheme -> (quantization_config, group (-1: per channel), bits, symmetric)
SCHEMES = {
    "gptq8": ({"quant_method": "gptq", "bits": 8, "group_size": 128, "desc_act": False, "sym": False,
               "checkpoint_format": "gptq"}, 128, 8, False),
    "gptq8_v2": ({"quant_method": "gptq", "bits": 8, "group_size": 128, "desc_act": False, "sym": False,
                  "checkpoint_format": "gptq_v2"}, 128, 8, False),
    "gptq8_channel": ({"quant_method": "gptq", "bits": 8, "group_size": -1, "desc_act": False, "sym": True},
                      -1, 8, True),
    "w8a8": ({"quant_method": "compressed-tensors", "format": "int-quantized", "ignore": ["lm_head"],
              "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                  "num_bits": 8, "type": "int", "strategy": "channel", "symmetric": True, "dynamic": False},
                  "input_activations": {"num_bits": 8, "type": "int", "strategy": "tensor", "symmetric": True,
                                        "dynamic": False}}}}, -1, 8, True),
    "w8a8_group_asym": ({"quant_method": "compressed-tensors", "format": "int-quantized", "ignore": ["lm_head"],
                         "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                             "num_bits": 8, "type": "int", "strategy": "group", "group_size": 128,
                             "symmetric": False}, "input_activations": {
                             "num_bits": 8, "type": "int", "strategy": "token", "dynamic": True}}}}, 128, 8, False),
    "w8a16_packed": ({"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"],
                      "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                          "num_bits": 8, "type": "int", "strategy": "channel", "symmetric": True}}}}, -1, 8, True),
    "w8a16_packed_asym": ({"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"],
                           "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                               "num_bits": 8, "type": "int", "strategy": "group", "group_size": 128,
                               "symmetric": False}}}}, 128, 8, False),
    "w4a16_asym": ({"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"],
                    "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                        "num_bits": 4, "type": "int", "strategy": "group", "group_size": 128,
                        "symmetric": False}}}}, 128, 4, False),
}
ROW_SCHEMES = ("gptq8_channel", "w8a8", "w8a16_packed")  # symmetric per channel: tiered's int8 as stored


def packed_tensors(w: torch.Tensor, scheme: str) -> tuple[dict, torch.Tensor]:
    """One projection's tensors in `scheme`'s layout (suffix -> tensor) and the weight they encode, fp32."""
    N, K = w.shape
    _, group, bits, symmetric = SCHEMES[scheme]
    group = K if group < 0 else group
    gptq = scheme.startswith("gptq")
    codes, zero, scale = quantize(w, group, bits, symmetric, torch.float16 if gptq else torch.bfloat16)
    ref = encoded(codes, zero, scale)
    mid = 2 ** (bits - 1)
    if gptq:  # qweight [K/4, N]: word [k // 4, n] holds input k at bits 8 (k % 4); qzeros [G, N/4]
        stored_zero = zero if scheme == "gptq8_v2" else (zero - 1) & 0xFF
        return {"qweight": pack_fields(codes.T.reshape(K // 4, 4, N).permute(0, 2, 1).reshape(K // 4, -1), 8)
                .reshape(K // 4, N),
                "qzeros": pack_fields(stored_zero.T.contiguous(), 8), "scales": scale.T.contiguous(),
                "g_idx": (torch.arange(K) // group).to(torch.int32)}, ref
    q, zp = codes - mid, zero - mid  # compressed-tensors' signed codes and zero points
    out = {"weight_scale": scale}
    if scheme.startswith("w8a8"):
        out["weight"] = q.to(torch.int8)
        out["input_scale"] = torch.tensor([0.02], dtype=torch.bfloat16)  # static activation scale: dropped
        if not symmetric:
            out["weight_zero_point"] = zp.to(torch.int8)
            out["input_zero_point"] = torch.tensor([0], dtype=torch.int8)
    else:
        out["weight_packed"] = pack_fields(codes, bits)  # q + 2^(bits-1) per field, along the inputs
        out["weight_shape"] = torch.tensor([N, K])
        if not symmetric:  # packed along the outputs
            out["weight_zero_point"] = pack_fields(zero.T.contiguous(), bits).T.contiguous()
    return out, ref


def write_scheme(src: Path, dst: Path, scheme: str) -> tuple[Path, Path]:
    """`src` with every decoder projection quantized as `scheme` (dst), and the weights those codes encode as
    a plain fp32 checkpoint (dst-dequantized): the oracle's."""
    def quantize(name, w):
        parts = name.split(".")
        if ".layers." in name and parts[-1] == "weight" and parts[-2] in LINEARS and w.dim() == 2:
            return packed_tensors(w.float(), scheme)
        return None
    return write_quantized(src, dst, SCHEMES[scheme][0], quantize)


@pytest.fixture(scope="module")
def zoo(tmp_path_factory) -> QuantZoo:
    # widths of a multiple of 128 (groups of 128 over their inputs)
    return QuantZoo(tmp_path_factory.mktemp("int8ckpt"), write_scheme, "llama_wide",
                    hidden_size=256, moe_intermediate_size=256, intermediate_size=256)


def prompt(n: int = 12, seed: int = 0) -> list[int]:
    return prompt_ids(VOCAB, n, seed)


def test_pack_fields_is_the_documented_layout():
    """The writers' packing, against words written out by hand: 8-bit field j at bits 8j, 4-bit at 4j."""
    assert pack_fields(torch.tensor([[1, 2, 128, 255, 7]]), 8).tolist() == [[0xFF800201 - 2**32, 7]]
    assert pack_fields(torch.tensor([[1, 2, 3, 4, 5, 6, 7, 15]]), 4).tolist() == [[0xF7654321 - 2**32]]


@pytest.mark.parametrize("scheme", SCHEMES)
def test_weights_unpack_to_the_encoded_values(zoo, scheme):
    from safetensors.torch import load_file

    path, ref_dir = zoo.get("llama_wide", scheme)
    ref = load_file(str(ref_dir / "model.safetensors"))
    ckpt = open_checkpoint(path)
    int4 = scheme == "w4a16_asym"
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.down_proj.weight"):
        h = ckpt.handle(name)
        assert h.format == ("INT4" if int4 else "INT8") and h.shape == tuple(ref[name].shape)
        assert torch.equal(h.load(torch.float32), ref[name])
        if int4:  # asymmetric 4-bit: tiered's int4 groups of 32, the same weight
            codes, scale, zero = h.int4_parts(32)
            N, K = h.shape
            w = ((codes.float() - 8).view(N, K // 32, 32) * scale[..., None] + zero[..., None]).view(N, K)
            assert torch.equal(w, ref[name])
        elif scheme in ROW_SCHEMES:
            q, s = h.int8_parts()
            assert h.int8_per_row and q.dtype == torch.int8 and s.shape == (h.shape[0],)
            assert torch.equal(q.float() * s[:, None], ref[name])
        else:
            assert not h.int8_per_row and h.int8_group == 128
            with pytest.raises(ValueError):
                h.int8_parts()
    assert not any(n.endswith((".qweight", ".qzeros", ".scales", ".g_idx", "weight_packed", "weight_scale",
                               "weight_zero_point", "input_scale", "input_zero_point")) for n in ckpt.names())


@pytest.mark.parametrize("scheme", SCHEMES)
def test_dense_model_equals_transformers(zoo, scheme):
    path, _ = zoo.get("llama_wide", scheme)
    llm = LLM(path, EngineConfig(max_context=32, decode_weights="fp32", dtype="float32", accelerator="none"))
    ids = prompt()
    assert rel(llm.logits(ids), hf_logits(zoo.hf("llama_wide", scheme), ids)) <= REL_TOL


@pytest.mark.parametrize("scheme", SCHEMES)
def test_moe_model_equals_transformers(zoo, scheme):
    """Every projection, the routed experts' too, dequantized exactly: transformers' logits to 1e-4."""
    path, _ = zoo.get("qwen3_moe", scheme)
    llm = LLM(path, EngineConfig(max_context=32, decode_weights="fp32", dtype="float32", expert_weights="fp32",
                                 accelerator="none"))
    ids = prompt()
    assert rel(llm.logits(ids), hf_logits(zoo.hf("qwen3_moe", scheme), ids)) <= REL_TOL


@pytest.mark.parametrize("scheme", ROW_SCHEMES)
def test_cpu_decode_copies_hold_the_codes(zoo, scheme):
    """Symmetric int8 per channel is tiered's per-row int8: the CPU's default engine keeps each projection's
    checkpoint codes, bit for bit, as its decode copy (fused q/k/v and gate/up side by side), and decodes like
    transformers on the encoded weights."""
    from tiered.eval.kl import kl_divergence
    from tiered.quant.int8 import Int8Linear

    path, _ = zoo.get("llama_wide", scheme)
    ckpt = open_checkpoint(path)
    auto = LLM(path, EngineConfig(max_context=32, accelerator="none"))
    assert auto.plan.precision == "int8" and not any("re-quantized" in n for n in auto.plan.notes)
    mods = {n: m for n, m in auto.model.named_modules() if isinstance(m, Int8Linear)}
    assert len(mods) == 2 * 4  # per layer: q/k/v, o, gate/up, down
    layer = auto.model.model.layers[1]
    fused = layer.self_attn.q_proj.decode.shared.fused
    want = torch.cat([ckpt.handle(f"model.layers.1.self_attn.{p}.weight").int8_parts()[0]
                      for p in ("q_proj", "k_proj", "v_proj")])
    assert isinstance(fused, Int8Linear) and torch.equal(fused.q, want)
    down = layer.mlp.down_proj.decode
    q, s = ckpt.handle("model.layers.1.mlp.down_proj.weight").int8_parts()
    assert torch.equal(down.q, q) and torch.equal(down.scale, s.to(torch.bfloat16))
    ids = prompt(16)
    ref = hf_logits(zoo.hf("llama_wide", scheme), ids)
    kl = kl_divergence(ref[7:], stepwise_logits(auto, ids, 8))
    assert float(kl.max()) < 2e-3, kl


def test_grouped_int8_decode_copies_are_requantized_and_noted(zoo):
    """Grouped, asymmetric int8 has no per-row codes: the decode copies re-quantize it per row, and the plan
    says so."""
    from tiered.eval.kl import kl_divergence

    path, _ = zoo.get("llama_wide", "w8a8_group_asym")
    auto = LLM(path, EngineConfig(max_context=32, accelerator="none"))
    assert auto.plan.precision == "int8"
    assert any("re-quantized per row" in n for n in auto.plan.notes), auto.plan.notes
    ids = prompt(16)
    kl = kl_divergence(hf_logits(zoo.hf("llama_wide", "w8a8_group_asym"), ids)[7:], stepwise_logits(auto, ids, 8))
    # one scale a row over these random weights: ~0.7% of a weight matrix's norm against the codes' values
    # (int8 per 32: 0.5%, bf16: 0.16%); measured 4.2e-3 at most (the codes as stored per row, w8a8: 5.5e-4)
    assert float(kl.max()) < 1e-2, kl


@pytest.mark.parametrize("scheme", ["gptq8_channel", "w8a8"])
def test_moe_experts_stay_int8(zoo, scheme):
    """Routed experts of symmetric per-channel int8 keep their codes as tiered's "int8" expert kind (the
    scale in bf16: exact for compressed-tensors' bf16 scales), in every mode that keeps them as stored."""
    from tiered.memory.expert_store import expert_tensor_names, moe_layers
    from tiered.quant.experts import ExpertFormat
    from tiered.quant.gguf_experts import encode_expert, requantized_note, stored_format

    path, _ = zoo.get("qwen3_moe", scheme)
    ckpt = open_checkpoint(path)
    hs = [ckpt.handle(n) for n in expert_tensor_names(ckpt.config.model_type, moe_layers(ckpt, ckpt.config)[0], 1)]
    assert stored_format(hs) == "int8"
    for layout in ("cpu", "tiled"):
        fmt = ExpertFormat("int8", [h.shape for h in hs], int4_layout=layout)
        assert requantized_note(hs, fmt) is None
        for w, h in zip(fmt.dequantize(encode_expert(fmt, hs)), hs):
            q, s = h.int8_parts()
            assert torch.equal(w, q.float() * s.to(torch.bfloat16).float()[:, None])
    ids = prompt()
    ref = hf_logits(zoo.hf("qwen3_moe", scheme), ids)
    # a prompt's tiled int8 expert calls of 2+ rows read int8 activations with tiered's kernels (Plan.batch_act
    # "q8", as int4's do; 5.6e-3 / 6.6e-3 measured, 2026-12-05): 1e-2 there, 5e-3 on int16 ones
    tol = 1e-2 if kernels.available() else 5e-3
    llm = LLM(path, EngineConfig(max_context=32, decode_weights="fp32", accelerator="none"))
    assert llm.plan.dtypes["experts"] == "int8"
    assert rel(llm.logits(ids), ref) < tol
    exact = LLM(path, EngineConfig(max_context=32, decode_weights="fp32", accelerator="none", batch_activations="bf16"))
    assert rel(exact.logits(ids), ref) < 5e-3
    host = LLM(path, EngineConfig(max_context=32, decode_weights="fp32", accelerator="host"))  # the strict stand-in
    assert host.plan.dtypes["experts"] == "int8"
    assert rel(host.logits(ids), ref) < tol


def test_grouped_moe_experts_load_dequantized(zoo):
    """Grouped or asymmetric int8 experts have no stored expert kind: they take the compute format, each
    weight dequantized exactly, noted as mapped exactly."""
    from tiered.memory.expert_store import expert_tensor_names, moe_layers
    from tiered.quant.gguf_experts import stored_format

    path, _ = zoo.get("qwen3_moe", "w8a16_packed_asym")
    ckpt = open_checkpoint(path)
    hs = [ckpt.handle(n) for n in expert_tensor_names(ckpt.config.model_type, moe_layers(ckpt, ckpt.config)[0], 1)]
    assert stored_format(hs) is None
    llm = LLM(path, EngineConfig(max_context=32, decode_weights="fp32", dtype="float32", accelerator="none"))
    assert llm.plan.dtypes["experts"] == "fp32"
    assert any("mapped exactly" in n for n in llm.plan.notes), llm.plan.notes
    ids = prompt()
    assert rel(llm.logits(ids), hf_logits(zoo.hf("qwen3_moe", "w8a16_packed_asym"), ids)) <= REL_TOL


def test_moe_bytes_count_the_stored_tensors(zoo):
    """A checkpoint's bytes are its files' tensors: codes, scales and zero points once each."""
    from safetensors import safe_open

    path, _ = zoo.get("qwen3_moe", "gptq8")
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        stored = sum(f.get_tensor(k).nbytes for k in f.keys())
    assert open_checkpoint(path).nbytes() == stored


def _edit(zoo, tmp_path, scheme, config=None, tensors=None) -> Path:
    return edited(zoo.get("llama_wide", scheme)[0], tmp_path / "edited", config, tensors)


def _act_order(zoo, tmp_path, scheme: str) -> tuple[Path, Path]:
    """`scheme` (gptq8 or w8a8_group_asym) re-quantized with act-order groups: input k in group g_idx[k] of a
    random permutation's order; the checkpoint and its dequantized reference."""
    from safetensors.torch import load_file, save_file

    gptq = scheme == "gptq8"
    path = _edit(zoo, tmp_path, scheme, config=(lambda q: q.update(desc_act=True)) if gptq else None)
    ref_dir = tmp_path / "reference"
    shutil.copytree(zoo.get("llama_wide", scheme)[1], ref_dir)
    t, ref = load_file(str(path / "model.safetensors")), load_file(str(ref_dir / "model.safetensors"))
    g = torch.Generator().manual_seed(3)
    suffix = ".qweight" if gptq else ".weight_scale"
    for base in [k[:-len(suffix)] for k in t if k.endswith(suffix)]:
        w = ref[base + ".weight"]
        N, K = w.shape
        g_idx = torch.argsort(torch.randperm(K, generator=g)) // 128
        codes = torch.empty(N, K, dtype=torch.long)
        zeros, scales = [], []
        for grp in range(K // 128):
            cols = (g_idx == grp).nonzero().flatten()
            c, z, s = quantize(w[:, cols], len(cols), 8, False, torch.float16 if gptq else torch.bfloat16)
            codes[:, cols] = c
            zeros.append(z[:, 0])
            scales.append(s[:, 0])
        zero, scale = torch.stack(zeros, 1), torch.stack(scales, 1)  # [N, G]
        ref[base + ".weight"] = (codes - zero[:, g_idx]).float() * scale[:, g_idx].float()
        if gptq:
            t[base + ".qweight"] = pack_fields(codes.T.reshape(K // 4, 4, N).permute(0, 2, 1).reshape(K // 4, -1),
                                               8).reshape(K // 4, N)
            t[base + ".qzeros"] = pack_fields(((zero - 1) & 0xFF).T.contiguous(), 8)
            t[base + ".scales"], t[base + ".g_idx"] = scale.T.contiguous(), g_idx.to(torch.int32)
        else:
            t[base + ".weight"] = (codes - 128).to(torch.int8)
            t[base + ".weight_zero_point"] = (zero - 128).to(torch.int8)
            t[base + ".weight_scale"], t[base + ".weight_g_idx"] = scale, g_idx.to(torch.int32)
    save_file(t, str(path / "model.safetensors"), metadata={"format": "pt"})
    save_file(ref, str(ref_dir / "model.safetensors"), metadata={"format": "pt"})
    return path, ref_dir


@pytest.mark.parametrize("scheme", ["gptq8", "w8a8_group_asym"])
def test_act_order_loads_through_g_idx(zoo, tmp_path, scheme):
    """GPTQ's desc_act / compressed-tensors' weight_g_idx: groups in a permutation's order load dequantized
    through g_idx, exactly."""
    from safetensors.torch import load_file

    path, ref_dir = _act_order(zoo, tmp_path, scheme)
    name = "model.layers.1.mlp.down_proj.weight"
    h = open_checkpoint(path).handle(name)
    assert h.format == "INT8" and h.int8_group == 0
    assert torch.equal(h.load(torch.float32), load_file(str(ref_dir / "model.safetensors"))[name])
    llm = LLM(path, EngineConfig(max_context=32, decode_weights="fp32", dtype="float32", accelerator="none"))
    ids = prompt()
    assert rel(llm.logits(ids), hf_logits(load_hf_model(ref_dir), ids)) <= REL_TOL


def test_gptq_g_idx_without_desc_act_is_refused(zoo, tmp_path):
    def shuffle(t):
        k = "model.layers.0.self_attn.o_proj.g_idx"
        t[k] = t[k].flip(0).contiguous()
    h = open_checkpoint(_edit(zoo, tmp_path, "gptq8", tensors=shuffle)).handle("model.layers.0.self_attn.o_proj.weight")
    with pytest.raises(CheckpointError, match="desc_act"):
        h.load()


def _ct_weights(q):
    return q["config_groups"]["group_0"]["weights"]


@pytest.mark.parametrize("scheme, change, words", [
    ("gptq8", lambda q: q.update(bits=3), ("3-bit", "4- and 8-bit")),
    ("gptq8", lambda q: q.update(bits=2), ("2-bit",)),
    ("gptq8", lambda q: q.update(checkpoint_format="marlin"), ("marlin", "gptq_v2")),
    ("gptq8", lambda q: q.update(pack_dtype="int16"), ("int16", "int32 words")),
    ("w8a8", lambda q: _ct_weights(q).update(num_bits=4), ("int-quantized", "8-bit integer")),
    ("w8a8", lambda q: _ct_weights(q).update(strategy="block", block_structure=[128, 128]), ("block", "per tensor")),
    ("w8a8", lambda q: q.update(sparsity_config={"format": "sparse-24-bitmask"}), ("sparse",)),
    ("w8a16_packed", lambda q: q["config_groups"].update(group_1={"targets": ["re:.*mlp.*"], "weights": {
        "num_bits": 4, "type": "int", "strategy": "group", "group_size": 128}}), ("mix", "bits")),
])
def test_unsupported_schemes_are_refused(zoo, tmp_path, scheme, change, words):
    with pytest.raises(UnsupportedModelError) as e:
        open_checkpoint(_edit(zoo, tmp_path, scheme, config=change))
    assert all(w in str(e.value) for w in words), str(e.value)


def test_damaged_tensors_are_refused(zoo, tmp_path):
    base = "model.layers.0.self_attn.o_proj"

    def put(name, value):
        return lambda t: t.__setitem__(base + name, value(t[base + name]))
    cases = [
        ("gptq8", lambda t: t.pop(base + ".qzeros"), r"lacks tensor .*o_proj.qzeros"),
        ("gptq8", put(".scales", lambda s: s[:, :8].contiguous()), r"o_proj's 8-bit gptq tensors disagree"),
        ("gptq8", put(".scales", lambda s: s.to(torch.int32)), r"o_proj.scales.* stored as I32"),
        ("w8a8", lambda t: t.pop(base + ".weight_scale"), r"lacks tensor .*o_proj.weight_scale"),
        ("w8a8", put(".weight_scale", lambda s: s[:8].contiguous()), r"o_proj.weight_scale.* shape \(8, 1\)"),
        ("w8a8_group_asym", put(".weight_zero_point", lambda z: z[:, :1].contiguous()),
         r"o_proj.weight_zero_point.* not the zero points"),
        ("w8a16_packed", put(".weight_packed", lambda p: p[:, :8].contiguous()), r"o_proj's int8 tensors disagree"),
        ("w4a16_asym", put(".weight_zero_point", lambda z: z[:8].contiguous()), r"o_proj.weight_zero_point is I32"),
    ]
    for i, (scheme, damage, match) in enumerate(cases):
        with pytest.raises(CheckpointError, match=match):
            open_checkpoint(_edit(zoo, tmp_path / str(i), scheme, tensors=damage))


def test_symmetric_config_with_wide_codes_is_refused_on_read(zoo, tmp_path):
    """A config that says symmetric over codes that do not fit int8 about their zero: refused when the codes
    are read as tiered's int8."""
    def shift(t):
        t["model.layers.0.self_attn.o_proj.qzeros"] = pack_fields(torch.zeros(1, 256, dtype=torch.long), 8)
    path = _edit(zoo, tmp_path, "gptq8_channel", tensors=shift)
    h = open_checkpoint(path).handle("model.layers.0.self_attn.o_proj.weight")
    with pytest.raises(CheckpointError, match="leave -128..127"):
        h.int8_parts()


def test_info_names_the_schemes(zoo):
    from typer.testing import CliRunner

    from tiered.cli import app

    res = CliRunner().invoke(app, ["info", str(zoo.get("llama_wide", "w8a8")[0])])
    assert res.exit_code == 0, res.output
    assert "INT8 x14" in res.output and "int8:        per output channel, kept as stored x14" in res.output
    res = CliRunner().invoke(app, ["info", str(zoo.get("llama_wide", "gptq8")[0])])
    assert "int8:        groups of 128 (dequantized) x14" in res.output, res.output
