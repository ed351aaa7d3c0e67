"""Block-scaled fp8 safetensors checkpoints (DeepSeek-V3's and Qwen3-FP8's release format) against
transformers loading the same directories (its dequantizing CPU load), and the "fp8" expert kind.

The checkpoints are the tiny MoE and dense fixtures converted by tiered.bench.checkpoint.
write_fp8_checkpoint (every decoder projection e4m3 with 128 x 128 block scales; at these widths each
weight is one block, so `wide` (hidden 256, expert F 384) adds several).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from fixtures import hf_logits, prompt_ids, write_tiny_checkpoint  # noqa: E402
from fixtures import max_rel_err as rel  # noqa: E402
from moe_fixtures import VOCAB, build_hf_moe_model, load_hf_moe_model  # noqa: E402

from tiered import LLM, EngineConfig, SamplingParams  # noqa: E402
from tiered.bench.checkpoint import write_fp8_checkpoint  # noqa: E402
from tiered.checkpoint import open_checkpoint  # noqa: E402
from tiered.errors import CheckpointError, UnsupportedModelError  # noqa: E402
from tiered.kernels import load  # noqa: E402
from tiered.memory import sizes  # noqa: E402
from tiered.memory.expert_store import expert_tensor_names  # noqa: E402
from tiered.quant.experts import ExpertFormat  # noqa: E402
from tiered.quant.fp8 import dequantize_fp8, quantize_fp8  # noqa: E402
from tiered.quant.gguf_experts import encode_expert, requantized_note, stored_format  # noqa: E402

REL_TOL = 1e-4
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
WIDE = dict(hidden_size=256, moe_intermediate_size=384, intermediate_size=256)  # whole 128-blocks: transformers
# derives the block from the scale grid, so a partial block (as in 200 x 300 below) is refused there
KINDS = ("qwen3_moe", "deepseek_v3", "mixtral", "wide")


class Zoo:
    """fp8 checkpoints written once per session, and transformers' models of them."""

    def __init__(self, root: Path) -> None:
        self.root, self._hf = root, {}

    def dir(self, kind: str) -> Path:
        out = self.root / f"{kind}-fp8"
        if not out.is_dir():
            src = self.root / kind
            if kind in ("qwen3", "llama_wide"):
                write_tiny_checkpoint(kind, src)
            else:
                base, changes = ("qwen3_moe", WIDE) if kind == "wide" else (kind, {})
                build_hf_moe_model(base, VOCAB, **changes).save_pretrained(src, safe_serialization=True)
            write_fp8_checkpoint(src, out)
        return out

    def hf(self, kind: str):
        if kind not in self._hf:
            self._hf[kind] = load_hf_moe_model(self.dir(kind), **hf_fp8_kwargs())
        return self._hf[kind]


def hf_fp8_kwargs() -> dict:
    """transformers' fp8 layers run its finegrained-fp8 Triton kernel where CUDA is present, which needs the
    `kernels` package (absent on the 2026-11-28 H100: test_fp8_experts_on_a_gpu failed with its ImportError,
    the engine untested); there the reference dequantizes the blocks at load instead (the same products
    in fp32, what its CPU path computes). TIERED_TEST_FP8_DEQUANTIZE=1 forces that on a CPU machine."""
    from transformers.utils import is_kernels_available

    if os.environ.get("TIERED_TEST_FP8_DEQUANTIZE") == "1" or (torch.cuda.is_available()
                                                                  and not is_kernels_available()):
        from transformers import FineGrainedFP8Config

        return {"quantization_config": FineGrainedFP8Config(dequantize=True)}
    return {}


@pytest.fixture(scope="module")
def zoo(tmp_path_factory) -> Zoo:
    return Zoo(tmp_path_factory.mktemp("fp8"))


def prompt(n: int = 12, seed: int = 0) -> list[int]:
    return prompt_ids(VOCAB, n, seed)


# ------------------------------------------------------------------ the format
def test_every_e4m3_code_dequantizes_as_torch():
    codes = torch.arange(256, dtype=torch.uint8).reshape(2, 128)
    codes = codes[:, (codes[0] & 0x7F) != 0x7F]  # NaN codes out
    bs = torch.tensor([[0.5]])
    ref = codes.view(torch.float8_e4m3fn).float() * 0.5
    assert torch.equal(dequantize_fp8(codes, bs), ref)


def test_quantize_round_trips_to_block_precision():
    w = torch.randn(200, 300) * torch.linspace(0.01, 3, 300)
    q, bs = quantize_fp8(w)
    assert q.dtype == torch.uint8 and bs.shape == (2, 3)
    back = dequantize_fp8(q, bs)
    assert ((back - w).abs() <= w.abs() / 16 + bs.repeat_interleave(128, 0)[:200].repeat_interleave(128, 1)[:, :300]
            * 2 ** -9).all()  # e4m3: 3 mantissa bits; subnormals step 2^-9 of the scale
    q2, bs2 = quantize_fp8(back)
    assert torch.equal(dequantize_fp8(q2, bs2), back)  # representable values are kept exactly


def test_whole_blocks_dequantize_as_partial_ones():
    """The broadcast path (whole 128 x 128 blocks) and the per-weight scales agree bit for bit."""
    from tiered.quant.fp8 import expand_scales

    q, bs = quantize_fp8(torch.randn(256, 384))
    ref = q.view(torch.float8_e4m3fn).float() * expand_scales(bs, 256, 384)
    assert torch.equal(dequantize_fp8(q, bs), ref)
    assert torch.equal(dequantize_fp8(q, bs, torch.bfloat16), ref.to(torch.bfloat16))


def test_fp8_expert_kind_encodes_and_dequantizes():
    shapes = ((160, 256), (160, 256), (256, 160))
    fmt = ExpertFormat("fp8", shapes)
    ws = [torch.randn(s) * 0.05 for s in shapes]
    slot = fmt.empty()
    fmt.quantize(ws, slot)
    for w, got in zip(ws, fmt.dequantize(slot)):
        assert torch.equal(got, dequantize_fp8(*quantize_fp8(w)))
    x = torch.randn(3, 256)
    g, u, d = fmt.dequantize(slot)
    ref = torch.nn.functional.linear(torch.nn.functional.silu(x @ g.T) * (x @ u.T), d)
    assert rel(fmt.forward(x, slot), ref) < 1e-5


# ------------------------------------------------------------------ loading
def test_weights_load_as_transformers_dequantizes_them(zoo):
    ckpt = open_checkpoint(zoo.dir("wide"))
    hf = dict(zoo.hf("wide").named_parameters())
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.o_proj.weight"):
        h = ckpt.handle(name)
        assert h.format == "F8_E4M3" and h.fp8_block == (128, 128)
        assert torch.equal(h.load(torch.float32), hf[name].detach())
    assert not any(n.endswith("_scale_inv") for n in ckpt.names())
    assert ckpt.handle("model.layers.1.mlp.gate.weight").format == "F32"  # the router stays as it was


@pytest.mark.parametrize("kind", KINDS)
def test_logits_equal_transformers(zoo, kind):
    llm = LLM(zoo.dir(kind), EngineConfig(decode_weights="fp32", max_context=32))
    assert llm.plan.dtypes["experts"] == "fp8"  # kept as stored
    ids = prompt()
    assert rel(llm.logits(ids), hf_logits(zoo.hf(kind), ids)) <= REL_TOL


def test_dense_fp8_checkpoint_equals_transformers(zoo):
    llm = LLM(zoo.dir("qwen3"), EngineConfig(decode_weights="fp32", max_context=32))
    ids = prompt()
    assert rel(llm.logits(ids), hf_logits(zoo.hf("qwen3"), ids)) <= REL_TOL


@pytest.mark.skipif(load() is None, reason="the fp8 decode copies need tiered's kernels")
def test_cpu_decode_reads_the_fp8_weights_as_stored(zoo):
    """The CPU's default engine (one copy per weight): every projection of whole 128-row blocks is an
    Fp8Linear over the stored bytes, decoded by the native fp8 kernel on fp32 activations (so decode
    steps equal the lossless engine's to fp32 rounding) and prefilled through bf16 GEMMs; the plan
    prices and counts them as fp8."""
    from fixtures import stepwise_logits
    from tiered.eval.kl import kl_divergence
    from tiered.quant.fp8 import Fp8Linear

    path = zoo.dir("llama_wide")
    auto = LLM(path, EngineConfig(max_context=32, accelerator="none"))
    fp8 = [m for m in auto.model.modules() if isinstance(m, Fp8Linear)]
    assert len(fp8) == 2 * 4  # per layer: q/k/v fused, o, gate/up fused, down
    lossless = LLM(path, EngineConfig(max_context=32, accelerator="none", decode_weights="fp32", dtype="float32"))
    ids = prompt(16)
    ref = lossless.logits(ids)
    assert rel(ref, hf_logits(zoo.hf("llama_wide"), ids)) <= REL_TOL
    got = stepwise_logits(auto, ids, 8)
    assert float(kl_divergence(ref[7:], got).max()) < 1e-3
    head = 2 * auto.config.vocab_size * auto.config.hidden_size  # the lm_head's bf16 copy
    assert auto.plan.precision == "fp8"
    assert auto.decode_weight_bytes == sum(m.q.numel() + 4 * m.bs.numel() for m in fp8) + head


def test_greedy_equals_transformers(zoo):
    ids = prompt(seed=1)
    out = LLM(zoo.dir("wide"), EngineConfig(decode_weights="fp32", max_context=32)).generate([ids], GREEDY)[0].token_ids
    t = torch.tensor([ids])
    with torch.no_grad():
        ref = zoo.hf("wide").generate(t, attention_mask=torch.ones_like(t), do_sample=False, max_new_tokens=12,
                                      min_new_tokens=12, eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
    assert out == ref and len(set(out)) > 1


def test_experts_keep_the_stored_bytes(zoo):
    ckpt = open_checkpoint(zoo.dir("wide"))
    hs = [ckpt.handle(n) for n in expert_tensor_names(ckpt.config.model_type, 1, 3)]
    assert stored_format(hs) == "fp8" and requantized_note(hs, ExpertFormat("fp8", [h.shape for h in hs])) is None
    fmt = ExpertFormat("fp8", [h.shape for h in hs])
    assert sizes.expert_bytes(ckpt.config, "fp8") == fmt.nbytes
    for v, h in zip(fmt.views(encode_expert(fmt, hs)), hs):
        q, bs = h.scaled_fp8()
        assert torch.equal(v["q"], q.view(torch.uint8)) and torch.equal(v["bs"], bs)


def test_experts_on_disk_and_behind_the_stand_in(zoo, tmp_path):
    """fp8 experts on disk read segment by segment from the checkpoint's own files (no converted
    copy) through a small cache, and resident behind the strict host stand-in: the same logits."""
    ids = prompt()
    ref = hf_logits(zoo.hf("wide"), ids)
    cfg = open_checkpoint(zoo.dir("wide")).config
    room = sizes.weight_bytes(cfg, "fp32", sizes.is_expert_param) + 2 ** 18 + 5 * sizes.expert_bytes(cfg, "fp8")
    llm = LLM(zoo.dir("wide"), EngineConfig(decode_weights="fp32", max_context=32, cpu_memory=room,
                                            offload_dir=str(tmp_path / "off")))
    store = llm.experts.store
    assert llm.plan.dtypes["experts"] == "fp8" and store.raw
    assert not (tmp_path / "off").exists() or not any((tmp_path / "off").iterdir())
    assert store.disk_files() == sorted(str(f) for f in zoo.dir("wide").glob("*.safetensors"))
    assert rel(llm.logits(ids), ref) <= REL_TOL
    key = next(iter(store.raw))
    slot = store.fmt.empty()
    store.read(key, slot)
    encoded = store.fmt.segment_views(store.encode(key))  # the bytes an in-RAM expert is encoded to
    assert all(torch.equal(a, b) for a, b in zip(store.fmt.segment_views(slot), encoded))
    llm = LLM(zoo.dir("wide"), EngineConfig(decode_weights="fp32", max_context=32, accelerator="host"))
    assert rel(llm.logits(ids), ref) <= REL_TOL


def test_bf16_engine_runs_the_fp8_checkpoint(zoo):
    """The GPU's default compute dtype: dequantized to bf16 as transformers does, fp8 experts."""
    ids = prompt()
    llm = LLM(zoo.dir("deepseek_v3"), EngineConfig(dtype="bfloat16", max_context=32))
    assert rel(llm.logits(ids), hf_logits(zoo.hf("deepseek_v3"), ids)) < 0.05


def test_experts_can_be_converted_to_another_format(zoo):
    llm = LLM(zoo.dir("wide"), EngineConfig(decode_weights="fp32", max_context=32, expert_weights="fp32"))
    ids = prompt()
    assert llm.plan.dtypes["experts"] == "fp32"
    assert rel(llm.logits(ids), hf_logits(zoo.hf("wide"), ids)) <= REL_TOL


# ------------------------------------------------------------------ bad checkpoints
def _broken(zoo, tmp_path, config=None, drop=None) -> Path:
    out = tmp_path / "broken"
    shutil.copytree(zoo.dir("qwen3_moe"), out)
    if config:
        cfg = json.loads((out / "config.json").read_text())
        config(cfg)
        (out / "config.json").write_text(json.dumps(cfg))
    if drop:
        from safetensors.torch import load_file, save_file

        f = out / "model.safetensors"
        t = load_file(str(f))
        drop(t)
        save_file(t, str(f), metadata={"format": "pt"})
    return out


@pytest.mark.parametrize("change, error, words", [
    (lambda c: c["quantization_config"].update(quant_method="gptq"), UnsupportedModelError, ("gptq", "bf16 release")),
    (lambda c: c["quantization_config"].update(fmt="e5m2"), UnsupportedModelError, ("e5m2",)),
    (lambda c: c.pop("quantization_config"), CheckpointError, ("float8", "quantization_config")),
    (lambda c: c["quantization_config"].update(weight_block_size=[128]), CheckpointError, ("weight_block_size",)),
    (lambda c: c["quantization_config"].update(weight_block_size=[64, 64]), CheckpointError, ("block scales of shape",)),
])
def test_bad_quantization_config_is_refused(zoo, tmp_path, change, error, words):
    with pytest.raises(error) as e:
        open_checkpoint(_broken(zoo, tmp_path, config=change))
    assert all(w in str(e.value) for w in words), str(e.value)


def test_exponent_byte_scales_load_as_powers_of_two(zoo, tmp_path):
    """UE8M0 block scales (one exponent byte, 2^(b - 127): DeepSeek-V3.1's "scale_fmt" and MXFP8 files)
    are read as transformers reads uint8 scales."""
    name = "model.layers.0.self_attn.q_proj.weight"
    exps = {}

    def to_exponents(t):
        s = t[name + "_scale_inv"]
        e = (s.log2().round() + 127).to(torch.uint8)
        t[name + "_scale_inv"] = exps["e"] = e

    ckpt = open_checkpoint(_broken(zoo, tmp_path, drop=to_exponents))
    h = ckpt.handle(name)
    q, bs = h.scaled_fp8()
    assert bs.dtype == torch.float32 and torch.equal(bs, (exps["e"].float() - 127).exp2())
    assert torch.equal(h.load(torch.float32), dequantize_fp8(q, bs))


def test_scales_of_another_dtype_are_refused(zoo, tmp_path):
    name = "model.layers.0.self_attn.k_proj.weight_scale_inv"
    with pytest.raises(CheckpointError, match="stored as I32"):
        open_checkpoint(_broken(zoo, tmp_path, drop=lambda t: t.__setitem__(name, t[name].to(torch.int32))))


def test_missing_scales_are_refused(zoo, tmp_path):
    name = "model.layers.0.self_attn.k_proj.weight_scale_inv"
    with pytest.raises(CheckpointError, match="lacks tensor .*k_proj.weight_scale_inv"):
        open_checkpoint(_broken(zoo, tmp_path, drop=lambda t: t.pop(name)))


@pytest.mark.cuda
def test_fp8_experts_on_a_gpu(zoo):
    """Every weight on the GPU, the experts in fp8 slots (dequantized per call on the device)."""
    llm = LLM(zoo.dir("wide"), EngineConfig(decode_weights="fp32", dtype="float32", max_context=32, accelerator="cuda"))
    assert llm.device.type == "cuda" and llm.plan.dtypes["experts"] == "fp8"
    ids = prompt()
    assert rel(llm.logits(ids).cpu(), hf_logits(zoo.hf("wide"), ids)) <= REL_TOL
    llm.close()
