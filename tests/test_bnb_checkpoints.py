"""bitsandbytes safetensors checkpoints (quant_method "bitsandbytes"): 4-bit NF4 and FP4, with and without
double quantization, and 8-bit LLM.int8, written here by a serializer that shares no code with tiered's
reader (checkpoint/bnb.py), from the published layout (bitsandbytes' QuantState.as_dict(packed=True) and
Linear8bitLt._save_to_state_dict), against transformers on the weights those codes encode (dequantized
here in fp32). transformers' own load of these directories needs bitsandbytes, which the CPU image lacks.

Checked against bitsandbytes 0.50.2 itself (CPU, in a separate environment, 2026-11-27): for weights
quantized by its quantize_4bit (nf4 and fp4, blocksizes 32 / 64 / 128, with and without
compress_statistics, uint8 and bf16 quant_storage) and int8_vectorwise_quant, the reader's fp32 weights
equal its dequantize_4bit / int8_vectorwise_dequant bit for bit (and, rounded to bf16, its bf16 ones);
Linear4bit / Linear8bitLt state dicts have exactly the tensors written below; this serializer's dynamic
map equals create_dynamic_map, and its codes and absmax equal quantize_4bit's (FP4: up to the code of a
zero, where bitsandbytes writes 0 or -0 by its own order and this writer always 0). One exception found
there: bitsandbytes' native CPU dequantize_4bit kernel treats blocks as per row when in_features is not
a multiple of the blocksize, where its quantizer, its CUDA kernel and its torch reference
(backends/default/ops.py) run blocks over the flat weight; tiered reads them flat.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from fixtures import hf_logits, prompt_ids, stepwise_logits  # noqa: E402
from fixtures import max_rel_err as rel  # noqa: E402
from moe_fixtures import VOCAB  # noqa: E402
from quant_fixtures import QuantZoo, edited, write_quantized  # noqa: E402

from tiered import LLM, EngineConfig  # noqa: E402
from tiered.checkpoint import open_checkpoint  # noqa: E402
from tiered.errors import CheckpointError, UnsupportedModelError  # noqa: E402

REL_TOL = 1e-4

# ---- the serializer: bitsandbytes' published format --------------------------------------------------
# NF4 (QLoRA, Dettmers et al. 2023): quantiles of N(0, 1) normalized to [-1, 1]
NF4_VALUES = [-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
              -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
              0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
              0.7229568362236023, 1.0]
# bitsandbytes' FP4 by code: sign bit 3, then 2 exponent bits (bias 2) and 1 mantissa bit; divided by 12
FP4_VALUES = [0, 0.0625, 8, 12, 4, 6, 2, 3, -0.0, -0.0625, -8, -12, -4, -6, -2, -3]


def table(quant_type: str) -> torch.Tensor:
    v = torch.tensor(NF4_VALUES if quant_type == "nf4" else FP4_VALUES, dtype=torch.float32)
    return v / v.abs().max()


def dynamic_map() -> torch.Tensor:
    """bitsandbytes' signed 8-bit dynamic map (Dettmers 2016, "8-Bit Approximations for Parallelism in Deep
    Learning"): for exponent e = 0..6, 2^e fractions at the midpoints of 2^e equal steps in [0.1, 1],
    scaled by 10^(e - 6), with both signs; then 0 and 1; sorted. fp32 [256]."""
    vals = [0.0, 1.0]
    for e in range(7):
        edges = torch.linspace(0.1, 1, 2 ** e + 1, dtype=torch.float32)
        mids = (edges[1:] + edges[:-1]) / 2
        vals += (10.0 ** (e - 6) * mids).tolist() + (-(10.0 ** (e - 6)) * mids).tolist()  # products in fp32
    return torch.tensor(sorted(vals), dtype=torch.float32)


def nearest(x: torch.Tensor, codebook: torch.Tensor) -> torch.Tensor:
    """Index of the codebook entry nearest each x (ties: the first, so FP4's zero is code 0, never -0's 8)."""
    return (x.reshape(-1, 1) - codebook.reshape(1, -1)).abs().argmin(dim=1)


def per_block(x: torch.Tensor, scales: torch.Tensor, blocksize: int, op) -> torch.Tensor:
    """op(x[i], scales[i // blocksize]) over the flat x."""
    idx = torch.arange(x.numel()) // blocksize
    return op(x.reshape(-1), scales[idx])


def serialize_4bit(w: torch.Tensor, quant_type: str, double: bool, blocksize: int = 64,
                   nested_blocksize: int = 256) -> tuple[dict, torch.Tensor]:
    """One Linear4bit's state dict entries (suffix after the module -> tensor) for w [N, K], and the fp32
    weight the codes encode."""
    N, K = w.shape
    flat = w.reshape(-1).float()
    n = flat.numel()
    blocks = -(-n // blocksize)
    absmax = torch.stack([flat[b * blocksize:(b + 1) * blocksize].abs().max() for b in range(blocks)])
    codes = nearest(per_block(flat, absmax, blocksize, torch.div), table(quant_type))
    if n % 2:  # the last byte's low nibble: the code of 0
        codes = torch.cat([codes, nearest(torch.zeros(1), table(quant_type))])
    packed = (codes[0::2] * 16 + codes[1::2]).to(torch.uint8).reshape(-1, 1)  # first of a pair: high nibble
    state = {"quant_type": quant_type, "blocksize": blocksize, "dtype": "float32", "shape": [N, K]}
    out = {"weight": packed, "weight.quant_map": table(quant_type)}
    if double:
        offset = absmax.mean()
        centred = absmax - offset
        nb = -(-blocks // nested_blocksize)
        nabs = torch.stack([centred[b * nested_blocksize:(b + 1) * nested_blocksize].abs().max() for b in range(nb)])
        dmap = dynamic_map()
        acodes = nearest(per_block(centred, nabs, nested_blocksize, torch.div), dmap)
        absmax = per_block(dmap[acodes], nabs, nested_blocksize, torch.mul) + offset  # what the codes give
        out.update({"weight.absmax": acodes.to(torch.uint8), "weight.nested_absmax": nabs,
                    "weight.nested_quant_map": dmap})
        state.update(nested_blocksize=nested_blocksize, nested_dtype="float32", nested_offset=offset.item())
    else:
        out["weight.absmax"] = absmax
    out[f"weight.quant_state.bitsandbytes__{quant_type}"] = torch.tensor(list(json.dumps(state).encode()),
                                                                          dtype=torch.uint8)
    ref = per_block(table(quant_type)[codes[:n]], absmax, blocksize, torch.mul).reshape(N, K)
    return out, ref


def serialize_int8(w: torch.Tensor) -> tuple[dict, torch.Tensor]:
    """One Linear8bitLt's state dict entries for w [N, K] (LLM.int8, Dettmers et al. 2022), and the fp32
    weight the codes encode, (q * SCB) / 127 as bitsandbytes computes it."""
    scb = w.float().abs().amax(dim=1)
    q = torch.round(w.float() * (127.0 / scb[:, None])).clamp(-127, 127).to(torch.int8)
    ref = (q.float() * scb[:, None]) * torch.tensor(1 / 127, dtype=torch.float32)
    return {"weight": q, "SCB": scb, "weight_format": torch.tensor(0, dtype=torch.uint8)}, ref


SCHEMES = {  # name -> (bits, quant_type, double quantization, blocksize)
    "nf4": (4, "nf4", False, 64), "nf4-dq": (4, "nf4", True, 64), "fp4": (4, "fp4", False, 128),
    "fp4-dq": (4, "fp4", True, 64), "int8": (8, None, False, None)}


def quantization_config(scheme: str) -> dict:
    bits, qt, dq, _ = SCHEMES[scheme]
    return {"quant_method": "bitsandbytes", "load_in_4bit": bits == 4, "load_in_8bit": bits == 8,
            "_load_in_4bit": bits == 4, "_load_in_8bit": bits == 8, "bnb_4bit_quant_type": qt or "fp4",
            "bnb_4bit_use_double_quant": dq, "bnb_4bit_compute_dtype": "float32", "bnb_4bit_quant_storage": "uint8",
            "llm_int8_threshold": 6.0, "llm_int8_skip_modules": None, "llm_int8_has_fp16_weight": False,
            "llm_int8_enable_fp32_cpu_offload": False}


def quantized(name: str, w: torch.Tensor) -> bool:
    """The Linear weights transformers hands to bitsandbytes: every decoder-layer matrix (projections,
    experts, routers); the lm_head and embeddings stay dense."""
    return ".layers." in name and name.endswith(".weight") and w.dim() == 2


def write_bnb(src: Path, dst: Path, scheme: str) -> tuple[Path, Path]:
    """`src` with every decoder Linear in `scheme` (dst), and the weights the codes encode as a plain fp32
    checkpoint (dst-dequantized), the oracle's."""
    bits, qt, dq, bs = SCHEMES[scheme]

    def quantize(name, w):
        if not quantized(name, w):
            return None
        return serialize_4bit(w, qt, dq, bs) if bits == 4 else serialize_int8(w)
    return write_quantized(src, dst, quantization_config(scheme), quantize)


@pytest.fixture(scope="module")
def zoo(tmp_path_factory) -> QuantZoo:
    return QuantZoo(tmp_path_factory.mktemp("bnbckpt"), write_bnb, "llama")


def prompt(n: int = 12, seed: int = 0) -> list[int]:
    return prompt_ids(VOCAB, n, seed)


FORMAT = {"nf4": "BNB_NF4", "nf4-dq": "BNB_NF4", "fp4": "BNB_FP4", "fp4-dq": "BNB_FP4", "int8": "INT8"}


@pytest.mark.parametrize("scheme", tuple(SCHEMES))
def test_weights_dequantize_to_the_encoded_values(zoo, scheme):
    from safetensors import safe_open
    from safetensors.torch import load_file

    path, ref_dir = zoo.get("llama", scheme)
    ref = load_file(str(ref_dir / "model.safetensors"))
    ckpt = open_checkpoint(path)
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        stored = {k: f.get_slice(k).get_shape() for k in f.keys()}
    for name in ("model.layers.0.self_attn.k_proj.weight", "model.layers.1.mlp.down_proj.weight"):
        h = ckpt.handle(name)
        assert h.format == FORMAT[scheme] and h.shape == tuple(ref[name].shape)
        assert torch.equal(h.load(torch.float32), ref[name])  # the same fp32 products, bit for bit
        base = name[:-len(".weight")]
        pieces = [k for k in stored if k == name or k.startswith(name + ".") or k in (base + ".SCB", base + ".weight_format")]
        with safe_open(str(path / "model.safetensors"), "pt") as f:
            assert h.nbytes == sum(f.get_tensor(k).numel() * f.get_tensor(k).element_size() for k in pieces)
    assert not any(".absmax" in n or ".quant_" in n or n.endswith((".SCB", ".weight_format")) for n in ckpt.names())
    assert ckpt.handle("lm_head.weight").format == "F32"  # not quantized: stays dense


def test_odd_shapes_cross_blocks(tmp_path):
    """Blocks run over the flat weight (across rows), the last one partial, an odd element count (the last
    byte's low nibble is padding), and several nested blocks of absmax codes."""
    from tiered.checkpoint.bnb import fold
    from tiered.checkpoint.handle import TensorHandle

    torch.manual_seed(5)
    w = torch.randn(7, 37)  # 259 elements: 5 blocks of 64 (the last of 3), 130 bytes
    for qt in ("nf4", "fp4"):
        parts, ref = serialize_4bit(w, qt, double=True, blocksize=64, nested_blocksize=2)
        fmt = {torch.uint8: "U8", torch.float32: "F32"}
        handles = {f"m.{k}": TensorHandle(name=f"m.{k}", shape=tuple(t.shape), format=fmt[t.dtype],
                                          nbytes=t.numel() * t.element_size(), path="-", _load=lambda t=t: t.clone())
                   for k, t in parts.items()}
        fold(handles, quantization_config("nf4-dq"), "test")
        assert list(handles) == ["m.weight"] and handles["m.weight"].shape == (7, 37)
        assert torch.equal(handles["m.weight"].load(), ref)
        assert (ref - w).abs().max() < 0.2 * w.abs().max()


@pytest.mark.parametrize("scheme", tuple(SCHEMES))
def test_dense_model_equals_transformers(zoo, scheme):
    path, _ = zoo.get("llama", scheme)
    llm = LLM(path, EngineConfig(max_context=32, decode_weights="fp32", dtype="float32", accelerator="none"))
    ids = prompt()
    assert rel(llm.logits(ids), hf_logits(zoo.hf("llama", scheme), ids)) <= REL_TOL


def test_cpu_decode_4bit_on_bf16_copies(zoo):
    """4-bit weights have no tiered kernel: "auto" decode copies are the dequantized weights in bf16."""
    from tiered.eval.kl import kl_divergence

    path, _ = zoo.get("llama", "nf4-dq")
    auto = LLM(path, EngineConfig(max_context=32, accelerator="none"))
    assert auto.plan.precision == "bf16"
    ids = prompt(16)
    kl = kl_divergence(hf_logits(zoo.hf("llama", "nf4-dq"), ids)[7:], stepwise_logits(auto, ids, 8))
    assert float(kl.max()) < 1e-3, kl


def test_cpu_decode_int8_keeps_the_codes(zoo):
    """LLM.int8 is tiered's per-row int8: the default CPU engine's decode copies hold the checkpoint's codes
    bit for bit (fused q/k/v and gate/up side by side), scales SCB / 127 rounded to bf16."""
    from safetensors.torch import load_file

    from tiered.eval.kl import kl_divergence
    from tiered.quant.int8 import Int8Linear

    path, _ = zoo.get("llama", "int8")
    t = load_file(str(path / "model.safetensors"))
    auto = LLM(path, EngineConfig(max_context=32, accelerator="none"))
    assert auto.plan.precision == "int8"
    copies = [m for m in auto.model.modules() if isinstance(m, Int8Linear)]
    groups = [("q_proj", "k_proj", "v_proj"), ("o_proj",), ("gate_proj", "up_proj"), ("down_proj",)]
    want = []
    for layer in range(2):
        for g in groups:
            sub = "self_attn" if g[0] in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            bases = [f"model.layers.{layer}.{sub}.{p}" for p in g]
            want.append((torch.cat([t[b + ".weight"] for b in bases]),
                         torch.cat([t[b + ".SCB"] for b in bases]) * torch.tensor(1 / 127, dtype=torch.float32)))
    found = [(m.q, m.scale) for m in copies]  # (the fp32 lm_head gets a bf16 copy)
    assert len(found) == len(want)
    for q, s in want:
        assert any(torch.equal(q, fq) and torch.equal(s.to(torch.bfloat16), fs) for fq, fs in found)
    ids = prompt(16)
    kl = kl_divergence(hf_logits(zoo.hf("llama", "int8"), ids)[7:], stepwise_logits(auto, ids, 8))
    assert float(kl.max()) < 1e-3, kl


@pytest.mark.parametrize("scheme", ["nf4-dq", "fp4", "int8"])
def test_moe_equals_transformers(zoo, scheme):
    """Mixtral with every expert, router and attention projection quantized: lossless fp32 experts match
    transformers within 1e-4 in RAM and behind the strict host stand-in; LLM.int8 experts are kept
    int8 as stored under "auto"."""
    from tiered.memory.expert_store import expert_tensor_names, moe_layers
    from tiered.quant.experts import ExpertFormat
    from tiered.quant.gguf_experts import encode_expert, requantized_note, stored_format

    path, _ = zoo.get("mixtral", scheme)
    ckpt = open_checkpoint(path)
    hs = [ckpt.handle(n) for n in expert_tensor_names(ckpt.config.model_type, moe_layers(ckpt, ckpt.config)[0], 1)]
    assert {h.format for h in hs} == {FORMAT[scheme]}
    ids = prompt()
    ref = hf_logits(zoo.hf("mixtral", scheme), ids)
    for acc in ("none", "host"):
        llm = LLM(path, EngineConfig(max_context=32, decode_weights="fp32", dtype="float32", expert_weights="fp32",
                                     accelerator=acc))
        assert rel(llm.logits(ids), ref) <= REL_TOL
    if scheme != "int8":
        assert stored_format(hs) is None  # no tiered expert kind holds NF4 / FP4: the compute format
        assert requantized_note(hs, ExpertFormat("fp32", [h.shape for h in hs])) is None  # dequantized exactly
        assert "BNB" in requantized_note(hs, ExpertFormat("bf16", [h.shape for h in hs]))
        return
    assert stored_format(hs) == "int8"
    fmt = ExpertFormat("int8", [h.shape for h in hs], int4_layout="plain")
    assert requantized_note(hs, fmt) is None
    slot = encode_expert(fmt, hs)
    for v, h in zip(fmt.views(slot), hs):
        assert torch.equal(v["q"], h.int8_parts()[0])  # the checkpoint's codes
    llm = LLM(path, EngineConfig(max_context=32, decode_weights="fp32", accelerator="none"))
    assert llm.plan.dtypes["experts"] == "int8"
    assert rel(llm.logits(ids), ref) < 0.02  # bf16 scales and activations


def _edit(zoo, tmp_path, scheme, tensors=None, config=None) -> Path:
    return edited(zoo.get("llama", scheme)[0], tmp_path / "edited", config, tensors)


BASE = "model.layers.0.self_attn.o_proj"


def _state(t: dict, change, qt: str = "nf4", new_qt: str | None = None) -> None:
    """Rewrite o_proj's quant_state JSON through `change` (and its tensor name's quant_type)."""
    key = f"{BASE}.weight.quant_state.bitsandbytes__{qt}"
    state = json.loads(bytes(t.pop(key).tolist()))
    change(state)
    t[key.replace("__" + qt, "__" + (new_qt or qt))] = torch.tensor(list(json.dumps(state).encode()), dtype=torch.uint8)


@pytest.mark.parametrize("scheme, tensors, error, words", [
    ("nf4-dq", lambda t: t.pop(BASE + ".weight.absmax"), CheckpointError, ("lacks tensor", "o_proj.weight.absmax")),
    ("nf4-dq", lambda t: t.pop(BASE + ".weight.nested_quant_map"), CheckpointError, ("lacks tensor", "nested_quant_map")),
    ("nf4", lambda t: t.pop(BASE + ".weight.quant_state.bitsandbytes__nf4"), CheckpointError,
     ("quant_state", "o_proj.weight")),
    ("nf4", lambda t: _state(t, lambda s: s.update(shape=[64, 32])), CheckpointError,
     ("o_proj.weight", "shape [64, 32]", "bytes")),
    ("nf4", lambda t: _state(t, lambda s: s.update(shape=[4096])), CheckpointError, ("shape [4096]", "Linear weight")),
    ("nf4", lambda t: _state(t, lambda s: s.update(quant_type="af4"), new_qt="af4"), UnsupportedModelError,
     ("'af4'", "nf4 and fp4")),
    ("nf4", lambda t: _state(t, lambda s: s.update(quant_type="fp4")), CheckpointError, ("names quant_type 'nf4'",)),
    ("nf4", lambda t: _state(t, lambda s: s.update(blocksize=0)), CheckpointError, ("blocksize 0",)),
    ("nf4", lambda t: t.__setitem__(BASE + ".weight.absmax", t[BASE + ".weight.absmax"][:-1].clone()),
     CheckpointError, ("absmax", "needs 64")),
    ("int8", lambda t: t.pop(BASE + ".SCB"), CheckpointError, ("lacks tensor", "o_proj.SCB")),
    ("int8", lambda t: t.__setitem__(BASE + ".weight_format", torch.tensor(1, dtype=torch.uint8)), UnsupportedModelError,
     ("'col32'", "row-major")),
    ("int8", lambda t: t.__setitem__(BASE + ".SCB", t[BASE + ".SCB"][:8].clone()), CheckpointError, ("SCB", "64")),
])
def test_malformed_pieces_are_refused(zoo, tmp_path, scheme, tensors, error, words):
    with pytest.raises(error) as e:
        open_checkpoint(_edit(zoo, tmp_path, scheme, tensors=tensors))
    assert all(w in str(e.value) for w in words), str(e.value)
    assert e.value.hint


def test_info_names_the_formats(zoo):
    from typer.testing import CliRunner

    from tiered.cli import app

    res = CliRunner().invoke(app, ["info", str(zoo.get("llama", "nf4-dq")[0])])
    assert res.exit_code == 0, res.output
    assert "BNB_NF4 x14" in res.output, res.output
