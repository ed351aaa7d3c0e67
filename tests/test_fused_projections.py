"""Fused q/k/v and gate/up GEMMs (Attention.fuse_qkv, MLP.fuse_gate_up; runtime/install.fuse_projections):
the same outputs as the separate projections, the parameters views of the fused weight (no second
copy), and the engine on an accelerator fuses them and still matches transformers."""

from __future__ import annotations

import copy

import pytest
import torch

from tiered import LLM, EngineConfig
from tiered.models.layers import MLP, Attention, AttentionMetadata, KVCache, build_attention_metadata, set_prompt_ffn
from tiered.runtime.install import fuse_projections


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3", "mistral"])
def test_fused_attention_and_mlp_equal_the_separate_projections(zoo, name):
    """qwen2: q/k/v biases; qwen3: per-head q/k norms (fused GEMM, separate RoPE)."""
    llm = LLM(zoo.dir(name), EngineConfig(accelerator="none", decode_weights="fp32", dtype="float32",
                                          max_context=32, plan="off"))
    layer = llm.model.model.layers[0]
    attn, mlp = copy.deepcopy(layer.self_attn), copy.deepcopy(layer.mlp)
    cfg = llm.config
    x = torch.randn(2, 5, cfg.hidden_size)
    positions = torch.arange(5).repeat(2, 1)
    slots = torch.tensor([0, 1])
    meta = build_attention_metadata(llm.model.rotary, positions, slots, cfg.sliding_window)
    caches = [KVCache(cfg, 2, 8, torch.float32) for _ in range(2)]
    want, want_mlp = attn(x, meta, caches[0]), mlp(x)
    assert attn.fuse_qkv() and mlp.fuse_gate_up()
    fused_w, fused_b = attn.qkv
    for lin in (attn.q_proj, attn.k_proj, attn.v_proj):  # views of the fused tensor: one copy of the bytes
        assert lin.weight.untyped_storage().data_ptr() == fused_w.untyped_storage().data_ptr()
    assert (fused_b is not None) == (attn.q_proj.bias is not None)
    assert mlp.gate_proj.weight.untyped_storage().data_ptr() == mlp.gate_up.untyped_storage().data_ptr()
    got = attn(x, meta, caches[1])
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)
    assert torch.allclose(mlp(x), want_mlp, rtol=1e-5, atol=1e-6)
    assert torch.equal(caches[0].k, caches[1].k) and torch.equal(caches[0].v, caches[1].v)
    llm.close()


def test_meta_weights_are_left_unfused():
    mlp = MLP(8, 16).to("meta")
    assert not mlp.fuse_gate_up() and mlp.gate_up is None


def test_engine_on_an_accelerator_fuses_and_matches_transformers(zoo):
    ids = list(range(2, 18))
    llm = LLM(zoo.dir("qwen2"), EngineConfig(accelerator="host", decode_weights="fp32", max_context=32))
    try:
        layers = llm.model.model.layers
        assert all(l.self_attn.qkv is not None and l.mlp.gate_up is not None for l in layers)
        assert fuse_projections(llm.model) == 2 * len(layers)  # idempotent: already fused
        with torch.no_grad():
            ref = zoo.hf("qwen2")(torch.tensor([ids])).logits[0]
        out = llm.logits(ids)
        assert float((out - ref).abs().max() / ref.abs().max()) <= 1e-4
    finally:
        llm.close()
    cpu = LLM(zoo.dir("qwen2"), EngineConfig(accelerator="none", decode_weights="fp32", max_context=32))
    assert all(l.self_attn.qkv is None for l in cpu.model.model.layers)  # the CPU keeps its own decode step
    cpu.close()


def test_the_engine_gives_each_fused_modules_freed_parts_back(zoo, monkeypatch):
    """install runs Accelerator.trim after each module it fuses (on CUDA torch.cuda.empty_cache): the
    q/k/v and gate/up parts a fused weight replaced go back to the driver instead of staying reserved
    (session 28's H100 memory probe: 2230 MiB reserved after the dense default's load, 1810 allocated,
    against a 2048 MiB budget)."""
    from tiered.hardware.accelerator import HostAccelerator

    trims = []
    monkeypatch.setattr(HostAccelerator, "trim", lambda self: trims.append(1))
    llm = LLM(zoo.dir("qwen2"), EngineConfig(accelerator="host", decode_weights="fp32", max_context=32))
    try:
        assert len(trims) == 2 * len(llm.model.model.layers) + 1  # each fused module, then the load's end
    finally:
        llm.close()
    assert fuse_projections(torch.nn.Sequential(MLP(8, 16)), trim=lambda: trims.append(2)) == 1 and trims[-1] == 2


def test_a_prompts_ffn_stays_in_the_dequantized_gemms_dtype(monkeypatch):
    """One-copy int4 projections whose prompt calls dequantize for bf16 GEMMs (quant/int4.Int4Linear.dense_dtype,
    through PhaseLinear and the fused gate/up's Slice), under a plan's bf16 prompt FFN (set_prompt_ffn): MLP casts
    a prompt's fp32 x to bf16 once and keeps gate, up, their product and down in bf16 (no cast back and forth
    between the GEMMs), its output in x's dtype; without the plan's dtype, decode steps (the decode module's rows),
    plain nn.Linear projections and dtypes already alike take the usual path."""
    import torch.nn.functional as F

    from tiered import kernels
    from tiered.models.layers import swiglu
    from tiered.quant import int4
    from tiered.quant.linear import PhaseLinear, SharedOutput, Slice

    if not kernels.available():
        pytest.skip("the tiled int4 layout needs tiered/kernels")
    monkeypatch.setattr(int4, "dequantize_rows", lambda batch_act="bf16", isa=None, tuning=None: 8)
    monkeypatch.setattr(int4, "dequantize_dtype", lambda: torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    D, Fi, threshold = 64, 128, 4

    def tiled(n, k):
        return int4.Int4Linear.from_codes(*int4.quantize_int4(torch.randn(n, k, generator=g) * 0.05), int4.GROUP,
                                          None, "tiled")
    mlp = MLP(D, Fi)
    shared = SharedOutput(tiled(2 * Fi, D), 2)
    mlp.gate_proj = PhaseLinear(None, None, Slice(shared, 0, Fi), threshold)
    mlp.up_proj = PhaseLinear(None, None, Slice(shared, Fi, 2 * Fi), threshold)
    down = tiled(D, Fi)
    mlp.down_proj = PhaseLinear(None, None, down, threshold)
    x = torch.randn(1, 16, D, generator=g)
    assert mlp._prompt_dtype(x) is None  # no plan for it: x's dtype throughout
    assert set_prompt_ffn(mlp, torch.bfloat16) == 1
    assert mlp._prompt_dtype(x) == torch.bfloat16
    with torch.inference_mode():
        y = mlp(x)
        h = x.to(torch.bfloat16)
        gate_up = shared.fused.dense(h)
        assert gate_up.dtype == torch.bfloat16
        # gate and up's fused output to swiglu whole (quant/linear.fused_pair): in bf16, one pass on the CPU
        want = down.dense(swiglu(gate_up)).float()
        assert y.dtype == torch.float32 and torch.equal(y, want)
        # the halves' SiLU and product by torch's bf16 ops (rounded twice; the path before fused_pair): not what runs
        # now, where swiglu computes in fp32 and rounds once
        assert not torch.equal(y, down.dense(F.silu(gate_up[..., :Fi]) * gate_up[..., Fi:]).float())
    assert mlp._prompt_dtype(x[:, :threshold]) is None  # a decode step: the decode module's rows
    assert mlp._prompt_dtype(x.to(torch.bfloat16)) is None  # already that dtype
    plain = MLP(D, Fi)
    set_prompt_ffn(plain, torch.bfloat16)
    assert plain._prompt_dtype(x) is None  # nn.Linear: x's dtype throughout
