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
