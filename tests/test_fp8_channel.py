"""FP8 checkpoints scaled per output channel or per tensor: compressed-tensors' float-quantized
"channel" / "tensor" strategies (RedHatAI's Llama-3.1-70B-Instruct-FP8), fbgemm_fp8 (Meta's
Llama-3.1-405B-Instruct-FP8) and AutoFP8's per-tensor scales, as tiered.bench.checkpoint.
write_fp8_checkpoint writes them.

The oracle is transformers on the same weights dequantized here, independently of tiered (e4m3 value x
its scale, in fp32, written as a plain checkpoint): transformers' own loads of these formats need the
compressed-tensors package or fbgemm-gpu's CUDA kernels.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from fixtures import hf_logits, load_hf_model, prompt_ids, stepwise_logits, write_tiny_checkpoint  # noqa: E402
from fixtures import max_rel_err as rel  # noqa: E402
from moe_fixtures import VOCAB, build_hf_moe_model, load_hf_moe_model  # noqa: E402
from quant_fixtures import edited  # noqa: E402

from tiered import LLM, EngineConfig  # noqa: E402
from tiered.bench.checkpoint import FP8_SCHEMES, write_fp8_checkpoint  # noqa: E402
from tiered.checkpoint import open_checkpoint  # noqa: E402
from tiered.errors import CheckpointError, UnsupportedModelError  # noqa: E402
from tiered.kernels import load  # noqa: E402

REL_TOL = 1e-4
SCHEMES = ("channel", "tensor", "fbgemm", "autofp8")


def dequantized_copy(src: Path, dst: Path) -> Path:
    """`src` (an fp8 directory) with every fp8 weight replaced by e4m3(q) * scale in fp32 (the scale
    broadcast over its row, or the tensor), scales and activation scales dropped, no quantization_config."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    dst.mkdir()
    for f in src.iterdir():
        if f.suffix == ".safetensors":
            with safe_open(str(f), framework="pt") as st:
                t = {k: st.get_tensor(k) for k in st.keys()}
            out = {}
            for k, v in t.items():
                if v.dtype == torch.float8_e4m3fn:
                    s = t[k + "_scale"].float()
                    out[k] = v.float() * (s.reshape(-1, 1) if s.numel() > 1 else s.reshape(()))
                elif not k.endswith(("_scale", "input_scale")):
                    out[k] = v
            save_file(out, str(dst / f.name), metadata={"format": "pt"})
        elif f.name == "config.json":
            cfg = json.loads(f.read_text())
            cfg.pop("quantization_config")
            (dst / f.name).write_text(json.dumps(cfg))
        elif f.is_file():
            shutil.copy(f, dst / f.name)
    return dst


class Zoo:
    def __init__(self, root: Path) -> None:
        self.root, self._hf = root, {}

    def src(self, kind: str) -> Path:
        out = self.root / kind
        if not out.is_dir():
            if kind == "llama_wide":
                write_tiny_checkpoint(kind, out)
            else:
                build_hf_moe_model(kind, VOCAB).save_pretrained(out, safe_serialization=True)
        return out

    def fp8(self, kind: str, scheme: str) -> Path:
        return write_fp8_checkpoint(self.src(kind), self.root / f"{kind}-{scheme}", scheme)

    def hf(self, kind: str, scheme: str):
        key = (kind, scheme)
        if key not in self._hf:
            d = dequantized_copy(self.fp8(kind, scheme), self.root / f"{kind}-{scheme}-dequantized")
            self._hf[key] = load_hf_model(d) if kind == "llama_wide" else load_hf_moe_model(d)
        return self._hf[key]


@pytest.fixture(scope="module")
def zoo(tmp_path_factory) -> Zoo:
    return Zoo(tmp_path_factory.mktemp("fp8ch"))


def prompt(n: int = 12, seed: int = 0) -> list[int]:
    return prompt_ids(VOCAB, n, seed)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_scales_fold_into_the_weight_handle(zoo, scheme):
    """Each weight and its scales become one F8_E4M3 handle with the block a scale covers; activation
    scales are dropped; the dequantized weight is e4m3(q) x scale in fp32."""
    path = zoo.fp8("llama_wide", scheme)
    ckpt = open_checkpoint(path)
    name = "model.layers.0.mlp.down_proj.weight"
    h = ckpt.handle(name)
    N, K = h.shape
    per_channel = FP8_SCHEMES[scheme]["block"] == "channel"
    assert h.format == "F8_E4M3" and h.fp8_block == ((1, K) if per_channel else (N, K))
    q, bs = h.scaled_fp8()
    assert bs.dtype == torch.float32 and bs.shape == ((N, 1) if per_channel else (1, 1))
    assert torch.equal(h.load(torch.float32), q.float() * bs)
    assert not any(k.endswith(("_scale", "input_scale")) for k in ckpt.names())


@pytest.mark.parametrize("scheme", SCHEMES)
def test_dense_model_equals_transformers(zoo, scheme):
    """A Llama (hidden 256) in the lossless mode: logits of transformers on the dequantized weights."""
    llm = LLM(zoo.fp8("llama_wide", scheme), EngineConfig(max_context=32, decode_weights="fp32", dtype="float32",
                                                         accelerator="none"))
    ids = prompt()
    assert rel(llm.logits(ids), hf_logits(zoo.hf("llama_wide", scheme), ids)) <= REL_TOL


@pytest.mark.skipif(load() is None, reason="the fp8 decode copies need tiered's kernels")
@pytest.mark.parametrize("scheme", ["channel", "autofp8"])
def test_cpu_decode_keeps_channel_and_tensor_scales(zoo, scheme):
    """The CPU's default engine keeps every projection as stored: Fp8Linears with one scale per row
    (a per-tensor scale repeated per row, so q/k/v and gate/up still fuse), decoded by the native fp8
    kernel; decode steps match transformers on the dequantized weights (KL < 1e-3; the prompt, through
    bf16 GEMMs, < 5e-3: measured up to 1.1e-3)."""
    from tiered.eval.kl import kl_divergence
    from tiered.quant.fp8 import Fp8Linear

    path = zoo.fp8("llama_wide", scheme)
    auto = LLM(path, EngineConfig(max_context=32, accelerator="none"))
    fp8 = [m for m in auto.model.modules() if isinstance(m, Fp8Linear)]
    assert len(fp8) == 2 * 4 and all(m.row_block == 1 and m.bs.shape == (m.out_features, 1) for m in fp8)
    assert auto.plan.precision == "fp8"
    ids = prompt(16)
    ref = hf_logits(zoo.hf("llama_wide", scheme), ids)
    kl = kl_divergence(ref[7:], stepwise_logits(auto, ids, 8))
    # the prompt's row through bf16 GEMMs of dequantized rows; decode steps on the fp8 kernel in fp32
    assert float(kl[0]) < 5e-3 and float(kl[1:].max()) < 1e-3, kl
    head = 2 * auto.config.vocab_size * auto.config.hidden_size  # the lm_head's bf16 copy
    assert auto.decode_weight_bytes == sum(m.q.numel() + 4 * m.bs.numel() for m in fp8) + head
    # the planner counts what the engine holds (one scale a row: 4 bytes a row beyond its fp8 bytes)
    rows = sum(m.out_features for m in fp8)
    assert auto.plan.memory["cpu"] >= auto.cpu_budget.used - 4 * rows


@pytest.mark.parametrize("kind,scheme", [("qwen3_moe", "channel"), ("mixtral", "fbgemm"), ("qwen3_moe", "tensor")])
def test_moe_experts_keep_row_scales(zoo, kind, scheme):
    """Routed experts scaled per channel (or per tensor, repeated per row) stay fp8 as stored (the
    "fp8-row" expert kind: q and one fp32 scale a row), computed by the native kernel: logits of
    transformers on the dequantized weights, in the lossless mode and the default one."""
    from tiered.quant.experts import ExpertFormat
    from tiered.quant.gguf_experts import encode_expert, requantized_note, stored_format
    from tiered.memory.expert_store import expert_tensor_names, moe_layers

    path = zoo.fp8(kind, scheme)
    ckpt = open_checkpoint(path)
    hs = [ckpt.handle(n) for n in expert_tensor_names(ckpt.config.model_type, moe_layers(ckpt, ckpt.config)[0], 1)]
    assert stored_format(hs) == "fp8-row"
    fmt = ExpertFormat("fp8-row", [h.shape for h in hs])
    assert requantized_note(hs, fmt) is None
    for w, h in zip(fmt.dequantize(encode_expert(fmt, hs)), hs):
        assert torch.equal(w, h.load(torch.float32))  # bit for bit
    ids = prompt()
    ref = hf_logits(zoo.hf(kind, scheme), ids)
    llm = LLM(path, EngineConfig(max_context=32, decode_weights="fp32", accelerator="none"))
    assert llm.plan.dtypes["experts"] == "fp8-row"
    assert rel(llm.logits(ids), ref) <= REL_TOL
    # behind the strict host stand-in: resident experts dequantized on the device, misses on the CPU
    host = LLM(path, EngineConfig(max_context=32, decode_weights="fp32", accelerator="host"))
    assert host.plan.dtypes["experts"] == "fp8-row"
    assert rel(host.logits(ids), ref) <= REL_TOL
    auto = LLM(path, EngineConfig(max_context=32, accelerator="none"))
    got = stepwise_logits(auto, ids, 8)
    assert rel(got[-1], ref[-1]) < 0.05


def _edit(zoo, tmp_path, scheme, config=None, tensors=None) -> Path:
    return edited(zoo.fp8("llama_wide", scheme), tmp_path / "edited", config, tensors)


def _weights(group):
    return group["config_groups"]["group_0"]["weights"]


@pytest.mark.parametrize("change, words", [
    (lambda q: q.update(format="marlin-24"), ("marlin-24", "float-quantized")),
    (lambda q: q.update(format="pack-quantized"), ("mixes fp8 tensors", "compressed-tensors")),
    # integer schemes are read (test_int8_checkpoints), but not over float8 tensors
    (lambda q: q.update(format="int-quantized"), ("mixes fp8 tensors", "compressed-tensors")),
    (lambda q: _weights(q).update(type="int"), ("group_0", "8-bit float")),
    (lambda q: _weights(q).update(num_bits=4), ("group_0", "8-bit float")),
    (lambda q: _weights(q).update(symmetric=False), ("group_0", "symmetric")),
    (lambda q: _weights(q).update(strategy="group", group_size=128), ("group_0", "per tensor, channel or block")),
    (lambda q: q.update(sparsity_config={"format": "sparse-24-bitmask"}), ("sparse",)),
])
def test_unsupported_compressed_tensors_schemes_are_refused(zoo, tmp_path, change, words):
    with pytest.raises(UnsupportedModelError) as e:
        open_checkpoint(_edit(zoo, tmp_path, "channel", config=change))
    assert all(w in str(e.value) for w in words), str(e.value)


def test_malformed_scales_are_refused(zoo, tmp_path):
    name = "model.layers.0.self_attn.o_proj.weight_scale"
    with pytest.raises(CheckpointError, match=r"o_proj.weight.* has block scales of shape \(3, 1\)"):
        open_checkpoint(_edit(zoo, tmp_path, "fbgemm", tensors=lambda t: t.__setitem__(name, t[name][:3])))
    with pytest.raises(CheckpointError, match=r"lacks tensor .*o_proj.weight_scale_inv.* \(or .*o_proj.weight_scale"):
        open_checkpoint(_edit(zoo, tmp_path / "b", "fbgemm", tensors=lambda t: t.pop(name)))


def test_block_strategy_reads_its_block_structure(zoo, tmp_path):
    """compressed-tensors' "block" strategy: scales per block_structure, as the fine-grained format's."""
    from tiered.quant.fp8 import quantize_fp8

    def to_blocks(q):
        _weights(q).update(strategy="block", block_structure=[128, 128])

    def rescale(t):
        for k in [k for k in t if k.endswith(".weight") and t[k].dtype == torch.float8_e4m3fn]:
            w = t[k].float() * t[k + "_scale"].float()
            q, bs = quantize_fp8(w)
            t[k], t[k + "_scale"] = q.view(torch.float8_e4m3fn), bs

    path = _edit(zoo, tmp_path, "channel", config=to_blocks, tensors=rescale)
    h = open_checkpoint(path).handle("model.layers.0.mlp.down_proj.weight")
    assert h.fp8_block == (128, 128) and h.scaled_fp8()[1].shape == (2, 4)
    with pytest.raises(CheckpointError, match="block_structure"):
        open_checkpoint(_edit(zoo, tmp_path / "b", "channel",
                              config=lambda q: _weights(q).update(strategy="block", block_structure=[128])))


def test_fp8_row_expert_kind_computes_its_weights():
    """The fp8-row expert format: quantized per row, dequantized exactly, computed by the native fused
    kernel (few rows) and by dequantize-then-matmul (many rows) to the same SwiGLU."""
    import torch.nn.functional as F

    from tiered.quant.experts import ExpertFormat, quantize_projection

    shapes = ((160, 256), (160, 256), (256, 160))
    fmt = ExpertFormat("fp8-row", shapes)
    assert fmt.nbytes == sum(N * K + 4 * N for N, K in shapes)  # each segment already 64-byte aligned here
    g = torch.Generator().manual_seed(0)
    ws = [torch.randn(s, generator=g) * 0.05 for s in shapes]
    slot = fmt.empty()
    fmt.quantize(ws, slot)
    deq = fmt.dequantize(slot)
    for w, d, (N, K) in zip(ws, deq, shapes):
        v = quantize_projection(w, "fp8-row")
        assert v["bs"].shape == (N, 1)
        assert torch.equal(d, v["q"].view(torch.float8_e4m3fn).float() * v["bs"])
        assert ((d - w).abs() <= w.abs().amax(1, keepdim=True) / 16).all()
    for n in (1, 5, 300):
        x = torch.randn(n, 256, generator=g)
        ref = (F.silu(x.double() @ deq[0].double().T) * (x.double() @ deq[1].double().T)) @ deq[2].double().T
        assert rel(fmt.forward(x, slot).double(), ref) < 1e-4, n


def test_info_names_the_scaling(zoo):
    from typer.testing import CliRunner

    from tiered.cli import app

    res = CliRunner().invoke(app, ["info", str(zoo.fp8("llama_wide", "channel"))])
    assert res.exit_code == 0 and "fp8 scales:  per output channel x14" in res.output, res.output
    res = CliRunner().invoke(app, ["info", str(zoo.fp8("llama_wide", "autofp8"))])
    assert res.exit_code == 0 and "fp8 scales:  per tensor x14" in res.output, res.output
