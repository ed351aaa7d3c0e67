"""The "mxfp4" expert kind (quant/mxfp4.py): gpt-oss's MXFP4 experts held as their e2m1 codes and
computed exactly.

Checked: the kind's dequantized weights (torch, every layout; the native prefill dequantization) are
the MXFP4 values bit for bit across every E8M0 exponent 0..254 with the bias group, in both nibble
orders; what the form refuses (a bias that is no bf16 number, a scale byte 255 under non-zero codes);
the native kernels (tiled int4's int8-activation paths with the e2m1 table) against the dequantized
weights times the q8-rounded activations, on every ISA path this CPU has, at 1, 2, 5, 8 and 64 rows,
including groups whose int16 sums would overflow without widening (AVX2's vpmaddubsw); that no bf16 /
int16 activation path is ever taken; the fused expert and the torch-op path (a CUDA device's plain
layout, an accelerator's copies) on the same weights; the segment layout and its bytes; the planner's
pricing names. The engines on the tiny gpt-oss checkpoints are in tests/test_gpt_oss.py and
tests/test_gguf_gpt_oss.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tiered.checkpoint.gpt_oss import FP4_E2M1, dequantize_mxfp4, mxfp4_codes, with_bias
from tiered.checkpoint.model_config import biased_width
from tiered.kernels import load
from tiered.quant import mxfp4
from tiered.quant.experts import ExpertFormat, fit_format, pricing_precision, token_activations

ext = load()
native_only = pytest.mark.skipif(ext is None, reason="native extension unavailable (tiered.kernels.load() is None)")
from test_native_kernels import isa  # noqa: E402,F401  the ISA paths (scalar .. this machine's best) as a fixture


def random_mxfp4(R: int, G: int, exponents: torch.Tensor, seed: int):
    """(blocks uint8 [R, G, 16], e8m0 uint8 [R, G], bias bf16 [R]): random codes, the scale bytes drawn
    from `exponents`."""
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (R, G, 16), dtype=torch.uint8, generator=g)
    scales = exponents[torch.randint(0, len(exponents), (R, G), generator=g)].to(torch.uint8)
    bias = (torch.randn(R, generator=g) * torch.exp2(torch.randint(-20, 20, (R,), generator=g).float())).bfloat16()
    return blocks, scales, bias


def mxfp4_values(blocks: torch.Tensor, scales: torch.Tensor, halves: bool) -> torch.Tensor:
    """The MXFP4 weights fp32 [R, G * 32], computed independently of tiered: each e2m1 value times
    2^(e - 127) in fp64 (exact), rounded once to fp32."""
    R, G, _ = blocks.shape
    lo, hi = (blocks & 15).long(), (blocks >> 4).long()
    codes = torch.cat((lo, hi), -1) if halves else torch.stack((lo, hi), -1).reshape(R, G, 32)
    v = torch.tensor(FP4_E2M1, dtype=torch.float64)[codes]
    return (v * torch.exp2(scales.double() - 127)[..., None]).float().reshape(R, G * 32)


def as_segments(blocks, scales, bias, halves: bool, layout: str):
    """One projection [R, biased_width(K)] in the kind's segments, and the weight it should hold."""
    R, G, _ = blocks.shape
    width = biased_width(G * 32)
    codes, scale = mxfp4_codes(blocks, scales, bias, width, halves)
    want = with_bias(mxfp4_values(blocks, scales, halves), bias.float(), width)
    return mxfp4.segments(codes, scale, layout), want


# --------------------------------------------------------------------------------- exact weights
@pytest.mark.parametrize("layout", ["tiled", "plain", "cpu"])
@pytest.mark.parametrize("halves", [False, True], ids=["openai_nibbles", "ggml_nibbles"])
def test_dequantized_weights_are_the_mxfp4_values_bit_for_bit(layout, halves):
    """Every E8M0 exponent 0..254 (2^-127 .. 2^127: subnormal to overflowing products), random codes,
    random bf16 biases from 2^-20 to 2^20: (E2M1_U[code] - 12) * scale + zero equals the MXFP4 values
    with the bias as column K, zeros after it, bit for bit (infinities included), in every layout;
    and checkpoint/gpt_oss.dequantize_mxfp4 agrees."""
    blocks, scales, bias = random_mxfp4(256, 4, torch.arange(255), seed=3)
    scales[:, 0] = torch.arange(256) % 255  # every exponent at least once
    v, want = as_segments(blocks, scales, bias, halves, layout)
    got = mxfp4.dequantize(v, 256, want.shape[1])
    assert ("gw" in v) == (layout == "tiled")
    assert torch.equal(got, want) and torch.isinf(want).any() and (want[want != 0].abs() < 2.0 ** -126).any()
    assert torch.equal(with_bias(dequantize_mxfp4(blocks, scales, halves), bias, want.shape[1]), want)


def test_expert_format_slot_holds_the_weights_exactly():
    """A gpt-oss-shaped expert (gate / up [F, Db], down [D, Fb]) in an ExpertFormat slot: fmt.dequantize
    gives each projection's MXFP4 weight and bias; the tiled slot has no residual segment: 320 bytes a
    16 x 32 group-tile (0.625 a weight) plus 64-byte alignment."""
    D, F_ = 64, 32
    Db, Fb = biased_width(D), biased_width(F_)
    shapes = ((F_, Db), (F_, Db), (D, Fb))
    exps = torch.arange(100, 140)
    for layout in ("tiled", "plain"):
        fmt = ExpertFormat("mxfp4", shapes, layout)
        slot, parts, wants = fmt.empty(), [], []
        for i, (N, K) in enumerate(shapes):
            blocks, scales, bias = random_mxfp4(N, (K - 32) // 32, exps, seed=10 + i)
            v, want = as_segments(blocks, scales, bias, False, layout)
            parts.append(v)
            wants.append(want)
        fmt.encode(parts, slot)
        for got, want in zip(fmt.dequantize(slot), wants):
            assert torch.equal(got, want), layout
        if layout == "tiled":
            assert [list(v) for v in fmt.views(slot)] == [["gw"]] * 3
            assert fmt.nbytes == sum(N * K * 5 // 8 for N, K in shapes)  # 1920 + 1920 + 2560: whole 64-byte lines


def test_table_is_twice_the_e2m1_values():
    """E2M1_U - 12 (the kernels' table, csrc/gemv.cpp kE2m1U) and the torch path's bit arithmetic are
    2 * FP4_E2M1 by code."""
    want = [int(2 * v) for v in FP4_E2M1]
    assert [u - mxfp4.CENTRE for u in mxfp4.E2M1_U] == want
    assert mxfp4.e2m1_doubled(torch.arange(16, dtype=torch.uint8)).tolist() == want


def test_refused_forms():
    """A bias that is no bf16 number (fp32 with more bits, not finite) and a scale byte 255 (NaN in
    E8M0) under a non-zero code are refused (ValueError); an all-zero group takes byte 255."""
    blocks, scales, bias = random_mxfp4(4, 2, torch.arange(120, 130), seed=5)
    with pytest.raises(ValueError, match="bf16"):
        mxfp4_codes(blocks, scales, torch.tensor([0.1, 0.2, 0.3, 0.4]), 96)
    with pytest.raises(ValueError, match="bf16"):
        mxfp4_codes(blocks, scales, torch.tensor([1.0, float("inf"), 0.0, 0.0]), 96)
    bad = scales.clone()
    bad[1, 1] = 255
    blocks[1, 1, 0] = 0x01
    with pytest.raises(ValueError, match="255"):
        mxfp4_codes(blocks, bad, bias, 96)
    zero = blocks.clone()
    zero[1, 1] = 0x88  # -0 and -0: no value
    codes, _ = mxfp4_codes(zero, bad, bias, 96)
    assert not (codes[1, 32:64] & 7).any()


@pytest.mark.parametrize("halves", [False, True], ids=["openai_nibbles", "ggml_nibbles"])
@pytest.mark.parametrize("R, K", [(16, 32), (32, 96), (48, 2880), (64, 64)])
def test_tiles_straight_from_the_blocks_are_the_tiled_segments(halves, R, K):
    """tiled_from_blocks (the load path) writes the bytes segments(mxfp4_codes(...), "tiled") gives, bit for
    bit, into the slot's view it is handed (every byte of it: the view starts as garbage), over every E8M0
    byte but the NaN; with a strided (fused gate/up) view of the blocks too; and refuses what mxfp4_codes
    refuses."""
    G, width = K // 32, biased_width(K)
    blocks, scales, bias = random_mxfp4(2 * R, G, torch.arange(0, 255), seed=R + K)
    for rows in (slice(0, R), slice(1, 2 * R, 2)):  # contiguous, and every other row (gate of gate_up)
        b, s, bb = blocks[rows], scales[rows], bias[rows]
        want = mxfp4.segments(*mxfp4_codes(b, s, bb, width, halves), "tiled")["gw"]
        out = torch.full((R // 16, width // 32, 320), 0xA5, dtype=torch.uint8)
        got = mxfp4.tiled_from_blocks(b, s, bb, width, halves, out=out)
        assert got.data_ptr() == out.data_ptr() and torch.equal(got, want)
        assert torch.equal(mxfp4.tiled_from_blocks(b, s, bb, width, halves), want)
    with pytest.raises(ValueError, match="bf16"):
        mxfp4.tiled_from_blocks(blocks[:R], scales[:R], torch.full((R,), 0.1), width, halves)
    bad, nonzero = scales[:R].clone(), blocks[:R].clone()
    bad[3, 0], nonzero[3, 0, 0] = 255, 0x11
    with pytest.raises(ValueError, match="255"):
        mxfp4.tiled_from_blocks(nonzero, bad, bias[:R], width, halves)


def test_quantize_is_ocp_rounding():
    """Dense weights re-quantized (`quantize`: what the kind does to weights not stored as MXFP4, OCP
    MX's scale 2^(floor(log2 max) - 2)): MXFP4 values come back exactly (the group's scale may be finer
    than the stored one, never coarser); others within half the group's max (the top step, clipped at 6)."""
    blocks, scales, _ = random_mxfp4(16, 3, torch.arange(110, 130), seed=6)
    w = mxfp4_values(blocks, scales, False)
    codes, scale = mxfp4.quantize(w)
    assert torch.equal(mxfp4.dequantize(mxfp4.segments(codes, scale, "plain"), 16, 96), w)
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(1)) * 3
    c, s = mxfp4.quantize(x)
    err = (mxfp4.dequantize(mxfp4.segments(c, s, "plain"), 8, 64) - x).abs().reshape(8, 2, 32).amax(-1)
    assert (err <= x.abs().reshape(8, 2, 32).amax(-1) / 2).all()


def test_pricing_and_fitting():
    """The planner prices mxfp4 as int4 on int8 activations at every setting (gemv/cpu/int4q8); shapes the tiled layout
    cannot hold fall back to int8-g32 (exact for MXFP4 too) or int8."""
    from tiered.hardware import op_time
    from tiered.hardware.profile import HardwareProfile, LinearModel
    from tiered.memory.sizes import bytes_per_element

    assert pricing_precision("mxfp4") == "int4" and token_activations("mxfp4", "bf16") == "q8"
    assert token_activations("int4", "bf16") == "bf16" and op_time.gemv_dtype("int4", token_activations("mxfp4", "bf16")) == "int4q8"
    assert op_time.find(HardwareProfile("p", "test", {"gemv/cpu/int4q8": LinearModel(0.0, 1.0)}), "gemv", "cpu", "mxfp4").beta == 1.0
    assert bytes_per_element("mxfp4") == 0.625
    assert fit_format("mxfp4", ((40, 96), (32, 96), (64, 50))) == "int8-g32,mxfp4,int8"


# ------------------------------------------------------------------------------------ kernels
def q8_reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [B, K] @ w^T with x rounded as the kernels round it (int8 per group of 32: xq = round(x * 127 /
    max|x|), half to even, dx = max|x| / 127), in fp64."""
    B, K = x.shape
    xg = x.reshape(B, K // 32, 32)
    amax = xg.abs().amax(-1, keepdim=True)
    xq = torch.round(xg * torch.where(amax > 0, 127 / amax, torch.zeros_like(amax)))
    return ((xq * (amax / 127)).reshape(B, K).double() @ w.double().T).float()


def rel(y, ref):
    return ((y - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


@native_only
@pytest.mark.parametrize("N,K0", [(16, 32), (48, 64), (96, 576), (32, 2048)])
def test_kernel_is_the_weights_times_q8_activations(isa, N, K0):
    """int4_tiled_kernel(e2m1=True) (the kind's projection kernel) against the dequantized weight times
    the q8-rounded activations, exact up to fp32 sums, at 1, 2, 5, 8 and 64 rows, on every ISA path
    (AVX-512 vpdpbusd, AVX2's streamed and unpacked vpmaddubsw, scalar); whatever act / batch_act it
    is given (bf16 and int16 paths never run it); the native dequantization gives the torch one's bits."""
    blocks, scales, bias = random_mxfp4(N, K0 // 32, torch.arange(118, 132), seed=N + K0)
    v, w = as_segments(blocks, scales, bias, False, "tiled")
    K = w.shape[1]
    g = torch.Generator().manual_seed(7)
    out_bias = torch.randn(N, generator=g)
    for act, batch in (("q8", "q8"), ("bf16", "bf16"), ("bf16", "q8")):
        k = ext.int4_tiled_kernel(v["gw"], None, None, out_bias, act, batch, e2m1=True)
        assert k.name().startswith("mxfp4tq8") and k.in_features == K and k.out_features == N
        for B in (1, 2, 5, 8, 64):
            x = torch.randn(B, K, generator=g)
            x[:, K0] = 1.0  # the bias input
            x[:, K0 + 1:] = 0.0
            x[0, :32] = 0  # an all-zero group (dx = 0)
            assert rel(k(x), q8_reference(x, w) + out_bias) < 1e-5, (isa, act, batch, B)
    for fp32 in (True, False):
        got = ext.int4_tiled_dequantize(v["gw"], None, None, fp32=fp32, e2m1=True)
        assert torch.equal(got, w if fp32 else w.bfloat16()), fp32


@native_only
def test_kernel_sums_do_not_overflow(isa):
    """Groups of code 7 (u = 24) or 15 (u = 0) against activations all at +-127 after rounding: sums of
    u xq reach 32 * 24 * 127 = 97536, and a row's int16 lanes of AVX2's vpmaddubsw sums 16 * 24 * 127
    over a group, beyond int16 (that path widens them every two chunks); scales 2^-31 .. 2^25."""
    N, K0 = 32, 256
    blocks = torch.full((N, K0 // 32, 16), 0x77, dtype=torch.uint8)
    blocks[1::2] = 0xFF
    blocks[::4, 3] = 0x7F
    scales = torch.full((N, K0 // 32), 127 - 30, dtype=torch.uint8) + torch.arange(K0 // 32, dtype=torch.uint8) * 8
    bias = torch.ones(N, dtype=torch.bfloat16)
    v, w = as_segments(blocks, scales, bias, False, "tiled")
    K = w.shape[1]
    k = ext.int4_tiled_kernel(v["gw"], None, e2m1=True)
    for B in (1, 2, 8, 64):
        x = torch.ones(B, K)
        x[1::2] = -1
        x[:, K0 + 1:] = 0
        assert rel(k(x), q8_reference(x, w)) < 1e-5, (isa, B)
        assert rel(k(x), x @ w.T) < 1e-5, (isa, B)  # +-1 rounds to +-127 / 127 exactly


@native_only
def test_fused_expert_native_and_torch_paths(isa):
    """A SwiGLU expert of mxfp4 projections: the native fused kernel (ExpertFormat.forward's native
    path, int8 activations) and the torch-op path of the plain layout (what a CUDA device computes
    after its copy: the weight dequantized with the table, then matmuls) both against the fp32 weights."""
    D, F_ = 128, 96
    g = torch.Generator().manual_seed(8)
    ws = [torch.randn(F_, D, generator=g) * 0.05, torch.randn(F_, D, generator=g) * 0.05,
          torch.randn(D, F_, generator=g) * 0.05]
    shapes = ((F_, D), (F_, D), (D, F_))
    tiled, plain = ExpertFormat("mxfp4", shapes, "tiled"), ExpertFormat("mxfp4", shapes, "plain")
    assert tiled.native is not None and plain.native is None
    s_t, s_p = tiled.empty(), plain.empty()
    tiled.quantize(ws, s_t)
    plain.quantize(ws, s_p)
    for a, b in zip(tiled.dequantize(s_t), plain.dequantize(s_p)):
        assert torch.equal(a, b)
    wg, wu, wd = tiled.dequantize(s_t)
    for B in (1, 3, 8, 20):
        x = torch.randn(B, D, generator=g)
        ref = (F.silu(x @ wg.T) * (x @ wu.T)) @ wd.T
        assert rel(tiled.forward(x, s_t), ref) < 2e-2, (isa, B)  # 8-bit activations
        assert rel(plain.forward(x, s_p), ref) < 1e-5, (isa, B)  # torch: fp32 x, exact weights


@native_only
def test_prompt_projections_past_the_kernel_rows_dequantize_on_avx512(monkeypatch):
    """An mxfp4 projection of more rows than quant/experts.mxfp4_kernel_rows() is dequantized for one GEMM,
    in bf16 where the kernels' ISA is AVX-512 (oneDNN's bf16 GEMM: 4.9 ms against the q8 kernel's 9.7 at 256 rows
    of a gpt-oss-20b projection on 2 Sapphire Rapids cores); on AVX2 the q8 kernel takes up to 512 rows."""
    from tiered import kernels as kmod
    from tiered.quant import experts as ex

    N, K = 48, 96
    w = torch.randn(N, K, generator=torch.Generator().manual_seed(3)) * 0.05
    v = mxfp4.segments(*mxfp4.quantize(w), "tiled")
    wq = mxfp4.dequantize(mxfp4.segments(*mxfp4.quantize(w), "plain"), N, K)
    x = torch.randn(128, K, generator=torch.Generator().manual_seed(4))
    bf16 = F.linear(x.bfloat16(), wq.bfloat16()).float()
    monkeypatch.setattr(kmod, "isa", lambda: "avx512")
    monkeypatch.setattr(kmod, "mxfp4_kernel_rows", lambda: None)  # this machine untuned: the table by ISA
    rows = ex.mxfp4_kernel_rows()
    assert rows == ex.MXFP4_KERNEL_ROWS["avx512"] < 128
    assert torch.equal(ex.project(x, v, "mxfp4", "tiled"), bf16)
    assert rel(ex.project(x[:rows], v, "mxfp4", "tiled"), q8_reference(x[:rows], wq)) < 1e-5  # the q8 kernel
    monkeypatch.setattr(kmod, "isa", lambda: "avx2")
    assert ex.mxfp4_kernel_rows() == ex.GROUPED_ROWS["mxfp4"]
    assert rel(ex.project(x, v, "mxfp4", "tiled"), q8_reference(x, wq)) < 1e-5
    # a measured tuning (kernels/tune.py's mxfp4_kernel_rows; 0: the kernel at any rows, as on 2 Zen 5 cores)
    # decides on any ISA; a profiled machine's through `tuning`
    monkeypatch.setattr(kmod, "isa", lambda: "avx512")
    monkeypatch.setattr(kmod, "mxfp4_kernel_rows", lambda: 0)
    assert ex.mxfp4_kernel_rows() == 1 << 30 and ex.prompt_rows("mxfp4", None)[0] == 1 << 30
    assert rel(ex.project(x, v, "mxfp4", "tiled"), q8_reference(x, wq)) < 1e-5  # 128 rows: the q8 kernel
    monkeypatch.setattr(kmod, "mxfp4_kernel_rows", lambda: 64)
    assert torch.equal(ex.project(x, v, "mxfp4", "tiled"), bf16)  # past 64: dequantized
    assert ex.prompt_rows("mxfp4", "avx512", True, tuning={"mxfp4_kernel_rows": 0})[0] == 1 << 30
    assert ex.prompt_rows("mxfp4", "avx512", True, tuning={})[0] == ex.MXFP4_KERNEL_ROWS["avx512"]
