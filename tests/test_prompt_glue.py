"""A prompt's elementwise glue on the CPU through tiered/kernels (csrc/prompt.cpp): RoPE in one pass, the same values
as apply_rotary's torch ops bit for bit, and SwiGLU's activation computed in fp32 and rounded once."""

from __future__ import annotations

import math

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
    # rows in x's order: each token's heads side by side, as the projection's output held them
    assert got.transpose(1, 2).is_contiguous() and got.dtype == dtype and torch.equal(got, ref)
    assert torch.equal(layers.apply_rotary(x, cos, sin), ref)  # the prompt path takes it
    assert torch.equal(layers.apply_rotary(x, cos, sin, layers.Rotary.signed(sin)), ref)
    heads = kernels.load().rope(x.contiguous(), cos, sin)  # heads one after another: so out
    assert heads.is_contiguous() and torch.equal(heads, ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["tokens", "heads"])
def test_native_rope_with_a_head_norm_is_the_fp32_norm_then_rope_rounded_once(dtype, layout, monkeypatch):
    """Qwen3's per-head q/k norm on the way into RoPE (apply_rotary's `norm`): one native pass over each row, the
    values of RMSNorm's fp32 pass and then RoPE's over fp32 rows, bit for bit, rounded once to x's dtype; without
    the kernels (or for one token) the same fp32 passes in torch."""
    g = torch.Generator().manual_seed(3)
    # the slice of a fused q/k/v output seen as heads (tokens 96 * 3 elements apart), or heads one after another
    qkv = torch.randn(2, 21, 3 * 6 * 32, generator=g).to(dtype) * 3
    x = qkv[..., :6 * 32].view(2, 21, 6, 32).transpose(1, 2)
    x = x if layout == "tokens" else x.contiguous()
    cos, sin = torch.randn(2, 1, 21, 32, generator=g), torch.randn(2, 1, 21, 32, generator=g)
    norm = layers.RMSNorm(32, 1e-6)
    norm.weight.data = torch.rand(32, generator=g) + 0.5
    norm.weight.requires_grad_(False)
    xf = norm(x.float())  # RMSNorm's own fp32 pass (the native rms_norm)
    ref = (xf * cos + layers._rotate_half(xf) * sin).to(dtype)
    got = kernels.load().rope(x, cos, sin, norm.weight, norm.eps)
    assert got.dtype == dtype and got.shape == x.shape and torch.equal(got, ref)
    assert torch.equal(layers.apply_rotary(x, cos, sin, None, norm), ref)
    assert torch.equal(layers.apply_rotary(x, cos, sin, layers.Rotary.signed(sin), norm), ref)
    monkeypatch.setattr(layers, "_norm_rope_kernels", lambda *a: None)  # torch's passes
    assert torch.equal(layers.apply_rotary(x, cos, sin, None, norm), ref)
    one = x[:, :, :1]  # a decode step's token: torch's passes, the same values
    assert torch.equal(layers.apply_rotary(one, cos[:, :, :1], sin[:, :, :1], None, norm), ref[:, :, :1])


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_geglu_is_gelu_tanh_of_gate_times_up_rounded_once(dtype):
    """layers.glu(gu, "gelu_tanh") (Gemma's GeGLU) in one native pass: torch's gelu(approximate="tanh") of the gate
    times up, in fp32 (within the polynomial exp's error, large gates included: tanh's +-1) and rounded once."""
    g = torch.Generator().manual_seed(3)
    gu = (torch.randn(3, 29, 2 * 96, generator=g) * 4).to(dtype)
    gu[0, 0, :4] = torch.tensor([-60.0, -9.0, 9.0, 60.0])
    gate, up = gu.float().chunk(2, -1)
    exact = F.gelu(gate, approximate="tanh") * up
    got = layers.glu(gu, "gelu_tanh")
    assert got.shape == (3, 29, 96) and got.dtype == dtype
    # atol: where torch's tanh rounds to -1 (gates below ~-4.9) its GELU is 0; ours keeps x sigmoid(2z), ~1e-6 there
    if dtype == torch.float32:
        assert torch.allclose(got, exact, rtol=2e-6, atol=1e-5)
    else:
        assert ((got.float() - exact).abs() <= exact.abs() * (2 ** -8 + 2e-6) + 1e-5).all()
    with pytest.raises(RuntimeError, match="act must be silu or gelu_tanh"):
        kernels.load().swiglu(gu, act="relu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_swiglu_of_a_gate_and_an_up_tensor_equals_the_fused_ones(dtype):
    """swiglu(gate, up): an expert's two projections' outputs, the same bits as swiglu over them side by side."""
    g = torch.Generator().manual_seed(2)
    gate, up = torch.randn(2, 33, 80, generator=g).to(dtype), torch.randn(2, 33, 80, generator=g).to(dtype)
    got = kernels.load().swiglu(gate, up)
    assert got.shape == (2, 33, 80) and got.dtype == dtype
    assert torch.equal(got, layers.swiglu(torch.cat([gate, up], -1)))


@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_glu_of_a_transposed_gemm_output_is_the_native_ones(act, dtype, monkeypatch):
    """A big one-copy weight's prompt GEMM past AMX_ROWS writes y^T (quant/int4.gemm_by_row_chunks): its [1, T, 2F]
    transposed view goes through the native kernel's gate / up pair over the two halves of its storage, the same
    bits as the contiguous rows' pass, the result [1, T, F] a transposed view of [F, T]; torch's ops not called."""
    from tiered.quant.int4 import gemm_by_row_chunks
    import tiered.quant.int4 as int4

    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(40, 24, generator=g).to(dtype), torch.randn(96, 24, generator=g).to(dtype)
    monkeypatch.setattr(int4, "DEQUANTIZE_CHUNK", 16 * 24)  # chunks of 16 rows of W: the y^T path
    gu = gemm_by_row_chunks(x, 96, lambda a, b: w[a:b], None).unsqueeze(0)
    assert gu.shape == (1, 40, 96) and gu.stride(-1) != 1
    monkeypatch.setattr(layers, "glu_activation", lambda *a: pytest.fail("torch's ops ran"))
    got = layers.glu(gu, act)
    assert got.shape == (1, 40, 48) and got.stride(-2) == 1 and got.dtype == dtype
    assert torch.equal(got, kernels.load().swiglu(gu.contiguous(), act=act))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_gemm_over_a_transposed_input_multiplies_its_storage(dtype, monkeypatch):
    """quant/int4.gemm_by_row_chunks over x [T, K] that is a view of x^T's storage (the GLU's output over a
    transposed gate / up GEMM: the down projection's input) computes y^T = W x^T in one GEMM and returns y as a view
    of it, F.linear not called (over the transposed view it had taken 1.3x the time); the product as F.linear's of
    the contiguous rows, the bias added; a contiguous x and a chunked weight as before."""
    import torch.nn.functional as F

    import tiered.quant.int4 as int4
    from tiered.quant.int4 import gemm_by_row_chunks

    g = torch.Generator().manual_seed(8)
    xt = torch.randn(64, 40, generator=g).to(dtype)  # x^T's storage: K = 64, T = 40
    w, bias = torch.randn(48, 64, generator=g).to(dtype), torch.randn(48, generator=g).to(dtype)
    want = F.linear(xt.t().contiguous(), w, bias)
    linear = F.linear
    monkeypatch.setattr(int4.F, "linear", lambda *a: pytest.fail("F.linear over the transposed view"))
    got = gemm_by_row_chunks(xt.t(), 48, lambda a, b: w[a:b], bias)
    assert got.shape == (40, 48) and got.stride() == (1, 40)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    assert torch.allclose(got.float(), want.float(), **tol)
    monkeypatch.setattr(int4.F, "linear", linear)
    assert gemm_by_row_chunks(xt.t().contiguous(), 48, lambda a, b: w[a:b], bias).is_contiguous()
    monkeypatch.setattr(int4, "DEQUANTIZE_CHUNK", 16 * 64)  # 16-row chunks of W: y^T by rows either way
    assert torch.allclose(gemm_by_row_chunks(xt.t(), 48, lambda a, b: w[a:b], bias).float(), want.float(), **tol)


def test_a_chunked_gemms_output_reuses_its_memory_once_nothing_holds_it(monkeypatch):
    """quant/int4.gemm_by_row_chunks' y^T (a weight past DEQUANTIZE_CHUNK: Gemma's gate / up at a 1024-token chunk,
    42 MB of new pages a call past glibc's mmap threshold) comes from this thread's buffer where nothing holds its
    memory any more; a result still held (its view, or one made from it) keeps its values: the next call takes
    other memory."""
    import tiered.quant.int4 as int4
    from tiered.quant.int4 import gemm_by_row_chunks

    g = torch.Generator().manual_seed(9)
    x, w = torch.randn(40, 24, generator=g), torch.randn(96, 24, generator=g)
    monkeypatch.setattr(int4, "DEQUANTIZE_CHUNK", 16 * 24)  # chunks of 16 rows of W: the y^T path
    first = gemm_by_row_chunks(x, 96, lambda a, b: w[a:b], None)
    kept, ptr = first.clone(), first.data_ptr()
    second = gemm_by_row_chunks(2 * x, 96, lambda a, b: w[a:b], None)  # `first` still held: other memory
    assert second.data_ptr() != ptr and torch.equal(first, kept)
    assert torch.allclose(second, 2 * kept, rtol=1e-5, atol=1e-5)
    ptr = second.data_ptr()
    del first, second
    third = gemm_by_row_chunks(x, 96, lambda a, b: w[a:b], None)  # nothing holds the last: its memory again
    assert third.data_ptr() == ptr and torch.allclose(third, kept, rtol=1e-5, atol=1e-5)
    with torch.inference_mode():  # made in inference mode, then a call outside it: a tensor of its own
        inner = gemm_by_row_chunks(x, 96, lambda a, b: w[a:b], None)
        ptr = inner.data_ptr()
        del inner
    outside = gemm_by_row_chunks(x, 96, lambda a, b: w[a:b], None)
    assert not outside.is_inference() and outside.data_ptr() != ptr


def test_glue_refuses_what_it_cannot_read():
    ext = kernels.load()
    with pytest.raises(RuntimeError, match="head_dim must be even"):
        ext.rope(torch.zeros(1, 1, 2, 3), torch.zeros(1, 1, 2, 3), torch.zeros(1, 1, 2, 3))
    with pytest.raises(RuntimeError, match="cos and sin must hold"):
        ext.rope(torch.zeros(1, 2, 4, 8), torch.zeros(1, 1, 3, 8), torch.zeros(1, 1, 3, 8))
    with pytest.raises(RuntimeError, match=r"norm_weight must be fp32 \[8\]"):
        ext.rope(torch.zeros(1, 2, 4, 8), torch.zeros(1, 1, 4, 8), torch.zeros(1, 1, 4, 8), torch.ones(6), 1e-6)
    with pytest.raises(RuntimeError, match="fp32 or bf16"):
        ext.swiglu(torch.zeros(2, 8, dtype=torch.float16))
    with pytest.raises(RuntimeError, match="up must be the gate's shape"):
        ext.swiglu(torch.zeros(2, 8), torch.zeros(2, 6))
    with pytest.raises(RuntimeError, match="up must be the gate's shape"):
        ext.swiglu(torch.zeros(2, 8), torch.zeros(2, 8, dtype=torch.bfloat16))


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


@pytest.mark.parametrize("delta_dtype", [None, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_native_residual_rms_norm_adds_normalizes_and_rounds_once(delta_dtype, dtype):
    """RMSNorm.residual on fp32 CPU rows: h = x + delta exactly as torch adds them, y = F.rms_norm(h) within fp32
    rounding (the native decode step's norm), in bf16 rounded once from it; forward(x, dtype) is its y."""
    g = torch.Generator().manual_seed(3)
    D = 96
    norm = layers.RMSNorm(D, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(D, generator=g))
    x = torch.randn(2, 37, D, generator=g) * 3
    delta = None if delta_dtype is None else torch.randn(2, 37, D, generator=g).to(delta_dtype)
    with torch.inference_mode():
        h, y = norm.residual(x, delta, dtype)
        want_h = x if delta is None else x + delta
        assert h.dtype == torch.float32 and torch.equal(h, want_h)
        assert torch.equal(norm(want_h, dtype), y)
        exact = F.rms_norm(want_h, (D,), norm.weight, 1e-5)
        assert torch.equal(y, kernels.load().rms_norm(x, norm.weight, 1e-5, dtype or torch.float32, delta)[1])
    if dtype is None:
        assert y.dtype == torch.float32 and torch.allclose(y, exact, rtol=1e-5, atol=1e-6)
    else:  # one rounding of the fp32 value: within half a bf16 ulp of it (plus the fp32 reduction's ulps)
        assert y.dtype == dtype and ((y.float() - exact).abs() <= exact.abs() * (2 ** -8 + 1e-5) + 1e-6).all()


def test_rms_norm_of_lower_precision_rows_keeps_hfs_order():
    """bf16 x (a GPU's or a bf16 engine's rows): torch's ops in HF's order, the normalized x rounded to bf16 before
    the weight; a bf16 delta to a bf16 x is added in bf16."""
    g = torch.Generator().manual_seed(4)
    norm = layers.RMSNorm(64, 1e-6).to(torch.bfloat16)
    x, d = torch.randn(3, 64, generator=g).bfloat16(), torch.randn(3, 64, generator=g).bfloat16()
    with torch.inference_mode():
        h, y = norm.residual(x, d)
        assert h.dtype == torch.bfloat16 and torch.equal(h, x + d)
        assert torch.equal(y, norm.weight * F.rms_norm((x + d).float(), (64,), None, 1e-6).to(torch.bfloat16))


def test_native_rms_norm_refuses_what_it_cannot_read():
    ext = kernels.load()
    with pytest.raises(RuntimeError, match="x must be fp32"):
        ext.rms_norm(torch.zeros(2, 8, dtype=torch.bfloat16), torch.ones(8), 1e-5, torch.float32)
    with pytest.raises(RuntimeError, match="weight must be fp32"):
        ext.rms_norm(torch.zeros(2, 8), torch.ones(7), 1e-5, torch.float32)
    with pytest.raises(RuntimeError, match="delta must have x's sizes"):
        ext.rms_norm(torch.zeros(2, 8), torch.ones(8), 1e-5, torch.float32, torch.zeros(1, 8))
    with pytest.raises(RuntimeError, match="dtype must be fp32 or bf16"):
        ext.rms_norm(torch.zeros(2, 8), torch.ones(8), 1e-5, torch.float16)


def test_a_prompts_layers_take_the_norms_in_their_gemms_dtype(zoo, monkeypatch):
    """One-copy int4 projections that dequantize a prompt's rows for bf16 GEMMs (SmolLM2's default plan on
    AVX-512), a bf16 KV cache: each layer's norms hand attention and FFN bf16 rows (layers.input_dtype), which stay
    bf16 to their outputs, added to the fp32 residual stream by the next norm's pass (DecoderLayer.step). The
    hidden states equal the path that casts inside the blocks (input_dtype None: fp32 norms, every projection
    casting its input) bit for bit; a decode row, an fp32 KV cache and an int8 one keep fp32 norms."""
    from tiered import LLM, EngineConfig
    from tiered.quant import int4

    monkeypatch.setattr(int4, "dequantize_rows", lambda batch_act="bf16", isa=None, tuning=None: 8)
    monkeypatch.setattr(int4, "dequantize_dtype", lambda: torch.bfloat16)
    llm = LLM(zoo.dir("llama"), EngineConfig(accelerator="none", decode_weights="int4", max_context=64))
    try:
        model, cfg = llm.model, llm.config
        # the plan's prompt dtypes as SmolLM2's default plan on AVX-512 sets them (whatever this machine's plan chose)
        assert layers.set_prompt_attention(model, torch.bfloat16) and layers.set_prompt_ffn(model, torch.bfloat16)
        seen = []
        for layer in model.model.layers:
            for block in (layer.self_attn, layer.mlp):
                block.register_forward_pre_hook(lambda m, args: seen.append((type(m).__name__, args[0].dtype)))
                block.register_forward_hook(lambda m, args, out: seen.append((type(m).__name__, out.dtype)))
        T = 40
        ids = torch.randint(2, cfg.vocab_size, (1, T), generator=torch.Generator().manual_seed(5))
        positions, slots = torch.arange(T).unsqueeze(0), torch.tensor([0])

        def hidden(kv_dtype, n=T):
            cache = layers.KVCache(cfg, 1, 64, kv_dtype)
            seen.clear()
            with torch.inference_mode():
                return model.hidden_states(ids[:, :n], positions[:, :n], slots, cache), list(seen)

        bf16, fp32 = torch.bfloat16, torch.float32
        got, dtypes = hidden(bf16)
        assert dtypes == ([("Attention", bf16)] * 2 + [("MLP", bf16)] * 2) * cfg.num_hidden_layers  # (in, out)
        assert got.dtype == fp32
        import tiered.models.llama as llama_mod

        with monkeypatch.context() as m:
            m.setattr(llama_mod, "input_dtype", lambda block, x, cache: None)
            want, cast_inside = hidden(bf16)
        assert cast_inside[0] == ("Attention", fp32) and cast_inside[2] == ("MLP", fp32)  # that path ran
        assert torch.equal(got, want)
        for kv in (fp32, torch.int8):  # the cache not in the prompt's dtype: attention's rows stay fp32
            assert hidden(kv)[1][0] == ("Attention", fp32)
        assert hidden(bf16, 1)[1][0] == ("Attention", fp32)  # a decode row
    finally:
        llm.close()


@pytest.fixture(params=["native", "avx512"])
def attention_kernel(request):
    """The bf16 prompt attention's kernel a test runs on: "native" this machine's (AMX tiles where the CPU has AMX,
    else AVX512-BF16's vdpbf16ps), "avx512" the AVX512-BF16 one with AMX's turned off (amx_rows), run on AMX CPUs
    too (a duplicate of "native" elsewhere: skipped)."""
    ext = kernels.load()
    if request.param == "native":
        yield request.param
        return
    if ext is None or not ext.amx_available():
        pytest.skip("no AMX here: the native kernel is the AVX512-BF16 one (or none)")
    was = ext.amx_rows(False)
    try:
        yield request.param
    finally:
        ext.amx_rows(was)


@pytest.mark.parametrize("shape", [(1, 9, 3, 64, 200, 208), (2, 4, 4, 128, 37, 48), (1, 8, 2, 32, 65, 65)])
def test_bf16_prompt_attention_is_as_close_to_fp32_as_torchs_bf16_attention(shape, attention_kernel):
    """A bf16 prompt's causal attention from position 0 (query i over keys 0..i, S >= T keys: the cache's aligned
    count) on tiered's kernel (AMX tiles, or AVX512-BF16: layers.attend takes it): within the error torch's bf16
    flash attention makes against an fp32 reference, GQA included, its rows laid out as o_proj reads them."""
    from tiered.models.layers import _bf16_attention, attend

    B, H, Hkv, hd, T, S = shape
    g = torch.Generator().manual_seed(4)
    q = torch.randn(B, T, H, hd, generator=g).bfloat16().transpose(1, 2)  # a projection's output seen as heads
    k, v = (torch.randn(B, Hkv, S, hd, generator=g).bfloat16() for _ in range(2))
    if _bf16_attention(q, k, v) is None:
        pytest.skip("no bf16 attention kernel here")
    scale = hd ** -0.5
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True, scale=scale,
                                         enable_gqa=H != Hkv)
    torch_bf16 = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=H != Hkv)
    got = attend(q, k, v, None, True, scale, H != Hkv)
    assert got.dtype == torch.bfloat16 and got.shape == (B, H, T, hd) and got.transpose(1, 2).is_contiguous()
    err, torch_err = (got.float() - ref).abs().max().item(), (torch_bf16.float() - ref).abs().max().item()
    assert err <= 1.5 * torch_err + 1e-3
    assert (got.float() - ref).abs().mean() <= 1.5 * (torch_bf16.float() - ref).abs().mean()
    # a mask, past positions or fp32 take torch's SDPA
    assert _bf16_attention(q.float(), k.float(), v.float()) is None and _bf16_attention(q[:, :, :1], k, v) is None
    with pytest.raises(RuntimeError, match="head_dim % 32"):
        kernels.load().bf16_prompt_attention(q[..., :16], k[..., :16], v[..., :16], scale)


@pytest.mark.skipif(kernels.load() is None, reason="tiered/kernels not built")
@pytest.mark.parametrize("shape", [(1, 9, 3, 64, 100, 37), (1, 8, 2, 128, 64, 200), (2, 4, 4, 32, 33, 64)])
def test_bf16_chunk_attention_after_cached_positions_is_as_close_to_fp32_as_torchs(shape, attention_kernel):
    """A bf16 prefill chunk of T queries after `past` cached positions (query i over keys 0..past + i: the mask
    attention_mask builds for it) on tiered's bf16 kernel (layers.attend's `past`): within the error torch's bf16 SDPA
    under that mask makes against an fp32 reference. Keys past past + T (an aligned cache's widened count) are never
    read: NaN there changes nothing."""
    from tiered.models.layers import _bf16_attention, attend

    B, H, Hkv, hd, T, past = shape
    S = past + T
    g = torch.Generator().manual_seed(5)
    q = torch.randn(B, T, H, hd, generator=g).bfloat16().transpose(1, 2)
    k, v = (torch.randn(B, Hkv, S + 11, hd, generator=g).bfloat16() for _ in range(2))
    k[:, :, S:], v[:, :, S:] = float("nan"), float("nan")
    if _bf16_attention(q, k, v, past) is None:
        pytest.skip("no bf16 attention kernel here")
    scale = hd ** -0.5
    mask = torch.ones(T, S, dtype=torch.bool).tril(past)
    kk, vv = k[:, :, :S], v[:, :, :S]
    ref = F.scaled_dot_product_attention(q.float(), kk.float(), vv.float(), attn_mask=mask, scale=scale,
                                         enable_gqa=H != Hkv)
    torch_bf16 = F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask, scale=scale, enable_gqa=H != Hkv)
    got = attend(q, k, v, F.pad(mask, (0, 11), value=False), False, scale, H != Hkv, past)
    assert got.dtype == torch.bfloat16 and got.shape == (B, H, T, hd) and bool(got.isfinite().all())
    err, torch_err = (got.float() - ref).abs().max().item(), (torch_bf16.float() - ref).abs().max().item()
    assert err <= 1.5 * torch_err + 1e-3
    assert (got.float() - ref).abs().mean() <= 1.5 * (torch_bf16.float() - ref).abs().mean()
    # the same queries read as a prompt from position 0 differ (the past is attended to)
    assert (attend(q, k, v, None, True, scale, H != Hkv).float() - ref).abs().max() > 10 * err
    with pytest.raises(RuntimeError, match="S >= "):
        kernels.load().bf16_prompt_attention(q, k[:, :, :S - 1], v[:, :, :S - 1], scale, past)


@pytest.mark.skipif(kernels.load() is None, reason="tiered/kernels not built")
@pytest.mark.parametrize("shape", [(1, 8, 4, 256, 300, 0, 128), (1, 8, 4, 256, 200, 900, 1024),
                                   (1, 4, 2, 64, 333, 70, 50), (2, 4, 4, 32, 65, 0, 1), (1, 4, 2, 64, 100, 500, 64)])
def test_bf16_windowed_attention_is_as_close_to_fp32_as_torchs(shape, attention_kernel):
    """A sliding layer's bf16 prompt on tiered's bf16 kernel (layers.attend's `window`): query i at position past + i over
    keys past + i - window + 1..past + i (attention_mask's window), from position 0 or after cached positions, windows
    shorter and longer than a block of 64 keys, of one key, and not a multiple of 16: within the error torch's bf16
    SDPA under that mask makes against an fp32 reference, and not the unwindowed attention."""
    from tiered.models.layers import _bf16_attention, attend, attention_mask

    B, H, Hkv, hd, T, past, window = shape
    S = past + T
    g = torch.Generator().manual_seed(7)
    q = torch.randn(B, T, H, hd, generator=g).bfloat16().transpose(1, 2)
    k, v = (torch.randn(B, Hkv, S, hd, generator=g).bfloat16() for _ in range(2))
    if _bf16_attention(q, k, v, past) is None:
        pytest.skip("no bf16 attention kernel here")
    scale = hd ** -0.5
    mask = attention_mask(torch.arange(past, S).expand(B, T), S, window)
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask, scale=scale,
                                         enable_gqa=H != Hkv)
    torch_bf16 = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=H != Hkv)
    got = attend(q, k, v, mask, False, scale, H != Hkv, past, window)
    assert got.dtype == torch.bfloat16 and got.shape == (B, H, T, hd) and bool(got.isfinite().all())
    err, torch_err = (got.float() - ref).abs().max().item(), (torch_bf16.float() - ref).abs().max().item()
    assert err <= 1.5 * torch_err + 1e-3
    assert (got.float() - ref).abs().mean() <= 1.5 * (torch_bf16.float() - ref).abs().mean()
    if window < S:  # the window is attended to, not the whole past
        assert (attend(q, k, v, mask, False, scale, H != Hkv, past).float() - ref).abs().max() > 10 * err + 1e-2
    with pytest.raises(RuntimeError, match="head_dim % 32"):
        kernels.load().bf16_prompt_attention(q, k, v, scale, past, -1)


@pytest.mark.parametrize("past", [0, 40])
def test_bf16_attention_follows_scores_whose_max_jumps_along_the_keys(past, attention_kernel):
    """The bf16 kernel's online softmax (AMX's and AVX512-BF16's) takes each block's exponentials against a running max it moves only where a
    row's scores pass it by more than 2^8 (csrc/gemv.cpp kAttnLazyMax): keys that grow along the sequence and two
    spikes make rows' maxima jump by far more than that after their first block of 64 keys (checked on the fp32
    scores), and smaller rises stay under the old max; the output stays within the error torch's bf16 attention
    makes against an fp32 reference."""
    from tiered.models.layers import _bf16_attention, attend

    B, H, Hkv, hd, T = 1, 4, 2, 64, 260
    S = past + T
    g = torch.Generator().manual_seed(6)
    q = torch.randn(B, T, H, hd, generator=g).bfloat16().transpose(1, 2)
    k = torch.randn(B, Hkv, S, hd, generator=g) * (1 + 0.04 * torch.arange(S)).view(1, 1, S, 1)
    k[:, :, [90, 201]] *= 6
    k, v = k.bfloat16(), torch.randn(B, Hkv, S, hd, generator=g).bfloat16()
    if _bf16_attention(q, k, v, past) is None:
        pytest.skip("no bf16 attention kernel here")
    scale = hd ** -0.5
    mask = torch.ones(T, S, dtype=torch.bool).tril(past)
    scores = (q.float() @ k.float().repeat_interleave(H // Hkv, 1).transpose(-1, -2) * scale).masked_fill(~mask, -1e30)
    first = scores[..., :64].amax(-1)  # each row's max after its first block, then over all its keys
    assert ((scores.amax(-1) - first) / math.log(2) > 8).float().mean() > 0.5
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask, scale=scale,
                                         enable_gqa=True)
    torch_bf16 = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    got = attend(q, k, v, None if past == 0 else mask, past == 0, scale, True, past or None)
    err, torch_err = (got.float() - ref).abs().max().item(), (torch_bf16.float() - ref).abs().max().item()
    assert bool(got.isfinite().all()) and err <= 1.5 * torch_err + 1e-3
    assert (got.float() - ref).abs().mean() <= 1.5 * (torch_bf16.float() - ref).abs().mean()
