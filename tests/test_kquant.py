"""GGUF k-quants decoded from their own bits (quant/kquant.py, gemv.cpp's "q6k" and "q5k" kernels).

Each layout holds the file's codes and scales bit for bit (its dequantization is gguf's, exactly); every ISA path
computes x @ W^T with that W, on int16 activations at one row (and calls of 2+ rows with batch_act "bf16") and int8
ones with "q8"; bad tensors are refused with a clear error; the decode copies a GGUF file's Q6_K / Q5_K tensors get
are these, counted at the file's bytes.
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
from gguf_writer import quantize_iq4_xs, quantize_q5_k, quantize_q6_k, random_blocks, random_k_blocks  # noqa: E402

ext = load()
pytestmark = pytest.mark.skipif(ext is None, reason="native extension unavailable (tiered.kernels.load() is None)")
ORDER = ["scalar", "avx2", "avx512"]
ISAS = ORDER[:ORDER.index(ext.best_gemv_isa()) + 1] if ext is not None else []
KINDS = {"q6k": Q.Q6_K, "q5k": Q.Q5_K, "iq4xs": Q.IQ4_XS}
QUANTIZE = {"q6k": quantize_q6_k, "q5k": quantize_q5_k, "iq4xs": quantize_iq4_xs}
SHAPES = {"q6k": ((3, 24, 384), (3, 48, 16), (3, 3, 16)), "q5k": ((3, 24, 320), (3, 24, 2, 16), (3, 3, 2, 16)),
          "iq4xs": ((3, 24, 256), (3, 24, 16), (3, 3, 16))}


@pytest.fixture(params=ISAS)
def isa(request):
    ext.set_isa(request.param)
    yield request.param
    ext.reset_isa()


def blocks(kind: str, rows: int, cols: int, seed: int) -> np.ndarray:
    """Random blocks: every code and scale byte random (Q6_K's negative scales too), the fp16 scales small, finite."""
    if kind == "iq4xs":
        return random_blocks(rows, cols, KINDS[kind], seed=seed)
    return random_k_blocks(rows, cols, KINDS[kind], seed=seed)


def reference(kind: str, raw: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(dequantize(raw, KINDS[kind]).reshape(raw.shape[0], -1)).float()


def pack(kind: str, raw: np.ndarray):
    from tiered.quant.kquant import LINEAR_OF_KIND

    return getattr(ext, LINEAR_OF_KIND[kind].PACK)(torch.from_numpy(raw))


def rel(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y - ref).abs().max() / ref.abs().max()).item()


@pytest.mark.parametrize("kind", list(KINDS))
def test_layout_holds_the_files_codes_and_scales_bit_for_bit(kind):
    """The native repacking then dequantization gives gguf.quants.dequantize's fp32 values exactly, and their bf16
    rounding; the layout's tensors have the documented shapes and the file's bytes; two weights' parts side by side
    are each weight's tiles."""
    from tiered.quant.kquant import LINEAR_OF_KIND, bytes_per_weight

    raw = blocks(kind, 48, 768, seed=1)
    parts = pack(kind, raw)
    assert tuple(tuple(p.shape) for p in parts) == SHAPES[kind]
    ref = reference(kind, raw)
    dq = getattr(ext, f"{kind}_tiled_dequantize")
    w = dq(*parts, False)
    assert np.array_equal(w.numpy().view(np.int32), ref.numpy().view(np.int32))
    for name in ISAS:  # (AVX-512's bf16 rows: kquant_bf16_avx512; the others the scalar loop)
        ext.set_isa(name)
        try:
            assert torch.equal(dq(*parts, True), ref.bfloat16()), name
        finally:
            ext.reset_isa()
    lin = LINEAR_OF_KIND[kind].from_blocks([raw[:16], raw[16:]])
    assert torch.equal(lin.dequantize(), ref) and (lin.out_features, lin.in_features) == (48, 768)
    nbytes = sum(t.numel() * t.element_size() for t in lin.parts())
    assert nbytes == 48 * 768 * bytes_per_weight(kind) == lin.kernel().weight_bytes()
    # the file's bytes (Q5_K's / IQ4_XS's: with their 6-bit scales (and mins) a byte each)
    assert nbytes == raw.nbytes * {"q5k": 180 / 176, "iq4xs": 138 / 136}.get(kind, 1)


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("batch_act", ["bf16", "q8"])
def test_kernel_is_the_dequantized_weight_on_every_isa(isa, kind, batch_act):
    """y = x @ W^T + b at 1..11 rows on every ISA path: within the activations' quantization (int16 per group of 32
    at one row and with batch_act "bf16", ~1e-4; int8 with "q8" from 2 rows, ~1e-2)."""
    raw = blocks(kind, 64, 512, seed=2)
    ref_w = reference(kind, raw)
    bias = torch.randn(64)
    k = getattr(ext, f"{kind}_kernel")(*pack(kind, raw), bias, batch_act)
    gen = torch.Generator().manual_seed(0)
    for B in (1, 2, 3, 5, 8, 11):
        x = torch.randn(B, 512, generator=gen)
        ref = x @ ref_w.T + bias
        q8 = batch_act == "q8" and B > 1 and isa != "avx2"  # (AVX2 keeps int16 activations)
        assert rel(k(x), ref) < (2e-2 if q8 else 2e-4), (isa, kind, batch_act, B)
    assert k.name().startswith(f"{kind}(tiered,{isa}")


@pytest.mark.parametrize("kind", list(KINDS))
def test_isa_paths_agree(kind):
    """The scalar, AVX2 and AVX-512 paths compute the same integer dots: their outputs within fp32 rounding."""
    raw = blocks(kind, 32, 1024, seed=3)
    parts = pack(kind, raw)
    x = torch.randn(3, 1024)
    ys = {}
    for name in ISAS:
        ext.set_isa(name)
        try:
            ys[name] = getattr(ext, f"{kind}_kernel")(*parts)(x)
        finally:
            ext.reset_isa()
    for name, y in ys.items():
        assert rel(y, ys["scalar"]) < 1e-5, name


@pytest.mark.parametrize("kind", list(KINDS))
def test_bad_tensors_are_refused(kind):
    """Rows that are not whole tiles, scales of the wrong shape or dtype, a width that is not whole super-blocks or
    an unknown batch_act raise a clear error (no crash, nothing read out of bounds)."""
    from tiered.quant.kquant import LINEAR_OF_KIND

    raw = blocks(kind, 32, 512, seed=4)
    qt, sc, d = pack(kind, raw)
    kernel = getattr(ext, f"{kind}_kernel")
    with pytest.raises(RuntimeError, match="N % 16"):
        pack(kind, raw[:8])
    with pytest.raises(RuntimeError, match="must be a contiguous CPU"):
        kernel(qt, sc[:, :-1].contiguous(), d)
    with pytest.raises(RuntimeError, match="float16"):
        kernel(qt, sc, d.float())
    with pytest.raises(RuntimeError, match="multiple of 256"):
        kernel(qt[:, :4].contiguous(), sc[:, :sc.shape[1] // 4].contiguous(), d[:, :1].contiguous())
    with pytest.raises(RuntimeError, match="batch_act"):
        kernel(qt, sc, d, None, "int4")
    with pytest.raises(ValueError, match="one width"):
        LINEAR_OF_KIND[kind].from_blocks([raw, blocks(kind, 16, 256, seed=5)])
    with pytest.raises(RuntimeError, match="qt_out: must be a contiguous CPU"):  # outputs of another weight's shape
        pack_into(kind, raw, [qt[:1], sc, d])
    with pytest.raises(RuntimeError, match="scales_out: must be a contiguous CPU"):
        pack_into(kind, raw, [qt, sc.float(), d])


def pack_into(kind: str, raw: np.ndarray, outs):
    from tiered.quant.kquant import LINEAR_OF_KIND

    return getattr(ext, LINEAR_OF_KIND[kind].PACK)(torch.from_numpy(raw), *outs)


@pytest.mark.parametrize("kind", list(KINDS))
def test_repacking_writes_into_given_tiles(kind):
    """A repacking pass given its outputs writes them in place (a fused group's parts their own tiles of one weight,
    as from_blocks does): the same bytes as new tensors, nothing outside the slices touched."""
    raw = blocks(kind, 48, 512, seed=6)
    whole = pack(kind, raw)
    outs = [torch.full_like(t, 7) for t in whole]
    for lo, hi in ((0, 1), (1, 3)):  # tiles [lo, hi): rows 16 lo .. 16 hi
        got = pack_into(kind, raw[16 * lo:16 * hi], [o[lo:hi] for o in outs])
        assert all(g.data_ptr() == o[lo:hi].data_ptr() for g, o in zip(got, outs))
    assert all(torch.equal(o, w) for o, w in zip(outs, whole))


@pytest.mark.parametrize("kind", list(KINDS))
def test_linear_forward_and_prefill_paths(kind):
    """A decode row through the kernel, a prompt's rows (past quant/int4.dequantize_rows()) through the
    bf16-dequantized weight and one GEMM (or the kernel where the ISA GEMMs fp32), both close to x @ W^T in x's
    dtype; a weight quantized from real values stays near them (gguf_writer's plain fits)."""
    from tiered.quant.kquant import LINEAR_OF_KIND

    w = torch.randn(48, 512)
    lin = LINEAR_OF_KIND[kind].from_blocks([QUANTIZE[kind](w.numpy())], bias=torch.randn(48))
    W = lin.dequantize()
    assert rel(W, w) < 0.1
    x = torch.randn(1, 512)
    assert rel(lin(x), x @ W.T + lin.bias) < 2e-4
    xp = torch.randn(300, 512).bfloat16()
    y = lin.dense(xp)
    assert y.dtype == torch.bfloat16 and y.shape == (300, 48)
    assert rel(y.float(), xp.float() @ W.T + lin.bias) < 2e-2


@pytest.mark.parametrize("kind", list(KINDS) + ["int8-g32"])
def test_prefill_rows_follow_the_machines_rule_for_their_activations(monkeypatch, kind):
    """A prompt's rows past quant/int4.dequantize_rows(batch_act) dequantize for one GEMM, within them (None: every
    count) they run the kernel on `batch_act` activations, as Int4Linear.dense's: on int8 activations the kernel where
    the machine's tuning says so (it had asked the rule for bf16 ones: 96 rows on AVX-512 whatever batch_act)."""
    import tiered.quant.int4 as int4
    from tiered.quant.int8 import Int8G32Linear
    from tiered.quant.kquant import LINEAR_OF_KIND

    w = torch.randn(48, 512)
    asked = []

    def rows(batch_act="bf16", *a, **k):
        asked.append(batch_act)
        return None if batch_act == "q8" else 16
    monkeypatch.setattr(int4, "dequantize_rows", rows)
    monkeypatch.setattr(int4, "dequantize_dtype", lambda *a, **k: torch.bfloat16)
    x = torch.randn(40, 512)
    for batch_act in ("q8", "bf16"):
        lin = Int8G32Linear.from_dense(w, batch_act=batch_act) if kind == "int8-g32" else \
            LINEAR_OF_KIND[kind].from_blocks([QUANTIZE[kind](w.numpy())], batch_act=batch_act)
        y, kernel = lin.dense(x), lin(x)
        assert asked[-1] == batch_act
        # q8: the kernel at every row count, bit for bit; bf16: past 16 rows the bf16 GEMM (not the kernel's bits)
        assert torch.equal(y, kernel) == (batch_act == "q8"), batch_act
        assert rel(y, kernel) < 2e-2


def test_gguf_k_quant_tensors_take_their_copies_counted_at_their_bytes():
    """auto_kind gives a Q6_K / Q5_K tensor its copy as stored where the kernels are built and its rows make whole
    tiles (else bf16); "int8" keeps the int8-g32 copy; the byte accounting and the planner's keys price them at the
    file's bytes, a byte at the int8-g32 copies' rate until a profile times their own."""
    from types import SimpleNamespace

    from tiered.hardware import op_time
    from tiered.memory.sizes import bytes_per_element
    from tiered.quant.linear import auto_kind, copy_kind

    for fmt, kind in (("Q6_K", "q6k"), ("Q5_K", "q5k")):
        assert auto_kind(SimpleNamespace(format=fmt, shape=(4096, 14336))) == kind
        assert auto_kind(SimpleNamespace(format=fmt, shape=(40, 512))) == "bf16"  # rows not whole tiles
        assert copy_kind(SimpleNamespace(format=fmt, shape=(4096, 14336)), "int8") == "int8-g32"
        assert op_time.DTYPE_FALLBACK[kind][1] == "int8-g32" and op_time.gemv_dtype(kind, "q8") == kind + "q8"
    assert bytes_per_element("q6k") == 210 / 256 and bytes_per_element("q5k") == 180 / 256


def test_the_q6k_fits_give_the_same_blocks():
    """quant/gguf_encode.quantize_q6_k's absmax fit in torch and the native q6k_fit_rows (what a layer stored otherwise
    than an expert format's q6k re-quantizes through: quant/experts.quantize_blocks) write the same bytes, all-zero
    sub-blocks, ties and heavy tails included, and gguf reads them back within half a step of the weights."""
    g = torch.Generator().manual_seed(0)
    for w in (0.02 * torch.randn(64, 1024, generator=g), torch.randn(32, 512, generator=g) ** 3,
              torch.zeros(16, 256), torch.full((16, 256), 0.5)):
        w[:3, :16] = 0
        blocks = quantize_q6_k(w)
        assert torch.equal(ext.q6k_fit_rows(w), blocks)
        assert np.array_equal(quantize_q6_k(w.numpy()), blocks.numpy())  # numpy in, numpy out
        back = dequantize(blocks.numpy(), Q.Q6_K).reshape(w.shape)
        assert np.abs(back - w.numpy()).max() <= 1.01 * float(w.abs().max()) / 62 + 1e-12
    with pytest.raises(RuntimeError, match="multiple of 256"):
        ext.q6k_fit_rows(torch.zeros(4, 96))


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_k_quant_handle_dequantizes_natively_as_gguf_does(kind):
    """quant/gguf_experts.dequantized: a Q6_K / Q5_K / IQ4_XS tensor's fp32 weight through the native repack and
    dequantization equals gguf's dequantization bit for bit; a shape that does not tile takes the handle's load."""
    from types import SimpleNamespace

    from tiered.quant.gguf_experts import dequantized

    raw = QUANTIZE[kind](np.random.default_rng(5).standard_normal((32, 512)).astype(np.float32) * 0.02)
    ref = dequantize(raw, KINDS[kind]).reshape(32, 512)
    h = SimpleNamespace(format=KINDS[kind].name, shape=(32, 512), blocks=lambda: raw, load=None)
    got = dequantized(h)
    assert got.dtype == torch.float32 and np.array_equal(got.numpy().view(np.int32), ref.astype(np.float32).view(np.int32))
    odd = SimpleNamespace(format=KINDS[kind].name, shape=(24, 512), blocks=lambda: raw[:24],
                          load=lambda dt: torch.from_numpy(ref[:24].copy()))
    assert torch.equal(dequantized(odd), torch.from_numpy(ref[:24]))
    if kind == "q6k":  # Q4_K (no k-quant layout of its own here): q4k_dequantize_rows, gguf's values too
        from gguf_writer import quantize_q4_k

        raw4 = quantize_q4_k(np.random.default_rng(6).standard_normal((32, 512)).astype(np.float32) * 0.02)
        raw4[:, 4:16] = np.random.default_rng(7).integers(0, 256, (32, 12), dtype=np.uint8)  # every scale / min bit
        ref4 = dequantize(raw4, Q.Q4_K).reshape(32, 512)
        got4 = dequantized(SimpleNamespace(format="Q4_K", shape=(32, 512), blocks=lambda: raw4, load=None))
        assert np.array_equal(got4.numpy().view(np.int32), ref4.astype(np.float32).view(np.int32))
