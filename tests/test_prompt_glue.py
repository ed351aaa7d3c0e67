"""A prompt's elementwise glue on the CPU through tiered/kernels (csrc/prompt.cpp): RoPE in one pass, the same values
as apply_rotary's torch ops bit for bit, and SwiGLU's activation computed in fp32 and rounded once."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tiered import kernels
from tiered.models import layers

pytestmark = pytest.mark.skipif(not kernels.available(), reason="tiered/kernels is not built")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_rope_equals_the_torch_ops(dtype):
    g = torch.Generator().manual_seed(0)
    # the model's layout: [B, T, H, hd] projections seen as [B, H, T, hd]; two sequences' tables
    x = torch.randn(2, 37, 12, 64, generator=g).to(dtype).transpose(1, 2)
    cos, sin = torch.randn(2, 1, 37, 64, generator=g), torch.randn(2, 1, 37, 64, generator=g)
    xf = x.float()
    ref = (xf * cos + layers._rotate_half(xf) * sin).to(dtype)
    got = kernels.load().rope(x, cos, sin)
    assert got.is_contiguous() and got.dtype == dtype and torch.equal(got, ref)
    assert torch.equal(layers.apply_rotary(x, cos, sin), ref)  # the prompt path takes it
    assert torch.equal(layers.apply_rotary(x, cos, sin, layers.Rotary.signed(sin)), ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_swiglu_is_silu_of_gate_times_up_rounded_once(dtype):
    gu = torch.randn(3, 29, 2 * 96, generator=torch.Generator().manual_seed(1)).to(dtype)
    gate, up = gu.float().chunk(2, -1)
    exact = F.silu(gate) * up  # fp32
    got = layers.swiglu(gu)
    assert got.shape == (3, 29, 96) and got.dtype == dtype
    if dtype == torch.float32:
        assert torch.allclose(got, exact, rtol=1e-6, atol=1e-7)
    else:  # one rounding of the fp32 value: within half a bf16 ulp of it, plus exp's 2e-7
        assert ((got.float() - exact).abs() <= exact.abs() * (2 ** -8 + 1e-6) + 1e-30).all()


def test_glue_refuses_what_it_cannot_read():
    ext = kernels.load()
    with pytest.raises(RuntimeError, match="head_dim must be even"):
        ext.rope(torch.zeros(1, 1, 2, 3), torch.zeros(1, 1, 2, 3), torch.zeros(1, 1, 2, 3))
    with pytest.raises(RuntimeError, match="cos and sin must hold"):
        ext.rope(torch.zeros(1, 2, 4, 8), torch.zeros(1, 1, 3, 8), torch.zeros(1, 1, 3, 8))
    with pytest.raises(RuntimeError, match="fp32 or bf16"):
        ext.swiglu(torch.zeros(2, 8, dtype=torch.float16))


@pytest.mark.parametrize("rows", [3, 200])
def test_one_copy_gate_and_up_reach_swiglu_as_one_fused_output(rows, monkeypatch):
    """SmolLM2's default MLP: gate and up are slices of one fused int4 copy (quant/linear.fused_pair); the fused
    output goes to swiglu whole (decode rows through the fused module, prompt rows through its dense path) and
    the layer computes what the two slices' SiLU and product compute, within a rounding of bf16."""
    from tiered.quant.int4 import Int4Linear, quantize_int4
    from tiered.quant.linear import PhaseLinear, SharedOutput, Slice, fused_pair

    D, Fw, threshold = 64, 96, 4
    g = torch.Generator().manual_seed(2)
    fused = Int4Linear.from_codes(*quantize_int4(torch.randn(2 * Fw, D, generator=g) / 8), layout="tiled", batch_act="q8")
    down = Int4Linear.from_codes(*quantize_int4(torch.randn(D, Fw, generator=g) / 8), layout="tiled", batch_act="q8")
    shared = SharedOutput(fused, 2)
    mlp = layers.MLP(D, Fw)
    mlp.gate_proj = PhaseLinear(None, None, Slice(shared, 0, Fw), threshold)
    mlp.up_proj = PhaseLinear(None, None, Slice(shared, Fw, 2 * Fw), threshold)
    mlp.down_proj = PhaseLinear(None, None, down, threshold)
    x = torch.randn(1, rows, D, generator=g).to(torch.bfloat16)
    seen = []
    native = layers.swiglu
    monkeypatch.setattr(layers, "swiglu", lambda gu: seen.append(gu.shape) or native(gu))
    with torch.inference_mode():
        got = mlp(x)
        gu = fused.dense(x) if rows > threshold else fused(x)
        assert torch.equal(fused_pair(mlp.gate_proj, mlp.up_proj, x), gu)
        gate, up = gu.float().chunk(2, -1)
        ref = mlp.down_proj((F.silu(gate) * up).to(torch.bfloat16))
        assert fused_pair(mlp.up_proj, mlp.gate_proj, x) is None  # not in the fused output's order
    assert seen == [(1, rows, 2 * Fw)]
    assert got.shape == (1, rows, D) and torch.allclose(got.float(), ref.float(), rtol=2e-2, atol=2e-2)
