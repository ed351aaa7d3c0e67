"""tiered's fp8 kernel (tiered/kernels/csrc/gemv.cpp, "fp8"): FP8 E4M3 ("fn") weights with a fp32 scale
per 128 x 128 block, as DeepSeek-V3 / Qwen3-FP8 checkpoints store them, against fp64 references on every
ISA path this CPU has (set_isa forces the AVX2 and scalar fallbacks); and fp8 projections in the fused
SwiGLU expert (ExpertSpec) from a flat slot, alone and beside int8."""

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from tiered.kernels import load
from tiered.kernels.linear import NATIVE_EXPERT_KINDS, expert_spec

ext = load()
native = pytest.mark.skipif(ext is None, reason="native extension unavailable (tiered.kernels.load() is None)")
ORDER = ["scalar", "avx2", "avx512"]
ISAS = ORDER[:ORDER.index(ext.best_gemv_isa()) + 1] if ext is not None else []
BLOCK = 128  # rows and columns per scale block
CODES = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)  # e4m3fn's 254 non-NaN codes
ALIGN = 64  # segment alignment in a slot (quant/experts.ALIGN)


@pytest.fixture(params=ISAS)
def isa(request):
    """An ISA path, the best one put back afterwards."""
    ext.set_isa(request.param)
    yield request.param
    ext.reset_isa()


def rel(y, ref):
    return ((y.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def block_scales(bs, N, K):
    """bs [ceil(N/128), ceil(K/128)] -> its scale of every weight, [N, K] fp64."""
    return bs.double().repeat_interleave(BLOCK, 0)[:N].repeat_interleave(BLOCK, 1)[:, :K]


def dequantize(q, bs):
    """The weight q (e4m3fn bits, uint8 [N, K]) and bs encode, fp64: e4m3(q) * bs[n // 128, k // 128]."""
    return q.view(torch.float8_e4m3fn).double() * block_scales(bs, *q.shape)


def fp8_weight(N, K, seed, scale=1e-2):
    """Random codes (every non-NaN code once when N * K >= 254, -0.0 and the subnormals among them) and
    block scales around `scale`, distinct per block: (q uint8 [N, K], bs fp32, w fp64)."""
    g = torch.Generator().manual_seed(seed)
    q = CODES[torch.randint(0, len(CODES), (N * K,), generator=g)]
    if N * K >= len(CODES):
        q[torch.randperm(N * K, generator=g)[:len(CODES)]] = CODES
    q = q.reshape(N, K)
    bs = (torch.rand(-(-N // BLOCK), -(-K // BLOCK), generator=g) + 0.5) * scale
    return q, bs, dequantize(q, bs)


def test_e4m3_codes_are_fp16_bits_times_256():
    """The kernels' conversion: code b -> fp16 bits ((b & 0x80) << 8) | ((b & 0x7f) << 7) is e4m3(b) / 256
    exactly, for every non-NaN code (subnormals and -0.0 included); in SIMD the same bits are the byte
    sign-extended to int16, shifted left by 7 and ANDed with 0xBFFF."""
    b = CODES.to(torch.int32)
    h = ((b & 0x80) << 8) | ((b & 0x7F) << 7)
    assert torch.equal(((b.to(torch.int8).to(torch.int32) << 7) & 0xBFFF), h)
    half = h.to(torch.int16).view(torch.float16).double() * 256
    want = CODES.view(torch.float8_e4m3fn).double()
    assert torch.equal(half, want) and torch.equal(torch.signbit(half), torch.signbit(want))
    assert (want.abs() < 2.0 ** -6).sum() == 16  # the subnormals (and zeros) are among them


@native
@pytest.mark.parametrize("K", [1, 16, 128, 137, 160])
def test_every_code_exactly(isa, K):
    """Row n holds code n in its last column (the scalar tail, a 16-column step, a whole block, past a
    block) and random codes elsewhere; x is one there and zero elsewhere, so y[n] is the code's value
    times its block's scale, exactly, on every path."""
    N = len(CODES)
    q, _, _ = fp8_weight(N, K, K)
    q[:, -1] = CODES
    bs = torch.full((-(-N // BLOCK), -(-K // BLOCK)), 0.5)
    bs[-1, -1] = 2.0
    x = torch.zeros(1, K)
    x[0, -1] = 1
    k = ext.fp8_kernel(q, bs)
    assert ext.gemv_isa() == isa and k.name() == f"fp8(tiered,{isa})"
    want = (CODES.view(torch.float8_e4m3fn).float() * block_scales(bs, N, K)[:, -1].float())[None]
    assert torch.equal(k(x), want)


@native
def test_nan_codes_read_as_480(isa):
    """e4m3fn's NaN codes (0x7f, 0xff; checkpoints hold none) read as +-480, the fp16 form's value, the
    same on every path."""
    q = torch.tensor([[0x7F], [0xFF]], dtype=torch.uint8)
    assert torch.equal(ext.fp8_kernel(q, torch.ones(1, 1))(torch.ones(1, 1)), torch.tensor([[480.0, -480.0]]))


@native
@pytest.mark.parametrize("N,K", [(1, 1), (33, 100), (130, 257), (256, 384), (96, 2048)])
def test_fp8_kernel(isa, N, K):
    q, bs, w = fp8_weight(N, K, N * K)
    g = torch.Generator().manual_seed(N + K)
    bias = torch.randn(N, generator=g)
    k = ext.fp8_kernel(q, bs)
    kb = ext.fp8_kernel(q.view(torch.float8_e4m3fn), bs, bias)  # the float8 tensor itself, and a bias
    assert (k.in_features, k.out_features) == (K, N)
    assert k.weight_bytes() == N * K + bs.numel() * 4
    for B in (1, 2, 5, 8, 9, 17):  # 9, 17: passes of 8 activation rows and a remainder
        x = torch.randn(B, K, generator=g)
        ref = x.double() @ w.T
        y = k(x)
        assert y.dtype == torch.float32 and y.shape == (B, N)
        assert rel(y, ref) < 1e-5, (isa, B)
        assert rel(kb(x), ref + bias.double()) < 1e-5, (isa, B)
        assert torch.equal(k(x.bfloat16()), k(x.bfloat16().float()))  # any float dtype in, read as fp32


@native
@pytest.mark.parametrize("N,K", [(1, 1), (33, 100), (130, 257), (96, 2048)])
@pytest.mark.parametrize("layout", ["channel", "tensor", "channel per 128 columns"])
def test_fp8_kernel_channel_and_tensor_scales(isa, N, K, layout):
    """Scales per output channel (row_block 1) or per tensor (row_block N), one across all columns
    (bs [., 1]: compressed-tensors' and fbgemm's FP8) or one per 128 columns, against fp64."""
    q, _, _ = fp8_weight(N, K, N + K)
    g = torch.Generator().manual_seed(N * K)
    rb = N if layout == "tensor" else 1
    cols = -(-K // BLOCK) if layout.endswith("columns") else 1
    bs = (torch.rand(-(-N // rb), cols, generator=g) + 0.5) * 1e-2
    s = bs.double().repeat_interleave(rb, 0)[:N].repeat_interleave(BLOCK if cols > 1 else K, 1)[:, :K]
    w = q.view(torch.float8_e4m3fn).double() * s
    k = ext.fp8_kernel(q, bs, row_block=rb)
    assert k.weight_bytes() == N * K + bs.numel() * 4
    for B in (1, 2, 5, 9):
        x = torch.randn(B, K, generator=g)
        assert rel(k(x), x.double() @ w.T) < 1e-5, (isa, B)


@native
def test_every_path_and_prefetch_agree():
    """The paths sum in different orders: the same results to fp32 rounding; the stream prefetch changes
    no bits."""
    q, bs, w = fp8_weight(200, 1000, 7)
    x = torch.randn(5, 1000, generator=torch.Generator().manual_seed(7))
    k = ext.fp8_kernel(q, bs)
    saved = ext.tuning()
    try:
        ys = {}
        for name in ISAS:
            ext.set_isa(name)
            ext.set_tuning(stream_prefetch=True)
            ys[name] = k(x)
            ext.set_tuning(stream_prefetch=False)
            assert torch.equal(k(x), ys[name]), name
    finally:
        ext.reset_isa()
        ext.set_tuning(**saved)
    for name, y in ys.items():
        assert rel(y, x.double() @ w.T) < 1e-5, name


@native
def test_fp8_kernel_rejects_bad_inputs():
    q, bs, _ = fp8_weight(130, 257, 0)
    with pytest.raises(RuntimeError, match=r"fp8_kernel: q must be uint8 .* or float8_e4m3fn \[N, K\]"):
        ext.fp8_kernel(q.view(torch.int8), bs)
    with pytest.raises(RuntimeError, match=r"fp8_kernel: q must be"):
        ext.fp8_kernel(q.reshape(-1), bs)
    with pytest.raises(RuntimeError, match=r"fp8_kernel: q must be"):
        ext.fp8_kernel(q[:, :0], bs)
    with pytest.raises(RuntimeError, match=r"fp8_kernel: q must be a contiguous CPU Byte tensor \[130, 129\]"):
        ext.fp8_kernel(q[:, ::2], bs)
    with pytest.raises(RuntimeError, match=r"fp8_kernel: bs must be a contiguous CPU float32 .* = \[2, 3\] or \[2, 1\] "
                                           r"tensor, got Float \[2, 2\]"):
        ext.fp8_kernel(q, bs[:, :2].contiguous())
    with pytest.raises(RuntimeError, match=r"fp8_kernel: bs must be .* got BFloat16 \[2, 3\]"):
        ext.fp8_kernel(q, bs.bfloat16())
    with pytest.raises(RuntimeError, match=r"fp8_kernel: bs must be .* got Float \[3, 2\]"):
        ext.fp8_kernel(q, bs.T)
    with pytest.raises(RuntimeError, match=r"gemv: bias must have 130 elements, got 3"):
        ext.fp8_kernel(q, bs, torch.zeros(3))
    with pytest.raises(RuntimeError, match=r"fp8_kernel: row_block must be >= 1, got 0"):
        ext.fp8_kernel(q, bs, row_block=0)
    with pytest.raises(RuntimeError, match=r"fp8_kernel: bs must be .* \[ceil\(N/1\), ceil\(K/128\)\] = \[130, 3\]"):
        ext.fp8_kernel(q, bs, row_block=1)  # per-channel scales need a row each
    with pytest.raises(RuntimeError, match=r"x must be \[B, 257\]"):
        ext.fp8_kernel(q, bs)(torch.zeros(1, 256))


# ------------------------------------------------------------------------------------ the fused expert
def slot_of(segments):
    """Tensors -> (one flat uint8 slot holding them in order, each at a 64-byte aligned offset; offsets)."""
    offsets, off = [], 0
    for t in segments:
        offsets.append(off)
        off = -(-(off + t.numel() * t.element_size()) // ALIGN) * ALIGN
    slot = torch.zeros(off, dtype=torch.uint8)
    for t, o in zip(segments, offsets):
        b = t.contiguous().reshape(-1).view(torch.uint8)
        slot[o:o + b.numel()] = b
    return slot, offsets


def int8_weight(N, K, seed):
    """An int8 projection in the plain layout (q int8 [N, K], scale bf16 [N]) and its weight, fp64."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-127, 128, (N, K), dtype=torch.int8, generator=g)
    s = ((torch.rand(N, generator=g) + 0.5) * 1e-2).bfloat16()
    return (q, s), q.double() * s.double()[:, None]


def expert(kinds, D, Fi, seed):
    """One expert of per-projection `kinds` ("fp8" or "int8"; gate, up [Fi, D], down [D, Fi]) in a slot:
    (spec, slot, fp64 weights, a SimpleNamespace standing in for its ExpertFormat)."""
    shapes = ((Fi, D), (Fi, D), (D, Fi))
    fields, ws = [], []  # per projection: its segments (name, tensor)
    for i, (kind, (N, K)) in enumerate(zip(kinds, shapes)):
        if kind == "fp8":
            q, bs, w = fp8_weight(N, K, seed + i, scale=2e-4)  # |w| up to ~0.1
            fields.append([("q", q), ("bs", bs)])
        elif kind == "fp8-row":  # one fp32 scale a row
            q, _, _ = fp8_weight(N, K, seed + i)
            s = (torch.rand(N, 1, generator=torch.Generator().manual_seed(seed + i)) + 0.5) * 2e-4
            w = q.view(torch.float8_e4m3fn).double() * s.double()
            fields.append([("q", q), ("bs", s)])
        else:
            (q, s), w = int8_weight(N, K, seed + i)
            fields.append([("q", q), ("scale", s)])
        ws.append(w)
    slot, offs = slot_of([t for segs in fields for _, t in segs])
    offsets = [offs[2 * i:2 * i + 2] for i in range(3)]
    layout = [[(f, o, tuple(t.shape), t.dtype) for (f, t), o in zip(segs, offsets[i])] for i, segs in enumerate(fields)]
    spec = ext.expert_spec(list(kinds), [list(s) for s in shapes], offsets, slot.numel())
    fmt = SimpleNamespace(is_dense=False, kinds=tuple(kinds), shapes=shapes, int4_layout="plain", _layout=layout,
                          nbytes=slot.numel(), act="bf16", batch_act="bf16", exact_zeros=False)
    return spec, slot, ws, fmt


def swiglu(x, ws):
    wg, wu, wd = ws
    x = x.double()
    return (F.silu(x @ wg.T) * (x @ wu.T)) @ wd.T


# D not a multiple of 128 (a partial block), Fi not a multiple of 32 (so int8's kernel reads fp32 x: exact too)
KINDS = [("fp8", "fp8", "fp8"), ("fp8", "fp8", "int8"), ("fp8-row",) * 3, ("fp8-row", "fp8-row", "fp8")]


@native
@pytest.mark.parametrize("kinds", KINDS)
def test_fused_expert(isa, kinds):
    D, Fi = 200, 136
    spec, slot, ws, fmt = expert(kinds, D, Fi, 3)
    g = torch.Generator().manual_seed(4)
    for B in (1, 3, 8, 11):
        x = torch.randn(B, D, generator=g)
        y = spec.forward(slot, x)
        assert y.dtype == torch.float32 and y.shape == (B, D)
        assert rel(y, swiglu(x, ws)) < 1e-5, (isa, kinds, B)
    # kernels/linear.expert_spec passes the same offsets from an ExpertFormat's layout
    assert "fp8" in NATIVE_EXPERT_KINDS and "fp8-row" in NATIVE_EXPERT_KINDS
    assert torch.equal(expert_spec(fmt).forward(slot, x), y)


@native
@pytest.mark.parametrize("kinds", KINDS)
def test_fused_experts_of_a_layer(isa, kinds):
    """forward_group (a layer's experts in two parallel regions), forward_layer (and their weighted sum)
    and bind_layer over fp8 slots."""
    D, Fi, E = 200, 136, 3
    experts = [expert(kinds, D, Fi, 10 * e) for e in range(E)]
    spec, slots = experts[0][0], [ex[1] for ex in experts]
    g = torch.Generator().manual_seed(5)
    bounds = [0, 2, 2, 7]  # expert 1 has no rows
    xs = torch.randn(bounds[-1], D, generator=g)
    ys = spec.forward_group(slots, xs, bounds)
    for e in range(E):
        r = slice(bounds[e], bounds[e + 1])
        assert torch.equal(ys[r], spec.forward(slots[e], xs[r])), e
        if bounds[e + 1] > bounds[e]:
            assert rel(ys[r], swiglu(xs[r], experts[e][2])) < 1e-5, (isa, e)
    N, top_k = 5, 2
    x = torch.randn(N, D, generator=g)
    idx = torch.stack([torch.randperm(E, generator=g)[:top_k] for _ in range(N)])
    wt = torch.rand(N, top_k, generator=g)
    routed = sorted(set(idx.flatten().tolist()))
    out = spec.forward_layer([slots[e] for e in routed], x, idx, wt, routed)
    ref = torch.zeros(N, D, dtype=torch.float64)
    for n in range(N):
        for j in range(top_k):
            ref[n] += wt[n, j].double() * swiglu(x[n:n + 1], experts[idx[n, j].item()][2])[0]
    assert out.dtype == torch.float32 and rel(out, ref) < 1e-5, isa
    bound = spec.bind_layer(slots)
    assert bound.num_experts == E and bound.hidden == D


@native
def test_expert_spec_checks_fp8_segments():
    D, Fi = 200, 136
    _, slot, _, fmt = expert(("fp8",) * 3, D, Fi, 0)
    shapes = [[Fi, D], [Fi, D], [D, Fi]]
    offsets = [[o for _, o, _, _ in segs] for segs in fmt._layout]
    with pytest.raises(RuntimeError, match=r"expert_spec: fp8's q \[N, K\] and scales float32 .* must lie in the slot's"):
        ext.expert_spec(["fp8"] * 3, shapes, offsets[:2] + [[offsets[2][0], slot.numel() - 4]], slot.numel())
    with pytest.raises(RuntimeError, match=r"expert_spec: fp8's q"):
        ext.expert_spec(["fp8"] * 3, shapes, offsets[:2] + [[offsets[2][0], offsets[2][1] + 2]], slot.numel())
    # fp8-row's scales are [N] fp32: 4 N bytes from their offset
    with pytest.raises(RuntimeError, match=r"expert_spec: fp8-row's q \[N, K\] and scales float32 \[N\]"):
        ext.expert_spec(["fp8-row"] * 3, shapes, offsets[:2] + [[offsets[2][0], slot.numel() - 4 * D + 64]],
                        slot.numel())
    spec = ext.expert_spec(["fp8"] * 3, shapes, offsets, slot.numel())
    with pytest.raises(RuntimeError, match=r"the slot must be a contiguous CPU uint8 tensor"):
        spec.forward(slot[:-64], torch.zeros(1, D))
