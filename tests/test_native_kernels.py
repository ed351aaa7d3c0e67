"""tiered's own GEMV kernels (tiered/kernels/csrc/gemv.cpp) against dequantized fp32 references, on
every ISA path this CPU has (set_isa forces the AVX2 and scalar fallbacks), and the fused expert
against the torch-op expert path."""

import pytest
import torch
import torch.nn.functional as F

from tiered.kernels import load
from tiered.kernels.linear import (int4_kernel, int4_tiled_kernel, kernel_for, plain_codes, tiled_codes, tiled_residual,
                                   tiled_group_scales, tiled_int8, tiled_scales, untiled_codes, untiled_group_scales,
                                   untiled_int8, untiled_residual, untiled_scales)
from tiered.quant.experts import ExpertFormat
from tiered.quant.int4 import Int4Linear, quantize_int4
from tiered.quant.int8 import Int8Linear

ext = load()
pytestmark = pytest.mark.skipif(ext is None, reason="native extension unavailable (tiered.kernels.load() is None)")
ORDER = ["scalar", "avx2", "avx512"]
ISAS = ORDER[:ORDER.index(ext.best_gemv_isa()) + 1] if ext is not None else []
if ext is not None and ext.best_gemv_isa() == "avx512" and ext.has_vbmi():
    ISAS.append("avx512+int16")  # the machine tuning's int16 activations for tiled int4 (tune.py)
SHAPES = [(33, 64), (97, 576), (160, 96), (1, 32)]  # (N, K): odd N, K a multiple of 32


@pytest.fixture(params=ISAS)
def isa(request):
    """An ISA path (and "avx512+int16": AVX-512 with the int4_int16_act tuning), the machine's own
    tuning put back afterwards."""
    saved = ext.tuning()
    name, _, tuned = request.param.partition("+")
    ext.set_isa(name)
    ext.set_tuning(int4_int16_act=tuned == "int16")
    yield name
    ext.reset_isa()
    ext.set_tuning(**saved)


def rel(y, ref):
    return ((y - ref).abs().max() / ref.abs().max().clamp_min(1e-6)).item()


@pytest.mark.parametrize("N,K", SHAPES)
def test_int4(isa, N, K):
    g = torch.Generator().manual_seed(N * K)
    w = torch.randn(N, K, generator=g) * 0.05
    codes, scale, zero = quantize_int4(w)
    sz = torch.stack([scale, zero], -1).transpose(0, 1).contiguous().bfloat16()  # (G, N, 2) as Int4Linear
    zr = (zero.T - sz[..., 1].float()).bfloat16()  # (G, N) as ExpertFormat's residual
    bias = torch.randn(N, generator=g)
    wq = ((codes.float().reshape(N, -1, 32) - 8) * sz[..., 0].T.float()[..., None]
          + (sz[..., 1].T.float() + zr.T.float())[..., None]).reshape(N, K)
    k = int4_kernel(plain_codes(codes), sz, zr, bias)
    assert ext.gemv_isa() == isa and k.in_features == K and k.out_features == N
    for B in range(1, 9):
        x = torch.randn(B, K, generator=g)
        ref = x.bfloat16().float() @ wq.T + bias  # activations read as bf16, as torch's int4 kernel does
        assert rel(k(x), ref) < 1e-4, (isa, B)


# The int16 activations' range (gemv.cpp kW16Levels): 127 * 257, so that each value is 256 h + l
# with h and l signed bytes (the AVX-512 path multiplies them by vpdpbusd).
W16_LEVELS = 32639


def group_round(x, levels: int):
    """x [..., K] per group of 32 as the kernels quantize it: (codes round(x * levels / max|x|), half
    to even, [..., K/32, 32]; max|x| [..., K/32, 1]); the step is max|x| / levels."""
    xg = x.reshape(*x.shape[:-1], x.shape[-1] // 32, 32)
    amax = xg.abs().amax(-1, keepdim=True)
    return torch.round(xg * torch.where(amax > 0, levels / amax, torch.zeros_like(amax))), amax


def q8_reference(x, codes, sz, zr, levels: int = 127, offset_exact: bool = False):
    """int4 x int8-activation result emulated in torch (fp64 for the exact integer dots): x [B, K] ->
    [B, N]. x per group of 32: xq = round(x * 127 / max|x|) (half to even), dx = max|x| / 127;
    y = sum_g s dx sum_i (q_i - 8) xq_i + (zero + residual) sum_i x_i.
    levels=W16_LEVELS, offset_exact: the int16 activations of the tiled layout's AVX2 path, whose -8 s
    term multiplies the exact sum of x: y = sum_g s dx sum_i q_i xq_i + (zero + residual - 8 s) sum_i x_i."""
    B, K = x.shape
    N, G = codes.shape[0], K // 32
    xg = x.reshape(B, G, 32)
    xq, amax = group_round(x, levels)
    s = sz[..., 0].float().T  # (N, G)
    z = sz[..., 1].float().T + zr.float().T - (8 * s if offset_exact else 0)
    q = codes.double().reshape(N, G, 32) - (0 if offset_exact else 8)
    d = torch.einsum("ngi,bgi->bng", q, xq.double()).float()  # (B, N, G)
    return (s * (amax[..., 0] / levels)[:, None, :] * d).sum(-1) + xg.sum(-1) @ z.T


@pytest.mark.parametrize("N,K", SHAPES + [(50, 160), (19, 4096)])  # G % 4 = 0, 1, 2, 3; K = Mixtral's width
def test_int4_q8(isa, N, K):
    g = torch.Generator().manual_seed(N * K + 1)
    w = torch.randn(N, K, generator=g) * 0.05
    codes, scale, zero = quantize_int4(w)
    sz = torch.stack([scale, zero], -1).transpose(0, 1).contiguous().bfloat16()
    zr = (zero.T - sz[..., 1].float()).bfloat16()
    bias = torch.randn(N, generator=g)
    wq = ((codes.float().reshape(N, -1, 32) - 8) * sz[..., 0].T.float()[..., None]
          + (sz[..., 1].T.float() + zr.T.float())[..., None]).reshape(N, K)
    k = int4_kernel(plain_codes(codes), sz, zr, bias, act="q8")
    assert ext.gemv_isa() == isa and k.name().startswith("int4q8")
    for B in range(1, 10):  # 9: two passes of activation rows
        x = torch.randn(B, K, generator=g)
        x[0, :32] = 0  # an all-zero group (dx = 0)
        y = k(x)
        assert rel(y, q8_reference(x, codes, sz, zr) + bias) < 1e-5, (isa, B)  # exact up to fp32 rounding
        assert rel(y, x @ wq.T + bias) < 2e-2, (isa, B)  # 8-bit activations: ~0.3% typical


TILED_SHAPES = [(16, 32), (48, 64), (96, 576), (32, 4096)]  # (N, K): N % 16 == 0, K % 32 == 0


def int4_case(N, K, seed):
    """codes [N, K], sz [G, N, 2], zr [G, N], bias [N] and the dequantized fp32 weight they encode."""
    g = torch.Generator().manual_seed(seed)
    codes, scale, zero = quantize_int4(torch.randn(N, K, generator=g) * 0.05)
    sz = torch.stack([scale, zero], -1).transpose(0, 1).contiguous().bfloat16()
    zr = (zero.T - sz[..., 1].float()).bfloat16()
    wq = ((codes.float().reshape(N, -1, 32) - 8) * sz[..., 0].T.float()[..., None]
          + (sz[..., 1].T.float() + zr.T.float())[..., None]).reshape(N, K)
    return codes, sz, zr, torch.randn(N, generator=g), wq, g


def test_tiled_layout_round_trips():
    codes, sz, zr, *_ = int4_case(48, 96, 0)
    t = tiled_codes(codes)
    assert t.shape == (48, 48) and t.dtype == torch.uint8
    assert torch.equal(untiled_codes(t), codes)
    assert torch.equal(untiled_scales(tiled_scales(sz)), sz) and torch.equal(untiled_residual(tiled_residual(zr)), zr)
    # byte 4r + j of a tile's first 64 bytes: column j low, column 4 + j high, of row r
    assert t.reshape(-1)[4 * 5 + 2].item() == codes[5, 2].item() | (codes[5, 6].item() << 4)
    with pytest.raises(ValueError):
        tiled_codes(codes[:40])


@pytest.mark.parametrize("N,K", TILED_SHAPES)
def test_int4_tiled(isa, N, K):
    """act "bf16": on AVX-512 (VBMI) and scalar, bf16 activations as the plain kernel (one rounding of
    x); on AVX2 (and AVX-512 without VBMI) x as int16 per group of 32 (more exact than bf16)."""
    codes, sz, zr, bias, wq, g = int4_case(N, K, N * K + 2)
    k = int4_tiled_kernel(tiled_codes(codes), tiled_scales(sz), tiled_residual(zr), bias)
    assert k.name().startswith("int4t(") and k.in_features == K and k.out_features == N
    for B in range(1, 10):  # 9: two passes of activation rows
        x = torch.randn(B, K, generator=g)
        x[0, :32] = 0  # an all-zero group (scale 0)
        check_tiled_bf16_act(k, x, codes, sz, zr, wq, bias, (isa, B))


def check_tiled_bf16_act(k, x, codes, sz, zr, wq, bias, what):
    """k(x) on its "bf16" activations: int16 ones on the AVX2 path and where the machine's tuning
    asks for them on AVX-512 (exact to 1e-5 against their emulation, and closer to fp32 x than bf16
    would be), else x rounded to bf16."""
    y = k(x)
    if "int16 x" in k.name():
        assert rel(y, q8_reference(x, codes, sz, zr, levels=W16_LEVELS, offset_exact=True) + bias) < 1e-5, what
        assert rel(y, x @ wq.T + bias) < 2e-4, what
    else:
        assert rel(y, x.bfloat16().float() @ wq.T + bias) < 1e-4, what


@pytest.mark.parametrize("N,K", TILED_SHAPES + [(16, 160)])
def test_int4_tiled_q8(isa, N, K):  # int8 activations: the plain q8 kernel's numerics, exactly
    codes, sz, zr, bias, wq, g = int4_case(N, K, N * K + 3)
    k = int4_tiled_kernel(tiled_codes(codes), tiled_scales(sz), tiled_residual(zr), bias, act="q8")
    assert k.name().startswith("int4tq8")  # AVX2: vpmaddubsw on int16-summed groups
    for B in list(range(1, 10)) + [12, 13, 17]:  # AVX2: streamed in passes of 4 rows up to 12, unpacked past
        x = torch.randn(B, K, generator=g)
        x[0, :32] = 0  # an all-zero group (dx = 0)
        y = k(x)
        assert rel(y, q8_reference(x, codes, sz, zr) + bias) < 1e-5, (isa, B)
        assert rel(y, x @ wq.T + bias) < 2e-2, (isa, B)


@pytest.mark.parametrize("N,K", [(48, 64), (32, 576)])
def test_int4_tiled_batch_act(isa, N, K):  # one row on bf16 activations, two or more on int8 ones
    codes, sz, zr, bias, wq, g = int4_case(N, K, N * K + 6)
    k = int4_tiled_kernel(tiled_codes(codes), tiled_scales(sz), tiled_residual(zr), bias, batch_act="q8")
    x = torch.randn(9, K, generator=g)
    check_tiled_bf16_act(k, x[:1], codes, sz, zr, wq, bias, isa)  # AVX2: int16 activations
    assert "q8 from 2 rows" in k.name()
    for B in (2, 4, 5, 9, 13):  # AVX2: passes of 4 rows per tile and the 1-3 left over; unpacked tiles past 12
        assert rel(k(x[:B]), q8_reference(x[:B], codes, sz, zr) + bias) < 1e-5, (isa, B)


def test_int4_tiled_rejects_bad_shapes():
    codes, sz, zr, *_ = int4_case(32, 64, 4)
    with pytest.raises(RuntimeError, match="16"):
        ext.int4_tiled_kernel(tiled_codes(codes)[:24], tiled_scales(sz))
    with pytest.raises(RuntimeError, match="sz"):
        ext.int4_tiled_kernel(tiled_codes(codes), sz)  # Int4Linear's [G, N, 2], not the tiled [N/16, G, 16, 2]
    with pytest.raises(RuntimeError, match="act"):
        ext.int4_tiled_kernel(tiled_codes(codes), tiled_scales(sz), act="fp8")
    with pytest.raises(RuntimeError, match="batch_act"):
        ext.int4_tiled_kernel(tiled_codes(codes), tiled_scales(sz), batch_act="int2")


def test_int4_tiled_dequantize(isa):  # every ISA path gives the same bits
    codes, sz, zr, _, wq, _ = int4_case(64, 96, 5)
    args = (tiled_codes(codes), tiled_scales(sz), tiled_residual(zr))
    w = ext.int4_tiled_dequantize(*args)
    assert w.dtype == torch.bfloat16 and w.shape == (64, 96)
    assert torch.equal(w, wq.bfloat16())  # one rounding of the exact weight
    assert torch.equal(ext.int4_tiled_dequantize(*args, n0=16, n1=48), w[16:48])
    w32 = ext.int4_tiled_dequantize(*args, fp32=True)
    assert w32.dtype == torch.float32 and rel(w32, wq) < 1e-6
    with pytest.raises(RuntimeError, match="tiles"):
        ext.int4_tiled_dequantize(*args, n0=8, n1=48)


@pytest.mark.parametrize("N,K", [(48, 64), (32, 576), (16, 160)])
@pytest.mark.parametrize("residual", [True, False])
def test_int4_tiled_scales_inline_give_the_same_bits(isa, N, K, residual):
    """The scales inline (tiled_inline: each group-tile's 256 code bytes, then its (s, z) pairs: one
    stream of whole cache lines) against the same weight with its scales apart, on every ISA, for
    every activation kind and batch (the streaming, blocked and int16 paths), with and without a
    residual, and the dequantized weight."""
    from tiered.kernels.linear import inline_codes, inline_scales, tiled_inline

    codes, sz, zr, bias, wq, g = int4_case(N, K, N * K + 9)
    tc, ts, tr = tiled_codes(codes), tiled_scales(sz), tiled_residual(zr) if residual else None
    buf = tiled_inline(tc, ts)
    assert buf.shape == (N // 16, K // 32, 320)
    assert torch.equal(inline_scales(buf), ts) and torch.equal(inline_codes(buf), tc)
    for act, batch in (("bf16", "bf16"), ("bf16", "q8"), ("q8", "q8")):
        apart = int4_tiled_kernel(tc, ts, tr, bias, act, batch)
        inline = int4_tiled_kernel(buf, None, tr, bias, act, batch)
        assert inline.name() == apart.name() and inline.weight_bytes() == apart.weight_bytes()
        for B in (1, 2, 4, 5, 9):
            x = torch.randn(B, K, generator=g)
            assert torch.equal(inline(x), apart(x)), (act, batch, B)
    assert torch.equal(ext.int4_tiled_dequantize(buf, None, tr), ext.int4_tiled_dequantize(tc, ts, tr))
    with pytest.raises(RuntimeError, match="take no sz"):
        ext.int4_tiled_kernel(buf, ts)
    with pytest.raises(RuntimeError, match="320"):
        ext.int4_tiled_kernel(torch.cat([buf, buf[..., :32]], dim=-1), None)


def test_int4_linear_codes_match_torch_layout():
    w = torch.randn(48, 128) * 0.05
    codes, scale, zero = quantize_int4(w)
    m = Int4Linear.from_codes(codes, scale, zero, bias=torch.randn(48)).with_plain_codes(codes)
    x = torch.randn(3, 128)
    assert "tiered" in kernel_for(m).name()
    assert rel(kernel_for(m)(x), m(x).float()) < 1e-2  # torch's kernel rounds its output to bf16


@pytest.mark.parametrize("N,K", SHAPES + [(7, 50)])
def test_int8(isa, N, K):
    g = torch.Generator().manual_seed(N + K)
    m = Int8Linear.from_dense(torch.randn(N, K, generator=g), bias=torch.randn(N, generator=g))
    k = kernel_for(m)
    wq = m.q.float() * m.scale.float()[:, None]
    for B in range(1, 9):
        x = torch.randn(B, K, generator=g)
        x[0, :min(K, 32)] = 0  # an all-zero group (scale 0)
        y = k(x)
        assert rel(y, int8_activations(k, x) @ wq.T + m.bias) < 1e-5, (isa, B)
        assert rel(y, x @ wq.T + m.bias) < 1e-3, (isa, B)


@pytest.mark.parametrize("N,K", TILED_SHAPES + [(16, 160)])
def test_int8_tiled(isa, N, K):  # the per-row kernel's integer dots, from the tiled layout
    g = torch.Generator().manual_seed(N * 3 + K)
    m = Int8Linear.from_dense(torch.randn(N, K, generator=g), bias=torch.randn(N, generator=g))
    k, rows = ext.int8_tiled_kernel(tiled_int8(m.q), m.scale, m.bias), kernel_for(m)
    assert k.name() == f"int8t(tiered,{isa}; int16 x)"
    wq = m.q.float() * m.scale.float()[:, None]
    for B in range(1, 10):
        x = torch.randn(B, K, generator=g)
        x[0, :32] = 0  # an all-zero group (scale 0)
        y = k(x)
        # 5e-5: torch's rounding of x * 32639 / max|x| can land one int16 step from the kernels' at
        # a near tie (the per-row kernel's too, e.g. this test's shape (48, 64) at B = 5)
        assert rel(y, int8_activations(k, x) @ wq.T + m.bias) < 5e-5, (isa, B)
        if isa != "scalar":  # the same int16 activations as the per-row kernel (whose scalar path reads fp32 x)
            assert rel(y, rows(x)) < 1e-6, (isa, B)


@pytest.mark.parametrize("N,K", TILED_SHAPES + [(16, 160)])
def test_int8g32_tiled(isa, N, K):  # GGUF Q8_0's weights: fp16 scales per row and group of 32
    g = torch.Generator().manual_seed(N * 11 + K)
    q = torch.randint(-127, 128, (N, K), generator=g, dtype=torch.int8)
    st = (torch.rand(N, K // 32, generator=g) * 1e-2 + 1e-3).half()
    bias = torch.randn(N, generator=g)
    k = ext.int8g32_tiled_kernel(tiled_int8(q), tiled_group_scales(st), bias)
    assert k.name() == f"int8g32t(tiered,{isa}; int16 x)"
    wq = (q.float().reshape(N, -1, 32) * st.float()[..., None]).reshape(N, K)
    for B in range(1, 10):
        x = torch.randn(B, K, generator=g)
        x[0, :32] = 0
        y = k(x)
        assert rel(y, int8_activations(k, x) @ wq.T + bias) < 5e-5, (isa, B)
        assert rel(y, x @ wq.T + bias) < 1e-3, (isa, B)
    assert torch.equal(untiled_group_scales(tiled_group_scales(st)), st)
    with pytest.raises(RuntimeError, match="st must be"):
        ext.int8g32_tiled_kernel(tiled_int8(q), st)  # [N, K/32], not the tiled [N/16, K/32, 16]


@pytest.mark.parametrize("g32", [False, True])
def test_int8_tiled_batch_act(isa, g32):  # one row on int16 activations, two or more on int8 ones (AVX-512, scalar)
    N, K = 48, 576
    g = torch.Generator().manual_seed(17 + g32)
    q = torch.randint(-128, 128, (N, K), generator=g, dtype=torch.int8)  # -128: the codes' full range
    scale = torch.rand(N, generator=g) * 1e-2 + 1e-3
    st = (torch.rand(N, K // 32, generator=g) * 1e-2 + 1e-3).half()
    bias = torch.randn(N, generator=g)
    if g32:
        k = ext.int8g32_tiled_kernel(tiled_int8(q), tiled_group_scales(st), bias, "q8")
        wq = (q.float().reshape(N, -1, 32) * st.float()[..., None]).reshape(N, K)
    else:
        k = ext.int8_tiled_kernel(tiled_int8(q), scale, bias, "q8")
        wq = q.float() * scale[:, None]
    q8 = isa != "avx2"  # AVX2 keeps int16 activations (vpmaddubsw's pair sums would saturate)
    assert ("q8 from 2 rows" in k.name()) == q8
    x = torch.randn(13, K, generator=g)
    x[1, :32] = 0  # an all-zero group (dx = 0)
    x[2, 64:96] = 1e3  # a group whose int8 codes reach +-127
    assert rel(k(x[:1]), int8_activations(k, x[:1]) @ wq.T + bias) < 5e-5  # one row: int16, as before
    for B in (2, 3, 4, 5, 8, 9, 13):  # passes of 8 rows: two chains up to 4 rows, one from 5
        xq, amax = group_round(x[:B], 127)
        ref = (xq * (amax / 127)).reshape(B, K) @ wq.T + bias if q8 else int8_activations(k, x[:B]) @ wq.T + bias
        y = k(x[:B])
        assert rel(y, ref) < 5e-5, (isa, B)
        assert rel(y[:1], k(x[:1])) < (2e-2 if q8 else 1e-6), (isa, B)  # row 0 alone: int16 activations
    with pytest.raises(RuntimeError, match="batch_act"):
        ext.int8_tiled_kernel(tiled_int8(q), scale, bias, "int4")


def test_tiled_int8_layout_round_trips_and_rejects_bad_shapes():
    q = torch.randint(-127, 128, (32, 64), dtype=torch.int8)
    t = tiled_int8(q)
    assert t.dtype == torch.uint8 and t.shape == (32, 64)
    assert t[0, :8].tolist() == [int(v) + 128 for v in q[0, :4]] + [int(v) + 128 for v in q[1, :4]]  # rows 0, 1 of columns 0-3
    assert torch.equal(untiled_int8(t), q)
    with pytest.raises(ValueError, match="16"):
        tiled_int8(q[:24])
    with pytest.raises(ValueError, match="32"):
        tiled_int8(q[:, :48])
    with pytest.raises(RuntimeError, match="16"):
        ext.int8_tiled_kernel(t[:24], torch.ones(24))


@pytest.mark.parametrize("kind", ["int8", "int8-g32"])
def test_expert_int8_tiles_only_what_fits(kind):  # N % 16, K % 32: the kernels' binding and the format agree
    D = 128
    g = torch.Generator().manual_seed(2)
    cases = ((96, (True, True, True)), (40, (False, False, False)), (48, (True, True, False)))
    for Fi, tiled in cases if kind == "int8" else cases[:1]:  # int8-g32's K % 32 == 0 makes every N tile
        ws = [torch.randn(Fi, D, generator=g) * 0.05, torch.randn(Fi, D, generator=g) * 0.05,
              torch.randn(D, Fi, generator=g) * 0.05]
        fmt = ExpertFormat(kind, ((Fi, D), (Fi, D), (D, Fi)), "tiled")
        slot = fmt.empty()
        fmt.quantize(ws, slot)
        assert tuple("qt" in v for v in fmt.views(slot)) == tiled, Fi
        wg, wu, wd = fmt.dequantize(slot)
        assert rel(wd, ws[2]) < 1e-2
        x = torch.randn(3, D, generator=g)
        ref = (F.silu(x @ wg.T) * (x @ wu.T)) @ wd.T
        assert rel(fmt.forward(x, slot), ref) < 1e-4, Fi  # native: int16 activations
        assert rel(fmt.forward(x.repeat(20, 1), slot)[:3], ref) < 1e-4, Fi  # in groups of rows


def int8_activations(k, x):
    """The activations an int8 kernel multiplies: x itself, or on the AVX2 and AVX-512 paths (K % 32
    == 0) x rounded to int16 per group of 32 (dx = max|x| / W16_LEVELS, half to even: ~60x finer than bf16)."""
    if "int16 x" not in k.name():
        return x
    q, amax = group_round(x, W16_LEVELS)
    return (q * (amax / W16_LEVELS)).reshape(x.shape)


@pytest.mark.parametrize("N,K", SHAPES + [(7, 50), (5, 100)])
def test_bf16(isa, N, K):
    g = torch.Generator().manual_seed(N * 7 + K)
    lin = torch.nn.Linear(K, N).to(torch.bfloat16)
    k = kernel_for(lin)
    for B in range(1, 9):
        x = torch.randn(B, K, generator=g)
        ref = x.bfloat16().float() @ lin.weight.float().T + lin.bias.float()
        assert rel(k(x), ref) < 1e-5, (isa, B)


@pytest.mark.parametrize("N,K", SHAPES + [(7, 50), (5, 100)])
def test_fp32(isa, N, K):  # the lossless mode's decode weights: our loop to 16 rows, at::linear above
    g = torch.Generator().manual_seed(N * 5 + K)
    lin = torch.nn.Linear(K, N)
    lin.weight.data, lin.bias.data = torch.randn(N, K, generator=g) / K ** 0.5, torch.randn(N, generator=g)
    k = kernel_for(lin)
    assert k.name() == f"fp32(tiered,{isa})"
    for B in list(range(1, 9)) + [16, 17, 40]:
        x = torch.randn(B, K, generator=g)
        ref = (x.double() @ lin.weight.double().T + lin.bias.double()).float()
        # relative to sum |x w| + |b|, the scale of fp32 rounding (a single output near 0 cancels)
        scale = (x.abs() @ lin.weight.abs().T + lin.bias.abs()).max()
        assert ((k(x) - ref).abs().max() / scale).item() < 1e-6, (isa, B)
    with pytest.raises(RuntimeError, match="f32_kernel"):
        ext.f32_kernel(torch.randn(N, 2 * K)[:, ::2])  # rows not contiguous


def test_int8_linear_small_batch_uses_native_and_matches():
    m = Int8Linear.from_dense(torch.randn(40, 64))
    x = torch.randn(2, 5, 64)  # 10 rows: torch's kernel; 1 row: ours
    wq = m.q.float() * m.scale.float()[:, None]
    assert rel(m(x), x @ wq.T) < 2e-2
    assert rel(m(x[0, :1]), int8_activations(m._native, x[0, :1]) @ wq.T) < 1e-5 and m._native


@pytest.mark.parametrize("name,layout", [("int4", "plain"), ("int4", "tiled"), ("int8", "cpu"), ("int8", "tiled"),
                                         ("int8-g32", "tiled"), ("int4,int4,int8-g32", "tiled"),
                                         ("int4,int4,int8", "plain"),
                                         ("int4,int4,int8", "tiled"), ("bf16", "cpu")])
def test_fused_expert(isa, name, layout):  # int4 projections on int8 activations (EXPERT_INT4_ACT)
    D, Fi = 128, 96
    g = torch.Generator().manual_seed(1)
    ws = [torch.randn(Fi, D, generator=g) * 0.05, torch.randn(Fi, D, generator=g) * 0.05,
          torch.randn(D, Fi, generator=g) * 0.05]
    fmt = ExpertFormat(name, ((Fi, D), (Fi, D), (D, Fi)), layout)
    if fmt.is_dense:
        slot = tuple(w.bfloat16() for w in ws)
    else:
        slot = fmt.empty()
        fmt.quantize(ws, slot)
        assert fmt.native is not None
    wg, wu, wd = fmt.dequantize(slot)
    for B in (1, 3, 8):
        x = torch.randn(B, D, generator=g)
        ref = (F.silu(x @ wg.T) * (x @ wu.T)) @ wd.T
        y = fmt.forward(x, slot)
        tol = 2e-2 if "int4" in name and layout == "plain" else 1e-2  # plain int4: int8 activations (EXPERT_INT4_ACT)
        assert y.dtype == x.dtype and rel(y, ref) < tol, (isa, name, B)
        # and about the same in groups of 8 rows (up to 32: NATIVE_ROWS, then grouped_rows)
        y_grouped = fmt.forward(x.repeat(4, 1), slot)[:B]
        assert rel(y, y_grouped) < 2e-2
        if layout == "tiled" and B > 1:  # batch_act q8: int8 activations from 2 rows, the tiled int8 kinds' too
            q8 = ExpertFormat(name, fmt.shapes, layout, "q8")
            y8 = q8.forward(x, slot)
            same = "int4" not in name and isa == "avx2"  # (AVX2's int8 kernels keep int16 activations)
            assert rel(y8, ref) < 2e-2 and torch.equal(y8, y) == same, (isa, name, B)
            assert torch.equal(q8.forward(x[:1], slot), fmt.forward(x[:1], slot))  # one row: as before


@pytest.mark.parametrize("name", ["int8-g32", "int8", "int4"])
def test_forward_group_format_rows(isa, name):  # a row's output does not depend on how many rows its expert took
    """ExpertFormat.forward_group's format_rows (the MoE runner passes its step's tokens): with batch_act "q8" an
    expert given one row of a 5-token step reads the int8 activations a call of several rows reads, as the native
    step's layer call computes it, where without format_rows its lone row reads int16 (AVX2's int8 kinds: int16
    always); an expert split into groups of 8 rows takes the whole call's formats in each group."""
    D, Fi = 128, 96
    g = torch.Generator().manual_seed(5)
    fmt = ExpertFormat(name, ((Fi, D), (Fi, D), (D, Fi)), "tiled", "q8")
    slot = fmt.empty()
    fmt.quantize([torch.randn(Fi, D, generator=g) * 0.05, torch.randn(Fi, D, generator=g) * 0.05,
                  torch.randn(D, Fi, generator=g) * 0.05], slot)
    x = torch.randn(9, D, generator=g)
    many = fmt.forward_group(x[:3], [slot], [0, 3])  # 3 rows: int8 activations
    one = fmt.forward_group(x[:1], [slot], [0, 1], format_rows=5)
    assert rel(one, many[:1]) < 1e-6, (isa, name)
    lone = fmt.forward_group(x[:1], [slot], [0, 1])  # one row by itself: int16 where the ISA has int8 rows
    assert (rel(lone, many[:1]) < 1e-6) == (isa == "avx2" and "int8" in name), (isa, name)
    nine = fmt.forward_group(x, [slot], [0, 9])  # groups of 8 and 1: the 9th row in the call's formats
    assert rel(nine[8:], fmt.forward_group(x[7:], [slot], [0, 2])[1:]) < 1e-6, (isa, name)


def test_no_native_kernel_for_torch_int4_layout_falls_back():
    fmt = ExpertFormat("int4", ((32, 64), (32, 64), (64, 32)), "cpu")
    assert fmt.native is None
    slot = fmt.empty()
    fmt.quantize([torch.randn(32, 64) * 0.05, torch.randn(32, 64) * 0.05, torch.randn(64, 32) * 0.05], slot)
    assert fmt.forward(torch.randn(1, 64), slot).shape == (1, 64)


def test_set_isa_rejects_unknown():
    with pytest.raises(RuntimeError):
        ext.set_isa("neon")


@pytest.mark.parametrize("fmt", ["Q4_0", "Q4_1"])
def test_q4_blocks_repack_to_the_tiled_layout_bit_for_bit(fmt, isa):
    """GGUF Q4_0 / Q4_1 expert blocks -> the tiled int4 segments in one native pass (loading a MoE
    GGUF), the same bytes as the numpy / torch path (unpack_q4_blocks, int4_segments): codes,
    bf16 scales and zeros, and the zero's bf16 residual (nonzero for Q4_1's m + 8 d); on every ISA
    path (AVX-512 gathers a tile's 16 rows into a vector's lanes)."""
    import numpy as np

    from tiered.bench.gguf_moe import random_blocks
    from tiered.quant.experts import int4_segments
    from tiered.quant.int4 import unpack_q4_blocks

    rng = np.random.default_rng(0)
    raw = random_blocks(rng, 48, 96, "Q4_0", 0.02)
    if fmt == "Q4_1":  # d, m, codes: a random fp16 m in each block
        b = raw.reshape(48, -1, 18)
        m = (rng.standard_normal(b.shape[:2]) * 0.01).astype(np.float16).view(np.uint8).reshape(*b.shape[:2], 2)
        raw = np.concatenate([b[:, :, :2], m, b[:, :, 2:]], axis=-1).reshape(48, -1)
    from tiered.kernels.linear import tiled_inline

    ref = int4_segments(*unpack_q4_blocks(raw, fmt), "plain")  # (G, N) order: tiled below
    ref = {"codes": tiled_codes(unpack_q4_blocks(raw, fmt)[0]), "sz": tiled_scales(ref["sz"]),
           "zr": tiled_residual(ref["zr"])}
    codes, sz, zr = ext.q4_blocks_tiled(torch.from_numpy(raw), 18 if fmt == "Q4_0" else 20)
    assert torch.equal(codes, ref["codes"])
    assert torch.equal(sz.view(torch.int16), ref["sz"].view(torch.int16))
    assert torch.equal(zr.view(torch.int16), ref["zr"].view(torch.int16))
    assert (fmt == "Q4_1") == bool(zr.float().abs().max() > 0)
    # the scales inline (ExpertFormat's tiled int4 segments): the numpy / torch path's bytes too
    gw, zr2 = ext.q4_blocks_tiled(torch.from_numpy(raw), 18 if fmt == "Q4_0" else 20, inline_sz=True)
    segs = int4_segments(*unpack_q4_blocks(raw, fmt), "tiled")
    assert torch.equal(gw, tiled_inline(codes, sz)) and torch.equal(gw, segs["gw"])
    assert torch.equal(zr2.view(torch.int16), zr.view(torch.int16)) and torch.equal(zr2.view(torch.int16), segs["zr"].view(torch.int16))
    gw_out, zr_out = torch.full_like(gw, 7), torch.full_like(zr, 7)
    got = ext.q4_blocks_tiled(torch.from_numpy(raw), 18 if fmt == "Q4_0" else 20, zr_out=zr_out, inline_out=gw_out)
    assert got[0].data_ptr() == gw_out.data_ptr() and got[1].data_ptr() == zr_out.data_ptr()
    assert torch.equal(gw_out, gw) and torch.equal(zr_out.view(torch.int16), zr.view(torch.int16))
    with pytest.raises(RuntimeError, match="go to inline_out"):
        ext.q4_blocks_tiled(torch.from_numpy(raw), 18 if fmt == "Q4_0" else 20, codes, inline_out=gw_out)
    with pytest.raises(RuntimeError, match="N % 16"):
        ext.q4_blocks_tiled(torch.from_numpy(raw[:8]), 18 if fmt == "Q4_0" else 20)
    outs = [torch.full_like(t, 7) for t in (codes, sz, zr)]  # written in place: the same bytes
    got = ext.q4_blocks_tiled(torch.from_numpy(raw), 18 if fmt == "Q4_0" else 20, *outs)
    assert all(g.data_ptr() == o.data_ptr() and torch.equal(g.view(torch.uint8), t.view(torch.uint8))
               for g, o, t in zip(got, outs, (codes, sz, zr)))
    with pytest.raises(RuntimeError, match="sz_out: must be a contiguous CPU BFloat16 tensor of shape"):
        ext.q4_blocks_tiled(torch.from_numpy(raw), 18 if fmt == "Q4_0" else 20, outs[0], outs[1].float())


def test_q8_blocks_repack_to_the_tiled_layout_bit_for_bit(isa):
    """GGUF Q8_0 expert blocks -> the tiled int8-g32 segments in one native pass, the same bytes as
    the numpy / torch path (unpack_q8_blocks, int8_g32_segments), on every ISA path."""
    import numpy as np

    from tiered.bench.gguf_moe import random_blocks
    from tiered.quant.experts import int8_g32_segments
    from tiered.quant.gguf_experts import unpack_q8_blocks

    raw = random_blocks(np.random.default_rng(1), 48, 96, "Q8_0", 0.02)
    ref = int8_g32_segments(*unpack_q8_blocks(raw), "tiled")
    qt, st = ext.q8_blocks_tiled(torch.from_numpy(raw))
    assert torch.equal(qt, ref["qt"]) and torch.equal(st.view(torch.int16), ref["st"].view(torch.int16))
    with pytest.raises(RuntimeError, match="N % 16"):
        ext.q8_blocks_tiled(torch.from_numpy(raw[:8]))
    qt_out, st_out = torch.zeros_like(qt), torch.zeros_like(st)  # written in place: the same bytes
    got = ext.q8_blocks_tiled(torch.from_numpy(raw), qt_out, st_out)
    assert got[0].data_ptr() == qt_out.data_ptr() and torch.equal(qt_out, qt)
    assert torch.equal(st_out.view(torch.int16), st.view(torch.int16))
    with pytest.raises(RuntimeError, match="qt_out: must be a contiguous CPU Byte tensor of shape"):
        ext.q8_blocks_tiled(torch.from_numpy(raw), qt_out[:16])


def test_stream_prefetch_changes_no_bits(isa):
    """The machine tuning's software prefetch (tune.py) only moves loads earlier: every weight
    format's kernel gives the same bits with it off, on into the L1, on into the L2, on for calls of 2+ rows
    only (stream_prefetch_rows) and on for the sub-byte formats only (stream_prefetch_bytes off), at 1 to 9
    activation rows."""
    codes, sz, zr, bias, _, g = int4_case(96, 576, 11)
    lin = torch.nn.Linear(576, 96).to(torch.bfloat16)
    kernels = [int4_tiled_kernel(tiled_codes(codes), tiled_scales(sz), tiled_residual(zr), bias, batch_act="q8"),
               int4_kernel(plain_codes(codes), sz, zr, bias, act="q8"), int4_kernel(plain_codes(codes), sz, zr, bias),
               kernel_for(Int8Linear.from_dense(torch.randn(96, 576, generator=g))), kernel_for(lin)]
    saved = ext.tuning()
    try:
        for B in (1, 2, 9):
            x = torch.randn(B, 576, generator=g)
            ext.set_tuning(stream_prefetch=True, prefetch_l2=False, stream_prefetch_bytes=True)
            on = [k(x) for k in kernels]
            ext.set_tuning(prefetch_l2=True)
            on_l2 = [k(x) for k in kernels]
            ext.set_tuning(prefetch_l2=False, stream_prefetch_bytes=False)  # on for int4 only
            wide_only = [k(x) for k in kernels]
            ext.set_tuning(stream_prefetch=False, stream_prefetch_rows=True)  # on for 2+ rows only
            rows_only = [k(x) for k in kernels]
            ext.set_tuning(stream_prefetch_rows=False)
            off = [k(x) for k in kernels]
            for k, a, b, c, d, e in zip(kernels, on, on_l2, off, rows_only, wide_only):
                assert all(torch.equal(o, c) for o in (a, b, d, e)), (isa, k.name(), B)
    finally:
        ext.set_tuning(**saved)


@pytest.mark.parametrize("heads,kv_heads,hd", [(12, 4, 64), (8, 2, 128), (4, 4, 64), (10, 2, 64), (6, 3, 96)])
@pytest.mark.parametrize("kv", [torch.float32, torch.bfloat16])
def test_the_wide_attention_computes_what_the_8_wide_one_does(heads, kv_heads, hd, kv):
    """attend_wide (AVX-512: 16-float vectors) gives the native step's attention the 8-wide path's result, to
    float rounding (the same sums in another order): a prompt's causal rows, and one decode row over enough keys
    that the step splits them among threads (merge_parts); head sizes not a multiple of 64 keep the 8-wide loops."""
    from tiered.checkpoint.model_config import ModelConfig
    from tiered.models import build_model
    from tiered.models.layers import KVCache
    from tiered.runtime.cpu_decode import CPUDecodeStep

    if ext.best_gemv_isa() != "avx512":
        pytest.skip("attend_wide is AVX-512's")
    torch.manual_seed(0)
    cfg = ModelConfig(model_type="llama", vocab_size=64, hidden_size=128, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=hd)
    model = build_model(cfg, 2100).eval()
    for p in model.parameters():
        p.data.normal_(0, 0.5)
    step = CPUDecodeStep(model, native=True)
    T = 203
    prompt = (torch.randint(0, 64, (T, 1)), torch.arange(T).unsqueeze(1), torch.zeros(T, dtype=torch.long))
    was = ext.tuning()["attend_wide"]
    out = {}
    try:
        for wide in (False, True):
            ext.set_tuning(attend_wide=wide)
            assert ext.tuning()["attend_wide"] is wide
            cache = KVCache(cfg, 1, 2100, kv)
            g = torch.Generator().manual_seed(1)  # the same cached keys and values either way
            cache.k.normal_(generator=g), cache.v.normal_(generator=g)
            with torch.inference_mode():
                rows = step(*prompt, cache, rows=torch.arange(T)).float()
                one = step(torch.tensor([[5]]), torch.tensor([[2048]]), torch.tensor([0]), cache).float()
            out[wide] = (rows, one)
    finally:
        ext.set_tuning(attend_wide=was)
    for a, b in zip(out[False], out[True]):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4 * a.abs().max().item())


def test_kernel_tuning_is_measured_saved_and_applied(tmp_path, monkeypatch):
    """tune.measure runs its A/B on this machine and leaves the extension set to what it chose; the
    saved tuning.json is what load() applies, unless TIERED_KERNEL_TUNING=0."""
    from tiered.kernels import tune

    wide = ext.best_gemv_isa() == "avx512"  # attend_wide stays off without AVX-512
    # the extension's own; bf16_native_rows is Python's
    switches = {k: tune.DEFAULTS[k] and (k != "attend_wide" or wide) for k in tune.EXT_OPTIONS}
    settings = tune.EXT_OPTIONS
    saved = ext.tuning()
    try:
        result = tune.measure(ext, total_bytes=16 << 20, rounds=3)
        assert set(tune.DEFAULTS) <= set(result) and ext.tuning() == {k: result[k] for k in settings}
        assert len(result["ratios"]["stream_prefetch"]) == 3
        # the byte formats' batch-1 prefetches, timed on their own: off where that wins by the margin
        byte_off = tune.choose(result["ratios"]["stream_prefetch_bytes"], result["margin"])
        assert result["stream_prefetch_bytes"] is (not byte_off)
        assert ("prefetch_l2" in result["ratios"]) == result["stream_prefetch"]  # only where prefetches stay on
        # calls of 2+ rows: timed only where batch 1 runs without prefetches (else they prefetch anyway)
        assert ("stream_prefetch_rows" in result["ratios"]) == (not result["stream_prefetch"])
        assert ("int4_int16_act" in result["ratios"]) == (ext.best_gemv_isa() == "avx512" and ext.has_vbmi())
        assert ("attend_wide" in result["ratios"]) == wide  # the attention's vector width: AVX-512's choice
        assert result["bf16_native_rows"] == tune.choose_rows(
            {n: result["ratios"][f"bf16_rows_{n}"] for n in tune.ROW_CHOICES}, result["margin"])
        for key, ratios in (("q8_dequantize_rows", "q8_dequantize"), ("q8_expert_grouped_rows", "q8_expert_groups"),
                            ("mxfp4_kernel_rows", "mxfp4_kernel")):
            assert result[key] == tune.choose_dequantize_rows(
                {n: result["ratios"][f"{ratios}_{n}"] for n in tune.DEQUANTIZE_ROW_CHOICES}, result["margin"])
        assert tune.measured(tmp_path) is False
        assert result["attempts"] == 1 and isinstance(result["contended"], bool)
        again = dict(result, contended=True)  # a contended tuning measured again counts on
        assert tune.measure(ext, total_bytes=16 << 20, rounds=1, previous=again)["attempts"] == 2
        ext.set_tuning(**{k: result[k] for k in settings})
        flipped = {k: (not v) and (k != "attend_wide" or wide) for k, v in switches.items()}
        tune.save({**result, **flipped, "contended": False}, tmp_path)  # whatever this machine's load was
        assert tune.measured(tmp_path)
        ext.set_tuning(**switches)
        assert tune.apply(ext, tmp_path)["stream_prefetch"] == flipped["stream_prefetch"]
        assert ext.tuning() == flipped
        ext.set_tuning(**switches)
        monkeypatch.setenv("TIERED_KERNEL_TUNING", "0")
        assert tune.apply(ext, tmp_path) is None and ext.tuning() == switches
        monkeypatch.delenv("TIERED_KERNEL_TUNING")
        for added in ("bf16_native_rows", "q8_dequantize_rows", "q8_expert_grouped_rows", "mxfp4_kernel_rows",
                      "stream_prefetch_bytes"):
            tune.save({k: v for k, v in result.items() if k != added}, tmp_path)
            assert not tune.measured(tmp_path)  # a tuning saved before a choice was added is measured again
        for malformed in ({"q8_dequantize_rows": "never"}, {"bf16_native_rows": 2.5}):
            tune.save({**result, **flipped, **malformed}, tmp_path)
            assert tune.apply(ext, tmp_path) is None and ext.tuning() == switches  # a malformed choice: none applied
        (tmp_path / "tuning.json").write_text("{not json")
        assert tune.apply(ext, tmp_path) is None and ext.tuning() == switches
    finally:
        ext.set_tuning(**saved)


def test_the_tunings_prefetch_is_named_as_it_runs():
    """tune.prefetch_name, the kernel-tuning line's words for the stream prefetches: off, off at batch 1 but on for
    calls of 2+ rows (stream_prefetch_rows), on, on into the L2, and the byte formats' batch-1 switch where it
    differs (stream_prefetch_bytes)."""
    from tiered.kernels.tune import prefetch_name

    assert prefetch_name({"stream_prefetch": False, "stream_prefetch_rows": False}) == "off"
    assert prefetch_name({"stream_prefetch": False}) == "off"  # a tuning saved before the switch
    assert prefetch_name({"stream_prefetch": False, "stream_prefetch_rows": True}) == "off at batch 1, on for 2+ rows"
    assert prefetch_name({"stream_prefetch": True, "stream_prefetch_rows": True}) == "on"
    assert prefetch_name({"stream_prefetch": True, "prefetch_l2": True}) == "on, into the L2"
    assert prefetch_name({"stream_prefetch": True, "stream_prefetch_bytes": True}) == "on"
    assert (prefetch_name({"stream_prefetch": True, "stream_prefetch_bytes": False})
            == "on (formats of a byte or more: off at batch 1)")
    assert (prefetch_name({"stream_prefetch": False, "stream_prefetch_rows": False, "stream_prefetch_bytes": True})
            == "off (formats of a byte or more: on at batch 1)")


def test_a_dequantize_choice_that_cannot_be_timed_keeps_the_table(monkeypatch):
    """tune.measure: a row-count A/B that raises (a format this machine's kernels cannot run) leaves its choice
    None (quant's tables by ISA) with the error said, and the other choices measured: the tuning, and with it a
    fresh build's load(), does not fail for it."""
    from tiered.kernels import tune

    def broken(*a, **kw):
        raise RuntimeError("no mxfp4 kernel here")
    monkeypatch.setattr(tune, "_mxfp4_ab", broken)
    saved = ext.tuning()
    try:
        result = tune.measure(ext, total_bytes=16 << 20, rounds=1)
    finally:
        ext.set_tuning(**saved)
    assert result["mxfp4_kernel_rows"] is None and "no mxfp4 kernel here" in result["errors"]["mxfp4_kernel_rows"]
    assert isinstance(result["q8_dequantize_rows"], int) and isinstance(result["q8_expert_grouped_rows"], int)
    assert not any(k.startswith("mxfp4_kernel_") for k in result["ratios"])


def test_a_tuning_other_processes_disturbed_is_measured_again(tmp_path, monkeypatch):
    """contention.others_share: the share of the cores other processes ran meanwhile (/proc/stat's busy
    seconds less this process's own); a tuning with more than CONTENDED_SHARE of them is "contended"
    and tune.measured (setup's `python -m tiered.kernels`) says measure again, up to RETUNES tunings
    in a row; one saved before the field is kept. tune.complete (the engine's load(), which tunes only
    a fresh build) keeps every tuning of all choices."""
    from tiered.hardware import contention
    from tiered.kernels import tune

    clock = {"busy": 100.0, "own": 10.0, "wall": 50.0}
    monkeypatch.setattr(contention, "_busy_seconds", lambda: clock["busy"])
    monkeypatch.setattr(contention, "_own_seconds", lambda: clock["own"])
    monkeypatch.setattr(contention.time, "monotonic", lambda: clock["wall"])
    monkeypatch.setattr(contention.os, "cpu_count", lambda: 2)
    start = contention.start()
    clock.update(busy=104.0, own=12.0, wall=52.0)  # 4 CPU seconds in 2 s on 2 cores, 2 of them ours
    assert contention.others_share(*start) == pytest.approx(0.5)
    assert contention.others_share(None, *start[1:]) is None
    assert contention.record(start, None) == {"others_share": 0.5, "contended": True, "attempts": 1}
    assert contention.record(start, {"contended": True, "attempts": 2})["attempts"] == 3
    assert contention.record(start, {"contended": False, "attempts": 2})["attempts"] == 1
    monkeypatch.setattr(contention.time, "sleep", lambda s: clock.update(busy=clock["busy"] + 2 * s * 0.1,
                                                                       wall=clock["wall"] + s))
    assert contention.quiet_now(0.5) is True  # others took 10% of the 2 cores while this one slept
    # one pytest process beside a tuning on 2 cores took 0.239 of them, and its choices were off (CONTENDED_SHARE)
    monkeypatch.setattr(contention.time, "sleep", lambda s: clock.update(busy=clock["busy"] + 2 * s * 0.239,
                                                                       wall=clock["wall"] + s))
    assert contention.quiet_now(0.5) is False
    monkeypatch.setattr(contention.time, "sleep", lambda s: clock.update(busy=clock["busy"] + 2 * s * 0.9,
                                                                       wall=clock["wall"] + s))
    assert contention.quiet_now(0.5) is False
    base = dict(tune.DEFAULTS)
    for fields, keep in ((dict(contended=False, attempts=1), True), (dict(contended=True, attempts=1), False),
                         (dict(contended=True, attempts=tune.RETUNES), True), ({}, True)):
        tune.save({**base, **fields}, tmp_path)
        assert tune.measured(tmp_path) is keep and tune.complete(tmp_path), fields
    assert tune.saved(tmp_path) == base
    (tmp_path / "tuning.json").write_text("[1, 2]")
    assert tune.saved(tmp_path) is None and not tune.measured(tmp_path) and not tune.complete(tmp_path)


def test_int4_prompt_rows_dequantize_from_where_the_gemm_first_wins():
    """tune.choose_dequantize_rows: the largest row count, ascending, below the first at which dequantize +
    GEMM wins by the margin (half the smallest where it wins there), 0 (never) where it never does."""
    from tiered.kernels.tune import choose_dequantize_rows

    zen5 = {64: [2.8], 128: [1.9], 256: [1.4], 512: [1.15]}  # the 2 Zen 5 cores' 4096 x 4096 medians, 2026-12-01
    assert choose_dequantize_rows(zen5) == 0
    assert choose_dequantize_rows({64: [1.3], 128: [0.9], 256: [0.5], 512: [0.4]}) == 64
    assert choose_dequantize_rows({64: [0.7], 128: [0.5]}) == 32
    assert choose_dequantize_rows({64: [1.2], 128: [0.98], 256: [1.1]}) == 0  # within the margin: the kernel


def test_bf16_expert_rows_go_native_up_to_where_torch_first_wins():
    """tune.choose_rows: the largest row count, ascending, before torch's GEMMs win by the margin."""
    from tiered.kernels.tune import choose_rows

    assert choose_rows({2: [1.6], 4: [1.4], 8: [0.86], 32: [0.5]}) == 4  # the Zen 4 VM's medians
    assert choose_rows({2: [1.2], 4: [1.1], 8: [1.05], 32: [1.3]}) == 32  # native throughout: as before tuning
    assert choose_rows({2: [0.9], 4: [1.2], 8: [1.1], 32: [1.0]}) == 1  # torch from 2 rows: stop there
    assert choose_rows({2: [0.98], 4: [0.5]}) == 2  # within the margin keeps the native kernel


def test_tuning_takes_the_alternative_only_past_the_margin():
    from tiered.kernels.tune import choose

    assert choose([0.90, 0.95, 0.96, 1.2, 0.8])  # median 0.95
    assert not choose([0.98, 0.99, 0.97, 1.1, 0.6])  # median 0.98: within the 3% margin
    assert not choose([1.05, 1.1, 1.2])
    assert not choose([])
    assert choose([0.9, 1.0])  # even count: the mean of the middle two


def test_kernel_errors_are_formatted_without_iostreams():
    """On the H200 host (shared/gpu-runs/2026-11-26-h200) the built library carried its own copy of
    libstdc++'s stream code, and a TORCH_CHECK that printed a number segfaulted: every rejected input
    killed the process (37 pytest workers). The sources check through TIERED_CHECK (kernel.h), which
    formats with std::to_string; this keeps TORCH_CHECK's ostringstream out of them."""
    import re
    from pathlib import Path

    csrc = Path(__file__).resolve().parents[1] / "tiered" / "kernels" / "csrc"
    for f in sorted(csrc.glob("*.[ch]*")):
        text = f.read_text()
        if f.name == "kernel.h":  # TIERED_CHECK's own definition
            text = text.replace("TORCH_CHECK(cond, ::tiered::cat(__VA_ARGS__))", "")
        bad = re.findall(r"\b(?:TORCH_CHECK|TORCH_INTERNAL_ASSERT|c10::str)\s*\(|std::\w*stringstream", text)
        assert not bad, f"{f.name}: {bad[:3]}: use TIERED_CHECK / tiered::cat"
    with pytest.raises(RuntimeError, match=r"int8_kernel: scale must have N = 4 elements, got 3"):
        load().int8_kernel(torch.zeros(4, 32, dtype=torch.int8), torch.ones(3), None)


@pytest.mark.parametrize("fmt", ["Q4_0", "Q4_1", "Q4_K"])
def test_decode_copies_from_gguf_blocks_are_the_unpacked_path_bit_for_bit(fmt):
    """quant/linear.build_decode_module packs GGUF Q4 decode copies (a fused q/k/v group here) in one
    native pass (_tiled_from_blocks): the same tiled bytes and outputs as unpacking the blocks and
    Int4Linear.from_codes. A group with a part not in blocks, or torch's "cpu" layout, unpacks as before."""
    import numpy as np

    from tiered.bench.gguf_moe import random_blocks
    from tiered.quant.int4 import Int4Linear, unpack_q4_blocks
    from tiered.quant.linear import DecodeWeight, build_decode_module

    from tiered.bench.gguf_dense import random_k_blocks
    from tiered.quant.gguf_experts import unpack_q4k_blocks

    rng = np.random.default_rng(1)
    K = 256 if fmt == "Q4_K" else 96
    raws = [random_blocks(rng, n, 96, "Q4_0", 0.02) if fmt != "Q4_K" else random_k_blocks(rng, n, K, "Q4_K", 0.02)
            for n in (48, 16, 32)]
    if fmt == "Q4_1":
        raws = [np.concatenate([r.reshape(r.shape[0], -1, 18)[:, :, :2],
                                (rng.standard_normal((r.shape[0], 3)) * 0.01).astype(np.float16).view(np.uint8)
                                .reshape(r.shape[0], 3, 2), r.reshape(r.shape[0], -1, 18)[:, :, 2:]], -1)
                .reshape(r.shape[0], -1) for r in raws]
    parts = [DecodeWeight("int4", blocks=r, block_format=fmt) for r in raws]
    bias = torch.randn(96)
    got = build_decode_module(parts, [bias[:48], None, bias[64:]], "tiled", "q8")
    unpack = unpack_q4k_blocks if fmt == "Q4_K" else (lambda r: unpack_q4_blocks(r, fmt))
    codes, scale, zero = (torch.cat(t) for t in zip(*(unpack(r) for r in raws)))
    want_bias = torch.cat([bias[:48], torch.zeros(16), bias[64:]])
    want = Int4Linear.from_codes(codes, scale, zero, 32, want_bias, "tiled", "q8")
    assert (got.layout, got.batch_act, got.in_features, got.out_features) == ("tiled", "q8", K, 96)
    assert torch.equal(got.packed, want.packed) and torch.equal(got.bias, want.bias)
    x = torch.randn(3, K)
    assert torch.equal(got(x[:1]), want(x[:1])) and torch.equal(got(x), want(x))
    cpu = build_decode_module(parts, [None] * 3, "cpu")  # torch's layout: through the codes
    assert cpu.layout == "cpu" and torch.equal(cpu.packed, Int4Linear.from_codes(codes, scale, zero).packed)
    mixed = [parts[0], DecodeWeight("int4", *unpack(raws[1])), parts[2]]  # unpacked codes in it
    assert torch.equal(build_decode_module(mixed, [None] * 3, "tiled").packed, want.packed)


def test_int4_prefill_path_by_isa(monkeypatch):
    """Int4Linear.dense (a prompt through a one-copy int4 weight) takes the kernel on its batch_act
    activations (Plan.batch_act: int8 by default, bf16 where asked) up to quant/int4.dequantize_rows()
    rows, the dequantized weight and one GEMM beyond, in dequantize_dtype() (bf16 on AVX-512, oneDNN's
    bf16 GEMM; else fp32); all give the same product within bf16 rounding."""
    import tiered.quant.int4 as I
    from tiered import kernels

    assert I.dequantize_rows() == I.DEQUANTIZE_ROWS.get(kernels.isa(), I.DEQUANTIZE_ROWS_OTHER)
    assert (I.dequantize_rows("q8", "avx2"), I.dequantize_rows("bf16", "avx2")) == (None, 256)
    assert I.dequantize_rows("q8", "avx512") == I.dequantize_rows("bf16", "avx512") == 96
    # a profiled machine's measured tuning decides its q8 calls (kernels/tune.py: 0 never), not its bf16 ones
    for tuned, rows in ((0, None), (128, 128), (None, 96)):
        assert I.dequantize_rows("q8", "avx512", {"q8_dequantize_rows": tuned}) == rows
        assert I.dequantize_rows("bf16", "avx512", {"q8_dequantize_rows": tuned}) == 96
    monkeypatch.setattr(kernels, "q8_dequantize_rows", lambda: None)  # this machine untuned: the tables
    g = torch.Generator().manual_seed(0)
    lin = I.Int4Linear.from_codes(*I.quantize_int4(torch.randn(64, 128, generator=g) * 0.05), 32, None, "tiled")
    x = torch.randn(80, 128, generator=g)
    calls = []
    monkeypatch.setattr(I.Int4Linear, "kernel", lambda self, act=None: calls.append(act) or
                        (lambda t: t.to(torch.bfloat16).float() @ tiled_dequantize_ref(self).T))
    monkeypatch.setattr(I, "DEQUANTIZE_ROWS", {kernels.isa(): None})
    by_kernel = lin.dense(x)
    assert calls == ["bf16"]  # from_codes' batch_act
    lin.batch_act = "q8"
    lin.dense(x)
    assert calls == ["bf16", "q8"]
    lin.batch_act = "bf16"
    monkeypatch.setattr(I, "DEQUANTIZE_ROWS", {kernels.isa(): 48})
    assert I.dequantize_dtype() == I.DEQUANTIZE_DTYPE.get(kernels.isa(), torch.float32)
    for dtype in (torch.bfloat16, torch.float32):
        monkeypatch.setattr(I, "DEQUANTIZE_DTYPE", {kernels.isa(): dtype})
        by_gemm = lin.dense(x)
        assert calls == ["bf16", "q8"]  # 80 rows > 48: dequantized, no kernel call
        assert by_gemm.dtype == x.dtype and by_gemm.shape == (80, 64)
        assert float((by_kernel - by_gemm).norm() / by_gemm.norm()) < 1e-2
        monkeypatch.setattr(I, "DEQUANTIZE_CHUNK", 16 * 128)  # 16-row chunks of W, y^T by rows: the same product
        assert torch.equal(lin.dense(x), by_gemm)
        monkeypatch.setattr(I, "DEQUANTIZE_CHUNK", 32 * 2**20)
    # calls on int8 activations follow DEQUANTIZE_ROWS_Q8 where it names the ISA (AVX2: the kernel at every row
    # count, 1.4-2.2x dequantize + fp32 GEMM's speed at 256-1024 rows on 2 Zen 3 cores), DEQUANTIZE_ROWS elsewhere
    monkeypatch.setattr(I, "DEQUANTIZE_ROWS_Q8", {kernels.isa(): None})
    lin.batch_act = "q8"
    lin.dense(x)
    assert calls == ["bf16", "q8", "q8"]  # 80 rows > 48, yet the kernel
    # ... unless this machine's kernel tuning measured where dequantizing wins (kernels.q8_dequantize_rows)
    monkeypatch.setattr(kernels, "q8_dequantize_rows", lambda: 64)
    assert torch.allclose(lin.dense(x), lin.dequantized(x).float()) and calls == ["bf16", "q8", "q8"]
    monkeypatch.setattr(kernels, "q8_dequantize_rows", lambda: 0)
    monkeypatch.setattr(I, "DEQUANTIZE_ROWS_Q8", {kernels.isa(): 48})
    lin.dense(x)
    assert calls == ["bf16", "q8", "q8", "q8"]  # never, whatever the table says


def tiled_dequantize_ref(lin):
    from tiered.kernels.linear import tiled_dequantize

    return tiled_dequantize(lin.packed, None)


def test_q6k_blocks_repack_bit_for_bit_on_every_isa(isa):
    """q6k_blocks_tiled's vectorized (AVX-512, AVX2) and baseline builds of one loop give the torch
    path's bytes: gguf's dequantization, quantize_int8_g32's fp16 scales and round-half-even codes."""
    import sys
    from pathlib import Path

    from gguf import GGMLQuantizationType as Q

    sys.path.insert(0, str(Path(__file__).parent))
    from gguf_writer import random_k_blocks
    from tiered.kernels.linear import tiled_group_scales, tiled_int8
    from tiered.quant.gguf_dequant import dequantize_blocks
    from tiered.quant.int8 import quantize_int8_g32

    raw6 = random_k_blocks(48, 768, Q.Q6_K, seed=7)
    qt, st = ext.q6k_blocks_tiled(torch.from_numpy(raw6))
    q, s = quantize_int8_g32(dequantize_blocks(raw6, "Q6_K"))
    assert torch.equal(qt, tiled_int8(q)) and torch.equal(st.view(torch.int16), tiled_group_scales(s).view(torch.int16))


def test_k_quant_blocks_repack_natively_bit_for_bit(isa):
    """Q4_K super-blocks -> the tiled int4 layout (q4_blocks_tiled with block 144) and Q6_K -> tiled
    int8-g32 (q6k_blocks_tiled) in one native pass each: the same bytes as the numpy / torch paths
    (unpack_q4k_blocks + int4_segments; gguf_dequant + quantize_int8_g32 + tiled_int8), on blocks
    whose every byte is random except finite fp16 scales (all 6-bit sub-scale patterns); on every ISA path."""
    import sys
    from pathlib import Path

    from gguf import GGMLQuantizationType as Q

    sys.path.insert(0, str(Path(__file__).parent))
    from gguf_writer import random_k_blocks
    from tiered.kernels.linear import tiled_group_scales, tiled_int8
    from tiered.quant.experts import int4_segments
    from tiered.quant.gguf_dequant import dequantize_blocks
    from tiered.quant.gguf_experts import unpack_q4k_blocks
    from tiered.quant.int8 import quantize_int8_g32

    raw = random_k_blocks(48, 512, Q.Q4_K, seed=5)
    gw, zr = ext.q4_blocks_tiled(torch.from_numpy(raw), 144, inline_sz=True)
    ref = int4_segments(*unpack_q4k_blocks(raw), "tiled")
    assert torch.equal(gw, ref["gw"]) and torch.equal(zr.view(torch.int16), ref["zr"].view(torch.int16))
    codes, sz, zr2 = ext.q4_blocks_tiled(torch.from_numpy(raw), 144)
    assert torch.equal(codes, tiled_codes(unpack_q4k_blocks(raw)[0])) and torch.equal(zr2.view(torch.int16), zr.view(torch.int16))
    with pytest.raises(RuntimeError, match="block must be"):
        ext.q4_blocks_tiled(torch.from_numpy(raw), 143)

    raw6 = random_k_blocks(32, 512, Q.Q6_K, seed=6)
    qt, st = ext.q6k_blocks_tiled(torch.from_numpy(raw6))
    q, s = quantize_int8_g32(dequantize_blocks(raw6, "Q6_K"))
    assert torch.equal(qt, tiled_int8(q)) and torch.equal(st.view(torch.int16), tiled_group_scales(s).view(torch.int16))
    with pytest.raises(RuntimeError, match="N % 16"):
        ext.q6k_blocks_tiled(torch.from_numpy(raw6[:8]))
    outs = [torch.full_like(qt, 7), torch.full_like(st, 7)]  # written in place: the same bytes
    got = ext.q6k_blocks_tiled(torch.from_numpy(raw6), *outs)
    assert all(g.data_ptr() == o.data_ptr() for g, o in zip(got, outs))
    assert torch.equal(got[0], qt) and torch.equal(got[1].view(torch.int16), st.view(torch.int16))
    with pytest.raises(RuntimeError, match="st_out: must be a contiguous CPU Half tensor"):
        ext.q6k_blocks_tiled(torch.from_numpy(raw6), None, st.float())


def test_run_grouped_is_each_kernel_on_its_rows():
    """run_grouped(kernels, x [G, B, K]) -> [G, B, N], row block g through kernels[g] (latent
    attention's per-head absorbed matrices); mismatched kernels or x are refused."""
    g = torch.Generator().manual_seed(0)
    ws = [torch.randn(24, 32, generator=g).to(torch.bfloat16) for _ in range(3)]
    ks = [ext.bf16_kernel(w) for w in ws]
    x = torch.randn(3, 2, 32, generator=g)
    y = ext.run_grouped(ks, x)
    assert y.shape == (3, 2, 24) and y.dtype == torch.float32
    for i, k in enumerate(ks):
        assert torch.equal(y[i], k(x[i]))
    with pytest.raises(RuntimeError, match="run_grouped"):
        ext.run_grouped(ks, x[:2].contiguous())  # 2 row blocks for 3 kernels
    with pytest.raises(RuntimeError, match="run_grouped"):
        ext.run_grouped(ks + [ext.bf16_kernel(torch.randn(8, 32).to(torch.bfloat16))], torch.randn(4, 2, 32))


def test_a_scratch_buffer_made_in_inference_mode_serves_calls_outside_it():
    """kernels/linear's reused dequantize buffer, first made inside torch.inference_mode (the engine's forwards,
    the kernel tuning's A/Bs in an engine's process), is made again for a call outside it: an inference tensor
    takes no in-place write there ("Inplace update to inference tensor outside InferenceMode")."""
    import threading

    from tiered.kernels.linear import bf16_rows

    w = torch.randn(64, 96)
    out = {}

    def run():  # a thread of its own: a fresh scratch, whatever earlier tests left in this one's
        with torch.inference_mode():
            inside = bf16_rows(w, 0, 64)
        assert inside.is_inference()
        outside = bf16_rows(w, 0, 32)  # fits the buffer made inside
        out["ok"] = not outside.is_inference() and torch.equal(outside, w[:32].to(torch.bfloat16))

    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert out.get("ok")
