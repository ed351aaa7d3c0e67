"""GGUF Q6_K decoded from its own bits (quant/q6k.py, gemv.cpp's "q6k" kernels).

The layout holds the file's codes and scales bit for bit (its dequantization is gguf's, exactly); every ISA path
computes x @ W^T with that W, on int16 activations at one row (and calls of 2+ rows with batch_act "bf16") and int8
ones with "q8"; bad tensors are refused with a clear error; the decode copies a GGUF file's Q6_K tensors get are
these, counted at Q6_K's bytes.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize

from tiered.kernels import load

sys.path.insert(0, str(Path(__file__).parent))
from gguf_writer import quantize_q6_k, random_k_blocks  # noqa: E402

ext = load()
pytestmark = pytest.mark.skipif(ext is None, reason="native extension unavailable (tiered.kernels.load() is None)")
ORDER = ["scalar", "avx2", "avx512"]
ISAS = ORDER[:ORDER.index(ext.best_gemv_isa()) + 1] if ext is not None else []


@pytest.fixture(params=ISAS)
def isa(request):
    ext.set_isa(request.param)
    yield request.param
    ext.reset_isa()


def blocks(rows: int, cols: int, seed: int) -> np.ndarray:
    """Random Q6_K blocks: every code and int8 sub-scale byte random (negative scales too), d small and finite."""
    return random_k_blocks(rows, cols, Q.Q6_K, seed=seed)


def reference(raw: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(dequantize(raw, Q.Q6_K).reshape(raw.shape[0], -1)).float()


def rel(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y - ref).abs().max() / ref.abs().max()).item()


def test_layout_holds_the_files_codes_and_scales_bit_for_bit():
    """q6k_blocks_q6t then q6k_tiled_dequantize gives gguf.quants.dequantize's fp32 values exactly, and their
    bf16 rounding; the layout's tensors have the documented shapes; two weights' parts side by side are each
    weight's tiles."""
    from tiered.quant.q6k import BYTES_PER_WEIGHT, Q6KLinear

    raw = blocks(48, 768, seed=1)
    qt, sc, d = ext.q6k_blocks_q6t(torch.from_numpy(raw))
    assert qt.shape == (3, 24, 384) and qt.dtype == torch.uint8
    assert sc.shape == (3, 48, 16) and sc.dtype == torch.int8 and d.shape == (3, 3, 16) and d.dtype == torch.float16
    ref = reference(raw)
    w = ext.q6k_tiled_dequantize(qt, sc, d, False)
    assert np.array_equal(w.numpy().view(np.int32), ref.numpy().view(np.int32))
    assert torch.equal(ext.q6k_tiled_dequantize(qt, sc, d, True), ref.bfloat16())
    lin = Q6KLinear.from_blocks([raw[:16], raw[16:]])
    assert torch.equal(lin.dequantize(), ref) and (lin.out_features, lin.in_features) == (48, 768)
    nbytes = sum(t.numel() * t.element_size() for t in (lin.qt, lin.sc, lin.d))
    assert nbytes == raw.nbytes == 48 * 768 * BYTES_PER_WEIGHT  # the file's bytes, not more


@pytest.mark.parametrize("batch_act", ["bf16", "q8"])
def test_kernel_is_the_dequantized_weight_on_every_isa(isa, batch_act):
    """y = x @ W^T + b at 1..11 rows on every ISA path: within the activations' quantization (int16 per group of 32
    at one row and with batch_act "bf16", ~1e-4; int8 with "q8" from 2 rows, ~1e-2), and the paths agree."""
    raw = blocks(64, 512, seed=2)
    ref_w = reference(raw)
    bias = torch.randn(64)
    k = ext.q6k_kernel(*ext.q6k_blocks_q6t(torch.from_numpy(raw)), bias, batch_act)
    gen = torch.Generator().manual_seed(0)
    for B in (1, 2, 3, 5, 8, 11):
        x = torch.randn(B, 512, generator=gen)
        y = k(x)
        ref = x @ ref_w.T + bias
        q8 = batch_act == "q8" and B > 1 and isa != "avx2"  # (AVX2 keeps int16 activations)
        assert rel(y, ref) < (2e-2 if q8 else 2e-4), (isa, batch_act, B)
    assert k.name().startswith(f"q6k(tiered,{isa}")


def test_isa_paths_agree():
    """The scalar, AVX2 and AVX-512 paths compute the same integer dots: their outputs within fp32 rounding."""
    raw = blocks(32, 1024, seed=3)
    parts = ext.q6k_blocks_q6t(torch.from_numpy(raw))
    x = torch.randn(3, 1024)
    ys = {}
    for name in ISAS:
        ext.set_isa(name)
        try:
            ys[name] = ext.q6k_kernel(*parts)(x)
        finally:
            ext.reset_isa()
    for name, y in ys.items():
        assert rel(y, ys["scalar"]) < 1e-5, name


def test_bad_tensors_are_refused():
    """A width that is not whole super-blocks, rows that are not whole tiles, or scales of the wrong shape or
    dtype raise a clear error (no crash, nothing read out of bounds)."""
    raw = blocks(32, 512, seed=4)
    qt, sc, d = ext.q6k_blocks_q6t(torch.from_numpy(raw))
    with pytest.raises(RuntimeError, match="N % 16"):
        ext.q6k_blocks_q6t(torch.from_numpy(raw[:8]))
    with pytest.raises(RuntimeError, match="sc must be"):
        ext.q6k_kernel(qt, sc[:, :-1].contiguous(), d)
    with pytest.raises(RuntimeError, match="d must be"):
        ext.q6k_kernel(qt, sc, d.float())
    with pytest.raises(RuntimeError, match="multiple of 256"):
        ext.q6k_kernel(qt[:, :4].contiguous(), sc[:, :8].contiguous(), d[:, :1].contiguous())
    with pytest.raises(RuntimeError, match="batch_act"):
        ext.q6k_kernel(qt, sc, d, None, "int4")
    from tiered.quant.q6k import Q6KLinear

    with pytest.raises(ValueError, match="one width"):
        Q6KLinear.from_blocks([raw, blocks(16, 256, seed=5)])


def test_linear_forward_and_prefill_paths():
    """Q6KLinear: a decode row through the kernel, a prompt's rows (past quant/int4.dequantize_rows()) through the
    bf16-dequantized weight and one GEMM (or the kernel where the ISA GEMMs fp32), both close to x @ W^T in x's
    dtype; a weight quantized from real values stays near them (gguf_writer's Q6_K: ~1% of a sub-block's max)."""
    from tiered.quant.q6k import Q6KLinear

    w = torch.randn(48, 512)
    raw = quantize_q6_k(w.numpy())
    lin = Q6KLinear.from_blocks([raw], bias=torch.randn(48))
    W = lin.dequantize()
    assert rel(W, w) < 0.05
    x = torch.randn(1, 512)
    assert rel(lin(x), x @ W.T + lin.bias) < 2e-4
    xp = torch.randn(300, 512).bfloat16()
    y = lin.dense(xp)
    assert y.dtype == torch.bfloat16 and y.shape == (300, 48)
    assert rel(y.float(), xp.float() @ W.T + lin.bias) < 2e-2


def test_gguf_q6k_tensors_take_q6k_copies_counted_at_their_bytes():
    """auto_kind gives a Q6_K tensor the q6k copy where the kernels are built and its rows make whole tiles (else
    bf16); "int8" keeps its int8-g32 copy; the byte accounting and the planner's keys
    price it at 210 bytes per 256 weights, a byte at the int8-g32 copies' rate until a profile times its own."""
    from types import SimpleNamespace

    from tiered.hardware import op_time
    from tiered.memory.sizes import bytes_per_element
    from tiered.quant.linear import auto_kind, copy_kind

    assert auto_kind(SimpleNamespace(format="Q6_K", shape=(4096, 14336))) == "q6k"
    assert auto_kind(SimpleNamespace(format="Q6_K", shape=(40, 512))) == "bf16"  # rows not whole tiles
    assert copy_kind(SimpleNamespace(format="Q6_K", shape=(4096, 14336)), "int8") == "int8-g32"
    assert bytes_per_element("q6k") == 210 / 256
    assert op_time.DTYPE_FALLBACK["q6k"][1] == "int8-g32" and op_time.gemv_dtype("q6k", "q8") == "q6kq8"
