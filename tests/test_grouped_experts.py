"""runtime/grouped_experts.py: a MoE layer's routed experts from stacked weights with no host sync,
against the per-expert loop of models/moe.LocalExperts, and captured as a graph (the stand-in here,
CUDA when a GPU is lent)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tiered.hardware.accelerator import HostAccelerator
from tiered.models.moe import expert_forward
from tiered.runtime.grouped_experts import GATHER_SLOTS, grouped_experts_forward, grouped_method


def _layer(E, F, D, dtype, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    w = [torch.randn(E, *shape, generator=g) / shape[-1] ** 0.5 for shape in ((F, D), (F, D), (D, F))]
    return [t.to(device, dtype) for t in w]


def _routing(N, E, k, dtype, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(N)])
    w = torch.softmax(torch.randn(N, k, generator=g), -1)
    return idx.to(device), w.to(device, dtype)


def _loop(x, idx, w, gate, up, down):
    """LocalExperts' rule: each routed expert once over its tokens, index_add_ in expert order."""
    out = torch.zeros_like(x)
    for e in torch.unique(idx).tolist():
        rows, slot = torch.where(idx == e)
        out.index_add_(0, rows, expert_forward(x[rows], gate[e], up[e], down[e]) * w[rows, slot, None])
    return out


@settings(max_examples=25, deadline=None)
@given(N=st.integers(1, 7), k=st.integers(1, 4), E=st.sampled_from([4, 8]), seed=st.integers(0, 1000),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_grouped_and_gather_equal_the_per_expert_loop(N, k, E, seed, dtype):
    gate, up, down = _layer(E, 32, 16, dtype, seed)
    x = torch.randn(N, 16, generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
    idx, w = _routing(N, E, k, dtype, seed)
    ref = _loop(x, idx, w, gate, up, down)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for method in ("grouped", "gather"):
        out = grouped_experts_forward(x, idx, w, gate, up, down, method)
        assert out.shape == x.shape and out.dtype == dtype
        assert float((out.float() - ref.float()).abs().max()) <= tol * float(ref.float().abs().max())


def test_method_follows_device_dtype_and_slots():
    cpu = torch.zeros(1, 8)
    assert grouped_method(cpu, 2) == "grouped" and grouped_method(cpu.bfloat16(), 1000) == "grouped"
    with pytest.raises(ValueError, match="unknown"):
        grouped_experts_forward(cpu, torch.zeros(1, 1, dtype=torch.long), torch.ones(1, 1),
                                *_layer(2, 8, 8, torch.float32), method="nope")


def test_grouped_experts_capture_on_the_standin_and_follow_new_routing():
    """No host sync anywhere (the stand-in's capture refuses one), and a replay after the routing
    tensors change in place computes the new routing's experts."""
    acc = HostAccelerator()
    with acc.scope():
        gate, up, down = (acc.to_device(t) for t in _layer(8, 32, 16, torch.float32))
        idx, w = (acc.to_device(t) for t in _routing(1, 8, 2, torch.float32, seed=1))
        x = acc.to_device(torch.randn(1, 16))
        for method in ("grouped", "gather"):
            replay, out = acc.capture(lambda m=method: grouped_experts_forward(x, idx, w, gate, up, down, m))
            new_idx, new_w = _routing(1, 8, 2, torch.float32, seed=7)
            idx.copy_(acc.to_device(new_idx)), w.copy_(acc.to_device(new_w))
            replay()
            ref = _loop(x.cpu(), new_idx, new_w, gate.cpu(), up.cpu(), down.cpu())
            assert torch.allclose(out.cpu(), ref, rtol=1e-5, atol=1e-6)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype,N", [(torch.bfloat16, 1), (torch.bfloat16, 5), (torch.float32, 1)])
def test_cuda_grouped_experts_capture_as_a_cuda_graph(dtype, N):
    """On CUDA: bf16 takes torch._grouped_mm, fp32 the gather (the grouped GEMM's fp32 fallback reads
    its offsets on the host); either captures into a CUDA graph and replays new routing."""
    from tiered.hardware.cuda import CudaAccelerator

    acc = CudaAccelerator()
    gate, up, down = _layer(8, 256, 128, dtype, device="cuda")
    idx, w = _routing(N, 8, 2, dtype, seed=1, device="cuda")
    x = torch.randn(N, 128, device="cuda").to(dtype)
    method = grouped_method(x, idx.numel())
    assert method == ("grouped" if dtype == torch.bfloat16 else "gather" if 2 * N <= GATHER_SLOTS else None)
    replay, out = acc.capture(lambda: grouped_experts_forward(x, idx, w, gate, up, down, method))
    new_idx, new_w = _routing(N, 8, 2, dtype, seed=7, device="cuda")
    idx.copy_(new_idx), w.copy_(new_w)
    replay()
    torch.cuda.synchronize()
    ref = _loop(x, new_idx, new_w, gate, up, down)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert float((out.float() - ref.float()).abs().max()) <= tol * float(ref.float().abs().max())
